"""StreamingLLM (Xiao et al., 2023): attention sinks plus a window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.lazy import torch
from kvcli.methods.base import Method, check_budget, param
from kvcli.methods.registry import register

if TYPE_CHECKING:
    from kvcli.cache import LayerView


@register
@dataclass
class StreamingLLM(Method):
    name = "streamingllm"
    description = "Keep the first `sinks` tokens (attention sinks) and the most recent ones; no scores needed."
    sinks: int = param(4, "initial tokens always kept (attention sinks)")

    def validate(self, budget: int) -> None:
        check_budget(budget, self.sinks + 1, "sinks + 1 recent token")

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        length = view.length
        if length <= budget:
            return None
        device = view.layer.device
        recent = budget - self.sinks
        sinks = torch.arange(self.sinks, device=device)
        keep = torch.cat((sinks, torch.arange(length - recent, length, device=device)))
        return keep.expand(view.num_heads, budget)
