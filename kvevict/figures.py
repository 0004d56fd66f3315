"""Figures written to files (benchmark reports and analyses share these two steps)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend: figures go to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: str | Path, **layout: Any) -> Path:
    """Lay out ``figure``, write it to ``path`` (PNG at 120 dpi; folders created) and free it."""
    figure.tight_layout(**layout)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot().close(figure)
    return path
