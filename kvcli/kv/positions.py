"""Position bookkeeping: the positions a block's tokens get, and the limits those positions must respect.

The cache re-assigns positions (:mod:`kvcli.kv.cache`): a layer holding ``T`` tokens sees them at
``P - T ... P - 1`` and the new block at ``P ... P + n - 1``, where ``P`` is
:meth:`KVCache.next_position` (the largest cache length over layers, or the stream index when
positions are kept). :class:`BlockPositions` hands those positions to a forward, refuses positions
past the point where the model's RoPE changes frequencies (kvcli cannot re-rotate keys across it)
and warns once when they pass the trained context.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kvcli.errors import UnsupportedModelError
from kvcli.kv.cache import KVCache


class BlockPositions:
    """The positions of each block one engine runs: ``rope_limit`` refused, ``trained_context`` warned about once."""

    def __init__(self, rope_limit: int | None, trained_context: int, warn: Callable[[str], None] | None = None):
        self.rope_limit = rope_limit
        self.trained_context = trained_context
        self.warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
        self.warned_context = False

    def place(self, cache: KVCache, length: int, device: torch.device) -> torch.Tensor:
        """Positions ``[1, length]`` of a block run next against ``cache``, whose ``block_start`` they set."""
        start = cache.next_position()
        cache.block_start = start
        end = start + length
        limit = self.rope_limit
        if limit and end > limit:
            raise UnsupportedModelError(
                f"positions reach {end}, past {limit}, where this model's RoPE switches to other frequencies: "
                "kvcli cannot re-rotate keys across that switch (use a compressing method whose budget plus "
                f"block stays within {limit} positions)")
        if self.trained_context and end > self.trained_context and not self.warned_context:
            self.warned_context = True
            self.warn(f"positions reach {end}, past the model's trained context of {self.trained_context}: "
                      "quality will degrade (use a compressing method or a smaller budget or block)")
        return torch.arange(start, end, device=device)[None, :]
