"""PoD's attention (section 2.2, Eq. 3-4): full attention to proximal tokens, shared scores for distant ones.

For a query at slot ``i`` of layer ``l`` and a KV head whose block (of consecutive similar layers)
starts at its *lead* layer ``a``:

* proximal tokens are the first ``n_s`` slots and the last ``n_r`` slots up to the query itself,
  ``[0, n_s) ∪ (i - n_r, i]`` (Eq. 3: ``K_[1, n_s]`` and ``K_[n - n_r + 1, n]``, 1-based); they are
  scored with the layer's own query and keys, ``a^P = Q_l K_l^T / sqrt(d)``;
* the other visible slots ``[n_s, i - n_r]`` are distant, scored with the lead layer's query and
  keys, ``a^D = Q_a K_a^T / sqrt(d)``: every layer of the block shares the lead's attention scores;
* both parts weigh the layer's own values, and the gate of Eq. 4,
  ``g = sum exp a^P / (sum exp a^P + sum exp a^D)``, mixes ``o = g o^P + (1 - g) o^D``.

Appendix C.1 shows that this mix is exactly one softmax over the concatenated logits ``[a^P; a^D]``
(the gate is the softmax mass of the proximal part), which is how :func:`shared_attention`
computes it: one ``[queries, slots]`` logit matrix whose distant entries come from the lead, one
softmax, one product with the values. In the lead layer itself ``a^D`` is the layer's own score, so
the lead computes plain full attention (the cache routes its heads through kvcli's ordinary
attention, which makes that equality exact rather than approximate).

With the gate threshold ``tau`` (appendix B.4) a query whose gate reaches ``tau`` skips the distant
part: its output is ``o^P`` alone. The lead layer never skips (its distant term is its own attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvcli.io.lazy import torch

#: Self-checks of PoD's cache bookkeeping that read device values to the host (each one stalls a GPU):
#: off in use, switched on by the test suite, where a bookkeeping bug must fail loudly.
CHECKS = False


@dataclass
class SharingPlan:
    """Which layer leads each KV head's block, and PoD's proximal window.

    ``leads[h, l]`` is the lead (lowest) layer of the block holding layer ``l`` for KV head ``h``;
    ``sinks`` (n_s) and ``recent`` (n_r, the query itself included) define the proximal tokens;
    ``tau`` is the optional gate threshold.
    """

    leads: torch.Tensor
    sinks: int
    recent: int
    tau: float | None = None

    def __post_init__(self) -> None:
        self.leads = self.leads.to(torch.long).cpu()
        kv_heads, layers = self.leads.shape
        self._leads = self.leads.tolist()  # read as Python ints: no tensor read inside a forward
        self._lead_heads = [[h for h in range(kv_heads) if self._leads[h][layer] == layer] for layer in range(layers)]
        self._other_heads = [[h for h in range(kv_heads) if self._leads[h][layer] != layer] for layer in range(layers)]
        self._last_reader = {}
        for layer in range(layers):
            for lead in self.leads[:, layer].tolist():
                self._last_reader[lead] = max(self._last_reader.get(lead, lead), layer)

    @property
    def num_layers(self) -> int:
        return self.leads.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.leads.shape[0]

    def lead_heads(self, layer: int) -> list[int]:
        """KV heads for which ``layer`` is the lead: it keeps every key of theirs and attends fully."""
        return self._lead_heads[layer]

    def other_heads(self, layer: int) -> list[int]:
        """KV heads whose lead is a lower layer: ``layer`` keeps only their proximal keys."""
        return self._other_heads[layer]

    def lead_of(self, head: int, layer: int) -> int:
        return self._leads[head][layer]

    def last_reader(self, lead: int) -> int:
        """The highest layer that reads ``lead``'s queries in a forward pass (``lead`` itself if none)."""
        return self._last_reader.get(lead, lead)

    def near_slots(self, length: int) -> tuple[int, int]:
        """``(sinks, recent)`` slots whose keys a non-lead layer must keep between forward passes.

        The next query (slot ``length``) sees as proximal the first ``n_s`` slots and the last
        ``n_r - 1`` cached ones (its window of ``n_r`` includes itself); every later query needs
        only those or newer slots.
        """
        sinks = min(self.sinks, length)
        recent = min(max(self.recent - 1, 0), length - sinks)
        return sinks, recent


def proximal_and_distant(query_slots: torch.Tensor, length: int, sinks: int, recent: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``[queries, length]`` masks: which slots are proximal and which distant for each query.

    Causal: slots after the query are neither. Proximal ``t < n_s or i - n_r < t <= i``; distant
    ``n_s <= t <= i - n_r``.
    """
    slots = torch.arange(length, device=query_slots.device)[None, :]
    i = query_slots[:, None]
    visible = slots <= i
    proximal = visible & ((slots < sinks) | (slots > i - recent))
    return proximal, visible & ~proximal


@dataclass(frozen=True)
class OwnSlots:
    """Where a layer's own keys count for a block of ``n`` queries among ``T`` slots: ``slots`` ``[S]`` (ascending)
    its own keys are at, ``proximal`` ``[n, S]`` which of them each query sees as proximal, ``hidden`` ``[n, T]``
    the slots after each query (masked)."""

    slots: torch.Tensor
    proximal: torch.Tensor
    hidden: torch.Tensor

    @property
    def everything(self) -> bool:
        """Whether the layer has its own key at every slot (distinct slots below T: exactly 0 .. T-1)."""
        return self.slots.shape[0] == self.hidden.shape[1]


def shared_attention(query: torch.Tensor, lead_query: torch.Tensor, own_keys: torch.Tensor,
                     own_slots: torch.Tensor | None, lead_keys: torch.Tensor, values: torch.Tensor,
                     query_slots: torch.Tensor | None, sinks: int, recent: int, scaling: float,
                     tau: float | None = None, window: int = 0, first: int | None = None,
                     held: tuple[int, int] | None = None, with_gate: bool = False,
                     rows: slice | torch.Tensor | None = None, skip: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Eq. 3-4 for the KV heads of a layer that are not their block's lead, all queries of a block at once.

    Shapes (``H`` KV heads, ``G`` query heads per KV head, ``n`` queries, ``T`` slots):

    * ``query``, ``lead_query``: ``[H, G, n, D]``, this layer's queries and the lead layer's (already
      multiplied by the scaling when ``scaling`` is 1);
    * ``own_keys``: ``[H, S, D]``, this layer's keys at the slots ``own_slots`` ``[S]`` (every slot
      proximal to some query must be there; distant ones need not be);
    * ``lead_keys``: ``[H, T, D]``, the lead layer's keys of every slot (only distant slots count);
    * ``values``: ``[H, T, Dv]``; ``query_slots``: ``[n]``, the consecutive slots of the queries' own tokens,
      the first of which is ``first`` when the caller knows it (read from ``query_slots`` otherwise).
      Keys and values may carry a leading batch dimension of 1 (a cache layer's tensors as stored).

    A cache layer passes ``held = (s, r)`` instead of ``own_slots`` and ``query_slots``: its own keys are
    those of the first ``s`` and the last ``r`` slots and its queries the block's last ``n`` slots
    (``first`` is ``T - n``), so the masks are made once per block for every layer (:func:`held_masks`).
    ``rows``: which of the ``H`` heads share, where the layer leads the others (:func:`mixed_logits`).

    Returns the output ``[H, G, n, Dv]``, the attention of the ``window`` queries before the last ``skip`` summed
    over them ``[H, G, T]`` (float32, for scoring methods; None when ``window`` is 0) and the gate
    ``g`` ``[h, G, n]`` of the sharing heads (float32; only with a threshold ``tau`` or ``with_gate``, else None).
    """
    n, length = lead_query.shape[2], values.shape[-2]
    if held is not None:
        first = length - n
        own = held_masks(n, length, *held, sinks, recent, query.device)
    else:
        first = int(query_slots[0]) if first is None else first
        own = OwnSlots(own_slots, *_query_masks(query_slots, own_slots, length, sinks, recent))
    if CHECKS:
        _check_own_keys(own.slots, first, length, sinks, recent)
    if scaling != 1.0:
        lead_query, query = lead_query * scaling, query * scaling
    logits = mixed_logits(query, lead_query, own_keys, lead_keys, own, rows)
    # Scores and the gate read float32 probabilities; the output alone needs none (softmax still sums in float32).
    exact = window > 0 or tau is not None or with_gate
    probs = torch.softmax(logits.masked_fill_(own.hidden, float("-inf")), dim=-1,
                          dtype=torch.float32 if exact else values.dtype)
    gate = None
    if tau is not None or with_gate:
        probs, gate = _gated(probs, own, rows, tau)
    heads, group = lead_query.shape[:2]
    output = torch.matmul((probs.to(values.dtype) if exact else probs).view(heads, group * n, length), values)
    end = n - skip
    tail = probs[:, :, end - min(window, end):end, :].sum(dim=2) if window > 0 else None
    return output.view(heads, group, n, values.shape[-1]), tail, gate


def mixed_logits(query: torch.Tensor, lead_query: torch.Tensor, own_keys: torch.Tensor, lead_keys: torch.Tensor,
                 own: OwnSlots, rows: slice | torch.Tensor | None) -> torch.Tensor:
    """Eq. 3's logits ``[H, G, n, T]`` (scaled queries): every slot starts with the lead's score (a^D), the
    proximal slots take the layer's own (a^P); one softmax over a row is then Eq. 4's gated mix (App. C.1).

    ``rows`` (a cache layer whose KV heads lead in part) says which of the ``H`` heads of ``lead_query`` and
    ``lead_keys`` are not leads: ``query`` and ``own_keys`` then hold those heads only, and the other rows,
    whose lead query and keys are their own, are plain attention (App. C.1) computed in the same batched
    matmuls. None: every head shares.
    """
    heads, group, n, _ = lead_query.shape
    length = lead_keys.shape[-2]
    logits = torch.matmul(lead_query.reshape(heads, group * n, -1), lead_keys.transpose(-1, -2))
    logits = logits.view(heads, group, n, length)
    sharing = query.shape[0]
    scores = torch.matmul(query.reshape(sharing, group * n, -1), own_keys.transpose(-1, -2))
    scores = scores.view(sharing, group, n, own.slots.shape[0])
    shared = logits if rows is None else logits[rows]  # a view for a slice of heads, a copy for an index
    if own.everything:
        shared = torch.where(own.proximal, scores, shared)
    else:
        shared[..., own.slots] = torch.where(own.proximal, scores, shared[..., own.slots])
    if rows is None:
        return shared
    if own.everything or not isinstance(rows, slice):
        logits[rows] = shared
    return logits


def _gated(probs: torch.Tensor, own: OwnSlots, rows: slice | torch.Tensor | None, tau: float | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate ``g`` of Eq. 4 of the sharing heads (``rows``, None: all), the softmax mass of their proximal slots
    (App. C.1), and ``probs`` where, with a threshold ``tau`` (appendix B.4), a query whose gate reaches it
    leaves the distant part out (``o = o^P``). The lead rows are never gated."""
    sharing_probs = probs if rows is None else probs[rows]
    proximal_probs = (sharing_probs if own.everything else sharing_probs[..., own.slots]) * own.proximal
    gate = proximal_probs.sum(dim=-1)
    if tau is None:
        return probs, gate
    proximal_only = torch.zeros_like(sharing_probs)
    proximal_only[..., own.slots] = proximal_probs / gate[..., None].clamp_min(torch.finfo(torch.float32).tiny)
    gated = torch.where((gate >= tau)[..., None], proximal_only, sharing_probs)
    if rows is None:
        return gated, gate
    probs[rows] = gated
    return probs, gate


def _check_own_keys(own_slots: torch.Tensor, first: int, length: int, sinks: int, recent: int) -> None:
    """Self-check (:data:`CHECKS`): every slot proximal to a query from slot ``first`` on has the layer's own key."""
    device = own_slots.device
    needed = torch.cat((torch.arange(min(sinks, length), device=device),
                        torch.arange(max(first - recent + 1, 0), length, device=device)))
    if not bool(torch.isin(needed, own_slots).all()):
        raise RuntimeError("PoD: a proximal key is missing from the layer's own keys (cache bookkeeping bug)")


@lru_cache(maxsize=2)  # a stream's cache grows every block: only the block in progress needs its masks
def held_masks(n: int, length: int, held_sinks: int, held_recent: int, sinks: int, recent: int,
               device: torch.device) -> OwnSlots:
    """For the block's last ``n`` slots of ``length`` as queries, against own keys at the first ``held_sinks``
    and the last ``held_recent`` slots: those slots, which of them are proximal to each query and the slots
    after each query (made once per block, read only)."""
    own_slots = edge_slots(held_sinks, held_recent, length, device)
    query_slots = torch.arange(length - n, length, device=device)
    return OwnSlots(own_slots, *_query_masks(query_slots, own_slots, length, sinks, recent))


def _query_masks(query_slots: torch.Tensor, own_slots: torch.Tensor, length: int, sinks: int, recent: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of ``own_slots`` ``[S]`` are proximal to each query at ``query_slots`` ``[n]`` (``[n, S]``), and
    the slots of ``length`` after each query (``[n, length]``, masked)."""
    i, t = query_slots[:, None], own_slots[None, :]
    own_proximal = (t <= i) & ((t < sinks) | (t > i - recent))
    return own_proximal, torch.arange(length, device=query_slots.device)[None, :] > i


def edge_slots(first: int, last: int, length: int, device: torch.device) -> torch.Tensor:
    """The first ``first`` and the last ``last`` of ``length`` slots, ascending: what a non-lead layer keeps
    keys of (its sinks and recent window)."""
    return torch.cat((torch.arange(first, device=device), torch.arange(length - last, length, device=device)))


# --- a whole sequence without a cache (post-training, references) ---------------------------------------

#: Name of the attention function for whole-sequence PoD forwards (registered by :func:`register_sequence_attention`).
SEQUENCE_ATTENTION = "kvcli-pod"
#: Keyword argument of the model's forward call carrying a :class:`SharedForward`.
SHARED_KWARG = "kvcli_pod"


@dataclass
class SharedForward:
    """What one whole-sequence PoD forward carries from a lead layer to the higher layers of its blocks.

    Pass a fresh one per forward call (``model(ids, kvcli_pod=SharedForward(plan))``); it holds the
    lead layers' rotated queries and keys until their last reader is done.
    """

    plan: SharingPlan

    def __post_init__(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}


def sequence_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """PoD attention over a whole sequence ``[1, H, n, D]`` (no cache), differentiable, for post-training.

    Lead heads get causal full attention; the others :func:`shared_attention` with every slot's own
    key available (the proximal mask decides which are used). Without a :class:`SharedForward` in
    the keyword arguments this is kvcli's ordinary attention.
    """
    from kvcli.kv.attention import kvcli_attention

    shared: SharedForward | None = kwargs.pop(SHARED_KWARG, None)
    if shared is None:
        return kvcli_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    plan, layer = shared.plan, module.layer_idx
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    kv_heads, n = key.shape[1], query.shape[2]
    group = query.shape[1] // kv_heads
    grouped = query.view(kv_heads, group, n, -1)
    if plan.last_reader(layer) > layer:
        shared.queries[layer], shared.keys[layer] = grouped, key[0]
    outputs: list[torch.Tensor | None] = [None] * kv_heads
    lead_heads, other_heads = plan.lead_heads(layer), plan.other_heads(layer)
    if lead_heads:
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped[lead_heads], key[0, lead_heads, None], value[0, lead_heads, None], is_causal=n > 1, scale=scaling)
        for i, h in enumerate(lead_heads):
            outputs[h] = out[i]
    if other_heads:
        leads = [plan.lead_of(h, layer) for h in other_heads]
        slots = torch.arange(n, device=query.device)
        pairs = list(zip(other_heads, leads, strict=True))
        lead_query = torch.stack([shared.queries[a][h] for h, a in pairs])
        lead_keys = torch.stack([shared.keys[a][h] for h, a in pairs])
        out, _, _ = shared_attention(grouped[other_heads], lead_query, key[0, other_heads], slots, lead_keys,
                                     value[0, other_heads], slots, plan.sinks, plan.recent, scaling, plan.tau)
        for i, h in enumerate(other_heads):
            outputs[h] = out[i].to(value.dtype)
    for lead in set(plan.leads[:, layer].tolist()):
        if plan.last_reader(lead) == layer:
            shared.queries.pop(lead, None)
            shared.keys.pop(lead, None)
    output = torch.stack(outputs).view(1, kv_heads * group, n, -1)
    return output.transpose(1, 2).contiguous(), None


def register_sequence_attention() -> None:
    """Make ``attn_implementation="kvcli-pod"`` available (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEQUENCE_ATTENTION, sequence_attention)
