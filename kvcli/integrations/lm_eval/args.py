"""``--model_args`` of the lm-eval model ``kvcli``: what the user typed, checked before the model loads.

lm-eval hands the arguments over as keywords (digits already ints, anything else as text); :class:`ModelArgs`
holds them as given and :meth:`ModelArgs.validate` turns them into :class:`CheckedArgs`, one clear
:class:`UsageError` for the first mistake, so that a typo costs no wait for a model (seconds to minutes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcli.engine.engine import Engine
from kvcli.errors import BudgetError, UsageError
from kvcli.io.report import warn
from kvcli.methods import Method, make_method
from kvcli.models.load import LoadedModel, load_model

#: Bits per key and value element of the cache: 16 (the model's precision), 8, 4 or 2 (kvcli.kv.quant).
KV_BITS = (16, 8, 4, 2)


@dataclass(frozen=True)
class CheckedArgs:
    """The model arguments parsed: the engine to build and how requests are read and written."""

    model: str
    device: str | None  # resolved when the model loads (:func:`_device`)
    dtype: str
    method: Method
    budget: int
    block: int | None  # None: the engine's default for the device
    kv_bits: int
    one_shot: bool | None  # None: by size
    max_gen_toks: int
    seed: int

    def load(self) -> tuple[LoadedModel, Engine]:
        """The model, and the engine that streams every request through its compressed cache."""
        loaded = load_model(self.model, device=_device(self.device), dtype=self.dtype)
        try:
            engine = Engine(loaded.model, self.method, self.budget, block=self.block, warn=warn, kv_bits=self.kv_bits)
        except BudgetError as exc:
            raise UsageError(exc.for_flag("cache")) from None
        return loaded, engine


@dataclass(frozen=True)
class ModelArgs:
    """The model arguments as lm-eval hands them over; ``options`` are the other keys, the method's parameters
    (``sinks=8``, as ``kvcli ppl -o sinks=8``)."""

    model: str
    method: str
    cache: int | str
    block: int | str
    kv_bits: int | str
    device: str | None
    dtype: str
    one_shot: bool | str | None
    max_gen_toks: int | str
    seed: int | str
    options: dict = field(default_factory=dict)

    def validate(self) -> CheckedArgs:
        """Every argument checked and parsed, loading nothing; the first one wrong is a :class:`UsageError`."""
        bits = _whole("kv_bits", self.kv_bits, 1)
        if bits not in KV_BITS:
            raise UsageError(f"kv_bits={self.kv_bits}: must be 16, 8, 4 or 2 (bits per cached key and value "
                             "element)")
        budget = _whole("cache", self.cache, 1)
        block = _block(self.block)
        one_shot = _one_shot(self.one_shot)
        max_gen_toks = _whole("max_gen_toks", self.max_gen_toks, 1)
        seed = _whole("seed", self.seed, 0)
        method = make_method(str(self.method), self.options)
        return CheckedArgs(str(self.model), self.device, str(self.dtype), method, budget, block, bits, one_shot,
                           max_gen_toks, seed)


def _whole(name: str, value: int | str, minimum: int) -> int:
    """A whole-number model_arg (lm-eval hands over digits as ints already, anything else as text)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a whole number, not {value!r}") from None
    if number < minimum:
        raise UsageError(f"{name} must be at least {minimum}, not {number}")
    return number


def _block(value: int | str) -> int | None:
    """``block``: tokens per forward pass, or ``auto`` (None: the engine's default for the device)."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        block = int(value)
    except ValueError:
        raise UsageError(f"block must be a number of tokens or auto, not {value!r}") from None
    if block < 1:
        raise UsageError(f"block must be at least 1 token, not {block}")
    return block


def _device(value: str | None) -> str:
    """The device to load on. lm-eval's command line passes ``cuda:0`` unless told otherwise; where CUDA is
    missing that default becomes kvcli's ``auto``, as lm-eval's own Hugging Face model treats it."""
    device = str(value or "auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        warn(f"device {device} is not available here (lm-eval passes cuda:0 by default): using the CPU")
        return "auto"
    return device


def _one_shot(value: bool | str | None) -> bool | None:
    """``one_shot``: read a context in one forward pass (true), always in blocks (false) or by size (auto)."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return None
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise UsageError(f"one_shot must be true, false or auto, not {value!r}")
