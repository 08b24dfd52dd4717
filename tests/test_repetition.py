"""Answers that do not loop (the repetition control of the writer) and summaries in sections that cover the whole
document (kvcli.reading.sections)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TEXT

from kvcli.engine.engine import Engine
from kvcli.methods import make_method
from kvcli.models.load import tiny_llama
from kvcli.reading.generate import RepetitionGuard
from kvcli.reading.prompts import (
    ANSWER_REPETITION,
    SUMMARY_REPETITION,
    TEMPLATES,
    PromptParts,
    Repetition,
    build_prompt,
    question_instruction,
)
from kvcli.reading.reader import Reader
from kvcli.reading.sections import Section, line_breaks, split_sections, summarize_in_sections


class CharTokenizer:
    """Token id = code point (ASCII, so that every id is one of the tiny model's 128): no chat template, no BOS."""

    chat_template = None

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)

    def __call__(self, text, **kwargs):
        return Encoding(input_ids=[ord(c) % 128 for c in text], special_tokens_mask=[0] * len(text))


class Encoding(dict):
    """What a tokenizer call returns: read by key and by attribute."""

    __getattr__ = dict.__getitem__


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seed=1)


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


# --- the guard ------------------------------------------------------------------------------------------------
def test_a_token_that_would_repeat_an_ngram_of_the_answer_is_banned():
    guard = RepetitionGuard(Repetition(no_repeat_ngram=3))
    for token in (5, 6, 7, 5):
        guard.add(token)
    assert guard.banned() == []  # "7 5" has not been followed yet
    guard.add(6)
    assert guard.banned() == [7]  # "5 6" was followed by 7
    logits = torch.zeros(10)
    out = guard(logits)
    assert out[7] == float("-inf") and torch.isfinite(out[[0, 1, 2, 3, 4, 5, 6, 8, 9]]).all()
    assert torch.equal(logits, torch.zeros(10))  # a captured graph's logits are never written into


def test_the_penalty_weighs_down_every_token_the_answer_holds():
    guard = RepetitionGuard(Repetition(penalty=2.0))
    guard.add(1)
    logits = torch.tensor([4.0, 4.0, -4.0, -4.0])
    assert guard(logits).tolist() == [4.0, 2.0, -4.0, -4.0]
    guard.add(3)
    assert guard(logits).tolist() == [4.0, 2.0, -4.0, -8.0]
    assert logits.tolist() == [4.0, 4.0, -4.0, -4.0]


def test_off_changes_nothing():
    assert not Repetition().active and Repetition(0, 1.0) == Repetition()
    assert ANSWER_REPETITION.active and SUMMARY_REPETITION.active
    assert ANSWER_REPETITION.penalty == 1.0  # a penalty would weigh down the second "4" of the key 60494


def test_a_base_models_answer_ends_where_it_would_ask_the_next_question(smol_tokenizer):
    plain = build_prompt(CharTokenizer(), question_instruction("Who?"))
    assert not plain.chat and plain.stop == ("\nQuestion:", "\nAnswer:")
    chat = build_prompt(smol_tokenizer, question_instruction("Who?"))
    assert chat.chat and chat.stop == ()
    assert build_prompt(CharTokenizer(), TEMPLATES["summary"]).stop == ()


# --- the writer ------------------------------------------------------------------------------------------------
def write(model, method: str, repetition: Repetition, tokens: int = 80) -> list[int]:
    engine = Engine(model, make_method(method), 48, block=16)
    reader = Reader(engine, CharTokenizer(), repetition=repetition)
    document = torch.randint(3, 128, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    return reader.run(PromptParts([1, 2], [3, 4, 5], chat=False), [document], tokens, one_shot=False).ids


@pytest.mark.parametrize("method", ["snapkv", "streamingllm", "treekv", "pyramidinfer"])
def test_the_answer_never_repeats_an_ngram_whatever_the_decode_step(model, method):
    """snapkv, streamingllm and treekv write with the static steps (kvcli.kv.decode: the CUDA graph on a GPU),
    pyramidinfer with the engine's: the ban applies to the logits either way."""
    plain = write(model, method, Repetition())
    assert len(set(ngrams(plain, 3))) < len(ngrams(plain, 3))  # the tiny random model loops
    guarded = write(model, method, Repetition(no_repeat_ngram=3))
    assert len(guarded) == 80 and len(set(ngrams(guarded, 3))) == len(ngrams(guarded, 3))
    first = next(i for i, (a, b) in enumerate(zip(plain, guarded, strict=True)) if a != b)
    assert plain[first - 2:first + 1] in [list(g) for g in ngrams(plain[:first], 3)]  # it differs where it looped


def test_the_prompt_does_not_count(model, monkeypatch):
    """The guard knows the answer's tokens and nothing else: not the prompt's, not the document's."""
    import kvcli.reading.generate

    guards: list[RepetitionGuard] = []

    class Spy(RepetitionGuard):
        def __init__(self, settings):
            super().__init__(settings)
            guards.append(self)

    monkeypatch.setattr(kvcli.reading.generate, "RepetitionGuard", Spy)
    engine = Engine(model, make_method("snapkv"), 48, block=16)
    reader = Reader(engine, CharTokenizer(), repetition=Repetition(no_repeat_ngram=2))
    gen = reader.run(PromptParts([1, 2], [3, 4, 5], chat=False), [list(range(10, 90))], 20, one_shot=False)
    assert len(guards) == 1 and guards[0].ids == gen.ids and len(gen.ids) == 20


# --- sections --------------------------------------------------------------------------------------------------
def test_sections_end_at_a_line_break_in_their_last_quarter():
    is_break = line_breaks(CharTokenizer())
    text = [ord(c) for c in ("a" * 70 + "\n" + "b" * 40)]
    pieces = list(split_sections([text[:50], text[50:]], 80, is_break))
    assert [len(p) for p in pieces] == [71, 40] and pieces[0][-1] == ord("\n")
    plain = list(split_sections([list(range(10, 260))], 100))
    assert [len(p) for p in plain] == [100, 100, 50] and sum(plain, []) == list(range(10, 260))
    # a remainder of a quarter of a section or less goes with the last section
    assert [len(p) for p in split_sections([list(range(220))], 100)] == [100, 120]
    assert [len(p) for p in split_sections([[1] * 45] * 5, 100)] == [100, 125]  # streamed in chunks alike


def test_a_long_document_is_summarized_section_by_section_then_as_a_whole(model):
    engine = Engine(model, make_method("treekv"), 48, block=16)
    reader = Reader(engine, CharTokenizer(), repetition=Repetition(no_repeat_ngram=3))
    calls: list[tuple[list[int], int]] = []
    run = reader.run

    def spy(parts, document, max_new_tokens, **kwargs):
        ids = [token for chunk in document for token in chunk]
        calls.append((parts.suffix, len(ids), max_new_tokens))
        return run(parts, [ids], max_new_tokens, **kwargs)

    reader.run = spy
    document = torch.randint(40, 128, (250,), generator=torch.Generator().manual_seed(2)).tolist()
    seen: list[Section] = []
    shown: list[str] = []
    gen, sections = summarize_in_sections(reader, TEMPLATES["tldr"], [document], 12, section=100, combine=True,
                                          on_section=lambda i, s: seen.append(s), on_text=shown.append)
    assert [(s.start, s.tokens) for s in sections] == [(0, 100), (100, 100), (200, 50)] and seen == sections
    assert [c[1:] for c in calls] == [(100, 12), (100, 12), (50, 12), (calls[3][1], 12)]
    assert calls[0][0] != calls[3][0]  # the sections are asked for a summary, the last pass the user's tldr
    assert gen.document_tokens == 250 and gen.generated_tokens <= 12 and "".join(shown) == gen.text
    assert gen.prompt_tokens > 250  # every pass's prompt counted


def test_the_default_summary_is_the_sections_summaries_in_order_as_they_are_written(model):
    engine = Engine(model, make_method("treekv"), 48, block=16)
    reader = Reader(engine, CharTokenizer(), repetition=Repetition(no_repeat_ngram=3))
    document = torch.randint(40, 128, (250,), generator=torch.Generator().manual_seed(2)).tolist()
    shown: list[str] = []
    read: list[int] = []
    gen, sections = summarize_in_sections(reader, TEMPLATES["summary"], [document], 6, section=100,
                                          on_text=shown.append, on_read=lambda g: read.append(len(shown)))
    assert len(sections) == 3 and read == [0]  # on_read once, before the first text
    assert gen.text == "".join(shown) and gen.generated_tokens <= 18
    assert gen.text.count("\n\n") >= 2 and all(s.summary in gen.text for s in sections)


def test_a_document_within_one_section_is_one_pass(model):
    engine = Engine(model, make_method("treekv"), 48, block=16)
    document = list(range(40, 120))
    for section in (0, 100):
        gen, sections = summarize_in_sections(Reader(engine, CharTokenizer()), TEMPLATES["summary"], [document], 4,
                                              section=section)
        assert sections == [] and gen.document_tokens == 80


# --- the CLI ---------------------------------------------------------------------------------------------------
def common(model_dir, book) -> list[str]:
    return [str(book), "--model", str(model_dir), "--method", "treekv", "--cache", "48", "--block", "32",
            "--max-new-tokens", "40"]


def test_help_names_the_controls(invoke):
    summary = invoke("summarize", "--help").stdout
    assert "--no-repeat-ngram" in summary and "--repetition-penalty" in summary and "--section" in summary
    answer = invoke("ask", "--help").stdout
    assert "--no-repeat-ngram" in answer and "--section" not in answer


def test_ask_writes_with_the_control_unless_it_is_turned_off(invoke, tiny_model_dir, book, smol_tokenizer):
    args = [*common(tiny_model_dir, book), "--quiet", "--json"]
    default = json.loads(invoke("ask", *args[:1], "What happens?", *args[1:]).stdout)
    off = json.loads(invoke("ask", *args[:1], "What happens?", *args[1:], "--no-repeat-ngram", "0").stdout)
    assert (default["no_repeat_ngram"], default["repetition_penalty"]) == (ANSWER_REPETITION.no_repeat_ngram,
                                                                           ANSWER_REPETITION.penalty)
    assert off["no_repeat_ngram"] == 0
    n = ANSWER_REPETITION.no_repeat_ngram
    ids = smol_tokenizer.encode(default["answer"], add_special_tokens=False)
    assert len(ids) > n and len(set(ngrams(ids, n + 1))) == len(ngrams(ids, n + 1))


def test_summarize_in_sections_from_the_cli(invoke, tiny_model_dir, tmp_path):
    long_book = tmp_path / "long.txt"
    long_book.write_text(TEXT * 4)
    result = invoke("summarize", *common(tiny_model_dir, long_book), "--section", "120", "--json")
    data = json.loads(result.stdout)
    assert (data["no_repeat_ngram"], data["repetition_penalty"]) == (SUMMARY_REPETITION.no_repeat_ngram,
                                                                     SUMMARY_REPETITION.penalty)
    starts = [part["start"] for part in data["sections"]]
    assert data["section"] == 120 and len(starts) >= 2 and starts[0] == 0
    assert sum(part["tokens"] for part in data["sections"]) == data["document_tokens"]
    assert all(part["tokens"] <= 120 for part in data["sections"])
    assert all(part["summary"] in data["summary"] for part in data["sections"])
    streamed = invoke("summarize", *common(tiny_model_dir, long_book), "--section", "120", "--quiet")
    assert streamed.stdout.strip() == data["summary"]
    tldr = invoke("summarize", *common(tiny_model_dir, long_book), "--section", "120", "--template", "tldr")
    assert "section 1 (tokens 1-" in tldr.stderr and "section 2 (tokens" in tldr.stderr
    assert f"in {len(starts)} sections, summarized one by one" in tldr.stderr
    assert data["kv_cache_bytes"] > 0 and data["generated_tokens"] > 0
    one = json.loads(invoke("summarize", *common(tiny_model_dir, long_book), "--section", "0", "--json",
                            "--quiet").stdout)
    assert one["sections"] == [] and one["document_tokens"] == data["document_tokens"]


@pytest.mark.parametrize("args,message", [
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram must be at least 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be above 0"),
    (["--section", "-5"], "--section must be at least 0"),
])
def test_bad_values_are_one_line(invoke, book, args, message):
    result = invoke("summarize", str(book), *args)
    assert result.exit_code == 2 and result.stderr.startswith(f"kvcli: error: {message}")
    assert result.stderr.count("\n") == 1


def test_ctrl_c_in_a_section_keeps_what_the_sections_said(model):
    """Ctrl-C while a section is written: the answer is the summaries so far (the one being written cut short),
    shown as the answer would have been, and marked interrupted."""
    from kvcli.reading.generate import Generation

    engine = Engine(model, make_method("treekv"), 48, block=16)
    reader = Reader(engine, CharTokenizer())
    said = iter(["First part.", "Second, cut"])

    def run(parts, document, max_new_tokens, **kwargs):
        gen = Generation(text=next(said), finish_reason="length")
        if gen.text.endswith("cut"):
            gen.finish_reason = "interrupted"
        return gen

    reader.run = run
    shown: list[str] = []
    gen, sections = summarize_in_sections(reader, TEMPLATES["summary"], [list(range(40, 120)) * 3], 8, section=100,
                                          combine=True, on_text=shown.append)
    assert gen.finish_reason == "interrupted" and [s.summary for s in sections] == ["First part.", "Second, cut"]
    assert gen.text == "".join(shown) == "First part.\n\nSecond, cut" and gen.document_tokens == 200
