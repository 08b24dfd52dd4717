"""Perplexity against the bytes a cache holds, per method and bit width: the Pareto front of ``--kv-bits``.

    python docs/results/kv_bits_plot.py docs/results/kv-bits/crime-16k-*.jsonl --out pareto.png

Reads the rows ``docs/results/kv_bits_table.py`` writes (one ``kvcli ppl --json`` run per line, each run at one
``--cache-bytes``), draws one panel per method with a line per bit width through its budgets (x: the
``kv_cache_bytes`` the run reported, y: perplexity), marks the points no other run of that method beats in both
bytes and perplexity, and prints those points.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvcli.io.plots import pyplot, save_figure


def load(paths: list[Path]) -> dict[str, list[tuple[int, int, float]]]:
    """Per method, its runs as ``(bits, kv_cache_bytes, ppl)``; a cell measured in two files keeps the last."""
    cells: dict[tuple[str, int, int], float] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                method, bits = row["cell"]
                cells[(method, bits, row["kv_cache_bytes"])] = row["ppl"]
    runs: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for (method, bits, nbytes), ppl in sorted(cells.items()):
        runs[method].append((bits, nbytes, ppl))
    return runs


def front(runs: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """The runs no other run beats in both bytes and perplexity, fewest bytes first."""
    kept, best = [], float("inf")
    for run in sorted(runs, key=lambda r: (r[1], r[2])):
        if run[2] < best:
            kept.append(run)
            best = run[2]
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    runs = load(args.rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True, squeeze=False)
    for ax, (method, points) in zip(axes[0], runs.items(), strict=True):
        by_bits: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for bits, nbytes, ppl in points:
            by_bits[bits].append((nbytes / 2**20, ppl))
        for bits in sorted(by_bits, reverse=True):
            xs, ys = zip(*sorted(by_bits[bits]), strict=True)
            ax.plot(xs, ys, marker="o", label=f"{bits} bits")
        best = front(points)
        ax.plot([b / 2**20 for _, b, _ in best], [p for _, _, p in best], "k--", lw=0.8, label="front")
        ax.set_title(method)
        ax.set_xlabel("KV cache held (MiB)")
        ax.legend()
        print(f"{method}: front " + ", ".join(f"{bits} bits {b / 2**20:.2f} MiB {p:.3f}" for bits, b, p in best))
    axes[0][0].set_ylabel("perplexity")
    save_figure(fig, args.out)


if __name__ == "__main__":
    main()
