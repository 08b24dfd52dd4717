"""The plot of ``kvcli ruler --plot``: the average RULER score per method with its 95% interval.

Drawn from the score rows (:meth:`kvcli.eval.ruler.trials.RulerResult.scores`), one panel per length: against kvpress's
compression ratio for a ``--ratios`` run (the form of kvpress's leaderboard), else per task at the run's cache.
Needs matplotlib (:func:`kvcli.io.plots.pyplot`).
"""

from __future__ import annotations

from pathlib import Path

from kvcli.io.plots import pyplot, save_figure


def plot_ruler(scores: list[dict], path: Path, model: str) -> Path:
    """Write the figure of ``scores`` to ``path`` (PNG) and return it."""
    plt = pyplot()
    lengths = sorted({row["length"] for row in scores})
    tasks = list(dict.fromkeys(row["task"] for row in scores))
    by_ratio = any(row["ratio"] is not None for row in scores)
    width = 5.5 if by_ratio else max(5.5, 0.9 * len(tasks))
    fig, axes = plt.subplots(1, len(lengths), squeeze=False, sharey=True, figsize=(width * len(lengths), 4.2))
    for ax, length in zip(axes[0], lengths, strict=True):
        rows = [row for row in scores if row["length"] == length]
        if by_ratio:
            _by_ratio(ax, [row for row in rows if row["task"] == "average"])
        else:
            _by_task(ax, rows, tasks)
        ax.set_title(f"{length:,} tokens", fontsize=10)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("mean score (95% interval)")
    axes[0, -1].legend(fontsize=8)
    cache = "" if by_ratio else f", cache {scores[0]['cache']:,} tokens/layer" if scores[0]["cache"] else ""
    fig.suptitle(f"RULER on {model}{cache}", fontsize=11)
    return save_figure(fig, path)


def _by_ratio(ax, averages: list[dict]) -> None:
    """One line per method: its average over tasks at each ratio."""
    for method in dict.fromkeys(row["method"] for row in averages):
        line = sorted((row for row in averages if row["method"] == method), key=lambda row: row["ratio"])
        x = [row["ratio"] for row in line]
        y = [row["score"] for row in line]
        errors = [[row["score"] - row["ci95"][0] for row in line], [row["ci95"][1] - row["score"] for row in line]]
        ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=method)
    ax.set_xlabel("compression ratio (kvpress's)")


def _by_task(ax, rows: list[dict], tasks: list[str]) -> None:
    """Bars per task (the average last), one per method side by side."""
    methods = list(dict.fromkeys(row["method"] for row in rows))
    cells = {(row["task"], row["method"]): row for row in rows}
    step = 0.8 / len(methods)
    for offset, method in enumerate(methods):
        present = [(i, cells[(task, method)]) for i, task in enumerate(tasks) if (task, method) in cells]
        x = [i - 0.4 + step * (offset + 0.5) for i, _ in present]
        y = [row["score"] for _, row in present]
        errors = [[row["score"] - row["ci95"][0] for _, row in present],
                  [row["ci95"][1] - row["score"] for _, row in present]]
        ax.bar(x, y, width=step, yerr=errors, capsize=2, label=method)
    ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=8)
