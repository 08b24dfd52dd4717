"""kvcli: stream documents of any length through a language model with a KV cache of fixed size.

The library's public names are importable from here, whatever folder they live in (see the README's
"From Python"): ``load_model``, ``make_method``, ``Engine``, ``Reader`` and the few around them. They are
imported on first use, so that ``import kvcli`` (and the CLI's start-up) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the module that defines it.
PUBLIC = {
    "load_model": "kvcli.models.load",
    "make_method": "kvcli.methods",
    "METHODS": "kvcli.methods",
    "Method": "kvcli.methods",
    "Engine": "kvcli.engine.engine",
    "score_stream": "kvcli.engine.streaming",
    "Reader": "kvcli.reading.reader",
    "KvcliError": "kvcli.errors",
}

__all__ = ["METHODS", "Engine", "KvcliError", "Method", "Reader", "__version__", "load_model", "make_method",
           "score_stream"]

if TYPE_CHECKING:
    from kvcli.engine.engine import Engine
    from kvcli.engine.streaming import score_stream
    from kvcli.errors import KvcliError
    from kvcli.methods import METHODS, Method, make_method
    from kvcli.models.load import load_model
    from kvcli.reading.reader import Reader


def __getattr__(name: str) -> object:
    if name not in PUBLIC:
        raise AttributeError(f"module 'kvcli' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value
    return value
