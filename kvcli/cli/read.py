"""``kvcli read`` and ``kvcli ask`` with several questions or a saved read: read a book once, ask it many things.

:mod:`kvcli.reading.saved` reads without a question and answers from the result; this module checks the options,
loads the model a saved read names (checked against its fingerprint), and prints the answers: the text on stdout
(each after ``Q:`` when there are several), or one JSON object with ``--json``; what each cost on stderr.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvcli.cli.options import (
    CacheOpt,
    KvBitsOpt,
    MethodOpt,
    OptionOpt,
    ReadBlockOpt,
    Setup,
    build_method,
    explicit,
    parse_kv_bits,
    parse_read_block,
    with_setup,
)
from kvcli.errors import UsageError

if TYPE_CHECKING:  # imported where used: --help loads no torch
    from kvcli.reading.saved import ReadState

#: ``ask``'s :class:`kvcli.cli.reading.ReadOptions` (not imported: that module imports this one).
ReadOptions = Any

SUFFIX = ".kvc"  # kvcli.reading.saved.SUFFIX, without importing torch for --help
#: Options of ``ask`` that a saved read fixes (it was made with them), and those that, when on, need the question
#: while reading (a saved read and several questions read without it).
FIXED_BY_READ = ("method", "cache", "block", "option", "kv_bits", "preset")
NEEDS_QUESTION = ("one_shot", "probe", "recap")


@with_setup
def read(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files (read as one text), or - for "
                                          "stdin.")],
    out: Annotated[Path, typer.Option("--out", help=f"The saved read: a file ending in {SUFFIX}, replaced whole.")],
    method: MethodOpt = "treekv",
    cache: CacheOpt = 1024,
    block: ReadBlockOpt = "auto",
    option: OptionOpt = None,
    kv_bits: KvBitsOpt = "16",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout: the file, its size, "
                                           "the tokens read and the time.")] = False,
    *,
    setup: Setup,
) -> None:
    """Read SOURCE once into a fixed-size compressed cache and save it, to ask it questions later.

    `kvcli ask FILE.kvc QUESTION...` then answers without reading the book again. The read knows no question, so
    nothing steers what the cache keeps; the file also keeps every token's keys (8 bits, the middle layers), from
    which each question first recalls the pages it points at (--recall; with --recall 0 an answer equals `kvcli ask
    SOURCE QUESTION --no-probe --no-one-shot` with the same options). The file holds the model's fingerprint:
    another model is refused.
    """
    made = build_method(method, option, cache)
    block_size, bits = parse_read_block(block), parse_kv_bits(kv_bits)
    check_out(out, source, setup)
    state, loaded, engine = read_source(source, setup, made, cache, block_size, bits, out)
    size = state.save(out)
    report_read(state, out, size, loaded, engine, setup, json_out)


def check_out(out: Path, source: str, setup: Setup) -> None:
    """``--out``/``--save``: a file ending in :data:`SUFFIX`, apart from every input, in a writable folder."""
    from kvcli.io.outputs import check_output

    if not out.name.endswith(SUFFIX) or out.name == SUFFIX:
        raise UsageError(f"the saved read {out} must be a file name ending in {SUFFIX} (kvcli ask knows it by that)")
    setup.check_outputs({"--out": out}, source)
    check_output(out, "--out")


def read_source(source: str, setup: Setup, method, cache: int, block: int, kv_bits: int, out: Path | None = None):
    """SOURCE read without a question by an engine of ``method`` (budget ``cache``, ``block``, ``kv_bits``): the
    :class:`ReadState`, the model and the engine. Progress on stderr while it reads. ``out``: the file the read
    will be saved to, beside which its recall index is spilled while reading (None: the system's temporary
    folder)."""
    from kvcli.io.report import ReadProgress
    from kvcli.reading.reader import Reader, document_tokens
    from kvcli.reading.saved import read_identity, read_once

    documents = setup.documents(source)
    loaded = setup.load()
    engine = setup.build_engine(loaded, method, cache, block, kv_bits=kv_bits)
    reader = Reader(engine, loaded.tokenizer)
    with ReadProgress(enabled=not setup.quiet) as progress:
        reader.on_progress = progress.update
        state = read_once(reader, document_tokens(documents, loaded.tokenizer), read_identity(loaded, engine),
                          None if out is None else out.parent)
    return state, loaded, engine


def report_read(state: ReadState, out: Path, size: int, loaded, engine, setup: Setup, json_out: bool) -> None:
    """What ``kvcli read`` made: one JSON object on stdout with ``--json``, else a line on stderr."""
    from kvcli.io.report import dumps, mib, peak_memory_bytes, print_result

    tokens = state.document_tokens
    index = state.recall_bytes()
    peak = peak_memory_bytes(loaded.device)
    if json_out:
        print_result(dumps({"out": str(out), "file_bytes": size, "recall_index_bytes": index, "document_tokens": tokens,
                            "peak_memory_bytes": peak,
                            "pending_tokens": len(state.pending), "max_cache_tokens": state.max_cache_tokens,
                            "read_seconds": state.read_seconds, "model": loaded.name, "method": engine.method.name,
                            "params": engine.method.settings(), "cache": engine.budget, "block": engine.block,
                            "kv_bits": engine.kv_bits}))
        return
    setup.note(f"read {tokens:,} tokens in {state.read_seconds:.1f} s into {out} ({mib(size)}, "
               f"{size / tokens:,.0f} bytes per token read, {mib(index)} of them the recall index) · {loaded.name} · "
               f"{engine.method.name} · cache "
               f"{'unbounded' if engine.budget is None else f'{engine.budget:,} tokens/layer'} · "
               f"block {engine.block} · peak memory {mib(peak)}")


def ask_many(ctx: typer.Context, source: str, questions: list[str], setup: Setup, read: ReadOptions,
             frame: bool, save: Path | None, recall: int | None = None) -> None:
    """``kvcli ask`` from a saved read, or with several questions or ``--save``: one read without a question (or
    the saved one), then every question answered from it."""
    from kvcli.reading.saved import is_saved_read

    saved = is_saved_read(source)
    for name in FIXED_BY_READ if saved else ():
        if explicit(ctx, name):
            raise UsageError(f"--{name.replace('_', '-')}: {source} was read with its own method, budget, block and "
                             "--kv-bits; ask it without this option (or read the book again)")
    for name in NEEDS_QUESTION:
        if explicit(ctx, name) and getattr(read, name):  # --no-probe, --no-one-shot, --recap 0 say what is done
            raise UsageError(f"--{name.replace('_', '-')} needs the question while reading; a saved read or several "
                             "questions share one read made without it")
    if saved and save is not None:
        raise UsageError(f"--save: {source} is a saved read already")
    if save is not None:
        check_out(save, source, setup)
    checked = read.validate()
    if saved:
        state, loaded, engine = open_saved(ctx, Path(source), setup)
    else:
        state, loaded, engine = read_source(source, setup, checked.method, read.cache, checked.block, checked.kv_bits,
                                            save)
        if save is not None:
            report_read(state, save, state.save(save), loaded, engine, setup, False)
    answer_all(state, questions, loaded, engine, setup, read, checked.repetition, frame, recall)


def open_saved(ctx: typer.Context, path: Path, setup: Setup):
    """The saved read at ``path``, its model (the one it names, unless ``--model`` or ``--dtype`` say otherwise;
    refused unless its files are the read's) and an engine with the read's method, budget, block and bits."""
    from kvcli.methods import make_method
    from kvcli.models.fingerprint import fingerprint
    from kvcli.reading.saved import ReadState

    state = ReadState.load(path)
    ident = state.identity
    replace = {}
    if not explicit(ctx, "model") and isinstance(ident.get("name"), str):
        replace["model"] = ident["name"]
    if not explicit(ctx, "dtype") and isinstance(ident.get("dtype"), str):
        replace["dtype"] = ident["dtype"].removeprefix("torch.")
    setup = dataclasses.replace(setup, **replace)
    loaded = setup.load()
    state.check({"model": fingerprint(loaded.name), "dtype": str(loaded.dtype)}, path)
    try:
        method = make_method(ident["method"], ident["params"])
        engine = setup.build_engine(loaded, method, ident["budget"], ident["block"], kv_bits=ident["kv_bits"],
                                    kv_keys=ident["kv_keys"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path} is a damaged saved read (its settings: {type(exc).__name__}): read the book again"
                         ) from None
    return state, loaded, engine


def answer_all(state: ReadState, questions: list[str], loaded, engine, setup: Setup, read: ReadOptions,
               repetition, frame: bool, recall: int | None = None) -> None:
    """Every question answered from ``state``, in order: the text streamed on stdout (after ``Q: question`` when
    there are several), or one JSON object at the end with ``--json``; each answer's cost on stderr."""
    from kvcli.io.report import StdoutStream, dumps, peak_memory_bytes, print_result, reset_peak_memory
    from kvcli.reading.prompts import stop_token_ids
    from kvcli.reading.reader import Reader
    from kvcli.reading.saved import answer, prompt_parts

    tokenizer = loaded.tokenizer
    # The prompt's format (chat template or a base model's cue), and so its stop strings, is every question's.
    form = prompt_parts(tokenizer, questions[0], read.answer_prefix, frame)
    reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model, read.stop),
                    stop=[*read.stop, *form.stop], temperature=read.temperature, seed=read.seed, repetition=repetition)
    rows = []
    for question in questions:
        parts = prompt_parts(tokenizer, question, read.answer_prefix, frame)
        out = None if read.json_out else StdoutStream()
        if out is not None:
            out.write((f"Q: {question}\nA: " if len(questions) > 1 else "") + read.answer_prefix)
        reset_peak_memory(loaded.device)
        gen = answer(reader, state, parts, read.max_new_tokens, on_text=out.write if out else None, recall=recall)
        peak = peak_memory_bytes(loaded.device)
        if out is not None:
            out.end()
            if len(questions) > 1:
                out.write("\n")
        rows.append({"question": question, "answer": (read.answer_prefix + gen.text).strip(),
                     "prompt_tokens": gen.prompt_tokens, "generated_tokens": gen.generated_tokens,
                     "seconds": gen.seconds, "finish_reason": gen.finish_reason, "recall_tokens": gen.recap_tokens,
                     "peak_memory_bytes": peak})
        setup.note(answer_summary(gen, state, loaded, engine, peak))
        if gen.finish_reason == "interrupted":
            break
    if read.json_out:
        print_result(dumps({"answers": rows, "document_tokens": state.document_tokens,
                            "read_seconds": state.read_seconds, "model": loaded.name, "method": engine.method.name,
                            "params": engine.method.settings(), "cache": engine.budget, "block": engine.block,
                            "kv_bits": engine.kv_bits}))
    if rows and rows[-1]["finish_reason"] == "interrupted":
        raise typer.Exit(130)


def answer_summary(gen, state: ReadState, loaded, engine, peak: int) -> str:
    """What one answer from a read cost, for stderr: the last block and the question, then the writing."""
    from kvcli.io.report import mib

    cache = "unbounded" if engine.budget is None else f"{engine.budget:,} tokens/layer"
    last = gen.prompt_tokens - state.read_tokens
    return (f"answered from a read of {state.document_tokens:,} tokens (read once in {state.read_seconds:.1f} s): "
            f"its last {last:,} prompt tokens in {gen.read_seconds:.1f} s · generated {gen.generated_tokens:,} "
            f"tokens in {gen.write_seconds:.1f} s ({gen.finish_reason})\n{loaded.name} · {engine.method.name} · "
            f"cache {cache} · max cache {gen.max_cache_tokens:,} tokens · KV cache {mib(gen.kv_cache_bytes)} · peak "
            f"memory {mib(peak)}")


def collect_questions(given: list[str], path: Path | None) -> list[str]:
    """The questions of ``ask``: those given, then those of ``--questions`` (a line each); at least one, none empty."""
    questions = list(given)
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--questions {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
        questions += [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise UsageError("no question: give QUESTION after SOURCE (or --questions FILE)")
    if any(not question.strip() for question in questions):
        raise UsageError("the question is empty")
    return questions
