"""Which decode steps write an answer after a read: the conditions of each static layout, and
:func:`answer_steps`, which takes the first that applies, else the engine's own steps. The overview is
:mod:`kvcli.kv.decode`'s.
"""

from __future__ import annotations

import torch

from kvcli.kv.cache import CompressedLayer, KVCache, WindowLayer
from kvcli.kv.decode.evicting import EvictingCache
from kvcli.kv.decode.layouts import RingCache
from kvcli.kv.decode.steps import EagerSteps, StaticSteps


def _plain_and_in_range(engine, cache: KVCache, end: int) -> bool:
    """What every static step needs: a plain softmax (its attention computes nothing else), plain, unquantized
    layers, and positions up to ``end`` (excluded) within the model's."""
    if cache.kv_quant is not None or not engine.architecture.plain_softmax:
        return False
    if not all(type(layer) in (CompressedLayer, WindowLayer) and layer.is_initialized
               and isinstance(layer.keys, torch.Tensor) for layer in cache.layers):
        return False  # a layer of its own layout (PoD) attends its own way
    if any(layer.window is not None and layer.get_seq_length() != layer.window - 1 for layer in cache.layers):
        return False  # a window layer writes in a ring of its window, which must be full
    limits = [limit for limit in (engine.architecture.rope_limit, engine.trained_context) if limit]
    return all(end <= limit for limit in limits)  # past them the eager steps refuse or warn, at the step that does


def static_steps_apply(engine, cache: KVCache, room: int) -> bool:
    """Whether :class:`AnswerLayer` steps can write ``room`` tokens after what ``engine`` read into ``cache``."""
    return not engine.evicts_while_writing() and _plain_and_in_range(engine, cache, cache.next_position() + room)


def _budgeted(engine, cache: KVCache) -> list[tuple[CompressedLayer, int]]:
    """The layers the budget governs (no attention window), each with its budget."""
    return [(layer, budget) for layer, budget in zip(cache.layers, engine.budgets, strict=True) if budget is not None]


def ring_steps_apply(engine, cache: KVCache, room: int) -> bool:
    """Whether :class:`RingLayer` steps can: a method that evicts the oldest token after its sinks while writing,
    every budgeted layer full at its budget (so that each step evicts exactly one; a window layer full at its
    window), positions compacted."""
    method = engine.method
    if not (method.evicts_oldest_while_writing and _plain_and_in_range(engine, cache, cache.next_position() + room)):
        return False
    if cache.keep_positions or cache.heads_apart:
        return False
    budgeted = _budgeted(engine, cache)
    return (bool(budgeted) and all(layer.get_seq_length() == budget > method.sinks for layer, budget in budgeted)
            and cache.next_position() == max(budget for _, budget in budgeted))  # the sinks at positions 0 ...


def evicting_steps_apply(engine, cache: KVCache, room: int) -> bool:
    """Whether :class:`EvictingCache` steps can write ``room`` tokens: a method with a step eviction
    (:meth:`kvcli.methods.base.Method.step_eviction`), every budgeted layer alike (shapes, RoPE frequencies)
    and full at one budget (so that each step evicts exactly one) with the state that eviction reads, a window
    layer full at its window; positions re-assigned (the query never moves) or kept."""
    end = cache.next_position() + (room if cache.keep_positions else 1)
    if not (engine.evicts_while_writing() and _plain_and_in_range(engine, cache, end)):
        return False
    budgeted = _budgeted(engine, cache)
    if not budgeted:
        return False
    layers = [layer for layer, _ in budgeted]
    budget = budgeted[0][1]
    if any(layer.get_seq_length() != budget or other != budget for layer, other in budgeted):
        return False
    if len({(layer.keys.shape, layer.values.shape, layer.keys.dtype) for layer in layers}) != 1:
        return False
    if len({cache.freq_group[layer.layer_idx] for layer in layers}) != 1:
        return False  # the layers' keys rotate as one batch, with one set of RoPE frequencies
    heads = layers[0].values.shape[1]
    eviction = engine.method.step_eviction(budget, [layer.method_state for layer in layers], heads, engine.device)
    if eviction is None:
        return False
    return all(set(layer.state) == set(eviction.names)
               and all(layer.state[name].shape == (heads, budget) for name in eviction.names) for layer in layers)


def answer_steps(engine, cache: KVCache, room: int, static: bool = True,
                 compiled: bool = False) -> EagerSteps | StaticSteps:
    """The decode steps for writing up to ``room`` tokens after a read into ``cache``: static where
    :func:`static_steps_apply`, :func:`ring_steps_apply` or :func:`evicting_steps_apply` (on every device: a
    CPU gains too, no cache is concatenated per token), else the engine's own; ``static`` False forces the
    engine's (the reference the static steps are tested against); ``compiled`` compiles a static step
    (:class:`StaticSteps`)."""
    if static and room > 0:
        if static_steps_apply(engine, cache, room):
            return StaticSteps(engine, cache, room, compiled=compiled)
        if ring_steps_apply(engine, cache, room):
            return StaticSteps(engine, cache, room, layout=RingCache, compiled=compiled)
        if evicting_steps_apply(engine, cache, room):
            return StaticSteps(engine, cache, room, layout=EvictingCache, compiled=compiled)
    return EagerSteps(engine, cache)
