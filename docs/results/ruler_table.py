"""kvcli's and kvpress's RULER rows on the same samples, as one markdown table (issue #53).

    python docs/results/ruler_table.py docs/results/ruler-4k/anna-kvcli.jsonl docs/results/ruler-4k/anna-kvpress.jsonl

Rows: `kvcli ruler --rows` (kvcli's methods) and `docs/results/kvpress_ruler.py --out` (kvpress's presses), joined on
(task, length, index). Only the samples both files hold count, so every column averages the same samples. A
cell is the mean score in percent; the average row adds the 95% Wilson interval over all trials of the column.
``FILE=LABEL`` adds LABEL to the names of that file's columns (the same method at two commits, side by side).
``--length 16k`` keeps the rows of one length (a file of ``--lengths 4k,16k`` holds both); ``--summary`` prints
one line a column (average, interval, trials) instead of the per-task table; ``--length 16k --against 4k`` prints a
line a method with its averages at both lengths and their ratio, #53's streamed goal (each length's average over
the samples every column of that length read); ``--costs`` prints what the trials cost instead of their scores: a
line a file and length with the peak resident set of its first trial and its largest, the median seconds of a
trial and the most tokens the cache held (kvpress's rows: the context tokens a layer kept, on average over layers).

    python docs/results/ruler_table.py docs/results/ruler-debmake/debmake-gemma-*.jsonl --length 16k --against 4k
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kvcli.cli.ruler import ruler_length
from kvcli.eval.needle import wilson_interval


def load(argument: str) -> list[dict]:
    """The trial rows of ``argument`` (a file, or ``FILE=LABEL``), each with the label it adds to its column."""
    path, label = split_label(argument)
    try:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        sys.exit(f"ruler_table: {path}: not a file of JSON rows ({error})")
    return [row | {"label": label} for row in rows if "task" in row and "score" in row]


def split_label(argument: str) -> tuple[str, str]:
    """``FILE=LABEL`` as (FILE, LABEL); a file whose own name holds ``=`` stays whole."""
    path, _, label = argument.rpartition("=") if "=" in argument and not Path(argument).exists() else (argument, "", "")
    return path, label


def main() -> None:
    parser = argparse.ArgumentParser(description="RULER rows of kvcli and kvpress as one markdown table.")
    parser.add_argument("rows", nargs="+", help="files of `kvcli ruler --rows` or `kvpress_ruler.py --out` rows "
                        "(FILE=LABEL adds LABEL to that file's columns)")
    parser.add_argument("--length", type=ruler_length, help="only the rows of this length (4096 or 4k)")
    parser.add_argument("--summary", action="store_true", help="one line a column: average, interval, trials, and "
                        "the samples it scored above / below the first column")
    parser.add_argument("--against", type=ruler_length, help="with --length: a line a method, its averages at this "
                        "length and at --length and their ratio (#53's 16k / 4k)")
    parser.add_argument("--costs", action="store_true", help="a line a file and length: peak memory, seconds, cache")
    args = parser.parse_args()
    if args.costs:
        return print_costs(args.rows, args.length)
    rows = [row for path in args.rows for row in load(path)]
    if args.against:
        if not args.length:
            sys.exit("ruler_table: --against needs --length (the length it is set against)")
        return print_against(rows, args.length, args.against)
    if args.length:
        rows = [row for row in rows if row["length"] == args.length]
    cells = shared_cells(rows)
    columns = ordered(cells)
    shared = set(next(iter(cells.values())))
    tasks = sorted({task for task, _, _ in shared}, key=lambda t: (t.startswith("niah") is False, t))
    print(f"{len(shared)} samples ({len(tasks)} tasks) read by every column\n")
    if args.summary:
        return print_summary(cells, columns)
    print("| task | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for task in tasks:
        means = []
        for column in columns:
            scores = [v for (t, _, _), v in cells[column].items() if t == task]
            means.append(f"{100 * sum(scores) / len(scores):.0f}" if scores else "-")
        print(f"| {task} | " + " | ".join(means) + " |")
    averages = [mean_interval(list(cells[column].values())) for column in columns]
    print("| average (95% CI) | " + " | ".join(averages) + " |")


def print_summary(cells: dict[str, dict[tuple, float]], columns: list[str]) -> None:
    """A line a column: average, interval, trials, and on how many samples it scored above and below the first
    column; the counts pair each sample with itself, so two settings on the same samples show which samples moved."""
    first = cells[columns[0]]
    print("| column | average (95% CI) | trials | samples higher / lower than the first |")
    print("| --- | ---: | ---: | ---: |")
    for column in columns:
        scores = cells[column]
        moved = "" if column == columns[0] else (f"{sum(scores[k] > first[k] for k in scores)} / "
                                                 f"{sum(scores[k] < first[k] for k in scores)}")
        print(f"| {column} | {mean_interval(list(scores.values()))} | {len(scores)} | {moved} |")


def shared_cells(rows: list[dict]) -> dict[str, dict[tuple, float]]:
    """Each column's scores by sample (task, length, index), only the samples every column read; exits with one
    line when there are no rows or no shared sample."""
    if not rows:
        sys.exit("ruler_table: no trial rows in these files")
    cells: dict[str, dict[tuple, float]] = defaultdict(dict)
    for row in rows:
        budget = row["ratio"] if row.get("ratio") is not None else f"cache {row['cache']}"  # streamed rows: a cache
        column = row["method"] if row["method"] == "full" else f"{row['method']} {budget}"
        column += f" {row['label']}" if row["label"] else ""
        cells[column][(row["task"], row["length"], row["index"])] = row["score"]
    shared = set.intersection(*(set(scores) for scores in cells.values()))
    if not shared:
        sys.exit("ruler_table: no sample is read by every column (columns of other lengths? give --length)")
    return {column: {key: v for key, v in scores.items() if key in shared} for column, scores in cells.items()}


def ordered(cells: dict[str, dict]) -> list[str]:
    """Full attention first, then by budget and method, a method's labelled columns in the files' order."""
    order = {column: i for i, column in enumerate(cells)}
    return sorted(cells, key=lambda c: (c != "full", c.split()[1] if " " in c else "", c.split()[0], order[c]))


def print_against(rows: list[dict], length: int, against: int) -> None:
    """A line a column: its average at ``against`` and at ``length`` and the ratio of the two (blank where a column
    has only one of them, as full attention past the model's window)."""
    base = shared_cells([row for row in rows if row["length"] == against])
    cells = shared_cells([row for row in rows if row["length"] == length])
    names = [f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}" for n in (against, length)]
    print(f"{len(next(iter(base.values())))} samples at {names[0]} and {len(next(iter(cells.values())))} at "
          f"{names[1]}, each read by every column of its length\n")
    print(f"| column | {names[0]} (95% CI) | {names[1]} (95% CI) | {names[1]} / {names[0]} |")
    print("| --- | ---: | ---: | ---: |")
    for column in ordered({**base, **cells}):
        means = [list(table[column].values()) if column in table else None for table in (base, cells)]
        ratio = f"{100 * sum(means[1]) / len(means[1]) / (sum(means[0]) / len(means[0])):.0f} %" \
            if all(means) and sum(means[0]) else ""
        print(f"| {column} | " + " | ".join(mean_interval(m) if m else "" for m in means) + f" | {ratio} |")


#: Where kvcli's trial rows and kvpress_ruler.py's rows keep a trial's peak resident set and the tokens it cached.
PEAK_FIELDS = ("peak_memory_bytes", "peak_rss_bytes")
CACHED_FIELDS = ("max_cache_tokens", "kept_tokens")


def print_costs(paths: list[str], length: int | None) -> None:
    """A line a file and length: its trials, the peak resident set (model included) of the first trial and the
    largest, the median seconds of a trial and the most tokens the cache held; the first trial is a process's
    memory before the allocator keeps what later trials freed (docs/benchmarks.md)."""
    print("| rows | length | trials | peak GiB, first trial | peak GiB, largest | median s | cache tokens, most |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in paths:
        rows = [row for row in load(path) if length in (None, row["length"])
                and any(field in row for field in PEAK_FIELDS)]
        for n in sorted({row["length"] for row in rows}):
            trials = [row for row in rows if row["length"] == n]
            peaks = [first_field(row, PEAK_FIELDS) / 2**30 for row in trials]
            print(f"| {Path(split_label(path)[0]).name} | {n:,} | {len(trials)} | {peaks[0]:.2f} | "
                  f"{max(peaks):.2f} | {statistics.median(row['seconds'] for row in trials):.0f} | "
                  f"{max(first_field(row, CACHED_FIELDS) for row in trials):,} |")


def first_field(row: dict, fields: tuple[str, ...]) -> int:
    """The value of the first of ``fields`` the row has: kvcli's and kvpress's rows name the same cost apart."""
    return next(row[field] for field in fields if field in row)


def mean_interval(scores: list[float]) -> str:
    """The mean score in percent, bold, and its 95% Wilson interval over the trials."""
    low, high = wilson_interval(sum(scores), len(scores))  # type: ignore[arg-type] - partial successes
    return f"**{100 * sum(scores) / len(scores):.1f}** ({100 * low:.0f}-{100 * high:.0f})"


if __name__ == "__main__":
    main()
