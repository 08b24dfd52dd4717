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
from typing import TYPE_CHECKING, ClassVar

from kvcli.errors import BudgetError, UsageError
from kvcli.lazy import F, torch

if TYPE_CHECKING:
    from kvcli.cache import KVCache, LayerView


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
    #: The method compresses what is read, not what is written: every generated token is kept, so the
    #: cache grows by at most ``--max-new-tokens`` while answering (SnapKV, PyramidKV: their papers).
    keeps_answer: ClassVar[bool] = False

    def new_cache(self, model: torch.nn.Module) -> KVCache:
        """The cache this method streams into: kvcli's ordinary one unless the method stores keys its own way."""
        from kvcli.cache import KVCache

        return KVCache.for_model(model)

    def score_window(self, block_len: int) -> int:
        """How many of a forward's last queries must record their attention (0: none needed)."""
        return 0

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        """Tokens each layer may keep, averaging ``budget``; uniform unless the method allocates across layers."""
        return [budget] * num_layers

    def equal_bytes_budget(self, budget: int, config) -> int:
        """Tokens per layer this method may keep in the bytes of a plain cache of ``budget`` tokens per layer.

        The same number for every method that stores a key and a value per kept token; a method that
        stores fewer keys (PoD with a selection) keeps more tokens in the same bytes. This is what
        makes ``--cache-bytes`` compare methods at equal memory.
        """
        return budget

    def validate(self, budget: int) -> None:
        """Raise :class:`BudgetError` when ``budget`` cannot hold what the method always keeps, and
        :class:`UsageError` for parameters out of range."""

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """Indices ``[H_kv, k]`` (ascending) of the tokens to keep, or None to keep all."""
        return None

    def nests(self) -> bool:
        """Whether a read that needs only its last position may compress each layer as soon as it has
        run and give the next layer only the tokens it passes on (PyramidInfer's nested selection).
        Hidden states are per token, so where KV heads choose apart the next layer gets the union of
        what they pass. See :meth:`kvcli.engine.Engine.forward`."""
        return False

    def compress_nested(self, view: LayerView, budget: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """In a nested forward: the tokens the layer stores (as :meth:`compress`) and the tokens whose hidden
        states go on to the next layer (indices ``[H_kv, k]`` into the layer before it stores; None: all).
        By default the next layer gets what this one stores."""
        keep = self.compress(view, budget)
        return keep, keep

    def settings(self) -> dict:
        """This instance's parameter values by name: what results record so a run can be reproduced."""
        return dataclasses.asdict(self)

    @classmethod
    def has_param(cls, name: str) -> bool:
        """Whether ``-o name=...`` (dashes or underscores) sets a parameter of this method."""
        return name.replace("-", "_") in {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def params(cls) -> list[dict]:
        """Name, default, type and help of every parameter, for ``kvcli methods --json``."""
        out = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append({"name": f.name, "default": default, "type": _type_name(f.type),
                        "help": f.metadata.get("help", "")})
        return out


@dataclass
class ScoredMethod(Method):
    """A method that keeps the sinks, the recent window and the best-scoring other tokens (kvpress's
    scorer presses): a subclass is its scoring rule, :meth:`score`, and nothing else.

    :meth:`observe` runs after every forward, over budget or not, for methods whose scores
    accumulate across blocks (H2O, PyramidInfer); :meth:`score` runs only when the layer must shrink.
    The sinks and the recent window are always kept; ties go to the earlier token (:func:`select_top`).
    Subclasses declare ``sinks: int`` and ``recent: int | None`` as parameters (their defaults differ
    by paper), which this class reads.
    """

    def validate(self, budget: int) -> None:
        check_split(budget, self.sinks, self.recent)

    def kept_recent(self, view: LayerView, budget: int) -> int:
        """The recent window, protected like the sinks."""
        return Split.of(budget, self.sinks, self.recent).recent

    def kept_count(self, view: LayerView, budget: int) -> int:
        """How many tokens the layer keeps once it is over it: the budget, unless the method keeps fewer."""
        return budget

    def observe(self, view: LayerView) -> None:
        """Fold this forward's attention into the layer's per-token state (nothing by default)."""

    def score(self, view: LayerView) -> torch.Tensor:
        """Scores ``[H_kv, T]`` (or ``[1, T]`` for one choice per layer) of every cached token."""
        raise NotImplementedError

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        self.observe(view)
        length = view.length
        count = self.kept_count(view, budget)
        if length <= count:
            return None
        scores = self.score(view)
        return select_top(scores, self.protected(view, budget, count), count).expand(view.num_heads, count)

    def protected(self, view: LayerView, budget: int, count: int) -> torch.Tensor:
        """Boolean ``[T]``: the sinks, the recent window and the reader's question, kept whatever they score.

        Beyond the papers: the question (:attr:`LayerView.question`) is what the answer is written from,
        so it stays where the method's window is shorter (PyramidKV's 8), up to half of what the layer
        keeps beside its sinks, so that a small top layer still has room for what the question asks
        about (measured in docs/methods.md).
        """
        question = min(view.question, max(count - self.sinks, 0) // 2)
        recent = max(self.kept_recent(view, budget), question)
        return recent_and_sinks(view.length, self.sinks, recent, view.layer.device)


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


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth ``[H, P]`` scores along the sequence: stride-1, same-length pooling of odd width ``kernel``.

    Max pooling ignores the padding; average pooling divides by ``kernel`` at the edges too
    (zero padding counted, as ``F.avg_pool1d`` does by default and SnapKV's code uses it).
    """
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    x = scores[:, None, :]
    if pooling == "max":
        out = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return out[:, 0, :]


def check_budget(budget: int, always_kept: int, what: str) -> None:
    if budget < always_kept:
        raise BudgetError(budget, always_kept, what)


#: Help of the ``recent`` parameter of the methods that follow :class:`Split` by default.
AUTO_RECENT_HELP = "most recent tokens always kept (auto: cache - sinks - cache // 2; 4 + 508 + 512 at 1024)"


@dataclass
class Split:
    """The budget split the papers compare methods under: sinks + recent window + selected tokens.

    TreeKV's experiments (section 5.1) keep, of a 1k cache, "4 initial tokens, 508 recent tokens,
    and 512 method-selected tokens" for TreeKV, H2O and TOVA alike: the selected part is half the
    cache and the recent window is what the sinks leave of the other half. ``recent=None`` applies
    that rule at any budget (256 = 4 + 124 + 128); H2O's own paper splits heavy hitters and recent
    tokens 50/50, which the same rule matches.
    """

    sinks: int
    recent: int
    selected: int

    @classmethod
    def of(cls, budget: int, sinks: int, recent: int | None) -> Split:
        if recent is None:
            # Half the cache is selected; when the sinks eat into that half, the window gives way first.
            recent = max(budget - sinks - budget // 2, 0)
        return cls(sinks, recent, budget - sinks - recent)


def check_split(budget: int, sinks: int, recent: int | None) -> None:
    """Raise :class:`UsageError` for negative sizes or a budget smaller than sinks + recent."""
    if sinks < 0 or (recent is not None and recent < 0):
        raise UsageError("sinks and recent must be >= 0")
    if recent is None:
        check_budget(budget, sinks, "the sinks")
    else:
        check_budget(budget, sinks + recent, "sinks + recent")
