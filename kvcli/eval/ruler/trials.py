"""A RULER run: every sample read by every method as ``kvcli ask`` reads it, graded, its trials kept as rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from kvcli.errors import BudgetError, KvcliError, UsageError
from kvcli.eval.needle import wilson_interval
from kvcli.eval.ruler.grading import recall
from kvcli.eval.ruler.tasks import TASKS, Book, Sample, answer_limit, make_sample
from kvcli.io.identity import as_json, method_params_check, resumed_trials
from kvcli.io.outputs import RowLog
from kvcli.io.report import each_once
from kvcli.reading.prompts import build_prompt, question_frame, question_instruction

DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 5


@dataclass
class Trial:
    task: str
    length: int
    index: int
    method: str
    outputs: list[str]
    answer: str
    score: float
    prompt_tokens: int
    one_shot: bool
    max_cache_tokens: int
    seconds: float
    ratio: float | None = None  # kvpress's compression_ratio that sized the budget (None: a fixed --cache)
    cache: int | None = None  # the budget the trial was given, tokens per layer
    #: The trial's peak memory (kvcli.io.report.peak_memory_bytes: the process's peak RSS on a CPU, model included);
    #: None in rows written before it was recorded.
    peak_memory_bytes: int | None = None


@dataclass
class RulerResult:
    trials: list[Trial] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def scores(self) -> list[dict]:
        """Rows ``{task, length, ratio, cache, method, samples, score, ci95}`` in the order the grid ran, then per
        length, ratio and method the average over tasks (``task`` "average"). ``cache`` is the mean budget of the
        trials (a ratio's differs per sample). ``ci95`` is the 95% Wilson interval of the mean score, the score
        taken as a rate over the samples (exact for scores of 0 and 1, the single needles')."""
        groups: dict[tuple, list[Trial]] = {}
        for t in self.trials:
            groups.setdefault((t.task, t.length, t.ratio, t.method), []).append(t)
        rows = [_row(task, group) for (task, *_), group in groups.items()]
        totals: dict[tuple, list[Trial]] = {}
        for (_task, *cell), group in groups.items():
            totals.setdefault(tuple(cell), []).extend(group)
        return rows + [_row("average", group) for group in totals.values()]

    def as_dict(self) -> dict:
        return {**self.settings, "scores": self.scores(), "trials": [asdict(t) for t in self.trials]}


def _row(task: str, trials: list[Trial]) -> dict:
    scores = [t.score for t in trials]
    caches = [t.cache for t in trials if t.cache is not None]
    low, high = wilson_interval(sum(scores), len(scores))  # type: ignore[arg-type] - a rate of partial successes
    first = trials[0]
    return {"task": task, "length": first.length, "ratio": first.ratio,
            "cache": round(sum(caches) / len(caches)) if caches else None, "method": first.method,
            "samples": len(scores), "score": sum(scores) / len(scores), "ci95": [low, high]}


def kept_tokens(context: int, ratio: float) -> int:
    """What a kvpress 0.5.5 press at ``compression_ratio`` ``ratio`` keeps of ``context`` tokens per layer: its
    ``kvpress.utils.compute_n_kept``, ``max(1, int(context * (1 - ratio)))``, the same float expression so that
    it truncates alike (``int(1000 * (1 - 0.9))`` is 99)."""
    return max(1, int(context * (1 - ratio)))


def ratio_budget(parts, sample: Sample, ratio: float) -> int:
    """The budget of a trial at ``ratio``: what kvpress keeps of the context it compresses (the chat template's
    opening and the document: ``parts.prefix`` and ``sample.doc``) plus the question after it, which kvpress
    appends uncompressed (``parts.suffix``: ask's frame, RULER's question, the assistant's start, the prefix)."""
    return kept_tokens(len(parts.prefix) + len(sample.doc), ratio) + len(parts.suffix)


def check_ratios(ratios: Sequence[float], one_shot: bool | None) -> None:
    """A ratio is a share of a prompt read in one shot: in (0, 1), and never with every prompt streamed."""
    for ratio in ratios:
        if not 0 < ratio < 1:
            raise UsageError(f"--ratios {ratio:g}: a compression ratio is a share of the prompt removed, "
                             "greater than 0 and less than 1")
    if one_shot is False:
        raise UsageError("--ratios sizes a one-shot read; --no-one-shot streams every prompt: give --cache instead")


def check_one_shot(engine, tasks: Sequence[str], lengths: Sequence[int], max_new_tokens: int | None) -> None:
    """Refuse a length whose prompts a ratio run could stream: a prompt holds at most its length less the task's
    room for the answer, and the reader streams what exceeds :func:`kvcli.reading.reader.one_shot_limit`."""
    from kvcli.reading.reader import one_shot_limit

    for length in lengths:
        for name in tasks:
            task = TASKS[name]
            limit = one_shot_limit(engine, answer_limit(name, max_new_tokens))
            if length - task.reserve > limit:
                raise UsageError(f"--ratios: {name} at {length:,} tokens would be streamed (one shot holds "
                                 f"{limit:,} prompt tokens here); a streamed read needs a fixed --cache")


def check_ratio_budget(built: dict, cache: int, ratio: float, sample: Sample) -> None:
    """Every method's budget check (:func:`kvcli.engine.engine.check_budget`) on the budget a ratio gives a sample,
    in one line that names the ratio and the sample."""
    from kvcli.engine.engine import check_budget

    for method in built.values():
        try:
            check_budget(method, cache)
        except BudgetError as exc:
            raise UsageError(f"--ratios {ratio:g}: {sample.task} sample {sample.index} at {sample.length:,} tokens "
                             f"keeps {cache} tokens per layer, fewer than {exc.what} ({exc.need}): choose a longer "
                             "length or a lower ratio") from None


class RulerLog:
    """``kvcli ruler --rows``: every finished trial a JSON line at once; with ``resume`` the trials already there
    are taken, never those of another run (model, book, settings: each row records ``run``) nor of a method read
    with other parameters (each row records its method's ``params``)."""

    FLAG = "--rows"

    def __init__(self, path, resume: bool = False, about: dict | None = None,
                 note: Callable[[str], None] | None = None):
        self.log = RowLog(path, self.FLAG)
        self.resume = resume
        self.about = dict(about or {})
        self.note = note
        self.run: dict = {}
        self.params: dict[str, dict] = {}
        self.written = 0

    def open(self, run: dict, params: dict[str, dict], wanted: set[tuple]) -> dict[tuple, Trial]:
        """The trials of this run already in the file, by (task, length, index, method, ratio); the note counts
        those of ``wanted``, the grid's keys (the file may hold other methods', tasks' or samples' rows)."""
        self.run, self.params = as_json({**self.about, **run}), as_json(params)
        done: dict[tuple, Trial] = {}
        for trial in resumed_trials(self.log, self.resume, "task", self.run, Trial, "ruler trial",
                                    method_params_check(params)):
            done[(trial.task, trial.length, trial.index, trial.method, trial.ratio)] = trial
        if self.resume and self.note:
            self.note(f"took {len(wanted & done.keys())} of {len(wanted)} trials from {self.log.path}")
        return done

    def add(self, trial: Trial) -> None:
        self.log.append({**asdict(trial), "params": self.params.get(trial.method), "run": self.run})
        self.written += 1


def run_ruler(model, tokenizer, book: Book, tasks: Iterable[str], methods: Iterable[str], *,
              lengths: Iterable[int] = DEFAULT_LENGTHS, samples: int = DEFAULT_SAMPLES, budget: int = 1024,
              ratios: Sequence[float] | None = None, block: int = 1024, seed: int = 0,
              max_new_tokens: int | None = None, one_shot: bool | None = None, probe: bool = True,
              options: dict[str, dict] | None = None, kv_bits: int = 16, recap: int = 0, frame: bool = True,
              saved: int | None = None, warn: Callable[[str], None] | None = None,
              on_trial: Callable[[Trial, int, int], None] | None = None, log: RulerLog | None = None,
              book_digest: str = "") -> RulerResult:
    """Every sample of ``tasks`` x ``lengths`` read by every method as ``kvcli ask`` reads it (one shot when it
    fits the model's context, otherwise streamed with the question as probe, ``recap`` as ask's), graded by
    :func:`recall`. ``frame`` False asks RULER's question as written, without ask's frame (``kvcli ask --no-frame``);
    the samples are the same either way (sized with the frame). ``max_new_tokens`` caps every task's own answer
    length (:attr:`Task.answer_tokens`). ``saved``: each sample is read without its question, as ``kvcli read``
    reads, and the question asked from that read as ``kvcli ask BOOK.kvc`` asks it, with ``saved`` tokens of
    recall (:func:`kvcli.reading.saved.answer`; 0: none); None: the question is known while reading, as ``ask``.
    ``ratios`` instead of ``budget``: each sample is read once per ratio, at the budget kvpress would keep of it
    (:func:`ratio_budget`), in one forward where it knows its question."""
    from kvcli.reading.prompts import stop_token_ids

    tasks, methods, lengths = list(tasks), list(methods), list(lengths)
    built = grid_methods(model, tasks, methods, lengths, samples, budget=budget, ratios=ratios, block=block,
                         one_shot=one_shot, max_new_tokens=max_new_tokens, options=options)
    result = RulerResult(settings={"cache": None if ratios else budget, "ratios": list(ratios) if ratios else None,
                                   "block": block, "seed": seed, "samples": samples,
                                   "max_new_tokens": max_new_tokens, "one_shot": one_shot, "probe": probe,
                                   "kv_bits": kv_bits, "recap": recap, "frame": question_frame(tokenizer, frame),
                                   "saved": saved, "params": {name: m.settings() for name, m in built.items()}})
    levels: list[float | None] = list(ratios) if ratios else [None]
    wanted = grid_keys(tasks, lengths, samples, methods, levels)
    previous: dict[tuple, Trial] = {}
    if log is not None:
        run = row_run(result.settings, dtype=str(next(model.parameters()).dtype), book_sha256=book_digest)
        previous = log.open(run, result.settings["params"], wanted)
    reading = Reading(model, tokenizer, built, block, kv_bits, recap, one_shot, probe, each_once(warn),
                      stop_token_ids(tokenizer, model), saved)
    for length in lengths:
        for name in tasks:
            answer_tokens = answer_limit(name, max_new_tokens)
            for index in range(samples):
                sample = make_sample(tokenizer, book, name, length, index, seed)
                parts = build_prompt(tokenizer, question_instruction(sample.question, sample.answer_prefix, frame))
                for trial in sample_trials(reading, sample, parts, methods, levels, budget, answer_tokens, previous,
                                           log):
                    result.trials.append(trial)
                    if on_trial:
                        on_trial(trial, len(result.trials), len(wanted))
    return result


def grid_methods(model, tasks: list[str], methods: list[str], lengths: list[int], samples: int, *, budget: int,
                 ratios: Sequence[float] | None, block: int, one_shot: bool | None, max_new_tokens: int | None,
                 options: dict[str, dict] | None) -> dict:
    """The grid's methods, built from ``options``, once the grid is known to be runnable: known tasks, something
    in every axis, ratios a one-shot read can take, or a budget every method accepts; else a UsageError."""
    from kvcli.engine.engine import Engine, check_budget
    from kvcli.methods import make_method

    for name in tasks:
        if name not in TASKS:
            raise UsageError(f"unknown task {name!r}; choose from: {', '.join(TASKS)}")
    if not tasks or not methods or not lengths or samples < 1:
        raise UsageError("the grid needs at least one task, method, length and sample")
    built = {name: make_method(name, (options or {}).get(name)) for name in methods}
    if ratios:
        check_ratios(ratios, one_shot)
        if one_shot is None:
            check_one_shot(Engine(model, make_method("full"), None, block=block), tasks, lengths, max_new_tokens)
    else:
        for method in built.values():
            check_budget(method, budget)
    return built


def row_run(settings: dict, **about: str) -> dict:
    """What every row of a run records as ``run``: the settings but the methods' parameters (each row has its
    method's), the sample count and the ratios (a resume may add samples or ratios, as it may add tasks), and
    ``saved`` when the read knew its question (rows from before saved reads existed are such reads)."""
    run = {key: value for key, value in settings.items()
           if key not in ("params", "samples", "ratios") and not (key == "saved" and value is None)}
    return {**run, **about}


def sample_trials(reading: Reading, sample: Sample, parts, methods: list[str], levels: list[float | None],
                  budget: int, answer_tokens: int, previous: dict[tuple, Trial], log: RulerLog | None):
    """The trials of one sample, every method at every ratio (or the one budget), each taken from ``previous``
    when a resumed file has it, else read and logged. A method that ignores the budget (full) reads a sample
    once; its other ratios are that read."""
    read_once: dict[str, Trial] = {}
    for ratio in levels:
        cache = budget if ratio is None else ratio_budget(parts, sample, ratio)
        if ratio is not None:
            check_ratio_budget(reading.built, cache, ratio, sample)
        for method in methods:
            trial = previous.get((sample.task, sample.length, sample.index, method, ratio))
            if trial is None:
                trial = (replace(read_once[method], ratio=ratio, cache=cache) if method in read_once
                         else reading.trial(sample, parts, method, ratio, cache, answer_tokens))
                if log is not None:
                    log.add(trial)
            else:
                check_resumed(trial, sample, cache)
            if reading.built[method].unbounded:
                read_once.setdefault(method, trial)
            yield trial


def grid_keys(tasks: list[str], lengths: list[int], samples: int, methods: list[str],
              levels: list[float | None]) -> set[tuple]:
    """Every trial of a run by its row key (task, length, index, method, ratio)."""
    return {(name, length, index, method, ratio) for name in tasks for length in lengths
            for index in range(samples) for method in methods for ratio in levels}


def check_resumed(trial: Trial, sample: Sample, cache: int) -> None:
    """A trial taken from ``--rows`` must be this run's: the same expected values and the same budget."""
    if trial.outputs != sample.outputs:
        raise KvcliError(f"{RulerLog.FLAG}: {sample.task} sample {sample.index} at {sample.length:,} expects "
                         f"{trial.outputs}, this run draws {sample.outputs}: run without --resume")
    if trial.cache != cache:
        raise KvcliError(f"{RulerLog.FLAG}: {sample.task} sample {sample.index} at {sample.length:,} was read at a "
                         f"budget of {trial.cache}, this run gives it {cache}: run without --resume")


@dataclass
class Reading:
    """How every trial of a run is read: ``kvcli ask``'s reader on a fresh engine per trial."""

    model: object
    tokenizer: object
    built: dict
    block: int
    kv_bits: int
    recap: int
    one_shot: bool | None
    probe: bool
    warn: Callable[[str], None] | None
    stop_ids: set[int]
    saved: int | None = None  # read without the question, then asked with this much recall (run_ruler's ``saved``)

    def trial(self, sample: Sample, parts, method: str, ratio: float | None, cache: int,
              answer_tokens: int) -> Trial:
        """One trial: ``sample`` read by ``method`` at a budget of ``cache`` tokens per layer, then graded."""
        from kvcli.engine.engine import Engine
        from kvcli.io.report import peak_memory_bytes, reset_peak_memory
        from kvcli.reading.prompts import ANSWER_REPETITION
        from kvcli.reading.reader import Reader

        engine = Engine(self.model, self.built[method], cache, block=self.block, warn=self.warn, kv_bits=self.kv_bits)
        reader = Reader(engine, self.tokenizer, stop_ids=self.stop_ids, recap=self.recap, repetition=ANSWER_REPETITION)
        reset_peak_memory(engine.device)
        started = time.perf_counter()
        if self.saved is None:
            gen = reader.run(parts, [sample.doc], answer_tokens, one_shot=self.one_shot, probe=self.probe)
        else:
            from kvcli.reading.saved import answer as answer_saved
            from kvcli.reading.saved import read_once

            gen = answer_saved(reader, read_once(reader, [sample.doc]), parts, answer_tokens, recall=self.saved)
        answer = gen.text.strip()
        return Trial(sample.task, sample.length, sample.index, method, sample.outputs, answer,
                     recall(answer, sample.outputs), gen.prompt_tokens, gen.one_shot, gen.max_cache_tokens,
                     time.perf_counter() - started, ratio, cache, peak_memory_bytes(engine.device))
