"""The ``kvcli`` application: every command registered here, explicitly, and the console entry point.

Command modules define plain functions and never import this module, so imports point one way:
app -> commands -> options/render -> library. Results go to stdout (text or one JSON object),
everything else to stderr. User mistakes become one line on stderr and exit code 2 (usage) or 1
(runtime); Ctrl-C prints what was measured.
"""

from __future__ import annotations

import sys

import typer

from kvcli.cli import analyze, bench, listing, needle, perplexity, reading
from kvcli.errors import BudgetError, KvcliError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Push whole books through a language model with a KV cache that never grows, and measure the cost.",
)
app.command()(perplexity.ppl)
app.command()(reading.summarize)
app.command()(reading.ask)
app.command()(needle.needle)
app.command()(bench.bench)
app.command()(analyze.analyze)
app.command()(listing.methods)
app.command()(listing.presets)


def main() -> None:
    """Console entry point: turn user errors into one line on stderr instead of a traceback."""
    try:
        app()
    except BudgetError as exc:  # every command sets the budget with --cache
        print(f"kvcli: error: {exc.for_flag('--cache')}", file=sys.stderr)
        sys.exit(2)
    except UsageError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KvcliError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("kvcli: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
