"""Compressing every layer of a block at once (``Method.compress_layers``, issue #27) is exactly compressing
them one by one: the same kept tokens, the same per-token state and sweep index, bit for bit.

The engine calls ``compress_layers``; the reference tests drive ``compress`` one layer at a time. Layers
that stand alike are batched (their heads as rows), so these tests compare the two on many layers,
with ties, probes, questions, decoding and uneven budgets.
"""

from __future__ import annotations

import pytest
import torch

from kvcli.kv.cache import AttentionRecord, LayerView
from kvcli.methods import make_method
from kvcli.methods.base import Method
from tests.support import append_tokens, make_cache

LAYERS, HEADS, GROUP = 5, 2, 2
SCORED = ["treekv", "snapkv", "pyramidkv", "h2o", "tova", "pyramidinfer", "streamingllm"]


def records(lengths: list[int], window: int, probe: int, seed: int, ties: bool) -> list[AttentionRecord]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        if ties:  # few distinct values: equal scores, which every rule breaks to the left
            probs = torch.randint(0, 3, (HEADS, GROUP, length), generator=gen).float() / 4
        else:
            probs = torch.rand(HEADS, GROUP, length, generator=gen)
        question = probs * 0.5 if probe else None
        out.append(AttentionRecord(probs, window + probe, question, own=window if probe else None))
    return out


def stream(method: Method, budgets: list[int], blocks: list[int], batched: bool, *, probe: int = 0,
           question: int = 0, ties: bool = False) -> list:
    cache = make_cache(num_layers=LAYERS, kv_heads=HEADS)
    history = []
    for step, n in enumerate(blocks):
        append_tokens(cache, n)
        window = min(method.score_window(n) or 1, n)
        recs = records(cache.lengths(), window, probe, seed=step, ties=ties)
        views = []
        for idx, layer in enumerate(cache.layers):
            layer.record = recs[idx]
            views.append(LayerView(idx, LAYERS, layer, n, layer.record, seen=cache.stream_start,
                                   mean_budget=sum(budgets) // LAYERS, question=min(question, n)))
        if batched:
            kept = method.compress_layers(views, budgets)
        else:
            kept = [method.compress(view, budget) for view, budget in zip(views, budgets, strict=True)]
        for view, keep in zip(views, kept, strict=True):
            if keep is not None:
                view.layer.keep(keep)
            view.layer.record = None
        history.append([(layer.token_idx.tolist(), {k: v.tolist() for k, v in layer.state.items()},
                         dict(layer.method_state)) for layer in cache.layers])
    return history


@pytest.mark.parametrize("name", SCORED)
@pytest.mark.parametrize("blocks", [[40, 16, 16, 16, 16], [70] + [1] * 6, [8] * 12])
@pytest.mark.parametrize("ties", [False, True])
def test_layers_at_once_equal_layers_one_by_one(name, blocks, ties):
    method = make_method(name)
    budget = 32
    budgets = method.layer_budgets(budget, LAYERS)  # uneven for pyramidkv and pyramidinfer
    assert stream(method, budgets, blocks, True, ties=ties) == stream(method, budgets, blocks, False, ties=ties)


@pytest.mark.parametrize("name", ["treekv", "snapkv", "h2o", "pyramidinfer"])
def test_with_a_probe_and_a_question_too(name):
    method = make_method(name, {"guard": 4} if name == "treekv" else None)
    budgets = [32] * LAYERS
    blocks = [40, 16, 16, 16]
    assert (stream(method, budgets, blocks, True, probe=3, question=5)
            == stream(method, budgets, blocks, False, probe=3, question=5))


def test_layers_that_differ_are_compressed_apart():
    """Uneven budgets give layers different lengths: each group is batched on its own."""
    method = make_method("treekv")
    budgets = [24, 24, 32, 32, 40]
    blocks = [48, 16, 16, 16]
    assert stream(method, budgets, blocks, True) == stream(method, budgets, blocks, False)


@pytest.mark.parametrize("name", SCORED)
def test_engine_streams_alike_batched_or_not(tiny, name, monkeypatch):
    """Through the engine (real attention records): the batched compression gives the same NLL and cache."""
    from kvcli.engine.engine import Engine

    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(3)).tolist()

    def run():
        engine = Engine(tiny, make_method(name), 48, 16)
        cache = engine.new_cache()
        totals = engine.score([ids], cache=cache)
        return totals.nll_sum, [layer.token_idx.tolist() for layer in cache.layers]

    batched = run()
    monkeypatch.setattr(type(make_method(name)), "compress_layers", Method.compress_layers)
    assert run() == batched


@pytest.mark.parametrize(("name", "options"), [
    ("snapkv", {"pooling": "avg", "kernel": 5}), ("snapkv", {"pooling": "max", "kernel": 7}),
    ("snapkv", {"kernel": 1}), ("pyramidkv", {"pooling": "avg"}), ("pyramidkv", {"share": "layer"}),
    ("snapkv", {"share": "layer", "kernel": 1}), ("h2o", None), ("tova", None),
    ("pyramidinfer", None)])
@pytest.mark.parametrize("ties", [False, True])
def test_layers_of_different_lengths_selected_at_once_as_alone(name, options, ties):
    """Layers that differ in length and count (padded rows, one sort: ``_compress_uneven``) keep what each
    keeps alone, with pooling of either kind across the padding, a probe and a question."""
    method = make_method(name, options)
    budgets = [20, 26, 32, 38, 44]
    for probe, question in ((0, 0), (3, 5)):
        assert (stream(method, budgets, [60, 16, 16, 16], True, probe=probe, question=question, ties=ties)
                == stream(method, budgets, [60, 16, 16, 16], False, probe=probe, question=question, ties=ties))
