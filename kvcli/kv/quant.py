"""A quantized KV cache under eviction: cached keys and values packed to 8, 4 or 2 bits (``--kv-bits``).

What one layer's keys (or values) ``[1, H, T, D]`` become (:class:`QuantizedTokens`):

* the *sealed* tokens: integers of ``bits`` bits packed into bytes (one 8-bit, two 4-bit or four 2-bit
  values per byte), rounded either per token, with a scale and a zero point in fp16 per group of
  :data:`GROUP` channels (asymmetric min-max rounding, KIVI's value scheme), or per channel on a grid fixed
  per head (keys at 2 bits, stored before RoPE: KIVI's and KVQuant's key scheme);
* the *residual*: the last :data:`RESIDUAL` tokens in the model's own precision; a token is sealed
  (quantized, once) as soon as a newer block pushes it out of that window.

**Rotation** (4 and 2 bits, :data:`ROTATE`): before a token is rounded, each head's vector is multiplied by a
fixed orthonormal matrix (a normalized Hadamard matrix, :func:`rotation`), and multiplied back when read, as
QuaRot and QuIP# do. The rotation spreads an outlier channel's energy over every channel, so a group's range
fits its bulk instead of its largest value; it is per token, so it travels with the token under eviction
and costs no bytes; per-channel keys of a model that normalizes its keys are not rotated (:meth:`KVQuant.rotates`).
Per-channel key grids span the calibration tokens' 1st to 99th percentile
(:data:`CLIP`), not their extremes: the rare value outside is clamped, and every other one rounds on a
finer grid. The measurements behind both choices are in docs/notes/2026-11-29-rotated-2-bit.md.

Why keys are not rounded per channel over groups of tokens, as in KIVI: eviction keeps any subset of
tokens per head, so the tokens of a token group part ways; each survivor would drag its group's scales
along, or be re-rounded with new neighbours, adding error at every eviction. A per-token group travels
with its token, and a per-channel grid fixed once per head never moves: any ``keep`` is an exact gather,
and a token is rounded once in its life (re-sealing a token that had to be dequantized gives back the same
integers, up to the model dtype's rounding, since rounding grid values again on the same grid is idempotent).

Everything that reads the cache (attention, and through it every method's scores) sees the
dequantized tensors (:meth:`QuantizedTokens.dense`); the new block's own keys and values are
attended at full precision.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from kvcli.errors import UsageError
from kvcli.io.lazy import torch
from kvcli.kv.architecture import head_shape
from kvcli.kv.basis import KeyBasis, grid_bytes, grid_when_ready, query_weight

#: The bit widths ``--kv-bits`` takes: 16 is the model's own precision (nothing quantized).
KV_BITS = (16, 8, 4, 2)
#: How keys are rounded (``--kv-keys``): per token in groups of channels, per channel with fixed scales, or on
#: fixed principal axes weighed by the queries (:mod:`kvcli.kv.basis`). The last two store keys before RoPE.
KEY_MODES = ("token", "channel", "pca")
#: The key modes whose fixed grid is fitted to keys before RoPE (:attr:`kvcli.kv.storage.LayerStorage.pre_rope`).
PRE_ROPE_MODES = ("channel", "pca")
#: The key mode each bit width uses unless told (chosen on the tuning books: docs/notes/2026-11-27-low-bit-keys.md,
#: docs/notes/2026-12-05-keys-on-their-own-axes.md).
DEFAULT_KEYS = {8: "token", 4: "token", 2: "pca"}
#: The same for a model that normalizes its keys (Gemma 3): a ``pca`` grid's axes cost a head ``D x D`` bytes, dear
#: in such models' wide heads, and their normalized keys already fit a per-channel grid.
NORMED_DEFAULT_KEYS = {8: "token", 4: "token", 2: "channel"}
#: Whether each bit width rotates before rounding (:func:`rotation`; not 8 bits, whose rounding is already fine).
ROTATE = {8: False, 4: True, 2: True}
#: Channels per scale/zero group (per token) at each bit width, rotated: a whole head of 64 channels (fewer in a
#: smaller head). Without the rotation 2 bits needs groups of 32 (docs/methods.md, "Quantized KV cache").
GROUP = {8: 64, 4: 64, 2: 64}
UNROTATED_GROUP = {8: 64, 4: 64, 2: 32}
#: Share of the calibration tokens' values a per-channel key grid leaves outside at each end (clamped).
CLIP = 0.01
#: Most recent tokens of each layer kept at full precision (KIVI's residual).
RESIDUAL = 32
#: With per-channel keys, the first tokens each head holds stay at full precision (the attention sinks: their
#: keys lie far outside the other tokens' channel ranges, which would otherwise set the scales).
SINKS = 4
#: Bytes of one scale or zero point (fp16) of a per-token group.
PARAM_BYTES = 2
#: Bytes of one per-channel scale or zero point (fp32: fixed per layer and head, so precision costs nothing).
CHANNEL_PARAM_BYTES = 4
#: fp16's largest finite value: per-token scales and zero points are fp16, so inputs are clamped to it.
FP16_MAX = 65504.0


def check_kv_bits(bits: int, flag: str = "--kv-bits") -> int:
    """``bits`` if it is one of :data:`KV_BITS`, else a one-line :class:`UsageError`."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in KV_BITS:
        raise UsageError(f"{flag} must be 16, 8, 4 or 2 (bits per cached key and value element), not {bits}")
    return bits


def check_kv_keys(mode: str | None, flag: str = "--kv-keys") -> str | None:
    """``mode`` if one of :data:`KEY_MODES`, None for None or ``auto`` (:data:`DEFAULT_KEYS`), else a UsageError."""
    if mode is None or mode == "auto":
        return None
    if mode not in KEY_MODES:
        raise UsageError(f"{flag} must be auto, token, channel or pca (how cached keys are rounded), not {mode}")
    return mode


@dataclass(frozen=True)
class KVQuant:
    """How a cache quantizes: ``bits`` per element, ``group`` channels per scale, ``residual`` full-precision
    tokens, ``keys`` the key mode (None: :data:`DEFAULT_KEYS`), ``sinks`` full-precision first tokens
    (None: :data:`SINKS` for per-channel keys, 0 otherwise), ``rotate`` whether tokens are rotated before
    rounding (None: :data:`ROTATE`), ``key_norm`` whether the model normalizes its keys (a q/k norm, as Gemma 3):
    then per-channel keys are not rotated (:meth:`rotates`)."""

    bits: int
    group: int | None = None  # None: GROUP[bits] (UNROTATED_GROUP without the rotation)
    residual: int = RESIDUAL
    keys: str | None = None
    sinks: int | None = None
    rotate: bool | None = None
    key_norm: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (8, 4, 2):
            raise ValueError(f"a quantized cache takes 8, 4 or 2 bits, not {self.bits}")
        if self.keys is not None and self.keys not in KEY_MODES:
            raise ValueError(f"keys are rounded per token, per channel or on axes (pca), not {self.keys!r}")

    @property
    def key_mode(self) -> str:
        return self.keys or (NORMED_DEFAULT_KEYS if self.key_norm else DEFAULT_KEYS)[self.bits]

    @property
    def rotated(self) -> bool:
        return ROTATE[self.bits] if self.rotate is None else self.rotate

    def rotates(self, mode: str) -> bool:
        """Whether a store rounding the ``mode`` way rotates its tokens first. Not per-channel keys of a model that
        normalizes its keys: each channel of such keys keeps a fixed scale (the norm's weight), which a per-channel
        grid fits as it is and a rotation would blur into every channel (measured on one model of each kind:
        docs/notes/2026-11-29-rotated-2-bit.md)."""
        return self.rotated and mode != "pca" and not (mode == "channel" and self.key_norm)

    @property
    def front(self) -> int:
        """Full-precision first tokens of every store of this cache."""
        if self.sinks is not None:
            return self.sinks
        return SINKS if self.key_mode in PRE_ROPE_MODES else 0

    def group_of(self, dim: int) -> int:
        """Channels per group for a head of ``dim`` channels (a divisor of ``dim``)."""
        group = min(self.group or (GROUP if self.rotated else UNROTATED_GROUP)[self.bits], dim)
        while dim % group:
            group -= 1
        return group

    def token_bytes(self, dim: int, mode: str = "token") -> int:
        """Bytes one sealed token costs per KV head for a ``dim``-channel key or value: payload, and per-token
        scales and zeros when rounded per token (per-channel parameters are paid once per head, :meth:`head_bytes`)."""
        if mode in PRE_ROPE_MODES:
            return packed_width(dim, self.bits)
        return packed_width(dim, self.bits) + 2 * PARAM_BYTES * (dim // self.group_of(dim))

    def head_bytes(self, dim: int, mode: str = "token") -> int:
        """Bytes a store pays once per KV head, whatever it holds: per-channel scales and zero points, or a ``pca``
        grid (:class:`~kvcli.kv.basis.KeyBasis`)."""
        if mode == "pca":
            return grid_bytes(dim)
        return 2 * CHANNEL_PARAM_BYTES * dim if mode == "channel" else 0


def per_byte(bits: int) -> int:
    return 8 // bits


def packed_width(dim: int, bits: int) -> int:
    """Bytes that hold ``dim`` values of ``bits`` bits."""
    return -(-dim * bits // 8)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers ``[..., D]`` in ``[0, 2**bits)`` (uint8) as bytes ``[..., ceil(D * bits / 8)]``, first value lowest."""
    if bits == 8:
        return q.to(torch.uint8)
    n = per_byte(bits)
    dim = q.shape[-1]
    pad = -dim % n
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // n, n)  # explicit: a store of no head has no elements
    out = q[..., 0].clone()
    for i in range(1, n):
        out |= q[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of :func:`pack`: uint8 integers ``[..., dim]``."""
    if bits == 8:
        return packed
    n = per_byte(bits)
    shifts = torch.arange(0, bits * n, bits, dtype=torch.uint8, device=packed.device)
    q = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return q.flatten(-2)[..., :dim]


def _fp16_toward(x: torch.Tensor, down: bool) -> torch.Tensor:
    """``x`` (fp32) as the nearest fp16 at or below it (``down``) or at or above it."""
    half = x.to(torch.float16)
    off = half.float() > x if down else half.float() < x
    away = torch.full_like(half, float("-inf") if down else float("inf"))
    return torch.where(off, torch.nextafter(half, away), half)


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max rounding of ``x`` ``[..., D]`` per group of ``group`` consecutive channels.

    Returns the packed integers ``[..., packed_width(D)]`` and fp16 scale and zero ``[..., D / group]``.
    The zero point is the group's minimum rounded down to fp16 and the scale its range over the levels
    rounded up, so the grid ``zero + scale * [0, 2**bits - 1]`` covers the whole group and :func:`dequantize`
    is within half a (stored) step of ``x``: ``|x - x'| <= scale / 2``, up to fp32 arithmetic. fp16 holds
    the parameters (4 bytes per group; fp32 would add up to a third at 2 bits), so ``x`` is first clamped to
    fp16's finite range (+-65,504): a value beyond it comes back as that bound, never as inf or nan.
    """
    dim = x.shape[-1]
    grouped = x.float().clamp(-FP16_MAX, FP16_MAX).view(*x.shape[:-1], dim // group, group)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    levels = (1 << bits) - 1
    zero = _fp16_toward(low, down=True)
    scale = _fp16_toward(((high - zero.float()) / levels).clamp_min(1e-6), down=False)
    q = ((grouped - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, levels)
    return pack(q.to(torch.uint8).view(*x.shape[:-1], dim), bits), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Values ``[..., dim]`` in ``dtype`` from :func:`quantize`'s output."""
    groups = scale.shape[-1]
    q = unpack(packed, bits, dim).view(*packed.shape[:-1], groups, dim // groups).float()
    x = q * scale.float()[..., None] + zero.float()[..., None]
    return x.view(*packed.shape[:-1], dim).to(dtype)


def channel_params(x: torch.Tensor, bits: int, clip: float = CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel fp32 scale and zero ``[1, H, 1, D]`` spanning the tokens of ``x`` ``[1, H, n, D]`` from the
    ``clip`` to the ``1 - clip`` quantile of each channel (0: min to max)."""
    x = x.float()
    if clip:
        low = x.quantile(clip, dim=2, keepdim=True)
        high = x.quantile(1 - clip, dim=2, keepdim=True)
    else:
        low = x.amin(dim=2, keepdim=True)
        high = x.amax(dim=2, keepdim=True)
    return ((high - low) / ((1 << bits) - 1)).clamp_min(1e-6), low


def quantize_channels(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` ``[1, H, n, D]`` rounded on fixed per-channel grids (:func:`channel_params`), packed.

    Within a channel's calibrated range the error is at most half that channel's step; a value outside
    (beyond the calibration's clipped quantiles, or a later token's outlier) is clamped to the range's nearer
    end. Scales and zeros are fp32, so no magnitude overflows them.
    """
    q = ((x.float() - zero) / scale).round_().clamp_(0, (1 << bits) - 1)
    return pack(q.to(torch.uint8), bits)


def dequantize_channels(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dim: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Values ``[1, H, n, dim]`` in ``dtype`` from :func:`quantize_channels`' output."""
    return (unpack(packed, bits, dim).float() * scale + zero).to(dtype)


@functools.lru_cache(maxsize=16)
def rotation(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed orthonormal ``[dim, dim]`` fp32 matrix a rotated store multiplies each token by before rounding.

    A normalized Sylvester-Hadamard matrix when ``dim`` is a power of two (every entry ``+-1/sqrt(dim)``: each
    rotated channel is an equal-weight mix of all channels); otherwise a random orthonormal matrix from a fixed
    seed. Both are a pure function of ``dim``, so a saved store needs only the fact that it was rotated.
    """
    if dim & (dim - 1) == 0:
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < dim:
            matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
        matrix = matrix / dim ** 0.5
    else:
        gaussian = torch.randn(dim, dim, generator=torch.Generator().manual_seed(dim), dtype=torch.float64)
        matrix = torch.linalg.qr(gaussian).Q.float()
    return matrix.to(device)


class QuantizedTokens:
    """One layer's keys or values ``[1, H, T, D]`` in three parts, in stream order: the first ``front`` tokens
    of every head at full precision (the attention sinks, with keys rounded before RoPE), then the sealed tokens
    packed, then the last ``residual`` at full precision.

    ``mode`` ``token``: each sealed token carries its own scale and zero per group of channels. ``channel``: one
    fp32 scale and zero per head and channel, fixed when the store first seals and never changed, so no later
    eviction or arrival moves another token's grid (KIVI's and KVQuant's key scheme, on keys before RoPE, where a
    channel's range is stable); in a rotated store, the rotated channels. ``pca``: a grid on each head's axes
    (:class:`~kvcli.kv.basis.KeyBasis`), fixed once the first block's queries have been seen (:meth:`observe`).
    Offers what the cache layers need of a tensor (``shape``, ``dtype``, ``device``) and :meth:`append`,
    :meth:`dense`, :meth:`gather`, :meth:`nbytes`.
    """

    def __init__(self, like: torch.Tensor, config: KVQuant, mode: str = "token"):
        _, heads, _, dim = like.shape
        self.config, self.mode = config, mode
        self.bits = config.bits
        self.group = config.group_of(dim)
        self.sinks = config.front
        self.dim = dim
        self.dtype, self.device = like.dtype, like.device
        width = packed_width(dim, self.bits)
        self.packed = torch.empty((1, heads, 0, width), dtype=torch.uint8, device=self.device)
        params = (1, heads, 0, dim // self.group) if mode == "token" else (1, heads, 0, dim)
        self.scale = torch.empty(params, dtype=torch.float16 if mode == "token" else torch.float32, device=self.device)
        self.zero = torch.empty_like(self.scale)
        self.front = like.new_empty((1, heads, 0, dim))
        self.tail = like.new_empty((1, heads, 0, dim))
        self.rotation = rotation(dim, self.device) if config.rotates(mode) else None
        self.grid: KeyBasis | None = None  # mode pca: the axes, fixed at the first seal
        self.queries, self.observed = None, 0  # mode pca, until the grid is fixed: the queries' weights, blocks seen

    # --- what the cache reads of a tensor ------------------------------------------------------
    @property
    def sealed(self) -> int:
        return self.packed.shape[2]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, self.tail.shape[1], self.front.shape[2] + self.sealed + self.tail.shape[2], self.dim))

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense()[index]

    # --- storage ---------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """Add tokens ``[1, H, n, D]`` after the others, then seal all but the front and the last ``residual``."""
        self.tail = torch.cat((self.tail, x.to(self.dtype)), dim=2)
        self._seal()

    def _seal(self) -> None:
        room = self.sinks - self.front.shape[2]
        if room > 0 and self.sealed == 0:  # the front fills first, with the first tokens
            take = min(room, self.tail.shape[2])
            self.front = torch.cat((self.front, self.tail[:, :, :take]), dim=2)
            self.tail = self.tail[:, :, take:]
        count = self.tail.shape[2] - self.config.residual
        if count > 0 and self.mode == "pca" and self.grid is None:
            self.grid = grid_when_ready(self.tail[:, :, :count], self.queries, self.observed, self.bits)
            self.queries = None if self.grid is not None else self.queries  # weighed into the grid
        if count <= 0 or (self.mode == "pca" and self.grid is None):
            return
        rows = self.tail[:, :, :count]
        if self.rotation is not None:
            rows = rows.float() @ self.rotation
        if self.mode == "token":
            packed, scale, zero = quantize(rows, self.bits, self.group)
            self.scale = torch.cat((self.scale, scale), dim=2)
            self.zero = torch.cat((self.zero, zero), dim=2)
        elif self.mode == "pca":
            packed = self.grid.encode(rows)
        else:
            if self.scale.shape[2] == 0:  # the grid is fixed by the first tokens sealed
                self.scale, self.zero = channel_params(rows, self.bits)
            packed = quantize_channels(rows, self.scale, self.zero, self.bits)
        self.packed = torch.cat((self.packed, packed), dim=2)
        self.tail = self.tail[:, :, count:].clone()  # a view would keep the sealed rows' memory alive

    def observe(self, query: torch.Tensor) -> None:
        """The queries ``[1, H_q, n, D]`` of a block that attended these keys: a ``pca`` store weighs its axes by
        them (:func:`~kvcli.kv.basis.query_weight`) until its grid is fixed, then seals what waited."""
        if self.mode != "pca" or self.grid is not None:
            return
        weight = query_weight(query, self.tail.shape[1])
        self.queries = weight if self.queries is None else (self.queries * self.observed + weight) / (self.observed + 1)
        self.observed += 1
        self._seal()  # what waited for the grid

    def _unseal(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        if self.mode == "pca":
            return self.grid.decode(packed, self.dtype)
        dtype = self.dtype if self.rotation is None else torch.float32
        if self.mode == "token":
            x = dequantize(packed, scale, zero, self.bits, self.dim, dtype)
        else:
            x = dequantize_channels(packed, self.scale, self.zero, self.bits, self.dim, dtype)
        return x if self.rotation is None else (x @ self.rotation.T).to(self.dtype)

    def dense(self) -> torch.Tensor:
        """Every token ``[1, H, T, D]`` in the model's dtype: the front, the sealed ones dequantized, the residual."""
        if self.sealed == 0:
            return torch.cat((self.front, self.tail), dim=2) if self.front.shape[2] else self.tail
        parts = (self.front, self._unseal(self.packed, self.scale, self.zero), self.tail)
        return torch.cat(parts if self.front.shape[2] else parts[1:], dim=2)

    def _full_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Tokens at ``idx`` ``[H, k]`` (store order) at full precision, whichever part holds them."""
        front, sealed = self.front.shape[2], self.sealed
        out = self.tail.new_zeros((1, idx.shape[0], idx.shape[1], self.dim))
        if self.tail.shape[2]:
            out = _rows(self.tail, (idx - front - sealed).clamp(min=0))
        if sealed:
            at = (idx - front).clamp(0, sealed - 1)
            params = (_rows(self.scale, at), _rows(self.zero, at)) if self.mode == "token" else (None, None)
            unsealed = self._unseal(_rows(self.packed, at), *params)
            out = torch.where((idx < front + sealed)[None, :, :, None], unsealed, out)
        if front:
            out = torch.where((idx < front)[None, :, :, None], _rows(self.front, idx.clamp(max=front - 1)), out)
        return out

    def gather(self, indices: torch.Tensor) -> None:
        """Keep, per head, the tokens at ``indices`` ``[H, k]`` (ascending), exactly: no token is rounded again.

        The first ``front`` kept tokens form the new front (a sealed one dequantized). Of the others, the
        first ``s`` of every head, ``s`` the fewest sealed ones any head keeps, stay packed (their bytes
        gathered); the rest join the residual (a sealed one dequantized), which is sealed again down to
        ``residual`` tokens (rounding grid values again on the same grid gives the same integers).
        """
        heads, count = indices.shape
        front, sealed = self.front.shape[2], self.sealed
        lead = min(self.sinks, count)
        new_front = self._full_rows(indices[:, :lead])
        rest = indices[:, lead:]
        in_packed = (rest >= front) & (rest < front + sealed)
        sealed_kept = int(in_packed.sum(dim=1).min()) if sealed and heads and rest.shape[1] else 0
        head = rest[:, :sealed_kept] - front
        new_tail = self._full_rows(rest[:, sealed_kept:])
        self.packed = _rows(self.packed, head)
        if self.mode == "token":
            self.scale = _rows(self.scale, head)
            self.zero = _rows(self.zero, head)
        self.front, self.tail = new_front, new_tail
        self._seal()

    def nbytes(self) -> int:
        """Bytes held: packed integers, scales, zeros, the exact front and residual, a grid or its queries' weights."""
        waiting = [] if self.queries is None else [self.queries]
        parts = (self.packed, self.scale, self.zero, self.front, self.tail, *waiting)
        return sum(t.numel() * t.element_size() for t in parts) + (self.grid.nbytes() if self.grid else 0)


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` ``[1, H, n, ...]`` at ``idx`` ``[H, k]``."""
    return t.gather(2, idx[None, :, :, None].expand(1, idx.shape[0], idx.shape[1], t.shape[-1]))


def stored(x: torch.Tensor | QuantizedTokens) -> torch.Tensor:
    """A layer's keys or values as one dense tensor (dequantized when quantized)."""
    return x.dense() if isinstance(x, QuantizedTokens) else x


def nbytes(x: torch.Tensor | QuantizedTokens | None) -> int:
    if x is None:
        return 0
    if isinstance(x, QuantizedTokens):
        return x.nbytes()
    return x.numel() * x.element_size()


def gather_tokens(x: torch.Tensor | QuantizedTokens, indices: torch.Tensor) -> torch.Tensor | QuantizedTokens:
    """``x`` ``[1, H, T, D]`` kept at ``indices`` ``[H, k]`` per head (a quantized store gathered in place)."""
    if isinstance(x, QuantizedTokens):
        x.gather(indices)
        return x
    from kvcli.kv.joined import wide_index

    return x.gather(2, wide_index(indices, x.shape[-1]))


def cache_bytes(config, tokens: int, bits: int, dtype: torch.dtype, keys: str | None = None, states: int = 0,
                windows: Sequence[int | None] | None = None) -> int:
    """Bytes a plain (non-PoD) cache of ``tokens`` per budgeted layer costs on a model with ``config`` at ``bits``,
    keys rounded the ``keys`` way (None: :data:`DEFAULT_KEYS`), each token of each layer and KV head paying its
    bookkeeping besides, with ``states`` per-token values of the method (:func:`bookkeeping_bytes`).

    ``windows`` gives each layer's attention window (None: every layer full): a layer with a window W keeps its
    W - 1 tokens whatever the budget, with their positions and no method state (:class:`kvcli.kv.cache.WindowLayer`).
    """
    layers = windows if windows is not None else [None] * config.num_hidden_layers
    return sum(layer_bytes(config, tokens, bits, dtype, keys, states) if window is None
               else layer_bytes(config, window - 1, bits, dtype, keys) for window in layers)


def layer_bytes(config, tokens: int, bits: int, dtype: torch.dtype, keys: str | None = None, states: int = 0) -> int:
    """Bytes one layer of ``tokens`` costs (every KV head; :func:`cache_bytes`).

    16 bits: keys and values in ``dtype``. Fewer: the front and the residual at full precision, every other
    token sealed (:meth:`KVQuant.token_bytes` for keys and values), and the per-head parameters.
    """
    kv_heads, head_dim = head_shape(config)
    element = torch.tensor([], dtype=dtype).element_size()
    full = 2 * head_dim * element
    if bits == 16:
        return kv_heads * tokens * (full + bookkeeping_bytes(states))
    quant = KVQuant(bits, keys=keys)
    front = min(tokens, quant.front)
    residual = min(tokens - front, quant.residual)
    sealed = tokens - front - residual
    mode = quant.key_mode
    per_head = (sealed * (quant.token_bytes(head_dim, mode) + quant.token_bytes(head_dim)) + (front + residual) * full
                + tokens * bookkeeping_bytes(states, mode))
    if sealed:
        per_head += quant.head_bytes(head_dim, mode)
    return kv_heads * per_head


#: Bytes of a cached token's entry position, per layer and KV head (int32, kvcli.kv.cache.POSITION_DTYPE).
ENTRY_BYTES = 4
#: Bytes of a cached token's stream index, per layer and KV head (int32).
INDEX_BYTES = 4
#: Bytes of positions a cached token costs per layer and KV head where its keys are stored after RoPE: its entry
#: position and stream index.
POSITION_BYTES = ENTRY_BYTES + INDEX_BYTES
#: Bytes of one per-token state value a method keeps (an accumulated score, float32).
STATE_BYTES = 4


def bookkeeping_bytes(states: int = 0, key_mode: str = "token") -> int:
    """Bytes one cached token costs per layer and KV head besides its key and value: its positions and ``states``
    per-token values of the method (:attr:`kvcli.methods.base.ScoredMethod.state_names`). Keys rounded per channel
    (``key_mode`` "channel") are stored before RoPE and rotated from 0 wherever they sit, so their layers keep no
    entry position (:attr:`kvcli.kv.cache.CompressedLayer.entry_pos`)."""
    entry = 0 if key_mode in PRE_ROPE_MODES else ENTRY_BYTES
    return entry + INDEX_BYTES + STATE_BYTES * states


@dataclass(frozen=True)
class TokenCosts:
    """Bytes one cached token costs per layer and KV head, by part: its key and its value as the cache stores them
    (packed at ``--kv-bits`` below 16, with per-token scales and zero points), a key at full precision (PoD's
    proximal keys are never packed), and its bookkeeping (:func:`bookkeeping_bytes`). What a method that stores
    fewer keys than values (PoD) needs to turn a plain cache's bytes into its own tokens."""

    key: int
    value: int
    full_key: int
    bookkeeping: int


def token_costs(config, bits: int, dtype: torch.dtype, keys: str | None = None, states: int = 0) -> TokenCosts:
    """:class:`TokenCosts` on a model with ``config`` at ``bits``, keys rounded the ``keys`` way (None: by bits), a
    token keeping ``states`` per-token values of the method (:func:`bookkeeping_bytes`)."""
    _, head_dim = head_shape(config)
    full = head_dim * torch.tensor([], dtype=dtype).element_size()
    if bits == 16:
        return TokenCosts(full, full, full, bookkeeping_bytes(states))
    quant = KVQuant(bits, keys=keys)
    mode = quant.key_mode
    key, value = quant.token_bytes(head_dim, mode), quant.token_bytes(head_dim)
    return TokenCosts(key, value, full, bookkeeping_bytes(states, mode))


def tokens_for_bytes(config, nbytes: int, bits: int, dtype: torch.dtype, keys: str | None = None,
                     states: int = 0, windows: Sequence[int | None] | None = None) -> int:
    """The most tokens per budgeted layer whose cache (:func:`cache_bytes`) fits in ``nbytes`` (0 if not even one)."""

    def cost(tokens: int) -> int:
        return cache_bytes(config, tokens, bits, dtype, keys, states, windows)

    low, high = 0, 1
    while cost(high) <= nbytes:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if cost(mid) <= nbytes:
            low = mid
        else:
            high = mid
    return low
