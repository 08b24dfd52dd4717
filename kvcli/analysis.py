"""What the attention of a model looks like on one prompt, and what each compression method keeps of it.

``kvcli analyze`` runs a prompt that fits in memory once through the model and measures four things
the papers behind kvcli's methods build on:

1. **Entropy and sparsity per layer and head** (PyramidKV section 3, *pyramidal information
   funneling*): if attention spreads widely in low layers and concentrates in high ones, a pyramid
   of budgets spends the cache where it is needed.
2. **Inter-layer attention similarity per head and PoD's greedy layer grouping** (PoD section 2.1,
   Eq. 2 and Algorithm 1): consecutive layers whose attention distributions agree can share them.
3. **Positions each method keeps** at a given budget (TreeKV Figure 1): regional biases of the
   scoring methods next to TreeKV's sparse-past, dense-present structure.
4. **Haar-wavelet magnitude by position** (TreeKV section 3.3, Figure 2): the signal
   ``s = a ∘ V`` of the last query, decomposed into detail levels, grows towards the end of the
   sequence, which is what motivates a cache that is sparse on the left and dense on the right.

Attention is recorded by an attention function registered with transformers' ``AttentionInterface``
for one forward pass (no model class is patched): it computes the layer's output with kvcli's own
attention function and, beside it, the float32 attention distributions of a sample of queries (the
last ``queries`` ones). Only ``layers x heads x queries x tokens`` probabilities are kept, never a
layer's whole ``tokens x tokens`` map, so 2,048 tokens of SmolLM2-135M take about 140 MB.

Everything here is a plain function of tensors or of the JSON-ready result dictionary, so the
statistics can be checked against slow references and the plots redrawn from ``analysis.json``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface

from kvcli.attention import block_causal_mask, kvcli_attention
from kvcli.engine import Engine, blocks_of
from kvcli.methods.base import Method

RECORDING_ATTENTION = "kvcli-analysis"
RECORDER_KWARG = "kvcli_analysis"
DEFAULT_METHODS = ("streamingllm", "h2o", "snapkv", "tova", "treekv", "pyramidkv", "pyramidinfer")
LOG2 = math.log(2.0)
SQRT2 = math.sqrt(2.0)


# --- recording attention ------------------------------------------------------------------------


@dataclass
class AttentionSample:
    """The attention of a sample of queries in every layer of one forward pass, and the values it weighs.

    ``probs[l]`` is ``[heads, queries, tokens]`` (float32, one row per sampled query, zero past the
    query's own position); ``values[l]`` is ``[kv_heads, tokens, head_dim]``; ``rows`` holds the
    positions of the sampled queries (ascending, the last one is the prompt's last token).
    """

    probs: list[torch.Tensor]
    values: list[torch.Tensor]
    rows: torch.Tensor

    @property
    def visible(self) -> torch.Tensor:
        """How many keys each sampled query sees (its position + 1): the support of its distribution."""
        return self.rows + 1


class AttentionRecorder:
    """Collects, layer by layer, what :func:`recording_attention` measures during one forward pass."""

    def __init__(self, rows: torch.Tensor, num_layers: int):
        self.rows = rows
        self.probs: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> None:
        self.probs[layer] = sampled_attention(query, key, scaling, self.rows.to(query.device)).cpu()
        self.values[layer] = value[0].detach().to("cpu", torch.float32)

    def sample(self) -> AttentionSample:
        if any(p is None for p in self.probs):
            raise RuntimeError("some layers did not run through the recording attention function")
        return AttentionSample(list(self.probs), list(self.values), self.rows.clone())


def sampled_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the queries at ``rows`` over all keys: ``[q_heads, len(rows), keys]`` in fp32.

    Recomputed in float32 from the layer's queries and keys (the model's own pass may run in bf16)
    so that entropies and divergences of near-zero probabilities are not rounding noise. Query
    head ``h`` reads KV head ``h // group``, the order of transformers' ``repeat_kv``.
    """
    q_heads, q_len = query.shape[1], query.shape[2]
    k_len = key.shape[2]
    group = q_heads // key.shape[1]
    keys = key[0].float().repeat_interleave(group, dim=0)
    logits = torch.matmul(query[0, :, rows].float(), keys.transpose(1, 2)) * scaling
    visible = block_causal_mask(q_len, k_len, query.device)[rows]
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def recording_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """kvcli's attention for the output, plus a record of the sampled queries' distributions.

    The recorder travels as a keyword argument of the forward call (as ``kvcli_cache`` does for the
    engine), so no global state is involved and the output is exactly what the model computes.
    """
    recorder: AttentionRecorder | None = kwargs.pop(RECORDER_KWARG, None)
    output = kvcli_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if recorder is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        recorder.record(module.layer_idx, query, key, value, scale)
    return output


def query_rows(length: int, queries: int) -> torch.Tensor:
    """Positions of the sampled queries: the last ``queries`` of the prompt (PoD's "last q tokens").

    The last queries all see nearly the whole prompt, so their entropies are comparable, and the
    very last one is the query TreeKV's wavelet analysis looks at.
    """
    queries = max(1, min(queries, length))
    return torch.arange(length - queries, length)


@torch.inference_mode()
def record_attention(model: torch.nn.Module, ids: torch.Tensor, queries: int = 64) -> AttentionSample:
    """Run ``ids`` ``[T]`` through the model once and record the attention of its last ``queries`` queries.

    The model's attention implementation is switched to :data:`RECORDING_ATTENTION` for this one
    pass and restored afterwards, whatever happens.
    """
    AttentionInterface.register(RECORDING_ATTENTION, recording_attention)
    recorder = AttentionRecorder(query_rows(ids.shape[0], queries), model.config.num_hidden_layers)
    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDING_ATTENTION)
    try:
        model.get_decoder()(input_ids=ids[None].to(device), use_cache=False, **{RECORDER_KWARG: recorder})
    finally:
        model.set_attn_implementation(previous)
    return recorder.sample()


# --- 1. entropy and sparsity (PyramidKV) -------------------------------------------------------------


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of each distribution along the last dimension (0 log 0 = 0).

    ``p log p`` with the logarithm clamped at 1e-30 rather than ``xlogy``: the same values and about
    three times faster, which matters for the layers x layers similarity matrix.
    """
    return -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1) / LOG2


def keys_for_mass(probs: torch.Tensor, mass: float = 0.9) -> torch.Tensor:
    """How many keys, taken from the most attended down, it takes to hold ``mass`` of each distribution.

    A cache that keeps only the top keys keeps at least ``mass`` of the attention with this many:
    the fewer, the sparser (and the more compressible) the layer.
    """
    cumulative = probs.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    needed = (cumulative < mass).sum(dim=-1) + 1
    return needed.clamp(max=probs.shape[-1])


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (no tie correction): the sign says whether ``y`` falls as ``x`` grows."""
    rx = torch.tensor(list(x), dtype=torch.float64).argsort().argsort().double()
    ry = torch.tensor(list(y), dtype=torch.float64).argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / denominator if denominator else float("nan")


def attention_profile(sample: AttentionSample, mass: float = 0.9) -> dict:
    """Per layer and head, the mean over sampled queries of entropy, normalised entropy and sparsity.

    Normalised entropy divides by ``log2(visible keys)`` (1 = uniform over everything the query
    sees); ``keys_fraction`` is :func:`keys_for_mass` over the visible keys.
    """
    visible = sample.visible.double()
    entropy, normalised, fraction = [], [], []
    for probs in sample.probs:
        bits = entropy_bits(probs).double()  # [H, q]
        entropy.append(bits.mean(dim=1))
        normalised.append((bits / torch.log2(visible).clamp(min=1e-12)).mean(dim=1))
        fraction.append((keys_for_mass(probs, mass).double() / visible).mean(dim=1))
    entropy_t, fraction_t = torch.stack(entropy), torch.stack(fraction)
    layer_entropy = entropy_t.mean(dim=1).tolist()
    return {
        "mass": mass,
        "entropy_bits": _rounded(entropy_t),
        "entropy_normalized": _rounded(torch.stack(normalised)),
        "keys_fraction": _rounded(fraction_t),
        "layer_entropy_bits": _rounded(entropy_t.mean(dim=1)),
        "layer_keys_fraction": _rounded(fraction_t.mean(dim=1)),
        "entropy_vs_depth_spearman": round(spearman(range(len(layer_entropy)), layer_entropy), 4),
    }


# --- 2. inter-layer similarity and PoD's layer grouping ----------------------------------------------


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in bits along the last dimension: 0 for equal, 1 for disjoint distributions.

    ``JS = (KL(p || m) + KL(q || m)) / 2`` with ``m = (p + q) / 2``; base-2 logarithms bound it by 1,
    which makes ``1 - JS`` a similarity in [0, 1] as PoD describes it.
    """
    m = (p + q) / 2
    kl_p = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(dim=-1)
    kl_q = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(dim=-1)
    return ((kl_p + kl_q) / (2 * LOG2)).clamp(min=0.0)


def layer_similarity(probs: Sequence[torch.Tensor]) -> torch.Tensor:
    """PoD's Eq. 2 per head: ``sim_h(a, b) = 1 - mean_j JS(S_j^{a,h}, S_j^{b,h})`` over the sampled queries j.

    ``probs[l]`` is ``[heads, queries, tokens]``; returns ``[heads, layers, layers]``, symmetric with
    ones on the diagonal. (The paper writes the average JS divergence itself but says the score runs
    from 0, completely dissimilar, to 1, identical; that is ``1 - JS`` with base-2 logarithms.)
    JS is computed as ``H(m) - (H(p) + H(q)) / 2``, equal to :func:`js_divergence`, so that each of the
    ``layers**2 / 2`` pairs costs one entropy instead of two divergences.
    """
    layers, heads = len(probs), probs[0].shape[0]
    entropies = [entropy_bits(p) for p in probs]  # [heads, queries] per layer
    sim = torch.ones(heads, layers, layers, dtype=torch.float64)
    for a in range(layers):
        for b in range(a + 1, layers):
            js = entropy_bits((probs[a] + probs[b]) / 2) - (entropies[a] + entropies[b]) / 2
            value = 1.0 - js.clamp(0.0, 1.0).double().mean(dim=-1)
            sim[:, a, b] = value
            sim[:, b, a] = value
    return sim


def greedy_layer_groups(similar: torch.Tensor) -> list[list[int]]:
    """PoD's Algorithm 1 for one head: merge consecutive layers bottom-up while each is similar to all of the block.

    ``similar`` is a boolean ``[layers, layers]`` relation (``sim_h >= 0.5`` in the paper). Layer l
    joins the current (last) block when it is similar to every layer already in it; otherwise it
    starts a new block. Layers are numbered from 0 here (the paper counts from 1).
    """
    blocks = [[0]]
    for layer in range(1, similar.shape[0]):
        current = blocks[-1]
        if all(bool(similar[layer, other]) for other in current):
            current.append(layer)
        else:
            blocks.append([layer])
    return blocks


def group_vote(sim: torch.Tensor, kv_heads: int, threshold: float = 0.5) -> torch.Tensor:
    """PoD's GQA rule (appendix B.2): two layers are similar for a KV head when most of its query heads say so.

    ``sim`` is ``[q_heads, layers, layers]``; returns a boolean ``[kv_heads, layers, layers]``. A
    strict majority is needed, so a tie (possible with an even group) counts as not similar.
    """
    q_heads, layers = sim.shape[0], sim.shape[1]
    votes = (sim >= threshold).view(kv_heads, q_heads // kv_heads, layers, layers).sum(dim=1)
    return votes * 2 > q_heads // kv_heads


def similarity_report(sample: AttentionSample, threshold: float = 0.5) -> dict:
    """Similarity matrices (per query head and their mean) and PoD's groups, ready for JSON.

    Groups are given per query head (Algorithm 1 as written), per KV head (the majority vote PoD
    uses for GQA models, whose keys are shared per KV head) and for the mean matrix (a summary).
    """
    sim = layer_similarity(sample.probs)
    mean = sim.mean(dim=0)
    groups = [greedy_layer_groups(sim[h] >= threshold) for h in range(sim.shape[0])]
    kv_groups = [greedy_layer_groups(vote) for vote in group_vote(sim, sample.values[0].shape[0], threshold)]
    return {
        "definition": "1 - Jensen-Shannon divergence (bits), averaged over the sampled queries",
        "threshold": threshold,
        "per_head": _rounded(sim),
        "mean": _rounded(mean),
        "groups": groups,
        "group_counts": [len(g) for g in groups],
        "kv_groups": kv_groups,
        "kv_group_counts": [len(g) for g in kv_groups],
        "mean_matrix_groups": greedy_layer_groups(mean >= threshold),
    }


# --- 3. positions each method keeps (TreeKV Figure 1) -------------------------------------------------


def bin_edges(length: int, bins: int) -> list[int]:
    """``bins + 1`` integer edges splitting positions ``0 .. length-1`` into near-equal bins."""
    bins = max(1, min(bins, length))
    return [round(i * length / bins) for i in range(bins + 1)]


def position_counts(token_idx: torch.Tensor, edges: Sequence[int]) -> list[int]:
    """Kept tokens per position bin, summed over KV heads, for one layer's ``token_idx`` ``[H_kv, T]``."""
    which = torch.bucketize(token_idx.flatten().cpu(), torch.tensor(edges[1:-1]), right=True)
    return torch.bincount(which, minlength=len(edges) - 1).tolist()


@torch.inference_mode()
def kept_positions(model: torch.nn.Module, ids: torch.Tensor, method: Method, cache_size: int | None,
                   block: int) -> tuple[list[torch.Tensor], list[int] | None]:
    """Stream ``ids`` through :class:`~kvcli.engine.Engine` and return each layer's kept stream positions.

    The prompt goes in blocks of ``block`` tokens with a compression after each, exactly as
    ``kvcli ppl`` reads a document; returns ``token_idx`` ``[H_kv, T_l]`` per layer and the budgets.
    """
    engine = Engine(model, method, cache_size, block=block, warn=lambda message: None)
    cache = engine.new_cache()
    for chunk in blocks_of([ids], block):
        engine.forward(cache, chunk[None, :])
    return [layer.token_idx.cpu() for layer in cache.layers], engine.budgets


def positions_report(model: torch.nn.Module, ids: torch.Tensor, methods: dict[str, Method], cache_size: int,
                     block: int, bins: int, on_method: Callable[[str], None] | None = None) -> dict:
    """For each method: kept tokens per layer and position bin, and the heat-map row.

    ``kept_fraction[b]`` is the fraction of (layer, KV head, position) slots of bin b that the cache
    still holds at the end of the prompt: the mean over layers and heads of TreeKV Figure 1's 0/1 map.
    """
    length = ids.shape[0]
    edges = bin_edges(length, bins)
    widths = torch.tensor(edges[1:], dtype=torch.float64) - torch.tensor(edges[:-1], dtype=torch.float64)
    out: dict = {"cache": cache_size, "block": block, "bin_edges": edges, "methods": {}}
    for name, method in methods.items():
        if on_method:
            on_method(name)
        started = time.perf_counter()
        kept, budgets = kept_positions(model, ids, method, None if name == "full" else cache_size, block)
        counts = [position_counts(token_idx, edges) for token_idx in kept]
        kv_heads = kept[0].shape[0]
        fraction = torch.tensor(counts, dtype=torch.float64).sum(dim=0) / (widths * kv_heads * len(kept))
        out["methods"][name] = {
            "budgets": budgets,
            "cache_tokens": [int(t.shape[1]) for t in kept],
            "kv_heads": kv_heads,
            "counts": counts,
            "kept_fraction": _rounded(fraction),
            "seconds": round(time.perf_counter() - started, 3),
        }
    return out


# --- 4. Haar wavelets (TreeKV section 3.3) ---------------------------------------------------------------


def haar_step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One level of the Haar DWT along the last dimension, with TreeKV section 3.2's filters.

    ``g = (√2/2, √2/2)`` and ``h = (-√2/2, √2/2)`` give, for each pair ``(x[2n], x[2n+1])``,
    ``A[n] = (x[2n] + x[2n+1]) / √2`` and ``D[n] = (x[2n] - x[2n+1]) / √2``.
    """
    if x.shape[-1] % 2:
        raise ValueError("a Haar step needs an even length")
    even, odd = x[..., 0::2], x[..., 1::2]
    return (even + odd) / SQRT2, (even - odd) / SQRT2


def haar_inverse_step(approx: torch.Tensor, detail: torch.Tensor) -> torch.Tensor:
    """The paper's single-level reconstruction R(A, D): ``x[2n] = (A + D) / √2``, ``x[2n+1] = (A - D) / √2``."""
    out = approx.new_empty((*approx.shape[:-1], 2 * approx.shape[-1]))
    out[..., 0::2] = (approx + detail) / SQRT2
    out[..., 1::2] = (approx - detail) / SQRT2
    return out


def haar_dwt(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Multi-level Haar DWT along the last dimension: ``(A_L, [D_1, ..., D_L])``, D_1 the highest frequency."""
    if x.shape[-1] % (2 ** levels):
        raise ValueError(f"length {x.shape[-1]} is not a multiple of 2**{levels}")
    details = []
    approx = x
    for _ in range(levels):
        approx, detail = haar_step(approx)
        details.append(detail)
    return approx, details


def haar_idwt(approx: torch.Tensor, details: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`haar_dwt`: apply R from the deepest level up."""
    x = approx
    for detail in reversed(details):
        x = haar_inverse_step(x, detail)
    return x


def detail_reconstruction(detail: torch.Tensor, level: int) -> torch.Tensor:
    """TreeKV's ``Rec(D_l) = R(R(...R(0, D_l)..., 0), 0)``: level l's detail alone, back at full length."""
    x = haar_inverse_step(torch.zeros_like(detail), detail)
    for _ in range(level - 1):
        x = haar_inverse_step(x, torch.zeros_like(x))
    return x


def wavelet_magnitudes(sample: AttentionSample, levels: int = 5) -> tuple[torch.Tensor, int]:
    """Mean magnitude of ``Rec(D_l)`` at every position, over layers and heads: ``([levels, T'], start)``.

    TreeKV's signal is ``s = a^(t) ∘ V^(t)``: each position's value vector weighted by the attention the
    last query pays it (the terms whose sum is the attention output). It is decomposed along the
    sequence, per head and channel; the magnitude at a position is the L2 norm over the head's
    channels. The DWT needs a multiple of ``2**levels`` positions, so the oldest ``T mod 2**levels``
    (fewer than 32 at 5 levels, inside the sink region the paper leaves out) are dropped; ``start``
    is the first position kept.
    """
    length = sample.probs[0].shape[-1]
    start = length % (2 ** levels)
    total = torch.zeros(levels, length - start, dtype=torch.float64)
    count = 0
    for probs, values in zip(sample.probs, sample.values, strict=True):
        group = probs.shape[0] // values.shape[0]
        last = probs[:, -1, start:]  # [H, T'] the last query's attention
        signal = last[:, :, None] * values[:, start:].repeat_interleave(group, dim=0)  # [H, T', D]
        _, details = haar_dwt(signal.transpose(1, 2), levels)  # along positions, per channel
        for level, detail in enumerate(details, start=1):
            total[level - 1] += detail_reconstruction(detail, level).norm(dim=1).double().sum(dim=0)
        count += probs.shape[0]
    return total / count, start


def wavelet_report(sample: AttentionSample, levels: int = 5, points: int = 64, edge: int = 32) -> dict:
    """Per detail level, the magnitude curve averaged into at most ``points`` position bins."""
    magnitudes, start = wavelet_magnitudes(sample, levels)
    length = sample.probs[0].shape[-1]
    edges = [start + e for e in bin_edges(length - start, points)]
    curves = {}
    for level in range(levels):
        row = magnitudes[level]
        curves[f"D{level + 1}"] = _rounded(torch.stack([row[a - start:b - start].mean()
                                                        for a, b in zip(edges[:-1], edges[1:], strict=True)]), 6)
    return {
        "signal": "a ∘ V of the last query (attention-weighted values), per head",
        "wavelet": "haar",
        "levels": levels,
        "start": start,
        "edge": edge,
        "bin_edges": edges,
        "magnitude": curves,
    }


# --- the whole analysis --------------------------------------------------------------------------------


def analyze(model: torch.nn.Module, ids: torch.Tensor, methods: dict[str, Method], *, cache_size: int,
            block: int = 256, queries: int = 64, levels: int = 5, bins: int = 128, threshold: float = 0.5,
            on_step: Callable[[str], None] | None = None) -> dict:
    """Run the four analyses on prompt ``ids`` ``[T]`` and return one JSON-ready dictionary.

    Attention is recorded once and reduced (entropy, similarity, wavelets) before the methods
    stream the prompt, so the sample's memory is freed before the engine runs.
    """
    say = on_step or (lambda message: None)
    timings = {}
    started = time.perf_counter()
    say("recording attention")
    sample = record_attention(model, ids, queries)
    timings["record"] = time.perf_counter() - started
    tick = time.perf_counter()
    profile = attention_profile(sample)
    say("comparing layers")
    similarity = similarity_report(sample, threshold)
    wavelet = wavelet_report(sample, levels)
    timings["statistics"] = time.perf_counter() - tick
    config = model.config
    attention = {"layers": len(sample.probs), "heads": sample.probs[0].shape[0],
                 "kv_heads": sample.values[0].shape[0], "query_positions": sample.rows.tolist(), **profile}
    del sample
    tick = time.perf_counter()
    positions = positions_report(model, ids, methods, cache_size, block, bins,
                                 on_method=lambda name: say(f"streaming with {name}"))
    timings["positions"] = time.perf_counter() - tick
    return {
        "tokens": int(ids.shape[0]),
        "queries": len(attention["query_positions"]),
        "trained_context": int(getattr(config, "max_position_embeddings", 0) or 0),
        "attention": attention,
        "similarity": similarity,
        "positions": positions,
        "wavelet": wavelet,
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }


def _rounded(tensor: torch.Tensor, digits: int = 4):
    """Nested lists of floats rounded for a compact JSON file."""
    if tensor.dim() == 0:
        return round(float(tensor), digits)
    return [_rounded(t, digits) for t in tensor] if tensor.dim() > 1 else [round(float(v), digits) for v in tensor]


# --- text summary and plots ----------------------------------------------------------------------------


def summary_lines(result: dict) -> list[str]:
    """A few lines that say what the analysis found, for stdout."""
    att, sim, pos, wav = result["attention"], result["similarity"], result["positions"], result["wavelet"]
    layers = att["layers"]
    third = max(1, layers // 3)
    entropy = att["layer_entropy_bits"]
    keys = att["layer_keys_fraction"]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    rho = att["entropy_vs_depth_spearman"]
    rho = float("nan") if rho is None else rho  # NaN (a single layer) is null in JSON
    trend = "falls with depth (funnels)" if rho < -0.3 else "rises with depth" if rho > 0.3 else "no clear trend"
    lines = [
        f"attention entropy (bits, last {result['queries']} queries, mean over heads): first {third} layers "
        f"{mean(entropy[:third]):.2f}, middle {mean(entropy[third:layers - third] or entropy):.2f}, last {third} "
        f"{mean(entropy[-third:]):.2f}; Spearman vs depth {rho:+.2f}: {trend}",
        f"keys holding {att['mass']:.0%} of attention: first {third} layers {mean(keys[:third]):.1%}, last {third} "
        f"{mean(keys[-third:]):.1%} of the visible keys (min {min(keys):.1%} at layer {keys.index(min(keys))}, "
        f"max {max(keys):.1%} at layer {keys.index(max(keys))})",
        f"PoD groups (1 - JS >= {sim['threshold']}) of {layers} layers: per query head {sim['group_counts']}, "
        f"per KV head (majority vote) {sim['kv_group_counts']}, mean matrix {len(sim['mean_matrix_groups'])}",
    ]
    length = result["tokens"]
    quarter_edges = [round(i * length / 4) for i in range(5)]
    lines.append(f"kept positions at cache {pos['cache']} (share of kept tokens in each quarter of the "
                 f"{length:,}-token prompt):")
    edges = pos["bin_edges"]
    for name, row in pos["methods"].items():
        totals = [0.0] * 4
        for b, count in enumerate(torch.tensor(row["counts"]).sum(dim=0).tolist()):
            centre = (edges[b] + edges[b + 1]) / 2
            totals[min(3, sum(centre >= e for e in quarter_edges[1:4]))] += count
        whole = sum(totals) or 1.0
        lines.append(f"  {name:<14} " + "  ".join(f"{t / whole:6.1%}" for t in totals))
    mags = wav["magnitude"]
    w_edges = wav["bin_edges"]
    inside = [i for i in range(len(w_edges) - 1)
              if w_edges[i] >= wav["start"] + wav["edge"] and w_edges[i + 1] <= length - wav["edge"]]
    if len(inside) >= 4:
        head, tail = inside[: len(inside) // 4], inside[-(len(inside) // 4):]
        ratios = ", ".join(f"{name} {mean([c[i] for i in tail]) / max(mean([c[i] for i in head]), 1e-12):.1f}x"
                           for name, c in mags.items())
        lines.append(f"Haar detail magnitude, last quarter / first quarter (edges of {wav['edge']} excluded): "
                     f"{ratios}")
    return lines


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """Draw the four figures from a result dictionary (or a loaded ``analysis.json``); returns the paths."""
    return [plot_entropy(result, out_dir / "entropy.png"), plot_similarity(result, out_dir / "similarity.png"),
            plot_positions(result, out_dir / "positions.png"),
            plot_positions_by_layer(result, out_dir / "positions_by_layer.png"),
            plot_wavelet(result, out_dir / "wavelet.png")]


def plot_entropy(result: dict, path: Path) -> Path:
    """Entropy and sparsity against depth, one thin line per head and the mean in bold."""
    from kvcli.plots import pyplot, save_figure

    plt = pyplot()
    att = result["attention"]
    layers = list(range(att["layers"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    for axis, key, mean_key, title in (
            (left, "entropy_bits", "layer_entropy_bits", "entropy (bits)"),
            (right, "keys_fraction", "layer_keys_fraction", f"share of keys holding {att['mass']:.0%} of attention")):
        for h, row in enumerate(torch.tensor(att[key]).T.tolist()):
            axis.plot(layers, row, color="0.75", linewidth=0.7, label="heads" if h == 0 else None)
        axis.plot(layers, att[mean_key], color="C0", linewidth=2, marker="o", markersize=3, label="mean of heads")
        axis.set_xlabel("layer")
        axis.set_title(title, fontsize=9)
        axis.grid(alpha=0.3)
    right.set_yscale("log")
    right.yaxis.set_major_formatter(lambda value, _: f"{value:.1%}".replace(".0%", "%"))
    left.legend(loc="best", fontsize=8)
    fig.suptitle(f"attention of the last {result['queries']} queries over {result['tokens']:,} tokens", fontsize=10)
    return save_figure(fig, path)


def _grid(count: int) -> tuple[int, int]:
    cols = math.ceil(math.sqrt(count))
    return math.ceil(count / cols), cols


def plot_similarity(result: dict, path: Path) -> Path:
    """The mean similarity matrix and one per head, PoD's groups outlined on the diagonal.

    The grid has one spare cell for the colour bar, which keeps every panel the same size.
    """
    from matplotlib.patches import Rectangle

    from kvcli.plots import pyplot, save_figure

    plt = pyplot()
    sim = result["similarity"]
    group = result["attention"]["heads"] // result["attention"]["kv_heads"]
    panels = [("mean over heads", sim["mean"], sim["mean_matrix_groups"])]
    panels += [(f"head {h} (KV {h // group}): {len(g)} group{'s' if len(g) > 1 else ''}", m, g)
               for h, (m, g) in enumerate(zip(sim["per_head"], sim["groups"], strict=True))]
    rows, cols = _grid(len(panels) + 1)
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols, 2.2 * rows), squeeze=False)
    cells = list(axes.flat)
    image = None
    for axis, (title, matrix, groups) in zip(cells, panels, strict=False):
        image = axis.imshow(matrix, vmin=0, vmax=1, cmap="viridis", origin="lower")
        for group in groups:
            axis.add_patch(Rectangle((group[0] - 0.5, group[0] - 0.5), len(group), len(group), fill=False,
                                     edgecolor="red", linewidth=1.0))
        axis.set_title(title, fontsize=8)
        axis.tick_params(labelsize=6)
    for axis in cells[len(panels):]:
        axis.axis("off")
    bar = cells[len(panels)].inset_axes((0.1, 0.1, 0.08, 0.8))
    fig.colorbar(image, cax=bar, label="1 - JS")
    fig.suptitle(f"inter-layer attention similarity (layer x layer); PoD groups at {sim['threshold']} in red",
                 fontsize=10)
    return save_figure(fig, path)


def plot_positions(result: dict, path: Path) -> Path:
    """Methods x position bins: the fraction of (layer, KV head) slots still holding each bin."""
    from kvcli.plots import pyplot, save_figure

    plt = pyplot()
    pos = result["positions"]
    names = list(pos["methods"])
    matrix = [pos["methods"][n]["kept_fraction"] for n in names]
    fig, axis = plt.subplots(figsize=(9, 0.45 * len(names) + 1.4))
    image = axis.imshow(matrix, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest",
                        extent=(0, result["tokens"], len(names) - 0.5, -0.5))
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("position in the prompt")
    fig.colorbar(image, ax=axis, label="kept (share of layers x heads)")
    axis.set_title(f"positions kept at cache {pos['cache']}, block {pos['block']}", fontsize=10)
    return save_figure(fig, path)


def plot_positions_by_layer(result: dict, path: Path) -> Path:
    """One panel per method, layers x position bins (TreeKV Figure 1's layout), averaged over KV heads."""
    from kvcli.plots import pyplot, save_figure

    plt = pyplot()
    pos = result["positions"]
    edges = torch.tensor(pos["bin_edges"], dtype=torch.float64)
    widths = edges[1:] - edges[:-1]
    names = list(pos["methods"])
    cols = min(len(names), 4)
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.2 * rows), squeeze=False)
    for axis, name in zip(axes.flat, names, strict=False):
        row = pos["methods"][name]
        fraction = torch.tensor(row["counts"], dtype=torch.float64) / (widths * row["kv_heads"])
        axis.imshow(fraction.tolist(), aspect="auto", cmap="Greys", vmin=0, vmax=1, origin="lower",
                    interpolation="nearest", extent=(0, result["tokens"], -0.5, len(row["counts"]) - 0.5))
        axis.set_title(name, fontsize=9)
        axis.tick_params(labelsize=6)
    for axis in list(axes.flat)[len(names):]:
        axis.axis("off")
    for axis in axes[:, 0]:
        axis.set_ylabel("layer", fontsize=8)
    for axis in axes[-1, :]:
        axis.set_xlabel("position", fontsize=8)
    fig.suptitle(f"kept positions per layer at cache {pos['cache']} (dark = kept by every KV head)", fontsize=10)
    return save_figure(fig, path)


def plot_wavelet(result: dict, path: Path) -> Path:
    """Magnitude of each Haar detail level by position, without the first and last ``edge`` tokens."""
    from kvcli.plots import pyplot, save_figure

    plt = pyplot()
    wav = result["wavelet"]
    edges = wav["bin_edges"]
    low, high = wav["start"] + wav["edge"], result["tokens"] - wav["edge"]
    inside = [i for i in range(len(edges) - 1) if edges[i] >= low and edges[i + 1] <= high]
    centres = [(edges[i] + edges[i + 1]) / 2 for i in inside]
    fig, axis = plt.subplots(figsize=(7, 3.6))
    for level, (name, curve) in enumerate(wav["magnitude"].items()):
        axis.plot(centres, [curve[i] for i in inside], label=f"{name} (level {level + 1})", linewidth=1.2)
    axis.set_yscale("log")
    axis.set_xlabel(f"position (first and last {wav['edge']} left out)")
    axis.set_ylabel("mean |Rec(D_l)|")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title("Haar detail magnitude of a ∘ V for the last query (mean over layers and heads)", fontsize=9)
    return save_figure(fig, path)
