"""Gemma 3 270M, the second real model: sliding-window layers, two RoPE bases, one KV head (slow: --run-slow)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvcli.engine.engine import Engine
from kvcli.kv.architecture import describe
from kvcli.methods import make_method

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def alice(gemma, books) -> torch.Tensor:
    text = (books / "pg11-alice-in-wonderland.txt").read_text(encoding="utf-8")[:20000]
    return torch.tensor(gemma.tokenizer(text).input_ids[:1024])


def test_the_preset_reads_gemma3_layer_facts(gemma):
    arch = describe(gemma.model)
    assert arch.model_type == "gemma3_text" and len(arch.layers) == 18
    assert arch.budgeted == [5, 11, 17]
    assert {layer.window for i, layer in enumerate(arch.layers) if i not in arch.budgeted} == {512}
    assert {layer.rope_theta for layer in arch.layers} == {10000.0, 1000000.0}
    assert all(arch.layers[i].rope_theta == 1000000.0 for i in arch.budgeted)


def test_full_streamed_equals_one_eager_forward(gemma, alice):
    model, ids = gemma.model, alice[:700]
    totals = Engine(model, make_method("full"), None, block=256).score([ids.tolist()])
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
    finally:
        model.set_attn_implementation("kvcli")
    expected = F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum").item()
    assert totals.nll_sum == pytest.approx(expected, rel=1e-3 if gemma.dtype != torch.float32 else 1e-4)


@pytest.mark.parametrize("name", ["streamingllm", "snapkv"])
def test_compressing_methods_keep_windows_and_budget(gemma, alice, name):
    engine = Engine(gemma.model, make_method(name), 256, block=128)
    cache = engine.new_cache()
    totals = engine.score([alice.tolist()], cache=cache)
    lengths = cache.lengths()
    assert math.isfinite(totals.ppl) and totals.ppl < 60
    assert [lengths[i] for i in engine.architecture.budgeted] == [256, 256, 256]
    assert all(lengths[i] == 511 for i in range(18) if i not in engine.architecture.budgeted)
    assert totals.max_cache_tokens == 256


@pytest.mark.parametrize("name", ["streamingllm", "treekv", "snapkv", "pyramidkv"])
def test_summarize_streams_a_document_and_writes_within_budget(gemma, books, name):
    """`kvcli summarize` with Gemma 3: a document read in blocks (3k tokens, cache 256, the chat template's
    end-of-turn stops it), every budgeted layer within budget while reading and writing."""
    from kvcli.io.documents import open_source
    from kvcli.reading.prompts import TEMPLATES, build_prompt, stop_token_ids
    from kvcli.reading.reader import Reader, document_tokens

    engine = Engine(gemma.model, make_method(name), 256, block=256)
    tokenizer = gemma.tokenizer
    parts = build_prompt(tokenizer, TEMPLATES["summary"])
    ids = [t for chunk in document_tokens(open_source(str(books / "pg11-alice-in-wonderland.txt")), tokenizer)
           for t in chunk][:3000]
    reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, gemma.model))
    gen = reader.run(parts, [ids], 16, one_shot=False)
    assert not gen.one_shot and gen.document_tokens == 3000
    assert gen.max_cache_tokens <= max(engine.budgets[i] for i in engine.architecture.budgeted)
    assert gen.ids and gen.text.strip()
