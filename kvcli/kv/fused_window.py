"""A long observation window's attention, summed over its queries, without writing its scores (Triton, GPU).

H2O's window is a whole block (every query of it adds to the accumulated scores), so the unfused path
(:func:`kvcli.kv.attention.window_attention`) writes every query's scores over every key, casts them to fp32,
softmaxes and sums them: traffic that grows with the block's square (measured in docs/benchmarks.md, "GPU").
Two kernels do the same sums from the queries and keys alone, in the manner of flash attention: the first
finds each query's log-sum-exp over the keys it sees, the second adds ``exp(q.k - lse)`` over the queries for
each key. The scores are computed twice and never stored; both kernels accumulate in fp32.

Used on CUDA for bf16 and fp16 queries whose head size is a power of two, when Triton is importable
(:func:`applies`); elsewhere the caller takes the unfused path. The kernels also run on a CPU under
Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch

#: Queries and keys per tile.
TILE = 64
#: Shortest window worth the kernels: shorter ones are batched across layers (kvcli.kv.scores.defer).
MIN_WINDOW = 128


def applies(query: torch.Tensor, window: int) -> bool:
    """Whether :func:`window_sums` computes this window: a GPU's half-precision queries, a head size the tiles
    take, a long window, and Triton present (or its interpreter asked for, on any device)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and (query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16)):
        return False
    dim = query.shape[-1]
    return window >= MIN_WINDOW and dim >= 16 and dim & (dim - 1) == 0 and _kernels() is not None


def window_sums(query: torch.Tensor, key: torch.Tensor, scaling: float, first: int, last: int) -> torch.Tensor:
    """Softmax attention of the queries ``first:last`` of the block ``query`` ``[1, H_q, n, D]`` over ``key``
    ``[1, H_kv, T, D]`` (the block's own keys last, each seen only from its own query on), summed over those
    queries: ``[H_kv, group, T]`` in fp32, what :func:`kvcli.kv.attention.window_attention` returns."""
    lse_kernel, sum_kernel = _kernels()
    _, q_heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    rows = last - first
    lse = torch.empty(q_heads, rows, device=query.device, dtype=torch.float32)
    out = torch.empty(q_heads, length, device=query.device, dtype=torch.float32)
    shape = (q_heads // kv_heads, first, last, length - n, length, scaling * math.log2(math.e))
    strides = (*query.stride()[1:], *key.stride()[1:])
    lse_kernel[(q_heads, triton_cdiv(rows, TILE))](query, key, lse, *strides, *shape, TILE=TILE, DIM=dim)
    sum_kernel[(q_heads, triton_cdiv(length, TILE))](query, key, lse, out, *strides, *shape, TILE=TILE, DIM=dim)
    return out.view(kv_heads, q_heads // kv_heads, length)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: ``triton.language``, bound by :func:`_kernels` (the kernels below read it as a global, as Triton requires).
tl = None


@lru_cache(maxsize=2)
def _kernels():
    """The two kernels below, compiled on first use (None without Triton). Built here, not at import, because
    Triton decides when it wraps a kernel whether it is interpreted, and so that kvcli never imports Triton
    unless a GPU's window asks for it."""
    global tl
    try:
        import triton
        import triton.language
    except ImportError:
        return None
    tl = triton.language
    return triton.jit(lse_kernel), triton.jit(sum_kernel)


# The kernels, plain functions until _kernels wraps them (``tl`` is triton.language by then).
def lse_kernel(q_ptr, k_ptr, lse_ptr, sq_h, sq_n, sq_d, sk_h, sk_n, sk_d, group, first, last, offset, length,
               scale, TILE: tl.constexpr, DIM: tl.constexpr):
    head = tl.program_id(0)
    rows = first + tl.program_id(1) * TILE + tl.arange(0, TILE)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + head * sq_h + rows[:, None] * sq_n + dims[None, :] * sq_d, mask=(rows < last)[:, None],
                other=0.0)
    k_base = k_ptr + (head // group) * sk_h
    best = tl.full([TILE], float("-inf"), tl.float32)
    total = tl.zeros([TILE], tl.float32)
    for start in range(0, length, TILE):  # keys no query of the tile sees are masked out
        cols = start + tl.arange(0, TILE)
        k = tl.load(k_base + cols[:, None] * sk_n + dims[None, :] * sk_d, mask=(cols < length)[:, None],
                    other=0.0)
        seen = (cols[None, :] <= offset + rows[:, None]) & (cols[None, :] < length)
        s = tl.where(seen, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, 1))
        total = total * tl.exp2(best - new_best) + tl.sum(tl.exp2(s - new_best[:, None]), 1)
        best = new_best
    tl.store(lse_ptr + head * (last - first) + rows - first, best + tl.log2(total), mask=rows < last)

def sum_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, sq_h, sq_n, sq_d, sk_h, sk_n, sk_d, group, first, last, offset,
               length, scale, TILE: tl.constexpr, DIM: tl.constexpr):
    head = tl.program_id(0)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    dims = tl.arange(0, DIM)
    k = tl.load(k_ptr + (head // group) * sk_h + cols[:, None] * sk_n + dims[None, :] * sk_d,
                mask=(cols < length)[:, None], other=0.0)
    acc = tl.zeros([TILE], tl.float32)
    for begin in range(first, last, TILE):  # queries that see none of the tile's keys are masked out
        rows = begin + tl.arange(0, TILE)
        q = tl.load(q_ptr + head * sq_h + rows[:, None] * sq_n + dims[None, :] * sq_d,
                    mask=(rows < last)[:, None], other=0.0)
        lse = tl.load(lse_ptr + head * (last - first) + rows - first, mask=rows < last, other=float("inf"))
        seen = (cols[None, :] <= offset + rows[:, None]) & (rows < last)[:, None]
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale - lse[:, None])
        acc += tl.sum(tl.where(seen, p, 0.0), 0)
    tl.store(out_ptr + head * length + cols, acc, mask=cols < length)
