"""Corpora at scale: bad inputs a new user meets, one row per document, resume, checkpoints, several ranks."""

from __future__ import annotations

import struct

import pytest


def one_line_error(result, code: int = 1) -> str:
    """The error line of a failed run, after checking it is the only output and the exit code."""
    assert result.exit_code == code, result.stdout + result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_truncated_gguf_is_one_line(invoke, book, tmp_path):
    model = tmp_path / "cut.gguf"
    # A GGUF header (magic, version 3, no tensors, one metadata entry) cut inside its first key.
    model.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 40) + b"general.arch")
    line = one_line_error(invoke("ppl", book, "--model", model, "--quiet"))
    assert "truncated or corrupt" in line and str(model) in line


def test_corrupt_gguf_is_one_line(invoke, book, tmp_path):
    model = tmp_path / "junk.gguf"
    model.write_bytes(b"this is not a model\n" * 10)
    line = one_line_error(invoke("ppl", book, "--model", model, "--quiet"))
    assert str(model) in line


@pytest.mark.parametrize("spec", ["/no/such/model-folder", "./no-such-model", "models/no/such"])
def test_missing_model_path_is_no_such_file_not_a_repo_id(invoke, book, spec):
    line = one_line_error(invoke("ppl", book, "--model", spec, "--quiet"))
    assert "no such file or folder" in line and "Repo id" not in line


def test_jsonl_into_missing_folder_is_one_line(invoke, book, tmp_path):
    target = tmp_path / "missing" / "curve.jsonl"
    line = one_line_error(invoke("ppl", book, "--jsonl", target, "--quiet"))
    assert "--jsonl" in line and "no such folder" in line


def test_jsonl_onto_a_folder_is_one_line(invoke, book, tmp_path):
    line = one_line_error(invoke("ppl", book, "--jsonl", tmp_path, "--quiet"))
    assert "--jsonl" in line and "is a folder" in line
