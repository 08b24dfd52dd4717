"""Files kvcli reads are data, never code: crafted or damaged state files get one line and run nothing."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from kvcli.errors import KvcliError
from kvcli.methods.pod.adapt import STATE_FILE, load_state
from kvcli.methods.pod.groups import GroupsFile, ModelShape


class _RunsCode:
    """Unpickling this calls ``os.system``: what an attacker would drop into a shared folder."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted(path, marker) -> None:
    with open(path, "wb") as handle:
        pickle.dump({"model": {}, "optimizer": {}, "step": 0, "total": 2, "groups": [], "x": _RunsCode(marker)},
                    handle)


def test_a_crafted_adapt_state_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    _crafted(tmp_path / STATE_FILE, marker)
    with pytest.raises(KvcliError, match="not a readable kvcli adapt state"):
        load_state(tmp_path / STATE_FILE)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "key removed", "wrong type", "not a dict"])
def test_a_damaged_adapt_state_is_one_line(tmp_path, damage):
    state = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {}, "param_groups": []}, "step": 1, "total": 4,
             "groups": [[[0, 1]]]}
    path = tmp_path / STATE_FILE
    if damage == "key removed":
        del state["groups"]
    if damage == "wrong type":
        state["step"] = "1"
    torch.save([state] if damage == "not a dict" else state, path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    if damage == "bit-flipped":
        for index in range(0, len(data), 97):
            data[index] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(KvcliError, match="kvcli adapt state"):
        load_state(path)


def test_adapt_with_a_crafted_state_in_out_runs_nothing(invoke, tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"word{i % 41} and so on" for i in range(800)))
    groups = tmp_path / "groups.json"
    GroupsFile("tiny", ModelShape.of(AutoConfig.from_pretrained(tiny_model_dir)), [[[0, 1]], [[0], [1]]]).save(groups)
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "pwned"
    _crafted(out / STATE_FILE, marker)
    result = invoke("adapt", "--model", tiny_model_dir, "--data", book, "--groups", groups, "--tokens", 128,
                    "--seq-len", 64, "--sinks", 2, "--recent", 8, "--out", out, "--quiet")
    assert result.exit_code == 1
    assert not marker.exists()
    assert "not a readable kvcli adapt state" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- shared helpers

def one_line(result, code: int) -> str:
    """The error line of a failed in-process run, after checking the exit code and that it is the only line."""
    assert result.exit_code == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def long_book(tmp_path, name: str = "long.txt", repeat: int = 3):
    from conftest import TEXT

    path = tmp_path / name
    path.write_text(TEXT * repeat, encoding="utf-8")
    return path


def ppl(model, source, *extra):
    return ["ppl", source, "--model", model, "--cache", "48", "--block", "16", "--json", "--quiet", *extra]


def numbers(output: str) -> dict:
    """A ``ppl --json`` result without what differs between two runs of the same tokens (time, memory)."""
    import json

    from test_corpora import without_timing

    return {k: v for k, v in without_timing(json.loads(output)).items() if k != "interrupted"}


# --------------------------------------------------------------------------- checkpoints: data only, sealed

def _checkpoint(invoke, model, tmp_path):
    """A finished stream's checkpoint folder, the book it read and the run's result."""
    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    result = invoke(*ppl(model, book, "-n", "150", "--checkpoint", folder, "--checkpoint-every", "64"))
    assert result.exit_code == 0, result.stderr
    return folder, book, result.stdout


def _seal(path, payload) -> None:
    from kvcli.io.statefile import save_state

    save_state(path, payload)


def _sealed_pickle(path, marker) -> None:
    """A state file with kvcli's header and a checksum that matches: only the unpickler can refuse it."""
    import hashlib

    body = pickle.dumps({"format": 2, "x": _RunsCode(marker)}, protocol=2)
    path.write_bytes(b"kvcli-state 1 " + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def test_a_crafted_checkpoint_with_a_valid_checksum_runs_nothing(invoke, tiny_model_dir, tmp_path):
    folder, book, _ = _checkpoint(invoke, tiny_model_dir, tmp_path)
    marker = tmp_path / "pwned"
    _sealed_pickle(folder / "state.pt", marker)
    line = one_line(invoke(*ppl(tiny_model_dir, book, "--checkpoint", folder, "--resume")), 1)
    assert "not a readable kvcli checkpoint" in line and not marker.exists()
    _sealed_pickle(tmp_path / STATE_FILE, marker)
    with pytest.raises(KvcliError, match="not a readable kvcli adapt state"):
        load_state(tmp_path / STATE_FILE)
    assert not marker.exists()


def _fuzzed_checkpoints(folder, rng):
    """(name, bytes) of damaged copies of ``folder/state.pt``: cut, bit-flipped, keys removed or mistyped
    (sealed again, so that the checks after the checksum are the ones that answer)."""
    import io

    from kvcli.io.statefile import load_state as read

    path = folder / "state.pt"
    data = path.read_bytes()
    payload = read(path, "checkpoint", "")
    for cut in (0, 10, 60, len(data) // 3, len(data) - 1):
        yield f"cut at {cut}", data[:cut]
    for _ in range(6):
        flipped = bytearray(data)
        flipped[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        yield "one bit flipped", bytes(flipped)
    damaged = [("identity", lambda p: p.pop("identity")), ("position", lambda p: p.pop("position")),
               ("content", lambda p: p.pop("content")), ("totals", lambda p: p.pop("totals")),
               ("cache", lambda p: p.pop("cache")), ("previous", lambda p: p.pop("previous")),
               ("totals.tokens", lambda p: p["totals"].pop("tokens")),
               ("layer keys", lambda p: p["cache"]["facts"]["layers"][0].pop("keys")),
               ("a layer", lambda p: p["cache"]["facts"]["layers"].pop()),
               ("a tensor", lambda p: p["cache"]["tensors"].pop("0.values")),
               ("position type", lambda p: p.update(position="12")),
               ("a method as data", lambda p: p["cache"]["facts"]["layers"][0].update(update={"value": 1})),
               ("keys of another length", lambda p: p["cache"]["tensors"].update({"0.token_idx": torch.zeros(2, 1)}))]
    for name, damage in damaged:
        copy = torch.load(io.BytesIO(_saved(payload)), weights_only=True)
        damage(copy)
        buffer = io.BytesIO()
        _seal_to(buffer, copy)
        yield f"{name} removed or wrong", buffer.getvalue()


def _saved(payload) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _seal_to(buffer, payload) -> None:
    import hashlib

    body = _saved(payload)
    buffer.write(b"kvcli-state 1 " + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def test_fuzzed_checkpoints_are_one_line_and_never_a_number(invoke, tiny_model_dir, tmp_path):
    import numpy as np

    folder, book, _ = _checkpoint(invoke, tiny_model_dir, tmp_path)
    good = (folder / "state.pt").read_bytes()
    for name, data in _fuzzed_checkpoints(folder, np.random.default_rng(0)):
        (folder / "state.pt").write_bytes(data)
        result = invoke(*ppl(tiny_model_dir, book, "-n", "150", "--checkpoint", folder, "--resume"))
        assert result.stdout == "", name  # no number at all rather than a wrong one
        line = one_line(result, 1)
        assert "--checkpoint" in line or "state.pt" in line, (name, line)
    (folder / "state.pt").write_bytes(good)
    assert invoke(*ppl(tiny_model_dir, book, "-n", "150", "--checkpoint", folder, "--resume")).exit_code == 0


def test_fuzzed_adapt_states_are_one_line(tmp_path):
    import numpy as np

    rng = np.random.default_rng(1)
    state = {"model": {"w": torch.ones(64)}, "optimizer": {"state": {}, "param_groups": []}, "step": 1,
             "total": 4, "groups": [[[0, 1]]]}
    path = tmp_path / STATE_FILE
    _seal(path, state)
    data = path.read_bytes()
    variants = [data[:cut] for cut in (0, 5, 70, len(data) // 2, len(data) - 1)]
    for _ in range(6):
        flipped = bytearray(data)
        flipped[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        variants.append(bytes(flipped))
    for key in state:
        variants.append(_sealed_bytes({k: v for k, v in state.items() if k != key}))
    variants += [_sealed_bytes({**state, "step": True}), _sealed_bytes({**state, "step": 9}), _sealed_bytes([state])]
    for data in variants:
        path.write_bytes(data)
        with pytest.raises(KvcliError, match="adapt state"):
            load_state(path)
    _seal(path, state)
    assert load_state(path)["step"] == 1


def _sealed_bytes(payload) -> bytes:
    import io

    buffer = io.BytesIO()
    _seal_to(buffer, payload)
    return buffer.getvalue()


# --------------------------------------------------------------------------- checkpoints know their source

def test_resume_checks_the_content_not_the_name(invoke, tiny_model_dir, tmp_path, monkeypatch):
    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    first = invoke(*ppl(tiny_model_dir, book, "-n", "300", "--checkpoint", folder))
    assert first.exit_code == 0, first.stderr
    whole = invoke(*ppl(tiny_model_dir, book, "-n", "600"))
    # The same text by a relative path, and on stdin, resumes to the uninterrupted numbers.
    monkeypatch.chdir(tmp_path)
    relative = invoke(*ppl(tiny_model_dir, "long.txt", "-n", "600", "--checkpoint", "ckpt", "--resume"))
    assert relative.exit_code == 0, relative.stderr
    assert numbers(relative.stdout) == numbers(whole.stdout)
    piped = invoke(*ppl(tiny_model_dir, "-", "-n", "600", "--checkpoint", folder, "--resume"),
                   input=book.read_text())
    assert piped.exit_code == 0, piped.stderr
    assert numbers(piped.stdout) == numbers(whole.stdout)
    # Other text: the same size with one word changed, and another text on stdin.
    text = book.read_text()
    book.write_text(text.replace("sister", "sistor", 1))
    line = one_line(invoke(*ppl(tiny_model_dir, book, "-n", "600", "--checkpoint", folder, "--resume")), 1)
    assert "other text" in line and "--overwrite" in line
    other = invoke(*ppl(tiny_model_dir, "-", "-n", "600", "--checkpoint", folder, "--resume"),
                   input="Call me Ishmael. " * 5)
    assert "another text" in one_line(other, 1)


def test_a_checkpoint_knows_its_model_by_its_files_not_by_its_name(invoke, tiny_model_dir, tmp_path, monkeypatch):
    """The same model folder named another way resumes to the uninterrupted numbers; the folder with its
    tokenizer or one weight changed, or other library releases, are refused with one line saying what differs."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    assert invoke(*ppl(model, book, "-n", "150", "--checkpoint", folder)).exit_code == 0
    whole = invoke(*ppl(model, book, "-n", "300"))
    monkeypatch.chdir(tmp_path)
    for spelling in ("model/", "./model"):  # relative, a trailing slash: the same files
        again = invoke(*ppl(spelling, book, "-n", "300", "--checkpoint", folder, "--resume"))
        assert again.exit_code == 0, again.stderr
        assert {**numbers(again.stdout), "model": None} == {**numbers(whole.stdout), "model": None}

    resume = ppl(model, book, "-n", "400", "--checkpoint", folder, "--resume")
    with monkeypatch.context() as patch:
        import kvcli.eval.checkpoint

        patch.setattr(kvcli.eval.checkpoint, "library_versions", lambda: {"torch": "9.9", "transformers": "5.23"})
        line = one_line(invoke(*resume), 1)
        assert "it was made with torch " in line and "this run has 9.9" in line
    settings = model / "tokenizer_config.json"
    original = settings.read_text(encoding="utf-8")
    settings.write_text(json.dumps({**json.loads(original), "model_max_length": 12345}), encoding="utf-8")
    line = one_line(invoke(*resume), 1)
    assert "the model's tokenizer differs from the checkpoint's (sha256 " in line
    settings.write_text(original, encoding="utf-8")
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0  # one weight of one tensor
    save_file(tensors, weights, metadata={"format": "pt"})
    line = one_line(invoke(*resume), 1)
    assert line.startswith(f"kvcli: error: --checkpoint {folder}: the model's weights differ from the checkpoint's "
                           "(sha256 ") and "--overwrite" not in line


@pytest.mark.parametrize("bits", ["8", "4", "2"])
def test_a_quantized_cache_checkpoints_and_resumes_to_the_longer_runs_totals(invoke, tiny_model_dir, tmp_path, bits):
    """A packed cache is saved as its tensors (kvcli.kv.snapshot) and restored bit for bit: a finished run extended
    from its checkpoint equals the uninterrupted longer run; resuming it with other bits is refused with one line."""
    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    quantized = ("--kv-bits", bits, "--max-tokens")
    short = invoke(*ppl(tiny_model_dir, book, *quantized, "100", "--checkpoint", folder, "--checkpoint-every", "32"))
    assert short.exit_code == 0, short.stderr
    longer = invoke(*ppl(tiny_model_dir, book, *quantized, "400", "--checkpoint", folder, "--resume"))
    assert longer.exit_code == 0, longer.stderr
    assert numbers(longer.stdout) == numbers(invoke(*ppl(tiny_model_dir, book, *quantized, "400")).stdout)
    other = "16" if bits == "8" else "8"
    line = one_line(invoke(*ppl(tiny_model_dir, book, "--kv-bits", other, "--checkpoint", folder, "--resume")), 1)
    assert f"it was made with kv_bits {bits}, not this run's {other}" in line


def test_a_state_that_is_not_data_is_refused_when_saved(tmp_path):
    """A layer holding an object (a method's state that is not a tensor or a number) is refused when the checkpoint
    is written, writing nothing, rather than saved to be refused on resume."""
    from kvcli.engine.engine import Engine
    from kvcli.eval.checkpoint import Checkpointer
    from kvcli.methods import make_method
    from kvcli.models.load import tiny_llama

    engine = Engine(tiny_llama(), make_method("streamingllm"), 48, block=16)
    saver = Checkpointer(tmp_path / "ckpt", {"block": 16}, 32, None)
    state, feed = saver.begin(engine, [list(range(1, 100))], None)

    def poisoned(stream_state):
        stream_state.cache.layers[0].method_state["callback"] = print
        saver.on_state(stream_state)

    with pytest.raises(KvcliError, match=r"cannot checkpoint the cache: .*callback is a builtin_function_or_method"):
        engine.score(feed, state=state, on_state=poisoned)
    assert not saver.path.exists()


def test_rows_resume_by_any_path_and_refuse_an_edited_document(invoke, tiny_model_dir, tmp_path, monkeypatch):
    import json

    from test_corpora import corpus, ppl_args, without_timing

    folder = corpus(tmp_path)
    rows = tmp_path / "rows.jsonl"
    whole = invoke(*ppl_args(folder, tiny_model_dir), "--rows", rows)
    assert whole.exit_code == 0, whole.stderr
    monkeypatch.chdir(tmp_path)
    again = invoke(*ppl_args("corpus", tiny_model_dir), "--rows", "rows.jsonl", "--resume")
    assert again.exit_code == 0, again.stderr
    data = json.loads(again.stdout)
    assert data["job"]["resumed"] == 3 and data["job"]["documents"] == 0
    assert without_timing(data)["ppl"] == without_timing(json.loads(whole.stdout))["ppl"]
    doc = folder / "doc1.txt"
    doc.write_text(doc.read_text().replace("Alice", "Alica", 1))
    line = one_line(invoke(*ppl_args(folder, tiny_model_dir), "--rows", rows, "--resume"), 1)
    assert "doc1.txt" in line and "other content" in line


# --------------------------------------------------------------------------- exclusive, no silent overwrite

def test_a_held_checkpoint_folder_or_adapt_out_is_refused_at_once(invoke, tiny_model_dir, tmp_path):
    import fcntl

    from kvcli.io.outputs import LOCK_FILE

    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with open(folder / LOCK_FILE, "a+") as other:  # another run holds the folder, as lock_folder does
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("4242\n")
        other.flush()
        line = one_line(invoke(*ppl("/no/such/model", book, "--checkpoint", folder)), 1)
        assert "in use by another kvcli run (process 4242)" in line  # refused at once, before loading a model
        line = one_line(invoke("adapt", "--model", "/no/such/model", "--data", book, "--tokens", 2048, "--out",
                               folder, "--quiet"), 1)
        assert "--out" in line and "in use" in line
    # A lock file left by a killed run (no process holds it) does not stop the next run.
    (folder / LOCK_FILE).write_text("999999999\n")
    assert invoke(*ppl(tiny_model_dir, book, "-n", "100", "--checkpoint", folder)).exit_code == 0


def test_two_concurrent_runs_in_one_folder_the_second_refuses(tiny_model_dir, tmp_path):
    import subprocess
    import sys
    import time
    from pathlib import Path

    book = long_book(tmp_path, repeat=30)
    folder = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "kvcli", *map(str, ppl(tiny_model_dir, book, "--checkpoint", folder))]
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (folder / ".kvcli.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 1 and second.stdout == ""
    assert "in use by another kvcli run" in second.stderr and "Traceback" not in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1


def test_a_checkpoint_is_never_overwritten_silently(invoke, tiny_model_dir, tmp_path):
    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    assert invoke(*ppl(tiny_model_dir, book, "-n", "100", "--checkpoint", folder)).exit_code == 0
    saved = (folder / "state.pt").read_bytes()
    line = one_line(invoke(*ppl(tiny_model_dir, book, "-n", "200", "--checkpoint", folder)), 2)
    assert "--resume" in line and "--overwrite" in line and "another folder" in line
    assert (folder / "state.pt").read_bytes() == saved
    assert one_line(invoke(*ppl(tiny_model_dir, book, "--checkpoint", folder, "--resume", "--overwrite")), 2)
    fresh = invoke(*ppl(tiny_model_dir, book, "-n", "200", "--checkpoint", folder, "--overwrite"))
    assert fresh.exit_code == 0
    assert numbers(fresh.stdout) == numbers(invoke(*ppl(tiny_model_dir, book, "-n", "200")).stdout)


# --------------------------------------------------------------------------- exact -n

def test_extending_a_finished_run_equals_the_longer_run(invoke, tiny_model_dir, tmp_path):
    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    short = invoke(*ppl(tiny_model_dir, book, "-n", "100", "--checkpoint", folder))  # 101 tokens: a 5-token last block
    assert short.exit_code == 0
    assert numbers(short.stdout) == numbers(invoke(*ppl(tiny_model_dir, book, "-n", "100")).stdout)
    again = invoke(*ppl(tiny_model_dir, book, "-n", "100", "--checkpoint", folder, "--resume"))
    assert numbers(again.stdout) == numbers(short.stdout)
    longer = invoke(*ppl(tiny_model_dir, book, "-n", "400", "--checkpoint", folder, "--resume"))
    assert longer.exit_code == 0, longer.stderr
    assert numbers(longer.stdout) == numbers(invoke(*ppl(tiny_model_dir, book, "-n", "400")).stdout)
    line = one_line(invoke(*ppl(tiny_model_dir, book, "-n", "50", "--checkpoint", folder, "--resume")), 1)
    assert "more than --max-tokens 50" in line


# --------------------------------------------------------------------------- partial results are true

def _interrupt_at(monkeypatch, call: int) -> None:
    """Ctrl-C inside the ``call``-th forward pass (in the middle of a block)."""
    from kvcli.engine.engine import Engine

    original = Engine.forward
    count = [0]

    def forward(self, *args, **kwargs):
        count[0] += 1
        if count[0] == call:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "forward", forward)


def test_a_partial_result_covers_exactly_the_tokens_scored(invoke, tiny_model_dir, tmp_path, monkeypatch):
    import json

    book = long_book(tmp_path)
    with monkeypatch.context() as patch:
        _interrupt_at(patch, 20)
        cut = invoke(*ppl(tiny_model_dir, book))
    assert cut.exit_code == 130
    partial = json.loads(cut.stdout)
    assert partial["interrupted"] is True and partial["tokens"] == 19 * 16 - 1
    assert partial["kv_cache_bytes"] <= partial["full_kv_cache_bytes"]
    same = invoke(*ppl(tiny_model_dir, book, "-n", partial["tokens"]))
    assert numbers(cut.stdout) == numbers(same.stdout)  # bytes, bits/byte, cache bytes: all of those tokens


def test_a_partial_resumed_result_covers_exactly_the_tokens_scored(invoke, tiny_model_dir, tmp_path, monkeypatch):
    import json

    book = long_book(tmp_path)
    folder = tmp_path / "ckpt"
    with monkeypatch.context() as patch:
        _interrupt_at(patch, 12)
        assert invoke(*ppl(tiny_model_dir, book, "--checkpoint", folder, "--checkpoint-every", "64")).exit_code == 130
    with monkeypatch.context() as patch:
        _interrupt_at(patch, 6)
        cut = invoke(*ppl(tiny_model_dir, book, "--checkpoint", folder, "--resume"))
    assert cut.exit_code == 130
    partial = json.loads(cut.stdout)
    assert partial["interrupted"] is True and partial["tokens"] == (128 + 5 * 16) - 1
    assert numbers(cut.stdout) == numbers(invoke(*ppl(tiny_model_dir, book, "-n", partial["tokens"])).stdout)


def test_sigterm_reports_what_was_measured_with_exit_130(tiny_model_dir, tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    book = long_book(tmp_path, repeat=40)
    curve = tmp_path / "curve.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    victim = subprocess.Popen([sys.executable, "-m", "kvcli", *map(str, ppl(tiny_model_dir, book, "--jsonl", curve))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while (not curve.exists() or curve.stat().st_size < 2000) and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.send_signal(signal.SIGTERM)
    out, err = victim.communicate(timeout=120)
    assert victim.returncode == 130 and "Traceback" not in err
    partial = json.loads(out)
    assert partial["interrupted"] is True and 0 < partial["tokens"]
    assert partial["kv_cache_bytes"] <= partial["full_kv_cache_bytes"]


def test_nothing_scored_has_no_bits_per_byte(invoke, tiny_model_dir, tmp_path):
    import json

    one = tmp_path / "one.txt"
    one.write_text("Alice")
    result = invoke(*ppl(tiny_model_dir, one))
    data = json.loads(result.stdout)
    assert data["tokens"] == 0 and data["bits_per_byte"] is None and data["ppl"] is None


# --------------------------------------------------------------------------- failures: one line, early

def test_usage_errors_exit_2_and_method_parameters_state_their_range(invoke, tiny_model_dir, book):
    assert "--dtype 'bogus'" in one_line(invoke(*ppl(tiny_model_dir, book, "--dtype", "bogus")), 2)
    assert "unknown encoding" in one_line(invoke(*ppl(tiny_model_dir, book, "--encoding", "klingon")), 2)
    line = one_line(invoke(*ppl(tiny_model_dir, book, "-o", "sinks=-1")), 2)
    assert "sinks must be an integer >= 0" in line
    assert "an integer >= 1" in one_line(invoke(*ppl(tiny_model_dir, book, "--method", "snapkv", "-o", "window=0")), 2)
    assert "finite" in one_line(invoke(*ppl(tiny_model_dir, book, "--method", "pyramidkv", "-o", "beta=nan")), 2)


def test_every_integer_parameter_of_every_method_refuses_minus_one(invoke, book):
    import dataclasses

    from kvcli.methods import METHODS

    for name, cls in METHODS.items():
        for field in dataclasses.fields(cls):
            if field.type in ("int", "int | None"):
                result = invoke("ppl", book, "--model", "/no/such/model", "--method", name, "-o", f"{field.name}=-1")
                assert f"-o {field.name}=-1" in one_line(result, 2), (name, field.name)


def test_outputs_that_cannot_be_written_are_one_line_before_any_model_loads(invoke, book, tmp_path):
    readonly = _readonly_folder(tmp_path)
    for args in (["ppl", book, "--jsonl", readonly / "c.jsonl"], ["ppl", book, "--rows", readonly / "r.jsonl"],
                 ["ppl", book, "--save-logits", readonly / "f.kvlogits"],
                 ["ppl", book, "--checkpoint", readonly / "ckpt"],
                 ["calibrate", book, "--out", readonly / "g.json"], ["analyze", book, "--out", readonly / "a"],
                 ["adapt", "--data", book, "--tokens", "2048", "--out", readonly / "adapted"]):
        line = one_line(invoke(*args, "--model", "/no/such/model", "--quiet"), 1)  # the model is never reached
        assert str(readonly) in line and "no such file or folder" not in line, line


def _readonly_folder(tmp_path):
    """A folder no file can be created in: a 0o555 folder, or for root (whom permissions do not stop) /sys."""
    from pathlib import Path

    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_a_full_side_file_keeps_the_result_on_stdout(invoke, tiny_model_dir, book, tmp_path):
    import json

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    plain = json.loads(invoke(*ppl(tiny_model_dir, book, "-n", "100")).stdout)
    for flag in ("--jsonl", "--rows", "--save-logits"):
        result = invoke(*ppl(tiny_model_dir, book, "-n", "100", flag, "/dev/full"))
        assert result.exit_code == 1, result.stderr
        assert json.loads(result.stdout)["ppl"] == plain["ppl"]  # the measurement is whole
        line = one_line(result, 1)
        assert flag in line and "the result on stdout is whole" in line
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")  # a failed side file never removes a device


def test_stdout_full_or_closed_and_version_are_one_line(tiny_model_dir, book):
    import subprocess
    import sys
    from pathlib import Path

    import kvcli

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "kvcli", *map(str, ppl(tiny_model_dir, book, "-n", "50"))]
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            result = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
        assert result.returncode == 1 and result.stderr.strip() == (
            "kvcli: error: cannot write the result to stdout: No space left on device")
    closed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            timeout=300, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 1 and closed.stderr.strip().splitlines() == [
        "kvcli: error: stdout is closed: results have nowhere to go (redirect it to a file or /dev/null)"]
    version = subprocess.run([sys.executable, "-m", "kvcli", "--version"], capture_output=True, text=True, env=env)
    assert version.returncode == 0 and version.stdout.strip() == f"kvcli {kvcli.__version__}"


def test_ctrl_c_while_waiting_on_a_fifo_is_quiet(tiny_model_dir, tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    # A suite started as a background job of a non-interactive shell inherits SIGINT ignored, and an ignored
    # signal stays ignored across exec: Python then installs no KeyboardInterrupt handler and the Ctrl-C
    # below would do nothing. The child gets the disposition of a terminal's foreground job instead.
    victim = subprocess.Popen([sys.executable, "-m", "kvcli", *map(str, ppl(tiny_model_dir, fifo))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wchan = Path(f"/proc/{victim.pid}/wchan")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and victim.poll() is None:  # until it blocks opening the FIFO
        if wchan.exists() and "partner" in wchan.read_text():
            break
        time.sleep(0.05)
    victim.send_signal(signal.SIGINT)
    out, err = victim.communicate(timeout=120)
    assert victim.returncode == 130 and "Traceback" not in err and "Exception ignored" not in err
    assert json.loads(out)["interrupted"] is True


def test_a_gguf_cut_inside_its_tensors_is_one_line(invoke, book, tmp_path, monkeypatch):
    from test_modelcache import write_tiny_gguf

    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    whole = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    line = one_line(invoke("ppl", book, "--model", cut, "--quiet"), 1)
    assert "truncated or corrupt GGUF" in line and str(cut) in line


# --------------------------------------------------------------------------- fault injection

def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_totals(invoke, tiny_model_dir, tmp_path):
    """A few runs killed with SIGKILL at random moments after their first checkpoint; each resumed (or started
    again, when killed before it) ends with exactly the totals of a run never killed."""
    import random
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    book = long_book(tmp_path, repeat=4)
    expected = numbers(invoke(*ppl(tiny_model_dir, book)).stdout)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    chance = random.Random(30)
    for run in range(3):
        folder = tmp_path / f"ckpt{run}"
        args = ppl(tiny_model_dir, book, "--checkpoint", folder, "--checkpoint-every", "32")
        victim = subprocess.Popen([sys.executable, "-m", "kvcli", *map(str, args)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while not (folder / "state.pt").exists() and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(chance.uniform(0.0, 0.5))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        resumed = invoke(*args, "--resume")
        assert resumed.exit_code == 0, resumed.stderr
        assert numbers(resumed.stdout) == expected, run


# --------------------------------------------------------------------------- model folders run no code

def _folder_with_code(tiny_model_dir, tmp_path, model_type: str | None):
    """A copy of the tiny model whose config points at custom code that leaves a marker when it is imported."""
    import json
    import shutil

    folder = tmp_path / f"code-{model_type or 'llama'}"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "pwned"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import LlamaConfig, LlamaForCausalLM\n"
                                    "class EvilConfig(LlamaConfig):\n    pass\n"
                                    "class EvilModel(LlamaForCausalLM):\n    pass\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    if model_type:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def test_a_model_folder_never_runs_its_own_code_even_when_stdin_says_yes(invoke, tiny_model_dir, book, tmp_path):
    folder, marker = _folder_with_code(tiny_model_dir, tmp_path, "evilarch")
    line = one_line(invoke("ppl", book, "--model", folder, "-n", "20", "--quiet", input="y\n" * 20), 1)
    assert "custom code" in line and not marker.exists()
    known, marker = _folder_with_code(tiny_model_dir, tmp_path / "known", None)  # a family transformers has
    assert invoke("ppl", book, "--model", known, "-n", "20", "--quiet").exit_code == 0 and not marker.exists()


def test_bin_weights_that_ask_for_code_are_refused_with_one_line(invoke, tiny_model_dir, book, tmp_path):
    import io
    import shutil
    import zipfile

    folder = tmp_path / "bin-model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"x": torch.ones(1)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as plain, zipfile.ZipFile(folder / "pytorch_model.bin",
                                                                                   "w") as crafted:
        for info in plain.infolist():  # torch's own zip layout, with a data.pkl that calls os.system
            data = plain.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = pickle.dumps({"model.embed_tokens.weight": _RunsCode(marker)}, protocol=2)
            crafted.writestr(info, data)
    line = one_line(invoke("ppl", book, "--model", folder, "-n", "20", "--quiet"), 1)
    assert "not plain tensors" in line and not marker.exists()


def test_fuzzed_references_are_one_line_and_never_a_number(invoke, tiny_model_dir, book, tmp_path):
    import json

    import numpy as np

    reference = tmp_path / "ref.kvlogits"
    saved = invoke(*ppl(tiny_model_dir, book, "-n", "60", "--method", "full", "--save-logits", reference,
                        "--logits-top-k", "4"))
    assert saved.exit_code == 0, saved.stderr
    good = reference.read_bytes()
    compare = ppl(tiny_model_dir, book, "--kl-base", reference)
    assert json.loads(invoke(*compare).stdout)["kl_tokens"] == 60
    rng = np.random.default_rng(2)
    header_end = good.index(b"}") + 1
    variants = {"cut": good[: len(good) // 2], "empty": b"", "header key": good.replace(b'"vocab"', b'"vocob"')}
    for index in range(4):  # one bit in the records, past the header and before the footer
        flipped = bytearray(good)
        flipped[int(rng.integers(header_end, len(good) - 200))] ^= 1 << int(rng.integers(0, 8))
        variants[f"flip {index}"] = bytes(flipped)
    for name, data in variants.items():
        reference.write_bytes(data)
        result = invoke(*compare)
        assert result.stdout == "", name
        assert str(reference) in one_line(result, 1), name
