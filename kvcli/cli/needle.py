"""``kvcli needle``: the pass-key test as a grid of methods x lengths x depths (:mod:`kvcli.eval.needle`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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


def _depth(item: str) -> float:
    return float(item.rstrip("%")) / (100 if item.endswith("%") else 1)


def _length(item: str) -> int:
    item = item.lower()
    return int(float(item[:-1]) * 1000) if item.endswith("k") else int(item)


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
    from kvcli.cli.render import needle_tables
    from kvcli.eval.needle import DEFAULT_TRIALS, TrialLog, book_tokens, run_grid
    from kvcli.io.outputs import check_output
    from kvcli.io.report import dumps, print_result
    from kvcli.methods import METHODS

    method_list = split_list(methods, str, "--methods")
    for name in method_list:
        if name not in METHODS:
            raise UsageError(f"unknown method {name!r}; choose from: {', '.join(sorted(METHODS))}")
    length_list = split_list(lengths, _length, "--lengths")
    depth_list = split_list(depths, _depth, "--depths")
    trials = DEFAULT_TRIALS if trials is None else trials  # the library's default, imported only when run
    check_at_least(1, trials=trials, max_new_tokens=max_new_tokens)
    check_recap(recap)
    block_size = parse_read_block(block)
    bits = parse_kv_bits(kv_bits)
    check_cache(cache)
    check_seed(seed)
    per_method = method_options(method_list, option)
    if resume and rows is None:
        raise UsageError("--resume needs --rows FILE: the trials written there are taken, the rest are run")
    setup.check_outputs({"--out": out if plots else None, "--rows": rows}, source, folders=("--out",))
    if plots:
        check_output(out, "--out", folder=True)  # before the grid, not after it
    if rows is not None:
        from kvcli.io.paths import hold_file

        check_output(rows, "--rows")  # before the model loads
        ctx.with_resource(hold_file(rows, "--rows"))  # one run per rows file, until the command ends
    documents = setup.documents(source)
    loaded = setup.load()
    tokens = book_tokens(documents, loaded.tokenizer, max(length_list) * trials)

    def on_trial(trial, done, total) -> None:
        mark = "ok" if trial.correct else "miss"
        setup.note(f"[{done}/{total}] {trial.method} length {trial.length:,} depth {trial.depth:.0%}: "
                   f"{trial.answer!r} ({mark}, key {trial.key}, {trial.seconds:.1f} s)")

    log = TrialLog(rows, resume, about={"model": loaded.name}, note=setup.note) if rows is not None else None
    try:
        result = run_grid(loaded.model, loaded.tokenizer, tokens, method_list, lengths=length_list,
                          depths=depth_list, trials=trials, budget=cache, block=block_size, seed=seed,
                          max_new_tokens=max_new_tokens, one_shot=one_shot, probe=probe, options=per_method,
                          answer_prefix=answer_prefix, fixed=fixed, warn=setup.say, on_trial=on_trial, kv_bits=bits,
                          recap=recap, log=log)
    except KeyboardInterrupt:
        if log is not None:
            setup.note(f"{log.written} new trials are in {rows}; the same command with --resume runs the rest")
        raise
    if json_out:
        print_result(dumps({"model": loaded.name, **result.as_dict()}))
    else:
        print_result(needle_tables(result, loaded.name))
    if plots and result.trials:
        _plot(result, out, loaded.name, setup)


def _plot(result, out: Path, model: str, setup: Setup) -> None:
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
