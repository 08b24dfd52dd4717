"""Attention scores are fp32 on every path: the CPU's bf16 attention keeps what an fp32 reference keeps."""

from __future__ import annotations

import pytest
import torch

from kvcli.attention import explicit_attention, window_attention
from kvcli.methods.base import recent_and_sinks, select_top


def near_tie_input(cached: int = 60, new: int = 4, dim: int = 64):
    """bf16 query/keys whose logits are exact in bf16 and differ by multiples of 2**-10 (near-ties).

    Every query is ``8 e1`` and ``scaling = 1/8``, so a key's logit is its first coordinate, chosen
    on a grid of 2**-10 (exact in bf16 below 0.25): the matmul is exact in bf16 and every ranking
    difference comes from the softmax and the sum over the window, the part that must be fp32.
    """
    gen = torch.Generator().manual_seed(0)
    steps = torch.randperm(cached + new, generator=gen).float()  # distinct logits, 2**-10 apart
    keys = torch.zeros(1, 1, cached + new, dim)
    keys[0, 0, :, 0] = 0.125 + steps * 2.0**-10
    query = torch.zeros(1, 2, new, dim)  # two query heads sharing the KV head (GQA)
    query[..., 0] = 8.0
    values = torch.randn(1, 1, cached + new, dim, generator=gen)
    return query.bfloat16(), keys.bfloat16(), values.bfloat16(), dim ** -0.5


def test_bf16_cpu_scores_keep_the_same_tokens_as_an_fp32_reference():
    query, keys, values, scaling = near_tie_input()
    window, budget = 4, 32
    _, scores = explicit_attention(query, keys, values, scaling, window)
    assert scores.dtype == torch.float32
    reference = window_attention(query.double(), keys.double(), scaling, window)  # fp64 all the way
    length = keys.shape[2]
    protected = recent_and_sinks(length, 2, 4, scores.device)

    def kept(probs: torch.Tensor) -> torch.Tensor:
        return select_top(probs.mean(dim=1), protected, budget)

    assert torch.equal(kept(scores), kept(reference))
    # The input does exercise the fault: summing the bf16 probabilities (the former CPU scores)
    # turns near-ties into exact ties and keeps other tokens.
    logits = ((query[0] * scaling) @ keys[0].transpose(1, 2))[None]  # [H_kv, group, queries, keys]
    new = query.shape[2]
    logits[..., length - new:] = logits[..., length - new:].masked_fill(~torch.ones(new, new).bool().tril(),
                                                                        float("-inf"))
    bf16_sums = torch.softmax(logits, dim=-1)[:, :, -window:].sum(dim=2, dtype=torch.float32)
    assert bf16_sums.shape == scores.shape
    assert not torch.equal(kept(bf16_sums), kept(reference))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("queries,cached", [(1, 37), (1, 38), (16, 40), (64, 64)])
def test_cuda_blocks_and_generated_tokens_match_the_explicit_attention(queries, cached):
    """On CUDA a block against a cache is causal aligned to its last key (the flash kernel, no boolean mask):
    the same output and window scores as the explicit path's block-causal mask, GQA included."""
    from kvcli.attention import sdpa_attention

    generator = torch.Generator().manual_seed(queries + cached)
    q = torch.randn(1, 8, queries, 64, generator=generator)
    k = torch.randn(1, 2, queries + cached, 64, generator=generator)
    v = torch.randn(1, 2, queries + cached, 64, generator=generator)
    want, want_scores = explicit_attention(q, k, v, 0.125, 4)
    got, got_scores = sdpa_attention(q.cuda().half(), k.cuda().half(), v.cuda().half(), None, 0.125, 4)
    assert torch.allclose(got.float().cpu(), want, atol=2e-2)
    assert torch.allclose(got_scores.cpu(), want_scores, atol=2e-2)
