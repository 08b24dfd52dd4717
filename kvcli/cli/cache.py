"""``kvcli cache``: the converted models kvcli keeps (see :mod:`kvcli.models.cache`), listed or cleared."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="A JSON object: {folder, bytes, entries: [{name, path, bytes, "
                                       "source, variant, created, problem}], foreign: [names kvcli did not make]}.")]

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
    """Remove every model kvcli cached (the next load of each converts it again). Folders kvcli did not make are
    left alone and named."""
    from kvcli.io.report import mib, print_result
    from kvcli.models.cache import clear as clear_cache
    from kvcli.models.cache import models_dir

    done = clear_cache()
    _name_foreign(done.foreign, clearing=True)
    plural = "" if done.removed == 1 else "s"
    print_result(f"removed {done.removed} cached model{plural} ({mib(done.bytes)}) from {models_dir()}")


def show(json_out: bool) -> None:
    from kvcli.cli.render import cache_listing
    from kvcli.io.report import dumps, print_result
    from kvcli.models.cache import models_dir, scan

    found, foreign = scan()
    if json_out:
        print_result(dumps({"folder": str(models_dir()), "bytes": sum(e.bytes for e in found), "entries": [
            {"name": e.name, "path": str(e.path), "bytes": e.bytes, "source": (e.manifest or {}).get("source"),
             "variant": (e.manifest or {}).get("variant"), "created": (e.manifest or {}).get("created"),
             "problem": e.problem} for e in found], "foreign": foreign}))
    else:
        _name_foreign(foreign, clearing=False)
        print_result(cache_listing(found, models_dir()))


def _name_foreign(names: list[str], *, clearing: bool) -> None:
    """One line on stderr naming what kvcli found in its cache folder but did not make (and never removes)."""
    from kvcli.io.report import warn
    from kvcli.models.cache import models_dir

    if not names:
        return
    folder = models_dir()
    kind = "folder" if all((folder / name).is_dir() for name in names) else "item"
    what = f"{len(names)} {kind}{'' if len(names) == 1 else 's'} kvcli did not make"
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    warn(f"left {what} in {folder}: {shown}" if clearing else
         f"{folder} also holds {what} (`kvcli cache clear` leaves them): {shown}")
