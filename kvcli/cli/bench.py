"""``kvcli bench``: methods x cache budgets over one token stream, a table on stdout, results.json and plots.

:mod:`kvcli.eval.bench` plans, runs, saves and plots. The table is the result (stdout); progress, skipped
runs and the paths written go to stderr.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvcli.cli.options import (
    BlockOpt,
    DataDirOpt,
    MethodsOptionOpt,
    Setup,
    check_at_least,
    check_cache,
    method_options,
    parse_block,
    parse_kv_bits,
    resolve_block,
    split_list,
    with_setup,
)

if TYPE_CHECKING:  # the command's module is imported by --help: torch is imported where it is used
    from kvcli.models.load import LoadedModel


@dataclass(frozen=True)
class BenchOptions:
    """``kvcli bench``'s own options, as the user gave them."""

    source: str
    methods: str
    cache: str
    max_tokens: int
    out: Path
    kv_bits: str
    block: str
    option: list[str] | None
    plot: bool
    markdown: bool
    kl: bool
    json_out: bool
    data_dir: Path | None

    def validate(self) -> tuple[int | None, list]:
        """The block (None: the device's default) and the planned runs (:func:`kvcli.eval.bench.plan_grid`), every
        option checked first, reading no file and loading no model; the first one wrong is a :class:`UsageError`."""
        from kvcli.eval.bench import plan_grid

        method_list = split_list(self.methods, str, "--methods")
        budgets = split_list(self.cache, int, "--cache")
        for budget in budgets:
            check_cache(budget)
        check_at_least(1, max_tokens=self.max_tokens)
        block = parse_block(self.block)
        bits = [parse_kv_bits(item) for item in split_list(self.kv_bits, str, "--kv-bits")]
        return block, plan_grid(method_list, budgets, method_options(list(dict.fromkeys(method_list)), self.option),
                                bits)


@with_setup
def bench(
    ctx: typer.Context,
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
    kv_bits: Annotated[str, typer.Option("--kv-bits", help="Comma-separated bits per cached key and value element "
                                         "(16, 8, 4, 2): every run at each.")] = "16",
    block: BlockOpt = "auto",
    option: MethodsOptionOpt = None,
    plot: Annotated[bool, typer.Option("--plots/--no-plots", "--plot/--no-plot", help="Draw ppl_vs_cache.png and "
                                       "nll_vs_position.png beside results.json.")] = True,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as Markdown (for docs).")] = False,
    kl: Annotated[bool, typer.Option("--kl/--no-kl", help="Run full attention once as a reference and give "
                                     "every run its KL divergence from it (mean, 99th percentile, same top "
                                     "token); tokens/s include the comparison.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object {runs: [...], ...} instead of "
                                           "the table.")] = False,
    data_dir: DataDirOpt = None,
    *,
    setup: Setup,
) -> None:
    """Perplexity, speed and memory of several methods at several cache sizes on the same tokens."""
    from kvcli.eval.bench import check_out_dir, read_token_stream
    from kvcli.io.outputs import lock_folder

    opts = BenchOptions(source=source, methods=methods, cache=cache, max_tokens=max_tokens, out=out, kv_bits=kv_bits,
                        block=block, option=option, plot=plot, markdown=markdown, kl=kl, json_out=json_out,
                        data_dir=data_dir)
    block_size, specs = opts.validate()
    setup.check_outputs({"--out": out}, source, data_dir=data_dir, folders=("--out",))
    ctx.with_resource(lock_folder(out, "--out"))  # one run per folder: two would each keep only their own runs
    check_out_dir(out)
    documents = setup.documents(source, data_dir)
    loaded = setup.load()
    stream = read_token_stream(documents, loaded.tokenizer, source, max_tokens)
    grid = run(opts, specs, stream, resolve_block(block_size, loaded), loaded, setup)
    render(opts, grid, setup)
    if grid.interrupted:
        setup.note(f"interrupted: {len(grid.runs)} of {len(specs)} runs are in {out}; run the same command to go on")
        raise typer.Exit(130)


def run(opts: BenchOptions, specs: list, stream, block: int, loaded: LoadedModel, setup: Setup):
    """Every planned run over the token stream (those already in ``--out`` skipped), each one a line on stderr as it
    starts (unless a progress line shows it) and as it ends."""
    from kvcli.eval.bench import run_grid
    from kvcli.io.report import StreamProgress

    progress = StreamProgress(stream.tokens + 1, loaded.device, enabled=not setup.quiet)

    def on_start(spec, index: int, total: int) -> None:
        if not progress.enabled:  # a terminal shows the run on the progress line instead
            setup.note(f"[{index + 1}/{total}] {spec.label} ...")
        progress.update(0, 0.0, float("nan"), 0, label=spec.label)

    def on_block(stats, totals) -> None:
        progress.update(totals.processed, stats.tokens_per_second, totals.ppl, stats.cache_tokens)

    def on_run(run: dict, index: int, total: int) -> None:
        label = run["method"] if run["cache"] is None else f"{run['method']} · cache {run['cache']:,}"
        label += f" · {run['kv_bits']}-bit" if run.get("kv_bits", 16) != 16 else ""
        setup.note(f"[{index + 1}/{total}] {label}: ppl {run['ppl']:.3f} · {run['tokens_per_second']:,.0f} "
                   f"tokens/s · {run['seconds']:.1f} s")

    def on_skip(runs: list) -> None:
        setup.note(f"skipping {len(runs)} finished run{'s' * (len(runs) != 1)} already in {opts.out}")

    with progress.running():
        return run_grid(loaded, stream, specs, block=block, out_dir=opts.out, on_block=on_block, warn=setup.say,
                        on_skip=on_skip, on_start=on_start, on_run=on_run, kl=opts.kl,
                        on_reference=lambda: setup.note("KL reference: full attention, reference.kvlogits"))


def render(opts: BenchOptions, grid, setup: Setup) -> None:
    """The table (or, with ``--json``, one JSON object) on stdout and the plots in ``--out``."""
    from kvcli.cli.render import bench_table
    from kvcli.eval.bench import bench_json
    from kvcli.io.report import dumps, print_result

    if opts.json_out:
        print_result(dumps(bench_json(grid, opts.out, _plots(grid, opts.out, opts.plot, setup))))
    else:
        print_result(bench_table(grid.runs, grid.settings, grid.interrupted, opts.markdown))
        _plots(grid, opts.out, opts.plot, setup)


def _plots(grid, out: Path, plot: bool, setup: Setup) -> list[Path]:
    """Plots of every run in results.json; an install missing matplotlib (a dependency) gets one warning, no PNGs."""
    from kvcli.eval.bench import plot_results
    from kvcli.io.plots import MISSING, have_matplotlib

    if not plot or not grid.results["runs"]:
        return []
    if not have_matplotlib():
        setup.say(f"{MISSING}: results.json written, no PNGs")
        return []
    paths = plot_results(grid.results, out)
    for path in paths:
        setup.note(f"wrote {path}")
    return paths
