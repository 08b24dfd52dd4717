"""The tuning harness of issue 57: repetition control and section summaries, on the tuning books only.

Usage::

    python docs/results/repetition_tuning.py repeat MODEL BOOK [BOOK ...] [--tokens 21000]
    python docs/results/repetition_tuning.py sections MODEL BOOK [BOOK ...] [--tokens 21000] [--sizes 2048,4096]

``repeat`` reads the first ``--tokens`` tokens of each book once for ``summarize`` and once for ``ask`` (the
book's question below), with treekv at cache 1,024 as in the issue, then writes from a copy of the cache with
every setting of :data:`SETTINGS`: the same read, only the writing differs. ``sections`` summarizes the same
text in one pass and in sections of each size (:mod:`kvcli.reading.sections`), with the default repetition control,
with a last pass over the section summaries (each row keeps the sections too), and checks which thirds of the
text the summary mentions (:func:`coverage`). One JSON line per output.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import weakref
from collections import Counter

from kvcli.engine.engine import Engine
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.generate import Generation
from kvcli.reading.prompts import (
    SUMMARY_REPETITION,
    TEMPLATES,
    Instruction,
    Repetition,
    build_prompt,
    encode,
    question_instruction,
    stop_token_ids,
)
from kvcli.reading.reader import Reader
from kvcli.reading.recap import RECAP_TOKENS
from kvcli.reading.sections import summarize_in_sections

SETTINGS = {
    "off": Repetition(),
    "ngram3": Repetition(no_repeat_ngram=3),
    "ngram4": Repetition(no_repeat_ngram=4),
    "penalty1.2": Repetition(penalty=1.2),
    "ngram4+penalty1.2": Repetition(no_repeat_ngram=4, penalty=1.2),
}

#: One question per tuning book about its first 21k tokens (the issue's for *A Tale of Two Cities*).
QUESTIONS = {
    "pg98": ("Which bank does Mr. Lorry work for?", "tellson"),
    "pg1342": ("Who rents Netherfield Park?", "bingley"),
    "pg11": ("What does Alice follow down the rabbit hole?", "rabbit"),
}

#: A dedicated instruction for the last pass over section summaries, tried against the user's instruction.
FINAL = Instruction("The text above sums up a story part by part, in order. Summarize the whole story in a few "
                    "sentences, from its beginning to its end.", "\n\nSummary:")


def sentences(text: str) -> list[str]:
    """Sentences of ``text`` (a line break inside one, as a model wraps its lines, joins it), and list items,
    lower-cased, without surrounding spaces and punctuation."""
    text = re.sub(r"(?<![.!?:])\n(?![-*\d\n])", " ", text)
    pieces = re.split(r"(?<=[.!?])\s+|\n+", text)
    return [p for p in (re.sub(r"\W+", " ", piece).strip().lower() for piece in pieces) if p]


def most_repeated(text: str) -> tuple[int, str]:
    """The most repeated sentence or line of ``text`` (a loop of short lines has no sentence end), and its count."""
    lines = [p for p in (re.sub(r"\W+", " ", line).strip().lower() for line in text.split("\n")) if p]
    best = (0, "")
    for counts in (Counter(sentences(text)), Counter(lines)):
        if counts:
            sentence, count = counts.most_common(1)[0]
            best = max(best, (count, sentence))
    return best


def distinct(text: str, n: int) -> float:
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def thirds_terms(text: str) -> list[set[str]]:
    """Per third of ``text``: capitalised words (4+ letters) used at least 3 times there and never in the other
    thirds, the third's own names."""
    size = len(text) // 3
    parts = [text[:size], text[size:2 * size], text[2 * size:]]
    counts = [Counter(re.findall(r"\b[A-Z][a-z]{3,}\b", part)) for part in parts]
    out = []
    for i, count in enumerate(counts):
        others = set().union(*(set(c) for j, c in enumerate(counts) if j != i))
        out.append({word for word, n in count.items() if n >= 3 and word not in others})
    return out


def coverage(summary: str, terms: list[set[str]]) -> list[list[str]]:
    return [sorted(word for word in third if re.search(rf"\b{word}\b", summary)) for third in terms]


def measure(text: str) -> dict:
    count, sentence = most_repeated(text)
    return {"repeats": count, "repeated": sentence[:80], "distinct1": round(distinct(text, 1), 3),
            "distinct2": round(distinct(text, 2), 3)}


def excerpt(loaded, path: str, tokens: int) -> tuple[str, list[int]]:
    text = open(path, encoding="utf-8").read()
    ids = encode(loaded.tokenizer, text[: tokens * 6])[:tokens]
    return loaded.tokenizer.decode(ids), ids


def snapshot(cache):
    """A copy of a read's cache to write from (its layers point back at the copy)."""
    copied = copy.deepcopy(cache)
    for layer in copied.layers:
        layer.owner = weakref.proxy(copied)
    return copied


def engine_for(loaded) -> Engine:
    return Engine(loaded.model, make_method("treekv"), 1024, block=1024)


def repeat(loaded, book: str, text_ids: list[int], new_tokens: dict[str, int], settings: list[str]) -> None:
    tokenizer = loaded.tokenizer
    stops = stop_token_ids(tokenizer, loaded.model)
    key = book.split("/")[-1].split("-")[0]
    question, answer = QUESTIONS[key]
    for command, instruction in (("summarize", TEMPLATES["summary"]), ("ask", question_instruction(question))):
        reader = Reader(engine_for(loaded), tokenizer, stop_ids=stops, recap=RECAP_TOKENS if command == "ask" else 0)
        cache = reader.engine.new_cache()
        read = Generation()
        hidden = reader.read(cache, build_prompt(tokenizer, instruction), [text_ids], read, one_shot=False)
        for name in settings:
            reader.writer.repetition = SETTINGS[name]
            gen = Generation()
            reader.write(snapshot(cache), hidden, gen, new_tokens[command])
            row = {"model": loaded.name, "book": key, "command": command, "setting": name, **measure(gen.text),
                   "tokens": gen.generated_tokens, "finish": gen.finish_reason, "text": gen.text}
            if command == "ask":
                row["right"] = answer in gen.text.lower()
            print(json.dumps(row), flush=True)


def sections(loaded, book: str, text: str, text_ids: list[int], sizes: list[int]) -> None:
    tokenizer = loaded.tokenizer
    key = book.split("/")[-1].split("-")[0]
    terms = thirds_terms(text)
    print(json.dumps({"book": key, "terms": [sorted(t) for t in terms]}), file=sys.stderr, flush=True)
    for size in [0, *sizes]:
        for final_name, instruction in (("user", TEMPLATES["summary"]), ("dedicated", FINAL)):
            if size == 0 and final_name == "dedicated":
                continue
            reader = Reader(engine_for(loaded), tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model),
                            repetition=SUMMARY_REPETITION)
            final = instruction if size else TEMPLATES["summary"]
            if size and final_name == "dedicated" and cached.get(size):
                gen, parts = None, cached[size]
                summary = _final_only(reader, final, parts)
            else:
                gen, parts = summarize_in_sections(reader, final, [text_ids], 256, section=size, combine=True)
                summary = gen.text
                cached[size] = parts
            print(json.dumps({"model": loaded.name, "book": key, "section": size, "final": final_name,
                              **measure(summary), "covers": coverage(summary, terms), "summary": summary,
                              "sections": [p.summary for p in parts]}), flush=True)


cached: dict[int, list] = {}


def _final_only(reader: Reader, instruction: Instruction, parts: list) -> str:
    from kvcli.reading.sections import _joined

    notes = encode(reader.tokenizer, _joined(parts))
    return reader.run(build_prompt(reader.tokenizer, instruction), [notes], 256).text


def table(paths: list[str]) -> None:
    """The rows of ``repeat`` runs (JSON lines files) as a Markdown table, measured again from their text."""
    rows = [json.loads(line) for path in paths for line in open(path, encoding="utf-8") if line.strip()]
    print("| model | book | command | setting | most repeated sentence | distinct-1 | distinct-2 | tokens | end |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        m = measure(row["text"])
        right = {True: " (right)", False: " (wrong)"}.get(row.get("right"), "")
        print(f"| {row['model']} | {row['book']} | {row['command']}{right} | {row['setting']} | {m['repeats']} | "
              f"{m['distinct1']} | {m['distinct2']} | {row['tokens']} | {row['finish']} |")


def main() -> None:
    if sys.argv[1:2] == ["table"]:
        table(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["repeat", "sections"])
    parser.add_argument("model")
    parser.add_argument("books", nargs="+")
    parser.add_argument("--tokens", type=int, default=21000)
    parser.add_argument("--sizes", default="2048,4096")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    loaded = load_model(args.model)
    for book in args.books:
        text, ids = excerpt(loaded, book, args.tokens)
        if args.phase == "repeat":
            repeat(loaded, book, ids, {"summarize": 256, "ask": 128}, args.settings.split(","))
        else:
            cached.clear()
            sections(loaded, book, text, ids, [int(s) for s in args.sizes.split(",")])


if __name__ == "__main__":
    main()
