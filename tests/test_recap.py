"""The recap of a streamed read with a question (kvcli.reading.recap): which passages it keeps, and how the reader
reads them before the question."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcli.engine.engine import Engine
from kvcli.kv.cache import KVCache
from kvcli.methods import make_method
from kvcli.models.load import tiny_llama
from kvcli.reading.prompts import PromptParts
from kvcli.reading.reader import RECAP_SEPARATOR, Reader
from kvcli.reading.recap import (
    Recap,
    best_last,
    question_pairs,
    rare_pair_starts,
    scored_layers,
    stream_order,
    word_joins,
)
from tests.support import append_tokens, make_cache

LAYERS = 12  # scored: layers 4 to 10


def fake_cache(n: int, peaks: dict[int, float], layers: dict[int, dict[int, float]] | None = None,
               cached: int = 5, group: int = 2) -> SimpleNamespace:
    """A cache whose layers recorded the question's attention after a block of ``n`` tokens: ``cached`` older
    tokens first, then the block; ``peaks`` maps a block offset to its weight in one query head of layer 6
    (every other weight 1.0), ``layers`` gives other layers' peaks the same way."""
    built = []
    for i in range(LAYERS):
        probe = torch.ones(2, group, cached + n)
        for offset, weight in ({6: peaks} | (layers or {})).get(i, {}).items():
            probe[1, 0, cached + offset] = weight
        built.append(SimpleNamespace(record=SimpleNamespace(probe=probe), window=None))
    return SimpleNamespace(layers=built)


def test_only_the_middle_layers_score():
    assert scored_layers(30) == range(10, 26) and scored_layers(LAYERS) == range(4, 11)
    recap = Recap(3, radius=1)
    # Stronger peaks in a bottom and a top layer do not vote; the middle layer's peak at 2 does.
    recap.observe(fake_cache(12, {2: 20.0}, {0: {5: 500.0}, 11: {8: 500.0}}), list(range(100, 112)), start=0)
    assert recap.passages() == [101, 102, 103]


def test_a_peak_brings_its_neighbours_in_stream_order_and_the_recap_stays_bounded():
    recap = Recap(6, radius=2)
    recap.observe(fake_cache(20, {3: 40.0, 12: 90.0}), list(range(100, 120)), start=10)
    # The best peak first (12 with 10..14), then the next (3 with 1..5) would overflow six tokens: left out.
    assert recap.passages() == [110, 111, 112, 113, 114]
    wide = Recap(10, radius=2)
    wide.observe(fake_cache(20, {3: 40.0, 12: 90.0}), list(range(100, 120)), start=10)
    assert wide.passages() == [101, 102, 103, 104, 105, 110, 111, 112, 113, 114]


def test_a_peak_is_the_best_token_within_its_radius():
    recap = Recap(10, radius=2)
    recap.observe(fake_cache(20, {8: 90.0, 9: 80.0, 3: 40.0}), list(range(100, 120)), start=0)
    # 9 is no peak (8 beats it within two tokens): its passage would repeat 8's, and 3's comes in instead.
    assert recap.passages() == [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]


def test_a_name_of_several_tokens_outweighs_one_token_a_head_rests_on():
    # Five tokens at 30 (a name the question matches) against one at 60 (a token some head rests on everywhere):
    # nearness-weighed over a passage of radius 2, the name's centre has 30 * (1/3 + 2/3 + 1 + 2/3 + 1/3) = 90.
    name = dict.fromkeys(range(10, 15), 30.0)
    recap = Recap(5, radius=2)
    recap.observe(fake_cache(20, {3: 60.0} | name), list(range(100, 120)), start=0)
    assert recap.passages() == [110, 111, 112, 113, 114]
    lone = Recap(5, radius=2)
    lone.observe(fake_cache(20, {3: 60.0} | dict.fromkeys(range(10, 15), 10.0)), list(range(100, 120)), start=0)
    assert lone.passages() == [101, 102, 103, 104, 105]  # a weaker name (50 weighed) loses to the lone 60


def test_a_pair_of_the_questions_tokens_rare_in_the_block_marks_where_it_begins():
    block = [7, 8, 9, 1, 2, 5, 1, 2, 5, 1, 2, 3, 4]
    # (2, 3) and (3, 4) begin once: marked; (1, 2) begins three times, a phrase the block repeats: not; (8, 9) is no
    # pair of the question's.
    assert rare_pair_starts(block, question_pairs([1, 2, 3, 4])) == [0.0] * 10 + [1.0, 1.0, 0.0]
    thrice = [1.0 if i in (3, 6, 9) else 0.0 for i in range(13)]
    assert rare_pair_starts(block, question_pairs([1, 2]), rare=3) == thrice
    assert rare_pair_starts(block, question_pairs([])) == [0.0] * 13
    assert rare_pair_starts([], question_pairs([1, 2])) == []


def test_a_passage_that_names_what_the_question_names_outranks_a_lookalike_the_attention_prefers():
    # Two needles the question's attention scores alike (60 against 50): the one whose tokens 103, 104 are a pair of
    # the question's own is recapped; without the question's tokens the other is.
    ids = list(range(100, 120))
    for question, kept in (([103, 104], [101, 102, 103, 104, 105]), ([], [110, 111, 112, 113, 114])):
        recap = Recap(5, radius=2, question=question)
        recap.observe(fake_cache(20, {3: 50.0, 12: 60.0}), ids, start=0)
        assert recap.passages() == kept
    # The pair begins two tokens right of the peak at 3: the peak stays, and its passage 101..105 is recapped.
    recap = Recap(5, radius=2, question=[105, 106])
    recap.observe(fake_cache(20, {3: 50.0, 12: 60.0}), ids, start=0)
    assert recap.passages() == [101, 102, 103, 104, 105]


def test_the_last_radius_tokens_are_never_peaks_and_left_neighbours_come_from_the_block_before():
    recap = Recap(5, radius=2)
    recap.observe(fake_cache(8, {7: 1000.0, 6: 1000.0, 2: 50.0}), list(range(100, 108)), start=0)
    assert recap.passages() == [100, 101, 102, 103, 104]  # the peak at 2, not the block's last two
    recap = Recap(5, radius=2)
    recap.observe(fake_cache(8, {2: 50.0}), list(range(100, 108)), start=0)
    recap.observe(fake_cache(8, {0: 900.0}), list(range(200, 208)), start=8)
    # The new peak (stream 8) reaches back into the previous block's last two tokens.
    assert recap.passages() == [106, 107, 200, 201, 202]


def test_the_prompt_before_the_document_is_never_recapped():
    recap = Recap(5, radius=2, first=4)
    recap.observe(fake_cache(10, {1: 500.0, 6: 400.0}), list(range(100, 110)), start=0)
    assert recap.passages() == [104, 105, 106, 107, 108]


def pairs(*words: range) -> set[tuple[int, int]]:
    """The adjacent ids of each range: tokens that make one word."""
    return {(a, a + 1) for word in words for a in word[:-1]}


def test_a_passage_stretches_to_finish_the_words_its_radius_cuts():
    joined = pairs(range(106, 109), range(112, 115))  # words 106-108 and 112-114 across the radius's edges
    plain, recap = Recap(5, radius=2, reach=2), Recap(9, radius=2, reach=2)  # room for the one passage
    for each in (plain, recap):
        each.observe(fake_cache(20, {10: 90.0}), list(range(100, 120)), start=0)
    assert plain.passages() == [108, 109, 110, 111, 112]  # without word boundaries: the radius
    assert recap.passages(lambda a, b: (a, b) in joined) == list(range(106, 115))


def test_a_word_longer_than_the_reach_is_left_out_but_never_the_peak():
    recap = Recap(5, radius=2, reach=2)
    recap.observe(fake_cache(20, {10: 90.0}), list(range(100, 120)), start=0)
    # 112-119 is one word: no boundary within two tokens past the radius, so the passage stops before it.
    assert recap.passages(lambda a, b: (a, b) in pairs(range(112, 120))) == [108, 109, 110, 111]
    # The peak inside a long word on both sides: the radius stays.
    assert recap.passages(lambda a, b: (a, b) in pairs(range(100, 120))) == [108, 109, 110, 111, 112]


def test_a_word_running_past_the_block_is_not_known_to_end_and_the_document_start_is_a_boundary():
    recap = Recap(7, radius=2, reach=2, first=3)
    recap.observe(fake_cache(12, {5: 90.0, 9: 80.0}), list(range(100, 112)), start=0)
    joined = pairs(range(100, 106), range(110, 112))
    # Peak 5: the word 100-105 begins before the document (stream 3), whose start is a boundary.
    # Peak 9: its radius ends at the block's last token, inside a word that the next block may go on with.
    assert recap.passages(lambda a, b: (a, b) in joined) == [103, 104, 105, 106, 107, 108, 109]


def test_tokens_join_into_a_word_when_letters_or_digits_meet():
    joins = word_joins(Tokenizer())
    assert joins(ord("6"), ord("0")) and joins(ord("s"), ord("w"))
    assert not joins(ord("s"), ord(" ")) and not joins(ord(" "), ord("k")) and not joins(ord("4"), ord("."))


def test_a_word_starts_where_a_sentencepiece_tokenizer_drops_the_space_of_a_token_decoded_alone():
    pieces = {1: "\u2581pass", 2: "\u2581key", 3: "word", 4: "s"}

    def decode(ids, **kwargs):  # as a legacy SentencePiece tokenizer: the first piece's space is dropped
        return "".join(pieces[i] for i in ids).replace("\u2581", " ").lstrip(" ")

    joins = word_joins(SimpleNamespace(decode=decode))
    assert decode([2]) == "key" and not joins(1, 2)  # " key" after "pass", though "key" alone has no space
    assert joins(3, 4) and not joins(4, 1)


def test_a_hyphen_joins_a_word_so_a_uuid_is_recapped_whole():
    joins = word_joins(Tokenizer())
    assert joins(ord("8"), ord("-")) and joins(ord("-"), ord("2")) and not joins(ord(" "), ord("-"))
    uuid = "06f57118-2b33-482a-8b93-485a2705e088"
    text = "Of all the words, the one for the gate is: " + uuid + ". Then the story goes on for a while longer."
    peak = text.index(uuid)  # the question finds the uuid's first character
    recap = Recap(64)  # the default radius and reach
    recap.observe(fake_cache(len(text), {peak: 90.0}), [ord(c) for c in text], start=0)

    def recapped(rule) -> str:
        return "".join(chr(i) for i in recap.passages(rule))

    # 36 tokens, 28 past the radius: the reach finishes it.
    assert "is: " + uuid + "." in recapped(joins)
    # With a hyphen as a boundary the passage stopped at one inside the uuid.
    letters = word_joins(SimpleNamespace(decode=lambda ids, **kwargs: "".join(chr(i) for i in ids).replace("-", "+")))
    assert uuid not in recapped(letters) and "is: 06f57118" in recapped(letters)


def test_without_recorded_question_attention_there_is_no_recap():
    cache = fake_cache(10, {})
    for layer in cache.layers:
        layer.record = None
    recap = Recap(5, radius=2)
    recap.observe(cache, list(range(10)), start=0)
    assert recap.passages() == []


def test_a_recap_needs_room_for_one_passage():
    for tokens, radius in ((0, 2), (4, 2), (16, 8)):
        with pytest.raises(ValueError):
            Recap(tokens, radius)
    Recap(17, 8)


# --- the reader ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=1)


class Tokenizer:
    """Token id = code point, enough to encode the separator."""

    def __call__(self, text, **kwargs):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(20, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_with(model, recap: int, method: str = "snapkv", last: dict | None = None, block: int = 16,
              one_shot: bool | None = False, budget: int = 80, calls: list | None = None):
    """A read of a document with a question (streamed unless ``one_shot``); ``last`` gets the last read forward's
    ids and ``held``, ``calls`` every forward's ids."""
    engine = Engine(model, make_method(method), budget, block=block)
    calls = [] if calls is None else calls
    original = engine.forward

    def forward(cache, ids, **kwargs):
        calls.append(ids[0].tolist())
        if last is not None and not kwargs.get("decoding"):
            last.update(ids=ids[0].tolist(), held=kwargs.get("held", 0))
        return original(cache, ids, **kwargs)

    engine.forward = forward
    prefix, doc, suffix = ids_of(3, 1), ids_of(90, 5), ids_of(6, 2)
    gen = Reader(engine, Tokenizer(), recap=recap).run(PromptParts(prefix, suffix, chat=False), [doc], 2,
                                                        one_shot=one_shot)
    return gen, [token for call in calls for token in call], prefix, doc, suffix


def test_the_recap_is_read_after_the_document_and_before_the_question(model):
    gen, read, prefix, doc, suffix = read_with(model, recap=40)
    separator = [ord(c) for c in RECAP_SEPARATOR]
    start = len(prefix) + len(doc) + len(separator)
    again = read[start:start + gen.recap_tokens]
    assert read[:len(prefix) + len(doc)] == prefix + doc
    assert read[len(prefix) + len(doc):start] == separator
    assert read[start + gen.recap_tokens:gen.prompt_tokens] == suffix
    assert 0 < gen.recap_tokens <= 40
    assert all(token in doc for token in again)
    assert gen.document_tokens == len(doc)
    assert gen.prompt_tokens == len(prefix) + len(doc) + len(separator) + gen.recap_tokens + len(suffix)


def test_after_a_recap_the_whole_last_block_is_held_with_the_question(model):
    last: dict = {}
    gen, _, _, _, suffix = read_with(model, recap=40, last=last, block=80)
    separator = [ord(c) for c in RECAP_SEPARATOR]
    assert 0 < gen.recap_tokens and last["held"] == len(last["ids"])  # the document's end, the recap, the question
    assert len(last["ids"]) > len(separator) + gen.recap_tokens + len(suffix)
    plain: dict = {}
    read_with(model, recap=0, last=plain, block=80)
    assert plain["held"] == len(suffix) < len(plain["ids"])  # without a recap the question alone


def test_a_cache_forgets_the_tokens_every_head_of_a_layer_holds():
    cache = make_cache(num_layers=1, kv_heads=2)
    append_tokens(cache, 10)
    layer = cache.layers[0]
    layer.keep(torch.tensor([[0, 1, 2, 3, 5, 6], [0, 2, 3, 4, 5, 7]]))
    keys = layer.keys.clone()
    # 2 and 3 both heads hold; 4 one head only (it stays: every head keeps as many); 8 none.
    assert cache.forget(torch.tensor([2, 3, 4, 8])) == 4
    assert layer.token_idx.tolist() == [[0, 1, 5, 6], [0, 4, 5, 7]]
    assert torch.equal(layer.keys[0, 0], keys[0, 0, [0, 1, 4, 5]])
    assert torch.equal(layer.keys[0, 1], keys[0, 1, [0, 3, 4, 5]])
    assert cache.forget(torch.tensor([9])) == 0 and layer.token_idx.shape == (2, 4)


def test_before_the_recap_the_cache_forgets_its_copies_of_the_recapped_tokens(model, monkeypatch):
    calls = []
    original = KVCache.forget

    def forget(cache, stream):
        before = [layer.token_idx.clone() for layer in cache.layers]
        gone = original(cache, stream)
        calls.append((stream.tolist(), before, [layer.token_idx.clone() for layer in cache.layers], gone))
        return gone

    monkeypatch.setattr(KVCache, "forget", forget)
    gen, read, prefix, doc, _ = read_with(model, recap=40)
    [(stream, before, after, gone)] = calls
    start = len(prefix) + len(doc) + len(RECAP_SEPARATOR)
    assert [doc[i - len(prefix)] for i in sorted(stream)] == read[start:start + gen.recap_tokens]
    for held, left in zip(before, after, strict=True):
        every = set.intersection(*(set(row) for row in held.tolist())) & set(stream)
        assert [sorted(row) for row in left.tolist()] == [sorted(set(row) - every) for row in held.tolist()]
    assert gone == sum(held.numel() - left.numel() for held, left in zip(before, after, strict=True)) > 0


def test_the_recap_is_given_the_questions_own_tokens_not_the_frame(model, monkeypatch):
    import kvcli.reading.reader as reader

    given = []

    def recap(*args, question=(), **kwargs):
        given.append(list(question))
        return Recap(*args, question=question, **kwargs)

    monkeypatch.setattr(reader, "Recap", recap)
    engine = Engine(model, make_method("snapkv"), 80, block=16)
    prefix, doc, suffix = ids_of(3, 1), ids_of(90, 5), ids_of(6, 2)
    for span, question in (((1, 4), suffix[1:4]), (None, suffix)):
        Reader(engine, Tokenizer(), recap=40).run(PromptParts(prefix, suffix, chat=False, question_span=span), [doc],
                                                 2, one_shot=False)
        assert given.pop() == question


def test_no_recap_when_off_or_when_the_method_scores_nothing(model):
    plain, read, prefix, doc, suffix = read_with(model, recap=0)
    assert plain.recap_tokens == 0 and plain.prompt_tokens == len(prefix) + len(doc) + len(suffix)
    assert read[:plain.prompt_tokens] == prefix + doc + suffix
    streaming, *_ = read_with(model, recap=40, method="streamingllm")
    assert streaming.recap_tokens == 0


def test_a_prompt_that_fits_one_forward_but_not_the_budget_is_read_whole_then_its_recap(model):
    calls: list = []
    gen, read, prefix, doc, suffix = read_with(model, recap=40, one_shot=None, calls=calls)
    separator = [ord(c) for c in RECAP_SEPARATOR]
    assert gen.one_shot and 0 < gen.recap_tokens <= 40
    assert calls[0] == prefix + doc[:-1]  # the document in one forward, the question its probe
    start = len(prefix) + len(doc) + len(separator)  # then, in blocks, its last token, the recap and the question
    assert read[len(calls[0]):start] == [doc[-1], *separator]
    assert read[start + gen.recap_tokens:gen.prompt_tokens] == suffix
    assert all(token in doc for token in read[start:start + gen.recap_tokens])
    whole: list = []
    plain, *_ = read_with(model, recap=0, one_shot=None, calls=whole)  # no recap: one forward, the question in it
    assert plain.one_shot and plain.recap_tokens == 0 and whole[0] == prefix + doc + suffix
    roomy: list = []
    fits, *_ = read_with(model, recap=40, one_shot=None, budget=160, calls=roomy)  # nothing to compress
    assert fits.one_shot and fits.recap_tokens == 0 and roomy[0] == prefix + doc + suffix


def test_a_recap_takes_at_most_half_the_budget(model):
    capped, *_ = read_with(model, recap=200, budget=40)
    assert 0 < capped.recap_tokens <= 20
    none, *_ = read_with(model, recap=200, budget=32)  # half of it holds no passage of 17 tokens
    assert none.recap_tokens == 0


def test_the_recap_reads_the_documents_opening_first_and_its_best_passage_last():
    # Best first as Recap.chosen gives them: a needle at 50-52, the document's opening at 10-12 (an instruction a
    # small model would continue if it came last), a weaker lookalike at 30-31 after the needle's rank.
    chosen = {50: 5, 51: 6, 52: 7, 10: 1, 11: 2, 12: 3, 30: 8, 31: 9}
    assert best_last(chosen, opening=10 + 17) == [1, 2, 3, 8, 9, 5, 6, 7]
    # Neighbouring passages stay one run, in stream order, ranked by their best passage.
    assert best_last({20: 2, 40: 4, 21: 3, 41: 5}, opening=0) == [4, 5, 2, 3]
    assert stream_order({20: 2, 40: 4, 21: 3, 41: 5}) == [2, 3, 4, 5]
