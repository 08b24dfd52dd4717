"""``kvcli analyze``: attention entropy, inter-layer similarity, kept positions and wavelets on one prompt.

:mod:`kvcli.eval.analysis` measures and draws; this module reads the options, loads the model, writes
``analysis.json`` and the PNGs, and prints a short summary (or the JSON).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvcli.cli.options import BlockOpt, Setup, build_method, parse_block, resolve_block, split_list, with_setup
from kvcli.errors import KvcliError, UsageError

if TYPE_CHECKING:  # the command's module is imported by --help: torch is imported where it is used
    import torch

    from kvcli.models.load import LoadedModel


@dataclass(frozen=True)
class AnalyzeOptions:
    """``kvcli analyze``'s own options, as the user gave them."""

    source: str
    out: Path
    max_tokens: int
    methods: str
    cache: int
    block: str
    queries: int
    levels: int
    bins: int
    threshold: float
    json_out: bool
    plots: bool

    def validate(self) -> tuple[int | None, dict]:
        """The block (None: the device's default) and each method of ``--methods`` built with the budget, every
        option checked first, reading no file and loading no model; the first one wrong is a :class:`UsageError`."""
        if self.max_tokens < 2 or self.queries < 1 or self.bins < 1 or self.levels < 1:
            raise UsageError("--max-tokens must be at least 2, and --queries, --bins and --levels at least 1")
        block = parse_block(self.block)
        if not 0.0 <= self.threshold <= 1.0:
            raise UsageError(f"--threshold must be between 0 and 1, not {self.threshold}")
        names = split_list(self.methods, str, "--methods")
        return block, {name: build_method(name, None, self.cache) for name in names}


@with_setup
def analyze(
    source: Annotated[str, typer.Argument(help="A text file, a folder of .txt files (read as one text), or - for "
                                          "stdin; its first --max-tokens tokens are the prompt.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for analysis.json and the PNGs.")] = Path("analysis"),
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Prompt length in tokens (at most the "
                                            "model's trained context).")] = 2048,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods whose kept positions are "
                                         "mapped.")] = "streamingllm,h2o,snapkv,tova,treekv,pyramidkv,pyramidinfer",
    cache: Annotated[int, typer.Option("--cache", "-c", help="KV budget in tokens per layer for the kept-positions "
                                       "map.")] = 256,
    block: BlockOpt = "auto",
    queries: Annotated[int, typer.Option("--queries", help="Sampled queries: the last N of the prompt, whose "
                                         "attention distributions are recorded.")] = 64,
    levels: Annotated[int, typer.Option("--levels", help="Haar wavelet levels (TreeKV uses 5).")] = 5,
    bins: Annotated[int, typer.Option("--bins", help="Position bins of the kept-positions map.")] = 128,
    threshold: Annotated[float, typer.Option("--threshold", help="PoD similarity threshold for grouping "
                                             "layers.")] = 0.5,
    json_out: Annotated[bool, typer.Option("--json", help="Print analysis.json on stdout instead of the "
                                           "summary.")] = False,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the five PNGs beside analysis.json.")] = True,
    *,
    setup: Setup,
) -> None:
    """Attention entropy and sparsity per layer, PoD's layer groups, kept positions per method, Haar wavelets."""
    from kvcli.eval.analysis import analyze as run_analysis
    from kvcli.io.outputs import check_output

    opts = AnalyzeOptions(source=source, out=out, max_tokens=max_tokens, methods=methods, cache=cache, block=block,
                          queries=queries, levels=levels, bins=bins, threshold=threshold, json_out=json_out,
                          plots=plots)
    block_size, method_objs = opts.validate()
    setup.check_outputs({"--out": opts.out}, opts.source, folders=("--out",))
    check_output(opts.out, "--out", folder=True)  # before the analysis, not after
    documents = setup.documents(opts.source)
    loaded = setup.load()
    block_size = resolve_block(block_size, loaded)
    ids = prompt_ids(opts, documents, loaded, setup)
    started = time.perf_counter()
    result = run_analysis(loaded.model, ids, method_objs, budget=opts.cache, block=block_size, queries=opts.queries,
                          levels=opts.levels, bins=opts.bins, threshold=opts.threshold, on_step=partial(_step, setup))
    result = {"model": loaded.name, "source": opts.source, "device": str(loaded.device),
              "dtype": str(loaded.dtype).removeprefix("torch."), **result,
              "seconds": round(time.perf_counter() - started, 3)}
    render(opts, write_files(opts, result, setup), result)


def _step(setup: Setup, message: str) -> None:
    """A progress line on stderr: which part of the analysis runs now."""
    setup.note(f"analyze: {message}")


def prompt_ids(opts: AnalyzeOptions, documents: list, loaded: LoadedModel, setup: Setup) -> torch.Tensor:
    """The prompt: the first ``--max-tokens`` tokens of SOURCE, which one plain forward pass over the model's
    trained context must take and the wavelets' levels must fit."""
    import torch

    from kvcli.eval.needle import book_tokens

    trained = loaded.trained_context
    if trained and opts.max_tokens > trained:
        raise UsageError(f"--max-tokens {opts.max_tokens} is longer than the model's trained context ({trained}): "
                         "the analysis needs one plain forward pass over the prompt")
    ids = torch.tensor(book_tokens(documents, loaded.tokenizer, opts.max_tokens), dtype=torch.long)
    if ids.shape[0] < 2 ** opts.levels:
        raise KvcliError(f"{opts.source} has {ids.shape[0]} tokens; the analysis needs at least {2 ** opts.levels} "
                         f"(2**--levels)")
    if ids.shape[0] < opts.max_tokens:
        setup.say(f"{opts.source} has only {ids.shape[0]:,} tokens: analysing all of them")
    return ids


def write_files(opts: AnalyzeOptions, result: dict, setup: Setup) -> str:
    """analysis.json and (``--plots``) the PNGs in ``--out``; the JSON text written, which lists the files."""
    from kvcli.eval.analysis import write_plots
    from kvcli.io.outputs import atomic_write
    from kvcli.io.plots import MISSING, have_matplotlib
    from kvcli.io.report import dumps

    out = opts.out
    files = []
    json_path = out / "analysis.json"
    try:  # the folder was checked before the analysis; a disk that fills up since is still one line
        out.mkdir(parents=True, exist_ok=True)
        if opts.plots and have_matplotlib():
            _step(setup, "drawing")
            files = [str(path) for path in write_plots(result, out)]
        elif opts.plots:
            setup.say(f"{MISSING}: writing analysis.json only")
        result["files"] = [str(json_path), *files]
        text = dumps(result)
        atomic_write(json_path, (text + "\n").encode("utf-8"))
    except OSError as exc:
        raise KvcliError(f"--out {out}: {exc.strerror or exc}") from None
    return text


def render(opts: AnalyzeOptions, text: str, result: dict) -> None:
    """analysis.json on stdout (``--json``), else a header, what the analysis found and the files written."""
    from kvcli.cli.render import summary_lines
    from kvcli.io.report import print_result

    if opts.json_out:
        print_result(text)
        return
    header = (f"analyzed {result['tokens']:,} tokens of {opts.source} · {result['model']} ({result['dtype']}, "
              f"{result['device']}) · {result['seconds']:.1f} s")
    print_result("\n".join([header, *summary_lines(json.loads(text)), f"wrote {', '.join(result['files'])}"]))
