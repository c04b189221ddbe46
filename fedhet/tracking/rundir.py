"""The run directory: the results contract of design.md section 5.

Layout::

    <run_dir>/config.yaml      resolved config (written before round 0)
    <run_dir>/metrics.jsonl    one JSON line per round, appended as each round ends
    <run_dir>/checkpoint.pt    state after the last completed round (atomic; weights_only loadable)
    <run_dir>/clients/         per-client states when the disk state store is used
    <run_dir>/summary.json     final and best metrics, communication, wall time; written last

``summary.json`` exists only for a finished run, so a directory without it is never mistaken
for a complete result. Every file is written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedhet.core.state import atomic_torch_save, safe_torch_load
from fedhet.errors import CheckpointError

CHECKPOINT_FORMAT = 1


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class RunDirectory:
    """Reads and writes one run's files.

    Args:
        path: the run directory.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.pt"

    def is_complete(self) -> bool:
        return self.summary_path.is_file()

    def ensure_new(self) -> None:
        """Refuse to start a run where another run's results are."""
        if self.metrics_path.exists() or self.checkpoint_path.exists() or self.summary_path.exists():
            raise CheckpointError(
                f"run directory '{self.path}' already holds a run; continue it with --resume {self.path} "
                "or choose another --run_dir"
            )

    def create(self, config_yaml: str) -> None:
        """Start a new run: write the resolved config (refusing to overwrite an existing run)."""
        self.ensure_new()
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path, config_yaml)

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def truncate_metrics(self, rounds_done: int) -> None:
        """Keep the metrics lines of the first ``rounds_done`` rounds (drop a round that never checkpointed)."""
        if not self.metrics_path.exists():
            return
        kept = [
            line
            for line in self.metrics_path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("round", -1) < rounds_done
        ]
        atomic_write_text(self.metrics_path, "".join(line + "\n" for line in kept))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_torch_save({"format": CHECKPOINT_FORMAT, **state}, self.checkpoint_path)

    def load_checkpoint(self) -> dict[str, Any]:
        state = safe_torch_load(self.checkpoint_path, "checkpoint")
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"checkpoint '{self.checkpoint_path}' is not a fedhet round checkpoint (format "
                f"{state.get('format') if isinstance(state, dict) else type(state).__name__}); start a new run"
            )
        return state

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.summary_path, json.dumps(summary, indent=2, sort_keys=True) + "\n")


class RunDirectoryCallback:
    """Round callback: metrics line, then checkpoint, each round; the summary at the end."""

    def __init__(self, run_dir: RunDirectory, extra_state: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.extra_state = extra_state or {}

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        self.run_dir.append_metrics(record)
        self.run_dir.save_checkpoint({**loop.checkpoint_state(), **self.extra_state})

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        self.run_dir.write_summary(summary)
