"""Perplexity over documents of any length: the library side of ``kvcli ppl``.

Three protocols: each document streamed from a fresh cache (results token-weighted over
documents), every document as one continuous stream (``stream=True``, TreeKV Figure 4), and the
sliding-window protocol (``context``/``stride``, TreeKV Table 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcli.engine.engine import BlockStats, Engine, LogitsHook, StreamTotals, kv_bytes_per_token
from kvcli.errors import EmptyDocumentError, UsageError
from kvcli.eval.checkpoint import Checkpointer
from kvcli.io.corpus import CorpusResult, content_of, run_corpus
from kvcli.io.documents import Document
from kvcli.io.outputs import SideFailures
from kvcli.io.ranks import Ranks
from kvcli.io.report import peak_memory_bytes, reset_peak_memory
from kvcli.io.text import TokenChunk, TokenFeed, iter_tokens, leading_special_tokens, token_stream
from kvcli.models.load import LoadedModel


@dataclass
class PerplexityRun:
    """Everything ``kvcli ppl`` reports; ``as_dict`` is the ``--json`` object."""

    loaded: LoadedModel
    method: str
    params: dict
    cache: int | None
    block: int
    protocol: str
    totals: StreamTotals
    documents: list[dict]
    peak_memory: int
    job: dict | None = None  # a corpus job's throughput: ranks, documents and tokens per second of wall time

    def as_dict(self) -> dict:
        totals = self.totals
        per_token = kv_bytes_per_token(self.loaded.model, self.loaded.dtype)
        # Nothing scored (a one-token text) has no bits per byte: null in JSON, not 0.
        bits_per_byte = (totals.nll_sum / math.log(2) / totals.num_bytes if totals.tokens and totals.num_bytes
                         else float("nan"))
        out = {
            "model": self.loaded.name, "method": self.method, "params": self.params, "cache": self.cache,
            "block": self.block, "protocol": self.protocol, "tokens": totals.tokens, "nll": totals.nll,
            "ppl": totals.ppl, "bits_per_byte": bits_per_byte, "bytes": totals.num_bytes,
            "kv_cache_bytes": totals.kv_cache_bytes, "full_kv_cache_bytes": totals.processed * per_token,
            "max_cache_tokens": totals.max_cache_tokens, "peak_memory_bytes": self.peak_memory,
            "seconds": totals.seconds, "tokens_per_second": totals.tokens_per_second,
            "device": str(self.loaded.device), "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "interrupted": totals.interrupted,
        }
        if self.documents:
            out["documents"] = self.documents
        if self.job is not None:
            out["job"] = self.job
        return out


def evaluate(
    loaded: LoadedModel,
    documents: list[Document],
    engine: Engine,
    *,
    max_tokens: int | None = None,
    stream: bool = False,
    context: int | None = None,
    stride: int | None = None,
    on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
    rows_path: Path | None = None,
    resume: bool = False,
    ranks: Ranks | None = None,
    on_document: Callable[[int, Document], None] | None = None,
    checkpoint: Checkpointer | None = None,
    on_logits: LogitsHook | None = None,
    failures: SideFailures | None = None,
    rows_identity: dict | None = None,
    batch: int = 1,
) -> tuple[StreamTotals, list[dict], int, dict | None]:
    """Score ``documents``; return the totals, one row per document (unless streamed), peak memory and,
    for documents scored one by one, the job's throughput.

    Documents scored one by one form a corpus job (:func:`kvcli.io.corpus.run_corpus`): rows go to
    ``rows_path`` as they finish, ``resume`` skips those already there, and under several ``ranks``
    rank 0 gets every row and the totals, summed in document order as one process sums them.
    A ``checkpoint`` saves one stream (``stream`` or a single document) as it goes, and continues the
    saved one when ``resume`` is set. ``on_logits`` sees every scored token's log-probabilities in
    stream order, documents one after the other (see :mod:`kvcli.eval.kl`); it needs one process reading
    every document (no ``resume``, one rank). ``failures`` collects a rows file that failed while the job
    went on (see :class:`kvcli.io.outputs.SideFailures`). ``rows_identity`` is what every row records as the
    settings that made it, and what ``resume`` requires of the rows it reuses (:mod:`kvcli.io.identity`).
    ``batch`` documents are scored side by side (:mod:`kvcli.engine.batched`): the documents protocol only, with
    neither ``max_tokens`` nor ``on_logits``, which follow one document after another.
    """
    reset_peak_memory(loaded.device)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    if batch > 1 and (stream or checkpoint is not None or context is not None or max_tokens is not None
                      or on_logits is not None):
        raise UsageError("a batch of documents goes with the documents protocol only: no --stream, --context, "
                         "--checkpoint, --max-tokens, --save-logits or --kl-base")
    ranks = ranks or Ranks()
    scoring = _StreamScoring(engine, loaded.tokenizer, context, stride, on_block, on_logits, checkpoint)
    if checkpoint is not None and not stream:
        if len(documents) != 1:
            raise UsageError("--checkpoint saves one stream: add --stream for a folder (or --rows for one row "
                             "per document)")
        stream = True  # one document streamed is the same run as the documents protocol over it
    if stream:
        overall = scoring(token_stream(documents, loaded.tokenizer), None if max_tokens is None else max_tokens + 1)
        return overall, [], peak_memory_bytes(loaded.device), None
    if batch > 1:
        each = _BatchedDocuments(engine, loaded.tokenizer, batch, len(documents) > 1, on_block, on_document)
    else:
        each = _EachDocument(scoring, len(documents) > 1, max_tokens, on_document)
    job = run_corpus(documents, each, rows_path=rows_path, resume=resume, ranks=ranks, failures=failures,
                     identity=rows_identity, warn=engine.warn)
    peaks = ranks.gather(peak_memory_bytes(loaded.device))
    overall, rows, throughput = _job_result(job, ranks)
    return overall, rows, max(peaks) if peaks else 0, throughput


@dataclass
class _StreamScoring:
    """How :func:`evaluate` scores one stream of tokens: the sliding-window protocol when ``context`` is set;
    else the stream from a fresh cache, saved as it goes by ``checkpoint`` (continued from it on resume)."""

    engine: Engine
    tokenizer: object
    context: int | None = None
    stride: int | None = None
    on_block: Callable[[BlockStats, StreamTotals], None] | None = None
    on_logits: LogitsHook | None = None
    checkpoint: Checkpointer | None = None

    def __call__(self, chunks: Iterable[TokenChunk], limit: int | None) -> StreamTotals:
        """The totals of the stream ``chunks``, of which at most ``limit`` tokens are read."""
        engine, context, checkpoint = self.engine, self.context, self.checkpoint
        sliding = context is not None
        feed = TokenFeed(chunks, self.tokenizer, limit, lookback=engine.block + (context or 0))
        if sliding:
            totals = engine.score_sliding(feed, context, self.stride or context,
                                          lead=leading_special_tokens(self.tokenizer), on_block=self.on_block,
                                          on_logits=self.on_logits)
        elif checkpoint is not None:
            state, tokens = checkpoint.begin(engine, feed, limit)
            totals = engine.score(tokens, on_block=self.on_block, state=state, on_state=checkpoint.on_state)
            if not totals.interrupted:
                checkpoint.finish()
        else:
            totals = engine.score(feed, on_block=self.on_block, on_logits=self.on_logits)
        # Bits per byte over the text scored, not the text read ahead: the tokens up to the last one
        # scored (the sliding protocol scores every token after the first once), or run through the model.
        covered = (totals.tokens + 1 if totals.tokens else 0) if sliding else totals.processed
        totals.num_bytes = feed.bytes_at(covered)
        return totals


@dataclass
class _EachDocument:
    """What the corpus job of :func:`evaluate` does with a document (:data:`kvcli.io.corpus.Process`): score it as
    its own stream, until ``max_tokens`` tokens are scored over all of them. Among ``several`` documents, one
    with fewer than 2 tokens is an :class:`EmptyDocumentError` (the job skips it); alone, its row scores none."""

    scoring: _StreamScoring
    several: bool
    max_tokens: int | None = None
    on_document: Callable[[int, Document], None] | None = None
    scored: int = 0  # tokens scored so far by this process

    def __call__(self, index: int, doc: Document) -> tuple[dict, bool] | None:
        remaining = None if self.max_tokens is None else self.max_tokens - self.scored
        if remaining is not None and remaining <= 0:
            return None
        if self.on_document is not None:
            self.on_document(index, doc)
        totals = self.scoring(iter_tokens(doc, self.scoring.tokenizer), None if remaining is None else remaining + 1)
        self.scored += totals.tokens
        if not totals.tokens and not totals.interrupted and self.several:
            raise EmptyDocumentError(doc.name, "has fewer than 2 tokens (nothing to score)")
        return {**document_row(totals), **content_of(doc)}, not totals.interrupted


@dataclass
class _BatchedDocuments:
    """:class:`_EachDocument`'s rows, ``batch`` documents scored at a time (:mod:`kvcli.engine.batched`).

    The corpus job tells it the documents it will ask for (:meth:`plan`, in order) and then asks for each in turn;
    the first ask starts the batch, and a document that finishes before it is asked for waits here, as does the
    error of one with nothing to read, raised when that document is asked for."""

    engine: Engine
    tokenizer: object
    batch: int
    several: bool
    on_block: Callable[[BlockStats, StreamTotals], None] | None = None
    on_document: Callable[[int, Document], None] | None = None
    share: list[tuple[int, Document]] = field(default_factory=list)
    finished: dict[int, StreamTotals] = field(default_factory=dict)
    feeds: dict[int, TokenFeed] = field(default_factory=dict)
    empty: dict[int, EmptyDocumentError] = field(default_factory=dict)
    running: Iterator[tuple[int, StreamTotals]] | None = None

    def plan(self, share: list[tuple[int, Document]]) -> None:
        self.share = share

    def __call__(self, index: int, doc: Document) -> tuple[dict, bool] | None:
        from kvcli.engine.batched import score_documents

        if self.running is None:
            self.running = score_documents(self.engine, self._tokens(), self.batch, self.on_block)
        while index not in self.finished:
            position, totals = next(self.running, (None, None))
            if position is None:
                return None
            self.finished[self.share[position][0]] = totals
        totals = self.finished.pop(index)
        if index in self.empty:
            raise self.empty.pop(index)
        totals.num_bytes = self.feeds.pop(index).bytes_at(totals.processed)
        if not totals.tokens and not totals.interrupted and self.several:
            raise EmptyDocumentError(doc.name, "has fewer than 2 tokens (nothing to score)")
        return {**document_row(totals), **content_of(doc)}, not totals.interrupted

    def _tokens(self) -> Iterator[list[int]]:
        """The planned documents' token ids, each read as its row starts."""
        for index, doc in self.share:
            if self.on_document is not None:
                self.on_document(index, doc)
            feed = TokenFeed(iter_tokens(doc, self.tokenizer), self.tokenizer, None)
            self.feeds[index] = feed
            try:
                tokens = [token for ids in feed for token in ids]
            except EmptyDocumentError as error:
                self.empty[index], tokens = error, []
            yield tokens


def _job_result(job: CorpusResult, ranks: Ranks) -> tuple[StreamTotals, list[dict], dict]:
    """A corpus job's totals (its rows summed in document order, as one process sums them), its rows to report
    (one per document, when there are several) and its throughput over the documents it scored itself."""
    overall = StreamTotals()
    for row in job.rows:
        if "skipped" not in row:
            overall.add(row_totals(row))
    overall.interrupted = job.interrupted
    rows = [{"name": row["document"], **row} for row in job.rows] if len(job.rows) > 1 else []
    fresh = [row for row, new in zip(job.rows, job.new, strict=True) if new]
    processed = sum(row.get("processed", 0) for row in fresh)
    throughput = {"ranks": ranks.world_size, "documents": len(fresh), "resumed": job.resumed,
                  "tokens": processed, "seconds": job.seconds,
                  "documents_per_second": len(fresh) / job.seconds if job.seconds > 0 else 0.0,
                  "tokens_per_second": processed / job.seconds if job.seconds > 0 else 0.0}
    return overall, rows, throughput


def document_row(totals: StreamTotals) -> dict:
    """A document's row (``--json``'s ``documents``, a line of ``--rows``), with every sum a merge needs."""
    return {"tokens": totals.tokens, "nll": totals.nll, "ppl": totals.ppl, "seconds": totals.seconds,
            "bytes": totals.num_bytes, "processed": totals.processed, "nll_sum": totals.nll_sum,
            "max_cache_tokens": totals.max_cache_tokens, "kv_cache_bytes": totals.kv_cache_bytes}


def row_totals(row: dict) -> StreamTotals:
    """The totals a row was made from (exactly: JSON keeps every float's digits)."""
    return StreamTotals(tokens=row["tokens"], processed=row["processed"], nll_sum=row["nll_sum"],
                        num_bytes=row["bytes"], seconds=row["seconds"], max_cache_tokens=row["max_cache_tokens"],
                        kv_cache_bytes=row["kv_cache_bytes"])
