"""Grade every committed pass-key trial under docs/results/ again with kvcli's one grader,
``kvcli.eval.needle.is_correct``.

Usage: ``python docs/results/rescore.py [FOLDER]`` (default: the folder of this script). Reads every ``.json`` and
``.jsonl`` file that holds trials (rows with ``answer`` and ``key``), and prints per file and per group (frame,
book and method, where the rows record them) the count the file records against the count the grader gives
now, then every trial whose grade changes. The files are left as they were recorded: the scripts that read
them (needle_rows.py) grade their answers again, so the numbers in the docs are the grader's, not the file's.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvcli.eval.needle import is_correct

GROUPS = ("frame", "book", "method")


def trials(path: Path) -> list[dict]:
    """The pass-key trials of ``path``: a ``--json`` output (or any object with ``trials``) or a rows file."""
    text = path.read_text(encoding="utf-8")
    try:
        values = [json.loads(text)]
    except json.JSONDecodeError:  # more than one JSON value: one a line
        values = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = []
    for value in values:
        rows.extend(value.get("trials", [value]) if isinstance(value, dict) else [])
    return [row for row in rows if isinstance(row, dict) and "answer" in row and "key" in row and "correct" in row]


def rescore(path: Path, root: Path) -> tuple[int, int, int]:
    """Print ``path``'s counts, recorded against graded now; return (trials, recorded, now)."""
    rows = trials(path)
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    changed = []
    for row in rows:
        now = is_correct(row["answer"], row["key"])
        counts = groups[tuple(row.get(name) for name in GROUPS if name in row)]
        counts[0] += 1
        counts[1] += bool(row["correct"])
        counts[2] += now
        if now != bool(row["correct"]):
            changed.append(row)
    old, new = sum(bool(r["correct"]) for r in rows), sum(c[2] for c in groups.values())
    print(f"{path.relative_to(root)}: {old}/{len(rows)} recorded, {new}/{len(rows)} now")
    for group, (count, was, now) in groups.items():
        mark = "" if was == now else f"  <- {now - was:+d}"
        print(f"  {' / '.join(map(str, group))}: {was}/{count} -> {now}/{count}{mark}")
    for row in changed:
        where = " ".join(f"{name} {row[name]}" for name in (*GROUPS, "depth", "trial") if name in row)
        verdict = "now correct" if not row["correct"] else "now a miss"
        print(f"  {verdict}: {where} key {row['key']}: {row['answer'][:80]!r}")
    return len(rows), old, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    totals = [0, 0, 0]
    for path in sorted(p for p in args.folder.rglob("*") if p.suffix in (".json", ".jsonl")):
        if trials(path):
            for index, value in enumerate(rescore(path, args.folder)):
                totals[index] += value
    count, old, new = totals
    print(f"all files: {old}/{count} recorded, {new}/{count} now ({new - old:+d})")


if __name__ == "__main__":
    main()
