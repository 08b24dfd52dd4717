"""A summary of a long document in sections: each section summarized as it streams, then the summaries.

``kvcli summarize`` reads a document longer than one section this way. Written in one pass from a cache
compressed to 1,024 tokens, a summary of a whole book holds what the cache kept, mostly its last scene, and
a small model loops on it (docs/notes/2026-11-27-repetition.md). Here the document streams in sections of
``section`` tokens; each is read into a fresh compressed cache with the summary instruction after it and
summarized in at most ``section_new_tokens`` tokens, then dropped, so memory stays one cache whatever the
length. The section summaries, in order and joined by blank lines, are then read as one short document with
the user's instruction, and that summary is the answer. Sections end at a line break where one is near, so
that a section rarely starts in the middle of a word.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from kvcli.reading.prompts import TEMPLATES, Instruction, PromptParts, build_prompt, encode

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads the defaults below without it
    from kvcli.reading.generate import Generation
    from kvcli.reading.reader import Reader

#: Tokens of a section by default: read in one shot on a CPU (kvcli.reading.reader.ONE_SHOT_CAP), compressed to
#: the cache (chosen on the tuning books: docs/notes/2026-11-27-repetition.md).
SECTION_TOKENS = 4096
#: Tokens a section's summary may take: a few sentences.
SECTION_NEW_TOKENS = 96
#: What every section is asked.
SECTION_INSTRUCTION = TEMPLATES["summary"]
#: Between two section summaries in the document the last pass reads.
SECTION_SEPARATOR = "\n\n"


@dataclass
class Section:
    """One section of the document: where it starts (tokens), its length and its summary."""

    start: int
    tokens: int
    summary: str

    def as_dict(self) -> dict:
        return {"start": self.start, "tokens": self.tokens, "summary": self.summary}


def split_sections(chunks: Iterable[list[int]], size: int, is_break: Callable[[int], bool] = lambda token: False
                   ) -> Iterator[list[int]]:
    """The token ids of ``chunks`` in sections of at most ``size`` tokens; a section ends after the last token of
    its last quarter for which ``is_break`` holds (a line break), else at ``size``. The last section takes up to a
    quarter of ``size`` more rather than leave a remainder that short (a few hundred tokens summarized alone made
    the default model describe itself: "a helpful AI assistant named SmolLM")."""
    pending: list[int] = []
    for chunk in chunks:
        pending.extend(chunk)
        while len(pending) > size + size // 4:
            cut = size
            for index in range(size - 1, size - size // 4 - 1, -1):
                if is_break(pending[index]):
                    cut = index + 1
                    break
            yield pending[:cut]
            del pending[:cut]
    if pending:
        yield pending


def line_breaks(tokenizer) -> Callable[[int], bool]:
    """Whether a token id's text holds a line break (decoded once per id)."""

    @cache
    def is_break(token: int) -> bool:
        return "\n" in tokenizer.decode([token])

    return is_break


def summarize_in_sections(reader: Reader, instruction: Instruction, document: Iterable[list[int]],
                          max_new_tokens: int, *, section: int = SECTION_TOKENS, combine: bool = False,
                          one_shot: bool | None = None, probe: bool = True,
                          on_section: Callable[[int, Section], None] | None = None,
                          on_text: Callable[[str], None] | None = None,
                          on_read: Callable[[Generation], None] | None = None) -> tuple[Generation, list[Section]]:
    """Summarize ``document`` with ``instruction``: in one pass if it fits one section (or ``section`` is 0),
    else section by section (the module's text). Returns a :class:`Generation` whose token counts and times
    cover every pass, and the sections (none for one pass).

    Without ``combine`` (the default summary) the answer is the sections' summaries in order, each streamed
    through ``on_text`` as it is written (``on_read`` before the first), a blank line between two; with
    ``combine`` (another instruction: a TL;DR, key points, the user's prompt) the summaries are read as one
    text with ``instruction``, and that last pass writes the answer. ``on_section(index, section)`` after each
    section's summary. A section's summary takes at most :data:`SECTION_NEW_TOKENS` (or ``max_new_tokens``,
    if fewer).
    """
    from kvcli.reading.generate import Generation

    tokenizer = reader.tokenizer
    parts = build_prompt(tokenizer, instruction)
    if section <= 0:
        return reader.run(parts, document, max_new_tokens, one_shot=one_shot, probe=probe, on_text=on_text,
                          on_read=on_read), []
    pieces = split_sections(document, section, line_breaks(tokenizer))
    first = next(pieces, [])
    second = next(pieces, None)
    if second is None:
        return reader.run(parts, [first], max_new_tokens, one_shot=one_shot, probe=probe, on_text=on_text,
                          on_read=on_read), []
    section_parts = build_prompt(tokenizer, SECTION_INSTRUCTION)
    stream = None if combine else on_text
    sections: list[Section] = []
    spent, written = Generation(), Generation()
    texts: list[str] = []  # each section's summary as streamed
    start = 0
    for ids in _chain_sections(first, second, pieces):
        if stream and sections:
            stream(SECTION_SEPARATOR)
        gen = _read_section(reader, section_parts, ids, start, min(SECTION_NEW_TOKENS, max_new_tokens), one_shot,
                            probe, on_text=stream, on_read=on_read if stream and not sections else None)
        sections.append(Section(start, len(ids), gen.text.strip()))
        texts.append(gen.text)
        start += len(ids)
        _add(spent, gen)
        written.ids.extend(gen.ids)
        written.finish_reason, written.kv_cache_bytes = gen.finish_reason, gen.kv_cache_bytes
        if gen.finish_reason == "interrupted":  # Ctrl-C: the answer is what the sections said so far
            if not stream:
                if on_read:
                    on_read(gen)
                if on_text:
                    on_text(_joined(sections))
            break
        if on_section:
            on_section(len(sections) - 1, sections[-1])
    if combine and written.finish_reason != "interrupted":
        final = reader.run(parts, [encode(tokenizer, _joined(sections))], max_new_tokens, one_shot=one_shot,
                           probe=probe, on_text=on_text, on_read=on_read)
        return _total(final, spent, start, len(sections)), sections
    written.text = SECTION_SEPARATOR.join(texts)  # what on_text was given
    return _total(written, spent, start, len(sections)), sections


def _joined(sections: list[Section]) -> str:
    """The section summaries in order, as one text."""
    return SECTION_SEPARATOR.join(s.summary for s in sections if s.summary)


def _chain_sections(first: list[int], second: list[int], rest: Iterator[list[int]]) -> Iterator[list[int]]:
    yield first
    yield second
    yield from rest


def _read_section(reader: Reader, parts: PromptParts, ids: list[int], start: int, max_new_tokens: int,
                  one_shot: bool | None, probe: bool, **callbacks) -> Generation:
    """One section read and summarized (``callbacks`` as for :meth:`Reader.run`), the reader's progress counting
    from ``start`` (the document's tokens before it)."""
    report = reader.on_progress
    if report is not None:
        reader.on_progress = lambda read, cached, seconds: report(start + read, cached, seconds)
    try:
        return reader.run(parts, [ids], max_new_tokens, one_shot=one_shot, probe=probe, **callbacks)
    finally:
        reader.on_progress = report


def _add(spent: Generation, gen: Generation) -> None:
    """What a pass read, wrote and took, added to ``spent``."""
    spent.prompt_tokens += gen.prompt_tokens
    spent.max_cache_tokens = max(spent.max_cache_tokens, gen.max_cache_tokens)
    spent.read_seconds += gen.read_seconds
    spent.write_seconds += gen.write_seconds


def _total(final: Generation, spent: Generation, document_tokens: int, sections: int) -> Generation:
    """``final`` with the token counts and times of every pass before it, over ``document_tokens`` read in
    ``sections``."""
    _add(spent, final)
    final.prompt_tokens = spent.prompt_tokens
    final.max_cache_tokens = spent.max_cache_tokens
    final.read_seconds, final.write_seconds = spent.read_seconds, spent.write_seconds
    final.document_tokens = document_tokens
    final.one_shot = False
    final.sections = sections
    return final
