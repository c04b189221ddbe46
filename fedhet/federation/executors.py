"""Executors: where client steps run. The round loop talks to them only through this interface.

The sequential executor runs every step in this process, one after another, reusing one live
module per architecture. A Ray executor plugs in through the same three methods: each worker
holds its own :class:`~fedhet.federation.runtime.ClientRuntime` built from the same config and
receives ``ClientTask``s (state and download travel with the task), so no state hides in a
worker between calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from fedhet.federation.runtime import ClientResult, ClientRuntime, ClientTask, CollaborationResult


class Executor(ABC):
    """Runs client steps for the round loop."""

    def bind(self, runtime: ClientRuntime) -> None:
        """Attach the runtime (the sequential executor uses it directly; remote ones ship its recipe)."""
        self.runtime = runtime

    @abstractmethod
    def fit_clients(self, tasks: Sequence[ClientTask]) -> list[ClientResult]:
        """Run local training for each task; results in task order."""

    @abstractmethod
    def collaborate(self, round_idx: int, tasks: Sequence[ClientTask]) -> CollaborationResult:
        """Run the lock-step collaborative phase over all tasks at once."""

    @abstractmethod
    def evaluate(self, tasks: Sequence[ClientTask], eval_sets: Sequence[Sequence[Any]]) -> list[list[tuple[Tensor, Tensor]]]:
        """Evaluate each task's client on its evaluation sets (``eval_sets[i]`` for task ``i``)."""

    def shutdown(self) -> None:
        """Release workers (nothing to do in-process)."""


class SequentialExecutor(Executor):
    """In-process, one client after another (the default; deterministic and cheapest on one machine)."""

    def fit_clients(self, tasks: Sequence[ClientTask]) -> list[ClientResult]:
        return [self.runtime.fit_client(task) for task in tasks]

    def collaborate(self, round_idx: int, tasks: Sequence[ClientTask]) -> CollaborationResult:
        return self.runtime.collaborate(round_idx, tasks)

    def evaluate(self, tasks: Sequence[ClientTask], eval_sets: Sequence[Sequence[Any]]) -> list[list[tuple[Tensor, Tensor]]]:
        return [self.runtime.evaluate_client(task, sets) for task, sets in zip(tasks, eval_sets)]


EXECUTORS: dict[str, type[Executor]] = {"sequential": SequentialExecutor}
