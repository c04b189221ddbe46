"""The run directory: the results contract of design.md section 5.

Layout::

    <run_dir>/config.yaml      resolved config (written before round 0)
    <run_dir>/metrics.jsonl    one JSON line per round, appended as each round ends
    <run_dir>/checkpoint.pt    state after the last completed round (atomic; weights_only loadable)
    <run_dir>/clients/         per-client states when the disk state store is used
    <run_dir>/summary.json     final and best metrics, communication, wall time, the environment
                               (versions, CPU, threads, GPU: :func:`run_environment`); written last

``summary.json`` exists only for a finished run, so a directory without it is never mistaken
for a complete result. Every file is written atomically (temporary file, fsync, rename).

A new run claims its directory with an exclusive ``os.mkdir`` (:meth:`RunDirectory.claim`): two
runs started in the same second with the same method and seed (parallel sweep agents, a job
array) used to share ``runs/<method>-<time>-s<seed>/`` and interleave their metrics; now the
second one gets ``...-s<seed>-2``. A directory named by the user must be new or empty.

Every run, new or resumed, also holds ``<run_dir>/.fedhet.lock`` with an exclusive ``flock``
for its whole life (:meth:`RunDirectory.lock`). ``mkdir`` alone cannot settle two runs given the
same ``--run_dir`` (both may find it empty: the second mkdir fails, then the directory is still
empty until the first writes ``config.yaml``), nor a ``--resume`` of a run that is still going.
The kernel drops the lock when its process dies, however it dies, so a killed run resumes
without any clean-up; a run that ends normally removes the lock file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from fedhet.core.state import atomic_torch_save, safe_torch_load
from fedhet.errors import CheckpointError, ConfigError, DiskError, disk_error
from fedhet.files import atomic_write_text, remove_stale_temporaries

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no run lock, mkdir's exclusivity only
    fcntl = None  # type: ignore[assignment]

CHECKPOINT_FORMAT = 1
LOCK_NAME = ".fedhet.lock"

__all__ = ["CHECKPOINT_FORMAT", "LOCK_NAME", "RunDirectory", "RunDirectoryCallback"]


class RunDirectory:
    """Reads and writes one run's files.

    Args:
        path: the run directory.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._created = False  # made by claim(): release() may remove it
        self._lock_fd: int | None = None  # the open, flock-ed LOCK_NAME while this process runs here

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
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise (disk_error(base.parent, exc) or exc) from None
        candidates = [base] + ([base.with_name(f"{base.name}-{n}") for n in range(2, 1000)] if unique else [])
        for candidate in candidates:
            claimed = cls(candidate)
            try:
                os.mkdir(candidate)  # atomic: exactly one process succeeds for a name
            except FileExistsError:
                if unique:
                    continue
                claimed.check_available()  # a file or a finished run: say so before locking
                claimed.lock()  # a second run given the same --run_dir stops here ...
                try:
                    claimed.check_available()  # ... or here, if the first one already wrote into it
                except BaseException:
                    claimed.unlock()
                    raise
                return claimed  # an empty directory the user made for this run
            except OSError as exc:
                raise (disk_error(candidate, exc) or exc) from None
            claimed._created = True
            try:
                claimed.lock()
            except ConfigError:
                raise  # another run locked it first and owns it now: leave it alone
            except BaseException:
                claimed.release()
                raise
            return claimed
        raise ConfigError(f"run directories '{base}' to '{candidates[-1]}' all exist; choose another --run_dir")

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_NAME

    def lock(self) -> None:
        """Take the run's exclusive lock, held until :meth:`unlock` or this process ends.

        Raises:
            ConfigError: another live process holds it (a run in this directory is going on).
            DiskError: the directory is read-only (the lock file cannot be created).
        """
        if fcntl is None or self._lock_fd is not None:
            return
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                raise ConfigError(f"run directory '{self.path}' does not exist; check the path") from None
            except OSError as exc:
                raise (disk_error(self.lock_path, exc) or exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
                os.close(fd)
                raise ConfigError(
                    f"run directory '{self.path}' is in use by another fedhet run (process {holder or '?'}); "
                    "wait for it to end, or choose another --run_dir"
                ) from None
            # The file may have been removed by its previous holder between open and flock (unlock
            # unlinks it): a lock on that orphan excludes nobody, so take the current file instead.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        except OSError as exc:
            os.close(fd)
            raise (disk_error(self.lock_path, exc) or exc) from None
        self._lock_fd = fd

    def unlock(self) -> None:
        """Release the lock and remove its file (a run ended; a killed run's lock dies with its process)."""
        if self._lock_fd is None:
            return
        try:
            self.lock_path.unlink(missing_ok=True)  # before closing: nobody can lock it in between
        except OSError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def remove_stale_temporaries(self) -> list[Path]:
        """Delete temporary files a killed writer left (``.checkpoint.pt.tmp<pid>`` ...); call while locked."""
        return remove_stale_temporaries(self.path)

    def check_available(self) -> None:
        """Refuse a directory chosen for a new run that exists and is not empty (cheap; run before any work).

        Raises:
            ConfigError: the path exists and is a file or a non-empty directory.
            DiskError: the directory, or the nearest existing one above a new one, is not writable.
        """
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(
                f"run directory '{self.path}' is a file, not a directory; choose another --run_dir "
                "(a new or an empty directory)"
            )
        existing = next((p for p in (self.path, *self.path.parents) if p.exists()), None)
        if existing is not None and existing.is_dir() and not os.access(existing, os.W_OK):
            # access() answers EROFS for a read-only mount (root included): say so before any work
            raise DiskError(existing, "it is read-only (a read-only file system or no write permission)",
                            "make it writable")
        if self.path.exists() and any(p.name != LOCK_NAME for p in self.path.iterdir()):
            raise ConfigError(
                f"run directory '{self.path}' already exists and is not empty; continue an interrupted run "
                f"with 'fedhet fit --resume {self.path}', or choose another --run_dir"
            )

    def release(self) -> None:
        """Undo :meth:`claim` after a start-up failure: remove the directory again if it is ours and empty.

        Only a directory this process made is removed, with an empty ``clients/`` left by the disk
        state store, and only with ``os.rmdir``, so nothing a run wrote is ever deleted. The lock
        is released (its file removed) in any case.
        """
        self.unlock()
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
        """Append one line; a failed write (full disk) is cut off again, so the file holds whole lines only."""
        line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        try:
            fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise (disk_error(self.metrics_path, exc) or exc) from None
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(line):
                written += os.write(fd, line[written:])
            os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise (disk_error(self.metrics_path, exc) or exc) from None
        finally:
            os.close(fd)

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


def default_run_path(name: str, seed: int) -> Path:
    """``runs/<name>-<time>-s<seed>``: where a run given no ``--run_dir`` goes (made unique when claimed)."""
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-s{seed}"


def run_environment() -> dict[str, Any]:
    """What a run's numbers were computed on: versions, CPU model, threads and the GPU if one was used.

    The same seed gives the same numbers on one machine and software stack; on another CPU
    (other vector instructions, so other float rounding) or another torch, training takes another
    path. A page whose cells ran on several machines (a long bench continued from its json) says
    so from this record.
    """
    import platform

    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_initialized() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
            "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "gpu": gpu}  # fmt: skip


class RunDirectoryCallback:
    """Round callback: metrics line, then checkpoint, each round; the summary (with its environment) at the end."""

    def __init__(self, run_dir: RunDirectory, extra_state: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.extra_state = extra_state or {}

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        self.run_dir.append_metrics(record)
        self.run_dir.save_checkpoint({**loop.checkpoint_state(), **self.extra_state})

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        self.run_dir.write_summary({**summary, "environment": run_environment()})
