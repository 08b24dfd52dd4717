"""Writing an answer one token at a time: the engine's compressed step, or a static step replayed as a CUDA graph.

Every generated token is one forward pass of a single query. kvcli's ordinary step
(:class:`EagerSteps`) runs it through :meth:`kvcli.engine.engine.Engine.forward`, which lets the method evict
while writing. On a GPU that step is host-bound: a few hundred small kernels launched from Python, one
by one, for one token (docs/benchmarks.md).

A method that keeps the answer (:attr:`kvcli.methods.base.Method.keeps_answer`: SnapKV, PyramidKV) or
an unbounded one (``full``) evicts nothing while writing, so no step changes what the cache held
before it: the cached keys keep their positions and every step is the same program on the same
tensors. :class:`StaticSteps` makes it so: each layer's keys (rotated to their positions) and values
move once into a buffer with room for the answer; a step writes its key and value at the layer's next
slot, held on the device, attends to the filled slots only, and advances the slots and the position on
the device too. On CUDA that step is captured once as a ``torch.cuda.CUDAGraph`` and replayed per
token: one launch and one host read (the token) a step. When the answer is done, the layers take
their buffers back (:meth:`StaticSteps.finish`), so the cache holds what the eager steps would have
left: the read and the answer.

StreamingLLM evicts while writing, but always the oldest token after its sinks: its window is a ring
(:class:`RingLayer`). The new token overwrites the slot of the token the step before evicted, and instead
of re-rotating every window key each step, positions run on from the read (the query at ``start + t``)
while the sinks are scored with the query turned back by ``t``: every distance is the one the eager
step's re-assigned positions give.

A method that evicts one token a step by its scores (TreeKV's pair rule, H2O's and TOVA's lowest score)
gives that rule in fixed shapes (:meth:`kvcli.methods.base.Method.step_eviction`). Every layer's tokens are
then stacked with one slot for the step's (:class:`EvictingCache`); after each step one batched eviction for
all layers drops a token per KV head, closes the gap, and rotates the keys to where they sit at the next
step, so the cache stays what the engine's step leaves.

A layer with an attention window (Gemma 3, Qwen 2, Mistral) drops its oldest token every step whatever the
method: in every layout it writes in a ring of its window (:class:`RingLayer` without sinks).

Where no static step can stand in (a method whose decoding rule has no fixed-shape form, attention that is
not a plain softmax, a quantized cache, a layer with its own layout, positions that would pass the trained
context), :func:`answer_steps` returns the eager one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcli.kv.attention import grouped_logits
from kvcli.kv.cache import CompressedLayer, KVCache, WindowLayer
from kvcli.kv.joined import union_offsets
from kvcli.kv.rope import rotate_keys

__all__ = ["AnswerCache", "AnswerLayer", "EagerSteps", "EvictingCache", "EvictingLayer", "RingCache", "RingLayer",
           "StaticSteps", "answer_steps",
           "evicting_steps_apply", "graph_capturable", "ring_steps_apply", "static_steps_apply"]


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
    def of(cls, layer: CompressedLayer, steps: StaticSteps) -> AnswerLayer:
        """The layer ``steps`` write through in place of ``layer``."""
        return cls(layer, steps.start, steps.room)

    def __init__(self, layer: CompressedLayer, start: int, room: int):
        super().__init__()
        # The buffer holds the keys rotated to where they are now: their entry positions become those.
        moved_to = layer.current_positions(start) if layer.needs_rotation(start) else None
        keys, values = self.take(layer, start)
        if moved_to is not None:
            layer.entry_pos = moved_to.expand_as(layer.entry_pos)
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
        offsets = torch.arange(steps, device=self.device).expand(layer.entry_pos.shape[0], steps)
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
    def of(cls, layer: CompressedLayer, steps: StaticSteps) -> RingLayer:
        sinks = 0 if layer.window is not None else steps.engine.method.sinks
        return cls(layer, steps.start, sinks, steps.position, steps.token, steps.clock)

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
        self.tokens = torch.cat((tokens, tokens.new_zeros(1)))  # each slot's token

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
        layer.entry_pos = torch.cat((sinks, self.entry[order])).expand(heads, -1)
        layer.token_idx = torch.cat((layer.token_idx[0, :self.sinks], self.tokens[order])).expand(heads, -1)
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
    def build(cls, steps: StaticSteps) -> AnswerCache:
        """The cache ``steps`` write through, taking over the layers of ``steps.cache`` (a layer with an attention
        window as a ring of it, whatever the method)."""
        return cls([(RingLayer if layer.window is not None else cls.layer_type).of(layer, steps)
                    for layer in steps.cache.layers])

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


class EvictingLayer(AnswerLayer):
    """One layer's part of :class:`EvictingCache`: the step writes its token into the last slot and attends to
    every slot, the keys as the cache rotated them for this step, and keeps its query's attention (as a record
    would); the cache evicts after the whole step."""

    def __init__(self, stack: EvictingCache, index: int, layer: CompressedLayer):
        CacheLayerMixin.__init__(self)
        self.stack, self.index = stack, index  # this layer's place in the stacked tensors
        self.layer_idx = layer.layer_idx
        self.moved = layer.moved
        self.keys, self.values = stack.keys[index], stack.values[index]  # [1, H, T + 1, D]
        self.current = stack.current[index]
        # what the step attends to: the slots and the unused ones after them (zeros, masked out)
        self.attended_keys, self.attended_values = stack.padded_current[index], stack.padded_values[index]
        self.probs = stack.probs[index]  # [H, group, T + 1]
        self.length = self.keys.shape[2] - 1
        self.dtype, self.device = self.keys.dtype, self.keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = self.length
        self.keys[:, :, new:].copy_(key_states)
        self.values[:, :, new:].copy_(value_states)
        self.current[:, :, new:].copy_(key_states)  # at the step's position, where it was rotated
        return self.current, self.values

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int) -> tuple[torch.Tensor, None]:
        """Attention to every slot; the query's attention ``[H_kv, group, T]`` is kept for the eviction."""
        logits = grouped_logits(query, self.attended_keys, scaling).masked_fill_(self.stack.unused, float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out = torch.matmul(probs.to(value.dtype), self.attended_values).view(query.shape[:3] + value.shape[-1:])
        self.probs.copy_(probs.view(self.probs.shape[:2] + probs.shape[-1:])[..., :self.probs.shape[-1]])
        return out, None

    def advance(self) -> None:
        """Nothing of its own: :meth:`EvictingCache.advance` moves every stacked layer at once."""

    def written(self) -> list[torch.Tensor]:
        return []  # the stacked tensors are the cache's (EvictingCache.written)

    def give_back(self, layer: CompressedLayer, steps: int, start: int, stream_start: int) -> None:
        """``layer`` holds the budget's tokens the steps left, in stream order, with the method's state."""
        stack, i, count = self.stack, self.index, self.length
        layer.keys = self.keys[:, :, :count].clone()
        layer.values = self.values[:, :, :count].clone()
        layer.entry_pos = stack.entry[i, :, :count].clone()
        layer.token_idx = stack.tokens[i, :, :count].clone()
        layer.state = {name: rows[:, :count].clone() for name, rows in stack.state_of(i).items()}
        layer.moved = self.moved or steps > 0


class EvictingCache(AnswerCache):
    """The layers of a method that evicts one token a step by its scores while writing (TreeKV, H2O, TOVA),
    stacked: each layer's ``budget`` tokens and one slot for the step's, in stream order as the engine's step
    leaves them.

    After a step (:meth:`advance`), the method's :class:`kvcli.methods.base.StepEviction` picks the token each
    KV head of each layer drops, the slots after it move one to the left, and the keys are rotated from their
    entry copies to where they sit at the next step (a token leaving moves the ones after it), as the engine's
    step rotates them: for every layer at once, a few dozen kernels a step rather than a few dozen a layer.
    The query stays at the read's next position, as in the engine's steps.
    """

    layer_type = EvictingLayer

    @staticmethod
    def query_moves(cache: KVCache) -> bool:
        return cache.keep_positions  # every token at its index in the stream: nothing is re-assigned

    @classmethod
    def build(cls, steps: StaticSteps) -> EvictingCache:
        return cls(steps)

    def __init__(self, steps: StaticSteps):
        engine, cache = steps.engine, steps.cache
        layers = [layer for layer in cache.layers if layer.window is None]  # the budgeted ones; window layers ring
        first = layers[0]
        count, heads = first.get_seq_length(), first.values.shape[1]
        slots, size = count + 1, len(layers)
        self.eviction = engine.method.step_eviction(engine.budgets[first.layer_idx],
                                                    [layer.method_state for layer in layers], heads, engine.device)
        # [layers, 1, H, T + 1, D] views of buffers whose unused slots up to a multiple of SLOT_MULTIPLE stay zero
        self.padded_keys = first.keys.new_zeros((size, 1, heads, padded(slots), first.keys.shape[-1]))
        self.padded_values = first.values.new_zeros((size, 1, heads, padded(slots), first.values.shape[-1]))
        self.keys, self.values = self.padded_keys[..., :slots, :], self.padded_values[..., :slots, :]
        self.unused = torch.arange(padded(slots), device=engine.device) >= slots
        self.entry = first.entry_pos.new_zeros((size, heads, slots))  # where each key was rotated
        self.tokens = first.token_idx.new_zeros((size, heads, slots))
        self.state = {name: first.state[name].new_zeros((size * heads, slots)) for name in self.eviction.names}
        for i, layer in enumerate(layers):  # moved in one layer at a time: memory stays near one cache
            self.keys[i, :, :, :count] = layer.keys
            self.values[i, :, :, :count] = layer.values
            layer.keys = layer.values = None
            self.entry[i, :, :count] = layer.entry_pos
            self.tokens[i, :, :count] = layer.token_idx
            for name, rows in self.state_of(i).items():
                rows[:, :count] = layer.state[name]
        self.inv_freq = first.inv_freq  # every layer's (evicting_steps_apply)
        self.heads_apart = cache.heads_apart
        self.keep_positions = cache.keep_positions  # the keys sit where they entered: none is ever rotated
        self.position = steps.position  # the step's position [1, 1], fixed unless positions are kept
        self.token = steps.token  # the step's token index in the stream [1, 1], shared with the steps
        self.slots = torch.arange(slots, device=engine.device)
        # The keys rotated to where they sit at the coming step.
        self.padded_current = self.padded_keys if self.keep_positions else torch.zeros_like(self.padded_keys)
        self.current = self.padded_current[..., :slots, :]
        group = engine.model.config.num_attention_heads // heads
        self.probs = torch.zeros((size, heads, group, slots), dtype=torch.float32, device=engine.device)
        self.chunk = size if engine.device.type == "cuda" else 1
        self.place()
        stacked = {layer.layer_idx: EvictingLayer(self, i, layer) for i, layer in enumerate(layers)}
        super().__init__([stacked[layer.layer_idx] if layer.window is None else RingLayer.of(layer, steps)
                          for layer in cache.layers])

    def state_of(self, index: int) -> dict[str, torch.Tensor]:
        """The method's per-token state of stacked layer ``index``, as views ``[H, T + 1]``."""
        size, heads, slots = self.entry.shape
        return {name: rows.view(size, heads, slots)[index] for name, rows in self.state.items()}

    def place(self, first: int = 0, last: int | None = None) -> None:
        """Rotate the cached keys of layers ``first ... last - 1`` to their positions at the coming step (the
        last slot is the step's own)."""
        if self.keep_positions:
            return
        layers = slice(first, last)
        entry = self.entry[layers]
        size, heads, slots = entry.shape
        count = slots - 1
        if self.heads_apart:  # the distinct tokens of a layer's heads in stream order, ending before the query
            offsets = union_offsets(list(self.tokens[layers, :, :count].unbind(0)))  # [H, layers * T]
            positions = self.position - offsets.view(heads, size, count).transpose(0, 1)
        else:
            positions = self.position - count + self.slots[:count]
        rotated = rotate_keys(self.keys[layers, 0, :, :count], positions - entry[:, :, :count], self.inv_freq)
        self.current[layers, 0, :, :count] = rotated

    def advance(self) -> None:
        """Enter the step's token, let the method evict one token per KV head of every layer, close the gaps,
        and rotate the keys for the next step: a GPU runs it for all layers at once (few kernels), a CPU
        ``chunk`` layers at a time (the tensors of a few layers stay in its caches)."""
        size, heads, slots = self.entry.shape
        count = slots - 1
        self.entry[:, :, count:] = self.position
        self.tokens[:, :, count:] = self.token
        for state in self.state.values():
            state[:, count:] = 0
        gone = self.eviction.victim(self.probs, self.state)  # [rows, 1]
        after = (self.slots[:count] >= gone).view(size, heads, count)  # the slots that take their right neighbour's
        for first in range(0, size, self.chunk):
            layers = slice(first, first + self.chunk)
            for tensor in (self.keys[layers, 0], self.values[layers, 0]):
                tensor[:, :, :count] = torch.where(after[layers, :, :, None], tensor[:, :, 1:], tensor[:, :, :count])
            for rows in (self.entry[layers], self.tokens[layers],
                         *(state.view(size, heads, slots)[layers] for state in self.state.values())):
                rows[:, :, :count] = torch.where(after[layers], rows[:, :, 1:], rows[:, :, :count])
            self.place(first, first + self.chunk)
        super().advance()  # the window layers' rings

    def written(self) -> list[torch.Tensor]:
        """Not the rotated keys, which :meth:`restored` makes again: a rehearsal saves one copy fewer of the cache."""
        return [self.keys, self.values, self.entry, self.tokens, *self.state.values(), *self.eviction.written(),
                *super().written()]  # and the window layers' rings

    def restored(self) -> None:
        self.place()

    def give_back(self, cache: KVCache, steps: int, start: int) -> None:
        self.eviction.save([layer.method_state for layer in cache.layers if layer.window is None])
        super().give_back(cache, steps, start)


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


def graph_capturable(model: torch.nn.Module) -> bool:
    """Whether a decode step of ``model`` is worth capturing as a CUDA graph: on CUDA, with plain weights on
    one device (quantized weights and accelerate's dispatch hooks may launch what a graph cannot hold; a
    capture that fails anyway falls back to launching the step, :meth:`StaticSteps.__call__`)."""
    device = next(model.parameters()).device
    dispatched = len(set(getattr(model, "hf_device_map", {}).values())) > 1
    return device.type == "cuda" and not getattr(model, "is_quantized", False) and not dispatched


class EagerSteps:
    """The engine's own step: each token one :meth:`kvcli.engine.engine.Engine.forward` marked ``decoding``."""

    def __init__(self, engine, cache: KVCache):
        self.engine = engine
        self.cache = cache
        self.max_tokens = cache.max_tokens()

    def __call__(self, token: int) -> torch.Tensor:
        """The logits ``[V]`` after ``token``."""
        hidden = self.engine.forward(self.cache, torch.tensor([[token]], dtype=torch.long), decoding=True)
        self.max_tokens = max(self.max_tokens, self.cache.max_tokens())
        return self.engine.logits(hidden[-1:])[0]

    def finish(self) -> None:
        """Nothing to hand back: every step wrote into the cache."""


class StaticSteps:
    """Up to ``room`` decode steps on fixed buffers that take over ``cache``'s layers (see the module's text);
    :meth:`finish` gives them back. ``layout`` is the kind of cache they write through: :class:`AnswerCache`
    (nothing evicted while writing), :class:`RingCache` (StreamingLLM) or :class:`EvictingCache` (a method's
    step eviction). ``graph`` None captures on CUDA and runs eagerly elsewhere. ``compiled`` runs the step through
    ``torch.compile`` (before the capture, on CUDA): inductor fuses the model's small elementwise kernels, which
    a graph otherwise replays one by one, at the cost of a compilation of tens of seconds in each process."""

    def __init__(self, engine, cache: KVCache, room: int, graph: bool | None = None,
                 layout: type[AnswerCache] = AnswerCache, compiled: bool = False):
        self.engine = engine
        self.cache = cache
        self.room = room
        self.layout = layout
        self.start = cache.next_position()
        self.steps = 0
        with torch.inference_mode():
            self.ids = torch.zeros((1, 1), dtype=torch.long, device=engine.device)
            self.position = torch.tensor([[self.start]], device=engine.device)
            self.token = torch.tensor([[cache.stream_start]], device=engine.device)
            # start + t: the position itself where it moves on, else a ring's own (RingLayer)
            self.clock = self.position if layout.query_moves(cache) else self.position.clone()
            self.answer = layout.build(self)
        self.use_graph = graph_capturable(engine.model) if graph is None else graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.program = torch.compile(self.step, dynamic=False) if compiled else self.step

    def run(self) -> torch.Tensor:
        """One step through :attr:`program`. A compiled program that fails to compile is dropped for the plain
        step, with one warning, and the step run again: a step writes only at its slots and moves them on last,
        so what a partly run step wrote, the plain one writes again the same."""
        try:
            return self.program()
        except Exception as error:  # dynamo and inductor raise many kinds; the plain step is always there
            if self.program == self.step:
                raise
            self.engine.warn(f"could not compile the decode step ({type(error).__name__}); writing without compiling")
            self.program = self.step
            return self.step()

    def step(self) -> torch.Tensor:
        """One token's forward on the buffers (the program a graph captures): the logits ``[V]`` after it,
        every layer's slot, the token index and (unless the layout's query stays) the position moved on by one."""
        engine = self.engine
        hidden = engine.decoder(input_ids=self.ids, position_ids=self.position, past_key_values=self.answer,
                                use_cache=True, kvcli_cache=self.answer).last_hidden_state
        logits = engine.head(hidden[0, -1:])[0]
        self.answer.advance()
        self.clock.add_(1)  # the position, where it moves on
        self.token.add_(1)
        return logits

    def rehearse(self, steps: int) -> None:
        """Run ``steps`` steps and undo everything they wrote (slots, position, token index, and what a ring or
        an eviction overwrote): the warm-up before a capture (kernel choices, workspaces)."""
        written = self.answer.written() + [self.position, self.token] + ([] if self.clock is self.position
                                                                         else [self.clock])
        saved = [tensor.clone() for tensor in written]
        for _ in range(steps):
            self.run()
        for tensor, copy in zip(written, saved, strict=True):
            tensor.copy_(copy)
        self.answer.restored()

    def capture(self) -> None:
        """Rehearse the step on a side stream and capture one step; a replay then runs it from the slots and
        position as they stand."""
        side = torch.cuda.Stream(self.engine.device)
        side.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(side):
            self.rehearse(2)
        torch.cuda.current_stream(self.engine.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.program()

    @torch.inference_mode()
    def __call__(self, token: int) -> torch.Tensor:
        """The logits ``[V]`` after ``token`` (a view the next call overwrites when replaying a graph)."""
        if self.steps >= self.room:
            raise RuntimeError(f"the static steps have room for {self.room} tokens")
        self.ids.fill_(token)
        self.steps += 1
        if not self.use_graph:
            return self.run()
        if self.graph is None:
            try:
                self.capture()
            except RuntimeError:  # a kernel or hook that cannot be captured: the same step, launched eagerly
                self.graph = self.logits = None
                self.use_graph = False
                return self.run()
        self.graph.replay()
        return self.logits

    @torch.inference_mode()
    def finish(self) -> None:
        """Hand the buffers back to the cache's layers with the tokens written, as the eager steps would have
        left them (entered at their positions, the stream moved on); the graph and its memory go."""
        steps = self.steps
        self.answer.give_back(self.cache, steps, self.start)
        self.cache.stream_start += steps
        if steps:  # the last step's position in the eager steps: re-assigned, one that evicts stays at the start
            moved = self.cache.keep_positions or not self.engine.evicts_while_writing()
            self.cache.block_start = self.start + steps - 1 if moved else self.start
        self.graph = self.logits = None
        self.answer = None
        self.steps = 0

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens()


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
