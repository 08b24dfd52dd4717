"""Writing an answer from a read cache, one compressed forward per token: the write phase of ``ask`` and
``summarize`` (the read phase is :mod:`kvcli.reading.reader`).

Tokens are generated one at a time; each is run through :meth:`Engine.forward` alone, which compresses
with one new token (the method's decoding rule), so the cache stays within the per-layer budget at every
step of generation too. Where the method's decoding rule has a fixed-shape form (it evicts nothing while
writing, the oldest token of a window, or one token by its scores), the answer is written with a static
step instead, on fixed buffers, replayed as a CUDA graph on a GPU (:mod:`kvcli.kv.decode`). Each step's
logits go through the repetition rules (:class:`RepetitionGuard`), a token is sampled, and the text is
cut at an end-of-sequence token or a stop string (:class:`TextStream`).

Nothing here knows about the CLI: generated text leaves through a callback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvcli.engine.engine import Engine
from kvcli.kv.decode import answer_steps
from kvcli.reading.prompts import Repetition


class TextStream:
    """Generated ids in, new text out: decodes the whole list each time and hands out the new suffix.

    Byte-level tokens can split a character; text ending in U+FFFD (an incomplete character) is held
    back until the next token completes it. Text that could be the start of a ``stop`` string is also
    held back, so a stop string never reaches the reader; when one appears the text is cut before it.
    """

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.shown = ""
        self.final = ""
        self.stopped = False

    def text(self) -> str:
        # No clean-up of spaces before punctuation: it could change text already shown.
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """Add a token; return the text that is now final (may be empty). Sets :attr:`stopped`."""
        self.ids.append(token)
        text = self.text()
        cut = self._stop_index(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text[:cut])
        stable = text.rstrip("\ufffd")
        return self._advance(stable[: len(stable) - self._partial_stop(stable)])

    def finish(self) -> str:
        """The rest of the text once generation is over (:attr:`final` then holds all of it)."""
        text = self.text()
        cut = self._stop_index(text)
        self.final = text if cut is None else text[:cut]
        if not self.final.startswith(self.shown):  # a decoder that rewrote earlier text: show what differs
            common = len(os.path.commonprefix([self.final, self.shown]))
            self.shown = self.shown[:common]
        return self._advance(self.final)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown):], text
        return new

    def _stop_index(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass
class Generation:
    """What a read-then-write run produced and what it cost."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    document_tokens: int = 0
    one_shot: bool = False
    max_cache_tokens: int = 0  # largest per-layer cache after any compression step, prefill or decode
    kv_cache_bytes: int = 0  # the cache when generation ended
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    finish_reason: str = "length"  # "eos", "stop", "length" or "interrupted"
    recap_tokens: int = 0  # document tokens read a second time before the question (kvcli.reading.recap)
    sections: int = 0  # summaries written section by section (kvcli.reading.sections): how many; 0 = one read

    @property
    def generated_tokens(self) -> int:
        return len(self.ids)

    @property
    def seconds(self) -> float:
        return self.read_seconds + self.write_seconds


class RepetitionGuard:
    """:class:`Repetition` applied to one answer's logits, step by step.

    The n-gram ban is kept on the host, where every sampled token already is (the sampler reads it back):
    the N-gram prefixes seen so far, each with the tokens that followed it. The banned tokens of a step go
    to the logits' device as one small index; the penalty's record of the answer's tokens is a mask on that
    device, updated there. Neither reads anything back, so a step's only host read stays the sampled token,
    and the logits of a captured CUDA graph (:mod:`kvcli.kv.decode`) are never written into (a new tensor is
    returned), so the next replay is not disturbed.
    """

    def __init__(self, settings: Repetition):
        self.settings = settings
        self.ids: list[int] = []
        self.followers: dict[tuple[int, ...], set[int]] = {}
        self.seen: torch.Tensor | None = None  # [V] bool on the logits' device, for the penalty

    def add(self, token: int) -> None:
        """Record a token the answer now holds."""
        self.ids.append(token)
        n = self.settings.no_repeat_ngram
        if n and len(self.ids) >= n:
            self.followers.setdefault(tuple(self.ids[len(self.ids) - n:-1]), set()).add(token)
        if self.seen is not None:
            self.seen[token] = True

    def banned(self) -> list[int]:
        """Tokens that would complete an N-gram already written."""
        n = self.settings.no_repeat_ngram
        if not n or len(self.ids) < n - 1:
            return []
        key = tuple(self.ids[len(self.ids) - n + 1:]) if n > 1 else ()
        return sorted(self.followers.get(key, ()))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with the rules applied (``logits`` itself when they change nothing)."""
        if self.settings.penalty != 1.0:
            if self.seen is None:
                self.seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                self.seen[self.ids] = True
            penalty = self.settings.penalty
            logits = torch.where(self.seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        banned = self.banned()
        if banned:
            index = torch.tensor(banned, dtype=torch.long).to(logits.device, non_blocking=True)
            logits = logits.index_fill(-1, index, float("-inf"))
        return logits


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy (first maximum) at temperature 0, else one draw from ``softmax(logits / temperature)``."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))



class AnswerWriter:
    """Writes an answer after a read: sampling, the repetition rules and the stops, one compressed forward per
    token. Apart from the reader so that one read cache can be written from several times (copies of it)."""

    def __init__(self, engine: Engine, tokenizer, *, stop_ids: Iterable[int] = (), stop: Iterable[str] = (),
                 temperature: float = 0.0, seed: int = 0, repetition: Repetition = Repetition()):
        """``repetition``: how the answer is kept from looping (default none: plain greedy or sampling, as
        ``transformers``' ``generate``)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.stop = list(stop)
        self.temperature = temperature
        self.seed = seed
        self.repetition = repetition

    def write(self, cache, hidden: torch.Tensor, result: Generation, max_new_tokens: int,
              on_text: Callable[[str], None] | None = None) -> None:
        """Generate up to ``max_new_tokens`` tokens after ``hidden``; every step is one compressed forward."""
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(self.seed) if self.temperature > 0 else None
        stream = TextStream(self.tokenizer, self.stop)
        emit = on_text or (lambda text: None)
        result.finish_reason = "length"
        steps = answer_steps(self.engine, cache, max(max_new_tokens - 1, 0))  # the last token needs no forward
        guard = RepetitionGuard(self.repetition) if self.repetition.active else None
        try:
            logits = self.engine.logits(hidden)[0]
            for step in range(max_new_tokens):
                token = sample(guard(logits) if guard else logits, self.temperature, generator)
                if token in self.stop_ids:
                    result.finish_reason = "eos"
                    break
                result.ids.append(token)
                if guard:
                    guard.add(token)
                piece = stream.add(token)
                if piece:
                    emit(piece)
                if stream.stopped:
                    result.finish_reason = "stop"
                    break
                if step + 1 == max_new_tokens:
                    break
                logits = steps(token)
        except KeyboardInterrupt:
            result.finish_reason = "interrupted"
        finally:
            steps.finish()  # the cache holds the answer's tokens whatever ended the writing
            result.max_cache_tokens = max(result.max_cache_tokens, steps.max_tokens)
        rest = stream.finish()
        if rest:
            emit(rest)
        result.text = stream.final
        result.write_seconds = time.perf_counter() - started
        result.kv_cache_bytes = cache.nbytes()
