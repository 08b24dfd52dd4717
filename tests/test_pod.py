"""PoD: Eq. 3-4 against a literal per-query reference, App. C.1 (the lead layer is full attention), the whole
model against full attention without sharing, memory actually freed, groups files and calibration."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from kvcli.engine.engine import Engine
from kvcli.errors import UsageError
from kvcli.eval.analysis.calibrate import calibrate, sample_sequences
from kvcli.kv.attention import explicit_attention
from kvcli.kv.quant import POSITION_BYTES, token_costs
from kvcli.methods import METHODS, make_method
from kvcli.methods.full import Full
from kvcli.methods.pod.attention import (
    SEQUENCE_ATTENTION,
    SHARED_KWARG,
    SharedForward,
    SharingPlan,
    proximal_and_distant,
    register_sequence_attention,
    shared_attention,
)
from kvcli.methods.pod.cache import PodCache
from kvcli.methods.pod.groups import (
    GroupsFile,
    ModelShape,
    groups_from_similarity,
    resolve,
    shipped_for,
    shipped_groups,
)
from kvcli.models.load import tiny_llama

# --- Eq. 3-4, literally ----------------------------------------------------------------------------------


def literal_pod(q_own, q_lead, k_own, k_lead, v, i, sinks, recent, tau=None):
    """Eq. 3-4 for one query (slot ``i``, 0-based) of one head, in python floats.

    Proximal: slots ``[0, n_s)`` and ``[i - n_r + 1, i]`` (Eq. 3's ``K_[1, n_s]`` and ``K_[n - n_r + 1, n]``);
    distant: the rest of ``[0, i]``. Two separate softmaxes, then the gate of Eq. 4.
    """
    d = len(q_own)
    scale = 1 / math.sqrt(d)
    proximal = [t for t in range(i + 1) if t < sinks or t >= i - recent + 1]
    distant = [t for t in range(i + 1) if t not in proximal]

    def dot(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    a_p = [dot(q_own, k_own[t]) * scale for t in proximal]
    a_d = [dot(q_lead, k_lead[t]) * scale for t in distant]

    def softmax_mix(logits, slots):
        top = max(logits)
        weights = [math.exp(a - top) for a in logits]
        total = sum(weights)
        return [sum(w * v[t][c] for w, t in zip(weights, slots, strict=True)) / total for c in range(len(v[0]))]

    o_p = softmax_mix(a_p, proximal)
    if not distant:  # "the corresponding attention term is omitted"
        return o_p, 1.0
    o_d = softmax_mix(a_d, distant)
    sum_p = sum(math.exp(a) for a in a_p)
    sum_d = sum(math.exp(a) for a in a_d)
    g = sum_p / (sum_p + sum_d)
    if tau is not None and g >= tau:  # appendix B.4: the distant part is left out
        return o_p, g
    return [g * p + (1 - g) * q for p, q in zip(o_p, o_d, strict=True)], g


@pytest.mark.parametrize("sinks,recent,cached,new,tau", [
    (2, 3, 10, 5, None),   # a block against a cache: the window slides within the block
    (2, 3, 0, 14, None),   # a prefill: early queries have no distant tokens
    (0, 1, 9, 1, None),    # decoding one token, no sinks, the window is the query alone
    (4, 20, 6, 4, None),   # everything proximal
    (1, 4, 12, 6, 0.5),    # the gate threshold skips some queries' distant part
])
def test_shared_attention_matches_literal_eq_3_4(sinks, recent, cached, new, tau):
    gen = torch.Generator().manual_seed(7)
    heads, group, dim = 2, 2, 4
    length = cached + new
    q = torch.randn(heads, group, new, dim, generator=gen, dtype=torch.float64) * 2
    q_lead = torch.randn(heads, group, new, dim, generator=gen, dtype=torch.float64) * 2
    k_own = torch.randn(heads, length, dim, generator=gen, dtype=torch.float64)
    k_lead = torch.randn(heads, length, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(heads, length, 3, generator=gen, dtype=torch.float64)
    query_slots = torch.arange(cached, length)
    # the layer holds its own keys only for slots some query of the block sees as proximal
    proximal, _ = proximal_and_distant(query_slots, length, sinks, recent)
    own_slots = proximal.any(dim=0).nonzero()[:, 0]
    out, _, gate = shared_attention(q, q_lead, k_own[:, own_slots], own_slots, k_lead, v, query_slots, sinks, recent,
                                    dim ** -0.5, tau, with_gate=True)
    skipped = 0
    for h in range(heads):
        for j in range(group):
            for n in range(new):
                expected, g = literal_pod(q[h, j, n].tolist(), q_lead[h, j, n].tolist(), k_own[h].tolist(),
                                          k_lead[h].tolist(), v[h].tolist(), cached + n, sinks, recent, tau)
                assert out[h, j, n].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
                assert float(gate[h, j, n]) == pytest.approx(g, rel=1e-5)
                skipped += tau is not None and g >= tau
    if tau is not None:
        assert skipped > 0


def test_lead_equals_own_query_and_keys_is_full_attention():
    """App. C.1: with the layer's own Q and K as the lead's, Eq. 3-4 is plain softmax attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=gen)
    k = torch.randn(1, 2, 16, 8, generator=gen)
    v = torch.randn(1, 2, 16, 8, generator=gen)
    full, _ = explicit_attention(q, k, v, 8 ** -0.5, 0)
    slots = torch.arange(16)
    out, _, _ = shared_attention(q[0].view(2, 2, 6, 8), q[0].view(2, 2, 6, 8), k[0], slots, k[0], v[0],
                                 torch.arange(10, 16), 2, 3, 8 ** -0.5)
    torch.testing.assert_close(out.reshape(1, 4, 6, 8), full, rtol=1e-5, atol=1e-6)


# --- the whole model ---------------------------------------------------------------------------------------

SHARED = [[[0, 1, 2], [3]], [[0], [1, 2, 3]]]  # KV head 0: lead 0 for layers 0-2; KV head 1: lead 1 for 1-3


def tiny(seed: int = 0):
    return tiny_llama(num_layers=4, hidden=64, heads=4, kv_heads=2, seed=seed)


def groups_for(model, blocks=SHARED) -> GroupsFile:
    return GroupsFile("tiny", ModelShape.of(model.config), blocks)


def stream(model, method, ids: torch.Tensor, block: int):
    engine = Engine(model, method, None, block=block)
    cache = engine.new_cache()
    hidden = [engine.forward(cache, ids[None, i:i + block]) for i in range(0, ids.shape[0], block)]
    return torch.cat(hidden), cache


@pytest.mark.parametrize("block", [1, 7, 64])
def test_every_layer_its_own_block_is_full_attention(block):
    model = tiny()
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(0))
    full, full_cache = stream(model, Full(), ids, 64)
    pod, cache = stream(model, make_method("pod", {"groups": GroupsFile.separate(model.config), "sinks": 2,
                                                   "recent": 5}), ids, block)
    if block == 64:
        assert torch.equal(pod, full)  # one forward: the same attention calls, bit for bit
    torch.testing.assert_close(pod, full, rtol=1e-5, atol=1e-5)
    assert cache.nbytes() == full_cache.nbytes()  # no sharing: every key is kept


def test_lead_layer_output_is_exactly_full_attention():
    """App. C.1: layer 0 leads every head, so its attention output is full attention bit for bit."""
    model = tiny()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    captured: dict[str, torch.Tensor] = {}
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda module, args, output: captured.__setitem__("out", output[0].detach().clone()))
    try:
        stream(model, Full(), ids, 40)
        full = captured["out"]
        stream(model, make_method("pod", {"groups": groups_for(model), "sinks": 2, "recent": 4}), ids, 40)
        pod = captured["out"]
    finally:
        hook.remove()
    assert torch.equal(pod, full)


def test_lead_heads_of_a_mixed_layer_are_full_attention():
    """In layer 1 KV head 1 leads (full attention) while KV head 0 shares layer 0's distant scores."""
    gen = torch.Generator().manual_seed(3)
    plan = SharingPlan(groups_for(tiny()).leads(), sinks=2, recent=4)
    cache = PodCache(4, 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)), plan)
    cache.block_start = cache.stream_start = 0
    k = [torch.randn(1, 2, 20, 8, generator=gen) for _ in range(2)]
    v = [torch.randn(1, 2, 20, 8, generator=gen) for _ in range(2)]
    q = [torch.randn(1, 4, 20, 8, generator=gen) for _ in range(2)]
    for layer in range(2):
        cache.layers[layer].update(k[layer], v[layer])
        out, _ = cache.layers[layer].attend(q[layer], k[layer], v[layer], 8 ** -0.5, 0)
    full, _ = explicit_attention(q[1][:, 2:], k[1][:, 1:], v[1][:, 1:], 8 ** -0.5, 0)
    assert torch.equal(out[:, 2:], full)
    assert not torch.allclose(out[:, :2], explicit_attention(q[1][:, :2], k[1][:, :1], v[1][:, :1], 8 ** -0.5, 0)[0])


@pytest.mark.parametrize("block", [1, 5, 16])
def test_streaming_in_blocks_matches_one_sequence_forward(block):
    """The cache path (blocks, decoding) and the whole-sequence path (post-training) compute the same thing."""
    model = tiny()
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(2))
    method = make_method("pod", {"groups": groups_for(model), "sinks": 3, "recent": 6})
    streamed, _ = stream(model, method, ids, block)
    register_sequence_attention()
    model.set_attn_implementation(SEQUENCE_ATTENTION)
    with torch.no_grad():
        whole = model.model(input_ids=ids[None], use_cache=False,
                            **{SHARED_KWARG: SharedForward(method.plan(model.config))}).last_hidden_state[0]
    torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
    full, _ = stream(tiny(), Full(), ids, 48)
    assert not torch.allclose(streamed, full, atol=1e-3)  # sharing changes the result: the test has teeth


def test_whole_model_matches_a_per_query_reference():
    """Every layer's attention recomputed query by query (Eq. 3-4) from the Q, K, V the model produces."""
    model = tiny(seed=4)
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(4))
    sinks, recent = 2, 5
    method = make_method("pod", {"groups": groups_for(model), "sinks": sinks, "recent": recent})
    plan = method.plan(model.config)
    qkv: dict[int, tuple] = {}

    def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        qkv[layer] = (query[0].double(), key[0].double())
        group = query.shape[1] // key.shape[1]
        out = torch.empty(query.shape[1], query.shape[2], value.shape[-1], dtype=torch.float64)
        for head in range(query.shape[1]):
            kv = head // group
            lead_q, lead_k = qkv[plan.lead_of(kv, layer)]
            for i in range(query.shape[2]):
                o, _ = literal_pod(query[0, head, i].double().tolist(), lead_q[head, i].tolist(),
                                   key[0, kv].double().tolist(), lead_k[kv].tolist(), value[0, kv].double().tolist(),
                                   i, sinks, recent)
                out[head, i] = torch.tensor(o)
        return out.to(query.dtype)[None].transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface

    AttentionInterface.register("kvcli-pod-reference", reference_attention)
    streamed, _ = stream(model, method, ids, 5)
    model.set_attn_implementation("kvcli-pod-reference")
    with torch.no_grad():
        expected = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    torch.testing.assert_close(streamed, expected, rtol=1e-4, atol=1e-4)


# --- memory --------------------------------------------------------------------------------------------------


def test_distant_keys_are_freed_outside_the_lead_layer():
    model = tiny()
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(5))
    sinks, recent = 4, 8
    _, cache = stream(model, make_method("pod", {"groups": groups_for(model), "sinks": sinks, "recent": recent}),
                      ids, 13)
    head_dim, element = 16, 4
    expected = 0
    for layer in cache.layers:
        leads = len(layer.lead_heads)
        others = len(layer.other_heads)
        assert layer.keys.shape[:3] == (1, leads, 100)
        assert layer.near_keys.shape[:3] == (1, others, sinks + recent - 1 if others else 0)  # freed, not masked
        assert layer.values.shape[:3] == (1, 2, 100)
        expected += (2 * 100 + leads * 100 + others * (sinks + recent - 1)) * head_dim * element
        expected += 2 * 100 * POSITION_BYTES  # every token's positions in both KV heads
    assert cache.nbytes() == expected
    full_bytes = 2 * 4 * 2 * 100 * head_dim * element
    # 4 (head, layer) pairs of 8 keep all keys: keys of distant tokens shrink to half
    assert cache.nbytes() < 0.85 * full_bytes


def test_queries_of_lead_layers_do_not_outlive_the_forward():
    model = tiny()
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(6))
    _, cache = stream(model, make_method("pod", {"groups": groups_for(model), "sinks": 2, "recent": 3}), ids, 7)
    assert cache.lead_queries is None and cache.lead_keys is None


# --- groups files, bad input ---------------------------------------------------------------------------------


def test_groups_file_round_trip_and_saving(tmp_path):
    model = tiny()
    groups = groups_for(model)
    path = groups.save(tmp_path / "g.json")
    loaded = GroupsFile.load(path)
    assert loaded.groups == SHARED and loaded.shape == groups.shape
    assert loaded.leads().tolist() == [[0, 0, 0, 3], [0, 1, 1, 1]]
    # per distant token: 8 (layer, head) values + 4 lead keys out of 16 keys and values
    assert loaded.theoretical_kv_saving() == pytest.approx(4 / 16)
    assert json.loads(path.read_text())["theoretical_kv_saving"] == 0.25


def test_bad_inputs_are_usage_errors(tmp_path):
    model = tiny()
    with pytest.raises(UsageError, match="not found"):
        make_method("pod", {"groups": str(tmp_path / "missing.json")})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        make_method("pod", {"groups": str(tmp_path / "bad.json")})
    with pytest.raises(UsageError, match="tau"):
        make_method("pod", {"tau": "1.5"})
    with pytest.raises(UsageError, match="tau"):
        make_method("pod", {"tau": "-0.1"})
    with pytest.raises(UsageError, match="recent"):
        make_method("pod", {"recent": "0"})
    other = tiny_llama(num_layers=3, hidden=64, heads=4, kv_heads=2)
    path = groups_for(model).save(tmp_path / "tiny.json")
    method = make_method("pod", {"groups": str(path)})
    with pytest.raises(UsageError, match="this model has 3 layers"):
        method.new_cache(other)
    with pytest.raises(UsageError, match="consecutive"):
        GroupsFile("x", ModelShape.of(model.config), [[[0, 2], [1, 3]], [[0, 1, 2, 3]]])
    with pytest.raises(UsageError, match="ships no PoD groups"):
        make_method("pod").new_cache(model)


def test_a_windowed_model_is_refused_before_groups_are_sought_or_calibrated(invoke, book, tmp_path, smol_tokenizer):
    """Gemma 3 has sliding-window layers, which PoD cannot share keys across: a user is told so at once, not sent
    to calibrate groups (minutes) that the method would then refuse."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    folder = tmp_path / "tiny-gemma"
    Gemma3ForCausalLM(config).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    out = tmp_path / "groups.json"
    for args in (("calibrate", book, "--out", out, "-N", 2, "--tokens", 64),
                 ("ppl", book, "--method", "pod", "-o", "select=snapkv", "--max-tokens", 100)):
        result = invoke(*args, "--model", folder, "--quiet")
        assert result.exit_code != 0 and "sliding-window layers" in result.stderr, result.stderr
        assert "ships no PoD groups" not in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_pod_is_listed_and_bad_input_exits_with_one_line(invoke, book, tmp_path):
    assert "pod" in METHODS
    listed = invoke("methods")
    assert listed.exit_code == 0 and "pod" in listed.stdout and "tau" in listed.stdout
    for option, message in ((f"groups={tmp_path / 'none.json'}", "not found"), ("tau=2", "tau must be between")):
        result = invoke("ppl", book, "--method", "pod", "-o", option)
        assert result.exit_code != 0
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_shipped_groups_match_the_default_model_shape():
    from transformers import LlamaConfig

    shipped = shipped_groups()
    assert [g.model for g in shipped] == ["smollm2-135m"]
    config = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64)
    groups = shipped_for(config)
    assert groups.threshold == 0.55 and groups.q == 16  # shipped stricter than the paper's 0.5 (docs/methods.md)
    assert resolve("auto", config).groups == groups.groups
    assert 0.0 < groups.theoretical_kv_saving() < 0.5
    regrouped = groups.regrouped(0.0)  # everything similar: one block per KV head
    assert regrouped.blocks_per_kv_head() == [1, 1, 1]
    paper = groups.regrouped(0.5)  # a lower threshold merges more layers: fewer blocks, more saved
    assert sum(paper.blocks_per_kv_head()) < sum(groups.blocks_per_kv_head())
    assert make_method("pod", {"threshold": 0.5}).layer_groups(config).groups == paper.groups
    # With a selection only the most similar layers share unless a threshold is given.
    strict = make_method("pod", {"select": "snapkv"}).layer_groups(config)
    assert strict.groups == groups.regrouped(0.8).groups and strict.threshold == 0.8
    assert make_method("pod", {"select": "snapkv"}).settings()["threshold"] == 0.8
    assert sum(strict.blocks_per_kv_head()) > sum(groups.blocks_per_kv_head())
    assert make_method("pod", {"select": "snapkv", "threshold": 0.5}).layer_groups(config).groups == paper.groups
    with pytest.raises(UsageError, match="threshold must be between"):
        make_method("pod", {"threshold": 1.5})


# --- calibration ---------------------------------------------------------------------------------------------


def test_groups_from_similarity_follow_the_vote_and_algorithm_1():
    layers = 4
    sim = torch.ones(4, layers, layers)  # 4 query heads, 2 KV heads of 2
    sim[0, 2, :2] = sim[0, :2, 2] = 0.2  # one vote of two against layer 2 for KV head 0: a tie is not similar
    sim[2, 3, 0] = sim[2, 0, 3] = 0.1
    sim[3, 3, 0] = sim[3, 0, 3] = 0.1  # both heads of KV head 1: layer 3 unlike layer 0
    groups = groups_from_similarity(sim, 2, 0.5)
    assert groups == [[[0, 1], [2, 3]], [[0, 1, 2], [3]]]


def test_calibrate_on_a_tiny_model(tmp_path, smol_tokenizer, tiny_model_dir):
    from kvcli.io.documents import open_source
    from kvcli.models.load import load_model

    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 97} and more text" for i in range(2000)))
    docs = open_source(str(book))
    sequences = sample_sequences(docs, smol_tokenizer, 3, 64, seed=1)
    assert len(sequences) == 3 and all(s.shape == (64,) for s in sequences)
    assert len({tuple(s.tolist()) for s in sequences}) == 3
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    groups = calibrate(loaded.model, loaded.tokenizer, docs, threshold=0.5, q=8, n=2, length=64, model_id="tiny")
    assert groups.samples == 2 and groups.tokens_per_sample == 64 and groups.q == 8
    assert len(groups.groups) == 2 and len(groups.similarity) == 4
    path = groups.save(tmp_path / "tiny.json")
    method = make_method("pod", {"groups": str(path)})
    assert method.new_cache(loaded.model).plan.leads.shape == (2, 2)
    with pytest.raises(UsageError, match="trained context"):
        calibrate(loaded.model, loaded.tokenizer, docs, n=1, length=100_000)


# --- PoD with a token selection at a fixed budget (issue #12 item 4, beyond the paper) ----------------------


def run_budget(model, method, ids, budget, block=16, heads_apart=None):
    engine = Engine(model, method, budget, block=block)
    cache = engine.new_cache()
    if heads_apart is not None:
        cache.heads_apart = heads_apart
    hidden = torch.cat([engine.forward(cache, ids[None, i:i + block]) for i in range(0, ids.shape[0], block)])
    return hidden, cache


@pytest.mark.parametrize("select,options", [("streamingllm", {"sinks": 4}), ("snapkv", {"sinks": 4, "recent": 7}),
                                            ("treekv", {"sinks": 4, "recent": 7}), ("h2o", {"sinks": 4, "recent": 7})])
def test_pod_selection_without_sharing_is_the_selection_itself(select, options):
    """Every layer its own block: PoD + selection keeps, rotates and attends exactly like the selection alone
    (with each head's tokens compacted on their own, as PoD's layers place them: no ``heads_apart``)."""
    model = tiny()
    ids = torch.randint(0, 128, (160,), generator=torch.Generator().manual_seed(8))
    alone, alone_cache = run_budget(model, make_method(select, options), ids, 48, heads_apart=False)
    pod = make_method("pod", {"groups": GroupsFile.separate(model.config), "sinks": 4, "recent": 8, "select": select})
    both, cache = run_budget(model, pod, ids, 48)
    assert torch.equal(both, alone)
    assert [layer.token_idx.tolist() for layer in cache.layers] == [
        layer.token_idx.tolist() for layer in alone_cache.layers]


@pytest.mark.parametrize("select", ["streamingllm", "snapkv", "treekv", "tova"])
def test_pod_selection_shares_the_leads_choice_and_holds_fewer_bytes(select):
    model = tiny()
    ids = torch.randint(0, 128, (160,), generator=torch.Generator().manual_seed(9))
    pod = make_method("pod", {"groups": groups_for(model), "sinks": 4, "recent": 8, "select": select})
    _, cache = run_budget(model, pod, ids, 48)
    plan = cache.plan
    for layer in cache.layers:
        assert layer.get_seq_length() == 48
        assert layer.near_keys.shape[2] == (4 + 7 if layer.other_heads else 0)  # proximal keys survive selections
        for head in range(2):  # each head keeps, in every layer, the tokens its block's lead chose
            lead = cache.layers[plan.lead_of(head, layer.layer_idx)]
            assert layer.token_idx[head].tolist() == lead.token_idx[head].tolist()
    _, plain = run_budget(model, make_method(select, {"sinks": 4} if select == "streamingllm" else
                                             {"sinks": 4, "recent": 7}), ids, 48)
    assert cache.nbytes() < plain.nbytes()


def test_equal_bytes_budget_keeps_more_tokens_in_no_more_bytes():
    model = tiny()
    groups = groups_for(model)
    budget = groups.equal_bytes_budget(48, 4, 8, token_costs(model.config, 16, torch.float32))
    assert budget > 48
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(10))
    _, cache = run_budget(model, make_method("pod", {"groups": groups, "sinks": 4, "recent": 8,
                                                     "select": "streamingllm"}), ids, budget)
    _, plain = run_budget(model, make_method("streamingllm", {"sinks": 4}), ids, 48)
    assert max(cache.lengths()) == budget and cache.nbytes() <= plain.nbytes()


def test_budget_for_bytes_gives_pod_selection_more_tokens_in_the_same_bytes():
    from kvcli.engine.engine import budget_for_bytes, kv_bytes_per_token

    model = tiny()
    positions = model.config.num_hidden_layers * model.config.num_key_value_heads * POSITION_BYTES
    nbytes = 48 * (kv_bytes_per_token(model, torch.float32) + positions) + 5  # a few bytes short of 49 tokens
    groups = groups_for(model)
    pod = make_method("pod", {"groups": groups, "sinks": 4, "recent": 8, "select": "snapkv"})
    assert pod.layer_groups(model.config).groups == groups.groups  # no stored similarity: the file's own groups
    assert budget_for_bytes(make_method("snapkv"), model, nbytes, torch.float32) == 48
    costs = token_costs(model.config, 16, torch.float32)
    assert budget_for_bytes(pod, model, nbytes, torch.float32) == groups.equal_bytes_budget(48, 4, 8, costs)
    assert budget_for_bytes(make_method("pod", {"groups": groups}), model, nbytes, torch.float32) == 48
    with pytest.raises(UsageError, match="cannot hold one token"):
        budget_for_bytes(make_method("snapkv"), model, 10, torch.float32)


def test_parse_bytes_units_and_errors():
    from kvcli.cli.options import parse_bytes

    assert parse_bytes("47185920", "--b") == 47185920 and parse_bytes("45MiB", "--b") == 45 * 2**20
    assert parse_bytes("1.5GB", "--b") == 1_500_000_000 and parse_bytes("2 KiB", "--b") == 2048
    for bad in ("", "12QB", "-3", "MiB", "0"):
        with pytest.raises(UsageError):
            parse_bytes(bad, "--b")


def test_ppl_cache_bytes_compares_methods_at_equal_memory(invoke, tmp_path, tiny_model_dir):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 37} and more" for i in range(800)))
    from transformers import AutoConfig

    config = ModelShape.of(AutoConfig.from_pretrained(tiny_model_dir))
    groups = tmp_path / "groups.json"
    GroupsFile("tiny", config, [[[0, 1]], [[0], [1]]]).save(groups)
    reports = {}
    for name, options in (("snapkv", ["-o", "sinks=2", "-o", "recent=7"]),
                          ("pod", ["-o", f"groups={groups}", "-o", "sinks=2", "-o", "recent=8",
                                   "-o", "select=snapkv"])):
        result = invoke("ppl", book, "--model", tiny_model_dir, "--method", name, *options, "--cache-bytes", "24KiB",
                        "--max-tokens", 300, "--quiet", "--json")
        assert result.exit_code == 0, result.stderr
        reports[name] = json.loads(result.stdout)
    assert reports["pod"]["cache"] > reports["snapkv"]["cache"]
    assert reports["pod"]["max_cache_tokens"] > reports["snapkv"]["max_cache_tokens"]
    assert reports["pod"]["kv_cache_bytes"] <= reports["snapkv"]["kv_cache_bytes"] <= 24 * 1024
    small = invoke("ppl", book, "--model", tiny_model_dir, "--method", "pod", "-o", f"groups={groups}",
                   "-o", "select=snapkv", "--cache-bytes", "2KiB", "--quiet")
    assert small.exit_code == 2 and small.stderr.count("\n") == 1 and "--cache-bytes 2KiB holds" in small.stderr


def test_pod_selection_bad_input():
    with pytest.raises(UsageError, match="select must be"):
        make_method("pod", {"select": "full"})
    from kvcli.errors import BudgetError

    with pytest.raises(BudgetError):
        make_method("pod", {"select": "streamingllm", "sinks": 4, "recent": 8}).validate(11)
    assert make_method("pod").unbounded and not make_method("pod", {"select": "snapkv"}).unbounded


def test_pod_default_window_fits_the_default_cache_with_a_selection():
    """Alone PoD's window is long (it keeps every token anyway); with a selection the default window must
    leave room in the default --cache of 1,024, and the selection protects the same recent tokens."""
    from kvcli.errors import BudgetError

    assert make_method("pod").recent == 3072
    pod = make_method("pod", {"select": "snapkv"})
    assert pod.recent == 512 and pod.inner.recent == 511
    pod.validate(1024)
    with pytest.raises(BudgetError):
        pod.validate(16 + 511)
    assert make_method("pod", {"select": "snapkv", "recent": 100}).recent == 100


# --- post-training (section 2.2) -------------------------------------------------------------------------------


def test_adapt_trains_resumes_and_saves_a_folder_pod_loads(tmp_path, tiny_model_dir):
    from kvcli.io.documents import open_source
    from kvcli.methods.pod.adapt import STATE_FILE, adapt
    from kvcli.models.load import load_model

    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 53} then text" for i in range(1500)))
    docs = open_source(str(book))
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    model = copy.deepcopy(loaded.model)  # load_model's instance is shared with other tests
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    groups = GroupsFile("tiny", ModelShape.of(model.config), [[[0, 1]], [[0], [1]]])
    out = tmp_path / "adapted"
    seen: list[int] = []

    def stop_after_two(step, total, loss):
        seen.append(step)
        assert math.isfinite(loss)
        if step == 2:
            raise KeyboardInterrupt  # Ctrl-C: the state is saved and the run says it was interrupted

    with pytest.raises(UsageError, match="sees a distant token"):  # everything proximal: nothing to adapt
        adapt(model, loaded.tokenizer, docs, groups, out, tokens=5 * 64, seq_len=64, sinks=2, recent=62)
    first = adapt(model, loaded.tokenizer, docs, groups, out, tokens=5 * 64, seq_len=64, lr=1e-3, sinks=2, recent=8,
                  on_step=stop_after_two)
    assert first.interrupted and first.steps == 2 and (out / STATE_FILE).is_file()
    second = adapt(model, loaded.tokenizer, docs, groups, out, tokens=5 * 64, seq_len=64, lr=1e-3, sinks=2, recent=8,
                   on_step=lambda step, total, loss: seen.append(step))
    assert second.resumed_from == 2 and second.steps == 5 and not second.interrupted
    assert seen == [1, 2, 3, 4, 5] and not (out / STATE_FILE).exists()
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())
    adapted = load_model(str(out), device="cpu", dtype="float32")
    method = make_method("pod", {"sinks": 2, "recent": 8})  # groups=auto finds out/pod_groups.json
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0))
    hidden, cache = stream(adapted.model, method, ids, 16)
    assert cache.plan.leads.tolist() == [[0, 0], [0, 1]] and torch.isfinite(hidden).all()


def test_calibrate_and_adapt_commands_on_the_tiny_model(invoke, tmp_path, tiny_model_dir):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 41} and so on" for i in range(1500)))
    groups = tmp_path / "groups.json"
    result = invoke("calibrate", book, "--out", groups, "--model", tiny_model_dir, "--samples", 2, "--tokens", 64,
                    "--q", 4, "--quiet", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["samples"] == 2 and GroupsFile.load(groups).q == 4
    out = tmp_path / "adapted"
    result = invoke("adapt", "--model", tiny_model_dir, "--data", book, "--groups", groups, "--tokens", 128,
                    "--seq-len", 64, "--lr", "1e-3", "--sinks", 2, "--recent", 8, "--out", out, "--quiet", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 2
    scored = invoke("ppl", book, "--model", out, "--method", "pod", "-o", "sinks=2", "-o", "recent=8",
                    "--max-tokens", 100, "--quiet", "--json")
    assert scored.exit_code == 0, scored.stderr
    report = json.loads(scored.stdout)
    kept = invoke("ppl", book, "--model", out, "--method", "full", "--max-tokens", 100, "--quiet", "--json")
    assert report["cache"] is None and report["kv_cache_bytes"] < json.loads(kept.stdout)["kv_cache_bytes"]
    bad = invoke("adapt", "--model", tiny_model_dir, "--data", book, "--tokens", 128, "--seq-len", 64, "--sinks", 2,
                 "--recent", 8, "--out", out, "--quiet")
    assert bad.exit_code != 0 and "ships no PoD groups" in bad.stderr


@pytest.mark.parametrize("select", ["snapkv", "h2o"])
def test_cache_bytes_never_buy_pod_more_than_asked_at_any_bit_width(select):
    """PoD with a selection keeps more tokens in the same bytes than the selection with keys rounded as PoD rounds
    them, per token (at 2 bits the selection alone rounds keys per channel, keeps no entry positions and so holds
    more); its proximal keys at full precision, its values and every token's positions (and the selection's scores)
    are paid for, so ``--cache-bytes`` is never exceeded, and ``nbytes`` is every byte of every tensor the cache
    holds."""
    from kvcli.engine.engine import budget_for_bytes
    from kvcli.kv.snapshot import snapshot_cache

    model = tiny()
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(6))
    nbytes = 60_000
    for bits in (16, 8, 4, 2):
        pod = make_method("pod", {"groups": groups_for(model), "sinks": 4, "recent": 8, "select": select})
        budget = budget_for_bytes(pod, model, nbytes, torch.float32, bits)
        assert budget > budget_for_bytes(make_method(select), model, nbytes, torch.float32, bits, "token")
        engine = Engine(model, pod, budget, block=32, kv_bits=bits, warn=lambda message: None)
        cache = engine.new_cache()
        for start in range(0, ids.shape[1], 32):
            engine.forward(cache, ids[:, start:start + 32])
        tensors, _ = snapshot_cache(cache)
        assert cache.nbytes() == sum(t.numel() * t.element_size() for t in tensors.values()), bits
        assert cache.nbytes() <= nbytes, (bits, cache.nbytes())


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_a_long_proximal_window_at_few_bits_buys_pod_fewer_tokens_never_more_bytes(bits):
    """Proximal keys stay at full precision in every layer: with many of them and keys packed small, PoD holds fewer
    tokens than a plain cache of the same bytes, and still no more bytes than asked (at 4 and 2 bits it used to be
    given the plain cache's tokens, and held more)."""
    from kvcli.engine.engine import budget_for_bytes

    model = tiny()
    ids = torch.randint(0, 128, (1, 800), generator=torch.Generator().manual_seed(7))
    nbytes = 150_000
    pod = make_method("pod", {"groups": groups_for(model), "sinks": 4, "recent": 120, "select": "snapkv"})
    budget = budget_for_bytes(pod, model, nbytes, torch.float32, bits)
    plain = budget_for_bytes(make_method("snapkv"), model, nbytes, torch.float32, bits)
    if bits == 2:
        assert budget < plain  # the case this test is for
    engine = Engine(model, pod, budget, block=32, kv_bits=bits, warn=lambda message: None)
    cache = engine.new_cache()
    for start in range(0, ids.shape[1], 32):
        engine.forward(cache, ids[:, start:start + 32])
    assert cache.nbytes() <= nbytes, (budget, plain, cache.nbytes())


@pytest.mark.parametrize("length", [60, 800])  # one shot (with a recap, were there a probe) and streamed
def test_ask_with_a_pod_selection_reads_without_a_probe_and_says_so(invoke, tmp_path, tiny_model_dir, length):
    """PoD's cache stores every block it is given, so it cannot take the question's probe: `ask` reads without
    one (and so without a recap), with one warning, rather than failing with a traceback."""
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 37} and more" for i in range(length)))
    from transformers import AutoConfig

    groups = tmp_path / "groups.json"
    GroupsFile("tiny", ModelShape.of(AutoConfig.from_pretrained(tiny_model_dir)), [[[0, 1]], [[0], [1]]]).save(groups)
    result = invoke("ask", book, "Which word comes first?", "--model", tiny_model_dir, "--method", "pod",
                    "-o", f"groups={groups}", "-o", "sinks=2", "-o", "recent=8", "-o", "select=snapkv",
                    "--cache", "64", "--block", "32", "--max-new-tokens", "3", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["generated_tokens"] >= 1
    assert result.stderr.count("pod reads without the question's probe") == 1


def test_a_saved_pod_read_answers_without_recall_and_refuses_it(tiny_model_dir):
    """Recall takes the question's queries from a probe, which PoD's cache cannot take: a saved PoD read answers
    without recall by default, and asking for recall is refused with kvcli's one-line error, never a traceback."""
    from kvcli import Engine, KvcliError, load_model
    from kvcli.reading.reader import Reader
    from kvcli.reading.saved import answer, read_once

    loaded = load_model(str(tiny_model_dir))
    pod = make_method("pod", {"groups": GroupsFile.separate(loaded.model.config), "sinks": 2, "recent": 8,
                              "select": "snapkv"})
    reader = Reader(Engine(loaded.model, pod, 48, block=16), loaded.tokenizer)
    state = read_once(reader, [list(range(5, 120))])
    assert answer(reader, state, "Which word comes first?", 3).recap_tokens == 0
    with pytest.raises(KvcliError, match="no recall index this kvcli can use"):
        answer(reader, state, "Which word comes first?", 3, recall=32)
