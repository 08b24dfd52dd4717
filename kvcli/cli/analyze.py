"""``kvcli analyze``: attention entropy, inter-layer similarity, kept positions and wavelets on one prompt.

:mod:`kvcli.eval.analysis` measures and draws; this module reads the options, loads the model, writes
``analysis.json`` and the PNGs, and prints a short summary (or the JSON).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from kvcli.cli.options import BlockOpt, Setup, build_method, parse_block, resolve_block, split_list, with_setup
from kvcli.errors import KvcliError, UsageError


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
    import torch

    from kvcli.cli.render import summary_lines
    from kvcli.eval.analysis import analyze as run_analysis
    from kvcli.eval.analysis import write_plots
    from kvcli.eval.needle import book_tokens
    from kvcli.io.outputs import atomic_write, check_output
    from kvcli.io.plots import MISSING, have_matplotlib
    from kvcli.io.report import dumps, print_result

    if max_tokens < 2 or queries < 1 or bins < 1 or levels < 1:
        raise UsageError("--max-tokens must be at least 2, and --queries, --bins and --levels at least 1")
    block_size = parse_block(block)
    if not 0.0 <= threshold <= 1.0:
        raise UsageError(f"--threshold must be between 0 and 1, not {threshold}")
    method_objs = {name: build_method(name, None, cache) for name in split_list(methods, str, "--methods")}
    setup.check_outputs({"--out": out}, source, folders=("--out",))
    check_output(out, "--out", folder=True)  # before the analysis, not after
    documents = setup.documents(source)
    loaded = setup.load()
    block_size = resolve_block(block_size, loaded)
    trained = loaded.trained_context
    if trained and max_tokens > trained:
        raise UsageError(f"--max-tokens {max_tokens} is longer than the model's trained context ({trained}): the "
                         "analysis needs one plain forward pass over the prompt")
    ids = torch.tensor(book_tokens(documents, loaded.tokenizer, max_tokens), dtype=torch.long)
    if ids.shape[0] < 2 ** levels:
        raise KvcliError(f"{source} has {ids.shape[0]} tokens; the analysis needs at least {2 ** levels} "
                         f"(2**--levels)")
    if ids.shape[0] < max_tokens:
        setup.say(f"{source} has only {ids.shape[0]:,} tokens: analysing all of them")

    def step(message: str) -> None:
        setup.note(f"analyze: {message}")

    started = time.perf_counter()
    result = run_analysis(loaded.model, ids, method_objs, budget=cache, block=block_size, queries=queries,
                          levels=levels, bins=bins, threshold=threshold, on_step=step)
    result = {"model": loaded.name, "source": source, "device": str(loaded.device),
              "dtype": str(loaded.dtype).removeprefix("torch."), **result,
              "seconds": round(time.perf_counter() - started, 3)}
    files = []
    json_path = out / "analysis.json"
    try:  # the folder was checked before the analysis; a disk that fills up since is still one line
        out.mkdir(parents=True, exist_ok=True)
        if plots and have_matplotlib():
            step("drawing")
            files = [str(path) for path in write_plots(result, out)]
        elif plots:
            setup.say(f"{MISSING}: writing analysis.json only")
        result["files"] = [str(json_path), *files]
        text = dumps(result)
        atomic_write(json_path, (text + "\n").encode("utf-8"))
    except OSError as exc:
        raise KvcliError(f"--out {out}: {exc.strerror or exc}") from None
    if json_out:
        print_result(text)
        return
    header = (f"analyzed {result['tokens']:,} tokens of {source} · {loaded.name} ({result['dtype']}, "
              f"{result['device']}) · {result['seconds']:.1f} s")
    print_result("\n".join([header, *summary_lines(json.loads(text)), f"wrote {', '.join(result['files'])}"]))
