"""Positions each compression method keeps at a given budget (TreeKV Figure 1).

The prompt is streamed through :class:`~kvcli.engine.engine.Engine` with each method, exactly as
``kvcli ppl`` reads a document, and each layer's kept stream positions are counted per position bin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvcli.engine.engine import Engine, blocks_of
from kvcli.eval.analysis.statistics import bin_edges, rounded
from kvcli.methods.base import Method


def position_counts(token_idx: torch.Tensor, edges: Sequence[int]) -> list[int]:
    """Kept tokens per position bin, summed over KV heads, for one layer's ``token_idx`` ``[H_kv, T]``."""
    which = torch.bucketize(token_idx.flatten().cpu(), torch.tensor(edges[1:-1]), right=True)
    return torch.bincount(which, minlength=len(edges) - 1).tolist()


@torch.inference_mode()
def kept_positions(model: torch.nn.Module, ids: torch.Tensor, method: Method, budget: int | None,
                   block: int) -> tuple[list[torch.Tensor], list[int] | None]:
    """Stream ``ids`` through :class:`~kvcli.engine.engine.Engine` and return each layer's kept stream positions.

    The prompt goes in blocks of ``block`` tokens with a compression after each, exactly as
    ``kvcli ppl`` reads a document; ``budget`` is the tokens per layer (None: no budget). Returns
    ``token_idx`` ``[H_kv, T_l]`` per layer and the per-layer budgets.
    """
    engine = Engine(model, method, budget, block=block, warn=lambda message: None)
    cache = engine.new_cache()
    for chunk in blocks_of([ids], block):
        engine.forward(cache, chunk[None, :])
    return [layer.token_idx.cpu() for layer in cache.layers], engine.budgets


def positions_report(model: torch.nn.Module, ids: torch.Tensor, methods: dict[str, Method], budget: int,
                     block: int, bins: int, on_method: Callable[[str], None] | None = None) -> dict:
    """For each method: kept tokens per layer and position bin, and the heat-map row.

    ``budget`` is the tokens per layer; an unbounded method (``full``) runs without one.
    ``kept_fraction[b]`` is the fraction of (layer, KV head, position) slots of bin b that the cache
    still holds at the end of the prompt: the mean over layers and heads of TreeKV Figure 1's 0/1 map.
    The JSON keeps the key ``cache`` for the budget.
    """
    length = ids.shape[0]
    edges = bin_edges(length, bins)
    widths = torch.tensor(edges[1:], dtype=torch.float64) - torch.tensor(edges[:-1], dtype=torch.float64)
    out: dict = {"cache": budget, "block": block, "bin_edges": edges, "methods": {}}
    for name, method in methods.items():
        if on_method:
            on_method(name)
        started = time.perf_counter()
        kept, budgets = kept_positions(model, ids, method, None if method.unbounded else budget, block)
        counts = [position_counts(token_idx, edges) for token_idx in kept]
        kv_heads = kept[0].shape[0]
        fraction = torch.tensor(counts, dtype=torch.float64).sum(dim=0) / (widths * kv_heads * len(kept))
        out["methods"][name] = {
            "budgets": budgets,
            "cache_tokens": [int(t.shape[1]) for t in kept],
            "kv_heads": kv_heads,
            "counts": counts,
            "kept_fraction": rounded(fraction),
            "seconds": round(time.perf_counter() - started, 3),
        }
    return out
