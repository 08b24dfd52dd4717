"""Several documents in one forward: row ``b`` of a batch reads against its own :class:`~kvcli.kv.cache.KVCache`.

A batch of documents shares the model's matmuls (its projections and MLPs take ``B x n`` rows at once, which is
what fills a GPU when the model is small), but never its cache: each document keeps its own compressed cache,
positions and method state, so each row's numbers are those of the document read alone. :class:`CacheRows` is
what the model is handed as ``past_key_values``; each layer's :meth:`RowsLayer.update` stores row ``b``'s keys in
row ``b``'s cache and returns :class:`RowStates`, one tensor per row (their lengths may differ), which kvcli's
attention (:func:`kvcli.kv.attention.kvcli_attention`) reads row by row against that row's cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcli.kv.cache import KVCache


class RowStates(list):
    """The keys (or values) of every row of a batch after a layer's update, ``[1, H, T_b, D]`` each: a list
    rather than one tensor, because each row's cache holds its own number of tokens."""


class RowsLayer(CacheLayerMixin):
    """Layer ``i`` of every row's cache, as one layer of the batch."""

    is_compileable = False
    is_croppable = False

    def __init__(self, rows: Sequence[CacheLayerMixin]):
        super().__init__()
        self.rows = list(rows)
        self.is_sliding = getattr(self.rows[0], "is_sliding", False)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to set up: every row's own layer initialises itself on its first update."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[RowStates, RowStates]:
        """Row ``b`` of the block's keys and values into row ``b``'s cache layer; each row's keys and values back."""
        keys, values = RowStates(), RowStates()
        for b, layer in enumerate(self.rows):
            key, value = layer.update(key_states[b:b + 1], value_states[b:b + 1], *args, **kwargs)
            keys.append(key)
            values.append(value)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.rows[0].get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for layer in self.rows:
            layer.reset()


class CacheRows(Cache):
    """The caches of a batch's rows, as the one cache the model reads: row ``b`` of every input is
    ``caches[b]``'s (see the module's docstring)."""

    def __init__(self, caches: Sequence[KVCache]):
        if not caches:
            raise ValueError("a batch needs at least one row")
        self.rows = list(caches)
        layers = [RowsLayer([cache.layers[i] for cache in self.rows]) for i in range(len(self.rows[0].layers))]
        super().__init__(layers=layers)
