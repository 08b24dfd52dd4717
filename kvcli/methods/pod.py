"""PoD (Ma et al., "Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention Similarity").

PoD keeps every token. Proximal tokens (the first ``sinks`` and the last ``recent`` before each
query, sliding with it) get full attention in every layer; distant tokens are scored once per
block of similar layers, with the lead (lowest) layer's queries and keys, and weigh each layer's own
values (Eq. 3-4). So a distant token's key is stored only in the lead layer of each KV head's block,
and its values in every layer: the memory saving. The blocks come from a groups file
(:mod:`kvcli.analysis.calibrate`); kvcli ships one for its default model. See :mod:`kvcli.pod` and the PoD
section of docs/methods.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.errors import UsageError
from kvcli.methods.base import Method, param
from kvcli.methods.registry import register
from kvcli.pod.attention import SharingPlan
from kvcli.pod.cache import PodCache
from kvcli.pod.groups import GroupsFile, resolve


@register
@dataclass
class PoD(Method):
    name = "pod"
    unbounded = True
    description = ("Keep every token; distant tokens share one set of keys per block of similar layers "
                   "(keys only in each block's lead layer, values everywhere). Ignores --cache.")
    groups: str = param("auto", "layer groups JSON (kvcli.analysis.calibrate); auto = the file shipped for the model")
    sinks: int = param(16, "n_s: initial tokens that are always proximal (full attention in every layer)")
    recent: int = param(1008, "n_r: latest tokens before each query, itself included, that are proximal")
    tau: float | None = param(None, "gate threshold (App. B.4): a query whose proximal share g >= tau skips "
                              "distant tokens in non-lead layers; default: never skip")

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise UsageError(f"pod: sinks must be >= 0, not {self.sinks}")
        if self.recent < 1:
            raise UsageError(f"pod: recent must be >= 1 (the window includes the query itself), not {self.recent}")
        if self.tau is not None and not 0.0 <= self.tau <= 1.0:
            raise UsageError(f"pod: tau must be between 0 and 1, not {self.tau}")
        if isinstance(self.groups, str) and self.groups not in ("", "auto"):
            GroupsFile.load(self.groups)  # a missing or malformed file fails before the model loads

    def settings(self) -> dict:
        out = super().settings()
        if isinstance(self.groups, GroupsFile):
            out["groups"] = self.groups.model
        return out

    def plan(self, config) -> SharingPlan:
        """The sharing plan for a model with this ``config``: its groups, checked against the model."""
        groups = resolve(self.groups, config)
        return SharingPlan(groups.leads(), self.sinks, self.recent, self.tau)

    def new_cache(self, model: torch.nn.Module) -> PodCache:
        return PodCache.for_model(model, self.plan(model.config))
