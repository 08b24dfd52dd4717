"""The fixed buffers a static decode step writes through where the method evicts nothing while writing
(:class:`AnswerCache`) or always the oldest token (:class:`RingCache`, and every layer with an attention window),
and what every layout shares: slots padded to :data:`SLOT_MULTIPLE`, the masked attention, :class:`StepFrame`.
The overview is :mod:`kvcli.kv.decode`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcli.kv.attention import grouped_logits
from kvcli.kv.cache import CompressedLayer, KVCache
from kvcli.kv.rope import rotate_keys

#: Every fixed buffer's slots are a multiple of this, the unused ones masked out: cuBLAS runs a product whose
#: inner size is not a multiple of 8 (a step's probabilities times ``T + 1`` values) on a slow fallback kernel
#: (docs/benchmarks.md, "Aligned slots").
SLOT_MULTIPLE = 64


def padded(slots: int) -> int:
    """``slots`` rounded up to :data:`SLOT_MULTIPLE`."""
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     visible: torch.Tensor) -> torch.Tensor:
    """Attention of ``query`` ``[1, H_q, n, D]`` to the ``visible`` ``[T]`` keys of ``key``/``value``
    ``[1, H_kv, T, D]`` (query heads grouped under their KV head): ``[1, H_q, n, D]``.

    The softmax runs in fp32; hidden keys get probability 0, so the buffer's unfilled slots (zeros)
    add nothing to the output.
    """
    logits = grouped_logits(query, key, scaling)
    logits.masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).view(query.shape[:3] + value.shape[-1:])


@dataclass(frozen=True)
class StepFrame:
    """What a layout is built from, shared with the steps that write through it: the engine and the read's
    ``cache``, the answer's first position ``start`` and its ``room`` in tokens, and the step's counters on the
    device (``[1, 1]`` each, moved on by the steps): its ``position``, its ``token`` index in the stream, and
    ``clock`` (``start + t``: the position itself where the query moves on, else a ring's own)."""

    engine: Any
    cache: KVCache
    start: int
    room: int
    position: torch.Tensor
    token: torch.Tensor
    clock: torch.Tensor


class AnswerLayer(CacheLayerMixin):
    """One layer's keys and values in a fixed buffer with ``room`` free slots after the ``length`` filled ones
    (a method that keeps the answer).

    ``slot`` (a one-element device tensor) is where the next token goes; it moves on the device
    (:meth:`advance`), so a captured graph writes each replay's token one slot further.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    window = None  # kvcli_attention checks the layer's window against the model's

    @classmethod
    def of(cls, layer: CompressedLayer, frame: StepFrame) -> AnswerLayer:
        """The layer the steps of ``frame`` write through in place of ``layer``."""
        return cls(layer, frame.start, frame.room)

    def __init__(self, layer: CompressedLayer, start: int, room: int):
        super().__init__()
        # The buffer holds the keys rotated to where they are now: their entry positions become those.
        moved_to = layer.current_positions(start) if layer.needs_rotation(start) else None
        keys, values = self.take(layer, start)
        if moved_to is not None:
            layer.entry_pos = moved_to.to(layer.entry_pos.dtype).expand_as(layer.entry_pos)
        self.keys = self.buffer(keys, room)
        self.values = self.buffer(values, room)
        self.slot = torch.tensor([self.length], device=self.device)
        self.slots = torch.arange(self.keys.shape[2], device=self.device)

    def take(self, layer: CompressedLayer, start: int, rotated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys (rotated to their positions before ``start``, or as stored: rotated where they
        entered) and values, moved out of it (not copied: memory stays at one cache), with what this layer
        records of them."""
        keys, values = (layer.current_keys(start) if rotated else layer.keys), layer.values
        layer.keys = layer.values = None
        self.layer_idx = layer.layer_idx
        self.length = keys.shape[-2]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        return keys, values

    @staticmethod
    def buffer(tokens: torch.Tensor, room: int) -> torch.Tensor:
        """``tokens`` ``[1, H, T, D]`` at the start of a zeroed buffer with ``room`` more slots, and unused ones up
        to a multiple of :data:`SLOT_MULTIPLE`, which every step masks out."""
        out = tokens.new_zeros(tokens.shape[:2] + (padded(tokens.shape[2] + room),) + tokens.shape[3:])
        out[:, :, :tokens.shape[2]] = tokens
        return out

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("an answer layer is built full")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int) -> tuple[torch.Tensor, None]:
        """The step's attention, to the filled slots and the token just written (no scores: nothing is evicted)."""
        return masked_attention(query, self.keys, self.values, scaling, self.slots <= self.slot), None

    def advance(self) -> None:
        """After a step (on the device): the next token goes one slot further."""
        self.slot.add_(1)

    def written(self) -> list[torch.Tensor]:
        """What a step changes that a later step reads: the slot (a step writes only into free slots)."""
        return [self.slot]

    def give_back(self, layer: CompressedLayer, steps: int, start: int, stream_start: int) -> None:
        """``layer`` holds what it held and the ``steps`` tokens written, entered at ``start ...``."""
        filled = self.length + steps
        # A copy when room was left over: a view would hold the whole buffer while reporting the filled part.
        cut = (lambda tensor: tensor[:, :, :filled].clone()) if filled < self.keys.shape[2] else (lambda tensor: tensor)
        layer.keys = cut(self.keys)
        layer.values = cut(self.values)
        offsets = torch.arange(steps, device=self.device, dtype=layer.entry_pos.dtype).expand(layer.entry_pos.shape[0],
                                                                                              steps)
        layer.entry_pos = torch.cat((layer.entry_pos, start + offsets), dim=-1)
        layer.token_idx = torch.cat((layer.token_idx, stream_start + offsets), dim=-1)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class RingLayer(AnswerLayer):
    """A layer that evicts its oldest token each step while writing: StreamingLLM's (``sinks`` fixed tokens and
    a ring of ``window + 1`` slots) or a layer with an attention window of ``W`` (no sinks, a ring of ``W``
    slots), the next token written over the oldest (which the eager step evicted after the step before).

    The sinks sit at positions ``0 ... sinks - 1`` and the step's query at ``start`` in the eager step's
    re-assigned positions; here the ring's ``clock`` runs on at ``start + t`` (the ring's keys keep the
    positions they were rotated at), so the sinks are scored with the query turned back by ``t``. Where the
    model's position stays at ``start`` (:meth:`AnswerCache.query_moves` False), the step's key and query
    are turned forward to the clock.
    """

    @classmethod
    def of(cls, layer: CompressedLayer, frame: StepFrame) -> RingLayer:
        sinks = 0 if layer.window is not None else frame.engine.method.sinks
        return cls(layer, frame.start, sinks, frame.position, frame.token, frame.clock)

    def __init__(self, layer: CompressedLayer, start: int, sinks: int, position: torch.Tensor, token: torch.Tensor,
                 clock: torch.Tensor):
        CacheLayerMixin.__init__(self)
        self.window = layer.window  # kvcli_attention checks it against the model's
        self.is_sliding = layer.window is not None
        tokens = layer.token_idx[0, sinks:]
        keys, values = self.take(layer, start)
        self.sinks = sinks
        self.sink_keys, self.sink_values = keys[:, :, :sinks], values[:, :, :sinks]
        self.keys = self.buffer(keys[:, :, sinks:], 1)
        self.values = self.buffer(values[:, :, sinks:], 1)
        self.size = keys.shape[2] - sinks + 1  # window + 1 slots; the buffer's others are never attended
        self.unused = torch.arange(self.keys.shape[2], device=self.device) >= self.size
        self.slot = torch.tensor([self.size - 1], device=self.device)
        self.inv_freq = layer.inv_freq
        self.start = start
        self.position = position  # the step's position [1, 1], shared with the steps
        self.token = token  # the step's token index in the stream [1, 1], shared with the steps
        self.clock = clock  # start + t [1, 1], shared with the steps: the position position is, or turned to
        self.turn = clock is not position
        self.entry = torch.cat((torch.arange(start - self.length + sinks, start, device=self.device),
                                torch.zeros(1, dtype=torch.long, device=self.device)))  # each ring slot's position
        self.tokens = torch.cat((tokens, tokens.new_zeros(1))).long()  # each slot's token (the steps write int64)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.turn:
            key_states = self.turned(key_states)
        self.entry.index_copy_(0, self.slot, self.clock[0])
        self.tokens.index_copy_(0, self.slot, self.token[0])
        return super().update(key_states, value_states)

    def turned(self, rows: torch.Tensor) -> torch.Tensor:
        """Queries or keys ``[1, H, 1, D]`` the model rotated at ``position``, rotated to ``clock``."""
        return rotate_keys(rows, (self.clock - self.position).expand(rows.shape[1], 1), self.inv_freq)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int) -> tuple[torch.Tensor, None]:
        """Attention to the sinks (the query turned back to ``start``) and to every slot of the ring."""
        if self.turn:
            query = self.turned(query)
        ring = grouped_logits(query, self.keys, scaling).masked_fill_(self.unused, float("-inf"))
        if self.sinks:
            back = (self.start - self.clock).expand(query.shape[1], 1)
            ring = torch.cat((grouped_logits(rotate_keys(query, back, self.inv_freq), self.sink_keys, scaling), ring),
                             dim=-1)
        probs = torch.softmax(ring, dim=-1, dtype=torch.float32).to(value.dtype)
        out = torch.matmul(probs[..., self.sinks:], self.values)
        if self.sinks:
            out = out + torch.matmul(probs[..., :self.sinks], self.sink_values)
        return out.view(query.shape[:3] + value.shape[-1:]), None

    def advance(self) -> None:
        self.slot.add_(1).remainder_(self.size)

    def written(self) -> list[torch.Tensor]:
        """The slot and the whole ring: a step overwrites the slot of a token the next step still reads."""
        return [self.slot, self.keys, self.values, self.entry, self.tokens]

    def give_back(self, layer: CompressedLayer, steps: int, start: int, stream_start: int) -> None:
        """``layer`` holds the sinks and the window the eager steps would have left, oldest first, each key
        entered at the position it was rotated at."""
        newest = (self.size - 2 + steps) % self.size  # the last slot written (none yet: the window's last)
        order = (newest + 1 + torch.arange(self.size, device=self.device)) % self.size
        order = order[1:]  # the oldest slot: evicted by the eager step after the last token (or still empty)
        heads = self.keys.shape[1]
        layer.keys = torch.cat((self.sink_keys, self.keys[:, :, order]), dim=2)
        layer.values = torch.cat((self.sink_values, self.values[:, :, order]), dim=2)
        sinks = torch.arange(self.sinks, device=self.device)
        kind = layer.entry_pos.dtype
        layer.entry_pos = torch.cat((sinks, self.entry[order])).to(kind).expand(heads, -1)
        layer.token_idx = torch.cat((layer.token_idx[0, :self.sinks], self.tokens[order].to(kind))).expand(heads, -1)
        layer.moved = True


class AnswerCache(Cache):
    """The cache a static step runs against: its layers (:attr:`layer_type`, one per layer of the read's cache)
    and the attributes :func:`kvcli.kv.attention.kvcli_attention` reads, none of which asks for scores."""

    layer_type: type[AnswerLayer] = AnswerLayer
    @staticmethod
    def query_moves(cache: KVCache) -> bool:
        """Whether the step's query moves on one position per token (else it stays at the read's next position,
        where the eager steps place every token of an answer that evicts as it goes)."""
        return True

    @classmethod
    def build(cls, frame: StepFrame) -> AnswerCache:
        """The cache the steps of ``frame`` write through, taking over the layers of ``frame.cache`` (a layer with
        an attention window as a ring of it, whatever the method)."""
        return cls([(RingLayer if layer.window is not None else cls.layer_type).of(layer, frame)
                    for layer in frame.cache.layers])

    def __init__(self, layers: list[AnswerLayer]):
        super().__init__(layers=layers)
        self.score_window = 0
        self.question_scores = False
        self.probing = False

    def advance(self) -> None:
        """After a step (on the device): what the next step needs moved on."""
        for layer in self.layers:
            layer.advance()

    def written(self) -> list[torch.Tensor]:
        """What a step changes that a later step reads (undone after a rehearsal)."""
        return [tensor for layer in self.layers for tensor in layer.written()]

    def restored(self) -> None:
        """After a rehearsal restored :meth:`written`: rebuild what is derived from it (nothing here)."""

    def give_back(self, cache: KVCache, steps: int, start: int) -> None:
        """``cache``'s layers hold what they held and the ``steps`` tokens written from position ``start``."""
        for layer, answer in zip(cache.layers, self.layers, strict=True):
            answer.give_back(layer, steps, start, cache.stream_start)


class RingCache(AnswerCache):
    """StreamingLLM's layers while writing (:class:`RingLayer`)."""

    layer_type = RingLayer
