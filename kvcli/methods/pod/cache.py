"""The cache layer behind PoD: every layer keeps its values, only each KV head's lead keeps distant keys.

Storage of one layer ``l`` (``T`` slots, the same tokens in every layer):

* ``values`` ``[1, H, T, Dv]``, ``entry_pos``/``token_idx`` ``[H, T]``: every KV head, every token;
* ``keys`` ``[1, len(lead_heads), T, D]``: all keys of the KV heads whose block starts at ``l``;
* ``near_keys`` ``[1, len(other_heads), s + m, D]``: for the other KV heads, only the keys of the
  first ``s`` and last ``m`` slots, the ones the next query can see as proximal (``s = n_s``,
  ``m = n_r - 1``). When a token leaves the proximal window its key is cut out of the tensor
  (freed, not masked); its keys live on only in the lead layer of each head's block.

Keys per KV head are ragged (a lead head holds T keys, the others ``s + m``), so they are held as
two dense tensors split by head rather than one; :meth:`PodStore.nbytes` counts what is held.

Positions work as for every kvcli layer: keys are stored as rotated at their entry position and
rotated to the slot's current position when read. All layers hold the same slots, so the lead's
keys, the lead's queries (rotated at the block's positions in the same forward) and the layer's
own keys always agree on positions.

The lead layer's queries and keys of the current block are needed by the higher layers of its blocks
in the same forward pass. :class:`PodCache` holds them for every KV head in two tensors for the forward,
each head's rows overwritten by the next layer that leads it (blocks are runs of consecutive layers, so
a head's rows always hold its current lead's), and a layer reads all its heads' leads at once.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvcli.kv.architecture import describe
from kvcli.kv.attention import dense_attention
from kvcli.kv.cache import CompressedLayer, KVCache
from kvcli.kv.quant import QuantizedTokens, gather_tokens, nbytes, stored
from kvcli.kv.rope import rotate_keys
from kvcli.methods.pod import attention as pod_attention
from kvcli.methods.pod.attention import SharingPlan, edge_slots, shared_attention
from kvcli.methods.pod.groups import check_supported


@lru_cache(maxsize=256)
def _heads_at(heads: tuple[int, ...], device: torch.device) -> slice | torch.Tensor:
    if not heads:
        return slice(0, 0)
    if heads == tuple(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, device=device)


@lru_cache(maxsize=256)
def _head_index(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(heads, dtype=torch.long, device=device)


def head_index(heads: list[int], device: torch.device) -> torch.Tensor:
    """The KV heads ``heads`` as an index tensor on ``device``, made once: a write through ``index_copy_`` is
    one operation where a slice costs two (the view, then the copy)."""
    return _head_index(tuple(heads), torch.device(device))


def heads_at(heads: list[int], device: torch.device) -> slice | torch.Tensor:
    """What indexes the KV heads ``heads`` (ascending) of a tensor on ``device``: a slice (a view)
    when they are consecutive, else an index made once (never a Python list, which becomes a tensor
    at every use)."""
    return _heads_at(tuple(heads), torch.device(device))


class PodCache(KVCache):
    """A :class:`~kvcli.kv.cache.KVCache` of :class:`PodLayer` s that share distant keys as ``plan`` says."""

    def __init__(self, num_layers: int, inv_freq: torch.Tensor | list[torch.Tensor], plan: SharingPlan):
        if plan.num_layers != num_layers:
            raise ValueError(f"the plan has {plan.num_layers} layers, the model {num_layers}")
        self.plan = plan
        #: In the current forward, per KV head, the scaled queries ``[H, G, n, D]`` and rotated keys ``[1, H, T, D]``
        #: of the layer that leads it (None between forwards): what a non-lead layer scores distant tokens with.
        self.lead_queries: torch.Tensor | None = None
        self.lead_keys: torch.Tensor | None = None
        super().__init__(num_layers, inv_freq)

    def share(self, heads: list[int], queries: torch.Tensor, keys: torch.Tensor) -> None:
        """Hold the scaled ``queries`` ``[h, G, n, D]`` and ``keys`` ``[1, h, T, D]`` of the KV heads ``heads`` whose
        lead is the layer calling.

        The first lead of a forward starts its tensors (the last layer drops them, :meth:`PodLayer.attend`; a
        forward cut short leaves ones of another shape, or rows every later lead overwrites before a reader
        reads them). They are copies: later leads overwrite rows in place, and a lead's stored keys must not
        change."""
        held = self.lead_queries
        if held is None or held.shape[2] != queries.shape[2] or self.lead_keys.shape[2] != keys.shape[2]:
            if len(heads) == self.plan.kv_heads:
                self.lead_queries, self.lead_keys = queries.clone(), keys.clone()
                return
            self.lead_queries = queries.new_empty((self.plan.kv_heads, *queries.shape[1:]))
            self.lead_keys = keys.new_empty((1, self.plan.kv_heads, *keys.shape[2:]))
        rows = head_index(heads, queries.device)
        self.lead_queries.index_copy_(0, rows, queries)
        self.lead_keys.index_copy_(1, rows, keys)

    def quantize(self, bits: int, keys: str | None = None, key_norm: bool = False) -> PodCache:
        """As :meth:`KVCache.quantize`, keys always rounded per token: PoD reads its keys rotated from their
        entry positions (:meth:`PodLayer._rotated`), so it cannot store them before RoPE."""
        return super().quantize(bits, "token", key_norm)

    def new_layer(self, layer_idx: int) -> CompressedLayer:
        return PodLayer(self, layer_idx)

    @classmethod
    def for_model(cls, model: torch.nn.Module, plan: SharingPlan) -> PodCache:
        check_supported(model.config)
        arch = describe(model)
        return cls(len(arch.layers), [layer.inv_freq for layer in arch.layers], plan)


class PodStore(CompressedLayer):
    """What one PoD layer holds: values (all heads), lead heads' keys (all tokens), other heads' proximal keys
    (:attr:`near_keys`); how a block is appended, distant keys freed, a selection kept, the bytes counted.
    Reading them (positions, rotation, attention) is :class:`PodLayer`'s."""

    owner: PodCache

    def __init__(self, owner: PodCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        plan = owner.plan
        self.lead_heads = plan.lead_heads(layer_idx)
        self.other_heads = plan.other_heads(layer_idx)
        self.near_keys: torch.Tensor | None = None
        self.near_sinks = 0  # near_keys hold slots [0, near_sinks) and the last near_recent slots
        self.near_recent = 0
        self._cached = 0  # slots held before the current forward's block arrived (where its positions start)

    # --- transformers' CacheLayerMixin -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        dim = key_states.shape[-1]
        self.keys = self.new_store(key_states.new_empty((1, len(self.lead_heads), 0, dim)), keys=True)
        self.near_keys = key_states.new_empty((1, len(self.other_heads), 0, dim))
        self.near_sinks = self.near_recent = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        if owner.probing:
            raise NotImplementedError("pod does not take query-aware probes yet")
        new = key_states.shape[-2]
        self._cached = self.get_seq_length()
        positions, tokens = owner.new_entries(key_states.shape[1], new, self.device)
        if isinstance(self.values, QuantizedTokens):  # --kv-bits: values and lead keys packed, proximal keys not
            self.keys.append(key_states[:, heads_at(self.lead_heads, self.device)])
            self.values.append(value_states)
        else:
            self.keys = torch.cat((self.keys, key_states[:, heads_at(self.lead_heads, self.device)]), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
        if self.other_heads:  # a layer that leads every head holds no proximal keys of its own
            self.near_keys = torch.cat((self.near_keys, key_states[:, heads_at(self.other_heads, self.device)]), dim=-2)
        self.near_recent += new
        self.entry_pos = torch.cat((self.entry_pos, positions), dim=-1)
        self.token_idx = torch.cat((self.token_idx, tokens), dim=-1)
        # The attention reads the layer itself (see attend).
        return key_states, value_states if isinstance(self.values, QuantizedTokens) else self.values

    def get_seq_length(self) -> int:
        return 0 if self.values is None else self.values.shape[-2]

    def reset(self) -> None:
        super().reset()
        self.near_keys = None
        self.near_sinks = self.near_recent = 0

    # --- kvcli ---------------------------------------------------------------------------------
    def near_slots(self) -> torch.Tensor:
        """The slots ``near_keys`` hold, ascending: ``[0, near_sinks)`` and the last ``near_recent``."""
        return edge_slots(self.near_sinks, self.near_recent, self.get_seq_length(), self.device)

    def free_distant_keys(self) -> None:
        """Cut the keys that no later query of this layer sees as proximal out of ``near_keys``."""
        length = self.get_seq_length()
        sinks, recent = self.owner.plan.near_slots(length)
        if (sinks, recent) == (self.near_sinks, self.near_recent):
            return
        if not self.other_heads:  # every head leads: no proximal keys of its own to cut
            self.near_sinks, self.near_recent = sinks, recent
            return
        # The held slots ascend and hold every wanted one, so the wanted first ``sinks`` slots are the first
        # ``sinks`` held and the wanted last ``recent`` the last ``recent`` held: two slices, no search.
        held = self.near_keys.shape[2]
        if pod_attention.CHECKS:
            stored, wanted = self.near_slots(), edge_slots(sinks, recent, length, self.device)
            kept = torch.cat((stored[:sinks], stored[held - recent:]))
            if not torch.equal(kept, wanted):
                raise RuntimeError("PoD: a key still proximal was already freed (cache bookkeeping bug)")
        self.near_keys = torch.cat((self.near_keys[:, :, :sinks], self.near_keys[:, :, held - recent:]), dim=2)
        self.near_sinks, self.near_recent = sinks, recent

    def keep(self, indices: torch.Tensor) -> None:
        """Keep, per KV head, the tokens at ``indices`` ``[H, k]`` (ascending): PoD with a token selection.

        Values and bookkeeping are gathered for every head, lead keys for the lead heads. The other
        heads' proximal keys stay as they are: the selection must keep the first ``n_s`` and the last
        ``n_r - 1`` slots (``pod`` protects them), which are again the first and last slots after it.
        """
        heads, count = indices.shape
        length = self.get_seq_length()
        if pod_attention.CHECKS and self.other_heads:
            near = self.near_slots()
            kept = indices[heads_at(self.other_heads, self.device)]
            first, last = kept[:, :self.near_sinks], kept[:, count - self.near_recent:]
            if (count < near.shape[0] or not bool((first == near[:self.near_sinks]).all())
                    or not bool((last == near[self.near_sinks:]).all())):
                raise RuntimeError("PoD: a selection dropped a proximal token of a non-lead layer")
        self.values = gather_tokens(self.values, indices)
        self.keys = gather_tokens(self.keys, indices[heads_at(self.lead_heads, self.device)])
        self.entry_pos = self.entry_pos.gather(1, indices)
        self.token_idx = self.token_idx.gather(1, indices)
        self.state = {name: value.gather(1, indices) for name, value in self.state.items()}
        self.moved = self.moved or count < length

    def nbytes(self) -> int:
        if self.values is None:
            return 0
        return sum(nbytes(t) for t in (self.keys, self.near_keys, self.values)) + self.bookkeeping_bytes()


class PodLayer(PodStore):
    """One PoD layer as attention reads it: its keys rotated to the block's positions, its queries and keys shared
    with the higher layers its heads lead, and Eq. 3-4 for the heads it does not lead."""

    def slot_positions(self) -> torch.Tensor:
        """Current position of every slot during a forward: consecutive, the new block's at ``block_start..``."""
        start = self.owner.block_start - self._cached
        return torch.arange(start, start + self.get_seq_length(), device=self.device)

    def _in_place(self) -> bool:
        """Whether every key still sits where it entered (nothing to rotate in this forward)."""
        return self.owner.keep_positions or (not self.moved and self.owner.block_start == self._cached)

    def _rotated(self, keys: torch.Tensor, heads: list[int], slots: torch.Tensor | None) -> torch.Tensor:
        """``keys`` ``[1, h, S, D]`` of KV heads ``heads`` at ``slots`` (all when None), rotated to now."""
        if self._in_place():
            return keys
        at = heads_at(heads, self.device)
        entry = self.entry_pos[at] if slots is None else self.entry_pos[at][:, slots]
        current = self.slot_positions() if slots is None else self.slot_positions()[slots]
        return rotate_keys(keys, current[None, :] - entry, self.inv_freq)

    def lead_keys(self) -> torch.Tensor:
        """This layer's keys of its lead heads at every slot, rotated: ``[1, len(lead_heads), T, D]``."""
        return self._rotated(stored(self.keys), self.lead_heads, None)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PoD attention of this layer for a block of queries ``[1, Hq, n, D]``, then free distant keys.

        A layer whose every head leads is plain attention on kvcli's ordinary path. Otherwise one
        :func:`~kvcli.methods.pod.attention.shared_attention` serves all heads: the others with their lead's
        queries and keys, the lead heads with their own (App. C.1: exactly full attention, bit for bit
        in ``tests/test_pod.py``), so a layer costs one attention's operations, not two.
        Returns ``([1, Hq, n, Dv], window attention [H, G, T] or None)``.
        """
        owner, plan = self.owner, self.owner.plan
        layer = self.layer_idx
        n = query.shape[2]
        kv_heads = self.values.shape[1]
        group = query.shape[1] // kv_heads
        values = stored(self.values)  # dequantized once per call when quantized
        skip = min(owner.score_skip, n) if window else 0  # the question's template tail does not vote
        if not self.other_heads:  # every head leads: plain attention on kvcli's ordinary path
            keys = self.lead_keys()
            output, probs = dense_attention(query, keys, values, scaling, window, skip=skip)
            if plan.last_reader(layer) > layer:  # the higher layers of its blocks read them, rotated once here
                owner.share(self.lead_heads, query.view(kv_heads, group, n, -1) * scaling, keys)
        else:
            # Lead heads join the shared heads' matmuls with their own queries and keys as the "lead's":
            # Eq. 3-4 is then plain attention for them (App. C.1), and one attention serves the layer.
            scaled = query.view(kv_heads, group, n, -1) * scaling
            if self.lead_heads:
                at = heads_at(self.lead_heads, query.device)
                owner.share(self.lead_heads, scaled[at], self.lead_keys())
            heads = self.other_heads
            rows = heads_at(heads, query.device) if self.lead_heads else None  # None: every head shares
            own_keys = self.near_keys if self._in_place() else self._rotated(self.near_keys, heads, self.near_slots())
            out, probs, _ = shared_attention(scaled if rows is None else scaled[rows], owner.lead_queries, own_keys,
                                             None, owner.lead_keys, values, None, plan.sinks, plan.recent, 1.0,
                                             plan.tau, window, held=(self.near_sinks, self.near_recent), rows=rows,
                                             skip=skip)
            output = out.view(1, kv_heads * group, n, -1)
        self.free_distant_keys()
        if layer == plan.num_layers - 1:  # the forward is over: its lead queries and keys go
            owner.lead_queries = owner.lead_keys = None
        return output, probs
