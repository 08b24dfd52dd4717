"""Perplexity over documents of any length: the library side of ``kvcli ppl``.

Three protocols: each document streamed from a fresh cache (results token-weighted over
documents), every document as one continuous stream (``stream=True``, TreeKV Figure 4), and the
sliding-window protocol (``context``/``stride``, TreeKV Table 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvcli.engine import BlockStats, Engine, LogitsHook, StreamTotals, kv_bytes_per_token
from kvcli.models import LoadedModel
from kvcli.report import peak_memory_bytes, reset_peak_memory
from kvcli.text import Document, TokenChunk, TokenFeed, iter_tokens, token_stream


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

    def as_dict(self) -> dict:
        totals = self.totals
        per_token = kv_bytes_per_token(self.loaded.model, self.loaded.dtype)
        bits_per_byte = totals.nll_sum / math.log(2) / totals.num_bytes if totals.num_bytes else float("nan")
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
    on_logits: LogitsHook | None = None,
) -> tuple[StreamTotals, list[dict], int]:
    """Score ``documents`` and return the totals, one row per document (unless streamed) and peak memory.

    ``on_logits`` sees every scored token's log-probabilities in stream order, documents one after
    the other (see :mod:`kvcli.kl`)."""
    reset_peak_memory(loaded.device)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    tokenizer = loaded.tokenizer

    def run(chunks: Iterable[TokenChunk], limit: int | None) -> StreamTotals:
        feed = TokenFeed(chunks, tokenizer, limit)
        if context is not None:
            totals = engine.score_sliding(feed, context, stride or context, on_block=on_block, on_logits=on_logits)
        else:
            totals = engine.score(feed, on_block=on_block, on_logits=on_logits)
        totals.num_bytes = feed.num_bytes
        return totals

    overall = StreamTotals()
    rows: list[dict] = []
    if stream:
        overall = run(token_stream(documents, tokenizer), None if max_tokens is None else max_tokens + 1)
    else:
        for doc in documents:
            remaining = None if max_tokens is None else max_tokens - overall.tokens
            if remaining is not None and remaining <= 0:
                break
            totals = run(iter_tokens(doc, tokenizer), None if remaining is None else remaining + 1)
            overall.add(totals)
            rows.append({"name": doc.name, "tokens": totals.tokens, "nll": totals.nll, "ppl": totals.ppl,
                         "seconds": totals.seconds})
            if totals.interrupted:
                break
        if len(rows) == 1:
            rows = []
    return overall, rows, peak_memory_bytes(loaded.device)
