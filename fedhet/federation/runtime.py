"""The client-side work of a round as functions of (client state, download): no hidden globals.

:class:`ClientRuntime` owns what a worker needs to run clients: the algorithm, the scenario, the
Trainer template, and one live client module per architecture (weights are swapped in with
``load_state_dict``; modules are never rebuilt per client). Its three entry points,
:meth:`ClientRuntime.fit_client`, :meth:`ClientRuntime.collaborate` and
:meth:`ClientRuntime.evaluate_client`, take everything they need as arguments and return
everything they change, so an executor can run them in this process or on a Ray worker holding
its own runtime, and a resumed run repeats exactly what an uninterrupted one did.

Every random stream is seeded from ``(seed, purpose, round, client)`` with the global RNG
isolated, so results do not depend on the order in which clients run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedhet.algorithms.base import Algorithm, ClientModule
from fedhet.errors import TrainingError
from fedhet.federation.payloads import Payload
from fedhet.federation.state import ClientState
from fedhet.federation.trainer import OptimizerStateCarrier, TrainerTemplate, clone_state
from fedhet.seeding import derive_seed, seeded


@dataclass(frozen=True)
class ClientTask:
    """One client's work in a round: its id, committed state (``None``: fresh), and download."""

    client_id: int
    round_idx: int
    state: ClientState | None
    download: Payload | None
    receive: bool = True  # False when the download was already applied (after a collaborative phase)


@dataclass(frozen=True)
class ClientResult:
    """What a client step returns: the upload (if any), the new state, and scalars to log."""

    client_id: int
    upload: Payload | None
    state: ClientState
    metrics: dict[str, float]


@dataclass(frozen=True)
class CollaborationResult:
    """New states of the participants after the lock-step phase, and the bytes it exchanged."""

    states: list[ClientState]
    bytes_up: int
    bytes_down: int


class ClientRuntime:
    """Runs client steps for one experiment (see module docstring).

    Args:
        algorithm: the method.
        scenario: the (set up) federated scenario.
        architectures: registered model name of each client, indexed by client id.
        trainer: the Trainer template of client fits.
        seed: the experiment seed.
        persist_optimizer_state: carry each client's optimizer state across rounds.
        feature_dim: when set, every backbone emits features of this common dimension
            (HtFLlib's ``-fd``; see :func:`fedhet.models.create_model`).
        rounds: the run's number of rounds, exposed to modules as ``total_rounds`` for schedules
            that decay over rounds (FCCL+'s learning rate).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        scenario: Any,
        architectures: Sequence[str],
        trainer: TrainerTemplate,
        seed: int,
        persist_optimizer_state: bool = True,
        feature_dim: int | None = None,
        rounds: int = 1,
    ) -> None:
        self.algorithm = algorithm
        self.rounds = rounds
        self.feature_dim = feature_dim
        self.scenario = scenario
        self.architectures = list(architectures)
        self.trainer = trainer
        self.seed = seed
        self.persist_optimizer_state = persist_optimizer_state
        self._modules: dict[tuple[str, int], ClientModule] = {}
        self.device = trainer.device()

    # ------------------------------------------------------------------ modules and state
    def build_module(self, architecture: str, init_seed: int) -> ClientModule:
        """A new client module with a model initialised from ``init_seed`` (global RNG untouched)."""
        from fedhet.models import create_model

        options = {} if self.feature_dim is None else {"feature_dim": self.feature_dim}
        with seeded(init_seed):
            model = create_model(
                architecture,
                num_classes=self.scenario.num_classes,
                in_channels=self.scenario.in_channels,
                seed=init_seed,
                **options,
            )
            return self.algorithm.build_client(model, self.scenario.num_classes)

    def module(self, architecture: str, slot: int = 0) -> ClientModule:
        """The live module of ``architecture`` (``slot`` > 0 when several must be live at once)."""
        key = (architecture, slot)
        if key not in self._modules:
            self._modules[key] = self.build_module(architecture, derive_seed(self.seed, "template", architecture))
        return self._modules[key]

    def initial_state(self, client_id: int) -> ClientState:
        """The state of a client before its first round: its own initialisation seed, fresh optimizer."""
        module = self.build_module(self.architectures[client_id], derive_seed(self.seed, "init", client_id))
        return {"module": clone_state(module.client_state()), "optimizer": None}

    def _load(self, module: ClientModule, task: ClientTask) -> ClientState:
        state = task.state if task.state is not None else self.initial_state(task.client_id)
        module.load_client_state(state["module"])
        module.round_idx, module.total_rounds = task.round_idx, self.rounds
        if task.receive:
            module.on_receive(task.download)
        return state

    # ------------------------------------------------------------------ client steps
    def fit_client(self, task: ClientTask) -> ClientResult:
        """Receive, train for the local budget, upload: one client's round."""
        module = self.module(self.architectures[task.client_id])
        state = self._load(module, task)
        seed = derive_seed(self.seed, "fit", task.round_idx, task.client_id)
        carrier = OptimizerStateCarrier(state.get("optimizer") if self.persist_optimizer_state else None)
        trainer = self.trainer.build(callbacks=[carrier])
        with seeded(seed, self.device):
            trainer.fit(module, train_dataloaders=self.scenario.train_loader(task.client_id, seed))
        loss = module.mean_train_loss()
        if not math.isfinite(loss):
            raise TrainingError(
                f"client {task.client_id} got a non-finite training loss in round {task.round_idx}; "
                "lower method.lr or set --trainer.gradient_clip_val"
            )
        upload = self._make_upload(module, task.client_id)
        new_state = {"module": clone_state(module.client_state()), "optimizer": carrier.states}
        return ClientResult(task.client_id, upload, new_state, {"train/loss": loss})

    def _make_upload(self, module: ClientModule, client_id: int) -> Payload | None:
        train = self.scenario.client_data(client_id).train
        was_training = module.training
        module.to(self.device).eval()
        with torch.no_grad():
            upload = module.make_upload(self._batches_on_device(train))
        module.train(was_training)
        if upload is None:
            return None
        return dataclasses.replace(upload.to("cpu"), num_examples=len(train))

    def collaborate(self, round_idx: int, tasks: Sequence[ClientTask]) -> CollaborationResult:
        """The lock-step phase: every participant live at once, stepping on the same public batches."""
        slots: dict[str, int] = {}
        modules: list[ClientModule] = []
        states: list[ClientState] = []
        for task in tasks:
            architecture = self.architectures[task.client_id]
            module = self.module(architecture, slots.get(architecture, 0))
            slots[architecture] = slots.get(architecture, 0) + 1
            states.append(self._load(module, task))
            modules.append(module)
        phase = self.algorithm.build_collaborative_phase(modules)
        if phase is None:
            raise TrainingError(f"{self.algorithm.name} declares collaborative epochs but builds no collaborative phase")
        phase.round_idx, phase.total_rounds = round_idx, self.rounds
        seed = derive_seed(self.seed, "collaborate", round_idx)
        trainer = self.trainer.build(max_epochs=self.algorithm.collaborative_epochs(), max_steps=-1, limit_train_batches=None)
        with seeded(seed, self.device):
            trainer.fit(phase, train_dataloaders=self.scenario.public_loader(seed))
        new_states = [
            {"module": clone_state(module.client_state()), "optimizer": state.get("optimizer")}
            for module, state in zip(modules, states)
        ]
        return CollaborationResult(new_states, phase.exchanged_bytes_up, phase.exchanged_bytes_down)

    # ------------------------------------------------------------------ evaluation
    def _batches_on_device(self, data: Any) -> Any:
        """Evaluation-order batches of ``data`` on the evaluation device (built only if iterated)."""
        device = self.device
        for x, y in self.scenario.eval_loader(data):
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    @torch.no_grad()
    def evaluate_client(self, task: ClientTask, eval_sets: Sequence[Any]) -> list[tuple[Tensor, Tensor]]:
        """Logits of the model a client holds (its state plus the latest download) on each set.

        Returns, per evaluation set, ``(top-k correct counts [2], total [1])`` for k = 1 and 5.
        """
        from fedhet.metrics import topk_correct

        module = self.module(self.architectures[task.client_id])
        self._load(module, task)
        module.to(self.device).eval()
        results = []
        for data in eval_sets:
            correct = torch.zeros(2, dtype=torch.float64)
            total = 0
            for x, y in self._batches_on_device(data):
                correct += topk_correct(module(x), y, (1, 5)).cpu().to(torch.float64)
                total += y.numel()
            results.append((correct, torch.tensor([float(total)], dtype=torch.float64)))
        module.train()
        return results
