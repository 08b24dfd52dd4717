"""The CLI as a user meets it: stdout holds only results, errors are one line, inputs of every kind."""

from __future__ import annotations

import json

import pytest
from conftest import TEXT


def test_ppl_json_has_the_documented_keys(invoke, tiny_model_dir, book):
    result = invoke("ppl", str(book), "--model", str(tiny_model_dir), "--method", "streamingllm",
                    "--cache", "64", "--block", "32", "--max-tokens", "300", "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("model", "method", "cache", "block", "tokens", "nll", "ppl", "bits_per_byte", "kv_cache_bytes",
                "full_kv_cache_bytes", "peak_memory_bytes", "seconds", "tokens_per_second"):
        assert key in data
    assert data["tokens"] == 300 and data["max_cache_tokens"] <= 64
    assert data["ppl"] == pytest.approx(2.718281828 ** data["nll"], rel=1e-6)
    assert data["kv_cache_bytes"] < data["full_kv_cache_bytes"]
    assert 0 < data["bits_per_byte"] < 100 and data["peak_memory_bytes"] > 0


def test_ppl_text_summary_and_jsonl_curve(invoke, tiny_model_dir, book, tmp_path):
    curve = tmp_path / "curve.jsonl"
    result = invoke("ppl", str(book), "--model", str(tiny_model_dir), "--cache", "48", "--block", "16",
                    "--max-tokens", "100", "--jsonl", str(curve), "--quiet")
    assert result.exit_code == 0
    assert result.stdout.startswith("perplexity ")
    records = [json.loads(line) for line in curve.read_text().splitlines()]
    assert sum(r["tokens"] for r in records) == 100
    assert {"position", "nll", "cache_tokens", "tokens_per_second"} <= set(records[0])
    assert max(r["cache_tokens"] for r in records) <= 48


def test_stdin_source(invoke, tiny_model_dir):
    result = invoke("ppl", "-", "--model", str(tiny_model_dir), "--cache", "64", "--max-tokens", "50", "--json",
                    "--quiet", input=TEXT)
    assert result.exit_code == 0
    assert json.loads(result.stdout)["tokens"] == 50


def test_documents_fresh_cache_versus_one_stream(invoke, tiny_model_dir, tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    (folder / "b.txt").write_text(TEXT[::-1])
    common = ["--model", str(tiny_model_dir), "--cache", "64", "--block", "32", "--json", "--quiet"]
    per_doc = json.loads(invoke("ppl", str(folder), *common).stdout)
    streamed = json.loads(invoke("ppl", str(folder), "--stream", *common).stdout)
    assert [d["name"].rsplit("/", 1)[-1] for d in per_doc["documents"]] == ["a.txt", "b.txt"]
    assert per_doc["tokens"] == sum(d["tokens"] for d in per_doc["documents"])
    assert "documents" not in streamed and streamed["tokens"] == per_doc["tokens"] + 1  # b's first token scored
    weighted = sum(d["nll"] * d["tokens"] for d in per_doc["documents"]) / per_doc["tokens"]
    assert per_doc["nll"] == pytest.approx(weighted, rel=1e-9)


def test_sliding_window_protocol(invoke, tiny_model_dir, book):
    result = invoke("ppl", str(book), "--model", str(tiny_model_dir), "--method", "full", "--context", "64",
                    "--stride", "32", "--max-tokens", "200", "--json", "--quiet")
    data = json.loads(result.stdout)
    assert data["protocol"] == "sliding" and data["tokens"] == 200


def test_methods_json_lists_names_descriptions_params(invoke):
    data = json.loads(invoke("methods", "--json").stdout)
    names = {m["name"] for m in data}
    assert {"full", "streamingllm"} <= names
    for method in data:
        assert method["description"] and isinstance(method["params"], list)


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["ppl", "/no/such/book.txt"], "no such file", 1),
        (["ppl", "BOOK", "--method", "nosuch"], "unknown method", 2),
        (["ppl", "BOOK", "--method", "streamingllm", "--cache", "3"], "--cache 3", 2),
        (["ppl", "EMPTY", "--model", "MODEL"], "empty", 1),
        (["ppl", "BOOK", "--model", "/no/such/model.gguf"], "no such model file", 1),
    ],
)
def test_errors_are_one_line_without_traceback(invoke, args, message, code, book, tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    args = [str(book) if a == "BOOK" else str(empty) if a == "EMPTY" else str(tiny_model_dir) if a == "MODEL"
            else a for a in args]
    result = invoke(*args, "--quiet")
    assert result.exit_code == code, result.stderr
    assert result.stdout == ""
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_latin1_input_warns_once_and_runs(invoke, tiny_model_dir, tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(("Caf\xe9 cr\xe8me br\xfbl\xe9e. " * 30).encode("latin-1"))
    result = invoke("ppl", str(path), "--model", str(tiny_model_dir), "--cache", "64", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] > 0
    assert result.stderr.lower().count("utf-8") == 1


@pytest.mark.parametrize("module", ["kvcli", "kvcli.cli"])
def test_both_module_entry_points_list_every_command(module):
    import subprocess
    import sys

    from kvcli.cli import app

    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = [command.name or command.callback.__name__ for command in app.registered_commands]
    assert len(names) == 14  # ppl, summarize, ask, read, needle, ruler, bench, bench-speed, analyze, methods, models,
    # presets, calibrate, adapt
    assert all(f" {name} " in proc.stdout for name in names)


def test_block_auto_is_the_devices_default_and_bad_blocks_are_refused(invoke, tiny_model_dir, book):
    from kvcli.engine.engine import default_block

    assert default_block("cpu") == 256 and default_block("cuda") > default_block("cpu")
    common = ["ppl", str(book), "--model", str(tiny_model_dir), "--cache", "64", "--max-tokens", "40", "--quiet"]
    for extra in ([], ["--block", "auto"]):
        result = invoke(*common, *extra, "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["block"] == default_block("cpu")
    for bad in ("0", "big"):
        result = invoke(*common, "--block", bad)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "--block" in result.stderr
