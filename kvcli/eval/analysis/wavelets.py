"""Haar-wavelet magnitude by position (TreeKV section 3.3, Figure 2).

The signal ``s = a ∘ V`` of the last query is decomposed into detail levels along the sequence; its
magnitude growing towards the end is what motivates a cache that is sparse on the left and dense on
the right. The transform is a few lines of torch with the paper's own filters (no PyWavelets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcli.eval.analysis.record import AttentionSample
from kvcli.eval.analysis.statistics import bin_edges, rounded

SQRT2 = math.sqrt(2.0)


def haar_step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One level of the Haar DWT along the last dimension, with TreeKV section 3.2's filters.

    ``g = (√2/2, √2/2)`` and ``h = (-√2/2, √2/2)`` give, for each pair ``(x[2n], x[2n+1])``,
    ``A[n] = (x[2n] + x[2n+1]) / √2`` and ``D[n] = (x[2n] - x[2n+1]) / √2``.
    """
    if x.shape[-1] % 2:
        raise ValueError("a Haar step needs an even length")
    even, odd = x[..., 0::2], x[..., 1::2]
    return (even + odd) / SQRT2, (even - odd) / SQRT2


def haar_inverse_step(approx: torch.Tensor, detail: torch.Tensor) -> torch.Tensor:
    """The paper's single-level reconstruction R(A, D): ``x[2n] = (A + D) / √2``, ``x[2n+1] = (A - D) / √2``."""
    out = approx.new_empty((*approx.shape[:-1], 2 * approx.shape[-1]))
    out[..., 0::2] = (approx + detail) / SQRT2
    out[..., 1::2] = (approx - detail) / SQRT2
    return out


def haar_dwt(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Multi-level Haar DWT along the last dimension: ``(A_L, [D_1, ..., D_L])``, D_1 the highest frequency."""
    if x.shape[-1] % (2 ** levels):
        raise ValueError(f"length {x.shape[-1]} is not a multiple of 2**{levels}")
    details = []
    approx = x
    for _ in range(levels):
        approx, detail = haar_step(approx)
        details.append(detail)
    return approx, details


def haar_idwt(approx: torch.Tensor, details: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`haar_dwt`: apply R from the deepest level up."""
    x = approx
    for detail in reversed(details):
        x = haar_inverse_step(x, detail)
    return x


def detail_reconstruction(detail: torch.Tensor, level: int) -> torch.Tensor:
    """TreeKV's ``Rec(D_l) = R(R(...R(0, D_l)..., 0), 0)``: level l's detail alone, back at full length."""
    x = haar_inverse_step(torch.zeros_like(detail), detail)
    for _ in range(level - 1):
        x = haar_inverse_step(x, torch.zeros_like(x))
    return x


def wavelet_magnitudes(sample: AttentionSample, levels: int = 5) -> tuple[torch.Tensor, int]:
    """Mean magnitude of ``Rec(D_l)`` at every position, over layers and heads: ``([levels, T'], start)``.

    TreeKV's signal is ``s = a^(t) ∘ V^(t)``: each position's value vector weighted by the attention the
    last query pays it (the terms whose sum is the attention output). It is decomposed along the
    sequence, per head and channel; the magnitude at a position is the L2 norm over the head's
    channels. The DWT needs a multiple of ``2**levels`` positions, so the oldest ``T mod 2**levels``
    (fewer than 32 at 5 levels, inside the sink region the paper leaves out) are dropped; ``start``
    is the first position kept.
    """
    length = sample.probs[0].shape[-1]
    start = length % (2 ** levels)
    total = torch.zeros(levels, length - start, dtype=torch.float64)
    count = 0
    for probs, values in zip(sample.probs, sample.values, strict=True):
        group = probs.shape[0] // values.shape[0]
        last = probs[:, -1, start:]  # [H, T'] the last query's attention
        signal = last[:, :, None] * values[:, start:].repeat_interleave(group, dim=0)  # [H, T', D]
        _, details = haar_dwt(signal.transpose(1, 2), levels)  # along positions, per channel
        for level, detail in enumerate(details, start=1):
            total[level - 1] += detail_reconstruction(detail, level).norm(dim=1).double().sum(dim=0)
        count += probs.shape[0]
    return total / count, start


def wavelet_report(sample: AttentionSample, levels: int = 5, points: int = 64, edge: int = 32) -> dict:
    """Per detail level, the magnitude curve averaged into at most ``points`` position bins."""
    magnitudes, start = wavelet_magnitudes(sample, levels)
    length = sample.probs[0].shape[-1]
    edges = [start + e for e in bin_edges(length - start, points)]
    curves = {}
    for level in range(levels):
        row = magnitudes[level]
        curves[f"D{level + 1}"] = rounded(torch.stack([row[a - start:b - start].mean()
                                                       for a, b in zip(edges[:-1], edges[1:], strict=True)]), 6)
    return {
        "signal": "a ∘ V of the last query (attention-weighted values), per head",
        "wavelet": "haar",
        "levels": levels,
        "start": start,
        "edge": edge,
        "bin_edges": edges,
        "magnitude": curves,
    }
