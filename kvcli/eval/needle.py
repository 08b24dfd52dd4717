"""The pass-key test as a grid: methods x document lengths x depths x trials.

A sentence holding a random key is hidden at a relative depth of an excerpt of a book, the model is
asked for the key, and the answer counts as correct when it writes the key as a whole number
(:func:`is_correct`). Each trial reads the haystack through :class:`kvcli.reading.reader.Reader` exactly as
``kvcli ask`` does, with the same prompt and no answer prefix unless one is asked for: one-shot prefill
when the prompt fits, otherwise streamed with the question as a probe. The needle sentence, the question's wording and
the key's length vary from trial to trial, and the needle sits at any word boundary, so a rate does
not hold for one phrasing only. Every method sees the same haystacks and keys.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvcli.engine.engine import Engine, check_budget
from kvcli.errors import KvcliError, UsageError
from kvcli.eval.kl import token_digest
from kvcli.io.identity import as_json, method_params_check, resumed_trials
from kvcli.io.outputs import RowLog
from kvcli.io.report import each_once
from kvcli.reading.prompts import (
    ANSWER_REPETITION,
    PromptParts,
    build_prompt,
    encode,
    question_frame,
    question_instruction,
    stop_token_ids,
)
from kvcli.reading.reader import Reader
from kvcli.reading.recap import RECAP_TOKENS

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
#: What a trial hides and asks by default: one needle sentence, one question and a key length drawn per
#: trial (from the seed), so that no number holds for one phrasing only. The first needle and question
#: are the fixed harness's (``fixed=True``); the last needle and question were never used to choose any
#: setting (docs/results.md says which books and phrasings settings were chosen on).
NEEDLES = (
    NEEDLE,
    "The secret pass key is {key}; keep it in mind.",
    "Remember this pass key: {key}.",
    "Note that the pass key is {key}, and do not forget it.",
    "Here is the pass key you will need later: {key}.",
)
QUESTIONS = (
    QUESTION,
    "What is the pass key mentioned in the text?",
    "Which number is the pass key? Reply with the number.",
    "Tell me the pass key from the text.",
)
KEY_DIGITS = (4, 5, 6, 7)
#: An answer prefix as in the pass-key prompts of the long-context literature (``--answer-prefix``): a
#: user of ``kvcli ask`` types none, so the grid's default is none. The trailing space matters:
#: tokenizers write the space before a number as a token of its own, so the prompt ends exactly where
#: the key starts in the needle ("is", " ", digits) and the model copies it (docs/reading.md).
ANSWER_PREFIX = "The pass key is "
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_LENGTHS = (6000,)
#: Tokens a trial may write: enough for the longest answer the question wordings draw, such as "The pass key
#: mentioned in the text is 7117200." (17 tokens with SmolLM2's one token a digit), before the end of the turn.
ANSWER_TOKENS = 32
#: Haystacks per length and depth: 4 x the 5 default depths = 20 trials per method and length, enough
#: for a 95% interval about +-20 points wide at mid rates (5 trials left it +-40 points).
DEFAULT_TRIALS = 4
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95%


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (Wilson, 1927), 95% by default.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0/n or n/n, which
    are common pass-key outcomes.
    """
    if trials < 1:
        raise ValueError("an interval needs at least one trial")
    rate = successes / trials
    z2 = z * z
    centre = (rate + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z / (1 + z2 / trials) * math.sqrt(rate * (1 - rate) / trials + z2 / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Trial:
    method: str
    length: int  # excerpt tokens (the haystack without the needle and the prompt around it)
    depth: float
    trial: int
    key: str
    answer: str
    correct: bool
    prompt_tokens: int
    one_shot: bool
    max_cache_tokens: int
    seconds: float
    needle: str = NEEDLE
    question: str = QUESTION


@dataclass
class NeedleResult:
    trials: list[Trial] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def accuracy(self, by_depth: bool = False) -> list[dict]:
        """Rows ``{method, length[, depth], correct, trials, accuracy, ci95}`` in the order the grid ran
        (``ci95``: the 95% Wilson interval ``[low, high]`` of the accuracy)."""
        groups: dict[tuple, list[Trial]] = {}
        for t in self.trials:
            key = (t.method, t.length, t.depth) if by_depth else (t.method, t.length)
            groups.setdefault(key, []).append(t)
        rows = []
        for key, trials in groups.items():
            row = {"method": key[0], "length": key[1]}
            if by_depth:
                row["depth"] = key[2]
            correct = sum(t.correct for t in trials)
            low, high = wilson_interval(correct, len(trials))
            row.update(correct=correct, trials=len(trials), accuracy=correct / len(trials), ci95=[low, high])
            rows.append(row)
        return rows

    def as_dict(self) -> dict:
        return {**self.settings, "trials": [asdict(t) for t in self.trials], "accuracy": self.accuracy(),
                "by_depth": self.accuracy(by_depth=True)}


class TrialLog:
    """``kvcli needle --rows``: every finished trial a JSON line at once, so that a kill loses at most the trial
    being read, and ``--resume`` runs only the trials not yet there.

    A row is reused only by a run that would draw and read it the same way: each row records ``run``
    (model, dtype, the book's tokens, the grid and every setting but the methods) and its method's
    ``params``. A row of another run is refused with one line, never mixed into the rates.
    """

    FLAG = "--rows"

    def __init__(self, path: Path, resume: bool = False, about: dict | None = None,
                 note: Callable[[str], None] | None = None):
        self.log = RowLog(path, self.FLAG)  # checks the path before any model work
        self.resume = resume
        self.about = dict(about or {})  # what run_grid cannot see: the model's name
        self.note = note  # says, when resuming, how many trials were taken: the first new one may be minutes away
        self.run: dict = {}
        self.written = 0

    def open(self, run: dict, params: dict[str, dict], total: int) -> dict[tuple, Trial]:
        """Start the file for ``run`` (``total`` trials); with ``resume``, the trials already there, by (method,
        length, depth, trial)."""
        self.run = as_json({**self.about, **run})  # compared with rows read back, whose tuples are lists
        done: dict[tuple, Trial] = {}
        for trial in resumed_trials(self.log, self.resume, "trial", self.run, Trial, "needle trial",
                                    method_params_check(params)):
            trial.correct = is_correct(trial.answer, trial.key)  # graded again: rows of an older grader count alike
            done[(trial.method, trial.length, trial.depth, trial.trial)] = trial
        if self.resume and self.note:
            taken = sum(1 for key in done if key[0] in params)
            left = total - taken
            self.note(f"took {taken} of {total} trials from {self.log.path}; "
                      + (f"reading the other {left}" if left else "none left to read"))
        return done

    def add(self, trial: Trial, params: dict) -> None:
        """Append ``trial``, read with ``params``, as one whole line."""
        self.log.append({**asdict(trial), "params": params, "run": self.run})
        self.written += 1


#: One number as an answer may write it, tried in this order wherever a run of digits starts: grouped by threes
#: with one separator used throughout ("60,494", "8 056 020", "60'494"); spelled digit by digit with one space or
#: hyphen, three digits or more ("6 0 4 9 4", "6-0-4-9-4"; "pages 1-2" is two numbers); a plain run of digits. A
#: grouping that goes on with a shorter group is none ("12,345,6" is 12, 345 and 6). A period never joins digits:
#: it is a decimal point or a sentence's end ("50651.50651" is the key written twice).
NUMBER = re.compile(
    r"(?<![0-9])(?:"
    r"[0-9]{1,3}(?P<group>[,' _\u00a0\u2009\u202f\u2019])[0-9]{3}(?:(?P=group)[0-9]{3})*(?!(?P=group)[0-9])"
    r"|[0-9](?P<spell>[ -])[0-9](?:(?P=spell)[0-9])+"
    r"|[0-9]+"
    r")(?![0-9])")


def numbers(answer: str) -> list[str]:
    """The numbers written in ``answer`` (:data:`NUMBER`), each as its digits only, in order."""
    return [re.sub(r"[^0-9]", "", match.group()) for match in NUMBER.finditer(answer)]


def is_correct(answer: str, key: str) -> bool:
    """The one grader of a pass key: ``key`` is one of the numbers ``answer`` writes, whole.

    The key must be a whole number of the answer, never part of one: "The pass key is 60494." does not answer
    6049, nor "80560208056020" (the key twice with nothing between) 8056020. Separators are removed only
    inside a number written as people group digits (:data:`NUMBER`): "60,494", "60 494" and "6 0 4 9 4" answer
    60494, but "Chapter 12, page 345." does not answer 12345 (a comma and a space, then words, are no
    grouping), nor "60494 60494" 6049460494 (a group of five digits is no group of three). Every pass-key check
    in kvcli and in docs/results/ goes through this function, so that every rate is graded alike.
    """
    return key in numbers(answer)


def haystack(tokenizer, tokens: Sequence[int], length: int, depth: float, key: str, offset: int = 0, *,
             needle: str = NEEDLE, at_sentence: bool = True) -> str:
    """``length`` tokens of ``tokens`` from ``offset``, cut at token boundaries, decoded, with ``needle``
    (its ``{key}`` filled) inserted at ``depth`` (0 = start, 1 = end) of the excerpt: after the last
    sentence end within 2 % of the text before it (``at_sentence``), else at the nearest word boundary."""
    excerpt = list(tokens[offset:offset + length])
    at = round(depth * len(excerpt))
    before = tokenizer.decode(excerpt[:at])
    after = tokenizer.decode(excerpt[at:])
    if at_sentence:
        before, after = sentence_break(before, after, reach=len(before + after) // 50)
    else:
        before, after = word_break(before, after)
    return " ".join(part for part in (before.rstrip(), needle.format(key=key), after.lstrip()) if part)


SENTENCE_END = re.compile(r"""[.!?;]["'’”)]*\s""")


def sentence_break(before: str, after: str, reach: int) -> tuple[str, str]:
    """Move the cut back to the last sentence end within ``reach`` characters, so the needle is a
    sentence of its own rather than a clause spliced into another (the fixed harness)."""
    tail = before[max(len(before) - reach, 0):] if reach > 0 else ""
    ends = list(SENTENCE_END.finditer(tail))
    if not ends:
        return before, after
    cut = len(before) - len(tail) + ends[-1].end()
    return before[:cut], before[cut:] + after


def word_break(before: str, after: str) -> tuple[str, str]:
    """Move a cut inside a word back to the last whitespace before it (a word boundary in any sentence)."""
    if not before[-1:].strip() or not after[:1].strip():
        return before, after  # already between words
    cut = max(before.rfind(" "), before.rfind("\n"))
    if cut < 0:
        return before, after
    return before[:cut], before[cut:] + after


def excerpt_offset(total: int, length: int, trial: int) -> int:
    """Trial ``t`` reads the ``t``-th excerpt of the book (wrapping round when the book is short)."""
    room = total - length
    return (trial * length) % (room + 1) if room > 0 else 0


def run_grid(model, tokenizer, tokens: Sequence[int], methods: Iterable[str], *,
             lengths: Iterable[int] = DEFAULT_LENGTHS, depths: Iterable[float] = DEFAULT_DEPTHS,
             trials: int = DEFAULT_TRIALS,
             budget: int = 1024, block: int = 1024, seed: int = 0, max_new_tokens: int = ANSWER_TOKENS,
             one_shot: bool | None = None, probe: bool = True, options: dict[str, dict] | None = None,
             answer_prefix: str = "", fixed: bool = False, warn: Callable[[str], None] | None = None,
             on_trial: Callable[[Trial, int, int], None] | None = None, kv_bits: int = 16,
             recap: int = RECAP_TOKENS, log: TrialLog | None = None) -> NeedleResult:
    """Run the grid on ``model``; ``tokens`` is the book (document ids without special tokens).

    Every trial is read and answered as ``kvcli ask DOC QUESTION`` does with these options: the
    default ``answer_prefix`` is none and ``recap`` ask's, as a user types. ``fixed`` hides the same needle sentence and
    asks the same question with five-digit keys at sentence breaks in every trial (the harness of
    earlier results); by default each trial draws its needle, question and key length. ``options``
    maps a method name to its parameters. ``on_trial(trial, done, total)`` reports progress. Every
    draw comes from ``random.Random(seed)`` in grid order, so a seed fixes every haystack. ``log`` writes
    every trial as it finishes and, when resuming, takes the trials it already holds instead of running them.
    """
    methods, lengths, depths = list(methods), list(lengths), list(depths)
    built = _grid_methods(tokens, methods, lengths, depths, trials, budget, options)
    stop_ids = stop_token_ids(tokenizer, model)
    params = {name: m.settings() for name, m in built.items()}
    result = NeedleResult(settings={"cache": budget, "block": block, "seed": seed, "fixed": fixed,
                                    "questions": [QUESTION] if fixed else list(QUESTIONS),
                                    "needles": [NEEDLE] if fixed else list(NEEDLES),
                                    "frame": question_frame(tokenizer), "answer_prefix": answer_prefix,
                                    "max_new_tokens": max_new_tokens,
                                    "probe": probe, "params": params, "kv_bits": kv_bits, "recap": recap})
    previous: dict[tuple, Trial] = {}
    total = len(lengths) * len(depths) * trials * len(methods)
    if log is not None:
        run = {key: value for key, value in result.settings.items() if key != "params"}
        run.update(dtype=str(next(model.parameters()).dtype), one_shot=one_shot, lengths=lengths, depths=depths,
                   trials=trials, tokens=len(tokens), tokens_sha256=token_digest(tokens))
        previous = log.open(run, params, total)
    done, warn = 0, each_once(warn)  # an engine per trial: each warning once
    for stack in haystacks(tokenizer, tokens, lengths, depths, trials, seed, fixed=fixed):
        parts = build_prompt(tokenizer, question_instruction(stack.question, answer_prefix))
        for name in methods:
            earlier = previous.get((name, stack.length, stack.depth, stack.trial))
            if earlier is not None:
                if earlier.key != stack.key:
                    raise KvcliError(f"{TrialLog.FLAG}: the trial of {name} at depth {stack.depth:.0%} (trial "
                                     f"{stack.trial}) has key {earlier.key}, this run draws {stack.key}: it was "
                                     "drawn by another kvcli; run without --resume to start over")
                result.trials.append(earlier)
                done += 1
                continue
            engine = Engine(model, built[name], budget, block=block, warn=warn, kv_bits=kv_bits)
            reader = Reader(engine, tokenizer, stop_ids=stop_ids, recap=recap, repetition=ANSWER_REPETITION)
            record = _trial(reader, name, stack, parts, max_new_tokens, one_shot=one_shot, probe=probe)
            result.trials.append(record)
            if log is not None:
                log.add(record, params[name])
            done += 1
            if on_trial:
                on_trial(record, done, total)
    return result


def _grid_methods(tokens: Sequence[int], methods: list[str], lengths: list[int], depths: list[float], trials: int,
                  budget: int, options: dict[str, dict] | None) -> dict:
    """The grid's methods built with their options, once the grid is checked: a bad grid is refused before the
    model reads anything."""
    from kvcli.methods import make_method

    if not methods or not lengths or not depths or trials < 1:
        raise UsageError("the grid needs at least one method, length, depth and trial")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise UsageError(f"depth {depth} is not between 0 and 1")
    if min(lengths) < 1:
        raise UsageError("lengths must be positive")
    if len(tokens) < max(lengths):
        raise UsageError(f"the source has {len(tokens):,} tokens; a haystack of {max(lengths):,} needs a longer book")
    built = {}
    for name in methods:
        built[name] = make_method(name, (options or {}).get(name))
        check_budget(built[name], budget)
    return built


def _trial(reader: Reader, name: str, stack: Haystack, parts: PromptParts, max_new_tokens: int, *,
           one_shot: bool | None, probe: bool) -> Trial:
    """One haystack read and answered by ``reader`` as ``kvcli ask`` does, graded strictly."""
    started = time.perf_counter()
    gen = reader.run(parts, [stack.doc], max_new_tokens, one_shot=one_shot, probe=probe)
    answer = gen.text.strip()
    return Trial(name, stack.length, stack.depth, stack.trial, stack.key, answer, is_correct(answer, stack.key),
                 gen.prompt_tokens, gen.one_shot, gen.max_cache_tokens, time.perf_counter() - started,
                 stack.needle, stack.question)


@dataclass
class Haystack:
    """One cell of the grid: an excerpt of ``length`` tokens with ``key`` hidden at ``depth`` in
    ``needle``, encoded, and the ``question`` that asks for it."""

    length: int
    trial: int
    depth: float
    key: str
    doc: list[int]
    needle: str = NEEDLE
    question: str = QUESTION


def haystacks(tokenizer, tokens: Sequence[int], lengths: Iterable[int], depths: Iterable[float], trials: int,
              seed: int = 0, *, fixed: bool = False) -> Iterator[Haystack]:
    """The grid's haystacks in grid order (length, trial, depth), every draw from ``random.Random(seed)``:
    what ``run_grid`` reads, so that a script can rebuild the haystacks of a ``kvcli needle`` run.

    ``fixed``: :data:`NEEDLE` at a sentence break, :data:`QUESTION`, five-digit keys. Otherwise each
    haystack draws a needle of :data:`NEEDLES`, a question of :data:`QUESTIONS` and a key length of
    :data:`KEY_DIGITS`, and the needle goes in at the word boundary nearest its depth.
    """
    rng = random.Random(seed)
    depths = list(depths)
    for length in lengths:
        for trial in range(trials):
            offset = excerpt_offset(len(tokens), length, trial)
            for depth in depths:
                if fixed:
                    key, needle, question = str(rng.randint(10000, 99999)), NEEDLE, QUESTION
                else:
                    digits = rng.choice(KEY_DIGITS)
                    key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
                    needle, question = rng.choice(NEEDLES), rng.choice(QUESTIONS)
                text = haystack(tokenizer, tokens, length, depth, key, offset, needle=needle, at_sentence=fixed)
                yield Haystack(length, trial, depth, key, encode(tokenizer, text), needle, question)


def book_tokens(documents, tokenizer, limit: int | None = None) -> list[int]:
    """The first ``limit`` tokens of ``documents`` read as one text (all of them when None)."""
    from kvcli.io.text import first_tokens

    return first_tokens(documents, tokenizer, limit, special_tokens=False, separator="\n\n")[0]
