"""Methods by name, so that adding one is one file with ``@register`` on its dataclass."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvcli.errors import UsageError

if TYPE_CHECKING:
    from kvcli.methods.base import Method

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def _convert(raw: str, default, annotation: str):
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if "bool" in kind:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if "int" in kind and "None" not in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    if "int" in kind:  # int | None
        return None if raw.lower() in ("none", "auto") else int(raw)
    return raw


def make_method(name: str, options: dict[str, object] | None = None) -> Method:
    """Build a method from its name and ``-o`` options (strings are converted to the field's type)."""
    if name not in METHODS:
        raise UsageError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, raw in (options or {}).items():
        key = key.replace("-", "_")
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise UsageError(f"method {name!r} has no parameter {key!r} (parameters: {known})")
        if isinstance(raw, str):
            try:
                values[key] = _convert(raw, fields[key].default, fields[key].type)
            except ValueError:
                raise UsageError(f"-o {key}={raw}: expected a value of type {fields[key].type}") from None
        else:
            values[key] = raw
    return cls(**values)
