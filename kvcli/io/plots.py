"""Headless matplotlib for the plots of `kvcli bench`, `kvcli analyze` and `kvcli needle`.

matplotlib is a dependency of kvcli, so the plain install draws every plot. An environment that lost it
still gets its results as JSON: the commands check :func:`have_matplotlib` first and say once what is
missing, rather than failing after minutes of measuring.
"""

from __future__ import annotations

from pathlib import Path

from kvcli.errors import KvcliError

#: What a command says when matplotlib cannot be imported (a broken install: it is a dependency).
MISSING = "plots need matplotlib, a kvcli dependency missing here (pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or a clear error if it is missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise KvcliError(MISSING) from exc
    matplotlib.use("Agg")  # files only: no display needed, and no GUI backend chosen by the environment
    import matplotlib.pyplot as plt

    return plt


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def save_figure(fig, path: Path, tight: bool = True) -> Path:
    """Write ``fig`` as a PNG at ``path`` and free it (long grids draw many figures). ``tight=False`` for a
    figure laid out by matplotlib's constrained layout (a colour bar shared by panels), which
    ``tight_layout`` would undo. The file is replaced whole (:func:`kvcli.io.outputs.atomic_write`): a kill
    leaves the old plot or the new one, and a link at ``path`` is replaced, never written through."""
    import io

    from kvcli.io.outputs import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    pyplot().close(fig)
    atomic_write(path, buffer.getvalue())
    return path
