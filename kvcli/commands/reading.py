"""``kvcli summarize``, ``kvcli ask``, ``kvcli needle`` and ``kvcli presets``: reading whole books.

The commands are thin: :mod:`kvcli.generate` reads and writes, :mod:`kvcli.needle` runs the pass-key
grid, :mod:`kvcli.presets` finds presets. Generated text streams to stdout as it is produced;
progress and statistics go to stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from kvcli.cli import (
    BlockOpt,
    CacheOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    EightBitOpt,
    EncodingOpt,
    FourBitOpt,
    MethodOpt,
    ModelOpt,
    OptionOpt,
    QuietOpt,
    app,
    build_method,
    load,
    method_options,
    parse_options,
    split_list,
)
from kvcli.errors import UsageError

SourceArg = Annotated[str, typer.Argument(help="A text file, a folder of .txt files (read as one text), or - for "
                                          "stdin.")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Stop after generating this many tokens.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy; above 0, sample from the "
                                               "softmax at this temperature.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the sampler (--temperature > 0).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout instead of "
                                       "streaming the text.")]
PresetOpt = Annotated[list[str] | None, typer.Option("--preset", "-p", help="Preset NAME or PATH.toml filling "
                                                     "defaults (repeatable: a model and a method preset); explicit "
                                                     "options win. See `kvcli presets`.")]
OneShotOpt = Annotated[bool | None, typer.Option("--one-shot/--no-one-shot", help="Prefill the whole prompt in one "
                                                 "forward pass (the question is the observation window) or stream "
                                                 "it in blocks. Default: one shot when it fits the model's context.",
                                                 show_default=False)]
ProbeOpt = Annotated[bool, typer.Option("--probe/--no-probe", help="Query-aware compression while streaming: "
                                        "the instruction's queries score the cache after every block.")]
StopOpt = Annotated[list[str] | None, typer.Option("--stop", help="Extra stop string (repeatable).")]
AnswerPrefixOpt = Annotated[str, typer.Option("--answer-prefix", help="Start the answer with this text (e.g. "
                                              "'The answer is'); the model continues it.")]

# Options a preset may fill: preset key -> the command's parameter name.
PRESET_PARAMS = {"model": "model", "dtype": "dtype", "device": "device", "method": "method", "cache": "cache",
                 "block": "block"}


def _explicit(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option ``name`` (command line or environment) rather than leaving its default.

    Compared by name: recent Typer versions bring their own copy of click's ``ParameterSource``.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and getattr(source, "name", "") not in ("DEFAULT", "DEFAULT_MAP")


def apply_presets(ctx: typer.Context, specs: list[str] | None, values: dict) -> dict:
    """Fill ``values`` (the command's parameters) from presets where the user gave no explicit option.

    Returns the values with ``options`` (a dict: preset options updated by ``-o``) and ``stop``.
    """
    from kvcli.presets import merge

    merged = merge(specs)
    out = dict(values)
    for key, param in PRESET_PARAMS.items():
        if key in merged and param in out and not _explicit(ctx, param):
            out[param] = merged[key]
    out["options"] = {**merged.get("options", {}), **parse_options(values.get("option"))}
    out["stop"] = list(dict.fromkeys([*merged.get("stop", []), *(values.get("stop") or [])]))
    return out


class StdoutStream:
    """Writes generated text to stdout piece by piece; a reader that went away ends the program quietly."""

    def __init__(self):
        self.wrote = ""

    def write(self, text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            _closed_stdout()
        self.wrote += text

    def end(self) -> None:
        if not self.wrote.endswith("\n"):
            self.write("\n")


def _closed_stdout() -> None:
    """stdout's reader is gone (``| head``): point stdout at /dev/null so that the flush at exit is
    silent, and exit 0."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    raise SystemExit(0)


class ReadProgress:
    """A transient line on stderr while the document is read (only when stderr is a terminal)."""

    def __init__(self, enabled: bool):
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from kvcli.report import stderr_console

        self.enabled = enabled and sys.stderr.isatty()
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=stderr_console, transient=True, disable=not self.enabled)
        self.task = self.progress.add_task("reading")

    def update(self, read: int, cache_tokens: int, seconds: float) -> None:
        if self.enabled:
            rate = read / seconds if seconds > 0 else 0.0
            self.progress.update(self.task, description=f"reading {read:,} tokens  {rate:,.0f} tok/s  "
                                                        f"cache {cache_tokens:,}")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


def read_and_write(ctx: typer.Context, *, command: str, source: str, instruction, values: dict) -> None:
    """The shared body of ``summarize`` and ``ask``."""
    from kvcli.engine import Engine
    from kvcli.generate import Reader, build_prompt, document_tokens, stop_token_ids
    from kvcli.report import dumps, mib, peak_memory_bytes, print_result, reset_peak_memory, stderr_console, warn
    from kvcli.text import open_source

    v = apply_presets(ctx, values.get("preset"), values)
    if v["block"] < 1:
        raise UsageError(f"--block must be at least 1, not {v['block']}")
    if v["max_new_tokens"] < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, not {v['max_new_tokens']}")
    if v["temperature"] < 0:
        raise UsageError(f"--temperature must not be negative, not {v['temperature']}")
    method_obj = build_method(v["method"], v["options"], v["cache"])
    quiet = v["quiet"]
    say = (lambda message: None) if quiet else warn
    documents = open_source(source, encoding=v["encoding"], warn=say)
    loaded = load(v["model"], v["device"], v["dtype"], v["device_map"], v["load_in_4bit"], v["load_in_8bit"])
    tokenizer = loaded.tokenizer
    budget = None if v["method"] == "full" else v["cache"]
    engine = Engine(loaded.model, method_obj, budget, block=v["block"], warn=say)
    parts = build_prompt(tokenizer, instruction)
    reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model, v["stop"]), stop=v["stop"],
                    temperature=v["temperature"], seed=v["seed"])
    out = None if v["json_out"] else StdoutStream()
    reset_peak_memory(loaded.device)
    progress = ReadProgress(enabled=not quiet)
    reader.on_progress = progress.update

    primer = instruction.answer_prefix

    def after_reading(gen) -> None:
        progress.__exit__()
        if out is not None and primer:
            out.write(primer)

    with progress:
        gen = reader.run(parts, document_tokens(documents, tokenizer), v["max_new_tokens"], one_shot=v["one_shot"],
                         probe=v["probe"], on_text=out.write if out else None, on_read=after_reading)
    peak = peak_memory_bytes(loaded.device)
    key = "summary" if command == "summarize" else "answer"
    if out is not None:
        out.end()
    else:
        print_result(dumps({
            key: (primer + gen.text).strip(),
            "prompt_tokens": gen.prompt_tokens,
            "document_tokens": gen.document_tokens,
            "generated_tokens": gen.generated_tokens,
            "max_cache_tokens": gen.max_cache_tokens,
            "kv_cache_bytes": gen.kv_cache_bytes,
            "peak_memory_bytes": peak,
            "seconds": gen.seconds,
            "read_seconds": gen.read_seconds,
            "write_seconds": gen.write_seconds,
            "model": loaded.name,
            "method": v["method"],
            "params": method_obj.settings(),
            "cache": budget,
            "block": v["block"],
            "one_shot": gen.one_shot,
            "chat_template": parts.chat,
            "finish_reason": gen.finish_reason,
        }))
    if not quiet:
        mode = "one shot" if gen.one_shot else f"streamed in blocks of {v['block']}"
        cache_text = "unbounded" if budget is None else f"{budget:,} tokens/layer"
        stderr_console.print(
            f"read {gen.prompt_tokens:,} prompt tokens ({mode}) in {gen.read_seconds:.1f} s · generated "
            f"{gen.generated_tokens:,} tokens in {gen.write_seconds:.1f} s ({gen.finish_reason})\n"
            f"{loaded.name} · {v['method']} · cache {cache_text} · max cache {gen.max_cache_tokens:,} tokens · "
            f"KV cache {mib(gen.kv_cache_bytes)} · peak memory {mib(peak)}", markup=False, highlight=False)
    if gen.finish_reason == "interrupted":
        raise typer.Exit(130)


@app.command()
def summarize(
    ctx: typer.Context,
    source: SourceArg,
    model: ModelOpt = "smollm2-135m",
    method: MethodOpt = "treekv",
    cache: CacheOpt = 1024,
    block: BlockOpt = 256,
    option: OptionOpt = None,
    max_new_tokens: MaxNewOpt = 256,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Your own instruction, placed after the "
                                               "document.")] = None,
    template: Annotated[str | None, typer.Option("--template", help="A named instruction: summary (default), "
                                                 "tldr or keypoints.")] = None,
    answer_prefix: AnswerPrefixOpt = "",
    temperature: TemperatureOpt = 0.0,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
    preset: PresetOpt = None,
    one_shot: OneShotOpt = None,
    probe: ProbeOpt = True,
    stop: StopOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    encoding: EncodingOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Read SOURCE (any length) through a fixed-size KV cache, then write a summary of it to stdout."""
    import dataclasses

    from kvcli.generate import TEMPLATES, custom_instruction

    if prompt is not None and template is not None:
        raise UsageError("--prompt and --template are alternatives: give one")
    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt is empty")
        instruction = custom_instruction(prompt, answer_prefix)
    else:
        name = template or "summary"
        if name not in TEMPLATES:
            raise UsageError(f"unknown --template {name!r}; choose one of: {', '.join(TEMPLATES)}")
        instruction = dataclasses.replace(TEMPLATES[name], answer_prefix=answer_prefix)
    read_and_write(ctx, command="summarize", source=source, instruction=instruction, values=locals())


@app.command()
def ask(
    ctx: typer.Context,
    source: SourceArg,
    question: Annotated[str, typer.Argument(help="The question, answered from the document.")],
    model: ModelOpt = "smollm2-135m",
    method: MethodOpt = "treekv",
    cache: CacheOpt = 1024,
    block: BlockOpt = 256,
    option: OptionOpt = None,
    max_new_tokens: MaxNewOpt = 128,
    answer_prefix: AnswerPrefixOpt = "",
    temperature: TemperatureOpt = 0.0,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
    preset: PresetOpt = None,
    one_shot: OneShotOpt = None,
    probe: ProbeOpt = True,
    stop: StopOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    encoding: EncodingOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Answer QUESTION about SOURCE; the question steers which tokens the compressed cache keeps."""
    from kvcli.generate import question_instruction

    if not question.strip():
        raise UsageError("the question is empty")
    read_and_write(ctx, command="ask", source=source, instruction=question_instruction(question, answer_prefix),
                   values=locals())


def _depth(item: str) -> float:
    value = float(item.rstrip("%")) / (100 if item.endswith("%") else 1)
    return value


def _length(item: str) -> int:
    item = item.lower()
    return int(float(item[:-1]) * 1000) if item.endswith("k") else int(item)


@app.command()
def needle(
    source: Annotated[str, typer.Argument(help="A book (text file, folder or -) to cut the haystacks from.")],
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods to compare.")] = "full,snapkv",
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated haystack lengths in tokens "
                                         "(6000 or 6k).")] = "6000",
    depths: Annotated[str, typer.Option("--depths", help="Comma-separated depths of the needle (0.1 or "
                                        "10%).")] = "0.1,0.3,0.5,0.7,0.9",
    trials: Annotated[int, typer.Option("--trials", help="Haystacks per length and depth (each with its own "
                                        "excerpt and key).")] = 1,
    cache: CacheOpt = 1024,
    block: BlockOpt = 256,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Method parameter KEY=VALUE for every "
                                                     "listed method that has it, or METHOD.KEY=VALUE for one "
                                                     "(repeatable).")] = None,
    seed: SeedOpt = 0,
    max_new_tokens: MaxNewOpt = 12,
    one_shot: OneShotOpt = None,
    probe: ProbeOpt = True,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object: every trial and the accuracy "
                                           "tables.")] = False,
    model: ModelOpt = "smollm2-135m",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    encoding: EncodingOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Pass-key retrieval as a grid: methods x lengths x depths, accuracy on stdout."""
    from kvcli.methods import METHODS
    from kvcli.needle import book_tokens, run_grid
    from kvcli.report import dumps, print_result, warn
    from kvcli.text import open_source

    method_list = split_list(methods, str, "--methods")
    for name in method_list:
        if name not in METHODS:
            raise UsageError(f"unknown method {name!r}; choose from: {', '.join(sorted(METHODS))}")
    length_list = split_list(lengths, _length, "--lengths")
    depth_list = split_list(depths, _depth, "--depths")
    if trials < 1:
        raise UsageError("--trials must be at least 1")
    if block < 1 or max_new_tokens < 1:
        raise UsageError("--block and --max-new-tokens must be at least 1")
    if cache < 1:
        raise UsageError(f"--cache must be a positive number of tokens, not {cache}")
    per_method = method_options(method_list, option)
    say = (lambda message: None) if quiet else warn
    documents = open_source(source, encoding=encoding, warn=say)
    loaded = load(model, device, dtype, device_map, load_in_4bit, load_in_8bit)
    tokens = book_tokens(documents, loaded.tokenizer, max(length_list) * trials)
    show = not quiet

    def on_trial(trial, done, total) -> None:
        if show:
            from kvcli.report import stderr_console

            mark = "ok" if trial.correct else "miss"
            stderr_console.print(f"[{done}/{total}] {trial.method} length {trial.length:,} depth {trial.depth:.0%}: "
                                 f"{trial.answer!r} ({mark}, key {trial.key}, {trial.seconds:.1f} s)",
                                 markup=False, highlight=False)

    result = run_grid(loaded.model, loaded.tokenizer, tokens, method_list, lengths=length_list, depths=depth_list,
                      trials=trials, cache=cache, block=block, seed=seed, max_new_tokens=max_new_tokens,
                      one_shot=one_shot, probe=probe, options=per_method, warn=say, on_trial=on_trial)
    if json_out:
        print_result(dumps({"model": loaded.name, **result.as_dict()}))
    else:
        print_result(needle_tables(result, loaded.name))


def needle_tables(result, model_name: str) -> str:
    """The grid as two Rich tables rendered to text: accuracy per method x length, then per depth."""
    import io

    from rich.console import Console
    from rich.table import Table

    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False, color_system=None, highlight=False)
    settings = result.settings
    rows = result.accuracy()
    lengths = list(dict.fromkeys(r["length"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["length"]): r for r in rows}
    table = Table(title="pass-key accuracy", caption=f"{model_name} · cache {settings['cache']:,} · block "
                                                        f"{settings['block']} · seed {settings['seed']}")
    table.add_column("method")
    for length in lengths:
        table.add_column(f"{length:,} tokens", justify="right")
    for name in methods:
        table.add_row(name, *(_fmt(cell.get((name, length))) for length in lengths))
    console.print(table)
    deep = result.accuracy(by_depth=True)
    depths = list(dict.fromkeys(r["depth"] for r in deep))
    cell = {(r["method"], r["length"], r["depth"]): r for r in deep}
    table = Table(title="by depth of the needle")
    table.add_column("method")
    table.add_column("length", justify="right")
    for depth in depths:
        table.add_column(f"{depth:.0%}", justify="right")
    for name in methods:
        for length in lengths:
            table.add_row(name, f"{length:,}", *(_fmt(cell.get((name, length, d))) for d in depths))
    console.print(table)
    return buffer.getvalue()


def _fmt(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['accuracy']:.0%} ({row['correct']}/{row['trials']})"


@app.command()
def presets(json_out: Annotated[bool, typer.Option("--json", help="A JSON list of {name, kind, source, path, "
                                                   "settings}.")] = False) -> None:
    """List the presets (built-in and in the user folder) that --preset NAME accepts."""
    from kvcli.presets import list_presets, user_dir
    from kvcli.report import dumps, print_result

    found = list_presets()
    if json_out:
        print_result(dumps([p.as_dict() for p in found]))
        return
    lines = []
    for kind in ("model", "method", "mixed"):
        group = [p for p in found if p.kind == kind]
        if not group:
            continue
        lines.append(f"{kind} presets:")
        for p in group:
            settings = ", ".join(f"{k}={_short(v)}" for k, v in p.settings.items() if k not in ("description", "kind"))
            lines.append(f"  {p.name:<24} {settings}")
            lines.append(f"  {'':<24} {p.source}: {p.path}")
    lines.append(f"user presets folder: {user_dir()}")
    print_result("\n".join(lines))


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)
