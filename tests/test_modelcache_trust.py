"""The model cache trusts only what it made (kvcli/modelcache.py): ``kvcli cache clear`` removes kvcli's entries and
temporary folders and nothing else, and fails in one line when it cannot.

Entries are built with the fake conversion of ``test_modelcache`` (two small files), so these tests need no model.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from test_modelcache import _fake_convert
from test_trust import one_line

from kvcli import modelcache


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache of this test's own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVCLI_CACHE", str(folder))
    return folder


def built(tmp_path: Path, content: bytes = b"weights") -> Path:
    """A complete entry (fake conversion of a source file holding ``content``)."""
    source = tmp_path / f"model-{content.hex()[:8]}.gguf"
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
    from kvcli import outputs

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
    from kvcli.outputs import atomic_write

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    atomic_write(target, b"{}")
    assert not target.is_symlink() and target.read_bytes() == b"{}" and victim.read_text() == "keep me"


def test_atomic_write_syncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    """The rename survives a power cut only once the folder is synced too."""
    import stat

    from kvcli import outputs

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(outputs.os, "fsync", fsync)
    outputs.atomic_write(tmp_path / "out.json", b"{}")
    assert synced == ["file", "folder"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from kvcli import outputs
    from kvcli.errors import KvcliError

    target = tmp_path / "out.json"
    target.write_text("old")

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs.os, "replace", full)
    with pytest.raises(KvcliError, match="No space left"):
        outputs.atomic_write(target, b"new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
