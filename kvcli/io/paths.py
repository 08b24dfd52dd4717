"""Where outputs go: never over an input, and into a file one run at a time.

A typo such as ``kvcli ppl book.txt --jsonl book.txt`` must not cost the book: the check runs before
any output is opened (and before any model loads), compares every output with every input, and
refuses with one line naming both (a usage error, exit 2). :func:`check_apart` is the one check every
command calls (through :meth:`kvcli.cli.options.Setup.check_outputs`). Paths are compared

* **by what they are, not how they are spelled**: the resolved path (``./book.txt``, ``../x/book.txt``
  and a symbolic link to it are one file) and the ``(st_dev, st_ino)`` of what exists (a hard link is
  the same file under another name);
* **by where they lie**: an input folder is read whole (every ``.txt`` of a corpus, the files of a
  model folder), so no output file may lie directly in one (a subfolder is not read); and an output
  folder takes files of kvcli's naming, so no input file may lie directly in one.

Outputs that exist and are neither regular files nor folders (``/dev/null``, ``/dev/full``, a pipe)
are written into, never replaced, so they never clash with anything.

:func:`hold_file` makes an output file (a rows file) one run's own while the run lasts, with the lock
:func:`kvcli.io.outputs.lock_folder` takes on a folder: a second run into it is refused at once.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvcli.errors import KvcliError, UsageError


@dataclass(frozen=True)
class Output:
    """A path a command writes: a file, or a folder it writes files into (``folder``)."""

    flag: str  # how the user named it: "--jsonl", "--out"
    path: Path
    folder: bool = False


@dataclass(frozen=True)
class Input:
    """A path a command reads; a folder is read whole (a corpus, a model folder)."""

    what: str  # how a message names it: "the source", "--kl-base", "the model"
    path: Path


@dataclass
class _Place:
    """A path as it is on disk: resolved, and its (device, inode) and kind when it exists."""

    path: Path
    resolved: Path = field(init=False)
    inode: tuple[int, int] | None = field(init=False, default=None)
    mode: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.resolved = Path(os.path.abspath(self.path)).resolve()
        try:
            info = os.stat(self.path)
        except (OSError, ValueError):
            return
        self.inode, self.mode = (info.st_dev, info.st_ino), info.st_mode

    @property
    def exists(self) -> bool:
        return self.inode is not None

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def replaceable(self) -> bool:
        """A new path, a regular file or a folder: what writing can destroy (a device or a pipe is written into)."""
        return not self.exists or stat.S_ISREG(self.mode) or stat.S_ISDIR(self.mode)

    def same(self, other: _Place) -> bool:
        return self.resolved == other.resolved or (self.inode is not None and self.inode == other.inode)

    def directly_in(self, folder: _Place) -> bool:
        """Whether this path is an entry of ``folder`` (by path, or by the folder's inode)."""
        return _Place(self.resolved.parent).same(folder)


def check_apart(outputs: Iterable[Output], inputs: Iterable[Input]) -> None:
    """Refuse (:class:`UsageError`, one line naming both) an output that is an input, an output file directly in
    an input folder, an output folder holding an input file, or two outputs on the same path."""
    given = [(item, _Place(item.path)) for item in inputs]
    seen: list[tuple[Output, _Place]] = []
    for out in outputs:
        place = _Place(out.path)
        if not place.replaceable:
            continue
        for read, where in given:
            _check_pair(out, place, read, where)
        for other, where in seen:
            if place.same(where):
                raise UsageError(f"{out.flag} {out.path} and {other.flag} {other.path} are the same path: give each "
                                 "output its own")
        seen.append((out, place))


def _check_pair(out: Output, place: _Place, read: Input, where: _Place) -> None:
    """Refuse ``out`` if writing it can change ``read``."""
    if place.same(where):
        also = "" if Path(out.path) == Path(read.path) else " (the same file by another name)"
        raise UsageError(f"{out.flag} {out.path} is {read.what} {read.path}{also}: an output never replaces an "
                         f"input; choose another {'folder' if out.folder else 'file'}")
    if where.is_dir and not out.folder and place.directly_in(where):
        raise UsageError(f"{out.flag} {out.path} lies in {read.what} {read.path}, which is read whole: choose a "
                         "file outside it")
    if out.folder and not where.is_dir and where.exists and where.directly_in(place):
        raise UsageError(f"{out.flag} {out.path} holds {read.what} {read.path}, and kvcli writes its files there: "
                         "choose another folder")


def source_inputs(source: str, data_dir: str | os.PathLike[str] | None = None) -> list[Input]:
    """What ``kvcli.io.documents.open_source`` reads for SOURCE: the file or folder, the PG-19 folder
    (``--data-dir`` or ``KVCLI_DATA``), nothing for standard input or the Hub."""
    from kvcli.io.documents import PG19

    if source == "-" or not source:
        return []
    if Path(source).exists():
        return [Input("the source", Path(source))]
    if source == PG19:
        local = data_dir if data_dir not in (None, "") else os.environ.get("KVCLI_DATA") or None
        return [Input("the data folder", Path(local))] if local is not None else []
    return []


def model_inputs(spec: str) -> list[Input]:
    """The local file or folder ``--model`` names (nothing for a preset name or a Hub id)."""
    path = Path(os.path.expanduser(spec))
    return [Input("the model", path)] if spec and path.exists() else []


@contextmanager
def hold_file(path: Path, flag: str) -> Iterator[Path]:
    """Hold the output file ``path`` (created if missing, never truncated here) for one run: a second run that
    asks for it while this one lasts is refused at once with one line.

    The lock is ``fcntl.flock`` on the file itself, as :func:`kvcli.io.outputs.lock_folder` takes it on a folder's
    lock file: the kernel drops it when the process ends in any way, so a killed run leaves no stale lock. A
    device or a pipe (``/dev/null``) is written into by any number of runs and is not locked.
    """
    import fcntl

    path = Path(path)
    if path.exists() and not path.is_file():
        yield path
        return
    try:
        handle = open(path, "a")  # noqa: SIM115 - held open for the run, closed below
    except OSError as exc:
        raise KvcliError(f"{flag} {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise KvcliError(f"{flag} {path} is in use by another kvcli run: wait for it to end, or use another "
                         "file") from None
    try:
        yield path
    finally:
        handle.close()  # closing the file releases the lock
