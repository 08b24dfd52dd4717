"""Planning and running a ``kvcli bench`` grid: every method at every budget over one token stream.

A grid scores the same tokens many times, so the source is tokenized once and held as ids (all its
documents as one stream, like ``kvcli ppl --stream``). Each finished run is saved to ``results.json``
(:mod:`kvcli.eval.bench.results`) before the next one starts.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvcli import __version__
from kvcli.engine.engine import BlockStats, Engine, LogitsHook, StreamTotals
from kvcli.errors import KvcliError, UsageError
from kvcli.eval.bench.results import GridResult, load_results, run_key, save_results
from kvcli.eval.kl import KLMeter, LogitsWriter, Reference, token_digest
from kvcli.eval.perplexity import PerplexityRun
from kvcli.io.documents import Document
from kvcli.io.report import peak_memory_bytes, reset_peak_memory
from kvcli.io.text import first_tokens
from kvcli.methods import METHODS, Method, make_method
from kvcli.models.load import LoadedModel

DEFAULT_MAX_TOKENS = 8192
#: The full-attention reference every run's KL divergence is measured against, kept beside results.json.
REFERENCE_FILE = "reference.kvlogits"


@dataclass
class TokenStream:
    """The token ids every run of a grid scores, and the UTF-8 bytes they stand for (for bits per byte)."""

    ids: torch.Tensor  # int64 [n]; the first token is context only, the other n-1 are scored
    num_bytes: int
    source: str  # what the results record as the source: an absolute path, "-" or "pg19"

    @property
    def tokens(self) -> int:
        return self.ids.shape[0] - 1


def source_name(source: str) -> str:
    """A source as results record it: paths made absolute, so a rerun from another folder still matches."""
    if source not in ("-", "") and Path(source).exists():
        return str(Path(source).resolve())
    return source


def read_token_stream(documents: Iterable[Document], tokenizer, source: str,
                      max_tokens: int | None = DEFAULT_MAX_TOKENS) -> TokenStream:
    """The first ``max_tokens`` scored tokens of ``documents`` as one stream (plus the unscored first token)."""
    ids, num_bytes = first_tokens(documents, tokenizer, None if max_tokens is None else max_tokens + 1)
    if len(ids) < 2:
        raise KvcliError(f"{source}: fewer than two tokens, nothing to score")
    return TokenStream(torch.tensor(ids, dtype=torch.long), num_bytes, source_name(source))


@dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: a method, its ``-o`` options and a budget in tokens per layer (None for an
    unbounded method such as ``full``; results record it under ``cache``)."""

    method: str
    budget: int | None
    options: tuple[tuple[str, str], ...] = ()
    kv_bits: int = 16  # bits per cached key and value element (kvcli.kv.quant)

    def build(self) -> Method:
        method = make_method(self.method, dict(self.options))
        if self.budget is not None:
            method.validate(self.budget)
        return method

    @property
    def label(self) -> str:
        bits = "" if self.kv_bits == 16 else f" · {self.kv_bits}-bit"
        return (self.method if self.budget is None else f"{self.method} · cache {self.budget:,}") + bits


def plan_grid(methods: Sequence[str], budgets: Sequence[int],
              options: dict[str, dict[str, str]] | None = None, kv_bits: Sequence[int] = (16,)) -> list[RunSpec]:
    """Every method at every budget and every ``kv_bits``, in the order given; an unbounded method
    (``full``) once per ``kv_bits``, without a budget.

    Everything is validated here (names, budgets, options, budgets a method cannot hold), so that a
    typo fails in a second rather than after the model has loaded and half the grid has run.
    """
    if not methods:
        raise UsageError("no methods to run")
    for name in methods:
        if name not in METHODS:
            raise UsageError(f"unknown method {name!r}; choose from: {', '.join(sorted(METHODS))}")
    for budget in budgets:
        if budget < 1:
            raise UsageError(f"budgets must be positive numbers of tokens, not {budget}")
    if not budgets and any(not METHODS[name].unbounded for name in methods):
        raise UsageError("no budget for the methods that need one")
    specs = []
    for name in dict.fromkeys(methods):
        opts = tuple(sorted((options or {}).get(name, {}).items()))
        cells = [None] if METHODS[name].unbounded else list(dict.fromkeys(budgets))
        for budget in cells:
            for bits in dict.fromkeys(kv_bits):
                spec = RunSpec(name, budget, opts, bits)
                spec.build()
                specs.append(spec)
    return specs


def measure(loaded: LoadedModel, stream: TokenStream, spec: RunSpec, block: int, *,
            on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
            warn: Callable[[str], None] | None = None,
            on_logits: LogitsHook | None = None) -> tuple[StreamTotals, int]:
    """Score the stream once with ``spec``; return the totals and the peak memory of this run alone.

    The peak is reset first (CUDA's max allocated; on Linux CPUs the resident-set high-water mark via
    ``/proc/self/clear_refs``), so it is each run's own. On CPU it is still the whole process: model
    weights and whatever the allocator kept from earlier runs included.
    """
    engine = Engine(loaded.model, spec.build(), spec.budget, block=block, warn=warn, kv_bits=spec.kv_bits)
    gc.collect()
    reset_peak_memory(loaded.device)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    totals = engine.score([stream.ids], on_block=on_block, on_logits=on_logits)
    totals.num_bytes = stream.num_bytes
    return totals, peak_memory_bytes(loaded.device)


def ensure_reference(loaded: LoadedModel, stream: TokenStream, block: int, path: Path) -> bool:
    """Score the stream once with ``full`` into ``path`` unless a reference of these tokens is there.

    Returns False when Ctrl-C stopped it (the partial file is removed). Every cell's KL divergence
    is measured against this one run, so the grid pays for full attention once.
    """
    if path.exists():
        try:
            ref = Reference(path)
            ref.close()
            if (ref.model, ref.tokens, ref.sha256) == (loaded.name, stream.tokens, token_digest(stream.ids[1:])):
                return True
        except KvcliError:
            pass  # a file from another stream or a cut-off run: measured again
    writer = LogitsWriter(path, loaded.name, int(loaded.model.config.vocab_size))
    engine = Engine(loaded.model, make_method("full"), None, block=block, warn=lambda message: None)
    try:
        totals = engine.score([stream.ids], on_logits=writer.add)
    except BaseException:
        writer.abort()
        raise
    if totals.interrupted:
        writer.abort()
        return False
    writer.close()
    return True


def run_record(loaded: LoadedModel, stream: TokenStream, spec: RunSpec, block: int, totals: StreamTotals,
               peak: int) -> dict:
    """One run as ``results.json`` stores it: ``kvcli ppl --stream --json``'s keys plus source, curve, time."""
    params = spec.build().settings()
    record = PerplexityRun(loaded, spec.method, params, spec.budget, block, "stream", totals, [], peak).as_dict()
    record.pop("interrupted")
    record["kv_bits"] = spec.kv_bits
    record["source"] = stream.source
    record["curve"] = [[stats.position, round(stats.nll, 5) if math.isfinite(stats.nll) else None]
                       for stats in totals.blocks]
    record["finished"] = now()
    return record


def settings(loaded: LoadedModel, stream: TokenStream, block: int) -> dict:
    """The fields of :data:`SETTING_FIELDS` for this model, stream and block."""
    return {"model": loaded.name, "source": stream.source, "tokens": stream.tokens, "block": block,
            "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device)}


def run_grid(
    loaded: LoadedModel,
    stream: TokenStream,
    specs: Sequence[RunSpec],
    *,
    block: int,
    out_dir: Path,
    warm_up: bool = True,
    on_skip: Callable[[list[dict]], None] | None = None,
    on_start: Callable[[RunSpec, int, int], None] | None = None,
    on_run: Callable[[dict, int, int], None] | None = None,
    on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
    warn: Callable[[str], None] | None = None,
    kl: bool = True,
    on_reference: Callable[[], None] | None = None,
) -> GridResult:
    """Run every spec not already in ``out_dir/results.json``, saving after each one.

    With ``kl`` every measured run also records its KL divergence from a full-attention run of the
    same tokens (``kl_mean``, ``kl_p99``, ``same_top``; :mod:`kvcli.eval.kl`), saved once as
    :data:`REFERENCE_FILE` in ``out_dir`` (``on_reference`` is called before it is measured).
    Tokens/s then include the comparison.

    Runs are matched on :data:`KEY_FIELDS`; runs in the file that match nothing planned (another
    model, source or length) are kept as they are. ``warm_up`` first scores two blocks untimed, so
    that the first run's tokens/s does not pay for thread pools and kernel selection. Ctrl-C stops
    the grid: the run in progress is dropped, every finished one is already on disk.
    """
    out_dir = Path(out_dir)
    results = load_results(out_dir)
    common = settings(loaded, stream, block)
    head = metadata(common, stream)
    finished = {run_key(run): run for run in results["runs"]}
    keys = planned_keys(common, specs)
    skipped = [finished[key] for key in keys if key in finished]
    pending = [spec for spec, key in zip(specs, keys, strict=True) if key not in finished]
    if skipped and on_skip:
        on_skip(skipped)
    interrupted = False
    measured = 0
    try:
        if pending and warm_up:
            interrupted = warm_up_on(loaded, stream, pending[0], block)
        reference = out_dir / REFERENCE_FILE
        if pending and kl and not interrupted:
            if on_reference:
                on_reference()
            out_dir.mkdir(parents=True, exist_ok=True)
            interrupted = not ensure_reference(loaded, stream, block, reference)
        for index, spec in enumerate(pending):
            if interrupted:
                break
            if on_start:
                on_start(spec, index, len(pending))
            record = measure_run(loaded, stream, spec, block, reference if kl else None, on_block=on_block, warn=warn)
            if record is None:
                interrupted = True
                break
            finished[save_run(out_dir, results, head, record)] = record
            measured += 1
            if on_run:
                on_run(record, index, len(pending))
    except KeyboardInterrupt:
        interrupted = True
    runs = [finished[key] for key in keys if key in finished]
    return GridResult(runs, results, head, len(skipped), measured, interrupted)


def planned_keys(common: dict, specs: Sequence[RunSpec]) -> list[str]:
    """The key (:func:`run_key`) each planned run is saved under, to find the runs already in results.json."""
    return [run_key({**common, "method": spec.method, "cache": spec.budget, "params": spec.build().settings(),
                     "kv_bits": spec.kv_bits}) for spec in specs]


def warm_up_on(loaded: LoadedModel, stream: TokenStream, spec: RunSpec, block: int) -> bool:
    """Score the stream's first two blocks untimed with ``spec``, so that the first measured run's tokens/s
    does not pay for thread pools and kernel selection; True when Ctrl-C stopped it."""
    warm = Engine(loaded.model, spec.build(), spec.budget, block=block, warn=lambda message: None)
    return warm.score([stream.ids[: 2 * block + 1]]).interrupted


def measure_run(loaded: LoadedModel, stream: TokenStream, spec: RunSpec, block: int, reference: Path | None, *,
                on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
                warn: Callable[[str], None] | None = None) -> dict | None:
    """One cell measured (:func:`measure`) and recorded (:func:`run_record`), with its KL divergence from the
    ``reference`` file when there is one; None when Ctrl-C stopped it, so that no partial run is recorded."""
    meter = KLMeter(Reference(reference)) if reference is not None else None
    try:
        totals, peak = measure(loaded, stream, spec, block, on_block=on_block, warn=warn,
                               on_logits=meter.add if meter else None)
    finally:
        if meter:
            meter.reference.close()
    if totals.interrupted:
        return None
    record = run_record(loaded, stream, spec, block, totals, peak)
    if meter:
        divergence = meter.finish().as_dict()
        divergence.pop("kl_base")  # always REFERENCE_FILE beside results.json
        record.update(divergence)
    return record


def save_run(out_dir: Path, results: dict, head: dict, record: dict) -> str:
    """Put ``record`` into ``results`` (in place of an earlier run with its key) and save results.json at once,
    so that a grid stopped later keeps it; returns its key."""
    key = run_key(record)
    results.update(head, updated=now())
    results["runs"] = [run for run in results["runs"] if run_key(run) != key] + [record]
    save_results(out_dir, results)
    return key


def metadata(common: dict, stream: TokenStream) -> dict:
    """The top-level fields of ``results.json``: the settings of the latest invocation that measured a run."""
    return {"kvcli": __version__, **common, "bytes": stream.num_bytes}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
