"""THE round loop: the only place in fedhet where federated rounds are iterated.

A run is a schedule of steps: the method's ``before`` phases (pretraining), the federated rounds,
then ``after`` phases (fine-tuning, extra full-participation rounds). Each step is a round::

    sample clients -> for each: its committed state + the server's download (built once per round)
    -> [collaborative phase on public data, all participants in lock-step]
    -> local stages, each one lean Trainer fit -> upload (validated, bytes measured)
    -> server: aggregate -> trained refine stages (own Trainer template and budget) -> downloads
    -> evaluate the declared targets (clients after/before the download; server models once)
    -> log once -> checkpoint

Methods only override hooks (:mod:`fedhet.algorithms.base`); executors decide where client
steps run; callbacks (run directory, W&B, console, progress) observe the steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fedhet.algorithms.base import Algorithm, ClientStates, ClientUpload, RunPhase, ServerContext
from fedhet.core.payloads import Payload
from fedhet.core.quiet import silence_lightning
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation.executors import SequentialExecutor
from fedhet.federation.ledger import CommunicationLedger
from fedhet.federation.lr_schedule import LRSchedule
from fedhet.federation.runtime import FEDERATION, ClientRuntime, ClientTask, RuntimeRecipe
from fedhet.federation.sampling import clients_per_round, sample_clients
from fedhet.federation.settings import FederationSettings
from fedhet.federation.state import ClientStateStore, MemoryStateStore
from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate
from fedhet.metrics import BestTracker, ClientSetAccuracy, round_metrics
from fedhet.metrics.report import HEADLINE, SERVER_KEY, as_matrix_list, mean_last
from fedhet.seeding import derive_seed, seeded

log = logging.getLogger("fedhet")

#: Above this many clients, ``eval_clients: auto`` evaluates the round's participants only.
EVAL_ALL_UP_TO = 100


class RoundCallback(Protocol):
    """Observers of the loop (run directory, W&B, console)."""

    def on_round_end(self, loop: FederationLoop, record: dict[str, Any]) -> None: ...

    def on_run_end(self, loop: FederationLoop, summary: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Step:
    """One entry of the run's schedule: a federated round or one step of a run phase."""

    phase: str
    phase_step: int
    participation: float | int | None  # None: every client
    exchange: bool = True

    @property
    def is_round(self) -> bool:
        return self.phase == FEDERATION


def final_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """The reported values of a round record: everything but validation, timing, traffic, server and eval keys."""
    return {k: v for k, v in record.items() if not k.startswith(("val/", "time/", "comm/", "server/", "eval/"))}


def relative_update(upload: Payload, download: Payload | None) -> float | None:
    """``||w_upload - w_global|| / ||w_global||`` over the model weights both carry (``None``: nothing to compare).

    Only tensors under a ``weights`` field that the client's download holds under the same name
    and shape count: the global model the client started from is the server's own reference of
    scale, known before any upload arrives, so the bound needs no other upload (one client per
    round is enough). Prototypes, logits and control variates have no such reference (a server's
    prototypes may differ in scale from a client's by design) and are left to the value bound.
    """
    if download is None:
        return None
    received = {name: tensor for name, tensor in download.tensors() if name.startswith("weights.")}
    uploaded, references = [], []
    for name, tensor in upload.tensors():
        reference = received.get(name)
        if reference is None or not tensor.is_floating_point() or reference.shape != tensor.shape:
            continue
        uploaded.append(tensor.detach())
        references.append(reference.to(tensor.dtype))
    if not uploaded:
        return None
    # fused over all tensors (one call each, not five per tensor: this runs for every upload of every
    # round); the norms are accumulated in float64, so a 1e30 upload gives a finite, huge ratio
    reference_sq = float(torch.stack(torch._foreach_norm(references, 2, dtype=torch.float64)).square().sum())
    if reference_sq <= 0.0:
        return None
    differences = torch._foreach_sub(uploaded, references)
    delta_sq = float(torch.stack(torch._foreach_norm(differences, 2, dtype=torch.float64)).square().sum())
    return (delta_sq / reference_sq) ** 0.5


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
    """Runs a federated experiment step by step (phases before, rounds, phases after).

    Args:
        algorithm: the method.
        scenario: a :class:`fedhet.data.FederatedScenario` (set up by the loop).
        architectures: the model name of every client (index = client id).
        trainer: Trainer template of client fits (local budget, accelerator, precision ...).
        rounds: number of communication rounds.
        seed: experiment seed (initialisation, sampling, batch order).
        settings: the round-loop settings (``federation:`` in a config: participation,
            evaluation, executor, noise, targets ...), documented and checked in
            :class:`~fedhet.federation.settings.FederationSettings`; ``None``: its defaults.
        server_trainer: Trainer template of trained server stages (hardware and numerics only;
            budgets are the method's).
        state_store: where client states live (default: in memory; ``settings.state_store`` is
            the command line's choice of store, made before the loop is built).
        callbacks: round observers.
        recipe: how a worker rebuilds this run's client runtime (built from the objects when ``None``).
        feature_dim: common feature dimension, a neck on every backbone (``None``: none).
        feature_proj: that neck: ``"pool"`` (HtFLlib's parameter-free pooling) or ``"linear"`` (learnable).
        family_name: name of the model family, for messages.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        scenario: Any,
        architectures: Sequence[str],
        trainer: TrainerTemplate,
        rounds: int,
        seed: int = 0,
        settings: FederationSettings | None = None,
        server_trainer: ServerTrainerTemplate | None = None,
        state_store: ClientStateStore | None = None,
        callbacks: Sequence[RoundCallback] = (),
        recipe: RuntimeRecipe | None = None,
        feature_dim: int | None = None,
        family_name: str = "custom",
        feature_proj: str = "pool",
    ) -> None:
        if rounds < 1:
            raise ConfigError(f"rounds={rounds}: run at least one round")
        settings = settings if settings is not None else FederationSettings()
        silence_lightning()
        self.settings = settings
        self.algorithm = algorithm
        self.scenario = scenario
        self.architectures = list(architectures)
        self.trainer = trainer
        self.server_trainer = server_trainer or ServerTrainerTemplate(
            accelerator=trainer.accelerator, memory_format=trainer.memory_format
        )
        self.rounds = rounds
        self.seed = seed
        self.store = state_store or MemoryStateStore()
        self.executor = settings.executor or SequentialExecutor()
        self.callbacks = list(callbacks)
        self.family_name = family_name
        self.target_accuracy = settings.targets()
        participation = settings.participation
        upload_noise, download_noise = settings.upload_noise, settings.download_noise
        persist_optimizer_state = settings.persist_optimizer_state

        scenario.setup()
        if len(self.architectures) != scenario.num_clients:
            raise ConfigError(f"{len(self.architectures)} client architectures for {scenario.num_clients} clients")
        clients_per_round(scenario.num_clients, participation)  # validates early
        check_compatibility(algorithm, scenario, self.architectures, family_name)
        if algorithm.collaborative_epochs() > 0 and (upload_noise is not None or download_noise is not None):
            raise ConfigError(
                f"{algorithm.name} exchanges outputs batch by batch in a lock-step phase, which the upload/"
                "download noise of privacy studies does not cover; drop federation.upload_noise/download_noise"
            )
        self.lr_schedule = settings.lr_schedule or LRSchedule()
        self.runtime = ClientRuntime(
            algorithm,
            scenario,
            self.architectures,
            trainer,
            seed,
            persist_optimizer_state,
            feature_dim,
            rounds,
            self.lr_schedule,
            feature_proj,
        )
        self.runtime.drop_invalid_exchanges = settings.on_invalid_upload == "drop"
        self.runtime.exchange_value_bound = settings.upload_value_bound
        if algorithm.capabilities.common_feature_dim:
            dims = {a: int(self.runtime.module(a).model.num_features) for a in sorted(set(self.architectures))}
            if len(set(dims.values())) > 1:
                raise ConfigError(
                    f"{algorithm.name} exchanges features and needs one feature dimension, but the backbones "
                    f"emit {dims}; set --feature_dim 64 (adds a neck to every backbone; --feature_proj linear: "
                    "a learnable one)"
                )
        self.recipe = recipe or RuntimeRecipe(
            architectures=tuple(self.architectures),
            seed=seed,
            rounds=rounds,
            persist_optimizer_state=persist_optimizer_state,
            feature_dim=feature_dim,
            feature_proj=feature_proj,
            algorithm=algorithm,
            scenario=scenario,
            trainer=trainer,
            lr_schedule=self.lr_schedule,
        )
        self.executor.start(self.recipe, self.runtime)
        self.server = algorithm.build_server()
        # the round position the clients get too; set now, so a resumed run's first download sees it
        self.server.total_rounds = rounds
        aggregator = self.settings.aggregator
        if aggregator.robust and not self.server.supports_aggregator():
            raise ConfigError(
                f"federation.aggregator.rule={aggregator.rule!r} replaces the mean of weight-averaging "
                f"methods, but {algorithm.name}'s server combines uploads its own way; use rule 'mean' "
                "or a FedAvg-family method (FedAvg, FedProx, MOON, FedRS, FedPer, LG-FedAvg, FML, FedType)"
            )
        #: every dropped upload: ``{"round", "client", "reason"}`` (checkpointed with the run)
        self.dropped_uploads: list[dict[str, Any]] = []
        self._upload_stats: dict[str, float] = {}
        self.server.setup_server(self.server_context())
        self.schedule = self._build_schedule()
        self.ledger = CommunicationLedger()
        self.best = BestTracker(scenario.kind, with_server="server" in algorithm.evaluation)
        self.history: list[dict[str, Any]] = []
        self.next_round = 0  # steps of the schedule completed (rounds and phase steps)
        self.elapsed_s = 0.0
        self.last_matrix: dict[str, Any] = {}
        self._downloads: dict[tuple[int, int], Payload | None] = {}
        self._participants: list[int] = []
        self._fresh_states: dict[int, Any] = {}

    # ------------------------------------------------------------------ set-up
    def server_context(self) -> ServerContext:
        """What the server may know: formats, label counts, a model factory, the public data."""
        scenario = self.scenario
        public = (lambda seed: scenario.public_loader(seed)) if scenario.public_data() is not None else None
        return ServerContext(
            num_clients=scenario.num_clients,
            num_classes=scenario.num_classes,
            architectures=tuple(self.architectures),
            seed=self.seed,
            initial_client_state=lambda cid: self.runtime.initial_state(cid)["module"],
            data_format=self.runtime.data_format,
            # a scenario generating its clients on demand is not walked whole before the first round
            label_counts=None if getattr(scenario, "lazy_clients", False) else self.runtime.label_counts(),
            label_counts_source=self.runtime.label_counts,
            model_factory=self.runtime.build_network,
            public_loader=public,
            aggregate_states=self.settings.aggregator if self.settings.aggregator.robust else None,
        )

    def _build_schedule(self) -> list[Step]:
        phases = list(self.algorithm.phases())
        if self.settings.extra_rounds:
            phases.append(RunPhase("extra", "after", rounds=self.settings.extra_rounds, participation=None))
        names = [p.name for p in phases]
        if len(set(names)) != len(names) or FEDERATION in names:
            raise ConfigError(f"{self.algorithm.name} declares run phases with clashing names: {names}")
        steps: list[Step] = []
        for phase in (p for p in phases if p.when == "before"):
            steps += [Step(phase.name, i, phase.participation, phase.exchange) for i in range(phase.rounds)]
        steps += [Step(FEDERATION, r, self.settings.participation) for r in range(self.rounds)]
        for phase in (p for p in phases if p.when == "after"):
            steps += [Step(phase.name, i, phase.participation, phase.exchange) for i in range(phase.rounds)]
        return steps

    @property
    def column_names(self) -> list[str]:
        return list(self.scenario.domains) if self.scenario.kind == "domain_shift" else ["local", "global"]

    # ------------------------------------------------------------------ one step
    def _sample(self, step: Step) -> list[int]:
        if step.participation is None:
            return list(range(self.scenario.num_clients))
        seed = self.seed if step.is_round else derive_seed(self.seed, "phase", step.phase)
        return sample_clients(self.scenario.num_clients, step.participation, seed, step.phase_step)

    def run_round(self, step_idx: int) -> dict[str, Any]:
        """Run step ``step_idx`` of the schedule (round ``step_idx`` when there are no phases) and return its record."""
        step = self.schedule[step_idx]
        started = time.perf_counter()
        self.ledger.start_round()
        if step_idx == 0:
            # what the clients sent once before the first round for the server's set-up (FedFTG's label counts)
            for payload in self.server.setup_uploads():
                self.ledger.record_up(payload.nbytes())
        selected = self._sample(step)
        self._participants = selected
        self._notify("on_round_start", step_idx, len(selected))
        tasks = []
        for cid in selected:
            download = self._download(cid, step_idx) if step.exchange else None
            if download is not None:
                self.ledger.record_down(download.nbytes())
            tasks.append(
                ClientTask(cid, step.phase_step, self.store.get(cid), download, step.phase, step.exchange, step_idx)
            )

        if step.exchange and tasks and self.algorithm.collaborative_epochs() > 0:
            results, bytes_up, bytes_down = self.executor.fit_collaborative(tasks)
            self.ledger.record_up(bytes_up)
            self.ledger.record_down(bytes_down)
            for result in results:
                if result.dropped is not None:
                    self._record_drop(step_idx, result.client_id, result.dropped)
        else:
            results = self.executor.fit_clients(
                tasks, on_result=lambda done: self._notify("on_client_end", step_idx, done, len(tasks))
            )
        fit_s = time.perf_counter() - started
        # the step's new states, reused by this step's evaluation (a disk store would re-read them)
        self._fresh_states = {result.client_id: result.state for result in results}
        received = []
        for result in results:
            self.store.put(result.client_id, step_idx, result.state)
            if result.upload is not None:
                upload = result.upload
                if self.settings.upload_noise is not None:
                    upload = self.settings.upload_noise.perturb(
                        upload, derive_seed(self.seed, "upload-noise", step_idx, result.client_id)
                    )
                attack = self.settings.upload_attack
                if attack is not None and attack.attacks(result.client_id):
                    upload = attack.poison(upload, self._downloads.get((step_idx, result.client_id)))
                self.ledger.record_up(upload.nbytes())
                received.append(ClientUpload(result.client_id, self.architectures[result.client_id], upload))
        if step.exchange:  # before the screening: what a server expects may depend on it
            self.server.phase, self.server.round_idx = step.phase, step.phase_step
        uploads = self._screen_uploads(step_idx, received)

        if step.exchange:
            self._server_round(step_idx, step.phase_step, uploads)

        record: dict[str, Any] = {"round": step_idx, "clients": len(selected)}
        if not step.is_round:
            record.update({"phase": step.phase, "phase_step": step.phase_step})
        for key in sorted({k for r in results for k in r.metrics}):
            values = [r.metrics[key] for r in results if key in r.metrics]
            record[key] = sum(values) / len(values)
        for result in results:
            for key, value in result.metrics.items():
                name = "train_loss" if key == "train/loss" else key.replace("/", "_")
                record[f"client/{result.client_id}/{name}"] = value
        record.update({f"server/{k}": v for k, v in self.server.metrics().items()})
        record.update(self.ledger.end_round(step_idx, len(selected)))
        record["comm/dropped_uploads"] = len(received) - len(uploads)
        record.update({key: round(value, 6) for key, value in self._upload_stats.items()})
        self.store.commit(step_idx)

        eval_started = time.perf_counter()
        last = step_idx == len(self.schedule) - 1
        if (
            not step.is_round
            or (step.phase_step + 1) % self.settings.eval_every == 0
            or last
            or step.phase_step == self.rounds - 1
        ):
            self._notify("on_evaluate_start", step_idx)
            record.update(self.evaluate(step_idx))
            self.best.update(step_idx, record)
        record["time/fit_s"] = round(fit_s, 3)
        record["time/eval_s"] = round(time.perf_counter() - eval_started, 3)
        record["time/round_s"] = round(time.perf_counter() - started, 3)
        return record

    def _screen_uploads(self, step_idx: int, uploads: list[ClientUpload]) -> list[ClientUpload]:
        """Check every upload where it enters; with ``fail`` stop naming its sender, with ``drop`` go on without it.

        Checked against the server's own expectations only (never against another upload), so the
        client named is always the one at fault: finite floating values (:meth:`Payload.validate`),
        the server's keys, shapes, dtypes and counts (:meth:`ServerPhase.check_upload`), the value
        bound and the norm bound relative to the global model the client received.
        """
        accepted: list[ClientUpload] = []
        self._upload_stats = {}
        for upload in uploads:
            sender = f"client {upload.client_id}"
            try:
                upload.payload.validate(sender)
                self.server.check_upload(upload)
                ratio, largest = self._check_bounds(step_idx, upload)
            except TrainingError as error:
                if self.settings.on_invalid_upload == "fail":
                    raise TrainingError(f"round {step_idx}: {error}") from None
                self._record_drop(step_idx, upload.client_id, str(error))
                continue
            accepted.append(upload)
            # the largest accepted values of the round, logged so bounds can be chosen from data
            stats = self._upload_stats
            stats["comm/max_upload_value"] = max(stats.get("comm/max_upload_value", 0.0), largest)
            if ratio is not None:
                stats["comm/max_update_ratio"] = max(stats.get("comm/max_update_ratio", 0.0), ratio)
        return accepted

    def _record_drop(self, step_idx: int, client_id: int, reason: str) -> None:
        """Count an upload (or a lock-step exchange) left out under ``on_invalid_upload: drop``."""
        log.warning("dropped the upload of client %d in round %d: %s", client_id, step_idx, reason)
        self.dropped_uploads.append({"round": step_idx, "client": client_id, "reason": reason})

    def _check_bounds(self, step_idx: int, upload: ClientUpload) -> tuple[float | None, float]:
        """Raise a one-line :class:`TrainingError` if ``upload`` exceeds the value or the norm bound.

        Returns:
            ``(relative update, largest value)`` of an upload within both bounds.
        """
        sender = f"client {upload.client_id}"
        largest = upload.payload.check_value_bound(self.settings.upload_value_bound, sender)
        ratio = relative_update(upload.payload, self._downloads.get((step_idx, upload.client_id)))
        bound = self.settings.upload_norm_bound
        if bound is not None and ratio is not None and ratio > bound:
            raise TrainingError(
                f"{sender} sent weights {ratio:.3g}x the global model's norm away from it "
                f"(bound {bound:g}); a diverged or poisoned client, "
                "or raise federation.upload_norm_bound"
            )
        return ratio, largest

    def _server_round(self, step_idx: int, round_idx: int, uploads: list[ClientUpload]) -> None:
        """Aggregate, fit the trained refine stages with the server template and their own budgets."""
        self.server.aggregate(round_idx, uploads)
        self._downloads.clear()  # the server changed: every download is rebuilt
        for index, stage in enumerate(self.server.refine_stages()):
            if not stage.should_refine():
                continue
            seed = (
                derive_seed(self.seed, "server", step_idx)
                if index == 0
                else derive_seed(self.seed, "server", step_idx, index)
            )
            budget = stage.refine_budget()
            with seeded(seed, self.server_trainer.device()):
                loader = stage.server_dataloader(seed)
                self.server_trainer.build(budget.epochs, budget.steps).fit(stage, train_dataloaders=loader)

    def _download(self, client_id: int, step_idx: int) -> Payload | None:
        """What ``client_id`` receives at the start of step ``step_idx``, built once (with download noise, if on)."""
        key = (step_idx, client_id)
        if key not in self._downloads:
            download = self.server.download_for(client_id)
            if download is not None and self.settings.download_noise is not None:
                download = self.settings.download_noise.perturb(
                    download, derive_seed(self.seed, "download-noise", step_idx, client_id)
                )
            self._downloads[key] = download
        return self._downloads[key]

    # ------------------------------------------------------------------ evaluation
    def clients_to_evaluate(self, step_idx: int) -> list[int]:
        """The clients evaluated after step ``step_idx`` (see ``eval_clients``)."""
        num = self.scenario.num_clients
        mode = self.settings.eval_clients
        if mode == "auto":
            mode = "all" if num <= EVAL_ALL_UP_TO else "participants"
        if mode == "all":
            return list(range(num))
        if mode == "participants":
            return sorted(self._participants) if self._participants else list(range(num))
        count = min(int(mode), num)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "eval-clients", step_idx))
        return sorted(torch.randperm(num, generator=generator)[:count].tolist())

    def _notify(self, hook: str, *args: Any) -> None:
        """Call the optional progress hook ``hook`` (``on_round_start``, ``on_client_end``, ``on_evaluate_start``)."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self, *args)

    def evaluate(self, round_idx: int) -> dict[str, float]:
        """The declared targets on the test and validation sets; headline metrics from client models.

        Client models are evaluated with the download they would receive next (the download the
        server holds after step ``r`` is the one clients receive in step ``r + 1``).
        """
        targets = self.evaluation_targets
        metrics: dict[str, float] = {}
        clients = self.clients_to_evaluate(round_idx)
        if "clients" in targets:
            metrics.update(self._evaluate_clients(round_idx, clients, apply_download=True, prefix=""))
        if "clients_before_download" in targets:
            prefix = "" if "clients" not in targets else "pre/"
            metrics.update(self._evaluate_clients(round_idx, clients, apply_download=False, prefix=prefix))
        if "server" in targets:
            metrics.update(self._evaluate_server(self.algorithm.evaluation_models(self.server, self.client_states())))
            metrics.update(self._evaluate_references(self.algorithm.reference_models(self.server)))
        metrics["eval/clients"] = float(len(clients))
        return metrics

    @property
    def evaluation_targets(self) -> tuple[str, ...]:
        """The method's targets, plus the clients before the download when asked (``pre/`` metrics)."""
        targets = tuple(self.algorithm.evaluation)
        if self.settings.eval_after_local_training and "clients_before_download" not in targets:
            targets += ("clients_before_download",)
        return targets

    def _evaluate_clients(
        self, round_idx: int, clients: list[int], apply_download: bool, prefix: str
    ) -> dict[str, float]:
        step = self.schedule[min(round_idx, len(self.schedule) - 1)]
        tasks = [
            ClientTask(
                cid,
                step.phase_step,
                self._fresh_states[cid] if cid in self._fresh_states else self.store.get(cid),
                self._download(cid, round_idx + 1) if apply_download else None,
                step.phase,
                step_idx=round_idx,
            )
            for cid in clients
        ]
        columns = len(self.column_names)
        per_client = self.executor.evaluate(tasks, apply_download)
        results: dict[str, dict[str, torch.Tensor]] = {}
        for index, split in enumerate(self.scenario.evaluation_splits):
            offset = index * columns
            metric = ClientSetAccuracy(len(clients), columns)
            for row, counts in enumerate(per_client):
                for column in range(columns):
                    correct, total = counts[offset + column]
                    metric.update(correct, float(total), row, column)
            results[split] = metric.compute()
        own = torch.tensor([self.scenario.client_domain_index(c) for c in clients])
        if not prefix and "test" in results:
            self.last_matrix = {
                "rows": [f"client {c} ({self.architectures[c]})" for c in clients],
                "columns": self.column_names,
                "top1": as_matrix_list(results["test"]["top1"]),
            }
        metrics = round_metrics(
            self.scenario.kind, results.get("test"), results["val"], own, self.scenario.domains, clients
        )
        return {f"{prefix}{k}" if not k.startswith("val/") else f"val/{prefix}{k[4:]}": v for k, v in metrics.items()}

    def client_states(self) -> ClientStates:
        """Every client's stored state, read-only, for a method's evaluation-only models."""

        def module_state(cid: int) -> dict[str, torch.Tensor]:
            state = self._fresh_states.get(cid) or self.store.get(cid) or self.runtime.initial_state(cid)
            return state["module"]

        return ClientStates(
            architectures=tuple(self.architectures),
            module_state=module_state,
            num_examples=lambda cid: len(self.scenario.client_data(cid).train),
            build_network=lambda architecture: self.runtime.build_network(architecture, self.seed),
        )

    def _evaluate_server(self, models: dict[str, nn.Module]) -> dict[str, float]:
        """Server-side models once each on the global sets: ``acc_server`` is their mean top-1 (percent)."""
        if not models:
            return {}
        sets = self.runtime.eval_sets(None)
        scores: dict[str, list[float]] = {split: [] for split in self.scenario.evaluation_splits}
        out: dict[str, float] = {}
        for name, model in models.items():
            for split, score in self._score_on_global_sets(model, sets).items():
                scores[split].append(score)
            if "test" in scores:
                out[f"server/{name}/acc"] = round(100.0 * scores["test"][-1], 4)
        for split, values in scores.items():
            key = SERVER_KEY if split == "test" else f"val/{SERVER_KEY}"
            out[key] = round(100.0 * sum(values) / len(values), 4)
        return out

    def _evaluate_references(self, models: dict[str, nn.Module]) -> dict[str, float]:
        """``Algorithm.reference_models`` scored as ``acc_server_<name>`` (never part of ``acc_server``)."""
        if not models:
            return {}
        sets = self.runtime.eval_sets(None)
        out: dict[str, float] = {}
        for name, model in models.items():
            for split, score in self._score_on_global_sets(model, sets).items():
                key = f"{SERVER_KEY}_{name}" if split == "test" else f"val/{SERVER_KEY}_{name}"
                out[key] = round(100.0 * score, 4)
        return out

    def _score_on_global_sets(self, model: nn.Module, sets: Sequence[Any]) -> dict[str, float]:
        """Top-1 of ``model`` averaged over each evaluation split's global sets (fractions), by split."""
        splits = self.scenario.evaluation_splits
        per_split = len(sets) // len(splits)
        counts = self.runtime.evaluate_model(model, sets)
        top1 = [float(c[0] / t[0]) if float(t[0]) else 0.0 for c, t in counts]
        return {split: sum(top1[i * per_split : (i + 1) * per_split]) / per_split for i, split in enumerate(splits)}

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Run the remaining steps (all of them, or those after a restored checkpoint)."""
        try:
            for step_idx in range(self.next_round, len(self.schedule)):
                started = time.perf_counter()
                record = self.run_round(step_idx)
                self.history.append(record)
                self.next_round = step_idx + 1
                self.elapsed_s += time.perf_counter() - started
                for callback in self.callbacks:
                    callback.on_round_end(self, record)
                self.store.prune()
            summary = self.summary()
            for callback in self.callbacks:
                callback.on_run_end(self, summary)
        finally:
            self.executor.shutdown()
        return summary

    def summary(self) -> dict[str, Any]:
        """The results contract of design.md section 5 (``summary.json``)."""
        keys = HEADLINE[self.scenario.kind]
        evaluated = [r for r in self.history if any(k in r for k in (keys[0], SERVER_KEY, f"val/{keys[0]}"))]
        final = final_metrics(evaluated[-1]) if evaluated else {}
        last3 = mean_last(evaluated, keys, 3)
        last3.update(mean_last(evaluated, (SERVER_KEY,), 3))
        return {
            "method": self.algorithm.name,
            "scenario": type(self.scenario).__name__,
            "scenario_kind": self.scenario.kind,
            "seed": self.seed,
            "rounds": self.rounds,
            "phases": sorted({s.phase for s in self.schedule} - {FEDERATION}),
            "models": self.architectures,
            "final": final,
            "best": self.best.summary(),
            "last3": last3,
            "matrix": self.last_matrix,
            "comm": {
                "bytes_up": self.ledger.total_up,
                "bytes_down": self.ledger.total_down,
                "bytes_up_per_round": self.ledger.total_up / max(len(self.history), 1),
                "bytes_down_per_round": self.ledger.total_down / max(len(self.history), 1),
            },
            "wall_s": round(self.elapsed_s, 3),
            **({"rounds_to_target": self.rounds_to_target()} if self.target_accuracy else {}),
            **({"dropped_uploads": self.dropped_upload_counts()} if self.settings.on_invalid_upload == "drop" else {}),
        }

    def dropped_upload_counts(self) -> dict[str, Any]:
        """Uploads dropped under ``on_invalid_upload: drop``: the total and per client (ids as strings, JSON keys)."""
        per_client: dict[str, int] = {}
        for drop in sorted(self.dropped_uploads, key=lambda d: d["client"]):
            per_client[str(drop["client"])] = per_client.get(str(drop["client"]), 0) + 1
        return {"total": len(self.dropped_uploads), "per_client": per_client}

    def rounds_to_target(self) -> dict[str, int | None]:
        """Communication rounds until each ``target_accuracy`` metric first reached its target (``None``: never).

        FedFTG's Table 2: the first federated round whose evaluation reaches the target, counted
        from 1; phase steps (pretraining, fine-tuning) do not count. Only evaluated rounds can
        reach it, so ``eval_every > 1`` rounds the count up to the next evaluation.
        """
        out: dict[str, int | None] = {}
        for key, targets in self.target_accuracy.items():
            for target in targets:
                reached = None
                for record in self.history:
                    step = self.schedule[record["round"]]
                    if step.is_round and record.get(key, float("-inf")) >= target:
                        reached = step.phase_step + 1
                        break
                out[f"{key}>={target:g}"] = reached
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly after the last completed step."""
        return {
            "next_round": self.next_round,
            "server": self.server.server_state(),
            "store": self.store.checkpoint_state(),
            "ledger": self.ledger.state_dict(),
            "best": self.best.state_dict(),
            "history": self.history,
            "elapsed_s": self.elapsed_s,
            "last_matrix": self.last_matrix,
            "dropped_uploads": self.dropped_uploads,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.next_round = int(state["next_round"])
        self.server.load_server_state(state["server"])
        self.store.restore(state["store"])
        self.ledger.load_state_dict(state["ledger"])
        self.best.load_state_dict(state["best"])
        self.history = list(state["history"])
        self.elapsed_s = float(state["elapsed_s"])
        self.last_matrix = dict(state["last_matrix"])
        self.dropped_uploads = list(state.get("dropped_uploads", []))
        self._downloads.clear()
        self._fresh_states = {}
