"""Statistics of a recorded attention sample: entropy and sparsity per layer and head (PyramidKV),
inter-layer similarity and PoD's greedy layer grouping, and the reductions that make them JSON-ready.

Every function takes tensors or an :class:`~kvcli.eval.analysis.record.AttentionSample` and returns
tensors or plain lists and dictionaries, so each can be checked against a slow literal reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcli.eval.analysis.record import AttentionSample
from kvcli.methods.pod.groups import greedy_layer_groups, group_vote

LOG2 = math.log(2.0)


# --- entropy and sparsity (PyramidKV) ----------------------------------------------------------------


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of each distribution along the last dimension (0 log 0 = 0).

    ``p log p`` with the logarithm clamped at 1e-30 rather than ``xlogy``: the same values at a
    fraction of the cost, which matters because the layers x layers similarity matrix takes one
    entropy per pair (the speed-up is in docs/analysis.md, section 2).
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
        "entropy_bits": rounded(entropy_t),
        "entropy_normalized": rounded(torch.stack(normalised)),
        "keys_fraction": rounded(fraction_t),
        "layer_entropy_bits": rounded(entropy_t.mean(dim=1)),
        "layer_keys_fraction": rounded(fraction_t.mean(dim=1)),
        "entropy_vs_depth_spearman": round(spearman(range(len(layer_entropy)), layer_entropy), 4),
    }


# --- inter-layer similarity and PoD's layer grouping ----------------------------------------------


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
        "per_head": rounded(sim),
        "mean": rounded(mean),
        "groups": groups,
        "group_counts": [len(g) for g in groups],
        "kv_groups": kv_groups,
        "kv_group_counts": [len(g) for g in kv_groups],
        "mean_matrix_groups": greedy_layer_groups(mean >= threshold),
    }


# --- reductions shared by the reports -------------------------------------------------------------


def bin_edges(length: int, bins: int) -> list[int]:
    """``bins + 1`` integer edges splitting positions ``0 .. length-1`` into near-equal bins."""
    bins = max(1, min(bins, length))
    return [round(i * length / bins) for i in range(bins + 1)]


def rounded(tensor: torch.Tensor, digits: int = 4):
    """Nested lists of floats rounded for a compact JSON file."""
    if tensor.dim() == 0:
        return round(float(tensor), digits)
    return [rounded(t, digits) for t in tensor] if tensor.dim() > 1 else [round(float(v), digits) for v in tensor]
