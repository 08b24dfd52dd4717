"""Safetensors files written and read without holding their data whole: a saved read's recall index grows with the
book (gigabytes at a million tokens), so every copy of it in memory is that much more host memory.

:func:`file_parts` gives a file as its parts, the header and the bytes of each tensor, for
:func:`kvcli.io.outputs.atomic_write` to write one after another; a tensor may be given as a list of chunks along
its first dimension, written in order, never joined, or as :class:`Streamed` pieces read from elsewhere (a file)
as they are written. :class:`TensorFile` reads a file's header, then each tensor, or a range of one, only when asked.
The layout is safetensors' own (an 8-byte little-endian header length, a JSON header of ``dtype``, ``shape`` and
``data_offsets`` per tensor and ``__metadata__``, padded with spaces to a multiple of 8, then the data), so
``safetensors.torch.load`` reads these files too. Data only: nothing is unpickled or run, and a header that does not
describe its data exactly is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

#: Bytes read at once when a file's data is hashed.
PIECE = 16 << 20


class TensorFileError(ValueError):
    """The bytes are not a safetensors file whose header describes its data exactly."""


class Streamed:
    """A tensor too large to hold whole: its dtype and shape, and its bytes in order, in pieces, given anew each time
    it is iterated (once to hash them, once to write them). A source that gives another number of bytes than the
    shape holds is an error, not a file whose header lies."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int], pieces: Callable[[], Iterable[bytes | memoryview]]):
        self.dtype, self.shape, self._pieces = dtype, [int(n) for n in shape], pieces
        self.nbytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()

    def __iter__(self) -> Iterator[bytes | memoryview]:
        given = 0
        for piece in self._pieces():
            given += len(piece)
            yield piece
        if given != self.nbytes:
            raise ValueError(f"a streamed tensor gave {given} bytes for {self.nbytes}")


def file_parts(tensors: dict[str, torch.Tensor | Sequence[torch.Tensor] | Streamed],
               metadata: dict[str, str] | None = None,
               sealed: str | None = None) -> tuple[list[bytes | memoryview | Streamed], str]:
    """The file holding ``tensors`` (each a tensor, its chunks along the first dimension, or :class:`Streamed`), as
    parts to write in order, and the SHA-256 of its data. ``sealed``: a key of ``metadata`` that receives that
    SHA-256 (JSON metadata stored under it gets ``"data_sha256"`` added), so the file carries the checksum of its
    own data."""
    entries, views, offset = {}, [], 0
    digest = hashlib.sha256()
    given = {name: value if isinstance(value, Streamed) else _chunks(value) for name, value in tensors.items()}
    # The widest elements first, so that every tensor starts at a multiple of its element size.
    for name in sorted(given, key=lambda n: (-_dtype(given[n]).itemsize, n)):
        start = offset
        for view in _views(name, given[name]):
            for piece in view if isinstance(view, Streamed) else (view,):
                digest.update(piece)
                offset += len(piece)
            views.append(view)
        entries[name] = {"dtype": _name(_dtype(given[name])), "shape": _shape(given[name]),
                         "data_offsets": [start, offset]}
    meta = dict(metadata or {})
    if sealed is not None:
        meta[sealed] = json.dumps({**json.loads(meta.get(sealed, "{}")), "data_sha256": digest.hexdigest()},
                                  default=str)
    if meta:
        entries["__metadata__"] = meta
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views], digest.hexdigest()


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape and where its bytes lie, counted from the file's start."""

    dtype: torch.dtype
    shape: list[int]
    begin: int
    end: int


class TensorFile:
    """A safetensors file read a part at a time from ``stream`` (seekable, binary; kept open): its header at once, a
    tensor or a range of bytes when asked, its data's SHA-256 a :data:`PIECE` at a time."""

    def __init__(self, stream: BinaryIO, max_header: int | None = None):
        self.stream = stream
        self.size = stream.seek(0, 2)
        stream.seek(0)
        head = stream.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if max_header is not None and length > max_header:
            raise TensorFileError("header too long")
        if not 2 <= length <= self.size - 8:
            raise TensorFileError("not a safetensors file, or cut short")
        self.header = header_of(head + stream.read(length))
        self.data = 8 + length
        self.metadata = dict(self.header.get("__metadata__") or {})
        self._entries: dict[str, Entry] | None = None

    @property
    def entries(self) -> dict[str, Entry]:
        """Every tensor's :class:`Entry`, checked to cover the data exactly (a :class:`TensorFileError` if not)."""
        if self._entries is None:
            self._entries = _entries(self.header, self.data, self.size)
        return self._entries

    def read(self, begin: int, size: int) -> bytearray:
        """``size`` bytes of the file from ``begin``."""
        try:
            return read_at(self.stream, begin, size)
        except EOFError:
            raise TensorFileError("the file is shorter than its header says") from None

    def load(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read into memory."""
        entry = self.entries[name]
        if entry.end == entry.begin:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(self.read(entry.begin, entry.end - entry.begin), dtype=entry.dtype).view(entry.shape)

    def sha256(self) -> str:
        """The SHA-256 of the file's data (all that follows the header)."""
        digest = hashlib.sha256()
        for begin in range(self.data, self.size, PIECE):
            digest.update(self.read(begin, min(PIECE, self.size - begin)))
        return digest.hexdigest()


def read_at(stream: BinaryIO, begin: int, size: int) -> bytearray:
    """``size`` bytes of ``stream`` from byte ``begin``, in a new writable buffer (tensors may be views of it); an
    :class:`EOFError` where the stream ends sooner."""
    buffer = bytearray(size)
    stream.seek(begin)
    if stream.readinto(buffer) != size:
        raise EOFError(f"{size} bytes from byte {begin}: the file ends sooner")
    return buffer


def _entries(header: dict, data: int, size: int) -> dict[str, Entry]:
    """The tensors of ``header``, whose data starts at byte ``data`` of a file of ``size`` bytes, each checked to
    hold its shape, and together to cover the data exactly."""
    entries, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            if not isinstance(entry["shape"], list) or not isinstance(entry["data_offsets"], list):
                raise TypeError("shape and data_offsets are lists")
            dtype, shape = _BY_NAME[entry["dtype"]], [int(n) for n in entry["shape"]]
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TensorFileError(f"tensor {name!r}: {type(exc).__name__} in its header entry") from None
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - data or \
                end - begin != math.prod(shape) * dtype.itemsize:
            raise TensorFileError(f"tensor {name!r}: its offsets do not hold its shape")
        spans.append((begin, end))
        entries[name] = Entry(dtype, shape, data + begin, data + end)
    spans.sort()
    if [b for b, _ in spans] != [0, *(e for _, e in spans[:-1])] or (spans[-1][1] if spans else 0) != size - data:
        raise TensorFileError("the tensors do not cover the data exactly")
    return entries


def header_of(raw: bytes | bytearray | memoryview) -> dict:
    """The JSON header of the safetensors file ``raw``."""
    size = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else -1
    if not 2 <= size <= len(raw) - 8:
        raise TensorFileError("not a safetensors file, or cut short")
    try:
        header = json.loads(bytes(raw[8:8 + size]))
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise TensorFileError("its header is not a JSON object")
    return header


def _chunks(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    chunks = [value] if isinstance(value, torch.Tensor) else list(value)
    if not chunks:
        raise ValueError("a tensor given as no chunks")
    return chunks


def _dtype(value: list[torch.Tensor] | Streamed) -> torch.dtype:
    return value.dtype if isinstance(value, Streamed) else value[0].dtype


def _shape(value: list[torch.Tensor] | Streamed) -> list[int]:
    if isinstance(value, Streamed):
        return value.shape
    first = value[0]
    return [sum(c.shape[0] for c in value), *first.shape[1:]] if first.dim() else []


def _views(name: str, value: list[torch.Tensor] | Streamed) -> list[memoryview | Streamed]:
    """The parts of one tensor: itself where it is :class:`Streamed`, else a view of each chunk's bytes."""
    if isinstance(value, Streamed):
        return [value]
    first = value[0]
    if any(c.dtype != first.dtype or c.shape[1:] != first.shape[1:] for c in value):
        raise ValueError(f"{name}: chunks of different dtypes or shapes")
    if first.dim() == 0 and len(value) > 1:
        raise ValueError(f"{name}: a scalar given as chunks")
    return [_bytes(chunk) for chunk in value]


def _name(dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"no safetensors name for {dtype}")
    return DTYPES[dtype]


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` on the host (a view where it is already contiguous there)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
