"""The run directory: the results contract of design.md section 5.

Layout::

    <run_dir>/config.yaml      resolved config (written before round 0)
    <run_dir>/metrics.jsonl    one JSON line per round, appended as each round ends
    <run_dir>/checkpoint.pt    state after the last completed round (atomic; weights_only loadable)
    <run_dir>/clients/         per-client states when the disk state store is used
    <run_dir>/summary.json     final and best metrics, communication, wall time; written last

``summary.json`` exists only for a finished run, so a directory without it is never mistaken
for a complete result. Every file is written atomically (temporary file, fsync, rename).

A new run claims its directory with an exclusive ``os.mkdir`` (:meth:`RunDirectory.claim`): two
runs started in the same second with the same method and seed (parallel sweep agents, a job
array) used to share ``runs/<method>-<time>-s<seed>/`` and interleave their metrics; now the
second one gets ``...-s<seed>-2``. A directory named by the user must be new or empty.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedhet.core.state import atomic_torch_save, safe_torch_load
from fedhet.errors import CheckpointError, ConfigError
from fedhet.files import atomic_write_text

CHECKPOINT_FORMAT = 1


class RunDirectory:
    """Reads and writes one run's files.

    Args:
        path: the run directory.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._created = False  # made by claim(): release() may remove it

    @classmethod
    def claim(cls, path: str | Path, unique: bool = False) -> RunDirectory:
        """Create a new run's directory exclusively, so that no other run can write into it.

        Args:
            path: the directory to create (its parents are created as needed).
            unique: the name is a default (``runs/<method>-<time>-s<seed>``): if it exists, take
                the first free ``<path>-2``, ``<path>-3`` ... instead. Otherwise (a ``--run_dir``
                the user chose) an existing empty directory is used and a non-empty one refused.

        Raises:
            ConfigError: ``path`` (not ``unique``) exists and is not an empty directory.
        """
        base = Path(path)
        base.parent.mkdir(parents=True, exist_ok=True)
        candidates = [base] + ([base.with_name(f"{base.name}-{n}") for n in range(2, 1000)] if unique else [])
        for candidate in candidates:
            try:
                os.mkdir(candidate)  # atomic: exactly one process succeeds for a name
            except FileExistsError:
                if unique:
                    continue
                cls(candidate).check_available()
                return cls(candidate)  # an empty directory the user made for this run
            claimed = cls(candidate)
            claimed._created = True
            return claimed
        raise ConfigError(f"run directories '{base}' to '{candidates[-1]}' all exist; choose another --run_dir")

    def check_available(self) -> None:
        """Refuse a directory chosen for a new run that exists and is not empty (cheap; run before any work).

        Raises:
            ConfigError: the path exists and is a file or a non-empty directory.
        """
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise ConfigError(
                f"run directory '{self.path}' already exists and is not empty; continue an interrupted run "
                f"with 'fedhet fit --resume {self.path}', or choose another --run_dir"
            )

    def release(self) -> None:
        """Undo :meth:`claim` after a start-up failure: remove the directory again if it is ours and empty.

        Only a directory this process made is removed, with an empty ``clients/`` left by the disk
        state store, and only with ``os.rmdir``, so nothing a run wrote is ever deleted.
        """
        if not self._created:
            return
        for directory in (self.path / "clients", self.path):
            try:
                directory.rmdir()
            except OSError:
                pass

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
        """Start a new run: write the resolved config (refusing to overwrite an existing run).

        Call it on a directory from :meth:`claim`; on any other path it is not safe against a
        second run starting at the same moment.
        """
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

    def rerun_hint(self) -> str:
        """How to start a run again that cannot continue: its own config, in a new directory.

        ``config.yaml`` records ``run_dir``, so the command names a new one explicitly.
        """
        return f"start it again from its config: fedhet fit --config {self.config_path} --run_dir {self.path}-rerun"

    def load_checkpoint(self) -> dict[str, Any]:
        """The round checkpoint, or one line saying why the run cannot continue and what to do instead."""
        if not self.checkpoint_path.is_file():
            raise CheckpointError(
                f"run '{self.path}' has no checkpoint.pt (it stopped before its first round ended), so it cannot "
                f"continue; {self.rerun_hint()}"
            )
        try:
            state = safe_torch_load(self.checkpoint_path, "checkpoint")
        except CheckpointError:
            # A truncated or foreign file: deleting it (as a generic hint would say) leaves nothing to resume.
            raise CheckpointError(
                f"checkpoint '{self.checkpoint_path}' is corrupt or not a fedhet file, so the run cannot continue; "
                f"{self.rerun_hint()}"
            ) from None
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"checkpoint '{self.checkpoint_path}' is not a fedhet round checkpoint (format {found}); "
                f"{self.rerun_hint()}"
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
