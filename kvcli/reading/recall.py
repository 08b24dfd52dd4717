"""Recall: the pages of a saved read that a question points at, found after the read and read once more.

Beyond the papers (a reading choice of a read made without its question, ``kvcli ask FILE.kvc --recall N``).
A read saved before any question is known keeps what its method chose without the question, and what it evicted
is gone from the cache. While reading, :class:`PageIndex` keeps every token's keys before RoPE in the middle
layers, rounded to 8 bits per token and KV head, and the token ids of the read: the keys spilled off the device,
as InfiniGen and Quest keep what they may fetch back. At question time the question's own queries (before RoPE,
from a pass that stores nothing) attend to every token the read saw, per query head and layer; a token weighs its
share times the part of its word's share it takes (:func:`_page_shares`), a page of :data:`PAGE` tokens the largest
weight one of its tokens has, the best over the question's tokens, averaged over KV heads and summed over layers; the
heaviest pages are read once more, the heaviest passage last, after the document and before the question, as the
recap of a streamed ``ask`` is (:mod:`kvcli.reading.recap`).

The rules, and why:

* Every token's keys, not a page summary: Quest's channel-wise bounds of a page favour the pages whose keys spread
  widest, so every question chose the same few pages; each token's own key finds the page that holds the words
  the question repeats (docs/notes/2026-11-29-recall-exact-keys.md).
* The largest share a page's tokens take, from the question token that gives it most: one word of the question
  ("bridge") may be all that finds its page, and one token of the page may be all it matches.
* A token's share counts by the part it takes of what the question token gives every token of the same word (the
  same token id), squared (:data:`DISTINCT`): a word the document repeats in the same setting (the sentence form
  several facts share, "the pass key for the", or "the" itself) spreads its attention over every copy and says
  little of which copy the question means, while a word whose attention falls on one of its copies (the name) does,
  so the form's most favoured copy cannot outweigh the page of the asked name
  (docs/notes/2026-12-06-recall-distinct-words.md).
* Keys and queries before RoPE: a page's positions were re-assigned or evicted long before the question, so only
  the content of the keys can be compared (Quest compares after RoPE, within one context window).
* Only pages weighing at least :data:`KEEP_SHARE` of the heaviest: the budget is an upper bound, not a quota. A
  small model given several sentences of the same form ("the pass key for the X is K") copies one of the others;
  a page far lighter than the heaviest is seldom the one the question needs, and recalled it competes with it
  (docs/notes/2026-12-05-recall-question-first.md).
* The heaviest passage last, next to the question: a small model copies the nearest sentence that fits the
  question, so pages in stream order let the latest of several similar facts answer every question about any of
  them. Each page comes with the page after it, and neighbouring pages stay together in stream order: the answer
  follows the words the question repeats, and may cross the page's end.
* 8 bits a channel, symmetric per token and KV head (a float16 scale, the largest magnitude over 127, kept within
  float16's normal range): the ranking of pages does not move from the model's precision, at half its bytes.
* The middle layers (a third to five sixths of the depth), as the recap: the bottom layers' question attention is
  spread, the top layers' goes to the answer's format. Of those, only the layers the model lets see every token
  where it has such layers (Gemma 3's global layers), as the recap: a layer with a window never looked past it in
  training, so its questions' attention over a whole book is noise (:func:`recall_layers`).
* The recalled pages end the document in the question's block, held with the question: when the document's
  unread tail, a paragraph break and the pages would overflow a block, the tail is read first, on its own. Read
  across a block's end, most of the pages would be compressed before the question is read, with nothing to tell
  the method they matter, and a small layer may keep none of them
  (docs/notes/2026-11-30-every-method-and-a-second-96k-read.md).
* The pages of the prompt's start (the chat template) and the document's last tokens (read with the question in
  any case) are never recalled.
* Memory: the keys grow with the read (``layers x heads x (dim + 2)`` bytes a token: 3,168 for SmolLM2-135M), on
  disk only (:mod:`kvcli.reading.keystore`: spilled as each block is read, scored a range at a time), so the host's
  memory stays flat but for the token ids (4 bytes a token, and 8 while a question is scored); the device holds the
  cache, the recalled tokens and one block.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from kvcli.kv.architecture import head_shape
from kvcli.reading.keystore import KeyStore
from kvcli.reading.recap import consecutive_runs, scored_layers

#: Tokens per page of the index: the unit recalled.
PAGE = 32

#: A page is recalled only if it weighs at least this share of the heaviest page's weight.
KEEP_SHARE = 0.5

#: A token's weight is its share times (the part of its word's share it takes) to this power (:func:`_page_shares`).
DISTINCT = 2

#: Tokens of the read scored at once by :func:`_page_shares` (read from disk as one piece per layer and KV head):
#: its temporaries, ``[queries, CHUNK]`` floats, stay a few megabytes.
CHUNK = 1 << 15

#: What :class:`PageIndex` stores, recorded in a saved read: a file without it has no index this kvcli can use.
KIND = "keys-int8"

_HALF = torch.finfo(torch.float16)


class PageIndex:
    """Every token of a read: its keys before RoPE in the middle layers as int8 with a float16 scale per token and
    KV head, spilled to disk as each block is read (:class:`kvcli.reading.keystore.KeyStore`), and the read's token
    ids, for :func:`select`. ``folder``: where the spill goes (None: the system's temporary folder)."""

    def __init__(self, layers: list[int], heads: int, dim: int, page: int = PAGE, folder: Path | None = None):
        self.layers, self.heads, self.dim, self.page = layers, heads, dim, page
        self.store = KeyStore.spill(len(layers), heads, dim, folder)
        self.ids = array("i")
        self.usable = True  # False once a layer saw only some tokens of a block (a nested read)
        self._keys: dict[int, torch.Tensor] = {}

    @classmethod
    def for_model(cls, model, windows: list[int | None], folder: Path | None = None) -> PageIndex:
        """The index of ``model``, whose layers have attention ``windows`` (None: none): :func:`recall_layers`."""
        heads, dim = head_shape(model.config)
        return cls(recall_layers(scored_layers(model.config.num_hidden_layers), windows), heads, dim, folder=folder)

    @contextmanager
    def recording(self, decoder):
        """While in the block, the keys every forward makes in the middle layers are noted for :meth:`add`."""
        with _capture(decoder, self.layers, "k", self.heads, self.dim, self._keys):
            yield self

    def add(self, ids: list[int]) -> None:
        """The block ``ids`` was just read: its keys (noted while :meth:`recording`) join the index."""
        keys = [self._keys.pop(i, None) for i in self.layers]
        self.ids.extend(ids)
        if not self.usable or any(k is None or k.shape[0] != len(ids) for k in keys):
            self.usable = False
            return
        values, scale = quantize(torch.stack(keys, dim=1).float())  # [n, layers, heads, dim]
        self.store.append(values.cpu(), scale.cpu())

    def token_ids(self) -> torch.Tensor:
        return torch.frombuffer(self.ids, dtype=torch.int32).clone() if self.ids else torch.zeros(0, dtype=torch.int32)

    def facts(self) -> dict:
        return {"layers": self.layers, "heads": self.heads, "dim": self.dim, "page": self.page,
                "usable": self.usable, "kind": KIND}


def recall_layers(layers, windows: list[int | None]) -> list[int]:
    """Of ``layers``, those without an attention window (``windows[i]`` None); all of them where each has one (Mistral
    gives every layer its window)."""
    free = [i for i in layers if windows[i] is None]
    return free or list(layers)


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[..., dim]`` as int8 and one float16 scale per row: ``rows ~= values * scale``, each element
    within half a scale step, the scale the row's largest magnitude over 127 within float16's normal range (a row
    of zeros, or one past 65,504 x 127, cannot make it 0 or infinite)."""
    scale = (rows.abs().amax(dim=-1) / 127).clamp(_HALF.tiny, _HALF.max).half()
    values = (rows / scale.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return values, scale


def select(engine, cache, store: KeyStore, ids: torch.Tensor, facts: dict, suffix: list[int],
           span: tuple[int, int] | None, tokens: int, first: int) -> list[int]:
    """The ids of the pages the question points at most (:func:`heaviest_last`), at most ``tokens`` of them; never a
    page before stream index ``first`` (the prompt's start). ``store`` and ``ids`` are the read's index
    (:class:`PageIndex`, or a saved read's). The queries are those of the ``suffix``'s tokens in ``span`` (the
    question's own words; None: all) from a pass of the suffix after ``cache``, which keeps nothing of it."""
    page = int(facts["page"])
    pages = store.tokens // page
    count = min(tokens // page, pages)
    if count < 1 or not suffix:
        return []
    queries: dict[int, torch.Tensor] = {}
    query_heads = int(engine.model.config.num_attention_heads)
    with _capture(engine.decoder, facts["layers"], "q", query_heads, int(facts["dim"]), queries):
        engine.probe(cache, torch.tensor([suffix], dtype=torch.long))
    start, end = span or (0, len(suffix))
    weight = torch.zeros(pages)
    _, words = torch.unique(ids[: pages * page].long(), return_inverse=True)
    used = recall_layers(facts["layers"], engine.architecture.windows)  # an older file kept windowed layers too
    for j, layer in enumerate(facts["layers"]):
        if layer not in used:
            continue
        q = queries[layer][start:end].float().cpu().unflatten(1, (store.heads, -1))  # [n, H, group, D]
        for head in range(store.heads):
            pieces = partial(store.pieces, j, head, pages * page, CHUNK)
            weight += _page_shares(q[:, head].flatten(0, 1), pieces, page, words) / store.heads
    weight[: -(-first // page)] = -1.0  # pages that hold the prompt's start
    return [token for p in heaviest_last(weight, count) for token in ids[p * page:(p + 1) * page].tolist()]


def heaviest_last(weight: torch.Tensor, count: int, share: float = KEEP_SHARE) -> list[int]:
    """At most ``count`` pages: the heaviest (``weight`` >= 0, and at least ``share`` of the heaviest's) each with
    the page after it, neighbours joined into passages in stream order, the passages lightest first and the
    heaviest (by its heaviest page) last."""
    chosen: set[int] = set()
    floor = share * float(weight.max()) if weight.numel() else 0.0
    for p in weight.argsort(descending=True).tolist():
        if len(chosen) >= count or weight[p] < 0 or weight[p] < floor:
            break
        pair = {p, p + 1} if p + 1 < weight.numel() else {p}
        chosen |= pair if len(chosen | pair) <= count else {p}
    runs = consecutive_runs(chosen)
    runs.sort(key=lambda run: max(weight[p].item() for p in run))
    return [p for run in runs for p in run]


def _page_shares(queries: torch.Tensor, pieces: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
                 page: int, words: torch.Tensor | None = None) -> torch.Tensor:
    """Per page: the largest weight any of ``queries`` ``[m, D]`` gives one of its tokens, each query attending to
    every token of the keys ``pieces()`` gives in order (int8 ``[n, D]`` and their scales ``[n]``, ``n`` whole
    pages). A token's weight is its share ``s`` times ``(s / S) ** DISTINCT``, ``S`` the query's share of every token
    of the same word (``words`` ``[T]``: each token's word, numbered from 0; None: every token a word of its own, the
    weight the share).

    Two passes over the pieces, in logs: the first finds each query's largest logit and, from it, the softmax's
    ``Z`` and every word's ``U`` (the sum of ``exp l`` over the word's tokens), rescaled as a larger logit comes, as
    online softmax does; the second gives a token ``log w = (1 + DISTINCT) l - DISTINCT log U - log Z`` and a page
    its tokens' largest (``exp`` is monotone). So the read is never held whole: only a piece, ``[n, m]`` logits, and
    per query a sum per word."""
    top = queries.new_full((queries.shape[0], 1), -torch.inf)
    total = queries.new_zeros(queries.shape[0], 1)
    per_word = None if words is None else queries.new_zeros(queries.shape[0], int(words.max()) + 1)
    at = 0
    for keys, scales in pieces():  # [m, n]: each query's row whole, for its largest logit and its sums
        logits = _logits(queries, keys, scales, by_token=False)
        highest = torch.maximum(top, logits.amax(dim=1, keepdim=True))
        fade = (top - highest).exp()  # 0 at the first piece, where top is -inf
        shares = (logits - highest).exp()
        total = total * fade + shares.sum(dim=1, keepdim=True)
        if per_word is not None:
            per_word.mul_(fade).index_add_(1, words[at:at + keys.shape[0]], shares)
        top, at = highest, at + keys.shape[0]
    top = top.squeeze(1)
    if per_word is not None:
        # log U itself (the first pass kept it less the largest logit); [words, m], copied so that a token's row is
        # whole to gather
        per_word = per_word.T.contiguous().clamp_min_(torch.finfo(per_word.dtype).tiny).log_().add_(top)
    heaviest, at, log_total = [], 0, top + total.squeeze(1).log()
    for keys, scales in pieces():  # [n, m]: each token's row whole, for its word's sums and its largest weight
        logits = _logits(queries, keys, scales, by_token=True)
        if per_word is not None:  # l - log U <= 0: a token takes at most its word's share (clamped where U underflows)
            logits += DISTINCT * (logits - per_word.index_select(0, words[at:at + keys.shape[0]])).clamp_max_(0)
        heaviest.append((logits - log_total).amax(dim=1).unflatten(0, (-1, page)).amax(dim=1).exp())
        at += keys.shape[0]
    return torch.cat(heaviest) if heaviest else queries.new_zeros(0)


def _logits(queries: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor, by_token: bool) -> torch.Tensor:
    """Each query's scaled dot product with each int8 key times its scale: ``[n, m]`` (``by_token``) or ``[m, n]``,
    made in the layout its use reduces or gathers along, as torch's CPU kernels are several times slower across
    rows than along them."""
    scale = scales.float() / queries.shape[-1] ** 0.5
    if by_token:
        return (keys.float() @ queries.T) * scale.unsqueeze(1)
    return (queries @ keys.float().T) * scale


def before_rope(output: torch.Tensor, attention, kind: str, heads: int, dim: int) -> torch.Tensor:
    """A layer's keys (``kind`` "k", ``heads`` KV heads) or queries ("q") before RoPE, ``[n, heads, dim]``, from the
    output ``[1, n, ...]`` of its projection (:func:`projection`): the slice of a fused ``qkv_proj`` (Phi-3), then
    the layer's own ``k_norm``/``q_norm`` where it has one, over a head (Gemma 3, Qwen 3) or over the whole
    projection (OLMo 2), as the model applies it before RoPE."""
    fused = getattr(attention, f"{kind}_proj", None) is None
    if fused:
        queries = output.shape[-1] - 2 * int(attention.config.num_key_value_heads) * dim
        output = output[..., :queries] if kind == "q" else output[..., queries:queries + heads * dim]
    rows = output[0]
    norm = getattr(attention, f"{kind}_norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.numel() == rows.shape[-1]:
        return norm(rows).unflatten(-1, (heads, dim))  # one norm over the whole projection
    rows = rows.unflatten(-1, (heads, dim))
    return norm(rows) if norm is not None else rows


def projection(attention, kind: str):
    """The module whose output holds the layer's keys (``kind`` "k") or queries ("q"): ``k_proj``/``q_proj``, or a
    fused ``qkv_proj``."""
    return getattr(attention, f"{kind}_proj", None) or attention.qkv_proj


@contextmanager
def _capture(decoder, layers: list[int], kind: str, heads: int, dim: int, into: dict[int, torch.Tensor]):
    """Within the block, ``into[layer]`` is the layer's keys or queries before RoPE (:func:`before_rope`,
    ``[n, heads, dim]``) of the last forward."""
    def hook(layer: int):
        attention = decoder.layers[layer].self_attn

        def keep(module, args, output) -> None:
            into[layer] = before_rope(output, attention, kind, heads, dim)
        return keep

    hooks = [projection(decoder.layers[i].self_attn, kind).register_forward_hook(hook(i)) for i in layers]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
