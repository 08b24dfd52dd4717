"""The cache layer behind PoD: every layer keeps its values, only each KV head's lead keeps distant keys.

Storage of one layer ``l`` (``T`` slots, the same tokens in every layer):

* ``values`` ``[1, H, T, Dv]``, ``entry_pos``/``token_idx`` ``[H, T]``: every KV head, every token;
* ``keys`` ``[1, len(lead_heads), T, D]``: all keys of the KV heads whose block starts at ``l``;
* ``near_keys`` ``[1, len(other_heads), s + m, D]``: for the other KV heads, only the keys of the
  first ``s`` and last ``m`` slots, the ones the next query can see as proximal (``s = n_s``,
  ``m = n_r - 1``). When a token leaves the proximal window its key is cut out of the tensor
  (freed, not masked); its keys live on only in the lead layer of each head's block.

Keys per KV head are ragged (a lead head holds T keys, the others ``s + m``), so they are held as
two dense tensors split by head rather than one; :meth:`PodLayer.nbytes` counts what is held.

Positions work as for every kvcli layer: keys are stored as rotated at their entry position and
rotated to the slot's current position when read. All layers hold the same slots, so the lead's
keys, the lead's queries (rotated at the block's positions in the same forward) and the layer's
own keys always agree on positions.

The lead layer's queries of the current block are needed by the higher layers of its blocks in
the same forward pass: :attr:`PodCache.shared_queries` holds them from the lead's attention call
until the last layer that reads them is done.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvcli.architecture import describe
from kvcli.attention import dense_attention
from kvcli.cache import CompressedLayer, KVCache
from kvcli.errors import UnsupportedModelError
from kvcli.pod import attention as pod_attention
from kvcli.pod.attention import SharingPlan, edge_slots, shared_attention
from kvcli.quant import QuantizedTokens, gather_tokens, nbytes, stored
from kvcli.rope import rotate_keys


@lru_cache(maxsize=256)
def _heads_at(heads: tuple[int, ...], device: torch.device) -> slice | torch.Tensor:
    if not heads:
        return slice(0, 0)
    if heads == tuple(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, device=device)


def heads_at(heads: list[int], device: torch.device) -> slice | torch.Tensor:
    """What indexes the KV heads ``heads`` (ascending) of a tensor on ``device``: a slice (a view)
    when they are consecutive, else an index made once (never a Python list, which becomes a tensor
    at every use)."""
    return _heads_at(tuple(heads), torch.device(device))


class PodCache(KVCache):
    """A :class:`~kvcli.cache.KVCache` of :class:`PodLayer` s that share distant keys as ``plan`` says."""

    def __init__(self, num_layers: int, inv_freq: torch.Tensor | list[torch.Tensor], plan: SharingPlan):
        if plan.num_layers != num_layers:
            raise ValueError(f"the plan has {plan.num_layers} layers, the model {num_layers}")
        self.plan = plan
        #: A lead layer's queries ``[H, G, n, D]`` and rotated lead keys ``[h_lead, T, D]`` in the current
        #: forward, until the last layer of its blocks has read them.
        self.shared_queries: dict[int, torch.Tensor] = {}
        self.shared_keys: dict[int, torch.Tensor] = {}
        super().__init__(num_layers, inv_freq)

    def new_layer(self, layer_idx: int) -> CompressedLayer:
        return PodLayer(self, layer_idx)

    @classmethod
    def for_model(cls, model: torch.nn.Module, plan: SharingPlan) -> PodCache:
        arch = describe(model)
        if any(window is not None for window in arch.windows):
            # Sharing assumes every layer holds the same slots; a window layer holds only its window.
            raise UnsupportedModelError(f"pod does not support model type {arch.model_type!r}: "
                                        "it has sliding-window layers")
        return cls(len(arch.layers), [layer.inv_freq for layer in arch.layers], plan)


class PodLayer(CompressedLayer):
    """One layer's values (all heads), lead heads' keys (all tokens), other heads' proximal keys."""

    owner: PodCache

    def __init__(self, owner: PodCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        plan = owner.plan
        self.lead_heads = plan.lead_heads(layer_idx)
        self.other_heads = plan.other_heads(layer_idx)
        self.near_keys: torch.Tensor | None = None
        self.near_sinks = 0  # near_keys hold slots [0, near_sinks) and the last near_recent slots
        self.near_recent = 0
        self._cached = 0  # slots held before the current forward's block arrived

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

        Lead heads get plain full attention through kvcli's ordinary path (App. C.1: exactly full
        attention); the other heads get :func:`~kvcli.pod.attention.shared_attention` with their
        lead's queries and keys. Returns ``([1, Hq, n, Dv], window attention [H, G, T] or None)``.
        """
        owner, plan = self.owner, self.owner.plan
        layer = self.layer_idx
        n = query.shape[2]
        kv_heads = self.values.shape[1]
        group = query.shape[1] // kv_heads
        length = self.get_seq_length()
        grouped = query.view(1, kv_heads, group, n, -1)
        values = stored(self.values)  # dequantized once per call when quantized
        output = query.new_empty((1, kv_heads, group, n, self.values.shape[-1]))
        window_probs = None
        if window:
            window_probs = torch.zeros(kv_heads, group, length, dtype=torch.float32, device=query.device)
        if self.lead_heads:
            heads, at = self.lead_heads, heads_at(self.lead_heads, query.device)
            lead_keys = self.lead_keys()
            out, probs = dense_attention(grouped[:, at].flatten(1, 2), lead_keys, values[:, at], scaling, window)
            output[:, at] = out.view(1, len(heads), group, n, -1)
            if window_probs is not None and probs is not None:
                window_probs[at] = probs
            if plan.last_reader(layer) > layer:  # the higher layers of its blocks read them, rotated once here
                owner.shared_queries[layer] = grouped[0]
                owner.shared_keys[layer] = lead_keys[0]
        if self.other_heads:
            heads, at = self.other_heads, heads_at(self.other_heads, query.device)
            pairs = [(h, plan.lead_of(h, layer)) for h in heads]
            lead_query = torch.stack([owner.shared_queries[a][h] for h, a in pairs])
            lead_keys = torch.stack([owner.shared_keys[a][owner.layers[a].lead_heads.index(h)] for h, a in pairs])
            own_keys = self.near_keys if self._in_place() else self._rotated(self.near_keys, heads, self.near_slots())
            out, probs, _ = shared_attention(grouped[0, at], lead_query, own_keys[0], None, lead_keys,
                                             values[0, at], None, plan.sinks, plan.recent, scaling, plan.tau,
                                             window, held=(self.near_sinks, self.near_recent))
            output[0, at] = out.to(output.dtype)
            if window_probs is not None and probs is not None:
                window_probs[at] = probs
        self.free_distant_keys()
        for lead in {plan.lead_of(h, layer) for h in range(kv_heads)}:
            if plan.last_reader(lead) == layer:
                owner.shared_queries.pop(lead, None)
                owner.shared_keys.pop(lead, None)
        return output.view(1, kv_heads * group, n, -1), window_probs

    def free_distant_keys(self) -> None:
        """Cut the keys that no later query of this layer sees as proximal out of ``near_keys``."""
        length = self.get_seq_length()
        sinks, recent = self.owner.plan.near_slots(length)
        if (sinks, recent) == (self.near_sinks, self.near_recent):
            return
        stored = self.near_slots()
        wanted = edge_slots(sinks, recent, length, self.device)
        keep = torch.searchsorted(stored, wanted).clamp(max=max(stored.shape[0] - 1, 0))
        if pod_attention.CHECKS and wanted.numel() and not torch.equal(stored[keep], wanted):
            raise RuntimeError("PoD: a key still proximal was already freed (cache bookkeeping bug)")
        self.near_keys = self.near_keys.index_select(2, keep).contiguous()
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
        return sum(nbytes(t) for t in (self.keys, self.near_keys, self.values))
