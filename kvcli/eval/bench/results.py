"""``results.json``: the runs a grid has measured, read and written so that nothing finished is lost.

Every finished run is written at once, atomically (a temporary file and ``os.replace``), so an
interrupted grid loses at most the run in progress, and a rerun into the same folder skips the runs
it already has (matched on :data:`KEY_FIELDS`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.io.outputs import atomic_write
from kvcli.io.report import clean_json, dumps

RESULTS_FILE = "results.json"
# What makes two runs the same measurement: a rerun skips a planned run whose values of these match.
SETTING_FIELDS = ("model", "source", "tokens", "block", "dtype", "device")
KEY_FIELDS = (*SETTING_FIELDS, "method", "cache", "params", "kv_bits")
#: A run recorded before a field existed measured its default (``kv_bits``: the model's 16 bits).
KEY_DEFAULTS = {"kv_bits": 16}


@dataclass
class GridResult:
    """The grid's runs in grid order (earlier ones reused, new ones measured), and the whole result set."""

    runs: list[dict]
    results: dict
    settings: dict  # this grid's model, source, tokens, bytes, block, dtype, device
    skipped: int
    measured: int
    interrupted: bool


def run_key(run: dict) -> str:
    """The identity of a measurement: equal keys mean a rerun would measure the same thing again."""
    return json.dumps([run.get(name, KEY_DEFAULTS.get(name)) for name in KEY_FIELDS], sort_keys=True)


def load_results(out_dir: Path) -> dict:
    """``out_dir/results.json``, or an empty result set; a file that is not one is an error, never overwritten."""
    path = Path(out_dir) / RESULTS_FILE
    if not path.exists():
        return {"runs": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvcliError(f"{path} is not a kvcli bench results file ({exc}); choose another --out") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise KvcliError(f"{path} is not a kvcli bench results file (no list of runs); choose another --out")
    for number, run in enumerate(data["runs"], start=1):
        if not isinstance(run, dict):
            raise KvcliError(f"{path} is not a kvcli bench results file (run {number} is {json.dumps(run)[:40]}, "
                             "not an object); choose another --out")
    return data


def save_results(out_dir: Path, results: dict) -> Path:
    """Write ``results.json`` at once (:func:`kvcli.io.outputs.atomic_write`: an exclusive temporary file renamed
    over it): Ctrl-C or a crash mid-write leaves the previous complete file, never half of one.

    One line per run (curves included) keeps the file greppable and diffable without indenting every
    number of a curve onto its own line.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    fields = [f"{json.dumps(key)}: {dumps(value)}" for key, value in results.items() if key != "runs"]
    runs = ",\n".join(f"  {dumps(run)}" for run in results.get("runs", []))
    fields.append(f'"runs": [\n{runs}\n]')
    atomic_write(path, ("{\n" + ",\n".join(fields) + "\n}\n").encode("utf-8"))
    return path


def check_out_dir(out_dir: Path) -> dict:
    """Fail before loading a model if ``out_dir`` cannot be written or holds something else; return its results."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvcliError(f"cannot create --out {out_dir}: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK):
        raise KvcliError(f"cannot write to --out {out_dir}")
    return load_results(out_dir)


def bench_json(grid: GridResult, out_dir: Path, plots: list[Path]) -> dict:
    """The ``--json`` object: this grid's runs, where the results are, and whether it was interrupted."""
    return clean_json({**grid.settings, "results": str(Path(out_dir) / RESULTS_FILE), "plots": [str(p) for p in plots],
                       "skipped": grid.skipped, "measured": grid.measured, "interrupted": grid.interrupted,
                       "runs": grid.runs})
