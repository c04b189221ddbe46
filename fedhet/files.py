"""Atomic file writes that need neither torch nor the run loop.

The experiment drivers (``fedhet sweep``, ``fedhet bench``) and the figure writer use these, so
that a reader (a resumed grid, a notebook, a rerun) never sees a half-written table or image:
every file is written to a temporary name in the same directory and renamed over the target.
They live apart from :mod:`fedhet.tracking.rundir` so that the drivers start without importing
torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_savefig(figure: Any, path: str | Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG through a temporary file, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        figure.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
