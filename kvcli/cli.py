"""The ``kvcli`` command: a thin Typer layer over the library.

Results go to stdout (text or one JSON object), everything else to stderr. User mistakes become
one line on stderr and exit code 2 (usage) or 1 (runtime); Ctrl-C prints what was measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvcli.errors import KvcliError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Push whole books through a language model with a KV cache that never grows, and measure the cost.",
)

# --- options shared by the commands -------------------------------------------------------------
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name (smollm2-135m), Hugging Face id or "
                                       "local folder, or a .gguf file.")]
MethodOpt = Annotated[str, typer.Option("--method", help="Compression method (see `kvcli methods`).")]
CacheOpt = Annotated[int, typer.Option("--cache", "-c", help="KV budget in tokens per layer (average over "
                                       "layers for methods that vary it). Ignored by `full`.")]
BlockOpt = Annotated[int, typer.Option("--block", "-b", help="Tokens per forward pass; the cache is compressed "
                                       "after every block.")]
OptionOpt = Annotated[list[str] | None, typer.Option("--option", "-o", help="Method parameter KEY=VALUE "
                                                     "(repeatable), e.g. -o sinks=8.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 on CUDA and on CPUs with AMX/AVX512-BF16, "
                                       "else fp32), bfloat16, float16 or float32.")]
DeviceMapOpt = Annotated[str | None, typer.Option("--device-map", help="accelerate device map (e.g. auto) to "
                                                  "spread a large model over GPUs.")]
FourBitOpt = Annotated[bool, typer.Option("--load-in-4bit", help="Quantize weights to 4 bits (bitsandbytes, "
                                          "CUDA only).")]
EightBitOpt = Annotated[bool, typer.Option("--load-in-8bit", help="Quantize weights to 8 bits (bitsandbytes, "
                                           "CUDA only).")]
EncodingOpt = Annotated[str | None, typer.Option("--encoding", help="Text encoding of the input (default UTF-8, "
                                                 "invalid bytes replaced with a warning).")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="Folder of .txt books for the pg19 source "
                                                 "when offline (or set KVCLI_DATA).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or warnings on stderr.")]


def parse_options(options: list[str] | None) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for item in options or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-o {item!r}: expected KEY=VALUE")
        parsed[key.strip()] = value.strip()
    return parsed


def build_method(name: str, options: list[str] | dict | None, cache: int):
    """The method ``name`` with its ``-o`` options (raw ``KEY=VALUE`` strings or parsed), checked against ``cache``."""
    from kvcli.methods import make_method

    if cache < 1:
        raise UsageError(f"--cache must be a positive number of tokens, not {cache}")
    method = make_method(name, options if isinstance(options, dict) else parse_options(options))
    method.validate(cache)
    return method


def split_list(text: str, convert, what: str) -> list:
    """``"a,b,c"`` as a list of converted items; a usage error names the option ``what`` when it fails."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{what} is empty")
    try:
        return [convert(item) for item in items]
    except ValueError:
        raise UsageError(f"{what}: cannot read {text!r} as a comma-separated list") from None


def method_options(methods: list[str], options: list[str] | None) -> dict[str, dict]:
    """``-o KEY=VALUE`` for every method with parameter KEY, ``-o METHOD.KEY=VALUE`` for one method."""
    import dataclasses

    from kvcli.methods import METHODS

    out: dict[str, dict] = {name: {} for name in methods}
    for key, value in parse_options(options).items():
        target, dot, name = key.rpartition(".")
        if dot:
            if target not in out:
                raise UsageError(f"-o {key}: {target!r} is not one of --methods")
            out[target][name] = value
            continue
        having = [m for m in methods if m in METHODS
                  and name.replace("-", "_") in {f.name for f in dataclasses.fields(METHODS[m])}]
        if not having:
            raise UsageError(f"-o {key}: none of {', '.join(methods)} has a parameter {name!r}")
        for m in having:
            out[m][name] = value
    return out


def load(model: str, device: str, dtype: str, device_map: str | None, load_in_4bit: bool, load_in_8bit: bool):
    from kvcli.models import load_model

    return load_model(model, device=device, dtype=dtype, device_map=device_map, load_in_4bit=load_in_4bit,
                      load_in_8bit=load_in_8bit)


@app.command()
def ppl(
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files, - for stdin, or pg19.")],
    model: ModelOpt = "smollm2-135m",
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
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    encoding: EncodingOpt = None,
    data_dir: DataDirOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Streaming perplexity of SOURCE under a fixed-size KV cache, with memory reported."""
    from kvcli.engine import Engine
    from kvcli.perplexity import PerplexityRun, evaluate
    from kvcli.report import StreamProgress, print_result, warn
    from kvcli.text import open_source

    if block < 1:
        raise UsageError(f"--block must be at least 1, not {block}")
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, not {max_tokens}")
    if (context is None) != (stride is None):
        raise UsageError("--context and --stride go together")
    if context is not None and not 1 <= stride <= context:
        raise UsageError("--stride must be between 1 and --context")
    if context is not None and stream:
        raise UsageError("--stream and --context/--stride are different protocols: choose one")
    method_obj = build_method(method, option, cache)
    say = (lambda message: None) if quiet else warn
    documents = open_source(source, encoding=encoding, data_dir=data_dir, warn=say)
    loaded = load(model, device, dtype, device_map, load_in_4bit, load_in_8bit)
    budget = None if method == "full" else cache
    engine = Engine(loaded.model, method_obj, budget, block=block, warn=say)

    progress = StreamProgress(max_tokens, loaded.device, enabled=not quiet)
    jsonl_file = jsonl.open("w") if jsonl else None
    done = {"tokens": 0, "nll": 0.0, "processed": 0}

    def on_block(stats, totals) -> None:
        if jsonl_file:
            jsonl_file.write(json.dumps({"position": stats.position, "tokens": stats.tokens, "nll": stats.nll,
                                         "cache_tokens": stats.cache_tokens,
                                         "tokens_per_second": stats.tokens_per_second}) + "\n")
        ppl_now = 2.718281828459045 ** (totals.nll_sum / totals.tokens) if totals.tokens else float("nan")
        progress.update(done["processed"] + totals.processed, stats.tokens_per_second, ppl_now, stats.cache_tokens)

    try:
        with progress.running():
            totals, rows, peak = evaluate(loaded, documents, engine, max_tokens=max_tokens, stream=stream,
                                          context=context, stride=stride, on_block=on_block)
    finally:
        if jsonl_file:
            jsonl_file.close()
    protocol = "sliding" if context is not None else ("stream" if stream else "documents")
    run = PerplexityRun(loaded, method, method_obj.settings(), budget, block, protocol, totals, rows, peak)
    result = run.as_dict()
    if json_out:
        from kvcli.report import dumps

        print_result(dumps(result))
    else:
        print_result(summary_text(result))
    if totals.interrupted:
        raise typer.Exit(130)


def summary_text(result: dict) -> str:
    from kvcli.report import mib

    lines = []
    if result.get("interrupted"):
        lines.append("interrupted: results so far")
    lines.append(f"perplexity {result['ppl']:.3f}  (nll {result['nll']:.4f} nats/token, "
                 f"{result['bits_per_byte']:.4f} bits/byte) over {result['tokens']:,} tokens")
    cache = "unbounded" if result["cache"] is None else f"{result['cache']:,} tokens/layer"
    lines.append(f"{result['model']} · {result['method']} · cache {cache} · block {result['block']} · "
                 f"{result['protocol']}")
    lines.append(f"KV cache {mib(result['kv_cache_bytes'])} (uncompressed: {mib(result['full_kv_cache_bytes'])})"
                 f" · peak memory {mib(result['peak_memory_bytes'])}")
    lines.append(f"{result['seconds']:.1f} s · {result['tokens_per_second']:,.0f} tokens/s on "
                 f"{result['device']} ({result['dtype']})")
    for row in result.get("documents", []):
        lines.append(f"  {row['name']}: ppl {row['ppl']:.3f} over {row['tokens']:,} tokens")
    return "\n".join(lines)


@app.command()
def methods(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {name, description, "
                                                   "params}.")] = False) -> None:
    """List the compression methods and their parameters (set them with -o KEY=VALUE)."""
    from kvcli.methods import METHODS
    from kvcli.report import dumps, print_result

    rows = [{"name": name, "description": cls.description, "params": cls.params()}
            for name, cls in sorted(METHODS.items())]
    if json_out:
        print_result(dumps(rows))
        return
    lines = []
    for row in rows:
        lines.append(f"{row['name']:<14} {row['description']}")
        for p in row["params"]:
            lines.append(f"{'':<16}-o {p['name']}={p['default']}  {p['help']}")
    print_result("\n".join(lines))


def _register_commands() -> None:
    from kvcli.commands import load_all

    load_all()


_register_commands()


def main() -> None:
    """Console entry point: turn user errors into one line on stderr instead of a traceback."""
    try:
        app()
    except UsageError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KvcliError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("kvcli: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
