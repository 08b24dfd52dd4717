"""The plot of ``kvcli needle``: pass-key accuracy per method as a heat map of haystack length x depth.

Drawn from the JSON-ready result (:meth:`kvcli.eval.needle.NeedleResult.as_dict`, what ``--json`` prints), so a
saved result can be drawn again. Needs matplotlib (:func:`kvcli.io.plots.pyplot`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.io.plots import pyplot, save_figure

NEEDLE_PLOT = "needle.png"


def claim_unused(path: Path) -> Path:
    """``path`` if no file is there, else the first of ``STEM-2.SUFFIX``, ``STEM-3.SUFFIX``, ... that is free,
    created empty at once (so that two runs never take the same name): a run never overwrites another's plot."""
    path = Path(path)
    for number in range(1, 10_000):
        candidate = path if number == 1 else path.with_name(f"{path.stem}-{number}{path.suffix}")
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        except OSError as exc:
            raise KvcliError(f"cannot write {candidate}: {exc.strerror or exc}") from None
        return candidate
    raise KvcliError(f"{path.parent} holds {path.name} and 9,998 numbered copies: use another --out folder")


def plot_needle(result: dict, path: Path, model: str | None = None) -> Path:
    """One panel per method: haystack lengths across, needle depths down (0 % at the top, as in the
    usual needle-in-a-haystack figure), each cell coloured by its accuracy and labelled ``correct/trials``.

    A cell the grid did not run stays blank, so a partial grid (Ctrl-C) is drawn as far as it went.
    """
    plt = pyplot()
    rows = result["by_depth"]
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lengths = sorted({row["length"] for row in rows})
    depths = sorted({row["depth"] for row in rows})
    cells = {(row["method"], row["length"], row["depth"]): row for row in rows}
    cols = min(len(methods), 3)
    lines = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(lines, cols, squeeze=False, sharey=True, layout="constrained",
                             figsize=(max(3.0 + 1.1 * len(lengths), 4.2) * cols, (1.8 + 0.55 * len(depths)) * lines))
    image = None
    for index, method in enumerate(methods):
        ax = axes[index // cols, index % cols]
        grid = [[cells[(method, length, depth)]["accuracy"] if (method, length, depth) in cells else math.nan
                 for length in lengths] for depth in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for y, depth in enumerate(depths):
            for x, length in enumerate(lengths):
                row = cells.get((method, length, depth))
                if row is not None:  # white on the dark ends of the colour map, black in between
                    ink = "white" if not 0.2 <= row["accuracy"] <= 0.85 else "black"
                    ax.text(x, y, f"{row['correct']}/{row['trials']}", ha="center", va="center", fontsize=8,
                            color=ink)
        total = [row for row in result["accuracy"] if row["method"] == method]
        correct, trials = sum(row["correct"] for row in total), sum(row["trials"] for row in total)
        ax.set_title(f"{method}: {correct}/{trials} ({correct / trials:.0%})" if trials else method, fontsize=10)
        ax.set_xticks(range(len(lengths)), [f"{length:,}" for length in lengths])
        ax.set_yticks(range(len(depths)), [f"{depth:.0%}" for depth in depths])
        ax.set_xlabel("haystack length (tokens)")
        if index % cols == 0:
            ax.set_ylabel("depth of the needle")
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label="accuracy", fraction=0.05, pad=0.02)
    caption = " · ".join(part for part in (model, f"cache {result['cache']:,} tokens/layer",
                                            f"block {result['block']}") if part)
    fig.suptitle(f"Pass-key retrieval accuracy\n{caption}", fontsize=11)
    return save_figure(fig, path, tight=False)
