"""Keys rounded on a basis of their own (``--kv-keys pca``): the 2-bit key scheme of :mod:`kvcli.kv.quant`.

A per-channel grid spends the same bits on every channel, but a head's keys before RoPE spend their energy in a
few directions, and its queries weigh channels unequally. So each head, once, from its first block:

* weighs every channel ``c`` by ``w_c``, the mean square of the queries of its group in that channel, averaged
  over the channel's RoPE pair (RoPE turns a pair's two channels into each other, so the pair's mean square is the
  same rotated or not: the post-RoPE queries attention sees give it), because an error ``e`` in a key moves a
  logit by ``q . e``, whose expected square is ``sum_c w_c e_c**2`` when the pairs turn;
* takes the principal axes ``U`` of its keys scaled by ``s = sqrt(w)`` (the covariance's eigenvectors), and gives
  the ``bits * D`` bits of a token to the axes by reverse water-filling (each next bit to the axis whose variance
  times ``4**-bits`` is largest, at most :data:`MAX_WIDTH` an axis; an axis of no bits is its calibration mean);
* rounds each axis on a fixed grid over its calibration values' quantiles (:data:`CLIP`, a quarter of it from
  3 bits on), as the per-channel grid of :func:`kvcli.kv.quant.channel_params` does for channels.

A key is then ``((k * s) @ U)`` rounded per axis and packed bit by bit (``bits * D`` bits a token, the
per-channel grid's width), and read back as ``(y @ U.T) / s``. The grid is fixed per head and per token, so any
subset of tokens is an exact gather, and rounding a read-back key again gives the same integers up to the model
dtype's rounding. The measurements behind it are in docs/notes/2026-12-05-keys-on-their-own-axes.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kvcli.io.lazy import torch

#: Most bits one axis of a head's keys gets (its integers are uint8).
MAX_WIDTH = 8
#: Share of an axis's calibration values its grid leaves outside at each end, at 1 or 2 bits (a quarter of it from
#: 3 bits on, whose finer grid makes clamping dearer than a wider step).
CLIP = 0.02
#: Fewest keys a head calibrates on unless a second block has come (:func:`grid_when_ready`): axes need more keys
#: than a head has channels to be more than noise.
MIN_ROWS = 128


def query_weight(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``w`` ``[1, kv_heads, 1, D]``: the mean square of ``query`` ``[1, H_q, n, D]`` per channel over the tokens and
    the query heads of each KV head's group, averaged over each RoPE pair ``(c, c + D/2)``."""
    _, heads, _, dim = query.shape
    square = query.float().square().mean(dim=2).view(1, kv_heads, heads // kv_heads, dim).mean(dim=2)
    if dim % 2 == 0:
        pair = (square[..., : dim // 2] + square[..., dim // 2:]) / 2
        square = torch.cat((pair, pair), dim=-1)
    return square[:, :, None, :]


def allocate(variance: torch.Tensor, total: int, most: int = MAX_WIDTH) -> torch.Tensor:
    """Bits per axis ``[H, D]`` (uint8) summing to ``total`` per head: each next bit to the axis whose
    ``variance * 4**-bits`` is largest (reverse water-filling, one bit at a time), at most ``most`` an axis."""
    heads, dim = variance.shape
    if total > most * dim:
        raise ValueError(f"{total} bits do not fit {dim} axes of at most {most}")
    width = torch.zeros((heads, dim), dtype=torch.long, device=variance.device)
    rows = torch.arange(heads, device=variance.device)
    for _ in range(total):
        gain = variance * torch.pow(0.25, width.to(variance.dtype))
        gain = gain.masked_fill(width >= most, -1.0)
        width[rows, gain.argmax(dim=1)] += 1
    return width.to(torch.uint8)


def grid_when_ready(rows: torch.Tensor, queries: torch.Tensor | None, observed: int, bits: int) -> KeyBasis | None:
    """The grid a store fixes on its oldest unrounded keys ``rows`` ``[1, H, n, D]``, or None while it waits: for the
    first block's queries (``observed`` blocks of them, weighed into ``queries``), and for :data:`MIN_ROWS` keys
    unless a second block's queries have come (a small budget may never hold that many)."""
    if observed == 0 or (rows.shape[2] < MIN_ROWS and observed < 2):
        return None
    return KeyBasis.calibrate(rows, queries, bits)


@dataclass
class KeyBasis:
    """One store's fixed grid: per head the axes ``basis`` ``[1, H, D, D]`` (int8, columns, each times 127 over its
    largest entry ``spread`` ``[1, H, 1, D]``, fp16: half the bytes of fp16 axes, rounded far finer than the 2-bit
    grid on them), the channel weights' square roots ``weight`` ``[1, H, 1, D]``, and per axis
    its bits ``width``, grid ``scale`` and ``zero`` (``[1, H, 1, D]``; an axis of no bits reads as its ``zero``,
    the calibration mean). Encoding and decoding use the same rounded axes."""

    #: The tensors a grid is made of, as :meth:`tensors` names them.
    PARTS: ClassVar[tuple[str, ...]] = ("basis", "spread", "weight", "width", "scale", "zero")

    basis: torch.Tensor
    spread: torch.Tensor
    weight: torch.Tensor
    width: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int  # per channel on average: a token's ``bits * D`` bits fill the widths

    @classmethod
    def calibrate(cls, rows: torch.Tensor, weight: torch.Tensor | None, bits: int) -> KeyBasis:
        """The grid of keys ``rows`` ``[1, H, n, D]`` (before RoPE) weighed by ``weight`` (:func:`query_weight`;
        None: every channel alike), ``bits`` a channel on average."""
        _, heads, _, dim = rows.shape
        x = rows.float()
        w = torch.ones((1, heads, 1, dim), device=x.device) if weight is None else weight.float()
        root = w.clamp_min(w.amax(dim=-1, keepdim=True) * 1e-8 + 1e-30).sqrt()
        scaled = x * root
        centred = scaled - scaled.mean(dim=2, keepdim=True)
        covariance = centred[0].transpose(1, 2) @ centred[0] / max(x.shape[2], 1)
        variance, axes = torch.linalg.eigh(covariance.double())
        spread = axes.abs().amax(dim=1, keepdim=True).float().to(torch.float16)[None]  # [1, H, 1, D]
        basis = (axes.float()[None] * 127 / spread.float()).round_().clamp_(-127, 127).to(torch.int8)
        width = allocate(variance.clamp_min(0).float(), bits * dim)[None, :, None, :]
        grid = cls(basis, spread, root, width, torch.ones_like(root), torch.zeros_like(root), bits)
        grid.scale, grid.zero = _grids(scaled @ grid.axes(), width)
        return grid

    def axes(self) -> torch.Tensor:
        """The axes ``[1, H, D, D]`` (fp32 columns) as stored."""
        return self.basis.float() * (self.spread.float() / 127)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Keys ``[1, H, n, D]`` (before RoPE) as packed bytes ``[1, H, n, bits * D / 8]``."""
        y = (x.float() * self.weight) @ self.axes()
        top = (1 << self.width.to(torch.int32)) - 1
        q = ((y - self.zero) / self.scale).round_().clamp_(min=0).minimum(top).to(torch.int32)
        axis, shift = self._layout()
        bits = (q.gather(3, axis.expand(*q.shape[:3], axis.shape[-1])) >> shift) & 1
        bits = bits.to(torch.uint8).view(*q.shape[:3], -1, 8)
        return (bits << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(dim=-1, dtype=torch.uint8)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The keys :meth:`encode` packed, ``[1, H, n, D]`` in ``dtype``."""
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        bits = ((packed[..., None] >> shifts) & 1).flatten(-2).float()
        q = bits @ self._powers()
        return (((q * self.scale + self.zero) @ self.axes().transpose(2, 3)) / self.weight).to(dtype)

    def _layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Which axis ``[1, H, 1, bits]`` each packed bit belongs to, and its place in that axis's integer."""
        width = self.width[0, :, 0].long()  # [H, D]
        heads, dim = width.shape
        end = torch.cumsum(width, dim=1)  # searched, not repeated: a fixed shape needs no wait for the device
        place = torch.arange(self.bits * dim, device=width.device).expand(heads, -1).contiguous()
        axis = torch.searchsorted(end, place, right=True)
        shift = place - (end - width).gather(1, axis)
        return axis[None, :, None, :], shift[None, :, None, :].to(torch.int32)

    def _powers(self) -> torch.Tensor:
        """``[1, H, bits, D]``: packed bit ``p`` of a token adds ``2**shift`` to its axis (0 elsewhere)."""
        axis, shift = self._layout()
        heads, total, dim = axis.shape[1], axis.shape[3], self.width.shape[3]
        powers = torch.zeros((1, heads, total, dim), device=axis.device)
        return powers.scatter_(3, axis[0, :, 0, :, None][None], torch.pow(2.0, shift[0, :, 0, :, None].float())[None])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], heads: int, dim: int, bits: int) -> KeyBasis:
        """The grid whose :meth:`tensors` these are, for ``heads`` heads of ``dim`` channels at ``bits`` bits on
        average; a ValueError unless every tensor has the shape and dtype such a grid has and the widths fill
        ``bits * dim`` bits a head (a crafted file must not make :meth:`decode` read out of place)."""
        shapes = _parts(heads, dim)
        for name, (shape, dtype) in shapes.items():
            value = tensors.get(name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
                raise ValueError(f"the key grid's {name} is not a {dtype} tensor of shape {list(shape)}")
        width = tensors["width"]
        if bool((width > MAX_WIDTH).any()) or bool((width.sum(dim=3, dtype=torch.int64) != bits * dim).any()):
            raise ValueError(f"the key grid's widths do not fill {bits * dim} bits a head")
        return cls(**{name: tensors[name] for name in shapes}, bits=bits)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {part: getattr(self, part) for part in self.PARTS}


def _parts(heads: int, dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each tensor of a grid of ``heads`` heads of ``dim`` channels (:attr:`KeyBasis.PARTS`)."""
    row = (1, heads, 1, dim)
    return {"basis": ((1, heads, dim, dim), torch.int8), "spread": (row, torch.float16), "weight": (row, torch.float32),
            "width": (row, torch.uint8), "scale": (row, torch.float32), "zero": (row, torch.float32)}


def grid_bytes(dim: int) -> int:
    """Bytes one head's grid holds for keys of ``dim`` channels, whatever it calibrated on."""
    parts = _parts(1, dim).values()
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in parts)


def _grids(y: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-axis fp32 step and low end ``[1, H, 1, D]`` of values ``y`` ``[1, H, n, D]`` at ``width`` bits: the
    :data:`CLIP` quantiles at 1 or 2 bits, a quarter of it from 3 bits on; an axis of 0 bits is its mean."""
    wide = width > 2
    ends = y.quantile(torch.tensor([CLIP / 4, CLIP, 1 - CLIP, 1 - CLIP / 4], device=y.device), dim=2, keepdim=True)
    low, high = torch.where(wide, ends[0], ends[1]), torch.where(wide, ends[3], ends[2])
    levels = ((1 << width.to(torch.int32)) - 1).float()
    none = width == 0
    scale = torch.where(none, torch.ones_like(low), ((high - low) / levels.clamp_min(1)).clamp_min(1e-6))
    zero = torch.where(none, y.mean(dim=2, keepdim=True), low)
    return scale, zero
