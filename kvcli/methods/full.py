"""Full attention: nothing is evicted. The reference every method is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from kvcli.methods.base import Method
from kvcli.methods.registry import register


@register
@dataclass
class Full(Method):
    name = "full"
    unbounded = True
    description = "No eviction: the cache grows with the stream (quality reference; memory is not bounded)."
