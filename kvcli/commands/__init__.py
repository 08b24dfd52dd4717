"""CLI commands beyond ``ppl`` and ``methods``, one module per command family.

Each module registers its commands on :data:`kvcli.cli.app`; every module here is imported by
:mod:`kvcli.cli`, so a new command family is one new file.
"""

import importlib
import pkgutil


def load_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
