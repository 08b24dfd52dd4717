"""Reading a whole document into a KV cache that never outgrows its budget, then having the answer written.

The pipeline behind ``kvcli summarize`` and ``kvcli ask`` (and the pass-key grid) has two phases; this module
is the read, :mod:`kvcli.reading.generate` the write (:class:`Reader` runs one after the other).

* **read**: the prompt is ``prefix + document + suffix`` (see :func:`kvcli.reading.prompts.build_prompt`). A prompt that
  fits the model's context in one affordable forward is prefilled in one shot, so that the end of
  the prompt (the question) is the observation window of the compression, as in SnapKV; kept
  tokens then stay at their positions if the method's paper keeps them (``Method.keeps_positions``). Where the
  reader has a recap and the method must compress such a prompt to its budget, the document (all but its last
  token) is that one forward instead, with the question as its probe, and the recap and the question follow as
  the last block, as after a streamed document: the recap carries the passages the question found into every
  layer, where one compression of the whole prompt kept them in some heads only. A longer
  document is streamed in blocks, the cache compressed after each one, and the suffix is passed as a
  *probe* on every block: its queries join the observation window without entering the cache, so
  the method keeps what the question looks at (query-aware compression). The last block carries
  the suffix itself. Only the last prompt token's hidden state is used, so every read forward is
  ``last_only``: a method that nests its layers (PyramidInfer) gives each layer only the tokens the
  layer below kept (a block with a probe is not nested: the probe scores after the whole block).
* **write**: the answer is generated from that last hidden state, one compressed forward per token
  (:class:`kvcli.reading.generate.AnswerWriter`).

Nothing here knows about the CLI: text arrives as chunks of token ids, generated text leaves through
a callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch

from kvcli.engine.engine import Engine, kv_bytes_per_token
from kvcli.errors import KvcliError
from kvcli.kv.cache import KVCache
from kvcli.reading.generate import AnswerWriter, Generation
from kvcli.reading.prompts import PromptParts, Repetition, encode
from kvcli.reading.recap import Recap, recap_room, word_joins

#: One forward pass over this many tokens is what auto one-shot prefill allows at most on a CPU (the
#: explicit CPU attention materialises ``heads x n x n`` probabilities); beyond it documents are streamed.
#: A GPU's cap comes from its free memory instead (:func:`one_shot_cap`).
ONE_SHOT_CAP = {"cpu": 8192}
#: Share of a GPU's free memory (after loading the model) that an auto one-shot prefill may fill; the
#: rest is left to the allocator's fragmentation, the decode steps and other processes on the card.
ONE_SHOT_MEMORY_SHARE = 0.5
#: Between the document and its recap: a paragraph break, as between the documents of a folder.
RECAP_SEPARATOR = "\n\n"


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


class Reader:
    """Reads a document into a compressed cache (the read phase), then has its :class:`AnswerWriter`
    (:attr:`writer`) write the answer from it (the write phase), on one engine."""

    def __init__(self, engine: Engine, tokenizer, *, stop_ids: Iterable[int] = (), stop: Iterable[str] = (),
                 temperature: float = 0.0, seed: int = 0, recap: int = 0, repetition: Repetition = Repetition(),
                 on_progress: Callable[[int, int, float], None] | None = None):
        """``recap``: at most this many tokens the question pointed at, re-read before it (:mod:`kvcli.reading.recap`;
        0 = none). ``stop_ids``, ``stop``, ``temperature``, ``seed`` and ``repetition`` are the writer's."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.recap = recap
        self.on_progress = on_progress  # (tokens read, current cache tokens, seconds so far)
        self.writer = AnswerWriter(engine, tokenizer, stop_ids=stop_ids, stop=stop, temperature=temperature,
                                   seed=seed, repetition=repetition)

    # --- read -------------------------------------------------------------------------------------
    def read(self, cache, parts: PromptParts, document: Iterable[list[int]], result: Generation, *,
             one_shot: bool | None = None, limit: int | None = None, probe: bool = True) -> torch.Tensor:
        """Put ``prefix + document + suffix`` into ``cache``; return the last prompt token's hidden state.
        ``one_shot`` None decides by size: a prompt of at most ``limit`` tokens is one forward."""
        started = time.perf_counter()
        probe = probe and can_probe(self.engine)
        chunks = iter(document)
        buffered, whole = _opening(parts, chunks, -1 if one_shot is False else (None if one_shot else limit))
        if whole and not recaps_whole(self.engine, self.recap, parts, probe, len(buffered)):
            hidden = self._read_whole(cache, parts, buffered, result, started)
        else:
            result.one_shot = whole  # with a recap: the document in one forward, then recap and question
            hidden = self._stream(cache, parts, buffered, chunks, result, probe, started,
                                  len(buffered) - 1 if whole else None)
        result.read_seconds = time.perf_counter() - started
        return hidden[-1:]

    def _read_whole(self, cache, parts: PromptParts, buffered: list[int], result: Generation,
                    started: float) -> torch.Tensor:
        """The prompt in one forward: its end, the question, is the observation window of the compression."""
        result.one_shot = True
        # Within the context, methods whose papers keep positions do so (see KVCache.keep_positions).
        cache.keep_positions = self.engine.method.keeps_positions
        ids = buffered + parts.suffix
        result.prompt_tokens = len(ids)
        result.document_tokens = len(ids) - len(parts.prefix) - len(parts.suffix)
        hidden = self._forward(cache, ids, None, result, last_only=True, question=len(parts.suffix),
                               span=parts.question_span)
        self._progress(result.prompt_tokens, cache, started)
        return hidden

    def _stream(self, cache, parts: PromptParts, pending: list[int], rest: Iterator[list[int]],
                result: Generation, probe: bool, started: float, block: int | None = None) -> torch.Tensor:
        """The prompt in blocks of ``block`` tokens (None: the engine's), compressed after each, with the question
        as the probe of every block (``probe``), then the recap, and the question at the end of the last block."""
        suffix, room = parts.suffix, recap_room(self.recap, self.engine.budget)
        probe_ids = torch.tensor([suffix], dtype=torch.long) if probe and suffix else None
        recap = Recap(room, first=len(parts.prefix), question=parts.question) if room and probe and suffix else None
        read = self.read_blocks(cache, pending, _chain([[]], rest), result, started, probe=probe_ids, recap=recap,
                                span=parts.question_span, block=block)
        document = read + len(pending) - len(parts.prefix)
        held = len(suffix)
        if recap is not None and (again := recapped(recap, cache, word_joins(self.tokenizer))):
            read, last = self.read_again(cache, pending, again, result, started, read, probe_ids, parts.question_span)
            held += last
        return self.finish(cache, pending, parts, result, read, document, held, started)

    def read_again(self, cache, pending: list[int], again: list[int], result: Generation, started: float, read: int,
                   probe: torch.Tensor | None = None, span: tuple[int, int] | None = None,
                   whole: bool = False) -> tuple[int, int]:
        """A paragraph break and ``again`` (recap, recall) read after the document; the tokens read so far, and how
        many the last block holds (they stay with the question). ``whole``: the document's unread tail goes first,
        all but its last token, where it would push part of ``again`` into a block compressed before the question."""
        result.recap_tokens = len(again)
        again = encode(self.tokenizer, RECAP_SEPARATOR) + again
        if whole and len(pending) + len(again) > self.engine.block:
            read = self.read_blocks(cache, pending, [[]], result, started, read=read, probe=probe, span=span,
                                    block=len(pending) - 1)
        read = self.read_blocks(cache, pending, [again], result, started, read=read, probe=probe, span=span)
        return read, len(pending)

    def read_blocks(self, cache, pending: list[int], chunks: Iterable[list[int]], result: Generation,
                    started: float, *, read: int = 0, probe: torch.Tensor | None = None, recap: Recap | None = None,
                    span: tuple[int, int] | None = None, after: Callable[[list[int]], None] | None = None,
                    block: int | None = None) -> int:
        """Add ``chunks`` to ``pending`` and read every whole ``block`` (None: the engine's) of it but the last (read
        with the question), ``probe`` scoring each, ``recap`` observing it, ``after`` given its ids once read; the
        tokens read so far (``read`` before). ``pending`` is left holding the 1 to ``block`` tokens not read yet."""
        block = block or self.engine.block
        for chunk in chunks:
            pending.extend(chunk)
            while len(pending) > block:  # keep at least one token back for the last block
                ids = pending[:block]
                seen = partial(recap.observe, ids=ids, start=cache.stream_start) if recap else None
                self._forward(cache, ids, probe, result, last_only=True, observe=seen, span=span)
                if after is not None:
                    after(ids)
                read += len(ids)
                del pending[:block]
                self._progress(read, cache, started)
        return read

    def finish(self, cache, pending: list[int], parts: PromptParts, result: Generation, read: int, document: int,
               held: int, started: float) -> torch.Tensor:
        """The last block, ``pending`` and the question (``parts.suffix``), whose own queries score the last compression
        and whose last ``held`` tokens stay; the hidden states."""
        suffix = parts.suffix
        result.prompt_tokens = read + len(pending) + len(suffix)
        result.document_tokens = document
        hidden = self._forward(cache, pending + suffix, None, result, last_only=True, question=len(suffix),
                               held=held, span=parts.question_span)
        self._progress(result.prompt_tokens, cache, started)
        return hidden

    def _forward(self, cache, ids: list[int], probe: torch.Tensor | None, result: Generation, last_only: bool = False,
                 question: int = 0, observe: Callable[[KVCache], None] | None = None, held: int = 0,
                 span: tuple[int, int] | None = None) -> torch.Tensor:
        """One engine forward; ``last_only``: only the last token's hidden state is used (a read), so a
        nesting method (PyramidInfer) may skip the hidden states of the tokens a layer drops; ``question``:
        the last tokens of ``ids`` that are the question; ``observe``, ``held`` and ``span`` (the question's own
        words among the suffix's tokens, which alone vote: :meth:`Engine.forward`)."""
        if not ids:
            raise KvcliError("the prompt is empty")
        hidden = self.engine.forward(cache, torch.tensor([ids], dtype=torch.long), probe=probe, last_only=last_only,
                                     question=question, observe=observe, held=held, span=span)
        result.max_cache_tokens = max(result.max_cache_tokens, cache.max_tokens())
        return hidden

    def _progress(self, read: int, cache, started: float) -> None:
        if self.on_progress:
            self.on_progress(read, cache.max_tokens(), time.perf_counter() - started)

    # --- write ------------------------------------------------------------------------------------
    def write(self, cache, hidden: torch.Tensor, result: Generation, max_new_tokens: int,
              on_text: Callable[[str], None] | None = None) -> None:
        """The write phase after :meth:`read` (:meth:`AnswerWriter.write`), for callers that read once and
        write from the cache themselves (lm-eval's generation, a cache copied to write several answers)."""
        self.writer.write(cache, hidden, result, max_new_tokens, on_text)

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
        self.writer.write(cache, hidden, result, max_new_tokens, on_text)
        return result


def recapped(recap: Recap, cache, joins) -> list[int]:
    """The recap's token ids, the document's opening first and then the best passage last
    (:meth:`kvcli.reading.recap.Recap.in_reading_order`), once ``cache`` has forgotten its own copies of them
    (:meth:`kvcli.kv.cache.KVCache.forget`): they are read again whole right after."""
    chosen = recap.chosen(joins)
    if chosen:
        cache.forget(torch.tensor(list(chosen)))
    return recap.in_reading_order(chosen)


def recaps_whole(engine: Engine, recap: int, parts: PromptParts, probe: bool, buffered: int) -> bool:
    """Whether a prompt that fits one forward (``buffered`` tokens before the question) is read with a recap of at
    most ``recap`` tokens: one fits the budget, the question probes, and the method must compress the prompt."""
    budget = engine.budget
    return (budget is not None and recap_room(recap, budget) > 0 and probe and bool(parts.suffix)
            and engine.compresses() and buffered + len(parts.suffix) > budget)


def _chain(first: Iterable[list[int]], rest: Iterator[list[int]]) -> Iterator[list[int]]:
    yield from first
    yield from rest


def _opening(parts: PromptParts, chunks: Iterator[list[int]], limit: int | None) -> tuple[list[int], bool]:
    """The prefix and the document's first chunks, taken while they and the suffix fit ``limit`` tokens (None:
    no limit); True when the document ended within them, so that the prompt is read in one forward."""
    buffered = list(parts.prefix)
    while limit is None or len(buffered) + len(parts.suffix) <= limit:
        try:
            buffered.extend(next(chunks))
        except StopIteration:
            return buffered, True
    return buffered, False


def document_tokens(documents, tokenizer, separator: str = "\n\n") -> Iterator[list[int]]:
    """Token ids of one or more :class:`kvcli.io.documents.Document` as one text, without BOS/EOS (the
    prompt's prefix carries them), documents joined by ``separator``."""
    from kvcli.io.text import token_stream

    for chunk in token_stream(documents, tokenizer, special_tokens=False, separator=separator):
        yield chunk.ids


def can_probe(engine: Engine) -> bool:
    """Whether ``engine``'s method can take the question's probe (:meth:`kvcli.methods.base.Method.probes`); where it
    cannot, says once that the read goes without one, and so without a recap."""
    if engine.method.probes():
        return True
    engine.warn(f"{engine.method.name} reads without the question's probe (its cache cannot take one), so without a "
                "recap: the question scores only the last block")
    return False
