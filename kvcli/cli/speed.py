"""``kvcli bench-speed``: tokens/s, model FLOPs utilisation and peak memory on a named model shape, kvcli next
to a plain forward of the same blocks, in one run (random weights, nothing downloaded).

:mod:`kvcli.eval.bench.speed` builds and times; the table or the JSON object is the result (stdout), progress goes
to stderr.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvcli.cli.options import (
    BlockOpt,
    DeviceOpt,
    DtypeOpt,
    MethodsOptionOpt,
    QuietOpt,
    build_method,
    check_at_least,
    check_cache,
    check_device,
    check_seed,
    method_options,
    parse_block,
    split_list,
)
from kvcli.errors import KvcliError, UsageError


def bench_speed(
    shape: Annotated[str, typer.Option("--shape", help="Model shape, random weights: tiny, smollm2-135m, "
                                       "llama-3.2-1b, llama-3.1-8b or qwen2.5-7b.")] = "smollm2-135m",
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods to time (see `kvcli methods`); "
                                         "each needs a budget.")] = "streamingllm",
    cache: Annotated[int, typer.Option("--cache", "-c", help="KV budget in tokens per layer (average over layers "
                                       "for methods that vary it); the plain forward's cache is cropped back to "
                                       "it too.")] = 1024,
    block: BlockOpt = "auto",
    tokens: Annotated[int | None, typer.Option("--tokens", "-n", help="Tokens timed per line, after a warm-up "
                                               "(default 8192 on a CPU, 65536 on a GPU), in whole blocks.")] = None,
    option: MethodsOptionOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    matmul_size: Annotated[int | None, typer.Option("--matmul-size", help="Side of the square matmul whose "
                                                    "measured rate MFU is relative to (default 8192 on a GPU, "
                                                    "1024 on a CPU).")] = None,
    decode: Annotated[int, typer.Option("--decode", help="Also time this many greedy one-token steps against the "
                                        "full cache (plain, then each method): the speed of writing an answer, with "
                                        "the step `ask` writes with (static and, on a GPU, a CUDA graph for every "
                                        "method but pyramidinfer and pod). 0: none.")] = 0,
    compile_decode: Annotated[bool, typer.Option("--compile", help="With --decode: run the methods' static steps "
                                                 "through torch.compile before the capture (fewer, fused kernels a "
                                                 "token; tens of seconds of compilation first, not timed; a step "
                                                 "that fails to compile runs as it is, with a warning).")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights and tokens.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object on stdout instead of the table.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Speed on a named model shape: tokens/s, MFU against the measured matmul rate, and peak memory, for kvcli
    and for a plain transformers forward of the same blocks. Random weights: nothing is downloaded."""
    from kvcli.cli.render import speed_table
    from kvcli.eval.bench.speed import SHAPES, run_speed
    from kvcli.io.report import dumps, print_result, stderr_console
    from kvcli.models.load import resolve_device, resolve_dtype

    if shape not in SHAPES:
        raise UsageError(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    check_device(device)
    check_seed(seed)
    check_cache(cache)
    check_at_least(1, tokens=tokens, matmul_size=matmul_size)
    check_at_least(0, decode=decode)
    block_size = parse_block(block)
    names = list(dict.fromkeys(split_list(methods, str, "--methods")))
    options = method_options(names, option)
    built = [build_method(name, options[name], cache) for name in names]
    for method in built:
        if method.unbounded:
            raise UsageError(f"--methods {method.name}: it keeps every token, so its cost grows with the stream; "
                             "time a method with a budget")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)

    def note(message: str) -> None:
        if not quiet:
            stderr_console.print(message, markup=False, highlight=False)

    import torch

    try:
        result = run_speed(shape, built, cache=cache, block=block_size, tokens=tokens, device=torch_device,
                           dtype=torch_dtype, matmul_size=matmul_size, seed=seed, decode=decode,
                           compile_decode=compile_decode, note=note)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        # The sizes asked for (a shape, --matmul-size, --tokens) are the user's to lower; any other failure is a bug.
        if not isinstance(exc, torch.OutOfMemoryError | MemoryError) and "allocate" not in str(exc):
            raise
        why = " ".join(str(exc).split())
        why = why[why.find("can't allocate"):] if "can't allocate" in why else why[:160]
        raise KvcliError(f"out of memory on {torch_device} ({why}): lower --matmul-size, --tokens or --cache, or "
                         "choose a smaller --shape") from None
    print_result(dumps(result) if json_out else speed_table(result))
