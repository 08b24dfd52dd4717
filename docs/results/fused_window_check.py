"""H2O on a GPU with and without the fused window sums (kvcli.kv.fused_window), in one process.

    python docs/results/fused_window_check.py llama-3.1-8b

Random weights of a named shape in bf16, block 1,024, cache 1,024: tokens/s of an H2O stream each way, and the
mean NLL each way, which differ only by the rounding of the window's scores (bf16 logits unfused, fp32 fused).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvcli.engine.engine import Engine
from kvcli.eval.bench.speed import build_model
from kvcli.kv import fused_window
from kvcli.methods import make_method

BLOCK = CACHE = 1024


def run(model, ids: torch.Tensor, fused: bool) -> dict:
    fused_window.MIN_WINDOW = 128 if fused else 1 << 30
    engine = Engine(model, make_method("h2o"), CACHE, block=BLOCK)
    engine.score([ids[: 4 * BLOCK]])  # warm-up: kernels compiled, allocator settled
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = engine.score([ids])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"fused": fused, "tokens_per_second": round(ids.numel() / seconds, 1), "nll": result.nll}


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
    model = build_model(shape, "cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    for fused in (False, True, False, True):
        print(json.dumps({"shape": shape, "tokens": tokens, **run(model, ids, fused)}), flush=True)


if __name__ == "__main__":
    main()
