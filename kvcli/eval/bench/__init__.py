"""``kvcli bench``: every method at every cache budget over one token stream, saved as it goes.

A grid scores the same tokens many times, so the source is tokenized once and held as ids (all its
documents as one stream, like ``kvcli ppl --stream``). Every finished run is written to
``results.json`` at once, atomically, so an interrupted grid loses at most the run in progress, and a
rerun into the same folder skips the runs it already has. The plots are drawn from everything in
``results.json``, so runs from earlier invocations appear next to new ones.

:mod:`kvcli.eval.bench.grid` plans and runs the grid, :mod:`kvcli.eval.bench.results` reads and writes
``results.json``, :mod:`kvcli.eval.bench.plots` draws it; this module re-exports their public names.
:mod:`kvcli.eval.bench.throughput` is a script (``python -m kvcli.eval.bench.throughput``) that times the engine
against plain transformers; it is not imported here.
"""

from __future__ import annotations

from kvcli.eval.bench.grid import (
    DEFAULT_MAX_TOKENS,
    GridResult,
    RunSpec,
    TokenStream,
    measure,
    metadata,
    now,
    plan_grid,
    read_token_stream,
    run_grid,
    run_record,
    settings,
    source_name,
)
from kvcli.eval.bench.plots import (
    NLL_PLOT,
    PPL_PLOT,
    SMOOTHING_FRACTION,
    plot_results,
    smooth_curve,
    smoothing_window,
)
from kvcli.eval.bench.results import (
    KEY_FIELDS,
    RESULTS_FILE,
    SETTING_FIELDS,
    bench_json,
    check_out_dir,
    load_results,
    run_key,
    save_results,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "KEY_FIELDS",
    "NLL_PLOT",
    "PPL_PLOT",
    "RESULTS_FILE",
    "SETTING_FIELDS",
    "SMOOTHING_FRACTION",
    "GridResult",
    "RunSpec",
    "TokenStream",
    "bench_json",
    "check_out_dir",
    "load_results",
    "measure",
    "metadata",
    "now",
    "plan_grid",
    "plot_results",
    "read_token_stream",
    "run_grid",
    "run_key",
    "run_record",
    "save_results",
    "settings",
    "smooth_curve",
    "smoothing_window",
    "source_name",
]
