"""Headless matplotlib for `kvcli bench` and `kvcli analyze`.

matplotlib is an optional extra (`pip install 'kvcli[plot]'`): results are still written as JSON
without it, and the commands say once how to get the pictures.
"""

from __future__ import annotations

from pathlib import Path

from kvcli.errors import KvcliError


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or a clear error if it is missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise KvcliError("plots need matplotlib: pip install 'kvcli[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` and free it (long grids draw many figures)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
