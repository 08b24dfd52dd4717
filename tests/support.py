"""Helpers for tests: drive a method on synthetic attention, one compression at a time; load a docs script.

The engine's forward pass is replaced by :func:`append_tokens` (random keys and values) and a
hand-made attention record, so a test controls exactly what the method sees and can compare the
kept stream positions with a literal re-implementation of the paper.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import torch

from kvcli.kv.cache import AttentionRecord, KVCache, LayerView


def make_cache(num_layers: int = 1, kv_heads: int = 2, head_dim: int = 8) -> KVCache:
    """An empty cache whose layers already hold ``kv_heads`` heads of ``head_dim`` (no tokens yet)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cache = KVCache(num_layers, inv_freq)
    empty = torch.empty(1, kv_heads, 0, head_dim)
    for layer in cache.layers:
        layer.lazy_initialization(empty, empty)
    return cache


def append_tokens(cache: KVCache, count: int) -> None:
    """Add ``count`` tokens with random keys/values to every layer, as a forward pass would."""
    _, kv_heads, _, head_dim = cache.layers[0].keys.shape
    cache.block_start = cache.next_position()
    for layer in cache.layers:
        layer.update(torch.randn(1, kv_heads, count, head_dim), torch.randn(1, kv_heads, count, head_dim))
    cache.stream_start += count


def compress_step(cache: KVCache, method, budget: int, num_new: int, probs: list[torch.Tensor] | None,
                  window: int, own: int | None = None) -> None:
    """Show ``method`` each layer with attention ``probs[layer]`` ``[H_kv, group, T]`` and apply its choice
    (``own``: how many of the ``window`` recorded queries are the block's own; None: all of them)."""
    for idx, layer in enumerate(cache.layers):
        layer.record = AttentionRecord(probs[idx], window, own=own) if probs is not None else None
        view = LayerView(idx, len(cache.layers), layer, num_new, layer.record, seen=cache.stream_start)
        keep = method.compress(view, budget)
        if keep is not None:
            layer.keep(keep)
        layer.record = None


def kept_positions(cache: KVCache, layer: int = 0) -> list[list[int]]:
    """Stream positions each KV head of ``layer`` holds, in cache order."""
    return cache.layers[layer].token_idx.tolist()


def retained_fraction(p: float, decay: float, layer: int, layers: int, schedule: str) -> float:
    """PyramidInfer's retained fraction of layer ``layer``, literally: p times one ratio per layer above 0,
    ``decay`` each (geometric) or eased from 1 to ``decay`` along a half cosine (cosine)."""
    if schedule == "geometric":
        return p * decay**layer
    fraction = p
    for i in range(layer + 1):
        fraction *= decay + (1 - decay) * (1 + math.cos(math.pi * i / layers)) / 2
    return fraction


def max_pooled(scores: list[float], kernel: int) -> list[float]:
    """Each score replaced by the largest within ``kernel // 2`` places on either side (edges ignored)."""
    half = kernel // 2
    return [max(scores[max(0, i - half):i + half + 1]) for i in range(len(scores))]


def docs_script(relative: str) -> ModuleType:
    """The script ``docs/<relative>`` (not a package module) imported under its own name, registered in
    ``sys.modules`` so that its dataclasses can look their module up."""
    path = Path(__file__).resolve().parents[1] / "docs" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
