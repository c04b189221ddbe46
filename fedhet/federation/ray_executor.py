"""Client steps on Ray actors: local cores, one big GPU shared by fractions, or a Ray cluster.

Ray is imported only when a :class:`RayExecutor` is built, so ``import fedhet`` never imports it
and a missing Ray is one line (``install fedhet[ray]``) when a config asks for this executor.

Each actor holds one :class:`~fedhet.federation.runtime.ClientRuntime` rebuilt from the run's
picklable :class:`~fedhet.federation.runtime.RuntimeRecipe` (one live module per architecture,
as in the sequential executor) and runs the client tasks it is given. What travels per task is
the client's kept state and its download, and back its result (upload, new state, scalars):

* the recipe goes through Ray's object store once, for all actors;
* a download shared by several clients (FedAvg's global model, a per-architecture average) is
  put in the object store once per call, not once per task;
* tensors travel as NumPy arrays (:func:`tensor_to_transport`), which Ray moves through its
  shared-memory object store without pickling their bytes; a ResNet-18 state (45 MB) goes to a
  worker and back about three times faster than with PyTorch's own pickling;
* a worker keeps the state each client left there (its last fit): the next evaluation of that
  client, and its next round, go to the same worker with the state left out of the task, as long
  as the driver still holds exactly that state (same object), so most states travel once per
  round (back to the driver, which keeps the state store) instead of three times;
* each result is fetched once and its object released at once: the driver keeps only what the
  round loop keeps (the state store and the uploads), no copies in Ray.

Tasks are handed out one per idle actor, the clients with most training examples first, each to
the worker holding its state when there is one, so a skewed partition does not leave one worker
finishing alone; an idle worker with nothing of its own takes the largest task still waiting
elsewhere (its state is sent). Per-client seeding makes the numbers independent of which worker
runs which client, and of their order.

The lock-step collaborative phase (every participant live at once) and trained server stages
run in the driver, as with every executor.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from fedhet.errors import ConfigError, FedhetError, TrainingError
from fedhet.federation.executors import EvalCounts, Executor, build_worker_runtime, largest_first
from fedhet.federation.runtime import ClientResult, ClientRuntime, ClientTask, RuntimeRecipe
from fedhet.hparams import NonNegativeFloat, PositiveFloat, PositiveInt

log = logging.getLogger("fedhet")


def import_ray() -> Any:
    """The ``ray`` module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "federation.executor: RayExecutor needs Ray, which is not installed; install fedhet[ray] "
            "(pip install 'fedhet[ray]')"
        ) from None
    return ray


def tensor_to_transport(tensor: Any) -> tuple[str, Any]:
    """How a tensor travels between Ray processes: as a NumPy array where it can.

    Ray serialises NumPy arrays out of band (zero-copy into its shared-memory object store), while
    a ``torch.Tensor`` is pickled byte by byte. Tensors NumPy cannot hold (on a GPU, bfloat16,
    requiring grad) keep PyTorch's pickling, so they arrive exactly as they left.
    """
    import torch

    if tensor.device.type == "cpu" and not tensor.requires_grad and tensor.dtype != torch.bfloat16:
        return ("numpy", tensor.numpy())
    return ("pickle", pickle.dumps(tensor))


def tensor_from_transport(packed: tuple[str, Any]) -> Any:
    """The tensor :func:`tensor_to_transport` sent, in memory of its own (never the read-only object store)."""
    import numpy as np
    import torch

    kind, data = packed
    if kind == "numpy":
        return torch.from_numpy(np.array(data))  # a writable copy: optimizers update loaded buffers in place
    return pickle.loads(data)


def use_tensor_transport(ray: Any) -> None:
    """Send tensors from this process as NumPy arrays (:func:`tensor_to_transport`); the receiver needs nothing."""
    import torch

    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_transport, deserializer=tensor_from_transport)


class RayClientWorker:
    """A Ray actor's body: one client runtime rebuilt from the recipe, running the tasks it is sent.

    It keeps the state each client's last fit here produced (``kept``), so the driver can leave
    the state out of the next task of that client (``cached=True``); ``forget`` lists clients whose
    kept state the driver no longer holds (superseded elsewhere, or out of the round).
    """

    def __init__(self, recipe: RuntimeRecipe, threads: int) -> None:
        import ray

        use_tensor_transport(ray)
        self.runtime = build_worker_runtime(recipe, threads)
        self.kept: dict[int, Any] = {}

    def ready(self) -> str:
        """Where the worker imported fedhet from, once its runtime is built."""
        import fedhet

        return fedhet.__file__ or ""

    def _task(self, task: ClientTask, download: Any, cached: bool, forget: Sequence[int]) -> ClientTask:
        for client_id in forget:
            self.kept.pop(client_id, None)
        if not cached:
            return dataclasses.replace(task, download=download)
        if task.client_id not in self.kept:
            raise RuntimeError(f"RayExecutor: client {task.client_id} has no state kept on this worker")
        return dataclasses.replace(task, download=download, state=self.kept[task.client_id])

    def fit(self, task: ClientTask, download: Any, cached: bool = False, forget: Sequence[int] = ()) -> ClientResult:
        """One client's round; ``download`` arrives separately (shared through the object store)."""
        result = self.runtime.fit_client(self._task(task, download, cached, forget))
        self.kept[task.client_id] = result.state
        return result

    def evaluate(
        self, task: ClientTask, download: Any, apply_download: bool, cached: bool = False, forget: Sequence[int] = ()
    ) -> EvalCounts:
        """One client's evaluation counts."""
        return self.runtime.evaluate_client(self._task(task, download, cached, forget), apply_download)


class RayExecutor(Executor):
    """Client steps on Ray actors, each with its own client runtime rebuilt from the recipe.

    Args:
        workers: actors (clients run this many at a time); ``None``: as many as the cluster's
            CPUs (and GPUs, when ``gpus_per_worker`` > 0) hold at the requested shares.
        cpus_per_worker: CPUs Ray reserves for each actor.
        gpus_per_worker: GPUs per actor; fractions share one GPU (``0.25``: four workers on one
            big GPU). ``0``: CPU-only actors.
        address: ``None`` starts a new local Ray instance on this machine (shut down with the
            run); otherwise the address of a running cluster to join (``"auto"``: the one
            ``ray start`` started on this machine, ``"host:6379"``, ``"ray://host:10001"``), which
            is left running. A Ray instance already started in this process is used as it is.
        threads_per_worker: intra-op threads of each actor (``None``: ``cpus_per_worker``,
            at least 1). On CPUs, several single-threaded workers beat one multi-threaded
            process for the small batches of FL clients (docs/performance.md).
    """

    def __init__(
        self,
        workers: PositiveInt | None = None,
        cpus_per_worker: PositiveFloat = 1.0,
        gpus_per_worker: NonNegativeFloat = 0.0,
        address: str | None = None,
        threads_per_worker: PositiveInt | None = None,
    ) -> None:
        if workers is not None and workers < 1:
            raise ConfigError(f"federation.executor: workers={workers} must be >= 1 (or null: as many as fit)")
        if cpus_per_worker <= 0 or gpus_per_worker < 0:
            raise ConfigError(
                f"federation.executor: cpus_per_worker={cpus_per_worker} must be > 0 and "
                f"gpus_per_worker={gpus_per_worker} >= 0"
            )
        if threads_per_worker is not None and threads_per_worker < 1:
            raise ConfigError(f"federation.executor: threads_per_worker={threads_per_worker} must be >= 1")
        import_ray()
        self.workers = workers
        self.cpus_per_worker = float(cpus_per_worker)
        self.gpus_per_worker = float(gpus_per_worker)
        self.address = address
        self.threads_per_worker = threads_per_worker or max(1, int(cpus_per_worker))
        self._actors: list[Any] = []
        self._held: dict[int, tuple[int, Any]] = {}  # client -> (worker keeping its state, the driver's copy)
        self._forget: list[list[int]] = []  # per worker: clients whose kept state it should drop
        self.states_sent = 0  # tasks that carried a client state to a worker
        self.states_kept = 0  # tasks that used the state their worker kept instead
        self._started_ray = False
        self.worker_fedhet: list[str] = []  # where each worker imported fedhet from (set by start)

    # ------------------------------------------------------------------ start-up
    def start(self, recipe: RuntimeRecipe, runtime: ClientRuntime) -> None:
        super().start(recipe, runtime)
        ray = import_ray()
        if self.address is None and runtime.device.type == "cuda" and self.gpus_per_worker == 0:
            raise ConfigError(
                "federation.executor: the trainer runs clients on a GPU but gpus_per_worker=0; set "
                "gpus_per_worker (e.g. 0.5: two workers share one GPU) or trainer.accelerator=cpu"
            )
        if self.address is None and self.gpus_per_worker > 0 and not _local_gpu():
            raise ConfigError(
                f"federation.executor: gpus_per_worker={self.gpus_per_worker} but this machine has no GPU; "
                "set gpus_per_worker=0"
            )
        if not ray.is_initialized():
            options: dict[str, Any] = {
                "include_dashboard": False,
                "logging_level": logging.ERROR,
                "log_to_driver": True,
            }
            if self.address is None:
                # a local instance with room for the asked-for workers (oversubscribing is the user's call),
                # whose workers import this fedhet (not another checkout an editable install points to)
                wanted = self.cpus_per_worker * (self.workers or 1)
                options["address"] = "local"  # a new instance, never one somebody started on this machine
                options["num_cpus"] = max(os.cpu_count() or 1, math.ceil(wanted))
                paths = [_fedhet_root(), os.environ.get("PYTHONPATH", "")]
                options["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
            else:
                options["address"] = self.address
            try:
                ray.init(**options)
            except (ConnectionError, ValueError, RuntimeError) as error:
                where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
                raise ConfigError(
                    f"federation.executor: could not start or join {where}: {_first_line(error)}"
                ) from None
            self._started_ray = True
        try:
            workers = self._worker_count(ray.cluster_resources())
            actor_class = ray.remote(RayClientWorker).options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0
            )
            recipe_ref = ray.put(recipe)  # one copy in the object store, read by every actor
            use_tensor_transport(ray)
            self._actors = [actor_class.remote(recipe_ref, self.threads_per_worker) for _ in range(workers)]
            self._forget = [[] for _ in self._actors]
            self.worker_fedhet = [self._get(actor.ready.remote(), None) for actor in self._actors]
            del recipe_ref
        except BaseException:
            self.shutdown()
            raise

    def _worker_count(self, resources: dict[str, float]) -> int:
        """The number of actors: as asked, or as many as fit; refuse a local demand that can never be met."""
        cpus, gpus = float(resources.get("CPU", 0.0)), float(resources.get("GPU", 0.0))
        fit = int(cpus // self.cpus_per_worker + 1e-9)
        if self.gpus_per_worker > 0:
            fit = min(fit, int(gpus // self.gpus_per_worker + 1e-9))
        workers = self.workers if self.workers is not None else max(1, fit)
        if self.gpus_per_worker > 0 and gpus == 0:
            raise ConfigError(
                f"federation.executor: gpus_per_worker={self.gpus_per_worker} but the Ray cluster has no GPU; "
                "set gpus_per_worker=0"
            )
        if self.address is None and workers > fit:
            raise ConfigError(
                f"federation.executor: {workers} workers x ({self.cpus_per_worker} CPUs, {self.gpus_per_worker} GPUs) "
                f"do not fit this machine's Ray instance ({cpus:g} CPUs, {gpus:g} GPUs); lower workers or the shares"
            )
        return workers

    # ------------------------------------------------------------------ client steps
    def fit_clients(
        self, tasks: Sequence[ClientTask], on_result: Callable[[int], None] | None = None
    ) -> list[ClientResult]:
        participants = {task.client_id for task in tasks}
        for client_id in [c for c in self._held if c not in participants]:
            self._release(client_id)  # out of this round: its worker stops keeping it
        return self._run("fit", tasks, (), on_result)

    def evaluate(self, tasks: Sequence[ClientTask], apply_download: bool = True) -> list[EvalCounts]:
        return self._run("evaluate", tasks, (apply_download,), None, send_downloads=apply_download)

    def _release(self, client_id: int) -> None:
        """Forget where a client's state is kept; its worker drops it with its next call."""
        worker, _ = self._held.pop(client_id)
        self._forget[worker].append(client_id)

    def _keeper(self, task: ClientTask) -> int | None:
        """The worker keeping exactly this task's state, if any (a stale copy is released)."""
        held = self._held.get(task.client_id)
        if held is None:
            return None
        if task.state is not None and held[1] is task.state:
            return held[0]
        self._release(task.client_id)  # the driver moved on from that state (collaboration, resume, ...)
        return None

    def _run(
        self,
        method: str,
        tasks: Sequence[ClientTask],
        extra: tuple[Any, ...],
        on_result: Callable[[int], None] | None,
        send_downloads: bool = True,
    ) -> list[Any]:
        """Hand the tasks to idle actors one at a time; results in task order, ``on_result`` as they arrive.

        A task whose state a worker keeps waits for that worker unless the others have nothing
        left to do; then it is sent, state and all, to whichever worker is idle.
        ``send_downloads=False`` (an evaluation before the download) sends none: the worker would not read them.
        """
        if not self._actors:
            raise RuntimeError("RayExecutor used before start() or after shutdown()")
        ray = import_ray()
        downloads: dict[int, Any] = {}  # id(download) -> its object-store reference, one per distinct payload
        for task in tasks if send_downloads else ():
            if task.download is not None and id(task.download) not in downloads:
                downloads[id(task.download)] = ray.put(task.download)
        # one queue per worker (the tasks whose state it keeps) and one for the rest, each largest first
        queues: list[list[int]] = [[] for _ in self._actors] + [[]]
        for index in largest_first(tasks, self.runtime):
            keeper = self._keeper(tasks[index])
            queues[-1 if keeper is None else keeper].append(index)
        idle = list(range(len(self._actors)))
        pending: dict[Any, tuple[int, int]] = {}
        results: list[Any] = [None] * len(tasks)
        done = 0
        while done < len(tasks):
            for worker in list(idle):
                index = self._next_task(queues, worker)
                if index is None:
                    continue
                idle.remove(worker)
                task = tasks[index]
                cached = self._held.get(task.client_id, (None,))[0] == worker
                self.states_kept += cached
                self.states_sent += not cached and task.state is not None
                bare = dataclasses.replace(task, download=None, state=None if cached else task.state)
                forget, self._forget[worker] = self._forget[worker], []
                call = getattr(self._actors[worker], method)
                download = downloads.get(id(task.download))
                pending[call.remote(bare, download, *extra, cached=cached, forget=forget)] = (index, worker)
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                index, worker = pending.pop(ref)
                results[index] = self._get(ref, tasks[index])
                del ref  # release the object: the driver keeps the value only
                if method == "fit":
                    client_id = tasks[index].client_id
                    if self._held.get(client_id, (worker,))[0] != worker:
                        self._release(client_id)  # run elsewhere: the old keeper's copy is stale
                    self._held[client_id] = (worker, results[index].state)
                idle.append(worker)
                done += 1
                if on_result is not None:
                    on_result(done)
        return results

    @staticmethod
    def _next_task(queues: list[list[int]], worker: int) -> int | None:
        """The worker's own largest task, else the largest unplaced one, else the largest kept elsewhere."""
        if queues[worker]:
            return queues[worker].pop(0)
        if queues[-1]:
            return queues[-1].pop(0)
        others = [queue for queue in queues[:-1] if queue]
        if not others:
            return None
        return max(others, key=len).pop(0)

    @staticmethod
    def _get(ref: Any, task: ClientTask | None) -> Any:
        """``ray.get``, with a worker's error raised as itself (fedhet errors stay one line)."""
        ray = import_ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            cause = error.cause
            if isinstance(cause, FedhetError):
                raise cause from None
            if isinstance(cause, BaseException):
                raise cause from error  # a bug: the worker's traceback is in the chained error
            raise
        except ray.exceptions.RayActorError as error:
            who = f"client {task.client_id} (round {task.round_idx})" if task is not None else "its start-up"
            raise TrainingError(
                f"a Ray worker died while running {who}: {_first_line(error)}; "
                "lower federation.executor workers if it ran out of memory"
            ) from None

    def shutdown(self) -> None:
        if not self._actors and not self._started_ray:
            return
        ray = import_ray()
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone with its cluster
                pass
        self._actors, self._held, self._forget = [], {}, []
        if self._started_ray:
            self._started_ray = False
            if ray.is_initialized():
                ray.shutdown()


def _local_gpu() -> bool:
    """Whether this machine has a CUDA GPU (what a local Ray instance would offer its actors)."""
    import torch

    return torch.cuda.is_available()


def _fedhet_root() -> str:
    """The directory this process imported the ``fedhet`` package from."""
    import fedhet

    return os.path.dirname(os.path.dirname(os.path.abspath(fedhet.__file__ or "")))


def _first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message (Ray's messages run over many lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
