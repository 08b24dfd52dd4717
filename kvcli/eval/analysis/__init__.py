"""What the attention of a model looks like on one prompt, and what each compression method keeps of it.

``kvcli analyze`` runs a prompt that fits in memory once through the model and measures four things
the papers behind kvcli's methods build on:

1. **Entropy and sparsity per layer and head** (PyramidKV section 3, *pyramidal information
   funneling*): if attention spreads widely in low layers and concentrates in high ones, a pyramid
   of budgets spends the cache where it is needed (:mod:`kvcli.eval.analysis.statistics`).
2. **Inter-layer attention similarity per head and PoD's greedy layer grouping** (PoD section 2.1,
   Eq. 2 and Algorithm 1): consecutive layers whose attention distributions agree can share them
   (:mod:`kvcli.eval.analysis.statistics`).
3. **Positions each method keeps** at a given budget (TreeKV Figure 1): regional biases of the
   scoring methods next to TreeKV's sparse-past, dense-present structure (:mod:`kvcli.eval.analysis.positions`).
4. **Haar-wavelet magnitude by position** (TreeKV section 3.3, Figure 2): the signal
   ``s = a ∘ V`` of the last query, decomposed into detail levels, grows towards the end of the
   sequence, which is what motivates a cache that is sparse on the left and dense on the right
   (:mod:`kvcli.eval.analysis.wavelets`).

The attention is recorded once (:mod:`kvcli.eval.analysis.record`) and the figures are drawn by
:mod:`kvcli.eval.analysis.plots`. Everything is a plain function of tensors or of the JSON-ready result
dictionary, so the statistics can be checked against slow references and the plots redrawn from
``analysis.json``. This module runs the whole analysis and re-exports the public names of the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvcli.eval.analysis.plots import (
    plot_entropy,
    plot_positions,
    plot_positions_by_layer,
    plot_similarity,
    plot_wavelet,
    write_plots,
)
from kvcli.eval.analysis.positions import kept_positions, position_counts, positions_report
from kvcli.eval.analysis.record import (
    RECORDER_KWARG,
    RECORDING_ATTENTION,
    AttentionRecorder,
    AttentionSample,
    query_rows,
    record_attention,
    recording_attention,
    sampled_attention,
)
from kvcli.eval.analysis.statistics import (
    LOG2,
    attention_profile,
    bin_edges,
    entropy_bits,
    greedy_layer_groups,
    group_vote,
    js_divergence,
    keys_for_mass,
    layer_similarity,
    similarity_report,
    spearman,
)
from kvcli.eval.analysis.wavelets import (
    SQRT2,
    detail_reconstruction,
    haar_dwt,
    haar_idwt,
    haar_inverse_step,
    haar_step,
    wavelet_magnitudes,
    wavelet_report,
)
from kvcli.methods.base import Method

__all__ = [
    "DEFAULT_METHODS",
    "LOG2",
    "RECORDER_KWARG",
    "RECORDING_ATTENTION",
    "SQRT2",
    "AttentionRecorder",
    "AttentionSample",
    "analyze",
    "attention_profile",
    "bin_edges",
    "detail_reconstruction",
    "entropy_bits",
    "greedy_layer_groups",
    "group_vote",
    "haar_dwt",
    "haar_idwt",
    "haar_inverse_step",
    "haar_step",
    "js_divergence",
    "kept_positions",
    "keys_for_mass",
    "layer_similarity",
    "plot_entropy",
    "plot_positions",
    "plot_positions_by_layer",
    "plot_similarity",
    "plot_wavelet",
    "position_counts",
    "positions_report",
    "query_rows",
    "record_attention",
    "recording_attention",
    "sampled_attention",
    "similarity_report",
    "spearman",
    "wavelet_magnitudes",
    "wavelet_report",
    "write_plots",
]

DEFAULT_METHODS = ("streamingllm", "h2o", "snapkv", "tova", "treekv", "pyramidkv", "pyramidinfer")


def analyze(model: torch.nn.Module, ids: torch.Tensor, methods: dict[str, Method], *, budget: int,
            block: int = 256, queries: int = 64, levels: int = 5, bins: int = 128, threshold: float = 0.5,
            on_step: Callable[[str], None] | None = None) -> dict:
    """Run the four analyses on prompt ``ids`` ``[T]`` and return one JSON-ready dictionary.

    ``budget`` is the tokens per layer each method may keep while it streams the prompt (unbounded
    methods ignore it; the result records it under ``positions.cache``). Attention is recorded once
    and reduced (entropy, similarity, wavelets) before the methods stream the prompt, so the
    sample's memory is freed before the engine runs.
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
    positions = positions_report(model, ids, methods, budget, block, bins,
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
