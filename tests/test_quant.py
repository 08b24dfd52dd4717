"""The quantized KV cache (``--kv-bits``): packing, rounding error, eviction, bytes, and the CLI's checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvcli.engine.engine import Engine, budget_for_bytes
from kvcli.errors import UsageError
from kvcli.kv.quant import (
    CLIP,
    ENTRY_BYTES,
    FP16_MAX,
    POSITION_BYTES,
    STATE_BYTES,
    KVQuant,
    QuantizedTokens,
    bookkeeping_bytes,
    cache_bytes,
    check_kv_bits,
    check_kv_keys,
    dequantize,
    pack,
    packed_width,
    quantize,
    rotation,
    tokens_for_bytes,
    unpack,
)
from kvcli.methods import make_method


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_round_trip(bits):
    q = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)  # two 4-bit or four 2-bit values per byte
    assert torch.equal(unpack(packed, bits, 64), q)


def test_pack_puts_the_first_value_in_the_low_bits():
    assert pack(torch.tensor([[1, 2]], dtype=torch.uint8), 4).tolist() == [[0x21]]
    assert pack(torch.tensor([[3, 0, 1, 2]], dtype=torch.uint8), 2).tolist() == [[0b10010011]]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_rounding_error_is_within_half_a_step(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 64) * torch.linspace(0.1, 10, 64)
    packed, scale, zero = quantize(x, bits, 32)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (2, 7, 2)
    y = dequantize(packed, scale, zero, bits, 64, torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)
    assert bool(((y - x).abs() <= step / 2 + 1e-3 * step + 1e-6).all())
    # Rounding a dequantized tensor again gives it back: tokens re-sealed after an eviction lose nothing.
    again = dequantize(*quantize(y, bits, 32), bits, 64, torch.float32)
    assert torch.allclose(again, y, atol=1e-2 * float(step.max()))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("offset", [1e3, -3e4, 6e4])
def test_rounding_error_is_within_half_a_step_far_from_zero(bits, offset):
    """The zero point is rounded down and the scale up to fp16, so large offsets keep the half-step bound."""
    torch.manual_seed(1)
    x = offset + torch.randn(3, 5, 64) * 4
    packed, scale, zero = quantize(x, bits, 32)
    y = dequantize(packed, scale, zero, bits, 64, torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)
    assert bool(torch.isfinite(scale).all() and torch.isfinite(zero).all())
    assert bool(((y - x.clamp(max=FP16_MAX)).abs() <= step / 2 + 1e-6 * abs(offset)).all())


def test_values_beyond_fp16_come_back_clamped_never_inf():
    x = torch.tensor([[1e5, -2e5, 3.0, 0.0] * 8])
    packed, scale, zero = quantize(x, 8, 32)
    y = dequantize(packed, scale, zero, 8, 32, torch.float32)
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(scale).all())
    # Every value within half a step of the input clamped to fp16's range: +-65,504 and 3.0 alike.
    assert bool(((y - x.clamp(-FP16_MAX, FP16_MAX)).abs() <= float(scale[0, 0]) / 2 + 1e-2).all())


def store(bits=4, tokens=40, heads=2, dim=16, residual=8, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(1, heads, tokens, dim)
    quant = QuantizedTokens(x[:, :, :0], KVQuant(bits, group=8, residual=residual))
    quant.append(x[:, :, :tokens // 2])
    quant.append(x[:, :, tokens // 2:])
    return x, quant


def test_a_store_seals_all_but_the_residual_and_reads_back_close():
    x, quant = store()
    assert quant.shape == x.shape and quant.sealed == 32 and quant.tail.shape[2] == 8
    dense = quant.dense()
    assert torch.equal(dense[:, :, 32:], x[:, :, 32:])  # the residual is exact
    assert (dense - x).abs().max() < 0.35  # 4 bits over a range of about 6 (a step of 0.4)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_eviction_keeps_exactly_the_chosen_tokens_per_head(bits):
    x, quant = store(bits=bits)
    before = quant.dense()
    indices = torch.tensor([[0, 3, 5, 20, 33, 38, 39], [1, 2, 30, 31, 32, 36, 39]])
    quant.gather(indices)
    expected = before.gather(2, indices[None, :, :, None].expand(1, 2, 7, x.shape[-1]))
    assert quant.shape == (1, 2, 7, x.shape[-1])
    assert torch.allclose(quant.dense(), expected, atol=1e-5)  # nothing rounded twice
    # Residual tokens that stay, stay exact.
    assert torch.equal(quant.dense()[0, 0, -2:], x[0, 0, 38:40])


def test_eviction_of_everything_sealed_and_of_nothing():
    x, quant = store()
    quant.gather(torch.arange(36, 40).expand(2, 4))
    assert quant.sealed == 0 and torch.equal(quant.dense(), x[:, :, 36:])
    x, quant = store()
    before = quant.dense()
    quant.gather(torch.arange(0, 3).expand(2, 3))  # sealed tokens stay packed, even where the residual is
    assert quant.sealed == 3 and quant.tail.shape[2] == 0 and torch.equal(quant.dense(), before[:, :, :3])


def test_bytes_count_packed_payload_scales_zeros_and_residual():
    x, quant = store(bits=4, dim=16)
    # 32 sealed tokens x 2 heads: 8 bytes of 4-bit pairs + 2 groups x (scale + zero) x 2 bytes; residual fp32.
    expected = 2 * 32 * (8 + 2 * 2 * 2) + 2 * 8 * 16 * 4
    assert quant.nbytes() == expected
    assert packed_width(64, 2) == 16 and KVQuant(4).token_bytes(64) == 32 + 4
    assert KVQuant(8).token_bytes(64) == 64 + 4 and KVQuant(2).token_bytes(64) == 16 + 4  # rotated: one group
    assert KVQuant(2, rotate=False).token_bytes(64) == 16 + 8  # 2 bits unrotated: groups of 32


@pytest.mark.parametrize("dim", [16, 64, 12])
def test_rotation_is_orthonormal_and_fixed_by_the_size(dim):
    matrix = rotation(dim)
    assert matrix.shape == (dim, dim) and matrix.dtype == torch.float32
    assert torch.allclose(matrix @ matrix.T, torch.eye(dim), atol=1e-5)
    assert torch.equal(matrix, rotation.__wrapped__(dim))  # a pure function of the size: nothing to save
    if dim == 64:
        assert torch.allclose(matrix.abs(), torch.full((dim, dim), dim ** -0.5))  # Hadamard: every channel mixed


@pytest.mark.parametrize("mode", ["token", "channel"])
def test_a_rotated_store_costs_the_same_bytes_and_keeps_the_rotated_error_bound(mode):
    """The rotation is orthonormal, so a token's error (L2) is its rotated vector's, which min-max rounding keeps
    within half a step per channel; and it adds no byte to the store."""
    torch.manual_seed(1)
    x = torch.randn(1, 2, 200, 64)
    x[..., 5] *= 20  # an outlier channel, as real keys have
    stores = {}
    for rotate in (False, True):
        config = KVQuant(2, group=64, residual=0, keys=mode, sinks=0, rotate=rotate)
        stores[rotate] = QuantizedTokens(x[:, :, :0], config, mode)
        stores[rotate].append(x)
    rotated = stores[True]
    assert rotated.nbytes() == stores[False].nbytes()
    error = (rotated.dense() - x).norm(dim=-1)
    if mode == "token":
        bound = rotated.scale.float().squeeze(-1) / 2 * 64 ** 0.5
        assert bool((error <= bound * (1 + 1e-4)).all())
    else:
        inside = ((x @ rotation(64) - rotated.zero) / rotated.scale).abs().le(3).all(dim=-1)  # within the grid
        assert bool((error[inside] <= (rotated.scale / 2).norm() * (1 + 1e-4)).all())


def test_a_rotated_store_seals_once_and_evicts_exactly():
    """Tokens that leave the packed part on an eviction (dequantized into the residual, then sealed again) come
    back on the grid they had: sealing a rotated grid value again gives the same integers."""
    x, quant = store(bits=2)
    assert quant.rotation is not None and quant.front.shape[2] == 4
    before = quant.dense()
    # Head 0 keeps four sealed tokens, head 1 two: head 0's last two (20, 25) leave the packed part.
    indices = torch.tensor([[0, 1, 2, 3, 5, 10, 20, 25, 33], [0, 1, 2, 3, 6, 7, 33, 36, 39]])
    quant.gather(indices)
    assert quant.sealed == 2 and quant.tail.shape[2] == 3
    quant.append(x[:, :, :40])  # everything kept is sealed behind the new tokens: 20 and 25 a second time
    expected = before.gather(2, indices[None, :, :, None].expand(1, 2, 9, x.shape[-1]))
    assert torch.allclose(quant.dense()[0, 0, :8], expected[0, 0, :8], atol=1e-3)


def channel_store(bits=2, tokens=40, heads=2, dim=16, residual=8, sinks=4, seed=0, rotate=False):
    torch.manual_seed(seed)
    x = torch.randn(1, heads, tokens, dim) * torch.linspace(0.1, 5, dim) + torch.linspace(-20, 20, dim)
    x[:, :, 0] *= 30  # a sink far outside the other tokens' ranges
    config = KVQuant(bits, residual=residual, keys="channel", sinks=sinks, rotate=rotate)
    quant = QuantizedTokens(x[:, :, :0], config, "channel")
    quant.append(x[:, :, :tokens // 2])
    quant.append(x[:, :, tokens // 2:])
    return x, quant


def test_channel_keys_keep_sinks_and_residual_exact_and_fix_one_grid_per_channel():
    x, quant = channel_store()
    assert quant.shape == x.shape and quant.front.shape[2] == 4 and quant.sealed == 28
    assert quant.scale.shape == (1, 2, 1, 16) and quant.scale.dtype == torch.float32
    dense = quant.dense()
    assert torch.equal(dense[:, :, :4], x[:, :, :4]) and torch.equal(dense[:, :, 32:], x[:, :, 32:])
    # The grid came from the first tokens sealed (4..11: the first append sealed all but front and residual),
    # spanning their 1st to 99th percentile per channel: a value inside rounds within half a step, one outside
    # comes back as the grid's nearer end.
    step, low = quant.scale, quant.zero
    high = low + step * 3
    first = slice(4, 12)
    calibration = x[:, :, first]
    assert torch.equal(low, calibration.quantile(CLIP, dim=2, keepdim=True))
    clamped = torch.minimum(torch.maximum(calibration, low), high)
    assert bool(((dense[:, :, first] - clamped).abs() <= step / 2 + 1e-5).all())
    assert bool((clamped != calibration).any())  # the clip took effect somewhere
    # Bytes: packed payload and the per-head grid, no per-token parameters.
    assert quant.nbytes() == 2 * 28 * 4 + 2 * 2 * 16 * 4 + 2 * (4 + 8) * 16 * 4


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_channel_keys_evict_exactly_per_head(bits, rotate):
    x, quant = channel_store(bits=bits, rotate=rotate)
    before = quant.dense()
    indices = torch.tensor([[1, 3, 5, 7, 9, 20, 33], [0, 2, 4, 6, 10, 30, 39]])  # head 0 drops its first sink
    quant.gather(indices)
    assert quant.sealed == 2  # 9 and 20, 10 and 30 stay packed; 7 and 6 join the front (dequantized)
    expected = before.gather(2, indices[None, :, :, None].expand(1, 2, 7, x.shape[-1]))
    assert quant.shape == (1, 2, 7, x.shape[-1]) and quant.front.shape[2] == 4
    assert torch.allclose(quant.dense(), expected, atol=1e-5)
    quant.append(x[:, :, :30])  # sealing after the eviction rounds on the same grid: a sealed token is unchanged
    assert torch.equal(quant.dense()[:, :, :4], expected[:, :, :4])
    assert torch.allclose(quant.dense()[:, :, 4:6], expected[:, :, 4:6], atol=1e-5)
    assert torch.equal(quant.dense()[:, :, -8:], x[:, :, 22:30])


@pytest.mark.parametrize("keys", ["channel", "pca"])
def test_pre_rope_key_cache_bytes_match_the_store(keys):
    model = tiny()
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(3))
    for bits in (8, 4, 2):
        engine = Engine(model, make_method("streamingllm", {}), 96, block=32, kv_bits=bits, kv_keys=keys)
        totals = engine.score([ids])
        expected = cache_bytes(model.config, 96, bits, torch.bfloat16, keys)
        assert totals.kv_cache_bytes == expected


def test_key_modes_by_bits_and_model():
    assert KVQuant(2).key_mode == "pca" and KVQuant(4).key_mode == "token"
    assert KVQuant(2, key_norm=True).key_mode == "channel" and KVQuant(2, keys="channel").key_mode == "channel"
    assert check_kv_keys("auto") is None and check_kv_keys("pca") == "pca"
    with pytest.raises(UsageError, match="--kv-keys must be auto, token, channel or pca"):
        check_kv_keys("tokens")


@pytest.mark.parametrize("method", ["streamingllm", "treekv", "snapkv"])
def test_channel_keys_stored_before_rope_read_back_at_their_positions(method):
    """8-bit per-channel keys are un-rotated when stored and rotated to their current positions when read: an
    error in either would be far from 16 bits once evictions move the keys."""
    model = tiny(torch.float32)
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(4))
    nll = {}
    for bits, keys in ((16, None), (8, "channel"), (2, "channel")):
        engine = Engine(model, make_method(method, {}), 96, block=32, kv_bits=bits, kv_keys=keys,
                        warn=lambda message: None)
        nll[bits] = engine.score([ids]).nll
    assert abs(nll[8] - nll[16]) < 0.01
    assert abs(nll[2] - nll[16]) < 0.5


def test_keys_stored_before_rope_keep_no_entry_position():
    """A per-channel key is rotated from 0 to where it sits whenever it is read, so its layer keeps no entry
    position (4 bytes a token and KV head fewer, which ``--cache-bytes`` counts); keys rounded per token keep it."""
    model = tiny()
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(6))
    for keys, kept in (("channel", False), ("token", True)):
        engine = Engine(model, make_method("snapkv", {}), 96, block=32, kv_bits=2, kv_keys=keys,
                        warn=lambda message: None)
        cache = engine.new_cache()
        for start in range(0, ids.shape[1], 32):
            engine.forward(cache, ids[:, start:start + 32])
        for layer in cache.layers:
            assert layer.pre_rope is not kept and (layer.entry_pos is not None) is kept
            assert layer.token_idx.shape == (2, layer.get_seq_length())
    assert bookkeeping_bytes(0, "channel") == POSITION_BYTES - ENTRY_BYTES
    assert bookkeeping_bytes(2, "token") == POSITION_BYTES + 2 * STATE_BYTES


def test_a_snapshot_without_entry_positions_restores_only_where_keys_precede_rope():
    """A saved 2-bit layer has no entry positions and restores; a 16-bit layer's file that lacks them (crafted or
    damaged) is refused rather than read with keys it cannot place."""
    from kvcli.kv.snapshot import SnapshotError, restore_cache, snapshot_cache

    model = tiny()
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(8))
    for bits in (2, 16):
        engine = Engine(model, make_method("snapkv", {}), 48, block=32, kv_bits=bits, warn=lambda message: None)
        cache = engine.new_cache()
        for start in range(0, ids.shape[1], 32):
            engine.forward(cache, ids[:, start:start + 32])
        tensors, facts = snapshot_cache(cache)
        if bits == 2:
            assert all(layer["entry_pos"] == {"value": None} for layer in facts["layers"])
            restore_cache(engine.new_cache(), tensors, facts, torch.device("cpu"))
        else:
            facts["layers"][0]["entry_pos"] = {"value": None}
            with pytest.raises(SnapshotError, match="entry_pos does not fit the keys"):
                restore_cache(engine.new_cache(), tensors, facts, torch.device("cpu"))


def test_channel_keys_read_back_at_kept_positions():
    """A one-shot read keeps positions (a token's position is its index in the stream): an 8-bit per-channel key,
    stored without its entry position, is read back there after evictions (the sinks 0-3, not next to the recent
    window), as the 16-bit cache's key is."""
    model = tiny(torch.float32)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(7))
    keys = {}
    for bits in (16, 8):
        engine = Engine(model, make_method("streamingllm", {}), 64, block=256, kv_bits=bits,
                        kv_keys="channel" if bits == 8 else None, warn=lambda message: None)
        cache = engine.new_cache()
        cache.keep_positions = True  # as a one-shot read sets it
        engine.forward(cache, ids, last_only=True)
        layer = cache.layers[1]
        assert layer.get_seq_length() == 64 and layer.pre_rope is (bits == 8)
        keys[bits] = layer.current_keys(cache.next_position())
    error = (keys[8] - keys[16]).abs().mean(-1) / keys[16].abs().mean(-1)  # per token; rotated elsewhere: ~1
    assert error.max() < 0.2


def tiny(dtype=torch.bfloat16):
    from kvcli.models.load import tiny_llama

    return tiny_llama(num_layers=2, hidden=128, heads=4, kv_heads=2, dtype=dtype)


@pytest.mark.parametrize("method", ["streamingllm", "treekv", "snapkv", "h2o", "tova", "pyramidkv", "full"])
def test_every_method_streams_a_quantized_cache_close_to_16_bits(method):
    model = tiny()
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(0))
    results = {}
    for bits in (16, 8, 4):
        engine = Engine(model, make_method(method, {}), 96, block=32, kv_bits=bits, warn=lambda message: None)
        totals = engine.score([ids])
        results[bits] = totals
    assert abs(results[8].nll - results[16].nll) < 0.01
    assert abs(results[4].nll - results[16].nll) < 0.05
    assert results[8].max_cache_tokens == results[16].max_cache_tokens
    assert results[4].kv_cache_bytes < results[8].kv_cache_bytes < results[16].kv_cache_bytes


def test_a_quantized_cache_costs_what_cache_bytes_predicts():
    model = tiny()
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1))
    for bits in (16, 8, 4, 2):
        engine = Engine(model, make_method("treekv", {}), 96, block=32, kv_bits=bits)
        totals = engine.score([ids])
        states = engine.method.token_states  # TreeKV's score and count, besides the positions
        assert totals.kv_cache_bytes == cache_bytes(model.config, 96, bits, torch.bfloat16, states=states)


def test_cache_bytes_buys_more_tokens_at_fewer_bits():
    model = tiny()
    method = make_method("treekv", {})
    states = method.token_states
    nbytes = cache_bytes(model.config, 512, 16, torch.bfloat16, states=states)
    budgets = {bits: budget_for_bytes(method, model, nbytes, torch.bfloat16, bits) for bits in (16, 8, 4, 2)}
    assert budgets[16] == 512
    # Head dim 32: 128 bytes a token and head at 16 bits, 24 of bookkeeping (positions, TreeKV's two scores).
    assert budgets[4] >= 2 * budgets[16] and budgets[2] > budgets[4] > budgets[8] > budgets[16]
    for bits, budget in budgets.items():
        assert cache_bytes(model.config, budget, bits, torch.bfloat16, states=states) <= nbytes
        assert cache_bytes(model.config, budget + 1, bits, torch.bfloat16, states=states) > nbytes
    assert tokens_for_bytes(model.config, 10, 4, torch.bfloat16) == 0


@pytest.mark.parametrize("select", [None, "snapkv"])
def test_pod_takes_a_quantized_cache(select):
    """PoD (every token, and with a selection) with layers sharing keys: close to 16 bits, fewer bytes."""
    from kvcli.methods.pod.groups import GroupsFile, ModelShape

    model = tiny()
    groups = GroupsFile("tiny", ModelShape.of(model.config), [[[0, 1]], [[0], [1]]])
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2))
    totals = {}
    for bits in (16, 8):
        options = {"groups": groups, "sinks": 4, "recent": 8, **({"select": select} if select else {})}
        engine = Engine(model, make_method("pod", options), 96, block=32, kv_bits=bits, warn=lambda message: None)
        totals[bits] = engine.score([ids])
    assert abs(totals[8].nll - totals[16].nll) < 0.02
    assert totals[8].kv_cache_bytes < 0.75 * totals[16].kv_cache_bytes
    # PoD reads keys rotated from their entry positions: per-token keys even where 2 bits default to channels.
    engine = Engine(model, make_method("pod", {"groups": groups}), 96, block=32, kv_bits=2, kv_keys="channel")
    assert engine.cache_key_mode == "token" and engine.new_cache().kv_quant.key_mode == "token"


@pytest.mark.parametrize("bits", [3, 0, 32, 1, True, "8"])
def test_bad_bits_are_a_usage_error(bits):
    with pytest.raises(UsageError, match="must be 16, 8, 4 or 2"):
        check_kv_bits(bits)


@pytest.mark.parametrize(("command", "value"), [
    (["ppl"], "3"), (["ppl"], "0"), (["ppl"], "32"), (["ppl"], "eight"), (["summarize"], "3"),
    (["ask", "--", "BOOK", "Who?"], "1"), (["needle"], "3"), (["bench"], "16,3"),
])
def test_cli_bad_kv_bits_is_one_line(tmp_path, command, value):
    book = tmp_path / "book.txt"
    book.write_text("hello world\n")
    args = [str(book) if item == "BOOK" else item for item in command]
    if "BOOK" not in command:
        args.append(str(book))
    if "--" in args:  # options before the positional arguments
        cut = args.index("--")
        args = args[:cut] + ["--kv-bits", value] + args[cut:]
    else:
        args += ["--kv-bits", value]
    result = subprocess.run([sys.executable, "-m", "kvcli", *args, "--out", str(tmp_path / "out")]
                            if command[0] in ("needle", "bench") else [sys.executable, "-m", "kvcli", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kv-bits must be 16, 8, 4 or 2" in lines[0]
    assert result.stdout == ""


def test_cli_bad_kv_keys_is_one_line(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("hello world\n")
    result = subprocess.run([sys.executable, "-m", "kvcli", "ppl", str(book), "--kv-bits", "2", "--kv-keys", "chan"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "kvcli: error: --kv-keys must be auto, token, channel or pca (how cached keys are rounded), not chan"]


def test_bench_grid_has_kv_bits_as_an_axis_and_old_runs_are_16_bits():
    from kvcli.eval.bench.grid import plan_grid
    from kvcli.eval.bench.results import run_key

    specs = plan_grid(["full", "treekv"], [64], kv_bits=[16, 4])
    assert [(s.method, s.budget, s.kv_bits) for s in specs] == [
        ("full", None, 16), ("full", None, 4), ("treekv", 64, 16), ("treekv", 64, 4)]
    assert specs[-1].label == "treekv · cache 64 · 4-bit"
    old = {"method": "treekv", "cache": 64, "params": {}}  # a results.json row from before --kv-bits
    assert run_key(old) == run_key({**old, "kv_bits": 16}) != run_key({**old, "kv_bits": 4})


@pytest.mark.parametrize("method", ["streamingllm", "treekv", "snapkv", "pyramidkv", "h2o", "tova", "pyramidinfer"])
def test_cache_bytes_count_every_tensor_held_and_stay_within_the_budget(method):
    """``kv_cache_bytes`` is every byte the cache holds (keys and values, packed or not, positions, stream indices,
    a method's per-token scores: what a saved read stores), and ``--cache-bytes`` never buys more than asked."""
    from kvcli.kv.snapshot import snapshot_cache

    model = tiny()
    ids = torch.randint(0, 128, (1, 320), generator=torch.Generator().manual_seed(5))
    nbytes = 40_000
    for bits in (16, 8, 4, 2):
        made = make_method(method, {})
        engine = Engine(model, made, budget_for_bytes(made, model, nbytes, torch.bfloat16, bits), block=32,
                        kv_bits=bits, warn=lambda message: None)
        cache = engine.new_cache()
        for start in range(0, ids.shape[1], 32):
            engine.forward(cache, ids[:, start:start + 32])
        tensors, _ = snapshot_cache(cache)
        held = sum(t.numel() * t.element_size() for t in tensors.values())
        assert cache.nbytes() == held, (method, bits)
        assert held <= nbytes, (method, bits, held)


def test_per_token_keys_at_2_bits_are_warned_of():
    """PoD rounds its keys per token, as --kv-keys token does: at 2 bits that loses the model, so the user is told."""
    model = tiny()
    said = []
    Engine(model, make_method("streamingllm", {}), 96, block=32, kv_bits=2, kv_keys="token", warn=said.append)
    Engine(model, make_method("pod", {}), 96, block=32, kv_bits=2, warn=said.append)
    assert len(said) == 2 and all("keys rounded per token at 2 bits" in line for line in said)
    Engine(model, make_method("streamingllm", {}), 96, block=32, kv_bits=2, warn=said.append)  # per channel
    Engine(model, make_method("pod", {}), 96, block=32, kv_bits=4, warn=said.append)
    assert len(said) == 2


@pytest.mark.parametrize(("family", "normalizes"), [("qwen3", True), ("gemma3", True), ("llama3", False)])
def test_per_channel_keys_are_rotated_unless_the_model_normalizes_its_keys(family, normalizes):
    """A q/k norm gives every key channel a fixed scale, which a per-channel grid fits unrotated; values (rounded per
    token) are rotated in every model."""
    from test_families import build

    model = build(family)
    default = Engine(model, make_method("streamingllm", {}), 48, block=16, kv_bits=2).cache_key_mode
    assert default == ("channel" if normalizes else "pca")  # a normalized key's wide head: axes cost too much
    engine = Engine(model, make_method("streamingllm", {}), 48, block=16, kv_bits=2, kv_keys="channel")
    cache = engine.new_cache()
    engine.forward(cache, torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(8)))
    layer = cache.layers[-1]  # a layer without a window (Gemma 3's first are windowed, too short to seal)
    assert layer.keys.mode == "channel" and layer.keys.sealed > 0
    assert (layer.keys.rotation is None) == normalizes and layer.values.rotation is not None


@pytest.mark.parametrize("method", ["streamingllm", "treekv", "snapkv", "pyramidkv"])
def test_cache_bytes_pay_for_window_layers_first(method):
    """Gemma 3's sliding layers keep their W - 1 tokens whatever the budget: ``--cache-bytes`` pays for them first
    and gives the full layers the rest, so the cache holds no more than asked and one more token would not fit (a
    packed layer may hold less than its most while its full-precision residual is not full)."""
    from test_families import WINDOW, build

    from kvcli.kv.architecture import describe

    model = build("gemma3")
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(6))
    nbytes = 20_000  # 8,160 of them the window layers' (fp32: 272 bytes a token and layer)
    windows = describe(model).windows
    for bits in (16, 4, 2):
        made = make_method(method, {})
        budget = budget_for_bytes(made, model, nbytes, torch.float32, bits)
        engine = Engine(model, made, budget, block=16, kv_bits=bits, warn=lambda message: None)
        cache = engine.new_cache()
        for start in range(0, ids.shape[1], 16):
            engine.forward(cache, ids[:, start:start + 16])
        assert cache.lengths()[:2] == [WINDOW - 1, WINDOW - 1] and sum(cache.lengths()[2:]) == budget
        states = made.token_states
        assert cache.nbytes() <= cache_bytes(model.config, budget, bits, torch.float32, states=states, windows=windows)
        assert cache.nbytes() <= nbytes < cache_bytes(model.config, budget + 1, bits, torch.float32, states=states,
                                                      windows=windows), (method, bits)


def test_cache_bytes_smaller_than_the_window_layers_are_refused_with_one_line():
    from test_families import build

    from kvcli.errors import UsageError

    with pytest.raises(UsageError, match="beside the .* bytes its attention-window layers hold"):
        budget_for_bytes(make_method("snapkv", {}), build("gemma3"), 4_000, torch.float32)
