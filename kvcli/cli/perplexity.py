"""``kvcli ppl``: streaming perplexity under a fixed-size KV cache, with memory reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

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
    parse_kv_bits,
    parse_options,
    with_setup,
)
from kvcli.errors import BudgetError, UsageError
from kvcli.kv.quant import check_kv_keys


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
    *,
    setup: Setup,
) -> None:
    """Streaming perplexity of SOURCE under a fixed-size KV cache, with memory reported."""
    from kvcli.io.outputs import check_output
    from kvcli.methods import make_method

    check_at_least(1, max_tokens=max_tokens, logits_top_k=logits_top_k, context=context)
    block_size = parse_block(block)
    bits = parse_kv_bits(kv_bits)
    keys = check_kv_keys(kv_keys)
    if checkpoint is not None:
        from kvcli.eval.checkpoint import check_restorable

        check_restorable(bits)  # before the model loads; the Checkpointer itself refuses it too
    if (context is None) != (stride is None):
        raise UsageError("--context and --stride go together")
    if context is not None and not 1 <= stride <= context:
        raise UsageError("--stride must be between 1 and --context")
    if context is not None and stream:
        raise UsageError("--stream and --context/--stride are different protocols: choose one")
    if stream and rows is not None:
        raise UsageError("--rows writes one row per document; --stream reads them as one stream")
    if resume and rows is None and checkpoint is None:
        raise UsageError("--resume needs --rows FILE (rows written are skipped) or --checkpoint DIR (its stream "
                         "continues)")
    if checkpoint is not None and (rows is not None or context is not None):
        raise UsageError(f"--checkpoint saves one stream, not {'--rows' if rows is not None else '--context'}: "
                         "choose one")
    if checkpoint is not None and resume and jsonl is not None:
        raise UsageError("--jsonl cannot continue the per-block curve of a resumed stream: leave it out")
    if logits_top_k is not None and save_logits is None:
        raise UsageError("--logits-top-k goes with --save-logits")
    if (save_logits is not None or kl_base is not None) and (resume or checkpoint is not None):
        raise UsageError("--save-logits and --kl-base follow one uninterrupted run token by token: leave out "
                         "--resume and --checkpoint")
    if overwrite and checkpoint is None:
        raise UsageError("--overwrite goes with --checkpoint (it starts over in a folder holding a checkpoint)")
    from kvcli.eval.checkpoint import parse_every

    every_tokens, every_seconds = parse_every(checkpoint_every)
    ranks, setup = join_ranks(setup)
    if ranks.distributed and (stream or max_tokens is not None or checkpoint is not None
                              or save_logits is not None or kl_base is not None):
        flag = ("--stream" if stream else "--max-tokens" if max_tokens is not None else
                "--checkpoint" if checkpoint is not None else "--save-logits/--kl-base")
        raise UsageError(f"{flag} needs one process: several ranks share whole documents")
    nbytes = parse_bytes(cache_bytes, "--cache-bytes") if cache_bytes is not None else None
    method_obj = build_method(method, option, cache) if nbytes is None else make_method(method, parse_options(option))
    setup.check_outputs({"--jsonl": jsonl, "--rows": rows, "--save-logits": save_logits, "--checkpoint": checkpoint},
                        source, data_dir=data_dir, folders=("--checkpoint",), inputs=(("--kl-base", kl_base),))
    for path, flag in ((jsonl, "--jsonl"), (rows, "--rows"), (save_logits, "--save-logits")):
        if path is not None:
            check_output(path, flag)
    if rows is not None and ranks.main:  # one run per rows file, until the command ends
        from kvcli.io.paths import hold_file

        ctx.with_resource(hold_file(rows, "--rows"))
    if checkpoint is not None:
        # The folder is this run's until the command ends (its context closes it then, however it ends),
        # and is checked before the model loads.
        from kvcli.eval.checkpoint import claim
        from kvcli.io.outputs import lock_folder

        ctx.with_resource(lock_folder(checkpoint, "--checkpoint"))
        claim(checkpoint, resume, overwrite)
    from kvcli.cli.render import ppl_summary
    from kvcli.eval.checkpoint import Checkpointer, identity
    from kvcli.eval.kl import DEFAULT_TOP_K, KLMeter, LogitsWriter, Reference
    from kvcli.eval.perplexity import PerplexityRun, evaluate
    from kvcli.io.identity import rows_identity
    from kvcli.io.outputs import SideFailures, open_output
    from kvcli.io.report import StreamProgress, dumps, print_result

    # Side files that fail while the run goes on (a full disk) are collected, not raised: the result is
    # printed first, then one line says which file is incomplete (kvcli.io.outputs.SideFailures).
    reference = Reference(kl_base) if kl_base is not None else None
    if reference is not None:
        ctx.call_on_close(reference.close)  # read to the end when fewer tokens are compared (KLMeter.finish)
        if max_tokens is not None and max_tokens > reference.tokens:
            raise UsageError(f"--max-tokens {max_tokens:,} is more than the {reference.tokens:,} tokens of {kl_base}")
        asked = max_tokens  # fewer tokens than the reference holds compare over its first ones
        max_tokens = max_tokens or reference.tokens  # the reference's tokens unless fewer are asked for
    documents = setup.documents(source, data_dir)
    loaded = setup.load()
    if nbytes is not None:
        cache = bytes_budget(method_obj, loaded, nbytes, cache_bytes, bits, keys)
    engine = setup.build_engine(loaded, method_obj, cache, block_size, kv_bits=bits, kv_keys=keys)
    saver = None
    if checkpoint is not None:
        saver = Checkpointer(checkpoint, identity(loaded, engine), every_tokens, every_seconds, resume=resume)
        if overwrite:
            saver.path.unlink(missing_ok=True)  # started over: a kill before the first save leaves no old state
    vocab = int(loaded.model.config.vocab_size)
    meter = None
    if reference is not None:
        reference.check_model(loaded.name, vocab)
        meter = KLMeter(reference, asked)
    failures = SideFailures()
    top_k = DEFAULT_TOP_K if logits_top_k is None else logits_top_k
    writer = LogitsWriter(save_logits, loaded.name, vocab, top_k) if save_logits else None
    hooks = [hook.add for hook in (writer, meter) if hook is not None]

    def on_logits(logprobs, targets) -> None:
        nonlocal writer
        if writer is not None:
            try:
                writer.add(logprobs, targets)
            except OSError as exc:
                failures.oserror("--save-logits", save_logits, exc)
                writer.abort()  # a reference cut short is removed: nobody may compare against it
                writer = None
        if meter is not None:
            meter.add(logprobs, targets)

    progress = StreamProgress(max_tokens, loaded.device, enabled=not setup.quiet and ranks.main)
    label: list[str] = []  # the document being scored, shown on the progress line

    def on_document(index: int, doc) -> None:
        label[:] = [f"{index + 1}/{len(documents)} {Path(doc.name).name}"]

    jsonl_file = open_output(jsonl, "--jsonl") if jsonl else None

    def on_block(stats, totals) -> None:
        nonlocal jsonl_file
        if jsonl_file:
            try:
                jsonl_file.write(json.dumps({"position": stats.position, "tokens": stats.tokens, "nll": stats.nll,
                                             "cache_tokens": stats.cache_tokens,
                                             "tokens_per_second": stats.tokens_per_second}) + "\n")
            except OSError as exc:
                failures.oserror("--jsonl", jsonl, exc)
                _close_quietly(jsonl_file)
                jsonl_file = None
        progress.update(totals.processed, stats.tokens_per_second, totals.ppl, stats.cache_tokens,
                        label[0] if label else None)

    finished = False
    try:
        with progress.running():
            totals, doc_rows, peak, job = evaluate(loaded, documents, engine, max_tokens=max_tokens, stream=stream,
                                                   context=context, stride=stride, on_block=on_block,
                                                   rows_path=rows, resume=resume, ranks=ranks,
                                                   on_document=on_document, checkpoint=saver,
                                                   on_logits=on_logits if hooks else None, failures=failures,
                                                   rows_identity=rows_identity("ppl", **identity(loaded, engine),
                                                                               kv_bits=bits, context=context,
                                                                               stride=stride))
        finished = True
    finally:
        if jsonl_file:
            try:
                jsonl_file.close()
            except OSError as exc:
                failures.oserror("--jsonl", jsonl, exc)
        if writer is not None:
            try:
                writer.close(totals.interrupted) if finished else writer.abort()
            except OSError as exc:
                failures.oserror("--save-logits", save_logits, exc)
                writer.abort()
                writer = None
        ranks.close()
    if not ranks.main:  # rank 0 prints the whole job's result
        failures.check()
        return
    if saver is not None and saver.resumed_from is not None:
        setup.note(f"continued the checkpoint in {checkpoint} from token {saver.resumed_from:,} of the stream")
    protocol = "sliding" if context is not None else ("stream" if stream else "documents")
    result = PerplexityRun(loaded, method, method_obj.settings(), engine.budget, engine.block, protocol, totals,
                           doc_rows, peak, job).as_dict()
    result["kv_bits"] = bits
    if bits != 16:
        result["kv_keys"] = engine.cache_key_mode
    if meter is not None:
        result.update(meter.finish(totals.interrupted).as_dict())
    if writer is not None:
        result["saved_logits"] = str(save_logits)
    print_result(dumps(result) if json_out else ppl_summary(result))
    failures.check()
    if totals.interrupted:
        raise typer.Exit(130)


def _close_quietly(handle) -> None:
    """Close a file whose writes already failed; its own flush failing too says nothing new."""
    try:
        handle.close()
    except OSError:
        pass
