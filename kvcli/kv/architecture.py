"""What kvcli must know about a model's decoder layers, read from the model itself.

kvcli stores keys as RoPE rotated them and re-rotates them when it re-assigns positions, so it needs
each layer's own rotation: families differ (Gemma 3 rotates its sliding-window layers with base 10k
and its full-attention layers with base 1M; Phi-3 and others rotate only part of each head; Llama 3.1
scales its frequencies). It also needs each layer's attention window: a layer the model restricts to
the last W tokens never needs more, whatever the compression method. Both are read from the model's
rotary module(s) and ``config.layer_types``, the way the model's own forward reads them, so a family
that names them the transformers way needs no code here.

A model without rotary position embeddings (GPT-2's learned positions, a state-space model) cannot
have its positions re-assigned; it is refused with one line (:class:`UnsupportedModelError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcli.errors import UnsupportedModelError
from kvcli.io.lazy import torch


def head_shape(config) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of a transformers ``config``: the KV heads default to the query heads (no GQA), the
    head size to the hidden size split over the query heads, as transformers' own attention reads them."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim)

#: RoPE types whose frequencies are fixed once the model is built: a key rotated at position p moves
#: to p' by one more rotation, exactly. (YaRN and LongRoPE also scale cos/sin by a constant, which
#: commutes with the rotation.)
STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}
#: RoPE types that recompute their frequencies from the sequence length: exact only while positions
#: stay below the length where they switch (kvcli's positions stay below cache + block).
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer: the frequencies its keys were rotated with and its attention window."""

    inv_freq: torch.Tensor  # [rotated dims / 2], float32
    window: int | None  # the layer attends to the last `window` positions only (itself included)
    layer_type: str  # "full_attention", "sliding_attention", ... as in config.layer_types
    rope_type: str
    rope_theta: float | None


@dataclass(frozen=True)
class Architecture:
    """The facts of every decoder layer, and the position past which the model's RoPE changes."""

    model_type: str
    layers: list[LayerFacts]
    head_dim: int
    #: Positions at or past this make a length-dependent RoPE switch frequencies (None: never).
    rope_limit: int | None = None
    #: Every layer's attention is a plain softmax of scaled logits: no logit soft-capping (Gemma 2) and no
    #: learned sinks (GPT-OSS), which only kvcli's explicit attention path computes.
    plain_softmax: bool = True
    #: The model normalizes its keys before RoPE (a ``k_norm``: Gemma 3, Qwen 3, OLMo 2), so each key channel keeps
    #: a fixed scale (kvcli.kv.quant.KVQuant.rotates).
    key_norm: bool = False

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.layers]

    @property
    def budgeted(self) -> list[int]:
        """Indices of the layers a method's budget governs: those without an attention window."""
        return [i for i, layer in enumerate(self.layers) if layer.window is None]


def _rope_parameters(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def _layer_window(config, layer_type: str | None) -> int | None:
    """The window the model's attention gets for a layer of this type (as the modeling code passes it)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None) is not None:
        return window if layer_type == "sliding_attention" else None
    # Families without layer types (Mistral, Phi-3) pass config.sliding_window to every layer.
    return window


def _layer_types(config) -> list[str | None]:
    """Each decoder layer's type as the config names it, or None for every layer of a family without types."""
    num_layers = int(config.num_hidden_layers)
    return list(getattr(config, "layer_types", None) or [None] * num_layers)[:num_layers]


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's attention window (None: the layer attends to everything), from the config alone, so
    that a method can refuse a model before it loads or calibrates anything."""
    return [_layer_window(config, layer_type) for layer_type in _layer_types(config)]


def describe(model: torch.nn.Module) -> Architecture:
    """Read every decoder layer's RoPE frequencies and window, or refuse a model kvcli cannot re-position."""
    config = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = None
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: it has no rotary position embedding (RoPE), so kvcli "
            "cannot re-assign the positions of cached keys (see `kvcli models` for the supported families)")
    _, head_dim = head_shape(config)
    limit: int | None = None
    layers = []
    for layer_type in _layer_types(config):
        keyed = layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq")
        prefix = f"{layer_type}_" if keyed else ""
        rope_type = rotary.rope_type[layer_type] if keyed else getattr(rotary, "rope_type", "default")
        params = _rope_parameters(config, layer_type if keyed else None)
        if rope_type in LENGTH_DEPENDENT_ROPE:
            # Below the switch the model uses the frequencies it was built with.
            inv_freq = getattr(rotary, f"{prefix}original_inv_freq")
            switch = params.get("original_max_position_embeddings") if rope_type == "longrope" else None
            switch = int(switch or rotary.original_max_seq_len)
            limit = switch if limit is None else min(limit, switch)
        elif rope_type in STATIC_ROPE:
            inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        else:
            raise UnsupportedModelError(
                f"model type {model_type!r} uses RoPE type {rope_type!r}, which kvcli cannot re-rotate exactly")
        if inv_freq is None:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported: its rotary module {type(rotary).__name__} "
                "exposes no inverse frequencies kvcli can re-rotate keys with")
        theta = params.get("rope_theta")
        layers.append(LayerFacts(inv_freq.detach().to(torch.float32).clone(), _layer_window(config, layer_type),
                                 layer_type or "full_attention", rope_type, None if theta is None else float(theta)))
    softcapped = getattr(config, "attn_logit_softcapping", None) is not None
    attentions = [getattr(layer, "self_attn", None) for layer in getattr(decoder, "layers", ())]
    sinks = any(hasattr(attention, "sinks") for attention in attentions)
    key_norm = any(hasattr(attention, "k_norm") for attention in attentions)
    return Architecture(model_type, layers, int(head_dim), limit, plain_softmax=not (softcapped or sinks),
                        key_norm=key_norm)


@dataclass(frozen=True)
class Family:
    """A model family kvcli streams, with the facts about it that kvcli reads and honours."""

    model_type: str
    models: str
    rope: str
    windows: str
    attention: str = ""


#: The families the architecture matrix (tests/test_families.py) checks against the model's own eager
#: attention. Another RoPE model whose rotary module follows transformers' conventions also works
#: (describe() reads it the same way); one without RoPE is refused.
FAMILIES = [
    Family("llama", "Llama 2, Llama 3.x, SmolLM2", "one base; llama3/linear/YaRN scaling; dynamic NTK exact below "
           "its switch, refused past it", "none"),
    Family("qwen2", "Qwen 2, Qwen 2.5", "one base", "sliding layers only with use_sliding_window (off in the "
           "released models)"),
    Family("qwen3", "Qwen 3", "one base", "as Qwen 2", "q/k norms"),
    Family("mistral", "Mistral 7B", "one base", "config.sliding_window on every layer when set (v0.1: 4096; "
           "v0.2+: none)"),
    Family("gemma2", "Gemma 2", "one base", "alternating sliding and full layers",
           "logit soft-capping; query_pre_attn_scalar"),
    Family("gemma3_text", "Gemma 3 (text), e.g. gemma3-270m", "per layer type: local base on sliding layers, "
           "global base on full layers", "5 sliding layers per full one", "query_pre_attn_scalar; q/k norms"),
    Family("phi3", "Phi-3, Phi-3.5, Phi-4-mini", "partial rotary (partial_rotary_factor); LongRoPE exact below "
           "its switch, refused past it", "config.sliding_window on every layer when set"),
    Family("olmo2", "OLMo 2", "one base", "none", "q/k norms"),
    Family("gpt_oss", "GPT-OSS", "YaRN", "alternating sliding and full layers", "learned attention sinks"),
]
