"""State files kvcli writes and reads back (stream checkpoints, ``kvcli adapt``'s training state): data only,
sealed with a checksum.

Two rules, because such a file sits in a folder other people may write, and a resumed run must
never continue from bytes that changed:

* **Never code.** The payload is read with ``torch.load(..., weights_only=True)``: torch's restricted
  unpickler builds tensors, numbers, strings and containers and refuses every other global, so a
  crafted file cannot run anything. No file kvcli reads is ever unpickled any other way.
* **Never a wrong number.** The file is a header line (``kvcli-state``, the format, the SHA-256 of
  the payload) followed by the payload torch wrote. A file cut short or with a single bit flipped
  fails the checksum and is refused with one line, where torch alone would load a flipped float.

The file is replaced at once (:func:`kvcli.io.outputs.atomic_write`), so a kill leaves the old one or
the new one.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from kvcli.errors import KvcliError
from kvcli.io.outputs import atomic_write

MAGIC = b"kvcli-state"
VERSION = 1


def save_state(path: Path, payload: dict) -> None:
    """Write ``payload`` (tensors, numbers, strings, lists and dicts only) to ``path``, sealed and atomically."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    header = b"%s %d %s\n" % (MAGIC, VERSION, hashlib.sha256(body).hexdigest().encode())
    atomic_write(Path(path), header + body)


def load_state(path: Path, what: str, advice: str) -> dict:
    """The dict saved at ``path`` by :func:`save_state`, or a :class:`KvcliError` naming ``what`` the file should
    be and ``advice`` (what to do instead): unreadable, not sealed by kvcli, damaged, or not a dict of data."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvcliError(f"cannot read {path}: {exc.strerror or exc}") from None
    newline = data.find(b"\n", 0, 128)
    fields = data[:newline].split(b" ") if newline > 0 else []
    if len(fields) != 3 or fields[0] != MAGIC:
        raise KvcliError(f"{path} is not a readable {what} (no kvcli-state header): {advice}")
    if fields[1] != str(VERSION).encode():
        raise KvcliError(f"{path} is a {what} of another format ({fields[1].decode(errors='replace')}): {advice}")
    body = data[newline + 1:]
    if hashlib.sha256(body).hexdigest().encode() != fields[2]:
        raise KvcliError(f"{path} is a damaged {what} (its checksum does not match: cut short or altered): {advice}")
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler refuses is the same one-line answer
        raise KvcliError(f"{path} is not a readable {what} ({type(exc).__name__}): {advice}") from None
    if not isinstance(payload, dict):
        raise KvcliError(f"{path} is not a {what}: {advice}")
    return payload
