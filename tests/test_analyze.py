"""kvcli analyze: the statistics against literal slow references, and the command as a user meets it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcli.eval.analysis import (
    AttentionSample,
    attention_profile,
    bin_edges,
    detail_reconstruction,
    entropy_bits,
    greedy_layer_groups,
    group_vote,
    haar_dwt,
    haar_idwt,
    js_divergence,
    keys_for_mass,
    layer_similarity,
    position_counts,
    record_attention,
    sampled_attention,
    spearman,
    wavelet_magnitudes,
)
from kvcli.models.load import tiny_llama

R2 = math.sqrt(2.0)


# --- references -----------------------------------------------------------------------------------------


def literal_js(p: list[float], q: list[float]) -> float:
    """JS divergence in bits, term by term from its definition."""
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl_p = sum(a * math.log2(a / c) for a, c in zip(p, m, strict=True) if a > 0)
    kl_q = sum(b * math.log2(b / c) for b, c in zip(q, m, strict=True) if b > 0)
    return (kl_p + kl_q) / 2


def literal_groups(sim: list[list[float]], threshold: float) -> list[list[int]]:
    """PoD's Algorithm 1 as printed, with layers counted from 1, shifted to 0 at the end."""
    blocks = [{1}]
    for layer in range(2, len(sim) + 1):
        current = blocks[-1]
        if all(sim[layer - 1][other - 1] >= threshold for other in current):
            current.add(layer)
        else:
            blocks.append({layer})
    return [sorted(layer - 1 for layer in block) for block in blocks]


# --- entropy and sparsity ------------------------------------------------------------------------------


def test_entropy_matches_a_hand_computation():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert entropy_bits(probs).tolist() == pytest.approx([2.0, 1.5, 0.0])


def test_keys_for_mass_counts_the_top_keys_needed():
    probs = torch.tensor([[0.05, 0.6, 0.1, 0.25], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert keys_for_mass(probs, 0.9).tolist() == [3, 1, 4]  # 0.6 + 0.25 + 0.1; one key; all four


def test_profile_averages_over_queries_and_normalises_by_visible_keys():
    # one layer, one head, two queries at positions 2 and 3 (3 and 4 visible keys)
    probs = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    sample = AttentionSample([probs], [torch.zeros(1, 4, 2)], torch.tensor([2, 3]))
    profile = attention_profile(sample, mass=0.9)
    assert profile["entropy_bits"] == [[pytest.approx(1.5)]]
    assert profile["entropy_normalized"][0][0] == pytest.approx((1 / math.log2(3) + 2 / 2) / 2, abs=1e-4)
    assert profile["keys_fraction"][0][0] == pytest.approx((2 / 3 + 4 / 4) / 2, abs=1e-4)


def test_spearman_sign():
    assert spearman([0, 1, 2, 3], [9, 7, 4, 1]) == pytest.approx(-1.0)
    assert spearman([0, 1, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.8)


# --- Jensen-Shannon similarity and PoD's grouping ---------------------------------------------------------


def test_js_divergence_on_hand_made_distributions():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    assert float(js_divergence(p, p)) == pytest.approx(0.0, abs=1e-7)
    assert float(js_divergence(p, torch.tensor([0.0, 0.0, 0.3, 0.7]))) == pytest.approx(1.0)  # disjoint
    a, b = [1.0, 0.0], [0.5, 0.5]
    expected = (math.log2(4 / 3) + 0.5 * math.log2(2 / 3) + 0.5 * math.log2(2)) / 2
    assert literal_js(a, b) == pytest.approx(expected)
    assert float(js_divergence(torch.tensor(a), torch.tensor(b))) == pytest.approx(expected, rel=1e-6)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.rand(2, 7, generator=generator).softmax(dim=-1)
        assert float(js_divergence(x, y)) == pytest.approx(literal_js(x.tolist(), y.tolist()), rel=1e-5)


def test_layer_similarity_is_one_minus_mean_js_over_queries():
    uniform = torch.full((1, 2, 4), 0.25)
    first = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]])
    disjoint = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.5]]])
    sim = layer_similarity([first, first.clone(), disjoint, uniform])
    assert sim.shape == (1, 4, 4)
    assert torch.equal(sim, sim.transpose(1, 2)) and torch.all(sim.diagonal(dim1=1, dim2=2) == 1)
    assert float(sim[0, 0, 1]) == pytest.approx(1.0)
    assert float(sim[0, 0, 2]) == pytest.approx(0.0, abs=1e-6)
    rows = [literal_js(a.tolist(), b.tolist()) for a, b in zip(first[0], uniform[0], strict=True)]
    assert float(sim[0, 0, 3]) == pytest.approx(1 - sum(rows) / 2, rel=1e-6)


def test_greedy_grouping_needs_similarity_to_every_layer_of_the_block():
    sim = [
        [1.0, 0.9, 0.8, 0.4, 0.1, 0.1],
        [0.9, 1.0, 0.7, 0.6, 0.1, 0.1],
        [0.8, 0.7, 1.0, 0.9, 0.2, 0.6],
        [0.4, 0.6, 0.9, 1.0, 0.5, 0.7],  # close to 1 and 2 but not to 0: starts a block
        [0.1, 0.1, 0.2, 0.5, 1.0, 0.5],  # exactly the threshold joins
        [0.1, 0.1, 0.6, 0.7, 0.5, 1.0],
    ]
    expected = [[0, 1, 2], [3, 4, 5]]
    assert literal_groups(sim, 0.5) == expected
    assert greedy_layer_groups(torch.tensor(sim) >= 0.5) == expected
    assert greedy_layer_groups(torch.tensor(sim) >= 0.95) == [[0], [1], [2], [3], [4], [5]]
    assert greedy_layer_groups(torch.tensor(sim) >= 0.0) == [[0, 1, 2, 3, 4, 5]]


def test_kv_head_groups_follow_the_majority_of_their_query_heads():
    alike = torch.ones(3, 3)
    apart = torch.eye(3)
    # KV head 0: query heads 0-2, two of three see layers alike; KV head 1: query heads 3-5, one of three
    sim = torch.stack([alike, alike, apart, alike, apart, apart])
    vote = group_vote(sim, kv_heads=2, threshold=0.5)
    assert [greedy_layer_groups(v) for v in vote] == [[[0, 1, 2]], [[0], [1], [2]]]
    tie = group_vote(torch.stack([alike, apart]), kv_heads=1)  # a tie is not a majority
    assert greedy_layer_groups(tie[0]) == [[0], [1], [2]]


# --- Haar wavelets ---------------------------------------------------------------------------------------


def test_haar_dwt_matches_the_papers_filters_by_hand():
    x = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    approx, (d1, d2) = haar_dwt(x, 2)
    # A1 = (x0 + x1, x2 + x3) / √2 = (2√2, 2√2); D1 = (x0 - x1, x2 - x3) / √2 = (-√2, 0)
    assert d1.tolist() == pytest.approx([-R2, 0.0])
    assert d2.tolist() == pytest.approx([0.0]) and approx.tolist() == pytest.approx([4.0])
    assert detail_reconstruction(d1, 1).tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    assert torch.allclose(haar_idwt(approx, [d1, d2]), x)


def test_haar_reconstruction_is_perfect_and_levels_add_up():
    x = torch.randn(3, 5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    approx, details = haar_dwt(x, 4)
    assert [d.shape[-1] for d in details] == [32, 16, 8, 4] and approx.shape[-1] == 4
    assert torch.allclose(haar_idwt(approx, details), x)
    zeros = [torch.zeros_like(d) for d in details]
    parts = [detail_reconstruction(d, level) for level, d in enumerate(details, start=1)]
    assert torch.allclose(sum(parts) + haar_idwt(approx, zeros), x)  # Rec(A_L) + sum of Rec(D_l)
    with pytest.raises(ValueError):
        haar_dwt(torch.zeros(12), 3)


def test_wavelet_signal_is_the_last_querys_attention_times_values():
    length, levels = 10, 2  # 10 % 4 = 2 oldest positions dropped
    probs = torch.zeros(2, 1, length)
    probs[:, 0] = torch.softmax(torch.arange(length, dtype=torch.float32), dim=0)
    values = torch.randn(1, length, 3, generator=torch.Generator().manual_seed(2))  # one KV head for two heads
    magnitudes, start = wavelet_magnitudes(AttentionSample([probs], [values], torch.tensor([length - 1])), levels)
    assert start == 2 and magnitudes.shape == (levels, length - 2)
    signal = (probs[0, 0, 2:, None] * values[0, 2:]).T  # [channels, positions]
    _, details = haar_dwt(signal, levels)
    expected = detail_reconstruction(details[1], 2).norm(dim=0)
    assert torch.allclose(magnitudes[1].float(), expected, atol=1e-6)


# --- recording and positions -----------------------------------------------------------------------------


def test_recorded_attention_is_the_models_own_causal_attention():
    model = tiny_llama(num_layers=2)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))
    sample = record_attention(model, ids, queries=8)
    assert model.config._attn_implementation == "kvcli"  # restored
    assert sample.rows.tolist() == list(range(32, 40))
    assert len(sample.probs) == 2 and sample.probs[0].shape == (4, 8, 40) and sample.values[0].shape == (2, 40, 16)
    assert torch.allclose(sample.probs[1].sum(dim=-1), torch.ones(4, 8))
    assert torch.all(sample.probs[0][:, 0, 33:] == 0)  # query at 32 sees keys 0..32 only
    eager = tiny_llama(num_layers=2)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        reference = eager(input_ids=ids[None], output_attentions=True).attentions
    for layer in range(2):
        assert torch.allclose(sample.probs[layer], reference[layer][0, :, 32:], atol=1e-5)


def test_sampled_attention_groups_query_heads_under_their_kv_head():
    query = torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(4))
    key = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(5))
    probs = sampled_attention(query, key, 0.5, torch.tensor([5]))
    for head in range(4):
        expected = torch.softmax(query[0, head, 5] @ key[0, head // 2].T * 0.5, dim=-1)
        assert torch.allclose(probs[head, 0], expected, atol=1e-6)


def test_position_bins():
    assert bin_edges(10, 4) == [0, 2, 5, 8, 10] and bin_edges(3, 8) == [0, 1, 2, 3]
    token_idx = torch.tensor([[0, 1, 2, 9], [0, 4, 5, 8]])
    assert position_counts(token_idx, [0, 2, 5, 8, 10]) == [3, 2, 1, 2]


# --- the command ---------------------------------------------------------------------------------------------


def analyze_args(book, model_dir, out, *extra: str) -> list[str]:
    return ["analyze", str(book), "--model", str(model_dir), "--max-tokens", "160", "--cache", "48", "--block", "32",
            "--queries", "8", "--bins", "16", "--out", str(out), "--quiet", *extra]


@pytest.fixture(scope="module")
def dracula(books):
    return books / "pg345-dracula.txt"


def test_analyze_writes_json_with_four_sections_and_pngs(invoke, tiny_model_dir, dracula, tmp_path):
    result = invoke(*analyze_args(dracula, tiny_model_dir, tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("analyzed 160 tokens") and "PoD groups" in result.stdout
    data = json.loads((tmp_path / "out" / "analysis.json").read_text())
    assert {"attention", "similarity", "positions", "wavelet"} <= set(data) and data["tokens"] == 160
    att = data["attention"]
    assert att["layers"] == 2 and att["heads"] == 4 and len(att["entropy_bits"]) == 2
    assert att["query_positions"] == list(range(152, 160))
    sim = data["similarity"]
    assert len(sim["per_head"]) == 4 and len(sim["groups"]) == 4
    assert all(sum(len(g) for g in groups) == 2 for groups in sim["groups"])
    assert len(sim["kv_groups"]) == 2 and len(sim["kv_group_counts"]) == 2
    methods = data["positions"]["methods"]
    assert list(methods) == ["streamingllm", "h2o", "snapkv", "tova", "treekv", "pyramidkv", "pyramidinfer"]
    for row in methods.values():
        assert len(row["counts"]) == 2 and len(row["kept_fraction"]) == 16
        assert max(row["cache_tokens"]) <= 2 * 48 and 0 <= min(row["kept_fraction"]) <= max(row["kept_fraction"]) <= 1
    streaming = methods["streamingllm"]
    assert streaming["cache_tokens"] == [48, 48]
    assert streaming["kept_fraction"][-1] == 1.0 and streaming["kept_fraction"][5] == 0.0
    assert sorted(data["wavelet"]["magnitude"]) == ["D1", "D2", "D3", "D4", "D5"]
    for name in ("entropy", "similarity", "positions", "positions_by_layer", "wavelet"):  # matplotlib is a dependency
        assert (tmp_path / "out" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_analyze_json_stdout_is_pure_json(invoke, tiny_model_dir, dracula, tmp_path):
    result = invoke(*analyze_args(dracula, tiny_model_dir, tmp_path, "--json", "--methods", "treekv,full",
                                  "--no-plots"))
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data == json.loads((tmp_path / "analysis.json").read_text())
    assert not list(tmp_path.glob("*.png")) and data["files"] == [str(tmp_path / "analysis.json")]
    assert list(data["positions"]["methods"]) == ["treekv", "full"]
    assert data["positions"]["methods"]["full"]["cache_tokens"] == [160, 160]


@pytest.mark.parametrize(
    ("change", "message", "code"),
    [
        ({"book": "/no/such/book.txt"}, "no such file", 1),
        ({"extra": ["--methods", "treekv,nosuch"]}, "unknown method", 2),
        ({"extra": ["--max-tokens", "600"]}, "trained context (512)", 2),
        ({"extra": ["--queries", "0"]}, "--queries", 2),
    ],
)
def test_errors_are_one_line_without_traceback(invoke, tiny_model_dir, dracula, tmp_path, change, message, code):
    args = analyze_args(change.get("book", dracula), tiny_model_dir, tmp_path, *change.get("extra", []))
    result = invoke(*args)
    assert result.exit_code == code, result.stderr
    assert result.stdout == "" and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
