"""docs/results/kvpress_ruler.py's own attention mask, which its kvpress trials use where layers differ in length.

kvpress itself runs in its own environment; the mask needs only torch, so it is checked here against
transformers' own causal and sliding-window mask functions on a layer whose cache indices are positions."""

from __future__ import annotations

import pytest
import torch
from support import docs_script
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function


def _script():
    return docs_script("results/kvpress_ruler.py")


def _reference(q_len: int, k_len: int, window: int | None) -> torch.Tensor:
    """transformers' mask for queries at positions k_len - q_len ... k_len - 1 over keys 0 ... k_len - 1."""
    rule = sliding_window_causal_mask_function(window) if window else causal_mask_function
    zero = torch.tensor(0)
    return rule(zero, zero, torch.arange(k_len - q_len, k_len)[:, None], torch.arange(k_len)[None, :])


@pytest.mark.parametrize(("q_len", "k_len", "window"), [(5, 5, None), (3, 9, None), (7, 7, 3), (2, 11, 4), (1, 9, 4)])
def test_own_mask_is_transformers_mask_in_cache_indices(q_len, k_len, window):
    """Prefill, question after a cache, one decode step; with and without a window of ``window`` (Gemma 3's local
    layers): the same entries visible as transformers' own mask functions give."""
    mask = _script().own_mask(q_len, k_len, window, torch.device("cpu"))
    assert mask.shape == (1, 1, q_len, k_len)
    assert torch.equal(mask[0, 0], _reference(q_len, k_len, window))


def test_one_new_query_without_a_window_needs_no_mask():
    """A decode step on a global layer sees the whole cache: no mask, as SDPA's default."""
    assert _script().own_mask(1, 9, None, torch.device("cpu")) is None


def test_windowed_layers_are_left_alone_by_the_press():
    """The wrapped hook returns a windowed layer's output untouched and calls the press on any other layer."""
    calls = []

    def hook(module, inputs, kwargs, output):
        calls.append(module)
        return "compressed"

    wrapped = _script().skipping_windowed_layers(hook)
    local, full = type("A", (), {"is_sliding": True})(), type("A", (), {"is_sliding": False})()
    assert wrapped(local, (), {}, "out") == "out"
    assert wrapped(full, (), {}, "out") == "compressed"
    assert calls == [full]
