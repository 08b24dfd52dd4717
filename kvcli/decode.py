"""Writing an answer one token at a time: the engine's compressed step, or a static step replayed as a CUDA graph.

Every generated token is one forward pass of a single query. kvcli's ordinary step
(:class:`EagerSteps`) runs it through :meth:`kvcli.engine.Engine.forward`, which lets the method evict
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

Where the static step cannot stand in (a method that evicts while writing, a quantized cache, a
layer with its own layout or an attention window, positions that would pass the trained context),
:func:`answer_steps` returns the eager one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcli.cache import CompressedLayer, KVCache

__all__ = ["AnswerLayer", "EagerSteps", "StaticSteps", "answer_steps", "static_steps_apply"]


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     visible: torch.Tensor) -> torch.Tensor:
    """Attention of ``query`` ``[1, H_q, n, D]`` to the ``visible`` ``[T]`` keys of ``key``/``value``
    ``[1, H_kv, T, D]`` (query heads grouped under their KV head): ``[1, H_q, n, D]``.

    The softmax runs in fp32; hidden keys get probability 0, so the buffer's unfilled slots (zeros)
    add nothing to the output.
    """
    _, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    grouped = (query * scaling).reshape(1, kv_heads, (q_heads // kv_heads) * q_len, dim)
    logits = torch.matmul(grouped, key.transpose(2, 3))
    logits.masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).view(1, q_heads, q_len, value.shape[-1])


class AnswerLayer(CacheLayerMixin):
    """One layer's keys and values in a fixed buffer with ``room`` free slots after the ``length`` filled ones.

    ``slot`` (a one-element device tensor) is where the next token goes; it moves on the device
    (:meth:`StaticSteps.step`), so a captured graph writes each replay's token one slot further.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    window = None  # kvcli_attention checks the layer's window against the model's

    def __init__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        self.layer_idx = layer_idx
        _, heads, length, _ = keys.shape
        self.length = length
        self.keys = keys.new_zeros((1, heads, length + room, keys.shape[-1]))
        self.values = values.new_zeros((1, heads, length + room, values.shape[-1]))
        self.keys[:, :, :length] = keys
        self.values[:, :, :length] = values
        self.slot = torch.tensor([length], device=keys.device)
        self.slots = torch.arange(length + room, device=keys.device)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("an answer layer is built full")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int) -> tuple[torch.Tensor, None]:
        """The step's attention, to the filled slots and the token just written (no scores: nothing is evicted)."""
        return masked_attention(query, key, value, scaling, self.slots <= self.slot), None

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class AnswerCache(Cache):
    """The cache a static step runs against: the attributes :func:`kvcli.attention.kvcli_attention` reads,
    none of which asks for scores."""

    def __init__(self, layers: list[AnswerLayer]):
        super().__init__(layers=layers)
        self.score_window = 0
        self.question_scores = False
        self.probing = False


def static_steps_apply(engine, cache: KVCache, room: int) -> bool:
    """Whether :class:`StaticSteps` can write ``room`` tokens after what ``engine`` read into ``cache``."""
    if engine.evicts_while_writing() or cache.kv_quant is not None:
        return False
    if not all(type(layer) is CompressedLayer and layer.is_initialized and isinstance(layer.keys, torch.Tensor)
               for layer in cache.layers):
        return False  # a window layer drops tokens as it writes; a layer of its own layout attends its own way
    end = cache.next_position() + room
    limits = [limit for limit in (engine.architecture.rope_limit, engine.trained_context) if limit]
    return all(end <= limit for limit in limits)  # past them the eager steps refuse or warn, at the step that does


class EagerSteps:
    """The engine's own step: each token one :meth:`kvcli.engine.Engine.forward` marked ``decoding``."""

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
    :meth:`finish` gives them back. ``graph`` None captures on CUDA and runs eagerly elsewhere."""

    def __init__(self, engine, cache: KVCache, room: int, graph: bool | None = None):
        self.engine = engine
        self.cache = cache
        self.room = room
        self.start = cache.next_position()
        self.steps = 0
        with torch.inference_mode():
            layers = []
            for layer in cache.layers:
                layers.append(AnswerLayer(layer.layer_idx, layer.current_keys(self.start), layer.values, room))
                if layer.needs_rotation(self.start):  # the buffer holds the keys rotated to where they are now
                    layer.entry_pos = layer.current_positions(self.start).expand_as(layer.entry_pos)
                layer.keys = layer.values = None  # moved, not copied: memory stays at one cache
            self.answer = AnswerCache(layers)
            self.ids = torch.zeros((1, 1), dtype=torch.long, device=engine.device)
            self.position = torch.tensor([[self.start]], device=engine.device)
        self.use_graph = engine.device.type == "cuda" if graph is None else graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def step(self) -> torch.Tensor:
        """One token's forward on the buffers (the program a graph captures): the logits ``[V]`` after it,
        every layer's slot and the position moved on by one."""
        engine = self.engine
        hidden = engine.decoder(input_ids=self.ids, position_ids=self.position, past_key_values=self.answer,
                                use_cache=True, kvcli_cache=self.answer).last_hidden_state
        logits = engine.head(hidden[0, -1:])[0]
        for layer in self.answer.layers:
            layer.slot.add_(1)
        self.position.add_(1)
        return logits

    def capture(self) -> None:
        """Warm the step up on a side stream (kernel choices, workspaces), undo the warm-up's moves, and
        capture one step; a replay then runs it from the slots and position as they stand."""
        slots = [layer.slot.clone() for layer in self.answer.layers]
        position = self.position.clone()
        side = torch.cuda.Stream(self.engine.device)
        side.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream(self.engine.device).wait_stream(side)
        for layer, slot in zip(self.answer.layers, slots, strict=True):
            layer.slot.copy_(slot)
        self.position.copy_(position)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step()

    @torch.inference_mode()
    def __call__(self, token: int) -> torch.Tensor:
        """The logits ``[V]`` after ``token`` (a view the next call overwrites when replaying a graph)."""
        if self.steps >= self.room:
            raise RuntimeError(f"the static steps have room for {self.room} tokens")
        self.ids.fill_(token)
        self.steps += 1
        if not self.use_graph:
            return self.step()
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.logits

    @torch.inference_mode()
    def finish(self) -> None:
        """Hand the buffers back to the cache's layers with the tokens written, as the eager steps would have
        appended them (entered at their positions, the stream moved on); the graph and its memory go."""
        steps = self.steps
        for layer, answer in zip(self.cache.layers, self.answer.layers, strict=True):
            filled = answer.length + steps
            layer.keys = answer.keys[:, :, :filled]
            layer.values = answer.values[:, :, :filled]
            heads = layer.entry_pos.shape[0]
            offsets = torch.arange(steps, device=layer.entry_pos.device).expand(heads, steps)
            layer.entry_pos = torch.cat((layer.entry_pos, self.start + offsets), dim=-1)
            layer.token_idx = torch.cat((layer.token_idx, self.cache.stream_start + offsets), dim=-1)
        self.cache.stream_start += steps
        self.cache.block_start = self.start + steps - 1 if steps else self.cache.block_start
        self.graph = self.logits = None
        self.answer = None
        self.steps = 0

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens()


def answer_steps(engine, cache: KVCache, room: int, static: bool = True) -> EagerSteps | StaticSteps:
    """The decode steps for writing up to ``room`` tokens after a read into ``cache``: static where
    :func:`static_steps_apply` (on every device: a CPU gains too, no cache is concatenated per token), else
    the engine's own; ``static`` False forces the engine's (the reference the static steps are tested against)."""
    if static and room > 0 and static_steps_apply(engine, cache, room):
        return StaticSteps(engine, cache, room)
    return EagerSteps(engine, cache)
