"""The baselines (SnapKV, PyramidKV, H2O, TOVA, PyramidInfer) against slow literal re-implementations.

Each reference below is written from the paper's definition with python lists and loops over heads,
queries and tokens, and sees the attention of every window query separately; the method sees only
what the engine gives it (the window's attention summed over queries). Both are driven step by
step over one-shot prefills, blocks and single-token decoding steps, and must keep exactly the
same stream positions. Ties go to the earlier token in both (scores are continuous random numbers,
so the only exact ties are the plateaus of max pooling).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from support import append_tokens, kept_positions, make_cache, max_pooled, retained_fraction

from kvcli.errors import UsageError
from kvcli.kv.cache import AttentionRecord, LayerView
from kvcli.methods import make_method
from kvcli.methods.base import select_top

STEPS = [24, 8, 8, 1, 1, 1, 8, 1, 1, 12, 1]  # one-shot prefill, blocks, decoding steps


def paper_recent(budget: int, sinks: int) -> int:
    """TreeKV's experiments: of 1,024 tokens, 4 sinks, 508 recent, 512 (half the cache) selected."""
    selected = budget // 2
    return max(budget - sinks - selected, 0)


def window_probs(gen: torch.Generator, heads: int, group: int, length: int, num_new: int, window: int):
    """Attention ``[H, G, w, T]`` of the last ``w`` queries of a block of ``num_new`` tokens (causal)."""
    w = min(window, num_new)
    logits = torch.randn(heads, group, w, length, generator=gen) * 2.0
    for q in range(w):
        visible = length - w + q + 1  # the query's own token is key length - w + q
        logits[:, :, q, visible:] = float("-inf")
    return torch.softmax(logits, dim=-1)


def drive(method, reference, budgets: list[int], window_of, steps=STEPS, kv_heads=2, group=2, seed=0):
    """Run ``method`` and ``reference`` side by side; compare kept positions after every compression."""
    layers = len(budgets)
    cache = make_cache(layers, kv_heads)
    gen = torch.Generator().manual_seed(seed)
    compressed = 0
    for n in steps:
        append_tokens(cache, n)
        reference.add(n)
        for idx, layer in enumerate(cache.layers):
            probs = window_probs(gen, kv_heads, group, layer.get_seq_length(), n, window_of(n))
            layer.record = AttentionRecord(probs.sum(dim=2), probs.shape[2])
            view = LayerView(idx, layers, layer, n, layer.record, seen=cache.stream_start,
                             mean_budget=sum(budgets) // layers)
            keep = method.compress(view, budgets[idx])
            if keep is not None:
                assert keep.shape[0] == kv_heads and keep.shape[1] <= budgets[idx]
                layer.keep(keep)
                compressed += 1
            layer.record = None
            expected = reference.choose(idx, probs.tolist(), n, budgets[idx])
            assert kept_positions(cache, idx) == expected, f"layer {idx} after {reference.seen} tokens"
    assert compressed > 0
    return cache


# --- literal references ------------------------------------------------------------------------------


class Reference:
    """Stream positions held per layer and KV head, and the per-token scores a method accumulates."""

    def __init__(self, layers: int, heads: int):
        self.heads = heads
        self.pos = [[[] for _ in range(heads)] for _ in range(layers)]
        self.score = [[{} for _ in range(heads)] for _ in range(layers)]
        self.seen = 0

    def add(self, n: int) -> None:
        for layer in self.pos:
            for positions in layer:
                positions.extend(range(self.seen, self.seen + n))
        self.seen += n

    @staticmethod
    def protected(length: int, sinks: int, recent: int) -> list[int]:
        return [i for i in range(length) if i < sinks or i >= length - recent]

    @staticmethod
    def pick(scores: list[float], protected: list[int], count: int) -> list[int]:
        """Protected slots plus the best others (ties: earlier slot), ``count`` in all, in slot order."""
        others = sorted((i for i in range(len(scores)) if i not in protected), key=lambda i: (-scores[i], i))
        return sorted(protected + others[: count - len(protected)])

    def keep(self, layer: int, head: int, slots: list[int]) -> list[int]:
        self.pos[layer][head] = [self.pos[layer][head][i] for i in slots]
        return self.pos[layer][head]


def summed_over_window(attn, head: int, length: int) -> list[float]:
    """Per slot, attention summed over the window queries, averaged over the GQA group."""
    group = attn[head]
    out = []
    for slot in range(length):
        total = 0.0
        for per_query in group:
            for row in per_query:
                total += row[slot]
        out.append(total / len(group))
    return out


class H2ORef(Reference):
    def __init__(self, layers, heads, sinks, recent):
        super().__init__(layers, heads)
        self.sinks, self.recent = sinks, recent

    def choose(self, layer, attn, n, budget):
        out = []
        for h in range(self.heads):
            positions, score = self.pos[layer][h], self.score[layer][h]
            length = len(positions)
            received = summed_over_window(attn, h, length)  # every query of the block is in the window
            for slot, pos in enumerate(positions):
                score[pos] = score.get(pos, 0.0) + received[slot]
            if length <= budget:
                out.append(list(positions))
                continue
            recent = paper_recent(budget, self.sinks) if self.recent is None else self.recent
            protected = self.protected(length, self.sinks, recent)
            slots = self.pick([score[p] for p in positions], protected, budget)
            out.append(list(self.keep(layer, h, slots)))
        return out


class TOVARef(Reference):
    def __init__(self, layers, heads, sinks, recent):
        super().__init__(layers, heads)
        self.sinks, self.recent = sinks, recent

    def choose(self, layer, attn, n, budget):
        length = len(self.pos[layer][0])
        if length <= budget:
            return [list(p) for p in self.pos[layer]]
        rows = [attn[h][g][-1] for h in range(self.heads) for g in range(len(attn[h]))]  # the last query
        scores = [sum(row[slot] for row in rows) / len(rows) for slot in range(length)]
        recent = paper_recent(budget, self.sinks) if self.recent is None else self.recent
        slots = self.pick(scores, self.protected(length, self.sinks, recent), budget)
        return [list(self.keep(layer, h, slots)) for h in range(self.heads)]


class SnapKVRef(Reference):
    """Per KV head; ``share="layer"``: every head of a layer keeps the tokens of the highest score any head
    gives each one (its heads then hold the same positions)."""

    def __init__(self, layers, heads, window, kernel, pooling, sinks, recent, share="head"):
        super().__init__(layers, heads)
        self.window, self.kernel, self.pooling, self.sinks, self.share = window, kernel, pooling, sinks, share
        self.recent = window if recent is None else recent

    def head_scores(self, layer, attn, n, h):
        length = len(self.pos[layer][h])
        raw = summed_over_window(attn, h, length)
        prefix = length - min(self.window, n)  # keys outside the observation window
        half = self.kernel // 2
        scores = []
        for i in range(length):
            if i >= prefix:
                scores.append(raw[i])
                continue
            neighbours = [raw[j] for j in range(i - half, i + half + 1) if 0 <= j < prefix]
            scores.append(max(neighbours) if self.pooling == "max" else sum(neighbours) / self.kernel)
        return scores

    def choose(self, layer, attn, n, budget):
        length = len(self.pos[layer][0])
        if length <= budget:
            return [list(self.pos[layer][h]) for h in range(self.heads)]
        per_head = [self.head_scores(layer, attn, n, h) for h in range(self.heads)]
        protected = self.protected(length, self.sinks, self.recent)
        if self.share == "layer":
            shared = [max(scores[i] for scores in per_head) for i in range(length)]
            slots = self.pick(shared, protected, budget)
            return [list(self.keep(layer, h, slots)) for h in range(self.heads)]
        return [list(self.keep(layer, h, self.pick(per_head[h], protected, budget))) for h in range(self.heads)]


class PyramidInferRef(Reference):
    """Per KV head by default; ``mean`` scores every head with the attention averaged over all query heads
    (one choice per layer), and ``recent_ratio`` shrinks the window to that fraction of the stream read."""

    def __init__(self, layers, heads, window, gamma, p, decay, min_len, sinks, recent, mean=False, recent_ratio=1.0,
                 kernel=1, schedule="geometric"):
        super().__init__(layers, heads)
        self.layers, self.kernel, self.schedule = layers, kernel, schedule
        self.window, self.gamma, self.p, self.decay, self.min_len = window, gamma, p, decay, min_len
        self.sinks, self.recent_cap, self.mean, self.recent_ratio = sinks, recent, mean, recent_ratio
        self.retained = [[] for _ in range(layers)]  # selected count per compression, for the retention test

    def choose(self, layer, attn, n, budget):
        w = min(self.window, n)
        weight = sum(self.gamma**age for age in range(w)) / w  # mean weight of this block's window queries
        self.recent = min(self.recent_cap, math.ceil(self.recent_ratio * self.seen))
        context = max(self.seen - self.sinks - self.recent, 0)  # candidates read so far
        fraction = retained_fraction(self.p, self.decay, layer, self.layers, self.schedule)
        target = max(self.min_len, math.ceil(fraction * context))
        selected = min(budget - self.sinks - self.recent, target)
        out = []
        for h in range(self.heads):
            positions, score = self.pos[layer][h], self.score[layer][h]
            length = len(positions)
            received = summed_over_window(attn, h, length)
            if self.mean:
                per_head = [summed_over_window(attn, g, length) for g in range(self.heads)]
                received = [sum(values[slot] for values in per_head) / self.heads for slot in range(length)]
            for slot, pos in enumerate(positions):
                score[pos] = score.get(pos, 0.0) * self.gamma**n + weight * received[slot]
            protected = self.protected(length, self.sinks, self.recent)
            if selected >= length - len(protected):
                out.append(list(positions))
                continue
            pooled = max_pooled([score[q] for q in positions], self.kernel)
            slots = self.pick(pooled, protected, len(protected) + selected)
            out.append(list(self.keep(layer, h, slots)))
        self.retained[layer].append(len(out[0]))
        return out


# --- kept sets, step by step ---------------------------------------------------------------------------


@pytest.mark.parametrize("sinks,recent", [(4, None), (2, 3), (0, 0)])
def test_h2o_keeps_the_heavy_hitters(sinks, recent):
    method = make_method("h2o", {"sinks": sinks, "recent": recent})
    assert method.score_window(8) == 8
    drive(method, H2ORef(1, 2, sinks, recent), [20], window_of=lambda n: n)


@pytest.mark.parametrize("sinks,recent", [(4, None), (0, 0), (1, 5)])
def test_tova_keeps_what_the_last_query_attends_to(sinks, recent):
    method = make_method("tova", {"sinks": sinks, "recent": recent})
    assert method.score_window(8) == 1
    cache = drive(method, TOVARef(1, 2, sinks, recent), [20], window_of=lambda n: 1)
    heads = kept_positions(cache)
    assert all(h == heads[0] for h in heads)  # one choice per layer


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_snapkv_decoding_keeps_the_prompt_selection_and_slides_the_window(name):
    """While writing, the prompt's selection stays and the token leaving the recent window goes."""
    method = make_method(name, {"window": 4, "sinks": 1})
    cache = make_cache(num_layers=1, kv_heads=2)
    append_tokens(cache, 20)
    cache.layers[0].keep(torch.tensor([[0, 3, 5, 9, 12, 16, 17, 18, 19], [0, 2, 7, 8, 13, 16, 17, 18, 19]]))
    append_tokens(cache, 1)  # stream position 20, cache length 10 > budget 9
    layer = cache.layers[0]
    probs = torch.rand(2, 1, 10)  # one decoding query, whatever it looks at
    keep = method.compress(LayerView(0, 1, layer, 1, AttentionRecord(probs, 1), decoding=True), 9)
    layer.keep(keep)
    # the window is the last 4 tokens (17, 18, 19, 20); 16 has just left it
    assert kept_positions(cache) == [[0, 3, 5, 9, 12, 17, 18, 19, 20], [0, 2, 7, 8, 13, 17, 18, 19, 20]]
    append_tokens(cache, 1)
    scored = method.compress(LayerView(0, 1, cache.layers[0], 1, AttentionRecord(torch.rand(2, 1, 10), 1)), 9)
    assert scored.shape == (2, 9)  # outside decoding the one query's attention re-selects as in the paper


@pytest.mark.parametrize("kernel,pooling,sinks,recent", [
    (7, "max", 0, None), (3, "avg", 0, None), (5, "max", 2, 3), (1, "max", 1, 6), (5, "avg", 2, 8)])
def test_snapkv_keeps_the_pooled_window_votes(kernel, pooling, sinks, recent):
    window = 4
    options = {"window": window, "kernel": kernel, "pooling": pooling, "sinks": sinks, "recent": recent}
    method = make_method("snapkv", options)
    assert method.score_window(8) == 4 and method.score_window(1) == 1
    drive(method, SnapKVRef(1, 2, window, kernel, pooling, sinks, recent), [20], window_of=lambda n: window)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_a_layer_shared_selection_keeps_one_token_set_per_layer(name):
    """``share=layer`` (beyond the papers): a layer's KV heads keep the same tokens, those of the highest
    score any of its heads gives them, and so hold the same positions."""
    options = {"window": 4, "kernel": 5, "share": "layer", **({"beta": 5} if name == "pyramidkv" else {})}
    method = make_method(name, options)  # beta 5: a pyramid on 2 layers of 20 tokens (beta 20 needs 24)
    assert not method.selects_per_head() and make_method(name, {}).selects_per_head()
    budgets = method.layer_budgets(20, 2) if name == "pyramidkv" else [20]
    reference = SnapKVRef(len(budgets), 2, window=4, kernel=5, pooling="max", sinks=0, recent=None, share="layer")
    cache = drive(method, reference, budgets, window_of=lambda n: 4)
    assert all(positions[0] == positions[1] for positions in (kept_positions(cache, i) for i in range(len(budgets))))


def test_pyramidkv_default_kernel_is_snapkv_default():
    assert make_method("pyramidkv", {}).kernel == make_method("snapkv", {}).kernel == 15


def test_pyramidkv_defaults_are_the_papers():
    """The paper's settings (beta 20, alpha 8) are pyramidkv's defaults; beta 5 is the pyramidkv-beta5 preset."""
    method = make_method("pyramidkv", {})
    assert (method.beta, method.window, method.recent_tokens(), method.sinks) == (20.0, 8, 8, 0)
    assert method.layer_budgets(100, 4) == make_method("pyramidkv", {"beta": 20}).layer_budgets(100, 4)


def test_pyramidkv_selects_like_snapkv_under_layer_budgets():
    method = make_method("pyramidkv", {"beta": 4, "kernel": 7})
    budgets = method.layer_budgets(24, 3)
    assert budgets[0] > budgets[1] > budgets[2] > 8 and sum(budgets) == 72
    reference = SnapKVRef(3, 2, window=8, kernel=7, pooling="max", sinks=0, recent=None)
    drive(method, reference, budgets, window_of=lambda n: 8)


@pytest.mark.parametrize("options,cache", [
    ({"min_len": 2, "decay": 0.7, "p": 0.8}, 20),
    ({"min_len": 3, "decay": 0.5, "recent": 4, "gamma": 0.8}, 16),
    ({"min_len": 0, "decay": 0.9, "sinks": 0, "gamma": 1.0, "window": 3}, 24)])
def test_pyramidinfer_keeps_a_decaying_fraction(options, cache):
    # Per KV head with the budget split's window from the first token: the rule kvcli used before the paper's
    # head-averaged selection and recent ratio became the defaults (tests/test_pyramidinfer.py tests those).
    method = make_method("pyramidinfer", {**options, "heads": "kv", "recent_ratio": 1.0})
    budgets = method.layer_budgets(cache, 3)
    assert sum(budgets) == 3 * cache and budgets == sorted(budgets, reverse=True)
    m = method
    recent = paper_recent(cache, m.sinks) if m.recent is None else m.recent
    reference = PyramidInferRef(3, 2, m.window, m.gamma, m.p, m.decay, m.min_len, m.sinks, recent, kernel=m.kernel,
                                schedule=m.schedule)
    drive(method, reference, budgets, window_of=lambda n: m.window)
    # Retention decays with depth: at the end every layer holds at most its budget and the
    # deeper layers (smaller fraction) hold no more than the ones below.
    final = [r[-1] for r in reference.retained]
    assert all(f <= b for f, b in zip(final, budgets, strict=True))
    assert final == sorted(final, reverse=True)


@pytest.mark.parametrize("options,cache", [({}, 20), ({"min_len": 2, "decay": 0.7, "recent_ratio": 0.1}, 24),
                                           ({"recent": 4, "recent_ratio": 0.3, "gamma": 0.8}, 16)])
def test_pyramidinfer_default_keeps_one_head_averaged_set_per_layer(options, cache):
    """The paper's defaults in a stream (``ppl``'s path): one set per layer from the attention averaged over
    every query head, and a recent window of ``recent_ratio`` of the stream read so far."""
    method = make_method("pyramidinfer", options)
    budgets = method.layer_budgets(cache, 3)
    m = method
    cap = paper_recent(cache, m.sinks) if m.recent is None else m.recent
    reference = PyramidInferRef(3, 2, m.window, m.gamma, m.p, m.decay, m.min_len, m.sinks, cap, mean=True,
                                recent_ratio=m.recent_ratio, kernel=m.kernel, schedule=m.schedule)
    cache_ = drive(method, reference, budgets, window_of=lambda n: m.window)
    for layer in range(3):
        heads = kept_positions(cache_, layer)
        assert all(h == heads[0] for h in heads)


def test_pyramidinfer_retention_binds_below_the_budget():
    # A large budget: the cache holds ceil(p * decay**l * context) selected tokens, not the budget.
    method = make_method("pyramidinfer", {"min_len": 1, "decay": 0.5, "p": 1.0, "sinks": 0, "recent": 2, "heads": "kv",
                                          "recent_ratio": 1.0, "kernel": 1, "schedule": "geometric"})
    reference = PyramidInferRef(2, 2, 32, 0.97, 1.0, 0.5, 1, 0, 2)
    cache = drive(method, reference, [200, 200], window_of=lambda n: 32, steps=[16, 8, 1, 1])
    seen = 26
    assert cache.lengths() == [seen, 2 + math.ceil(0.5 * (seen - 2))]


# --- budgets ---------------------------------------------------------------------------------------------


def pyramid_reals(cache: int, layers: int, beta: float, kept: int) -> list[float]:
    """PyramidKV eq. (1): k^{m-1} = k_total / (beta m), k^0 = 2 k_total / m - k^{m-1}, arithmetic between."""
    total = (cache - kept) * layers
    top = total / (beta * layers)
    bottom = 2 * total / layers - top
    return [kept + bottom - (bottom - top) / (layers - 1) * layer for layer in range(layers)]


@pytest.mark.parametrize("beta,layers,cache", [(20, 32, 1024), (20, 4, 100), (2, 30, 128), (7.5, 24, 513),
                                               (1, 5, 64), (20, 2, 29), (3, 80, 200)])
def test_pyramidkv_budget_sequence(beta, layers, cache):
    method = make_method("pyramidkv", {"beta": beta})
    budgets = method.layer_budgets(cache, layers)
    reals = pyramid_reals(cache, layers, beta, kept=8)
    assert sum(budgets) == cache * layers  # mean == cache exactly
    assert all(abs(b - r) < 1 for b, r in zip(budgets, reals, strict=True))
    assert all(a >= b for a, b in zip(budgets, budgets[1:], strict=False))  # bottom to top, never increasing
    assert min(budgets) > method.window
    if beta > 1:
        assert budgets[0] > budgets[-1]


def test_pyramidkv_budgets_by_hand():
    # cache 100, 4 layers, beta 20, alpha 8: S = 92, k^3 = 4.6, k^0 = 179.4, step 58.2667:
    # 179.4, 121.13, 62.87, 4.6 -> floors 179 121 62 4 (366 of 368) -> +1 to 62.87 and 4.6.
    assert make_method("pyramidkv", {"beta": 20}).layer_budgets(100, 4) == [187, 129, 71, 13]
    assert make_method("pyramidkv").layer_budgets(100, 1) == [100]


@pytest.mark.parametrize("schedule", ["geometric", "cosine"])
@pytest.mark.parametrize("decay,layers,cache", [(0.95, 32, 1024), (0.5, 6, 100), (1.0, 4, 64),
                                                (0.9, 80, 2048)])
def test_pyramidinfer_budget_sequence(decay, layers, cache, schedule):
    """Budgets proportional to the retained fractions, averaging the cache exactly, deeper never larger."""
    method = make_method("pyramidinfer", {"decay": decay, "schedule": schedule})
    budgets = method.layer_budgets(cache, layers)
    kept = 4 + paper_recent(cache, 4)
    selected = cache - kept
    weights = [Fraction(retained_fraction(1.0, decay, i, layers, schedule)) for i in range(layers)]
    if schedule == "geometric":
        weights = [Fraction(decay) ** i for i in range(layers)]
    reals = [kept + selected * layers * w / sum(weights) for w in weights]
    assert sum(budgets) == cache * layers
    assert all(abs(b - r) < 1 for b, r in zip(budgets, reals, strict=True))
    assert budgets == sorted(budgets, reverse=True)


# --- the real engine on a tiny Llama ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "h2o", "tova", "pyramidinfer"])
@pytest.mark.parametrize("block", [1, 16])
def test_engine_stays_within_every_layer_budget(tiny, name, block):
    from kvcli.engine.engine import Engine

    engine = Engine(tiny, make_method(name), 48, block)
    cache = engine.new_cache()
    lengths = []
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    totals = engine.score([ids], cache=cache, on_block=lambda stats, totals: lengths.append(cache.lengths()))
    assert len(lengths) == math.ceil(90 / block)
    assert sum(engine.budgets) <= 48 * 4
    for seen in lengths:
        assert all(length <= budget for length, budget in zip(seen, engine.budgets, strict=True))
    assert max(lengths[-1]) > 0 and math.isfinite(totals.nll)


@pytest.mark.parametrize("name", ["streamingllm", "treekv", "snapkv", "pyramidkv", "h2o", "tova", "pyramidinfer"])
def test_a_reused_method_instance_keeps_no_state_of_its_own(tiny, name):
    """Per-stream state lives in the cache, never on the method: an instance that has already run a
    stream at another budget keeps exactly the tokens a fresh instance keeps."""
    from kvcli.engine.engine import Engine

    ids = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(2)).tolist()

    def run(method, budget):
        engine = Engine(tiny, method, budget, 16)
        cache = engine.new_cache()
        totals = engine.score([ids], cache=cache)
        return totals.nll_sum, [layer.token_idx.tolist() for layer in cache.layers]

    used = make_method(name)
    run(used, 80)
    assert run(used, 40) == run(make_method(name), 40)


# --- validation and helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,options,cache", [
    ("snapkv", {}, 31),  # the window (32) is always kept
    ("snapkv", {"kernel": 4}, 64),
    ("snapkv", {"pooling": "mean"}, 64),
    ("snapkv", {"share": "all"}, 64),
    ("pyramidkv", {}, 27),  # 8 kept + beta 20 (the default): the top layer would select nothing
    ("pyramidkv", {"beta": 5}, 12),
    ("pyramidkv", {"beta": 0.5}, 128),
    ("h2o", {"sinks": 4, "recent": 60}, 63),
    ("tova", {"sinks": 8}, 7),
    ("pyramidinfer", {"decay": 1.5}, 64),
    ("pyramidinfer", {"schedule": "linear"}, 64),
    ("pyramidinfer", {"recent": 100}, 64),
])
def test_impossible_settings_are_usage_errors(name, options, cache):
    with pytest.raises(UsageError):
        make_method(name, options).validate(cache)


def test_select_top_breaks_ties_toward_earlier_tokens():
    scores = torch.tensor([[0.0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1]] * 2)
    protected = torch.zeros(12, dtype=torch.bool)
    protected[-1] = True
    assert select_top(scores, protected, 4).tolist() == [[1, 2, 3, 11]] * 2
