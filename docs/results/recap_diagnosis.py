"""The recap diagnoses behind docs/notes/2026-12-06-recap-repeats.md (run them on tuning books only).

    python docs/results/recap_diagnosis.py repeats BOOK MODEL SEED TASKS
    python docs/results/recap_diagnosis.py rank BOOK MODEL SEED TASK SAMPLES
    python docs/results/recap_diagnosis.py lexical BOOK MODEL SEED TASKS ROWS

Each reads RULER samples at 16k, streamed, TreeKV at cache 1,024 with ask's recap, as ``kvcli ruler`` does, and
patches kvcli's recap in this process only. ``repeats``: one sample a task; prints whether the rule of 35ede6a (a
passage re-read only if it adds a run of four tokens the recap does not hold; reverted) would choose another recap,
and both sizes. ``rank``: per trial, the asked needle's best score near its key, the block's best, its rank in the
block, and the 99th percentile of all scores. ``lexical``: three samples a task with a bonus of 1.0 on the recap's
score where a pair of the question's tokens starts that occurs at most twice in the block; rows to ROWS.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import kvcli.reading.reader as reader
from kvcli.eval.ruler.tasks import Book, make_sample
from kvcli.eval.ruler.trials import run_ruler
from kvcli.models.load import load_model
from kvcli.reading.recap import RECAP_TOKENS, Recap, passage_share, question_pairs, rare_pair_starts

LENGTH, GRAM, BONUS, RARE = 16384, 4, 1.0, 2
ORIGINAL_CHOSEN, ORIGINAL_OBSERVE, ORIGINAL_SHARE = Recap.chosen, Recap.observe, Recap._block_share


def chosen_without_repeats(self: Recap, joins=None) -> dict[int, int]:
    """:meth:`Recap.chosen` with the rule of 35ede6a: skip a passage whose every run of GRAM tokens is chosen."""
    chosen: dict[int, int] = {}
    read: set[tuple[int, ...]] = set()
    if self.scores is None:
        return chosen
    for score, start, span in zip(self.scores.tolist(), self.starts.tolist(), self.ids.tolist(), strict=True):
        if score <= 0:
            break
        lo, hi = self._edges(span, joins)
        grams = {tuple(span[j:j + GRAM]) for j in range(lo, max(hi - GRAM, lo) + 1)}
        if grams <= read:
            continue
        new = {start + j: span[j] for j in range(lo, hi) if span[j] >= 0 and start + j not in chosen}
        if len(chosen) + len(new) > self.tokens:
            continue
        chosen.update(new)
        read |= grams
    return chosen


def repeats() -> None:
    def compare(self: Recap, joins=None) -> dict[int, int]:
        now, rule = ORIGINAL_CHOSEN(self, joins), chosen_without_repeats(self, joins)
        print(f"differs {now != rule}: {len(now)} tokens now, {len(rule)} with the rule", flush=True)
        return now
    Recap.chosen = compare


def observe_ids(self: Recap, cache, ids: list[int], start: int) -> None:
    self.block_ids = list(ids)
    ORIGINAL_OBSERVE(self, cache, ids, start)


def rank(tokenizer, book: Book, task: str, seed: int) -> Callable:
    blocks: list[tuple[list[int], torch.Tensor]] = []

    def share(self: Recap, cache, n: int):
        scores = ORIGINAL_SHARE(self, cache, n)
        if scores is not None:
            blocks.append((self.block_ids, scores.cpu()))
        return scores

    def report(trial, *_) -> None:
        question = make_sample(tokenizer, book, task, LENGTH, trial.index, seed).question
        key = tokenizer.encode(" " + question.split(" for ")[1].split(" mentioned")[0], add_special_tokens=False)
        for ids, scores in blocks:
            for at in (i for i in range(len(ids) - len(key) + 1) if ids[i:i + len(key)] == key):
                near = scores[max(at - 12, 0):at + 20].max().item()
                print(f"  needle: {near:.3f} near its key, block best {scores.max():.3f}, "
                      f"rank in block {(scores > near).sum().item()}", flush=True)
        every = torch.cat([scores for _, scores in blocks])
        print(f"trial {trial.index}: score {trial.score}, 99th percentile {every.quantile(0.99):.3f}", flush=True)
        blocks.clear()
    Recap.observe, Recap._block_share = observe_ids, share
    return report


def lexical(rows: Path) -> Callable:
    question: set[tuple[int, int]] = set()
    original_stream = reader.Reader._stream

    def stream(self, cache, parts, *args, **kwargs):
        question.clear()
        question.update(question_pairs(parts.question))
        return original_stream(self, cache, parts, *args, **kwargs)

    def share(self: Recap, cache, n: int):
        scores = ORIGINAL_SHARE(self, cache, n)
        if scores is None:
            return None
        hits = BONUS * torch.tensor(rare_pair_starts(self.block_ids[:n], question, RARE))
        bonus = passage_share(hits.to(scores.dtype)[None, None], self.radius)[0, 0][:scores.numel()]
        return scores + bonus.to(scores.device)

    def write(trial, *_) -> None:
        print(f"{trial.task} {trial.index}: {trial.score}", flush=True)
        with rows.open("a") as out:
            out.write(json.dumps({"task": trial.task, "length": trial.length, "index": trial.index,
                                  "method": trial.method, "ratio": None, "cache": 1024, "score": trial.score,
                                  "answer": trial.answer}) + "\n")
    reader.Reader._stream, Recap.observe, Recap._block_share = stream, observe_ids, share
    return write


def main() -> None:
    command, book_path, model, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    loaded = load_model(model)
    book = Book(Path(book_path).read_text())
    tasks, samples, on_trial = sys.argv[5].split(","), 1, None
    if command == "repeats":
        repeats()
    elif command == "rank":
        samples, on_trial = int(sys.argv[6]), rank(loaded.tokenizer, book, tasks[0], seed)
    elif command == "lexical":
        samples, on_trial = 3, lexical(Path(sys.argv[6]))
    else:
        sys.exit(f"recap_diagnosis: unknown command {command!r} (repeats, rank or lexical)")
    run_ruler(loaded.model, loaded.tokenizer, book, tasks, ["treekv"], lengths=[LENGTH], samples=samples,
              budget=1024, seed=seed, recap=RECAP_TOKENS, on_trial=on_trial)


if __name__ == "__main__":
    main()
