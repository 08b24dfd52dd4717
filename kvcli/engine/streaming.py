"""The block loop: a stream of tokens scored block by block through an engine, and what it adds up.

:func:`score_stream` feeds blocks of ``engine.block`` tokens to ``engine.forward`` and sums the NLL
of every token after the first (the hidden state at t - 1 scores token t, carried across blocks);
:func:`score_sliding` is the papers' sliding-window protocol on top of it. :class:`BlockScorer` holds the
scoring side of an engine (the head's NLLs, these loops as methods) apart from how it runs a block, so this
module does not import :mod:`kvcli.engine.engine` (which re-exports everything here, its historical home).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvcli.kv.cache import KVCache

#: Sees the log-probabilities ``[rows, V]`` of scored tokens and their targets ``[rows]``, in stream order.
LogitsHook = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class BlockStats:
    """One block of a scored stream, for ``--jsonl`` curves and progress."""

    position: int  # index in the stream of the block's last token
    tokens: int  # tokens scored in this block
    nll: float  # mean NLL of those tokens (nats)
    cache_tokens: int  # largest per-layer cache size after compression
    tokens_per_second: float


@dataclass
class StreamTotals:
    """Running totals of a scored stream; everything a report needs, even after Ctrl-C."""

    tokens: int = 0  # scored tokens
    processed: int = 0  # tokens run through the model (scored or not)
    nll_sum: float = 0.0
    num_bytes: int = 0
    seconds: float = 0.0
    max_cache_tokens: int = 0
    kv_cache_bytes: int = 0
    interrupted: bool = False
    blocks: list[BlockStats] = field(default_factory=list)

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.nll) if self.tokens else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: StreamTotals) -> None:
        self.tokens += other.tokens
        self.processed += other.processed
        self.nll_sum += other.nll_sum
        self.num_bytes += other.num_bytes
        self.seconds += other.seconds
        self.max_cache_tokens = max(self.max_cache_tokens, other.max_cache_tokens)
        self.kv_cache_bytes = max(self.kv_cache_bytes, other.kv_cache_bytes)
        self.interrupted = self.interrupted or other.interrupted


@dataclass
class StreamState:
    """Where a scored stream stands after a block: all a later process needs to continue it exactly
    (the cache, the totals, the last hidden state that scores the next block's first token, and how
    many tokens of the stream were read)."""

    cache: KVCache
    totals: StreamTotals
    previous: torch.Tensor | None = None
    position: int = 0


#: Rows of logits a CPU projects at a time in :meth:`BlockScorer.token_nll`: small enough for its caches.
NLL_ROWS_CPU = 64

#: On a GPU the rows of one projection are bounded by their fp32 logits instead (2^26 values, 256 MiB): a
#: few large matmuls keep the card busy, where 64-row ones each cost a launch and run far below its rate.
NLL_VALUES_GPU = 1 << 26


def nll_chunk(device: torch.device | str, vocab: int) -> int:
    """Rows of hidden states :meth:`BlockScorer.token_nll` projects to logits at once on ``device``."""
    if torch.device(device).type == "cpu":
        return NLL_ROWS_CPU
    return max(NLL_ROWS_CPU, NLL_VALUES_GPU // vocab)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. A CPU tensor bound for a GPU is copied from pinned memory without blocking:
    a copy from ordinary (pageable) memory makes the host wait for every kernel already queued, a
    host-device sync at every block that leaves the GPU idle while the next block is launched."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class BlockScorer:
    """What scores a stream block by block: the model's head over the hidden states a block run returns, and
    the block loops of this module (:meth:`score`, :meth:`score_sliding`).

    A subclass runs the blocks (:class:`kvcli.engine.engine.Engine`, against a compressed cache): it gives
    ``block`` (tokens per forward), ``lag_host_reads`` (each block's NLL read to the host one block late),
    ``head`` (the model's output embeddings), :meth:`new_cache` and :meth:`forward`.
    """

    block: int
    lag_host_reads: bool
    head: torch.nn.Module

    def new_cache(self) -> KVCache:
        raise NotImplementedError

    def forward(self, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` ``[1, n]`` against ``cache`` and return the last hidden states ``[n, d]``."""
        raise NotImplementedError

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @torch.inference_mode()
    def token_nll(self, hidden: torch.Tensor, targets: torch.Tensor, chunk: int | None = None,
                  on_logits: LogitsHook | None = None) -> torch.Tensor:
        """NLL (nats, float32) of ``targets[i]`` given ``hidden[i]``, projecting a few rows at a time.

        Chunks keep the logits small enough for the CPU's caches and never build the block's full
        log-softmax output, which ``cross_entropy`` over the whole block would; ``chunk`` None is
        :func:`nll_chunk`'s rows for the device. ``on_logits`` sees
        each chunk's log-probabilities ``[rows, V]`` (float32) and targets, in stream order
        (``kvcli ppl --save-logits/--kl-base``).
        """
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        targets = to_device(targets, hidden.device)
        chunk = chunk or nll_chunk(hidden.device, self.head.out_features)
        for i in range(0, targets.shape[0], chunk):
            logits = self.head(hidden[i:i + chunk]).float()
            picked = logits.gather(1, targets[i:i + chunk, None])[:, 0]
            total = torch.logsumexp(logits, dim=-1)
            out[i:i + chunk] = total - picked
            if on_logits is not None:
                on_logits(logits - total[:, None], targets[i:i + chunk])
        return out

    def score(self, token_chunks: Iterable[list[int] | torch.Tensor], *, max_tokens: int | None = None,
              cache: KVCache | None = None, score_from: int = 0,
              on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
              state: StreamState | None = None, on_state: Callable[[StreamState], None] | None = None,
              on_logits: LogitsHook | None = None) -> StreamTotals:
        """Stream tokens through the model and sum the NLL of every token after the first: the block loop of
        :func:`score_stream`, which says what each argument does."""
        return score_stream(self, token_chunks, max_tokens=max_tokens, cache=cache, score_from=score_from,
                            on_block=on_block, state=state, on_state=on_state, on_logits=on_logits)

    def score_sliding(self, token_chunks: Iterable[list[int] | torch.Tensor], context: int, stride: int, *,
                      lead: Sequence[int] = (), on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
                      on_logits: LogitsHook | None = None) -> StreamTotals:
        """The papers' sliding-window protocol (:func:`score_sliding`)."""
        return score_sliding(self, token_chunks, context, stride, lead=lead, on_block=on_block, on_logits=on_logits)


class BlockLedger:
    """Blocks whose NLL is still on the device, read to the host (the one read per block) into the totals.

    With ``lag`` a block is read only after the next one is queued, so a GPU never idles waiting for
    the host; the totals and per-block curve are the same as reading at once.
    """

    def __init__(self, totals: StreamTotals, on_block: Callable[[BlockStats, StreamTotals], None] | None,
                 lag: bool):
        self.totals, self.on_block, self.lag = totals, on_block, lag
        self.pending: list[tuple] = []
        self.clock = time.perf_counter()

    def add(self, nll: torch.Tensor, scored: int, size: int, position: int, cache_tokens: int,
            cache_bytes: int) -> None:
        """One block done: ``nll`` (a device scalar) over ``scored`` of its ``size`` tokens."""
        if self.pending:
            self.settle()
        self.pending.append((nll, scored, size, position, cache_tokens, cache_bytes))
        if not self.lag:
            self.settle()

    def settle(self) -> None:
        """Read the oldest pending block into the totals and report it."""
        nll, scored, size, position, cache_tokens, cache_bytes = self.pending.pop(0)
        totals = self.totals
        value = float(nll)
        now = time.perf_counter()
        elapsed, self.clock = now - self.clock, now
        totals.tokens += scored
        totals.processed += size
        totals.nll_sum += value
        totals.kv_cache_bytes = cache_bytes
        stats = BlockStats(position, scored, value / scored if scored else float("nan"), cache_tokens,
                           size / elapsed if elapsed > 0 else 0.0)
        totals.blocks.append(stats)
        if self.on_block:
            self.on_block(stats, totals)

    def settle_all(self) -> None:
        while self.pending:
            self.settle()


def score_stream(engine: BlockScorer, token_chunks: Iterable[list[int] | torch.Tensor], *,
                 max_tokens: int | None = None, cache: KVCache | None = None, score_from: int = 0,
                 on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
                 state: StreamState | None = None,
                 on_state: Callable[[StreamState], None] | None = None,
                 on_logits: LogitsHook | None = None) -> StreamTotals:
    """Stream tokens through ``engine`` and sum the NLL of every token after the first (:meth:`Engine.score`).

    ``max_tokens`` bounds the tokens scored; ``cache`` is the one to stream into (a fresh one by default).
    ``score_from`` skips scoring the first tokens (they are still read into the cache), for the
    sliding-window protocol. Ctrl-C ends the stream early with what was measured so far: the totals
    of the blocks scored whole, nothing of the block it cut.
    ``state`` continues a stream from a checkpoint (``token_chunks`` then hold the tokens after
    ``state.position``); ``on_state`` sees the state after every block, for checkpoints.
    ``on_logits`` sees the scored tokens' log-probabilities (KL against a reference). Each block's
    NLL reaches the host once; on a GPU one block late (``engine.lag_host_reads``).
    """
    cache = state.cache if state else (cache or engine.new_cache())
    totals = state.totals if state else StreamTotals()
    previous: torch.Tensor | None = state.previous if state else None  # last hidden state of the previous block
    stream_pos = state.position if state else 0
    started = time.perf_counter() - totals.seconds
    # Checkpoints need the state of the block just done, so they read each block at once.
    ledger = BlockLedger(totals, on_block, lag=engine.lag_host_reads and on_state is None)
    try:
        for ids in blocks_of(token_chunks, engine.block, limit=None if max_tokens is None else max_tokens + 1):
            hidden = engine.forward(cache, ids[None, :])
            previous = score_block(engine, hidden, ids, previous, stream_pos, cache, ledger, score_from, on_logits)
            stream_pos += ids.shape[0]
            if on_state:
                totals.seconds = time.perf_counter() - started
                on_state(StreamState(cache, totals, previous, stream_pos))
    except KeyboardInterrupt:
        totals.interrupted = True
    ledger.settle_all()
    totals.seconds = time.perf_counter() - started
    # After Ctrl-C the cache may hold part of a block that was never scored: every figure, the cache's
    # bytes included, is that of the last block whose tokens the totals count.
    if not totals.interrupted:
        totals.kv_cache_bytes = cache.nbytes()
    return totals



def score_block(engine: BlockScorer, hidden: torch.Tensor, ids: torch.Tensor, previous: torch.Tensor | None,
                stream_pos: int, cache: KVCache, ledger: BlockLedger, score_from: int = 0,
                on_logits: LogitsHook | None = None) -> torch.Tensor:
    """Score the block ``ids`` (its tokens from stream index ``stream_pos`` on) from its hidden states ``[n, d]``
    and the last one of the block before (``previous``), into ``ledger``; return this block's last hidden state.

    Token t is scored from the hidden state at t - 1, so a stream's first token is never scored and every
    later one exactly once; tokens before ``score_from`` are read but not scored."""
    predictors = hidden[:-1] if previous is None else torch.cat((previous, hidden[:-1]))
    targets = ids[1:] if previous is None else ids
    first = stream_pos + (1 if previous is None else 0)  # stream index of targets[0]
    skip = max(0, min(score_from - first, targets.shape[0]))
    nll = engine.token_nll(predictors[skip:], targets[skip:], on_logits=on_logits).sum()
    cache_tokens = cache.max_tokens()
    ledger.totals.max_cache_tokens = max(ledger.totals.max_cache_tokens, cache_tokens)
    ledger.add(nll, targets.shape[0] - skip, ids.shape[0], stream_pos + ids.shape[0] - 1, cache_tokens,
               cache.nbytes())
    return hidden[-1:]


def score_sliding(engine: BlockScorer, token_chunks: Iterable[list[int] | torch.Tensor], context: int, stride: int, *,
                  lead: Sequence[int] = (), on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
                  on_logits: LogitsHook | None = None) -> StreamTotals:
    """The papers' sliding-window protocol (TreeKV Table 1, Hugging Face's perplexity guide).

    Windows of ``context`` tokens start every ``stride`` tokens; each is streamed from an empty
    cache and only the tokens not scored by an earlier window count (the last ``stride`` ones,
    all of them for the first window). Only the current window is held in memory.

    ``lead`` (the tokenizer's BOS, when the stream starts with it) begins every window after the
    first too, read but never scored, so that each window starts as a document does: a model
    trained with a BOS in front (Gemma) scores much worse without it (docs/notes/2026-11-23-gemma-3-270m.md).
    """
    if stride < 1 or context < stride or context - len(lead) < 2:
        raise ValueError("need 1 <= stride <= context, and room for two tokens after the lead")
    totals = StreamTotals()
    source = iter(chunk.tolist() if isinstance(chunk, torch.Tensor) else list(chunk) for chunk in token_chunks)
    buffer: list[int] = []  # tokens from stream index `begin` on
    begin = scored_end = 0
    exhausted = False
    while True:
        while not exhausted and len(buffer) < context:
            try:
                buffer.extend(next(source))
            except StopIteration:
                exhausted = True
        head = list(lead) if begin > 0 else []
        body = buffer[:context - len(head)]
        if len(body) < 2 or (scored_end > 0 and begin + len(body) <= scored_end):
            break
        part = engine.score([head + body], score_from=scored_end - begin + len(head), on_block=on_block,
                          on_logits=on_logits)
        totals.add(part)
        totals.blocks.extend(part.blocks)
        scored_end = begin + len(body)
        if part.interrupted or (exhausted and len(buffer) <= len(body)):
            break
        buffer = buffer[stride:]
        begin += stride
    return totals


def blocks_of(chunks: Iterable[list[int] | torch.Tensor], size: int,
              limit: int | None = None) -> Iterator[torch.Tensor]:
    """Regroup a stream of token chunks into tensors of ``size`` tokens (the last may be shorter)."""
    pending: list[int] = []
    taken = 0
    for chunk in chunks:
        ids = chunk.tolist() if isinstance(chunk, torch.Tensor) else list(chunk)
        if limit is not None:
            ids = ids[: limit - taken]
        taken += len(ids)
        pending.extend(ids)
        start = 0  # blocks are read from an offset and the list trimmed once per chunk: linear in the chunk,
        while len(pending) - start >= size:  # where re-slicing the rest after every block is quadratic
            yield torch.tensor(pending[start:start + size], dtype=torch.long)
            start += size
        del pending[:start]
        if limit is not None and taken >= limit:
            break
    if pending:
        yield torch.tensor(pending, dtype=torch.long)
