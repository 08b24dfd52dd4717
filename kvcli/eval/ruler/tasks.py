"""RULER's tasks and how one sample of each is drawn from a book and sized with the model's tokenizer.

The tasks, templates, needle types and answer prefixes are RULER's (NVIDIA's ``scripts/data/synthetic/`` as
lm-eval 0.4.13 ships them in ``lm_eval/tasks/ruler``). What needs a download in RULER comes from the book the user
gives instead (docs/ruler.md): the essay haystack is the book's text with the needles put in at sentence ends, and
the words of keys and of cwe's list are the book's own. A sample's draws come from its seed, task, length and index
only, so each sample is the same whatever else a run asks for.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcli.errors import UsageError
from kvcli.eval.needle import SENTENCE_END, excerpt_offset
from kvcli.reading.prompts import build_prompt, encode, question_instruction


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




def answer_limit(name: str, max_new_tokens: int | None) -> int:
    """The most tokens an answer to task ``name`` may have: the task's own (:attr:`Task.answer_tokens`), capped by
    ``--max-new-tokens``."""
    return min(TASKS[name].answer_tokens, max_new_tokens or TASKS[name].answer_tokens)

