"""The small interface every compression method implements, and the helpers they share.

A method is a dataclass whose fields are its parameters (set with ``-o KEY=VALUE``). After each
forward pass the engine shows it one layer at a time (:class:`kvcli.cache.LayerView`) and the
method answers with the token indices to keep per KV head, or ``None`` to keep everything.
The same call serves block streaming (many new tokens), one-shot prefill (one big block) and
decoding (one new token), so a method never needs three code paths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcli.cache import LayerView
from kvcli.errors import UsageError


def param(default, help: str, **kwargs):
    """A method parameter: a dataclass field whose ``help`` is what ``kvcli methods`` prints."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class Method:
    """Base class: keeps everything. Subclasses override :meth:`compress` and, if they score, :meth:`score_window`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: The paper keeps every token at the position it entered with (no re-assignment) when a prompt
    #: fits the model's context; kvcli then does so for a prompt read in one shot (``kvcli ask``).
    keeps_positions: ClassVar[bool] = False
    #: The method never evicts, so it takes no budget and its cache grows with the stream (``full``).
    unbounded: ClassVar[bool] = False

    def score_window(self, block_len: int) -> int:
        """How many of a forward's last queries must record their attention (0: none needed)."""
        return 0

    def layer_budgets(self, cache_size: int, num_layers: int) -> list[int]:
        """Tokens each layer may keep; uniform unless the method allocates across layers."""
        return [cache_size] * num_layers

    def validate(self, cache_size: int) -> None:
        """Raise :class:`UsageError` when ``cache_size`` cannot hold what the method always keeps."""

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """Indices ``[H_kv, k]`` (ascending) of the tokens to keep, or None to keep all."""
        return None

    def settings(self) -> dict:
        """This instance's parameter values by name: what results record so a run can be reproduced."""
        return dataclasses.asdict(self)

    @classmethod
    def params(cls) -> list[dict]:
        """Name, default, type and help of every parameter, for ``kvcli methods --json``."""
        out = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append({"name": f.name, "default": default, "type": _type_name(f.type),
                        "help": f.metadata.get("help", "")})
        return out


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def recent_and_sinks(length: int, sinks: int, recent: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[length]``: the first ``sinks`` and last ``recent`` tokens, which every method keeps."""
    protected = torch.zeros(length, dtype=torch.bool, device=device)
    protected[: min(sinks, length)] = True
    if recent > 0:
        protected[max(length - recent, 0):] = True
    return protected


def select_top(scores: torch.Tensor, protected: torch.Tensor, budget: int) -> torch.Tensor:
    """Per head, the protected tokens plus the best-scoring others: ascending indices ``[H, budget]``.

    ``scores`` is ``[H, T]``; ``protected`` is ``[T]`` or ``[H, T]``. Equal scores go to the
    earlier token (a stable sort), which matters for max pooling, whose plateaus tie exactly.
    (``torch.topk`` does not promise any order among ties.)
    """
    heads, length = scores.shape
    if budget >= length:
        return torch.arange(length, device=scores.device).expand(heads, length)
    ranked = scores.to(torch.float32).masked_fill(protected, float("inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :budget]
    return order.sort(dim=-1).values


def group_mean(probs: torch.Tensor) -> torch.Tensor:
    """Aggregate ``[H_kv, group, T]`` attention over the query heads that share each KV head (GQA)."""
    return probs.mean(dim=1)


def check_budget(cache_size: int, always_kept: int, what: str) -> None:
    if cache_size < always_kept:
        raise UsageError(f"--cache {cache_size} is smaller than {what} ({always_kept}): raise --cache or lower them")


@dataclass
class Split:
    """The budget split the papers compare methods under: sinks + recent window + selected tokens.

    TreeKV's experiments at cache 1024 use 4 + 508 + 512; ``recent=None`` reproduces that ratio
    (half of what the sinks leave) at any budget.
    """

    sinks: int
    recent: int
    selected: int

    @classmethod
    def of(cls, budget: int, sinks: int, recent: int | None) -> Split:
        recent = (budget - sinks) // 2 if recent is None else recent
        return cls(sinks, recent, budget - sinks - recent)


def check_split(cache_size: int, sinks: int, recent: int | None) -> None:
    """Raise :class:`UsageError` for negative sizes or a budget smaller than sinks + recent."""
    if sinks < 0 or (recent is not None and recent < 0):
        raise UsageError("sinks and recent must be >= 0")
    if recent is None:
        check_budget(cache_size, sinks, "the sinks")
    else:
        check_budget(cache_size, sinks + recent, "sinks + recent")
