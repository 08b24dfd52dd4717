"""PoD (Ma et al., "Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention Similarity").

PoD keeps every token. Proximal tokens (the first ``sinks`` and the last ``recent`` before each
query, sliding with it) get full attention in every layer; distant tokens are scored once per
block of similar layers, with the lead (lowest) layer's queries and keys, and weigh each layer's own
values (Eq. 3-4). So a distant token's key is stored only in the lead layer of each KV head's block,
and its values in every layer: the memory saving. The blocks come from a groups file
(:mod:`kvcli.eval.analysis.calibrate`); kvcli ships one for its default model. See :mod:`kvcli.methods.pod` and the PoD
section of docs/methods.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.errors import BudgetError, UsageError
from kvcli.io.lazy import torch
from kvcli.methods.base import Method, param
from kvcli.methods.pod.attention import SharingPlan
from kvcli.methods.pod.groups import GroupsFile, resolve
from kvcli.methods.registry import METHODS, register

if TYPE_CHECKING:
    from kvcli.kv.cache import LayerView
    from kvcli.kv.quant import TokenCosts
    from kvcli.methods.pod.cache import PodCache

#: Selection methods PoD can run on the distant region: they choose per KV head with a uniform budget.
SELECTORS = ("streamingllm", "snapkv", "treekv", "h2o", "tova")
#: n_r when the user sets none: alone PoD keeps every token, so a long window only costs bytes; with a
#: selection the window must fit in --cache beside the selected tokens.
RECENT_ALONE, RECENT_SELECTED = 3072, 512
#: With a selection, sharing must cost less perplexity than the extra tokens it buys: only layers
#: this similar share by default (docs/methods.md, "PoD + a token selection").
SELECT_THRESHOLD = 0.8
CHOSEN = "pod_chosen"  # in each layer's method state: the selection's choice for that layer this block


@register
@dataclass
class PoD(Method):
    name = "pod"
    unbounded = True
    description = ("Keep every token; distant tokens share one set of keys per block of similar layers "
                   "(keys only in each block's lead layer, values everywhere). Ignores --cache unless `select` is set.")
    groups: str = param("auto", "layer groups JSON (kvcli.eval.analysis.calibrate); auto = the model folder's "
                        "pod_groups.json (a kvcli adapt output), else the file shipped for the model")
    sinks: int = param(16, "n_s: initial tokens that are always proximal (full attention in every layer)")
    recent: int | None = param(None, "n_r: latest tokens before each query, itself included, that are proximal; "
                               f"default {RECENT_ALONE:,} alone (training-free perplexity within 1.10x of full on "
                               "this model; the paper's proportion is 1/8 of the context), "
                               f"{RECENT_SELECTED} with `select` (half the default --cache of 1,024)")
    threshold: float | None = param(None, "similarity threshold to regroup the groups file's stored calibration at "
                                    "(lower: more layers share, more bytes saved, higher perplexity; the paper's "
                                    f"0.5); default: the file's own, {SELECT_THRESHOLD} with `select`")
    tau: float | None = param(None, "gate threshold (App. B.4): a query whose proximal share g >= tau skips "
                              "distant tokens in non-lead layers; default: never skip")
    select: str = param("none", "token selection at the --cache budget (beyond the paper): none keeps every token, "
                        "or a method (streamingllm, snapkv, treekv, h2o, tova) chooses per block of layers")

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise UsageError(f"pod: sinks must be >= 0, not {self.sinks}")
        if self.recent is None:
            self.recent = RECENT_ALONE if self.select == "none" else RECENT_SELECTED
        if self.recent < 1:
            raise UsageError(f"pod: recent must be >= 1 (the window includes the query itself), not {self.recent}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise UsageError(f"pod: threshold must be between 0 and 1, not {self.threshold}")
        if self.tau is not None and not 0.0 <= self.tau <= 1.0:
            raise UsageError(f"pod: tau must be between 0 and 1, not {self.tau}")
        if isinstance(self.groups, str) and self.groups not in ("", "auto"):
            GroupsFile.load(self.groups)  # a missing or malformed file fails before the model loads
        self.inner: Method | None = None
        if self.select != "none":
            if self.select not in SELECTORS:
                raise UsageError(f"pod: select must be none or one of {', '.join(SELECTORS)}, not {self.select!r}")
            from kvcli.methods.registry import make_method

            options: dict[str, object] = {"sinks": self.sinks}
            if METHODS[self.select].has_param("recent"):
                options["recent"] = self.recent - 1  # the proximal keys the next query needs stay in every layer
            self.inner = make_method(self.select, options)
        # Without a selection PoD keeps every token and takes no budget (like full); with one it writes as
        # the selection does (SnapKV keeps its answer).
        self.unbounded = self.inner is None
        self.keeps_answer = self.inner is not None and self.inner.keeps_answer
        self.token_states = self.inner.token_states if self.inner is not None else 0

    def validate(self, budget: int) -> None:
        if self.inner is not None:
            if budget < self.sinks + self.recent:
                need = self.sinks + self.recent
                raise BudgetError(budget, need, "pod's sinks + recent - 1 proximal tokens + 1 selected")
            self.inner.validate(budget)

    def equal_bytes_budget(self, budget: int, config, costs: TokenCosts | None = None) -> int:
        """With a selection, distant tokens cost only values outside the leads, proximal ones a key at full precision
        in every layer: more tokens in the same bytes at 16 bits, fewer where keys are packed small."""
        if self.inner is None:
            return budget
        return self.layer_groups(config).equal_bytes_budget(budget, self.sinks, self.recent, costs)

    def probes(self) -> bool:
        return False  # PodStore appends every block it sees: a probe's queries would be stored (no rollback yet)

    def score_window(self, block_len: int) -> int:
        return self.inner.score_window(block_len) if self.inner is not None else 0

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """The selection method's choice, made per KV head by the lead layer of its block.

        Distant keys live only in the lead, so every layer of a block must keep the tokens its lead
        keeps: the lead's choice (from the lead's own scores) is applied to the whole block. The
        selection still runs in every layer, so scores it accumulates per layer stay up to date.
        """
        if self.inner is None:
            return None
        # Each layer's own choice waits in its method state (per stream, never on the method): a
        # lead is the lowest layer of its block, so it has chosen before any layer that follows it.
        view.method_state[CHOSEN] = self.inner.compress(view, budget)
        owner = view.layer.owner
        leads = owner.plan.leads[:, view.layer_idx].tolist()
        rows = [owner.layers[lead].method_state[CHOSEN] for lead in leads]
        for lead in {*leads, view.layer_idx}:  # a choice no higher layer reads is not kept between blocks
            if owner.plan.last_reader(lead) <= view.layer_idx:
                owner.layers[lead].method_state.pop(CHOSEN, None)
        if all(row is None for row in rows):
            return None
        if any(row is None for row in rows):
            raise RuntimeError("pod: layers of one block disagree on whether to compress")
        return torch.stack([row[h] for h, row in enumerate(rows)])

    def settings(self) -> dict:
        out = super().settings()
        if isinstance(self.groups, GroupsFile):
            out["groups"] = self.groups.model
        out["threshold"] = self.regroup_threshold()  # what a run records must reproduce it with -o
        return out

    def regroup_threshold(self) -> float | None:
        """The threshold the groups are regrouped at: ``threshold`` if set, else :data:`SELECT_THRESHOLD`
        with a selection, else None (the groups file's own)."""
        if self.threshold is not None:
            return self.threshold
        return SELECT_THRESHOLD if self.inner is not None else None

    def layer_groups(self, config) -> GroupsFile:
        """The groups for a model with this ``config``, checked against it, regrouped at :meth:`regroup_threshold`.

        Only an explicit ``threshold`` needs the file's stored similarity; a file without it keeps its
        own groups under the selection's default.
        """
        groups = resolve(self.groups, config)
        threshold = self.regroup_threshold()
        if threshold is None or (self.threshold is None and groups.similarity is None):
            return groups
        return groups.regrouped(threshold)

    def plan(self, config) -> SharingPlan:
        """The sharing plan for a model with this ``config``."""
        return SharingPlan(self.layer_groups(config).leads(), self.sinks, self.recent, self.tau)

    def new_cache(self, model: torch.nn.Module) -> PodCache:
        from kvcli.methods.pod.cache import PodCache

        return PodCache.for_model(model, self.plan(model.config))
