"""The cache a run starts from: the method's own kind of cache (PoD's shares keys), at the precision asked
(``--kv-bits``, keys rounded the ``--kv-keys`` way), with positions laid out as the method's heads choose.

Made apart from the engine that streams through it (:meth:`kvcli.engine.engine.Engine.new_cache`), so that
what a fresh cache depends on reads in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcli.kv.cache import KVCache
from kvcli.methods.base import Method


def key_mode(method: Method, kv_bits: int, kv_keys: str | None, key_norm: bool = False) -> str | None:
    """How ``method``'s cache rounds keys at ``kv_bits`` when asked for ``kv_keys`` on a model that normalizes its
    keys or not (``key_norm``): None at 16 bits; always per token for PoD, which reads its keys rotated from their
    entry positions (:meth:`PodCache.quantize`)."""
    from kvcli.kv.quant import KVQuant

    if kv_bits == 16:
        return None
    return "token" if method.name == "pod" else KVQuant(kv_bits, keys=kv_keys, key_norm=key_norm).key_mode


def heads_apart(method: Method, config, budgets: Sequence[int | None] | None, block: int,
                trained_context: int) -> bool:
    """Whether streamed positions follow the tokens all KV heads of a layer hold (:attr:`KVCache.heads_apart`):
    when the method's heads keep different tokens and the span that gives, at most every head's budget
    side by side plus two blocks, stays within the trained context (else each head's tokens are compacted)."""
    if not (budgets and method.selects_per_head()):
        return False
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    span = heads * max(budget or 0 for budget in budgets) + 2 * block
    return not trained_context or span <= trained_context


def new_cache(method: Method, model: torch.nn.Module, kv_bits: int, kv_keys: str | None, apart: bool,
              key_norm: bool = False) -> KVCache:
    """A fresh cache of ``method`` for ``model``: keys and values at ``kv_bits`` bits, keys rounded the ``kv_keys``
    way (``key_norm``: the model normalizes its keys, :attr:`kvcli.kv.architecture.Architecture.key_norm`),
    positions following the tokens all heads hold when ``apart`` (:func:`heads_apart`)."""
    cache = method.new_cache(model).quantize(kv_bits, kv_keys, key_norm)
    cache.heads_apart = apart
    return cache
