"""The compression step of a block: the method shrinks every layer the budget governs.

After a forward pass each budgeted layer holds its cached tokens plus the block's, and the
attention the method asked to record; :func:`compress_cache` shows the method every such layer (as a
:class:`kvcli.kv.cache.LayerView`) and keeps what it chooses. :func:`nested_forward` is the other way,
for a method that nests its selection (PyramidInfer): each layer is compressed as soon as it has run,
and the next layer processes only the tokens it passes on. :func:`layer_budgets` spreads a budget
over the layers. The engine (:mod:`kvcli.engine.engine`) calls all three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcli.errors import UnsupportedModelError
from kvcli.kv.architecture import Architecture
from kvcli.kv.cache import KVCache, LayerView
from kvcli.kv.scores import settle
from kvcli.methods.base import Method


def layer_budgets(method: Method, architecture: Architecture, budget: int | None,
                  num_layers: int) -> list[int | None] | None:
    """Each layer's budget: the method spreads it over the full-attention layers only, since a layer
    with an attention window keeps its window whatever the method (None: that layer, or no budget)."""
    if not budget:
        return None
    budgeted = architecture.budgeted
    budgets: list[int | None] = [None] * num_layers
    if budgeted:
        for idx, value in zip(budgeted, method.layer_budgets(budget, len(budgeted)), strict=True):
            budgets[idx] = value
    return budgets


def compress_cache(method: Method, cache: KVCache, budgeted: Sequence[int], budgets: Sequence[int | None],
                   mean_budget: int | None, num_new: int, decoding: bool = False, skip: set[int] = frozenset(),
                   question: int = 0, held: int = 0) -> None:
    """Let ``method`` shrink every layer in ``budgeted``; a window layer already keeps only its window.

    The method sees the budgeted layers numbered among themselves, as it allotted their budgets, all
    in one call (:meth:`Method.compress_layers`: layers that stand alike are compressed as one batch),
    unless ``compress`` was replaced on the instance, which is then called for each layer.
    ``skip`` holds layers a nested forward compressed already; ``question`` is how many of the last
    tokens are the question (:attr:`LayerView.question`), ``held`` how many are kept whatever they score
    (:attr:`LayerView.held`).
    """
    chosen = [(depth, idx) for depth, idx in enumerate(budgeted) if idx not in skip]
    views = [LayerView(depth, len(budgeted), cache.layers[idx], num_new, cache.layers[idx].record, decoding,
                       seen=cache.stream_start, mean_budget=mean_budget, question=question, held=held)
             for depth, idx in chosen]
    wanted = [budgets[idx] for _, idx in chosen]
    if "compress" in vars(method):  # compress replaced on the instance (a wrapper, a spy): honoured layer by layer
        kept = Method.compress_layers(method, views, wanted)
    else:
        kept = method.compress_layers(views, wanted)
    cache.keep_layers([(view.layer, keep) for view, keep in zip(views, kept, strict=True) if keep is not None])


def nested_forward(run: Callable[[], torch.Tensor], method: Method, cache: KVCache, decoder_layers: Sequence,
                   budgets: Sequence[int | None], mean_budget: int | None, num_new: int, device: torch.device,
                   done: set[int], question: int = 0, held: int = 0) -> torch.Tensor:
    """``run()``, a forward in which layer ``l + 1`` processes only the tokens layer ``l`` passes on
    (Algorithm 1 of PyramidInfer: ``KV <- PvC``; the authors' code gathers the kept tokens' hidden states).

    A forward pre-hook on every decoder layer after the first compresses the layer below (its
    attention was just recorded) and gathers the per-token inputs of the layer (hidden states,
    ``position_embeddings``, ``position_ids``) down to the block's tokens that go on; the cache
    layers learn which tokens they receive from ``cache.subset`` (their offsets in the block).
    The layers compressed are added to ``done``.
    """
    n = num_new
    num_layers = len(cache.layers)
    state = {"subset": torch.arange(n, device=device)}  # offsets in the block the next layer receives

    def before(idx: int):
        def hook(module, args, kwargs):
            below = idx - 1
            settle(cache)  # the layer below's window scores
            layer = cache.layers[below]
            tokens = layer.token_idx  # [H, T], before the layer stores its choice
            view = LayerView(below, num_layers, layer, n, layer.record, seen=cache.stream_start + n,
                             mean_budget=mean_budget, question=question, held=held)
            keep, passed = method.compress_nested(view, budgets[below])
            if keep is not None:
                layer.keep(keep)
            done.add(below)
            current = kept = state["subset"]
            if passed is not None:  # a token goes on when any KV head passes it (hidden states are per token)
                offsets = torch.unique(tokens.gather(1, passed)) - cache.stream_start
                kept = offsets[offsets >= 0]  # the block's tokens that go on, ascending
            state["subset"] = cache.subset = kept
            if kept.shape[0] == n:
                return None  # every token goes on: the model's inputs are right as they are
            # The hidden states hold the tokens the layer below processed (`current`); the model hands
            # every layer the whole block's positions.
            rows = torch.searchsorted(current, kept)
            return _gather_inputs(args, kwargs, rows, kept)
        return hook

    def first(module, args, kwargs):
        cache.subset = state["subset"]

    handles = [decoder_layers[0].register_forward_pre_hook(first, with_kwargs=True)]
    handles += [decoder_layers[idx].register_forward_pre_hook(before(idx), with_kwargs=True)
                for idx in range(1, len(decoder_layers))]
    try:
        return run()
    finally:
        for handle in handles:
            handle.remove()
        cache.subset = None


def _gather_inputs(args: tuple, kwargs: dict, rows: torch.Tensor, offsets: torch.Tensor) -> tuple[tuple, dict]:
    """A decoder layer's inputs cut down to some of the block's tokens, for a nested forward.

    ``rows`` index the incoming hidden states (the tokens the previous layer processed); ``offsets``
    index the block, which is what the model passes every layer (rotary ``position_embeddings``,
    ``position_ids``). kvcli's attention builds its own masks, so the model passes no mask to gather.
    """
    if kwargs.get("attention_mask") is not None:
        raise UnsupportedModelError("a nested forward needs kvcli's own masks, but the model passed one")
    kwargs = dict(kwargs)
    if args:
        args = (args[0].index_select(1, rows), *args[1:])
    else:
        kwargs["hidden_states"] = kwargs["hidden_states"].index_select(1, rows)
    cos_sin = kwargs.get("position_embeddings")
    if cos_sin is not None:
        kwargs["position_embeddings"] = tuple(part.index_select(1, offsets) for part in cos_sin)
    for name in ("position_ids", "cache_position"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            kwargs[name] = value.index_select(value.dim() - 1, offsets)
    return args, kwargs
