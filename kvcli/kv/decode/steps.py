"""The decode steps that write an answer one token at a time: the engine's own (:class:`EagerSteps`), or a
static step on fixed buffers (:class:`StaticSteps`), captured once as a CUDA graph and replayed per token, or
compiled. The overview is :mod:`kvcli.kv.decode`'s.
"""

from __future__ import annotations

import torch

from kvcli.kv.cache import KVCache
from kvcli.kv.decode.layouts import AnswerCache, StepFrame


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
            self.answer = layout.build(StepFrame(engine, cache, self.start, room, self.position, self.token,
                                                 self.clock))
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
