"""What kvcli asks a model about a document: instructions, the prompt around the document, and when to stop.

``kvcli summarize`` and ``kvcli ask`` wrap a document in the model's chat template (or a plain-text cue
for a base model): :func:`build_prompt` splits the rendered prompt into the tokens before and after
the document, which :mod:`kvcli.reading.reader` reads around it. Nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcli.io.text import leading_special_tokens

#: Stands in for the document when the chat template is rendered; split on to find prefix and suffix.
SENTINEL = "KVCLIDOCUMENTSENTINEL"

#: End-of-turn / end-of-text tokens of common chat formats; those in the vocabulary stop generation.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>",
               "<|end|>", "<|eom_id|>")

@dataclass(frozen=True)
class Instruction:
    """What to ask about a document: ``text`` for chat models, ``cue`` for base models (no chat template).

    ``answer_prefix`` starts the model's answer (after the assistant marker, or after the cue):
    "The pass key is" makes a small model answer with the key instead of chatting.
    """

    text: str
    cue: str
    answer_prefix: str = ""
    #: Where a base model's answer ends after the plain-text cue: a base model answers "Question: ... Answer:"
    #: and then writes the next question and answer, and the next, for as long as it may.
    cue_stop: tuple[str, ...] = ()
    #: The user's question inside ``text`` and ``cue`` (empty: none): only its own tokens score the cache
    #: (:attr:`PromptParts.question_span`).
    question: str = ""


#: Named prompts for ``kvcli summarize --template``.
TEMPLATES: dict[str, Instruction] = {
    "summary": Instruction("Summarize the text above in a few sentences.", "\n\nSummary:"),
    "tldr": Instruction("Give a one-sentence TL;DR of the text above.", "\n\nTL;DR:"),
    "keypoints": Instruction("List the key points of the text above as short bullet points.",
                             "\n\nKey points:\n-"),
}


#: How ``kvcli ask`` frames the user's question for a chat model. After thousands of tokens of a book a
#: small chat model given the bare question often goes on with the book or chats about it; told what to
#: do first, it answers. The question follows the instruction in the same line, with no "Question:" label,
#: which the 135M model copied out instead of answering (chosen on the tuning books: docs/reading.md).
ASK_FRAME = "Read the text above carefully, then answer in one short sentence. {question}"


def question_instruction(question: str, answer_prefix: str = "", frame: bool = True) -> Instruction:
    """The instruction of ``kvcli ask``: the question in :data:`ASK_FRAME` (``frame``; else the question as
    written, for a question that wants more than one short sentence), or a Question/Answer cue for base
    models."""
    question = question.strip()
    text = ASK_FRAME.format(question=question) if frame else question
    return Instruction(text, f"\n\nQuestion: {question}\nAnswer:", answer_prefix,
                       cue_stop=("\nQuestion:", "\nAnswer:"), question=question)


def question_frame(tokenizer, frame: bool = True) -> str:
    """What ``kvcli ask`` puts after the document, as text, with ``{question}`` where the question goes.

    This is the frame as the model reads it: :data:`ASK_FRAME` inside the tokenizer's chat template, or the
    Question/Answer cue of a model without one. A record of a run keeps it, so that rows read under one
    template or frame are never mixed with rows read under another.
    """
    parts = build_prompt(tokenizer, question_instruction("{question}", frame=frame))
    return tokenizer.decode(parts.suffix)


def custom_instruction(prompt: str, answer_prefix: str = "") -> Instruction:
    """A user's ``--prompt``: the same text for chat and base models."""
    prompt = prompt.strip()
    return Instruction(prompt, f"\n\n{prompt}\n", answer_prefix)


@dataclass(frozen=True)
class Repetition:
    """How the writer keeps an answer from looping, over the answer's own tokens only (never the prompt's).

    * ``no_repeat_ngram`` N: a token that would complete an N-gram the answer already holds is never chosen
      (Hugging Face's ``no_repeat_ngram_size``); so no run of N tokens, and no sentence of N tokens or more,
      is written twice. 0 = off.
    * ``penalty`` P: the logit of every token the answer already holds is divided by P where positive and
      multiplied by P where negative (CTRL's repetition penalty, Hugging Face's ``repetition_penalty``).
      1 = off.
    """

    no_repeat_ngram: int = 0
    penalty: float = 1.0

    @property
    def active(self) -> bool:
        return self.no_repeat_ngram > 0 or self.penalty != 1.0


#: What ``kvcli ask`` and ``kvcli needle`` (ask's path) write with by default: no run of 4 tokens twice, which ends
#: the loops of a small model reading a compressed book, and no penalty, which would weigh down the second "4" of
#: a key such as 60494 or a name the answer repeats (chosen on the tuning books:
#: docs/notes/2026-11-27-repetition.md).
ANSWER_REPETITION = Repetition(no_repeat_ngram=4)
#: What ``kvcli summarize`` writes with by default: the n-gram ban alone turned a summary's loop into near-copies
#: of one sentence and made-up words ("a master shoer ... a master shozer"); with a penalty of 1.2 the same reads
#: wrote varied sentences, on both tuning models.
SUMMARY_REPETITION = Repetition(no_repeat_ngram=4, penalty=1.2)


@dataclass
class PromptParts:
    """Token ids around the document: ``prefix + document + suffix`` is the whole prompt."""

    prefix: list[int]
    suffix: list[int]
    chat: bool  # built with the tokenizer's chat template (False: plain-text fallback)
    stop: tuple[str, ...] = ()  # stop strings of the prompt's format (the cue's, :attr:`Instruction.cue_stop`)
    #: ``(start, end)``: the suffix's tokens that are the user's question itself, without the frame around it,
    #: the end of the user's turn or the assistant's start. Only these queries score the cache, as the papers'
    #: observation window is the question (SnapKV) and not the chat template's markup, which is the same for
    #: every question and would outvote a short one. None: every token of the suffix scores.
    question_span: tuple[int, int] | None = None

    @property
    def question(self) -> list[int]:
        """The question's own tokens (:attr:`question_span`); the whole suffix where there is no span."""
        lo, hi = self.question_span or (0, len(self.suffix))
        return self.suffix[lo:hi]


def render_chat(tokenizer, content: str) -> str | None:
    """The chat template rendered for one user turn and the assistant's start; None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render one user turn: use the plain fallback
        return None
    return rendered if isinstance(rendered, str) else None


def build_prompt(tokenizer, instruction: Instruction, use_chat: bool = True) -> PromptParts:
    """Split the prompt into the tokens before and after the document.

    With a chat template the user turn is ``document + "\\n\\n" + instruction``: the template is
    rendered with a sentinel in place of the document and split there, so the prefix is everything
    up to where the user's content starts (system prompt, BOS, role markers) and the suffix is the
    instruction, the end of the user turn, the start of the assistant's and the answer prefix, if
    any. Without a template the prefix is the tokenizer's BOS and the suffix a plain-text cue such
    as ``"\\n\\nSummary:"``.
    """
    rendered = render_chat(tokenizer, f"{SENTINEL}\n\n{instruction.text}") if use_chat else None
    primer = instruction.answer_prefix
    if rendered is not None and rendered.count(SENTINEL) == 1:
        before, after = rendered.split(SENTINEL)
        suffix, span = encode_marked(tokenizer, after + primer, instruction.question)
        return PromptParts(encode(tokenizer, before), suffix, chat=True, question_span=span)
    cue = instruction.cue + (" " + primer if primer else "")
    suffix, span = encode_marked(tokenizer, cue, instruction.question)
    return PromptParts(leading_special_tokens(tokenizer), suffix, chat=False, stop=instruction.cue_stop,
                       question_span=span)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a piece of prompt; special tokens written in the text (``<|im_start|>``) are parsed."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)


def encode_marked(tokenizer, text: str, part: str) -> tuple[list[int], tuple[int, int] | None]:
    """:func:`encode` of ``text``, and the tokens ``(start, end)`` that cover the last occurrence of ``part`` in it
    (every token whose characters overlap it). None where ``part`` is empty or absent, or the tokenizer gives no
    character offsets (a slow tokenizer): then the caller treats the whole text as the part."""
    at = text.rfind(part) if part else -1
    if at < 0:
        return encode(tokenizer, text), None
    try:  # encode's own call, with the characters each token covers
        encoded = tokenizer(text, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        return encode(tokenizer, text), None
    ids, offsets = list(encoded.input_ids), encoded.get("offset_mapping")
    if offsets is None:
        return ids, None
    covering = [i for i, (first, last) in enumerate(offsets) if first < at + len(part) and last > at]
    return ids, (covering[0], covering[-1] + 1) if covering else None


def stop_token_ids(tokenizer, model=None, stop: Iterable[str] = ()) -> set[int]:
    """Ids that end generation: EOS of the tokenizer and generation config, end-of-turn tokens, and
    every ``stop`` string that is a single token of the vocabulary."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(tokenizer, "eos_token_id", None))
    config = getattr(model, "generation_config", None) if model is not None else None
    if config is not None:
        add(getattr(config, "eos_token_id", None))
    vocab = tokenizer.get_vocab()
    for token in (*END_OF_TURN, *stop):
        if token in vocab:
            ids.add(vocab[token])
    return ids
