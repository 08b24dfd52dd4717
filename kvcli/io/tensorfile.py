"""Safetensors files written and read without holding their data twice: a saved read's recall index grows with the
book (gigabytes at a million tokens), so every copy of it is that much more host memory.

:func:`file_parts` gives a file as its parts, the header and a view of each tensor's bytes, for
:func:`kvcli.io.outputs.atomic_write` to write one after another; a tensor may be given as a list of chunks along
its first dimension, written in order, never joined. :func:`read_tensors` reads a file into one buffer and makes
every tensor a view of it. The layout is safetensors' own (an 8-byte little-endian header length, a JSON header of
``dtype``, ``shape`` and ``data_offsets`` per tensor and ``__metadata__``, padded with spaces to a multiple of 8,
then the data), so ``safetensors.torch.load`` reads these files too. Data only: nothing is unpickled or run, and a
header that does not describe its data exactly is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


class TensorFileError(ValueError):
    """The bytes are not a safetensors file whose header describes its data exactly."""


def file_parts(tensors: dict[str, torch.Tensor | Sequence[torch.Tensor]], metadata: dict[str, str] | None = None,
               sealed: str | None = None) -> tuple[list[bytes | memoryview], str]:
    """The file holding ``tensors`` (each a tensor, or its chunks along the first dimension), as parts to write in
    order, and the SHA-256 of its data. ``sealed``: a key of ``metadata`` that receives that SHA-256 (JSON
    metadata stored under it gets ``"data_sha256"`` added), so the file carries the checksum of its own data."""
    entries, views, offset = {}, [], 0
    digest = hashlib.sha256()
    chunked = {name: _chunks(value) for name, value in tensors.items()}
    # The widest elements first, so that every tensor starts at a multiple of its element size.
    for name in sorted(chunked, key=lambda n: (-chunked[n][0].element_size(), n)):
        chunks = chunked[name]
        first = chunks[0]
        if any(c.dtype != first.dtype or c.shape[1:] != first.shape[1:] for c in chunks):
            raise ValueError(f"{name}: chunks of different dtypes or shapes")
        if first.dim() == 0 and len(chunks) > 1:
            raise ValueError(f"{name}: a scalar given as chunks")
        shape = [sum(c.shape[0] for c in chunks), *first.shape[1:]] if first.dim() else []
        start = offset
        for chunk in chunks:
            view = _bytes(chunk)
            digest.update(view)
            views.append(view)
            offset += len(view)
        entries[name] = {"dtype": _name(first.dtype), "shape": shape, "data_offsets": [start, offset]}
    meta = dict(metadata or {})
    if sealed is not None:
        meta[sealed] = json.dumps({**json.loads(meta.get(sealed, "{}")), "data_sha256": digest.hexdigest()},
                                  default=str)
    if meta:
        entries["__metadata__"] = meta
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views], digest.hexdigest()


def read_tensors(raw: bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of the safetensors file ``raw`` (views of it: keep it, never change it) and its metadata."""
    header = header_of(raw)
    data = 8 + int.from_bytes(raw[:8], "little")
    tensors, spans = {}, []
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
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(raw) - data or \
                end - begin != count * torch.empty((), dtype=dtype).element_size():
            raise TensorFileError(f"tensor {name!r}: its offsets do not hold its shape")
        spans.append((begin, end))
        tensors[name] = (torch.frombuffer(raw, dtype=dtype, count=count, offset=data + begin) if count
                         else torch.empty(0, dtype=dtype)).view(shape)
    spans.sort()
    if [b for b, _ in spans] != [0, *(e for _, e in spans[:-1])] or (spans[-1][1] if spans else 0) != len(raw) - data:
        raise TensorFileError("the tensors do not cover the data exactly")
    return tensors, dict(header.get("__metadata__") or {})


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


def data_of(raw: bytes | bytearray | memoryview) -> memoryview:
    """The tensor data of a safetensors file: what follows its 8-byte length and its JSON header (a view)."""
    return memoryview(raw)[8 + int.from_bytes(raw[:8], "little"):]


def _chunks(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    chunks = [value] if isinstance(value, torch.Tensor) else list(value)
    if not chunks:
        raise ValueError("a tensor given as no chunks")
    return chunks


def _name(dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"no safetensors name for {dtype}")
    return DTYPES[dtype]


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` on the host (a view where it is already contiguous there)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
