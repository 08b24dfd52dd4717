"""TreeKV (He et al., "Smooth Key-Value Cache Compression with Tree Structures"): pairwise eviction, sweeping.

The cache is ``sinks + tree region + recent``. Tokens leave the recent window into the tree region
(capacity ``selected``); whenever the region holds one token too many, Algorithm 1 of the paper
compares the averaged attention ``S / C`` of the region's ``idx``-th and ``(idx+1)``-th tokens,
evicts the lower one (the ``idx``-th on a tie) and moves ``idx`` one step right, cyclically. Old
tokens are compared again and again as ``idx`` comes round, new ones only once or twice, so the
kept tokens thin out towards the past: a binary-tree-like layout, dense on the right.

Streaming a block of ``n`` tokens evicts ``n`` tokens at once with exactly the decisions that
``n`` single evictions would make on the block's scores, as if the block's tokens had reached
the tree region one at a time. Between two wraps of ``idx`` those evictions compare disjoint
neighbour pairs, so each sweep is one vectorised step (see :func:`pair_rule`). Above one token
per call the pairs are units of ``tree_block`` consecutive tokens (the paper's block-level
prefill, section 4.2), scored by the mean of their tokens' averaged attention.

Algorithm 1 is :func:`accumulate` (lines 6-8: S and C) and :class:`TreeRegion` (lines 9-16: the
evictions, with :func:`pair_rule`); :class:`TreeKV` runs them on every layer of a block.

Beyond the paper, for streamed reads with a question (``kvcli ask``, ``needle``): the pair rule
compares neighbours, so of two adjacent tokens that both matter (the digits of a number) one goes
whenever the sweep meets them. When a block carries a probe, the ``guard`` tree-region tokens around
the question's attention peaks sit out that block's sweep (:class:`QuestionGuard`, docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.errors import UsageError
from kvcli.io.lazy import torch
from kvcli.methods.base import (
    Method,
    Split,
    check_budget,
    group_mean,
    layer_rows,
    param,
    per_token_rows,
    pool_scores,
    select_top,
    set_per_token_rows,
)
from kvcli.methods.batching import alike_groups, place
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView

AUTO_TREE_BLOCK = 16  # unit of block-level eviction when tree_block=0 and a call prefills an empty cache
SCORE = "treekv_s"  # accumulated attention S, per token (gathered with K/V by the cache)
COUNT = "treekv_c"  # how many recorded queries saw each token, C
IDX = "treekv_idx"  # in the layer's method state: 0-based start of the eviction scope, in tokens


def pair_rule(scores: torch.Tensor, capacity: int, steps: int, start: int) -> tuple[torch.Tensor, int]:
    """``steps`` evictions of Algorithm 1 over items in order, ``capacity`` settled then the rest arriving.

    ``scores`` ``[R, N]`` (N >= capacity + steps) scores items per row (a KV head of a layer); items
    ``capacity ...`` arrive one per step. Each step compares the ``idx``-th and ``(idx+1)``-th items
    present (0-based ``idx`` = ``start`` at first), evicts the ``idx+1``-th if the ``idx``-th scores
    higher and the ``idx``-th otherwise, then sets ``idx = (idx + 1) % capacity``. Until ``idx`` wraps,
    step ``j`` of a sweep compares positions ``idx + 2j`` and ``idx + 2j + 1`` of the sequence as it
    stood when the sweep began, so a sweep is one gather and one comparison for every row at once,
    and what survives a sweep is the sequence with each pair replaced by its winner. Returns the
    evicted item indices ``[R, steps]`` (in eviction order) and the next ``idx``.
    """
    rows, device = scores.shape[0], scores.device
    alive = torch.arange(capacity, device=device).expand(rows, capacity)
    evicted = []
    done, idx = 0, start
    while done < steps:
        count = min(steps - done, capacity - idx)
        pending = torch.arange(capacity + done, capacity + done + count, device=device).expand(rows, count)
        seq = torch.cat((alive, pending), dim=1)
        pairs = seq[:, idx: idx + 2 * count]  # the sweep's disjoint neighbour pairs, left then right
        paired = scores.gather(1, pairs).view(rows, count, 2)
        right_loses = paired[..., 0] > paired[..., 1]
        pairs = pairs.view(rows, count, 2)
        left, right = pairs[..., 0], pairs[..., 1]
        evicted.append(torch.where(right_loses, right, left))
        alive = torch.cat((seq[:, :idx], torch.where(right_loses, left, right), seq[:, idx + 2 * count:]), dim=1)
        done += count
        idx = (idx + count) % capacity
    if not evicted:
        return torch.empty((rows, 0), dtype=torch.long, device=device), idx
    return (evicted[0] if len(evicted) == 1 else torch.cat(evicted, dim=1)), idx


def pair_victim(scores: torch.Tensor, counts: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """One eviction of Algorithm 1 in every row: of the tokens at cache indices ``first`` and ``first + 1``
    (``first`` ``[1]`` for all rows or ``[R, 1]``, a tensor so that a static decode step holds it on the
    device), the lower averaged attention ``S / C`` goes, the left one on a tie. ``scores``, ``counts``
    ``[R, T]``; returns the cache index ``[R, 1]``."""
    pair = (first + torch.arange(2, device=scores.device)).expand(scores.shape[0], 2)
    importance = scores.gather(1, pair) / counts.gather(1, pair).clamp_min(1.0)
    return pair[:, :1] + (importance[:, :1] > importance[:, 1:]).long()


@dataclass
class PairStep:
    """TreeKV's eviction while writing (one token per step, :meth:`TreeKV.compress` with one new token) as a
    program of fixed shapes for :class:`kvcli.kv.decode.EvictingCache`, every layer's KV heads as rows, each
    layer's sweep index on the device.

    A step adds its query's attention to ``S`` and one to ``C`` (as :func:`accumulate` does for a
    one-query window), then evicts by :func:`pair_victim` at the tree region's ``idx``-th token.
    """

    sinks: int
    selected: int
    heads: int
    idx: torch.Tensor  # [layers, 1] long: each layer's sweep index, 0-based in the tree region

    names = (SCORE, COUNT)  # the per-token state a step reads and updates

    def victim(self, probs: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        scores = state[SCORE].add_(group_mean(probs.flatten(0, 1)))  # as accumulate
        counts = state[COUNT].add_(1.0)
        gone = pair_victim(scores, counts, (self.idx + self.sinks).repeat_interleave(self.heads, dim=0))
        self.idx.add_(1).remainder_(self.selected)
        return gone

    def written(self) -> list[torch.Tensor]:
        return [self.idx]

    def save(self, method_states: list[dict[str, object]]) -> None:
        """Leave each layer's sweep index where the engine's next compression reads it."""
        for method_state, idx in zip(method_states, self.idx[:, 0].tolist(), strict=True):
            method_state[IDX] = idx


def remove(positions: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``positions`` ``[R, N]`` without the entries at indices ``drop`` ``[R, m]`` (same m per row).

    A stable sort of the drop flags puts each row's kept entries first, in their order: the result's shape
    is known without reading the flags, so a GPU never waits (a boolean index would read its count back).
    """
    flags = torch.zeros(positions.shape, dtype=torch.uint8, device=positions.device)
    flags.scatter_(1, drop, 1)
    kept = flags.argsort(dim=1, stable=True)[:, :positions.shape[1] - drop.shape[1]]
    return positions.gather(1, kept)


def accumulate(views: list[LayerView]) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1, lines 6-8: add the block's attention to S and the number of recorded queries that saw each
    token to C.

    Returns both as rows ``[R, T]``, every layer's heads in turn; each layer keeps its own rows.
    """
    scores, counts = per_token_rows(views, SCORE), per_token_rows(views, COUNT)
    first = views[0]
    record, new, length = first.record, first.num_new, first.length
    if record is None:
        return scores, counts
    probs = layer_rows([view.record.probs for view in views]).mean(dim=1)  # [R, T]: GQA group averaged
    scores = scores + (probs if probs.shape[1] == length else probs[:, :length])
    # The block's own window sees new token j only from block index j on; extra probe queries see all.
    # Its queries are the block's indices first .. first + own - 1 (the last `skip` tokens come after them).
    own = min(record.own_window, new)
    first = new - record.skip - own
    counts = counts + float(record.window)
    if own > 1 or record.skip:  # new token j missed the window's queries before it: min(own, max(0, j - first))
        missed = (torch.arange(new, device=counts.device) - first).clamp(min=0, max=own).float()
        counts[:, length - new:] -= missed
    set_per_token_rows(views, SCORE, scores)
    set_per_token_rows(views, COUNT, counts)
    return scores, counts


@dataclass
class TreeRegion:
    """The tree region ``[lo, hi)`` of ``R`` rows of a cache of ``length`` tokens over its budget (``selected``
    settled tokens, then the ``excess`` ones that arrived), and Algorithm 1's evictions from it, lines 9-16.

    An eviction answers the region's surviving indices ``[R, k]`` (0 at ``lo``, ascending) and the next
    sweep index ``idx`` (0-based in the region); :meth:`kept` turns them into the cache indices to keep.
    """

    lo: int
    hi: int
    length: int
    selected: int
    rows: int
    device: torch.device

    @property
    def excess(self) -> int:
        """Tokens to evict: what the region holds beyond ``selected``."""
        return (self.hi - self.lo) - self.selected

    def everything(self) -> torch.Tensor:
        """Every index of the region, in order, in every row: ``[R, hi - lo]``."""
        return torch.arange(self.hi - self.lo, device=self.device).expand(self.rows, self.hi - self.lo)

    def evict_one(self, scores: torch.Tensor, counts: torch.Tensor, idx: int) -> torch.Tensor:
        """Lines 10-15 once (a decoding step: one comparison, cheaper than a sweep): the cache indices to keep
        ``[R, T - 1]``."""
        gone = pair_victim(scores, counts, torch.arange(self.lo + idx, self.lo + idx + 1, device=self.device))
        kept = torch.arange(self.length - 1, device=self.device).expand(self.rows, self.length - 1)
        return kept + (kept >= gone).long()

    def importance(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Line 10: the averaged attention ``S / C`` of the region's tokens ``[R, hi - lo]``."""
        return scores[:, self.lo:self.hi] / counts[:, self.lo:self.hi].clamp_min(1.0)

    def evict_tokens(self, importance: torch.Tensor, region: torch.Tensor | None, steps: int,
                     idx: int) -> tuple[torch.Tensor, int]:
        """Lines 11-16, ``steps`` times, token by token, over the region's survivors ``region`` (None: all)."""
        in_play = importance if region is None else importance.gather(1, region)
        gone, idx = pair_rule(in_play, self.selected, steps, idx)
        return remove(self.everything() if region is None else region, gone), idx

    def evict_units(self, importance: torch.Tensor, unit: int, units: int, idx: int) -> tuple[torch.Tensor, int]:
        """Lines 11-16, ``units`` times, on units of ``unit`` consecutive tokens scored by their mean importance
        (the paper's block-level eviction, section 4.2): whole units go."""
        capacity = self.selected // unit
        first_unit = idx // unit
        in_play = importance[:, : (capacity + units) * unit]  # settled units, then the arriving ones
        unit_scores = in_play.view(self.rows, capacity + units, unit).mean(-1)
        gone, first_unit = pair_rule(unit_scores, capacity, units, first_unit if first_unit < capacity else 0)
        tokens = (gone[:, :, None] * unit + torch.arange(unit, device=self.device)).flatten(1)
        return remove(self.everything(), tokens), first_unit * unit

    def kept(self, region: torch.Tensor) -> torch.Tensor:
        """The cache indices ``[R, k]`` to keep: the sinks, the region's survivors ``region``, the recent window."""
        sinks = torch.arange(self.lo, device=self.device).expand(self.rows, self.lo)
        recent = torch.arange(self.hi, self.length, device=self.device).expand(self.rows, self.length - self.hi)
        return torch.cat((sinks, region + self.lo, recent), dim=1)


@dataclass
class QuestionGuard:
    """Beyond the paper, for streamed reads with a question (``kvcli ask``, ``needle``): tokens the question
    attends to sit out a block's sweep.

    The pair rule compares neighbours, so of two adjacent tokens that both matter (the digits of a number) one
    goes whenever the sweep meets them. When a block carries a probe (the question's queries), ``guard``
    tree-region tokens per KV head around the probe's attention peaks are left out of that block's evictions
    (see docs/methods.md); the pair rule sweeps the other tokens as if the guarded were not there.
    """

    guard: int
    kernel: int

    def evict_tokens(self, views: list[LayerView], tree: TreeRegion, importance: torch.Tensor, steps: int,
                     idx: int) -> tuple[torch.Tensor, int] | None:
        """:meth:`TreeRegion.evict_tokens` over all of the region but the guarded tokens, or None where nothing
        is guarded (no probe, or ``guard`` 0): then the paper's sweep applies."""
        guarded = self.guarded(views, tree)
        if guarded is None:
            return None
        open_ = remove(tree.everything(), guarded)
        capacity = tree.selected - guarded.shape[1]
        gone, idx = pair_rule(importance.gather(1, open_), capacity, steps, idx % capacity)
        return remove(tree.everything(), open_.gather(1, gone)), idx

    def guarded(self, views: list[LayerView], tree: TreeRegion) -> torch.Tensor | None:
        """Tree-region indices ``[R, g]`` (ascending) around the probe's attention peaks, or None.

        The question's attention to the region (the most any query head of the KV head pays), max-pooled over
        ``kernel`` neighbours so that a peak guards its span, picks the top ``guard`` tokens per KV head (at
        most half the selected part, so the sweep still has room); ties go to the earlier token, as in
        :func:`select_top`. How large it must be is measured in docs/reading.md.
        """
        record = views[0].record
        count = min(self.guard, tree.selected // 2)
        if record is None or record.probe is None or count < 1:
            return None
        # Max, not mean, over the query heads of a KV head: a needle one query head finds is not diluted
        # by the heads that look elsewhere (as the SnapKV reference, which scores per query head).
        probe = layer_rows([view.record.probe for view in views]).amax(dim=1)
        probe = pool_scores(probe[:, tree.lo:tree.hi].float(), self.kernel, "max")
        return select_top(probe, torch.zeros(tree.hi - tree.lo, dtype=torch.bool, device=probe.device), count)


@register
@dataclass
class TreeKV(Method):
    name = "treekv"
    description = ("Sinks + recent window + a tree region thinned by pairwise eviction of the lower averaged "
                   "attention, the pair sweeping from old to new (TreeKV, Algorithm 1).")
    token_states = 2  # the attention summed over the queries that saw each token, and their count (SCORE, COUNT)
    sinks: int = param(4, "initial tokens always kept (attention sinks)")
    recent: int | None = param(None, "most recent tokens always kept; None = what the sinks leave of half the "
                                     "cache (the paper's 4 + 508 + 512 at cache 1024)")
    tree_block: int = param(0, "tokens per eviction unit in the tree region; 0 = auto: 16 when a "
                               "prompt is prefilled in one call (section 4.2), 1 when streaming or decoding")
    window: int = param(32, "last queries of each block whose attention is accumulated (capped by the block)")
    guard: int = param(256, "streamed reads with a question (probe) only: per KV head, this many tree-region "
                           "tokens around the question's attention peaks sit out the block's pair rule; 0 = off")
    kernel: int = param(15, "max-pooling width (odd) of the question's attention when picking guarded tokens")

    def selects_per_head(self) -> bool:
        return True

    def step_eviction(self, budget: int, method_states: list[dict[str, object]], heads: int,
                      device: torch.device) -> PairStep:
        split = Split.of(budget, self.sinks, self.recent)
        idx = [int(state.get(IDX, 0)) % split.selected for state in method_states]
        return PairStep(split.sinks, split.selected, heads, torch.tensor(idx, device=device)[:, None])

    def score_window(self, block_len: int) -> int:
        return min(self.window, block_len)

    def validate(self, budget: int) -> None:
        if self.sinks < 0 or (self.recent is not None and self.recent < 0) or self.tree_block < 0:
            raise UsageError("treekv: sinks, recent and tree_block must not be negative")
        if self.window < 1:
            raise UsageError("treekv: window must be at least 1")
        if self.guard < 0 or self.kernel < 1 or self.kernel % 2 == 0:
            raise UsageError("treekv: guard must be >= 0 and kernel an odd number >= 1")
        need = max(1, self.tree_block)
        what = f"sinks ({self.sinks}) + recent + {need} selected token{'s' if need > 1 else ''}"
        if self.recent is None:  # selected = min(cache // 2, cache - sinks) must reach `need`
            check_budget(budget, max(2 * need, self.sinks + need), what + " (recent = auto)")
        else:
            check_budget(budget, self.sinks + self.recent + need, what)

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        return self._compress_group([view], budget)[0]

    def compress_layers(self, views: list[LayerView], budgets: list[int]) -> list[torch.Tensor | None]:
        """Every layer at once where layers stand alike (the same length, budget, record shape and sweep
        index: every layer of a uniform budget in a stream): their KV heads are rows of one batch, so a
        block runs one accumulation and one pair sweep for the whole model, not one per layer. Each row is
        computed as :meth:`compress` computes it alone."""
        for view in views:
            self._start(view)
        keys = [self._batch_key(view, budget) for view, budget in zip(views, budgets, strict=True)]
        kept: list[torch.Tensor | None] = [None] * len(views)
        for members in alike_groups(keys):
            place(kept, members, self._compress_group([views[i] for i in members], budgets[members[0]]))
        return kept

    @staticmethod
    def _start(view: LayerView) -> None:
        if SCORE not in view.layer.state:  # a fresh (or reset) layer: the eviction scope starts at the left
            view.method_state[IDX] = 0

    @staticmethod
    def _batch_key(view: LayerView, budget: int) -> tuple:
        """Layers with equal keys are compressed as one batch."""
        state = tuple(None if name not in view.layer.state else view.layer.state[name].shape for name in (SCORE, COUNT))
        record = view.record
        seen = None if record is None else (record.window, record.own_window, record.probs.shape,
                                            None if record.probe is None else record.probe.shape)
        return (budget, view.length, view.num_new, view.num_heads, state, seen, view.method_state.get(IDX, 0))

    def _compress_group(self, views: list[LayerView], budget: int) -> list[torch.Tensor | None]:
        """:meth:`compress` for layers that stand alike (see :meth:`_batch_key`), their heads as rows: the block's
        attention joins S and C, then the tokens over ``budget`` leave the tree region by Algorithm 1, in units
        (:meth:`unit`) or token by token."""
        for view in views:
            self._start(view)
        first = views[0]
        scores, counts = accumulate(views)  # [R, T]: the heads of every layer, layer by layer
        if first.length <= budget:
            return [None] * len(views)
        split = Split.of(budget, self.sinks, self.recent)
        if split.selected < 1:
            raise UsageError(f"treekv: cache {budget} leaves no room for selected tokens")
        tree = TreeRegion(split.sinks, first.length - split.recent, first.length, split.selected, scores.shape[0],
                          first.layer.device)  # holding selected + excess tokens
        unit = self.unit(first, split.selected)
        units, rest = divmod(tree.excess, unit) if unit > 1 else (0, tree.excess)
        idx = first.method_state.get(IDX, 0) % split.selected
        if units == 0 and rest == 1:  # decoding: one comparison, cheaper than a sweep
            return self._per_layer(views, tree.evict_one(scores, counts, idx), (idx + 1) % split.selected)
        importance = tree.importance(scores, counts)
        if units:  # whole units (section 4.2), then token by token what is left over
            region, idx = tree.evict_units(importance, unit, units, idx)
            if rest:
                region, idx = tree.evict_tokens(importance, region, rest, idx)
        else:  # token by token; beyond the paper, around what the question attends to
            guarded = QuestionGuard(self.guard, self.kernel).evict_tokens(views, tree, importance, rest, idx)
            region, idx = guarded if guarded is not None else tree.evict_tokens(importance, None, rest, idx)
        return self._per_layer(views, tree.kept(region), idx)

    @staticmethod
    def _per_layer(views: list[LayerView], kept: torch.Tensor, idx: int) -> list[torch.Tensor]:
        """Rows ``[R, k]`` back to each layer's ``[H, k]``, and every layer's next sweep index."""
        for view in views:
            view.method_state[IDX] = idx
        if len(views) == 1:
            return [kept]
        return list(kept.view(len(views), views[0].num_heads, kept.shape[1]).unbind(0))

    def unit(self, view: LayerView, selected: int) -> int:
        """Tokens per eviction unit: ``tree_block``, or with 0 (auto) :data:`AUTO_TREE_BLOCK` for a prompt's
        prefill and 1 otherwise; 1 where a unit would not fit in the ``selected`` part.

        A call that fills an empty cache is a prompt's prefill, which the paper compresses in blocks (section
        4.2); a call that extends a cache continues a stream, which its language-modelling experiments (section
        5.2) evict token by token (the two compared in docs/methods.md)."""
        unit = self.tree_block or (AUTO_TREE_BLOCK if view.num_new == view.length and view.num_new > 1 else 1)
        return 1 if unit > selected else unit
