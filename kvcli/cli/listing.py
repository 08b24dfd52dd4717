"""``kvcli methods``, ``kvcli models`` and ``kvcli presets``: what the other commands accept."""

from __future__ import annotations

from typing import Annotated

import typer


def methods(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {name, description, "
                                                   "params}.")] = False) -> None:
    """List the compression methods and their parameters (set them with -o KEY=VALUE)."""
    from kvcli.cli.render import methods_listing
    from kvcli.methods import METHODS
    from kvcli.report import dumps, print_result

    rows = [{"name": name, "description": cls.description, "params": cls.params()}
            for name, cls in sorted(METHODS.items())]
    print_result(dumps(rows) if json_out else methods_listing(rows))


def presets(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {name, kind, source, path, "
                                                   "settings}.")] = False) -> None:
    """List the presets (built-in and in the user folder) that --preset NAME accepts."""
    from kvcli.cli.render import presets_listing
    from kvcli.presets import list_presets, user_dir
    from kvcli.report import dumps, print_result

    found = list_presets()
    print_result(dumps([p.as_dict() for p in found]) if json_out else presets_listing(found, user_dir()))


def models(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {model_type, models, rope, "
                                                  "windows, attention}.")] = False) -> None:
    """List the model families kvcli streams, with the RoPE, window and attention facts it honours."""
    from dataclasses import asdict

    from kvcli.architecture import FAMILIES
    from kvcli.cli.render import models_listing
    from kvcli.report import dumps, print_result

    print_result(dumps([asdict(f) for f in FAMILIES]) if json_out else models_listing(FAMILIES))
