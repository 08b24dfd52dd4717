"""The ``kvcli`` application: every command registered here, explicitly, and the console entry point.

Command modules define plain functions and never import this module, so imports point one way:
app -> commands -> options/render -> library. Results go to stdout (text or one JSON object),
everything else to stderr. User mistakes become one line on stderr and exit code 2 (usage) or 1
(runtime); Ctrl-C prints what was measured.
"""

from __future__ import annotations

import inspect
import sys

import click
import typer
from typer.core import TyperGroup

from kvcli.cli import analyze, bench, cache, listing, needle, perplexity, pod, read, reading, ruler, speed
from kvcli.errors import BudgetError, KvcliError, UsageError

#: click's usage error as this Typer has it (its own copy of click in recent versions, click itself before):
#: what parsing raises for an unknown command or option, a missing argument or a value of the wrong type.
ClickUsageError = typer.BadParameter.__bases__[0]


class KvcliGroup(TyperGroup):
    """Turns the user's mistakes into one line on stderr and an exit code, inside the app itself, so
    the console script and an in-process runner (tests, notebooks) behave the same.

    Typer's own usage errors (``kvcli bogus``, ``--cache abc``, a missing argument) would be a box of
    four to six lines; they are one line here too, ending with where the help is.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except ClickUsageError as exc:  # an option of kvcli itself (``kvcli --bogus``): no context to exit through
            click.echo(f"kvcli: error: {_usage_message(exc, info_name or 'kvcli')}", err=True)
            raise typer.Exit(2) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ClickUsageError as exc:
            _fail(ctx, _usage_message(exc, ctx.command_path), 2)
        except BudgetError as exc:  # every command sets the budget with --cache
            _fail(ctx, exc.for_flag("--cache"), 2)
        except UsageError as exc:
            _fail(ctx, str(exc), 2)
        except KvcliError as exc:
            _fail(ctx, str(exc), 1)


def _usage_message(exc, command_path: str) -> str:
    """A usage error of Typer's as kvcli's one line: the message, then which help to read (the command's, else
    ``command_path``'s)."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    where = exc.ctx.command_path if exc.ctx is not None else command_path
    return f"{message[:1].lower()}{message[1:]} (see '{where} --help')"


def _fail(ctx: click.Context, message: str, code: int) -> None:
    click.echo(f"kvcli: error: {message}", err=True)
    ctx.exit(code)


app = typer.Typer(
    cls=KvcliGroup,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Push whole books through a language model with a KV cache that never grows, and measure the cost.",
)


def _print_version(value: bool) -> None:
    if value:
        from kvcli import __version__

        typer.echo(f"kvcli {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print kvcli's version and exit.")) -> None:
    """Options of kvcli itself, before the command."""


def one_line_paragraphs(doc: str | None) -> str | None:
    """``doc`` with each paragraph on one line: Typer's rich help keeps a docstring's single line breaks, which
    would cut its sentences where the source wraps them, before the terminal's width does."""
    if doc is None:
        return None
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(doc).split("\n\n"))


def _help_from_docstrings(*typers: typer.Typer) -> None:
    """Every command of ``typers`` without a help of its own gets its docstring, a paragraph a line."""
    for info in (info for each in typers for info in each.registered_commands):
        info.help = info.help or one_line_paragraphs(info.callback.__doc__)


app.command()(perplexity.ppl)
app.command()(reading.summarize)
app.command()(reading.ask)
app.command()(read.read)
app.command()(needle.needle)
app.command()(ruler.ruler)
app.command()(bench.bench)
app.command("bench-speed")(speed.bench_speed)
app.command()(analyze.analyze)
app.command()(pod.calibrate)
app.command()(pod.adapt)
app.command()(listing.methods)
app.command()(listing.models)
app.command()(listing.presets)
_help_from_docstrings(app, cache.app)
app.add_typer(cache.app, name="cache")


def main() -> None:
    """Console entry point: Ctrl-C outside a measurement and a closed stdout end quietly too.

    SIGTERM (``kill``, a batch system's time limit) stops a run as Ctrl-C does: what was measured is
    printed, marked interrupted, with exit code 130. A stdout closed at start (``>&-``) is one line
    before any work, since the result would have nowhere to go.
    """
    import signal

    if sys.stdout is None:
        print("kvcli: error: stdout is closed: results have nowhere to go (redirect it to a file or /dev/null)",
              file=sys.stderr)
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            app()
        except KeyboardInterrupt:
            print("kvcli: interrupted", file=sys.stderr)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)
        finally:
            # The way out is not interrupted: a second Ctrl-C while the interpreter runs its exit handlers
            # (closing a FIFO) would print their traceback instead of ending quietly.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except SystemExit as exc:
        _leave(exc.code)
    _leave(0)


def _leave(code: object) -> None:
    """End the process with ``code`` (a ``SystemExit`` code), without the interpreter's teardown once torch
    is loaded.

    Freeing the modules torch and transformers import takes a good part of a short command's time
    (docs/benchmarks.md, start-up), and nothing kvcli needs happens in it: files are closed by their own
    ``with`` blocks before this point, exit handlers run here, both streams are flushed. With other threads
    alive (a data set loader's) or torch never imported, the usual exit runs.
    """
    import threading

    if "torch" not in sys.modules or threading.active_count() > 1:
        sys.exit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # what sys.exit does with a message
        code = 1
    import atexit
    import os

    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None:  # an interpreter without it: exit the usual way
        sys.exit(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (a closed pipe) loses nothing of ours
            pass
    os._exit(code)
