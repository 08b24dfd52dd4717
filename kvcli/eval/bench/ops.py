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
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: How a boolean-mask index (``x[mask]``) is counted: its result's size depends on the mask's values, so on
#: CUDA the kernel reads the mask's count back first, but it dispatches as ``aten.index`` with no ``nonzero``.
MASK_INDEX = "aten.index.Tensor[bool]"

#: Operations that copy a device value to the host: on CUDA each one waits for the stream to drain.
#: ``int()`` or ``bool()`` of a tensor dispatches ``aten.item`` (or ``is_nonzero``) here, not the
#: ``_local_scalar_dense`` it becomes below: all of them are counted.
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
                        "aten.equal.default", "aten.is_nonzero.default", "aten.masked_select.default", MASK_INDEX})


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
        name = str(func)
        if name == "aten.index.Tensor" and any(index is not None and index.dtype == torch.bool
                                               for index in args[1]):
            name = MASK_INDEX
        self.into.ops[name] += 1
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


def engine_block_ops(model: torch.nn.Module, method, budget: int, block: int, ids: torch.Tensor) -> OpCount:
    """Operations of one engine block (forward and compression) once the cache is full and every block compresses.

    ``ids`` needs ``budget + 4 * block`` tokens at least: the cache is filled past the budget first, and one
    more block runs so that the block counted has the shapes of the one before it (a stream's steady state:
    masks and offsets made once per shape are not counted again in every block).
    """
    from kvcli.engine.engine import Engine

    engine = Engine(model, method, budget, block=block)
    cache = engine.new_cache()
    start = 0
    while start < budget + 3 * block:
        engine.forward(cache, ids[None, start:start + block])
        start += block
    return count_ops(lambda: engine.forward(cache, ids[None, start:start + block]))


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcli.eval.bench.ops``: aten operations per block of each method against a plain forward
    (a named shape of :mod:`kvcli.eval.bench.speed`, random weights)."""
    import argparse

    from kvcli.methods.registry import METHODS

    parser = argparse.ArgumentParser(prog="python -m kvcli.eval.bench.ops", description=main.__doc__)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--methods", default=",".join(name for name in METHODS if name != "full"))
    parser.add_argument("--top", type=int, default=0, help="also list the N op names each method adds most")
    parser.add_argument("--attention", choices=("auto", "sdpa"), default="auto",
                        help="sdpa: every block takes the SDPA path, as on a GPU (kvcli.kv.attention.sdpa_everywhere)")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE",
                        type=lambda item: tuple(item.split("=", 1)) if "=" in item else parser.error(
                            f"-o {item!r}: expected KEY=VALUE"),
                        help="a method parameter, given to every method listed (e.g. --methods pod -o recent=128)")
    args = parser.parse_args(argv)
    from kvcli.kv.attention import sdpa_everywhere

    with sdpa_everywhere() if args.attention == "sdpa" else nullcontext():
        _print_counts(args)


def _print_counts(args) -> None:
    from kvcli.eval.bench.speed import build_model
    from kvcli.methods import make_method

    model = build_model(args.shape)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.cache + 4 * args.block,), generator=torch.Generator().manual_seed(0))
    plain = plain_block_ops(model, ids[: args.cache + args.block], args.cache)
    print(f"{args.shape}, cache {args.cache}, block {args.block}, attention {args.attention}: "
          f"plain forward {plain.total:,} ops")
    print("| method | engine ops | ratio | host reads |")
    print("| --- | ---: | ---: | ---: |")
    for name in args.methods.split(","):
        counted = engine_block_ops(model, make_method(name, dict(args.options)), args.cache, args.block, ids)
        print(f"| {name} | {counted.total:,} | {counted.total / plain.total:.2f}x | {counted.host_reads} |")
        if args.top:
            extra = counted.ops.copy()
            extra.subtract(plain.ops)
            for op, count in extra.most_common(args.top):
                print(f"    {count:+6d} {op}")


if __name__ == "__main__":
    main()
