"""Files kvcli reads are data, never code: crafted or damaged state files get one line and run nothing."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from kvcli.adapt import STATE_FILE, load_state
from kvcli.errors import KvcliError
from kvcli.pod.groups import GroupsFile, ModelShape


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
