"""The architecture matrix: every supported family from a tiny random config (no download, seconds).

For each family: streamed ``full`` equals one forward pass of the model's own eager attention;
StreamingLLM after evictions equals a literal reference built on the model's own rotary module,
``apply_rotary_pos_emb`` and eager attention (kept keys re-rotated to consecutive positions, window
layers holding their last W - 1 tokens, explicit masks); every registered method runs within its
budget with a finite perplexity. A model without RoPE is refused with one line.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from kvcli.engine.engine import Engine
from kvcli.errors import UnsupportedModelError
from kvcli.kv.architecture import describe
from kvcli.kv.architecture import layer_windows as config_windows
from kvcli.kv.attention import ATTENTION_NAME, register_attention
from kvcli.kv.cache import rotate_keys
from kvcli.kv.quant import POSITION_BYTES
from kvcli.methods import METHODS, make_method
from kvcli.methods.pod.groups import GroupsFile, ModelShape

VOCAB = 128
WINDOW = 16  # small enough that every stream below leaves it many times
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)
SLIDING, FULL = "sliding_attention", "full_attention"

#: One tiny config per family, each with what makes the family different from Llama.
CONFIGS = {
    "llama3": lambda: LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=16),  # q/k norms
    "mistral": lambda: MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW),  # every layer windowed
    "gemma2": lambda: Gemma2Config(**COMMON, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                   attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=24),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
                                       layer_types=[SLIDING, SLIDING, FULL], query_pre_attn_scalar=24, rope_parameters={
                                           SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                           FULL: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
    "phi3": lambda: Phi3Config(**COMMON, num_hidden_layers=2, pad_token_id=0, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo2": lambda: Olmo2Config(**COMMON, num_hidden_layers=2, pad_token_id=0),  # q/k norms
    "gpt_oss": lambda: GptOssConfig(**COMMON, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                    num_local_experts=4, num_experts_per_tok=2, layer_types=[SLIDING, FULL]),
}
FAMILIES = sorted(CONFIGS)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    register_attention()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).float().eval()
    if family == "gpt_oss":  # random init leaves the learned sinks at zero; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    model.set_attn_implementation(ATTENTION_NAME)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and a busy 2-core machine turns their barriers into seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {}


def model_of(models: dict, family: str) -> torch.nn.Module:
    if family not in models:
        models[family] = build(family)
    return models[family]


def stream_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def eager_nll(model, ids: torch.Tensor) -> float:
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum").item()


def layer_windows(config) -> list[int | None]:
    """Each layer's window as the modeling code passes it (read here independently of kvcli.kv.architecture)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == SLIDING else None for kind in types]


def nll_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(hidden).float()


def streamed_block_nll(model, method, budget, ids, block) -> list[float]:
    engine = Engine(model, method, budget, block=block)
    seen: list[float] = []
    engine.score([ids.tolist()], on_block=lambda stats, totals: seen.append(stats.nll * stats.tokens))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block", [5, 64])
def test_full_streamed_equals_one_eager_forward(models, family, block):
    model = model_of(models, family)
    ids = stream_ids(150, seed=block)
    totals = Engine(model, make_method("full"), None, block=block).score([ids.tolist()])
    assert totals.tokens == 149
    assert totals.nll_sum == pytest.approx(eager_nll(model, ids), rel=1e-5)
    windows = [w for w in layer_windows(model.config) if w is not None]
    assert all(w == WINDOW for w in windows)


def reference_streamingllm(model, ids: torch.Tensor, budget: int, sinks: int, block: int) -> list[float]:
    """StreamingLLM written out with the model's own pieces: per block, every layer's kept keys are rotated
    from where they entered to consecutive positions ending before the block (the model's rotary module
    and ``apply_rotary_pos_emb``), the block runs through the model's eager attention with an explicit
    mask (window layers see fewer than W positions back), then full layers keep sinks + recent tokens and
    window layers their last W - 1. Returns the summed NLL of each block's scored tokens."""
    config = model.config
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    windows = layer_windows(config)
    rotary = model.model.rotary_emb
    apply_rope = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
    keyed = types[0] is not None and hasattr(rotary, f"{types[0]}_inv_freq")
    keys: list[torch.Tensor | None] = [None] * len(types)
    values: list[torch.Tensor | None] = [None] * len(types)
    entry: list[torch.Tensor | None] = [None] * len(types)
    out, previous = [], None
    model.set_attn_implementation("eager")
    try:
        for start in range(0, ids.shape[0], block):
            chunk = ids[start:start + block]
            n = chunk.shape[0]
            held = [0 if k is None else k.shape[2] for k in keys]
            p = max(held)
            cache = DynamicCache()
            masks = {}
            for layer, kind in enumerate(types):
                if keys[layer] is not None:
                    now = torch.arange(p - held[layer], p)
                    extra = {"layer_type": kind} if keyed else {}
                    cos, sin = rotary(keys[layer], (now - entry[layer])[None], **extra)
                    scale = getattr(rotary, f"{kind}_attention_scaling" if keyed else "attention_scaling", 1.0)
                    moved = apply_rope(keys[layer], keys[layer], cos / scale, sin / scale)[1]
                    cache.update(moved, values[layer], layer)
                key_pos = torch.arange(p - held[layer], p + n)[None, :]
                query_pos = torch.arange(p, p + n)[:, None]
                visible = key_pos <= query_pos
                if windows[layer] is not None:
                    visible &= query_pos - key_pos < windows[layer]
                mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
                masks[kind] = mask
            mask_arg = masks if types[0] is not None else masks[None]
            with torch.no_grad():
                result = model.model(input_ids=chunk[None], position_ids=torch.arange(p, p + n)[None],
                                     past_key_values=cache, attention_mask=mask_arg, use_cache=True)
            hidden = result.last_hidden_state[0]
            predictors = hidden[:-1] if previous is None else torch.cat((previous, hidden[:-1]))
            targets = chunk[1:] if previous is None else chunk
            logits = nll_logits(model, predictors)
            if getattr(config, "final_logit_softcapping", None):
                cap = config.final_logit_softcapping
                logits = torch.tanh(logits / cap) * cap
            out.append(F.cross_entropy(logits, targets, reduction="sum").item())
            previous = hidden[-1:]
            for layer in range(len(types)):
                k, v = cache.layers[layer].keys, cache.layers[layer].values
                positions = torch.arange(p - held[layer], p + n)
                length = k.shape[2]
                if windows[layer] is not None:
                    keep = torch.arange(max(0, length - (windows[layer] - 1)), length)
                elif length > budget:
                    keep = torch.cat((torch.arange(sinks), torch.arange(length - (budget - sinks), length)))
                else:
                    keep = torch.arange(length)
                keys[layer], values[layer], entry[layer] = k[:, :, keep], v[:, :, keep], positions[keep]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_streamingllm_after_evictions_equals_the_literal_reference(models, family):
    model = model_of(models, family)
    ids = stream_ids(130, seed=7)
    budget, sinks, block = 24, 3, 10
    got = streamed_block_nll(model, make_method("streamingllm", {"sinks": sinks}), budget, ids, block)
    expected = reference_streamingllm(model, ids, budget, sinks, block)
    assert len(got) == len(expected) == 13
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_windows_read_from_the_config_are_the_models(models, family):
    """PoD refuses a model by its config's windows before it looks for groups; they must be what the model runs."""
    model = model_of(models, family)
    assert config_windows(model.config) == describe(model).windows == layer_windows(model.config)
    if any(describe(model).windows):
        with pytest.raises(UnsupportedModelError, match="sliding-window layers"):
            Engine(model, make_method("pod"), 64, block=16).new_cache()  # not "ships no PoD groups"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_runs_within_its_budget(models, family):
    model = model_of(models, family)
    arch = describe(model)
    ids = stream_ids(160, seed=3).tolist()
    budget = 64
    for name in sorted(METHODS):
        if METHODS[name].unbounded:
            continue
        options = {}
        if name == "pod":
            shape = ModelShape.of(model.config)
            options = {"groups": GroupsFile("tiny", shape, [[list(range(shape.layers))]] * shape.kv_heads)}
            if any(arch.windows):
                with pytest.raises(UnsupportedModelError, match="sliding-window layers"):
                    Engine(model, make_method(name, options), budget, block=16).new_cache()
                continue
        engine = Engine(model, make_method(name, options), budget, block=16)
        cache = engine.new_cache()
        lengths: list[list[int]] = []
        def record(stats, totals, cache=cache, lengths=lengths) -> None:
            lengths.append(cache.lengths())

        totals = engine.score([ids], cache=cache, on_block=record)
        assert math.isfinite(totals.nll), name
        budgeted = arch.budgeted
        if budgeted and name != "pod":  # pod's budget counts its own units (see docs/methods.md)
            assert sum(engine.budgets[i] for i in budgeted) <= budget * len(budgeted), name
            for seen in lengths:
                assert all(seen[i] <= engine.budgets[i] for i in budgeted), (name, seen)
            assert totals.max_cache_tokens <= max(engine.budgets[i] for i in budgeted), name
        for i, window in enumerate(arch.windows):
            if window is not None:
                assert all(seen[i] == window - 1 for seen in lengths[2:]), (name, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_rotates_keys_as_the_model_does(models, family):
    """Moving a key by d with the layer's frequencies equals the model rotating it at p + d (partial
    rotary, llama3/linear/YaRN scaling, Gemma 3's two bases)."""
    model = model_of(models, family)
    arch = describe(model)
    config = model.config
    rotary = model.model.rotary_emb
    apply_rope = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
    raw = torch.randn(1, 2, 5, arch.head_dim)
    start = torch.tensor([[3, 9, 17, 30, 41]])
    delta = torch.tensor([[-3, 2, -10, 7, 0], [5, -9, 1, -30, 12]])
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    for facts, kind in zip(arch.layers, types, strict=True):
        extra = {"layer_type": kind} if kind is not None and hasattr(rotary, f"{kind}_inv_freq") else {}

        def rope(positions, extra=extra):
            cos, sin = rotary(raw, positions, **extra)
            return apply_rope(raw, raw, cos, sin)[1]

        moved = rotate_keys(rope(start), delta, facts.inv_freq)
        for head in range(2):
            target = rope((start + delta[head])[0][None])
            torch.testing.assert_close(moved[:, head], target[:, head], atol=1e-5, rtol=1e-5)
    if family == "gemma3":  # local and global layers rotate with different bases
        assert not torch.equal(arch.layers[0].inv_freq, arch.layers[2].inv_freq)
        assert [layer.rope_theta for layer in arch.layers] == [10000.0, 10000.0, 1000000.0]
    if family == "phi3":
        assert arch.layers[0].inv_freq.shape[0] * 2 == arch.head_dim // 2


def test_window_layers_cost_no_budget_and_the_bytes_drop(models):
    """Gemma 3 (two window layers of three): the budget goes to the full layer; the window layers hold
    W - 1 tokens, so the cache is smaller than one holding the budget in every layer."""
    model = model_of(models, "gemma3")
    engine = Engine(model, make_method("streamingllm"), 40, block=8)
    cache = engine.new_cache()
    totals = engine.score([stream_ids(120, seed=1).tolist()], cache=cache)
    assert cache.lengths() == [WINDOW - 1, WINDOW - 1, 40]
    assert totals.max_cache_tokens == 40 and engine.budgets == [None, None, 40]
    kv_heads = model.config.num_key_value_heads
    per_token_layer = kv_heads * (2 * model.config.head_dim * 4 + POSITION_BYTES)  # K and V in fp32, positions
    assert totals.kv_cache_bytes == per_token_layer * (2 * (WINDOW - 1) + 40)
    assert totals.kv_cache_bytes < per_token_layer * 3 * 40


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_soft_capping_and_sinks_keep_the_engines_decode_step(family):
    """The static decode step (kvcli.kv.decode) computes a plain softmax only: Gemma 2's soft-capped logits and
    GPT-OSS's learned sinks write with the engine's step, here with every layer full (no window layer, which
    would keep it anyway)."""
    from kvcli.kv.decode import EagerSteps, answer_steps

    register_attention()
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.layer_types = [FULL] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.set_attn_implementation(ATTENTION_NAME)
    assert not describe(model).plain_softmax
    assert all(describe(model_of_family).plain_softmax for model_of_family in (build("llama3"), build("gemma3")))
    engine = Engine(model, make_method("snapkv"), 40, block=16)
    cache = engine.new_cache()
    engine.forward(cache, stream_ids(64, seed=2)[None], last_only=True)
    assert engine.budgets == [40] * config.num_hidden_layers
    assert isinstance(answer_steps(engine, cache, 4), EagerSteps)


def dynamic_llama() -> torch.nn.Module:
    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": 64}, num_hidden_layers=2,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def test_dynamic_ntk_is_exact_below_its_switch_and_refused_past_it():
    model = dynamic_llama()
    ids = stream_ids(60, seed=2)
    totals = Engine(model, make_method("full"), None, block=7).score([ids.tolist()])
    assert totals.nll_sum == pytest.approx(eager_nll(model, ids), rel=1e-5)
    bounded = Engine(model, make_method("streamingllm"), 32, block=8).score([stream_ids(200, seed=2).tolist()])
    assert math.isfinite(bounded.nll) and bounded.max_cache_tokens == 32
    with pytest.raises(UnsupportedModelError, match="switches to other frequencies"):
        Engine(model, make_method("full"), None, block=16).score([stream_ids(100, seed=2).tolist()])


def gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128)).eval()


def test_a_model_without_rope_is_refused_by_the_library():
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported: it has no rotary position embedding"):
        Engine(gpt2_model(), make_method("streamingllm"), 32)


def test_a_model_without_rope_gets_one_line_and_exit_1(invoke, book, tmp_path, smol_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(smol_tokenizer), n_embd=32, n_layer=2, n_head=2,
                               n_positions=512)).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    result = invoke("ppl", book, "--model", folder, "--method", "streamingllm", "--cache", "64")
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no rotary position embedding" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("family", FAMILIES)
def test_recall_sees_the_keys_and_queries_each_family_rotates(models, family, monkeypatch):
    """The recall index (kvcli.reading.recall) reads each layer's keys and queries before RoPE from its projections:
    they must be what the model itself hands to RoPE, whatever the layout (per-head norms before or after the
    heads are split, a norm over the whole projection, a fused qkv_proj)."""
    import importlib

    from kvcli.kv.architecture import head_shape
    from kvcli.reading.recall import _capture

    model = model_of(models, family)
    modeling = importlib.import_module(type(model).__module__)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    rotate = modeling.apply_rotary_pos_emb

    def record(q, k, *args, **kwargs):
        seen.append((q[0].transpose(0, 1).clone(), k[0].transpose(0, 1).clone()))  # [n, heads, dim] each
        return rotate(q, k, *args, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", record)
    heads, dim = head_shape(model.config)
    layers = list(range(model.config.num_hidden_layers))
    keys: dict[int, torch.Tensor] = {}
    queries: dict[int, torch.Tensor] = {}
    decoder = model.model
    with torch.no_grad(), _capture(decoder, layers, "k", heads, dim, keys), \
            _capture(decoder, layers, "q", model.config.num_attention_heads, dim, queries):
        model(input_ids=stream_ids(12, seed=5)[None])
    assert len(seen) == len(layers)
    for layer, (q, k) in zip(layers, seen, strict=True):
        assert torch.allclose(keys[layer], k, atol=1e-6), (family, layer)
        assert torch.allclose(queries[layer], q, atol=1e-6), (family, layer)


@pytest.mark.parametrize(("family", "layers"), [("gemma3", [2]), ("gpt_oss", [1]), ("mistral", [0, 1])])
def test_the_recall_index_keeps_the_middle_layers_without_a_window(models, family, layers):
    """Gemma 3's and GPT-OSS's windowed layers never looked past their window in training, so their attention over a
    whole read is not scored; a model whose every layer has a window (Mistral) keeps them all."""
    from kvcli.kv.architecture import describe
    from kvcli.reading.recall import PageIndex

    model = model_of(models, family)
    assert PageIndex.for_model(model, describe(model).windows).layers == layers
