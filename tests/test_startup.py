"""Starting fast: commands that load no model (listings, ``--help``, ``kvcli cache``, usage errors) import neither
torch nor transformers, which take seconds to import on a small CPU (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Runs kvcli's console entry point in a fresh interpreter, then reports on stderr which heavy modules it imported.
PROBE = """
import json, sys
from kvcli.cli.app import main
sys.argv = ["kvcli", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}),
      file=sys.stderr)
"""


def probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [
    ["--help"], ["methods"], ["methods", "--json"], ["models"], ["presets"], ["cache"], ["cache", "list", "--json"],
])
def test_listings_import_no_torch(args, config_home):
    result = probe(*args)
    assert result == {"code": 0, "heavy": []}


@pytest.mark.parametrize("args", [
    ["ppl"],                                     # a missing argument (Typer)
    ["ppl", "BOOK", "--no-such-option"],         # an unknown option (Typer)
    ["ppl", "BOOK", "--block", "x"],             # a bad value, checked by the command
    ["ppl", "BOOK", "--stride", "3"],            # options that go together
])
def test_usage_errors_import_no_torch(args, book):
    result = probe(*[str(book) if arg == "BOOK" else arg for arg in args])
    assert result == {"code": 2, "heavy": []}


def _kvcli_process(*args: str) -> subprocess.CompletedProcess:
    import os
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "kvcli", *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_command_that_loaded_torch_leaves_with_everything_written(invoke, tiny_model_dir, book, tmp_path):
    """Such a process ends without the interpreter's teardown (``cli.app._leave``): the result on stdout, a
    ``--jsonl`` file and the exit code are what an in-process run gives."""
    curve = tmp_path / "curve.jsonl"
    args = ["ppl", str(book), "--model", str(tiny_model_dir), "--cache", "48", "--block", "16", "--json", "--quiet"]
    done = _kvcli_process(*args, "--jsonl", str(curve))
    assert done.returncode == 0, done.stderr
    expected = json.loads(invoke(*args).stdout)
    assert json.loads(done.stdout)["nll"] == expected["nll"]
    rows = [json.loads(line) for line in curve.read_text().splitlines()]
    assert sum(row["tokens"] for row in rows) == expected["tokens"]


def test_an_error_after_torch_is_loaded_keeps_its_line_and_exit_code(tiny_model_dir, tmp_path):
    empty = tmp_path / "blank.txt"
    empty.write_text("   \n")
    done = _kvcli_process("ppl", str(empty), "--model", str(tiny_model_dir), "--json")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"kvcli: error: input is empty: {empty}"]
