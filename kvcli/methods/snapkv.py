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
from kvcli.io.lazy import torch
from kvcli.methods.base import (
    ScoredMethod,
    check_split,
    layer_rows,
    pad_tokens,
    param,
    past_lengths,
    pool_scores,
    recorded_probs,
)
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView


def check_pooling(window: int, kernel: int, pooling: str) -> None:
    if window < 1:
        raise UsageError("window must be at least 1")
    if kernel < 1 or kernel % 2 == 0:
        raise UsageError(f"kernel must be an odd number >= 1 (got {kernel})")
    if pooling not in ("max", "avg"):
        raise UsageError(f"pooling must be 'max' or 'avg' (got {pooling!r})")


@register
@dataclass
class SnapKV(ScoredMethod):
    name = "snapkv"
    keeps_positions = True
    # The papers (and their code) compress the prompt once and let the cache grow while writing. Any
    # eviction while writing takes the question or what is being copied out: the recent window's oldest
    # (the question first) or a re-selection by one query (the later digits of a number).
    keeps_answer = True
    description = ("Keep the tokens the last `window` queries attend to most (pooled over `kernel` "
                   "neighbours, per KV head) plus the window itself. Reading with a question (ask): the "
                   "question's queries are the window and the question, with the recap read before it, is kept "
                   "(beyond the paper).")
    window: int = param(32, "observation window: how many of a block's last queries score the cache")
    kernel: int = param(15, "pooling width along the sequence (odd; 1 = no pooling; SnapKV's code and kvpress "
                            "pool 5 with avg, KVCache-Factory 7 with max)")
    pooling: str = param("max", "pooling of the scores: max or avg")
    sinks: int = param(0, "initial tokens always kept (the paper keeps none)")
    recent: int | None = param(None, "most recent tokens always kept (default: the window)")
    share: str = param("head", "who selects: head (each KV head its own tokens, the paper) or layer (a layer's "
                       "heads keep the tokens any of them scores highest; beyond the paper)")

    def selects_per_head(self) -> bool:
        return self.share == "head"

    def _shared(self, scores: torch.Tensor, layers: int) -> torch.Tensor:
        """Scores ``[L * H, T]`` as the method selects with them: per KV head, or (``share=layer``) one row
        per layer, each token's highest score over its heads. A layer's heads then keep the same tokens:
        a key only some heads' queries find stays in all of them (docs/methods.md)."""
        if self.share == "head":
            return scores
        return scores.view(layers, -1, scores.shape[-1]).amax(dim=1)

    def recent_tokens(self) -> int:
        return self.window if self.recent is None else self.recent

    def kept_recent(self, view: LayerView, budget: int) -> int:
        return self.recent_tokens()

    def score_window(self, block_len: int) -> int:
        return min(self.window, block_len)

    def validate(self, budget: int) -> None:
        if self.share not in ("head", "layer"):
            raise UsageError(f"share must be head or layer (got {self.share!r})")
        check_pooling(self.window, self.kernel, self.pooling)
        check_split(budget, self.sinks, self.recent_tokens())

    def score_layers(self, views: list[LayerView]) -> torch.Tensor:
        """The window's attention, pooled over every key the whole window saw.

        The window keys (the block's last tokens as many as its own recorded queries, which only part
        of the window saw; a probe's queries see every key)
        are left out of the pooling, as in SnapKV, and compete with their raw score if ``recent`` does
        not cover them.
        """
        view = views[0]
        if view.record is None:
            raise RuntimeError("snapkv-style selection needs the attention of the observation window")
        length = view.length
        scores = layer_rows([v.record.probs for v in views]).mean(dim=1)  # GQA group averaged
        if scores.shape[1] != length:
            scores = scores[:, :length]
        prefix = length - min(view.record.own_window + view.record.skip, view.num_new, length)
        return self._shared(torch.cat((pool_scores(scores[:, :prefix], self.kernel, self.pooling), scores[:, prefix:]),
                                      dim=1), len(views))

    def padded_scores(self, views: list[LayerView], width: int) -> torch.Tensor:
        """:meth:`score_layers` of layers of different lengths at once, rows padded with -inf to ``width``.

        Each layer's window keys are filled with what pooling ignores (-inf for max, 0 for avg, which
        counts its padding as zeros) so that one pooling of all rows equals pooling each layer's prefix
        alone, and then get their raw scores back."""
        if any(view.record is None for view in views):
            raise RuntimeError("snapkv-style selection needs the attention of the observation window")
        scores = layer_rows([pad_tokens(recorded_probs(view), width, float("-inf")) for view in views]).mean(dim=1)
        if self.kernel <= 1:
            return self._shared(scores, len(views))
        prefixes = tuple(view.length - min(view.record.own_window + view.record.skip, view.num_new, view.length)
                         for view in views)
        unpooled = past_lengths(prefixes, views[0].num_heads, width, scores.device)  # each layer's window on
        neutral = float("-inf") if self.pooling == "max" else 0.0
        pooled = pool_scores(scores.masked_fill(unpooled, neutral), self.kernel, self.pooling)
        return self._shared(torch.where(unpooled, scores, pooled), len(views))
