"""Layers compressed as one batch: which layers of a forward stand alike, and each layer's rows of the answer.

The engine shows a method every budgeted layer of a forward at once
(:meth:`kvcli.methods.base.Method.compress_layers`). Layers that stand alike (every layer of a uniform budget
in a stream) are observed, scored and selected as one batch, their KV heads as the rows of one tensor, so
that a block runs one selection for the whole model rather than one per layer. A method says what "alike"
means (a key per layer) and computes a batch; grouping the layers and handing each its rows is done here,
once for every method. Each layer's answer is the one it gets alone: batching changes how many operations a
block runs, never what is kept.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from kvcli.kv.cache import LayerView

Answer = TypeVar("Answer")


def alike_groups(keys: Sequence[Hashable]) -> list[list[int]]:
    """The indices of equal ``keys`` (one key per layer), a group per key, in the order of their first layers."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def place(answers: list[Answer | None], members: list[int], batch: Sequence[Answer]) -> None:
    """Put the answers of a batch of layers (``members``, their indices in order) at their layers' places."""
    for i, answer in zip(members, batch, strict=True):
        answers[i] = answer


def record_and_state_key(view: LayerView, uneven: bool = False) -> tuple:
    """What layers must share to be scored as one batch, beside what they keep: the block's size, the KV heads, the
    shapes of the recorded attention and of the per-token state. ``uneven``: what layers that differ in length
    must share (their shapes but the tokens')."""
    record = view.record

    def shape(tensor: torch.Tensor | None):
        return None if tensor is None else tensor.shape[:-1] if uneven else tensor.shape

    seen = None if record is None else (record.window, record.own_window, shape(record.probs), shape(record.probe))
    state = tuple((name, shape(value)) for name, value in view.layer.state.items())
    return view.num_new, view.num_heads, seen, state


@dataclass
class ScoredBatches:
    """A forward's layers in the batches of a scored method (:class:`kvcli.methods.base.ScoredMethod`).

    ``alike``: groups of layers of the same length, kept count, protected span and shapes, selected as one;
    ``uneven``: groups of layers over their counts that stand alone by length or count (PyramidKV's budgets)
    but share their shapes otherwise, scored into rows padded to the longest and selected with one sort.
    """

    alike: list[list[int]]
    uneven: list[list[int]]

    @classmethod
    def of(cls, views: list[LayerView], counts: list[int], spans: list[tuple[int, int, int]]) -> ScoredBatches:
        """The batches of layers ``views`` keeping ``counts`` tokens each, their ``(length, sinks, recent)``
        protected ``spans``."""
        alike, lone = [], []
        for members in alike_groups([(count, span, *record_and_state_key(view))
                                     for view, count, span in zip(views, counts, spans, strict=True)]):
            if len(members) == 1 and views[members[0]].length > counts[members[0]]:
                lone.append(members[0])
            else:
                alike.append(members)
        uneven = alike_groups([record_and_state_key(views[i], uneven=True) for i in lone])
        return cls(alike, [[lone[j] for j in members] for members in uneven])


def layer_answers(chosen: torch.Tensor, layers: int, heads: int, count: int) -> list[torch.Tensor]:
    """The rows of a batch's choice ``[layers * rows, count]`` back to each layer's ``[heads, count]``: a method
    that chooses once per layer (one row a layer) gives the choice to every KV head."""
    rows = chosen.shape[0] // layers
    parts = chosen.split(rows) if layers > 1 else (chosen,)
    return [keep if rows == heads else keep.expand(heads, count) for keep in parts]


def uneven_layer_answers(chosen: torch.Tensor, counts: list[int], heads: int) -> list[torch.Tensor]:
    """The rows of a choice of layers of different counts ``[L * rows, max(counts)]`` (each layer's indices in its
    first ``counts[l]`` columns) back to each layer's ``[heads, counts[l]]``, as :func:`layer_answers`."""
    layers = len(counts)
    rows = chosen.shape[0] // layers
    if rows != heads:  # one choice per layer: every KV head keeps it
        chosen = chosen.view(layers, rows, -1).expand(layers, heads, -1).reshape(layers * heads, -1)
    return [keep[:, :count] for keep, count in zip(chosen.split(heads), counts, strict=True)]
