"""Atomic file writes that need neither torch nor the run loop.

The experiment drivers (``fedhet sweep``, ``fedhet bench``) and the figure writer use these, so
that a reader (a resumed grid, a notebook, a rerun) never sees a half-written table or image:
every file is written to a temporary name in the same directory and renamed over the target.
They live apart from :mod:`fedhet.tracking.rundir` so that the drivers start without importing
torch.

A write that fails (a full disk, a read-only directory) removes its temporary file and raises a
one-line :class:`~fedhet.errors.DiskError` naming the target, never a traceback or a stray
``.name.tmp<pid>`` file; :func:`remove_stale_temporaries` clears those a killed writer left.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fedhet.errors import disk_error

#: ``.<name>.tmp<pid>``: the temporary names of every atomic writer here and in ``fedhet.core.state``.
TEMPORARY = re.compile(r"^\..+\.tmp\d+$")


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def atomic_write(path: str | Path, write: Callable[[IO[Any]], None], mode: str = "wb") -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync, then rename it over ``path``.

    On any failure the temporary file is removed; a full disk or a read-only directory becomes a
    one-line :class:`~fedhet.errors.DiskError` naming ``path``.
    """
    path = Path(path)
    tmp = _temporary(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        error = disk_error(path, exc) if isinstance(exc, Exception) else None
        if error is not None:
            raise error from None
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync, then rename."""
    atomic_write(path, lambda handle: handle.write(text), mode="w")


def atomic_write_bytes(path: str | Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, then rename."""
    atomic_write(path, lambda handle: handle.write(data))


def atomic_savefig(figure: Any, path: str | Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG through a temporary file, then rename."""
    atomic_write(path, lambda handle: figure.savefig(handle, dpi=dpi, format="png"))


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the ``.<name>.tmp<pid>`` files a killed writer left in ``directory`` (not below it).

    Call it only while holding the directory (a run's lock): a live writer's file looks the same.
    """
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if TEMPORARY.match(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
