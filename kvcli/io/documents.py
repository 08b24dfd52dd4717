"""Reading documents: files, folders, standard input and PG-19, a piece at a time.

Books and corpora can be far larger than memory, so nothing here reads a whole file: text
arrives in pieces of about ``chunk_chars`` characters (:mod:`kvcli.io.text` tokenizes them as they come).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvcli.errors import KvcliError, UsageError

DEFAULT_CHUNK_CHARS = 1 << 20
# Reads start this small and double up to ``chunk_chars``: the first block waits only for a small
# piece to be tokenized (a command reading 64 tokens of a book tokenizes kilobytes, not a megabyte),
# while a long stream soon reads in large pieces.
_FIRST_READ = 1 << 14

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
        if sys.stdin is None:  # started with stdin closed (``<&-``): Python has no stream at all
            raise KvcliError("stdin is closed: give a file instead of -, or redirect one into stdin (< book.txt)")
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
    the raw bytes as they are read (what a row or checkpoint was made from). A text the
    encoding cannot start at all (UTF-16 or UTF-32 without a byte order mark) has no byte to
    replace: it is one line that says which encoding to name.
    """
    try:
        yield from _decode_pieces(stream, name, encoding, chunk_chars, warn, tally)
    except UnicodeDecodeError:
        raise  # never: bad bytes are replaced
    except UnicodeError as exc:
        hint = "name its byte order, e.g. --encoding utf-16-le" if "BOM" in str(exc) else "choose another --encoding"
        raise KvcliError(f"cannot decode {name} as {encoding or 'UTF-8'} ({exc}): {hint}") from None


def _decode_pieces(
    stream: BinaryIO, name: str, encoding: str | None, chunk_chars: int, warn: Callable[[str], None],
    tally: ContentHash | None,
) -> Iterator[str]:
    """:func:`_decode` itself."""
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
