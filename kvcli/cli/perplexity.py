"""``kvcli ppl``: streaming perplexity under a fixed-size KV cache, with memory reported.

The command reads its options into a :class:`PplOptions`, whose :meth:`PplOptions.validate` refuses a bad
combination before anything is opened; :func:`claim_outputs` then takes the files the run writes, and
:func:`score` loads the model and scores the source, with the side files (:class:`SideFiles`) fed as it goes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer

from kvcli.cli.options import (
    BlockOpt,
    CacheOpt,
    DataDirOpt,
    KvBitsOpt,
    KvKeysOpt,
    MethodOpt,
    OptionOpt,
    RowsOpt,
    Setup,
    build_method,
    check_at_least,
    join_ranks,
    parse_block,
    parse_bytes,
    parse_count,
    parse_kv_bits,
    parse_options,
    with_setup,
)
from kvcli.errors import BudgetError, UsageError
from kvcli.kv.quant import check_kv_keys

if TYPE_CHECKING:  # the command's module is imported by --help: torch is imported where it is used
    from kvcli.engine.engine import Engine
    from kvcli.engine.streaming import StreamTotals
    from kvcli.eval.checkpoint import Checkpointer
    from kvcli.eval.kl import Reference
    from kvcli.io.ranks import Ranks
    from kvcli.methods import Method
    from kvcli.models.load import LoadedModel


def bytes_budget(method, loaded, nbytes: int, text: str, kv_bits: int = 16, kv_keys: str | None = None) -> int:
    """``--cache-bytes`` as the method's budget in tokens per layer on the loaded model at ``kv_bits`` (keys
    rounded the ``kv_keys`` way), checked."""
    from kvcli.engine.engine import budget_for_bytes, check_budget

    budget = budget_for_bytes(method, loaded.model, nbytes, loaded.dtype, kv_bits, kv_keys)
    try:
        check_budget(method, budget)
    except BudgetError as exc:
        raise UsageError(f"--cache-bytes {text} holds {budget} tokens per layer, fewer than {exc.what} "
                         f"({exc.need}): raise --cache-bytes") from None
    return budget


@dataclass(frozen=True)
class CheckedPpl:
    """The options of :class:`PplOptions` that need parsing, parsed: what the run is built from."""

    block: int | None  # None: the engine's default for the device
    kv_bits: int
    kv_keys: str | None
    every_tokens: int | None  # --checkpoint-every, as tokens or as seconds
    every_seconds: float | None
    cache_bytes: int | None  # None: the budget is --cache
    method: Method
    batch: int | None = 1  # None: --batch auto


def parse_batch(text: str) -> int | None:
    """``--batch``: a number of documents (at least 1), or ``auto`` (None: chosen from free memory on a GPU)."""
    return parse_count(text, "--batch", "documents")


@dataclass(frozen=True)
class PplOptions:
    """``kvcli ppl``'s own options, as the user gave them."""

    source: str
    method: str
    cache: int
    block: str
    option: list[str] | None
    kv_bits: str
    kv_keys: str
    cache_bytes: str | None
    max_tokens: int | None
    stream: bool
    context: int | None
    stride: int | None
    json_out: bool
    jsonl: Path | None
    data_dir: Path | None
    rows: Path | None
    checkpoint: Path | None
    checkpoint_every: str
    resume: bool
    overwrite: bool
    save_logits: Path | None
    kl_base: Path | None
    logits_top_k: int | None
    batch: str = "1"

    @property
    def protocol(self) -> str:
        """How the source is scored, as the result names it: sliding windows, one stream, or document by document."""
        return "sliding" if self.context is not None else ("stream" if self.stream else "documents")

    def validate(self) -> CheckedPpl:
        """Every option checked and parsed, reading no file and loading no model, so that a mistake costs no wait;
        the first one wrong is a :class:`UsageError`."""
        from kvcli.methods import make_method

        check_at_least(1, max_tokens=self.max_tokens, logits_top_k=self.logits_top_k, context=self.context)
        batch = parse_batch(self.batch)
        block = parse_block(self.block)
        bits = parse_kv_bits(self.kv_bits)
        keys = check_kv_keys(self.kv_keys)
        self._check_together(batch)
        from kvcli.eval.checkpoint import parse_every  # imports torch: after the checks that need none

        every_tokens, every_seconds = parse_every(self.checkpoint_every)
        nbytes = parse_bytes(self.cache_bytes, "--cache-bytes") if self.cache_bytes is not None else None
        method = (build_method(self.method, self.option, self.cache) if nbytes is None
                  else make_method(self.method, parse_options(self.option)))
        return CheckedPpl(block, bits, keys, every_tokens, every_seconds, nbytes, method, batch)

    def _check_together(self, batch: int | None) -> None:
        """Options that only make sense with another, or that choose between protocols (``batch``: --batch parsed,
        None for auto)."""
        if (self.context is None) != (self.stride is None):
            raise UsageError("--context and --stride go together")
        if self.context is not None and not 1 <= self.stride <= self.context:
            raise UsageError("--stride must be between 1 and --context")
        if self.context is not None and self.stream:
            raise UsageError("--stream and --context/--stride are different protocols: choose one")
        if self.stream and self.rows is not None:
            raise UsageError("--rows writes one row per document; --stream reads them as one stream")
        if self.resume and self.rows is None and self.checkpoint is None:
            raise UsageError("--resume needs --rows FILE (rows written are skipped) or --checkpoint DIR (its stream "
                             "continues)")
        if self.checkpoint is not None and (self.rows is not None or self.context is not None):
            raise UsageError(f"--checkpoint saves one stream, not {'--rows' if self.rows is not None else '--context'}"
                             ": choose one")
        if self.checkpoint is not None and self.resume and self.jsonl is not None:
            raise UsageError("--jsonl cannot continue the per-block curve of a resumed stream: leave it out")
        if self.logits_top_k is not None and self.save_logits is None:
            raise UsageError("--logits-top-k goes with --save-logits")
        if (self.save_logits is not None or self.kl_base is not None) and (self.resume or self.checkpoint is not None):
            raise UsageError("--save-logits and --kl-base follow one uninterrupted run token by token: leave out "
                             "--resume and --checkpoint")
        if self.one_stream() and (batch or 1) > 1:
            raise UsageError("--batch scores a folder's documents side by side, each from its own cache: leave out "
                             "--stream, --context, --checkpoint, --max-tokens, --jsonl, --save-logits and --kl-base, "
                             "which follow one stream at a time")
        if self.overwrite and self.checkpoint is None:
            raise UsageError("--overwrite goes with --checkpoint (it starts over in a folder holding a checkpoint)")

    def one_stream(self) -> bool:
        """Whether an option follows one stream token by token (so documents cannot be read side by side)."""
        return (self.stream or self.context is not None or self.checkpoint is not None or self.max_tokens is not None
                or self.jsonl is not None or self.save_logits is not None or self.kl_base is not None)

    def check_ranks(self, ranks: Ranks) -> None:
        """Several ranks share whole documents: what follows one stream token by token needs one process."""
        if ranks.distributed and (self.stream or self.max_tokens is not None or self.checkpoint is not None
                                  or self.save_logits is not None or self.kl_base is not None):
            flag = ("--stream" if self.stream else "--max-tokens" if self.max_tokens is not None else
                    "--checkpoint" if self.checkpoint is not None else "--save-logits/--kl-base")
            raise UsageError(f"{flag} needs one process: several ranks share whole documents")


@with_setup
def ppl(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files, - for stdin, or pg19.")],
    method: MethodOpt = "streamingllm",
    cache: CacheOpt = 1024,
    block: BlockOpt = "auto",
    option: OptionOpt = None,
    kv_bits: KvBitsOpt = "16",
    kv_keys: KvKeysOpt = "auto",
    cache_bytes: Annotated[str | None, typer.Option("--cache-bytes", help="KV budget in bytes (e.g. 45MiB), "
                                                    "turned into tokens per layer for this method and model: "
                                                    "compares methods at equal memory (PoD with a selection "
                                                    "keeps more tokens in the same bytes). Replaces --cache.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", "-n", help="Stop after this many scored "
                                                   "tokens.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Run all documents as one continuous stream with one "
                                         "cache (TreeKV Figure 4) instead of a fresh cache per document.")] = False,
    context: Annotated[int | None, typer.Option("--context", help="Sliding-window protocol: window length L "
                                                "(each window streamed from an empty cache).")] = None,
    stride: Annotated[int | None, typer.Option("--stride", help="Sliding-window protocol: stride S; only the "
                                               "last S tokens of each window are scored.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")] = False,
    jsonl: Annotated[Path | None, typer.Option("--jsonl", help="Write one JSON record per block to this file "
                                               "(position, nll, cache tokens, tokens/s).")] = None,
    data_dir: DataDirOpt = None,
    rows: RowsOpt = None,
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="Save the whole state of the stream "
                                                    "(--stream, or one document) in this folder as it goes; "
                                                    "--resume continues it after a kill.")] = None,
    checkpoint_every: Annotated[str, typer.Option("--checkpoint-every", help="Tokens (100000) or time (90s, "
                                                  "10m, 1h) between checkpoints.")] = "10m",
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed run: skip the documents already in "
                                         "--rows, or continue the stream saved in --checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start over in a --checkpoint folder that holds "
                                            "another run's checkpoint, replacing it.")] = False,
    save_logits: Annotated[Path | None, typer.Option("--save-logits", help="Save every scored token's top-k "
                                                     "log-probabilities to this file as it streams: the "
                                                     "reference for --kl-base.")] = None,
    kl_base: Annotated[Path | None, typer.Option("--kl-base", help="Compare with a reference saved by "
                                                 "--save-logits over the same tokens: mean and 99th percentile "
                                                 "KL divergence, same top token %.")] = None,
    logits_top_k: Annotated[int | None, typer.Option("--logits-top-k", help="Tokens per position --save-logits "
                                                     "keeps; the others are one bucket (default 32).")] = None,
    batch: Annotated[str, typer.Option("--batch", help="Score this many documents of a folder side by side, each "
                                       "from its own fresh cache, their blocks in one forward: the same numbers "
                                       "per document as one at a time (within float rounding), faster on a GPU "
                                       "with a small model; little gain on a CPU. auto: as many as half the GPU's "
                                       "free memory holds (1 on a CPU).")] = "1",
    *,
    setup: Setup,
) -> None:
    """Streaming perplexity of SOURCE under a fixed-size KV cache, with memory reported."""
    opts = PplOptions(
        source=source, method=method, cache=cache, block=block, option=option, kv_bits=kv_bits, kv_keys=kv_keys,
        cache_bytes=cache_bytes, max_tokens=max_tokens, stream=stream, context=context, stride=stride,
        json_out=json_out, jsonl=jsonl, data_dir=data_dir, rows=rows, checkpoint=checkpoint,
        checkpoint_every=checkpoint_every, resume=resume, overwrite=overwrite, save_logits=save_logits,
        kl_base=kl_base, logits_top_k=logits_top_k, batch=batch)
    checked = opts.validate()
    ranks, setup = join_ranks(setup)
    opts.check_ranks(ranks)
    claim_outputs(ctx, opts, setup, ranks.main)
    scored = score(opts, checked, setup, ranks, open_reference(ctx, opts))
    if not ranks.main:  # rank 0 prints the whole job's result
        scored.side.failures.check()
        return
    render(opts, checked, scored, setup)
    scored.side.failures.check()
    if scored.totals.interrupted:
        raise typer.Exit(130)


def claim_outputs(ctx: typer.Context, opts: PplOptions, setup: Setup, main: bool) -> None:
    """Before the model loads: every output apart from the inputs and writable, ``--rows`` held by this run (rank 0
    of several) and the ``--checkpoint`` folder locked and claimed, both until the command ends (its context
    releases them however it ends)."""
    from kvcli.io.outputs import check_output

    setup.check_outputs({"--jsonl": opts.jsonl, "--rows": opts.rows, "--save-logits": opts.save_logits,
                         "--checkpoint": opts.checkpoint}, opts.source, data_dir=opts.data_dir,
                        folders=("--checkpoint",), inputs=(("--kl-base", opts.kl_base),))
    for path, flag in ((opts.jsonl, "--jsonl"), (opts.rows, "--rows"), (opts.save_logits, "--save-logits")):
        if path is not None:
            check_output(path, flag)
    if opts.rows is not None and main:  # one run per rows file
        from kvcli.io.paths import hold_file

        ctx.with_resource(hold_file(opts.rows, "--rows"))
    if opts.checkpoint is not None:
        from kvcli.eval.checkpoint import claim
        from kvcli.io.outputs import lock_folder

        ctx.with_resource(lock_folder(opts.checkpoint, "--checkpoint"))
        claim(opts.checkpoint, opts.resume, opts.overwrite)


def open_reference(ctx: typer.Context, opts: PplOptions) -> Reference | None:
    """The ``--kl-base`` reference (None without one), open until the command ends, checked to hold at least the
    ``--max-tokens`` asked for."""
    if opts.kl_base is None:
        return None
    from kvcli.eval.kl import Reference

    reference = Reference(opts.kl_base)
    ctx.call_on_close(reference.close)  # read to the end when fewer tokens are compared (KLMeter.finish)
    if opts.max_tokens is not None and opts.max_tokens > reference.tokens:
        raise UsageError(f"--max-tokens {opts.max_tokens:,} is more than the {reference.tokens:,} tokens of "
                         f"{opts.kl_base}")
    return reference


class SideFiles:
    """What a run writes and compares beside its result: ``--jsonl`` (a record per block), ``--save-logits`` (a
    reference) and the ``--kl-base`` comparison, fed as the run streams.

    A side file that fails while the run goes on (a full disk) is collected in :attr:`failures`, not raised: the
    result is printed first, then one line says which file is incomplete (:class:`kvcli.io.outputs.SideFailures`).
    """

    def __init__(self, opts: PplOptions, loaded: LoadedModel, reference: Reference | None) -> None:
        from kvcli.eval.kl import DEFAULT_TOP_K, KLMeter, LogitsWriter
        from kvcli.io.outputs import SideFailures, open_output

        vocab = int(loaded.model.config.vocab_size)
        self.meter = None
        if reference is not None:
            reference.check_model(loaded.name, vocab)
            self.meter = KLMeter(reference, opts.max_tokens)  # fewer tokens asked: compared over the first ones
        self.failures = SideFailures()
        self.logits_path, self.jsonl_path = opts.save_logits, opts.jsonl
        top_k = DEFAULT_TOP_K if opts.logits_top_k is None else opts.logits_top_k
        self.writer = LogitsWriter(opts.save_logits, loaded.name, vocab, top_k) if opts.save_logits else None
        self.hooked = self.writer is not None or self.meter is not None
        self.jsonl = open_output(opts.jsonl, "--jsonl") if opts.jsonl else None

    def on_logits(self, logprobs, targets) -> None:
        """Every scored token's log-probabilities: to the reference being saved and to the comparison."""
        if self.writer is not None:
            try:
                self.writer.add(logprobs, targets)
            except OSError as exc:
                self.failures.oserror("--save-logits", self.logits_path, exc)
                self.writer.abort()  # a reference cut short is removed: nobody may compare against it
                self.writer = None
        if self.meter is not None:
            self.meter.add(logprobs, targets)

    def on_block(self, stats) -> None:
        """One ``--jsonl`` record per block."""
        if not self.jsonl:
            return
        try:
            self.jsonl.write(json.dumps({"position": stats.position, "tokens": stats.tokens, "nll": stats.nll,
                                         "cache_tokens": stats.cache_tokens,
                                         "tokens_per_second": stats.tokens_per_second}) + "\n")
        except OSError as exc:
            self.failures.oserror("--jsonl", self.jsonl_path, exc)
            _close_quietly(self.jsonl)
            self.jsonl = None

    def close(self, totals: StreamTotals | None) -> None:
        """Close the files once the run ends: the saved reference complete when it finished (``totals``), removed
        when it raised (``totals`` None)."""
        if self.jsonl:
            try:
                self.jsonl.close()
            except OSError as exc:
                self.failures.oserror("--jsonl", self.jsonl_path, exc)
        if self.writer is not None:
            try:
                self.writer.close(totals.interrupted) if totals is not None else self.writer.abort()
            except OSError as exc:
                self.failures.oserror("--save-logits", self.logits_path, exc)
                self.writer.abort()
                self.writer = None


@dataclass(frozen=True)
class Scored:
    """What a ``ppl`` run measured (:func:`kvcli.eval.perplexity.evaluate`'s results) and on what."""

    loaded: LoadedModel
    engine: Engine
    totals: StreamTotals
    doc_rows: list[dict]
    peak: int
    job: dict | None
    saver: Checkpointer | None
    side: SideFiles


def score(opts: PplOptions, checked: CheckedPpl, setup: Setup, ranks: Ranks, reference: Reference | None) -> Scored:
    """Load the model and score SOURCE the way the options say, with a progress line and the side files fed."""
    from kvcli.eval.checkpoint import identity
    from kvcli.eval.perplexity import evaluate
    from kvcli.io.identity import rows_identity
    from kvcli.io.report import StreamProgress

    documents = setup.documents(opts.source, opts.data_dir)
    loaded = setup.load()
    cache = opts.cache if checked.cache_bytes is None else bytes_budget(
        checked.method, loaded, checked.cache_bytes, opts.cache_bytes, checked.kv_bits, checked.kv_keys)
    engine = setup.build_engine(loaded, checked.method, cache, checked.block, kv_bits=checked.kv_bits,
                                kv_keys=checked.kv_keys)
    saver = _checkpointer(opts, checked, loaded, engine)
    side = SideFiles(opts, loaded, reference)
    # Compared with a reference, the run scores the reference's tokens unless fewer are asked for.
    max_tokens = (opts.max_tokens or reference.tokens) if reference is not None else opts.max_tokens
    progress = StreamProgress(max_tokens, loaded.device, enabled=not setup.quiet and ranks.main)
    label: list[str] = []  # the document being scored, shown on the progress line

    def on_document(index: int, doc) -> None:
        label[:] = [f"{index + 1}/{len(documents)} {Path(doc.name).name}"]

    def on_block(stats, totals) -> None:
        side.on_block(stats)
        progress.update(totals.processed, stats.tokens_per_second, totals.ppl, stats.cache_tokens,
                        label[0] if label else None)

    finished = None  # the totals once the run ends without raising
    try:
        with progress.running():
            totals, doc_rows, peak, job = evaluate(
                loaded, documents, engine, max_tokens=max_tokens, stream=opts.stream, context=opts.context,
                stride=opts.stride, on_block=on_block, rows_path=opts.rows, resume=opts.resume, ranks=ranks,
                on_document=on_document, checkpoint=saver, on_logits=side.on_logits if side.hooked else None,
                failures=side.failures, rows_identity=rows_identity("ppl", **identity(loaded, engine),
                                                                    context=opts.context, stride=opts.stride),
                batch=resolve_batch(checked.batch, engine, documents, setup, opts.one_stream()))
        finished = totals
    finally:
        side.close(finished)
        ranks.close()
    return Scored(loaded, engine, totals, doc_rows, peak, job, saver, side)


def resolve_batch(batch: int | None, engine: Engine, documents, setup: Setup, one_stream: bool) -> int:
    """``--batch``'s documents in flight: the number given, or for ``auto`` 1 on a CPU, for one document or with an
    option that follows one stream, else as many as the GPU's free memory holds (:func:`choose_batch`), said on
    stderr."""
    import torch

    from kvcli.engine.batched import choose_batch

    if batch is not None:
        return batch
    if engine.device.type != "cuda" or len(documents) < 2 or one_stream:
        return 1
    free, _ = torch.cuda.mem_get_info(engine.device)
    longest = max(doc.size or 0 for doc in documents)  # bytes: at least the tokens an unbounded cache would hold
    chosen = choose_batch(engine, longest, free)
    setup.note(f"--batch auto: {chosen} documents at a time ({free / 2**30:.1f} GiB free)")
    return chosen


def _checkpointer(opts: PplOptions, checked: CheckedPpl, loaded: LoadedModel, engine: Engine) -> Checkpointer | None:
    """The ``--checkpoint`` saver of the stream (None without one); started over, the old state is gone at once,
    so a kill before the first save leaves nothing stale to resume."""
    if opts.checkpoint is None:
        return None
    from kvcli.eval.checkpoint import Checkpointer, identity

    saver = Checkpointer(opts.checkpoint, identity(loaded, engine), checked.every_tokens, checked.every_seconds,
                         resume=opts.resume)
    if opts.overwrite:
        saver.path.unlink(missing_ok=True)
    return saver


def render(opts: PplOptions, checked: CheckedPpl, scored: Scored, setup: Setup) -> None:
    """The result on stdout, one JSON object (``--json``) or the summary; where a checkpoint was continued from
    on stderr first."""
    from kvcli.cli.render import ppl_summary
    from kvcli.eval.perplexity import PerplexityRun
    from kvcli.io.report import dumps, print_result

    saver, engine, totals = scored.saver, scored.engine, scored.totals
    if saver is not None and saver.resumed_from is not None:
        setup.note(f"continued the checkpoint in {opts.checkpoint} from token {saver.resumed_from:,} of the stream")
    result = PerplexityRun(scored.loaded, opts.method, checked.method.settings(), engine.budget, engine.block,
                           opts.protocol, totals, scored.doc_rows, scored.peak, scored.job).as_dict()
    result["kv_bits"] = checked.kv_bits
    if checked.kv_bits != 16:
        result["kv_keys"] = engine.cache_key_mode
    if scored.side.meter is not None:
        result.update(scored.side.meter.finish(totals.interrupted).as_dict())
    if scored.side.writer is not None:
        result["saved_logits"] = str(opts.save_logits)
    print_result(dumps(result) if opts.json_out else ppl_summary(result))


def _close_quietly(handle: IO[str]) -> None:
    """Close a file whose writes already failed; its own flush failing too says nothing new."""
    try:
        handle.close()
    except OSError:
        pass
