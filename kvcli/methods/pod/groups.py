"""PoD's layer groups: which consecutive layers share the keys of distant tokens, per KV head.

A groups file is the output of calibration (PoD section 2.1, Algorithm 1, appendix B.2) and the
input of the ``pod`` method. It is plain JSON so that it can be read, diffed and shipped:

* ``groups[h]`` is the list of blocks of KV head ``h``: consecutive, ascending layer lists that
  partition ``0 .. layers-1``. The first (lowest) layer of a block is its *lead*: the only layer
  of the block that keeps the keys of distant tokens for that head (section 2.2).
* ``model`` and the model's shape (``layers``, ``heads``, ``kv_heads``, ``head_dim``) say which
  model the groups belong to; a file for another shape is refused with one clear line.
* ``threshold``, ``q``, ``samples``, ``tokens_per_sample``, ``seed`` and ``source`` record how the
  groups were calibrated, ``similarity`` the per-query-head ``1 - JS`` matrices they came from
  (so :meth:`GroupsFile.regrouped` can try another threshold without re-running the model).
* ``theoretical_kv_saving`` is the share of KV bytes saved once nearly every token is distant:
  ``(L * H - sum_h blocks_h) / (2 * L * H)``: per distant token each KV head keeps values in all L
  layers but keys only in its ``blocks_h`` leads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from kvcli.errors import KvcliError, UnsupportedModelError, UsageError
from kvcli.io.lazy import torch
from kvcli.io.outputs import atomic_write
from kvcli.kv.architecture import head_shape, layer_windows

if TYPE_CHECKING:
    from kvcli.kv.quant import TokenCosts

FORMAT = "kvcli-pod-groups/1"
#: A model folder written by PoD's post-training holds its groups under this name (``auto`` finds them).
GROUPS_IN_MODEL_FOLDER = "pod_groups.json"
#: Folder of ``kvcli.methods.pod`` holding the groups shipped with kvcli (one JSON file per supported model).
SHIPPED = "shipped"


@dataclass
class ModelShape:
    """What a groups file must agree with: the attention layout of the model it was calibrated on."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, config) -> ModelShape:
        kv_heads, head_dim = head_shape(config)
        return cls(model_type=str(getattr(config, "model_type", "")), layers=int(config.num_hidden_layers),
                   heads=int(config.num_attention_heads), kv_heads=kv_heads, head_dim=head_dim,
                   hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size))

    def attention_layout(self) -> tuple[int, int, int, int]:
        """The fields the PoD plan depends on (layers, heads, KV heads, head size)."""
        return self.layers, self.heads, self.kv_heads, self.head_dim


@dataclass
class GroupsFile:
    """PoD's head-wise layer blocks for one model, with how they were obtained."""

    model: str
    shape: ModelShape
    groups: list[list[list[int]]]
    threshold: float = 0.5
    q: int = 16
    samples: int = 0
    tokens_per_sample: int = 0
    seed: int = 0
    source: str = ""
    similarity: list | None = None  # [heads][layers][layers], 1 - JS per query head (Eq. 2)
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_groups(self.groups, self.shape.layers, self.shape.kv_heads)

    # --- what the method needs ---------------------------------------------------------------------
    def leads(self) -> torch.Tensor:
        """``[kv_heads, layers]``: for each KV head and layer, the lead (lowest) layer of its block."""
        out = torch.empty(self.shape.kv_heads, self.shape.layers, dtype=torch.long)
        for head, blocks in enumerate(self.groups):
            for block in blocks:
                out[head, block] = block[0]
        return out

    def blocks_per_kv_head(self) -> list[int]:
        return [len(blocks) for blocks in self.groups]

    def theoretical_kv_saving(self) -> float:
        """Share of KV bytes saved when (nearly) every token is distant: keys only in each head's leads."""
        layers, kv_heads = self.shape.layers, self.shape.kv_heads
        return (layers * kv_heads - sum(self.blocks_per_kv_head())) / (2 * layers * kv_heads)

    def equal_bytes_budget(self, budget: int, sinks: int, recent: int, costs: TokenCosts | None = None) -> int:
        """Tokens per layer PoD with a selection may keep in the bytes of a plain cache of ``budget`` tokens.

        With a key costing ``k`` bytes, a value ``v`` and each token's bookkeeping ``e`` (:class:`TokenCosts`; all
        alike and no bookkeeping when None), a plain cache costs ``L·H·B·(k + v + e)``. PoD holds values and
        bookkeeping of ``B'`` tokens everywhere, keys of ``B'`` tokens in each head's leads (``S`` (layer, head)
        pairs) and the ``P = sinks + recent - 1`` proximal keys, at full precision ``f``, in the other ``L·H - S``:
        ``B' = (L·H·B·(k + v + e) - (L·H - S)·P·f) / (L·H·(v + e) + S·k)``, rounded down (never more bytes than the
        plain cache). ``B'`` is below ``B`` where the proximal keys at full precision cost more than sharing the
        distant ones saves (packed keys at 4 and 2 bits with PoD's 527 proximal tokens): PoD then holds fewer tokens.
        """
        from kvcli.kv.quant import TokenCosts

        costs = costs or TokenCosts(1, 1, 1, 0)
        pairs = self.shape.layers * self.shape.kv_heads
        leads = sum(self.blocks_per_kv_head())
        proximal = min(sinks + max(recent - 1, 0), budget)
        plain = pairs * budget * (costs.key + costs.value + costs.bookkeeping)
        per_token = pairs * (costs.value + costs.bookkeeping) + leads * costs.key
        return max((plain - (pairs - leads) * proximal * costs.full_key) // per_token, 0)

    def check_model(self, config, where: str = "groups") -> None:
        """Raise :class:`UsageError` unless the model has the layers and heads these groups were made for."""
        shape = ModelShape.of(config)
        if shape.attention_layout() != self.shape.attention_layout():
            raise UsageError(
                f"{where} are for {self.model} ({self.shape.layers} layers, {self.shape.heads} heads, "
                f"{self.shape.kv_heads} KV heads, head size {self.shape.head_dim}); this model has {shape.layers} "
                f"layers, {shape.heads} heads, {shape.kv_heads} KV heads, head size {shape.head_dim}: "
                "calibrate groups for it (kvcli.eval.analysis.calibrate)")

    @classmethod
    def separate(cls, config, model: str = "model") -> GroupsFile:
        """Every layer its own block: no sharing, PoD computes exactly full attention (a reference)."""
        shape = ModelShape.of(config)
        groups = [[[layer] for layer in range(shape.layers)] for _ in range(shape.kv_heads)]
        return cls(model, shape, groups, threshold=1.0, q=0, notes={"kind": "separate"})

    def regrouped(self, threshold: float) -> GroupsFile:
        """The same calibration grouped at another threshold, from the stored similarity (no model needed)."""
        if self.similarity is None:
            raise UsageError(f"the groups of {self.model} store no similarity matrices: calibrate again to regroup "
                             "them at another threshold")
        check_threshold(threshold)
        blocks = groups_from_similarity(torch.tensor(self.similarity), self.shape.kv_heads, threshold)
        return dataclasses.replace(self, groups=blocks, threshold=threshold)

    # --- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"format": FORMAT, "model": self.model, **asdict(self.shape), "threshold": self.threshold,
               "q": self.q, "samples": self.samples, "tokens_per_sample": self.tokens_per_sample,
               "seed": self.seed, "source": self.source, "blocks_per_kv_head": self.blocks_per_kv_head(),
               "theoretical_kv_saving": round(self.theoretical_kv_saving(), 4), "groups": self.groups}
        if self.notes:
            out["notes"] = self.notes
        if self.similarity is not None:
            out["similarity"] = self.similarity
        return out

    def save(self, path: str | Path) -> Path:
        """Write the file whole or not at all (a full disk or a kill never leaves half a groups file)."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvcliError(f"cannot create {path.parent}: {exc.strerror or exc}") from None
        atomic_write(path, (json.dumps(self.to_dict(), indent=1) + "\n").encode("utf-8"))
        return path

    @classmethod
    def from_dict(cls, data: dict, where: str = "groups") -> GroupsFile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UsageError(f"{where} is not a PoD groups file (expected \"format\": \"{FORMAT}\")")
        try:
            shape = ModelShape(**{name: data[name] for name in ModelShape.__dataclass_fields__})
            return cls(model=str(data["model"]), shape=shape, groups=data["groups"],
                       threshold=float(data.get("threshold", 0.5)), q=int(data.get("q", 0)),
                       samples=int(data.get("samples", 0)), tokens_per_sample=int(data.get("tokens_per_sample", 0)),
                       seed=int(data.get("seed", 0)), source=str(data.get("source", "")),
                       similarity=data.get("similarity"), notes=dict(data.get("notes", {})))
        except KeyError as exc:
            raise UsageError(f"{where} lacks the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{where} is malformed: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> GroupsFile:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"PoD groups file not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read PoD groups file {path}: {exc}") from None
        return cls.from_dict(data, where=str(path))


def greedy_layer_groups(similar: torch.Tensor) -> list[list[int]]:
    """PoD's Algorithm 1 for one head: merge consecutive layers bottom-up while each is similar to all of the block.

    ``similar`` is a boolean ``[layers, layers]`` relation (``sim_h >= 0.5`` in the paper). Layer l
    joins the current (last) block when it is similar to every layer already in it; otherwise it
    starts a new block. Layers are numbered from 0 here (the paper counts from 1).
    """
    blocks = [[0]]
    for layer in range(1, similar.shape[0]):
        current = blocks[-1]
        if all(bool(similar[layer, other]) for other in current):
            current.append(layer)
        else:
            blocks.append([layer])
    return blocks


def group_vote(sim: torch.Tensor, kv_heads: int, threshold: float = 0.5) -> torch.Tensor:
    """PoD's GQA rule (appendix B.2): two layers are similar for a KV head when most of its query heads say so.

    ``sim`` is ``[q_heads, layers, layers]``; returns a boolean ``[kv_heads, layers, layers]``. A
    strict majority is needed, so a tie (possible with an even group) counts as not similar.
    """
    q_heads, layers = sim.shape[0], sim.shape[1]
    votes = (sim >= threshold).view(kv_heads, q_heads // kv_heads, layers, layers).sum(dim=1)
    return votes * 2 > q_heads // kv_heads


def groups_from_similarity(sim: torch.Tensor, kv_heads: int, threshold: float) -> list[list[list[int]]]:
    """Majority vote per KV head (appendix B.2), then Algorithm 1's greedy grouping for each KV head."""
    return [greedy_layer_groups(vote) for vote in group_vote(sim, kv_heads, threshold)]


def check_threshold(threshold: float) -> None:
    if not 0.0 <= threshold <= 1.0:
        raise UsageError(f"the similarity threshold must be between 0 and 1, not {threshold}")


def check_groups(groups, layers: int, kv_heads: int) -> None:
    """Raise :class:`UsageError` unless ``groups`` gives, per KV head, consecutive blocks covering every layer once."""
    if not isinstance(groups, list) or len(groups) != kv_heads:
        count = len(groups) if isinstance(groups, list) else "no list of"
        raise UsageError(f"groups must list the blocks of each of the {kv_heads} KV heads (found {count})")
    for head, blocks in enumerate(groups):
        flat = [layer for block in blocks for layer in (block if isinstance(block, list) else [None])]
        # The length first: a file's "layers" may be absurd (10**13), and the list of them is never built then.
        if not blocks or any(not block for block in blocks) or len(flat) != layers or flat != list(range(layers)):
            raise UsageError(f"groups of KV head {head} must be consecutive layer blocks covering 0..{layers - 1} "
                             "in order")


def shipped_groups() -> list[GroupsFile]:
    """The groups files that come with kvcli."""
    folder = resources.files("kvcli.methods.pod") / SHIPPED
    out = []
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if entry.name.endswith(".json"):
            out.append(GroupsFile.from_dict(json.loads(entry.read_text()), where=f"shipped {entry.name}"))
    return out


def shipped_for(config) -> GroupsFile:
    """The shipped groups calibrated on a model of this shape (same architecture, sizes and vocabulary)."""
    shape = ModelShape.of(config)
    for groups in shipped_groups():
        if groups.shape == shape:
            return groups
    raise UsageError(f"kvcli ships no PoD groups for this model ({shape.model_type}, {shape.layers} layers, "
                     f"{shape.heads} heads, {shape.kv_heads} KV heads): calibrate some with `kvcli calibrate "
                     "TEXT --model MODEL --out FILE` and pass -o groups=FILE")


def check_supported(config) -> None:
    """Refuse a model with sliding-window layers, before any groups are looked for, calibrated or trained: sharing
    keys across layers assumes every layer holds the same slots, and a window layer holds only its window."""
    if any(window is not None for window in layer_windows(config)):
        model_type = getattr(config, "model_type", "?")
        raise UnsupportedModelError(f"pod does not support model type {model_type!r}: it has sliding-window layers")


def resolve(spec: str | GroupsFile, config) -> GroupsFile:
    """The groups the ``pod`` method runs with, checked against the model: a file, or ``auto``: the
    ``pod_groups.json`` of a model folder written by post-training, else the shipped groups for its shape."""
    check_supported(config)
    if isinstance(spec, GroupsFile):
        groups = spec
    elif spec in ("", "auto"):
        beside = Path(str(getattr(config, "_name_or_path", "") or "")) / GROUPS_IN_MODEL_FOLDER
        groups = GroupsFile.load(beside) if beside.is_file() else shipped_for(config)
    else:
        groups = GroupsFile.load(spec)
    groups.check_model(config, where=groups.model if isinstance(spec, GroupsFile) or spec == "auto" else str(spec))
    return groups
