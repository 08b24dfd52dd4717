"""A cache layer's storage: its keys and values, as the model made them or packed at a few bits.

:class:`LayerStorage` holds the tensors ``[1, H, T, D]`` and answers what transformers asks of a cache layer's
contents (its length, the sizes of its masks). What the stored tokens are (the position each entered at, its
index in the stream, what a method keeps beside it) is the bookkeeping of :class:`kvcli.kv.cache.CompressedLayer`,
built on this class: the two change for different reasons (a packed store at ``--kv-bits``, see
:mod:`kvcli.kv.quant`; a position rule, see :mod:`kvcli.kv.cache`), so each is read on its own.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcli.kv.quant import PRE_ROPE_MODES, QuantizedTokens, gather_tokens, nbytes


class LayerStorage(CacheLayerMixin):
    """One layer's keys and values: plain tensors, or packed stores when the cache is quantized
    (:attr:`kvcli.kv.cache.KVCache.kv_quant`). Tokens are appended after each forward and gathered on every
    eviction; a plain store's keys are kept as attention reads them, so one concatenation serves both."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner, layer_idx: int):
        super().__init__()
        # A weak reference: the cache owns its layers, so a finished run's cache (and its tensors) is
        # freed as soon as the last reference to it goes, without waiting for the garbage collector.
        self.owner = weakref.proxy(owner)
        self.layer_idx = layer_idx

    # --- transformers' CacheLayerMixin -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if batch != 1:
            raise ValueError("kvcli streams one sequence at a time (batch size 1)")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.new_store(key_states.new_empty((1, heads, 0, dim)), keys=True)
        self.values = self.new_store(value_states.new_empty((1, heads, 0, value_states.shape[-1])), keys=False)
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    # --- kvcli ---------------------------------------------------------------------------------
    def new_store(self, empty: torch.Tensor, keys: bool) -> torch.Tensor | QuantizedTokens:
        """Where this layer keeps keys (``keys``) or values: ``empty`` itself, or a packed store when the
        cache is quantized (:attr:`KVCache.kv_quant`): values rounded per token, keys the cache's key mode
        (per-channel keys are stored before RoPE, see :attr:`pre_rope`)."""
        quant = self.owner.kv_quant
        if quant is None:
            return empty
        return QuantizedTokens(empty, quant, quant.key_mode if keys else "token")

    @property
    def pre_rope(self) -> bool:
        """Whether the cached keys are stored un-rotated (position 0), as per-channel rounding needs: a
        channel's range before RoPE is stable across tokens, after it every pair spins with the position.
        Reading them then rotates each key once, from 0 to its current position."""
        return isinstance(self.keys, QuantizedTokens) and self.keys.mode in PRE_ROPE_MODES

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor | None,
               values: torch.Tensor) -> None:
        """Store a block's keys (as this layer stores them: un-rotated when :attr:`pre_rope`) and values.

        ``keys`` and ``values`` are the cached ones joined with the block's as attention read them: a plain store
        keeps them as they are (``keys`` None: the cached keys were rotated to read, so the stored ones are
        joined with the block's instead); a packed store appends the block's alone."""
        if isinstance(self.keys, QuantizedTokens):
            self.keys.append(key_states)
            self.values.append(value_states)
        else:
            self.keys = keys if keys is not None else torch.cat((self.keys, key_states), dim=-2)
            self.values = values

    def observe(self, query: torch.Tensor) -> None:
        """The queries ``[1, H_q, n, D]`` that attended this layer's keys: a packed store that weighs its grid by
        them (``--kv-keys pca``) takes them; nothing else does."""
        if isinstance(self.keys, QuantizedTokens):
            self.keys.observe(query)

    def gather(self, indices: torch.Tensor) -> None:
        """Keep, per KV head, the keys and values of the tokens at ``indices`` ``[H, k]``."""
        self.keys = gather_tokens(self.keys, indices)
        self.values = gather_tokens(self.values, indices)

    def nbytes(self) -> int:
        """Bytes of keys and values held (packed, with scales and zero points, when quantized)."""
        return nbytes(self.keys) + nbytes(self.values)
