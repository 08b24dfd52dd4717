"""Which layers still hold a streamed pass key: per layer and KV head, the key's digit tokens left in the cache.

    OMP_NUM_THREADS=1 python docs/results/needle_layers.py BOOK treekv 1 25000 guard=64

Arguments: book, method, depth index into the default depths (10, 30, 50, 70, 90 %) or ``DEPTHS:INDEX``
(``0.2,0.5,0.8:1``: the second haystack of ``kvcli needle --depths 0.2,0.5,0.8``), haystack length, then
``-o`` options as KEY=VALUE; ``prefix=none`` reads and answers as ``kvcli ask`` does, with no answer prefix;
``block=N`` and ``recap=N`` set the read's block and recap (default: ``kvcli ask``'s, 1024 and 512),
``cache=N`` the cache (1024), ``oneshot=1`` reads the document in one forward as ``kvcli ask`` reads one that
fits the context. The haystack and key are those of ``kvcli needle --trials 1 --fixed`` (seed 0); otherwise the
read is streamed with the question as a probe (as ``kvcli ask`` reads a long document).
Prints the digits kept per layer (one figure per KV head; the needle writes the key twice, so 10 at most),
for each layer whose heads do not keep every digit which ones each head lacks (``6049_`` : the last digit),
whether the recap re-read the key, and the answer.
"""

from __future__ import annotations

import sys

from kvcli.cli.options import READ_BLOCK
from kvcli.engine.engine import Engine
from kvcli.eval.needle import ANSWER_PREFIX, DEFAULT_DEPTHS, QUESTION, book_tokens, haystacks, is_correct
from kvcli.io.documents import open_source
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.generate import Generation
from kvcli.reading.prompts import build_prompt, encode, question_instruction, stop_token_ids
from kvcli.reading.reader import RECAP_SEPARATOR, Reader
from kvcli.reading.recap import RECAP_TOKENS, Recap


def main() -> None:
    book, method, length = sys.argv[1], sys.argv[2], int(sys.argv[4])
    depths, _, index = sys.argv[3].rpartition(":")
    depths, depth_index = ([float(d) for d in depths.split(",")] if depths else DEFAULT_DEPTHS), int(index)
    options = dict(item.split("=", 1) for item in sys.argv[5:])
    prefix = "" if options.pop("prefix", None) == "none" else ANSWER_PREFIX
    block, recap = int(options.pop("block", READ_BLOCK)), int(options.pop("recap", RECAP_TOKENS))
    budget, one_shot = int(options.pop("cache", 1024)), options.pop("oneshot", "0") == "1"
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    tokens = book_tokens(open_source(book), tokenizer)
    stack = list(haystacks(tokenizer, tokens, [length], depths, trials=1, fixed=True))[depth_index]
    key, doc = stack.key, stack.doc
    parts = build_prompt(tokenizer, question_instruction(QUESTION, prefix))
    stream = parts.prefix + doc
    width = len(key)
    digits = [i + j for i in range(len(stream) - width) if tokenizer.decode(stream[i:i + width]) == key
              for j in range(width)]
    engine = Engine(loaded.model, make_method(method, options), budget, block=block)
    reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model), recap=recap)
    recapped: list[int] = []
    passages = Recap.passages
    Recap.passages = lambda self, joins=None: recapped.extend(passages(self, joins)) or list(recapped)  # type: ignore[method-assign]
    result, cache = Generation(), engine.new_cache()
    hidden = reader.read(cache, parts, [doc], result, one_shot=one_shot, limit=None if one_shot else 0,
                         probe=True)
    recap_at = len(stream) + len(encode(tokenizer, RECAP_SEPARATOR))
    again = [recap_at + i + j for i in range(len(recapped) - width + 1)
             if tokenizer.decode(recapped[i:i + width]) == key for j in range(width)]
    kept, lacking = [], []
    for idx, layer in enumerate(cache.layers):
        held = [[bool((head == d).any()) for d in digits] for head in layer.token_idx]
        kept.append(f"{idx}:{'/'.join(str(sum(h)) for h in held)}")
        if not all(all(h) for h in held):
            lacking.append(f"{idx}:" + "/".join("".join(key[j % width] if h[j] else "_" for j in range(len(h)))
                                                for h in held))
    print(f"key {key}, digit tokens at {digits}")
    print("digits kept per layer (per KV head):", " ".join(kept))
    print("layers missing digits (per KV head, both copies):", " ".join(lacking) or "none")
    if again:
        print("the recap's copy, digits kept per layer (per KV head):", " ".join(
            f"{idx}:{'/'.join(str(sum(int((head == d).any()) for d in again)) for head in layer.token_idx)}"
            for idx, layer in enumerate(cache.layers)))
    text = tokenizer.decode(recapped)
    at = text.find(key)
    found = f"the key in {text[max(at - 80, 0):at + 40]!r}" if at >= 0 else "no key"
    print(f"recap: {len(recapped)} tokens, {found}")
    reader.write(cache, hidden, result, 32)
    print("answer", repr(result.text), "correct" if is_correct(result.text.strip(), key) else "miss")


if __name__ == "__main__":
    main()
