"""Executors: where client steps run. The round loop talks to them only through this interface.

An executor is built from the config with typed arguments (``federation.executor``) and started
with the run's :class:`~fedhet.federation.runtime.RuntimeRecipe`: a picklable description from
which a worker rebuilds the same client runtime (the resolved config, not live objects). Client
tasks carry their state and download; evaluation sends client tasks, never data, so no state
hides in a worker between calls and a worker can live in another process or on another machine.

* :class:`SequentialExecutor` (default): in-process, one client after another, reusing one live
  module per architecture.
* :class:`ProcessExecutor`: a pool of local worker processes, each rebuilding the runtime from
  the recipe; independent client steps run concurrently with ``threads_per_worker`` intra-op
  threads each and give the numbers of the sequential executor at the same thread count. The
  workers end within a second of the driver's death, however it dies (:func:`die_with_parent`).
* :class:`~fedhet.federation.ray_executor.RayExecutor` (``fedhet[ray]``): the same on Ray actors,
  on this machine (whole or fractional GPUs per worker) or on a running Ray cluster.

The lock-step collaborative phase needs every participant live in one process, so every
executor runs it in the driver's runtime.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from torch import Tensor

from fedhet.errors import ConfigError
from fedhet.federation.runtime import ClientResult, ClientRuntime, ClientTask, RuntimeRecipe

EvalCounts = list[tuple[Tensor, Tensor]]


class Executor(ABC):
    """Runs client steps for the round loop."""

    runtime: ClientRuntime

    def start(self, recipe: RuntimeRecipe, runtime: ClientRuntime) -> None:
        """Called once by the loop: the recipe workers rebuild from, and the driver's own runtime."""
        self.recipe = recipe
        self.runtime = runtime

    @abstractmethod
    def fit_clients(
        self, tasks: Sequence[ClientTask], on_result: Callable[[int], None] | None = None
    ) -> list[ClientResult]:
        """Run each task's local stages; results in task order. ``on_result(done)`` after each client ends."""

    def fit_collaborative(self, tasks: Sequence[ClientTask]) -> tuple[list[ClientResult], int, int]:
        """The lock-step phase and the local stages that follow it (in the driver: all participants live at once)."""
        return self.runtime.fit_collaborative(tasks)

    @abstractmethod
    def evaluate(self, tasks: Sequence[ClientTask], apply_download: bool = True) -> list[EvalCounts]:
        """Evaluate each task's client on its evaluation sets (test columns, then validation columns)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook: in-process executors hold nothing
        """Release workers (the loop calls this in a ``finally``)."""


def largest_first(tasks: Sequence[ClientTask], runtime: ClientRuntime) -> list[int]:
    """Task indices, the clients with most training examples first.

    Parallel executors hand tasks out in this order so the longest client steps start first and a
    skewed partition does not leave one worker finishing alone; per-client seeding makes the
    numbers independent of the order.
    """
    scenario = runtime.scenario
    # a lazily generated scenario knows its sizes without building the clients' data
    size_of = getattr(scenario, "client_train_size", None) or (lambda cid: len(scenario.client_data(cid).train))
    try:
        sizes = [size_of(task.client_id) for task in tasks]
    except Exception:  # a scenario without per-client training sets: task order
        return list(range(len(tasks)))
    return sorted(range(len(tasks)), key=lambda i: -sizes[i])


class SequentialExecutor(Executor):
    """In-process, one client after another (the default; deterministic and cheapest on one machine)."""

    def fit_clients(
        self, tasks: Sequence[ClientTask], on_result: Callable[[int], None] | None = None
    ) -> list[ClientResult]:
        results = []
        for task in tasks:
            results.append(self.runtime.fit_client(task))
            if on_result is not None:
                on_result(len(results))
        return results

    def evaluate(self, tasks: Sequence[ClientTask], apply_download: bool = True) -> list[EvalCounts]:
        return [self.runtime.evaluate_client(task, apply_download) for task in tasks]


# ---------------------------------------------------------------------------------------------
# worker-process side: one runtime per process, rebuilt from the recipe
# ---------------------------------------------------------------------------------------------
_WORKER_RUNTIME: ClientRuntime | None = None


def build_worker_runtime(recipe: RuntimeRecipe, threads: int) -> ClientRuntime:
    """Set up a worker process (``threads`` intra-op threads, quiet Lightning) and rebuild the runtime.

    Shared by every executor whose workers live in other processes (local pools, Ray actors), so
    they all run clients with the same numerics as the driver at the same thread count.
    """
    import torch

    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    from fedhet.core.quiet import silence_lightning

    silence_lightning()
    return recipe.build()


#: How often a worker's watchdog checks that its parent lives (seconds).
PARENT_POLL_S = 0.2


def die_with_parent(parent_pid: int) -> None:
    """End this worker process as soon as ``parent_pid`` (the driver that started it) is gone.

    A pool worker otherwise outlives a driver killed with ``kill -9`` for as long as its client
    step lasts (seconds of full CPU per worker), since nothing tells it the results have nowhere
    to go. On Linux the kernel sends it ``SIGKILL`` when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``); everywhere, a daemon thread polls ``os.getppid()`` and exits
    when the worker has been re-parented. Both check once right away: the parent may have died
    while the worker was still starting.
    """
    import ctypes
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog alone
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)  # no clean-up: the results and the run directory belong to the dead parent

    threading.Thread(target=watch, name="fedhet-parent-watchdog", daemon=True).start()


def _start_worker(recipe: RuntimeRecipe, threads: int, parent_pid: int | None = None) -> None:
    global _WORKER_RUNTIME
    if parent_pid is not None:
        die_with_parent(parent_pid)
    _WORKER_RUNTIME = build_worker_runtime(recipe, threads)


def _worker_fit(task: ClientTask) -> ClientResult:
    assert _WORKER_RUNTIME is not None, "worker started without a runtime"
    return _WORKER_RUNTIME.fit_client(task)


def _worker_evaluate(task: ClientTask, apply_download: bool) -> EvalCounts:
    assert _WORKER_RUNTIME is not None, "worker started without a runtime"
    return _WORKER_RUNTIME.evaluate_client(task, apply_download)


class ProcessExecutor(Executor):
    """Client steps in a pool of local worker processes, each with its own runtime from the recipe.

    Args:
        workers: worker processes (independent clients run this many at a time).
        threads_per_worker: intra-op threads of each worker. On CPUs, several single-threaded
            workers beat one multi-threaded process for the small batches of FL clients.
    """

    def __init__(self, workers: int = 2, threads_per_worker: int = 1) -> None:
        if workers < 1 or threads_per_worker < 1:
            raise ConfigError(
                f"federation.executor: workers={workers} and threads_per_worker={threads_per_worker} must be >= 1"
            )
        self.workers = workers
        self.threads_per_worker = threads_per_worker
        self._pool: ProcessPoolExecutor | None = None

    def start(self, recipe: RuntimeRecipe, runtime: ClientRuntime) -> None:
        super().start(recipe, runtime)
        self._pool = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(recipe, self.threads_per_worker, os.getpid()),
        )

    def _map(self, fn: Any, *iterables: Any) -> list[Any]:
        if self._pool is None:
            raise RuntimeError("ProcessExecutor used before start() or after shutdown()")
        return list(self._pool.map(fn, *iterables))

    def fit_clients(
        self, tasks: Sequence[ClientTask], on_result: Callable[[int], None] | None = None
    ) -> list[ClientResult]:
        if self._pool is None:
            raise RuntimeError("ProcessExecutor used before start() or after shutdown()")
        futures = {index: self._pool.submit(_worker_fit, tasks[index]) for index in largest_first(tasks, self.runtime)}
        if on_result is not None:
            for done, _ in enumerate(as_completed(futures.values()), start=1):
                on_result(done)
        return [futures[index].result() for index in range(len(tasks))]

    def evaluate(self, tasks: Sequence[ClientTask], apply_download: bool = True) -> list[EvalCounts]:
        return self._map(_worker_evaluate, tasks, [apply_download] * len(tasks))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


EXECUTORS: dict[str, type[Executor]] = {"sequential": SequentialExecutor, "process": ProcessExecutor}
