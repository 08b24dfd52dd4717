"""Which layers still hold a streamed pass key: per layer and KV head, the key's digit tokens left in the cache.

    OMP_NUM_THREADS=1 python docs/results/needle_layers.py BOOK treekv 1 25000 guard=64

Arguments: book, method, depth index into the default depths (10, 30, 50, 70, 90 %) or ``DEPTHS:INDEX``
(``0.2,0.5,0.8:1``: the second haystack of ``kvcli needle --depths 0.2,0.5,0.8``), haystack length, then
``-o`` options as KEY=VALUE; ``prefix=none`` reads and answers as ``kvcli ask`` does, with no answer prefix.
The haystack and key are those of ``kvcli needle --trials 1`` (seed 0); the read
is streamed with the question as a probe (as ``kvcli ask`` reads a long document) at cache 1024, block 256.
Prints the digits kept per layer (one figure per KV head; the needle writes the key twice, so 10 at most)
and the answer.
"""

from __future__ import annotations

import sys

from kvcli.documents import open_source
from kvcli.engine import Engine
from kvcli.generate import Generation, Reader
from kvcli.methods import make_method
from kvcli.models import load_model
from kvcli.needle import ANSWER_PREFIX, DEFAULT_DEPTHS, QUESTION, book_tokens, haystacks, is_correct
from kvcli.prompts import build_prompt, question_instruction, stop_token_ids


def main() -> None:
    book, method, length = sys.argv[1], sys.argv[2], int(sys.argv[4])
    depths, _, index = sys.argv[3].rpartition(":")
    depths, depth_index = ([float(d) for d in depths.split(",")] if depths else DEFAULT_DEPTHS), int(index)
    options = dict(item.split("=", 1) for item in sys.argv[5:])
    prefix = "" if options.pop("prefix", None) == "none" else ANSWER_PREFIX
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    tokens = book_tokens(open_source(book), tokenizer)
    stack = list(haystacks(tokenizer, tokens, [length], depths, trials=1, fixed=True))[depth_index]
    key, doc = stack.key, stack.doc
    parts = build_prompt(tokenizer, question_instruction(QUESTION, prefix))
    stream = parts.prefix + doc
    digits = [i + j for i in range(len(stream) - 5) if tokenizer.decode(stream[i:i + 5]) == key for j in range(5)]
    engine = Engine(loaded.model, make_method(method, options), 1024, block=256)
    reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model))
    result, cache = Generation(), engine.new_cache()
    hidden = reader.read(cache, parts, [doc], result, one_shot=False, limit=0, probe=True)
    kept = []
    for idx, layer in enumerate(cache.layers):
        per_head = [sum(int((head == d).any()) for d in digits) for head in layer.token_idx]
        kept.append(f"{idx}:{'/'.join(map(str, per_head))}")
    print(f"key {key}, digit tokens at {digits}")
    print("digits kept per layer (per KV head):", " ".join(kept))
    reader.write(cache, hidden, result, 12)
    print("answer", repr(result.text), "correct" if is_correct(result.text.strip(), key) else "miss")


if __name__ == "__main__":
    main()
