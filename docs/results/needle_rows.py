"""Break a ``kvcli needle`` run down by method, question wording, depth and key length, or compare two frames.

Usage:
  ``python docs/results/needle_rows.py FILE [FILE ...]``: FILE is a ``--rows`` file (one trial a line) or a
  ``--json`` output; prints each method's rate with its 95 % Wilson interval, then the rates by wording, by
  depth and by key length, then every miss; ``--against OTHER`` also pairs them with another run of the grid.
  ``python docs/results/needle_rows.py --compare docs/results/needle-24k/frame-compare-24k.jsonl``: the two
  frames of that file on the haystacks both read (paired by book, method, depth and trial), per book and for
  the tuning and held-out books, with the two-sided sign test on the haystacks only one frame answered;
  ``--frame current --tuning`` breaks that file's current-frame rows of the tuning books down instead.

The tables of docs/notes/2026-11-27-ask-frame.md, "Item 1's 24k table with the current frame" and "The frame
compared on 134 tuning haystacks", are what this prints for the files named there.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from math import comb
from pathlib import Path

from kvcli.eval.needle import is_correct, wilson_interval

TUNING = ("pg98-a-tale-of-two-cities", "pg1342-pride-and-prejudice", "pg11-alice-in-wonderland")


def read_trials(path: Path) -> list[dict]:
    """The trials of a ``--rows`` file (lines) or of a ``--json`` output (one object with ``trials``), each graded
    again by kvcli's grader (the files keep the grade of the kvcli that ran them: rescore.py)."""
    text = path.read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:  # more than one JSON value: a rows file
        whole = None
    if isinstance(whole, dict) and "trials" in whole:
        rows = whole["trials"]
    else:
        rows = [row for row in map(json.loads, text.splitlines()) if "correct" in row]
    return [{**row, "correct": is_correct(row["answer"], row["key"])} for row in rows]


def rate(rows: list[dict]) -> str:
    correct = sum(r["correct"] for r in rows)
    low, high = wilson_interval(correct, len(rows))
    return f"{correct}/{len(rows)} ({low:.0%}-{high:.0%})"


def breakdown(rows: list[dict]) -> None:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        print(f"{method:10s} {rate([r for r in rows if r['method'] == method])}")
    for label, field in (("wording", lambda r: r["question"]), ("depth", lambda r: r["depth"]),
                         ("key digits", lambda r: len(r["key"]))):
        print(f"-- by {label} ({' / '.join(methods)})")
        cells: dict = defaultdict(list)
        for r in rows:
            cells[(field(r), r["method"])].append(r["correct"])
        for value in sorted({field(r) for r in rows}, key=str):
            print(f"  {value}: " + " / ".join(f"{sum(cells[value, m])}/{len(cells[value, m])}" for m in methods))
    print("-- misses")
    for r in rows:
        if not r["correct"]:
            print(f"  {r['method']} {r['depth']:.0%} trial {r['trial']} key {r['key']}: {r['answer'][:70]!r}")


def sign_test(a: int, b: int) -> float:
    """Two-sided p of ``a`` against ``b`` discordant pairs under a fair coin."""
    n, k = a + b, max(a, b)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k, n + 1)) / 2 ** n) if n else 1.0


def compare(rows: list[dict]) -> None:
    frames = list(dict.fromkeys(r["frame"] for r in rows))
    if len(frames) != 2:
        raise SystemExit(f"--compare needs rows of two frames, found {frames}")
    by = {(r["frame"], r["book"], r["method"], r["depth"], r["trial"]): r["correct"] for r in rows}
    totals: dict = defaultdict(lambda: [0, 0, 0, 0, 0])
    for (frame, *cell), first in by.items():
        other = by.get((frames[1], *cell))
        if frame != frames[0] or other is None:
            continue
        for group in (cell[0], "tuning" if cell[0] in TUNING else "held out"):
            t = totals[group]
            t[0] += 1
            t[1] += first
            t[2] += other
            t[3] += first and not other
            t[4] += other and not first
    print(f"group: pairs, {frames[0]}, {frames[1]}, only {frames[0]} / only {frames[1]}, sign test p")
    for group, (pairs, a, b, only_a, only_b) in sorted(totals.items()):
        print(f"  {group}: {pairs}, {a}, {b}, {only_a} / {only_b}, p = {sign_test(only_a, only_b):.2f}")


def against(rows: list[dict], other: list[dict]) -> None:
    """The haystacks (same method, depth, trial and key: older runs record no length) that only one of two runs
    answered."""
    def cell(row: dict) -> tuple:
        return row["method"], row["depth"], row["trial"], row["key"]

    theirs = {cell(r): r["correct"] for r in other}
    pairs = [(r["correct"], theirs[cell(r)]) for r in rows if cell(r) in theirs]
    only_these = sum(mine and not its for mine, its in pairs)
    only_other = sum(its and not mine for mine, its in pairs)
    print(f"-- against the other run: {len(pairs)} pairs, {sum(m for m, _ in pairs)} against {sum(i for _, i in pairs)}"
          f" answered, only these {only_these} / only the other {only_other}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--compare", action="store_true", help="pair the two frames of a frame-compare file")
    parser.add_argument("--against", type=Path, help="another run of the same grid: the haystacks only one answered")
    parser.add_argument("--frame", help="a frame-compare file's rows of this frame only")
    parser.add_argument("--tuning", action="store_true", help="a frame-compare file's rows of the tuning books only")
    args = parser.parse_args()
    rows = [row for path in args.files for row in read_trials(path)
            if args.frame in (None, row.get("frame")) and (not args.tuning or row.get("book") in TUNING)]
    if args.compare:
        compare(rows)
    else:
        breakdown(rows)
        if args.against:
            against(rows, read_trials(args.against))


if __name__ == "__main__":
    main()
