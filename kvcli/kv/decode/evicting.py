"""The layout of a method that evicts one token a step by its scores while writing (TreeKV, H2O, TOVA): every
budgeted layer stacked, one batched eviction a step (:class:`EvictingCache`). The overview is
:mod:`kvcli.kv.decode`'s.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcli.kv.attention import grouped_logits
from kvcli.kv.cache import POSITION_DTYPE, CompressedLayer, KVCache
from kvcli.kv.decode.layouts import AnswerCache, AnswerLayer, RingLayer, StepFrame, padded
from kvcli.kv.joined import union_offsets
from kvcli.kv.rope import rotate_keys


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
        layer.entry_pos = stack.entry[i, :, :count].to(POSITION_DTYPE)  # a copy: the buffers are the steps'
        layer.token_idx = stack.tokens[i, :, :count].to(POSITION_DTYPE)
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
    def build(cls, frame: StepFrame) -> EvictingCache:
        return cls(frame)

    def __init__(self, frame: StepFrame):
        engine, cache = frame.engine, frame.cache
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
        # Where each key was rotated and its token, as the steps write them (int64; the layers' dtype on give_back).
        self.entry = first.entry_pos.new_zeros((size, heads, slots), dtype=torch.long)
        self.tokens = first.token_idx.new_zeros((size, heads, slots), dtype=torch.long)
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
        self.position = frame.position  # the step's position [1, 1], fixed unless positions are kept
        self.token = frame.token  # the step's token index in the stream [1, 1], shared with the steps
        self.slots = torch.arange(slots, device=engine.device)
        # The keys rotated to where they sit at the coming step.
        self.padded_current = self.padded_keys if self.keep_positions else torch.zeros_like(self.padded_keys)
        self.current = self.padded_current[..., :slots, :]
        group = engine.model.config.num_attention_heads // heads
        self.probs = torch.zeros((size, heads, group, slots), dtype=torch.float32, device=engine.device)
        self.chunk = size if engine.device.type == "cuda" else 1
        self.place()
        stacked = {layer.layer_idx: EvictingLayer(self, i, layer) for i, layer in enumerate(layers)}
        super().__init__([stacked[layer.layer_idx] if layer.window is None else RingLayer.of(layer, frame)
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
