"""PyramidInfer's nested reads (Algorithm 1: each layer processes only what the layer below kept).

The reference below runs a tiny Llama layer by layer in plain PyTorch from its weights (RMSNorm,
projections, RoPE, an explicit causal softmax over the tokens the layer receives, MLP), selects each
layer's pivotal contexts from the attention of the last queries averaged over every query head, and
gathers the kept tokens' hidden states for the next layer. The engine's nested forward must keep
the same tokens in every layer and end in the same hidden state for the last token.
"""

from __future__ import annotations

import math

import pytest
import torch
from support import max_pooled, retained_fraction
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvcli.engine.engine import Engine
from kvcli.methods import make_method
from kvcli.reading.prompts import PromptParts
from kvcli.reading.reader import Reader


def ids_of(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def one_shot(model, method, budget: int, ids: torch.Tensor, last_only: bool = True):
    engine = Engine(model, method, budget, block=ids.shape[1])
    cache = engine.new_cache()
    cache.keep_positions = method.keeps_positions  # as a one-shot read sets it
    hidden = engine.forward(cache, ids, last_only=last_only)
    return engine, cache, hidden


def rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def reference_nested(model, ids: torch.Tensor, cache_budget: int, budgets: list[int], method):
    """Algorithm 1 on a one-shot prompt, literally: returns the stream indices each layer stores, the
    stream indices each layer hands to the next (its pivotal contexts, PvC), and the last token's final
    (normed) hidden state. ``budgets`` are the layers' budgets, averaging ``cache_budget``; a layer stores
    the best of its PvC that its budget holds."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    n = ids.shape[1]
    decoder = model.model
    hidden = decoder.embed_tokens(ids)[0]  # [n, d]
    tokens = list(range(n))  # stream indices of the tokens the current layer receives
    cos, sin = decoder.rotary_emb(hidden[None], torch.arange(n)[None])
    kept_sets, processed = [], []  # what each layer stores; the tokens each layer hands to the next
    # The recent window: recent_ratio of the prompt, at most what the sinks leave of half the average budget.
    recent = min(cache_budget - method.sinks - cache_budget // 2, math.ceil(method.recent_ratio * n))
    for layer_idx, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        m = len(tokens)
        x = rms(hidden, layer.input_layernorm)
        q = attn.q_proj(x).view(m, heads, dim).transpose(0, 1)[None]
        k = attn.k_proj(x).view(m, kv_heads, dim).transpose(0, 1)[None]
        v = attn.v_proj(x).view(m, kv_heads, dim).transpose(0, 1)[None]
        index = torch.tensor(tokens)
        q, k = apply_rotary_pos_emb(q, k, cos[:, index], sin[:, index])  # each token at its own position
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        logits = (q @ k.transpose(-1, -2)) * attn.scaling
        logits = logits.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [1, H, m, m]
        out = (probs @ v)[0].transpose(0, 1).reshape(m, heads * dim)
        hidden = hidden + attn.o_proj(out)
        y = rms(hidden, layer.post_attention_layernorm)
        hidden = hidden + layer.mlp.down_proj(layer.mlp.act_fn(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))
        # Pivotal contexts: the last `window` queries' attention, averaged over every query head.
        window = min(method.window, m)
        scores = max_pooled(probs[0, :, m - window:, :].sum(dim=1).mean(dim=0).tolist(), method.kernel)
        budget = budgets[layer_idx]
        fraction = retained_fraction(method.p, method.decay, layer_idx, len(budgets), method.schedule)
        target = max(method.min_len, math.ceil(fraction * (n - method.sinks - recent)))
        stored = min(m, method.sinks + recent) + min(budget - method.sinks - recent, target)  # the budget's part
        passed = min(m, method.sinks + recent) + target  # the pivotal contexts, which the next layer processes
        protected = [i for i in range(m) if i < method.sinks or i >= m - recent]
        ranked = sorted((i for i in range(m) if i not in protected), key=lambda i: (-scores[i], i))
        kept_sets.append([tokens[i] for i in sorted(protected + ranked[: max(stored - len(protected), 0)])])
        if passed < m:
            rows = sorted(protected + ranked[: passed - len(protected)])
            hidden = hidden[rows]
            tokens = [tokens[i] for i in rows]
        processed.append(list(tokens))
    return kept_sets, processed, rms(hidden[-1:], decoder.norm)


@pytest.mark.parametrize("options,budget,n", [
    ({}, 48, 200),
    ({"recent_ratio": 0.05, "min_len": 4, "decay": 0.7}, 40, 160),
    ({"sinks": 0, "p": 0.5, "min_len": 8, "window": 8, "recent_ratio": 1.0}, 64, 120),
])
def test_nested_prefill_matches_a_literal_algorithm_1(tiny, options, budget, n):
    method = make_method("pyramidinfer", options)
    ids = ids_of(n)
    engine, cache, hidden = one_shot(tiny, method, budget, ids)
    expected_sets, passed, expected_hidden = reference_nested(tiny, ids, budget, engine.budgets, method)
    for layer, expected, pvc in zip(cache.layers, expected_sets, passed, strict=True):
        assert (layer.token_idx == layer.token_idx[0]).all()  # one token set per layer, shared by the heads
        assert layer.token_idx[0].tolist() == expected
        assert set(expected) <= set(pvc)  # a layer stores the best of what it hands on
    assert all(set(above) <= set(below) for below, above in zip(passed, passed[1:], strict=False))
    assert hidden.shape[0] == len(passed[-2])  # the top layer processed only the PvC of the one below
    assert len(passed[-2]) < n
    torch.testing.assert_close(hidden[-1:], expected_hidden, atol=1e-4, rtol=1e-4)


def test_where_the_budget_does_not_bind_every_layer_keeps_a_subset_of_the_layer_below(tiny):
    """The paper's case: each layer's cache is its pivotal contexts, a subset of the layer below's."""
    method = make_method("pyramidinfer", {"min_len": 4, "p": 0.8, "decay": 0.7})
    engine, cache, hidden = one_shot(tiny, method, 400, ids_of(240))
    sets = [set(layer.token_idx[0].tolist()) for layer in cache.layers]
    assert all(above < below for below, above in zip(sets, sets[1:], strict=False))
    assert hidden.shape[0] == len(sets[-2])  # the top layer processed the cache of the one below
    assert 239 in sets[-1]  # the last token (the recent window) reaches the top layer


def test_a_binding_budget_trims_what_each_layer_stores(tiny):
    engine, cache, hidden = one_shot(tiny, make_method("pyramidinfer", {"min_len": 4}), 48, ids_of(240))
    assert all(length <= budget for length, budget in zip(cache.lengths(), engine.budgets, strict=True))
    assert max(cache.lengths()) < hidden.shape[0] < 240  # what goes on is more than what is stored
    assert all(239 in layer.token_idx[0].tolist() for layer in cache.layers)


def test_layer_zero_and_the_kept_cache_of_an_unnested_read_agree_where_they_must(tiny):
    """Layer 0 sees the whole prompt in both paths, so it keeps the same tokens; the un-nested path
    returns every row, the nested one only the top layer's."""
    method = make_method("pyramidinfer")
    _, nested, top = one_shot(tiny, method, 48, ids_of(200))
    _, plain, every = one_shot(tiny, method, 48, ids_of(200), last_only=False)
    assert nested.layers[0].token_idx.tolist() == plain.layers[0].token_idx.tolist()
    assert every.shape[0] == 200 and top.shape[0] < 200


def test_ppl_never_nests_and_its_numbers_do_not_depend_on_nesting(tiny, monkeypatch):
    """``kvcli ppl`` scores every token, so the engine's scoring path compresses after each block
    whatever the method says; forbidding nesting changes nothing."""
    ids = ids_of(150, seed=5)[0].tolist()

    def run():
        engine = Engine(tiny, make_method("pyramidinfer"), 40, 32)
        cache = engine.new_cache()
        totals = engine.score([ids], cache=cache)
        return totals.nll_sum, [layer.token_idx.tolist() for layer in cache.layers]

    allowed = run()
    monkeypatch.setattr("kvcli.methods.pyramidinfer.PyramidInfer.nests", lambda self: False)
    assert run() == allowed


def test_nest_false_reads_un_nested_with_the_same_scores(tiny):
    method = make_method("pyramidinfer", {"nest": False})
    assert not method.nests()
    _, plain, every = one_shot(tiny, method, 48, ids_of(200))
    _, unnested, _ = one_shot(tiny, make_method("pyramidinfer"), 48, ids_of(200), last_only=False)
    assert every.shape[0] == 200
    assert [layer.token_idx.tolist() for layer in plain.layers] == [
        layer.token_idx.tolist() for layer in unnested.layers]


def test_per_kv_head_selection_nests_by_the_union_of_the_heads(tiny):
    """With heads=kv each KV head keeps its own tokens; the next layer processes every token some head of
    the layer below passed on, so what any head of a layer keeps was processed by the layer below."""
    method = make_method("pyramidinfer", {"heads": "kv", "min_len": 4})
    assert method.nests()
    engine, cache, hidden = one_shot(tiny, method, 48, ids_of(200))
    assert hidden.shape[0] < 200  # the top layer processed fewer tokens than the prompt
    kept = cache.layers[2].token_idx
    assert kept.shape[0] == 2 and kept[0].tolist() != kept[1].tolist()  # each KV head chose alone
    assert all(length <= budget for length, budget in zip(cache.lengths(), engine.budgets, strict=True))
    _, plain, _ = one_shot(tiny, make_method("pyramidinfer", {"heads": "kv", "min_len": 4, "nest": False}), 48,
                           ids_of(200), last_only=False)
    assert cache.layers[0].token_idx.tolist() == plain.layers[0].token_idx.tolist()  # layer 0 saw everything


@pytest.mark.parametrize("probe", [False, True])
def test_a_streamed_read_nests_its_blocks_unless_a_probe_scores_them(tiny, probe, monkeypatch):
    """A streamed read nests every block when no question is probed (only the last position is used);
    with a probe every block but the last is compressed after the probe has run, un-nested. The last
    block ends with the question, whose own queries score it, so it nests."""
    from kvcli.engine import engine as engine_module

    calls = []
    original = engine_module.nested_forward
    monkeypatch.setattr(engine_module, "nested_forward", lambda *a: calls.append(1) or original(*a))
    engine = Engine(tiny, make_method("pyramidinfer", {"min_len": 4}), 40, 32)
    reader = Reader(engine, tokenizer=None)
    cache = engine.new_cache()
    from kvcli.reading.generate import Generation

    result = Generation()
    doc = [ids_of(150, seed=7)[0].tolist()]
    hidden = reader.read(cache, PromptParts([1], [2, 3, 4], chat=False), doc, result, one_shot=False, probe=probe)
    assert hidden.shape[0] == 1 and not result.one_shot
    blocks = math.ceil((1 + 150 + 3) / 32)
    assert len(calls) == (1 if probe else blocks)  # the question probes every block before the last
    assert all(length <= budget for length, budget in zip(cache.lengths(), engine.budgets, strict=True))
    last = cache.stream_start - 1
    assert all(last in layer.token_idx[0].tolist() for layer in cache.layers)


def test_a_reused_instance_keeps_no_state_of_its_own_across_nested_reads(tiny):
    """State lives in the cache: an instance that already read at another budget keeps what a fresh one keeps."""
    used = make_method("pyramidinfer")
    fields = set(vars(used))
    one_shot(tiny, used, 80, ids_of(200))
    _, again, top = one_shot(tiny, used, 40, ids_of(200))
    _, fresh, top_fresh = one_shot(tiny, make_method("pyramidinfer"), 40, ids_of(200))
    assert [layer.token_idx.tolist() for layer in again.layers] == [layer.token_idx.tolist() for layer in fresh.layers]
    assert torch.equal(top, top_fresh)
    assert set(vars(used)) == fields  # nothing was stored on the method


def test_decoding_after_a_nested_read_stays_within_budget(tiny):
    engine, cache, hidden = one_shot(tiny, make_method("pyramidinfer"), 48, ids_of(200))
    for token in (5, 6, 7):
        engine.forward(cache, torch.tensor([[token]]), decoding=True)
        assert all(length <= budget for length, budget in zip(cache.lengths(), engine.budgets, strict=True))
    assert cache.stream_start == 203


def test_heads_and_recent_ratio_are_validated():
    from kvcli.errors import UsageError

    with pytest.raises(UsageError):
        make_method("pyramidinfer", {"heads": "query"}).validate(64)
    with pytest.raises(UsageError):
        make_method("pyramidinfer", {"recent_ratio": 0}).validate(64)
