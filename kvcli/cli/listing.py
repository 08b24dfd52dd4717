"""``kvcli methods``, ``kvcli models`` and ``kvcli presets``: what the other commands accept."""

from __future__ import annotations

from typing import Annotated

import typer


def methods(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {name, description, "
                                                   "params}.")] = False) -> None:
    """List the compression methods and their parameters (set them with -o KEY=VALUE)."""
    from kvcli.cli.render import methods_listing
    from kvcli.io.report import dumps, print_result
    from kvcli.methods import METHODS

    rows = [{"name": name, "description": cls.description, "params": cls.params()}
            for name, cls in sorted(METHODS.items())]
    print_result(dumps(rows) if json_out else methods_listing(rows))


def presets(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {name, kind, source, path, "
                                                   "settings}.")] = False) -> None:
    """List the presets (built-in and in the user folder) that --preset NAME accepts."""
    from kvcli.cli.render import presets_listing
    from kvcli.io.report import dumps, print_result, warn
    from kvcli.models.presets import list_presets, user_dir

    found = list_presets(warn)
    print_result(dumps([p.as_dict() for p in found]) if json_out else presets_listing(found, user_dir()))


def models(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {model_type, models, rope, "
                                                  "windows, attention, presets}.")] = False) -> None:
    """List the model families kvcli streams, with the RoPE, window and attention facts it honours and the
    model presets (--preset NAME) of each family."""
    from dataclasses import asdict

    from kvcli.cli.render import models_listing
    from kvcli.io.report import dumps, print_result
    from kvcli.kv.architecture import FAMILIES
    from kvcli.models.presets import list_presets

    presets: dict[str, list[str]] = {}
    for preset in list_presets():
        if "family" in preset.settings:
            presets.setdefault(preset.settings["family"], []).append(preset.name)
    if json_out:
        print_result(dumps([{**asdict(f), "presets": presets.get(f.model_type, [])} for f in FAMILIES]))
    else:
        print_result(models_listing(FAMILIES, presets))
