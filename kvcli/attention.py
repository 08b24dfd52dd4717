"""The attention function kvcli registers with transformers' ``AttentionInterface``.

It does two things the stock SDPA path cannot: it builds the block-causal mask of a block of
queries against a compressed cache whose length has nothing to do with positions, and it records
the attention that the last few queries pay to every cached key, which is what SnapKV, H2O,
TOVA, TreeKV and PyramidInfer score tokens with. On the CPU a block against the cache goes through
:func:`explicit_attention` (bf16 matmuls, probabilities for free); a long prefill and
every GPU call go through :func:`sdpa_attention`, which materialises only the observation window.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcli.cache import AttentionRecord, KVCache

ATTENTION_NAME = "kvcli"

#: From this many queries on, a prefill into an empty cache uses SDPA's causal kernel on the CPU too:
#: it never materialises the ``n x n`` probabilities, which costs more time and memory than the fused
#: kernel at these lengths (timings in docs/benchmarks.md, ``python -m kvcli.bench.throughput --attention``).
CAUSAL_KERNEL_FROM = 1024


@lru_cache(maxsize=16)
def block_causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """``[queries, keys]`` boolean mask: query i sees every cached key and the new keys up to itself."""
    offset = keys - queries
    rows = torch.arange(queries, device=device)[:, None]
    cols = torch.arange(keys, device=device)[None, :]
    return cols <= rows + offset


def window_probs(logits: torch.Tensor, scaling: float, visible: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scaling`` times the window's ``logits`` ``[H_kv, group, w, keys]``, summed over the queries.

    The one place scores are made, for every attention path and device: scaled, softmaxed and summed
    in fp32, so that bf16 rounding of the probabilities never turns near-equal scores into exact ties
    (which the eviction rules break to the left) on one device and not on another.
    """
    logits = logits.float().mul_(scaling)
    logits.masked_fill_(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=2)


def window_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries, summed over them: ``[H_kv, group, keys]`` in fp32."""
    _, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    window = min(window, q_len)
    tail = query[0, :, q_len - window:, :].reshape(kv_heads, group * window, dim)
    logits = torch.matmul(tail, key[0].transpose(1, 2)).view(kv_heads, group, window, k_len)
    return window_probs(logits, scaling, block_causal_mask(q_len, k_len, query.device)[q_len - window:])


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention as two batched matmuls around a softmax, returning the window's probabilities too.

    On CPUs with AMX the matmuls run at the bf16 rate while the fused SDPA kernel does not (timings
    in docs/benchmarks.md), and the probabilities the methods score with come for free. Query heads
    are grouped under their KV head (GQA) instead of repeating keys and values. The output keeps the
    input dtype; the window's scores are a second, fp32 softmax of the same logits' last rows
    (:func:`window_probs`), never sums of the bf16 probabilities.
    """
    _, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    grouped = (query[0] * scaling).reshape(kv_heads, group * q_len, dim)
    logits = torch.matmul(grouped, key[0].transpose(1, 2)).view(kv_heads, group, q_len, k_len)
    tail = None
    if window > 0:  # before the in-place causal mask below; the scaling is already in the logits
        w = min(window, q_len)
        visible = block_causal_mask(q_len, k_len, query.device)[q_len - w:]
        tail = window_probs(logits[:, :, q_len - w:, :], 1.0, visible)
    if q_len > 1:  # only the new keys need the causal mask: every cached key is visible to every query
        offset = k_len - q_len
        new_part = logits[..., offset:]
        new_part.masked_fill_(~block_causal_mask(q_len, q_len, query.device), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    output = torch.matmul(probs.view(kv_heads, group * q_len, k_len), value[0])
    output = output.view(1, q_heads, q_len, value.shape[-1])
    return output, tail


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scaling: float, window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``scaled_dot_product_attention`` for the output, the window's probabilities computed on the side.

    Without a mask, a prefill into an empty cache (as many keys as queries) takes SDPA's causal
    kernel, which never materialises the ``n x n`` probabilities; a block against a cache gets the
    block-causal mask.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is None and q_len > 1 and q_len != k_len:
        mask = block_causal_mask(q_len, k_len, query.device)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    probs = window_attention(query, key, scaling, window) if window > 0 else None
    return output, probs


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, window: int,
                    attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of every query to every key it can see, on the path that is fastest where it runs.

    On the CPU without a mask a block against the cache takes :func:`explicit_attention`; a long
    prefill into an empty cache and every GPU call take :func:`sdpa_attention`.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    long_prefill = attention_mask is None and q_len == k_len and q_len >= CAUSAL_KERNEL_FROM
    if query.device.type == "cpu" and attention_mask is None and not long_prefill:
        return explicit_attention(query, key, value, scaling, window)
    return sdpa_attention(query, key, value, attention_mask, scaling, window)


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
    cache: KVCache | None = kwargs.get("kvcli_cache")
    window = cache.score_window if cache is not None else 0
    own = cache.layers[module.layer_idx].attend(query, key, value, scaling, window) if cache is not None else None
    if own is not None:
        output, probs = own
    else:
        output, probs = dense_attention(query, key, value, scaling, window, attention_mask)
    if probs is not None:
        layer = cache.layers[module.layer_idx]
        window = min(window, q_len)
        if layer.record is None:
            layer.record = AttentionRecord(probs, window)
        else:  # a probe forward (query-aware scoring) adds its queries to the block's window
            layer.record = AttentionRecord(layer.record.probs + probs[..., : layer.record.probs.shape[-1]],
                                           layer.record.window + window)
    return output.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``attn_implementation="kvcli"`` available to every transformers model (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvcli_attention)
