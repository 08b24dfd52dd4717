"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs").

Every token carries its accumulated attention: the sum of the attention probabilities that every
query which has seen it paid to it, from all queries of every block (``score_window(n) = n``). The
score lives in the layer's per-token state, so it follows its token through evictions. Each KV
head keeps the sinks, the recent window and its heavy hitters (highest accumulated score).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.io.lazy import torch
from kvcli.methods.base import (
    AUTO_RECENT_HELP,
    ScoredMethod,
    group_mean,
    layer_rows,
    param,
    per_token_rows,
    set_per_token_rows,
)
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView

STATE = "h2o"


@register
@dataclass
class H2O(ScoredMethod):
    name = "h2o"
    keeps_positions = True
    description = ("Heavy hitters: keep the tokens with the largest attention accumulated over every "
                   "query so far (per KV head), plus sinks and the recent window.")
    sinks: int = param(4, "initial tokens always kept (attention sinks)")
    recent: int | None = param(None, AUTO_RECENT_HELP)

    state_names = (STATE,)
    token_states = 1

    def score_window(self, block_len: int) -> int:
        return block_len  # every query of the block adds to the accumulated scores

    def step_scores(self, probs: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return state[STATE].add_(group_mean(probs.flatten(0, 1)))  # as observe_layers

    def observe_layers(self, views: list[LayerView]) -> None:
        if views[0].record is not None:
            # Query heads of a GQA group share one cached token: their attention is averaged, so a
            # score is on the scale of a single head's (the sum would only rescale every token alike).
            fresh = layer_rows([view.record.probs for view in views]).mean(dim=1)
            length = views[0].length
            if fresh.shape[1] != length:
                fresh = fresh[:, :length]
            set_per_token_rows(views, STATE, per_token_rows(views, STATE) + fresh)

    def score_layers(self, views: list[LayerView]) -> torch.Tensor:
        return per_token_rows(views, STATE)
