"""Documents side by side: up to ``batch`` documents scored at once, each from its own fresh cache.

A corpus of short documents read one at a time leaves a GPU mostly idle with a small model: a block of one
document is too few rows for its matmuls. :func:`score_documents` keeps ``batch`` documents in flight and runs
the next block of each in one forward (:func:`forward_rows`), every row against its
own cache (:mod:`kvcli.kv.rows`), so each document's numbers are those it gets read alone (the matmuls of a
batch may round differently in the last bits). A document that ends frees its row for the next one. Only rows
whose next blocks are equally long share a forward: a document's shorter last block runs with the other rows
that have one of its length, or alone, so no row ever holds padding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvcli.engine.compression import compress_cache
from kvcli.engine.engine import Engine, forget_scores, kv_bytes_per_token
from kvcli.engine.observation import plan_observation
from kvcli.engine.streaming import BlockLedger, BlockStats, StreamTotals, blocks_of, score_block
from kvcli.kv.cache import KVCache

#: Share of a GPU's free memory the documents ``--batch auto`` puts in flight may take, by
#: :func:`document_bytes`: the rest is for the allocator's fragmentation and what that estimate leaves out.
BATCH_MEMORY_SHARE = 0.5
#: The most documents ``--batch auto`` puts in flight, whatever the free memory (not yet measured on a GPU;
#: docs/corpora.md): a bound on the rows of one forward, which a large card would otherwise make huge.
MOST_DOCUMENTS = 64


def document_bytes(engine: Engine, tokens: int) -> int:
    """Device bytes one more document in flight may cost during a block, over-counted on purpose: its cache at the
    largest layer budget (every token of a ``tokens``-long document for an unbounded method) plus a block, at the
    model's precision in every layer; the block's activations through one layer (the residual stream, queries, keys,
    values, the MLP's three widest tensors); one layer's attention probabilities of the block in float32."""
    config = engine.model.config
    budgets = [b for b in (engine.budgets or []) if b is not None]
    held = (max(budgets) if budgets else tokens) + engine.block
    dtype = next(engine.model.parameters()).dtype
    element = torch.tensor([], dtype=dtype).element_size()
    hidden = int(config.hidden_size)
    widest = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    activations = engine.block * (6 * hidden + 3 * widest) * element
    probabilities = int(config.num_attention_heads) * engine.block * held * 4
    return kv_bytes_per_token(engine.model, dtype) * held + activations + probabilities


def choose_batch(engine: Engine, longest: int, free_bytes: int) -> int:
    """``--batch auto``: how many documents (the longest ``longest`` tokens) fit in flight in
    :data:`BATCH_MEMORY_SHARE` of ``free_bytes``, from 1 to :data:`MOST_DOCUMENTS`."""
    fits = int(free_bytes * BATCH_MEMORY_SHARE) // document_bytes(engine, longest)
    return max(1, min(MOST_DOCUMENTS, fits))


@torch.inference_mode()
def forward_rows(engine: Engine, caches: Sequence[KVCache], ids: torch.Tensor) -> torch.Tensor:
    """Run row ``b`` of ``ids`` ``[B, n]`` against ``caches[b]``, compress each cache, and return the last hidden
    states ``[B, n, d]``: several documents in one forward (:mod:`kvcli.kv.rows`), each row's numbers those of
    :meth:`Engine.forward` on that document alone. The scored path only (``kvcli ppl``): no probe, no question."""
    n = ids.shape[1]
    compressing = engine.compresses()
    observation = plan_observation(engine.method, n, compressing, False, 0, 0, None)
    for cache in caches:
        cache.question_scores = observation.asks
        cache.score_window, cache.score_skip = observation.window, observation.skip
    try:
        hidden = engine.run_rows(caches, ids, store=True)
        for cache in caches:
            cache.stream_start += n
            if compressing:
                compress_cache(engine.method, cache, engine.architecture.budgeted, engine.budgets, engine.budget, n,
                               False, set(), observation.question, observation.held)
    finally:
        for cache in caches:
            forget_scores(cache)
    return hidden


@dataclass
class _Row:
    """A document in flight: its blocks still to read, its cache and what it has scored so far."""

    index: int
    blocks: list[torch.Tensor]
    cache: KVCache
    ledger: BlockLedger
    previous: torch.Tensor | None = None
    position: int = 0
    done: int = 0  # blocks read
    seconds: float = 0.0

    @property
    def totals(self) -> StreamTotals:
        return self.ledger.totals


@dataclass
class _Rows:
    """The documents in flight and those waiting for a row."""

    engine: Engine
    waiting: Iterator[tuple[int, Sequence[int] | torch.Tensor]]
    batch: int
    on_block: Callable[[BlockStats, StreamTotals], None] | None = None
    rows: list[_Row] = field(default_factory=list)

    def fill(self) -> None:
        """Start waiting documents, each with a fresh cache, until ``batch`` are in flight or none wait."""
        while len(self.rows) < self.batch:
            item = next(self.waiting, None)
            if item is None:
                return
            index, tokens = item
            blocks = list(blocks_of([tokens], self.engine.block))
            ledger = BlockLedger(StreamTotals(), self.on_block, lag=self.engine.lag_host_reads)
            self.rows.append(_Row(index, blocks, self.engine.new_cache(), ledger))

    def step(self) -> list[_Row]:
        """Read the next block of every row in flight (rows with equally long blocks in one forward); return the
        rows whose document this step finished, in the order they were started."""
        groups: dict[int, list[_Row]] = {}
        for row in self.rows:
            if row.done < len(row.blocks):
                groups.setdefault(row.blocks[row.done].shape[0], []).append(row)
        for members in groups.values():
            self._read(members)
        finished = [row for row in self.rows if row.done == len(row.blocks)]
        self.rows = [row for row in self.rows if row.done < len(row.blocks)]
        return finished

    def _read(self, members: list[_Row]) -> None:
        """One forward over the next block of each of ``members``; every row scored into its own totals."""
        started = time.perf_counter()
        ids = torch.stack([row.blocks[row.done] for row in members])
        engine = self.engine
        hidden = (engine.forward(members[0].cache, ids)[None] if len(members) == 1
                  else forward_rows(engine, [row.cache for row in members], ids))
        for row, states, block in zip(members, hidden, ids, strict=True):
            row.previous = score_block(engine, states, block, row.previous, row.position, row.cache, row.ledger)
            row.position += block.shape[0]
            row.done += 1
        share = (time.perf_counter() - started) / len(members)
        for row in members:
            row.seconds += share


def score_documents(engine: Engine, documents: Iterable[Sequence[int] | torch.Tensor], batch: int,
                    on_block: Callable[[BlockStats, StreamTotals], None] | None = None
                    ) -> Iterator[tuple[int, StreamTotals]]:
    """Score every document of ``documents`` (token ids each) from its own fresh cache, ``batch`` at a time (see
    the module's docstring); yield ``(index, totals)`` as each document finishes (indices count ``documents`` from
    0; documents that are equally long finish in the order given). ``on_block`` sees every block scored, with its
    document's totals. Ctrl-C yields every document in flight with
    the totals of its blocks scored whole, marked interrupted, then stops."""
    if batch < 1:
        raise ValueError(f"a batch holds at least one document, not {batch}")
    rows = _Rows(engine, iter(enumerate(documents)), batch, on_block)
    while True:
        try:  # reading the next documents' tokens too: Ctrl-C there ends the run as it does a forward
            rows.fill()
            if not rows.rows:
                return
            finished = rows.step()
        except KeyboardInterrupt:
            for row in rows.rows:
                yield row.index, _settled(row, interrupted=True)
            return
        for row in finished:
            yield row.index, _settled(row)


def _settled(row: _Row, interrupted: bool = False) -> StreamTotals:
    """A row's totals once every block it scored is read to the host: its seconds its share of the forwards it
    took part in, its cache's bytes those of its last block."""
    row.ledger.settle_all()
    totals = row.totals
    totals.seconds = row.seconds
    totals.interrupted = interrupted
    if not interrupted:
        totals.kv_cache_bytes = row.cache.nbytes()
    return totals
