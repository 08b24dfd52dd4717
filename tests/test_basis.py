"""Keys rounded on their own axes (``--kv-keys pca``, kvcli.kv.basis): the rules its docstring states, checked
against slow literal versions and against the per-channel grid it replaces at 2 bits."""

from __future__ import annotations

import pytest
import torch

from kvcli.kv.basis import MIN_ROWS, KeyBasis, allocate, query_weight
from kvcli.kv.quant import KVQuant, QuantizedTokens, channel_params, dequantize_channels, quantize_channels
from kvcli.kv.rope import rotate_keys


def keys_and_queries(heads: int = 2, tokens: int = 400, dim: int = 16, seed: int = 0):
    """Keys whose energy lies in a few directions (as a model's do before RoPE) and queries that weigh channels
    unequally."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(heads, dim, dim, generator=g) * torch.logspace(0, -2, dim)[:, None]
    keys = (torch.randn(1, heads, tokens, dim, generator=g) @ mix) + torch.randn(heads, 1, dim, generator=g)
    queries = torch.randn(1, 2 * heads, 64, dim, generator=g) * torch.linspace(0.2, 3, dim)
    return keys, queries


def slow_allocate(variance: list[float], total: int, most: int) -> list[int]:
    width = [0] * len(variance)
    for _ in range(total):
        gains = [v * 0.25 ** w if w < most else -1.0 for v, w in zip(variance, width, strict=True)]
        width[gains.index(max(gains))] += 1
    return width


def test_allocate_is_reverse_water_filling_one_bit_at_a_time():
    variance = torch.tensor([[9.0, 4.0, 1.0, 0.01], [1.0, 1.0, 1.0, 1.0]])
    width = allocate(variance, 8, most=3)
    assert width.sum(dim=1).tolist() == [8, 8] and int(width.max()) <= 3
    for row, got in zip(variance.tolist(), width.tolist(), strict=True):
        assert got == slow_allocate(row, 8, 3)
    with pytest.raises(ValueError, match="do not fit"):
        allocate(variance, 13, most=3)


def test_query_weight_is_the_same_before_and_after_rope():
    """A RoPE pair's mean square does not change as the pair turns, so post-RoPE queries give the weights."""
    _, queries = keys_and_queries()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    turned = rotate_keys(queries, torch.arange(64)[None, :] * 7, inv_freq)
    assert torch.allclose(query_weight(queries, 2), query_weight(turned, 2), rtol=1e-4)
    literal = queries.square().mean(dim=2).view(1, 2, 2, 16).mean(dim=2)
    assert torch.allclose(query_weight(queries, 2)[0, :, 0, :8], (literal[0, :, :8] + literal[0, :, 8:]) / 2)


def test_round_trip_packs_bits_times_channels_and_rounds_once():
    keys, queries = keys_and_queries()
    grid = KeyBasis.calibrate(keys[:, :, :200], query_weight(queries, 2), 2)
    packed = grid.encode(keys)
    assert packed.shape == (1, 2, 400, 16 * 2 // 8) and packed.dtype == torch.uint8
    back = grid.decode(packed, torch.float32)
    assert torch.equal(grid.encode(back), packed)  # a read-back key rounds to the same integers
    assert float((back - keys).norm() / keys.norm()) < 0.3
    assert int(grid.width.sum()) == 2 * 16 * 2


def test_bits_are_packed_axis_after_axis_lowest_first():
    keys, queries = keys_and_queries()
    grid = KeyBasis.calibrate(keys[:, :, :200], query_weight(queries, 2), 2)
    axis, shift = grid._layout()
    for head in range(2):
        widths = grid.width[0, head, 0].tolist()
        assert axis[0, head, 0].tolist() == [c for c, w in enumerate(widths) for _ in range(w)]
        assert shift[0, head, 0].tolist() == [j for w in widths for j in range(w)]


def test_axes_beat_a_channel_grid_on_the_logits():
    """What the axes are for: a smaller error in ``q . k`` than a per-channel grid of the same bits (2 a channel)."""
    keys, queries = keys_and_queries()
    grid = KeyBasis.calibrate(keys[:, :, :200], query_weight(queries, 2), 2)
    on_axes = grid.decode(grid.encode(keys), torch.float32)
    scale, zero = channel_params(keys[:, :, :200], 2)
    per_channel = dequantize_channels(quantize_channels(keys, scale, zero, 2), scale, zero, 2, 16, torch.float32)
    group = queries.view(1, 2, 2, 64, 16)

    def logit_error(approx):
        return float(((group @ (approx - keys)[:, :, None].transpose(-1, -2)) ** 2).mean())

    assert logit_error(on_axes) < 0.5 * logit_error(per_channel)


def test_a_store_waits_for_queries_then_gathers_exactly():
    keys, queries = keys_and_queries(tokens=MIN_ROWS + 100)
    store = QuantizedTokens(keys[:, :, :0], KVQuant(2, keys="pca"), "pca")
    store.append(keys[:, :, :MIN_ROWS + 60])
    assert store.sealed == 0 and torch.equal(store.dense(), keys[:, :, :MIN_ROWS + 60].to(store.dtype))
    store.observe(queries)
    assert store.sealed == MIN_ROWS + 60 - 4 - 32 and store.grid is not None
    store.append(keys[:, :, MIN_ROWS + 60:])
    before = store.dense()
    keep = torch.stack([torch.arange(0, MIN_ROWS + 100, 2), torch.arange(1, MIN_ROWS + 100, 2)])
    store.gather(keep)
    assert torch.allclose(store.dense(), before.gather(2, keep[None, :, :, None].expand(1, 2, -1, 16)), atol=1e-5)
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in (
        store.packed, store.front, store.tail, *store.grid.tensors().values()))


def test_a_store_without_enough_rows_calibrates_at_the_second_block():
    keys, queries = keys_and_queries(tokens=120)
    store = QuantizedTokens(keys[:, :, :0], KVQuant(2, keys="pca"), "pca")
    store.append(keys[:, :, :60])
    store.observe(queries)
    assert store.sealed == 0  # 24 rows: too few for a basis yet
    store.append(keys[:, :, 60:])
    store.observe(queries)
    assert store.grid is not None and store.sealed == 120 - 4 - 32


@pytest.mark.parametrize(("part", "value", "message"), [
    ("basis", torch.zeros(1, 2, 16, 15, dtype=torch.int8), "basis"),
    ("weight", torch.ones(1, 2, 1, 16, dtype=torch.float16), "weight"),
    ("width", torch.full((1, 2, 1, 16), 3, dtype=torch.uint8), "widths"),
    ("width", torch.tensor([9, 7] + [2] * 14, dtype=torch.uint8).view(1, 1, 1, 16).expand(1, 2, 1, 16), "widths"),
])
def test_a_crafted_grid_is_refused(part, value, message):
    keys, queries = keys_and_queries()
    tensors = KeyBasis.calibrate(keys[:, :, :200], query_weight(queries, 2), 2).tensors()
    KeyBasis.from_tensors(tensors, 2, 16, 2)  # the grid as made passes
    with pytest.raises(ValueError, match=message):
        KeyBasis.from_tensors({**tensors, part: value}, 2, 16, 2)
