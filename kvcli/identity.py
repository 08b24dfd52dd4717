"""What made a file of results: the settings recorded with it, compared field by field before it is continued.

A rows file (``ppl --rows``, ``ask``/``summarize --each --rows``, ``needle --rows``) records with every row the
settings that made it: the command, a format version, the model, the method and its parameters, the budget,
the block, the dtype, and what else changes a row (the question of ``ask``). ``--resume`` continues only rows
whose settings equal this run's; otherwise one line names the first setting that differs, so that rows of
another method, dtype, question or command are never mixed into a result.
"""

from __future__ import annotations

import json

from kvcli.report import dumps

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
