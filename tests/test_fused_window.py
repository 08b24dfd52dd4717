"""The fused window sums (kvcli.kv.fused_window) against the unfused softmax they replace.

On a GPU the kernels run compiled (bf16); without one, under Triton's interpreter (fp32), where Triton is
installed (it comes with CUDA builds of PyTorch, not with the CPU build: elsewhere these tests skip).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kvcli.kv import fused_window
from kvcli.kv.attention import window_logits
from kvcli.kv.scores import window_probs

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (CUDA builds of PyTorch)"),
    # Triton's interpreter must be asked for before Triton is first imported (torch and transformers may import
    # it), so for the whole process: run this file alone, `TRITON_INTERPRET=1 pytest tests/test_fused_window.py`.
    pytest.mark.skipif(not CUDA and not INTERPRETED, reason="no GPU: run alone with TRITON_INTERPRET=1"),
]


def inputs(q_heads: int, kv_heads: int, n: int, cached: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, n, q_heads, dim, generator=generator).transpose(1, 2)  # strided, as a model's
    key = torch.randn(1, kv_heads, cached + n, dim, generator=generator) * 2
    dtype, device = (torch.bfloat16, "cuda") if CUDA else (torch.float32, "cpu")
    return query.to(device, dtype), key.to(device, dtype)


@pytest.mark.parametrize(("n", "cached", "first", "last"), [(200, 300, 0, 200), (200, 0, 0, 200),
                                                             (260, 90, 40, 230), (130, 1000, 2, 130)])
@pytest.mark.parametrize("dim", [16, 64])
def test_the_fused_sums_equal_the_softmax_they_replace(n, cached, first, last, dim):
    """Every query's softmax over the keys it sees (all cached keys, the block's own up to itself), summed over
    the queries first:last, per query head: the same as the unfused path, whole blocks and windows that end
    before the block does (a question's template tail), with and without a cache, GQA groups of 3."""
    query, key = inputs(6, 2, n, cached, dim)
    scaling = dim ** -0.5
    assert fused_window.applies(query, last - first)
    fused = fused_window.window_sums(query, key, scaling, first, last)
    unfused = window_probs(*window_logits(query, key, scaling, first, last))
    assert fused.shape == unfused.shape == (2, 3, cached + n) and fused.dtype == torch.float32
    tolerance = 2e-2 if CUDA else 1e-4  # on the GPU the unfused logits are rounded to bf16, the fused are not
    torch.testing.assert_close(fused, unfused, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(fused.sum(dim=-1), torch.full_like(fused[..., 0], last - first), rtol=1e-4, atol=1e-3)


def test_short_windows_odd_heads_and_other_devices_stay_unfused():
    query, _ = inputs(2, 1, 200, 0, 16)
    assert not fused_window.applies(query, fused_window.MIN_WINDOW - 1)
    assert not fused_window.applies(inputs(2, 1, 200, 0, 24)[0], 200)  # not a power of two
    if not CUDA:
        os.environ.pop("TRITON_INTERPRET")
        try:
            assert not fused_window.applies(query, 200)  # a CPU without the interpreter
        finally:
            os.environ["TRITON_INTERPRET"] = "1"
    assert fused_window.applies(query, 200)
