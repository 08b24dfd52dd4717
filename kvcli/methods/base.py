"""The small interface every compression method implements, and the helpers they share.

A method is a dataclass whose fields are its parameters (set with ``-o KEY=VALUE``). After each
forward pass the engine shows it one layer at a time (:class:`kvcli.kv.cache.LayerView`) and the
method answers with the token indices to keep per KV head, or ``None`` to keep everything.
The same call serves block streaming (many new tokens), one-shot prefill (one big block) and
decoding (one new token), so a method never needs three code paths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar, Protocol

from kvcli.errors import BudgetError, UsageError
from kvcli.io.lazy import F, torch
from kvcli.methods.batching import ScoredBatches, layer_answers, place, uneven_layer_answers

if TYPE_CHECKING:
    from kvcli.kv.cache import KVCache, LayerView
    from kvcli.kv.quant import TokenCosts


class StepEviction(Protocol):
    """A method's eviction while writing, one token per step and KV head from full layers, in fixed shapes on the
    device (:meth:`Method.step_eviction`), so that :mod:`kvcli.kv.decode` can capture the step as a CUDA graph."""

    #: The per-token state (:attr:`kvcli.kv.cache.CompressedLayer.state`) a step reads and updates.
    names: tuple[str, ...]

    def victim(self, probs: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The cache index ``[R, 1]`` each row (a KV head of a layer, layer after layer) evicts, after the step's
        query paid ``probs`` ``[L, H_kv, group, T]`` (fp32, as a record holds them) to the ``T = budget + 1``
        tokens of each layer; ``state`` (each name ``[R, T]``, the step's token's entry 0) is updated in
        place."""

    def written(self) -> list[torch.Tensor]:
        """The device tensors of its own a step changes (undone after a rehearsal)."""

    def save(self, method_states: list[dict[str, object]]) -> None:
        """Leave in each layer's ``method_state`` what the engine's next compression reads."""


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
    #: While writing, each generated token evicts the oldest token after the first ``sinks`` (the method has
    #: a ``sinks`` parameter): a window that :mod:`kvcli.kv.decode` writes in a ring buffer (StreamingLLM).
    evicts_oldest_while_writing: ClassVar[bool] = False
    #: How many per-token values (float32, per layer and KV head) the method keeps beside each cached token: an
    #: accumulated score (H2O, PyramidInfer). ``--cache-bytes`` pays for them (kvcli.kv.quant.bookkeeping_bytes).
    token_states: ClassVar[int] = 0

    def new_cache(self, model: torch.nn.Module) -> KVCache:
        """The cache this method streams into: kvcli's ordinary one unless the method stores keys its own way."""
        from kvcli.kv.cache import KVCache

        return KVCache.for_model(model)

    def score_window(self, block_len: int) -> int:
        """How many of a forward's last queries must record their attention (0: none needed)."""
        return 0

    def step_eviction(self, budget: int, method_states: list[dict[str, object]], heads: int,
                      device: torch.device) -> StepEviction | None:
        """How a generated token's step evicts one token per KV head from layers full at ``budget`` (``heads``
        KV heads each; ``method_states`` theirs), as a program of fixed shapes on ``device``
        (:class:`kvcli.kv.decode.EvictingCache`), or None when only the engine's step can."""
        return None

    def selects_per_head(self) -> bool:
        """Whether the KV heads of a layer may keep different tokens (then a streamed cache gives a token one
        position in all of them: :attr:`kvcli.kv.cache.KVCache.heads_apart`)."""
        return False

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        """Tokens each layer may keep, averaging ``budget``; uniform unless the method allocates across layers."""
        return [budget] * num_layers

    def equal_bytes_budget(self, budget: int, config, costs: TokenCosts | None = None) -> int:
        """Tokens per layer this method may keep in the bytes of a plain cache of ``budget`` tokens per layer.

        The same number for every method that stores a key and a value per kept token; a method that
        stores fewer keys (PoD with a selection) keeps more tokens in the same bytes. This is what
        makes ``--cache-bytes`` compare methods at equal memory. ``costs``: what a token's parts cost
        (:class:`kvcli.kv.quant.TokenCosts`; None: a key, a value and nothing else, all alike).
        """
        return budget

    def validate(self, budget: int) -> None:
        """Raise :class:`BudgetError` when ``budget`` cannot hold what the method always keeps, and
        :class:`UsageError` for parameters out of range."""

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """Indices ``[H_kv, k]`` (ascending) of the tokens to keep, or None to keep all."""
        return None

    def compress_layers(self, views: list[LayerView], budgets: list[int]) -> list[torch.Tensor | None]:
        """:meth:`compress` for every budgeted layer of a forward, in order (what the engine calls).

        A method may answer for several layers at once (their heads as rows of one batch: fewer
        operations per block) as long as each layer's answer is the one :meth:`compress` gives it.
        """
        return [self.compress(view, budget) for view, budget in zip(views, budgets, strict=True)]

    def probes(self) -> bool:
        """Whether its cache can take a question's probe (:meth:`kvcli.engine.engine.Engine.forward`'s ``probe``:
        queries that attend and record without being stored). A reader that would probe reads without one where it
        cannot, and so without a recap."""
        return True

    def nests(self) -> bool:
        """Whether a read that needs only its last position may compress each layer as soon as it has
        run and give the next layer only the tokens it passes on (PyramidInfer's nested selection).
        Hidden states are per token, so where KV heads choose apart the next layer gets the union of
        what they pass. See :meth:`kvcli.engine.engine.Engine.forward`."""
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
    by paper), which this class reads. Beyond the papers, the reader's question is kept too
    (:func:`question_tail`); layers that stand alike are compressed as one batch (:mod:`kvcli.methods.batching`).
    """

    #: The per-token state :meth:`step_scores` reads and updates.
    state_names: ClassVar[tuple[str, ...]] = ()

    def validate(self, budget: int) -> None:
        check_split(budget, self.sinks, self.recent)

    def selects_per_head(self) -> bool:
        return True

    def step_scores(self, probs: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """While writing, in fixed shapes: the scores ``[L * H_kv, T]`` (or ``[L, T]``) of full layers' tokens
        after a generated token's query paid ``probs`` ``[L, H_kv, group, T]``, ``state`` (:attr:`state_names`,
        rows ``[L * H_kv, T]``) updated in place: what :meth:`observe_layers` then :meth:`score_layers` give
        in the engine's step. A subclass that writes it gets a static decode step (:class:`LowestStep`)."""
        raise NotImplementedError

    def step_eviction(self, budget: int, method_states: list[dict[str, object]], heads: int,
                      device: torch.device) -> StepEviction | None:
        own = type(self)
        if (own.step_scores is ScoredMethod.step_scores or own.kept_count is not ScoredMethod.kept_count
                or own.kept_recent is not ScoredMethod.kept_recent):
            return None  # no fixed-shape scores, or a layer that keeps other than its budget and window
        split = Split.of(budget, self.sinks, self.recent)
        return LowestStep(self, split.sinks, split.recent)

    def kept_recent(self, view: LayerView, budget: int) -> int:
        """The recent window, protected like the sinks."""
        return Split.of(budget, self.sinks, self.recent).recent

    def kept_count(self, view: LayerView, budget: int) -> int:
        """How many tokens the layer keeps once it is over it: the budget, unless the method keeps fewer."""
        return budget

    def observe(self, view: LayerView) -> None:
        """Fold this forward's attention into the layer's per-token state (nothing by default)."""
        self.observe_layers([view])

    def observe_layers(self, views: list[LayerView]) -> None:
        """:meth:`observe` for layers that stand alike (see :meth:`compress_layers`), at once where it can."""
        if type(self).observe is not ScoredMethod.observe:
            for view in views:
                self.observe(view)

    def score(self, view: LayerView) -> torch.Tensor:
        """Scores ``[H_kv, T]`` (or ``[1, T]`` for one choice per layer) of every cached token."""
        return self.score_layers([view])

    def score_layers(self, views: list[LayerView]) -> torch.Tensor:
        """:meth:`score` of layers that stand alike, their rows one after the other (``[L * H_kv, T]``
        or ``[L, T]``). A subclass writes this or :meth:`score`."""
        if type(self).score is ScoredMethod.score:
            raise NotImplementedError
        return layer_rows([self.score(view) for view in views])

    def compress(self, view: LayerView, budget: int) -> torch.Tensor | None:
        return self._compress_alike([view], budget, self.kept_count(view, budget))[0]

    def compress_layers(self, views: list[LayerView], budgets: list[int]) -> list[torch.Tensor | None]:
        """Layers that stand alike are observed, scored and selected as one batch, their heads as rows; lone
        layers that differ in length or count only, as one padded batch (:class:`ScoredBatches`). Each row is
        what :meth:`compress` computes for its layer alone."""
        counts = [self.kept_count(view, budget) for view, budget in zip(views, budgets, strict=True)]
        spans = [self._protected_span(view, budget, count)
                 for view, budget, count in zip(views, budgets, counts, strict=True)]
        batches = ScoredBatches.of(views, counts, spans)
        kept: list[torch.Tensor | None] = [None] * len(views)
        for members in batches.alike:
            place(kept, members, self._compress_alike([views[i] for i in members], budgets[members[0]],
                                                      counts[members[0]]))
        for members in batches.uneven:
            place(kept, members, self._compress_uneven([views[i] for i in members], [budgets[i] for i in members],
                                                       [counts[i] for i in members]))
        return kept

    def _compress_uneven(self, views: list[LayerView], budgets: list[int], counts: list[int]) -> list[torch.Tensor]:
        """:meth:`compress` of layers over their counts that differ in length or count (PyramidKV's budgets):
        scored into rows padded to the longest (:meth:`padded_scores`) and selected with one sort; each
        layer's answer is the one :meth:`compress` gives it."""
        if len(views) == 1:
            return self._compress_alike(views, budgets[0], counts[0])
        width = max(view.length for view in views)
        spans = tuple(self._protected_span(view, budget, count)
                      for view, budget, count in zip(views, budgets, counts, strict=True))
        scores = self.padded_scores(views, width)
        chosen = select_top_uneven(scores, spans, tuple(counts), scores.shape[0] // len(views), views[0].layer.device)
        return uneven_layer_answers(chosen, counts, views[0].num_heads)

    def padded_scores(self, views: list[LayerView], width: int) -> torch.Tensor:
        """Layers of different lengths observed (:meth:`observe`) and scored (:meth:`score_layers`) as rows
        ``[L * rows, width]``, each layer's padded with -inf (never chosen) past its length. By default
        layer by layer; a subclass may do it at once."""
        for view in views:
            self.observe_layers([view])
        return layer_rows([pad_tokens(self.score_layers([view]), width, float("-inf")) for view in views])

    def _compress_alike(self, views: list[LayerView], budget: int, count: int) -> list[torch.Tensor | None]:
        """:meth:`compress` of layers that stand alike, keeping ``count`` tokens each."""
        self.observe_layers(views)
        first = views[0]
        if first.length <= count:
            return [None] * len(views)
        protected = recent_and_sinks(*self._protected_span(first, budget, count), first.layer.device)
        return layer_answers(select_top(self.score_layers(views), protected, count), len(views), first.num_heads,
                             count)

    def protected(self, view: LayerView, budget: int, count: int) -> torch.Tensor:
        """Boolean ``[T]``: the sinks, the recent window and the reader's question (:func:`question_tail`), kept
        whatever they score."""
        return recent_and_sinks(*self._protected_span(view, budget, count), view.layer.device)

    def _protected_span(self, view: LayerView, budget: int, count: int) -> tuple[int, int, int]:
        """``(length, sinks, recent)`` of :meth:`protected`: the question's tail where it is longer than the window."""
        tail = question_tail(view, budget, count, self.sinks)
        return view.length, self.sinks, max(self.kept_recent(view, budget), tail)


def question_tail(view: LayerView, budget: int, count: int, sinks: int) -> int:
    """How many of a layer's last tokens a scored method keeps for the reader's question, whatever they score,
    when the layer keeps ``count`` tokens of which ``sinks`` sinks (0 when nothing is read for a question).

    Beyond the papers: the question (:attr:`LayerView.question`) is what the answer is written from,
    so it stays where the method's window is shorter (PyramidKV's 8), up to half of what the layer
    keeps beside its sinks, so that a small top layer still has room for what the question asks
    about (measured in docs/methods.md). After a recap the whole last block (:attr:`LayerView.held`)
    stays with it, up to three quarters: the recap was read so that every layer and head holds what the
    question pointed at, and scored by the question's queries a top layer would drop part of it again
    (a key's last digit: docs/reading.md). A layer below the mean budget (PyramidKV's top layers) holds
    less, its room less a quarter of the mean room, so that it keeps as many scored tokens of the rest of
    the book as an average layer would; a layer at the mean holds its three quarters.
    """
    room = max(count - sinks, 0)
    mean_room = max((view.mean_budget or budget) - sinks, 0)
    held_room = min(room * 3 // 4, room - mean_room // 4)
    return max(min(view.question, room // 2), min(view.held, held_room))


@dataclass
class LowestStep:
    """A scored method's eviction while writing (:meth:`ScoredMethod.step_scores`), for
    :class:`kvcli.kv.decode.EvictingCache`: of a full layer's tokens outside the sinks and the recent window,
    the lowest-scored goes, the latest of equal ones (:func:`select_top` keeps the earlier)."""

    method: ScoredMethod
    sinks: int
    recent: int

    @property
    def names(self) -> tuple[str, ...]:
        return self.method.state_names

    def victim(self, probs: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        scores = self.method.step_scores(probs, state)
        length = scores.shape[-1]
        ranked = rank_scores(scores, recent_and_sinks(length, self.sinks, self.recent, scores.device))
        gone = length - 1 - ranked.flip(-1).argmin(dim=-1, keepdim=True)  # argmin gives the first of equal ones
        rows = probs.shape[0] * probs.shape[1]
        return gone if gone.shape[0] == rows else gone.repeat_interleave(rows // gone.shape[0], dim=0)

    def written(self) -> list[torch.Tensor]:
        return []

    def save(self, method_states: list[dict[str, object]]) -> None:
        """Nothing: the scores live in the per-token state."""


def layer_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer tensors ``[H, ...]`` of equal shapes as one ``[L * H, ...]``, layer by layer."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def per_token_rows(views: list[LayerView], name: str) -> torch.Tensor:
    """The layers' per-token state ``name`` as rows ``[L * H, T]``, zeros for the tokens that just arrived:
    :meth:`LayerView.per_token` of each layer (which stores the padded state), in one piece."""
    if len(views) == 1:
        return views[0].per_token(name)
    first = views[0]
    states = [view.layer.state.get(name) for view in views]
    rows = len(views) * first.num_heads
    if states[0] is None:
        joined = torch.zeros((rows, first.length), dtype=torch.float32, device=first.layer.device)
    else:
        joined = torch.cat(states)
        missing = first.length - joined.shape[1]
        if missing > 0:
            joined = torch.cat((joined, joined.new_zeros((rows, missing))), dim=1)
    set_per_token_rows(views, name, joined)
    return joined


def set_per_token_rows(views: list[LayerView], name: str, value: torch.Tensor) -> None:
    """Each layer's rows of ``value`` ``[L * H, T]`` become its per-token state ``name``."""
    if len(views) == 1:
        views[0].set_per_token(name, value)
        return
    for view, rows in zip(views, value.split(views[0].num_heads), strict=True):
        view.set_per_token(name, rows)


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def recent_and_sinks(length: int, sinks: int, recent: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[length]``: the first ``sinks`` and last ``recent`` tokens, which every method keeps.

    The same few masks serve every layer and block of a stream, so they are made once (read only).
    """
    return _recent_and_sinks(length, min(sinks, length), min(max(recent, 0), length), torch.device(device))


@lru_cache(maxsize=64)
def _recent_and_sinks(length: int, sinks: int, recent: int, device: torch.device) -> torch.Tensor:
    places = _places(length, device)
    return (places < sinks) | (places >= length - recent)


@lru_cache(maxsize=64)
def _places(length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device)


def rank_scores(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """``scores`` in fp32 with the ``protected`` tokens at +inf: what every selection ranks (a kept token is never
    outranked; fp32, so that bf16 rounding never makes two scores tie)."""
    return (scores if scores.dtype == torch.float32 else scores.float()).masked_fill(protected, float("inf"))


def select_top(scores: torch.Tensor, protected: torch.Tensor, budget: int) -> torch.Tensor:
    """Per head, the protected tokens plus the best-scoring others: ascending indices ``[H, budget]``.

    ``scores`` is ``[H, T]``; ``protected`` is ``[T]`` or ``[H, T]``. Equal scores go to the
    earlier token (a stable sort), which matters for max pooling, whose plateaus tie exactly.
    (``torch.topk`` does not promise any order among ties.)
    """
    heads, length = scores.shape
    if budget >= length:
        return torch.arange(length, device=scores.device).expand(heads, length)
    ranked = rank_scores(scores, protected)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :budget]
    return order.sort(dim=-1).values


def pad_tokens(rows: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """``rows`` ``[..., T]`` extended to ``width`` along the tokens with ``fill``."""
    missing = width - rows.shape[-1]
    return rows if missing == 0 else F.pad(rows, (0, missing), value=fill)


def recorded_probs(view: LayerView) -> torch.Tensor:
    """The attention the layer's record holds ``[H_kv, group, T]``, for its cached tokens only (a probe's
    record also covers the probe's own keys, which are not kept)."""
    probs = view.record.probs
    return probs if probs.shape[-1] == view.length else probs[..., : view.length]


@lru_cache(maxsize=16)
def past_lengths(lengths: tuple[int, ...], rows: int, width: int, device: torch.device) -> torch.Tensor:
    """``[L * rows, width]``: True from each layer's length on, ``rows`` rows a layer (the padding of
    :meth:`ScoredMethod.padded_scores`, a window past a prefix, the columns past a count)."""
    columns = torch.arange(width, device=device)  # compared with Python ints: no copy from the host on a GPU
    return torch.stack([columns >= length for length in lengths]).repeat_interleave(rows, dim=0)


def select_top_uneven(scores: torch.Tensor, spans: tuple[tuple[int, int, int], ...], counts: tuple[int, ...],
                      rows: int, device: torch.device) -> torch.Tensor:
    """:func:`select_top` of layers that differ in length and count, with one sort: ``scores`` holds ``rows``
    rows per layer, padded with -inf past each layer's length; ``spans`` are the layers' ``(length, sinks,
    recent)``. Row block ``l`` of the answer ``[L * rows, max(counts)]`` holds layer ``l``'s indices,
    ascending, in its first ``counts[l]`` columns (exactly what :func:`select_top` gives the layer alone:
    the padding ranks last, and a stable sort keeps ties in order)."""
    protected, beyond = _uneven_masks(spans, counts, rows, scores.shape[1], torch.device(device))
    ranked = rank_scores(scores, protected)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, : max(counts)]
    return order.masked_fill(beyond, scores.shape[1]).sort(dim=-1).values


@lru_cache(maxsize=16)
def _uneven_masks(spans: tuple[tuple[int, int, int], ...], counts: tuple[int, ...], rows: int, width: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The protected tokens ``[L * rows, width]``, and the columns past each layer's count ``[L * rows, max(counts)]``
    (made once per shape: a stream repeats its lengths and counts block after block)."""
    protected = torch.stack([pad_tokens(recent_and_sinks(*span, device), width, False) for span in spans])
    return protected.repeat_interleave(rows, dim=0), past_lengths(counts, rows, max(counts), device)


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
    # [H, P] is one unbatched channel per head: the same kernel as [H, 1, P], without the reshapes.
    if pooling == "max":
        return F.max_pool1d(scores, kernel, stride=1, padding=kernel // 2)
    return F.avg_pool1d(scores, kernel, stride=1, padding=kernel // 2, count_include_pad=True)


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
