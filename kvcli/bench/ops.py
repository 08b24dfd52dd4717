"""Counting the aten operations a piece of code issues: a device-independent measure of engine overhead.

On a GPU a block is host-bound when Python and kernel launches take longer than the kernels, so the
number of operations the engine adds around a plain forward is what decides its speed there, and
host reads (``.item()``, ``.tolist()``, ``nonzero``) each stall the stream. Both can be counted on
the CPU: ``tests/test_overhead.py`` keeps them under a bound so the overhead cannot creep back on a
machine without a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operations that copy a device value to the host: on CUDA each one waits for the stream to drain.
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
                        "aten.is_nonzero.default"})


@dataclass
class OpCount:
    """How many aten operations ran, by name."""

    ops: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return sum(count for name, count in self.ops.items() if name in HOST_READS)


class _Counting(TorchDispatchMode):
    def __init__(self, into: OpCount):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.into.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(run: Callable[[], object]) -> OpCount:
    """Run ``run()`` and count the aten operations it dispatches (views and in-place ones included)."""
    counted = OpCount()
    with _Counting(counted):
        run()
    return counted


def plain_block_ops(model: torch.nn.Module, ids: torch.Tensor, cached: int) -> OpCount:
    """Operations of a stock transformers forward (SDPA, ``DynamicCache``) of ``ids[cached:]`` after ``cached`` tokens.

    The reference the engine is compared with: the same block against a cache of the same length,
    without kvcli's attention function, re-rotation or compression.
    """
    from transformers import DynamicCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        past = DynamicCache(config=model.config)
        with torch.inference_mode():
            model.model(input_ids=ids[None, :cached], past_key_values=past, use_cache=True)
            positions = torch.arange(cached, ids.shape[0], device=ids.device)[None]
            return count_ops(lambda: model.model(input_ids=ids[None, cached:], past_key_values=past, use_cache=True,
                                                 position_ids=positions))
    finally:
        model.set_attn_implementation(previous)
