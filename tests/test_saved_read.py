"""Read once, ask many (issue #54): `kvcli read`, `kvcli ask FILE.kvc`, several questions, `--save`.

A saved read's answer is the answer of a fresh `ask --no-probe --no-one-shot` with the same options (the read
knows no question, the last block goes through with it); a file of another model, a damaged or crafted file,
options the read fixed: one line each, nothing run.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

QUESTIONS = ["Who was tired?", "What was her sister reading?"]


@pytest.fixture(autouse=True)
def _no_user_presets(config_home):
    """Every test here sees the built-in presets only."""


def options(model_dir, method: str = "treekv", *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--quiet", "--method", method, "--cache", "64", "--block", "32", *extra]


ANSWER = ["--max-new-tokens", "12"]


def fresh_answer(invoke, book, model_dir, question: str, method: str, *extra: str) -> str:
    result = invoke("ask", str(book), question, *options(model_dir, method, *extra), *ANSWER, "--no-probe",
                    "--no-one-shot", "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["answer"]


@pytest.mark.parametrize(("method", "extra"), [("treekv", ()), ("snapkv", ()), ("streamingllm", ("--kv-bits", "4")),
                                               ("treekv", ("--kv-bits", "2"))])  # 2 bits: keys without entry positions
def test_saved_read_answers_as_a_fresh_ask_without_probe(invoke, tiny_model_dir, book, tmp_path, method, extra):
    from kvcli.reading.saved import ReadState

    saved = tmp_path / "book.kvc"
    made = invoke("read", str(book), "--out", str(saved), *options(tiny_model_dir, method, *extra), "--json")
    assert made.exit_code == 0, made.stderr
    info = json.loads(made.stdout)
    assert info["file_bytes"] == saved.stat().st_size and info["document_tokens"] > 32 * 3
    assert info["peak_memory_bytes"] > 0
    state = ReadState.load(saved)  # every token read, its keys in 8 bits and a scale per KV head, and its id
    layers, heads, dim = len(state.recall_facts["layers"]), state.recall_facts["heads"], state.recall_facts["dim"]
    assert info["recall_index_bytes"] == len(state.recall_ids) * (layers * heads * (dim + 2) + 4)
    assert 1 <= info["pending_tokens"] <= 32 and info["max_cache_tokens"] <= 64 + 32

    asked = invoke("ask", str(saved), *QUESTIONS, "--model", str(tiny_model_dir), "--quiet", "--max-new-tokens", "12",
                   "--recall", "0", "--json")
    assert asked.exit_code == 0, asked.stderr
    answers = json.loads(asked.stdout)["answers"]
    assert [row["question"] for row in answers] == QUESTIONS
    for row in answers:  # each question starts from the same saved cache, so order does not matter
        assert row["answer"] == fresh_answer(invoke, book, tiny_model_dir, row["question"], method, *extra)


def test_several_questions_and_save_read_once(invoke, tiny_model_dir, book, tmp_path):
    saved = tmp_path / "once.kvc"
    both = invoke("ask", str(book), *QUESTIONS, *options(tiny_model_dir), *ANSWER, "--save", str(saved))
    assert both.exit_code == 0, both.stderr
    assert [line for line in both.stdout.splitlines() if line.startswith("Q: ")] == [f"Q: {q}" for q in QUESTIONS]
    assert both.stdout.count("\nA: ") == 2
    again = invoke("ask", str(saved), *QUESTIONS, "--model", str(tiny_model_dir), "--quiet", "--max-new-tokens", "12")
    assert again.exit_code == 0 and again.stdout == both.stdout


def test_questions_from_a_file(invoke, tiny_model_dir, book, tmp_path):
    listed = tmp_path / "questions.txt"
    listed.write_text(f"{QUESTIONS[0]}\n\n  {QUESTIONS[1]}  \n", encoding="utf-8")
    result = invoke("ask", str(book), "--questions", str(listed), *options(tiny_model_dir), *ANSWER, "--json")
    assert result.exit_code == 0, result.stderr
    assert [row["question"] for row in json.loads(result.stdout)["answers"]] == QUESTIONS


@pytest.fixture()
def saved(invoke, tiny_model_dir, book, tmp_path):
    path = tmp_path / "book.kvc"
    assert invoke("read", str(book), "--out", str(path), *options(tiny_model_dir)).exit_code == 0
    return path


def one_line_error(result, code: int = 1) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvcli: error:")
    return result.stderr


def test_another_model_is_refused(invoke, saved, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-model"
    other.mkdir()
    for item in tiny_model_dir.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    error = one_line_error(invoke("ask", str(saved), "Who?", "--model", str(other)))
    assert "weights differ" in error


def test_damaged_and_crafted_files_are_one_line(invoke, saved, tiny_model_dir, tmp_path):
    from safetensors.torch import save

    raw = saved.read_bytes()
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(raw[: len(raw) // 2])
    assert "damaged" in one_line_error(invoke("ask", str(cut), "Who?", "--model", str(tiny_model_dir)))
    flipped = tmp_path / "flipped.kvc"
    flipped.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    assert "checksum" in one_line_error(invoke("ask", str(flipped), "Who?", "--model", str(tiny_model_dir)))
    pickled = tmp_path / "pickle.kvc"
    torch.save({"a": 1}, pickled)
    assert "not a saved read" in one_line_error(invoke("ask", str(pickled), "Who?"))
    foreign = tmp_path / "foreign.kvc"
    foreign.write_bytes(save({"x": torch.zeros(2)}))
    assert "no kvcli-read header" in one_line_error(invoke("ask", str(foreign), "Who?"))
    # A header that is consistent (its checksum matches) but names tensors the file lacks.
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    data = save({"x": torch.zeros(2)})
    body = data[8 + int.from_bytes(data[:8], "little"):]
    meta = json.loads(header["__metadata__"]["kvcli-read"])
    meta["data_sha256"] = hashlib.sha256(body).hexdigest()
    crafted = tmp_path / "crafted.kvc"
    crafted.write_bytes(save({"x": torch.zeros(2)}, metadata={"kvcli-read": json.dumps(meta)}))
    assert "saved read" in one_line_error(invoke("ask", str(crafted), "Who?", "--model", str(tiny_model_dir)))


@pytest.mark.parametrize("option", [["--method", "snapkv"], ["--cache", "128"], ["--kv-bits", "8"], ["--recap", "512"],
                                    ["--probe"], ["--one-shot"]])
def test_options_a_saved_read_fixes_are_refused(invoke, saved, tiny_model_dir, option):
    error = one_line_error(invoke("ask", str(saved), "Who?", "--model", str(tiny_model_dir), *option), code=2)
    assert option[0] in error


def test_out_must_be_a_kvc_file_apart_from_the_source(invoke, tiny_model_dir, book, tmp_path):
    assert ".kvc" in one_line_error(invoke("read", str(book), "--out", str(tmp_path / "x.bin")), code=2)
    assert not (tmp_path / "x.bin").exists()
    folder = tmp_path / "books"
    folder.mkdir()
    inside = folder / "a.kvc"
    inside.write_text("not a book but a file of the source folder\n")
    one_line_error(invoke("read", str(folder), "--out", str(inside), "--model", str(tiny_model_dir)), code=2)


@pytest.mark.parametrize("method", ["streamingllm", "h2o", "tova", "snapkv", "pyramidkv", "pyramidinfer", "treekv",
                                    "full"])
def test_every_method_round_trips_through_a_file(tiny_model_dir, tmp_path, method):
    """Library level: the cache restored from a file holds every tensor the read left, bit for bit."""
    from kvcli import Engine, load_model, make_method
    from kvcli.kv.snapshot import snapshot_cache
    from kvcli.reading.reader import Reader
    from kvcli.reading.saved import ReadState, read_once

    loaded = load_model(str(tiny_model_dir))
    engine = Engine(loaded.model, make_method(method), None if method == "full" else 48, block=16)
    state = read_once(Reader(engine, loaded.tokenizer), [list(range(5, 90)), list(range(10, 70))])
    state.save(tmp_path / "x.kvc")
    again = ReadState.load(tmp_path / "x.kvc")
    tensors, facts = snapshot_cache(again.cache(engine))
    assert facts == state.facts and set(tensors) == set(state.tensors)
    assert all(torch.equal(tensors[name], state.tensors[name]) for name in tensors)
    assert again.pending == state.pending and 1 <= len(again.pending) <= 16
    assert again.document_tokens == 85 + 60 and again.read_tokens + len(again.pending) == len(again.prefix) + 145


def test_page_index_keeps_every_tokens_keys_in_8_bits_on_disk():
    """Each block's keys go to the index's spill file as they come; a layer and head's keys over any range of tokens,
    across blocks, come back as rounded, and a saved read's layout ([layers, heads, tokens, dim]) streams from it."""
    from kvcli.reading.recall import PageIndex

    index = PageIndex([1, 2], heads=2, dim=4, page=4)
    keys = {layer: torch.randn(10, 2, 4) for layer in (1, 2)}  # keys before RoPE: [n, heads, dim]
    for start, stop in ((0, 6), (6, 10)):  # a page spans the two blocks
        index._keys.update({layer: k[start:stop] for layer, k in keys.items()})
        index.add(list(range(start, stop)))
    store = index.store
    assert store.tokens == 10 and len(store.segments) == 2 and store.nbytes == 10 * 2 * 2 * (4 + 2)
    rows = torch.stack([keys[layer] for layer in (1, 2)], dim=1)  # [n, layers, heads, dim]
    for layer in range(2):
        for head in range(2):
            values, scale = store.read(layer, head, 3, 9)  # across the blocks' boundary
            assert values.shape == (6, 4) and values.dtype == torch.int8 and scale.dtype == torch.float16
            scale = scale.float().unsqueeze(-1)
            assert torch.all((values.float() * scale - rows[3:9, layer, head]).abs() <= scale / 2 + 1e-6)
            assert torch.allclose(scale.squeeze(-1), rows[3:9, layer, head].abs().amax(dim=-1) / 127, rtol=1e-3)
            pieces = list(store.pieces(layer, head, 10, 4))
            assert [len(v) for v, _ in pieces] == [4, 4, 2]
            assert torch.equal(torch.cat([v for v, _ in pieces]), store.read(layer, head, 0, 10)[0])
    streamed_keys, streamed_scales = store.streamed()
    laid = torch.frombuffer(bytearray(b"".join(streamed_keys)), dtype=torch.int8).view(2, 2, 10, 4)
    assert torch.equal(laid[1, 0, 2:7], store.read(1, 0, 2, 7)[0])
    scales = torch.frombuffer(bytearray(b"".join(streamed_scales)), dtype=torch.float16).view(2, 2, 10)
    assert torch.equal(scales[0, 1], store.read(0, 1, 0, 10)[1])
    assert index.token_ids().tolist() == list(range(10)) and index.facts()["usable"]


def in_pieces(values: torch.Tensor, scale: torch.Tensor, size: int):
    """The keys ``values`` and ``scale`` as :func:`kvcli.reading.recall._page_shares` takes them: ranges of ``size``."""
    return lambda: ((values[at:at + size], scale[at:at + size]) for at in range(0, len(values), size))


def test_key_rounding_cannot_overflow_or_divide_by_zero():
    """Keys of zeros, of tiny and of huge magnitude (past float16's 65,504) round to finite values and scales."""
    from kvcli.reading.recall import quantize

    rows = torch.tensor([[0.0, 0.0, 0.0], [1e-9, -2e-9, 0.0], [3e9, -1e9, 5.0], [1e5, 7e4, -9e4]])
    values, scale = quantize(rows)
    assert torch.isfinite(scale.float()).all() and (scale.float() > 0).all()
    assert torch.equal(values[0], torch.zeros(3, dtype=torch.int8))
    back = values.float() * scale.float().unsqueeze(-1)
    assert torch.all((back[3] - rows[3]).abs() <= scale[3].float() / 2 + 1)  # within half a step
    assert values[2, 0] == 127  # clamped, not wrapped


def test_recall_finds_the_page_whose_keys_match_the_question():
    """The page scoring: a page holding one token whose key the queries match outweighs pages of keys that
    spread widely but match nothing (the failure of a per-page channel range)."""
    from kvcli.reading.recall import _page_shares, quantize

    query = torch.ones(2, 8)
    keys = torch.full((64, 8), -1.0)  # 8 pages of 8 tokens
    for token in range(24):  # the first three pages: each token high in one channel, low in the others
        keys[token] = -6.0
        keys[token, token % 8] = 6.0
    keys[45] = 2.0  # the one token that matches every channel of the question, in page 5
    pages = keys.unflatten(0, (8, 8))
    bound = (query[0] * pages.amax(dim=1)).sum(dim=-1)  # a page summary's upper bound (Quest)
    assert bound.argmax().item() < 3  # ... prefers a page that spreads widely
    values, scale = quantize(keys)
    shares = _page_shares(query, in_pieces(values, scale, 64), 8)
    assert shares.argmax().item() == 5 and shares.shape == (8,)


def test_recall_counts_a_token_by_the_part_of_its_words_attention_it_takes():
    """A word the document repeats in the same setting (the form several facts share) splits the question's
    attention over its copies; its heaviest copy outweighs the asked name's one token by share alone, but not once
    each share counts by the part of its word's it takes."""
    from kvcli.reading.recall import _page_shares, quantize

    query = torch.zeros(1, 8)
    query[0, 0] = 6.0
    keys = torch.zeros(64, 8)  # 8 pages of 8 tokens
    # one copy of the shared word in each of four pages, the first favoured
    for page, lift in zip((0, 2, 4, 6), (1.3, 1.0, 1.0, 1.0), strict=True):
        keys[page * 8 + 3, 0] = lift
    keys[5 * 8 + 1, 0] = 1.05  # the name: one token of its word, in page 5
    words = torch.zeros(64, dtype=torch.long)
    words[[3, 19, 35, 51]] = 1
    words[41] = 2
    values, scale = quantize(keys)
    by_share = _page_shares(query, in_pieces(values, scale, 16), 8)
    assert by_share.argmax().item() == 0  # the favoured copy of the shared word
    weighed = _page_shares(query, in_pieces(values, scale, 16), 8, words)
    assert weighed.argmax().item() == 5
    distinct = _page_shares(query, in_pieces(values, scale, 16), 8, torch.arange(64))
    assert torch.allclose(distinct, by_share)  # every word distinct: the weight is the share


def test_recall_page_weights_in_chunks_and_logs_equal_the_formula_taken_literally():
    """The scoring runs over the read in pieces, twice, and in logs; its page weights are the rule's, computed the
    slow way: every token's share ``s`` over the whole read, ``S`` its word's, the weight ``s * (s / S) **
    DISTINCT``."""
    from kvcli.reading.recall import DISTINCT, _page_shares, quantize

    torch.manual_seed(5)
    query = torch.randn(6, 16) * 3
    values, scale = quantize(torch.randn(640, 16))
    words = torch.randint(0, 40, (640,))
    words[7] = 40  # a word with a single copy
    logits = (query @ (values.float() * scale.float().unsqueeze(-1)).T) / 16 ** 0.5
    shares = torch.softmax(logits.double(), dim=-1)
    per_word = torch.zeros(6, 41, dtype=torch.double)
    for token in range(640):
        per_word[:, words[token]] += shares[:, token]
    weight = shares * (shares / per_word[:, words]) ** DISTINCT
    expected = weight.unflatten(-1, (80, 8)).amax(dim=-1).amax(dim=0).float()
    for size in (8, 24, 4096):  # one page a piece, pieces not a divisor of the read, one piece
        assert torch.allclose(_page_shares(query, in_pieces(values, scale, size), 8, words), expected, rtol=1e-4)
        assert torch.allclose(_page_shares(query, in_pieces(values, scale, size), 8, None),
                              shares.unflatten(-1, (80, 8)).amax(dim=-1).amax(dim=0).float(), rtol=1e-4)


def test_recall_scores_only_the_layers_without_a_window_where_there_are_some():
    from kvcli.reading.recall import recall_layers

    assert recall_layers(range(6, 16), [512 if i % 6 != 5 else None for i in range(18)]) == [11]  # Gemma 3 270M
    assert recall_layers(range(0, 2), [4096, 4096]) == [0, 1]  # every layer windowed (Mistral)
    assert recall_layers(range(10, 26), [None] * 30) == list(range(10, 26))


def test_recall_reads_whole_pages_of_the_document_again(invoke, saved, tiny_model_dir):
    from kvcli.reading.saved import ReadState

    state = ReadState.load(saved)
    page, ids = state.recall_facts["page"], state.recall_ids.tolist()
    assert state.recall_facts["usable"] and len(ids) == state.read_tokens
    asked = invoke("ask", str(saved), *QUESTIONS, "--model", str(tiny_model_dir), "--quiet", *ANSWER, "--recall", "64",
                   "--json")
    assert asked.exit_code == 0, asked.stderr
    for row in json.loads(asked.stdout)["answers"]:
        assert 0 < row["recall_tokens"] <= 64 and row["recall_tokens"] % page == 0
    off = json.loads(invoke("ask", str(saved), *QUESTIONS, "--model", str(tiny_model_dir), "--quiet", *ANSWER,
                            "--recall", "0", "--json").stdout)
    assert all(row["recall_tokens"] == 0 for row in off["answers"])
    assert "--recall goes with" in one_line_error(invoke("ask", str(saved.with_suffix(".txt")), "Who?", "--recall",
                                                        "64"), code=2)


def test_recall_is_on_by_default_where_the_read_kept_its_index(invoke, saved, tiny_model_dir, tmp_path):
    """A saved read recalls RECALL_TOKENS by default; a read with no index it can use (here an older kvcli's)
    answers without recall unless --recall is asked for, which is refused with one line."""
    from kvcli.reading.recap import RECALL_TOKENS
    from kvcli.reading.saved import ReadState

    state = ReadState.load(saved)
    whole_pages = (state.read_tokens - len(state.prefix)) // state.recall_facts["page"] * state.recall_facts["page"]
    asked = invoke("ask", str(saved), QUESTIONS[0], "--model", str(tiny_model_dir), "--quiet", *ANSWER, "--json")
    assert asked.exit_code == 0, asked.stderr
    assert 0 < json.loads(asked.stdout)["answers"][0]["recall_tokens"] <= min(RECALL_TOKENS, whole_pages)
    older = tmp_path / "older.kvc"
    state.recall_facts.pop("kind")
    state.save(older)
    plain = invoke("ask", str(older), QUESTIONS[0], "--model", str(tiny_model_dir), "--quiet", *ANSWER, "--json")
    assert plain.exit_code == 0, plain.stderr
    assert json.loads(plain.stdout)["answers"][0]["recall_tokens"] == 0
    error = one_line_error(invoke("ask", str(older), QUESTIONS[0], "--model", str(tiny_model_dir), "--recall", "64"))
    assert "no recall index this kvcli can use" in error


def test_a_read_with_an_older_index_is_refused_recall(saved):
    """A file from the kvcli whose index held page ranges (no ``kind``) answers, but not with --recall."""
    from kvcli.errors import KvcliError
    from kvcli.reading.saved import ReadState, recalled

    state = ReadState.load(saved)
    state.recall_facts.pop("kind")
    with pytest.raises(KvcliError, match="no recall index this kvcli can use"):
        recalled(None, state, None, None, 64)


def test_another_dtype_is_refused(invoke, saved, tiny_model_dir):
    from kvcli.reading.saved import ReadState

    made = ReadState.load(saved).identity["dtype"]
    other = "float32" if made == "torch.bfloat16" else "bfloat16"
    error = one_line_error(invoke("ask", str(saved), "Who?", "--model", str(tiny_model_dir), "--dtype", other))
    assert f"it was read with dtype {made!r}" in error


@pytest.mark.parametrize("method", ["h2o", "treekv", "snapkv"])
def test_answering_leaves_the_saved_state_as_it_was(tiny_model_dir, method):
    """Methods update their per-token scores in place while writing: each question gets a copy, so the second
    question starts from exactly the cache the first did."""
    from kvcli import Engine, load_model, make_method
    from kvcli.reading.reader import Reader
    from kvcli.reading.saved import answer, read_once

    loaded = load_model(str(tiny_model_dir))
    engine = Engine(loaded.model, make_method(method), 48, block=16)
    reader = Reader(engine, loaded.tokenizer)
    state = read_once(reader, [list(range(5, 120))])
    before = {name: tensor.clone() for name, tensor in state.tensors.items()}
    first = answer(reader, state, QUESTIONS[0], 10)
    assert all(torch.equal(before[name], tensor) for name, tensor in state.tensors.items())
    assert answer(reader, state, QUESTIONS[0], 10).ids == first.ids


def test_recalled_pages_come_heaviest_last_each_with_the_next():
    from kvcli.reading.recall import heaviest_last

    weight = torch.tensor([-1.0, 0.9, 0.1, 0.2, 0.6, 0.0, 0.5, 0.05, 0.3])
    # 1 with 2, 4 with 5, then 6 alone (with 7 they would be six pages), joining 4-5 into one passage (its
    # heaviest 0.6) read in stream order; the heaviest passage, 1-2, last
    assert heaviest_last(weight, 5) == [4, 5, 6, 1, 2]
    assert heaviest_last(weight, 1) == [1]
    assert heaviest_last(torch.tensor([-1.0, 0.1, 0.9]), 4) == [2]  # the last page has no next; -1 never


def test_recall_leaves_pages_far_lighter_than_the_heaviest():
    from kvcli.reading.recall import KEEP_SHARE, heaviest_last

    weight = torch.tensor([-1.0, 0.9, 0.1, 0.2, 0.6, 0.0, 0.5, 0.05, 0.3])
    assert KEEP_SHARE == 0.5
    # room for eight pages: 1, 4 and 6 weigh at least half of 0.9, each comes with its next; 8 (0.3) stays out
    assert heaviest_last(weight, 8) == [4, 5, 6, 7, 1, 2]
    assert heaviest_last(weight, 8, share=0.0) == [1, 2, 3, 4, 5, 6, 7, 8]  # 8, then 3 (with 4) join all
    assert heaviest_last(torch.tensor([-1.0, 0.1, 0.9]), 4, share=0.0) == [1, 2]


@pytest.mark.parametrize("tail", [3, 15])
def test_recalled_tokens_are_read_in_the_questions_block_whatever_the_documents_tail(tiny_model_dir, monkeypatch,
                                                                                      tail):
    """The document's unread tail, the paragraph break and the recall over one block: the tail is read first, as a
    block of its own, so every recalled token is read with the question and held with it; none goes into a block
    compressed before the question (an answer from a saved read has no probe to score that block by)."""
    from kvcli import Engine, load_model, make_method
    from kvcli.reading import saved
    from kvcli.reading.reader import Reader

    loaded = load_model(str(tiny_model_dir))
    engine = Engine(loaded.model, make_method("snapkv"), 48, block=16)
    reader = Reader(engine, loaded.tokenizer)
    start = len(saved.prompt_parts(loaded.tokenizer, "").prefix)  # the chat template's opening is read first
    state = saved.read_once(reader, [list(range(5, 5 + 64 + (tail - start) % 16))])
    assert len(state.pending) == tail
    again = list(range(200, 212))
    monkeypatch.setattr(saved, "recalled", lambda *args: again)
    forwards = []
    real = Reader._forward
    monkeypatch.setattr(Reader, "_forward", lambda self, cache, ids, *args, **kw: forwards.append(
        (list(ids), kw.get("held", 0))) or real(self, cache, ids, *args, **kw))
    parts = saved.prompt_parts(loaded.tokenizer, QUESTIONS[0])
    saved.answer(reader, state, parts, 1, recall=len(again))
    reads = [(ids, held) for ids, held in forwards if ids[-len(parts.suffix):] != parts.suffix or held]
    last, held = reads[-1]
    assert last[-len(parts.suffix) - len(again):-len(parts.suffix)] == again and held >= len(again) + len(parts.suffix)
    assert all(not set(again) & set(ids) for ids, _ in reads[:-1])
    if tail + len(again) + 1 > 16:  # the tail could not share the question's block: read on its own first
        assert reads[-2][0] == state.pending[:-1]  # its last token stays, read with the recall


def test_a_spill_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A full disk (or a temporary folder that cannot be written) is a KvcliError naming where the index goes."""
    from kvcli.errors import KvcliError
    from kvcli.reading.keystore import KeyStore

    store = KeyStore.spill(1, 1, 4, tmp_path)

    def full(data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.stream, "write", full)
    with pytest.raises(KvcliError, match="No space left on device.*TMPDIR"):
        store.append(torch.zeros(2, 1, 1, 4, dtype=torch.int8), torch.ones(2, 1, 1, dtype=torch.float16))
    with pytest.raises(KvcliError, match="cannot make the recall index's temporary file"):
        KeyStore.spill(1, 1, 4, tmp_path / "missing")
    kept = KeyStore.spill(1, 1, 4, tmp_path)
    kept.append(torch.zeros(2, 1, 1, 4, dtype=torch.int8), torch.ones(2, 1, 1, dtype=torch.float16))
    kept.stream.truncate(3)  # the file cut short under its segments
    with pytest.raises(KvcliError, match="cannot read the recall index: .*ends sooner"):
        kept.read(0, 0, 0, 2)
