"""The read-then-write pipeline: prompt building, query-aware reading, a decode loop that never outgrows
its budget, greedy decoding equal to transformers' own, incremental text, and the pass-key library."""

from __future__ import annotations

import copy

import pytest
import torch

from kvcli.engine.engine import Engine
from kvcli.errors import UsageError
from kvcli.eval.needle import NEEDLE, excerpt_offset, haystack, haystacks, is_correct, sentence_break, word_break
from kvcli.methods import METHODS, make_method
from kvcli.models.load import tiny_llama
from kvcli.reading.generate import Generation, TextStream
from kvcli.reading.prompts import (
    ASK_FRAME,
    TEMPLATES,
    Instruction,
    PromptParts,
    build_prompt,
    custom_instruction,
    encode,
    question_frame,
    question_instruction,
    stop_token_ids,
)
from kvcli.reading.reader import Reader

DOC = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do."


class CharTokenizer:
    """Token id = Unicode code point: enough for the parts of the pipeline that only decode."""

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seed=1)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def spy_forward(engine: Engine) -> list[dict]:
    """Record every forward the engine runs: tokens, probe and the per-layer cache sizes after it."""
    calls: list[dict] = []
    original = engine.forward

    def forward(cache, ids, probe=None, compress=True, decoding=False, last_only=False, question=0, observe=None,
                held=0, span=None):
        hidden = original(cache, ids, probe=probe, compress=compress, decoding=decoding, last_only=last_only,
                          question=question, observe=observe, held=held, span=span)
        calls.append({"ids": ids[0].tolist(), "probe": None if probe is None else probe[0].tolist(),
                      "lengths": cache.lengths(), "decoding": decoding, "last_only": last_only,
                      "question": question, "span": span})
        return hidden

    engine.forward = forward
    return calls


# --- prompts ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("instruction", [TEMPLATES["summary"], question_instruction("Who is tired?"),
                                         question_instruction("What is the pass key?", "The pass key is")])
def test_prefix_document_suffix_reproduce_the_chat_template(smol_tokenizer, instruction):
    parts = build_prompt(smol_tokenizer, instruction)
    assert parts.chat
    content = f"{DOC}\n\n{instruction.text}"
    rendered = smol_tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True) + instruction.answer_prefix
    ours = parts.prefix + encode(smol_tokenizer, DOC) + parts.suffix
    assert ours == encode(smol_tokenizer, rendered)
    assert smol_tokenizer.decode(ours) == rendered
    assert smol_tokenizer.decode(parts.suffix).endswith("<|im_start|>assistant\n" + instruction.answer_prefix)


def test_plain_text_fallback_without_a_chat_template(smol_tokenizer):
    parts = build_prompt(smol_tokenizer, TEMPLATES["summary"], use_chat=False)
    assert not parts.chat and smol_tokenizer.decode(parts.suffix) == "\n\nSummary:"
    primed = build_prompt(smol_tokenizer, question_instruction("Who?", "It was"), use_chat=False)
    assert smol_tokenizer.decode(primed.suffix) == "\n\nQuestion: Who?\nAnswer: It was"


@pytest.mark.parametrize("use_chat", [True, False])
@pytest.mark.parametrize("question", ["What is the pass key?", "Who wrote 6049 on the wall, and why?"])
def test_the_question_span_is_the_questions_own_tokens(smol_tokenizer, use_chat, question):
    """Only the question's own tokens vote: not ask's frame before it, not the end of the turn or the answer
    prefix after it; a template or a custom prompt has no question, so every token of its suffix votes."""
    parts = build_prompt(smol_tokenizer, question_instruction(question, "The answer is"), use_chat=use_chat)
    start, end = parts.question_span
    assert smol_tokenizer.decode(parts.suffix[start:end]).strip() == question
    assert 0 < start < end < len(parts.suffix)  # a frame or cue before it, the turn's end or "Answer:" after
    assert build_prompt(smol_tokenizer, TEMPLATES["summary"], use_chat=use_chat).question_span is None
    assert build_prompt(smol_tokenizer, custom_instruction("List the names."), use_chat=use_chat).question_span \
        is None


def test_question_frame_is_what_the_model_reads_after_the_document(smol_tokenizer):
    # the record of a needle run: the frame inside the chat template, or the base models' cue
    assert question_frame(smol_tokenizer) == \
        "\n\n" + ASK_FRAME + "<|im_end|>\n<|im_start|>assistant\n"
    base = copy.copy(smol_tokenizer)
    base.chat_template = None
    assert question_frame(base) == "\n\nQuestion: {question}\nAnswer:"


def test_stop_tokens_cover_eos_and_end_of_turn(smol_tokenizer):
    ids = stop_token_ids(smol_tokenizer)
    vocab = smol_tokenizer.get_vocab()
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= ids
    assert vocab["<|im_start|>"] not in ids
    assert vocab["<|im_start|>"] in stop_token_ids(smol_tokenizer, stop=["<|im_start|>"])


# --- text out -----------------------------------------------------------------------------------------------
def test_text_stream_never_splits_a_character(smol_tokenizer):
    text = "Café 😀 naïve — 日本語 ok"
    ids = encode(smol_tokenizer, text)
    stream = TextStream(smol_tokenizer)
    pieces = [stream.add(i) for i in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == smol_tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(ids) > len(text.split())  # some characters really were split across tokens


def test_text_stream_cuts_at_a_stop_string_without_showing_it():
    stream = TextStream(CharTokenizer(), stop=["END"])
    shown = [stream.add(ord(c)) for c in "abEN"]
    assert "".join(shown) == "ab" and not stream.stopped  # "EN" may start "END": held back
    assert stream.add(ord("D")) == "" and stream.stopped
    assert stream.finish() == "" and stream.shown == stream.final == "ab"
    other = TextStream(CharTokenizer(), stop=["END"])
    assert "".join(other.add(ord(c)) for c in "aEx") + other.finish() == "aEx"


# --- the decode loop ----------------------------------------------------------------------------------------
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy search with its SDPA attention and DynamicCache."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                 pad_token_id=0, eos_token_id=2)
    finally:
        model.set_attn_implementation("kvcli")
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("one_shot,block", [(True, 256), (False, 7)])
def test_greedy_with_full_equals_transformers_generate(model, one_shot, block):
    prompt = ids_of(40, seed=3)
    expected = reference_greedy(model, prompt, 10)
    engine = Engine(model, make_method("full"), None, block=block)
    parts = PromptParts(prompt[:5], prompt[-6:], chat=False)
    gen = Reader(engine, CharTokenizer(), stop_ids={2}).run(parts, [prompt[5:20], prompt[20:-6]], 10,
                                                           one_shot=one_shot)
    assert gen.one_shot is one_shot and gen.prompt_tokens == 40 and gen.document_tokens == 29
    assert gen.ids == expected[: len(gen.ids)]
    assert len(gen.ids) == 10 or expected[len(gen.ids)] == 2


SCORED = ["streamingllm", "snapkv", "pyramidkv", "treekv", "h2o", "tova", "pyramidinfer"]


@pytest.mark.parametrize("name", SCORED)
@pytest.mark.parametrize("one_shot", [True, False])
def test_cache_never_exceeds_the_budget_while_reading_and_writing(model, name, one_shot):
    if name not in METHODS:
        pytest.skip(f"{name} is not registered yet")
    method = make_method(name)
    try:
        method.validate(48)
    except UsageError as exc:
        pytest.skip(f"{name} cannot run at cache 48: {exc}")
    engine = Engine(model, method, 48, block=16)
    calls = spy_forward(engine)
    parts = PromptParts(ids_of(3, 1), ids_of(9, 2), chat=False)
    gen = Reader(engine, CharTokenizer()).run(parts, [ids_of(100, 4)], 30, one_shot=one_shot)
    assert gen.generated_tokens == 30 and gen.finish_reason == "length"
    decode_calls = [c for c in calls if len(c["ids"]) == 1]
    read_calls = calls[: len(calls) - len(decode_calls)]
    # PyramidKV's layers share the question's block at the read's last compression (PyramidKV.kept_count): each
    # keeps as much of it, the pyramid spreads the rest, and only their total stays within the budgets'.
    shared = read_calls[-1] if name == "pyramidkv" else None
    for call in read_calls:
        assert sum(call["lengths"]) <= sum(engine.budgets)
        if call is not shared:
            assert all(length <= budget for length, budget in zip(call["lengths"], engine.budgets, strict=True))
    read_end = read_calls[-1]["lengths"]
    if method.keeps_answer:
        # SnapKV and PyramidKV keep their answer: the cache grows by the generated tokens and by nothing
        # else, written by the static steps (kvcli.kv.decode), not by engine forwards (the last token needs none).
        assert not decode_calls
        assert gen.max_cache_tokens == max(read_end) + 29
        return
    if method.evicts_oldest_while_writing or method.step_eviction(48, [{}], 1, engine.device) is not None:
        # StreamingLLM writes in a ring of its window; TreeKV, H2O and TOVA evict a token a step in fixed buffers
        # (kvcli.kv.decode): never more than the budget.
        assert not decode_calls
        assert gen.max_cache_tokens == max(engine.budgets) == max(read_end)
        return
    # The others evict to stay within the budget at every step (the last token needs no forward).
    assert len(decode_calls) == 29
    for call in decode_calls:
        assert all(length <= budget for length, budget in zip(call["lengths"], engine.budgets, strict=True))
    assert gen.max_cache_tokens == max(max(c["lengths"]) for c in calls) <= max(engine.budgets)
    assert decode_calls[-1]["lengths"] == engine.budgets


def test_streamed_reading_probes_every_block_with_the_suffix(model):
    engine = Engine(model, make_method("snapkv", {"window": 4}), 32, block=16)
    calls = spy_forward(engine)
    prefix, doc, suffix = ids_of(3, 1), ids_of(70, 5), ids_of(6, 2)
    gen = Reader(engine, CharTokenizer()).run(PromptParts(prefix, suffix, chat=False), [doc[:33], doc[33:]], 1,
                                              one_shot=False)
    reads = calls[: len(calls)]
    assert [len(c["ids"]) for c in reads] == [16, 16, 16, 16, 9 + 6]
    assert all(c["probe"] == suffix and c["question"] == 0 for c in reads[:-1])
    # The question ends the last block, and its own queries score that compression: no probe twice.
    assert reads[-1]["ids"][-6:] == suffix and reads[-1]["probe"] is None and reads[-1]["question"] == 6
    assert sum(len(c["ids"]) for c in reads) == gen.prompt_tokens == 79 and gen.document_tokens == 70
    assert not gen.one_shot


def test_one_shot_is_chosen_when_the_prompt_fits(model):
    prefix, doc, suffix = ids_of(3, 1), ids_of(70, 5), ids_of(6, 2)
    for limit, expect_one_shot in ((79, True), (78, False)):
        engine = Engine(model, make_method("snapkv", {"window": 4}), 32, block=16)
        calls = spy_forward(engine)
        gen = Reader(engine, CharTokenizer()).run(PromptParts(prefix, suffix, chat=False), [doc[:40], doc[40:]], 1,
                                                  limit=limit)
        assert gen.one_shot is expect_one_shot
        if expect_one_shot:
            assert len(calls) == 1 and calls[0]["ids"] == prefix + doc + suffix and calls[0]["probe"] is None
            assert calls[0]["question"] == len(suffix)  # the question is the observation window
            assert gen.max_cache_tokens == 32


@pytest.mark.parametrize("name,keeps", [("snapkv", True), ("streamingllm", False)])
def test_one_shot_read_keeps_positions_for_methods_whose_papers_do(model, name, keeps):
    """After a one-shot read, SnapKV's kept keys stay at their stream positions and the next token comes
    at the prompt's length: the same logits as a stock forward against a cache holding exactly those keys
    unmoved. StreamingLLM (re-assigned positions) puts the next token right after its cache instead."""
    from transformers import DynamicCache

    prefix, doc, suffix = ids_of(3, 1), ids_of(70, 5), ids_of(6, 2)
    engine = Engine(model, make_method(name), 32, block=16)
    reader = Reader(engine, CharTokenizer())
    cache = engine.new_cache()
    gen = Generation()
    reader.read(cache, PromptParts(prefix, suffix, chat=False), [doc], gen, one_shot=True)
    assert gen.one_shot and cache.keep_positions is keeps and max(cache.lengths()) == 32
    assert cache.next_position() == (79 if keeps else 32)
    if not keeps:
        return
    for layer in cache.layers:
        assert torch.equal(layer.entry_pos, layer.token_idx)  # every kept key sits where it entered
    reference = DynamicCache(config=model.config)
    for idx, layer in enumerate(cache.layers):
        reference.update(layer.keys.clone(), layer.values.clone(), idx)
    token = torch.tensor([[17]])
    hidden = engine.forward(cache, token, decoding=True)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            expected = model(input_ids=token, position_ids=torch.tensor([[79]]), past_key_values=reference).logits[0]
    finally:
        model.set_attn_implementation("kvcli")
    torch.testing.assert_close(engine.logits(hidden), expected, rtol=1e-4, atol=1e-4)


def test_sampling_is_seeded(model):
    def run(seed, temperature):
        engine = Engine(model, make_method("streamingllm"), 32, block=16)
        reader = Reader(engine, CharTokenizer(), temperature=temperature, seed=seed)
        return reader.run(PromptParts([], ids_of(4, 2), chat=False), [ids_of(20, 1)], 12).ids

    assert run(7, 1.5) == run(7, 1.5)
    assert len({tuple(run(seed, 1.5)) for seed in range(4)}) > 1
    assert run(0, 0.0) == run(5, 0.0)


# --- pass key -----------------------------------------------------------------------------------------------
def test_haystack_hides_the_needle_at_its_depth(smol_tokenizer):
    tokens = encode(smol_tokenizer, DOC * 40)
    for depth in (0.0, 0.5, 1.0):
        text = haystack(smol_tokenizer, tokens, 300, depth, "12345")
        needle = NEEDLE.format(key="12345")
        assert text.count(needle) == 1
        where = text.index(needle) / max(1, len(text) - len(needle))
        assert abs(where - depth) < 0.05
    assert excerpt_offset(1000, 300, 0) == 0 and excerpt_offset(1000, 300, 2) == 600
    assert excerpt_offset(1000, 300, 3) == 900 % 701 and excerpt_offset(200, 300, 5) == 0


def test_varied_haystacks_hide_their_own_needle_at_a_word_boundary(smol_tokenizer):
    """By default each haystack draws its needle, question and key length, and the needle sits between two
    words of the book wherever its depth falls, sentence end or not."""
    from kvcli.eval.needle import KEY_DIGITS, NEEDLES, QUESTIONS

    tokens = encode(smol_tokenizer, DOC * 40)
    stacks = list(haystacks(smol_tokenizer, tokens, [300], [0.2, 0.5, 0.8], trials=4, seed=3))
    assert len(stacks) == 12
    assert len({s.needle for s in stacks}) > 1 and len({s.question for s in stacks}) > 1
    assert len({len(s.key) for s in stacks}) > 1 and all(len(s.key) in KEY_DIGITS for s in stacks)
    for stack in stacks:
        assert stack.needle in NEEDLES and stack.question in QUESTIONS
        text = smol_tokenizer.decode(stack.doc)
        needle = stack.needle.format(key=stack.key)
        assert text.count(needle) == 1
        at = text.index(needle)
        assert abs(at / max(1, len(text) - len(needle)) - stack.depth) < 0.05
        assert at == 0 or text[at - 1] == " "
    assert word_break("He came th", "en he went") == ("He came", " then he went")
    assert word_break("He came ", "then") == ("He came ", "then")  # already between words
    assert word_break("He came", " then") == ("He came", " then")
    assert word_break("word", "s") == ("word", "s")  # no boundary before: as cut


def test_needle_starts_after_a_sentence_end_within_reach():
    assert sentence_break("He came. She said \u201cno.\u201d Then he went", " away.", 40) == (
        "He came. She said \u201cno.\u201d ", "Then he went away.")
    assert sentence_break("He came. Then he went", " away.", 5) == ("He came. Then he went", " away.")  # too far
    assert sentence_break("no end here", " at all", 100) == ("no end here", " at all")
    assert sentence_break("Mr. Smith", " came", 0) == ("Mr. Smith", " came")


@pytest.mark.parametrize(("answer", "key"), [
    (" 60494.", "60494"), ("The pass key is 6049.", "6049"), ("It is 60,494", "60494"), ("60 494", "60494"),
    ("8,056,020", "8056020"), ("8\u202f056\u202f020.", "8056020"), ("60\u2019494", "60494"),
    ("6 0 4 9 4", "60494"), ("6-0-4-9-4", "60494"), ("The pass key is 50651.50651", "50651"),
    ("60494 60494", "60494"), ("2 60494", "60494"), ("The pass key is 8056020groomed", "8056020"),
])
def test_grader_accepts_the_key_as_a_whole_number(answer, key):
    assert is_correct(answer, key)


@pytest.mark.parametrize(("answer", "key"), [
    ("The pass key is 60494.", "6049"),  # a prefix of a longer number
    ("The pass key is 60494.", "0494"),  # a suffix
    ("Chapter 12, page 345.", "12345"),  # digits of two numbers run together
    ("The pass key is 80560208056020.", "8056020"),  # the key twice with nothing between is another number
    ("60494 60494", "6049460494"),  # two numbers, not one grouped
    ("12,345,6", "12345"), ("60.494", "60494"), ("604 94", "60494"), ("1. 1. 2. 4. 6.", "11246"),
    ("6049", "60494"), ("The pass key.", "60494"), ("", "60494"),
])
def test_grader_refuses_the_key_inside_other_digits(answer, key):
    assert not is_correct(answer, key)


def test_instruction_is_immutable_and_named_templates_exist():
    assert {"summary", "tldr", "keypoints"} <= set(TEMPLATES)
    assert isinstance(TEMPLATES["summary"], Instruction)
    with pytest.raises(AttributeError):
        TEMPLATES["summary"].text = "x"


@pytest.fixture()
def one_thread():
    """One intra-op thread: on a small CPU shared with other jobs, two threads wait on each other for
    milliseconds at every small op and a forward pass gets many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_pass_key_from_a_real_book_excerpt(smollm, books, one_thread):
    """The default model finds a key hidden in a ~1.5k-token excerpt, read one-shot and compressed to 512."""
    from kvcli.eval.needle import ANSWER_PREFIX, QUESTION, book_tokens
    from kvcli.io.documents import open_source
    from kvcli.reading.prompts import question_instruction
    from kvcli.reading.reader import Reader

    tokenizer = smollm.tokenizer
    method = "snapkv" if "snapkv" in METHODS else "full"
    tokens = book_tokens(open_source(str(books / "pg1342-pride-and-prejudice.txt")), tokenizer, 1500)
    doc = encode(tokenizer, haystack(tokenizer, tokens, 1500, 0.5, "73691"))
    parts = build_prompt(tokenizer, question_instruction(QUESTION, ANSWER_PREFIX))
    engine = Engine(smollm.model, make_method(method), None if method == "full" else 512)
    gen = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, smollm.model)).run(parts, [doc], 8)
    assert gen.one_shot and gen.prompt_tokens > 1500
    # SnapKV keeps its answer: the cache grows by the generated tokens that went through a forward (7 of 8).
    assert gen.max_cache_tokens <= (512 + 7 if method != "full" else gen.prompt_tokens + 8)
    assert "73691" in gen.text, gen.text


def test_answer_prefix_ends_where_the_key_starts_in_the_needle(smollm):
    """The pass-key prompt ends with the same tokens that precede the key in the needle ("is", " "),
    so the model's next token is the key's first digit when it finds the needle (see needle.ANSWER_PREFIX)."""
    from kvcli.eval.needle import ANSWER_PREFIX, QUESTION

    tokenizer = smollm.tokenizer
    needle = encode(tokenizer, NEEDLE.format(key="60494"))
    starts = [i for i in range(len(needle)) if tokenizer.decode(needle[i:]).startswith("60494")]
    assert starts, "the key must start a token of the needle"
    suffix = build_prompt(tokenizer, question_instruction(QUESTION, ANSWER_PREFIX)).suffix
    assert suffix[-2:] == needle[starts[0] - 2:starts[0]]


def test_wilson_interval_matches_known_values():
    """Reference values: Newcombe (1998), Table I, and Brown, Cai and DasGupta (2001), 95% Wilson intervals."""
    from kvcli.eval.needle import wilson_interval

    cases = {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
             (1, 29): (0.0061, 0.1718), (20, 20): (0.8389, 1.0), (10, 20): (0.2993, 0.7007)}
    for (successes, trials), (low, high) in cases.items():
        got = wilson_interval(successes, trials)
        assert got == pytest.approx((low, high), abs=1e-4), (successes, trials)


def test_one_shot_cap_follows_the_gpus_free_memory():
    """On a GPU the auto one-shot cap is what fills half the free memory with the prompt's keys, values and
    one layer's activations (Llama 3.1 8B in bf16: 216 KiB per token), then the trained context bounds it;
    a CPU keeps its fixed cap."""
    from types import SimpleNamespace

    from kvcli.eval.bench.speed import shape_config
    from kvcli.reading.reader import ONE_SHOT_CAP, one_shot_cap, one_shot_limit, prefill_bytes_per_token

    config = shape_config("llama-3.1-8b")
    weights = torch.nn.Linear(1, 1, dtype=torch.bfloat16, device="meta")
    model = SimpleNamespace(config=config, parameters=weights.parameters)
    per_token = prefill_bytes_per_token(model, torch.bfloat16)
    assert per_token == 2 * (2 * 32 * 8 * 128 + 4 * 4096 + 2 * 14336)
    gpu = SimpleNamespace(device=torch.device("cuda"), model=model, trained_context=131072)
    assert one_shot_cap(gpu, free_bytes=60 * 2**30) == (30 * 2**30 // per_token) // 1024 * 1024 == 145408
    assert one_shot_cap(gpu, free_bytes=4 * 2**30) == 9216
    assert one_shot_limit(gpu, 128, free_bytes=60 * 2**30) == 131072 - 128
    assert one_shot_cap(SimpleNamespace(device=torch.device("cpu"))) == ONE_SHOT_CAP["cpu"]


# --- the question as the observation window ------------------------------------------------------------------
class _SeeRecords:
    """Wraps a method's compress to keep what each call's record held (queries in all, own, question part)."""

    def __init__(self, method):
        self.seen: list[tuple[int, int, bool, int]] = []
        self.method = method
        original = method.compress

        def compress(view, budget):
            record = view.record
            self.seen.append((record.window, record.own_window, record.probe is not None, view.question))
            return original(view, budget)

        method.compress = compress


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "treekv"])
def test_a_known_question_is_the_whole_observation_window(model, name):
    """With a probe, its queries alone score (all of them, whatever the method's window: PyramidKV's is 8) and
    the block records nothing of its own; with the question ending the block, its own last queries are the
    window; without a question the method's window of the block's last queries decides."""
    method = make_method(name)
    spy = _SeeRecords(method)
    engine = Engine(model, method, 32, block=16)
    cache = engine.new_cache()
    question = torch.tensor([ids_of(20, 3)])
    engine.forward(cache, torch.tensor([ids_of(40, 1)]))  # no question: the method's own window
    engine.forward(cache, torch.tensor([ids_of(16, 2)]), probe=question)
    engine.forward(cache, torch.tensor([ids_of(30, 4)]), question=20)
    own = min(method.score_window(40), 40)
    assert spy.seen[0] == (own, own, False, 0)
    assert all(seen == (20, 0, True, 0) for seen in spy.seen[2:4])  # probe: 20 queries, none of the block's
    assert all(seen == (20, 20, True, 20) for seen in spy.seen[4:])  # the block's last 20 queries, the question
    assert all(layer.record is None for layer in cache.layers) and not cache.question_scores


@pytest.mark.parametrize("name", ["snapkv", "treekv", "h2o"])
def test_only_the_questions_own_queries_vote(model, name):
    """With ``span``, of the question ending the block only the span's queries record their attention: the same
    record as a block cut after the span whose last queries are the span, and nothing on the tail's keys. A
    probe's span records its span's queries alone, and none of the block's."""
    def forward(ids, **kwargs):
        method = make_method(name)
        seen = []
        original = method.compress

        def compress(view, budget):
            record = view.record
            seen.append((record.window, record.own_window, record.skip, record.probs.clone()))
            return original(view, budget)

        method.compress = compress
        engine = Engine(model, method, 32, block=64)
        cache = engine.new_cache()
        engine.forward(cache, torch.tensor([ids_of(40, 1)]))
        seen.clear()
        engine.forward(cache, torch.tensor([ids]), **kwargs)
        return seen

    block = ids_of(30, 4)
    spanned = forward(block, question=20, span=(5, 15))
    cut = forward(block[:25], question=10)
    assert [(w, own, skip) for w, own, skip, _ in spanned] == [(10, 10, 5)] * len(spanned)
    for (*_, probs), (*_, alone) in zip(spanned, cut, strict=True):
        torch.testing.assert_close(probs[..., :alone.shape[-1]], alone)
        assert probs[..., alone.shape[-1]:].abs().max() == 0  # the tail's keys come after every voter
    probed = forward(ids_of(16, 2), probe=torch.tensor([ids_of(20, 3)]), span=(5, 15))
    assert {(w, own, skip) for w, own, skip, _ in probed} == {(10, 0, 0)}


def test_a_scored_method_keeps_the_question_up_to_half_its_room():
    """SnapKV's window is 4 here, the question 10 tokens: all 10 stay whatever they score, while a layer that
    keeps only 12 beside its sinks keeps 6 of them (half) and leaves the rest to the selection."""
    from support import append_tokens, make_cache

    from kvcli.kv.cache import AttentionRecord, LayerView

    method = make_method("snapkv", {"window": 4, "kernel": 1})
    for budget, kept_question in ((40, 10), (12, 6)):
        cache = make_cache(num_layers=1, kv_heads=1)
        append_tokens(cache, 60)
        layer = cache.layers[0]
        probs = torch.zeros(1, 1, 60)
        probs[..., :30] = torch.linspace(1.0, 0.5, 30)  # the early text outscores the question
        layer.record = AttentionRecord(probs, 10, probs, own=10)
        keep = method.compress(LayerView(0, 1, layer, 60, layer.record, question=10), budget)
        kept = set(keep[0].tolist())
        assert len(kept) == budget
        assert {t for t in range(50, 60) if t in kept} == set(range(60 - kept_question, 60))


def held_tail(budget: int, held: int, mean: int | None = None) -> int:
    """How many of the last 30 of 60 tokens (a recap and a question of 10) SnapKV keeps at ``budget`` when the
    early text outscores them: what it holds whatever they score. Asserts the kept count and that the tail is
    contiguous."""
    from support import append_tokens, make_cache

    from kvcli.kv.cache import AttentionRecord, LayerView

    method = make_method("snapkv", {"window": 4, "kernel": 1})
    cache = make_cache(num_layers=1, kv_heads=1)
    append_tokens(cache, 60)
    layer = cache.layers[0]
    probs = torch.zeros(1, 1, 60)
    probs[..., :30] = torch.linspace(1.0, 0.5, 30)  # the early text outscores the recap and question
    layer.record = AttentionRecord(probs, 10, probs, own=10)
    view = LayerView(0, 1, layer, 60, layer.record, mean_budget=mean, question=10, held=held)
    kept = set(method.compress(view, budget)[0].tolist())
    tail = {t for t in range(30, 60) if t in kept}
    assert len(kept) == budget
    assert tail == set(range(60 - len(tail), 60))
    return len(tail)


def test_a_scored_method_keeps_what_is_held_with_the_question_up_to_three_quarters_of_its_room():
    """The recap read before the question (``held``: 30 tokens with the question's 10) stays whatever it scores,
    up to three quarters of what a layer keeps beside its sinks; the question alone keeps its half."""
    assert [held_tail(budget, held) for budget, held in ((40, 30), (20, 30), (12, 0))] == [30, 15, 6]


def test_a_layer_below_the_mean_budget_holds_less_and_leaves_a_quarter_of_the_mean_to_the_scores():
    """PyramidKV's top layers keep far fewer tokens than the mean: what is held after a recap takes at most the
    layer's room less a quarter of the mean room, so a small layer still keeps what scores best elsewhere; a
    layer at the mean (every layer of SnapKV) holds its three quarters as before."""
    assert [held_tail(budget, 30, mean=40) for budget in (40, 24, 12)] == [30, 14, 6]


def test_pyramidkv_layers_hold_the_same_share_of_the_question_and_spread_the_rest_as_a_pyramid():
    """At the compression with a question (a recap and the question held: 311 tokens at cache 542, 30 layers),
    every PyramidKV layer keeps what a layer at the mean holds of it, the pyramid spreads the rest from the bottom
    layer down, and the counts still average the budget; a hold over three quarters of the mean is cut there, and
    without a question the layers keep the paper's budgets."""
    from kvcli.kv.cache import LayerView
    from kvcli.methods.pyramidkv import pyramid_selected

    method = make_method("pyramidkv")

    def counts(held: int) -> list[int]:
        return [method.kept_count(LayerView(depth, 30, None, 0, None, mean_budget=542, question=40 if held else 0,
                                            held=held), 542) for depth in range(30)]

    shared = counts(311)
    assert sum(shared) == 30 * 542
    assert [count - 311 for count in shared] == list(pyramid_selected(542 - 311, 30, 20.0))
    assert shared == sorted(shared, reverse=True) and shared[-1] - 311 in (11, 12)
    assert counts(500)[-1] - 542 * 3 // 4 == pyramid_selected(542 - 406, 30, 20.0)[-1]
    assert counts(0) == [542] * 30
    assert method.layer_budgets(542, 30)[-1] < 40  # the paper's top layer: fewer tokens than the question


def test_a_pyramidkv_top_layer_keeps_the_whole_held_block_whatever_it_scores():
    """The top layer of 30 at mean budget 40, its early text outscoring the last 30 tokens (a recap and a
    question of 10): it keeps those 30 whole, and its share of the pyramid of the rest."""
    from support import append_tokens, make_cache

    from kvcli.kv.cache import AttentionRecord, LayerView

    method = make_method("pyramidkv", {"window": 4, "kernel": 1})
    cache = make_cache(num_layers=1, kv_heads=1)
    append_tokens(cache, 60)
    layer = cache.layers[0]
    probs = torch.zeros(1, 1, 60)
    probs[..., :30] = torch.linspace(1.0, 0.5, 30)
    layer.record = AttentionRecord(probs, 10, probs, own=10)
    top = method.layer_budgets(40, 30)[-1]
    view = LayerView(29, 30, layer, 60, layer.record, mean_budget=40, question=10, held=30)
    kept = set(method.compress(view, top)[0].tolist())
    assert top < 30 and set(range(30, 60)) <= kept
    assert len(kept) == method.kept_count(view, top) >= 30
