"""Pass key at 6,000 tokens for several method settings, on the five haystacks of ``kvcli needle --trials 1``.

    OMP_NUM_THREADS=1 python docs/results/pass_key_settings.py ../shared/data/books/pg98-a-tale-of-two-cities.txt \\
        "kernel=15,sinks=64,heads=kv" "method=snapkv" "kernel=15,sinks=64,heads=kv,nest=false"

Each argument after the book is one setting: comma-separated ``-o`` options of ``pyramidinfer`` (or of the
method named by ``method=``). The haystacks and keys are those of ``kvcli needle BOOK --lengths 6000
--trials 1`` (seed 0, depths 10-90 %); each is read as ``kvcli ask`` reads it (one shot at 6k), at cache
512. Prints, per setting, the answers found and the seconds of the five reads in this process.
"""

from __future__ import annotations

import sys
import time

from kvcli.engine.engine import Engine
from kvcli.eval.needle import ANSWER_PREFIX, DEFAULT_DEPTHS, QUESTION, book_tokens, haystacks, is_correct
from kvcli.io.documents import open_source
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.prompts import build_prompt, question_instruction, stop_token_ids
from kvcli.reading.reader import Reader

LENGTH, BUDGET = 6000, 512


def main() -> None:
    book, settings = sys.argv[1], sys.argv[2:]
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    tokens = book_tokens(open_source(book), tokenizer, 2 * LENGTH)
    stacks = list(haystacks(tokenizer, tokens, [LENGTH], DEFAULT_DEPTHS, trials=1, fixed=True))
    parts = build_prompt(tokenizer, question_instruction(QUESTION, ANSWER_PREFIX))
    stop_ids = stop_token_ids(tokenizer, loaded.model)
    for setting in settings:
        options = dict(item.split("=", 1) for item in setting.split(",") if item)
        name = options.pop("method", "pyramidinfer")
        answers = []
        started = time.perf_counter()
        for stack in stacks:
            engine = Engine(loaded.model, make_method(name, options), BUDGET, block=256)
            text = Reader(engine, tokenizer, stop_ids=stop_ids).run(parts, [stack.doc], 12).text.strip()
            answers.append("ok" if is_correct(text, stack.key) else repr(text[:8]))
        found = sum(answer == "ok" for answer in answers)
        print(f"{name} {options}: {found}/5 {answers} {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
