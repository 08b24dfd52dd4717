"""The engine against plain forward passes, and the cache's position bookkeeping against RoPE itself."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support import append_tokens, make_cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvcli.engine.engine import Engine, blocks_of
from kvcli.kv.cache import rotate_keys
from kvcli.kv.quant import POSITION_BYTES
from kvcli.methods import make_method
from kvcli.methods.pod.groups import GroupsFile
from kvcli.models.load import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, vocab=96)


def plain_nll(model, ids: torch.Tensor) -> float:
    """Sum of NLLs from one ordinary forward pass with transformers' own SDPA attention."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
    finally:
        model.set_attn_implementation("kvcli")
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum").item()


@pytest.mark.parametrize("block", [1, 7, 64, 200])
def test_full_streamed_equals_one_forward(model, block):
    ids = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(block))
    totals = Engine(model, make_method("full"), None, block=block).score([ids.tolist()])
    assert totals.tokens == 149
    assert totals.nll_sum == pytest.approx(plain_nll(model, ids), rel=1e-5)


def test_max_tokens_scores_exactly_that_many(model):
    ids = list(range(90))
    totals = Engine(model, make_method("full"), None, block=16).score([ids[:40], ids[40:]], max_tokens=50)
    assert totals.tokens == 50 and totals.processed == 51


def test_sliding_window_matches_the_reference_loop(model):
    """Windows of L tokens every S tokens, only unscored tokens counted (Hugging Face's perplexity guide)."""
    ids = torch.randint(0, 96, (130,), generator=torch.Generator().manual_seed(3))
    context, stride = 48, 20
    expected, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.shape[0], stride):
        end = min(begin + context, ids.shape[0])
        window = ids[begin:end]
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            logits = model(input_ids=window[None]).logits[0]
        model.set_attn_implementation("kvcli")
        nll = F.cross_entropy(logits[:-1].float(), window[1:], reduction="none")
        first_target = max(prev_end - begin, 1)  # index in the window of the first unscored token
        expected += nll[first_target - 1:].sum().item()
        count += nll[first_target - 1:].numel()
        prev_end = end
        if end == ids.shape[0]:
            break
    engine = Engine(model, make_method("full"), None, block=16)
    totals = engine.score_sliding([ids[:50].tolist(), ids[50:].tolist()], context, stride)
    assert totals.tokens == count == 129
    assert totals.nll_sum == pytest.approx(expected, rel=1e-5)


def test_sliding_windows_after_the_first_start_with_the_lead(model):
    """With a lead (the tokenizer's BOS) every later window is ``lead + context - 1 tokens``, the lead read but
    never scored, and every stream token after the first is still scored exactly once."""
    ids = torch.randint(1, 96, (130,), generator=torch.Generator().manual_seed(4)).tolist()
    stream = [0] + ids  # the document starts with its BOS, id 0
    engine = Engine(model, make_method("full"), None, block=16)
    windows = []
    original = engine.score

    def spy(chunks, **kwargs):
        windows.append((list(chunks[0]), kwargs["score_from"]))
        return original(chunks, **kwargs)

    engine.score = spy
    totals = engine.score_sliding([stream], 48, 20, lead=[0])
    assert totals.tokens == len(stream) - 1
    assert windows[0] == (stream[:48], 0)
    for k, (window, score_from) in enumerate(windows[1:], start=1):
        assert window[0] == 0 and window[1:] == stream[20 * k:20 * k + 47]
        assert score_from == (29 if k == 1 else 28)  # the first token after the last window's, the lead counted
    expected = 0.0
    for window, score_from in windows:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([window])).logits[0]
        nll = F.cross_entropy(logits[:-1].float(), torch.tensor(window[1:]), reduction="none")
        expected += nll[max(score_from, 1) - 1:].sum().item()
    assert totals.nll_sum == pytest.approx(expected, rel=1e-4)


def test_streamingllm_keeps_sinks_and_recent_and_stays_bounded(model):
    engine = Engine(model, make_method("streamingllm", {"sinks": "3"}), 32, block=10)
    cache = engine.new_cache()
    seen = []
    totals = engine.score([list(range(95))], cache=cache, on_block=lambda s, t: seen.append(max(cache.lengths())))
    assert max(seen) == 32 and math.isfinite(totals.nll)
    kept = cache.layers[0].token_idx[0].tolist()
    assert kept == [0, 1, 2] + list(range(95 - 29, 95))
    # layers x tokens x kv heads x (K and V of head_dim in fp32, and the positions)
    assert cache.nbytes() == 2 * 32 * 2 * (2 * 16 * 4 + POSITION_BYTES)


def test_positions_stay_bounded_far_past_the_trained_context(model):
    warnings = []
    engine = Engine(model, make_method("streamingllm"), 24, block=8, warn=warnings.append)
    totals = engine.score([list(range(96))] * 6)  # 576 tokens, model trained on 256 positions
    assert totals.tokens == 575 and math.isfinite(totals.nll) and not warnings
    full = Engine(model, make_method("full"), None, block=64, warn=warnings.append)
    full.score([list(range(96))] * 3)
    assert len(warnings) == 1 and "trained context of 256" in warnings[0]


def test_rotate_keys_agrees_with_transformers_rope():
    """Moving a key from position p by d equals rotating the raw key to p + d with the model's RoPE."""
    model = tiny_llama(num_layers=1)
    rotary = model.model.rotary_emb
    raw = torch.randn(1, 2, 5, 16)
    start = torch.tensor([[3, 9, 17, 30, 41]])
    delta = torch.tensor([[-3, 2, -10, 7, 0], [5, -9, 1, -30, 12]])
    def rope(positions):
        cos, sin = rotary(raw, positions)
        return apply_rotary_pos_emb(raw, raw, cos, sin)[1]

    moved = rotate_keys(rope(start), delta, rotary.inv_freq)
    for head in range(2):
        target = rope((start + delta[head])[0][None])
        assert torch.allclose(moved[:, head], target[:, head], atol=1e-5)


def test_cache_reads_keys_at_their_compacted_positions():
    """After an eviction, the keys attention sees sit at consecutive positions ending before the block."""
    cache = make_cache(kv_heads=2, head_dim=8)
    raw = torch.randn(1, 2, 10, 8)
    cache.block_start = 0
    layer = cache.layers[0]
    layer.update(rotate_keys(raw, torch.arange(10).expand(2, 10), cache.layers[0].inv_freq), torch.randn(1, 2, 10, 8))
    keep = torch.tensor([[0, 3, 4, 8], [1, 2, 7, 9]])
    layer.keep(keep)
    now = layer.current_keys(block_start=4)
    for head in range(2):
        expected = rotate_keys(raw[:, head:head + 1, keep[head]], torch.arange(4)[None], cache.layers[0].inv_freq)
        assert torch.allclose(now[:, head], expected[:, 0], atol=1e-5)


def test_blocks_of_regroups_and_limits():
    blocks = list(blocks_of([[1, 2, 3], [4], [5, 6, 7, 8]], size=3, limit=7))
    assert [b.tolist() for b in blocks] == [[1, 2, 3], [4, 5, 6], [7]]


def test_ctrl_c_keeps_what_was_measured(model):
    engine = Engine(model, make_method("full"), None, block=10)

    def interrupt(stats, totals):
        if totals.processed >= 30:
            raise KeyboardInterrupt

    totals = engine.score([list(range(80))], on_block=interrupt)
    assert totals.interrupted and totals.tokens == 29 and math.isfinite(totals.nll)


def test_cache_support_helpers_append():
    cache = make_cache(num_layers=2)
    append_tokens(cache, 5)
    append_tokens(cache, 3)
    assert cache.lengths() == [8, 8] and cache.layers[1].token_idx[0].tolist() == list(range(8))


def test_long_prefill_uses_the_causal_kernel_with_the_same_output_and_window(monkeypatch):
    """A prefill into an empty cache switches from the explicit attention to SDPA's causal kernel past
    CAUSAL_KERNEL_FROM queries; the output and the recorded window must not change."""
    from kvcli.kv import attention
    from kvcli.kv.cache import KVCache

    torch.manual_seed(0)
    query = torch.randn(1, 4, 40, 8)
    key, value = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    module = torch.nn.Module()
    module.layer_idx = 0

    def run(threshold: int):
        monkeypatch.setattr(attention, "CAUSAL_KERNEL_FROM", threshold)
        cache = KVCache(1, torch.ones(4))
        cache.score_window = 6
        output, _ = attention.kvcli_attention(module, query, key, value, None, kvcli_cache=cache)
        return output, cache.layers[0].record.probs

    explicit_out, explicit_probs = run(10_000)
    causal_out, causal_probs = run(16)
    torch.testing.assert_close(causal_out, explicit_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal_probs, explicit_probs, rtol=1e-5, atol=1e-5)
    assert explicit_probs.shape == (2, 2, 40)


def test_a_finished_cache_is_freed_without_the_garbage_collector(model):
    """The layers hold their cache weakly: dropping the last reference frees a run's tensors at once."""
    import gc
    import weakref

    engine = Engine(model, make_method("treekv"), 32, block=16)
    cache = engine.new_cache()
    engine.score([torch.randint(0, model.config.vocab_size, (80,)).tolist()], cache=cache)
    alive = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["streamingllm", "treekv", "snapkv", "pyramidkv", "h2o", "tova", "pyramidinfer",
                                  "pod"])
def test_runs_in_a_loop_return_to_the_baseline_without_the_garbage_collector(model, name):
    """Every method's runs leave no tensor behind once they return, with the garbage collector off."""
    import gc
    import warnings

    ids = torch.randint(0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    options = {"groups": GroupsFile.separate(model.config), "recent": 8, "sinks": 2} if name == "pod" else {}

    def run() -> None:
        Engine(model, make_method(name, options), 32, block=16).score([ids])

    def live_tensors() -> int:
        with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
            warnings.simplefilter("ignore", FutureWarning)
            return sum(isinstance(obj, torch.Tensor) for obj in gc.get_objects())

    run()  # first-call caches (masks, rotary tables) fill here
    gc.collect()
    gc.disable()
    try:
        baseline = live_tensors()
        for _ in range(3):
            run()
        assert live_tensors() == baseline
    finally:
        gc.enable()
