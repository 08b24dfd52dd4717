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

from kvcli.kv.decode.choice import answer_steps, evicting_steps_apply, ring_steps_apply, static_steps_apply
from kvcli.kv.decode.evicting import EvictingCache, EvictingLayer
from kvcli.kv.decode.layouts import AnswerCache, AnswerLayer, RingCache, RingLayer, StepFrame, masked_attention
from kvcli.kv.decode.steps import EagerSteps, StaticSteps, graph_capturable

__all__ = ["AnswerCache", "AnswerLayer", "EagerSteps", "EvictingCache", "EvictingLayer", "RingCache", "RingLayer",
           "StaticSteps", "StepFrame", "answer_steps", "evicting_steps_apply", "graph_capturable", "masked_attention",
           "ring_steps_apply", "static_steps_apply"]
