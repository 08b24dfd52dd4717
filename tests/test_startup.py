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
