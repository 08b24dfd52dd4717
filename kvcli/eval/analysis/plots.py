"""The figures of ``kvcli analyze``, drawn from a result dictionary or a loaded ``analysis.json``.

Needs matplotlib (:func:`kvcli.io.plots.pyplot` raises :class:`~kvcli.errors.KvcliError` without it);
it is imported only when a figure is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """Draw the four figures from a result dictionary (or a loaded ``analysis.json``); returns the paths."""
    return [plot_entropy(result, out_dir / "entropy.png"), plot_similarity(result, out_dir / "similarity.png"),
            plot_positions(result, out_dir / "positions.png"),
            plot_positions_by_layer(result, out_dir / "positions_by_layer.png"),
            plot_wavelet(result, out_dir / "wavelet.png")]


def plot_entropy(result: dict, path: Path) -> Path:
    """Entropy and sparsity against depth, one thin line per head and the mean in bold."""
    from kvcli.io.plots import pyplot, save_figure

    plt = pyplot()
    att = result["attention"]
    layers = list(range(att["layers"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    for axis, key, mean_key, title in (
            (left, "entropy_bits", "layer_entropy_bits", "entropy (bits)"),
            (right, "keys_fraction", "layer_keys_fraction", f"share of keys holding {att['mass']:.0%} of attention")):
        for h, row in enumerate(torch.tensor(att[key]).T.tolist()):
            axis.plot(layers, row, color="0.75", linewidth=0.7, label="heads" if h == 0 else None)
        axis.plot(layers, att[mean_key], color="C0", linewidth=2, marker="o", markersize=3, label="mean of heads")
        axis.set_xlabel("layer")
        axis.set_title(title, fontsize=9)
        axis.grid(alpha=0.3)
    right.set_yscale("log")
    right.yaxis.set_major_formatter(lambda value, _: f"{value:.1%}".replace(".0%", "%"))
    left.legend(loc="best", fontsize=8)
    fig.suptitle(f"attention of the last {result['queries']} queries over {result['tokens']:,} tokens", fontsize=10)
    return save_figure(fig, path)


def _grid(count: int) -> tuple[int, int]:
    cols = math.ceil(math.sqrt(count))
    return math.ceil(count / cols), cols


def plot_similarity(result: dict, path: Path) -> Path:
    """The mean similarity matrix and one per head, PoD's groups outlined on the diagonal.

    The grid has one spare cell for the colour bar, which keeps every panel the same size.
    """
    from matplotlib.patches import Rectangle

    from kvcli.io.plots import pyplot, save_figure

    plt = pyplot()
    sim = result["similarity"]
    group = result["attention"]["heads"] // result["attention"]["kv_heads"]
    panels = [("mean over heads", sim["mean"], sim["mean_matrix_groups"])]
    panels += [(f"head {h} (KV {h // group}): {len(g)} group{'s' if len(g) > 1 else ''}", m, g)
               for h, (m, g) in enumerate(zip(sim["per_head"], sim["groups"], strict=True))]
    rows, cols = _grid(len(panels) + 1)
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols, 2.2 * rows), squeeze=False)
    cells = list(axes.flat)
    image = None
    for axis, (title, matrix, groups) in zip(cells, panels, strict=False):
        image = axis.imshow(matrix, vmin=0, vmax=1, cmap="viridis", origin="lower")
        for group in groups:
            axis.add_patch(Rectangle((group[0] - 0.5, group[0] - 0.5), len(group), len(group), fill=False,
                                     edgecolor="red", linewidth=1.0))
        axis.set_title(title, fontsize=8)
        axis.tick_params(labelsize=6)
    for axis in cells[len(panels):]:
        axis.axis("off")
    bar = cells[len(panels)].inset_axes((0.1, 0.1, 0.08, 0.8))
    fig.colorbar(image, cax=bar, label="1 - JS")
    fig.suptitle(f"inter-layer attention similarity (layer x layer); PoD groups at {sim['threshold']} in red",
                 fontsize=10)
    return save_figure(fig, path)


def plot_positions(result: dict, path: Path) -> Path:
    """Methods x position bins: the fraction of (layer, KV head) slots still holding each bin."""
    from kvcli.io.plots import pyplot, save_figure

    plt = pyplot()
    pos = result["positions"]
    names = list(pos["methods"])
    matrix = [pos["methods"][n]["kept_fraction"] for n in names]
    fig, axis = plt.subplots(figsize=(9, 0.45 * len(names) + 1.4))
    image = axis.imshow(matrix, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest",
                        extent=(0, result["tokens"], len(names) - 0.5, -0.5))
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("position in the prompt")
    fig.colorbar(image, ax=axis, label="kept (share of layers x heads)")
    axis.set_title(f"positions kept at cache {pos['cache']}, block {pos['block']}", fontsize=10)
    return save_figure(fig, path)


def plot_positions_by_layer(result: dict, path: Path) -> Path:
    """One panel per method, layers x position bins (TreeKV Figure 1's layout), averaged over KV heads."""
    from kvcli.io.plots import pyplot, save_figure

    plt = pyplot()
    pos = result["positions"]
    edges = torch.tensor(pos["bin_edges"], dtype=torch.float64)
    widths = edges[1:] - edges[:-1]
    names = list(pos["methods"])
    cols = min(len(names), 4)
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.2 * rows), squeeze=False)
    for axis, name in zip(axes.flat, names, strict=False):
        row = pos["methods"][name]
        fraction = torch.tensor(row["counts"], dtype=torch.float64) / (widths * row["kv_heads"])
        axis.imshow(fraction.tolist(), aspect="auto", cmap="Greys", vmin=0, vmax=1, origin="lower",
                    interpolation="nearest", extent=(0, result["tokens"], -0.5, len(row["counts"]) - 0.5))
        axis.set_title(name, fontsize=9)
        axis.tick_params(labelsize=6)
    for axis in list(axes.flat)[len(names):]:
        axis.axis("off")
    for axis in axes[:, 0]:
        axis.set_ylabel("layer", fontsize=8)
    for axis in axes[-1, :]:
        axis.set_xlabel("position", fontsize=8)
    fig.suptitle(f"kept positions per layer at cache {pos['cache']} (dark = kept by every KV head)", fontsize=10)
    return save_figure(fig, path)


def plot_wavelet(result: dict, path: Path) -> Path:
    """Magnitude of each Haar detail level by position, without the first and last ``edge`` tokens."""
    from kvcli.io.plots import pyplot, save_figure

    plt = pyplot()
    wav = result["wavelet"]
    edges = wav["bin_edges"]
    low, high = wav["start"] + wav["edge"], result["tokens"] - wav["edge"]
    inside = [i for i in range(len(edges) - 1) if edges[i] >= low and edges[i + 1] <= high]
    centres = [(edges[i] + edges[i + 1]) / 2 for i in inside]
    fig, axis = plt.subplots(figsize=(7, 3.6))
    for level, (name, curve) in enumerate(wav["magnitude"].items()):
        axis.plot(centres, [curve[i] for i in inside], label=f"{name} (level {level + 1})", linewidth=1.2)
    axis.set_yscale("log")
    axis.set_xlabel(f"position (first and last {wav['edge']} left out)")
    axis.set_ylabel("mean |Rec(D_l)|")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title("Haar detail magnitude of a ∘ V for the last query (mean over layers and heads)", fontsize=9)
    return save_figure(fig, path)
