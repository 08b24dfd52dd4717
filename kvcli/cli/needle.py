"""``kvcli needle``: the pass-key test as a grid of methods x lengths x depths (:mod:`kvcli.eval.needle`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvcli.cli.options import (
    CacheOpt,
    KvBitsOpt,
    MethodsOptionOpt,
    ReadBlockOpt,
    ResumeTrialsOpt,
    Setup,
    TrialRowsOpt,
    check_at_least,
    check_cache,
    check_seed,
    method_options,
    parse_kv_bits,
    parse_read_block,
    split_list,
    with_setup,
)
from kvcli.cli.reading import AnswerPrefixOpt, MaxNewOpt, OneShotOpt, ProbeOpt, RecapOpt, SeedOpt, check_recap
from kvcli.errors import UsageError
from kvcli.reading.recap import RECAP_TOKENS

if TYPE_CHECKING:  # the command's module is imported by --help: torch is imported where it is used
    from kvcli.eval.needle import NeedleResult
    from kvcli.models.load import LoadedModel


def _depth(item: str) -> float:
    return float(item.rstrip("%")) / (100 if item.endswith("%") else 1)


def _length(item: str) -> int:
    item = item.lower()
    return int(float(item[:-1]) * 1000) if item.endswith("k") else int(item)


@dataclass(frozen=True)
class NeedleGrid:
    """The grid :class:`NeedleOptions` asks for, parsed: what :func:`kvcli.eval.needle.run_grid` runs."""

    methods: list[str]
    lengths: list[int]
    depths: list[float]
    trials: int
    block: int
    kv_bits: int
    options: dict[str, dict]  # each method's -o parameters


@dataclass(frozen=True)
class NeedleOptions:
    """``kvcli needle``'s own options, as the user gave them."""

    source: str
    methods: str
    lengths: str
    depths: str
    trials: int | None
    cache: int
    kv_bits: str
    block: str
    option: list[str] | None
    seed: int
    max_new_tokens: int
    one_shot: bool | None
    probe: bool
    answer_prefix: str
    recap: int
    fixed: bool
    json_out: bool
    out: Path
    plots: bool
    rows: Path | None
    resume: bool

    def validate(self) -> NeedleGrid:
        """Every option checked and parsed, reading no file and loading no model, so that a mistake costs no wait;
        the first one wrong is a :class:`UsageError`."""
        from kvcli.eval.needle import DEFAULT_TRIALS
        from kvcli.methods import METHODS

        methods = split_list(self.methods, str, "--methods")
        for name in methods:
            if name not in METHODS:
                raise UsageError(f"unknown method {name!r}; choose from: {', '.join(sorted(METHODS))}")
        lengths = split_list(self.lengths, _length, "--lengths")
        depths = split_list(self.depths, _depth, "--depths")
        trials = DEFAULT_TRIALS if self.trials is None else self.trials  # the library's, imported only when run
        check_at_least(1, trials=trials, max_new_tokens=self.max_new_tokens)
        check_recap(self.recap)
        block = parse_read_block(self.block)
        bits = parse_kv_bits(self.kv_bits)
        check_cache(self.cache)
        check_seed(self.seed)
        options = method_options(methods, self.option)
        if self.resume and self.rows is None:
            raise UsageError("--resume needs --rows FILE: the trials written there are taken, the rest are run")
        return NeedleGrid(methods, lengths, depths, trials, block, bits, options)


@with_setup
def needle(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A book (text file, folder or -) to cut the haystacks from.")],
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods to compare.")] = "full,snapkv",
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated haystack lengths in tokens "
                                         "(6000 or 6k).")] = "6000",
    depths: Annotated[str, typer.Option("--depths", help="Comma-separated depths of the needle (0.1 or "
                                        "10%).")] = "0.1,0.3,0.5,0.7,0.9",
    trials: Annotated[int | None, typer.Option("--trials", help="Haystacks per length and depth (each with its "
                                               "own excerpt and key); default 4: 20 per method and length over "
                                               "the 5 default depths.", show_default=False)] = None,
    cache: CacheOpt = 1024,
    kv_bits: KvBitsOpt = "16",
    block: ReadBlockOpt = "auto",
    option: MethodsOptionOpt = None,
    seed: SeedOpt = 0,
    max_new_tokens: MaxNewOpt = 32,  # kvcli.eval.needle.ANSWER_TOKENS (that module imports torch)
    one_shot: OneShotOpt = None,
    probe: ProbeOpt = True,
    answer_prefix: AnswerPrefixOpt = "",
    recap: RecapOpt = RECAP_TOKENS,
    fixed: Annotated[bool, typer.Option("--fixed", help="One needle sentence, one question and five-digit keys at "
                                        "sentence breaks in every trial (the harness of earlier results); by "
                                        "default each trial draws its needle, wording and key length, and the "
                                        "needle goes in at any word boundary.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object: every trial and the accuracy "
                                           "tables.")] = False,
    out: Annotated[Path, typer.Option("--out", help="Folder for needle.png, the accuracy per method as a map "
                                      "of length x depth; a plot already there is kept and the new one is "
                                      "needle-2.png (then -3, ...).")] = Path("needle"),
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw needle.png in --out.")] = True,
    rows: TrialRowsOpt = None,
    resume: ResumeTrialsOpt = False,
    *,
    setup: Setup,
) -> None:
    """Pass-key retrieval as a grid: methods x lengths x depths, accuracy on stdout, a map in --out.

    Every trial is `kvcli ask HAYSTACK QUESTION` as a user types it (no answer prefix unless
    --answer-prefix gives one), with the needle, the question's wording and the key's length drawn
    per trial (--fixed for one of each).
    """
    opts = NeedleOptions(
        source=source, methods=methods, lengths=lengths, depths=depths, trials=trials, cache=cache, kv_bits=kv_bits,
        block=block, option=option, seed=seed, max_new_tokens=max_new_tokens, one_shot=one_shot, probe=probe,
        answer_prefix=answer_prefix, recap=recap, fixed=fixed, json_out=json_out, out=out, plots=plots, rows=rows,
        resume=resume)
    grid = opts.validate()
    claim_outputs(ctx, opts, setup)
    documents = setup.documents(source)
    loaded = setup.load()
    result = run(opts, grid, setup, loaded, documents)
    render(opts, result, loaded.name, setup)


def claim_outputs(ctx: typer.Context, opts: NeedleOptions, setup: Setup) -> None:
    """Before the model loads: ``--out`` (when plotting) and ``--rows`` apart from the inputs and writable, the
    rows file held by this run until the command ends (one run per rows file)."""
    from kvcli.io.outputs import check_output

    setup.check_outputs({"--out": opts.out if opts.plots else None, "--rows": opts.rows}, opts.source,
                        folders=("--out",))
    if opts.plots:
        check_output(opts.out, "--out", folder=True)  # before the grid, not after it
    if opts.rows is not None:
        from kvcli.io.paths import hold_file

        check_output(opts.rows, "--rows")
        ctx.with_resource(hold_file(opts.rows, "--rows"))


def run(opts: NeedleOptions, grid: NeedleGrid, setup: Setup, loaded: LoadedModel, documents: list) -> NeedleResult:
    """Every trial of the grid, each one a line on stderr as it ends and a row of ``--rows``; a Ctrl-C says where
    the trials written are and how to run the rest."""
    from kvcli.eval.needle import TrialLog, book_tokens, run_grid

    tokens = book_tokens(documents, loaded.tokenizer, max(grid.lengths) * grid.trials)

    def on_trial(trial, done, total) -> None:
        mark = "ok" if trial.correct else "miss"
        setup.note(f"[{done}/{total}] {trial.method} length {trial.length:,} depth {trial.depth:.0%}: "
                   f"{trial.answer!r} ({mark}, key {trial.key}, {trial.seconds:.1f} s)")

    log = (TrialLog(opts.rows, opts.resume, about={"model": loaded.name}, note=setup.note) if opts.rows is not None
           else None)
    try:
        return run_grid(loaded.model, loaded.tokenizer, tokens, grid.methods, lengths=grid.lengths,
                        depths=grid.depths, trials=grid.trials, budget=opts.cache, block=grid.block, seed=opts.seed,
                        max_new_tokens=opts.max_new_tokens, one_shot=opts.one_shot, probe=opts.probe,
                        options=grid.options, answer_prefix=opts.answer_prefix, fixed=opts.fixed, warn=setup.say,
                        on_trial=on_trial, kv_bits=grid.kv_bits, recap=opts.recap, log=log)
    except KeyboardInterrupt:
        if log is not None:
            setup.note(f"{log.written} new trials are in {opts.rows}; the same command with --resume runs the rest")
        raise


def render(opts: NeedleOptions, result: NeedleResult, model: str, setup: Setup) -> None:
    """The accuracy tables (or, with ``--json``, every trial too) on stdout, then the map in ``--out``."""
    from kvcli.cli.render import needle_tables
    from kvcli.io.report import dumps, print_result

    if opts.json_out:
        print_result(dumps({"model": model, **result.as_dict()}))
    else:
        print_result(needle_tables(result, model))
    if opts.plots and result.trials:
        _plot(result, opts.out, model, setup)


def _plot(result: NeedleResult, out: Path, model: str, setup: Setup) -> None:
    """needle.png from the result, or the first free needle-N.png beside an earlier run's; an install missing
    matplotlib (a dependency) gets one warning, no PNG."""
    from kvcli.eval.needle_plot import NEEDLE_PLOT, claim_unused, plot_needle
    from kvcli.io.outputs import remove_partial
    from kvcli.io.plots import MISSING, have_matplotlib

    if not have_matplotlib():
        setup.say(f"{MISSING}: no {NEEDLE_PLOT}")
        return
    path = claim_unused(out / NEEDLE_PLOT)
    try:
        setup.note(f"wrote {plot_needle(result.as_dict(), path, model)}")
    except BaseException:
        remove_partial(path)  # the name this run claimed, empty or half-written
        raise
