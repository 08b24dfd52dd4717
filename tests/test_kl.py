"""``kvcli ppl --save-logits / --kl-base``: KL divergence against a reference run, token by token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TEXT

from kvcli.eval.kl import KLMeter, LogitsWriter, Reference


def ppl(invoke, model_dir, source, *args):
    result = invoke("ppl", str(source), "--model", str(model_dir), "--block", "32", "--json", "--quiet", *args)
    return result, json.loads(result.stdout) if result.exit_code == 0 else None


@pytest.fixture()
def folder(tmp_path):
    """Two documents: the default protocol scores them with a fresh cache each, --stream as one stream."""
    path = tmp_path / "books"
    path.mkdir()
    (path / "a.txt").write_text(TEXT)
    (path / "b.txt").write_text(TEXT.upper())
    return path


@pytest.mark.parametrize("protocol", [[], ["--stream"]])
def test_a_run_against_itself_has_zero_kl(invoke, tiny_model_dir, folder, tmp_path, protocol):
    ref = tmp_path / "ref.kvlogits"
    _, saved = ppl(invoke, tiny_model_dir, folder, "--method", "treekv", "--cache", "48", "--save-logits", ref,
                   *protocol)
    assert saved["saved_logits"] == str(ref)
    _, again = ppl(invoke, tiny_model_dir, folder, "--method", "treekv", "--cache", "48", "--kl-base", ref, *protocol)
    assert again["kl_tokens"] == saved["tokens"] == again["tokens"]
    assert again["kl_mean"] == 0.0 and again["kl_p99"] == 0.0 and again["same_top"] == 1.0


def test_a_compressed_run_diverges_from_full(invoke, tiny_model_dir, folder, tmp_path):
    ref = tmp_path / "full.kvlogits"
    ppl(invoke, tiny_model_dir, folder, "--method", "full", "--stream", "--save-logits", ref)
    result, data = ppl(invoke, tiny_model_dir, folder, "--method", "streamingllm", "--cache", "16", "--stream",
                       "--kl-base", ref)
    assert result.exit_code == 0, result.stderr
    assert data["kl_mean"] > 0 and data["kl_p99"] >= data["kl_mean"] and 0 < data["same_top"] <= 1
    text = invoke("ppl", str(folder), "--model", str(tiny_model_dir), "--cache", "16", "--block", "32", "--stream",
                  "--quiet", "--kl-base", str(ref)).stdout
    assert "KL divergence vs full.kvlogits: mean " in text and "same top token" in text


def test_cache_256_diverges_more_than_1024_on_the_default_model(smollm, books, tmp_path):
    from kvcli.engine.engine import Engine
    from kvcli.io.documents import open_source
    from kvcli.io.text import first_tokens
    from kvcli.methods import make_method

    ids, _ = first_tokens(open_source(str(books / "pg11-alice-in-wonderland.txt")), smollm.tokenizer, 1537)
    vocab = smollm.model.config.vocab_size
    writer = LogitsWriter(tmp_path / "full", smollm.name, vocab)
    Engine(smollm.model, make_method("full"), None).score([ids], on_logits=writer.add)
    writer.close()
    kl = {}
    for cache in (256, 1024):
        meter = KLMeter(Reference(tmp_path / "full"))
        Engine(smollm.model, make_method("treekv"), cache).score([ids], on_logits=meter.add)
        kl[cache] = meter.finish()
    assert kl[256].mean > kl[1024].mean > 0
    assert kl[256].same_top < 1 and kl[1024].tokens == 1536


def test_mismatched_references_are_refused_with_one_line(invoke, tiny_model_dir, folder, book, tmp_path):
    ref = tmp_path / "ref.kvlogits"
    ppl(invoke, tiny_model_dir, folder, "--method", "full", "--save-logits", ref)
    cases = [
        ([book, "--kl-base", ref], "the run scored"),  # the first document alone: a shorter stream
        ([folder, "--stream", "--kl-base", ref], "another token stream"),  # other protocol: b's first token scored
        ([folder, "--kl-base", ref, "--max-tokens", "100000"], "is more than the"),
        ([folder, "--logits-top-k", "8"], "--logits-top-k goes with --save-logits"),
        ([folder, "--kl-base", ref, "--save-logits", ref], "never replaces an input"),
        ([folder, "--kl-base", book], "not a reference saved with --save-logits"),
        ([folder, "--kl-base", tmp_path / "missing"], "cannot read"),
    ]
    for args, message in cases:
        result = invoke("ppl", *[str(a) for a in args], "--model", str(tiny_model_dir), "--block", "32", "--quiet")
        assert result.exit_code != 0 and message in result.stderr, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    cut = tmp_path / "cut.kvlogits"
    cut.write_bytes(ref.read_bytes()[:-3])
    result = invoke("ppl", str(folder), "--model", str(tiny_model_dir), "--quiet", "--kl-base", str(cut))
    assert result.exit_code != 0 and "incomplete" in result.stderr


def test_kl_over_buckets_matches_a_literal_computation(tmp_path):
    gen = torch.Generator().manual_seed(0)
    base_logits, run_logits = torch.randn(5, 40, generator=gen) * 3, torch.randn(5, 40, generator=gen) * 3
    targets = torch.arange(5)
    writer = LogitsWriter(tmp_path / "r", "m", 40, top_k=4)
    writer.add(base_logits.log_softmax(-1), targets)
    writer.close()
    meter = KLMeter(Reference(tmp_path / "r"))
    meter.add(run_logits.log_softmax(-1), targets)
    got = meter.finish()
    expected = []
    for p_row, q_row in zip(base_logits.double().softmax(-1).tolist(), run_logits.double().softmax(-1).tolist(),
                            strict=True):
        top = sorted(range(40), key=lambda i: -p_row[i])[:4]
        p = [p_row[i] for i in top] + [1 - sum(p_row[i] for i in top)]
        q = [q_row[i] for i in top] + [1 - sum(q_row[i] for i in top)]
        expected.append(sum(a * np.log(a / b) for a, b in zip(p, q, strict=True)))
    assert got.mean == pytest.approx(np.mean(expected), rel=2e-3)  # fp16 log-probabilities in the file
    assert got.p99 == pytest.approx(np.percentile(expected, 99), rel=2e-3)
