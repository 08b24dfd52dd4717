"""The tuning harness of issue 24: ``kvcli ask``'s path (prompt, reading, writing) on pass-key haystacks.

Usage: ``python docs/results/ask_tuning.py BOOK [--length WORDS_x_1.39] [--trials N] [--fixed]
[--methods a,b] [--cache N] [-o [METHOD.]KEY=VALUE] [--prefix TEXT]``. Each trial takes a random
excerpt of the book (``random.Random(--seed)``), hides a needle at a random word boundary (``--fixed``:
the issue's needle and question, five-digit keys, depths 10, 30, 50, 70, 90 %), and reads and answers
it with :class:`kvcli.reading.reader.Reader` and the prompt ``kvcli ask`` builds (no answer prefix unless
``--prefix``), exactly as ``kvcli ask DOC QUESTION --method M --cache N`` does. One JSON line per
trial, then the totals. Settings were chosen with it on the tuning books only (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvcli.engine.engine import Engine
from kvcli.eval.needle import NEEDLES, QUESTIONS, is_correct
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.prompts import build_prompt, encode, question_instruction, stop_token_ids
from kvcli.reading.reader import Reader

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def parse_options(items: list[str], methods: list[str]) -> dict[str, dict]:
    options: dict[str, dict] = {}
    for item in items:
        key, value = item.split("=", 1)
        target, key = key.split(".", 1) if "." in key else (None, key)
        for name in methods:
            if target in (None, name):
                options.setdefault(name, {})[key] = value
    return options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("book")
    parser.add_argument("--methods", default="snapkv,pyramidkv")
    parser.add_argument("--length", type=int, default=5300, help="excerpt size in tokens, about (0.72 words each)")
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new", type=int, default=24)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("-o", action="append", default=[])
    parser.add_argument("--prefix", default="")
    args = parser.parse_args()
    methods = args.methods.split(",")
    options = parse_options(args.o, methods)
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    words = open(args.book, encoding="utf-8").read().split(" ")
    rng = random.Random(args.seed)
    stop = stop_token_ids(tokenizer, loaded.model)
    correct = dict.fromkeys(methods, 0)
    for trial in range(args.trials):
        start = rng.randrange(0, max(1, len(words) - args.length))
        excerpt = words[start:start + int(args.length * 0.72)]
        depth = DEPTHS[trial % len(DEPTHS)] if args.fixed else rng.uniform(0.05, 0.95)
        at = int(depth * len(excerpt))
        digits = 5 if args.fixed else rng.choice([4, 5, 6, 7])
        key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        needle = (NEEDLES[0] if args.fixed else rng.choice(NEEDLES[:4])).format(key=key)
        question = QUESTIONS[0] if args.fixed else rng.choice(QUESTIONS[:3])
        doc = encode(tokenizer, " ".join(excerpt[:at] + [needle] + excerpt[at:]))
        parts = build_prompt(tokenizer, question_instruction(question, args.prefix))
        for name in methods:
            engine = Engine(loaded.model, make_method(name, options.get(name)), args.cache)
            started = time.perf_counter()
            gen = Reader(engine, tokenizer, stop_ids=stop).run(parts, [doc], args.max_new)
            ok = is_correct(gen.text, key)
            correct[name] += ok
            print(json.dumps({"trial": trial, "method": name, "depth": round(depth, 2), "key": key, "correct": ok,
                              "answer": gen.text[:80], "prompt_tokens": gen.prompt_tokens, "one_shot": gen.one_shot,
                              "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    print("TOTAL", json.dumps(correct), "of", args.trials, flush=True)


if __name__ == "__main__":
    main()
