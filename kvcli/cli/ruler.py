"""``kvcli ruler``: RULER's synthetic tasks, every sample read as ``kvcli ask`` reads it (:mod:`kvcli.eval.ruler`)."""

from __future__ import annotations

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
    explicit,
    method_options,
    parse_kv_bits,
    parse_read_block,
    split_list,
    with_setup,
)
from kvcli.cli.reading import NoFrameOpt, OneShotOpt, ProbeOpt, RecapOpt, check_recall, check_recap
from kvcli.errors import UsageError
from kvcli.reading.recap import RECALL_TOKENS, RECAP_TOKENS

if TYPE_CHECKING:
    from kvcli.eval.ruler import Book

#: The tasks of kvcli.eval.ruler.TASKS, here so that --help and the checks need no torch.
TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


#: ``--plot``: where the figure of the scores goes.
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Also draw the scores as a PNG at this path: the average "
                                              "per method (95% interval) against the ratio with --ratios, else per "
                                              "task; one panel per length.", show_default=False)]


def ruler_ratios(text: str | None, cache_given: bool, one_shot: bool | None) -> list[float] | None:
    """``--ratios``: kvpress's compression ratios, each in (0, 1), instead of an explicit ``--cache``."""
    if text is None:
        return None
    if cache_given:
        raise UsageError("--ratios and --cache both set the budget: give one of them")
    from kvcli.eval.ruler import check_ratios

    ratios = split_list(text, float, "--ratios")
    check_ratios(ratios, one_shot)
    return ratios


def ruler_length(item: str) -> int:
    """A length in tokens: ``4096``, or ``4k`` read as RULER writes its lengths (4k = 4,096, 16k = 16,384)."""
    item = item.strip().lower()
    return int(float(item[:-1]) * 1024) if item.endswith("k") else int(item)


@with_setup
def ruler(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A book (text file, folder or -): the haystack of the essay tasks "
                                          "and the words of keys and of cwe.")],
    tasks: Annotated[str, typer.Option("--tasks", help="Comma-separated tasks (all: " + ",".join(TASK_NAMES)
                                       + ").")] = ",".join(TASK_NAMES),
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated lengths in the model's tokens, the "
                                         "prompt and the answer's room together (4096 or 4k).")] = "4096",
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods to compare.")
                       ] = "full,snapkv,pyramidkv",
    samples: Annotated[int, typer.Option("--samples", help="Samples per task and length (each method reads the "
                                         "same ones).")] = 5,
    cache: CacheOpt = 1024,
    ratios: Annotated[str | None, typer.Option("--ratios", help="Comma-separated compression ratios instead of "
                                               "--cache, as kvpress's compression_ratio: each trial keeps what "
                                               "kvpress keeps of its prompt (one-shot reads only; docs/ruler.md).",
                                               show_default=False)] = None,
    kv_bits: KvBitsOpt = "16",
    block: ReadBlockOpt = "auto",
    option: MethodsOptionOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of every sample's draws.")] = 0,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n", help="Cap on every task's answer "
                                                       "length (default: each task's own, docs/ruler.md).",
                                                       show_default=False)] = None,
    one_shot: OneShotOpt = None,
    probe: ProbeOpt = True,
    recap: RecapOpt = RECAP_TOKENS,
    no_frame: NoFrameOpt = False,
    read_once: Annotated[bool, typer.Option("--read-once", help="Read each sample without its question, as `kvcli "
                                            "read` does, then ask it from that read, as `kvcli ask BOOK.kvc` does "
                                            "(docs/ruler.md).")] = False,
    recall: Annotated[int, typer.Option("--recall", help="With --read-once: read again at most this many tokens of "
                                        "the pages the question points at before it (0 = off), as `kvcli ask "
                                        "BOOK.kvc --recall`.")] = RECALL_TOKENS,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object: every trial and the scores.")] = False,
    rows: TrialRowsOpt = None,
    resume: ResumeTrialsOpt = False,
    export: Annotated[Path | None, typer.Option("--export", help="Write the samples to this file, one JSON line "
                                                "each, as kvpress's pipeline takes them (context, question, answer "
                                                "prefix, expected values), and read none (docs/ruler.md).",
                                                show_default=False)] = None,
    plot: PlotOpt = None,
    *,
    setup: Setup,
) -> None:
    """RULER's synthetic tasks (needles, variable tracking, common and frequent words) at each length, per method.

    Every trial is `kvcli ask DOCUMENT QUESTION --answer-prefix PREFIX` with RULER's text, question and answer
    prefix; its score is the share of expected values the answer writes as whole words or numbers. Prints the
    mean score per task, length and method with a 95% interval, and the average over tasks.
    """
    from kvcli.methods import METHODS

    task_list = known(split_list(tasks, str, "--tasks"), TASK_NAMES, "task")
    method_list = known(split_list(methods, str, "--methods"), sorted(METHODS), "method")
    length_list = split_list(lengths, ruler_length, "--lengths")
    check_at_least(1, samples=samples, max_new_tokens=max_new_tokens)
    check_at_least(64, lengths=min(length_list))
    check_recap(recap)
    saved = saved_recall(ctx, read_once, recall)
    block_size = parse_read_block(block)
    bits = parse_kv_bits(kv_bits)
    check_cache(cache)
    ratio_list = ruler_ratios(ratios, explicit(ctx, "cache"), one_shot)
    per_method = method_options(method_list, option)
    check_ruler_outputs(rows, resume, plot, export, json_out)
    setup.check_outputs({"--rows": rows, "--plot": plot, "--export": export}, source)
    documents = setup.documents(source)
    if export is not None:
        _export(setup, documents, export, task_list, length_list, samples=samples, seed=seed,
                max_new_tokens=max_new_tokens)
        return
    _run(setup, documents, task_list, method_list, length_list, samples=samples, cache=cache, ratios=ratio_list,
         block=block_size, seed=seed, max_new_tokens=max_new_tokens, one_shot=one_shot, probe=probe,
         options=per_method, bits=bits, recap=recap, frame=not no_frame, saved=saved, json_out=json_out, rows=rows,
         resume=resume, plot=plot)


def check_ruler_outputs(rows: Path | None, resume: bool, plot: Path | None, export: Path | None,
                        json_out: bool) -> None:
    """``--rows``, ``--resume``, ``--plot`` and ``--export``, checked before the model loads."""
    from kvcli.io.outputs import check_output

    if resume and rows is None:
        raise UsageError("--resume needs --rows FILE: the trials written there are taken, the rest are run")
    for flag, path in (("--rows", rows), ("--plot", plot)):
        if path is not None:  # apart from the book and the model: setup.check_outputs
            check_output(path, flag)
    if export is not None:
        check_export(export, rows=rows, json_out=json_out)


def saved_recall(ctx: typer.Context, read_once: bool, recall: int) -> int | None:
    """The recall of a ``--read-once`` run (None without it). Such a read knows no question, so the options of a
    read with one (``--one-shot``, ``--probe``, ``--recap``) are refused, as ``--recall`` is without it."""
    if not read_once:
        if explicit(ctx, "recall"):
            raise UsageError("--recall goes with --read-once: a read that knows its question recalls nothing")
        return None
    given = [flag for name, flag in (("one_shot", "--one-shot"), ("probe", "--probe"), ("recap", "--recap"))
             if explicit(ctx, name)]
    if given:
        raise UsageError(f"--read-once reads without the question: {', '.join(given)} do not apply")
    check_recall(recall)
    return recall


def known(names: list[str], choices, what: str) -> list[str]:
    """``names``, each one of ``choices``; else a :class:`UsageError` naming the first that is not."""
    for name in names:
        if name not in choices:
            raise UsageError(f"unknown {what} {name!r}; choose from: {', '.join(choices)}")
    return names


def check_export(export: Path, *, rows: Path | None, json_out: bool) -> None:
    """``--export`` writes the samples and reads none, so the outputs of a run (``--rows``, ``--resume``,
    ``--json``) are refused; the reading settings (methods, cache, ratios, ...) change no sample and are ignored,
    so a run's command line with ``--export`` added exports that run's samples."""
    from kvcli.io.outputs import check_output

    if rows is not None or json_out:
        raise UsageError("--export writes the samples and runs no trial: drop --rows, --resume and --json")
    check_output(export, "--export")


def _export(setup: Setup, documents, export: Path, task_list, length_list, *, samples, seed,
            max_new_tokens) -> None:
    """The samples of ``task_list`` x ``length_list`` written to ``export`` at once (a kill leaves the file as it
    was), sized with the model's tokenizer; nothing else of the model runs."""
    from kvcli.eval.ruler import export_samples, template_digest
    from kvcli.io.outputs import atomic_write
    from kvcli.io.report import dumps

    text, book = _book(documents)
    loaded = setup.load()
    about = {"book_sha256": _digest(text), "model": loaded.name,
             "chat_template_sha256": template_digest(loaded.tokenizer)}
    records = export_samples(loaded.tokenizer, book, task_list, length_list, samples, seed=seed,
                             max_new_tokens=max_new_tokens, about=about,
                             on_sample=lambda r: setup.note(f"{r['task']} {r['length']:,} sample {r['index']}: "
                                                            f"{r['tokens']:,} tokens"))
    atomic_write(export, "".join(dumps(record) + "\n" for record in records).encode("utf-8"))
    setup.note(f"wrote {len(records)} samples to {export}")


def _book(documents) -> tuple[str, Book]:
    """SOURCE's documents joined as the haystack's text, and the :class:`kvcli.eval.ruler.Book` of it."""
    from kvcli.eval.ruler import Book

    text = "\n\n".join("".join(doc.read_chunks()) for doc in documents)
    return text, Book(text)


def _digest(text: str) -> str:
    """The book's sha256, as every row and export records it."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _run(setup: Setup, documents, task_list, method_list, length_list, *, samples, cache, ratios, block, seed,
         max_new_tokens, one_shot, probe, options, bits, recap, frame, saved, json_out, rows, resume, plot) -> None:
    from kvcli.eval.ruler import RulerLog, run_ruler
    from kvcli.io.report import dumps, print_result

    text, book = _book(documents)
    loaded = setup.load()
    left = TimeLeft(length_list)

    def on_trial(trial, done, total) -> None:
        at = "" if trial.ratio is None else f" ratio {trial.ratio:g}"
        setup.note(f"[{done}/{total}] {trial.task} {trial.length:,}{at} {trial.method}: {trial.answer[:80]!r} "
                   f"(score {trial.score:.2f}, expected {' '.join(trial.outputs)}, {trial.seconds:.1f} s"
                   f"{left.after(trial.length, trial.seconds, total)})")

    log = RulerLog(rows, resume, about={"model": loaded.name}, note=setup.note) if rows is not None else None
    try:
        result = run_ruler(loaded.model, loaded.tokenizer, book, task_list, method_list, lengths=length_list,
                           samples=samples, budget=cache, ratios=ratios, block=block, seed=seed,
                           max_new_tokens=max_new_tokens, one_shot=one_shot, probe=probe, options=options,
                           kv_bits=bits, recap=recap, frame=frame, saved=saved, warn=setup.say, on_trial=on_trial,
                           log=log, book_digest=_digest(text))
    except KeyboardInterrupt:
        if log is not None:
            setup.note(f"{log.written} new trials are in {rows}; the same command with --resume runs the rest")
        raise
    if json_out:
        print_result(dumps({"model": loaded.name, **result.as_dict()}))
    else:
        print_result(score_table(result.scores(), loaded.name))
    if plot is not None and result.trials:
        from kvcli.eval.ruler.plot import plot_ruler

        setup.note(f"wrote {plot_ruler(result.scores(), plot, loaded.name)}")


class TimeLeft:
    """A grid's time left for its progress lines: each length's trials left times the mean seconds of its trials so
    far, or, for a length not yet begun (a grid runs its lengths in turn), the seconds a token of length has taken
    so far times its length. Reads do not all cost the same per token (a one-shot read of 4k against a streamed
    16k), so the estimate is rough until every length has had a trial."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.seconds = dict.fromkeys(lengths, 0.0)
        self.done = dict.fromkeys(lengths, 0)

    def after(self, length: int, seconds: float, total: int) -> str:
        """``"; about N min left"`` once a trial of ``length`` tokens took ``seconds``, of ``total`` trials (the
        same number at every length); nothing after the last."""
        self.seconds[length] += seconds
        self.done[length] += 1
        per_length = total // len(self.lengths)
        left = {n: per_length * self.lengths.count(n) - self.done[n] for n in self.done}
        if not any(left.values()):
            return ""
        per_token = sum(self.seconds.values()) / sum(n * done for n, done in self.done.items())
        estimate = sum(count * (self.seconds[n] / self.done[n] if self.done[n] else per_token * n)
                       for n, count in left.items())
        minutes = round(estimate / 60)
        if minutes < 1:
            return "; under a minute left"
        if minutes < 60:
            return f"; about {minutes} min left"
        return f"; about {minutes // 60} h {minutes % 60:02d} min left"


def score_table(scores: list[dict], model: str) -> str:
    """The scores as plain text: one line per task, length (ratio and mean budget of a --ratios run) and method,
    averages last."""
    by_ratio = any(row["ratio"] is not None for row in scores)
    head = "mean score (95% interval), samples"
    if by_ratio:
        head = "ratio (kvpress's compression_ratio), mean cache, " + head
    lines = [f"RULER on {model}: {head}", ""]
    width = max(len(row["task"]) for row in scores)
    for row in scores:
        low, high = row["ci95"]
        budget = f"  {row['ratio']:<5g} {row['cache']:>7,}" if by_ratio else ""
        lines.append(f"{row['task']:<{width}}  {row['length']:>7,}{budget}  {row['method']:<14} {row['score']:6.1%} "
                     f"({low:.0%}-{high:.0%})  n={row['samples']}")
    return "\n".join(lines)
