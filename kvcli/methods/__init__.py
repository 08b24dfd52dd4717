"""Compression methods, one module each, registered by name (see :mod:`kvcli.methods.registry`).

Every module in this package is imported here, so a new method is one new file with ``@register``.
"""

import importlib
import pkgutil

from kvcli.methods.base import Method
from kvcli.methods.registry import METHODS, make_method

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "Method", "make_method"]
