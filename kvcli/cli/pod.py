"""``kvcli calibrate`` and ``kvcli adapt``: PoD's layer groups and its post-training.

:mod:`kvcli.eval.analysis.calibrate` and :mod:`kvcli.methods.pod.adapt` do the work; these commands read the options,
load the model, show progress on stderr and print a short summary (or one JSON object).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcli.cli.options import Setup, check_seed, with_setup
from kvcli.errors import UsageError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]


def _bar(setup: Setup, total: int, what: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvcli.io.report import stderr_console

    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=stderr_console, transient=True, disable=setup.quiet)


@with_setup
def calibrate(
    source: Annotated[str, typer.Argument(help="A text file or a folder of .txt files to sample sequences from.")],
    out: Annotated[Path, typer.Option("--out", help="Groups file to write (JSON).")],
    threshold: Annotated[float, typer.Option("--threshold", help="Similarity (1 - JS) two layers need to share "
                                             "(Algorithm 1).")] = 0.5,
    q: Annotated[int, typer.Option("--q", help="Last queries of each sample whose attention is compared.")] = 16,
    samples: Annotated[int, typer.Option("--samples", "-N", help="Sampled sequences.")] = 16,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens per sampled sequence.")] = 2048,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampling.")] = 0,
    json_out: JsonOpt = False,
    *,
    setup: Setup,
) -> None:
    """PoD's layer groups for a model (Algorithm 1, App. B.2): pass the file to `--method pod -o groups=FILE`."""
    from kvcli.eval.analysis.calibrate import calibrate as run_calibration
    from kvcli.io.outputs import check_output
    from kvcli.io.report import dumps, print_result
    from kvcli.methods.pod.groups import check_supported

    check_seed(seed)
    setup.check_outputs({"--out": out}, source)
    check_output(out, "--out")  # before minutes of calibration, not after
    documents = setup.documents(source)
    loaded = setup.load()
    check_supported(loaded.model.config)  # before minutes of calibration: groups no model of this kind can use
    with _bar(setup, samples, "calibrating") as bar:
        task = bar.add_task("", total=samples)
        groups = run_calibration(loaded.model, loaded.tokenizer, documents, threshold, q, samples, tokens, seed=seed,
                                 model_id=loaded.name, source=", ".join(doc.name for doc in documents),
                                 on_sample=lambda done, total: bar.update(task, completed=done, total=total))
    groups.save(out)
    if json_out:
        summary = groups.to_dict()
        summary.pop("similarity", None)
        print_result(dumps({"out": str(out), **summary}))
        return
    print_result(f"{out}: {groups.shape.layers} layers, blocks per KV head {groups.blocks_per_kv_head()}, "
                 f"theoretical KV saving {groups.theoretical_kv_saving():.1%} ({groups.samples} x "
                 f"{groups.tokens_per_sample} tokens, last {groups.q} queries, threshold {groups.threshold})")


@with_setup
def adapt(
    data: Annotated[str, typer.Option("--data", help="A text file or a folder of .txt files to train on.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the adapted model (loads with --model OUT "
                                      "--method pod); an unfinished run there resumes.")],
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens to train on.")],
    groups: Annotated[str, typer.Option("--groups", help="Groups file; auto = the model folder's "
                                        "pod_groups.json (an earlier adapt's output, to train it further), else "
                                        "the shipped groups for the model.")] = "auto",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training sequence (one optimizer step "
                                         "each); must exceed --sinks + --recent so that distant tokens "
                                         "are trained.")] = 2048,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (cosine schedule, the paper's "
                                      "1e-5).")] = 1e-5,
    sinks: Annotated[int, typer.Option("--sinks", help="n_s of the PoD attention trained with.")] = 16,
    recent: Annotated[int, typer.Option("--recent", help="n_r of the PoD attention trained with (smaller than "
                                        "at inference trains the sharing on more queries).")] = 1024,
    save_every: Annotated[int, typer.Option("--save-every", help="Steps between saved states.")] = 50,
    json_out: JsonOpt = False,
    *,
    setup: Setup,
) -> None:
    """PoD's light post-training (section 2.2): fine-tune with PoD attention active, save an HF folder."""
    from kvcli.io.outputs import lock_folder
    from kvcli.io.report import dumps, print_result
    from kvcli.methods.pod.adapt import adapt as run_adapt
    from kvcli.methods.pod.adapt import check_settings
    from kvcli.methods.pod.groups import resolve
    from kvcli.models.load import discard

    if save_every < 0:
        raise UsageError(f"--save-every must be >= 0, not {save_every}")
    check_settings(tokens=tokens, seq_len=seq_len, lr=lr, sinks=sinks, recent=recent)
    setup.check_outputs({"--out": out}, data, folders=("--out",),
                        inputs=(("--groups", None if groups == "auto" else groups),))
    with lock_folder(out, "--out"):  # checked and held before the model loads: a second run is refused at once
        documents = setup.documents(data)
        loaded = setup.load()
        discard(loaded)  # training changes its weights: later loads in this process must not reuse them
        plan_groups = resolve(groups, loaded.model.config)
        with _bar(setup, max(tokens // max(seq_len, 1), 1), "adapting") as bar:
            task = bar.add_task("", total=max(tokens // max(seq_len, 1), 1))
            result = run_adapt(loaded.model, loaded.tokenizer, documents, plan_groups, out, tokens=tokens,
                               seq_len=seq_len, lr=lr, sinks=sinks, recent=recent, save_every=save_every,
                               on_step=lambda step, total, loss: bar.update(task, completed=step,
                                                                             description=f"loss {loss:.3f}"))
    summary = {"out": str(result.out), "steps": result.steps, "total_steps": result.total_steps,
               "tokens": result.tokens, "resumed_from": result.resumed_from, "interrupted": result.interrupted,
               "first_loss": result.losses[0] if result.losses else None,
               "last_loss": result.losses[-1] if result.losses else None, "seconds": round(result.seconds, 1)}
    if json_out:
        print_result(dumps(summary))
    else:
        state = "interrupted, resume with the same command" if result.interrupted else "done"
        print_result(f"{out}: {result.steps}/{result.total_steps} steps ({state}); loss {summary['first_loss']} -> "
                     f"{summary['last_loss']}; load it with --model {out} --method pod")
    if result.interrupted:
        raise typer.Exit(130)
