"""StreamingLLM (Xiao et al., 2023): attention sinks plus a window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.io.lazy import torch
from kvcli.methods.base import Method, check_budget, param
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView


@register
@dataclass
class StreamingLLM(Method):
    name = "streamingllm"
    description = "Keep the first `sinks` tokens (attention sinks) and the most recent ones; no scores needed."
    sinks: int = param(4, "initial tokens always kept (attention sinks)")
    evicts_oldest_while_writing = True

    def validate(self, budget: int) -> None:
        check_budget(budget, self.sinks + 1, "sinks + 1 recent token")

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        return self._kept(view, budget, {})

    def compress_layers(self, views: list[LayerView], budgets: list[int]) -> list[torch.Tensor | None]:
        made: dict[tuple, torch.Tensor] = {}  # layers of one length and budget share the indices
        return [self._kept(view, budget, made) for view, budget in zip(views, budgets, strict=True)]

    def _kept(self, view: LayerView, budget: int, made: dict[tuple, torch.Tensor]) -> torch.Tensor | None:
        """The sinks and the last ``budget - sinks`` tokens, for every head."""
        length = view.length
        if length <= budget:
            return None
        key = (length, budget, view.num_heads)
        if key not in made:
            device = view.layer.device
            recent = budget - self.sinks
            sinks = torch.arange(self.sinks, device=device)
            keep = torch.cat((sinks, torch.arange(length - recent, length, device=device)))
            made[key] = keep.expand(view.num_heads, budget)
        return made[key]
