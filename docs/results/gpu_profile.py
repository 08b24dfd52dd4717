"""Where a block's time goes on a GPU: the engine's block against a plain forward's, kernel by kernel.

    python docs/results/gpu_profile.py [SHAPE] [METHODS] [BLOCKS]   (default llama-3.1-8b streamingllm 4)

Builds the shape with random weights (kvcli.eval.bench.speed), runs ``BLOCKS`` blocks of 1,024 against a
1,024-token cache under torch.profiler for the plain forward and for each method, and prints, per line, the
wall time per block, the GPU's busy time per block and the kernels that take the most GPU time. Issue #27.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvcli.engine.engine import Engine
from kvcli.eval.bench.speed import build_model
from kvcli.eval.bench.throughput import synchronize
from kvcli.methods.registry import make_method

CACHE = BLOCK = 1024
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script


def plain_blocks(model, ids, blocks):
    from transformers import DynamicCache
    positions = torch.arange(CACHE, CACHE + BLOCK, device=ids.device)[None]
    model.set_attn_implementation("sdpa")
    past = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids[None, :CACHE], past_key_values=past, use_cache=True, logits_to_keep=1)

        def run(first):
            for b in range(blocks):
                start = CACHE + (first + b) * BLOCK
                model(input_ids=ids[None, start:start + BLOCK], past_key_values=past, use_cache=True,
                      position_ids=positions)
                past.crop(-BLOCK)
        run(0)
        try:
            yield lambda: run(blocks)
        finally:
            model.set_attn_implementation("kvcli")


def engine_blocks(model, method, ids, blocks):
    engine = Engine(model, method, CACHE, block=BLOCK)
    kv = engine.new_cache()
    engine.score([ids[:CACHE + BLOCK * (blocks + 1)]], cache=kv)
    yield lambda: engine.score([ids[CACHE + BLOCK * (blocks + 1):CACHE + BLOCK * (2 * blocks + 1)]], cache=kv)


def report(name, run, blocks):
    synchronize(DEVICE)
    started = time.perf_counter()
    run()
    synchronize(DEVICE)
    bare = time.perf_counter() - started
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        run()
        synchronize(DEVICE)
        wall = time.perf_counter() - started
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"== {name}: {bare / blocks * 1e3:.2f} ms/block; profiled: wall {wall / blocks * 1e3:.2f}, "
          f"GPU busy {busy / blocks:.2f} ms/block", flush=True)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:22]
    for e in top:
        if e.self_device_time_total <= 0:
            break
        print(f"   {e.self_device_time_total / 1e3 / blocks:7.3f} ms  x{e.count // blocks:<5d} {e.key[:110]}")
    print("   host, most self CPU time:")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"   {e.self_cpu_time_total / 1e3 / blocks:7.3f} ms  x{e.count // blocks:<5d} {e.key[:110]}")


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    methods = (sys.argv[2] if len(sys.argv) > 2 else "streamingllm").split(",")
    blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    model = build_model(shape, DEVICE, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (CACHE + BLOCK * (2 * blocks + 2),), device=DEVICE)
    lines = [("plain", plain_blocks(model, ids, blocks))]
    lines += [(name, engine_blocks(model, make_method(name), ids, blocks)) for name in methods]
    for name, gen in lines:
        run = next(gen)
        report(name, run, blocks)
        gen.close()


if __name__ == "__main__":
    main()
