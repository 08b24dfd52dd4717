"""Reading a whole document, then writing about it, with a KV cache that never outgrows its budget.

The pipeline behind ``kvcli summarize`` and ``kvcli ask`` (and the pass-key grid) has two phases:

* **read**: the prompt is ``prefix + document + suffix`` (see :func:`kvcli.reading.prompts.build_prompt`). A prompt that
  fits the model's context in one affordable forward is prefilled in one shot, so that the end of
  the prompt (the question) is the observation window of the compression, as in SnapKV; kept
  tokens then stay at their positions if the method's paper keeps them (``Method.keeps_positions``). A longer
  document is streamed in blocks, the cache compressed after each one, and the suffix is passed as a
  *probe* on every block: its queries join the observation window without entering the cache, so
  the method keeps what the question looks at (query-aware compression). The last block carries
  the suffix itself. Only the last prompt token's hidden state is used, so every read forward is
  ``last_only``: a method that nests its layers (PyramidInfer) gives each layer only the tokens the
  layer below kept (a block with a probe is not nested: the probe scores after the whole block).
* **write**: tokens are generated one at a time; each is run through :meth:`Engine.forward` alone,
  which compresses with one new token (the method's decoding rule), so the cache stays within the
  per-layer budget at every step of generation too. Where the method's decoding rule has a fixed-shape
  form (it evicts nothing while writing, the oldest token of a window, or one token by its scores), the
  answer is written with a static step instead, on fixed buffers, replayed as a CUDA graph on a GPU
  (:mod:`kvcli.kv.decode`).

Nothing here knows about the CLI: text arrives as chunks of token ids, generated text leaves through
a callback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch

from kvcli.engine.engine import Engine, kv_bytes_per_token
from kvcli.errors import KvcliError
from kvcli.kv.cache import KVCache
from kvcli.kv.decode import answer_steps
from kvcli.reading.prompts import PromptParts, Repetition, encode
from kvcli.reading.recap import Recap, word_joins

#: One forward pass over this many tokens is what auto one-shot prefill allows at most on a CPU (the
#: explicit CPU attention materialises ``heads x n x n`` probabilities); beyond it documents are streamed.
#: A GPU's cap comes from its free memory instead (:func:`one_shot_cap`).
ONE_SHOT_CAP = {"cpu": 8192}
#: Share of a GPU's free memory (after loading the model) that an auto one-shot prefill may fill; the
#: rest is left to the allocator's fragmentation, the decode steps and other processes on the card.
ONE_SHOT_MEMORY_SHARE = 0.5
#: Between the document and its recap: a paragraph break, as between the documents of a folder.
RECAP_SEPARATOR = "\n\n"


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


def prefill_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Memory one prompt token holds during a one-shot forward pass on a GPU: its keys and values in
    every layer (:func:`kvcli.engine.engine.kv_bytes_per_token`: the method compresses only after the pass) and
    its share of one layer's activations (a few hidden-size vectors and the MLP's two intermediate ones).
    SDPA's attention is linear in memory there, and the observation window is scored in bounded chunks."""
    config = model.config
    hidden = int(config.hidden_size)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    size = torch.empty((), dtype=dtype).element_size()
    return kv_bytes_per_token(model, dtype) + size * (4 * hidden + 2 * intermediate)


def one_shot_cap(engine: Engine, free_bytes: int | None = None) -> int:
    """Tokens one forward pass may take on ``engine``'s device: a fixed cap on a CPU; on a GPU as many
    as fill :data:`ONE_SHOT_MEMORY_SHARE` of its free memory (``free_bytes``, else measured), in
    whole thousands of tokens, so a larger card reads longer prompts in one shot."""
    device = engine.device
    if device.type != "cuda":
        return ONE_SHOT_CAP["cpu"]
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    dtype = next(engine.model.parameters()).dtype
    tokens = int(ONE_SHOT_MEMORY_SHARE * free_bytes) // prefill_bytes_per_token(engine.model, dtype)
    return tokens // 1024 * 1024


def one_shot_limit(engine: Engine, max_new_tokens: int, free_bytes: int | None = None) -> int:
    """Largest prompt prefilled in one forward by default: the trained context minus room for the
    answer, capped so that one forward pass stays affordable on the device (:func:`one_shot_cap`)."""
    cap = one_shot_cap(engine, free_bytes)
    if engine.trained_context:
        cap = min(cap, engine.trained_context - max_new_tokens)
    return max(cap, 0)


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


class Reader:
    """Runs the read phase and the write phase on one engine and one cache."""

    def __init__(self, engine: Engine, tokenizer, *, stop_ids: Iterable[int] = (), stop: Iterable[str] = (),
                 temperature: float = 0.0, seed: int = 0, recap: int = 0, repetition: Repetition = Repetition(),
                 on_progress: Callable[[int, int, float], None] | None = None):
        """``recap``: a streamed read with a question re-reads at most this many document tokens that the
        question pointed at before the question (:mod:`kvcli.reading.recap`); 0 = none.
        ``repetition``: how the answer is
        kept from looping (default none: plain greedy or sampling, as ``transformers``' ``generate``)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.stop = list(stop)
        self.temperature = temperature
        self.seed = seed
        self.recap = recap
        self.repetition = repetition
        self.on_progress = on_progress  # (tokens read, current cache tokens, seconds so far)

    # --- read -------------------------------------------------------------------------------------
    def read(self, cache, parts: PromptParts, document: Iterable[list[int]], result: Generation, *,
             one_shot: bool | None = None, limit: int | None = None, probe: bool = True) -> torch.Tensor:
        """Put ``prefix + document + suffix`` into ``cache``; return the last prompt token's hidden state.

        ``one_shot`` None decides by size: a prompt of at most ``limit`` tokens is one forward.
        """
        started = time.perf_counter()
        suffix = parts.suffix
        if one_shot is False:
            limit = -1
        elif one_shot is True:
            limit = None
        chunks = iter(document)
        buffered = list(parts.prefix)
        exhausted = False
        while limit is None or len(buffered) + len(suffix) <= limit:
            try:
                buffered.extend(next(chunks))
            except StopIteration:
                exhausted = True
                break
        if exhausted:
            result.one_shot = True
            # Within the context, methods whose papers keep positions do so (see KVCache.keep_positions).
            cache.keep_positions = self.engine.method.keeps_positions
            ids = buffered + suffix
            result.prompt_tokens = len(ids)
            result.document_tokens = len(ids) - len(parts.prefix) - len(suffix)
            hidden = self._forward(cache, ids, None, result, last_only=True, question=len(suffix))
            self._progress(result.prompt_tokens, cache, started)
        else:
            hidden = self._stream(cache, parts, buffered, chunks, result, probe, started)
        result.read_seconds = time.perf_counter() - started
        return hidden[-1:]

    def _stream(self, cache, parts: PromptParts, buffered: list[int], rest: Iterator[list[int]],
                result: Generation, probe: bool, started: float) -> torch.Tensor:
        block = self.engine.block
        suffix = parts.suffix
        probe_ids = torch.tensor([suffix], dtype=torch.long) if probe and suffix else None
        recap = Recap(self.recap, first=len(parts.prefix)) if self.recap and probe_ids is not None else None
        pending = buffered
        read = 0

        def blocks(observer: Recap | None) -> None:
            # Keep at least one token back: the last block goes through with the suffix.
            nonlocal read
            while len(pending) > block:
                ids = pending[:block]
                seen = partial(observer.observe, ids=ids, start=cache.stream_start) if observer else None
                self._forward(cache, ids, probe_ids, result, last_only=True, observe=seen)
                read += len(ids)
                del pending[:block]
                self._progress(read, cache, started)

        for chunk in _chain([pending], rest):
            if chunk is not pending:
                pending.extend(chunk)
            blocks(recap)
        document = read + len(pending) - len(parts.prefix)
        asked = len(suffix) if probe_ids is not None else 0
        held = asked
        if recap is not None and (again := recap.passages(word_joins(self.tokenizer))):
            result.recap_tokens = len(again)
            pending.extend(encode(self.tokenizer, RECAP_SEPARATOR) + again)
            blocks(None)
            held += len(pending)  # the last block, the recap in it, stays with the question
        total = read + len(pending) + len(suffix)
        result.prompt_tokens = total
        result.document_tokens = document
        # The question ends this block: its own queries score the last compression, as the probe scored
        # every compression before it (with --no-probe the block's own window decides).
        hidden = self._forward(cache, pending + suffix, None, result, last_only=True, question=asked, held=held)
        self._progress(total, cache, started)
        return hidden

    def _forward(self, cache, ids: list[int], probe: torch.Tensor | None, result: Generation,
                 last_only: bool = False, question: int = 0,
                 observe: Callable[[KVCache], None] | None = None, held: int = 0) -> torch.Tensor:
        """One engine forward; ``last_only``: only the last token's hidden state is used (a read), so a
        nesting method (PyramidInfer) may skip the hidden states of the tokens a layer drops; ``question``:
        the last tokens of ``ids`` that are the question; ``observe`` and ``held`` (:meth:`Engine.forward`)."""
        if not ids:
            raise KvcliError("the prompt is empty")
        hidden = self.engine.forward(cache, torch.tensor([ids], dtype=torch.long), probe=probe,
                                     last_only=last_only, question=question, observe=observe, held=held)
        result.max_cache_tokens = max(result.max_cache_tokens, cache.max_tokens())
        return hidden

    def _progress(self, read: int, cache, started: float) -> None:
        if self.on_progress:
            self.on_progress(read, cache.max_tokens(), time.perf_counter() - started)

    # --- write ------------------------------------------------------------------------------------
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

    def run(self, parts: PromptParts, document: Iterable[list[int]], max_new_tokens: int, *,
            one_shot: bool | None = None, limit: int | None = None, probe: bool = True,
            on_text: Callable[[str], None] | None = None, on_read: Callable[[Generation], None] | None = None,
            ) -> Generation:
        """Read ``document`` between ``parts`` into a fresh cache, then generate."""
        if limit is None:
            limit = one_shot_limit(self.engine, max_new_tokens)
        result = Generation()
        cache = self.engine.new_cache()
        hidden = self.read(cache, parts, document, result, one_shot=one_shot, limit=limit, probe=probe)
        if on_read:
            on_read(result)
        self.write(cache, hidden, result, max_new_tokens, on_text)
        return result


def _chain(first: Iterable[list[int]], rest: Iterator[list[int]]) -> Iterator[list[int]]:
    yield from first
    yield from rest


def document_tokens(documents, tokenizer, separator: str = "\n\n") -> Iterator[list[int]]:
    """Token ids of one or more :class:`kvcli.io.documents.Document` as one text, without BOS/EOS (the
    prompt's prefix carries them), documents joined by ``separator``."""
    from kvcli.io.text import token_stream

    for chunk in token_stream(documents, tokenizer, special_tokens=False, separator=separator):
        yield chunk.ids
