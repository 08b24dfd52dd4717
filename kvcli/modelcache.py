"""The model cache: a model that must be converted before it can run (a GGUF) is converted once, and every
later load reads the converted folder, memory-mapped, instead of parsing and dequantizing the file again.

Layout under :func:`cache_root` (``KVCLI_CACHE``, else ``$XDG_CACHE_HOME/kvcli``, else ``~/.cache/kvcli``)::

    models/<name>/                   an entry: what transformers' ``save_pretrained`` writes (safetensors
                                     weights, config, generation config, tokenizer, chat template) plus
    models/<name>/kvcli-entry.json   its manifest, written last: source, variant, every file's size
    models/.build-<name>-*/          an entry being built, renamed to ``models/<name>`` when complete
    models/.trash-<name>-*/          an entry being removed (renamed out of place first, then deleted)
    models/.locks/<name>.lock        held while an entry is built, so two first loads build it once
    models/.sources/<id>.json        a source file's SHA-256, remembered against its ``stat``

Rules, and why:

* **Never stale.** An entry is named by the SHA-256 of the source file's bytes and by the variant (the dtype
  the weights were dequantized to and the versions of the converting libraries), so a changed file or a new
  transformers gets a new entry. The hash is computed again whenever the file's ``stat`` (size, mtime,
  ctime, inode, device) differs from the remembered one; ctime changes on every write and cannot be set back
  by ``touch``, and a ``stat`` younger than :data:`RACY_SECONDS` is never remembered, because a write in
  the same clock tick could leave it unchanged (git's "racy clean" rule).
* **Complete or absent.** An entry is built in a temporary folder beside its final place and renamed into
  place, which is atomic: a kill leaves a complete entry or none (a leftover ``.build-*`` folder is removed by
  the next build of the same entry). Builders of one entry take its lock, so a second first load waits and
  then reads the entry the first one built.
* **Checked on every load.** Every file must have the size the manifest records (a ``stat`` each, so a
  weights file cut short is found before it is read); a damaged entry is rebuilt after one warning.
  Same-size corruption is not looked for: hashing the weights would cost more than the load it saves.
* **Data only.** Entries hold safetensors and JSON; nothing in the cache is unpickled or run.
* **Deletes only its own.** ``kvcli cache clear`` removes a folder only when its name is an entry's name and
  it holds a manifest kvcli wrote (:func:`is_entry`), or when it is one of kvcli's temporary folders; anything
  else under ``models/`` (a model someone saved there) is left alone and named.
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
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError

try:
    import fcntl
except ImportError:  # Windows: no lock; the atomic rename still leaves a complete entry or none
    fcntl = None

#: Version of the entry layout; an entry of another format is rebuilt.
FORMAT = 1
MANIFEST = "kvcli-entry.json"
#: A ``stat`` this recent may not change on a write in the same clock tick, so its hash is not remembered.
RACY_SECONDS = 2.0
_BUILD_PREFIX = ".build-"
_TRASH_PREFIX = ".trash-"
#: An entry's folder name: :func:`_slug` of its label, then 16 hex digits of its key (see :func:`converted`).
_ENTRY_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,79}-[0-9a-f]{16}"
#: kvcli's temporary folders: a build (``tempfile.mkdtemp``'s random suffix) or a removal of an entry.
_TEMPORARY_NAME = rf"\.(?:build|trash)-({_ENTRY_NAME})-[A-Za-z0-9_]+"
#: A remembered source hash (see :func:`file_sha256`).
_MEMO_NAME = r"[0-9a-f]{32}\.json"
#: What :func:`_write_json` leaves when killed while it writes a remembered hash.
_MEMO_TEMPORARY = rf"{_MEMO_NAME}\.\d+\.partial"
#: kvcli's own folders beside the entries.
_OWN_FOLDERS = (".locks", ".sources")


class CacheUnwritable(Exception):
    """The cache folder cannot be written (read-only, no permission, disk full): load without the cache."""


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


@dataclass(frozen=True)
class Entry:
    """One converted model in the cache (complete or not), as ``kvcli cache`` lists it."""

    path: Path
    bytes: int
    #: The manifest (source, variant, files), or None for a folder without a readable one.
    manifest: dict | None
    #: None when the entry is complete; else what is wrong with it.
    problem: str | None

    @property
    def name(self) -> str:
        return self.path.name


def file_sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, remembered against its ``stat`` (see the module's rules)."""
    path = path.resolve()
    before = _identity(path)
    memo = models_dir() / ".sources" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(memo.read_text(encoding="utf-8"))
        if saved.get("path") == str(path) and saved.get("stat") == before and _is_hex(saved.get("sha256")):
            return saved["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    sha = digest.hexdigest()
    newest = max(before["mtime_ns"], before["ctime_ns"]) / 1e9
    if _identity(path) == before and time.time() - newest > RACY_SECONDS:
        try:
            _write_json(memo, {"path": str(path), "stat": before, "sha256": sha})
        except OSError:
            pass  # a read-only cache only costs a hash per load
    return sha


def converted(source: Path, label: str, variant: dict[str, str], convert: Callable[[Path], None], *,
              warn: Callable[[str], None]) -> Path | None:
    """The folder of the cache entry for ``source`` converted as ``variant``, built first with
    ``convert(folder)`` when it is missing or damaged; None when the cache cannot be written (after one
    line through ``warn``), so the caller loads ``source`` itself.

    ``label`` starts the entry's folder name (for people); ``variant`` holds everything besides the
    source's bytes that changes what ``convert`` writes. ``convert`` raises :class:`CacheUnwritable` when
    writing fails; anything else it raises propagates, and the partial entry is removed.
    """
    source = source.resolve()
    key = hashlib.sha256(json.dumps({"format": FORMAT, "source": file_sha256(source), "variant": variant},
                                    sort_keys=True).encode()).hexdigest()
    final = models_dir() / f"{_slug(label)}-{key[:16]}"
    problem = check(final)
    if problem is None:
        return final
    if final.exists():
        warn(f"the cached model {final} is damaged ({problem}): converting {source.name} again")
    try:
        with _locked(final):
            if check(final) is None:  # another process built it while this one waited
                return final
            _remove(final)
            _build(final, source, variant, convert)
    except CacheUnwritable as exc:
        warn(f"the model cache {cache_root()} cannot be written ({exc}): loading {source.name} without it, "
             "which is slower every time (set KVCLI_CACHE to a writable folder)")
        return None
    return final


def check(entry: Path) -> str | None:
    """None when ``entry`` is complete (its manifest readable and every file of the size it records);
    else what is wrong, in a few words."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no manifest" if entry.exists() else "missing"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {type(exc).__name__}"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or manifest.get("format") != FORMAT:
        return "a manifest of another format"
    for name, size in files.items():
        if Path(name).name != name:
            return f"a manifest naming {name!r}"
        try:
            actual = (entry / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual:,} bytes, not {size:,}"
    return None


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
    ``models/``: what kvcli did not make, which it lists but never removes."""
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
            found.append(Entry(path, _folder_bytes(path), _manifest(path), check(path)))
        else:
            foreign.append(path.name)
    return found, foreign


def is_entry(path: Path) -> bool:
    """Whether kvcli made ``path``: a real folder (not a link) with an entry's name, holding a manifest of the
    current format. Only such folders (and kvcli's temporaries) are ever removed by :func:`clear`."""
    if not re.fullmatch(_ENTRY_NAME, path.name) or not path.is_dir() or path.is_symlink():
        return False
    manifest = _manifest(path)
    return manifest is not None and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)


def clear() -> Cleared:
    """Remove kvcli's entries, its temporary folders and its remembered hashes, leaving anything else alone.

    Each entry is renamed out of place first, then deleted, so an interrupted clear leaves no half entry, only a
    ``.trash-*`` folder that the next clear removes. A build in progress (its lock held) is left to finish. A
    command loading a model at the same time may find its entry gone and build it again. Raises
    :class:`KvcliError` when something kvcli made could not be removed (a read-only cache), saying how much was.
    """
    found, foreign = scan()
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
    for memo in sorted(sources.iterdir()) if sources.is_dir() else []:
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


def _build(final: Path, source: Path, variant: dict[str, str], convert: Callable[[Path], None]) -> None:
    """Convert into a temporary folder beside ``final``, write the manifest last, rename into place."""
    try:
        building = Path(tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{final.name}-", dir=final.parent))
    except OSError as exc:
        raise CacheUnwritable(exc.strerror or str(exc)) from None
    try:
        convert(building)
        files = {path.name: path.stat().st_size for path in sorted(building.iterdir()) if path.is_file()}
        manifest = {"format": FORMAT, "source": {"path": str(source), "bytes": source.stat().st_size},
                    "variant": variant, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        try:
            (building / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            os.rename(building, final)
        except OSError as exc:
            raise CacheUnwritable(exc.strerror or str(exc)) from None
    finally:
        _remove(building)  # gone already when the rename succeeded


@contextmanager
def _locked(entry: Path) -> Iterator[None]:
    """Hold ``entry``'s build lock; on entering, remove what killed builds of it left behind."""
    lock = entry.parent / ".locks" / f"{entry.name}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a+b")  # noqa: SIM115 (closed below, after the lock is released)
    except OSError as exc:
        raise CacheUnwritable(exc.strerror or str(exc)) from None
    try:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
            # Whoever builds this entry holds this lock, so its leftover build folders belong to dead builds.
            for leftover in entry.parent.glob(f"{_BUILD_PREFIX}{entry.name}-*"):
                _remove(leftover)
        yield
    finally:
        handle.close()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


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
    with open(lock, "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
    return False


def _check_is_folder(path: Path) -> None:
    """A one-line error when the cache (or its ``models/``) is a file: nothing could be cached in it."""
    if path.exists() and not path.is_dir():
        raise KvcliError(f"the model cache {path} is a file, not a folder: set KVCLI_CACHE to a folder "
                         "(or unset it to use ~/.cache/kvcli)")


def _manifest(entry: Path) -> dict | None:
    """``entry``'s manifest as a JSON object, or None when it has none that can be read."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def _write_json(path: Path, value: dict) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(value) + "\n", encoding="utf-8")
    os.replace(partial, path)


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
