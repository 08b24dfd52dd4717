"""Methods by name, so that adding one is one file with ``@register`` on its dataclass."""

from __future__ import annotations

import dataclasses
import math
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
        return None if "None" in kind and raw.lower() in ("none", "auto") else float(raw)
    if "int" in kind:  # int | None
        return None if raw.lower() in ("none", "auto") else int(raw)
    return raw


#: The smallest value of an integer parameter whose name means the same in every method: a window of queries
#: and a pooling width hold at least one. Every other integer parameter (sinks, recent, ...) counts tokens
#: and is at least 0.
MINIMUM = {"window": 1, "kernel": 1}


def allowed_range(field: dataclasses.Field) -> str | None:
    """What a parameter accepts, in words for a message, or None for parameters of any value (text)."""
    kind = _kind(field.type)
    if "bool" in kind:
        return "true or false"
    if "int" in kind:
        return f"an integer >= {MINIMUM.get(field.name, 0)}" + (" or auto" if "None" in kind else "")
    if "float" in kind:
        return "a finite number" + (" or auto" if "None" in kind else "")
    return None


def check_value(method: str, field: dataclasses.Field, value: object) -> None:
    """Refuse a parameter value outside its range with one line that states the range.

    The one check every method gets, before its own (``Method.validate``): a negative count of
    tokens or a NaN would otherwise reach torch as an obscure RuntimeError, or a wrong number.
    """
    kind = _kind(field.type)
    if value is None and "None" in kind:
        return
    if "bool" in kind:
        ok = isinstance(value, bool)
    elif "int" in kind:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= MINIMUM.get(field.name, 0)
    elif "float" in kind:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    else:
        return
    if not ok:
        help_text = field.metadata.get("help", "")
        raise UsageError(f"-o {field.name}={value}: {method}'s {field.name} must be {allowed_range(field)}"
                         + (f" ({help_text})" if help_text else ""))


def check_params(method: Method) -> None:
    """Every parameter of a built method within its range (a method made in Python skips :func:`make_method`)."""
    for field in dataclasses.fields(method):
        check_value(method.name, field, getattr(method, field.name))


def _kind(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def make_method(name: str, options: dict[str, object] | None = None) -> Method:
    """Build a method from its name and ``-o`` options (strings are converted to the field's type), each
    checked against its range (:func:`check_value`) before the method sees it."""
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
                expected = allowed_range(fields[key]) or f"a value of type {fields[key].type}"
                raise UsageError(f"-o {key}={raw}: {name}'s {key} must be {expected}") from None
        else:
            values[key] = raw
        check_value(name, fields[key], values[key])
    return cls(**values)
