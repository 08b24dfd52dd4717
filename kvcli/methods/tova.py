"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): Token Omission Via Attention.

Only the last query votes: its attention probabilities, averaged over every query head of the
layer, rank the cached tokens, and the layer keeps the best ones, the same choice for every KV
head. The original evicts the single lowest token at each decoding step and keeps no window; here
a block of any size is cut back to the budget at once, and the fair split of the other baselines
(sinks + recent window + selected) applies by default. ``-o sinks=0 -o recent=0`` is the original.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.io.lazy import torch
from kvcli.methods.base import AUTO_RECENT_HELP, ScoredMethod, param
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView


@register
@dataclass
class TOVA(ScoredMethod):
    name = "tova"
    keeps_positions = True
    description = ("Keep the tokens the last query attends to most, averaged over all heads of the layer "
                   "(one choice per layer), plus sinks and the recent window.")
    sinks: int = param(4, "initial tokens always kept (0 with recent=0: the original TOVA)")
    recent: int | None = param(None, AUTO_RECENT_HELP)

    def score_window(self, block_len: int) -> int:
        return 1

    def step_scores(self, probs: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return probs.mean(dim=(1, 2))  # every query head of each layer, as score_layers

    def score_layers(self, views: list[LayerView]) -> torch.Tensor:
        if views[0].record is None:
            raise RuntimeError("tova needs the attention of the last query")
        length = views[0].length
        if len(views) == 1:
            probs = views[0].record.probs
            return (probs if probs.shape[-1] == length else probs[..., :length]).mean(dim=(0, 1))[None, :]
        probs = torch.stack([view.record.probs for view in views])  # [L, H_kv, group, T]
        if probs.shape[-1] != length:
            probs = probs[..., :length]
        return probs.mean(dim=(1, 2))  # every query head of each layer: one row per layer
