"""Bad inputs a new user meets (the review battery's cases): an output never writes over an input, rows know
what made them, an empty document does not stop a corpus, and every mistake is one line, never a traceback."""

from __future__ import annotations

import json
import os

import pytest
from test_corpora import corpus, one_line_error

# --------------------------------------------------------------------------- outputs never land on inputs


def _refused(invoke, args: list, *inputs) -> str:
    """Run ``args``, check it is refused with one usage line before anything is written, and that every one of
    ``inputs`` is byte for byte what it was; return the line."""
    before = {path: path.read_bytes() for path in inputs}
    line = one_line_error(invoke(*args, "--quiet"), 2)
    for path, data in before.items():
        assert path.read_bytes() == data, path
    return line


def test_an_output_equal_to_the_source_is_refused_and_the_source_is_intact(invoke, tiny_model_dir, book):
    model = ["--model", tiny_model_dir]
    for args in (["ppl", book, "-n", "64", "--jsonl", book], ["ppl", book, "-n", "64", "--save-logits", book],
                 ["calibrate", book, "--samples", "2", "--tokens", "128", "--q", "8", "--out", book]):
        line = _refused(invoke, [*args, *model], book)
        assert f"{args[-2]} {book} is the source {book}" in line and "never replaces an input" in line


def test_an_output_inside_a_corpus_folder_is_refused(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    doc = folder / "doc2.txt"
    line = _refused(invoke, ["ppl", folder, "--rows", doc, "--json", "--model", tiny_model_dir], doc)
    assert f"--rows {doc} lies in the source {folder}" in line
    # Not only over a document: a new file in the folder would be read as one by the next run.
    line = _refused(invoke, ["ppl", folder, "--rows", folder / "rows.jsonl", "--model", tiny_model_dir])
    assert "lies in the source" in line and not (folder / "rows.jsonl").exists()
    # A subfolder is not read: an output folder there (a default --out under a corpus in .) is fine.
    (folder / "rows").mkdir()
    result = invoke("ppl", folder, "--rows", folder / "rows" / "r.jsonl", "--model", tiny_model_dir, "--quiet", "-n", 8)
    assert result.exit_code == 0, result.stderr


def test_a_hard_link_or_a_symlink_to_the_source_is_the_source(invoke, tiny_model_dir, book, tmp_path):
    hard, soft = tmp_path / "hard.txt", tmp_path / "soft.txt"
    os.link(book, hard)
    soft.symlink_to(book)
    for output in (hard, soft):
        line = _refused(invoke, ["ppl", book, "--jsonl", output, "--model", tiny_model_dir], book)
        assert f"--jsonl {output} is the source {book} (the same file by another name)" in line
    line = _refused(invoke, ["ppl", soft, "--save-logits", book, "--model", tiny_model_dir], book)
    assert "the same file by another name" in line


def test_outputs_apart_from_the_model_the_reference_presets_and_each_other(invoke, tiny_model_dir, book, tmp_path,
                                                                          config_home):
    preset = tmp_path / "mine.toml"
    preset.write_text('method = "streamingllm"\ncache = 64\n')
    inside = tiny_model_dir / "rows.jsonl"
    cases = [
        (["ppl", book, "--jsonl", inside, "--model", tiny_model_dir], "lies in the model"),
        (["adapt", "--data", book, "--tokens", "2048", "--out", tiny_model_dir, "--model", tiny_model_dir],
         "is the model"),
        (["ppl", book, "--checkpoint", book.parent, "--model", tiny_model_dir], "holds the source"),
        (["ppl", book, "--kl-base", preset, "--save-logits", preset, "--model", tiny_model_dir], "is --kl-base"),
        (["ask", book, "Who?", "--each", "--rows", preset, "--preset", preset, "--model", tiny_model_dir],
         "is --preset"),
        (["ppl", book, "--jsonl", tmp_path / "a", "--rows", tmp_path / "a", "--model", tiny_model_dir],
         "are the same path"),
        (["bench", book, "--out", book.parent, "--model", tiny_model_dir], "holds the source"),
        (["analyze", book, "--out", book, "--model", tiny_model_dir], "is the source"),
    ]
    for args, message in cases:
        line = _refused(invoke, args, book, preset)
        assert message in line, (args, line)
    assert not inside.exists()


def test_devices_are_written_into_never_compared(invoke, tiny_model_dir, book):
    result = invoke("ppl", book, "-n", "32", "--jsonl", os.devnull, "--save-logits", os.devnull,
                    "--model", tiny_model_dir, "--quiet", "--json")
    assert result.exit_code == 0, result.stderr


# --------------------------------------------------------------------------- rows know what made them

def _ppl(folder, model, *extra):
    return ["ppl", folder, "--model", model, "--cache", "48", "--block", "16", "--json", "--quiet", *extra]


def test_rows_resume_only_under_the_settings_that_made_them(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    rows = tmp_path / "rows.jsonl"
    assert invoke(*_ppl(folder, tiny_model_dir, "--rows", rows)).exit_code == 0
    run = json.loads(rows.read_text().splitlines()[0])["run"]
    assert run["command"] == "ppl" and run["method"] == "streamingllm" and run["budget"] == 48 and run["format"] == 1
    before = rows.read_bytes()
    made, other = run["dtype"], "bfloat16" if run["dtype"] == "torch.float32" else "float32"  # auto: per machine
    cases = [(["--method", "full"], "its method is 'streamingllm', this run's 'full'"),
             (["--dtype", other], f"its dtype is {made!r}, this run's 'torch.{other}'"),
             (["--block", "32"], "its block is 16, this run's 32"),
             (["--kv-bits", "8"], "its kv_bits is 16, this run's 8")]
    for extra, message in cases:
        line = one_line_error(invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume", *extra)))
        assert f"--rows {rows}: the row of {folder / 'doc0.txt'} was not made by this run ({message}" in line
        assert rows.read_bytes() == before  # nothing mixed in, nothing lost
    again = invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume"))
    assert again.exit_code == 0 and json.loads(again.stdout)["job"]["resumed"] == 3
    # A row written before rows recorded their run is not taken on trust.
    rows.write_text(json.dumps({k: v for k, v in json.loads(before.splitlines()[0]).items() if k != "run"}) + "\n")
    assert "it records no run" in one_line_error(invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume")))


def test_rows_of_another_question_or_command_are_refused(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path, count=2)
    rows = tmp_path / "rows.jsonl"
    ask = ["ask", folder, "What colour is the rabbit?", "--each", "--rows", rows, "-n", "2", "--cache", "64",
           "--model", tiny_model_dir, "--quiet"]
    assert invoke(*ask).exit_code == 0, rows.read_text()
    line = one_line_error(invoke(*[("Who is Alice?" if a == ask[2] else a) for a in ask], "--resume"))
    assert "its question is 'What colour is the rabbit?', this run's 'Who is Alice?'" in line
    line = one_line_error(invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume")))
    assert "it is a row of kvcli ask, this run is ppl" in line
    summary = ["summarize", folder, "--each", "--rows", rows, "-n", "2", "--cache", "64", "--model", tiny_model_dir,
               "--quiet", "--resume"]
    assert "it is a row of kvcli ask, this run is summarize" in one_line_error(invoke(*summary))


def test_a_rows_file_or_bench_folder_in_use_refuses_a_second_run(invoke, book, tmp_path):
    import fcntl

    from kvcli.io.outputs import LOCK_FILE

    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    out = tmp_path / "bench"
    out.mkdir()
    with open(rows, "a") as held, open(out / LOCK_FILE, "a+") as other:  # another run holds both, as kvcli does
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for args in (["ppl", book, "--rows", rows], ["ask", book, "Who?", "--each", "--rows", rows],
                     ["needle", book, "--rows", rows, "--no-plots"]):
            line = one_line_error(invoke(*args, "--model", "/no/such/model", "--quiet"))  # refused before the model
            assert f"--rows {rows} is in use by another kvcli run" in line, args
        line = one_line_error(invoke("bench", book, "--out", out, "--model", "/no/such/model", "--quiet"))
        assert f"--out {out} is in use by another kvcli run" in line


# --------------------------------------------------------------------------- an empty document is skipped


def test_an_empty_document_is_skipped_with_a_row_and_the_corpus_finishes(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    (folder / "doc1.txt").write_text("")
    (folder / "doc2.txt").write_text("Alice")  # one token: nothing to score
    rows = tmp_path / "rows.jsonl"
    args = [a for a in _ppl(folder, tiny_model_dir, "--rows", rows) if a != "--quiet"]
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    assert f"{folder / 'doc1.txt'} is empty: skipped" in result.stderr
    assert f"{folder / 'doc2.txt'} has fewer than 2 tokens (nothing to score): skipped" in result.stderr
    data = json.loads(result.stdout)
    assert [row.get("skipped") for row in data["documents"]] == [None, "empty", "empty"]
    assert data["tokens"] == data["documents"][0]["tokens"] > 0
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [row.get("skipped") for row in written] == [None, "empty", "empty"]
    again = invoke(*args, "--resume")
    assert again.exit_code == 0 and json.loads(again.stdout)["job"]["resumed"] == 3
    assert json.loads(again.stdout)["ppl"] == data["ppl"]
    # ask --each prints the skipped row among the answers; one empty file alone is still an error.
    each = invoke("ask", folder, "Who?", "--each", "-n", "2", "--cache", "64", "--model", tiny_model_dir, "--quiet")
    assert each.exit_code == 0, each.stderr
    assert [json.loads(line).get("skipped") for line in each.stdout.splitlines()] == [None, "empty", None]
    assert "input is empty" in one_line_error(invoke(*_ppl(folder / "doc1.txt", tiny_model_dir)))


# --------------------------------------------------------------------------- the battery: one line each

HUGE = "99999999999999999999"
ADAPT = ["adapt", "--data", "{book}", "--out", "{tmp}/a", "--tokens", "128", "--seq-len", "64", "--recent", "16"]


def _bad_file(name: str, tmp_path, model_dir, config_home):
    """The broken input a case names, made on demand: a folder of the review's fixtures, one file at a time."""
    import shutil

    from conftest import TEXT

    if name == "u16":
        path = tmp_path / "u16.txt"
        path.write_bytes(TEXT.encode("utf-16-le"))  # UTF-16 without its byte order mark
        return path
    if name == "evil":
        path = tmp_path / "evil.toml"
        path.write_bytes(b'method = "\xff\xfe"\n')
        return path
    if name == "user_evil":
        folder = config_home / "kvcli" / "presets"
        folder.mkdir(parents=True)
        (folder / "evil.toml").write_bytes(b'method = "\xff\xfe"\n')
        return folder
    if name == "results":
        folder = tmp_path / "bench"
        folder.mkdir()
        (folder / "results.json").write_text('{"runs": [42, null]}')
        return folder
    if name == "groups":
        path = tmp_path / "groups.json"
        path.write_text(json.dumps({"format": "kvcli-pod-groups/1", "model": "m", "model_type": "llama",
                                    "layers": 10**13, "heads": 4, "kv_heads": 2, "head_dim": 8, "hidden_size": 32,
                                    "vocab_size": 49152, "groups": [[[0, 1]], [[0], [1]]]}))
        return path
    folder = tmp_path / name  # a copy of the model folder with one file broken
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    if name == "config_list":
        (folder / "config.json").write_text("[]")
    elif name == "config_type":
        (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    elif name == "safetensors":
        weights = folder / "model.safetensors"
        weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:200])
    elif name == "tokenizer":
        (folder / "tokenizer.json").write_bytes(b"\xff\xfe{not utf-8")
    return folder


#: (case, arguments with {placeholders}, exit code, what the one line on stderr says). {book}, {model} and {tmp} are
#: the short book, the tiny model folder and the test's folder; any other placeholder is a broken input made by
#: _bad_file; an argument starting with + is made but not passed. A case without --model gets a missing one: it is
#: refused before any model is needed.
BATTERY = [
    ("utf16-no-bom", ["ppl", "{u16}", "--encoding", "utf-16", "--model", "{model}"], 1, "name its byte order"),
    ("config-list", ["ppl", "{book}", "--model", "{config_list}"], 1, "could not load the model from"),
    ("config-field", ["ppl", "{book}", "--model", "{config_type}"], 1, "hidden_size"),
    ("safetensors-header", ["ppl", "{book}", "--model", "{safetensors}"], 1, "could not load the model from"),
    ("tokenizer-bytes", ["ppl", "{book}", "--model", "{tokenizer}"], 1, "could not load the model from"),
    ("preset-bytes", ["ask", "{book}", "Who?", "--preset", "{evil}", "--model", "{model}"], 2, "not UTF-8 text"),
    ("user-preset-bytes", ["presets", "+{user_evil}"], 0, "evil.toml is not valid TOML: not UTF-8 text"),
    ("device-meta", ["ppl", "{book}", "--device", "meta"], 2, "--device 'meta': choose auto, cpu, cuda or cuda:N"),
    ("device-mps", ["ppl", "{book}", "--device", "mps"], 2, "choose auto, cpu, cuda or cuda:N"),
    ("speed-device", ["bench-speed", "--device", "meta"], 2, "choose auto, cpu, cuda or cuda:N"),
    ("temperature-nan", ["ask", "{book}", "Who?", "--temperature", "nan"], 2, "--temperature must be 0 (greedy)"),
    ("temperature-tiny", ["ask", "{book}", "Who?", "--temperature", "1e-45"], 2, "at least 0.0001, not 1e-45"),
    ("lr-nan", [*ADAPT, "--lr", "nan"], 2, "--lr"),
    ("lr-inf", [*ADAPT, "--lr", "inf"], 2, "not inf"),
    ("sinks", [*ADAPT, "--sinks", "-1"], 2, "not -1"),
    ("recent", [*ADAPT, "--recent", "-5"], 2, "not -5"),
    ("cache-bytes", ["ppl", "{book}", "--cache-bytes", "1" + "0" * 400], 2, "more than any memory"),
    ("speed-cache", ["bench-speed", "--cache", HUGE], 2, f"--cache must be at most 1,099,511,627,776, not {HUGE}"),
    ("seed", ["ask", "{book}", "Who?", "--seed", HUGE], 2, "--seed must be an integer"),
    ("groups-layers", ["ppl", "{book}", "--method", "pod", "-o", "groups={groups}", "--model", "{model}"], 2,
     "consecutive layer blocks"),
    ("top-k-0", ["ppl", "{book}", "--save-logits", "{tmp}/r.kvlogits", "--logits-top-k", "0"], 2,
     "--logits-top-k must be at least 1, not 0"),
    ("results-json", ["bench", "{book}", "--out", "{results}", "--model", "{model}", "-n", "32"], 1,
     "results.json is not a kvcli bench results file (run 1 is 42, not an object)"),
    ("cache-abc", ["ppl", "{book}", "--cache", "abc"], 2, "invalid value for '--cache'"),
    ("unknown-command", ["bogus"], 2, "no such command 'bogus' (see '"),
    ("no-source", ["ppl"], 2, "missing argument"),
    ("unknown-option", ["ask", "{book}", "Who?", "--cache-bytes", "1B"], 2, "no such option: --cache-bytes"),
]


@pytest.mark.parametrize(("case", "args", "code", "says"), BATTERY, ids=[case[0] for case in BATTERY])
def test_every_bad_input_of_the_battery_is_one_line(invoke, tiny_model_dir, book, tmp_path, config_home, case, args,
                                                    code, says):
    """Each bad input of the review battery: the exit code, one line on stderr saying what is wrong, no traceback."""
    import re

    def fill(arg: str) -> str:
        known = {"book": book, "model": tiny_model_dir, "tmp": tmp_path}
        return re.sub(r"\{(\w+)\}", lambda m: str(known.get(m[1]) or _bad_file(m[1], tmp_path, tiny_model_dir,
                                                                               config_home)), arg)

    filled = []
    for arg in args:
        if arg.startswith("+"):
            fill(arg[1:])  # made, not passed
        else:
            filled.append(fill(arg))
    if "--model" not in args and args[0] not in ("bench-speed", "bogus", "presets"):
        filled += ["--model", "/no/such/model"]
    result = invoke(*filled, *([] if args[0] == "presets" else ["--quiet"]))
    assert result.exit_code == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_closed_stdin_is_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for args in (["ppl", "-", "--json"], ["summarize", "-"]):
        result = subprocess.run([sys.executable, "-m", "kvcli", *args, "--model", "/no/such/model"], text=True,
                                capture_output=True, env=env, timeout=300, preexec_fn=lambda: os.close(0))
        assert result.returncode == 1 and result.stderr.strip().splitlines() == [
            "kvcli: error: stdin is closed: give a file instead of -, or redirect one into stdin (< book.txt)"]


def test_a_reference_longer_than_the_tokens_asked_for_compares_over_its_first_ones(invoke, tiny_model_dir, book,
                                                                                   tmp_path):
    ref = tmp_path / "ref.kvlogits"
    common = ["--model", tiny_model_dir, "--block", "32", "--quiet", "--json"]
    assert invoke("ppl", book, "-n", "256", "--method", "full", "--save-logits", ref, *common).exit_code == 0
    short = invoke("ppl", book, "-n", "128", "--method", "full", "--kl-base", ref, *common)
    assert short.exit_code == 0, short.stderr
    data = json.loads(short.stdout)
    # the same logits, up to the rounding of the stored top-k against the tail's mass
    assert data["tokens"] == data["kl_tokens"] == 128 and abs(data["kl_mean"]) < 1e-9 and data["same_top"] == 1.0
    # The records it did not compare are still read: a flipped bit after them is refused, not reported.
    damaged = tmp_path / "damaged.kvlogits"
    raw = bytearray(ref.read_bytes())
    raw[len(raw) - 600] ^= 1
    damaged.write_bytes(bytes(raw))
    line = one_line_error(invoke("ppl", book, "-n", "128", "--method", "full", "--kl-base", damaged, *common))
    assert "do not match their checksum" in line


def test_a_cuda_device_beyond_the_machines_is_one_line(monkeypatch):
    import torch

    from kvcli.errors import KvcliError
    from kvcli.models.load import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(KvcliError, match="has 1 CUDA device"):
        resolve_device("cuda:3")
