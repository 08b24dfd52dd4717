"""What every command shares: the options that load a model and read input, parsed into one object.

:func:`with_setup` adds the shared options (model, device, dtype, device map, quantisation,
encoding, quiet) to a command's signature and hands the command one :class:`Setup` instead, so a
command declares only its own options. The rest are small parsers for the option syntaxes the
commands share (``-o KEY=VALUE``, comma-separated lists, ``--cache``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcli.errors import UsageError

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name (smollm2-135m), Hugging Face id or "
                                       "local folder, or a .gguf file.")]
TrialRowsOpt = Annotated[Path | None, typer.Option("--rows", help="Append one JSON line per trial to this file as "
                                                   "each trial finishes (whole lines only, even after a kill).")]
ResumeTrialsOpt = Annotated[bool, typer.Option("--resume", help="Continue a killed run: take the trials already in "
                                               "--rows and run the rest (refused if they came from another book, "
                                               "model or setting).")]
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
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or warnings on stderr.")]

# Options several commands declare themselves (their defaults differ by command).
MethodOpt = Annotated[str, typer.Option("--method", help="Compression method (see `kvcli methods`).")]
CacheOpt = Annotated[int, typer.Option("--cache", "-c", help="KV budget in tokens per layer (average over "
                                       "layers for methods that vary it). Ignored by `full`.")]
BlockOpt = Annotated[str, typer.Option("--block", "-b", help="Tokens per forward pass; the cache is compressed "
                                       "after every block. auto: 256 on a CPU, 1024 on a GPU.")]
#: The block of a read (``ask``, ``summarize``, ``needle``) on every device: the fewer compressions a document
#: goes through, the fewer chances to evict a token the question needs (chosen on the tuning books:
#: docs/reading.md, "Blocks of 1,024").
READ_BLOCK = 1024
ReadBlockOpt = Annotated[str, typer.Option("--block", "-b", help="Tokens per forward pass while reading a document "
                                           "that does not fit one; the cache is compressed after every block. auto: "
                                           f"{READ_BLOCK} on every device.")]
OptionOpt = Annotated[list[str] | None, typer.Option("--option", "-o", help="Method parameter KEY=VALUE "
                                                     "(repeatable), e.g. -o sinks=8.")]
MethodsOptionOpt = Annotated[list[str] | None, typer.Option("--option", "-o", help="Method parameter KEY=VALUE for "
                                                            "every listed method that has it, or METHOD.KEY=VALUE "
                                                            "for one (repeatable).")]
KvBitsOpt = Annotated[str, typer.Option("--kv-bits", help="Bits per cached key and value element: 16 (the "
                                        "model's precision), 8, 4 or 2 (packed; values rounded per token in groups of "
                                        "channels, keys too at 8 and 4 bits and per channel at 2, each token rotated "
                                        "by a Hadamard matrix first at 4 and 2 bits, the last 32 tokens at full "
                                        "precision).")]
KvKeysOpt = Annotated[str, typer.Option("--kv-keys", help="How cached keys are rounded below 16 bits: token "
                                        "(per token in groups of channels), channel (per channel before RoPE, fixed "
                                        "scales, the first 4 tokens at full precision), pca (before RoPE on each "
                                        "head's principal axes weighed by its queries, bits spread over the axes) "
                                        "or auto (pca at 2 bits, channel for a model that normalizes its keys; "
                                        "token at 8 and 4).")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="Folder of .txt books for the pg19 source "
                                                 "when offline (or set KVCLI_DATA).")]
RowsOpt = Annotated[Path | None, typer.Option("--rows", help="Append one JSON line per document to this file as "
                                             "each document finishes (whole lines only, even after a kill).")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue a killed run: skip the documents whose rows "
                                         "are already in --rows.")]


@dataclass(frozen=True)
class Setup:
    """The shared options of a command: which model, on what, reading input how, how chatty."""

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    encoding: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        check_device(self.device)  # here, so that a preset's device is checked too

    def say(self, message: str) -> None:
        """A warning on stderr, unless ``--quiet``."""
        if not self.quiet:
            from kvcli.io.report import warn

            warn(message)

    def note(self, message: str) -> None:
        """A plain progress line on stderr, unless ``--quiet``."""
        if not self.quiet:
            from kvcli.io.report import stderr_console

            stderr_console.print(message, markup=False, highlight=False)

    def check_outputs(self, outputs: dict[str, Path | None], source: str | None = None, *,
                      data_dir: Path | None = None, folders: tuple[str, ...] = (),
                      inputs: tuple[tuple[str, Path | str | None], ...] = ()) -> None:
        """Refuse, before anything is opened, an output (flag -> path; ``folders`` names the flags that are
        folders) that would write over SOURCE, the model or one of ``inputs`` ((what, path) pairs)
        (:func:`kvcli.io.paths.check_apart`)."""
        from kvcli.io.paths import Input, Output, check_apart, model_inputs, source_inputs

        given = [*source_inputs(source or "-", data_dir), *model_inputs(self.model)]
        given += [Input(what, Path(path)) for what, path in inputs if path is not None]
        check_apart([Output(flag, Path(path), flag in folders) for flag, path in outputs.items() if path is not None],
                    given)

    def documents(self, source: str, data_dir: Path | None = None) -> list:
        """SOURCE as documents, checked before any model loads."""
        from kvcli.io.documents import open_source

        return open_source(source, encoding=self.encoding, data_dir=data_dir, warn=self.say)

    def load(self):
        """The model (loaded once per process; a GGUF through the model cache, whose warnings follow ``--quiet``)."""
        from kvcli.models.load import load_model

        return load_model(self.model, device=self.device, dtype=self.dtype, device_map=self.device_map,
                          load_in_4bit=self.load_in_4bit, load_in_8bit=self.load_in_8bit, warn=self.say)

    def build_engine(self, loaded, method, budget: int | None, block: int | None, kv_bits: int = 16,
                     kv_keys: str | None = None):
        """An engine for ``loaded`` whose warnings follow ``--quiet``, caching keys and values at ``kv_bits``
        (keys rounded the ``kv_keys`` way)."""
        from kvcli.engine.engine import Engine

        return Engine(loaded.model, method, budget, block=block, warn=self.say, kv_bits=kv_bits, kv_keys=kv_keys)


def join_ranks(setup: Setup):
    """This process's :class:`kvcli.io.ranks.Ranks` (joining the job when a launcher started several) and
    ``setup`` with the rank's device; only rank 0 draws progress and warns."""
    from kvcli.io.ranks import join, launched_ranks

    if launched_ranks() == 1:
        from kvcli.io.ranks import Ranks

        return Ranks(), setup
    ranks, device = join(setup.device)
    return ranks, dataclasses.replace(setup, device=device, quiet=setup.quiet or not ranks.main)


def options_bundle(argument: str, build: Callable[..., Any], parameters: list[inspect.Parameter]
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that adds ``parameters`` to a command's signature (Typer sees them as options) and
    passes the command ``build(**their values)`` as its ``argument`` instead."""
    names = [p.name for p in parameters]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != argument]

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kwargs[argument] = build(**{name: kwargs.pop(name) for name in names})
            return command(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=[*own, *parameters])  # type: ignore[attr-defined]
        return wrapper

    return decorate


def keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


#: Gives a command the shared options: Typer sees them in the signature, the command gets a
#: :class:`Setup` as its ``setup`` argument instead.
with_setup = options_bundle("setup", Setup, [
    keyword(field.name, annotation, field.default)
    for field, annotation in zip(dataclasses.fields(Setup), (ModelOpt, DeviceOpt, DtypeOpt, DeviceMapOpt, FourBitOpt,
                                                             EightBitOpt, EncodingOpt, QuietOpt), strict=True)
])


def explicit(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option ``name`` (command line or environment) rather than its default.

    Compared by name: recent Typer versions bring their own copy of click's ``ParameterSource``.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and getattr(source, "name", "") not in ("DEFAULT", "DEFAULT_MAP")


def parse_options(options: list[str] | None) -> dict[str, str]:
    """``-o KEY=VALUE`` items as a dict."""
    parsed: dict[str, str] = {}
    for item in options or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-o {item!r}: expected KEY=VALUE")
        parsed[key.strip()] = value.strip()
    return parsed


def split_list(text: str, convert: Callable[[str], Any], what: str) -> list:
    """``"a,b,c"`` as a list of converted items; a usage error names the option ``what`` when it fails."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{what} is empty")
    try:
        return [convert(item) for item in items]
    except ValueError:
        raise UsageError(f"{what}: cannot read {text!r} as a comma-separated list") from None


def parse_count(text: str | int, flag: str, unit: str) -> int | None:
    """``flag``'s value: a positive number of ``unit``, or ``auto`` (None: kvcli chooses)."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        raise UsageError(f"{flag} must be a number of {unit} or auto, not {text!r}") from None
    check_at_least(1, **{flag.removeprefix("--").replace("-", "_"): count})
    return count


def parse_block(text: str | int) -> int | None:
    """``--block``: a positive number of tokens, or ``auto`` (None: the engine picks per device)."""
    return parse_count(text, "--block", "tokens")


def parse_read_block(text: str | int) -> int:
    """``--block`` of a read: a positive number of tokens, or ``auto``: :data:`READ_BLOCK` on every device."""
    block = parse_block(text)
    return READ_BLOCK if block is None else block


def resolve_block(block: int | None, loaded) -> int:
    """A parsed ``--block`` for the loaded model: ``auto`` (None) becomes the engine's default for its device."""
    from kvcli.engine.engine import default_block

    return block if block is not None else default_block(loaded.device)


def check_device(device: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N, the devices kvcli runs on (torch knows more: meta, mps, xla...,
    where kvcli's kernels do not run), checked before any model loads."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise UsageError(f"--device {device!r}: choose auto, cpu, cuda or cuda:N")
    return device


#: The most tokens a count of tokens may ask for (``--cache``, ``--max-tokens``...): far beyond any memory, and
#: within what torch's 64-bit indices take after the arithmetic on them.
MAX_TOKENS = 2**40


def check_cache(cache: int) -> None:
    if cache < 1:
        raise UsageError(f"--cache must be a positive number of tokens, not {cache}")
    check_at_most(MAX_TOKENS, cache=cache)


#: The most bytes a size may ask for (an exabyte): beyond it a float is no longer an exact count, and 10**400
#: is no longer a float at all.
MAX_BYTES = 10**18
_BYTE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
               "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_bytes(text: str, flag: str) -> int:
    """``47185920``, ``45MiB``, ``47.2MB`` or ``1.5GiB`` as a number of bytes (decimal and binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise UsageError(f"{flag} {text!r}: expected bytes, e.g. 47185920, 45MiB or 1.5GB")
    value = float(match.group(1)) * _BYTE_UNITS[unit]
    if value > MAX_BYTES:
        raise UsageError(f"{flag} {text.strip()[:40]!r} is more than any memory (at most {MAX_BYTES:,} bytes)")
    if value < 1:
        raise UsageError(f"{flag} must be at least 1 byte, not {text!r}")
    return int(value)


def parse_kv_bits(text: str | int, flag: str = "--kv-bits") -> int:
    """``--kv-bits``: 16, 8, 4 or 2; anything else is one line (checked before any model loads)."""
    from kvcli.kv.quant import check_kv_bits

    try:
        bits = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{flag} must be 16, 8, 4 or 2 (bits per cached key and value element), not {text!r}") \
            from None
    return check_kv_bits(bits, flag)


def check_at_least(minimum: int, **values: int | None) -> None:
    """``--name`` must be at least ``minimum`` (and at most :data:`MAX_TOKENS`) for every given value that is
    not None."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise UsageError(f"--{name.replace('_', '-')} must be at least {minimum}, not {value}")
    check_at_most(MAX_TOKENS, **values)


def check_seed(seed: int) -> None:
    """``--seed``: what a torch generator takes (a 64-bit integer, signed or not)."""
    if not -(2**63) <= seed < 2**64:
        raise UsageError(f"--seed must be an integer from -2**63 to 2**64 - 1, not {seed}")


def check_at_most(maximum: int, **values: int | None) -> None:
    """``--name`` must be at most ``maximum`` for every given value that is not None."""
    for name, value in values.items():
        if value is not None and value > maximum:
            raise UsageError(f"--{name.replace('_', '-')} must be at most {maximum:,}, not {value}")


def build_method(name: str, options: dict[str, str] | list[str] | None, cache: int):
    """The method ``name`` with its ``-o`` options, checked against the budget ``--cache`` before any model loads."""
    from kvcli.methods import make_method

    check_cache(cache)
    method = make_method(name, options if isinstance(options, dict) else parse_options(options))
    from kvcli.engine.engine import check_budget  # after the checks that need no torch, so their errors come fast

    check_budget(method, cache)
    return method


def method_options(methods: list[str], options: list[str] | None) -> dict[str, dict]:
    """``-o KEY=VALUE`` for every method with parameter KEY, ``-o METHOD.KEY=VALUE`` for one method."""
    from kvcli.methods import METHODS

    out: dict[str, dict] = {name: {} for name in methods}
    for key, value in parse_options(options).items():
        target, dot, name = key.rpartition(".")
        if dot:
            if target not in out:
                raise UsageError(f"-o {key}: {target!r} is not one of --methods")
            out[target][name] = value
            continue
        having = [m for m in methods if m in METHODS and METHODS[m].has_param(name)]
        if not having:
            raise UsageError(f"-o {key}: none of {', '.join(methods)} has a parameter {name!r}")
        for m in having:
            out[m][name] = value
    return out
