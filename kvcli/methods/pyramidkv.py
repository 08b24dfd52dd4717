"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling"): SnapKV's selection under per-layer budgets that shrink from the bottom layer to the top.

Budget allocation (section 4.2.1). Every layer keeps the last alpha tokens (``window``, the
"instruction tokens"; here ``sinks`` + ``recent``, with ``recent`` defaulting to ``window``); what
is left, ``S = budget - sinks - recent`` per layer on average, makes the total
``k_total = m * S`` over the ``m`` layers, spread as an arithmetic sequence::

    k^{m-1} = k_total / (beta * m)          = S / beta          (top layer)
    k^0     = 2 * k_total / m - k^{m-1}     = 2 * S - S / beta  (bottom layer)
    k^l     = k^0 - (k^0 - k^{m-1}) / (m - 1) * l

so that ``sum_l k^l = m * (k^0 + k^{m-1}) / 2 = k_total``. The k^l are computed exactly (rational
arithmetic) and rounded by largest remainder (floors, then one more token to the layers with the
largest fractional parts, ties to the lower layer): the rounded budgets still sum to exactly
``k_total``, stay within one token of the real values and never increase from bottom to top. Layer
``l`` then holds ``sinks + recent + k^l`` tokens, so the budgets average exactly ``budget``
and every layer holds more than the window.

Selection (section 4.2.2) is SnapKV's. The defaults are the paper's (its experiment settings): alpha = 8 as the
observation window and beta = 20. Too small a cache for a pyramid: ``validate`` refuses (one line,
exit 2) a budget whose top layer would select no token at all (``S < beta``); kvpress and the
official code (KVCache-Factory) instead fall back to SnapKV's uniform budgets when the top layer
would select fewer than alpha tokens. At a 30-layer model and cache 256, beta 20 leaves the top
layer 8 + 12 tokens. The ``pyramidkv-beta5`` preset keeps beta 5, a choice of ours beyond the paper
(docs/methods.md).

Beyond the paper too: a reader's question, and after a recap the whole block it ends
(:attr:`LayerView.held`), is the instruction the paper's window stands for, so at the compression with a
question every layer keeps the same share of it, as much as a layer at the mean budget holds
(:meth:`PyramidKV.held`), and the pyramid spreads what is left (:meth:`PyramidKV.kept_count`), so that a small
top layer still holds what the answer is written from (docs/methods.md, "With a reader's question").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING

from kvcli.errors import UsageError
from kvcli.methods.base import check_budget, param, question_tail
from kvcli.methods.registry import register
from kvcli.methods.snapkv import SnapKV

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView


def apportion(shares: list[Fraction], total: int) -> list[int]:
    """Largest remainder: integers summing to ``total``, each within one of ``shares[i]`` (which sum to it).

    Floors first; the tokens still missing go one each to the largest fractional parts, ties to
    the earlier entry. A non-increasing sequence of shares stays non-increasing.
    """
    floors = [math.floor(share) for share in shares]
    missing = total - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[:missing]:
        floors[i] += 1
    return floors


@lru_cache(maxsize=64)
def pyramid_selected(selected_mean: int, num_layers: int, beta: float) -> tuple[int, ...]:
    """PyramidKV's arithmetic sequence k^0 >= ... >= k^{m-1} with mean ``selected_mean``, rounded exactly."""
    if num_layers == 1:
        return (selected_mean,)
    mean = Fraction(selected_mean)
    top = mean / Fraction(beta)
    bottom = 2 * mean - top
    step = (bottom - top) / (num_layers - 1)
    return tuple(apportion([bottom - step * layer for layer in range(num_layers)], selected_mean * num_layers))


@register
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    description = ("SnapKV selection (alpha = `window` = 8) under per-layer budgets decreasing "
                   "arithmetically from bottom to top (`beta` sets the top layer; the paper's 20; our beta 5 is "
                   "the pyramidkv-beta5 preset, beyond the paper), averaging --cache. With a question, "
                   "every layer holds as much of the question and its recap as snapkv's, and the pyramid "
                   "spreads the rest (beyond the paper).")
    window: int = param(8, "observation window alpha: the last queries that score the cache (paper: 8)")
    beta: float = param(20.0, "pyramid shape: the top layer selects (cache - sinks - recent) / beta tokens "
                        "(paper: 20; the pyramidkv-beta5 preset sets 5, beyond the paper)")

    def validate(self, budget: int) -> None:
        super().validate(budget)
        if not self.beta >= 1:
            raise UsageError(f"beta must be >= 1 (got {self.beta}); beta = 1 gives uniform budgets")
        check_budget(budget, self.sinks + self.recent_tokens() + math.ceil(self.beta),
                     "sinks + recent + beta (the top layer selects (cache - sinks - recent) / beta tokens)")

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        self.validate(budget)
        kept = self.sinks + self.recent_tokens()
        return [kept + selected for selected in pyramid_selected(budget - kept, num_layers, self.beta)]

    def held(self, view: LayerView) -> int:
        """Tokens of the reader's held block (:attr:`LayerView.held`) every layer keeps: what a layer at the mean
        budget holds of it (:func:`kvcli.methods.base.question_tail`), at least the window; 0 without a question."""
        if not view.held or view.mean_budget is None:
            return 0
        mean = view.mean_budget
        return max(question_tail(view, mean, mean, self.sinks), self.recent_tokens())

    def kept_count(self, view: LayerView, budget: int) -> int:
        """The layer's budget; at the compression with a question, the held block (:meth:`held`) and the layer's
        share of a pyramid over what is left of the mean budget, so that the budgets still average it."""
        held = self.held(view)
        if not held:
            return budget
        kept = self.sinks + held
        rest = max(view.mean_budget - kept, 0)
        return kept + pyramid_selected(rest, view.num_layers, self.beta)[view.layer_idx]

    def _protected_span(self, view: LayerView, budget: int, count: int) -> tuple[int, int, int]:
        held = self.held(view)
        if not held:
            return super()._protected_span(view, budget, count)
        return view.length, self.sinks, held
