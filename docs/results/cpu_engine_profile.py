"""Where the engine's CPU time goes, and whether SDPA would be faster than the explicit attention end to end.

    python docs/results/cpu_engine_profile.py profile ../shared/data/books/pg98-a-tale-of-two-cities.txt --tokens 4096
    python docs/results/cpu_engine_profile.py sdpa ../shared/data/books/pg98-a-tale-of-two-cities.txt --tokens 8192 \
        --methods streamingllm,snapkv,h2o,treekv

``profile``: the top operators of one streamingllm run (cache 1,024, block 256) under ``torch.profiler``.
``sdpa``: each method's tokens/s and perplexity with every block on the explicit CPU attention, with kvcli's
choice of path (:func:`kvcli.kv.attention.takes_explicit`) and inside :func:`kvcli.kv.attention.sdpa_everywhere`,
in one process. Run alone on the machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

import torch

from kvcli.engine.engine import Engine
from kvcli.eval.bench.throughput import first_tokens, open_source
from kvcli.kv import attention
from kvcli.methods.registry import make_method
from kvcli.models.load import load_model


def timed(engine: Engine, ids: torch.Tensor):
    engine.score([ids[:1025].tolist()])  # warm-up
    return engine.score([ids.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["profile", "sdpa"])
    parser.add_argument("source")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--methods", default="streamingllm")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m")
    ids = torch.tensor(first_tokens(open_source(args.source), loaded.tokenizer, args.tokens + 1)[0])
    if args.mode == "profile":
        from torch.profiler import ProfilerActivity, profile

        engine = Engine(loaded.model, make_method("streamingllm"), 1024, block=256)
        engine.score([ids[:1025].tolist()])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.score([ids.tolist()])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    print(f"dtype {loaded.model.dtype}: explicit = every block on the explicit path, rule = kvcli's choice "
          "(kvcli.kv.attention.takes_explicit), sdpa = every block on SDPA", flush=True)
    for method in args.methods.split(","):
        engine = Engine(loaded.model, make_method(method), 1024, block=256)
        share, attention.FLOAT32_EXPLICIT_SHARE = attention.FLOAT32_EXPLICIT_SHARE, 0.0
        try:
            explicit = timed(engine, ids)
        finally:
            attention.FLOAT32_EXPLICIT_SHARE = share
        rule = timed(engine, ids)
        with attention.sdpa_everywhere():
            sdpa = timed(engine, ids)
        print(f"{method:14}" + " | ".join(f"{name} {result.tokens_per_second:5.0f} tok/s ppl {result.ppl:.4f}"
                                          for name, result in (("explicit", explicit), ("rule", rule), ("sdpa", sdpa))),
              flush=True)


if __name__ == "__main__":
    main()
