"""A quantized KV cache under eviction: cached keys and values packed to 8, 4 or 2 bits (``--kv-bits``).

What one layer's keys (or values) ``[1, H, T, D]`` become (:class:`QuantizedTokens`):

* the *sealed* tokens: integers of ``bits`` bits packed into bytes (one 8-bit, two 4-bit or four 2-bit
  values per byte), with a scale and a zero point in fp16 per token for every group of
  :data:`GROUP` channels (asymmetric min-max rounding, KIVI's value scheme);
* the *residual*: the last :data:`RESIDUAL` tokens in the model's own precision; a token is sealed
  (quantized, once) as soon as a newer block pushes it out of that window.

Keys and values are stored alike: per token, in groups of channels. Why keys are not rounded per channel
over groups of tokens, as in KIVI: eviction keeps any subset of tokens per head, so the tokens of a
token group part ways; each survivor would drag its group's per-channel scales along (a scale row per
channel for a group that may be down to one token), or be re-rounded with new neighbours, adding error
at every eviction. A per-token group travels with its token: any ``keep`` is an exact gather, and a
token is rounded once in its life (re-sealing a token that had to be dequantized gives back the same
integers, since min-max rounding of grid values is idempotent). A per-channel key scale in front of
the per-token rounding (each channel divided by its largest magnitude, RoPE pairs sharing one) was
not used: it does not help on SmolLM2 (numbers in docs/results.md), so keys have none.

Everything that reads the cache (attention, and through it every method's scores) sees the
dequantized tensors (:meth:`QuantizedTokens.dense`); the new block's own keys and values are
attended at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcli.errors import UsageError
from kvcli.lazy import torch

#: The bit widths ``--kv-bits`` takes: 16 is the model's own precision (nothing quantized).
KV_BITS = (16, 8, 4, 2)
#: Channels per scale/zero group (per token) at each bit width: a whole head of 64 channels at 8 and 4
#: bits, 32 at 2 bits (64 there more than triples SmolLM2's perplexity; docs/results.md), fewer in a smaller head.
GROUP = {8: 64, 4: 64, 2: 32}
#: Most recent tokens of each layer kept at full precision (KIVI's residual).
RESIDUAL = 32
#: Bytes of one scale or zero point (fp16).
PARAM_BYTES = 2


def check_kv_bits(bits: int, flag: str = "--kv-bits") -> int:
    """``bits`` if it is one of :data:`KV_BITS`, else a one-line :class:`UsageError`."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in KV_BITS:
        raise UsageError(f"{flag} must be 16, 8, 4 or 2 (bits per cached key and value element), not {bits}")
    return bits


@dataclass(frozen=True)
class KVQuant:
    """How a cache quantizes: ``bits`` per element, ``group`` channels per scale, ``residual`` full-precision tokens."""

    bits: int
    group: int | None = None  # None: GROUP[bits]
    residual: int = RESIDUAL

    def __post_init__(self) -> None:
        if self.bits not in (8, 4, 2):
            raise ValueError(f"a quantized cache takes 8, 4 or 2 bits, not {self.bits}")

    def group_of(self, dim: int) -> int:
        """Channels per group for a head of ``dim`` channels (a divisor of ``dim``)."""
        group = min(self.group or GROUP[self.bits], dim)
        while dim % group:
            group -= 1
        return group

    def token_bytes(self, dim: int) -> int:
        """Bytes one sealed token costs per KV head for a ``dim``-channel key or value: payload, scales, zeros."""
        return packed_width(dim, self.bits) + 2 * PARAM_BYTES * (dim // self.group_of(dim))


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
    q = q.to(torch.uint8).view(*q.shape[:-1], -1, n)
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


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max rounding of ``x`` ``[..., D]`` per group of ``group`` consecutive channels.

    Returns the packed integers ``[..., packed_width(D)]`` and fp16 scale and zero ``[..., D / group]``;
    the integers are rounded against the fp16 parameters, so :func:`dequantize` is within half a step.
    """
    dim = x.shape[-1]
    grouped = x.float().view(*x.shape[:-1], dim // group, group)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    levels = (1 << bits) - 1
    zero = low.to(torch.float16)
    scale = ((high - zero.float()) / levels).clamp_min(1e-6).to(torch.float16)
    q = ((grouped - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, levels)
    return pack(q.to(torch.uint8).view(*x.shape[:-1], dim), bits), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Values ``[..., dim]`` in ``dtype`` from :func:`quantize`'s output."""
    groups = scale.shape[-1]
    q = unpack(packed, bits, dim).view(*packed.shape[:-1], groups, dim // groups).float()
    x = q * scale.float()[..., None] + zero.float()[..., None]
    return x.view(*packed.shape[:-1], dim).to(dtype)


class QuantizedTokens:
    """One layer's keys or values ``[1, H, T, D]``: sealed tokens packed, the last ``residual`` at full precision.

    Offers what the cache layers need of a tensor (``shape``, ``dtype``, ``device``) plus :meth:`append`,
    :meth:`dense`, :meth:`gather` and :meth:`nbytes`. Keys and values are stored alike.
    """

    def __init__(self, like: torch.Tensor, config: KVQuant):
        _, heads, _, dim = like.shape
        self.config = config
        self.bits = config.bits
        self.group = config.group_of(dim)
        self.dim = dim
        self.dtype = like.dtype
        self.device = like.device
        width = packed_width(dim, self.bits)
        self.packed = torch.empty((1, heads, 0, width), dtype=torch.uint8, device=self.device)
        self.scale = torch.empty((1, heads, 0, dim // self.group), dtype=torch.float16, device=self.device)
        self.zero = torch.empty_like(self.scale)
        self.tail = like.new_empty((1, heads, 0, dim))

    # --- what the cache reads of a tensor ------------------------------------------------------
    @property
    def sealed(self) -> int:
        return self.packed.shape[2]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, self.tail.shape[1], self.sealed + self.tail.shape[2], self.dim))

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense()[index]

    # --- storage ---------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """Add tokens ``[1, H, n, D]`` after the others, then seal all but the last ``residual``."""
        self.tail = torch.cat((self.tail, x.to(self.dtype)), dim=2)
        self._seal()

    def _seal(self) -> None:
        count = self.tail.shape[2] - self.config.residual
        if count <= 0:
            return
        rows = self.tail[:, :, :count]
        packed, scale, zero = quantize(rows, self.bits, self.group)
        self.packed = torch.cat((self.packed, packed), dim=2)
        self.scale = torch.cat((self.scale, scale), dim=2)
        self.zero = torch.cat((self.zero, zero), dim=2)
        self.tail = self.tail[:, :, count:].clone()  # a view would keep the sealed rows' memory alive

    def _unseal(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize(packed, scale, zero, self.bits, self.dim, self.dtype)

    def dense(self) -> torch.Tensor:
        """Every token ``[1, H, T, D]`` in the model's dtype: the sealed ones dequantized, then the residual."""
        if self.sealed == 0:
            return self.tail
        return torch.cat((self._unseal(self.packed, self.scale, self.zero), self.tail), dim=2)

    def gather(self, indices: torch.Tensor) -> None:
        """Keep, per head, the tokens at ``indices`` ``[H, k]`` (ascending), exactly: no token is rounded again.

        The first ``s`` kept tokens of every head, ``s`` the fewest sealed ones any head keeps, stay packed
        (their bytes gathered); the rest join the residual (a sealed one dequantized), which is sealed
        again down to ``residual`` tokens (rounding grid values again gives the same integers).
        """
        heads, count = indices.shape
        sealed = self.sealed
        sealed_kept = int((indices < sealed).sum(dim=1).min()) if sealed and heads else 0
        head = indices[:, :sealed_kept][None, :, :, None]

        def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return t.gather(2, idx.expand(1, heads, idx.shape[2], t.shape[-1]))

        rest = indices[:, sealed_kept:]
        in_tail = rest >= sealed
        from_tail = self.tail.new_empty((1, heads, rest.shape[1], self.dim))  # filled below
        if self.tail.shape[2]:
            from_tail = rows(self.tail, (rest - sealed).clamp(min=0)[None, :, :, None])
        if sealed and not bool(in_tail.all()):
            at = rest.clamp(max=sealed - 1)[None, :, :, None]
            unsealed = self._unseal(rows(self.packed, at), rows(self.scale, at), rows(self.zero, at))
            from_tail = torch.where(in_tail[None, :, :, None], from_tail, unsealed) if self.tail.shape[2] else unsealed
        self.packed = rows(self.packed, head)
        self.scale = rows(self.scale, head)
        self.zero = rows(self.zero, head)
        self.tail = from_tail
        self._seal()

    def nbytes(self) -> int:
        """Bytes held: packed integers, scales, zero points and the full-precision residual."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero, self.tail))


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
    from kvcli.joined import wide_index

    return x.gather(2, wide_index(indices, x.shape[-1]))


def cache_bytes(config, tokens: int, bits: int, dtype: torch.dtype) -> int:
    """Bytes a plain (non-PoD) cache of ``tokens`` per layer costs on a model with ``config`` at ``bits``.

    16 bits: keys and values in ``dtype``. Fewer: every token beyond the residual sealed
    (:meth:`KVQuant.token_bytes` for keys and values) and the residual at full precision.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers = config.num_hidden_layers
    element = torch.tensor([], dtype=dtype).element_size()
    full = 2 * head_dim * element
    if bits == 16:
        return layers * kv_heads * tokens * full
    quant = KVQuant(bits)
    residual = min(tokens, quant.residual)
    sealed = tokens - residual
    per_head = sealed * 2 * quant.token_bytes(head_dim) + residual * full
    return layers * kv_heads * per_head


def tokens_for_bytes(config, nbytes: int, bits: int, dtype: torch.dtype) -> int:
    """The most tokens per layer whose cache (:func:`cache_bytes`) fits in ``nbytes`` (0 if not even one)."""
    low, high = 0, 1
    while cache_bytes(config, high, bits, dtype) <= nbytes:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if cache_bytes(config, mid, bits, dtype) <= nbytes:
            low = mid
        else:
            high = mid
    return low
