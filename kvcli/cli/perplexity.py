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
    MethodOpt,
    OptionOpt,
    Setup,
    build_method,
    check_at_least,
    with_setup,
)
from kvcli.errors import UsageError


@with_setup
def ppl(
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files, - for stdin, or pg19.")],
    method: MethodOpt = "streamingllm",
    cache: CacheOpt = 1024,
    block: BlockOpt = 256,
    option: OptionOpt = None,
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
    from kvcli.cli.render import ppl_summary
    from kvcli.kl import DEFAULT_TOP_K, KLMeter, LogitsWriter, Reference
    from kvcli.perplexity import PerplexityRun, evaluate
    from kvcli.report import StreamProgress, dumps, print_result

    check_at_least(1, block=block, max_tokens=max_tokens)
    if (context is None) != (stride is None):
        raise UsageError("--context and --stride go together")
    if context is not None and not 1 <= stride <= context:
        raise UsageError("--stride must be between 1 and --context")
    if context is not None and stream:
        raise UsageError("--stream and --context/--stride are different protocols: choose one")
    if logits_top_k is not None and save_logits is None:
        raise UsageError("--logits-top-k goes with --save-logits")
    if save_logits is not None and kl_base is not None and save_logits.resolve() == kl_base.resolve():
        raise UsageError("--save-logits would overwrite the --kl-base reference: give another file")
    method_obj = build_method(method, option, cache)
    reference = Reference(kl_base) if kl_base is not None else None
    if reference is not None:
        if max_tokens is not None and max_tokens > reference.tokens:
            raise UsageError(f"--max-tokens {max_tokens:,} is more than the {reference.tokens:,} tokens of {kl_base}")
        max_tokens = max_tokens or reference.tokens  # the reference's tokens unless fewer are asked for
    documents = setup.documents(source, data_dir)
    loaded = setup.load()
    engine = setup.build_engine(loaded, method_obj, cache, block)
    vocab = int(loaded.model.config.vocab_size)
    meter = None
    if reference is not None:
        reference.check_model(loaded.name, vocab)
        meter = KLMeter(reference)
    writer = LogitsWriter(save_logits, loaded.name, vocab, logits_top_k or DEFAULT_TOP_K) if save_logits else None
    hooks = [hook.add for hook in (writer, meter) if hook is not None]

    def on_logits(logprobs, targets) -> None:
        for hook in hooks:
            hook(logprobs, targets)

    progress = StreamProgress(max_tokens, loaded.device, enabled=not setup.quiet)
    jsonl_file = jsonl.open("w") if jsonl else None

    def on_block(stats, totals) -> None:
        if jsonl_file:
            jsonl_file.write(json.dumps({"position": stats.position, "tokens": stats.tokens, "nll": stats.nll,
                                         "cache_tokens": stats.cache_tokens,
                                         "tokens_per_second": stats.tokens_per_second}) + "\n")
        progress.update(totals.processed, stats.tokens_per_second, totals.ppl, stats.cache_tokens)

    finished = False
    try:
        with progress.running():
            totals, rows, peak = evaluate(loaded, documents, engine, max_tokens=max_tokens, stream=stream,
                                          context=context, stride=stride, on_block=on_block,
                                          on_logits=on_logits if hooks else None)
        finished = True
    finally:
        if jsonl_file:
            jsonl_file.close()
        if writer is not None:
            writer.close(totals.interrupted) if finished else writer.abort()
        if reference is not None:
            reference.close()
    protocol = "sliding" if context is not None else ("stream" if stream else "documents")
    result = PerplexityRun(loaded, method, method_obj.settings(), engine.budget, block, protocol, totals, rows,
                           peak).as_dict()
    if meter is not None:
        result.update(meter.finish(totals.interrupted).as_dict())
    if writer is not None:
        result["saved_logits"] = str(save_logits)
    print_result(dumps(result) if json_out else ppl_summary(result))
    if totals.interrupted:
        raise typer.Exit(130)
