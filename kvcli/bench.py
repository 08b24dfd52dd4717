"""``kvcli bench``: every method at every cache budget over one token stream, saved as it goes.

A grid scores the same tokens many times, so the source is tokenized once and held as ids (all its
documents as one stream, like ``kvcli ppl --stream``). Every finished run is written to
``results.json`` at once, atomically, so an interrupted grid loses at most the run in progress, and a
rerun into the same folder skips the runs it already has. The plots are drawn from everything in
``results.json``, so runs from earlier invocations appear next to new ones.
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvcli import __version__
from kvcli.engine import BlockStats, Engine, StreamTotals
from kvcli.errors import KvcliError, UsageError
from kvcli.methods import METHODS, Method, make_method
from kvcli.models import LoadedModel
from kvcli.perplexity import PerplexityRun
from kvcli.plots import pyplot, save_figure
from kvcli.report import clean_json, dumps, peak_memory_bytes, reset_peak_memory
from kvcli.text import Document, first_tokens

RESULTS_FILE = "results.json"
PPL_PLOT = "ppl_vs_cache.png"
NLL_PLOT = "nll_vs_position.png"
DEFAULT_MAX_TOKENS = 8192
# What makes two runs the same measurement: a rerun skips a planned run whose values of these match.
SETTING_FIELDS = ("model", "source", "tokens", "block", "dtype", "device")
KEY_FIELDS = (*SETTING_FIELDS, "method", "cache", "params")
# The trailing window of the position plot: about this fraction of the stream, in whole blocks (at least one).
SMOOTHING_FRACTION = 16


@dataclass
class TokenStream:
    """The token ids every run of a grid scores, and the UTF-8 bytes they stand for (for bits per byte)."""

    ids: torch.Tensor  # int64 [n]; the first token is context only, the other n-1 are scored
    num_bytes: int
    source: str  # what the results record as the source: an absolute path, "-" or "pg19"

    @property
    def tokens(self) -> int:
        return self.ids.shape[0] - 1


def source_name(source: str) -> str:
    """A source as results record it: paths made absolute, so a rerun from another folder still matches."""
    if source not in ("-", "") and Path(source).exists():
        return str(Path(source).resolve())
    return source


def read_token_stream(documents: Iterable[Document], tokenizer, source: str,
                      max_tokens: int | None = DEFAULT_MAX_TOKENS) -> TokenStream:
    """The first ``max_tokens`` scored tokens of ``documents`` as one stream (plus the unscored first token)."""
    ids, num_bytes = first_tokens(documents, tokenizer, None if max_tokens is None else max_tokens + 1)
    if len(ids) < 2:
        raise KvcliError(f"{source}: fewer than two tokens, nothing to score")
    return TokenStream(torch.tensor(ids, dtype=torch.long), num_bytes, source_name(source))


@dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: a method, its ``-o`` options and a budget (None for ``full``)."""

    method: str
    cache: int | None
    options: tuple[tuple[str, str], ...] = ()

    def build(self) -> Method:
        method = make_method(self.method, dict(self.options))
        if self.cache is not None:
            method.validate(self.cache)
        return method

    @property
    def label(self) -> str:
        return self.method if self.cache is None else f"{self.method} · cache {self.cache:,}"


def plan_grid(methods: Sequence[str], budgets: Sequence[int],
              options: dict[str, dict[str, str]] | None = None) -> list[RunSpec]:
    """Every method at every budget, in the order given; ``full`` once, unbounded.

    Everything is validated here (names, budgets, options, budgets a method cannot hold), so that a
    typo fails in a second rather than after the model has loaded and half the grid has run.
    """
    if not methods:
        raise UsageError("--methods is empty")
    for name in methods:
        if name not in METHODS:
            raise UsageError(f"unknown method {name!r}; choose from: {', '.join(sorted(METHODS))}")
    for budget in budgets:
        if budget < 1:
            raise UsageError(f"--cache must be positive numbers of tokens, not {budget}")
    if not budgets and any(name != "full" for name in methods):
        raise UsageError("--cache is empty")
    specs = []
    for name in dict.fromkeys(methods):
        opts = tuple(sorted((options or {}).get(name, {}).items()))
        cells = [None] if name == "full" else list(dict.fromkeys(budgets))
        for budget in cells:
            spec = RunSpec(name, budget, opts)
            spec.build()
            specs.append(spec)
    return specs


# --- results.json -------------------------------------------------------------------------------

def run_key(run: dict) -> str:
    """The identity of a measurement: equal keys mean a rerun would measure the same thing again."""
    return json.dumps([run.get(name) for name in KEY_FIELDS], sort_keys=True)


def load_results(out_dir: Path) -> dict:
    """``out_dir/results.json``, or an empty result set; a file that is not one is an error, never overwritten."""
    path = Path(out_dir) / RESULTS_FILE
    if not path.exists():
        return {"runs": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvcliError(f"{path} is not a kvcli bench results file ({exc}); choose another --out") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise KvcliError(f"{path} is not a kvcli bench results file (no list of runs); choose another --out")
    return data


def save_results(out_dir: Path, results: dict) -> Path:
    """Write ``results.json`` through a temporary file and ``os.replace``: Ctrl-C or a crash mid-write
    leaves the previous complete file, never half of one.

    One line per run (curves included) keeps the file greppable and diffable without indenting every
    number of a curve onto its own line.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    fields = [f"{json.dumps(key)}: {dumps(value)}" for key, value in results.items() if key != "runs"]
    runs = ",\n".join(f"  {dumps(run)}" for run in results.get("runs", []))
    fields.append(f'"runs": [\n{runs}\n]')
    tmp = path.with_name(f".{RESULTS_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text("{\n" + ",\n".join(fields) + "\n}\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def check_out_dir(out_dir: Path) -> dict:
    """Fail before loading a model if ``out_dir`` cannot be written or holds something else; return its results."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvcliError(f"cannot create --out {out_dir}: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK):
        raise KvcliError(f"cannot write to --out {out_dir}")
    return load_results(out_dir)


# --- running ------------------------------------------------------------------------------------

@dataclass
class GridResult:
    """The grid's runs in grid order (earlier ones reused, new ones measured), and the whole result set."""

    runs: list[dict]
    results: dict
    settings: dict  # this grid's model, source, tokens, bytes, block, dtype, device
    skipped: int
    measured: int
    interrupted: bool


def measure(loaded: LoadedModel, stream: TokenStream, spec: RunSpec, block: int, *,
            on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
            warn: Callable[[str], None] | None = None) -> tuple[StreamTotals, int]:
    """Score the stream once with ``spec``; return the totals and the peak memory of this run alone.

    The peak is reset first (CUDA's max allocated; on Linux CPUs the resident-set high-water mark via
    ``/proc/self/clear_refs``), so it is each run's own. On CPU it is still the whole process: model
    weights and whatever the allocator kept from earlier runs included.
    """
    engine = Engine(loaded.model, spec.build(), spec.cache, block=block, warn=warn)
    gc.collect()
    reset_peak_memory(loaded.device)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    totals = engine.score([stream.ids], on_block=on_block)
    totals.num_bytes = stream.num_bytes
    return totals, peak_memory_bytes(loaded.device)


def run_record(loaded: LoadedModel, stream: TokenStream, spec: RunSpec, block: int, totals: StreamTotals,
               peak: int) -> dict:
    """One run as ``results.json`` stores it: ``kvcli ppl --stream --json``'s keys plus source, curve, time."""
    params = spec.build().settings()
    record = PerplexityRun(loaded, spec.method, params, spec.cache, block, "stream", totals, [], peak).as_dict()
    record.pop("interrupted")
    record["source"] = stream.source
    record["curve"] = [[stats.position, round(stats.nll, 5) if math.isfinite(stats.nll) else None]
                       for stats in totals.blocks]
    record["finished"] = now()
    return record


def settings(loaded: LoadedModel, stream: TokenStream, block: int) -> dict:
    """The fields of :data:`SETTING_FIELDS` for this model, stream and block."""
    return {"model": loaded.name, "source": stream.source, "tokens": stream.tokens, "block": block,
            "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device)}


def run_grid(
    loaded: LoadedModel,
    stream: TokenStream,
    specs: Sequence[RunSpec],
    *,
    block: int,
    out_dir: Path,
    warm_up: bool = True,
    on_skip: Callable[[list[dict]], None] | None = None,
    on_start: Callable[[RunSpec, int, int], None] | None = None,
    on_run: Callable[[dict, int, int], None] | None = None,
    on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> GridResult:
    """Run every spec not already in ``out_dir/results.json``, saving after each one.

    Runs are matched on :data:`KEY_FIELDS`; runs in the file that match nothing planned (another
    model, source or length) are kept as they are. ``warm_up`` first scores two blocks untimed, so
    that the first run's tokens/s does not pay for thread pools and kernel selection. Ctrl-C stops
    the grid: the run in progress is dropped, every finished one is already on disk.
    """
    out_dir = Path(out_dir)
    results = load_results(out_dir)
    common = settings(loaded, stream, block)
    head = metadata(common, stream)
    finished = {run_key(run): run for run in results["runs"]}
    keys = [run_key({**common, "method": spec.method, "cache": spec.cache,
                     "params": spec.build().settings()}) for spec in specs]
    skipped = [finished[key] for key in keys if key in finished]
    pending = [spec for spec, key in zip(specs, keys, strict=True) if key not in finished]
    if skipped and on_skip:
        on_skip(skipped)
    interrupted = False
    measured = 0
    try:
        if pending and warm_up:
            warm = Engine(loaded.model, pending[0].build(), pending[0].cache, block=block, warn=lambda message: None)
            interrupted = warm.score([stream.ids[: 2 * block + 1]]).interrupted
        for index, spec in enumerate(pending):
            if interrupted:
                break
            if on_start:
                on_start(spec, index, len(pending))
            totals, peak = measure(loaded, stream, spec, block, on_block=on_block, warn=warn)
            if totals.interrupted:
                interrupted = True
                break
            record = run_record(loaded, stream, spec, block, totals, peak)
            key = run_key(record)
            results.update(head, updated=now())
            results["runs"] = [run for run in results["runs"] if run_key(run) != key] + [record]
            save_results(out_dir, results)
            finished[key] = record
            measured += 1
            if on_run:
                on_run(record, index, len(pending))
    except KeyboardInterrupt:
        interrupted = True
    runs = [finished[key] for key in keys if key in finished]
    return GridResult(runs, results, head, len(skipped), measured, interrupted)


def metadata(common: dict, stream: TokenStream) -> dict:
    """The top-level fields of ``results.json``: the settings of the latest invocation that measured a run."""
    return {"kvcli": __version__, **common, "bytes": stream.num_bytes}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- plots --------------------------------------------------------------------------------------

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
                 *(f"{k}={run['params'].get(k)}" for k in varying_params[run["method"]])]
        lines.setdefault(" · ".join(parts), []).append(run)
    common = [_short(f, runs[0].get(f)) for f in ("model", "tokens", "source", "block") if f not in varying]
    return lines, common


def _colors(labels: Iterable[str]) -> dict[str, str]:
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan", "tab:gray"]
    return {label: palette[i % len(palette)] for i, label in enumerate(sorted(labels))}


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw ``ppl_vs_cache.png`` and ``nll_vs_position.png`` from every run in ``results``; return the files.

    Needs matplotlib (:func:`kvcli.plots.pyplot` raises :class:`KvcliError` without it).
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
    caches = sorted({run["cache"] for group in budgeted.values() for run in group})
    if caches:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for label, group in budgeted.items():
            ax.plot([run["cache"] for run in group], [run["ppl"] for run in group], marker="o", label=label,
                    color=colors[label])
        for label, group in unbounded.items():
            ax.axhline(group[0]["ppl"], linestyle="--", color="black", linewidth=1.2,
                       label=f"{label} (uncompressed): {group[0]['ppl']:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(caches, [f"{cache:,}" for cache in caches])
        ax.minorticks_off()
        if len(caches) == 1:
            ax.set_xlim(caches[0] / 2, caches[0] * 2)
        ax.set_xlabel("KV cache budget (tokens per layer, log₂ scale)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title(f"Perplexity vs KV cache size\n{subtitle}", fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
        written.append(save_figure(fig, Path(out_dir) / PPL_PLOT))

    written.append(_plot_positions(plt, budgeted, unbounded, caches, colors, smoothing_window(runs), subtitle,
                                   Path(out_dir) / NLL_PLOT))
    return written


def _plot_positions(plt, budgeted: dict[str, list[dict]], unbounded: dict[str, list[dict]], caches: list[int],
                    colors: dict[str, str], window: int, subtitle: str, path: Path) -> Path:
    """One column per cache budget (wrapping after 3), each with two panels sharing the position axis.

    Top: the running mean NLL of all tokens so far (it ends at log perplexity, so the order at the
    right edge is the table's). Bottom: the mean over a trailing window, which shows where in the
    stream a method loses or gains (TreeKV Figure 4 plots NLL against the stream position).
    """
    panels = caches or [None]
    cols = min(len(panels), 3)
    groups = math.ceil(len(panels) / cols)
    width = max(5.2 * cols, 8.0)  # one budget alone still leaves room for the subtitle
    fig, axes = plt.subplots(2 * groups, cols, figsize=(width, 3.4 * 2 * groups), sharex=True, sharey="row",
                             squeeze=False)
    for index, cache in enumerate(panels):
        top, bottom = axes[2 * (index // cols), index % cols], axes[2 * (index // cols) + 1, index % cols]
        lines = [(label, run, {"color": colors[label], "linewidth": 1.4})
                 for label, group in budgeted.items() for run in group if run["cache"] == cache]
        lines += [(f"{label} (uncompressed)", group[0], {"color": "black", "linestyle": "--", "linewidth": 1.2})
                  for label, group in unbounded.items()]
        for label, run, style in lines:
            if not run.get("curve"):
                continue
            for ax, width in ((top, math.inf), (bottom, window)):
                xs, ys = zip(*smooth_curve(run["curve"], width), strict=True)
                ax.plot(xs, ys, label=label, **style)
        top.set_title("no budget" if cache is None else f"cache {cache:,} tokens/layer", fontsize=10)
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


def bench_json(grid: GridResult, out_dir: Path, plots: list[Path]) -> dict:
    """The ``--json`` object: this grid's runs, where the results are, and whether it was interrupted."""
    return clean_json({**grid.settings, "results": str(Path(out_dir) / RESULTS_FILE), "plots": [str(p) for p in plots],
                       "skipped": grid.skipped, "measured": grid.measured, "interrupted": grid.interrupted,
                       "runs": grid.runs})
