"""torch, imported on first use: modules that only call it inside functions import it from here, so that
commands which never touch a model (``kvcli methods``, ``--help``, usage errors) start without it.

Rule: a module may take ``torch`` (or ``F``) from here only if nothing at its top level (class bodies,
decorators, default values) uses it; type hints are fine under ``from __future__ import annotations``.
``tests/test_startup.py`` checks that the listing commands and early usage errors import neither.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING


class LazyModule(types.ModuleType):
    """A stand-in for a module that imports it at the first attribute read, then holds its namespace, so later
    reads cost what a module's do."""

    def __getattr__(self, name: str):
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, name)


if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F  # noqa: N812 (torch's own spelling)
else:
    torch = LazyModule("torch")
    F = LazyModule("torch.nn.functional")

__all__ = ["F", "LazyModule", "torch"]
