"""The model cache: a model that must be converted before it can run (a GGUF) is converted once, and every
later load reads the converted folder, memory-mapped, instead of parsing and dequantizing the file again.

Layout under :func:`cache_root` (``KVCLI_CACHE``, else ``$XDG_CACHE_HOME/kvcli``, else ``~/.cache/kvcli``)::

    models/<name>/                   an entry: what transformers' ``save_pretrained`` writes (safetensors
                                     weights, config, generation config, tokenizer, chat template) plus
    models/<name>/kvcli-entry.json   its manifest, written last: source, variant, every file's size
    models/.build-<name>-*/          an entry being built, renamed to ``models/<name>`` when complete
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
* **Optional.** When the cache folder cannot be written, the caller loads the source directly, after one
  line saying so.

This module imports neither torch nor transformers: ``kvcli cache`` lists and clears entries without them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
    """Every entry in the cache, complete or not (interrupted builds included), by name."""
    folder = models_dir()
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.iterdir()):
        if not path.is_dir() or path.name in (".locks", ".sources"):
            continue
        problem = "an interrupted or running conversion" if path.name.startswith(_BUILD_PREFIX) else check(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = None
        out.append(Entry(path, _folder_bytes(path), manifest if isinstance(manifest, dict) else None, problem))
    return out


def clear() -> tuple[int, int]:
    """Remove every entry and remembered hash; ``(entries removed, bytes freed)``.

    A command loading a model at the same time may find its entry gone and build it again.
    """
    removed = []
    for entry in entries():
        _remove(entry.path)
        if not entry.path.exists():
            removed.append(entry)
    shutil.rmtree(models_dir() / ".sources", ignore_errors=True)
    return len(removed), sum(entry.bytes for entry in removed)


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
