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

Beyond the paper, for streamed reads with a question (``kvcli ask``, ``needle``): the pair rule
compares neighbours, so of two adjacent tokens that both matter (the digits of a number) one goes
whenever the sweep meets them. When a block carries a probe, the ``guard`` tree-region tokens around
the question's attention peaks sit out that block's sweep (see docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.errors import UsageError
from kvcli.lazy import torch
from kvcli.methods.base import Method, Split, check_budget, group_mean, param, pool_scores, select_top
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.cache import LayerView

AUTO_TREE_BLOCK = 16  # unit of block-level eviction when tree_block=0 and a call prefills an empty cache
SCORE = "treekv_s"  # accumulated attention S, per token (gathered with K/V by the cache)
COUNT = "treekv_c"  # how many recorded queries saw each token, C
IDX = "treekv_idx"  # in the layer's method state: 0-based start of the eviction scope, in tokens


def pair_rule(scores: torch.Tensor, capacity: int, steps: int, start: int) -> tuple[torch.Tensor, int]:
    """``steps`` evictions of Algorithm 1 over items in order, ``capacity`` settled then the rest arriving.

    ``scores`` ``[H, N]`` (N >= capacity + steps) scores items per head; items ``capacity ...`` arrive
    one per step. Each step compares the ``idx``-th and ``(idx+1)``-th items present (0-based
    ``idx`` = ``start`` at first), evicts the ``idx+1``-th if the ``idx``-th scores higher and the
    ``idx``-th otherwise, then sets ``idx = (idx + 1) % capacity``. Until ``idx`` wraps, step ``j`` of a
    sweep compares positions ``idx + 2j`` and ``idx + 2j + 1`` of the sequence as it stood when the
    sweep began, so a sweep is one gather and one comparison. Returns the evicted item indices
    ``[H, steps]`` (in eviction order) and the next ``idx``.
    """
    heads, device = scores.shape[0], scores.device
    alive = torch.arange(capacity, device=device).expand(heads, capacity)
    evicted = []
    done, idx = 0, start
    while done < steps:
        count = min(steps - done, capacity - idx)
        pending = torch.arange(capacity + done, capacity + done + count, device=device).expand(heads, count)
        seq = torch.cat((alive, pending), dim=1)
        left = idx + 2 * torch.arange(count, device=device)
        a, b = seq[:, left], seq[:, left + 1]
        right_loses = scores.gather(1, a) > scores.gather(1, b)
        evicted.append(torch.where(right_loses, b, a))
        drop = torch.zeros(seq.shape, dtype=torch.bool, device=device)
        drop[:, left] = ~right_loses
        drop[:, left + 1] = right_loses
        alive = seq[~drop].view(heads, capacity)
        done += count
        idx = (idx + count) % capacity
    if not evicted:
        return torch.empty((heads, 0), dtype=torch.long, device=device), idx
    return torch.cat(evicted, dim=1), idx


def remove(positions: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``positions`` ``[H, N]`` without the entries at indices ``drop`` ``[H, m]`` (same m per head)."""
    mask = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
    mask.scatter_(1, drop, False)
    return positions[mask].view(positions.shape[0], positions.shape[1] - drop.shape[1])


@register
@dataclass
class TreeKV(Method):
    name = "treekv"
    description = ("Sinks + recent window + a tree region thinned by pairwise eviction of the lower averaged "
                   "attention, the pair sweeping from old to new (TreeKV, Algorithm 1).")
    sinks: int = param(4, "initial tokens always kept (attention sinks)")
    recent: int | None = param(None, "most recent tokens always kept; None = what the sinks leave of half the "
                                     "cache (the paper's 4 + 508 + 512 at cache 1024)")
    tree_block: int = param(0, "tokens per eviction unit in the tree region; 0 = auto: 16 when a "
                               "prompt is prefilled in one call (section 4.2), 1 when streaming or decoding")
    window: int = param(32, "last queries of each block whose attention is accumulated (capped by the block)")
    guard: int = param(256, "streamed reads with a question (probe) only: per KV head, this many tree-region "
                           "tokens around the question's attention peaks sit out the block's pair rule; 0 = off")
    kernel: int = param(15, "max-pooling width (odd) of the question's attention when picking guarded tokens")

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
        layer = view.layer
        if SCORE not in layer.state:  # a fresh (or reset) layer: the eviction scope starts at the left
            view.method_state[IDX] = 0
        scores, counts = self._accumulate(view)
        length = view.length
        if length <= budget:
            return None
        split = Split.of(budget, self.sinks, self.recent)
        if split.selected < 1:
            raise UsageError(f"treekv: cache {budget} leaves no room for selected tokens")
        heads, device = view.num_heads, layer.device
        lo, hi = split.sinks, length - split.recent  # the tree region, holding selected + excess tokens
        excess = length - budget
        unit = self.tree_block or (AUTO_TREE_BLOCK if self.is_prefill(view) else 1)
        if unit > split.selected:
            unit = 1
        units, rest = divmod(excess, unit) if unit > 1 else (0, excess)
        idx = view.method_state.get(IDX, 0) % split.selected
        if units == 0 and rest == 1:  # decoding: one comparison, cheaper than a sweep
            pair = torch.arange(lo + idx, lo + idx + 2, device=device)
            importance = scores[:, pair] / counts[:, pair].clamp_min(1.0)
            gone = pair[0] + (importance[:, :1] > importance[:, 1:]).long()  # [H, 1] cache index
            view.method_state[IDX] = (idx + 1) % split.selected
            kept = torch.arange(length - 1, device=device).expand(heads, length - 1)
            return kept + (kept >= gone).long()
        importance = scores[:, lo:hi] / counts[:, lo:hi].clamp_min(1.0)  # S / C (Algorithm 1, line 10)
        region = torch.arange(hi - lo, device=device).expand(heads, hi - lo)
        if units:
            capacity = split.selected // unit
            first = idx // unit
            in_play = importance[:, : (capacity + units) * unit]  # settled units, then the arriving ones
            unit_scores = in_play.view(heads, capacity + units, unit).mean(-1)
            gone, first = pair_rule(unit_scores, capacity, units, first if first < capacity else 0)
            idx = first * unit
            tokens = (gone[:, :, None] * unit + torch.arange(unit, device=device)).flatten(1)
            region = remove(region, tokens)
        guarded = self._guarded(view, lo, hi, split.selected) if rest and not units else None
        if guarded is not None:  # the pair rule sweeps the other tokens, as if the guarded were not there
            open_ = remove(region, guarded)
            capacity = split.selected - guarded.shape[1]
            gone, idx = pair_rule(importance.gather(1, open_), capacity, rest, idx % capacity)
            region = remove(region, open_.gather(1, gone))
        elif rest:
            gone, idx = pair_rule(importance.gather(1, region), split.selected, rest, idx)
            region = remove(region, gone)
        view.method_state[IDX] = idx
        sinks = torch.arange(lo, device=device).expand(heads, lo)
        recent = torch.arange(hi, length, device=device).expand(heads, length - hi)
        return torch.cat((sinks, region + lo, recent), dim=1)

    def _guarded(self, view: LayerView, lo: int, hi: int, selected: int) -> torch.Tensor | None:
        """Tree-region indices ``[H, g]`` (ascending) around the probe's attention peaks, or None.

        The question's attention to the region, max-pooled over ``kernel`` neighbours so that a peak
        guards its span, picks the top ``guard`` tokens per KV head (at most half the selected part,
        so the sweep still has room); ties go to the earlier token, as in :func:`select_top`. How
        large it must be is measured in docs/reading.md.
        """
        record = view.record
        count = min(self.guard, selected // 2)
        if record is None or record.probe is None or count < 1:
            return None
        probe = pool_scores(group_mean(record.probe)[:, lo:hi].float(), self.kernel, "max")
        return select_top(probe, torch.zeros(hi - lo, dtype=torch.bool, device=probe.device), count)

    @staticmethod
    def is_prefill(view: LayerView) -> bool:
        """A call that fills an empty cache is a prompt's prefill, which the paper compresses in blocks
        (section 4.2); a call that extends a cache continues a stream, which its language-modelling
        experiments (section 5.2) evict token by token (the two compared in docs/methods.md)."""
        return view.num_new == view.length and view.num_new > 1

    def _accumulate(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the block's attention to S and the number of recorded queries that saw each token to C."""
        scores, counts = view.per_token(SCORE), view.per_token(COUNT)
        record, new = view.record, view.num_new
        if record is None:
            return scores, counts
        scores = scores + group_mean(record.probs)[:, : view.length]
        # The block's own window sees new token j only from block index j on; extra probe queries see all.
        own = min(record.own_window, new)
        counts = counts + float(record.window)
        if own > 1:  # new token j missed the first max(0, own - (new - j)) of the block's window queries
            missed = (own - torch.arange(new, 0, -1, device=counts.device)).clamp(min=0).float()
            counts[:, view.length - new:] -= missed
        view.set_per_token(SCORE, scores)
        view.set_per_token(COUNT, counts)
        return scores, counts
