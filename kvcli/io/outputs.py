"""Writing results to files so that a killed run never leaves half of one behind.

Two ways to write, by what a reader must never see:

* :func:`atomic_write` replaces a whole file (a checkpoint, a merged rows file): the bytes go to a
  new temporary file in the same folder (an unpredictable name, created exclusively, never through a
  link), are flushed to disk, the temporary file is renamed over the target and the folder is
  flushed too, so a reader, a kill or a power cut finds the old file or the new one, never a mixture.
* :class:`RowLog` appends rows, one JSON object a line, each with a single ``write`` of the whole
  line; a reader ignores a last line without its newline, and the owner cuts it off before
  appending again, so after any kind of death the file holds whole rows only.

:func:`check_output` is the one check of an output path, made before any model loads, so a missing
folder, a read-only one or a file where a folder should be is one line, not a traceback after
minutes of work. :func:`lock_folder` makes a folder one run's own for as long as the run lasts.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.io.report import dumps

try:
    import fcntl
except ImportError:  # Windows: only locking a folder needs it, and says so (lock_folder)
    fcntl = None


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
    if not os.access(where, os.W_OK) or not _can_create_in(where):
        raise KvcliError(f"{flag} {path}: cannot write in {where} (permission denied or a read-only file system)")
    return path


def _can_create_in(folder: Path) -> bool:
    """Whether a file can really be created in ``folder``: ``os.access`` says yes to root on a read-only mount."""
    probe = folder / f".kvcli-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return True
    except OSError:
        return False
    probe.unlink(missing_ok=True)
    return True


class SideFailures:
    """Side files of a run (``--jsonl``, ``--rows``, ``--save-logits``) that failed while it ran.

    A full disk or a vanished folder must not throw away a measurement of hours: the run stops writing
    the file that failed, finishes, prints its result on stdout, and only then :meth:`check` ends it with
    one line and exit code 1.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)

    def oserror(self, flag: str, path: Path, exc: OSError) -> None:
        self.add(f"{flag} {path}: {exc.strerror or exc}")

    def check(self) -> None:
        if self.messages:
            more = f" (and {len(self.messages) - 1} more)" if len(self.messages) > 1 else ""
            raise KvcliError(f"{self.messages[0]}{more}: that file is incomplete; the result on stdout is whole")


LOCK_FILE = ".kvcli.lock"
_HELD: dict[str, list] = {}  # folders this process has locked: resolved path -> [open lock file, depth]


@contextmanager
def lock_folder(folder: Path, flag: str) -> Iterator[Path]:
    """Hold ``folder`` (created if missing) for one run: a second run that asks for it while this one lasts is
    refused at once with one line that names the holder's process id.

    The lock is ``fcntl.flock`` on ``folder/.kvcli.lock`` (:func:`open_lock`: never through a link): the kernel
    drops it when the process ends in any way (``kill -9`` included), so a killed run never leaves a stale lock
    to clean up. The file stays behind, since deleting it would let two runs lock two different files. Locking
    a folder this process already holds nests (the CLI locks before loading the model, the library again).
    """
    folder = check_output(folder, flag, folder=True)
    if fcntl is None:
        raise KvcliError(f"{flag} {folder}: locking a folder needs POSIX file locks (fcntl), which this platform "
                         "does not have")
    key = str(folder.resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield folder
        finally:
            _HELD[key][1] -= 1
        return
    path = folder / LOCK_FILE
    try:
        handle = os.fdopen(open_lock(path), "r+", encoding="utf-8")
    except OSError as exc:
        raise KvcliError(f"{flag} {folder}: cannot create {LOCK_FILE} ({exc.strerror or exc})") from None
    except KvcliError as exc:
        raise KvcliError(f"{flag} {exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise KvcliError(f"{flag} {folder} is in use by another kvcli run (process {holder}): wait for it to end, "
                         "or use another folder") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD[key] = [handle, 1]
    try:
        yield folder
    finally:
        del _HELD[key]
        handle.close()  # closing the file releases the lock


def open_lock(path: Path) -> int:
    """A descriptor of the lock file ``path``, open for reading and writing: created with mode 0o600 when missing,
    never opened through a symbolic link, and kept only when it is a regular file with no other name. kvcli
    writes its process id into a lock file, so a link or a hard link planted under its name would have it
    overwrite someone else's file; such a path is a :class:`KvcliError` naming what is there. An ``OSError``
    when it cannot be opened (permissions, a folder)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise KvcliError(f"{path} is a symbolic link, not a lock file of kvcli's: remove it (kvcli never "
                             "locks or writes through a link)") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else "a hard link to another file"
        raise KvcliError(f"{path} is {what}, not a lock file of kvcli's: remove it")
    return fd


def open_output(path: Path, flag: str, mode: str = "w"):
    """``open(path, mode)`` after :func:`check_output`, with a failure worded for ``flag``."""
    check_output(path, flag)
    try:
        return open(path, mode, encoding="utf-8")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise KvcliError(f"{flag} {path}: {exc.strerror or exc}") from None


def remove_partial(path: Path) -> None:
    """Delete a file a failed run left half-written, if it is a regular file (never a device such as /dev/full)."""
    path = Path(path)
    if path.is_file():
        path.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes | Sequence[bytes | memoryview | Iterable[bytes | memoryview]]) -> None:
    """Replace ``path`` with ``data`` (bytes, or parts written one after another, each bytes or an iterable of
    pieces, so that a large file need not be joined in memory first) all at once (:func:`replace_file`); a
    failure is a :class:`KvcliError`.

    Only a regular file (or a new one) is replaced so: renaming over a device or a pipe would remove it.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise KvcliError(f"cannot write {path}: not a regular file (it is replaced whole, never written into)")
    try:
        replace_file(path, data)
    except OSError as exc:
        raise KvcliError(f"cannot write {path}: {exc.strerror or exc}") from None


def replace_file(path: Path, data: bytes | Sequence[bytes | memoryview | Iterable[bytes | memoryview]], *,
                 mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` so that a reader, a kill or a power cut finds the old file or the new one.

    The bytes go to a new temporary file beside ``path`` (:func:`new_temporary`), are synced to disk, and the
    file is renamed over ``path``; then the folder is synced, so that the rename itself survives a power cut.
    ``path`` itself is never opened: a link there is replaced, not followed. An ``OSError`` leaves ``path`` as it
    was and no temporary file behind.
    """
    path = Path(path)
    fd, temporary = new_temporary(path, mode)
    try:
        with os.fdopen(fd, "wb") as stream:
            for part in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
                for piece in [part] if isinstance(part, bytes | bytearray | memoryview) else part:
                    stream.write(piece)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def new_temporary(path: Path, mode: int = 0o600) -> tuple[int, Path]:
    """A new, empty file beside ``path`` under an unpredictable name, open for writing: ``(descriptor, path)``.

    It is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never an existing file, never through a link someone
    planted under the name) and ``mode`` less the umask (0o600: private; 0o666: as ``open`` would create it).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | \
        getattr(os, "O_BINARY", 0)
    for _ in range(100):
        temporary = path.with_name(f".{path.name[:200]}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(temporary, flags, mode), temporary
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path.parent))


def sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename, a new file) to disk; a no-op where folders cannot be opened (Windows)
    or synced (some network file systems)."""
    if os.name == "nt":
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_rows(path: Path, required: str = "document") -> list[dict]:
    """The whole rows of a rows file (none if it does not exist); a last line cut by a kill is ignored.

    Every row must hold ``required`` (``ppl``'s rows a ``document``, ``needle``'s a ``trial``), so that a file of
    another command is refused rather than read as this one's."""
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
        if not isinstance(row, dict) or required not in row:
            raise KvcliError(f"{path} line {number} is not a row of kvcli (one JSON object with a "
                             f"\"{required}\" a line): choose another file or remove it")
        rows.append(row)
    return rows


class RowLog:
    """A rows file this process appends to, a whole line per write."""

    def __init__(self, path: Path, flag: str):
        self.path = check_output(path, flag)
        self.flag = flag

    def start(self, resume: bool, required: str = "document") -> list[dict]:
        """Begin writing: with ``resume`` keep the whole rows already there (and return them; each holds
        ``required``), cutting off a half-written last line; without it, start an empty file."""
        rows = read_rows(self.path, required) if resume else []
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
