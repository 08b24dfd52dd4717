"""Where the recall index's keys lie: on disk, appended a block at a time while reading, read a range at a time
while a question is scored (:mod:`kvcli.reading.recall`).

The index holds every token's keys in the middle layers (3 KB a token for SmolLM2-135M, gigabytes at a million
tokens); held in memory it would make the host's memory grow with the book where the cache's does not. So the
keys go to a file as they are made: while reading, an unnamed temporary file (:meth:`KeyStore.spill`; the system
removes it when it is closed or the process dies, so nothing is left behind); in a saved read, the file itself
(:meth:`KeyStore.in_file`). Either is a list of segments, each ``[layers, heads, tokens, dim]`` int8 keys then
``[layers, heads, tokens]`` float16 scales: one segment per block while reading, one for the whole read in a saved
file, so the keys of one layer and head over a range of tokens are one read per segment it crosses.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from kvcli.errors import KvcliError
from kvcli.io.tensorfile import Streamed, read_at


@dataclass(frozen=True)
class Segment:
    """Tokens ``start`` to ``start + tokens`` of the read: where their keys and their scales begin in the file."""

    start: int
    tokens: int
    keys: int
    scales: int


class KeyStore:
    """The int8 keys and float16 scales of every token read, per layer and KV head, in ``stream``'s segments."""

    def __init__(self, stream: BinaryIO, layers: int, heads: int, dim: int, segments: list[Segment] | None = None):
        self.stream, self.layers, self.heads, self.dim = stream, layers, heads, dim
        self.segments = list(segments or [])

    @classmethod
    def spill(cls, layers: int, heads: int, dim: int, folder: Path | None = None) -> KeyStore:
        """An empty store in an unnamed temporary file in ``folder`` (None: the system's, ``TMPDIR``)."""
        try:
            return cls(tempfile.TemporaryFile(dir=folder), layers, heads, dim)
        except OSError as exc:
            raise KvcliError(f"cannot make the recall index's temporary file in {folder or tempfile.gettempdir()}: "
                             f"{exc.strerror or exc} (TMPDIR names another folder)") from None

    @classmethod
    def in_file(cls, stream: BinaryIO, layers: int, heads: int, dim: int, tokens: int, keys: int,
                scales: int) -> KeyStore:
        """The store of a saved read: one segment of ``tokens``, its keys at byte ``keys``, its scales at ``scales``."""
        return cls(stream, layers, heads, dim, [Segment(0, tokens, keys, scales)])

    @property
    def tokens(self) -> int:
        return self.segments[-1].start + self.segments[-1].tokens if self.segments else 0

    @property
    def nbytes(self) -> int:
        """Bytes of keys and scales."""
        return self.tokens * self.layers * self.heads * (self.dim + 2)

    def append(self, keys: torch.Tensor, scales: torch.Tensor) -> None:
        """Add the next tokens: ``keys`` ``[n, layers, heads, dim]`` int8 and ``scales`` ``[n, layers, heads]``."""
        try:
            at = self.stream.seek(0, 2)
            self.stream.write(keys.permute(1, 2, 0, 3).contiguous().numpy().tobytes())
            self.stream.write(scales.permute(1, 2, 0).contiguous().numpy().tobytes())
        except OSError as exc:
            raise KvcliError(f"cannot write the recall index ({exc.strerror or exc}); it takes "
                             f"{self.layers * self.heads * (self.dim + 2):,} bytes a token read in the temporary "
                             "folder (TMPDIR), or beside the saved read") from None
        n = keys.shape[0]
        self.segments.append(Segment(self.tokens, n, at, at + n * self.layers * self.heads * self.dim))

    def read(self, layer: int, head: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys ``[end - start, dim]`` (int8) and scales ``[end - start]`` (float16) of tokens ``start`` to
        ``end`` in the store's ``layer``-th layer and KV head ``head``."""
        keys, scales = [], []
        for seg in self.segments:
            lo, hi = max(start, seg.start), min(end, seg.start + seg.tokens)
            if lo >= hi:
                continue
            row = (layer * self.heads + head) * seg.tokens + lo - seg.start
            keys.append(self._read(seg.keys + row * self.dim, (hi - lo) * self.dim).view(hi - lo, self.dim))
            scales.append(self._read(seg.scales + row * 2, (hi - lo) * 2).view(torch.float16))
        if not keys:
            return torch.zeros((0, self.dim), dtype=torch.int8), torch.zeros(0, dtype=torch.float16)
        return (torch.cat(keys), torch.cat(scales)) if len(keys) > 1 else (keys[0], scales[0])

    def pieces(self, layer: int, head: int, end: int, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`read` of tokens 0 to ``end`` in ranges of ``size``."""
        for start in range(0, end, size):
            yield self.read(layer, head, start, min(start + size, end))

    def streamed(self) -> tuple[Streamed, Streamed]:
        """The keys ``[layers, heads, tokens, dim]`` and the scales ``[layers, heads, tokens]`` of the whole store,
        each read from the file a segment's layer and head at a time as it is written (a saved read's index)."""
        shape = [self.layers, self.heads, self.tokens]

        def part(kind: str, width: int):
            def pieces() -> Iterator[bytearray]:
                for row in range(self.layers * self.heads):
                    for seg in self.segments:
                        yield self._bytes(getattr(seg, kind) + row * seg.tokens * width, seg.tokens * width)
            return pieces

        return (Streamed(torch.int8, [*shape, self.dim], part("keys", self.dim)),
                Streamed(torch.float16, shape, part("scales", 2)))

    def _bytes(self, at: int, size: int) -> bytearray:
        try:
            return read_at(self.stream, at, size)
        except (OSError, EOFError) as exc:
            raise KvcliError(f"cannot read the recall index: {getattr(exc, 'strerror', None) or exc}") from None

    def _read(self, at: int, size: int) -> torch.Tensor:
        return torch.frombuffer(self._bytes(at, size), dtype=torch.int8) if size else torch.zeros(0, dtype=torch.int8)
