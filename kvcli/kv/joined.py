"""The cached tokens of many layers operated on at once: a few operations per block instead of a few per layer.

Why: past the model's own work, what a block costs on a GPU is one kernel launch per operation
(issue #27), and re-rotating the cached keys and gathering the kept tokens were each a dozen
operations per layer. Layers are joined along the token axis (they may hold different numbers of
tokens, as under PyramidKV), operated on once, and split back into per-layer views. The arithmetic
of every element is the one the per-layer code does (:func:`kvcli.kv.cache.rotate_keys`, a gather), so
results are identical to the last bit (``tests/test_joined.py``).

Joined batches are bounded (:data:`JOIN_ELEMENTS`), so the float32 temporaries of a rotation stay
small beside the cache however large the cache is; a cache above the bound is handled in several batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TypeVar

import torch

from kvcli.kv.rope import rotate_keys

#: Most key elements one joined batch holds (64 MiB of float32 per temporary): caches beyond it are
#: handled a few layers at a time.
JOIN_ELEMENTS = 1 << 24

Item = TypeVar("Item")


def batches(sizes: Sequence[int], limit: int | None = None) -> list[list[int]]:
    """Consecutive positions of ``sizes`` grouped so that each group's total stays within ``limit``
    (:data:`JOIN_ELEMENTS` by default; a single item above it is a group of its own)."""
    limit = JOIN_ELEMENTS if limit is None else limit
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def alike_batches(items: Sequence[Item], kind: Callable[[Item], tuple | None],
                  size: Callable[[Item], int]) -> tuple[list[Item], list[list[Item]]]:
    """``items`` split into those that go alone (``kind`` None) and batches of items of one kind, each within
    :data:`JOIN_ELEMENTS` by ``size`` (:func:`batches`); kinds in the order first met, items in their order."""
    alone: list[Item] = []
    kinds: dict[tuple, list[Item]] = {}
    for item in items:
        key = kind(item)
        if key is None:
            alone.append(item)
        else:
            kinds.setdefault(key, []).append(item)
    return alone, [[group[i] for i in batch] for group in kinds.values()
                   for batch in batches([size(item) for item in group])]


@lru_cache(maxsize=32)
def current_positions(lengths: tuple[int, ...], block_start: int, device: torch.device) -> torch.Tensor:
    """``[sum(lengths)]``: each layer's cached tokens at consecutive positions ending right before
    ``block_start`` (:meth:`kvcli.kv.cache.CompressedLayer.current_positions`), layer after layer.

    A stream at its budget starts every block at the same position with the same lengths, so this is
    made once per stream (read only)."""
    return torch.cat([torch.arange(block_start - length, block_start, device=device) for length in lengths])


@lru_cache(maxsize=32)
def kept_offsets(lengths: tuple[int, ...], counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[sum(counts)]``: where each layer's tokens start in the joined layers, once per index it keeps."""
    starts, first = [], 0
    for length, count in zip(lengths, counts, strict=True):
        starts.append(torch.full((count,), first, dtype=torch.long, device=device))
        first += length
    return torch.cat(starts)


def join(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``parts`` concatenated along ``dim`` (no copy for one part)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)


def rotated_keys(keys: Sequence[torch.Tensor], entry_pos: Sequence[torch.Tensor], block_start: int,
                 inv_freq: torch.Tensor, token_idx: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each layer's keys ``[1, H, T_l, D]`` (rotated at ``entry_pos`` ``[H, T_l]``) rotated to their current
    positions, all layers in one rotation; the layers must share ``inv_freq``. With the layers' stream
    indices ``token_idx``, a layer's heads share one order of positions (:func:`union_offsets`); without,
    each head's tokens are consecutive (:func:`current_positions`)."""
    lengths = tuple(key.shape[-2] for key in keys)
    device = keys[0].device
    if token_idx is not None:
        delta = (block_start - union_offsets(token_idx)) - join(entry_pos, dim=1)
    else:
        delta = current_positions(lengths, block_start, device) - join(entry_pos, dim=1)
    rotated = rotate_keys(join(keys, dim=2), delta, inv_freq)
    return list(rotated.split(lengths, dim=2)) if len(keys) > 1 else [rotated]


class RotationPlan:
    """Which cache layers rotate their keys as one batch in the coming forward, and the rotated keys of a batch
    whose layers have not all read theirs yet (:meth:`kvcli.kv.cache.KVCache.plan_rotation`).

    A batch is rotated (:func:`rotated_keys`) when the first of its layers reads its keys (:meth:`keys`) and each
    layer takes its own away, so only one batch's rotated keys wait beside the cache.
    """

    def __init__(self) -> None:
        self.start: int | None = None  # the block start planned for (None: nothing planned)
        self.heads_apart = False  # the layers' heads share one order of positions (KVCache.heads_apart)
        self.pending: dict[int, list] = {}  # layer index -> the layers of its batch, not rotated yet
        self.rotated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer index -> (keys, rotated keys)

    def plan(self, layers: Sequence, block_start: int, heads_apart: bool) -> None:
        """Group the ``layers`` whose keys a forward starting at ``block_start`` sees moved and that stand alike
        (:meth:`kvcli.kv.cache.CompressedLayer.join_kind`) into batches."""
        self.clear()
        _, groups = alike_batches(
            layers, lambda layer: layer.join_kind(rotation=True) if layer.needs_rotation(block_start) else None,
            lambda layer: layer.keys.numel())
        for members in groups:
            for layer in members:
                self.pending[layer.layer_idx] = members
        self.start, self.heads_apart = block_start, heads_apart

    def keys(self, layer, block_start: int) -> torch.Tensor | None:
        """``layer``'s cached keys rotated to their positions before ``block_start``, computed with the other
        layers of its batch; None when not planned for this forward, or when the layer changed since the plan."""
        if block_start != self.start:
            return None
        members = self.pending.get(layer.layer_idx)
        if members is not None:
            rotated = rotated_keys([m.keys for m in members], [m.entry_pos for m in members], block_start,
                                   members[0].inv_freq, [m.token_idx for m in members] if self.heads_apart else None)
            for member, keys in zip(members, rotated, strict=True):
                self.pending.pop(member.layer_idx)
                self.rotated[member.layer_idx] = (member.keys, keys)
        source, keys = self.rotated.pop(layer.layer_idx, (None, None))
        return keys if source is layer.keys else None  # a layer changed since the plan rotates alone

    def clear(self) -> None:
        """Forget the plan and any rotated keys not taken (after a forward: frees them)."""
        self.start = None
        self.pending = {}
        self.rotated = {}


#: Sorts after every stream index: pads the token indices of shorter layers in :func:`union_offsets`.
_PAD = torch.iinfo(torch.long).max


def union_offsets(token_idx: Sequence[torch.Tensor]) -> torch.Tensor:
    """How far before the next block each cached token sits when a layer's heads share one order of positions:
    ``[H, sum T_l]`` for the layers' stream indices ``[H, T_l]``, joined along tokens.

    The distinct tokens a layer's heads hold, in stream order, take consecutive positions ending right before
    the block: a token held by several heads has one position in all of them, and the gaps between a head's
    tokens are the tokens its other heads hold (:meth:`kvcli.kv.cache.CompressedLayer.current_positions`).
    The most recent token is 1 before the block, the oldest as many as the layer holds distinct tokens.
    All layers are ranked at once: each layer's indices are one row (padded past its length), sorted.
    """
    heads = token_idx[0].shape[0]
    lengths = tuple(index.shape[1] for index in token_idx)
    width = heads * max(lengths)
    place = _row_places(lengths, heads, token_idx[0].device)  # [H, sum T_l]: where each index goes in the rows
    rows = torch.full((len(lengths) * width,), _PAD, dtype=torch.long, device=place.device)
    rows = rows.scatter_(0, place.view(-1), join(token_idx, dim=1).reshape(-1).long()).view(len(lengths), width)
    values, order = rows.sort(dim=1)
    first = torch.ones_like(values, dtype=torch.bool)
    first[:, 1:] = values[:, 1:] != values[:, :-1]  # the first of equal indices (one token held by several heads)
    if any(length != lengths[0] for length in lengths):
        first &= values != _PAD
    rank = first.cumsum(dim=1)  # 1 for the oldest distinct token, equal for every copy of a token
    ahead = torch.empty_like(rank).scatter_(1, order, rank[:, -1:] - rank + 1)
    return torch.take(ahead, place)


@lru_cache(maxsize=32)
def _row_places(lengths: tuple[int, ...], heads: int, device: torch.device) -> torch.Tensor:
    """``[H, sum T_l]``: for each element of the layers' ``[H, T_l]`` joined along tokens, its place in rows of
    ``H * max(T_l)`` elements, one row per layer, head after head (made once per shape, read only)."""
    width = heads * max(lengths)
    parts = [(layer * width + torch.arange(heads * length, device=device)).view(heads, length)
             for layer, length in enumerate(lengths)]
    return torch.cat(parts, dim=1)


def joined_index(indices: Sequence[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
    """Per-layer kept indices ``[H, k_l]`` as one index ``[H, sum k_l]`` into the layers joined along tokens."""
    counts = tuple(index.shape[1] for index in indices)
    joined = join(indices, dim=1)
    if len(indices) == 1:
        return joined
    return joined + kept_offsets(tuple(lengths), counts, joined.device)


def gather_joined(parts: Sequence[torch.Tensor], index: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """Per-layer tensors kept at the joined ``index``: one gather, split back into per-layer views of
    ``counts`` tokens. ``parts`` are ``[H, T_l]`` with ``index`` ``[H, sum k_l]`` (:func:`joined_index`),
    or ``[1, H, T_l, D]`` with ``index`` expanded to ``[1, H, sum k_l, D]`` (:func:`wide_index`)."""
    dim = 1 if parts[0].dim() == 2 else 2
    gathered = join(parts, dim).gather(dim, index)
    return list(gathered.split(list(counts), dim=dim)) if len(parts) > 1 else [gathered]


def wide_index(index: torch.Tensor, dim: int) -> torch.Tensor:
    """A token index ``[H, k]`` expanded over a head dimension of ``dim``, for keys and values ``[1, H, T, dim]``."""
    heads, count = index.shape
    return index[None, :, :, None].expand(1, heads, count, dim)


def keep_joined(pairs: Sequence[tuple]) -> None:
    """Cache layers that stand alike (:meth:`kvcli.kv.cache.CompressedLayer.join_kind`), each with the indices
    ``[H, k_l]`` of the tokens it keeps: one gather per tensor for all of them, what
    :meth:`kvcli.kv.cache.CompressedLayer.keep` does layer by layer."""
    layers = [layer for layer, _ in pairs]
    index = joined_index([indices for _, indices in pairs], [layer.get_seq_length() for layer in layers])
    counts = [indices.shape[1] for _, indices in pairs]
    key_dim, value_dim = layers[0].keys.shape[-1], layers[0].values.shape[-1]
    wide = wide_index(index, key_dim)
    keys = gather_joined([layer.keys for layer in layers], wide, counts)
    values = gather_joined([layer.values for layer in layers], wide if value_dim == key_dim
                           else wide_index(index, value_dim), counts)
    entry_pos = gather_joined([layer.entry_pos for layer in layers], index, counts)
    token_idx = gather_joined([layer.token_idx for layer in layers], index, counts)
    states = {name: gather_joined([layer.state[name] for layer in layers], index, counts)
              for name in layers[0].state}
    for i, layer in enumerate(layers):
        layer.keys, layer.values = keys[i], values[i]
        layer.entry_pos, layer.token_idx = entry_pos[i], token_idx[i]
        layer.state = {name: parts[i] for name, parts in states.items()}
        layer.moved = True
