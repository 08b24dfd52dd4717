"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You Are Looking for Before Generation").

The last ``window`` queries of a block (the observation window) vote for the earlier keys: their
attention, summed over the window and averaged over the query heads of each KV head (GQA), is
smoothed along the sequence by a 1D pooling of width ``kernel``, and each KV head keeps its own
top-scoring tokens next to the window tokens themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.errors import UsageError
from kvcli.lazy import torch
from kvcli.methods.base import ScoredMethod, check_split, group_mean, param, pool_scores
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.cache import LayerView


def check_pooling(window: int, kernel: int, pooling: str) -> None:
    if window < 1:
        raise UsageError("window must be at least 1")
    if kernel < 1 or kernel % 2 == 0:
        raise UsageError(f"kernel must be an odd number >= 1 (got {kernel})")
    if pooling not in ("max", "avg"):
        raise UsageError(f"pooling must be 'max' or 'avg' (got {pooling!r})")


def slide_window(view: LayerView, sinks: int, recent: int) -> torch.Tensor:
    """Decoding: the prompt's selection stays and only the recent window slides.

    SnapKV and PyramidKV compress the prompt once and let the cache grow while writing; under a
    fixed budget the closest rule evicts the one token that has just left the window. Re-selecting
    with one query at every step instead drops tokens the next steps need (the later digits of a
    number being copied out): see docs/methods.md.
    """
    length, heads = view.length, view.num_heads
    leaving = max(length - recent - 1, min(sinks, length - 1))
    kept = torch.arange(length - 1, device=view.layer.device)
    return (kept + (kept >= leaving).long()).expand(heads, length - 1)


@register
@dataclass
class SnapKV(ScoredMethod):
    name = "snapkv"
    keeps_positions = True
    description = ("Keep the tokens the last `window` queries attend to most (pooled over `kernel` "
                   "neighbours, per KV head) plus the window itself.")
    window: int = param(32, "observation window: how many of a block's last queries score the cache")
    kernel: int = param(15, "pooling width along the sequence (odd; 1 = no pooling; the paper's code uses 7)")
    pooling: str = param("max", "pooling of the scores: max or avg")
    sinks: int = param(0, "initial tokens always kept (the paper keeps none)")
    recent: int | None = param(None, "most recent tokens always kept (default: the window)")

    def recent_tokens(self) -> int:
        return self.window if self.recent is None else self.recent

    def kept_recent(self, view: LayerView, budget: int) -> int:
        return self.recent_tokens()

    def score_window(self, block_len: int) -> int:
        return min(self.window, block_len)

    def validate(self, budget: int) -> None:
        check_pooling(self.window, self.kernel, self.pooling)
        check_split(budget, self.sinks, self.recent_tokens())

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        recent = self.recent_tokens()
        if view.decoding and recent > 0 and view.length - budget == 1:
            return slide_window(view, self.sinks, recent)
        return super().compress(view, budget)

    def score(self, view: LayerView) -> torch.Tensor:
        """The window's attention, pooled over every key the whole window saw.

        The window keys (the last ``min(window, num_new)`` tokens, which only part of the window saw)
        are left out of the pooling, as in SnapKV, and compete with their raw score if ``recent`` does
        not cover them.
        """
        if view.record is None:
            raise RuntimeError("snapkv-style selection needs the attention of the observation window")
        length = view.length
        scores = group_mean(view.record.probs)[:, :length]
        prefix = length - min(self.window, view.num_new, length)
        return torch.cat((pool_scores(scores[:, :prefix], self.kernel, self.pooling), scores[:, prefix:]), dim=1)
