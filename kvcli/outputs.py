"""Writing results to files so that a killed run never leaves half of one behind.

Two ways to write, by what a reader must never see:

* :func:`atomic_write` replaces a whole file (a checkpoint, a merged rows file): the bytes go to a
  temporary file in the same folder, are flushed to disk, and the temporary file is renamed over
  the target, so a reader finds the old file or the new one, never a mixture.
* :class:`RowLog` appends rows, one JSON object a line, each with a single ``write`` of the whole
  line; a reader ignores a last line without its newline, and the owner cuts it off before
  appending again, so after any kind of death the file holds whole rows only.

:func:`check_output` is the one check of an output path, made before any model loads, so a missing
folder or a file where a folder should be is one line, not a traceback after minutes of work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.report import dumps


def check_output(path: Path, flag: str, *, folder: bool = False) -> Path:
    """``path`` if a file (``folder``: a folder) can be written there; otherwise a :class:`KvcliError`
    that names ``flag``. A folder is created with its parents; a file's folder must exist."""
    path = Path(path)
    if folder:
        if path.exists() and not path.is_dir():
            raise KvcliError(f"{flag} {path}: is a file, expected a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvcliError(f"{flag} {path}: cannot create the folder ({exc.strerror or exc})") from None
        where = path
    else:
        if path.is_dir():
            raise KvcliError(f"{flag} {path}: is a folder, expected a file")
        where = path.parent
        if not where.is_dir():
            raise KvcliError(f"{flag} {path}: no such folder {where}")
        if path.exists() and not os.access(path, os.W_OK):
            raise KvcliError(f"{flag} {path}: permission denied")
    if not os.access(where, os.W_OK):
        raise KvcliError(f"{flag} {path}: cannot write in {where} (permission denied)")
    return path


def open_output(path: Path, flag: str, mode: str = "w"):
    """``open(path, mode)`` after :func:`check_output`, with a failure worded for ``flag``."""
    check_output(path, flag)
    try:
        return open(path, mode, encoding="utf-8")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise KvcliError(f"{flag} {path}: {exc.strerror or exc}") from None


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once: write a temporary file beside it, then rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise KvcliError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_rows(path: Path) -> list[dict]:
    """The whole rows of a rows file (none if it does not exist); a last line cut by a kill is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvcliError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):  # the last piece has no newline
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or "document" not in row:
            raise KvcliError(f"{path} line {number} is not a row of kvcli (one JSON object with a "
                             "\"document\" a line): choose another file or remove it")
        rows.append(row)
    return rows


class RowLog:
    """A rows file this process appends to, a whole line per write."""

    def __init__(self, path: Path, flag: str):
        self.path = check_output(path, flag)
        self.flag = flag

    def start(self, resume: bool) -> list[dict]:
        """Begin writing: with ``resume`` keep the whole rows already there (and return them), cutting
        off a half-written last line; without it, start an empty file."""
        rows = read_rows(self.path) if resume else []
        try:
            if not resume or not self.path.exists():
                self.path.write_bytes(b"")
            else:
                data = self.path.read_bytes()
                end = data.rfind(b"\n") + 1
                if end < len(data):
                    os.truncate(self.path, end)
        except OSError as exc:
            raise KvcliError(f"{self.flag} {self.path}: {exc.strerror or exc}") from None
        return rows

    def append(self, row: dict) -> None:
        """Add ``row`` as one line with one ``write`` call, and flush it to disk."""
        line = (dumps(row) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                while written < len(line):  # only for lines beyond what one write takes (megabytes)
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise KvcliError(f"{self.flag} {self.path}: {exc.strerror or exc}") from None

    def rewrite(self, rows: list[dict]) -> None:
        """Replace the file with ``rows`` at once (a merge in document order)."""
        atomic_write(self.path, "".join(dumps(row) + "\n" for row in rows).encode("utf-8"))
