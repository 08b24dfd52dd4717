"""Where a captured decode step's time goes on a GPU, against the bytes it must read (issue #56).

    python docs/results/decode_profile.py [SHAPE] [METHODS] [STEPS] [compile]   (default llama-3.1-8b snapkv,treekv 64)

Builds the shape with random weights (kvcli.eval.bench.speed), then prints JSON lines:
- ``floor``: the card's measured copy bandwidth, the bytes one token must read (every weight once, the cache's
  keys and values), the time that takes at that bandwidth, and a captured graph of the weights' matrix-vector
  products alone (every ``Linear`` of the model, in order, on one token): the rate no decode step can beat.
- per method, after a read of ``cache + block`` tokens: the captured step replayed ``STEPS`` times with one
  synchronisation at the end (the GPU's rate), the same with each token's argmax read to the host as ``kvcli
  ask`` reads it (the user's rate), and the uncaptured step under ``torch.profiler``: its kernel count, their
  summed GPU time and the kernels that take the most.
With ``compile``, the step is first wrapped in ``torch.compile`` (inductor fuses the model's elementwise operations;
the graph is captured over its kernels): an experiment, with the seconds the first step took (the compilation).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvcli.engine.engine import Engine
from kvcli.eval.bench.speed import build_model
from kvcli.kv.decode import answer_steps
from kvcli.methods.registry import make_method

CACHE = BLOCK = 1024
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def seconds(run, repeat: int) -> float:
    """Wall seconds per call of ``run``, the device synchronised around the clock, after one untimed call."""
    run()
    sync()
    started = time.perf_counter()
    for _ in range(repeat):
        run()
    sync()
    return (time.perf_counter() - started) / repeat


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 4 GiB (read and write counted)."""
    source = torch.empty(1 << 31, dtype=torch.int16, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() * 2 / seconds(lambda: target.copy_(source), 5)


def gemv_floor(model: torch.nn.Module) -> float:
    """Seconds per replay of a graph that runs every ``Linear`` of ``model`` on one token, in order."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.ones(1, m.in_features, dtype=m.weight.dtype, device="cuda") for m in linears}
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        for m in linears:  # warm-up: cuBLAS picks its kernels outside the capture
            m(inputs[m.in_features])
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for m in linears:
                m(inputs[m.in_features])
    return seconds(graph.replay, 50)


def kernels(run) -> dict:
    """Kernel count, summed GPU milliseconds and the top kernels of one call of ``run``."""
    activity = ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiled:
        run()
        sync()
    events = [e for e in profiled.events() if e.device_type.name == DEVICE.upper()]
    gpu_us = sum(getattr(e, "device_time", None) or e.cuda_time for e in events)
    table = profiled.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70)
    return {"kernels": len(events), "gpu_ms": gpu_us / 1000, "table": table}


def method_line(model, name: str, ids: torch.Tensor, steps: int, compiled: bool = False) -> dict:
    engine = Engine(model, make_method(name), CACHE, block=BLOCK)
    cache = engine.new_cache()
    for start in range(0, CACHE + BLOCK, BLOCK):
        engine.forward(cache, ids[None, start:start + BLOCK], last_only=True)
    cache_bytes = cache.nbytes()
    answer = answer_steps(engine, cache, 3 * steps + 8)
    try:
        kind = type(answer).__name__ + ("/" + answer.layout.__name__ if hasattr(answer, "layout") else "")
        if compiled:
            answer.step = torch.compile(answer.step)
        started = time.perf_counter()
        answer(7)
        sync()
        first = time.perf_counter() - started
        replay = seconds(lambda: answer(7), steps)
        read = seconds(lambda: int(answer(7).argmax()), steps)
        profiled = kernels(answer.step) if hasattr(answer, "step") else kernels(lambda: answer(7))
    finally:
        answer.finish()
    print(profiled.pop("table"), file=sys.stderr)
    return {"line": name + (" compiled" if compiled else ""), "steps": kind, "first_step_s": first,
            "replay_tokens_per_s": 1 / replay, "with_host_read_tokens_per_s": 1 / read,
            "eager_step_kernels": profiled["kernels"], "eager_step_gpu_ms": profiled["gpu_ms"],
            "cache_bytes": cache_bytes}


@torch.inference_mode()
def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    methods = (sys.argv[2] if len(sys.argv) > 2 else "snapkv,treekv").split(",")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    compiled = len(sys.argv) > 4 and sys.argv[4] == "compile"
    model = build_model(shape, DEVICE, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (CACHE + BLOCK,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEVICE)
    if DEVICE == "cuda":
        floor_line(model)
    for name in methods:
        print(json.dumps(method_line(model, name, ids, steps, compiled)), flush=True)


def floor_line(model: torch.nn.Module) -> None:
    bandwidth = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    read_bytes = weight_bytes - (0 if tied else embedding.numel() * embedding.element_size())
    floor = gemv_floor(model)
    print(json.dumps({"line": "floor", "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_read": read_bytes,
                      "tokens_per_s_at_bandwidth": bandwidth / read_bytes, "gemv_graph_tokens_per_s": 1 / floor}),
          flush=True)


if __name__ == "__main__":
    main()
