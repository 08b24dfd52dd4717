"""Where a pass-key answer breaks: the two diagnostics of
docs/notes/2026-11-25-ask-24k-streamed.md ("Where the answer breaks").

    python docs/results/answer_breaks.py forced BOOK METHODS DEPTH_INDEX [TEXT]
    python docs/results/answer_breaks.py graft BOOK DEPTH_INDEX METHOD:LAYERS[,METHOD:LAYERS] ...

``forced``: the 24k haystack ``DEPTH_INDEX`` of ``kvcli needle --depths 0.2,0.5,0.8 --trials 1 --fixed`` (seed 0)
read as ``kvcli ask`` reads it (streamed, the question as the probe, no answer prefix), then the tokens of
``TEXT`` (default "The pass key is ") fed as if the model had written them, then the answer, for each method.

``graft``: the 6k haystack ``DEPTH_INDEX`` of ``kvcli needle --lengths 6000 --trials 1 --fixed`` read in one shot
with full attention; each spec replaces the listed layers (``0-6``, ``6``, ``0-6+14``) by those layers of the
method's one-shot read at cache 512 (``none``: no layer), then answers. Prints one line per method or spec.
"""

from __future__ import annotations

import sys

import torch

from kvcli.engine.engine import Engine
from kvcli.eval.needle import DEFAULT_DEPTHS, QUESTION, book_tokens, haystacks, is_correct
from kvcli.io.documents import open_source
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.generate import Generation
from kvcli.reading.prompts import build_prompt, encode, question_instruction, stop_token_ids
from kvcli.reading.reader import Reader


def layers_of(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split("+"):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def main() -> None:
    mode, book = sys.argv[1], sys.argv[2]
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    tokens = book_tokens(open_source(book), tokenizer)
    parts = build_prompt(tokenizer, question_instruction(QUESTION, ""))
    stop = stop_token_ids(tokenizer, loaded.model)

    def reader(method: str, budget: int | None) -> Reader:
        return Reader(Engine(loaded.model, make_method(method, {}), budget, block=256), tokenizer, stop_ids=stop)

    if mode == "forced":
        methods, index = sys.argv[3].split(","), int(sys.argv[4])
        forced = encode(tokenizer, sys.argv[5] if len(sys.argv) > 5 else "The pass key is ")
        stack = list(haystacks(tokenizer, tokens, [24000], [0.2, 0.5, 0.8], trials=1, fixed=True))[index]
        for method in methods:
            run = reader(method, 1024)
            result, cache = Generation(), run.engine.new_cache()
            hidden = run.read(cache, parts, [stack.doc], result, one_shot=False, limit=0, probe=True)
            for token in forced:
                hidden = run.engine.forward(cache, torch.tensor([[token]]), decoding=True)[-1:]
            run.write(cache, hidden, result, 10)
            print(method, stack.key, repr(result.text), is_correct(result.text.strip(), stack.key), flush=True)
        return
    index, specs = int(sys.argv[3]), sys.argv[4:]
    stack = list(haystacks(tokenizer, tokens, [6000], DEFAULT_DEPTHS, trials=1, fixed=True))[index]
    compressed: dict = {}
    for spec in specs:
        run = reader("full", None)
        result, cache = Generation(), run.engine.new_cache()
        hidden = run.read(cache, parts, [stack.doc], result, one_shot=True)
        cache.keep_positions = True  # the grafted layers keep their tokens at their stream positions
        for item in [] if spec == "none" else spec.split(","):
            method, layers = item.split(":")
            if method not in compressed:
                other = reader(method, 512)
                compressed[method] = other.engine.new_cache()
                other.read(compressed[method], parts, [stack.doc], Generation(), one_shot=True)
            for layer in layers_of(layers):
                source, target = compressed[method].layers[layer], cache.layers[layer]
                target.keys, target.values = source.keys, source.values
                target.entry_pos, target.token_idx, target.moved = source.entry_pos, source.token_idx, True
        answer = Generation()
        run.write(cache, hidden, answer, 10)
        print(spec, stack.key, repr(answer.text), is_correct(answer.text.strip(), stack.key), flush=True)


if __name__ == "__main__":
    main()
