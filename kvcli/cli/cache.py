"""``kvcli cache``: the converted models kvcli keeps (see :mod:`kvcli.modelcache`), listed or cleared."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="A JSON object: {folder, bytes, entries: [{name, path, bytes, "
                                       "source, variant, created, problem}]}.")]

app = typer.Typer(help="The model cache: GGUF models converted once so that every later command starts in seconds "
                  "(KVCLI_CACHE moves it). Without a subcommand: list it.")


@app.callback(invoke_without_command=True)
def cache(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """The model cache: GGUF models converted once so that every later command starts in seconds (KVCLI_CACHE
    moves it). Without a subcommand: list it."""
    if ctx.invoked_subcommand is None:
        show(json_out)


@app.command("list")
def list_(json_out: JsonOpt = False) -> None:
    """List the cached models with their sizes, sources and the cache folder."""
    show(json_out)


@app.command()
def clear() -> None:
    """Remove every cached model (the next load of each converts it again)."""
    from kvcli.modelcache import clear as clear_cache
    from kvcli.modelcache import models_dir
    from kvcli.report import mib, print_result

    removed, freed = clear_cache()
    print_result(f"removed {removed} cached model{'' if removed == 1 else 's'} ({mib(freed)}) from {models_dir()}")


def show(json_out: bool) -> None:
    from kvcli.cli.render import cache_listing
    from kvcli.modelcache import entries, models_dir
    from kvcli.report import dumps, print_result

    found = entries()
    if json_out:
        print_result(dumps({"folder": str(models_dir()), "bytes": sum(e.bytes for e in found), "entries": [
            {"name": e.name, "path": str(e.path), "bytes": e.bytes, "source": (e.manifest or {}).get("source"),
             "variant": (e.manifest or {}).get("variant"), "created": (e.manifest or {}).get("created"),
             "problem": e.problem} for e in found]}))
    else:
        print_result(cache_listing(found, models_dir()))
