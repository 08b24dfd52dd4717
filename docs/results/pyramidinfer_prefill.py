"""One-shot prefill time of PyramidInfer (nested) against SnapKV at the same budget, on one pass-key prompt.

    OMP_NUM_THREADS=1 python docs/results/pyramidinfer_prefill.py ../shared/data/books/pg98-a-tale-of-two-cities.txt

Builds the ``kvcli needle`` prompt (the book's first ``--length`` tokens with the pass-key sentence at
``--depth``), reads it in one forward with each method in turn, ``--repeats`` rounds back to back in one
process (so a busy machine slows both alike), and prints each read's seconds, the median per method,
the ratio, the answer, and how many of the key's digits each layer's cache still holds (KV head 0).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvcli.engine.engine import Engine
from kvcli.eval.needle import ANSWER_PREFIX, QUESTION, book_tokens, excerpt_offset, haystack
from kvcli.io.documents import open_source
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.generate import Generation
from kvcli.reading.prompts import build_prompt, question_instruction, stop_token_ids
from kvcli.reading.reader import Reader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("book")
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--length", type=int, default=6000)
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="pyramidinfer,snapkv")
    parser.add_argument("-o", action="append", default=[], help="pyramidinfer option KEY=VALUE")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    tokens = book_tokens(open_source(args.book), tokenizer, args.length)
    key = str(random.Random(1).randint(10000, 99999))
    text = haystack(tokenizer, tokens, args.length, args.depth, key, excerpt_offset(len(tokens), args.length, 0))
    parts = build_prompt(tokenizer, question_instruction(QUESTION, ANSWER_PREFIX))
    doc = tokenizer(text, add_special_tokens=False).input_ids
    at = text.index(key)
    first = len(parts.prefix) + len(tokenizer(text[:at], add_special_tokens=False).input_ids)
    digits = set(range(first, first + len(key)))
    options = dict(item.split("=", 1) for item in args.o)
    names = args.methods.split(",")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    print(f"prompt {len(parts.prefix) + len(doc) + len(parts.suffix)} tokens, cache {args.cache}, "
          f"threads {torch.get_num_threads()}, key {key}")
    for round_ in range(args.repeats):
        for name in names:
            method = make_method(name, options if name == "pyramidinfer" else {})
            engine = Engine(loaded.model, method, args.cache)
            reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model))
            cache = engine.new_cache()
            result = Generation()
            started = time.perf_counter()
            hidden = reader.read(cache, parts, [doc], result, one_shot=True)
            seconds[name].append(time.perf_counter() - started)
            held = [len(digits & set(layer.token_idx[0].tolist())) for layer in cache.layers]
            reader.write(cache, hidden, result, 12)
            print(f"round {round_ + 1} {name}: read {seconds[name][-1]:.2f} s, answer {result.text.strip()!r}, "
                  f"digits held per layer {held}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, value in medians.items():
        print(f"{name}: median read {value:.2f} s over {args.repeats}")
    if len(names) == 2:
        print(f"{names[1]} / {names[0]}: {medians[names[1]] / medians[names[0]]:.2f}x")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
