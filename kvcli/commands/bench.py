"""``kvcli bench``: methods x cache budgets over one token stream, a table on stdout, results.json and plots.

The command is thin: :mod:`kvcli.bench` plans, runs, saves and plots. The table is the result (stdout);
progress, skipped runs and the paths written go to stderr.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from kvcli.cli import (
    BlockOpt,
    DataDirOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    EightBitOpt,
    EncodingOpt,
    FourBitOpt,
    ModelOpt,
    QuietOpt,
    app,
    load,
    method_options,
    split_list,
)
from kvcli.errors import UsageError


@app.command()
def bench(
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files, - for stdin, or pg19; all "
                                          "documents are read as one stream.")],
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods to compare (see `kvcli "
                                         "methods`); full runs once, without a budget.")] = "full,streamingllm,treekv",
    cache: Annotated[str, typer.Option("--cache", "-c", help="Comma-separated KV budgets in tokens per layer; "
                                       "every method but full runs at each.")] = "256,512,1024",
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Score the first N tokens of SOURCE (fewer "
                                            "if it is shorter).")] = 8192,
    out: Annotated[Path, typer.Option("--out", help="Folder for results.json and the plots; a rerun into the "
                                      "same folder skips the runs it already has.")] = Path("bench"),
    block: BlockOpt = 256,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Method parameter KEY=VALUE for every "
                                                     "listed method that has it, or METHOD.KEY=VALUE for one "
                                                     "(repeatable).")] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Draw ppl_vs_cache.png and nll_vs_position.png "
                                       "(needs matplotlib).")] = True,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as Markdown (for docs).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object {runs: [...], ...} instead of "
                                           "the table.")] = False,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    encoding: EncodingOpt = None,
    data_dir: DataDirOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Perplexity, speed and memory of several methods at several cache sizes on the same tokens."""
    from kvcli.bench import bench_json, check_out_dir, plan_grid, read_token_stream, run_grid
    from kvcli.report import StreamProgress, dumps, print_result, stderr_console, warn
    from kvcli.text import open_source

    method_list = split_list(methods, str, "--methods")
    budgets = split_list(cache, int, "--cache")
    if block < 1:
        raise UsageError(f"--block must be at least 1, not {block}")
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, not {max_tokens}")
    specs = plan_grid(method_list, budgets, method_options(list(dict.fromkeys(method_list)), option))
    say = (lambda message: None) if quiet else warn

    def note(message: str) -> None:
        if not quiet:
            stderr_console.print(message, markup=False, highlight=False)

    check_out_dir(out)
    documents = open_source(source, encoding=encoding, data_dir=data_dir, warn=say)
    loaded = load(model, device, dtype, device_map, load_in_4bit, load_in_8bit)
    stream = read_token_stream(documents, loaded.tokenizer, source, max_tokens)
    progress = StreamProgress(stream.tokens + 1, loaded.device, enabled=not quiet)

    def on_start(spec, index: int, total: int) -> None:
        if not progress.enabled:  # a terminal shows the run on the progress line instead
            note(f"[{index + 1}/{total}] {spec.label} ...")
        progress.update(0, 0.0, float("nan"), 0, label=spec.label)

    def on_block(stats, totals) -> None:
        ppl_now = math.exp(totals.nll_sum / totals.tokens) if totals.tokens else float("nan")
        progress.update(totals.processed, stats.tokens_per_second, ppl_now, stats.cache_tokens)

    def on_run(run: dict, index: int, total: int) -> None:
        note(f"[{index + 1}/{total}] {_label(run)}: ppl {run['ppl']:.3f} · {run['tokens_per_second']:,.0f} "
             f"tokens/s · {run['seconds']:.1f} s")

    with progress.running():
        grid = run_grid(loaded, stream, specs, block=block, out_dir=out, on_block=on_block, warn=say,
                        on_skip=lambda runs: note(f"skipping {len(runs)} finished run{'s' * (len(runs) != 1)} "
                                                  f"already in {out}"),
                        on_start=on_start, on_run=on_run)
    if json_out:
        plots = _plots(grid, out, plot, say, note)
        print_result(dumps(bench_json(grid, out, plots)))
    else:
        print_result(bench_table(grid.runs, grid.settings, grid.interrupted, markdown))
        _plots(grid, out, plot, say, note)
    if grid.interrupted:
        note(f"interrupted: {len(grid.runs)} of {len(specs)} runs are in {out}; run the same command to go on")
        raise typer.Exit(130)


def _plots(grid, out: Path, plot: bool, say, note) -> list[Path]:
    """Plots of every run in results.json; without matplotlib, one warning and no pictures."""
    from kvcli.bench import plot_results
    from kvcli.plots import have_matplotlib

    if not plot or not grid.results["runs"]:
        return []
    if not have_matplotlib():
        say("plots need matplotlib (pip install 'kvcli[plot]'): results.json written, no PNGs")
        return []
    paths = plot_results(grid.results, out)
    for path in paths:
        note(f"wrote {path}")
    return paths


def _label(run: dict) -> str:
    return run["method"] if run["cache"] is None else f"{run['method']} · cache {run['cache']:,}"


def bench_table(runs: list[dict], settings: dict, interrupted: bool = False, markdown: bool = False) -> str:
    """The grid's runs as a Rich table rendered to plain text (what the text mode prints on stdout);
    ``markdown`` draws it as a Markdown table under its caption, ready to paste into docs."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from kvcli.report import mib

    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False, color_system=None, highlight=False)
    full = next((run for run in runs if run["cache"] is None), None)
    source = Path(settings["source"]).name or settings["source"]
    uncompressed = runs[0]["full_kv_cache_bytes"] if runs else 0
    title = "kvcli bench" + (" (interrupted: finished runs only)" if interrupted else "")
    caption = (f"{settings['model']} · {settings['tokens']:,} tokens of {source} · block {settings['block']} · "
               f"{settings['device']} ({settings['dtype']}) · uncompressed KV cache {mib(uncompressed)}")
    if markdown:
        table = Table(box=box.MARKDOWN)
        console.print(caption + "\n", soft_wrap=True)
    else:
        table = Table(title=title, caption=caption)
    table.add_column("method")
    table.add_column("cache", justify="right")
    table.add_column("perplexity", justify="right")
    if full is not None:
        table.add_column("vs full", justify="right")
    table.add_column("bits/byte", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_column("KV cache", justify="right")
    table.add_column("peak memory", justify="right")
    for run in runs:
        cells = [run["method"], "-" if run["cache"] is None else f"{run['cache']:,}", f"{run['ppl']:.3f}"]
        if full is not None:
            cells.append("-" if run is full else f"{run['ppl'] / full['ppl'] - 1:+.1%}")
        share = run["kv_cache_bytes"] / run["full_kv_cache_bytes"] if run["full_kv_cache_bytes"] else float("nan")
        cells += [f"{run['bits_per_byte']:.4f}", f"{run['tokens_per_second']:,.0f}",
                  f"{mib(run['kv_cache_bytes'])} ({share:.0%})", mib(run["peak_memory_bytes"])]
        table.add_row(*cells)
    if not runs:
        console.print("no run finished")
    else:
        console.print(table)
    text = buffer.getvalue()
    if not markdown:
        return text
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return "\n".join(line for i, line in enumerate(lines) if line or lines[i - 1]).rstrip() + "\n"  # one blank at most
