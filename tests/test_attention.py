"""Attention scores are fp32 on every path: the CPU's bf16 attention keeps what an fp32 reference keeps."""

from __future__ import annotations

import pytest
import torch

from kvcli.kv import attention
from kvcli.kv.attention import explicit_attention, window_attention
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
    from kvcli.kv.attention import sdpa_attention

    generator = torch.Generator().manual_seed(queries + cached)
    q = torch.randn(1, 8, queries, 64, generator=generator)
    k = torch.randn(1, 2, queries + cached, 64, generator=generator)
    v = torch.randn(1, 2, queries + cached, 64, generator=generator)
    want, want_scores = explicit_attention(q, k, v, 0.125, 4)
    got, got_scores = sdpa_attention(q.cuda().half(), k.cuda().half(), v.cuda().half(), None, 0.125, 4)
    assert torch.allclose(got.float().cpu(), want, atol=2e-2)
    assert torch.allclose(got_scores.cpu(), want_scores, atol=2e-2)


def _stream_on_the_sdpa_path(name: str, ids: torch.Tensor, question: torch.Tensor, dtype: torch.dtype) -> list:
    """What a stream leaves on the GPU's attention path (forced on the CPU): each block's last hidden state, then
    every layer's kept tokens and keys; blocks scored by the block's own window, by a probe, and a nested read."""
    from kvcli.engine.engine import Engine
    from kvcli.kv.attention import sdpa_everywhere
    from kvcli.methods import make_method
    from kvcli.models.load import tiny_llama

    model = tiny_llama(num_layers=4, hidden=64, heads=4, kv_heads=2, seed=0).to(dtype)
    engine = Engine(model, make_method(name), 48, block=24)
    cache = engine.new_cache()
    out = []
    with sdpa_everywhere():
        for start in range(0, ids.shape[0], 24):
            probe = question[None] if start % 48 else None
            out.append(engine.forward(cache, ids[None, start:start + 24], probe=probe)[-1])
        out.append(engine.forward(cache, torch.cat((ids[:5], question))[None], question=question.shape[0],
                                  last_only=True)[-1])
    for layer in cache.layers:
        out += [layer.token_idx, layer.keys]
    return out


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "treekv", "h2o", "tova", "pyramidinfer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_scores_batched_across_layers_are_each_layers_own(name, dtype, monkeypatch):
    """On the SDPA path the layers' window softmaxes wait and run as one batch (kvcli.kv.scores): every kept token,
    key and hidden state is what each layer's own softmax at once gives, bit for bit, in one batch or several."""
    import kvcli.engine.engine
    from kvcli.kv import scores

    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (24 * 8,), generator=generator)
    question = torch.randint(0, 128, (6,), generator=generator)
    waited = []
    monkeypatch.setattr(kvcli.engine.engine, "settle",
                        lambda cache: (waited.append(len(cache.waiting)), scores.settle(cache)))
    batched = _stream_on_the_sdpa_path(name, ids, question, dtype)
    assert max(waited) == 4  # every layer's window waited for one batch
    monkeypatch.setattr(scores, "STACK_SCORES", 1)  # one layer a batch
    one_by_one = _stream_on_the_sdpa_path(name, ids, question, dtype)
    monkeypatch.setattr(scores, "DEFER_SCORES", 0)  # nothing waits: each layer's softmax in its attention
    at_once = _stream_on_the_sdpa_path(name, ids, question, dtype)
    assert all(torch.equal(a, b) for a, b in zip(batched, at_once, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(one_by_one, at_once, strict=True))


def test_the_cpu_does_not_wait_for_window_scores(monkeypatch):
    """On the CPU every window is softmaxed in its layer's attention: nothing waits (kvcli.kv.scores) outside
    :func:`kvcli.kv.attention.sdpa_everywhere`, the long one-shot prefills that take SDPA there included."""
    import kvcli.engine.engine
    from kvcli.engine.engine import Engine
    from kvcli.kv import scores
    from kvcli.methods import make_method
    from kvcli.models.load import tiny_llama

    model = tiny_llama(num_layers=2, hidden=32, heads=4, kv_heads=2, seed=0)
    engine = Engine(model, make_method("snapkv"), 48, block=24)
    cache = engine.new_cache()
    waited = []
    monkeypatch.setattr(kvcli.engine.engine, "settle",
                        lambda cache: (waited.append(len(cache.waiting)), scores.settle(cache)))
    engine.forward(cache, torch.randint(0, 128, (1, 1100)), question=8)  # a one-shot prefill: SDPA on the CPU
    engine.forward(cache, torch.randint(0, 128, (1, 24)))
    assert waited == [0, 0]


@pytest.mark.parametrize("dtype,queries,cached,recorded,softcap,explicit", [
    (torch.bfloat16, 256, 1024, 8, None, True),     # 16 bits: the explicit matmuls, probabilities for free
    (torch.float32, 256, 1024, 8, None, False),     # float32: SDPA's fused kernel, the window on the side
    (torch.float32, 256, 1024, 128, None, True),    # half the block scored (H2O): computed once, explicitly
    (torch.float32, 1, 1024, 0, None, False),       # a generated token
    (torch.bfloat16, 2048, 0, 2048, None, False),   # a long prefill into an empty cache: the causal kernel
    (torch.float32, 256, 1024, 8, 30.0, True),      # soft-capping: only the explicit path has it
])
def test_the_cpu_takes_the_explicit_path_for_16_bits_and_for_blocks_mostly_scored(dtype, queries, cached, recorded,
                                                                                    softcap, explicit):
    from kvcli.kv.attention import takes_explicit

    query = torch.zeros(1, 4, queries, 8, dtype=dtype)
    key = torch.zeros(1, 2, cached + queries, 8, dtype=dtype)
    assert takes_explicit(query, key, None, softcap=softcap, recorded=recorded) is explicit


def test_float32_blocks_on_either_cpu_path_give_the_same_output_and_scores():
    """The two CPU paths agree in float32: a block against a cache (GQA), its window's probabilities included."""
    from kvcli.kv.attention import sdpa_attention

    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 16, 8, generator=generator)
    key, value = torch.randn(2, 1, 2, 40, 8, generator=generator)
    want, want_scores = explicit_attention(query, key, value, 8 ** -0.5, 4, skip=2)
    got, got_scores = sdpa_attention(query, key, value, None, 8 ** -0.5, 4, skip=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_scores, want_scores, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("queries", "keys", "window"), [(7, 7, None), (5, 12, None), (6, 20, 4), (40, 40, 9)])
def test_a_mask_is_the_same_kept_or_made_again_and_only_small_ones_are_kept(queries, keys, window, monkeypatch):
    """A block's causal (windowed) mask and a window's rows of it are the literal rule whether kept or made each
    time; only masks of at most KEPT_MASK_ELEMENTS are kept, so reading prompts of many lengths in one process (one
    shot, whole-prompt masks) keeps none of them."""
    rows, cols = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
    literal = (cols <= rows + keys - queries) & (cols > rows + keys - queries - (window or keys + 1))
    first, last = queries // 2, queries
    literal_rows = ~(torch.arange(queries)[None, :] <= torch.arange(queries)[:, None])[first:last]
    for limit in (0, queries * keys):  # made every time, then kept
        monkeypatch.setattr(attention, "KEPT_MASK_ELEMENTS", limit)
        attention._kept_mask.cache_clear()
        attention._kept_window_mask.cache_clear()
        assert torch.equal(attention.block_causal_mask(queries, keys, torch.device("cpu"), window), literal)
        assert torch.equal(attention.hidden_by_mask(queries, keys, torch.device("cpu"), window), ~literal)
        assert torch.equal(attention.window_mask(queries, first, last, torch.device("cpu")), literal_rows)
        kept = attention._kept_mask.cache_info().currsize + attention._kept_window_mask.cache_info().currsize
        assert kept == (0 if limit == 0 else 3)
        assert attention.window_mask(queries, first, last, "cpu").shape == (last - first, queries)  # its rows alone
