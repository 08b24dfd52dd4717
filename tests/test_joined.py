"""Layers joined along the token axis (``kvcli.kv.joined``, issue #27) give exactly what each layer gives alone:
the same rotated keys and the same kept tokens, bit for bit, whatever the layers' lengths."""

from __future__ import annotations

import pytest
import torch

from kvcli.kv import joined
from kvcli.kv.cache import KVCache, rotate_keys
from kvcli.kv.quant import QuantizedTokens
from kvcli.methods import make_method
from tests.support import make_cache

HEADS, DIM = 2, 8


def filled(lengths: list[int], seed: int = 0, kv_bits: int = 16) -> KVCache:
    """A cache whose layers hold ``lengths`` tokens, kept from longer ones so their positions have moved."""
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(num_layers=len(lengths), kv_heads=HEADS, head_dim=DIM)
    if kv_bits != 16:
        cache = KVCache(len(lengths), cache.inv_freqs[0]).quantize(kv_bits)
    for layer, length in zip(cache.layers, lengths, strict=True):
        total = 2 * length + 3
        layer.update(torch.randn(1, HEADS, total, DIM, generator=gen), torch.randn(1, HEADS, total, DIM, generator=gen))
        layer.state = {"score": torch.rand(HEADS, total, generator=gen)}
        layer.keep(torch.sort(torch.randperm(total, generator=gen)[:length]).values.expand(HEADS, length).clone())
    cache.stream_start = 100
    return cache


def snapshot(cache: KVCache) -> list:
    def dense(x):
        return x.dense() if isinstance(x, QuantizedTokens) else x

    return [(dense(layer.keys).tolist(), dense(layer.values).tolist(), layer.entry_pos.tolist(),
             layer.token_idx.tolist(), {k: v.tolist() for k, v in layer.state.items()}) for layer in cache.layers]


def test_batches_stay_within_the_limit_and_keep_order():
    assert joined.batches([3, 3, 3, 3], limit=6) == [[0, 1], [2, 3]]
    assert joined.batches([10, 1, 1], limit=6) == [[0], [1, 2]]
    assert joined.batches([1, 1, 1]) == [[0, 1, 2]]


def test_joined_rotation_is_each_layers_own_bit_for_bit():
    cache = filled([5, 9, 1, 7])
    start = 40
    alone = [layer.current_keys(start) for layer in cache.layers]
    cache.block_start = start
    cache.plan_rotation()
    assert len({id(batch) for batch in cache.rotation.pending.values()}) == 1  # one batch for all four layers
    together = [layer.current_keys(start) for layer in cache.layers]
    for one, other in zip(alone, together, strict=True):
        assert torch.equal(one, other)
    assert not cache.rotation.pending and not cache.rotation.rotated  # each layer took its own, nothing is left behind


def test_layers_with_other_frequencies_rotate_apart():
    """Gemma 3's local and global layers rotate with different bases: they never share a batch."""
    base = make_cache(num_layers=1, kv_heads=HEADS, head_dim=DIM).inv_freqs[0]
    cache = KVCache(3, [base, base * 0.5, base.clone()])
    assert cache.freq_group == [0, 1, 0]


def test_a_layer_changed_after_the_plan_rotates_alone():
    cache = filled([6, 6])
    cache.block_start = 30
    cache.plan_rotation()
    layer = cache.layers[1]
    layer.keep(torch.tensor([[0, 2, 4]] * HEADS))
    cache.layers[0].current_keys(30)  # computes the batch with layer 1's old keys
    expected = rotate_keys(layer.keys, layer.current_positions(30)[None, :] - layer.entry_pos, layer.inv_freq)
    assert torch.equal(layer.current_keys(30), expected)


@pytest.mark.parametrize("counts", [[3, 3, 3], [2, 5, 1]])
def test_keeping_layers_at_once_is_keeping_them_one_by_one(counts):
    lengths = [6, 9, 5]
    gen = torch.Generator().manual_seed(1)
    kept = [torch.sort(torch.rand(HEADS, length, generator=gen).argsort(dim=1)[:, :count]).values
            for length, count in zip(lengths, counts, strict=True)]
    one_by_one, at_once = filled(lengths), filled(lengths)
    for layer, indices in zip(one_by_one.layers, kept, strict=True):
        layer.keep(indices)
    at_once.keep_layers(list(zip(at_once.layers, kept, strict=True)))
    assert snapshot(at_once) == snapshot(one_by_one)
    assert all(layer.moved for layer in at_once.layers)


def test_a_quantized_cache_keeps_layer_by_layer():
    one_by_one, at_once = filled([6, 6], kv_bits=8), filled([6, 6], kv_bits=8)
    indices = torch.tensor([[0, 1, 5]] * HEADS)
    assert at_once.layers[0].join_kind(rotation=False) is None
    for layer in one_by_one.layers:
        layer.keep(indices)
    at_once.keep_layers([(layer, indices) for layer in at_once.layers])
    assert snapshot(at_once) == snapshot(one_by_one)


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "pyramidkv", "treekv", "h2o", "pyramidinfer"])
def test_engine_streams_the_same_joined_or_layer_by_layer(tiny, name, monkeypatch):
    """Through the engine: joining layers changes no NLL and no kept token (every batch one layer against all
    layers in one), and a forward leaves no rotated keys behind."""
    from kvcli.engine.engine import Engine

    ids = torch.randint(0, 128, (170,), generator=torch.Generator().manual_seed(5)).tolist()

    def run():
        engine = Engine(tiny, make_method(name), 48, 16)
        cache = engine.new_cache()
        totals = engine.score([ids], cache=cache)
        assert not cache.rotation.pending and not cache.rotation.rotated
        return totals.nll_sum, [layer.token_idx.tolist() for layer in cache.layers]

    together = run()
    monkeypatch.setattr(joined, "JOIN_ELEMENTS", 1)
    assert run() == together


def literal_offsets(token_idx: torch.Tensor) -> list[list[int]]:
    """Each head's tokens: how many distinct tokens of the layer's heads are at or after it in the stream."""
    union = sorted(set(token_idx.flatten().tolist()))
    return [[len(union) - union.index(token) for token in row] for row in token_idx.tolist()]


@pytest.mark.parametrize("lengths", [[6], [6, 6, 6], [3, 9, 5]])
def test_heads_share_one_order_of_positions(lengths):
    """``union_offsets``: a token's distance to the block counts the distinct tokens any head holds after it."""
    gen = torch.Generator().manual_seed(len(lengths))
    layers = [torch.stack([torch.sort(torch.randperm(3 * length, generator=gen)[:length]).values
                           for _ in range(HEADS)]) for length in lengths]
    offsets = joined.union_offsets(layers).split(lengths, dim=1)
    for layer, got in zip(layers, offsets, strict=True):
        assert got.tolist() == literal_offsets(layer)


def test_heads_apart_rotate_to_the_union_positions_joined_or_alone():
    cache = filled([12, 16, 14])
    gen = torch.Generator().manual_seed(7)
    for layer, count in zip(cache.layers, [5, 9, 7], strict=True):  # each head keeps tokens of its own
        length = layer.get_seq_length()
        layer.keep(torch.stack([torch.sort(torch.randperm(length, generator=gen)[:count]).values
                                for _ in range(HEADS)]))
    assert any(len(set(map(tuple, layer.token_idx.tolist()))) > 1 for layer in cache.layers)
    cache.heads_apart = True
    start = 40
    alone = [layer.current_keys(start) for layer in cache.layers]
    for layer, keys in zip(cache.layers, alone, strict=True):
        positions = start - torch.tensor(literal_offsets(layer.token_idx))
        assert torch.equal(keys, rotate_keys(layer.keys, positions - layer.entry_pos, layer.inv_freq))
    cache.block_start = start
    cache.plan_rotation()
    assert all(torch.equal(layer.current_keys(start), keys) for layer, keys in zip(cache.layers, alone, strict=True))


def test_heads_apart_only_for_methods_whose_heads_choose_apart_within_the_context(tiny):
    from kvcli.engine.engine import Engine

    assert Engine(tiny, make_method("snapkv"), 48, 16).new_cache().heads_apart
    assert Engine(tiny, make_method("treekv"), 48, 16).new_cache().heads_apart
    assert not Engine(tiny, make_method("streamingllm"), 48, 16).new_cache().heads_apart
    assert not Engine(tiny, make_method("pyramidinfer"), 48, 16).new_cache().heads_apart  # heads=mean
    context = tiny.config.max_position_embeddings
    heads = tiny.config.num_key_value_heads
    too_wide = (context - 2 * 16) // heads + 1  # every head's budget side by side would pass the context
    assert not Engine(tiny, make_method("snapkv"), too_wide, 16).new_cache().heads_apart
    assert Engine(tiny, make_method("snapkv"), too_wide - 1, 16).new_cache().heads_apart
