"""RULER's synthetic tasks (Hsieh et al., 2024), built offline from a book, read as ``kvcli ask`` reads.

The tasks, templates, needle types and answer prefixes are RULER's (NVIDIA's ``scripts/data/synthetic/`` as
lm-eval 0.4.13 ships them in ``lm_eval/tasks/ruler``): needle in a haystack with one key or several, several
values or several queries, variable tracking (vt), common words (cwe) and frequent words extraction (fwe). What
needs a download in RULER comes from the book the user gives instead (docs/ruler.md): the essay haystack is the
book's text with the needles put in at sentence ends, and the words of keys and of cwe's list are the book's own.
Every sample is sized with the model's tokenizer: the whole prompt as ``kvcli ask`` builds it (chat template, the
question's frame) plus RULER's room for the answer fills the target length. A sample's draws come from its seed,
task, length and index only, so each sample is the same whatever else a run asks for.

A trial is ``kvcli ask DOCUMENT QUESTION --answer-prefix PREFIX``: the document is the task's text up to and
with the context, the question is RULER's question after it, and RULER's answer prefix starts the answer. Its
score is RULER's ``string_match_all`` (the share of expected values the answer holds) under kvcli's whole-token
rule (:func:`found`).
"""

from __future__ import annotations

import math
import random
import re
import string
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from kvcli.errors import BudgetError, KvcliError, UsageError
from kvcli.eval.needle import (
    SENTENCE_END,
    excerpt_offset,
    is_correct,
    wilson_interval,
)
from kvcli.io.identity import as_json, method_params_check, resumed_trials
from kvcli.io.outputs import RowLog
from kvcli.reading.prompts import build_prompt, encode, question_frame, question_instruction


@dataclass(frozen=True)
class Task:
    """One of RULER's synthetic tasks. ``reserve`` is RULER's ``tokens_to_generate``: the room a sample leaves
    for the answer when it is sized. ``answer_tokens`` is what a trial may write by default: RULER's own for vt,
    cwe and fwe, fewer for the needles (RULER's 128 is room for chat, and a CPU pays for every token)."""

    name: str
    kind: str  # niah, vt, cwe or fwe
    reserve: int
    answer_tokens: int
    haystack: str = "book"  # niah only: book (RULER's essays), repeat (one noise paragraph) or needle (distractors)
    key_type: str = "words"
    value_type: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1


TASKS: dict[str, Task] = {task.name: task for task in (
    Task("niah_single_1", "niah", 128, 32, haystack="repeat"),
    Task("niah_single_2", "niah", 128, 32),
    Task("niah_single_3", "niah", 128, 48, value_type="uuids"),
    Task("niah_multikey_1", "niah", 128, 32, keys=4),
    Task("niah_multikey_2", "niah", 128, 32, haystack="needle"),
    Task("niah_multikey_3", "niah", 128, 48, haystack="needle", key_type="uuids", value_type="uuids"),
    Task("niah_multivalue", "niah", 128, 64, values=4),
    Task("niah_multiquery", "niah", 128, 64, queries=4),
    Task("vt", "vt", 30, 30),
    Task("cwe", "cwe", 120, 120),
    Task("fwe", "fwe", 50, 50),
)}

NIAH_PREAMBLE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_needle_v} afterwards.")
NIAH_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: Where the needles of a book haystack may go, in percent of its sentences: RULER's 40 depths.
DEPTHS = [round(i * 100 / 39) for i in range(40)]
VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = "Find all variables that are assigned the value {query} in the text above."
VT_PREFIX = ("According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined "
             "the value {query}, they are:")  # RULER's spelling
VT_HOPS = 4
VT_EXAMPLE_UNITS = 16  # noise paragraphs of vt's worked example: about RULER's 500 tokens
CWE_PREAMBLE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                "the ones that appear most often.")
CWE_QUESTION = "What are the 10 most common words in the above list?"
CWE_PREFIX = "The top 10 words that appear most often in the list are:"
CWE_COMMON = 10
FWE_PREAMBLE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words.")
FWE_QUESTION = ("Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
                "appeared words in the above coded text?")
FWE_PREFIX = "According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA = 2.0
DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 5
DEFAULT_METHODS = ("full", "snapkv", "pyramidkv")


# --------------------------------------------------------------------------- grading


def found(answer: str, value: str) -> bool:
    """Whether ``answer`` writes ``value`` as a whole token: the one rule of every RULER score in kvcli.

    A number goes through the pass-key grader (:func:`kvcli.eval.needle.is_correct`: a whole number, "60494" never
    answers 6049). Anything else (a word, a hyphenated key, a uuid, a variable's name) must stand on its own,
    case aside as RULER lowercases: no letter, digit or hyphenated word may go on before or after it, so "Sun"
    answers "sun" but "sunny" or "sun-dial" do not.
    """
    if value.isdigit():
        return is_correct(answer, value)
    pattern = rf"(?<!\w)(?<!\w-){re.escape(value)}(?!\w)(?!-\w)"
    return re.search(pattern, answer, re.IGNORECASE) is not None


def recall(answer: str, outputs: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one answer: the share of ``outputs`` that :func:`found` finds in it."""
    if not outputs:
        raise ValueError("a sample expects at least one value")
    return sum(found(answer, value) for value in outputs) / len(outputs)


# --------------------------------------------------------------------------- the book


class Book:
    """The text that stands in for RULER's downloads: its words (split at white space, as RULER splits the
    essays) are the haystack, and its distinct lower-case words of three letters or more the vocabulary of
    keys and of cwe's list (RULER draws both from the wonderwords package)."""

    def __init__(self, text: str):
        self.words = text.split()
        found_words = {word.lower() for word in re.findall(r"[A-Za-z]{3,}", text)}
        self.vocabulary = sorted(found_words)
        if len(self.vocabulary) < 2 * CWE_COMMON:
            raise UsageError(f"the book has {len(self.vocabulary)} distinct words; RULER's tasks need a real book")


def split_sentences(text: str) -> list[str]:
    """``text`` cut after every sentence end (:data:`kvcli.eval.needle.SENTENCE_END`), in place of nltk's punkt."""
    cuts = [0, *(match.end() for match in SENTENCE_END.finditer(text))]
    pieces = [text[start:end].strip() for start, end in zip(cuts, [*cuts[1:], len(text)], strict=True)]
    return [piece for piece in pieces if piece]


def draw(kind: str, rng: random.Random, book: Book) -> str:
    """A random needle key or value of RULER's ``kind``: a 7-digit number, two words joined by a hyphen, a uuid."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(book.vocabulary)}-{rng.choice(book.vocabulary)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# --------------------------------------------------------------------------- samples


@dataclass
class Sample:
    """One sample: ``document`` is read as ask reads a file, ``question`` and ``answer_prefix`` go where ask's
    do, and ``outputs`` are the values the answer must hold. ``tokens``: the prompt as ask builds it plus the
    task's room for the answer, at most ``length``."""

    task: str
    length: int
    index: int
    document: str
    question: str
    answer_prefix: str
    outputs: list[str]
    tokens: int = 0
    doc: list[int] = field(default_factory=list, repr=False)


@dataclass
class Plan:
    """A sample's draws but the haystack's size: ``render(units)`` is the document with ``units`` units of
    haystack (words, noise paragraphs, distractor needles, list words), drawn from the state saved after the
    needles, so that only the haystack changes while it is sized."""

    render: Callable[[int], str]
    question: str
    answer_prefix: str
    outputs: list[str]
    least: int  # units the needles need around them
    most: int  # units the source holds (or a bound far past any length)


def _niah(task: Task, rng: random.Random, book: Book, index: int) -> Plan:
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    while len(keys) < max(task.keys, task.queries):
        key = draw(task.key_type, rng, book)
        if key in keys:
            continue
        keys.append(key)
        values.append([draw(task.value_type, rng, book) for _ in range(task.values)])
        needles += [NIAH_NEEDLE.format(type_needle_v=task.value_type, key=key, value=v) for v in values[-1]]
    rng.shuffle(needles)
    chosen = rng.sample(range(len(keys)), task.queries)
    queries = [keys[i] for i in chosen]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    preamble, question = NIAH_PREAMBLE, NIAH_QUESTION
    kind = task.value_type
    prefix = f"The special magic {kind} for {query} mentioned in the provided text are"
    if task.queries * task.values == 1:  # RULER's singular wording
        preamble = preamble.replace("Some", "A").replace("are", "is")
        question = question.replace("are all", "is")
        kind = kind[:-1]
        prefix = f"The special magic {kind} for {query} mentioned in the provided text is"
    state = rng.getstate()

    def render(units: int) -> str:
        r = random.Random()
        r.setstate(state)
        if task.haystack == "book":
            start = excerpt_offset(len(book.words), units, index)
            sentences = split_sentences(" ".join(book.words[start:start + units]))
            at = sorted(int(len(sentences) * depth / 100) for depth in r.sample(DEPTHS, len(needles)))
            pieces, last = [], 0
            for position, needle in zip(at, needles, strict=True):
                pieces += [*sentences[last:position], needle]
                last = position
            context = " ".join([*pieces, *sentences[last:]])
        else:
            if task.haystack == "repeat":
                lines = [NOISE] * units
            else:
                lines = [NIAH_NEEDLE.format(type_needle_v=task.value_type, key=_other(task.key_type, r, book, keys),
                                            value=draw(task.value_type, r, book)) for _ in range(units)]
            for at, needle in zip(sorted(r.sample(range(units), len(needles)), reverse=True), needles, strict=False):
                lines.insert(at, needle)
            context = "\n".join(lines)
        return f"{preamble.format(type_needle_v=kind)}\n{context}"

    most = len(book.words) if task.haystack == "book" else 10 ** 6
    return Plan(render, question.format(type_needle_v=kind, query=query), prefix,
                [v for i in chosen for v in values[i]], len(needles), most)


def _other(kind: str, rng: random.Random, book: Book, keys: list[str]) -> str:
    """A distractor's key: any key but the real ones."""
    while (key := draw(kind, rng, book)) in keys:
        pass
    return key


def _vt_chain(rng: random.Random, letters: int) -> tuple[list[str], list[str], str]:
    """One chain of RULER's vt: the variables, their assignments and the value they all end up holding."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(VT_HOPS)]
    return names, chain, value


def _vt_context(chain: list[str], units: int, rng: random.Random) -> str:
    sentences = [NOISE + "\n"] * units
    for j, at in enumerate(sorted(rng.sample(range(units), len(chain)))):
        sentences.insert(at + j, chain[j])
    return " ".join(sentences).replace(". \n", ".\n")


def _vt(task: Task, rng: random.Random, book: Book, index: int) -> Plan:
    ex_names, ex_chain, ex_value = _vt_chain(rng, 3)
    example = (f"{VT_PREAMBLE}\n\n{_vt_context(ex_chain, VT_EXAMPLE_UNITS, rng)}\nQuestion: "
               f"{VT_QUESTION.format(query=ex_value)} Answer: "
               f"{VT_PREFIX.format(num_v=VT_HOPS + 1, query=ex_value)} {' '.join(ex_names)}")
    names, chain, value = _vt_chain(rng, 5)
    state = rng.getstate()

    def render(units: int) -> str:
        r = random.Random()
        r.setstate(state)
        return f"{example}\n\n{VT_PREAMBLE}\n\n{_vt_context(chain, units, r)}"

    return Plan(render, VT_QUESTION.format(query=value), VT_PREFIX.format(num_v=VT_HOPS + 1, query=value), names,
                len(chain), 10 ** 6)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _cwe_list(rng: random.Random, common: list[str], uncommon: list[str], repeats: tuple[int, int]) -> str:
    """RULER's list: each common word ``repeats[0]`` times, each other word ``repeats[1]`` times, shuffled."""
    listed = common * repeats[0] + uncommon * repeats[1]
    rng.shuffle(listed)
    return _numbered(listed)


def _cwe(task: Task, rng: random.Random, book: Book, index: int, length: int) -> Plan:
    # RULER's (common, uncommon) repeats of the worked example and of the task: below 4,096 tokens, and from 4,096 on.
    example_repeats, repeats = ((3, 1), (6, 1)) if length < 4096 else ((10, 3), (30, 3))
    shown = rng.sample(book.vocabulary, 2 * CWE_COMMON if length < 4096 else 4 * CWE_COMMON)
    example = (f"{CWE_PREAMBLE}\n{_cwe_list(rng, shown[:CWE_COMMON], shown[CWE_COMMON:], example_repeats)}\n"
               f"Question: {CWE_QUESTION} Answer: {CWE_PREFIX} {_numbered(shown[:CWE_COMMON])}")
    common = rng.sample(book.vocabulary, CWE_COMMON)
    others = [word for word in book.vocabulary if word not in common]
    state = rng.getstate()

    def render(units: int) -> str:
        r = random.Random()
        r.setstate(state)
        return f"{example}\n{CWE_PREAMBLE}\n{_cwe_list(r, common, r.sample(others, units), repeats)}"

    return Plan(render, CWE_QUESTION, CWE_PREFIX, common, 1, len(others))


def _fwe(task: Task, rng: random.Random, book: Book, index: int, length: int) -> Plan:
    size = max(length // 50, 5)  # RULER's vocabulary: a coded word per 50 tokens
    vocabulary: set[str] = set()
    while len(vocabulary) < size:
        vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    coded = sorted(vocabulary)
    rng.shuffle(coded)
    coded[0] = "..."  # the most frequent word is noise, as in RULER
    zeta = math.pi ** 2 / 6  # zeta(ALPHA) for ALPHA 2
    state = rng.getstate()

    def render(units: int) -> str:
        r = random.Random()
        r.setstate(state)
        words = [w for k, w in enumerate(coded, start=1) for _ in range(int(units * k ** -FWE_ALPHA / zeta))]
        r.shuffle(words)
        return f"{FWE_PREAMBLE} {' '.join(words)}"

    return Plan(render, FWE_QUESTION, FWE_PREFIX, coded[1:4], 100, 10 ** 7)


def plan(task: Task, rng: random.Random, book: Book, index: int, length: int) -> Plan:
    """The draws of one sample of ``task`` (its haystack not yet sized)."""
    if task.kind == "niah":
        return _niah(task, rng, book, index)
    if task.kind == "vt":
        return _vt(task, rng, book, index)
    if task.kind == "cwe":
        return _cwe(task, rng, book, index, length)
    return _fwe(task, rng, book, index, length)


def make_sample(tokenizer, book: Book, name: str, length: int, index: int, seed: int = 0) -> Sample:
    """Sample ``index`` of task ``name`` at ``length`` tokens: the largest haystack whose prompt, as ``kvcli ask``
    builds it, plus the task's room for the answer, fits ``length`` tokens of ``tokenizer``."""
    task = TASKS[name]
    rng = random.Random(f"{seed}:{name}:{length}:{index}")  # a string seeds the same on every run and platform
    drafted = plan(task, rng, book, index, length)
    parts = build_prompt(tokenizer, question_instruction(drafted.question, drafted.answer_prefix))
    fixed = len(parts.prefix) + len(parts.suffix) + task.reserve
    sizes: dict[int, list[int]] = {}

    def tokens(units: int) -> int:
        if units not in sizes:
            sizes[units] = encode(tokenizer, drafted.render(units))
        return fixed + len(sizes[units])

    units = fit(tokens, length, drafted.least, drafted.most, f"{name} at {length:,} tokens")
    return Sample(name, length, index, drafted.render(units), drafted.question, drafted.answer_prefix,
                  list(drafted.outputs), tokens(units), sizes[units])


def fit(tokens: Callable[[int], int], length: int, least: int, most: int, what: str) -> int:
    """The most units in ``[least, most]`` with ``tokens(units) <= length`` (``tokens`` grows with units): doubling,
    then halving the gap, so no text tried is much longer than ``length``."""
    if tokens(least) > length:
        raise UsageError(f"{what}: the prompt and the answer's room alone take {tokens(least):,} tokens; "
                         "choose a longer length")
    low, high = least, least
    while tokens(high) <= length:
        if high >= most:
            raise UsageError(f"{what}: the book runs out ({most:,} units) before the haystack fills the length; "
                             "give a longer book or a shorter length")
        low, high = high, min(max(2 * high, high + 1), most)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if tokens(middle) <= length else (low, middle)
    return low


# --------------------------------------------------------------------------- export for kvpress

#: What goes between the context and the question in the user's turn: what :func:`build_prompt` puts between
#: the document and ask's instruction, so that kvpress's prompt is kvcli's with the bare question for ask's frame.
KVPRESS_SEPARATOR = "\n\n"


def answer_limit(name: str, max_new_tokens: int | None) -> int:
    """The most tokens an answer to task ``name`` may have: the task's own (:attr:`Task.answer_tokens`), capped by
    ``--max-new-tokens``."""
    return min(TASKS[name].answer_tokens, max_new_tokens or TASKS[name].answer_tokens)


def export_record(tokenizer, sample: Sample, seed: int, answer_tokens: int, about: dict) -> dict:
    """One line of ``kvcli ruler --export``: ``sample`` as kvpress's pipeline takes it (``context`` is what it
    compresses after the chat template's opening, ``question`` what it appends whole before the end of the turn,
    ``answer_prefix`` what starts the assistant's turn), the values the grader expects, the answer's token limit,
    and kvcli's own count of the prompt it would read (``context_tokens`` C and ``question_tokens`` Q, ask's frame
    included: docs/ruler.md), so that a kvpress row and a kvcli trial join on (task, length, index)."""
    parts = build_prompt(tokenizer, question_instruction(sample.question, sample.answer_prefix))
    return {"task": sample.task, "length": sample.length, "index": sample.index, "seed": seed,
            "context": sample.document, "question": KVPRESS_SEPARATOR + sample.question,
            "answer_prefix": sample.answer_prefix, "outputs": list(sample.outputs), "answer_tokens": answer_tokens,
            "tokens": sample.tokens, "context_tokens": len(parts.prefix) + len(sample.doc),
            "question_tokens": len(parts.suffix), **about}


def export_samples(tokenizer, book: Book, tasks: Iterable[str], lengths: Iterable[int], samples: int, *,
                   seed: int = 0, max_new_tokens: int | None = None, about: dict | None = None,
                   on_sample: Callable[[dict], None] | None = None) -> list[dict]:
    """Every sample a ``kvcli ruler`` run with the same tasks, lengths, samples and seed reads (the same
    :func:`make_sample`, in the run's order), as :func:`export_record` lines. ``about`` (the book's digest, the
    model, its chat template's digest) goes into every line. Nothing but the tokenizer runs."""
    records = []
    for length in lengths:
        for name in tasks:
            if name not in TASKS:
                raise UsageError(f"unknown task {name!r}; choose from: {', '.join(TASKS)}")
            answer_tokens = answer_limit(name, max_new_tokens)
            for index in range(samples):
                sample = make_sample(tokenizer, book, name, length, index, seed)
                records.append(export_record(tokenizer, sample, seed, answer_tokens, dict(about or {})))
                if on_sample:
                    on_sample(records[-1])
    return records


def template_digest(tokenizer) -> str | None:
    """The sha256 of the tokenizer's chat template (None without one): which template sized an export."""
    import hashlib

    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(template.encode("utf-8")).hexdigest() if isinstance(template, str) else None


# --------------------------------------------------------------------------- trials


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
    from kvcli.engine.engine import Engine, check_budget
    from kvcli.methods import make_method
    from kvcli.reading.prompts import stop_token_ids

    tasks, methods, lengths = list(tasks), list(methods), list(lengths)
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
    result = RulerResult(settings={"cache": None if ratios else budget, "ratios": list(ratios) if ratios else None,
                                   "block": block, "seed": seed, "samples": samples,
                                   "max_new_tokens": max_new_tokens, "one_shot": one_shot, "probe": probe,
                                   "kv_bits": kv_bits, "recap": recap, "frame": question_frame(tokenizer, frame),
                                   "saved": saved, "params": {name: m.settings() for name, m in built.items()}})
    levels: list[float | None] = list(ratios) if ratios else [None]
    wanted = grid_keys(tasks, lengths, samples, methods, levels)
    previous: dict[tuple, Trial] = {}
    if log is not None:
        # A row's ratio is in its key, not in the run: a resume may add ratios, as it may add tasks or samples.
        # A read that knew its question records no ``saved``: the rows written before reads from a saved one
        # existed are its rows.
        run = {key: value for key, value in result.settings.items()
               if key not in ("params", "samples", "ratios") and not (key == "saved" and value is None)}
        run.update(dtype=str(next(model.parameters()).dtype), book_sha256=book_digest)
        previous = log.open(run, result.settings["params"], wanted)
    reading = Reading(model, tokenizer, built, block, kv_bits, recap, one_shot, probe, warn,
                      stop_token_ids(tokenizer, model), saved)
    for length in lengths:
        for name in tasks:
            answer_tokens = answer_limit(name, max_new_tokens)
            for index in range(samples):
                sample = make_sample(tokenizer, book, name, length, index, seed)
                parts = build_prompt(tokenizer, question_instruction(sample.question, sample.answer_prefix, frame))
                # A method that ignores the budget (full) reads a sample once; its other ratios are that read.
                read_once: dict[str, Trial] = {}
                for ratio in levels:
                    cache = budget if ratio is None else ratio_budget(parts, sample, ratio)
                    if ratio is not None:
                        check_ratio_budget(built, cache, ratio, sample)
                    for method in methods:
                        trial = previous.get((name, length, index, method, ratio))
                        if trial is None:
                            trial = (replace(read_once[method], ratio=ratio, cache=cache) if method in read_once
                                     else reading.trial(sample, parts, method, ratio, cache, answer_tokens))
                            if log is not None:
                                log.add(trial)
                        else:
                            check_resumed(trial, sample, cache)
                        if built[method].unbounded:
                            read_once.setdefault(method, trial)
                        result.trials.append(trial)
                        if on_trial:
                            on_trial(trial, len(result.trials), len(wanted))
    return result


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
