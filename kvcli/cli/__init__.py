"""The command-line interface: a thin Typer layer over the library (see :mod:`kvcli.cli.app`)."""

from kvcli.cli.app import app, main

__all__ = ["app", "main"]
