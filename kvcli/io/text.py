"""Turning documents into tokens a piece at a time.

Documents (:mod:`kvcli.io.documents`) arrive in pieces of about ``chunk_chars`` characters and are
tokenized as they arrive. The token stream of a document is nevertheless exactly
``tokenizer(whole_text).input_ids``; see :func:`iter_tokens` for how chunk boundaries are made invisible.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvcli.errors import EmptyDocumentError
from kvcli.io.documents import Document

# A tokenizer only sees text up to the end of the current buffer, so the last few tokens it
# produces may change once more text arrives (a word or a whitespace run can continue).  A
# cut is only made with this many tokens and characters of text still after it.
_MARGIN_TOKENS = 8
_MARGIN_CHARS = 32
# Tokens of already emitted text that are tokenized again in front of the next buffer, so
# that tokenizers which treat the start of their input specially (SentencePiece's dummy
# "▁" prefix) only do so to text whose tokens are thrown away.
_CONTEXT_TOKENS = 4
# Without whitespace to cut at, a buffer may grow to this many pieces before cutting
# anywhere else (a megabyte of text without a single space or newline is not prose).
_FALLBACK_PIECES = 4


@dataclass
class TokenChunk:
    """Consecutive tokens of a document, with the size of the text they stand for."""

    ids: list[int]
    num_bytes: int
    """UTF-8 length of the text behind ``ids``, so that bits per byte can be computed from
    any prefix of the stream; over a whole document it sums to ``len(text.encode())``."""



# --------------------------------------------------------------------------- tokens


def iter_tokens(doc: Document, tokenizer: Any, *, add_special_tokens: bool = True) -> Iterator[TokenChunk]:
    """Tokenize a document as it is read, giving exactly ``tokenizer(text).input_ids``.

    The text is tokenized a buffer at a time.  Tokens near the end of a buffer are not final
    (the word or whitespace run there may go on), so each buffer is cut at a point with
    several tokens still after it, and only where whitespace follows a non-space character:
    pre-tokenizers of BPE models (GPT-2, Llama 3, SmolLM, ...) always start a new piece there,
    and the text after it tokenizes the same on its own as in the whole text.  The rest of the
    buffer, preceded by a few tokens' worth of text already emitted (whose tokens are thrown
    away again), is tokenized with the next piece.  Special tokens the tokenizer adds (BOS,
    EOS) appear once, at the start and end of the document.

    Text without whitespace for several pieces is cut at a word/punctuation boundary or,
    failing that, any token boundary, so that memory stays bounded at a small risk of a
    different token there.  A tokenizer without offsets (a "slow" one) gets the whole text.

    Raises :class:`EmptyDocumentError` if the document has nothing but whitespace.
    """
    if not getattr(tokenizer, "is_fast", False):
        yield from _iter_tokens_whole(doc, tokenizer, add_special_tokens)
        return
    leading, trailing = _special_affixes(tokenizer) if add_special_tokens else ([], [])
    buffer = ""  # already emitted context, then text not yet emitted
    emitted = 0  # length of that context in buffer
    has_text = False
    largest_piece = 1
    for piece in doc.read_chunks():
        if not piece:
            continue
        largest_piece = max(largest_piece, len(piece))
        has_text = has_text or not piece.isspace()
        buffer += piece
        if not has_text:
            continue
        fallback = len(buffer) - emitted > _FALLBACK_PIECES * largest_piece
        cut = _cut(tokenizer, buffer, emitted, fallback)
        if cut is None:
            continue
        ids, end, context_start = cut
        yield TokenChunk(leading + ids, _utf8_len(buffer[emitted:end]))
        leading = []
        buffer = buffer[context_start:]
        emitted = end - context_start
    if not has_text:
        raise EmptyDocumentError(doc.name)
    ids, offsets = _encode(tokenizer, buffer)
    first = _first_new_token(offsets, emitted, tokenizer)
    yield TokenChunk(leading + ids[first:] + trailing, _utf8_len(buffer[emitted:]))


def _iter_tokens_whole(doc: Document, tokenizer: Any, add_special_tokens: bool) -> Iterator[TokenChunk]:
    text = "".join(doc.read_chunks())
    if not text.strip():
        raise EmptyDocumentError(doc.name)
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    yield TokenChunk(list(ids), _utf8_len(text))


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def _encode(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    # verbose=False: a buffer longer than the model's context is expected here, not a mistake.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(encoding["input_ids"]), [tuple(span) for span in encoding["offset_mapping"]]


def leading_special_tokens(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (a BOS, or nothing): what starts every
    document of a token stream, and every window of ``kvcli ppl --context``."""
    return _special_affixes(tokenizer)[0]


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (BOS, EOS, CLS, ...).

    Buffers are tokenized without them, so they are learned once from a probe and added at
    the start and end of the document only.
    """
    probe = tokenizer("x", add_special_tokens=True, return_special_tokens_mask=True, verbose=False)
    ids = list(probe["input_ids"])
    text_positions = [i for i, special in enumerate(probe["special_tokens_mask"]) if not special]
    if not text_positions:
        return ids, []
    return ids[: text_positions[0]], ids[text_positions[-1] + 1 :]


def _first_new_token(offsets: list[tuple[int, int]], emitted: int, tokenizer: Any) -> int:
    """Index of the first token after the context, which must end exactly where a token does.

    Anything else means this tokenizer tokenized the text differently after a cut than in
    one piece, and the stream would silently differ from tokenizing the whole text.
    """
    if emitted == 0:
        return 0
    first = 0
    while first < len(offsets) and offsets[first][1] <= emitted:
        first += 1
    if any(start < emitted for start, _ in offsets[first:]):
        raise RuntimeError(
            f"{type(tokenizer).__name__} tokenized across a chunk boundary; "
            "incremental tokenization is not exact for this tokenizer"
        )
    return first


def _cut_tier(before: str, after: str) -> int:
    """How safe a token boundary between two characters is to restart tokenizing from.

    0: whitespace after non-whitespace, a new pre-token for every common BPE tokenizer.
    1: punctuation after a letter or digit, also a new pre-token for GPT-2 and Llama 3 rules.
    2: anything else, where only the tokens' own boundary speaks for it.
    """
    if after.isspace():
        return 0 if not before.isspace() else 2
    if before.isalnum() and not after.isalnum():
        return 1
    return 2


def _cut(tokenizer: Any, buffer: str, emitted: int, fallback: bool) -> tuple[list[int], int, int] | None:
    """Tokenize the buffer and pick where to stop emitting for now.

    Returns the new tokens before the cut, the cut position and where the context for the
    next buffer starts; None if there is no safe cut yet and more text should be read.
    """
    ids, offsets = _encode(tokenizer, buffer)
    first = _first_new_token(offsets, emitted, tokenizer)

    def boundaries() -> Iterator[tuple[int, int, int]]:
        """(index of the token after it, position, tier) of usable boundaries, last first."""
        for index in range(len(ids) - _MARGIN_TOKENS, first, -1):
            position = offsets[index - 1][1]
            # Tokens that share a character (the bytes of an emoji) have no boundary between;
            # trimmed offsets (a ByteLevel post-processor) can put an end inside the context.
            if emitted < position <= len(buffer) - _MARGIN_CHARS and offsets[index][0] >= position:
                yield index, position, _cut_tier(buffer[position - 1], buffer[position])

    for wanted_tier in (0, 1, 2) if fallback else (0,):
        chosen: tuple[int, int] | None = None
        for index, position, tier in boundaries():
            if tier != wanted_tier:
                continue
            if chosen is None:
                chosen = index, position
            elif index <= chosen[0] - _CONTEXT_TOKENS:
                return ids[first : chosen[0]], chosen[1], position
        if chosen is not None:
            return ids[first : chosen[0]], chosen[1], 0
    return None


# --------------------------------------------------------------------------- streams


def token_stream(documents: Iterable[Document], tokenizer: Any, *, special_tokens: bool = True,
                 separator: str | None = None) -> Iterator[TokenChunk]:
    """The tokens of ``documents`` one after another: the one way kvcli turns documents into a stream.

    ``special_tokens`` gives every document its own BOS/EOS (what perplexity scores); without them
    and with a ``separator`` (``"\\n\\n"``) the documents read as one text inside a prompt whose
    prefix carries the special tokens (``summarize``, ``ask``, ``needle``). Empty chunks are skipped.
    """
    joint = list(tokenizer(separator, add_special_tokens=False, verbose=False).input_ids) if separator else []
    for index, doc in enumerate(documents):
        if index and joint:
            yield TokenChunk(list(joint), _utf8_len(separator))
        for chunk in iter_tokens(doc, tokenizer, add_special_tokens=special_tokens):
            if chunk.ids:
                yield chunk


class TokenFeed:
    """Token ids of a chunk stream, cut after ``limit`` tokens, counting the UTF-8 bytes they cover.

    Iterating yields lists of ids; ``tokens`` and ``num_bytes`` grow as it goes (what was read, which
    runs ahead of what was scored). :meth:`bytes_at` gives the bytes behind the first ``position``
    tokens exactly at chunk ends and by decoding inside a chunk, so that a stream stopped early
    (Ctrl-C) reports bits per byte over the text it scored, not the text read ahead. ``lookback`` is
    how many tokens the reader may hold unscored (its block, or a window): chunks further back are
    forgotten, so memory stays bounded however long the stream.
    """

    def __init__(self, chunks: Iterable[TokenChunk], tokenizer: Any, limit: int | None, lookback: int | None = None):
        self.chunks = chunks
        self.tokenizer = tokenizer
        self.limit = limit
        self.lookback = lookback
        self.tokens = 0
        self.num_bytes = 0
        self._recent: list[tuple[int, int, list[int], int]] = []  # (first token, bytes before it, ids, bytes)

    def _keep(self, ids: list[int], num_bytes: int) -> None:
        self._recent.append((self.tokens, self.num_bytes, ids, num_bytes))
        if self.lookback is not None:
            horizon = self.tokens - self.lookback
            while len(self._recent) > 1 and self._recent[1][0] <= horizon:
                self._recent.pop(0)
        self.tokens += len(ids)
        self.num_bytes += num_bytes

    def __iter__(self) -> Iterator[list[int]]:
        for chunk in self.chunks:
            ids = chunk.ids
            if self.limit is not None and self.tokens + len(ids) >= self.limit:
                ids = ids[: self.limit - self.tokens]
                if ids:
                    self._keep(ids, self._decoded_bytes(ids))
                    yield ids
                return
            self._keep(ids, chunk.num_bytes)
            yield ids

    def _decoded_bytes(self, ids: list[int]) -> int:
        # Special tokens (BOS, EOS) stand for no text of the document: a chunk's bytes never count them.
        return _utf8_len(self.tokenizer.decode(ids, skip_special_tokens=True)) if ids else 0

    def bytes_at(self, position: int) -> int:
        """UTF-8 bytes of the text behind the stream's first ``position`` tokens (all of them read already)."""
        if position >= self.tokens:
            return self.num_bytes
        for first, before, ids, num_bytes in reversed(self._recent):
            if first <= position:
                inside = position - first
                return before + (num_bytes if inside >= len(ids) else self._decoded_bytes(ids[:inside]))
        return self._recent[0][1] if self._recent else 0  # before what lookback kept: the nearest chunk start


def first_tokens(documents: Iterable[Document], tokenizer: Any, limit: int | None, **stream: Any
                 ) -> tuple[list[int], int]:
    """The first ``limit`` tokens of :func:`token_stream` (all when None) and the UTF-8 bytes they stand for.

    For scoring or cutting the same tokens many times (``kvcli bench``, ``needle``, ``analyze``):
    tokenize once, keep the ids. Takes :func:`token_stream`'s keyword arguments.
    """
    feed = TokenFeed(token_stream(documents, tokenizer, **stream), tokenizer, limit)
    ids = [token for chunk in feed for token in chunk]
    return ids, feed.num_bytes
