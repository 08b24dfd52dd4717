"""What made a file of results: the settings recorded with it, compared field by field before it is continued.

A rows file (``ppl --rows``, ``ask``/``summarize --each --rows``, ``needle --rows``) records with every row the
settings that made it: the command, a format version, the model, the method and its parameters, the budget,
the block, the dtype, and what else changes a row (the question of ``ask``). ``--resume`` continues only rows
whose settings equal this run's; otherwise one line names the first setting that differs, so that rows of
another method, dtype, question or command are never mixed into a result.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import MISSING, fields

from kvcli.errors import KvcliError
from kvcli.io.report import dumps

#: The format of a row's ``run``: raised when a field changes meaning, so that older rows are refused, not misread.
ROWS_FORMAT = 1


def rows_identity(command: str, **settings) -> dict:
    """The ``run`` a row of ``command`` records: the command, :data:`ROWS_FORMAT` and ``settings`` (as JSON holds
    them)."""
    return as_json({"command": command, "format": ROWS_FORMAT, **settings})


def as_json(value):
    """``value`` as it reads back from JSON (tuples become lists), to compare with what a file holds."""
    return json.loads(dumps(value))


def first_difference(old, new: dict) -> str | None:
    """``None`` when ``old`` equals ``new``, else the fields that differ, the first (in ``new``'s order) with values."""
    if not isinstance(old, dict):
        return "it records no run"
    names = [name for name in [*new, *(name for name in old if name not in new)] if old.get(name) != new.get(name)]
    if not names:
        return None
    first = names[0]
    also = f"; also {', '.join(names[1:])}" if names[1:] else ""
    return f"its {first} is {old.get(first)!r}, this run's {new.get(first)!r}{also}"


def method_params_check(params: dict[str, dict]) -> Callable[[dict], str | None]:
    """For :func:`resumed_trials`' ``also``: a row of a method this run reads must record the parameters it reads
    with (``params[method]``), so that a resume never takes rows of ``-o`` settings other than this run's."""
    params = as_json(params)

    def differs(row: dict) -> str | None:
        if row.get("method") not in params:
            return None
        return first_difference({"params": row.get("params")}, {"params": params[row["method"]]})

    return differs


def resumed_trials(log, resume: bool, required: str, run: dict, record: type, name: str,
                   also: Callable[[dict], str | None] | None = None) -> Iterator:
    """The trials a rows file ``log`` (:class:`kvcli.io.outputs.RowLog`) holds when resuming, each read back as a
    ``record`` dataclass. A row of another run (its ``run`` against ``run``, then ``also(row)``) or one that is no
    ``name`` is refused in one line: a resume never mixes runs."""
    for number, row in enumerate(log.start(resume, required=required), start=1):
        where = f"{log.flag} {log.path} line {number}"
        differs = first_difference(row.get("run"), run)
        if differs is None and also is not None:
            differs = also(row)
        if differs is not None:
            raise KvcliError(f"{where} is a trial of another run ({differs}): choose another {log.flag} file, "
                             "or run without --resume to start over")
        try:
            # A field with a default may be missing: rows written before it existed still resume.
            yield record(**{f.name: row[f.name] for f in fields(record) if f.name in row or not has_default(f)})
        except (KeyError, TypeError):
            raise KvcliError(f"{where} is not a {name} of kvcli: remove it, or choose another {log.flag} "
                             "file") from None


def has_default(spec) -> bool:
    """Whether a dataclass field can be left out of the constructor."""
    return spec.default is not MISSING or spec.default_factory is not MISSING
