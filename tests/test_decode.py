"""The static decode step (kvcli.kv.decode) against the engine's own: the same tokens, the same cache after."""

from __future__ import annotations

import pytest
import torch

from kvcli.engine.engine import Engine
from kvcli.kv.decode import (
    AnswerCache,
    EagerSteps,
    EvictingCache,
    RingCache,
    StaticSteps,
    answer_steps,
    graph_capturable,
    masked_attention,
)
from kvcli.methods import make_method
from kvcli.models.load import tiny_llama

STEPS = 12
LAYOUTS = {"streamingllm": RingCache, "treekv": EvictingCache, "h2o": EvictingCache, "tova": EvictingCache}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=3)


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def read(model, name: str, one_shot: bool, kv_bits: int = 16, budget: int = 40, trained_context: int | None = None,
         block: int = 16, length: int = 90):
    """An engine and the cache of a read as ``kvcli ask`` does it (one shot, or streamed in blocks); a short
    ``trained_context`` makes a per-head method compact each head's positions (no ``heads_apart``)."""
    engine = Engine(model, make_method(name), budget, block=block, kv_bits=kv_bits)
    if trained_context is not None:
        engine.trained_context = trained_context
    cache = engine.new_cache()
    ids = ids_of(length, 7)
    if one_shot:
        cache.keep_positions = engine.method.keeps_positions
        hidden = engine.forward(cache, ids, last_only=True, question=6)
    else:
        for start in range(0, ids.shape[1], block):
            hidden = engine.forward(cache, ids[:, start:start + block], last_only=True)
    return engine, cache, int(engine.logits(hidden[-1:])[0].argmax())


def write(steps, token: int, count: int) -> tuple[list[int], torch.Tensor]:
    tokens, logits = [token], []
    for _ in range(count):
        out = steps(tokens[-1])
        logits.append(out.clone())
        tokens.append(int(out.argmax()))
    steps.finish()
    return tokens, torch.stack(logits)


def current(cache) -> list[tuple]:
    """What every layer holds, as attention would see it at the next position."""
    start = cache.next_position()
    return [(layer.current_keys(start), layer.values, layer.current_positions(start), layer.token_idx)
            for layer in cache.layers]


def assert_same_cache(expected: list[tuple], got: list[tuple]) -> None:
    """Two :func:`current` views hold the same tokens at the same positions, keys and values alike."""
    for (k0, v0, p0, t0), (k1, v1, p1, t1) in zip(expected, got, strict=True):
        assert torch.equal(t0, t1) and torch.equal(p0, p1)
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "one_shot", "budget", "count"), [
    ("snapkv", False, 40, STEPS), ("snapkv", True, 40, STEPS), ("pyramidkv", False, 40, STEPS),
    ("pyramidkv", True, 40, STEPS), ("full", False, 40, STEPS),
    ("streamingllm", False, 40, STEPS), ("streamingllm", True, 40, STEPS),
    ("streamingllm", False, 12, 20),  # a ring of 9 slots (4 sinks): the window wraps twice
    ("treekv", False, 40, STEPS), ("treekv", True, 40, STEPS),
    ("treekv", False, 12, 20),  # 4 sinks, 4 recent, 4 in the tree region: the sweep wraps five times
    ("h2o", False, 40, STEPS), ("h2o", False, 12, 20), ("tova", False, 40, STEPS), ("tova", False, 12, 20),
    ("h2o", True, 40, STEPS), ("tova", True, 12, 20),  # a one-shot read keeps positions: the query moves on
])
def test_static_steps_write_what_the_engine_writes(model, name, one_shot, budget, count):
    engine, cache, token = read(model, name, one_shot, budget=budget)
    eager_tokens, eager_logits = write(EagerSteps(engine, cache), token, count)
    eager_cache = current(cache)
    engine, cache, token = read(model, name, one_shot, budget=budget)
    steps = answer_steps(engine, cache, count)
    assert isinstance(steps, StaticSteps) and steps.layout is LAYOUTS.get(name, AnswerCache)
    static_tokens, static_logits = write(steps, token, count)
    assert static_tokens == eager_tokens
    torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
    # The cache after the answer: the same tokens at the same positions, keys as attention reads them.
    assert cache.lengths() == [len(layer[3][0]) for layer in eager_cache]
    assert_same_cache(eager_cache, current(cache))
    assert steps.max_tokens == max(cache.lengths())


def assert_static_writes_as_eager(reading) -> None:
    """Two reads by ``reading()`` (engine, cache, first token): the engine's steps after one and the static steps
    :func:`answer_steps` picks after the other write the same tokens and logits and leave the same cache."""
    results = []
    for static in (False, True):
        engine, cache, token = reading()
        steps = answer_steps(engine, cache, STEPS, static=static)
        assert isinstance(steps, StaticSteps if static else EagerSteps)
        results.append((*write(steps, token, STEPS), current(cache)))
    assert results[1][0] == results[0][0]
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-4)
    assert_same_cache(results[0][2], results[1][2])


def test_evicting_steps_with_each_heads_positions_compacted(model):
    """When a layer's heads do not share one order of positions, each head's tokens sit at consecutive positions."""
    def reading():
        engine, cache, token = read(model, "treekv", one_shot=False, trained_context=100)
        assert not cache.heads_apart
        return engine, cache, token

    assert_static_writes_as_eager(reading)


def test_evicting_steps_after_a_read_that_just_filled_the_cache(model):
    """A read of exactly the budget evicted nothing, so no key has moved yet; the first step's eviction moves
    some, and the cache after says so (its keys are rotated where they sit now)."""
    def reading():
        engine, cache, token = read(model, "treekv", one_shot=False, length=48, budget=48)
        assert cache.lengths() == [48] * 3 and not any(layer.moved for layer in cache.layers)
        return engine, cache, token

    assert_static_writes_as_eager(reading)


@pytest.mark.parametrize("name", ["snapkv", "treekv", "h2o"])
def test_static_steps_continue_where_the_reading_can_go_on(model, name):
    """After the static steps hand the cache back, another read or answer runs on it as after eager steps
    (TreeKV's sweep index and scores included)."""
    outs = []
    for static in (False, True):
        engine, cache, token = read(model, name, one_shot=False)
        write(answer_steps(engine, cache, 5, static=static), token, 5)
        hidden = engine.forward(cache, ids_of(16, 9), last_only=True)
        outs.append((engine.logits(hidden[-1:])[0], current(cache), cache.lengths(), cache.stream_start))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    assert_same_cache(outs[0][1], outs[1][1])  # what the read kept
    assert outs[1][2:] == outs[0][2:]


def test_an_interrupted_answer_leaves_the_cache_whole(model):
    engine, cache, token = read(model, "pyramidkv", one_shot=False)
    lengths = cache.lengths()
    steps = answer_steps(engine, cache, 8)
    steps(token)
    steps(token)
    steps.finish()  # what Reader.write does in its finally, Ctrl-C included
    assert cache.lengths() == [length + 2 for length in lengths]
    for layer in cache.layers:  # the 6 slots left over are freed, not held behind a view
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
    with pytest.raises(RuntimeError):
        fresh = answer_steps(engine, cache, 1)
        fresh(token)
        fresh(token)  # no room left for a second token
    fresh.finish()


@pytest.mark.parametrize(("name", "kv_bits"), [("pyramidinfer", 16), ("treekv", 8), ("h2o", 8), ("snapkv", 8),
                                             ("streamingllm", 8)])
def test_the_engines_steps_where_the_static_ones_cannot_stand_in(model, name, kv_bits):
    """A method that evicts by its scores while writing, or a quantized cache, keeps the engine's own steps."""
    engine, cache, _ = read(model, name, one_shot=False, kv_bits=kv_bits)
    assert isinstance(answer_steps(engine, cache, STEPS), EagerSteps)


def test_the_engines_steps_when_the_answer_would_pass_the_trained_context(model):
    engine, cache, _ = read(model, "full", one_shot=False)
    room = engine.trained_context - cache.next_position() + 1
    assert isinstance(answer_steps(engine, cache, room), EagerSteps)
    assert isinstance(answer_steps(engine, cache, room - 1), StaticSteps)


def test_masked_attention_ignores_the_hidden_slots():
    """Keys past the filled slots (garbage included) change nothing: the same output as attention to the filled ones."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 1, 8, generator=generator)
    key = torch.randn(1, 2, 10, 8, generator=generator)
    value = torch.randn(1, 2, 10, 8, generator=generator)
    visible = torch.arange(10) < 6
    out = masked_attention(query, key, value, 0.35, visible)
    padded_key, padded_value = key.clone(), value.clone()
    padded_key[:, :, 6:] = 1e4
    padded_value[:, :, 6:] = 1e4
    torch.testing.assert_close(masked_attention(query, padded_key, padded_value, 0.35, visible), out)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key[:, :, :6], value[:, :, :6], scale=0.35, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "full", "streamingllm", "treekv", "h2o", "tova"])
def test_the_captured_step_writes_what_the_uncaptured_one_writes(name):
    model = tiny_llama(num_layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=3).cuda()
    results = []
    for graph in (False, True):
        engine, cache, token = read(model, name, one_shot=False)
        steps = StaticSteps(engine, cache, STEPS, graph=graph, layout=LAYOUTS.get(name, AnswerCache))
        results.append(write(steps, token, STEPS))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[1][1], results[0][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("family", "name", "one_shot"), [("gemma3", "treekv", False), ("gemma3", "snapkv", False),
                                                          ("gemma3", "streamingllm", False), ("llama3", "h2o", True)])
def test_the_captured_step_with_window_rings_and_kept_positions(family, name, one_shot):
    """Window layers' rings (their clock turned to in the stacked layout) and a one-shot read's moving query,
    captured as a CUDA graph, against the same steps launched one kernel at a time."""
    from tests.test_families import build

    model = build(family).cuda()
    results = []
    for graph in (False, True):
        engine, cache, token = read(model, name, one_shot=one_shot)
        chosen = answer_steps(engine, cache, STEPS)
        assert isinstance(chosen, StaticSteps)
        chosen.finish()  # nothing written: the cache is whole again
        steps = StaticSteps(engine, cache, STEPS, graph=graph, layout=LAYOUTS.get(name, AnswerCache))
        results.append(write(steps, token, STEPS))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[1][1], results[0][1])


def test_a_ring_only_when_every_layer_is_full(model):
    """StreamingLLM's ring needs each step to evict exactly one token: a read shorter than the budget writes
    with the engine's steps."""
    engine = Engine(model, make_method("streamingllm"), 120, block=16)
    cache = engine.new_cache()
    engine.forward(cache, ids_of(90, 7), last_only=True)
    assert isinstance(answer_steps(engine, cache, STEPS), EagerSteps)


@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "treekv"])
def test_a_rehearsal_leaves_nothing_behind(model, name):
    """The warm-up before a CUDA graph's capture runs real steps: undone, they change no later step (a ring's
    rehearsal overwrites slots the first real step still reads)."""
    engine, cache, token = read(model, name, one_shot=False)
    eager = write(EagerSteps(engine, cache), token, 4)
    engine, cache, token = read(model, name, one_shot=False)
    steps = StaticSteps(engine, cache, 4, graph=False, layout=LAYOUTS.get(name, AnswerCache))
    with torch.inference_mode():
        steps.ids.fill_(5)
        steps.rehearse(2)
    tokens, logits = write(steps, token, 4)
    assert tokens == eager[0]
    torch.testing.assert_close(logits, eager[1], rtol=1e-4, atol=1e-4)


def test_a_capture_that_fails_launches_the_same_step(model, monkeypatch):
    """Quantized weights or dispatch hooks may hold kernels a CUDA graph cannot capture: the step then runs
    launched one kernel at a time, with the same answer."""
    engine, cache, token = read(model, "snapkv", one_shot=False)
    eager = write(EagerSteps(engine, cache), token, 4)
    engine, cache, token = read(model, "snapkv", one_shot=False)
    steps = StaticSteps(engine, cache, 4, graph=True)

    def fail():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(steps, "capture", fail)
    tokens, logits = write(steps, token, 4)
    assert tokens == eager[0] and not steps.use_graph
    torch.testing.assert_close(logits, eager[1], rtol=1e-4, atol=1e-4)


def test_graphs_only_for_plain_weights_on_one_gpu(model):
    assert not graph_capturable(model)  # a CPU


def test_a_scored_step_evicts_what_select_top_leaves_out():
    """H2O's and TOVA's step: the lowest score outside the sinks and the recent window goes, the latest of equal
    ones, as the engine's select_top (a stable sort keeping the earlier) leaves it; per layer for TOVA."""
    from kvcli.methods.base import LowestStep, select_top

    generator = torch.Generator().manual_seed(1)
    probs = torch.rand(2, 3, 2, 12, generator=generator).round(decimals=1)  # [L, H_kv, group, T]: many ties
    probs[..., 0] = 0.0  # a sink scoring lowest is kept all the same
    for name in ("h2o", "tova"):
        method = make_method(name, {"sinks": 2, "recent": 3})
        state = {key: torch.zeros(6, 12) for key in method.state_names}
        step = LowestStep(method, 2, 3)
        gone = step.victim(probs, {key: value.clone() for key, value in state.items()})
        scores = method.step_scores(probs, state)
        protected = (torch.arange(12) < 2) | (torch.arange(12) >= 9)
        kept = select_top(scores, protected, 11)
        left_out = [sorted(set(range(12)) - set(row.tolist())) for row in kept]
        expected = torch.tensor(left_out).repeat_interleave(6 // scores.shape[0], dim=0)
        assert torch.equal(gone, expected)


@pytest.mark.parametrize("family", ["gemma3", "qwen2", "mistral"])
@pytest.mark.parametrize(("name", "one_shot"), [("snapkv", False), ("snapkv", True), ("streamingllm", False),
                                                ("treekv", False), ("treekv", True), ("h2o", False), ("h2o", True),
                                                ("full", False)])
def test_window_layers_write_in_a_ring_of_their_window(family, name, one_shot):
    """Gemma 3 (two window layers of three, their own RoPE base), Qwen 2 (window layers above the first) and
    Mistral (every layer windowed): each window layer writes in a ring of its window beside the method's layout,
    with the tokens, logits and cache the engine's steps give."""
    from tests.test_families import WINDOW, build

    model = build(family)

    def reading():
        engine, cache, token = read(model, name, one_shot, block=8, length=96)
        assert WINDOW - 1 in cache.lengths()
        return engine, cache, token

    assert_static_writes_as_eager(reading)


@pytest.mark.parametrize("name", ["snapkv", "treekv", "streamingllm"])
def test_a_step_that_fails_to_compile_writes_what_the_plain_step_writes(model, name, monkeypatch):
    """``compiled``: a program that raises (as dynamo does on what it cannot trace) is dropped for the plain step
    with one warning, and the answer and the cache after it are the plain step's."""
    engine, cache, token = read(model, name, one_shot=False)
    expected_tokens, expected_logits = write(answer_steps(engine, cache, STEPS), token, STEPS)
    expected_cache = current(cache)
    engine, cache, token = read(model, name, one_shot=False)
    calls = []

    def failing_compile(step, **options):
        def compiled():
            calls.append(options)
            raise RuntimeError("cannot trace this")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    steps = answer_steps(engine, cache, STEPS, compiled=True)
    assert isinstance(steps, StaticSteps) and steps.program != steps.step
    with pytest.warns(UserWarning, match="could not compile the decode step") as warned:
        tokens, logits = write(steps, token, STEPS)
    assert len(warned) == 1 and calls == [{"dynamic": False}]
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert_same_cache(expected_cache, current(cache))


def test_a_compiled_step_runs_the_compiled_program(model, monkeypatch):
    """Every step of a ``compiled`` static step goes through what ``torch.compile`` returned (the capture on a
    GPU records that program), and writes what the plain step writes."""
    engine, cache, token = read(model, "snapkv", one_shot=False)
    expected_tokens, _ = write(answer_steps(engine, cache, STEPS), token, STEPS)
    engine, cache, token = read(model, "snapkv", one_shot=False)
    runs = []

    def counting_compile(step, **options):
        def compiled():
            runs.append(1)
            return step()
        return compiled

    monkeypatch.setattr(torch, "compile", counting_compile)
    tokens, _ = write(answer_steps(engine, cache, STEPS, compiled=True), token, STEPS)
    assert tokens == expected_tokens and len(runs) == STEPS


@pytest.mark.slow
def test_a_step_compiled_by_inductor_writes_what_the_plain_step_writes(model):
    """The real ``torch.compile`` (inductor's C++ on a CPU; minutes): the same tokens as the plain step."""
    engine, cache, token = read(model, "snapkv", one_shot=False)
    expected_tokens, expected_logits = write(answer_steps(engine, cache, STEPS), token, STEPS)
    engine, cache, token = read(model, "snapkv", one_shot=False)
    tokens, logits = write(answer_steps(engine, cache, STEPS, compiled=True), token, STEPS)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
