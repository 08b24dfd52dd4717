"""A compressible KV cache with positions re-assigned inside the cache.

Why it looks like this:

* One entry per KV head (GQA), never per query head, so memory is what the model really needs.
* Each layer may hold a different number of tokens (PyramidKV), and each KV head keeps its own
  choice of tokens (SnapKV-style per-head selection); within a layer the heads keep equally many.
* Positions are re-assigned after every eviction (StreamingLLM, TreeKV section 4.1): the cached
  tokens of a layer sit at consecutive positions that end right before the next block, so a
  stream of millions of tokens never leaves the model's trained positions. A prompt read in one
  shot within the trained context can instead keep every token where it entered
  (``KVCache.keep_positions``), as SnapKV, PyramidKV, H2O, TOVA and PyramidInfer do: compacting a kept key's
  neighbours together breaks the model's copying of it (see docs/methods.md).
  When the heads of a layer keep different tokens (SnapKV-style selection), a token gets one
  position in every head that holds it: the distinct tokens of all heads sit at consecutive
  positions in stream order, so each head's tokens keep the gaps its other heads fill (beyond the
  papers, which never stream per-head selections; see docs/methods.md).
* Keys are stored as they were rotated when they entered (RoPE at their entry position) and are
  rotated by the difference to their current position each time they are read. Rotating the
  stored copy in place after every eviction would round a long-lived key once per move in bf16;
  rotating from the entry copy rounds it once, however long it lives. Each layer rotates with its
  own frequencies (Gemma 3's local and global bases differ), read by :mod:`kvcli.kv.architecture`.
* A layer the model restricts to a window of W positions (Gemma 3's and GPT-OSS's sliding layers,
  Mistral's window) is a :class:`WindowLayer`: it keeps exactly the W - 1 tokens before the next one
  (a query sees itself and the W - 1 before it), whatever the method, and the budget never
  applies to it. Its tokens are consecutive in the stream, so compacting their positions keeps every
  distance the model's window mask measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from kvcli.kv.architecture import describe
from kvcli.kv.joined import RotationPlan, alike_batches, keep_joined, union_offsets
from kvcli.kv.quant import KVQuant, stored
from kvcli.kv.rope import rotate_keys
from kvcli.kv.storage import LayerStorage

__all__ = ["POSITION_DTYPE", "AttentionRecord", "CompressedLayer", "KVCache", "LayerView", "WindowLayer", "rotate_keys"]

#: The dtype of every cached token's entry position and stream index: 4 bytes each, per layer and KV head (a stream
#: of 2**31 tokens is far beyond any book, and the budget pays for every byte: kvcli.kv.quant.POSITION_BYTES).
POSITION_DTYPE = torch.int32


@dataclass
class AttentionRecord:
    """Attention paid by the last ``window`` queries of a forward pass, summed over those queries.

    ``probs`` has shape ``[H_kv, group, T]``: per KV head, per query head of its group, per key.
    ``probe`` is the part of ``probs`` the question's queries paid (a question streamed alongside
    the block as a probe, or the question ending the block, see :meth:`kvcli.engine.engine.Engine.forward`),
    kept apart for methods that treat the question's attention differently from the text's own
    (TreeKV's guard); None when no question scored. ``own`` counts the recorded queries that are the
    block's own last tokens (they see only the keys before them); the others are a probe's, which
    see every key. ``None`` means all ``window`` of them. ``skip``: how many of the block's last tokens came after
    the recorded queries (a question's chat-template tail, which attends but does not vote): the block's own
    recorded queries are its tokens ``n - skip - own_window`` to ``n - skip``.
    """

    probs: torch.Tensor
    window: int
    probe: torch.Tensor | None = None
    own: int | None = None
    skip: int = 0

    @property
    def own_window(self) -> int:
        """How many of the recorded queries are the block's own (the rest are a probe's)."""
        return self.window if self.own is None else self.own


class CompressedLayer(LayerStorage):
    """One layer's cache: its keys and values (:class:`kvcli.kv.storage.LayerStorage`) and, per token and KV
    head, the bookkeeping gathered with them on every eviction: the position each key was rotated at when it
    entered, its index in the stream, and the per-token state a method keeps."""

    #: The model's attention window of this layer (None: it sees every cached token).
    window: int | None = None

    def __init__(self, owner: KVCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        #: [H, T] position each key was rotated at; None where keys are stored before RoPE (:attr:`pre_rope`): such
        #: a key is rotated from 0 to where it sits whenever it is read, so where it entered is never needed.
        self.entry_pos: torch.Tensor | None = None
        self.token_idx: torch.Tensor | None = None  # [H, T] index of the token in the stream
        self.state: dict[str, torch.Tensor] = {}  # method-owned per-token tensors [H, T]
        self.method_state: dict[str, object] = {}  # method-owned values of the whole layer
        self.moved = False  # True once an eviction has shifted some kept key's position
        self.record: AttentionRecord | None = None

    # --- transformers' CacheLayerMixin -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        heads = key_states.shape[1]
        self.entry_pos = None if self.pre_rope else torch.empty((heads, 0), dtype=POSITION_DTYPE, device=self.device)
        self.token_idx = torch.empty((heads, 0), dtype=POSITION_DTYPE, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        cached = self.current_keys(owner.block_start)
        keys = torch.cat((cached, key_states), dim=-2)
        values = torch.cat((stored(self.values), value_states), dim=-2)
        if owner.probing:  # query-aware scoring: attend, record, but keep nothing
            return keys, values
        positions, tokens = owner.new_entries(key_states.shape[1], key_states.shape[-2], self.device)
        self.append(rotate_keys(key_states, -positions, self.inv_freq) if self.pre_rope else key_states,
                    value_states, keys if cached is self.keys else None, values)
        if self.entry_pos is not None:
            self.entry_pos = torch.cat((self.entry_pos, positions), dim=-1)
        self.token_idx = torch.cat((self.token_idx, tokens), dim=-1)
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.entry_pos = self.token_idx = None
        self.state = {}
        self.method_state = {}
        self.moved = False
        self.record = None

    # --- kvcli ---------------------------------------------------------------------------------
    def current_positions(self, block_start: int) -> torch.Tensor:
        """Positions the cached tokens hold now, ending right before ``block_start``: ``[1, T]``, consecutive in
        every head, or ``[H, T]`` when the heads keep different tokens (:attr:`KVCache.heads_apart`): then
        the distinct tokens of all heads take consecutive positions in stream order, so a token has one
        position in every head that holds it (:func:`kvcli.kv.joined.union_offsets`)."""
        if self.owner.heads_apart:
            return block_start - union_offsets([self.token_idx])
        length = self.get_seq_length()
        return torch.arange(block_start - length, block_start, device=self.device)[None, :]

    def needs_rotation(self, block_start: int) -> bool:
        """Whether a forward starting at ``block_start`` sees some cached key away from where it entered."""
        length = self.get_seq_length()
        return not (length == 0 or self.owner.keep_positions or (not self.moved and block_start == length))

    def current_keys(self, block_start: int) -> torch.Tensor:
        """Cached keys rotated to their current positions (a no-op until an eviction moves them)."""
        keys = stored(self.keys)  # dequantized when the cache is quantized
        if self.pre_rope:  # where a key sits now: its stream index where positions are kept, else re-assigned
            at = self.token_idx if self.owner.keep_positions else self.current_positions(block_start)
            return rotate_keys(keys, at, self.inv_freq)
        if not self.needs_rotation(block_start):
            return keys  # every key still sits where it entered
        joined = self.owner.rotation.keys(self, block_start)  # rotated with other layers' (KVCache.plan_rotation)
        if joined is not None:
            return joined
        delta = self.current_positions(block_start) - self.entry_pos
        return rotate_keys(keys, delta, self.inv_freq)

    def join_kind(self, rotation: bool) -> tuple | None:
        """What layers must share for their keys to be rotated (``rotation``) or their tokens kept as one batch
        (:mod:`kvcli.kv.joined`); None: this layer does it alone (a quantized store, a layer with its own layout).
        """
        own = type(self).current_keys if rotation else type(self).keep
        if own is not (CompressedLayer.current_keys if rotation else CompressedLayer.keep):
            return None
        if not (isinstance(self.keys, torch.Tensor) and isinstance(self.values, torch.Tensor)):
            return None
        shape = (self.keys.shape[1], self.keys.shape[-1], self.keys.dtype, self.keys.device)
        if rotation:
            return (*shape, self.owner.freq_group[self.layer_idx])
        length = self.get_seq_length()
        if any(value.shape[1] != length for value in self.state.values()):
            return None
        return (*shape, self.values.shape[-1], tuple((name, value.dtype) for name, value in self.state.items()))

    @property
    def inv_freq(self) -> torch.Tensor:
        """The RoPE frequencies this layer's keys were rotated with."""
        return self.owner.inv_freqs[self.layer_idx]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Attention computed by the layer itself, or None for kvcli's ordinary attention.

        A layer that stores keys in its own layout (PoD's shared distant keys) answers with the
        output ``[1, H_q, n, D]`` and the window's attention ``[H_kv, group, T]`` (or None).
        """
        return None

    def nbytes(self) -> int:
        """Bytes held: keys and values (:meth:`LayerStorage.nbytes`) and the bookkeeping kept beside them."""
        return super().nbytes() + self.bookkeeping_bytes()

    def bookkeeping_bytes(self) -> int:
        """Bytes of what is kept beside the keys and values: each token's entry position (where kept), stream index
        and per-token method state (what :func:`kvcli.kv.quant.bookkeeping_bytes` prices), and any tensor the method
        keeps for the whole layer."""
        if self.token_idx is None:
            return 0
        layer = [value for value in self.method_state.values() if isinstance(value, torch.Tensor)]
        positions = (self.token_idx,) if self.entry_pos is None else (self.entry_pos, self.token_idx)
        return sum(t.numel() * t.element_size() for t in (*positions, *self.state.values(), *layer))

    def keep(self, indices: torch.Tensor) -> None:
        """Keep, per KV head, the tokens at ``indices`` ``[H, k]`` (ascending), dropping the rest.

        :meth:`KVCache.keep_layers` does the same for many layers at once."""
        self.gather(indices)
        if self.entry_pos is not None:
            self.entry_pos = self.entry_pos.gather(1, indices)
        self.token_idx = self.token_idx.gather(1, indices)
        self.state = {name: value.gather(1, indices) for name, value in self.state.items()}
        self.moved = True


class WindowLayer(CompressedLayer):
    """A layer the model restricts to its last ``window`` positions: it keeps the ``window - 1`` tokens
    the next query can see and nothing else, so no method ever has to choose among them."""

    is_sliding = True

    def __init__(self, owner: KVCache, layer_idx: int, window: int):
        super().__init__(owner, layer_idx)
        self.window = window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if not self.owner.probing:  # attention still sees the whole block; the cache keeps only the window
            length = self.get_seq_length()
            extra = length - (self.window - 1)
            if extra > 0:
                heads = self.values.shape[1]
                self.keep(torch.arange(extra, length, device=self.device).expand(heads, length - extra))
        return keys, values


class KVCache(Cache):
    """The cache the engine hands to the model: one :class:`CompressedLayer` per decoder layer.

    ``block_start`` is the position the next forward's first token gets; ``stream_start`` is that
    token's index in the whole stream. The engine sets both before each forward, and ``subset`` when
    a layer receives only some of the block's tokens (a nested forward). ``inv_freq`` is one
    tensor of RoPE frequencies for every layer or one per layer; ``windows`` gives each layer's
    attention window (None: full attention).
    """

    def __init__(self, num_layers: int, inv_freq: torch.Tensor | Sequence[torch.Tensor],
                 windows: Sequence[int | None] | None = None):
        self.windows = list(windows) if windows is not None else [None] * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} windows for {num_layers} layers")
        super().__init__(layers=[self.new_layer(i) for i in range(num_layers)])
        self.inv_freqs = [inv_freq] * num_layers if isinstance(inv_freq, torch.Tensor) else list(inv_freq)
        self.block_start = 0
        self.stream_start = 0
        self.score_window = 0  # how many of a forward's last queries record their attention
        self.score_skip = 0  # how many queries after those do not (a question's chat-template tail)
        #: The recorded queries are the question's (the reader's instruction), not the text's: see Engine.forward.
        self.question_scores = False
        self.probing = False
        #: Layers' window logits waiting for their softmax, batched after the forward (:mod:`kvcli.kv.scores`).
        self.waiting: list = []
        self.keep_positions = False  # True: no re-assignment, a token's position is its index in the stream
        #: The method keeps different tokens in different KV heads: re-assigned positions follow the stream
        #: order of the tokens all heads of a layer hold together, not each head's own count
        #: (:meth:`CompressedLayer.current_positions`). Set by :func:`kvcli.engine.cache_factory.new_cache`.
        self.heads_apart = False
        #: Quantized keys and values (``--kv-bits`` 8, 4, 2; see :mod:`kvcli.kv.quant`), or None: the model's
        #: precision. Set before the first forward (:meth:`quantize`).
        self.kv_quant: KVQuant | None = None
        #: In a nested forward (PyramidInfer, see :meth:`kvcli.engine.engine.Engine.forward`), the offsets in the
        #: block ``[n_l]`` (ascending) of the tokens the current layer receives; None: every token of the block.
        self.subset: torch.Tensor | None = None
        #: Layers whose RoPE frequencies are equal share a number here: their keys rotate as one batch.
        self.freq_group = _equal_groups(self.inv_freqs)
        self._entries: tuple | None = None
        #: Which layers rotate their cached keys together in the current forward (:meth:`plan_rotation`).
        self.rotation = RotationPlan()

    def new_entries(self, heads: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry positions and stream indices ``[heads, count]`` of the tokens a layer appends in this forward.

        Every layer of a forward appends the same tokens (unless a nested forward gives it a ``subset``),
        so they are made once per forward, not once per layer."""
        key = (self.block_start, self.stream_start, heads, count, device)
        if self._entries is not None and self._entries[0] == key and self._entries[1] is self.subset:
            return self._entries[2], self._entries[3]
        if self.subset is None:
            offsets = torch.arange(count, device=device, dtype=POSITION_DTYPE)
        else:  # a nested forward: this layer sees only the block's tokens the layer below kept
            offsets = self.subset.to(device=device, dtype=POSITION_DTYPE)
        positions = (self.block_start + offsets).expand(heads, count)
        tokens = (self.stream_start + offsets).expand(heads, count)
        self._entries = (key, self.subset, positions, tokens)
        return positions, tokens

    def plan_rotation(self) -> None:
        """Before a forward: rotate the cached keys of layers that stand alike as one batch each, when the first
        of them reads its keys (:class:`kvcli.kv.joined.RotationPlan`), rather than one layer at a time."""
        self.rotation.plan(self.layers, self.block_start, self.heads_apart)

    def clear_rotation(self) -> None:
        """Drop what :meth:`plan_rotation` planned or computed (after a forward: frees the rotated keys)."""
        self.rotation.clear()

    def keep_layers(self, kept: Sequence[tuple[CompressedLayer, torch.Tensor]]) -> None:
        """:meth:`CompressedLayer.keep` of many layers: layers that stand alike keep their tokens with
        one gather per tensor (:func:`kvcli.kv.joined.keep_joined`), the others one by one."""
        alone, batches = alike_batches(kept, lambda pair: pair[0].join_kind(rotation=False),
                                       lambda pair: pair[0].keys.numel() + pair[0].values.numel())
        for layer, indices in alone:
            layer.keep(indices)
        for pairs in batches:
            keep_joined(pairs)

    def forget(self, stream: torch.Tensor) -> int:
        """Drop from every layer without a window the tokens of ``stream`` (stream indices) that all its KV heads
        hold; how many entries went. A reader calls it right before it reads those tokens again (the recap): a read
        may keep a passage cut short to its clusters, and beside a whole copy at a new position an answer can follow
        the cut one (docs/notes/2026-12-05-recap-passage-share.md). A token only some heads hold stays, since a
        layer keeps as many tokens in every head."""
        kept = []
        for layer in self.layers:
            tokens = layer.token_idx
            if layer.window is not None or tokens is None or not tokens.numel():
                continue
            inside = torch.isin(tokens, stream.to(tokens.device))
            candidates = tokens[inside].unique()
            common = candidates[torch.stack([torch.isin(candidates, row) for row in tokens]).all(0)]
            if common.numel():
                rest = ~torch.isin(tokens, common)
                kept.append((layer, rest.nonzero(as_tuple=True)[1].view(tokens.shape[0], -1)))
        gone = sum(layer.token_idx.numel() - indices.numel() for layer, indices in kept)
        self.keep_layers(kept)
        return gone

    def quantize(self, bits: int, keys: str | None = None, key_norm: bool = False) -> KVCache:
        """Store keys and values at ``bits`` bits from now on (16: the model's precision), keys rounded the
        ``keys`` way (None: :data:`kvcli.kv.quant.DEFAULT_KEYS`), ``key_norm`` whether the model normalizes its
        keys (:attr:`kvcli.kv.quant.KVQuant.key_norm`); before any token."""
        if any(layer.is_initialized for layer in self.layers):
            raise RuntimeError("a cache is quantized before it holds any token")
        self.kv_quant = None if bits == 16 else KVQuant(bits, keys=keys, key_norm=key_norm)
        return self

    def new_layer(self, layer_idx: int) -> CompressedLayer:
        """The layer object of decoder layer ``layer_idx``: a subclass may store keys differently (PoD)."""
        window = self.windows[layer_idx]
        return CompressedLayer(self, layer_idx) if window is None else WindowLayer(self, layer_idx, window)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> KVCache:
        """A cache for ``model``: each layer's own RoPE frequencies and window (UnsupportedModelError without RoPE)."""
        arch = describe(model)
        return cls(len(arch.layers), [layer.inv_freq for layer in arch.layers], arch.windows)

    def next_position(self) -> int:
        """The position of the next token: every layer's cache ends right before it (or, with
        ``keep_positions``, its index in the stream)."""
        if self.keep_positions:
            return self.stream_start
        return max(layer.get_seq_length() for layer in self.layers)

    def lengths(self) -> list[int]:
        return [layer.get_seq_length() for layer in self.layers]

    def max_tokens(self) -> int:
        """The largest layer a budget governs (every layer when all of them have a window): what
        ``max_cache_tokens`` reports, since a window layer holds its window whatever the budget."""
        budgeted = [layer.get_seq_length() for layer in self.layers if layer.window is None]
        return max(budgeted or self.lengths())

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def _equal_groups(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A number per tensor, the same for equal tensors (read once, when a cache is made)."""
    firsts: list[torch.Tensor] = []
    groups = []
    for tensor in tensors:
        for i, first in enumerate(firsts):
            if first is tensor or (first.shape == tensor.shape and torch.equal(first, tensor.to(first.device))):
                groups.append(i)
                break
        else:
            groups.append(len(firsts))
            firsts.append(tensor)
    return groups


@dataclass
class LayerView:
    """What a compression method sees of one layer after a forward pass.

    ``num_new`` tokens were appended since the last compression; ``record`` holds the attention
    of the last ``record.window`` queries (None when the method asked for no scores). ``decoding``
    is set while a model writes after reading a prompt, for methods whose papers treat generation
    differently from reading (SnapKV and PyramidKV compress the prompt once). ``seen`` counts the
    stream tokens read so far; ``mean_budget`` is the budget the layers' budgets average (None when
    the caller gave the layer's budget alone).
    """

    layer_idx: int
    num_layers: int
    layer: CompressedLayer
    num_new: int
    record: AttentionRecord | None
    decoding: bool = False
    seen: int = 0
    mean_budget: int | None = None
    #: The layer's last ``question`` tokens are the reader's question (and the assistant's start): a
    #: scored method keeps them, since the answer is written from them.
    question: int = 0
    #: The layer's last ``held`` tokens (the question and what the reader put right before it: after the recap
    #: of a streamed ``ask``, the whole last block) are kept by a scored method whatever they score, within a
    #: share of the layer (:meth:`kvcli.methods.base.ScoredMethod.protected`).
    held: int = 0

    @property
    def length(self) -> int:
        return self.layer.get_seq_length()

    @property
    def num_heads(self) -> int:
        return self.layer.values.shape[1]  # values hold every KV head (PoD keeps some keys only in a lead)

    @property
    def token_idx(self) -> torch.Tensor:
        return self.layer.token_idx

    @property
    def method_state(self) -> dict[str, object]:
        """The method's values for the whole layer (TreeKV's sweep index), reset with the layer."""
        return self.layer.method_state

    def per_token(self, name: str, fill: float = 0.0) -> torch.Tensor:
        """A method's per-token state ``[H, T]``, padded with ``fill`` for the tokens that just arrived.

        The tensor lives in the layer and is gathered with keys and values on every eviction, so a
        score accumulated over many blocks follows its token.
        """
        state = self.layer.state.get(name)
        if state is None:
            state = torch.full((self.num_heads, 0), fill, dtype=torch.float32, device=self.layer.device)
        missing = self.length - state.shape[1]
        if missing > 0:
            pad = torch.full((self.num_heads, missing), fill, dtype=state.dtype, device=state.device)
            state = torch.cat((state, pad), dim=1)
        self.layer.state[name] = state
        return state

    def set_per_token(self, name: str, value: torch.Tensor) -> None:
        """Replace a per-token state ``[H, T]`` (methods build new tensors rather than edit inference tensors)."""
        self.layer.state[name] = value
