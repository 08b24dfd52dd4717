"""``kvcli summarize`` and ``kvcli ask``: read a whole document into a fixed-size cache, then write.

:mod:`kvcli.reading.reader` reads and writes; this module parses the options, applies presets, and sends
the generated text to stdout as it is produced (statistics to stderr).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvcli.cli.options import (
    CacheOpt,
    KvBitsOpt,
    MethodOpt,
    OptionOpt,
    ReadBlockOpt,
    ResumeOpt,
    RowsOpt,
    Setup,
    build_method,
    check_at_least,
    check_seed,
    explicit,
    join_ranks,
    keyword,
    options_bundle,
    parse_kv_bits,
    parse_options,
    parse_read_block,
    with_setup,
)
from kvcli.errors import UsageError
from kvcli.reading.prompts import ANSWER_REPETITION, SUMMARY_REPETITION, Instruction, Repetition
from kvcli.reading.recap import RECALL_TOKENS, RECAP_TOKENS
from kvcli.reading.sections import SECTION_TOKENS

if TYPE_CHECKING:  # the command's module is imported by --help: torch is imported where it is used
    from kvcli.engine.engine import Engine
    from kvcli.methods import Method
    from kvcli.models.load import LoadedModel
    from kvcli.reading.generate import Generation

SourceArg = Annotated[str, typer.Argument(help="A text file, a folder of .txt files (read as one text; one by "
                                          "one with --each), or - for stdin.")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Stop after generating this many tokens.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy; from 0.0001 up, sample "
                                               "from the softmax at this temperature.")]
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
EachOpt = Annotated[bool, typer.Option("--each", help="One result per document of a folder, each read with a "
                                       "fresh cache: one JSON line per document on stdout, or to --rows FILE.")]
RecapOpt = Annotated[int, typer.Option("--recap", help="A document read with a question (ask) and compressed: "
                                       "re-read at most this many of its tokens (and at most half the cache) that "
                                       "the question pointed at, passage by passage, before the question (beyond "
                                       "the papers; see docs/reading.md). 0 = off, and a prompt that fits is then "
                                       "read in one plain forward; no effect on methods that score nothing.")]
NoFrameOpt = Annotated[bool, typer.Option("--no-frame", help="Ask the question as written, without ask's frame "
                                         "(\"Read the text above carefully, then answer in one short sentence.\") "
                                         "before it: for questions that want more than one sentence. Base models "
                                         "get their Question/Answer cue either way.")]
AnswerPrefixOpt = Annotated[str, typer.Option("--answer-prefix", help="Start the answer with this text (e.g. "
                                              "'The answer is'); the model continues it.")]
NoRepeatOpt = Annotated[int, typer.Option("--no-repeat-ngram", help="Never write the same run of this many tokens "
                                          "twice in one answer (the prompt does not count), so no sentence loops. "
                                          "0 = off.")]
PenaltyOpt = Annotated[float, typer.Option("--repetition-penalty", help="Divide the logits of tokens the answer "
                                           "already holds by this (multiply where negative). 1 = off.")]
SectionOpt = Annotated[int, typer.Option("--section", help="A document longer than this many tokens is summarized "
                                         "section by section as it streams, a summary per section in order, so "
                                         "the summary covers the whole text (--template, --prompt: then applied "
                                         "to those summaries). 0 = one pass over the whole document.")]


def check_repetition(no_repeat_ngram: int, penalty: float) -> Repetition:
    """``--no-repeat-ngram`` (0 or more) and ``--repetition-penalty`` (above 0) as one :class:`Repetition`."""
    check_at_least(0, no_repeat_ngram=no_repeat_ngram)
    if not penalty > 0:
        raise UsageError(f"--repetition-penalty must be above 0 (1 = off), not {penalty}")
    return Repetition(no_repeat_ngram, penalty)


#: The lowest temperature sampled at: below it ``logits / temperature`` overflows float32 into inf and NaN, and
#: long before that the draw is the greedy choice anyway.
MIN_TEMPERATURE = 1e-4


def check_temperature(temperature: float) -> None:
    """``--temperature``: 0 (greedy) or a finite number from :data:`MIN_TEMPERATURE` up."""
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise UsageError(f"--temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE}, "
                         f"not {temperature}")


def check_recall(tokens: int | None) -> None:
    """``--recall`` is 0 (off) or a number of tokens (None: the default)."""
    if tokens is not None and tokens < 0:
        raise UsageError(f"--recall must be 0 (off) or a number of tokens, not {tokens}")


def check_recap(tokens: int) -> None:
    """``--recap`` is 0 (off) or room for at least one passage (a peak and its neighbours)."""
    from kvcli.reading.recap import passage_width

    if tokens != 0 and tokens < passage_width():
        raise UsageError(f"--recap must be 0 (off) or at least {passage_width()} (one passage), not {tokens}")


@dataclass(frozen=True)
class CheckedRead:
    """The options of :class:`ReadOptions` that need parsing, parsed: what the reader is built from."""

    block: int
    kv_bits: int
    repetition: Repetition
    method: Method


@dataclass(frozen=True)
class ReadOptions:
    """How ``summarize`` and ``ask`` read and write: the options a method preset may fill, and the rest."""

    method: str
    cache: int
    block: str | int
    options: dict
    max_new_tokens: int
    answer_prefix: str
    temperature: float
    seed: int
    json_out: bool
    presets: list[str]
    one_shot: bool | None
    probe: bool
    stop: list[str]
    each: bool = False
    rows: Path | None = None
    resume: bool = False
    kv_bits: str | int = 16
    recap: int = 0
    no_repeat_ngram: int = 0
    repetition_penalty: float = 1.0

    def validate(self, section: int = 0) -> CheckedRead:
        """Every option (and summarize's ``--section``) checked and parsed, reading no file and loading no model,
        so that a mistake costs no wait; the first one wrong is a :class:`UsageError`."""
        check_at_least(1, max_new_tokens=self.max_new_tokens)
        check_recap(self.recap)
        check_at_least(0, section=section)
        repetition = check_repetition(self.no_repeat_ngram, self.repetition_penalty)
        block = parse_read_block(self.block)
        bits = parse_kv_bits(self.kv_bits)
        check_temperature(self.temperature)
        check_seed(self.seed)
        method = build_method(self.method, self.options, self.cache)
        if not self.each and (self.rows is not None or self.resume):
            raise UsageError(f"{'--rows' if self.rows is not None else '--resume'} goes with --each (one row per "
                             "document)")
        if self.resume and self.rows is None:
            raise UsageError("--resume needs --rows FILE (the rows already written are skipped)")
        if self.each and self.json_out:
            raise UsageError("--each already prints one JSON object per document: drop --json")
        return CheckedRead(block, bits, repetition, method)


@dataclass(frozen=True)
class Task:
    """What a run writes about a document: ``command`` (summarize or ask) with its ``instruction``, what the user
    asked (``about``: the question, the prompt or the template, recorded in every row of ``--rows``), and
    summarize's ``section`` length and whether the sections' summaries are then ``combine``d by one more pass."""

    command: str
    instruction: Instruction
    about: dict
    section: int = 0
    combine: bool = False


def with_reading(max_new_tokens: int, repetition: Repetition, recap: int = 0):
    """The options ``summarize`` and ``ask`` share, handed to the command as one :class:`ReadOptions` (``read``);
    the arguments are the command's defaults."""

    def build(method, cache, block, option, max_new_tokens, answer_prefix, temperature, seed, json_out, preset,
              one_shot, probe, stop, each, rows, resume, kv_bits, recap, no_repeat_ngram,
              repetition_penalty) -> ReadOptions:
        return ReadOptions(method, cache, block, parse_options(option), max_new_tokens, answer_prefix, temperature,
                           seed, json_out, preset or [], one_shot, probe, stop or [], each, rows, resume, kv_bits,
                           recap, no_repeat_ngram, repetition_penalty)

    return options_bundle("read", build, [
        keyword("method", MethodOpt, "treekv"), keyword("cache", CacheOpt, 1024),
        keyword("block", ReadBlockOpt, "auto"), keyword("option", OptionOpt, None),
        keyword("max_new_tokens", MaxNewOpt, max_new_tokens),
        keyword("answer_prefix", AnswerPrefixOpt, ""), keyword("temperature", TemperatureOpt, 0.0),
        keyword("seed", SeedOpt, 0), keyword("json_out", JsonOpt, False), keyword("preset", PresetOpt, None),
        keyword("one_shot", OneShotOpt, None), keyword("probe", ProbeOpt, True), keyword("stop", StopOpt, None),
        keyword("each", EachOpt, False), keyword("rows", RowsOpt, None), keyword("resume", ResumeOpt, False),
        keyword("kv_bits", KvBitsOpt, "16"), keyword("recap", RecapOpt, recap),
        keyword("no_repeat_ngram", NoRepeatOpt, repetition.no_repeat_ngram),
        keyword("repetition_penalty", PenaltyOpt, repetition.penalty),
    ])


# Preset keys and the object whose field of that name they fill when the user left it at its default.
SETUP_KEYS = ("model", "dtype", "device")
READ_KEYS = ("method", "cache", "block")


def apply_presets(ctx: typer.Context, specs: list[str] | None, setup: Setup, read: ReadOptions
                  ) -> tuple[Setup, ReadOptions]:
    """Fill what the user did not give from presets; ``-o`` options update the presets' options and
    stop strings add to theirs."""
    from kvcli.models.presets import merge

    merged = merge(specs)
    setup = dataclasses.replace(setup, **{k: merged[k] for k in SETUP_KEYS if k in merged and not explicit(ctx, k)})
    read = dataclasses.replace(read, **{k: merged[k] for k in READ_KEYS if k in merged and not explicit(ctx, k)})
    return setup, dataclasses.replace(read, options={**merged.get("options", {}), **read.options},
                                      stop=list(dict.fromkeys([*merged.get("stop", []), *read.stop])))


def write_about(reader, parts, task: Task, document, read: ReadOptions, **callbacks) -> tuple[Generation, list]:
    """Read ``document`` and write about it: in sections when the task has them (summarize,
    :mod:`kvcli.reading.sections`; their summaries then combined by one more pass or not), else in one pass. The
    :class:`kvcli.reading.generate.Generation` and the sections (none for one pass)."""
    if task.section:
        from kvcli.reading.sections import summarize_in_sections

        return summarize_in_sections(reader, task.instruction, document, read.max_new_tokens, section=task.section,
                                     combine=task.combine, one_shot=read.one_shot, probe=read.probe, **callbacks)
    callbacks.pop("on_section", None)
    return reader.run(parts, document, read.max_new_tokens, one_shot=read.one_shot, probe=read.probe,
                      **callbacks), []


def read_and_write(ctx: typer.Context, source: str, task: Task, setup: Setup, read: ReadOptions) -> None:
    """The shared body of ``summarize`` and ``ask``: presets applied, options checked, the model loaded, then
    SOURCE written about, as one text or (``--each``) document by document."""
    from kvcli.eval.checkpoint import identity
    from kvcli.reading.prompts import build_prompt, stop_token_ids
    from kvcli.reading.reader import Reader, document_tokens

    setup, read = apply_presets(ctx, read.presets, setup, read)
    checked = read.validate(task.section)
    ranks, setup = join_ranks(setup)
    if ranks.distributed and not read.each:
        raise UsageError("several ranks share the documents of a folder: add --each")
    claim_rows(ctx, source, setup, read, ranks.main)
    documents = setup.documents(source)
    loaded = setup.load()
    tokenizer = loaded.tokenizer
    engine = setup.build_engine(loaded, checked.method, read.cache, checked.block, kv_bits=checked.kv_bits)
    parts = build_prompt(tokenizer, task.instruction)
    reader = Reader(engine, tokenizer, stop_ids=stop_token_ids(tokenizer, loaded.model, read.stop),
                    stop=[*read.stop, *parts.stop],
                    temperature=read.temperature, seed=read.seed, recap=read.recap, repetition=checked.repetition)
    if read.each:
        settings = row_settings(task, read, parts, identity(loaded, engine), checked.kv_bits)
        each_document(documents, reader, parts, task, setup, read, ranks, settings)
        return
    written = write_one(reader, parts, task, document_tokens(documents, tokenizer), setup, read, loaded)
    render(written, task, read, checked, setup)
    if written.gen.finish_reason == "interrupted":
        raise typer.Exit(130)


@dataclass(frozen=True)
class Written:
    """One text read and written about (:func:`write_one`): the generation, summarize's sections, the peak memory,
    and on what (the model, the engine, whether the prompt took the chat template)."""

    gen: Generation
    sections: list
    peak: int
    loaded: LoadedModel
    engine: Engine
    chat: bool


def write_one(reader, parts, task: Task, document, setup: Setup, read: ReadOptions, loaded: LoadedModel) -> Written:
    """Read ``document`` and write about it, the text on stdout as it is produced (nothing with ``--json``: the
    object comes after), the progress and the sections a last pass combines on stderr."""
    from kvcli.io.report import ReadProgress, StdoutStream, peak_memory_bytes, reset_peak_memory

    out = None if read.json_out else StdoutStream()
    reset_peak_memory(loaded.device)
    progress = ReadProgress(enabled=not setup.quiet)
    reader.on_progress = progress.update
    primer = task.instruction.answer_prefix

    def after_reading(gen) -> None:
        progress.__exit__()
        if out is not None and primer:
            out.write(primer)

    def on_section(index: int, part) -> None:  # summaries combined by a last pass: each one shown on stderr
        setup.note(f"section {index + 1} (tokens {part.start + 1:,}-{part.start + part.tokens:,}): {part.summary}")

    with progress:
        gen, sections = write_about(reader, parts, task, document, read, on_text=out.write if out else None,
                                    on_read=after_reading, on_section=on_section if task.combine else None)
    peak = peak_memory_bytes(loaded.device)
    if out is not None:
        out.end()
    return Written(gen, sections, peak, loaded, reader.engine, parts.chat)


def render(written: Written, task: Task, read: ReadOptions, checked: CheckedRead, setup: Setup) -> None:
    """With ``--json``, the one JSON object on stdout (the text was not streamed); then, unless ``--quiet``, what
    the read cost on stderr."""
    from kvcli.cli.render import reading_summary
    from kvcli.io.report import dumps, print_result, stderr_console

    gen, engine = written.gen, written.engine
    if read.json_out:
        print_result(dumps({
            "summary" if task.command == "summarize" else "answer": (task.instruction.answer_prefix + gen.text).strip(),
            "prompt_tokens": gen.prompt_tokens,
            "document_tokens": gen.document_tokens,
            "generated_tokens": gen.generated_tokens,
            "max_cache_tokens": gen.max_cache_tokens,
            "kv_cache_bytes": gen.kv_cache_bytes,
            "kv_bits": checked.kv_bits,
            "peak_memory_bytes": written.peak,
            "seconds": gen.seconds,
            "read_seconds": gen.read_seconds,
            "write_seconds": gen.write_seconds,
            "model": written.loaded.name,
            "method": read.method,
            "params": checked.method.settings(),
            "cache": engine.budget,
            "block": engine.block,
            "one_shot": gen.one_shot,
            "recap_tokens": gen.recap_tokens,
            "chat_template": written.chat,
            "finish_reason": gen.finish_reason,
            "no_repeat_ngram": checked.repetition.no_repeat_ngram,
            "repetition_penalty": checked.repetition.penalty,
            **({"section": task.section, "sections": [part.as_dict() for part in written.sections]}
               if task.command == "summarize" else {}),
        }))
    if not setup.quiet:
        stderr_console.print(reading_summary(gen, written.loaded, read.method, engine.budget, engine.block,
                                             written.peak), markup=False, highlight=False)


def row_settings(task: Task, read: ReadOptions, parts, engine_identity: dict, kv_bits: int) -> dict:
    """What every ``--each`` row records as the settings that made it, and what ``--resume`` requires of the rows
    it takes (:mod:`kvcli.io.identity`): what was asked, the model and engine, how the answer was written."""
    instruction = task.instruction
    return {**task.about, **engine_identity, "kv_bits": kv_bits, "instruction": instruction.text,
            "cue": instruction.cue, "answer_prefix": instruction.answer_prefix, "chat_template": parts.chat,
            "max_new_tokens": read.max_new_tokens, "temperature": read.temperature, "seed": read.seed,
            "one_shot": read.one_shot, "probe": read.probe, "recap": read.recap, "stop": read.stop,
            "no_repeat_ngram": read.no_repeat_ngram, "repetition_penalty": read.repetition_penalty,
            "section": task.section, "combine": task.combine}


def claim_rows(ctx: typer.Context, source: str, setup: Setup, read: ReadOptions, main: bool) -> None:
    """Before anything is opened: ``--rows`` apart from every input (the source, the model, the presets), writable,
    and held by this run (rank 0 of several) until the command ends."""
    from kvcli.models.presets import find_preset

    setup.check_outputs({"--rows": read.rows}, source,
                        inputs=tuple(("--preset", find_preset(spec).path) for spec in read.presets))
    if read.rows is None:
        return
    from kvcli.io.outputs import check_output
    from kvcli.io.paths import hold_file

    check_output(read.rows, "--rows")
    if main:
        ctx.with_resource(hold_file(read.rows, "--rows"))


def each_document(documents: list, reader, parts, task: Task, setup: Setup, read: ReadOptions, ranks,
                  settings: dict) -> None:
    """``--each``: every document read with a fresh cache and written about; one JSON row per document, which
    records ``settings`` (what made it) in ``--rows``."""
    from kvcli.io.corpus import run_corpus
    from kvcli.io.identity import rows_identity
    from kvcli.io.report import DocumentProgress, dumps, print_result, stderr_console
    from kvcli.reading.reader import document_tokens

    tokenizer = reader.tokenizer
    primer = task.instruction.answer_prefix
    to_stdout = read.rows is None
    progress = DocumentProgress(len(documents), enabled=not setup.quiet)

    def process(index: int, doc) -> tuple[dict, bool]:
        progress.start(Path(doc.name).name)
        gen, sections = write_about(reader, parts, task, document_tokens([doc], tokenizer), read)
        progress.done()
        return {"tokens": gen.document_tokens, "text": (primer + gen.text).strip(), "prompt_tokens": gen.prompt_tokens,
                "generated_tokens": gen.generated_tokens, "finish_reason": gen.finish_reason,
                "one_shot": gen.one_shot, "max_cache_tokens": gen.max_cache_tokens,
                "kv_cache_bytes": gen.kv_cache_bytes, "kv_bits": reader.engine.kv_bits,
                "seconds": gen.seconds, **({"sections": len(sections)} if task.command == "summarize" else {})
                }, gen.finish_reason != "interrupted"

    def show(row: dict) -> None:
        print_result(dumps(row))

    try:
        with progress:
            job = run_corpus(documents, process, rows_path=read.rows, resume=read.resume, ranks=ranks,
                             on_row=show if to_stdout and not ranks.distributed else None,
                             identity=rows_identity(task.command, **settings), warn=setup.say)
    finally:
        ranks.close()
    if not ranks.main:
        return
    if to_stdout and ranks.distributed:  # rank 0 prints every rank's rows, in document order
        for row in job.rows:
            show(row)
    fresh = [row for row, new in zip(job.rows, job.new, strict=True) if new]
    tokens = sum(row.get("prompt_tokens", 0) + row.get("generated_tokens", 0) for row in fresh)
    if not setup.quiet:
        seconds = max(job.seconds, 1e-9)
        stderr_console.print(f"{task.command}: {len(fresh):,} documents ({job.resumed:,} resumed) on "
                             f"{ranks.world_size} rank{'s' if ranks.distributed else ''} in {job.seconds:.1f} s · "
                             f"{len(fresh) / seconds:.3f} documents/s · {tokens / seconds:,.0f} tokens/s",
                             markup=False, highlight=False)
    if job.interrupted:
        raise typer.Exit(130)


@with_reading(max_new_tokens=256, repetition=SUMMARY_REPETITION)
@with_setup
def summarize(
    ctx: typer.Context,
    source: SourceArg,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Your own instruction, placed after the "
                                               "document.")] = None,
    template: Annotated[str | None, typer.Option("--template", help="A named instruction: summary (default), "
                                                 "tldr or keypoints.")] = None,
    section: SectionOpt = SECTION_TOKENS,
    *,
    setup: Setup,
    read: ReadOptions,
) -> None:
    """Read SOURCE (any length) through a fixed-size KV cache, then write a summary of it to stdout.

    A document longer than --section tokens is summarized section by section as it streams, each section's
    summary written to stdout in turn; with --template, --prompt or --answer-prefix the section summaries
    (then on stderr) are read once more with that instruction, and that answer goes to stdout.
    """
    from kvcli.reading.prompts import TEMPLATES, custom_instruction

    if prompt is not None and template is not None:
        raise UsageError("--prompt and --template are alternatives: give one")
    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt is empty")
        instruction = custom_instruction(prompt, read.answer_prefix)
    else:
        name = template or "summary"
        if name not in TEMPLATES:
            raise UsageError(f"unknown --template {name!r}; choose one of: {', '.join(TEMPLATES)}")
        instruction = dataclasses.replace(TEMPLATES[name], answer_prefix=read.answer_prefix)
    # The default summary is the sections' own summaries in order; another instruction is applied to them.
    combine = prompt is not None or (template or "summary") != "summary" or bool(read.answer_prefix)
    about = {"prompt": prompt} if prompt is not None else {"template": template or "summary"}
    read_and_write(ctx, source, Task("summarize", instruction, about, section, combine), setup, read)


@with_reading(max_new_tokens=128, repetition=ANSWER_REPETITION, recap=RECAP_TOKENS)
@with_setup
def ask(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files (read as one text; one by one "
                                          "with --each), - for stdin, or a saved read (FILE.kvc, `kvcli read`).")],
    question: Annotated[list[str] | None, typer.Argument(help="The question, answered from the document; several "
                                                         "are answered in turn from one read.", show_default=False)
                        ] = None,
    *,
    setup: Setup,
    read: ReadOptions,
    no_frame: NoFrameOpt = False,
    questions_file: Annotated[Path | None, typer.Option("--questions", help="Also ask the questions in this file, "
                                                        "one per line (blank lines skipped).")] = None,
    save: Annotated[Path | None, typer.Option("--save", help="Read SOURCE once without the question, save the read "
                                              "to this FILE.kvc (as `kvcli read` does), then answer from it.")
                    ] = None,
    recall: Annotated[int | None, typer.Option("--recall", help="With a read made without the question (FILE.kvc, "
                                               "several questions, --save): first read again at most this many "
                                               "tokens of the pages the question points at (beyond the papers; "
                                               "docs/reading.md). 0 = off. Default: "
                                               f"{RECALL_TOKENS} where the read kept its index, else 0.",
                                               show_default=False)] = None,
) -> None:
    """Answer QUESTION about SOURCE; the question steers which tokens the compressed cache keeps.

    A document too long for one forward is streamed in blocks, and the passages the question pointed at
    are read once more before it (--recap). Several questions, --save or a saved read (FILE.kvc) read the
    document once without a question and answer each from that read (docs/reading.md#read-once-ask-many).
    """
    from kvcli.cli.read import ask_many, collect_questions
    from kvcli.reading.prompts import question_instruction
    from kvcli.reading.saved import is_saved_read

    questions = collect_questions(question or [], questions_file)
    check_recall(recall)
    if len(questions) > 1 or save is not None or is_saved_read(source):
        if read.each:
            raise UsageError("--each reads every document for one question: ask several questions without it")
        ask_many(ctx, source, questions, setup, read, not no_frame, save, recall)
        return
    if recall:
        raise UsageError("--recall goes with a read made without the question: a saved read (FILE.kvc), several "
                         "questions or --save")
    instruction = question_instruction(questions[0], read.answer_prefix, frame=not no_frame)
    read_and_write(ctx, source, Task("ask", instruction, {"question": questions[0]}), setup, read)
