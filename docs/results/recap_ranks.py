"""Where the needle ranks by the recap's score, layer by layer (docs/notes/2026-11-26-ask-recap.md,
"Two changes to the recap").

    python docs/results/recap_ranks.py BOOK [--trials 2] [--depths 0.2,0.5,0.8] [--method snapkv]

Reads the varied 24,000-token haystacks of ``kvcli needle BOOK --lengths 24000`` (seed 0) the way ``kvcli ask``
streams them, and for every block records, per layer, each token's largest share of the block paid by one query
head of the question's probe (the recap's score before its layers are chosen). Prints, per haystack, where the
best token of the needle sentence (the six tokens before the key, and the key) ranks among all stream tokens
when the score is the maximum over some layer ranges, and a summary line per range. Use tuning books only.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kvcli.reading.reader as reading
from kvcli.engine.engine import Engine
from kvcli.eval.needle import haystacks
from kvcli.methods import make_method
from kvcli.models.load import load_model
from kvcli.reading.prompts import build_prompt, encode, question_instruction, stop_token_ids
from kvcli.reading.reader import Reader
from kvcli.reading.recap import Recap, scored_layers

RANGES = ((7, 7), (7, 8), (0, 29), (10, 25))


class Recorder(Recap):
    """A recap that keeps every block's per-layer scores instead of passages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks: list[tuple[int, torch.Tensor]] = []

    def observe(self, cache, ids: list[int], start: int) -> None:
        n, rows = len(ids), []
        for layer in cache.layers:
            record = getattr(layer, "record", None)
            if record is None or record.probe is None:
                rows.append(torch.zeros(n))
                continue
            probs = record.probe[..., -n:].float()
            rows.append((probs / probs.sum(-1, keepdim=True)).amax(dim=(0, 1)).cpu())
        self.blocks.append((start, torch.stack(rows)))

    def passages(self) -> list[int]:
        return []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("book")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--depths", default="0.2,0.5,0.8")
    parser.add_argument("--method", default="snapkv")
    args = parser.parse_args()
    shipped = reading.Recap
    loaded = load_model("smollm2-135m")
    tokenizer = loaded.tokenizer
    with open(args.book, encoding="utf-8") as file:
        tokens = encode(tokenizer, file.read())
    stop = stop_token_ids(tokenizer, loaded.model)
    depths = [float(depth) for depth in args.depths.split(",")]
    ranks: dict[tuple[int, int], list[int]] = {span: [] for span in RANGES}
    print(f"shipped layers: {scored_layers(30)}")
    for stack in haystacks(tokenizer, tokens, [24000], depths, args.trials, 0):
        parts = build_prompt(tokenizer, question_instruction(stack.question))
        key = encode(tokenizer, stack.key)
        found = [i for i in range(len(stack.doc) - len(key)) if stack.doc[i:i + len(key)] == key]
        needle = {len(parts.prefix) + i + offset for i in found for offset in range(-6, len(key) + 1)}
        recorder = Recorder(512, first=len(parts.prefix))
        reader = Reader(Engine(loaded.model, make_method(args.method), 1024, block=256), tokenizer, stop_ids=stop,
                        recap=512)
        reading.Recap = lambda *_, made=recorder, **__: made  # the reader makes its recap by this name
        reader.run(parts, [stack.doc], 1, one_shot=False)
        starts = torch.cat([torch.arange(start, start + rows.shape[1]) for start, rows in recorder.blocks])
        scores = torch.cat([rows for _, rows in recorder.blocks], dim=1)
        mask = torch.tensor([int(index) in needle for index in starts])
        line = []
        for low, high in RANGES:
            score = scores[low:high + 1].amax(0)
            rank = int((score > score[mask].max()).sum())
            ranks[(low, high)].append(rank)
            line.append(f"layers {low}-{high}: {rank}")
        print(f"depth {stack.depth} trial {stack.trial} key {stack.key}: " + ", ".join(line), flush=True)
    reading.Recap = shipped
    for (low, high), values in ranks.items():
        print(f"layers {low}-{high}: median rank {statistics.median(values):.1f}, "
              f"in the top 30 {sum(rank <= 30 for rank in values)} of {len(values)}")


if __name__ == "__main__":
    main()
