"""``kvcli ruler --export``: the samples a run reads, written as kvpress's pipeline takes them (docs/ruler.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvcli.errors import UsageError
from kvcli.eval.ruler.tasks import TASKS, Book, Sample, answer_limit, make_sample
from kvcli.reading.prompts import build_prompt, question_instruction

#: What goes between the context and the question in the user's turn: what :func:`build_prompt` puts between
#: the document and ask's instruction, so that kvpress's prompt is kvcli's with the bare question for ask's frame.
KVPRESS_SEPARATOR = "\n\n"


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
