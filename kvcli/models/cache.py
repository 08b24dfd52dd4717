"""The model cache: a model that must be converted before it can run (a GGUF) is converted once, and every
later load reads the converted folder, memory-mapped, instead of parsing and dequantizing the file again.

Layout under :func:`cache_root` (``KVCLI_CACHE``, else ``$XDG_CACHE_HOME/kvcli``, else ``~/.cache/kvcli``)::

    models/<name>/                   an entry: what transformers' ``save_pretrained`` writes (safetensors
                                     weights, config, generation config, tokenizer, chat template) plus
    models/<name>/kvcli-entry.json   its manifest, written last: source, variant, every file's SHA-256
    models/.build-<name>-*/          an entry being built, renamed to ``models/<name>`` when complete
    models/.trash-<name>-*/          an entry being removed (renamed out of place first, then deleted)
    models/.locks/<name>.lock        held while an entry is built, so two first loads build it once
    models/.sources/<id>.json        a source file's SHA-256, remembered against its ``stat``
    <file>                           a file built once and trusted by its SHA-256 (:func:`built_file`: the
                                     GGUF of a model shipped in parts), with .locks/<file>.lock beside it

Rules, and why:

* **Private.** The cache root and ``models/`` must belong to the user and be writable by nobody else
  (:func:`ready`; kvcli creates them with mode 0o700): everything below trusts what it finds there only as
  far as it trusts the folder, so a folder that another user could write is refused, in one line saying how
  to fix it, and the model is loaded without the cache.
* **Never stale.** An entry is named by the SHA-256 of the source file's bytes and by the variant (the dtype
  the weights were dequantized to and the versions of the converting libraries), so a changed file or a new
  transformers gets a new entry. How the source's hash is remembered, and why that is safe:
  :func:`file_sha256`.
* **Complete or absent.** An entry is built in a temporary folder beside its final place, its files and
  manifest synced to disk, and renamed into place, which is atomic: a kill or a power cut leaves a complete
  entry or none (a leftover ``.build-*`` folder is removed by the next build of the same entry). Builders of
  one entry take its lock, so a second first load waits and then reads the entry the first one built.
* **Checked before every use.** The manifest records every file's SHA-256, computed at build. Before an
  entry is used each file must be a regular file (not a link) of the recorded size, and its bytes must be
  the recorded ones: checked in full (a SHA-256 of the file) unless the file is provably untouched since a
  full check (the cheap check of :func:`_vouched`: the same ``stat``, settled, and a seal over sampled
  bytes). A damaged entry is rebuilt after one warning.
* **Data only.** Entries hold safetensors and JSON; nothing in the cache is unpickled or run.
* **Deletes only its own.** ``kvcli cache clear`` removes a folder only when its name is an entry's name and
  it holds a manifest kvcli wrote for that name (:func:`is_entry`), or when it is one of kvcli's temporary
  folders; anything else under ``models/`` (a model someone saved there) is left alone and named.
* **Optional.** When the cache folder cannot be written, the caller loads the source directly, after one
  line saying so.

This module imports neither torch nor transformers: ``kvcli cache`` lists and clears entries without them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.io.outputs import open_lock, replace_file, sync_folder

try:
    import fcntl
except ImportError:  # Windows: no lock; the atomic rename still leaves a complete entry or none
    fcntl = None

#: Version of the entry layout; an entry of another format is rebuilt.
FORMAT = 2
#: Format 1 (before files carried their SHA-256) is still recognised as kvcli's, so that ``clear`` removes it.
_OLD_FORMAT_KEYS = {1: {"format", "source", "variant", "created", "files"}}
MANIFEST = "kvcli-entry.json"
#: A ``stat`` this recent may not change on a write in the same clock tick, so it vouches for nothing.
RACY_SECONDS = 2.0
#: The cheap check reads this many evenly spaced blocks of :data:`_SAMPLE_BLOCK` bytes (first and last included).
_SAMPLES = 16
_SAMPLE_BLOCK = 1 << 16
_BUILD_PREFIX = ".build-"
_TRASH_PREFIX = ".trash-"
#: An entry's folder name: :func:`_slug` of its label, then 16 hex digits of its key (see :func:`converted`).
_ENTRY_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,79}-[0-9a-f]{16}"
#: kvcli's temporary folders: a build (``tempfile.mkdtemp``'s random suffix) or a removal of an entry.
_TEMPORARY_NAME = rf"\.(?:build|trash)-({_ENTRY_NAME})-[A-Za-z0-9_]+"
#: A remembered source hash (see :func:`file_sha256`), and what writing one leaves when killed (this
#: version's :func:`kvcli.io.outputs.new_temporary` name, or an earlier version's).
_MEMO_NAME = r"[0-9a-f]{32}\.json"
_MEMO_TEMPORARY = rf"\.{_MEMO_NAME}\.[0-9a-f]{{12}}\.tmp|{_MEMO_NAME}\.\d+\.partial"
#: kvcli's own folders beside the entries.
_OWN_FOLDERS = (".locks", ".sources")


class CacheUnwritable(Exception):
    """The cache folder cannot be written (read-only, no permission, disk full): load without the cache."""


class CacheRefused(KvcliError):
    """The cache folder is not one kvcli can trust or use (another user's, writable by others, a file); the
    message is one line that says how to fix it."""


def cache_root() -> Path:
    """Where kvcli keeps what it builds once: ``KVCLI_CACHE``, else ``$XDG_CACHE_HOME/kvcli``, else
    ``~/.cache/kvcli``."""
    moved = os.environ.get("KVCLI_CACHE")
    if moved:
        return Path(os.path.expanduser(moved)).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcli"


def models_dir() -> Path:
    """The converted models: one folder per entry."""
    return cache_root() / "models"


def ready(*, create: bool) -> Path:
    """:func:`models_dir`, once it and the cache root are checked to be folders of this user that nobody else
    can write; ``create`` makes the missing ones first, with mode 0o700.

    Raises :class:`CacheRefused` (a file, another user's folder, a folder others can write) and
    :class:`CacheUnwritable` (a folder that cannot be created).
    """
    root, folder = cache_root(), models_dir()
    for path in (root, folder):
        _check_is_folder(path)
        if create:
            try:
                path.mkdir(mode=0o700, parents=path is root, exist_ok=True)
            except OSError as exc:
                raise CacheUnwritable(exc.strerror or str(exc)) from None
        if path.exists():
            _check_private(path)
    return folder


@dataclass(frozen=True)
class Entry:
    """One converted model in the cache (complete or not), as ``kvcli cache`` lists it."""

    path: Path
    bytes: int
    #: The manifest (source, variant, files), or None for a temporary folder.
    manifest: dict | None
    #: None when the entry is complete; else what is wrong with it.
    problem: str | None

    @property
    def name(self) -> str:
        return self.path.name


def file_sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, remembered in the cache (``models/.sources``) and taken from there while
    the file is provably the one that was hashed.

    Why a remembered hash is safe to use (a wrong one would load another model's entry):

    * It is read only from a cache that :func:`ready` accepts (this user's, writable by nobody else). Whoever
      can write there could as well replace an entry's weights, so no check of the memo could stop them; the
      checks below are against everything else: a changed source, a damaged or misplaced memo.
    * It is used only for the same resolved path with the same size, mtime, ctime, inode and device. Replacing
      the file (``mv``, ``cp``, an editor's save) changes its inode or ctime, writing into it changes ctime, and
      ctime cannot be set back (``touch`` sets only atime and mtime), so a swapped or edited file is hashed
      again. A ``stat`` taken less than :data:`RACY_SECONDS` after the file's last change vouches for nothing,
      because a write in the same clock tick could leave it unchanged (git's "racy clean" rule).
    * It is sealed (:func:`_vouched`): a SHA-256 over the memo's fields and 1 MiB of the file sampled from start
      to end, computed again on every use. A memo edited by hand, one copied from another file, or a file
      rewritten on a file system whose timestamps do not move (some network and FUSE mounts) fails the seal,
      and the file is hashed again.

    What it saves is the full hash on every load (0.06 s for the default model's 94 MiB, more for larger ones);
    the cheap check reads about 1 MiB.
    """
    path = path.resolve()
    memo = _memo_of(path)
    saved = _read_json(memo) if memo is not None else None
    if saved is not None and saved.get("path") == str(path) and _vouched(path, saved):
        return saved["sha256"]
    record = _hashed(path)
    if memo is not None and _settled(record):
        try:
            _write_json(memo, {"path": str(path), **record})
        except OSError:
            pass  # a read-only cache only costs a hash per load
    return record["sha256"]


def converted(source: Path, label: str, variant: dict[str, str], convert: Callable[[Path], None], *,
              warn: Callable[[str], None]) -> Path | None:
    """The folder of the cache entry for ``source`` converted as ``variant``, built first with
    ``convert(folder)`` when it is missing or damaged; None when the cache cannot be used (after one
    line through ``warn``), so the caller loads ``source`` itself.

    ``label`` starts the entry's folder name (for people); ``variant`` holds everything besides the
    source's bytes that changes what ``convert`` writes. ``convert`` raises :class:`CacheUnwritable` when
    writing fails; anything else it raises propagates, and the partial entry is removed.
    """
    source = source.resolve()
    try:
        return _converted(source, label, variant, convert, warn)
    except CacheRefused as exc:
        warn(f"{exc} (loading {source.name} without the cache, slower every time)")
    except CacheUnwritable as exc:
        warn(_unwritable(exc, source))
    return None


def _converted(source: Path, label: str, variant: dict[str, str], convert: Callable[[Path], None],
               warn: Callable[[str], None]) -> Path:
    """:func:`converted`, raising :class:`CacheRefused` or :class:`CacheUnwritable` where the cache cannot serve."""
    folder = ready(create=True)
    sha = file_sha256(source)
    final = folder / f"{_slug(label)}-{_key(sha, variant)[:16]}"
    problem, rehashed = _inspect(final)
    if problem is None:
        _reseal(final, rehashed)
        return final
    if final.exists() or final.is_symlink():
        warn(f"the cached model {final} is damaged ({problem}): converting {source.name} again")
    with _locked(final):
        if check(final) is None:  # another process built it while this one waited
            return final
        _remove(final)
        _build(final, source, sha, variant, convert)
    return final


def built_file(filename: str, sha256: str, build: Callable[[Path], None], *, warn: Callable[[str], None]) -> Path:
    """``cache_root() / filename`` holding the bytes whose SHA-256 is ``sha256``, trusted by that hash and never by
    its name: built first when it is missing or holds other bytes (after one line through ``warn``).

    ``build(path)`` writes the file at ``path``, a new private temporary file beside the target; the build runs
    under a lock (two first runs build it once, the second then finds the first one's file), the result is
    synced, checked against ``sha256`` and renamed into place. A kill leaves the old file or the new one, and a
    leftover temporary file that the next build removes. Raises :class:`CacheRefused` and
    :class:`CacheUnwritable` as :func:`ready` does, :class:`KvcliError` when the bytes built are not the ones
    expected; what ``build`` raises propagates.
    """
    ready(create=True)
    target = cache_root() / filename
    if _holds(target, sha256):
        return target
    if target.exists() or target.is_symlink():
        warn(f"{target} is not the file kvcli built (a link, or its SHA-256 differs): building it again")
    with _locked(target):
        if _holds(target, sha256):  # another process built it while this one waited
            return target
        try:
            fd, name = tempfile.mkstemp(prefix=f"{_BUILD_PREFIX}{filename}-", dir=target.parent)
            os.close(fd)
        except OSError as exc:
            raise CacheUnwritable(exc.strerror or str(exc)) from None
        building = Path(name)
        try:
            build(building)
            try:
                _sync_file(building)
                made = _hashed(building)["sha256"]
                if made != sha256:
                    raise KvcliError(f"{target}: the file built has SHA-256 {made}, not the expected {sha256}")
                os.replace(building, target)
                sync_folder(target.parent)
            except OSError as exc:
                raise CacheUnwritable(exc.strerror or str(exc)) from None
        finally:
            _remove(building)  # gone already when the rename succeeded
    return target


def _holds(path: Path, sha256: str) -> bool:
    """Whether ``path`` is a regular file (not a link) whose bytes have SHA-256 ``sha256``."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode) and file_sha256(path) == sha256
    except OSError:
        return False


def check(entry: Path) -> str | None:
    """None when ``entry`` is complete and every file holds the bytes it was built with; else what is wrong, in
    a few words."""
    return _inspect(entry)[0]


def discard(entry: Path) -> None:
    """Remove a damaged entry, so that the next :func:`converted` builds it again."""
    with _locked(entry):
        _remove(entry)


def entries() -> list[Entry]:
    """kvcli's entries in the cache, complete or not (interrupted builds and removals included), by name."""
    return scan()[0]


@dataclass(frozen=True)
class Cleared:
    """What :func:`clear` did: entries removed, the bytes they held, and what it left because kvcli did not make
    it (names under ``models/``)."""

    removed: int
    bytes: int
    foreign: list[str]


def scan() -> tuple[list[Entry], list[str]]:
    """kvcli's entries and temporary folders (as :class:`Entry`), and the names of everything else under
    ``models/``: what kvcli did not make, which it lists but never removes.

    The entries' problems come from the cheap part of :func:`check` (presence, type and size of each file): a
    listing reads no weights.
    """
    folder = models_dir()
    _check_is_folder(cache_root())
    _check_is_folder(folder)
    if not folder.is_dir():
        return [], []
    found, foreign = [], []
    for path in sorted(folder.iterdir()):
        if path.name in _OWN_FOLDERS:
            continue
        if _temporary_of(path) is not None:
            what = "an interrupted removal" if path.name.startswith(_TRASH_PREFIX) else \
                "an interrupted or running conversion"
            found.append(Entry(path, _folder_bytes(path), None, what))
        elif is_entry(path):
            found.append(Entry(path, _folder_bytes(path), _manifest(path), _inspect(path, hashing=False)[0]))
        else:
            foreign.append(path.name)
    return found, foreign


def is_entry(path: Path) -> bool:
    """Whether kvcli made ``path``: a real folder (not a link) with an entry's name, holding a manifest kvcli wrote
    for that name (its source hash and variant give the name's key), or a manifest of kvcli's earlier format.
    Only such folders (and kvcli's temporaries) are ever removed by :func:`clear`."""
    if not re.fullmatch(_ENTRY_NAME, path.name) or path.is_symlink() or not path.is_dir():
        return False
    manifest = _manifest(path)
    if manifest is None:
        return False
    old = _OLD_FORMAT_KEYS.get(manifest.get("format"))
    return set(manifest) == old if old else _names(path, manifest)


def clear() -> Cleared:
    """Remove kvcli's entries, its temporary folders and its remembered hashes, leaving anything else alone.

    Each entry is renamed out of place first, then deleted, so an interrupted clear leaves no half entry, only a
    ``.trash-*`` folder that the next clear removes. A build in progress (its lock held) is left to finish. A
    command loading a model at the same time may find its entry gone and build it again. Raises
    :class:`KvcliError` when something kvcli made could not be removed (a read-only cache), saying how much was.
    """
    found, foreign = scan()
    ready(create=False)
    removed, freed, failures = 0, 0, []
    for entry in found:
        if entry.name.startswith(_BUILD_PREFIX) and _building(_temporary_of(entry.path)):
            continue
        try:
            _delete(entry.path)
        except OSError as exc:
            failures.append(exc)
            continue
        if entry.manifest is not None:
            removed, freed = removed + 1, freed + entry.bytes
    sources = models_dir() / ".sources"
    for memo in sorted(sources.iterdir()) if sources.is_dir() and not sources.is_symlink() else []:
        if re.fullmatch(_MEMO_NAME, memo.name) or re.fullmatch(_MEMO_TEMPORARY, memo.name):
            try:
                memo.unlink()
            except OSError as exc:
                failures.append(exc)
    if failures:
        reason = failures[0].strerror or str(failures[0])
        raise KvcliError(f"could not clear the model cache {models_dir()} ({reason}): removed {removed} cached "
                         f"model{'' if removed == 1 else 's'}; make it writable (chmod u+w) and run it again")
    with contextlib.suppress(OSError):
        sources.rmdir()  # only when nothing else is in it
    return Cleared(removed, freed, foreign)


# --------------------------------------------------------------------------- entries: build and check

def _key(source_sha256: str, variant: dict) -> str:
    """The key that names an entry: the format, the source's bytes and the variant."""
    return hashlib.sha256(json.dumps({"format": FORMAT, "source": source_sha256, "variant": variant},
                                     sort_keys=True).encode()).hexdigest()


def _names(entry: Path, manifest: dict) -> bool:
    """Whether ``manifest`` is of this format and was written for the folder it is in (the folder's name ends in
    the key of the manifest's source hash and variant), not copied from another entry."""
    source, variant = manifest.get("source"), manifest.get("variant")
    sha = source.get("sha256") if isinstance(source, dict) else None
    return (manifest.get("format") == FORMAT and _is_hex(sha) and isinstance(variant, dict)
            and entry.name.endswith("-" + _key(sha, variant)[:16]))


def _build(final: Path, source: Path, sha: str, variant: dict[str, str], convert: Callable[[Path], None]) -> None:
    """Convert into a temporary folder beside ``final``, sync and hash every file, write the manifest last,
    rename into place and sync the cache folder."""
    try:
        building = Path(tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{final.name}-", dir=final.parent))
    except OSError as exc:
        raise CacheUnwritable(exc.strerror or str(exc)) from None
    try:
        convert(building)
        try:
            files = {}
            for path in sorted(building.iterdir()):
                if path.is_file() and not path.is_symlink():
                    _sync_file(path)
                    files[path.name] = _hashed(path)
            manifest = {"format": FORMAT, "source": {"path": str(source), "bytes": source.stat().st_size,
                                                     "sha256": sha},
                        "variant": variant, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
            _write_json(building / MANIFEST, manifest)
            os.rename(building, final)
            sync_folder(final.parent)
        except OSError as exc:
            raise CacheUnwritable(exc.strerror or str(exc)) from None
    finally:
        _remove(building)  # gone already when the rename succeeded


def _inspect(entry: Path, *, hashing: bool = True) -> tuple[str | None, dict]:
    """``(problem, rehashed)``: what is wrong with ``entry`` (None: nothing), and the fresh records of the files
    whose bytes had to be hashed in full (the cheap check could not vouch for them). ``hashing=False`` checks
    only presence, type and size."""
    if entry.is_symlink() or (entry.exists() and not entry.is_dir()):
        return "not a folder kvcli made", {}
    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ("no manifest" if entry.exists() else "missing"), {}
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {type(exc).__name__}", {}
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or manifest.get("format") != FORMAT:
        return "a manifest of another format", {}
    if not _names(entry, manifest):
        return "a manifest written for another entry", {}
    rehashed = {}
    for name, record in files.items():
        if Path(name).name != name or name in ("", ".", "..", MANIFEST):
            return f"a manifest naming {name!r}", {}
        problem, fresh = _file_problem(entry / name, record, hashing)
        if problem is not None:
            return problem, {}
        if fresh is not None:
            rehashed[name] = fresh
    return None, rehashed


def _file_problem(path: Path, record: object, hashing: bool) -> tuple[str | None, dict | None]:
    """What is wrong with one file of an entry against its manifest ``record`` (None: nothing), and its fresh
    record when it had to be hashed in full."""
    name = path.name
    if not _is_record(record):
        return f"a manifest without {name}'s SHA-256", None
    try:
        st = os.lstat(path)
    except OSError:
        return f"{name} is missing", None
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file", None
    if st.st_size != record["stat"]["bytes"]:
        return f"{name} has {st.st_size:,} bytes, not {record['stat']['bytes']:,}", None
    if not hashing or _vouched(path, record):
        return None, None
    try:
        fresh = _hashed(path)
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror or exc})", None
    if fresh["sha256"] != record["sha256"]:
        return f"{name} is not the file that was built (its SHA-256 differs)", None
    return None, fresh


def _reseal(entry: Path, rehashed: dict) -> None:
    """Record the new ``stat`` of files whose bytes were just checked in full, so that the next load can vouch
    for them cheaply; skipped while any of them is too recent to vouch for anything (just built), while a build
    holds the entry's lock, or when the cache cannot be written."""
    if not rehashed or not all(_settled(record) for record in rehashed.values()):
        return
    with contextlib.suppress(OSError, CacheUnwritable, KvcliError, BlockingIOError), _locked(entry, wait=False):
        manifest = _manifest(entry)
        files = manifest.get("files") if manifest is not None else None
        if not isinstance(files, dict):
            return
        for name, record in rehashed.items():
            if isinstance(files.get(name), dict) and files[name].get("sha256") == record["sha256"]:
                files[name] = record
        _write_json(entry / MANIFEST, manifest)


# --------------------------------------------------------------------------- what a file's bytes are

def _hashed(path: Path) -> dict:
    """A record of ``path``'s bytes: its SHA-256, its ``stat`` before hashing, when that was taken (``checked_ns``)
    and the seal of :func:`_vouched`. A file that changed while it was read gets ``checked_ns`` 0: its record
    vouches for nothing."""
    checked = time.time_ns()
    before = _identity(path)
    digest = hashlib.sha256()
    with _open_regular(path) as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    sample = _sample(path, before["bytes"])
    record = {"sha256": digest.hexdigest(), "stat": before,
              "checked_ns": checked if _identity(path) == before else 0}
    return {**record, "seal": _seal(record, sample)}


def _vouched(path: Path, record: dict) -> bool:
    """The cheap check: whether ``record``'s SHA-256 can be taken for ``path``'s bytes without reading them all.

    True only when the file has the recorded ``stat`` (size, mtime, ctime, inode, device: any write changes
    ctime, any replacement the inode), the record was made at least :data:`RACY_SECONDS` after the file's last
    change (:func:`_settled`), and the seal, a SHA-256 over the record and :data:`_SAMPLES` blocks read from
    start to end of the file, is the recorded one.
    """
    try:
        identity = _identity(path)
        if not _is_record(record) or record["stat"] != identity or not _settled(record):
            return False
        return secrets.compare_digest(record["seal"], _seal(record, _sample(path, identity["bytes"])))
    except OSError:
        return False


def _settled(record: dict) -> bool:
    """Whether ``record``'s ``stat`` was taken long enough after the file's last change to tell a later one."""
    newest = max(record["stat"]["mtime_ns"], record["stat"]["ctime_ns"])
    return record["checked_ns"] - newest > RACY_SECONDS * 1e9


def _seal(record: dict, sample: bytes) -> str:
    fields = {key: record[key] for key in ("sha256", "stat", "checked_ns")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode() + sample).hexdigest()


def _sample(path: Path, size: int) -> bytes:
    """The SHA-256 of :data:`_SAMPLES` blocks of ``path`` spread evenly from its first byte to its last."""
    digest = hashlib.sha256()
    span = max(size - _SAMPLE_BLOCK, 0)
    with _open_regular(path) as handle:
        for offset in sorted({span * i // (_SAMPLES - 1) for i in range(_SAMPLES)}):
            handle.seek(offset)
            digest.update(handle.read(_SAMPLE_BLOCK))
    return digest.digest()


def _identity(path: Path) -> dict[str, int]:
    """The ``stat`` of a regular file (never followed through a link); an OSError for anything else."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a regular file")
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def _open_regular(path: Path):
    """``open(path, "rb")``, never through a link."""
    return open(path, "rb", opener=lambda name, flags: os.open(name, flags | getattr(os, "O_NOFOLLOW", 0)))


def _is_record(value: object) -> bool:
    if not isinstance(value, dict) or not _is_hex(value.get("sha256")) or not _is_hex(value.get("seal")):
        return False
    identity = value.get("stat")
    keys = {"bytes", "mtime_ns", "ctime_ns", "inode", "device"}
    return (isinstance(identity, dict) and set(identity) == keys
            and all(type(identity[key]) is int for key in keys) and type(value.get("checked_ns")) is int)


def _memo_of(path: Path) -> Path | None:
    """Where ``path``'s hash is remembered; None when the cache is not one to trust (:func:`ready`)."""
    try:
        folder = ready(create=False)
    except KvcliError:
        return None
    return folder / ".sources" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"


# --------------------------------------------------------------------------- locks and files

@contextmanager
def _locked(entry: Path, *, wait: bool = True) -> Iterator[None]:
    """Hold ``entry``'s build lock (``wait=False``: BlockingIOError when another process holds it); on entering,
    remove what killed builds of it left behind."""
    lock = entry.parent / ".locks" / f"{entry.name}.lock"
    try:
        lock.parent.mkdir(mode=0o700, exist_ok=True)
        handle = os.fdopen(open_lock(lock), "r+b")
    except OSError as exc:
        raise CacheUnwritable(exc.strerror or str(exc)) from None
    except KvcliError as exc:
        raise CacheRefused(str(exc)) from None
    try:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            # Whoever builds this entry holds this lock, so its leftover build folders belong to dead builds.
            for leftover in entry.parent.glob(f"{_BUILD_PREFIX}{entry.name}-*"):
                _remove(leftover)
        yield
    finally:
        handle.close()


def _remove(path: Path) -> None:
    """Remove ``path`` if it is there: a folder with what is in it, a file or a link (never what a link names)."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _delete(path: Path) -> None:
    """Remove one of kvcli's folders in the cache: renamed out of place first (a kill leaves no half entry),
    then deleted; an OSError when either step fails (a read-only cache)."""
    trash = path
    if not path.name.startswith(_TRASH_PREFIX):
        trash = path.with_name(f"{_TRASH_PREFIX}{_temporary_of(path) or path.name}-{secrets.token_hex(4)}")
        os.rename(path, trash)
    shutil.rmtree(trash)


def _temporary_of(path: Path) -> str | None:
    """The entry name a temporary folder (a build or a removal) belongs to; None for anything else."""
    match = re.fullmatch(_TEMPORARY_NAME, path.name)
    return match.group(1) if match and path.is_dir() and not path.is_symlink() else None


def _building(name: str) -> bool:
    """Whether a live process holds entry ``name``'s build lock (so its build folder is in use)."""
    lock = models_dir() / ".locks" / f"{name}.lock"
    if fcntl is None or not lock.is_file():
        return False
    try:
        handle = os.fdopen(open_lock(lock), "r+b")
    except (OSError, KvcliError):
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
    return False


def _check_is_folder(path: Path) -> None:
    """A one-line error when the cache (or its ``models/``) is a file: nothing could be cached in it."""
    if path.exists() and not path.is_dir():
        raise CacheRefused(f"the model cache {path} is a file, not a folder: set KVCLI_CACHE to a folder "
                           "(or unset it to use ~/.cache/kvcli)")


def _check_private(folder: Path) -> None:
    """A one-line error when ``folder`` belongs to another user or others can write it: whoever can write the
    cache decides what kvcli loads from it. Windows has neither owners nor mode bits to check here."""
    if not hasattr(os, "geteuid"):
        return
    st = folder.stat()
    if st.st_uid != os.geteuid():
        raise CacheRefused(f"the model cache {folder} belongs to another user (uid {st.st_uid}), so kvcli does not "
                           "trust what is in it: set KVCLI_CACHE to a folder of your own")
    if st.st_mode & 0o022:
        raise CacheRefused(f"the model cache {folder} can be written by other users (mode {st.st_mode & 0o777:o}), "
                           f"so kvcli does not trust what is in it: run `chmod 700 {folder}`, or set KVCLI_CACHE "
                           "to a folder of your own")


def _unwritable(exc: CacheUnwritable, source: Path) -> str:
    return (f"the model cache {cache_root()} cannot be written ({exc}): loading {source.name} without it, "
            "which is slower every time (set KVCLI_CACHE to a writable folder)")


def _manifest(entry: Path) -> dict | None:
    """``entry``'s manifest as a JSON object, or None when it has none that can be read."""
    return _read_json(entry / MANIFEST)


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict) -> None:
    """Replace ``path`` whole (:func:`kvcli.io.outputs.replace_file`, a private file), creating its folder (0o700)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    replace_file(path, (json.dumps(value, indent=1) + "\n").encode("utf-8"), mode=0o600)


def _sync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-")[:80] or "model"


def _is_hex(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None
