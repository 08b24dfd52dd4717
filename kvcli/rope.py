"""RoPE re-rotation: moving a cached key from the position it was rotated at to another one.

Kept apart from :mod:`kvcli.cache` so that the cache and :mod:`kvcli.joined` (many layers rotated at
once) share one definition without importing each other.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE keys ``[1, H, T, D]`` by ``delta`` positions ``[H, T]`` (a pure rotation, no scaling).

    RoPE is a rotation per frequency pair, so moving a key from position p to p' is one more
    rotation by p' - p, computed in float32 and rounded once.
    """
    rot_dim = inv_freq.shape[0] * 2
    angle = delta.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    angle = torch.cat((angle, angle), dim=-1)
    k = keys[..., :rot_dim].to(torch.float32)
    rotated = (k * angle.cos() + rotate_half(k) * angle.sin()).to(keys.dtype)
    if rot_dim == keys.shape[-1]:
        return rotated
    return torch.cat((rotated, keys[..., rot_dim:]), dim=-1)
