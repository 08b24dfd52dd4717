"""PyramidInfer (Yang et al., 2024, "PyramidInfer: Pyramid KV Cache Compression for High-throughput LLM
Inference"), Algorithm 1, adapted to a stream with a bounded cache.

Per layer ``l`` and KV head, every cached token carries a weighted sum of the attention that the
recent queries paid to it (Algorithm 1's ``weighted_avg(A[-L:, :-L])``), and the layer keeps its
pivotal contexts (PvCs): the sinks, the recent window, and the best-scoring tokens, as many as

    min(S_l, max(min_len, ceil(f_l * (seen - sinks - recent))))

where ``seen`` is the number of stream tokens read so far and ``f_l`` the fraction layer ``l``
retains. That is Algorithm 1's retention: the top-p fraction of the context, ``p`` shrinking by a
decay ratio from one layer to the next, never cutting below ``min_len`` (N_l, the same for every
layer), applied to the whole context read so far, so a stream streamed in blocks of 256 or decoded
one token at a time retains the same fraction. (Taking p of the current cache at every compression
instead would make the cache size depend on the block size and collapse to ``min_len`` within a few
hundred decoding steps.)

Schedule. ``f_l = p * r_1 * ... * r_l``. The paper's text multiplies by one ratio per layer
(``schedule=geometric``: ``r_i = decay``, so ``f_l = p * decay**l``). The authors' released code
eases the ratio along a half cosine, ``r_i = decay + (1 - decay) * (1 + cos(pi * i / layers)) / 2``:
1 at the bottom, ``decay`` at the top (``schedule=cosine``, the default). Lower layers then keep
nearly the whole prompt and the pruning falls on the top layers, which matters to nested reads: a
token reaches the middle layers that retrieve facts only if every layer below passed it on, and the
queries of the lowest layers attend by position more than by content (measured in docs/results.md).

The cache never exceeds its budget: ``S_l``, the selected part of layer ``l``'s budget, is
proportional to ``f_l``, scaled so that the budgets average exactly ``--cache`` (rounded by largest
remainder, see :func:`kvcli.methods.pyramidkv.apportion`); the budget wins over ``min_len`` when
they disagree.

Weighting. The attention record holds the SUM over the last ``window`` queries of a block (L),
so within one block those queries weigh alike. Across blocks the scores decay: a query ``d``
queries older than the newest weighs ``gamma**d``. Each compression multiplies the stored scores
by ``gamma**n`` (n = new tokens) and adds ``c_w`` times the window's summed attention, where
``c_w = mean(gamma**a for a < w)`` is the mean weight of the block's ``w`` window queries. With
decoding (n = 1) this is exactly the geometric weighting of the recent queries, latest weighing
most, over an effective window of ``1 / (1 - gamma)`` (~33 queries at the default 0.97, about L);
with blocks of n >= 256 the previous blocks fade to nothing (0.97**256 < 1e-3), as in Algorithm 1,
whose L recent queries all sit in the current block. The scores are not divided by the total weight:
a candidate is older than the recent window, so it missed at most the queries older than itself,
whose weight is below ``gamma**recent``, and the ranking is that of the weighted average.

Defaults where the paper's Algorithm 1 gives no number: L = 32 queries, gamma = 0.97, p = 1
(layer 0 keeps the whole stream until its budget caps it), decay = 0.95 (the cosine schedule then
keeps about half the context at the top of a 30-layer model, the authors' 0.9 a quarter: the larger
share lets a nested read keep what the top layers retrieve; docs/methods.md has the comparison)
and min_len = 64 (the authors' released configuration uses a minimum context length of 64). The
recent window is ``recent_ratio`` (default 0.2, the authors' released default) of the stream read
so far, capped by the budget split's window (``recent``). The scores are max-pooled over 15
neighbours before TopP (``kernel``), as SnapKV's are: the paper pools nothing, but without it a
number written one digit per token keeps some digits and loses others (``-o kernel=1`` is the
paper's rule).

Heads. By default (``heads=mean``) a layer keeps one token set, scored by the attention averaged over
all its query heads, as the paper and its code do (``attn_weights.mean(dim=1)``). That is what lets a
read nest its layers: hidden states are per token, so layer ``l + 1`` can skip the tokens layer ``l``
dropped only if all heads dropped them. A read that needs only the last position (``summarize``,
``ask``, ``needle``) therefore compresses each layer as soon as it has run and hands the next layer
only its pivotal contexts (:meth:`kvcli.engine.engine.Engine.forward` with ``last_only``), which is the
paper's faster prefill. The PvC is the sinks, the recent window and the retained fraction without the
budget's cap (:meth:`PyramidInfer.passed_count`); the layer stores the first ``kept_count`` of the same
ranking, so its cache is within its budget and always among its PvC, and PvCs nest layer on layer.
``heads=kv`` lets each KV head choose alone (its query heads averaged); a nested read then hands the
next layer the union of the heads' PvCs. ``kvcli ppl`` never nests: every token needs its logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from kvcli.errors import UsageError
from kvcli.io.lazy import torch
from kvcli.methods.base import (
    ScoredMethod,
    Split,
    check_split,
    layer_rows,
    pad_tokens,
    param,
    past_lengths,
    per_token_rows,
    pool_scores,
    recorded_probs,
    select_top,
    set_per_token_rows,
)
from kvcli.methods.pyramidkv import apportion
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView

STATE = "pyramidinfer"


def cosine_ratio(layer_idx: int, num_layers: int, decay: float) -> float:
    """The cosine schedule's ratio between what layer ``layer_idx`` and the layer below retain: 1 at
    layer 0, easing along a half cosine to ``decay`` at the top (the authors' released code)."""
    return decay + (1 - decay) * (1 + math.cos(math.pi * layer_idx / num_layers)) / 2


def retained_fractions(num_layers: int, p: float, decay: float, schedule: str) -> list[float]:
    """Fraction of the context each layer retains: ``p`` times the ratios of layers ``1..l``."""
    if schedule == "geometric":
        return [p * decay**layer for layer in range(num_layers)]
    fractions, fraction = [], p
    for layer in range(num_layers):
        fraction *= cosine_ratio(layer, num_layers, decay)
        fractions.append(fraction)
    return fractions


def decaying_selected(selected_mean: int, num_layers: int, decay: float, schedule: str) -> list[int]:
    """Selected budgets proportional to each layer's retained fraction, averaging ``selected_mean`` exactly."""
    if schedule == "geometric":
        weights = [Fraction(decay) ** layer for layer in range(num_layers)]
    else:
        weights = [Fraction(f) for f in retained_fractions(num_layers, 1.0, decay, schedule)]
    total = selected_mean * num_layers
    norm = sum(weights)
    return apportion([total * weight / norm for weight in weights], total)


def window_weight(window: int, gamma: float) -> float:
    """Mean of ``gamma**a`` over the ages ``a < window`` of a block's window queries."""
    return sum(gamma**age for age in range(window)) / window


HEADS = ("mean", "kv")
SCHEDULES = ("cosine", "geometric")


@register
@dataclass
class PyramidInfer(ScoredMethod):
    name = "pyramidinfer"
    keeps_positions = True
    token_states = 1  # the recency-weighted score (STATE)
    description = ("Keep the tokens the recent queries attend to most (recency-weighted): a fraction of the stream "
                   "shrinking with depth (cosine schedule, at least min_len), under budgets that shrink alike; a read "
                   "nests the layers (each processes only what the one below kept).")
    window: int = param(32, "recent queries L whose attention scores the cache")
    gamma: float = param(0.97, "weight ratio per query of age: a query d steps older weighs gamma**d")
    p: float = param(1.0, "fraction of the stream layer 0 retains (before the budget caps it)")
    decay: float = param(0.95, "per-layer ratio of both the retained fraction and the budget (geometric), or the "
                               "top layer's ratio (cosine)")
    schedule: str = param("cosine", "cosine: the ratio eases from 1 at layer 0 to decay at the top, so lower layers "
                                    "keep nearly all (the authors' code); geometric: decay in every layer (the paper's "
                                    "text)")
    min_len: int = param(64, "min PvC length N_l: selected tokens a layer always keeps (budget allowing)")
    sinks: int = param(4, "initial tokens always kept (attention sinks)")
    recent: int | None = param(None, "most recent tokens kept at most (auto: cache - sinks - cache // 2; "
                                     "4 + 508 + 512 at 1024); recent_ratio may keep fewer")
    recent_ratio: float = param(0.2, "recent window as a fraction of the stream read so far (the paper's "
                                     "recent sequence ratio), capped by recent")
    heads: str = param("mean", "mean: one token set per layer from the attention averaged over all query "
                               "heads (the paper); kv: each KV head chooses alone (a nested read passes the union)")
    kernel: int = param(15, "max-pooling width (odd) of the scores along the sequence before TopP: 15 keeps a "
                            "number's neighbouring digits, as SnapKV's pooling does; 1 = none (the paper)")
    nest: bool = param(True, "reads that need only the last position hand each layer only the pivotal contexts of "
                             "the layer below (the paper's prefill); false: every layer processes every token")

    def score_window(self, block_len: int) -> int:
        return min(self.window, block_len)

    def validate(self, budget: int) -> None:
        if self.window < 1:
            raise UsageError("window must be at least 1")
        for key in ("gamma", "p", "decay", "recent_ratio"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise UsageError(f"{key} must be in (0, 1] (got {value})")
        if self.min_len < 0:
            raise UsageError("min_len must be >= 0")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UsageError(f"kernel must be an odd number >= 1 (got {self.kernel})")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)} (got {self.schedule!r})")
        if self.heads not in HEADS:
            raise UsageError(f"heads must be one of {', '.join(HEADS)} (got {self.heads!r})")
        check_split(budget, self.sinks, self.recent)

    def selects_per_head(self) -> bool:
        return self.heads == "kv"  # mean: one token set per layer

    def nests(self) -> bool:
        return self.nest

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        self.validate(budget)
        split = Split.of(budget, self.sinks, self.recent)
        kept = split.sinks + split.recent
        selected = decaying_selected(split.selected, num_layers, self.decay, self.schedule)
        return [kept + count for count in selected]

    def retention(self, view: LayerView, recent: int) -> int:
        """Selected tokens the view's layer retains after ``view.seen`` stream tokens, before the budget cap."""
        fraction = retained_fractions(view.num_layers, self.p, self.decay, self.schedule)[view.layer_idx]
        return max(self.min_len, math.ceil(fraction * max(view.seen - self.sinks - recent, 0)))

    def kept_recent(self, view: LayerView, budget: int) -> int:
        """``recent_ratio`` of the stream read so far, at most the window of the average budget's split
        (resolved from the average budget, not from the layer's: every layer keeps the same window)."""
        cap = Split.of(view.mean_budget or budget, self.sinks, self.recent).recent
        return min(cap, math.ceil(self.recent_ratio * view.seen))

    def kept_count(self, view: LayerView, budget: int) -> int:
        recent = self.kept_recent(view, budget)
        selected = min(budget - self.sinks - recent, self.retention(view, recent))
        return min(view.length, self.sinks + recent) + selected

    def passed_count(self, view: LayerView, budget: int) -> int:
        """The layer's pivotal contexts (PvC): sinks, recent window and the retained fraction, with no
        budget cap. A nested read hands their hidden states to the next layer; the layer itself stores the
        first :meth:`kept_count` of them (the same ranking), so what it stores is always among them."""
        recent = self.kept_recent(view, budget)
        return min(view.length, self.sinks + recent) + self.retention(view, recent)

    def compress_nested(self, view: LayerView, budget: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.observe(view)
        length = view.length
        stored, passed = self.kept_count(view, budget), self.passed_count(view, budget)
        if length <= stored:
            return None, None
        scores = self.score(view)
        protected = self.protected(view, budget, stored)
        keep = select_top(scores, protected, stored).expand(view.num_heads, stored)
        return keep, (None if passed >= length else select_top(scores, protected, passed))

    def observe_layers(self, views: list[LayerView]) -> None:
        record = views[0].record
        if record is not None:
            length, heads = views[0].length, views[0].num_heads
            fresh = layer_rows([view.record.probs for view in views]).mean(dim=1)  # GQA group averaged
            if fresh.shape[1] != length:
                fresh = fresh[:, :length]
            if self.heads == "mean":  # every query head alike (the KV heads' groups are equal in size)
                if len(views) == 1:
                    fresh = fresh.mean(dim=0, keepdim=True).expand_as(fresh)
                else:
                    layers = fresh.view(len(views), heads, length)
                    fresh = layers.mean(dim=1, keepdim=True).expand_as(layers).reshape(len(views) * heads, length)
            decayed = per_token_rows(views, STATE) * self.gamma**views[0].num_new
            set_per_token_rows(views, STATE, decayed + window_weight(record.window, self.gamma) * fresh)

    def score_layers(self, views: list[LayerView]) -> torch.Tensor:
        return pool_scores(per_token_rows(views, STATE), self.kernel, "max")

    def padded_scores(self, views: list[LayerView], width: int) -> torch.Tensor:
        """:meth:`observe_layers` and :meth:`score_layers` of layers of different lengths at once, on rows
        padded to ``width``: the padding holds zeros while scores accumulate, and -inf (what max pooling
        ignores, and never chosen) when they are pooled. Each layer keeps its own rows, unpadded."""
        states = [view.layer.state.get(STATE) for view in views]
        if views[0].record is None or any(state is None for state in states):
            return super().padded_scores(views, width)  # no record to fold in, or a layer's first block
        heads, count = views[0].num_heads, len(views)
        fresh = layer_rows([pad_tokens(recorded_probs(view), width, 0.0) for view in views]).mean(dim=1)  # GQA mean
        if self.heads == "mean":
            layers = fresh.view(count, heads, width)
            fresh = layers.mean(dim=1, keepdim=True).expand_as(layers).reshape(count * heads, width)
        decayed = layer_rows([pad_tokens(state, width, 0.0) for state in states]) * self.gamma**views[0].num_new
        state = decayed + window_weight(views[0].record.window, self.gamma) * fresh
        for view, rows in zip(views, state.split(heads), strict=True):
            view.set_per_token(STATE, rows[:, : view.length])
        padding = past_lengths(tuple(view.length for view in views), heads, width, state.device)
        return pool_scores(state.masked_fill(padding, float("-inf")), self.kernel, "max").masked_fill_(
            padding, float("-inf"))
