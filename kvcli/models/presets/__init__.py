"""Presets: TOML files that fill in a command's defaults (a model and its stop strings, a method and its budget).

A preset is found by name in the user's folder (``$XDG_CONFIG_HOME/kvcli/presets``, else
``~/.config/kvcli/presets``) and then among the built-in ones, so a user file overrides a built-in
preset of the same name; a path to a ``.toml`` file works too. Options given on the command line
always win over presets, and a later ``--preset`` over an earlier one.

Keys: ``model``, ``dtype``, ``device`` and ``stop`` (a list of strings) describe a model;
``method``, ``cache``, ``block`` and ``options`` (a table of method parameters) describe a method;
``description`` is free text and ``kind`` (model or method) is inferred when absent.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kvcli.errors import UsageError

MODEL_KEYS = {"model": str, "dtype": str, "device": str, "stop": list}
METHOD_KEYS = {"method": str, "cache": int, "block": int, "options": dict}
#: Keys that describe a preset rather than set an option: ``family`` is the ``model_type`` of a model
#: preset's architecture (``kvcli models`` lists the presets of each family).
OTHER_KEYS = {"description": str, "kind": str, "family": str}
KINDS = ("model", "method", "mixed")
TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "a table"}


@dataclass
class Preset:
    name: str
    kind: str  # "model", "method" or "mixed" (both)
    path: Path
    source: str  # "user", "built-in" or "file"
    settings: dict

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "source": self.source, "path": str(self.path),
                "settings": self.settings}


def builtin_dirs() -> list[Path]:
    """Folders of the built-in presets: this package's own folder, shipped as package data in every install."""
    return [Path(__file__).resolve().parent]


def user_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvcli" / "presets"


def search_path() -> list[tuple[Path, str]]:
    """Folders searched by name, highest priority first."""
    return [(user_dir(), "user")] + [(d, "built-in") for d in builtin_dirs()]


def parse(path: Path, name: str | None = None, source: str = "file") -> Preset:
    """Read and check one preset file."""
    try:
        with open(path, "rb") as handle:
            settings = tomllib.load(handle)
    except OSError as exc:
        raise UsageError(f"cannot read preset {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"preset {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text
        raise UsageError(f"preset {path} is not valid TOML: not UTF-8 text (byte {exc.start})") from None
    known = {**MODEL_KEYS, **METHOD_KEYS, **OTHER_KEYS}
    for key, value in settings.items():
        if key not in known:
            raise UsageError(f"preset {path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        expected = known[key]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise UsageError(f"preset {path}: {key} must be {TYPE_NAMES[expected]}, not {value!r}")
    if "stop" in settings and not all(isinstance(s, str) for s in settings["stop"]):
        raise UsageError(f"preset {path}: stop must be a list of strings")
    has_model = any(k in settings for k in MODEL_KEYS)
    has_method = any(k in settings for k in METHOD_KEYS)
    inferred = "mixed" if has_model and has_method else ("model" if has_model else "method")
    kind = settings.get("kind", inferred)
    if kind not in KINDS:
        raise UsageError(f"preset {path}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return Preset(name or path.stem, kind, path, source, settings)


def list_presets(warn: Callable[[str], None] | None = None) -> list[Preset]:
    """Every preset reachable by name, sorted; a user preset hides a built-in one of the same name.

    A file that is no preset (not TOML, an unknown key) is left out, after one line to ``warn``: one broken
    file in the user's folder must not break every listing (``--preset`` with its name still says why)."""
    found: dict[str, Preset | None] = {}
    for folder, source in search_path():
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            if path.stem in found:
                continue
            try:
                found[path.stem] = parse(path, source=source)
            except UsageError as exc:
                found[path.stem] = None  # still hides a built-in preset of its name, as find_preset does
                if warn is not None:
                    warn(f"{exc}: left out")
    return [found[name] for name in sorted(found) if found[name] is not None]


def find_preset(spec: str) -> Preset:
    """A preset by name (user folder first, then built-in) or by path to a ``.toml`` file."""
    path = Path(os.path.expanduser(spec))
    if spec.endswith(".toml") or os.sep in spec or "/" in spec:
        if path.is_file():
            return parse(path, source="file")
        raise UsageError(f"no such preset file: {spec}")
    for folder, source in search_path():
        candidate = folder / f"{spec}.toml"
        if candidate.is_file():
            return parse(candidate, source=source)
    names = ", ".join(p.name for p in list_presets()) or "none"
    raise UsageError(f"unknown preset {spec!r}; available: {names} (or give a path to a .toml file)")


def merge(specs: list[str] | None) -> dict:
    """Settings of several presets, later ones overriding earlier ones (``options`` merged key by key,
    ``stop`` lists joined)."""
    merged: dict = {}
    for spec in specs or []:
        settings = find_preset(spec).settings
        for key, value in settings.items():
            if key in OTHER_KEYS:
                continue
            if key == "options":
                merged["options"] = {**merged.get("options", {}), **value}
            elif key == "stop":
                merged["stop"] = list(dict.fromkeys([*merged.get("stop", []), *value]))
            else:
                merged[key] = value
    return merged
