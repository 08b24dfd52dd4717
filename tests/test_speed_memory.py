"""``kvcli bench-speed`` refuses a shape that does not fit the device's free memory, in one line and before it
allocates anything (issue 57)."""

from __future__ import annotations

import torch

import kvcli.eval.bench.speed as speed


def test_a_shape_too_large_for_the_free_memory_is_one_line_before_any_allocation(invoke, monkeypatch):
    built: list[str] = []
    original = speed.build_model

    def spy(name, device="cpu", dtype=torch.float32, seed=0):
        built.append(str(device))
        return original(name, device, dtype, seed)

    monkeypatch.setattr(speed, "build_model", spy)
    monkeypatch.setattr(speed, "free_memory", lambda device: 3 * speed.GiB)
    result = invoke("bench-speed", "--shape", "llama-3.1-8b", "--device", "cpu", "--dtype", "bfloat16")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == ("kvcli: error: --shape llama-3.1-8b needs about 15.5 GiB (15.0 GiB for the weights in "
                             "bfloat16, 0.6 GiB to run), and cpu has 3.0 GiB free: choose a smaller shape or a "
                             "device with more memory\n")
    assert built == ["meta"]  # counted on the meta device, never built on the CPU


def test_the_weights_counted_are_the_shapes_parameters():
    model = speed.build_model("llama-3.1-8b", "meta", torch.bfloat16)
    weights, working = speed.memory_needed(model, torch.bfloat16, 1024, 256)
    assert weights == 2 * sum(p.numel() for p in model.parameters()) and 8.0e9 < weights / 2 < 8.1e9
    assert 0 < working < weights / 10


def test_a_shape_that_fits_runs(invoke, monkeypatch):
    monkeypatch.setattr(speed, "free_memory", lambda device: 3 * speed.GiB)
    result = invoke("bench-speed", "--shape", "tiny", "--cache", "16", "--block", "8", "--tokens", "16", "--json",
                    "--quiet")
    assert result.exit_code == 0 and '"shape": "tiny"' in result.stdout
    speed.check_memory("tiny", torch.device("cpu"), torch.float32, 16, 8, free=None)  # a real reading passes too
