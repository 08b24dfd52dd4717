"""Reading documents and turning them into tokens a piece at a time.

Books and corpora can be far larger than memory, so nothing here reads a whole file: text
arrives in pieces of about ``chunk_chars`` characters and is tokenized as it arrives.  The
token stream of a document is nevertheless exactly ``tokenizer(whole_text).input_ids``; see
:func:`iter_tokens` for how chunk boundaries are made invisible.

Text is decoded from bytes by this module rather than by ``open(..., "r")``:

* no newline translation happens (as with ``newline=""``), so CRLF files are tokenized with
  their ``\\r`` characters, exactly as the bytes say;
* a UTF-8 byte order mark at the start of a file is dropped (it is an encoding marker, not
  text); other encodings are decoded as given;
* bytes that are not valid in the encoding become U+FFFD and produce one warning per
  document, instead of an exception half-way through a multi-gigabyte file.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvcli.errors import KvcliError, UsageError

DEFAULT_CHUNK_CHARS = 1 << 20
# Reads start this small and double up to ``chunk_chars``: the first block waits only for a small
# piece to be tokenized (a command reading 64 tokens of a book tokenizes kilobytes, not a megabyte),
# while a long stream soon reads in large pieces.
_FIRST_READ = 1 << 14

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

PG19 = "pg19"
# emozilla/pg19-test is plain parquet; deepmind/pg19 is the original but needs a loading
# script, which recent versions of `datasets` refuse to run.
_PG19_HUB_REPOS = ("emozilla/pg19-test", "deepmind/pg19")
_PG19_TEST_BOOKS = 100
_PG19_HELP = (
    "pg19 needs the network (pip install 'kvcli[datasets]') or local books: "
    "pass --data-dir DIR or set KVCLI_DATA=DIR (a folder of .txt files)"
)


@dataclass
class Document:
    """One text to evaluate; its text is read only when :attr:`read_chunks` is called."""

    name: str
    """File path, ``"<stdin>"`` or a dataset row id such as ``"pg19[3]"``: used in messages."""
    read_chunks: Callable[[], Iterator[str]]
    """Returns an iterator over the text in pieces of about ``chunk_chars`` characters.

    Call it once: standard input cannot be read twice.
    """
    size: int | None = None
    """Bytes of the file behind it (None for standard input and data set rows): what a corpus job
    balances ranks by."""
    open_bytes: Callable[[], BinaryIO] | None = None
    """The raw bytes behind the text (a file opened again, stdin), for :meth:`content_matches`; None for
    data set rows, which have no bytes of their own."""
    read: ContentHash | None = None
    """What the last :attr:`read_chunks` consumed: the count and SHA-256 of the raw bytes, growing as it reads."""

    def content_matches(self, count: int, sha256: str) -> bool:
        """Whether the document's first ``count`` raw bytes still hash to ``sha256`` (a row written earlier is
        of this content); True when there are no bytes to compare. Standard input is consumed doing so."""
        if self.open_bytes is None:
            return True
        digest = hashlib.sha256()
        left = count
        try:
            stream = self.open_bytes()
            while left > 0:
                data = stream.read(min(left, 1 << 20))
                if not data:
                    return False
                digest.update(data)
                left -= len(data)
        except OSError as error:
            raise KvcliError(f"cannot read {self.name}: {error.strerror or error}") from error
        return digest.hexdigest() == sha256


class ContentHash:
    """Bytes consumed from a source, counted and hashed as they are read."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.count = 0

    def update(self, data: bytes) -> None:
        self.hash.update(data)
        self.count += len(data)

    @property
    def sha256(self) -> str:
        return self.hash.hexdigest()


@dataclass
class TokenChunk:
    """Consecutive tokens of a document, with the size of the text they stand for."""

    ids: list[int]
    num_bytes: int
    """UTF-8 length of the text behind ``ids``, so that bits per byte can be computed from
    any prefix of the stream; over a whole document it sums to ``len(text.encode())``."""


def _print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def open_source(
    source: str,
    *,
    encoding: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    warn: Callable[[str], None] | None = None,
) -> list[Document]:
    """Resolve SOURCE into documents, failing now rather than after a model has loaded.

    SOURCE is a text file, a directory (each ``*.txt`` file in it, sorted by name, is one
    document), ``-`` for standard input, or ``pg19``.  An existing path wins over the dataset
    name, so a local folder called ``pg19`` is read as a folder.

    Missing files, unknown encodings and a ``pg19`` that can be found neither locally nor on
    the hub raise :class:`KvcliError` here; whether a document is empty is only known once
    it is read (see :func:`iter_tokens`).
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    if encoding is not None:
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise UsageError(f"unknown encoding: {encoding}") from None  # a bad --encoding: usage, exit 2
    warn = warn or _print_warning

    if source == "-":
        return [_stream_document("<stdin>", lambda: sys.stdin.buffer, encoding, chunk_chars, warn)]
    path = Path(source)
    if source and path.exists():
        if path.is_dir():
            return _directory_documents(path, encoding, chunk_chars, warn)
        return [_file_document(path, source, encoding, chunk_chars, warn)]
    if source == PG19:
        return _pg19_documents(data_dir, encoding, chunk_chars, warn)
    raise KvcliError(f"no such file: {source}")


def read_text(source: str, **kwargs: Any) -> str:
    """Whole text of a small source (a question, a prompt), documents joined by a blank line.

    Takes the keyword arguments of :func:`open_source`.  Unlike :func:`iter_tokens` this holds
    everything in memory, which is the point for short inputs.
    """
    texts = []
    for doc in open_source(source, **kwargs):
        text = "".join(doc.read_chunks())
        if not text.strip():
            raise KvcliError(f"input is empty: {doc.name}")
        texts.append(text)
    return "\n\n".join(texts)


# --------------------------------------------------------------------------- sources


def _file_document(
    path: Path, name: str, encoding: str | None, chunk_chars: int, warn: Callable[[str], None]
) -> Document:
    if not os.access(path, os.R_OK):
        raise KvcliError(f"cannot read {name}: permission denied")

    def read_chunks() -> Iterator[str]:
        document.read = ContentHash()
        try:
            with open(path, "rb") as stream:
                yield from _decode(stream, name, encoding, chunk_chars, warn, document.read)
        except OSError as error:
            raise KvcliError(f"cannot read {name}: {error.strerror or error}") from error

    document = Document(name, read_chunks, path.stat().st_size, open_bytes=lambda: open(path, "rb"))
    return document


def _stream_document(
    name: str,
    get_stream: Callable[[], BinaryIO],
    encoding: str | None,
    chunk_chars: int,
    warn: Callable[[str], None],
) -> Document:
    # The stream is looked up only when reading starts, so that a test (or a caller) may
    # replace sys.stdin between open_source and reading.
    def read_chunks() -> Iterator[str]:
        document.read = ContentHash()
        return _decode(get_stream(), name, encoding, chunk_chars, warn, document.read)

    document = Document(name, read_chunks, open_bytes=get_stream)
    return document


def _directory_documents(
    path: Path, encoding: str | None, chunk_chars: int, warn: Callable[[str], None]
) -> list[Document]:
    files = sorted(p for p in path.glob("*.txt") if p.is_file())
    if not files:
        raise KvcliError(f"no .txt files in directory: {path}")
    return [_file_document(p, str(p), encoding, chunk_chars, warn) for p in files]


def _decode(
    stream: BinaryIO, name: str, encoding: str | None, chunk_chars: int, warn: Callable[[str], None],
    tally: ContentHash | None = None,
) -> Iterator[str]:
    """Decode incrementally, so that a character split between two reads still decodes.

    Decoding starts strict and switches to replacement at the first bad byte: that is how
    the one warning is produced without scanning the input twice. ``tally`` counts and hashes
    the raw bytes as they are read (what a row or checkpoint was made from).
    """
    make_decoder = codecs.getincrementaldecoder(encoding or "utf-8-sig")
    decoder = make_decoder("strict")
    strict = True
    size = min(_FIRST_READ, chunk_chars)
    while True:
        data = stream.read(size)
        size = min(2 * size, chunk_chars)
        if tally is not None:
            tally.update(data)
        final = not data
        if strict:
            state = decoder.getstate()
            try:
                text = decoder.decode(data, final)
            except UnicodeDecodeError:
                strict = False
                decoder = make_decoder("replace")
                decoder.setstate(state)
                text = decoder.decode(data, final)
                warn(
                    f"{name} is not valid {encoding or 'UTF-8'}; undecodable bytes were replaced "
                    "with U+FFFD (use --encoding to read it with the right encoding)"
                )
        else:
            text = decoder.decode(data, final)
        if text:
            yield text
        if final:
            return


# --------------------------------------------------------------------------- pg19


def _pg19_documents(
    data_dir: str | os.PathLike[str] | None,
    encoding: str | None,
    chunk_chars: int,
    warn: Callable[[str], None],
) -> list[Document]:
    """Books of the PG-19 test split, from a local folder if one is configured, else the hub.

    A folder given explicitly (argument, then ``KVCLI_DATA``) is preferred over the network:
    it is what the user asked for, works offline and gives the same books every run.
    """
    local = data_dir if data_dir not in (None, "") else os.environ.get("KVCLI_DATA") or None
    if local is not None:
        root = Path(local)
        if not root.is_dir():
            raise KvcliError(f"data directory not found: {root} ({_PG19_HELP})")
        # KVCLI_DATA may be a root holding several data sets: use its pg19/ when it has one.
        if (root / PG19).is_dir():
            root = root / PG19
        files = sorted(p for p in root.glob("*.txt") if p.is_file())
        if not files:
            raise KvcliError(f"no .txt files in {root}: {_PG19_HELP}")
        return [_file_document(p, str(p), encoding, chunk_chars, warn) for p in files]
    documents = _pg19_from_hub(chunk_chars)
    if documents is None:
        raise KvcliError(_PG19_HELP)
    return documents


def _hub_offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _pg19_from_hub(chunk_chars: int) -> list[Document] | None:
    """Stream the test split with ``datasets``; None when that is not possible for any reason.

    Any failure (package missing, no network, dataset moved, changed format) means falling
    back to the message about local books, which is more useful than a traceback.
    """
    if _hub_offline():
        return None
    try:
        import datasets  # optional dependency: kvcli[datasets]
    except Exception:  # noqa: BLE001 - a broken install is as good as none here
        return None
    for repo in _PG19_HUB_REPOS:
        try:
            stream = datasets.load_dataset(repo, split="test", streaming=True)
            rows = _StreamedRows(stream)
            count = _split_size(stream) or _PG19_TEST_BOOKS
        except Exception:  # noqa: BLE001, S112 - any failure means "try the next, then local books"
            continue
        return [Document(f"{PG19}[{index}]", _row_reader(rows, index, chunk_chars)) for index in range(count)]
    return None


def _split_size(stream: Any) -> int | None:
    try:
        return int(stream.info.splits["test"].num_examples) or None
    except Exception:  # noqa: BLE001 - metadata is optional; the caller has a default
        return None


def _row_reader(rows: _StreamedRows, index: int, chunk_chars: int) -> Callable[[], Iterator[str]]:
    def read_chunks() -> Iterator[str]:
        text = rows.text(index)
        for start in range(0, len(text), chunk_chars):
            yield text[start : start + chunk_chars]

    return read_chunks


class _StreamedRows:
    """Rows of a streaming data set, fetched in order from one shared download.

    Documents are normally read one after the other; sharing the iterator means book *n*
    does not restart the stream and skip over books 0..n-1 again.  Reading out of order
    still works, by restarting.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._rows: Iterator[dict[str, Any]] = iter(stream)
        # Fetching the first book now proves that the hub answers and that rows have text.
        self._fetched: tuple[int, str] | None = (0, next(self._rows)["text"])
        self._next_index = 1

    def text(self, index: int) -> str:
        if self._fetched is not None and self._fetched[0] == index:
            text, self._fetched = self._fetched[1], None
            return text
        self._fetched = None
        if index < self._next_index:
            self._rows = iter(self._stream)
            self._next_index = 0
        for row in self._rows:
            self._next_index += 1
            if self._next_index - 1 == index:
                return row["text"]
        raise KvcliError(f"{PG19}: the data set has no book number {index}")


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

    Raises :class:`KvcliError` if the document has nothing but whitespace.
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
        raise KvcliError(f"input is empty: {doc.name}")
    ids, offsets = _encode(tokenizer, buffer)
    first = _first_new_token(offsets, emitted, tokenizer)
    yield TokenChunk(leading + ids[first:] + trailing, _utf8_len(buffer[emitted:]))


def _iter_tokens_whole(doc: Document, tokenizer: Any, add_special_tokens: bool) -> Iterator[TokenChunk]:
    text = "".join(doc.read_chunks())
    if not text.strip():
        raise KvcliError(f"input is empty: {doc.name}")
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
