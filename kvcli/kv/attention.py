"""The attention function kvcli registers with transformers' ``AttentionInterface``.

It does two things the stock SDPA path cannot: it builds the block-causal mask of a block of
queries against a compressed cache whose length has nothing to do with positions, and it records
the attention that the last few queries pay to every cached key, which is what SnapKV, H2O,
TOVA, TreeKV and PyramidInfer score tokens with. On the CPU a bf16 block against the cache, or a float32 one most of
whose queries are scored, goes through :func:`explicit_attention` (two matmuls, probabilities for free); the rest,
a long prefill and every GPU call go through :func:`sdpa_attention`, which materialises only the observation window.

It honours what families add to plain attention, as their eager attention does: a sliding window
(``sliding_window``: a query sees itself and the ``window - 1`` keys before it; Gemma 2/3, GPT-OSS,
Mistral), logit soft-capping (``softcap``: ``tanh(logits / cap) * cap`` before the softmax; Gemma 2),
learned sinks (``s_aux``: one extra logit per query head in the softmax's denominator, attending to
nothing; GPT-OSS) and the family's own scaling (``scaling``, e.g. Gemma's ``query_pre_attn_scalar``).
Query and key norms (Qwen3, OLMo 2, Gemma 3) are applied by the model before attention is called.
Soft-capping and sinks take the explicit path on every device, since SDPA has neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from kvcli.errors import UnsupportedModelError
from kvcli.kv import fused_window
from kvcli.kv.cache import KVCache
from kvcli.kv.rows import CacheRows, RowStates
from kvcli.kv.scores import defer, defers, record, window_probs

ATTENTION_NAME = "kvcli"

#: From this many queries on, a prefill into an empty cache uses SDPA's causal kernel on the CPU too:
#: it never materialises the ``n x n`` probabilities, which costs more time and memory than the fused
#: kernel at these lengths (timings in docs/benchmarks.md, ``python -m kvcli.eval.bench.throughput --attention``).
CAUSAL_KERNEL_FROM = 1024


#: Masks of at most this many elements (a block of 1,024 against 3,072 cached keys) are kept once made: a stream makes
#: the same few shapes layer after layer and block after block. A larger one, the whole-prompt mask of a one-shot
#: read, is made each time: making it is a few passes over its bytes, little beside the attention it masks, and
#: keeping one for every prompt length would hold up to 64 of them for the life of a process that reads many prompts
#: (``kvcli ruler``, lm-eval): 16 MiB each at 4,096 tokens, 256 MiB at 16,384.
KEPT_MASK_ELEMENTS = 1 << 22


def hidden_by_mask(queries: int, keys: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """The keys :func:`block_causal_mask` hides (its negation), for ``masked_fill_``."""
    return _mask(queries, keys, torch.device(device), window, True)


def block_causal_mask(queries: int, keys: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """``[queries, keys]`` boolean mask: query i sees every cached key and the new keys up to itself;
    with a ``window``, only the keys less than ``window`` positions before it (the cached keys of a
    window layer are the consecutive tokens right before the block, so indices measure positions).
    Read only, as :func:`hidden_by_mask`: one of at most :data:`KEPT_MASK_ELEMENTS` elements is shared."""
    return _mask(queries, keys, torch.device(device), window, False)


def _mask(queries: int, keys: int, device: torch.device, window: int | None, hidden: bool) -> torch.Tensor:
    make = _kept_mask if queries * keys <= KEPT_MASK_ELEMENTS else _made_mask
    return make(queries, keys, device, window, hidden)


def _made_mask(queries: int, keys: int, device: torch.device, window: int | None, hidden: bool) -> torch.Tensor:
    offset = keys - queries
    rows = torch.arange(queries, device=device)[:, None]
    cols = torch.arange(keys, device=device)[None, :]
    visible = cols <= rows + offset
    if window is not None:
        visible &= cols > rows + offset - window
    return ~visible if hidden else visible


_kept_mask = lru_cache(maxsize=64)(_made_mask)  # a shape per layer length: PyramidKV's 30 layers each have their own


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, ``tanh(logits / cap) * cap`` (in place where it can be)."""
    if cap is None:
        return logits
    return logits.div_(cap).tanh_().mul_(cap)


#: Largest number of fp32 attention scores :func:`window_attention` materialises at once (256 MiB): a
#: long observation window (H2O's is the whole prompt) is summed in chunks of queries below it.
WINDOW_CHUNK_SCORES = 1 << 26


def window_logits(query: torch.Tensor, key: torch.Tensor, scaling: float, first: int, last: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled logits ``[H_kv, group, last - first, keys]`` of the queries ``first:last`` against every key, and the
    mask of the block's own keys they must not see (:func:`kvcli.kv.scores.window_probs`; None for one query).

    Queries are scaled before the matmul, as the explicit path scales them: the same scores on both paths.
    """
    _, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    rows = last - first
    grouped = query.narrow(2, first, rows).mul(scaling).reshape(1, kv_heads, (q_heads // kv_heads) * rows, dim)
    logits = torch.matmul(grouped, key.transpose(2, 3)).view(kv_heads, q_heads // kv_heads, rows, k_len)
    return logits, window_mask(q_len, first, last, query.device) if q_len > 1 else None


def window_mask(queries: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """``[last - first, queries]``: the keys of the block's own that the queries ``first:last`` of a block of
    ``queries`` must not see (the rows ``first:last`` of :func:`hidden_by_mask` of the block against itself, made
    alone, not cut from the whole block's mask). Read only: a small one is shared, once per block size and window
    whatever the cache's length (layers differ in it)."""
    make = _kept_window_mask if (last - first) * queries <= KEPT_MASK_ELEMENTS else _window_mask
    return make(queries, first, last, torch.device(device))


def _window_mask(queries: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    return torch.arange(queries, device=device)[None, :] > torch.arange(first, last, device=device)[:, None]


_kept_window_mask = lru_cache(maxsize=16)(_window_mask)


def window_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int, skip: int = 0
                     ) -> torch.Tensor:
    """Softmax attention of the ``window`` queries before the last ``skip``, summed over them: ``[H_kv, group, keys]``
    in fp32.

    Summed chunk by chunk of queries, so memory stays bounded when the window is a whole long prompt;
    the usual window is one chunk, whose sum is returned as it is (no running total to add it to).
    """
    q_heads, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    end = q_len - skip
    window = min(window, end)
    if fused_window.applies(query, window):  # a GPU's long window (H2O's whole block): no scores written
        return fused_window.window_sums(query, key, scaling, end - window, end)
    chunk = max(1, WINDOW_CHUNK_SCORES // (q_heads * k_len))
    total = None
    for first in range(end - window, end, chunk):
        probs = window_probs(*window_logits(query, key, scaling, first, min(first + chunk, end)))
        total = probs if total is None else total.add_(probs)
    return total


def grouped_logits(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled logits of ``query`` ``[1, H_q, n, D]`` against ``key`` ``[1, H_kv, T, D]``: ``[1, H_kv, group * n, T]``,
    one batched matmul per KV head with its query heads side by side (GQA without repeating keys)."""
    _, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    grouped = (query * scaling).reshape(1, kv_heads, (q_heads // kv_heads) * q_len, dim)
    return torch.matmul(grouped, key.transpose(2, 3))


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       window: int, *, sliding_window: int | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention as two batched matmuls around a softmax, returning the window's probabilities too (the
    ``window`` queries before the last ``skip``).

    In bf16 on a CPU the two matmuls keep up with the fused SDPA kernel end to end (timings in
    docs/benchmarks.md), and the probabilities the methods score with come for free. Query heads
    are grouped under their KV head (GQA) instead of repeating keys and values. ``sinks`` ``[H_q]``
    are learned logits that join each query's softmax and are dropped after it. The output keeps the
    input dtype; the window's scores are a second, fp32 softmax of the same masked logits' last rows
    (:func:`window_probs`), never sums of the bf16 probabilities.
    """
    _, q_heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    logits = soft_cap(grouped_logits(query, key, scaling), softcap).view(kv_heads, group, q_len, k_len)
    if sliding_window is not None and k_len > 1:
        logits.masked_fill_(hidden_by_mask(q_len, k_len, query.device, sliding_window), float("-inf"))
    elif q_len > 1:  # only the new keys need the causal mask: every cached key is visible to every query
        offset = k_len - q_len
        new_part = logits[..., offset:]
        new_part.masked_fill_(hidden_by_mask(q_len, q_len, query.device), float("-inf"))
    tail = None
    if window > 0:  # the scaling is already in the logits
        end = q_len - skip
        tail = window_probs(logits[:, :, end - min(window, end):end, :], None)
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.to(logits.dtype).view(kv_heads, group, 1, 1).expand(kv_heads, group, q_len, 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :k_len].contiguous()
    output = torch.matmul(probs.view(1, kv_heads, group * q_len, k_len), value)
    output = output.view(1, q_heads, q_len, value.shape[-1])
    return output, tail


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scaling: float, window: int, sliding_window: int | None = None, skip: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``scaled_dot_product_attention`` for the output, the window's probabilities computed on the side (the
    ``window`` queries before the last ``skip``).

    Without a mask, a prefill into an empty cache (as many keys as queries) takes SDPA's causal
    kernel, which never materialises the ``n x n`` probabilities; a block against a cache, or any
    block of a window layer, gets the block-causal (windowed) mask. On CUDA a block or a generated
    token against a cache says "causal, aligned to the last key" instead (``causal_lower_right``),
    which runs the flash kernel directly: the backend SDPA picks for a boolean mask (cuDNN on an
    H100) builds a plan for every new key length, and a cache that grows while writing, or layers of
    different lengths, make a new length at every layer and step.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is None and sliding_window is None and q_len != k_len and query.device.type == "cuda":
        mask = causal_lower_right(q_len, k_len)
    elif mask is None and (sliding_window is not None or (q_len > 1 and q_len != k_len)):
        mask = block_causal_mask(q_len, k_len, query.device, sliding_window)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    probs = window_attention(query, key, scaling, window, skip) if window > 0 else None
    return output, probs


#: Devices whose blocks against a cache take :func:`explicit_attention` (:func:`takes_explicit`).
EXPLICIT_DEVICES = frozenset({"cpu"})
#: On those devices a float32 block takes it when at least this share of its queries record their attention
#: (H2O: all of them); 0 sends every float32 block down it, as every 16-bit one goes.
FLOAT32_EXPLICIT_SHARE = 0.5


@contextmanager
def sdpa_everywhere() -> Iterator[None]:
    """Within it, every device takes the SDPA path, as every GPU call does: to count and test the GPU's
    operations on a CPU (``python -m kvcli.eval.bench.ops --attention sdpa``, tests/test_overhead.py). The CPU
    builds a boolean block-causal mask (made once per shape) where CUDA passes ``causal_lower_right``."""
    global EXPLICIT_DEVICES
    before, EXPLICIT_DEVICES = EXPLICIT_DEVICES, frozenset()
    try:
        yield
    finally:
        EXPLICIT_DEVICES = before


def takes_explicit(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, *,
                   softcap: float | None = None, sinks: torch.Tensor | None = None, recorded: int = 0) -> bool:
    """Whether :func:`dense_attention` takes the explicit path: soft-capping and sinks always (SDPA has
    neither); on the CPU a block against the cache without a mask (never a long prefill into an empty cache) in a
    16-bit float, or in float32 where at least half its queries record their attention (``recorded``: H2O's whole
    block). In 16 bits the explicit matmuls keep up with SDPA end to end and give those probabilities for free; in
    float32 SDPA's fused kernel is faster, unless it would have to compute most of the probabilities a second time
    (docs/benchmarks.md, "Which attention path the CPU takes")."""
    if softcap is not None or sinks is not None:
        return True
    q_len, k_len = query.shape[2], key.shape[2]
    long_prefill = attention_mask is None and q_len == k_len and q_len >= CAUSAL_KERNEL_FROM
    if query.device.type not in EXPLICIT_DEVICES or attention_mask is not None or long_prefill:
        return False
    return query.dtype != torch.float32 or recorded >= FLOAT32_EXPLICIT_SHARE * q_len


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, window: int,
                    attention_mask: torch.Tensor | None = None, *, sliding_window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, skip: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of every query to every key it can see, on the path that is fastest where it runs.

    On the CPU some blocks against the cache take :func:`explicit_attention` (:func:`takes_explicit`); the others,
    a long prefill into an empty cache and every GPU call take :func:`sdpa_attention`, unless the layer
    soft-caps its logits or has sinks, which only the explicit path computes.
    """
    recorded = min(window, query.shape[2] - skip)
    if takes_explicit(query, key, attention_mask, softcap=softcap, sinks=sinks, recorded=recorded):
        if attention_mask is not None:
            raise ValueError("kvcli builds its own masks; soft-capping and sinks take no external mask")
        return explicit_attention(query, key, value, scaling, window, sliding_window=sliding_window,
                                  softcap=softcap, sinks=sinks, skip=skip)
    return sdpa_attention(query, key, value, attention_mask, scaling, window, sliding_window, skip)


def kvcli_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    q_len = query.shape[2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    cache: KVCache | CacheRows | None = kwargs.get("kvcli_cache")
    if isinstance(cache, CacheRows):
        return rows_attention(module, query, key, value, scaling, dropout, cache, kwargs), None
    sliding_window = kwargs.get("sliding_window")
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if layer is not None and layer.window != sliding_window:
        # The cache kept what kvcli.kv.architecture read; the model asks for another window.
        raise UnsupportedModelError(
            f"layer {module.layer_idx} of this model attends within a window of {sliding_window} tokens, but kvcli "
            f"read {layer.window} from its configuration: this architecture is not supported")
    window = cache.score_window if layer is not None and layer.window is None else 0  # window layers need no scores
    skip = min(cache.score_skip, q_len) if window else 0
    own = layer.attend(query, key, value, scaling, window) if layer is not None else None
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    recorded = min(window, q_len - skip)
    if own is not None:
        output, probs = own
    elif (recorded and query.device.type not in EXPLICIT_DEVICES and defers(query.shape[1], recorded, key.shape[2])
          and not takes_explicit(query, key, attention_mask, softcap=softcap, sinks=sinks, recorded=recorded)):
        # A GPU's SDPA path: the window's softmax waits to be batched with the other layers' (kvcli.kv.scores).
        # Not on the CPU, which is not bound by launches and whose long one-shot prefills take that path too.
        output, _ = sdpa_attention(query, key, value, attention_mask, scaling, 0, sliding_window)
        end = q_len - skip
        defer(cache, layer, *window_logits(query, key, scaling, end - recorded, end), recorded, skip)
        probs = None
    else:
        output, probs = dense_attention(query, key, value, scaling, window, attention_mask,
                                        sliding_window=sliding_window, softcap=softcap, sinks=sinks, skip=skip)
    if probs is not None:
        record(layer, probs, recorded, cache.probing, cache.question_scores, skip)
    if own is None and layer is not None and not cache.probing:  # a layer attending by itself packs no such grid
        layer.observe(query)  # a 2-bit key grid weighs its axes by the queries (kvcli.kv.basis)
    return output.transpose(1, 2).contiguous(), None


def rows_attention(module: torch.nn.Module, query: torch.Tensor, keys: RowStates, values: RowStates, scaling: float,
                   dropout: float, rows: CacheRows, kwargs: dict) -> torch.Tensor:
    """A batch of documents (:mod:`kvcli.kv.rows`): row ``b``'s queries against row ``b``'s own cache, each exactly
    as a document read alone attends (its mask, its scores recorded for its method), the outputs stacked."""
    outputs = [kvcli_attention(module, query[b:b + 1], keys[b], values[b], None, scaling, dropout,
                               **{**kwargs, "kvcli_cache": cache})[0] for b, cache in enumerate(rows.rows)]
    return torch.cat(outputs)


def register_attention() -> None:
    """Make ``attn_implementation="kvcli"`` available to every transformers model (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvcli_attention)
