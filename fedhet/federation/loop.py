"""THE round loop: the only place in fedhet where federated rounds are iterated.

Round ``r``::

    sample clients -> for each: its committed state + the server's download
    -> [collaborative phase on public data, all participants in lock-step]
    -> local fit with a lean Trainer -> upload (validated, bytes measured)
    -> server phase (closed-form aggregate, or a LightningModule fitted on server-side data)
    -> evaluate every client (test and validation sets) -> log once -> checkpoint

Methods only override hooks (:mod:`fedhet.algorithms.base`); executors decide where client
steps run; callbacks (run directory, W&B, console) observe the rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fedhet.algorithms.base import Algorithm, ClientUpload, ServerContext, TrainableServerPhase
from fedhet.errors import ConfigError
from fedhet.federation.executors import Executor, SequentialExecutor
from fedhet.federation.ledger import CommunicationLedger
from fedhet.federation.payloads import Payload
from fedhet.federation.privacy import PayloadNoise
from fedhet.federation.runtime import ClientRuntime, ClientTask
from fedhet.federation.sampling import clients_per_round, sample_clients
from fedhet.federation.state import ClientStateStore, MemoryStateStore
from fedhet.federation.trainer import TrainerTemplate, silence_lightning
from fedhet.metrics import BestTracker, ClientSetAccuracy, round_metrics
from fedhet.metrics.report import HEADLINE, as_matrix_list, mean_last
from fedhet.seeding import derive_seed, seeded

log = logging.getLogger("fedhet")


class RoundCallback(Protocol):
    """Observers of the loop (run directory, W&B, console)."""

    def on_round_end(self, loop: FederationLoop, record: dict[str, Any]) -> None: ...

    def on_run_end(self, loop: FederationLoop, summary: dict[str, Any]) -> None: ...


def check_compatibility(algorithm: Algorithm, scenario: Any, architectures: Sequence[str], family_name: str) -> None:
    """Refuse a method/scenario/model-family combination the method does not support, in one line."""
    caps = algorithm.capabilities
    distinct = sorted(set(architectures))
    if not caps.heterogeneous_models and len(distinct) > 1:
        raise ConfigError(
            f"{algorithm.name} averages whole models and needs one architecture for all clients, but "
            f"models '{family_name}' gives {len(distinct)} ({', '.join(distinct)}); "
            "use a homogeneous family, e.g. --models cpu_homo"
        )
    if scenario.kind not in caps.scenario_kinds:
        raise ConfigError(
            f"{algorithm.name} supports {' and '.join(caps.scenario_kinds)} scenarios, not {scenario.kind} "
            f"({type(scenario).__name__}); pick another scenario or method"
        )
    if caps.needs_public_data and scenario.public_data() is None:
        raise ConfigError(
            f"{algorithm.name} needs unlabeled public data but the scenario has none; set --scenario.public photos"
        )


class FederationLoop:
    """Runs a federated experiment round by round.

    Args:
        algorithm: the method.
        scenario: a :class:`fedhet.data.FederatedScenario` (set up by the loop).
        architectures: the model name of every client (index = client id).
        trainer: Trainer template of client fits (local budget, accelerator, precision ...).
        rounds: number of communication rounds.
        seed: experiment seed (initialisation, sampling, batch order).
        participation: fraction (float) or count (int) of clients per round.
        eval_every: evaluate every this many rounds (the last round is always evaluated).
        server_trainer: Trainer template of trainable server phases (defaults to ``trainer``).
        state_store: where client states live (default: in memory).
        executor: where client steps run (default: sequential, in-process).
        callbacks: round observers.
        persist_optimizer_state: carry client optimizer state across rounds.
        feature_dim: common feature dimension added as a linear neck to every backbone (``None``: none).
        family_name: name of the model family, for messages.
        upload_noise: Gaussian perturbation of every upload (privacy studies; ``None``: none).
        download_noise: Gaussian perturbation of every download (``None``: none).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        scenario: Any,
        architectures: Sequence[str],
        trainer: TrainerTemplate,
        rounds: int,
        seed: int = 0,
        participation: float | int = 1.0,
        eval_every: int = 1,
        server_trainer: TrainerTemplate | None = None,
        state_store: ClientStateStore | None = None,
        executor: Executor | None = None,
        callbacks: Sequence[RoundCallback] = (),
        persist_optimizer_state: bool = True,
        feature_dim: int | None = None,
        family_name: str = "custom",
        upload_noise: PayloadNoise | None = None,
        download_noise: PayloadNoise | None = None,
    ) -> None:
        if rounds < 1:
            raise ConfigError(f"rounds={rounds}: run at least one round")
        if eval_every < 1:
            raise ConfigError(f"federation.eval_every={eval_every}: must be >= 1")
        silence_lightning()
        self.algorithm = algorithm
        self.scenario = scenario
        self.architectures = list(architectures)
        self.trainer = trainer
        self.server_trainer = server_trainer or trainer
        self.rounds = rounds
        self.seed = seed
        self.participation = participation
        self.eval_every = eval_every
        self.store = state_store or MemoryStateStore()
        self.executor = executor or SequentialExecutor()
        self.callbacks = list(callbacks)
        self.family_name = family_name
        self.persist_optimizer_state = persist_optimizer_state
        self.upload_noise = upload_noise
        self.download_noise = download_noise

        scenario.setup()
        if len(self.architectures) != scenario.num_clients:
            raise ConfigError(
                f"{len(self.architectures)} client architectures for {scenario.num_clients} clients"
            )
        clients_per_round(scenario.num_clients, participation)  # validates early
        check_compatibility(algorithm, scenario, self.architectures, family_name)
        self.runtime = ClientRuntime(
            algorithm, scenario, self.architectures, trainer, seed, persist_optimizer_state, feature_dim, rounds
        )
        if algorithm.capabilities.common_feature_dim:
            dims = {a: int(self.runtime.module(a).model.num_features) for a in sorted(set(self.architectures))}
            if len(set(dims.values())) > 1:
                raise ConfigError(
                    f"{algorithm.name} exchanges features and needs one feature dimension, but the backbones "
                    f"emit {dims}; set --feature_dim 64 (adds a linear neck to every backbone)"
                )
        self.executor.bind(self.runtime)
        self.server = algorithm.build_server()
        self.server.setup(
            ServerContext(
                num_clients=scenario.num_clients,
                num_classes=scenario.num_classes,
                architectures=tuple(self.architectures),
                seed=seed,
                initial_client_state=lambda cid: self.runtime.initial_state(cid)["module"],
            )
        )
        self.ledger = CommunicationLedger()
        self.best = BestTracker(scenario.kind)
        self.history: list[dict[str, Any]] = []
        self.next_round = 0
        self.elapsed_s = 0.0
        self.last_matrix: dict[str, Any] = {}
        self._eval_sets = self._build_eval_sets()

    # ------------------------------------------------------------------ evaluation sets
    def _build_eval_sets(self) -> dict[str, list[list[Any]]]:
        """Per client, the evaluation sets of each split (columns of the accuracy matrix)."""
        sets: dict[str, list[list[Any]]] = {}
        for split in ("test", "val"):
            shared = list(self.scenario.eval_sets(split).values())
            if self.scenario.kind == "domain_shift":
                sets[split] = [shared for _ in range(self.scenario.num_clients)]
            else:  # own local split, then the global set
                sets[split] = [
                    [getattr(self.scenario.client_data(c), split), shared[0]] for c in range(self.scenario.num_clients)
                ]
        return sets

    @property
    def column_names(self) -> list[str]:
        return list(self.scenario.domains) if self.scenario.kind == "domain_shift" else ["local", "global"]

    # ------------------------------------------------------------------ one round
    def run_round(self, round_idx: int) -> dict[str, Any]:
        """Run round ``round_idx`` and return its metrics record."""
        started = time.perf_counter()
        self.ledger.start_round()
        selected = sample_clients(self.scenario.num_clients, self.participation, self.seed, round_idx)
        self._notify("on_round_start", round_idx, len(selected))
        tasks = []
        for cid in selected:
            download = self._download(cid, round_idx)
            if download is not None:
                self.ledger.record_down(download.nbytes())
            tasks.append(ClientTask(cid, round_idx, self.store.get(cid), download))

        if self.algorithm.collaborative_epochs() > 0:
            collaboration = self.executor.collaborate(round_idx, tasks)
            self.ledger.record_up(collaboration.bytes_up)
            self.ledger.record_down(collaboration.bytes_down)
            tasks = [
                ClientTask(t.client_id, round_idx, state, t.download, receive=False)
                for t, state in zip(tasks, collaboration.states)
            ]

        results = []
        for task in tasks:  # one client per call, so that progress observers see each client end
            results += self.executor.fit_clients([task])
            self._notify("on_client_end", round_idx, len(results), len(tasks))
        fit_s = time.perf_counter() - started
        uploads = []
        for result in results:
            self.store.put(result.client_id, round_idx, result.state)
            if result.upload is not None:
                upload = result.upload
                if self.upload_noise is not None:
                    upload = self.upload_noise.perturb(upload, derive_seed(self.seed, "upload-noise", round_idx, result.client_id))
                upload.validate(f"client {result.client_id}")
                self.ledger.record_up(upload.nbytes())
                uploads.append(ClientUpload(result.client_id, self.architectures[result.client_id], upload))

        self.server.aggregate(round_idx, uploads)
        if isinstance(self.server, TrainableServerPhase):
            seed = derive_seed(self.seed, "server", round_idx)
            with seeded(seed, self.runtime.device):
                self.server_trainer.build().fit(
                    self.server, train_dataloaders=self.server.server_dataloader(self.scenario, seed)
                )

        record: dict[str, Any] = {"round": round_idx, "clients": len(selected)}
        losses = [r.metrics["train/loss"] for r in results]
        record["train/loss"] = sum(losses) / len(losses)
        for result in results:
            record[f"client/{result.client_id}/train_loss"] = result.metrics["train/loss"]
        record.update({f"server/{k}": v for k, v in self.server.metrics().items()})
        record.update(self.ledger.end_round(round_idx, len(selected)))
        self.store.commit(round_idx)

        eval_started = time.perf_counter()
        if (round_idx + 1) % self.eval_every == 0 or round_idx == self.rounds - 1:
            self._notify("on_evaluate_start", round_idx)
            record.update(self.evaluate(round_idx))
            self.best.update(round_idx, record)
        record["time/fit_s"] = round(fit_s, 3)
        record["time/eval_s"] = round(time.perf_counter() - eval_started, 3)
        record["time/round_s"] = round(time.perf_counter() - started, 3)
        return record

    def _notify(self, hook: str, *args: Any) -> None:
        """Call the optional progress hook ``hook`` (``on_round_start``, ``on_client_end``, ``on_evaluate_start``)."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self, *args)

    def _download(self, client_id: int, round_idx: int) -> Payload | None:
        """What ``client_id`` receives at the start of ``round_idx`` (perturbed when download noise is on)."""
        download = self.server.download_for(client_id)
        if download is not None and self.download_noise is not None:
            download = self.download_noise.perturb(download, derive_seed(self.seed, "download-noise", round_idx, client_id))
        return download

    def evaluate(self, round_idx: int) -> dict[str, float]:
        """Every client's model (its state plus its current download) on the test and validation sets."""
        # the download the server holds after round r is the one clients receive in round r + 1
        tasks = [
            ClientTask(cid, round_idx, self.store.get(cid), self._download(cid, round_idx + 1))
            for cid in range(self.scenario.num_clients)
        ]
        columns = len(self.column_names)
        # one pass per client over its test columns then its validation columns (one state load)
        sets = [test + val for test, val in zip(self._eval_sets["test"], self._eval_sets["val"])]
        per_client = self.executor.evaluate(tasks, sets)
        results: dict[str, dict[str, torch.Tensor]] = {}
        for split, offset in (("test", 0), ("val", columns)):
            metric = ClientSetAccuracy(self.scenario.num_clients, columns)
            for cid, counts in enumerate(per_client):
                for column in range(columns):
                    correct, total = counts[offset + column]
                    metric.update(correct, float(total), cid, column)
            results[split] = metric.compute()
        own = torch.tensor([self.scenario.client_domain_index(c) for c in range(self.scenario.num_clients)])
        self.last_matrix = {
            "rows": [f"client {c} ({self.architectures[c]})" for c in range(self.scenario.num_clients)],
            "columns": self.column_names,
            "top1": as_matrix_list(results["test"]["top1"]),
        }
        return round_metrics(self.scenario.kind, results["test"], results["val"], own, self.scenario.domains)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Run the remaining rounds (all of them, or those after a restored checkpoint)."""
        for round_idx in range(self.next_round, self.rounds):
            started = time.perf_counter()
            record = self.run_round(round_idx)
            self.history.append(record)
            self.next_round = round_idx + 1
            self.elapsed_s += time.perf_counter() - started
            for callback in self.callbacks:
                callback.on_round_end(self, record)
            self.store.prune()
        summary = self.summary()
        for callback in self.callbacks:
            callback.on_run_end(self, summary)
        self.executor.shutdown()
        return summary

    def summary(self) -> dict[str, Any]:
        """The results contract of design.md section 5 (``summary.json``)."""
        keys = HEADLINE[self.scenario.kind]
        evaluated = [r for r in self.history if keys[0] in r]
        final = {k: v for k, v in evaluated[-1].items() if not k.startswith(("val/", "time/", "comm/", "server/"))} if evaluated else {}
        return {
            "method": self.algorithm.name,
            "scenario": type(self.scenario).__name__,
            "scenario_kind": self.scenario.kind,
            "seed": self.seed,
            "rounds": self.rounds,
            "models": self.architectures,
            "final": final,
            "best": self.best.summary(),
            "last3": mean_last(evaluated, keys, 3),
            "matrix": self.last_matrix,
            "comm": {
                "bytes_up": self.ledger.total_up,
                "bytes_down": self.ledger.total_down,
                "bytes_up_per_round": self.ledger.total_up / max(len(self.history), 1),
                "bytes_down_per_round": self.ledger.total_down / max(len(self.history), 1),
            },
            "wall_s": round(self.elapsed_s, 3),
        }

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly after the last completed round."""
        return {
            "next_round": self.next_round,
            "server": self.server.state_dict(),
            "store": self.store.checkpoint_state(),
            "ledger": self.ledger.state_dict(),
            "best": self.best.state_dict(),
            "history": self.history,
            "elapsed_s": self.elapsed_s,
            "last_matrix": self.last_matrix,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.next_round = int(state["next_round"])
        self.server.load_state_dict(state["server"])
        self.store.restore(state["store"])
        self.ledger.load_state_dict(state["ledger"])
        self.best.load_state_dict(state["best"])
        self.history = list(state["history"])
        self.elapsed_s = float(state["elapsed_s"])
        self.last_matrix = dict(state["last_matrix"])
