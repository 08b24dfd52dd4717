"""The plots of ``kvcli bench``, drawn from every run in ``results.json``.

Runs from earlier invocations appear next to new ones; runs that differ in a setting become separate,
labelled lines. Needs matplotlib (:func:`kvcli.io.plots.pyplot` raises :class:`~kvcli.errors.KvcliError`
without it).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvcli.eval.bench.results import SETTING_FIELDS
from kvcli.io.plots import pyplot, save_figure

PPL_PLOT = "ppl_vs_cache.png"
NLL_PLOT = "nll_vs_position.png"
# The trailing window of the position plot: about this fraction of the stream, in whole blocks (at least one).
SMOOTHING_FRACTION = 16


def smooth_curve(curve: Sequence[Sequence], window: int) -> list[tuple[int, float]]:
    """Trailing token-weighted mean NLL: the point at position p averages the blocks that end in (p - window, p].

    A block's weight is its number of scored tokens, the distance from the previous block's last
    position (the first block scores one token fewer than it reads, since token 0 has no prediction).
    """
    positions = [int(position) for position, _ in curve]
    sums, weights = [0.0], [0.0]
    previous = 0
    for position, nll in curve:
        weight = 0 if nll is None else position - previous
        previous = position
        weights.append(weights[-1] + weight)
        sums.append(sums[-1] + (weight * nll if weight else 0.0))
    out = []
    for i, position in enumerate(positions):
        first = bisect.bisect_right(positions, position - window)
        weight = weights[i + 1] - weights[first]
        if weight > 0:
            out.append((position, (sums[i + 1] - sums[first]) / weight))
    return out


def smoothing_window(runs: list[dict]) -> int:
    """Tokens averaged per point of the position plot: about 1/16 of the stream, rounded to whole blocks."""
    block = max(run["block"] for run in runs)
    tokens = max(run["tokens"] for run in runs)
    return block * max(1, round(tokens / SMOOTHING_FRACTION / block))


def _short(field: str, value) -> str:
    if field in ("model", "source") and isinstance(value, str):
        return Path(value).name or value
    if field == "tokens":
        return f"{value:,} tokens"
    if field == "block":
        return f"block {value}"
    return str(value)


def _series(runs: list[dict]) -> tuple[dict[str, list[dict]], list[str]]:
    """Group runs into lines: one per method, split further by any setting that differs between runs.

    Returns the lines by label and the settings common to all runs (for the title).
    """
    varying = [f for f in SETTING_FIELDS if len({json.dumps(run.get(f)) for run in runs}) > 1]
    by_method: dict[str, list[dict]] = {}
    for run in runs:
        by_method.setdefault(run["method"], []).append(run)
    varying_params = {
        method: sorted(k for k in {k for run in group for k in run.get("params", {})}
                       if len({json.dumps(run.get("params", {}).get(k)) for run in group}) > 1)
        for method, group in by_method.items()
    }
    lines: dict[str, list[dict]] = {}
    for run in runs:
        parts = [run["method"], *(_short(f, run.get(f)) for f in varying),
                 *(f"{k}={run['params'].get(k)}" for k in varying_params[run["method"]]),
                 *([f"{run['kv_bits']}-bit"] if run.get("kv_bits", 16) != 16 else [])]
        lines.setdefault(" · ".join(parts), []).append(run)
    common = [_short(f, runs[0].get(f)) for f in ("model", "tokens", "source", "block") if f not in varying]
    return lines, common


def _colors(labels: Iterable[str]) -> dict[str, str]:
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan", "tab:gray"]
    return {label: palette[i % len(palette)] for i, label in enumerate(sorted(labels))}


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw ``ppl_vs_cache.png`` and ``nll_vs_position.png`` from every run in ``results``; return the files.

    Needs matplotlib (:func:`kvcli.io.plots.pyplot` raises :class:`KvcliError` without it).
    """
    plt = pyplot()
    runs = [run for run in results.get("runs", []) if run.get("ppl") is not None and run.get("method")]
    if not runs:
        return []
    lines, common = _series(runs)
    colors = _colors(label for label, group in lines.items() if group[0].get("cache") is not None)
    subtitle = " · ".join(common)
    written = []

    budgeted = {label: sorted(group, key=lambda run: run["cache"]) for label, group in lines.items()
                if group[0].get("cache") is not None}
    unbounded = {label: group for label, group in lines.items() if group[0].get("cache") is None}
    budgets = sorted({run["cache"] for group in budgeted.values() for run in group})
    if budgets:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for label, group in budgeted.items():
            ax.plot([run["cache"] for run in group], [run["ppl"] for run in group], marker="o", label=label,
                    color=colors[label])
        for label, group in unbounded.items():
            ax.axhline(group[0]["ppl"], linestyle="--", color="black", linewidth=1.2,
                       label=f"{label} (uncompressed): {group[0]['ppl']:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [f"{budget:,}" for budget in budgets])
        ax.minorticks_off()
        if len(budgets) == 1:
            ax.set_xlim(budgets[0] / 2, budgets[0] * 2)
        ax.set_xlabel("KV cache budget (tokens per layer, log₂ scale)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title(f"Perplexity vs KV cache size\n{subtitle}", fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
        written.append(save_figure(fig, Path(out_dir) / PPL_PLOT))

    written.append(_plot_positions(plt, budgeted, unbounded, budgets, colors, smoothing_window(runs), subtitle,
                                   Path(out_dir) / NLL_PLOT))
    return written


def _plot_positions(plt, budgeted: dict[str, list[dict]], unbounded: dict[str, list[dict]], budgets: list[int],
                    colors: dict[str, str], window: int, subtitle: str, path: Path) -> Path:
    """One column per cache budget (wrapping after 3), each with two panels sharing the position axis.

    Top: the running mean NLL of all tokens so far (it ends at log perplexity, so the order at the
    right edge is the table's). Bottom: the mean over a trailing window, which shows where in the
    stream a method loses or gains (TreeKV Figure 4 plots NLL against the stream position).
    """
    panels = budgets or [None]
    cols = min(len(panels), 3)
    groups = math.ceil(len(panels) / cols)
    width = max(5.2 * cols, 8.0)  # one budget alone still leaves room for the subtitle
    fig, axes = plt.subplots(2 * groups, cols, figsize=(width, 3.4 * 2 * groups), sharex=True, sharey="row",
                             squeeze=False)
    for index, budget in enumerate(panels):
        top, bottom = axes[2 * (index // cols), index % cols], axes[2 * (index // cols) + 1, index % cols]
        lines = [(label, run, {"color": colors[label], "linewidth": 1.4})
                 for label, group in budgeted.items() for run in group if run["cache"] == budget]
        lines += [(f"{label} (uncompressed)", group[0], {"color": "black", "linestyle": "--", "linewidth": 1.2})
                  for label, group in unbounded.items()]
        for label, run, style in lines:
            if not run.get("curve"):
                continue
            for ax, width in ((top, math.inf), (bottom, window)):
                xs, ys = zip(*smooth_curve(run["curve"], width), strict=True)
                ax.plot(xs, ys, label=label, **style)
        top.set_title("no budget" if budget is None else f"cache {budget:,} tokens/layer", fontsize=10)
        if index % cols == 0:
            top.set_ylabel("NLL (nats/token),\nmean of all tokens so far")
            bottom.set_ylabel(f"NLL (nats/token),\nmean of last {window:,} tokens")
        bottom.set_xlabel("position in the stream (tokens)")
        bottom.xaxis.set_tick_params(labelbottom=True)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if not ax.lines:
            ax.set_visible(False)
    handles: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    axes[0, 0].legend(handles.values(), handles.keys(), fontsize=8)
    fig.suptitle(f"NLL along the stream\n{subtitle}", fontsize=11)
    return save_figure(fig, path)
