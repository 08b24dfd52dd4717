"""Recall: the pages of a saved read that a question points at, found after the read and read once more.

Beyond the papers (a reading choice of a read made without its question, ``kvcli ask FILE.kvc --recall N``).
A read saved before any question is known keeps what its method chose without the question, and what it evicted
is gone from the cache. While reading, :class:`PageIndex` keeps, for every page of :data:`PAGE` tokens and every
KV head of the middle layers, the smallest and the largest value of each channel of the page's keys before RoPE
(the page summary of Quest, Tang et al. 2024), and the token ids of the read. At question time the question's own
queries (before RoPE, from a pass that stores nothing) bound each page's attention logit from above,
``sum_d max(q_d * min_d, q_d * max_d)``; a page's weight is the largest softmax share of those bounds any of the
question's tokens gives it, per query head, averaged over heads and layers; the heaviest pages are read once
more, in stream order, after the document and before the question, as the recap of a streamed ``ask`` is
(:mod:`kvcli.reading.recap`). The largest share rather than the mean over the question's tokens: one word of the
question ("bridge") may be all that finds its page (docs/notes/2026-11-28-read-once.md).

The rules, and why:

* Keys and queries before RoPE: a page's positions were re-assigned or evicted long before the question, so only
  the content of the keys can be compared (Quest compares after RoPE, within one context window).
* The middle layers (a third to five sixths of the depth), as the recap: the bottom layers' question attention is
  spread, the top layers' goes to the answer's format.
* The pages of the prompt's start (the chat template) and the document's last tokens (read with the question in
  any case) are never recalled.
* Memory: the summaries and ids grow with the read (4 bytes a token for the ids, ``2 x layers x heads x dim``
  half floats a page), on the host once the read is done; the device holds the cache, the recalled tokens and one
  block.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kvcli.reading.recap import scored_layers

#: Tokens per page of the index: the unit recalled.
PAGE = 32


class PageIndex:
    """Per page of :data:`PAGE` tokens of a read: the channel-wise min and max of its keys before RoPE in the middle
    layers (``[pages, layers, heads, dim]``, half floats) and the read's token ids, for :meth:`select`."""

    def __init__(self, layers: list[int], heads: int, dim: int, page: int = PAGE):
        self.layers, self.heads, self.dim, self.page = layers, heads, dim, page
        self.low: list[torch.Tensor] = []  # per block: [pages, layers, heads, dim]
        self.high: list[torch.Tensor] = []
        self.ids: list[int] = []
        self.usable = True  # False once a layer saw only some tokens of a block (a nested read)
        self._keys: dict[int, torch.Tensor] = {}
        self._open: torch.Tensor | None = None  # keys [n < page, layers, heads, dim] of the page not yet full

    @classmethod
    def for_model(cls, model) -> PageIndex:
        config = model.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(list(scored_layers(config.num_hidden_layers)), heads, dim)

    @contextmanager
    def recording(self, decoder):
        """While in the block, the keys every forward makes in the middle layers are noted for :meth:`add`."""
        with _capture(decoder, self.layers, key_module, self._keys):
            yield self

    def add(self, ids: list[int]) -> None:
        """The block ``ids`` was just read: its keys (noted while :meth:`recording`) join the pages."""
        keys = [self._keys.pop(i, None) for i in self.layers]
        self.ids.extend(ids)
        if not self.usable or any(k is None or k.shape[1] != len(ids) for k in keys):
            self.usable = False
            return
        rows = torch.stack([k[0].reshape(len(ids), self.heads, self.dim) for k in keys], dim=1)
        if self._open is not None:
            rows = torch.cat((self._open, rows))
        whole = rows.shape[0] // self.page * self.page
        pages = rows[:whole].float().unflatten(0, (-1, self.page))
        self.low.append(pages.amin(dim=1).half())
        self.high.append(pages.amax(dim=1).half())
        self._open = rows[whole:]

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a saved read stores of the index: every whole page's min and max, and the ids read."""
        empty = torch.zeros((0, len(self.layers), self.heads, self.dim), dtype=torch.float16)
        return {"recall.low": torch.cat(self.low).cpu() if self.low else empty,
                "recall.high": torch.cat(self.high).cpu() if self.high else empty,
                "recall.ids": torch.tensor(self.ids, dtype=torch.int32)}

    def facts(self) -> dict:
        return {"layers": self.layers, "heads": self.heads, "dim": self.dim, "page": self.page, "usable": self.usable}


def select(engine, cache, tensors: dict[str, torch.Tensor], facts: dict, suffix: list[int],
           span: tuple[int, int] | None, tokens: int, first: int) -> list[int]:
    """The ids of the pages the question points at most, in stream order, at most ``tokens`` of them; never a page
    before stream index ``first`` (the prompt's start). The queries are those of the ``suffix``'s tokens in ``span``
    (the question's own words; None: all) from a pass of the suffix after ``cache``, which keeps nothing of it."""
    low, high = tensors["recall.low"].float(), tensors["recall.high"].float()
    pages, page = low.shape[0], int(facts["page"])
    count = min(tokens // page, pages)
    if count < 1 or not suffix:
        return []
    queries: dict[int, torch.Tensor] = {}
    with _capture(engine.decoder, facts["layers"], query_module, queries):
        engine.probe(cache, torch.tensor([suffix], dtype=torch.long))
    start, end = span or (0, len(suffix))
    weight = torch.zeros(pages)
    for j, layer in enumerate(facts["layers"]):
        q = queries[layer][0].reshape(len(suffix), -1, int(facts["dim"]))[start:end].float().cpu()  # [n, Hq, D]
        heads = low.shape[2]
        q = q.unflatten(1, (heads, -1)).permute(1, 0, 2, 3).flatten(1, 2)  # [H, n * group, D]
        bound = q.clamp(min=0) @ high[:, j].permute(1, 2, 0) + q.clamp(max=0) @ low[:, j].permute(1, 2, 0)
        share = torch.softmax(bound / q.shape[-1] ** 0.5, dim=-1)  # [H, n * group, pages]
        weight += share.amax(dim=1).mean(dim=0)  # each head's best query for the page: one question word may find it
    weight[: -(-first // page)] = -1.0  # pages that hold the prompt's start
    chosen = sorted(weight.topk(count).indices.tolist())
    ids = tensors["recall.ids"].tolist()
    return [token for p in chosen if weight[p] >= 0 for token in ids[p * page:(p + 1) * page]]


def key_module(attention):
    """The module whose output is the layer's keys before RoPE: the key norm where the model has one, else k_proj."""
    return getattr(attention, "k_norm", None) or attention.k_proj


def query_module(attention):
    """The module whose output is the layer's queries before RoPE (q_norm where the model has one, else q_proj)."""
    return getattr(attention, "q_norm", None) or attention.q_proj


@contextmanager
def _capture(decoder, layers: list[int], module_of, into: dict[int, torch.Tensor]):
    """Within the block, ``into[layer]`` is the output of ``module_of(layer's attention)`` of the last forward."""
    def hook(layer: int):
        def keep(module, args, output) -> None:
            into[layer] = output
        return keep

    hooks = [module_of(decoder.layers[i].self_attn).register_forward_hook(hook(i)) for i in layers]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
