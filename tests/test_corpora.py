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


# --------------------------------------------------------------------------- one row per document

TIMING = {"seconds", "tokens_per_second", "peak_memory_bytes", "job"}


def corpus(tmp_path, count: int = 3):
    """A folder of ``count`` short documents of different lengths (different sizes: a real deal to balance)."""
    from conftest import TEXT

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(count):
        (folder / f"doc{i}.txt").write_text(TEXT[: 300 + 150 * i] + f" Document {i}.", encoding="utf-8")
    return folder


def without_timing(result: dict) -> dict:
    """A ``ppl --json`` result without what differs from run to run (time, memory, the job's throughput)."""
    out = {k: v for k, v in result.items() if k not in TIMING}
    out["documents"] = [{k: v for k, v in row.items() if k != "seconds"} for row in result.get("documents", [])]
    return out


def ppl_args(folder, model):
    return ["ppl", folder, "--model", model, "--cache", "48", "--block", "16", "--json", "--quiet"]


def test_ppl_rows_are_the_documents_of_the_json(invoke, tiny_model_dir, tmp_path):
    import json

    folder = corpus(tmp_path)
    rows_file = tmp_path / "rows.jsonl"
    result = invoke(*ppl_args(folder, tiny_model_dir), "--rows", rows_file)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [row["document"] for row in rows] == [str(p) for p in sorted(folder.glob("*.txt"))]
    # Each line is the document's row and the settings that made it (what --resume checks).
    assert all(row.pop("run")["method"] == "streamingllm" for row in rows)
    assert rows == [{k: v for k, v in doc.items() if k != "name"} for doc in data["documents"]]
    assert data["job"]["documents"] == 3 and data["job"]["resumed"] == 0 and data["job"]["documents_per_second"] > 0


def test_ppl_resume_skips_written_rows_and_gives_the_same_totals(invoke, tiny_model_dir, tmp_path):
    import json

    folder = corpus(tmp_path)
    rows_file = tmp_path / "rows.jsonl"
    whole = json.loads(invoke(*ppl_args(folder, tiny_model_dir), "--rows", rows_file).stdout)
    lines = rows_file.read_bytes().splitlines(keepends=True)
    rows_file.write_bytes(lines[0] + lines[1][:25])  # a kill during the second row's write
    resumed = invoke(*ppl_args(folder, tiny_model_dir), "--rows", rows_file, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    again = json.loads(resumed.stdout)
    assert again["job"]["resumed"] == 1 and again["job"]["documents"] == 2
    assert without_timing(again) == without_timing(whole)
    lines = rows_file.read_bytes().splitlines()
    assert [json.loads(line)["document"] for line in lines] == [d["name"] for d in whole["documents"]]


def test_resume_without_rows_and_rows_with_stream_are_usage_errors(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    assert "--rows" in one_line_error(invoke(*ppl_args(folder, tiny_model_dir), "--resume"), 2)
    assert "--stream" in one_line_error(invoke(*ppl_args(folder, tiny_model_dir), "--stream", "--rows",
                                               tmp_path / "r.jsonl"), 2)
    assert "no such folder" in one_line_error(invoke(*ppl_args(folder, tiny_model_dir), "--rows",
                                                     tmp_path / "nope" / "r.jsonl"))


def test_rows_file_of_something_else_is_refused_on_resume(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    line = one_line_error(invoke(*ppl_args(folder, tiny_model_dir), "--rows", other, "--resume"))
    assert "not a row of kvcli" in line


@pytest.mark.parametrize("command", [["summarize"], ["ask", "Who is tired?"]])
def test_each_writes_one_json_line_per_document(invoke, tiny_model_dir, tmp_path, command):
    import json

    folder = corpus(tmp_path)
    common = ["--model", tiny_model_dir, "--cache", "48", "--block", "16", "-n", "4", "--each", "--quiet"]
    result = invoke(command[0], folder, *command[1:], *common)
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["document"] for row in rows] == [str(p) for p in sorted(folder.glob("*.txt"))]
    assert all(row["tokens"] > 0 and isinstance(row["text"], str) and row["generated_tokens"] <= 4 for row in rows)
    rows_file = tmp_path / "each.jsonl"
    to_file = invoke(command[0], folder, *command[1:], *common, "--rows", rows_file)
    assert to_file.exit_code == 0 and to_file.stdout == ""
    assert [json.loads(line)["text"] for line in rows_file.read_text().splitlines()] == [row["text"] for row in rows]


def test_shard_deals_longest_first_to_the_least_loaded_rank():
    from kvcli.io.corpus import shard

    sizes = [5, 90, 10, 40, 50, 7]
    shares = shard(sizes, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(sizes)))
    # 90 -> rank 0; 50, 40 -> rank 1 (90 each); 10 -> rank 0 on the tie (100); 7, 5 -> rank 1 (97, 102)
    assert shares == [[1, 2], [0, 3, 4, 5]]
    assert shard(sizes, 1) == [list(range(len(sizes)))]


# --------------------------------------------------------------------------- several ranks


def run_kvcli(*args, ranks: int = 1, timeout: int = 300):
    """``python -m kvcli ARGS`` in a subprocess (under torch.distributed.run when ``ranks`` > 1), one thread each."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, *launcher, "-m", "kvcli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_two_cpu_ranks_give_exactly_the_single_process_result(tiny_model_dir, tmp_path):
    import json

    folder = corpus(tmp_path, count=5)
    rows_file = tmp_path / "rows.jsonl"
    args = [*ppl_args(folder, tiny_model_dir)[1:], "--rows", rows_file]
    single = run_kvcli("ppl", *args)
    assert single.returncode == 0, single.stderr
    one = json.loads(single.stdout)
    single_rows = rows_file.read_text()
    double = run_kvcli("ppl", *args, ranks=2)
    assert double.returncode == 0, double.stderr
    two = json.loads(double.stdout)  # rank 0 alone prints
    assert two["job"]["ranks"] == 2 and one["job"]["ranks"] == 1
    assert without_timing(two) == without_timing(one)
    merged = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in merged] == [
        {k: v for k, v in json.loads(line).items() if k != "seconds"} for line in single_rows.splitlines()]
    assert not list(tmp_path.glob("rows.jsonl.rank*"))  # the ranks' part files are merged and gone


# --------------------------------------------------------------------------- checkpoints of one stream


def test_stream_killed_after_its_first_checkpoint_resumes_to_the_same_totals(tiny_model_dir, tmp_path):
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import TEXT

    book = tmp_path / "long.txt"
    book.write_text(TEXT * 8, encoding="utf-8")
    folder = tmp_path / "ckpt"
    args = ["ppl", book, "--model", tiny_model_dir, "--cache", "48", "--block", "16", "--json"]
    whole = run_kvcli(*args, "--quiet")
    assert whole.returncode == 0, whole.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    victim = subprocess.Popen([sys.executable, "-m", "kvcli", *map(str, args), "--checkpoint", folder,
                               "--checkpoint-every", "32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env)
    deadline = time.monotonic() + 120
    while not (folder / "state.pt").exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = run_kvcli(*args, "--checkpoint", folder, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    position = int(re.search(r"from token ([\d,]+)", resumed.stderr).group(1).replace(",", ""))
    first, again = json.loads(whole.stdout), json.loads(resumed.stdout)
    assert 0 < position < first["tokens"]  # it was killed mid-stream, not after the end
    assert without_timing(again) == without_timing(first)


def test_foreign_corrupt_and_misplaced_checkpoints_are_one_line(invoke, tiny_model_dir, book, tmp_path):
    folder = tmp_path / "ckpt"
    common = ["ppl", book, "--model", tiny_model_dir, "--block", "16", "--json", "--quiet", "--checkpoint", folder]
    assert invoke(*common, "--cache", "48").exit_code == 0
    assert (folder / "state.pt").is_file()  # the final state is saved
    line = one_line_error(invoke(*common, "--cache", "64", "--resume"))
    assert "budget 48" in line
    line = one_line_error(invoke(*common, "--cache", "48", "--method", "h2o", "--resume"))
    assert "method 'streamingllm'" in line
    (folder / "state.pt").write_bytes(b"not a checkpoint")
    assert "not a readable kvcli checkpoint" in one_line_error(invoke(*common, "--cache", "48", "--resume"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = one_line_error(invoke(*common[:-1], afile, "--cache", "48"))
    assert "--checkpoint" in line and "is a file" in line
    assert "no checkpoint" in one_line_error(invoke(*common[:-1], tmp_path / "empty", "--cache", "48", "--resume"))
