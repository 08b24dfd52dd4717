"""RoPE re-rotation: moving a cached key from the position it was rotated at to another one.

Kept apart from :mod:`kvcli.kv.cache` so that the cache and :mod:`kvcli.kv.joined` (many layers rotated at
once) share one definition without importing each other.
"""

from __future__ import annotations

import torch


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE keys ``[1, H, T, D]`` by ``delta`` positions ``[H, T]`` (a pure rotation, no scaling); leading
    dimensions broadcast (``[L, H, T, D]`` keys of ``L`` layers that share ``inv_freq`` take ``[L, H, T]``).

    RoPE is a rotation per frequency pair, so moving a key from position p to p' is one more
    rotation by p' - p, computed in float32 and rounded once. Each pair's cosine and sine are computed
    once for both halves of the head (the model's ``rotate_half`` form repeats them).
    """
    half = inv_freq.shape[-1]
    angle = delta.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    cos, sin = angle.cos(), angle.sin()
    first = keys[..., :half].to(torch.float32)
    second = keys[..., half:2 * half].to(torch.float32)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(keys.dtype)
    if 2 * half == keys.shape[-1]:
        return rotated
    return torch.cat((rotated, keys[..., 2 * half:]), dim=-1)
