"""``kvcli bench-speed``: named shapes with random weights, tokens/s, MFU and peak memory (issue #13, item 5)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.eval.bench.speed import SHAPES, attended_keys, build_model, flops_per_token, matmul_parameters

#: Parameter counts the model cards publish: the shapes must be the real ones.
PUBLISHED = {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
             "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_named_shapes_have_the_published_parameter_counts(name):
    model = build_model(name, device="meta", dtype=torch.bfloat16)  # allocates nothing
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_flops_per_token_of_the_8b_shape():
    model = build_model("llama-3.1-8b", device="meta", dtype=torch.bfloat16)
    embedding, norms = 128_256 * 4096, (2 * 32 + 1) * 4096
    # the LM head counts, the embedding lookup and the RMSNorm scales do not
    assert matmul_parameters(model) == PUBLISHED["llama-3.1-8b"] - embedding - norms
    flops = flops_per_token(model, attended_keys(1024, 1024))
    attention = 4 * 32 * 32 * 128 * (1024 + 512.5)
    assert flops == pytest.approx(2 * matmul_parameters(model) + attention)
    assert flops == pytest.approx(2 * 8.0e9, rel=0.02)


def test_tied_lm_head_counts_as_a_matmul():
    model = build_model("llama-3.2-1b", device="meta", dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    norms = (2 * 16 + 1) * 2048
    assert matmul_parameters(model) == PUBLISHED["llama-3.2-1b"] - norms  # the shared matrix counts once, as the head


def test_plain_blocks_keep_ids_and_positions_on_the_models_device():
    """On a meta model a position tensor left on the CPU fails (as it would on CUDA); nothing is allocated."""
    from kvcli.eval.bench.throughput import stream_plain_blocks

    model = build_model("tiny", device="meta")
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append((kwargs["input_ids"].device.type, getattr(kwargs.get("position_ids"), "device", None)))
        return forward(*args, **kwargs)

    model.forward = spy
    tokens, _ = stream_plain_blocks(model, torch.arange(16 + 4 * 8) % 512, block=8, budget=16)
    assert tokens == 3 * 8  # 16 to fill the cache, one block of warm-up, three timed
    assert {input_device for input_device, _ in seen} == {"meta"}
    assert {positions.type for _, positions in seen if positions is not None} == {"meta"}


def test_bench_speed_json_on_the_tiny_shape(invoke):
    result = invoke("bench-speed", "--shape", "tiny", "--methods", "streamingllm,snapkv", "--cache", "32",
                    "--block", "16", "--tokens", "40", "--device", "cpu", "--matmul-size", "256", "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["shape"] == "tiny" and out["block"] == 16 and out["tokens"] == 32  # whole blocks
    assert [row["kind"] for row in out["rows"]] == ["plain", "engine", "engine"]
    assert [row["method"] for row in out["rows"]] == [None, "streamingllm", "snapkv"]
    assert out["matmul_tflops"] > 0 and out["weight_bytes"] > 0 and out["flops_per_token"] > 0
    for row in out["rows"]:
        assert row["tokens"] == 32
        assert row["tokens_per_second"] > 0
        assert 0 < row["mfu"] < 1.5
        assert row["peak_memory_bytes"] > 0
    assert all(row["vs_plain"] > 0 and row["kv_cache_bytes"] > 0 for row in out["rows"][1:])
    assert result.stderr == ""


def test_bench_speed_decode_lines(invoke):
    """``--decode N``: one-token greedy steps against the full cache, plain then each method. StreamingLLM's
    cache stays at its budget while writing; SnapKV's grows by the steps (it keeps the answer)."""
    result = invoke("bench-speed", "--shape", "tiny", "--methods", "streamingllm,snapkv", "--cache", "32",
                    "--block", "16", "--tokens", "32", "--decode", "5", "--device", "cpu", "--matmul-size", "128",
                    "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    rows = {row["line"]: row for row in out["rows"]}
    assert [row["kind"] for row in out["rows"]][3:] == ["decode-plain", "decode", "decode"]
    assert out["decode_steps"] == 5
    for line in ("decode plain (sdpa)", "decode kvcli streamingllm", "decode kvcli snapkv"):
        assert rows[line]["tokens"] == 5 and rows[line]["tokens_per_second"] > 0
    assert rows["decode kvcli streamingllm"]["vs_plain"] > 0
    per_token = rows["kvcli streamingllm"]["kv_cache_bytes"] / 32
    assert rows["decode kvcli streamingllm"]["kv_cache_bytes"] == rows["kvcli streamingllm"]["kv_cache_bytes"]
    assert rows["decode kvcli snapkv"]["kv_cache_bytes"] == rows["kvcli snapkv"]["kv_cache_bytes"] + 7 * per_token


def test_bench_speed_compiled_decode_lines(invoke, monkeypatch):
    """``--decode N --compile``: the methods' static steps run what ``torch.compile`` returned, and their lines say
    so (the compilation itself is replaced here: inductor takes minutes on a CPU)."""
    compiled = []

    def recording_compile(step, **options):
        compiled.append(options)
        return step

    monkeypatch.setattr(torch, "compile", recording_compile)
    result = invoke("bench-speed", "--shape", "tiny", "--methods", "snapkv,treekv", "--cache", "32", "--block", "16",
                    "--tokens", "32", "--decode", "3", "--compile", "--device", "cpu", "--matmul-size", "128",
                    "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["compile_decode"] is True and compiled == [{"dynamic": False}] * 2
    assert [row["line"] for row in out["rows"]][-2:] == ["decode kvcli snapkv (compiled)",
                                                         "decode kvcli treekv (compiled)"]


def test_bench_speed_table_and_progress(invoke):
    result = invoke("bench-speed", "--shape", "tiny", "--cache", "16", "--block", "8", "--tokens", "16",
                    "--device", "cpu", "--matmul-size", "128")
    assert result.exit_code == 0, result.stderr
    assert "plain (sdpa)" in result.stdout and "kvcli streamingllm" in result.stdout and "MFU" in result.stdout
    assert "building tiny" in result.stderr  # progress on stderr, never on stdout
    assert "building" not in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "llama-9b"], "--shape 'llama-9b': choose one of"),
    (["--methods", "streamingllm,nope"], "unknown method 'nope'"),
    (["--methods", "full"], "--methods full: it keeps every token"),
    (["--cache", "0"], "--cache must be a positive number"),
    (["--block", "zero"], "--block must be a number of tokens or auto"),
    (["--decode", "-1"], "--decode must be at least 0"),
])
def test_bench_speed_usage_errors_are_one_line_and_exit_2(invoke, args, message):
    result = invoke("bench-speed", *args)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert result.stdout == ""


def test_shapes_are_the_named_ones():
    assert {"tiny", "smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b"} <= set(SHAPES)
