"""TreeKV against literal re-implementations of the paper's Algorithm 1 (python lists, 1-based idx).

The references below are written from the paper and the documented block semantics, not from
``kvcli/methods/treekv.py``: they keep the cache as a list of stream positions, evict one token
(or one unit) per step with ``list.remove`` and never vectorise anything.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.engine.engine import Engine
from kvcli.errors import UsageError
from kvcli.kv.cache import AttentionRecord, LayerView
from kvcli.methods import make_method
from kvcli.methods.base import Split
from kvcli.methods.treekv import pair_rule
from kvcli.models.load import tiny_llama
from tests.support import append_tokens, compress_step, kept_positions, make_cache

HEADS, GROUP = 2, 2


def raw_attention(length: int, seed: int | None) -> list:
    """Random positive weights ``[query, kv head, group, key]`` standing in for a model (no seed: ones)."""
    if seed is None:
        return torch.ones(length, HEADS, GROUP, length).tolist()
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(length, HEADS, GROUP, length, generator=gen).pow(4).tolist()


def group_weights(raw: list, query: int, head: int, visible: list[int]) -> list[list[float]]:
    """Attention of ``query`` for each query head of KV head ``head``, renormalised over ``visible``."""
    rows = []
    for g in range(GROUP):
        w = [raw[query][head][g][p] for p in visible]
        total = sum(w)
        rows.append([x / total for x in w])
    return rows


# --- references ---------------------------------------------------------------------------------------
def algorithm1(T: int, c: int, attend, sinks: int = 0, recent: int = 0) -> list[list[int]]:
    """Algorithm 1 of the paper, one token per step, for one head; returns the cache after every step.

    ``attend(i, K)`` gives the attention row a^(i) of token i over the cached tokens ``K``. With
    ``sinks``/``recent`` the pair scope runs over the tree region ``K[sinks : len(K) - recent]`` of
    capacity ``c - sinks - recent`` (with both 0 this is the paper's algorithm verbatim).
    """
    K, S, C, idx = [], [], [], 1
    capacity = c - sinks - recent
    history = []
    for i in range(T):
        K = K + [i]  # line 4
        a = attend(i, K)  # line 6
        C = [x + 1 for x in C + [0]]  # line 7
        S = [s + x for s, x in zip(S + [0.0], a, strict=True)]  # line 8
        if len(K) > c:  # line 9
            Sbar = [s / n for s, n in zip(S, C, strict=True)]  # line 10
            first = sinks + idx  # 1-based position in K of the scope's left token
            if Sbar[first - 1] > Sbar[first]:  # line 11
                drop = first + 1  # line 12
            else:
                drop = first  # line 14
            del K[drop - 1], S[drop - 1], C[drop - 1]
            idx = idx % capacity + 1  # the text's cycle 1, 2, ..., c (not line 16's formula)
        history.append(list(K))
    return history


class BlockReference:
    """One head of TreeKV fed ``n`` tokens per call: the documented block semantics, spelled out.

    The evictions of a call are those of Algorithm 1 run once per excess token on the call's
    scores, the tokens reaching the tree region one at a time (only the first ``selected + 1``
    region tokens are in play at each step). With ``unit > 1`` the excess is first evicted in whole
    units (consecutive groups of ``unit`` tokens from the region's left, ``selected // unit`` of
    them settled plus one arriving), the remainder token by token; ``idx`` is kept in tokens and
    maps to the unit holding it.
    """

    def __init__(self, budget: int, sinks: int, recent: int, unit: int = 1):
        self.budget, self.sinks, self.recent, self.unit = budget, sinks, recent, unit
        self.selected = budget - sinks - recent
        self.cache: list[int] = []
        self.S: dict[int, float] = {}
        self.C: dict[int, int] = {}
        self.idx = 1

    def step(self, tokens: list[int], rows: list[tuple[list[int], list[float]]]) -> None:
        """Append ``tokens``; ``rows`` are (visible tokens, weights) of each recorded query."""
        self.cache += tokens
        for t in tokens:
            self.S[t], self.C[t] = 0.0, 0
        for visible, weights in rows:
            for t, w in zip(visible, weights, strict=True):
                self.S[t] += w
                self.C[t] += 1
        excess = len(self.cache) - self.budget
        if excess <= 0:
            return
        sbar = {t: self.S[t] / self.C[t] for t in self.cache}
        region = self.cache[self.sinks: len(self.cache) - self.recent]
        unit = self.unit if self.unit <= self.selected else 1
        units, rest = divmod(excess, unit) if unit > 1 else (0, excess)
        if units:
            cu = self.selected // unit
            u = (self.idx - 1) // unit + 1
            if u > cu:
                u = 1
            for _ in range(units):
                groups = [region[k * unit:(k + 1) * unit] for k in range(cu + 1)]
                score = [sum(sbar[t] for t in g) / unit for g in groups]
                lose = groups[u] if score[u - 1] > score[u] else groups[u - 1]
                region = [t for t in region if t not in lose]
                u = u % cu + 1
            self.idx = (u - 1) * unit + 1
        for _ in range(rest):
            present = region[: self.selected + 1]
            left, right = present[self.idx - 1], present[self.idx]
            region.remove(right if sbar[left] > sbar[right] else left)
            self.idx = self.idx % self.selected + 1
        self.cache = self.cache[: self.sinks] + region + self.cache[len(self.cache) - self.recent:]


# --- driving the method --------------------------------------------------------------------------------
def run_method(T: int, budget: int, seed: int, block: int = 1, window: int = 1, probe: int = 0,
               **options) -> list[list[list[int]]]:
    """Stream T tokens in blocks through TreeKV on synthetic attention; kept positions after every block.

    ``probe`` extra queries (query-aware scoring) join each block's record and see every token.
    """
    raw = raw_attention(T, seed)
    raw_probe = raw_attention(T, None if seed is None else seed + 1000)
    method = make_method("treekv", {**options, "window": window})  # the record holds what it asks for
    method.validate(budget)
    cache = make_cache(num_layers=1, kv_heads=HEADS)
    history = []
    for start in range(0, T, block):
        n = min(block, T - start)
        append_tokens(cache, n)
        token_idx = cache.layers[0].token_idx.tolist()
        w = min(window, n)
        probs = torch.zeros(HEADS, GROUP, len(token_idx[0]))
        for h in range(HEADS):
            for q in range(start + n - w, start + n):
                visible = [t for t in token_idx[h] if t <= q]
                probs[h, :, : len(visible)] += torch.tensor(group_weights(raw, q, h, visible))
            for q in range(start + n - probe, start + n):
                probs[h] += torch.tensor(group_weights(raw_probe, q, h, token_idx[h]))
        compress_step(cache, method, budget, n, [probs], window=w + probe, own=w)
        assert cache.layers[0].token_idx.shape[1] == min(budget, start + n)
        history.append(kept_positions(cache))
    return history


def run_reference(T: int, budget: int, seed: int, block: int, window: int, sinks: int, recent: int,
                  unit: int = 1, probe: int = 0) -> list[list[list[int]]]:
    raw = raw_attention(T, seed)
    raw_probe = raw_attention(T, None if seed is None else seed + 1000)
    refs = [BlockReference(budget, sinks, recent, unit) for _ in range(HEADS)]
    history = []
    for start in range(0, T, block):
        tokens = list(range(start, min(start + block, T)))
        w = min(window, len(tokens))
        for h, ref in enumerate(refs):
            rows = []
            for q in tokens[len(tokens) - w:]:
                visible = [t for t in ref.cache + tokens if t <= q]
                per_group = group_weights(raw, q, h, visible)
                rows.append((visible, [sum(col) / GROUP for col in zip(*per_group, strict=True)]))
            for q in tokens[len(tokens) - probe:]:
                visible = ref.cache + tokens
                per_group = group_weights(raw_probe, q, h, visible)
                rows.append((visible, [sum(col) / GROUP for col in zip(*per_group, strict=True)]))
            ref.step(tokens, rows)
        history.append([list(ref.cache) for ref in refs])
    return history


def algorithm1_history(T: int, budget: int, seed: int, sinks: int = 0,
                       recent: int = 0) -> list[list[list[int]]]:
    raw = raw_attention(T, seed)
    per_head = []
    for h in range(HEADS):
        def attend(i, K, h=h):
            return [sum(col) / GROUP for col in zip(*group_weights(raw, i, h, K), strict=True)]
        per_head.append(algorithm1(T, budget, attend, sinks, recent))
    return [[per_head[h][step] for h in range(HEADS)] for step in range(T)]


# --- tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_matches_algorithm1_on_figure3_setting(seed):
    ours = run_method(17, 4, seed, sinks=0, recent=0, tree_block=1)
    assert ours == algorithm1_history(17, 4, seed)


def test_heads_choose_independently():
    histories = [run_method(17, 4, seed, sinks=0, recent=0, tree_block=1)[-1] for seed in range(5)]
    assert any(h[0] != h[1] for h in histories)


def test_reference_scope_cycles_like_figure3():
    """The reference's scope: steps 5, 6, 7, 8 use idx 1, 2, 3, 4 and step 17 is back at idx 1 (Figure 3)."""
    def attend(i, K):
        return [1.0 / len(K)] * len(K)

    history = algorithm1(17, 4, attend)
    assert history[3] == [0, 1, 2, 3]
    for step in range(4, 17):  # 0-based step i brings token i
        before = history[step - 1] + [step]
        (gone,) = set(before) - set(history[step])
        idx = (step - 4) % 4 + 1
        assert before.index(gone) + 1 in (idx, idx + 1)


def test_ties_evict_the_left_token():
    """Uniform attention over 8 cached tokens gives exact ties (1/8) once the cache of 7 is full."""
    assert run_method(40, 7, None, sinks=0, recent=0, tree_block=1) == algorithm1_history(40, 7, None)
    ours = run_method(40, 7, None, block=4, window=4, sinks=0, recent=0, tree_block=1)
    assert ours == run_reference(40, 7, None, 4, 4, 0, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_algorithm1_larger(seed):
    assert run_method(64, 12, seed, sinks=0, recent=0, tree_block=1) == algorithm1_history(64, 12, seed)


@pytest.mark.parametrize("seed,sinks,recent", [(0, 2, 3), (1, 4, None), (2, 1, 0), (3, 0, 5)])
def test_matches_algorithm1_with_sinks_and_recent(seed, sinks, recent):
    budget = 14
    split = Split.of(budget, sinks, recent)
    ours = run_method(64, budget, seed, sinks=sinks, recent=recent, tree_block=0)  # auto: token level at n=1
    assert ours == algorithm1_history(64, budget, seed, sinks, split.recent)


def test_block_reference_agrees_with_algorithm1_at_one_token():
    ref = run_reference(40, 10, 5, block=1, window=1, sinks=2, recent=3)
    assert ref == algorithm1_history(40, 10, 5, 2, 3)


@pytest.mark.parametrize("seed,block,window,sinks,recent,budget", [
    (0, 5, 3, 0, 0, 12), (1, 8, 8, 2, 3, 14), (2, 7, 32, 1, None, 16), (3, 30, 4, 2, 2, 12),
    (4, 3, 2, 4, 4, 11),
])
def test_block_streaming_matches_sequential_evictions(seed, block, window, sinks, recent, budget):
    recent_n = Split.of(budget, sinks, recent).recent
    ours = run_method(70, budget, seed, block=block, window=window, sinks=sinks, recent=recent, tree_block=1)
    assert ours == run_reference(70, budget, seed, block, window, sinks, recent_n)


def test_auto_unit_is_token_level_when_streaming():
    """tree_block=0 evicts token by token once a stream extends a cache (the paper's language modelling)."""
    budget, block = 40, 20  # the first block fills an empty cache without evicting; later ones extend it
    recent_n = Split.of(budget, 2, None).recent
    ours = run_method(120, budget, 9, block=block, window=4, sinks=2, recent=None, tree_block=0)
    assert ours == run_reference(120, budget, 9, block, 4, 2, recent_n)


@pytest.mark.parametrize("seed,block,unit,sinks,recent,budget", [
    (0, 4, 2, 0, 0, 12), (1, 8, 4, 2, 3, 21), (2, 6, 4, 1, 2, 17), (3, 16, 4, 0, 0, 16),
    (4, 5, 2, 2, None, 15),
])
def test_block_level_units_match_reference(seed, block, unit, sinks, recent, budget):
    recent_n = Split.of(budget, sinks, recent).recent
    ours = run_method(72, budget, seed, block=block, window=4, sinks=sinks, recent=recent, tree_block=unit)
    assert ours == run_reference(72, budget, seed, block, 4, sinks, recent_n, unit)


@pytest.mark.parametrize("seed,block,window,probe,unit", [(0, 6, 2, 3, 1), (1, 8, 4, 2, 4)])
def test_probe_queries_count_for_every_token(seed, block, window, probe, unit):
    ours = run_method(60, 16, seed, block=block, window=window, probe=probe, sinks=2, recent=4,
                      tree_block=unit)
    assert ours == run_reference(60, 16, seed, block, window, 2, 4, unit, probe)


def test_units_evict_whole_units():
    """Blocks of 8 with units of 4: each call removes two aligned runs of 4 neighbours of the region."""
    hist = run_method(48, 16, 7, block=8, window=8, sinks=0, recent=0, tree_block=4)
    for step in range(2, len(hist)):
        for h in range(HEADS):
            before = hist[step - 1][h] + list(range(8 * step, 8 * step + 8))
            gone = sorted(before.index(t) for t in set(before) - set(hist[step][h]))
            assert len(gone) == 8
            for k in range(0, 8, 4):
                assert gone[k] % 4 == 0 and gone[k:k + 4] == list(range(gone[k], gone[k] + 4))


def test_prefill_then_decode_switches_unit_size():
    """Auto tree_block: a one-shot prefill in units, then decoding token by token, as the reference does."""
    T, budget, seed = 100, 40, 11  # prefill 90: 3 units of 16 (over 2 settled units, wrapping) + 2 tokens
    raw = raw_attention(T, seed)
    method = make_method("treekv", {"sinks": 2, "recent": 6})
    cache = make_cache(num_layers=1, kv_heads=HEADS)
    refs = [BlockReference(budget, 2, 6, unit=16) for _ in range(HEADS)]
    start = 0
    for n in [90] + [1] * 10:
        tokens = list(range(start, start + n))
        append_tokens(cache, n)
        token_idx = cache.layers[0].token_idx.tolist()
        w = min(32, n)
        probs = torch.zeros(HEADS, GROUP, len(token_idx[0]))
        for h, ref in enumerate(refs):
            rows = []
            for q in tokens[n - w:]:
                visible = [t for t in token_idx[h] if t <= q]
                per_group = group_weights(raw, q, h, visible)
                probs[h, :, : len(visible)] += torch.tensor(per_group)
                rows.append((visible, [sum(col) / GROUP for col in zip(*per_group, strict=True)]))
            ref.unit = 16 if n > 1 else 1
            ref.step(tokens, rows)
        compress_step(cache, method, budget, n, [probs], window=w)
        assert kept_positions(cache) == [ref.cache for ref in refs]
        start += n


def test_pair_rule_ties_evict_the_left_item():
    scores = torch.zeros(1, 9)
    gone, idx = pair_rule(scores, capacity=4, steps=5, start=2)
    # equal scores evict the scope's left item: items 2, 4, then idx wraps: 0, 3, 6
    assert gone.tolist() == [[2, 4, 0, 3, 6]] and idx == 3


def test_validate():
    make_method("treekv").validate(9)  # 4 sinks + 1 recent + 4 selected (half the cache)
    with pytest.raises(UsageError):
        make_method("treekv").validate(4)
    with pytest.raises(UsageError):
        make_method("treekv", {"recent": "8"}).validate(12)
    make_method("treekv", {"recent": "8"}).validate(13)
    with pytest.raises(UsageError):
        make_method("treekv", {"recent": "8", "tree_block": "4"}).validate(15)
    with pytest.raises(UsageError):
        make_method("treekv", {"tree_block": "16"}).validate(31)  # selected = 31 // 2 = 15 < 16
    make_method("treekv", {"tree_block": "16"}).validate(32)
    with pytest.raises(UsageError):
        make_method("treekv", {"window": "0"}).validate(100)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("block,options", [(1, {}), (16, {}), (24, {}),
                                           (16, {"tree_block": "4", "sinks": "2"})])
def test_real_engine_stays_within_budget(model, block, options):
    """Block 24 with auto units of 16 evicts one unit and 8 single tokens per block once full."""
    budget = 32
    engine = Engine(model, make_method("treekv", options), budget, block)
    cache = engine.new_cache()
    seen = []
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(block)).tolist()
    totals = engine.score([ids], cache=cache, on_block=lambda stats, _: seen.append(max(cache.lengths())))
    assert max(seen) <= budget and totals.max_cache_tokens == budget
    assert math.isfinite(totals.nll)
    assert all(length == budget for length in cache.lengths())
    layer = cache.layers[0]
    assert layer.state["treekv_s"].shape == layer.token_idx.shape == (2, budget)
    assert (layer.token_idx.diff(dim=1) > 0).all()  # kept in stream order, no duplicates


def test_default_split_at_cache_1024_keeps_508_recent_tokens():
    """`kvcli ppl --method treekv --cache 1024` is the paper's 4 + 508 + 512 (section 5.1).

    Older tokens get more attention here, so every pair comparison evicts its right (newer) token;
    the sweep then reaches the region's right end on the 512th decoded token (the tree region's
    capacity) and evicts the token that has just left the recent window: the 509th newest, never
    one of the 508 newest.
    """
    method, budget = make_method("treekv"), 1024
    method.validate(budget)
    cache = make_cache(num_layers=1, kv_heads=HEADS)

    def step(count: int) -> None:
        append_tokens(cache, count)
        stream = cache.layers[0].token_idx.float()  # [H, T] stream positions
        probs = (1.0 / (1.0 + stream))[:, None, :].expand(HEADS, GROUP, stream.shape[1]).contiguous()
        compress_step(cache, method, budget, count, [probs], window=1)

    step(budget)
    evicted = []
    for _ in range(512):
        before = set(kept_positions(cache)[0])
        step(1)
        newest = cache.stream_start - 1
        kept = kept_positions(cache)
        assert all(set(range(newest - 507, newest + 1)) <= set(head) for head in kept)
        evicted.append(sorted((before | {newest}) - set(kept[0])))
    assert evicted[-1] == [cache.stream_start - 1 - 508]  # the 509th newest token
    assert Split.of(budget, 4, None) == Split(4, 508, 512)


@pytest.mark.parametrize("guard", [0, 8])
def test_guard_keeps_both_neighbours_the_question_attends_to(guard):
    """Two adjacent tokens the probe attends to (the digits of a pass key) are compared with each other by
    the pair rule, which evicts one of them; with a guard both sit out the sweep and stay."""
    method, budget = make_method("treekv", {"guard": guard, "kernel": 1}), 64  # 4 sinks + 28 recent + 32 selected
    method.validate(budget)
    cache = make_cache(num_layers=1, kv_heads=HEADS)
    append_tokens(cache, budget)
    append_tokens(cache, 16)
    length = budget + 16
    needle = [20, 21]  # tree-region items 16 and 17: one pair of the first sweep
    text = torch.full((HEADS, GROUP, length), 1.0 / length)
    probe = torch.zeros(HEADS, GROUP, length)
    probe[..., needle] = 0.5
    layer = cache.layers[0]
    layer.record = AttentionRecord(text + probe, 2, probe)
    keep = method.compress(LayerView(0, 1, layer, 16, layer.record, seen=cache.stream_start), budget)
    layer.keep(keep)
    kept = [set(head) for head in kept_positions(cache)]
    assert all(len(head) == budget for head in kept)
    survivors = [len(set(needle) & head) for head in kept]
    assert survivors == ([2, 2] if guard else [1, 1])
