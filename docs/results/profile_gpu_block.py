"""Where a GPU block's time goes: ``torch.profiler`` over engine blocks of a named shape (random weights).

    python docs/results/profile_gpu_block.py llama-3.1-8b snapkv h2o

For each method: tokens/s over 8 blocks of 1,024 tokens against a 1,024-token cache (after a warm-up that
fills it), then the profile of 2 more blocks, the kernels with the most GPU time first. This is how the
changes of docs/benchmarks.md's "GPU (H100, 2026-11-25)" were found; it needs a CUDA device.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvcli.engine.engine import Engine
from kvcli.eval.bench.speed import build_model
from kvcli.methods import make_method

CACHE = BLOCK = 1024


def main() -> None:
    shape, methods = sys.argv[1], sys.argv[2:]
    model = build_model(shape, "cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (CACHE + 14 * BLOCK,), generator=torch.Generator().manual_seed(0))
    for name in methods:
        engine = Engine(model, make_method(name), CACHE, block=BLOCK)
        cache = engine.new_cache()
        engine.score([ids[:CACHE + 3 * BLOCK]], cache=cache)
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.score([ids[CACHE + 3 * BLOCK:CACHE + 11 * BLOCK]], cache=cache)
        torch.cuda.synchronize()
        print(f"===== {name}: {8 * BLOCK / (time.perf_counter() - started):,.0f} tokens/s")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            engine.score([ids[CACHE + 11 * BLOCK:CACHE + 13 * BLOCK]], cache=cache)
            torch.cuda.synchronize()
        print(profiled.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
