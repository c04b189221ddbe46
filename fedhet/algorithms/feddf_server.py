"""FedDF as in its paper: server-side ensemble distillation after per-architecture averaging.

Paper: Lin, Kong, Stich & Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020 (Algorithm 1; Section 4 "heterogeneous systems").

A server plugin: it wraps any weight-averaging base method chosen in the config (FedAvg,
FedProx, MOON, FedProc, FedRS), whose clients and uploads it keeps unchanged.

Upload / download: the base method's (the client's model weights; its architecture's fused model).
Server round: the base averages the uploads within each architecture (FedAvg's
``sum_k n_k / n * w_k``); then every architecture's averaged model is the student of the
ensemble of *all* models just received (every architecture), distilled on the scenario's
unlabeled public data for ``distill_steps`` steps of
``T^2 * KL(softmax(mean_k z_k / T) || softmax(z_student / T))`` with Adam and a cosine-annealed
learning rate; the distilled models are the new global models sent to clients and evaluated as
``acc_server``. Teachers run in eval mode; students in train mode (BatchNorm statistics adapt to
the public data, as in the paper's code: ``student_bn="train"``, the default).
Client state kept across rounds: the base method's.
Deviations from paper/official code:

* The paper distils for up to ``10^4`` steps with early stopping on a held-out validation set;
  here the budget is a fixed ``distill_steps`` (default 500, a CPU-sized budget) and no labeled
  data reaches the server, so there is no early stopping.
* Public batches are the scenario's (RandomCrop + flip augmented once per batch); the paper
  draws unlabeled batches of the same kind (CIFAR-100 / STL-10 for CIFAR-10).
* The existing ``feddf`` method is the lock-step, serverless form of FCCL+'s benchmark; this
  one (``feddf_server``) is the paper's.
* ``student_bn`` (not in the paper; default ``"train"`` is the paper's code): ``"frozen"`` runs
  the students' BatchNorm layers in eval mode during the distillation, so they normalise with,
  and keep, the running statistics averaged from the clients' uploads (their affine weights still
  train); ``"restore"`` normalises with the public batches' statistics as the paper's code does
  and puts the clients' averaged running statistics back afterwards. Why: the global model is
  evaluated on, and sent to clients for, client data, and 100 train-mode steps on the public
  photo crops replace the digits' BatchNorm statistics by the photos' (issue 32's hypothesis
  for the ``digits_dir`` row ending near chance, 37.1 % with ``distill_steps=0``; a 5-round check
  did not confirm it as the main cause, ``docs/feddf_server.md``). Searched with the budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Capabilities,
    ClientUpload,
    LocalStage,
    ServerContext,
    ServerPhase,
    ServerPlugin,
    ServerRefinement,
    hparams_for,
)
from fedhet.algorithms.shared.common import FedAvgServer, batch_norm_layers, freeze_batch_norm
from fedhet.core.payloads import WeightsPayload
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import ConfigError
from fedhet.functional.distillation import ensemble_distillation_loss
from fedhet.hparams import (
    Hyperparameters,
    NonNegativeInt,
    PositiveFloat,
    categorical,
    int_uniform,
    knob,
    log_uniform,
)

StudentBatchNorm = Literal["train", "frozen", "restore"]


@dataclass(frozen=True)
class FedDFServerHparams(Hyperparameters):
    """The server distillation's settings (no optimizer: the clients are the base method's)."""

    distill_steps: NonNegativeInt = knob(
        500, "server distillation steps per round (paper: up to 10^4 with early stopping)", int_uniform(0, 1000)
    )
    distill_lr: PositiveFloat = knob(
        1e-3, "Adam learning rate of the distillation, cosine-annealed per round (paper: 1e-3)", log_uniform(1e-4, 1e-2)
    )
    temperature: PositiveFloat = knob(1.0, "distillation temperature T (paper: 1)", log_uniform(0.1, 10.0))
    student_bn: StudentBatchNorm = knob(
        "train",
        "students' BatchNorm during distillation: train (paper's code; statistics move to the public data), "
        "frozen (eval mode: the clients' averaged running statistics used and kept) or restore (train mode, "
        "then the clients' statistics put back)",
        categorical("train", "frozen", "restore"),
    )


class EnsembleDistillation(ServerRefinement):
    """Distils the ensemble of the round's client models into each architecture's averaged model.

    It reads ``distill_steps`` (steps per round), ``distill_lr`` (the initial Adam learning rate,
    cosine-annealed to 0 over the steps), ``temperature`` (``T`` of the distillation KL) and
    ``student_bn`` (what the distillation does to the students' BatchNorm running statistics).

    Args:
        hp: the plugin's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedDFServerHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.students = nn.ModuleDict()
        self.templates = nn.ModuleDict()  # one frozen network per architecture, teachers swap weights in
        self.teachers: list[tuple[str, dict[str, Tensor]]] = []
        #: the averaged clients' BatchNorm running statistics per architecture (``student_bn="restore"``)
        self.client_bn_stats: dict[str, list[dict[str, Tensor]]] = {}
        self.loss_sum = torch.zeros(())
        self.loss_steps = 0

    def attach(self, base: ServerPhase, context: ServerContext) -> None:
        if not isinstance(base, FedAvgServer):
            raise ConfigError(
                f"feddf_server refines weight-averaging bases (FedAvg, FedProx, MOON, FedProc, FedRS), not "
                f"{type(base).__name__}; set method.init_args.base to one of them"
            )
        if context.public_loader is None:
            raise ConfigError("feddf_server needs unlabeled public data; set --scenario.public photos")
        model_factory = context.require("model_factory", "feddf_server", "to build its students")
        super().attach(base, context)
        for architecture in dict.fromkeys(context.architectures):
            self.students[architecture] = model_factory(architecture, context.seed)
            self.templates[architecture] = model_factory(architecture, context.seed).requires_grad_(False)

    def begin_round(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        assert isinstance(self.base, FedAvgServer)
        self.teachers = []
        for upload in uploads:
            assert isinstance(upload.payload, WeightsPayload)
            self.teachers.append((upload.architecture, upload.payload.weights))
        for architecture, student in self.students.items():
            copy_state_into(student, self.base.global_by_architecture[architecture])
        self.client_bn_stats = {}
        if self.hp.student_bn == "restore":
            self.client_bn_stats = {
                architecture: [
                    {name: buffer.detach().clone() for name, buffer in layer.named_buffers()}
                    for layer in batch_norm_layers(student)
                ]
                for architecture, student in self.students.items()
            }
        self.loss_sum, self.loss_steps = torch.zeros(()), 0

    def should_refine(self) -> bool:
        return bool(self.teachers) and self.hp.distill_steps > 0

    def refine_budget(self) -> LocalStage:
        return LocalStage(name="distill", steps=self.hp.distill_steps)

    def server_dataloader(self, seed: int) -> Iterable[Any]:
        assert self.context.public_loader is not None
        return self.context.public_loader(seed)

    @torch.no_grad()
    def ensemble_logits(self, x: Tensor) -> Tensor:
        """Mean logits of the round's client models (eval mode) on ``x``."""
        total = None
        for architecture, weights in self.teachers:
            template = self.templates[architecture].eval()
            copy_state_into(template, weights)
            logits = template(x)
            total = logits if total is None else total + logits
        assert total is not None
        return total / len(self.teachers)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0]
        if self.hp.student_bn == "frozen":  # Lightning put the students in train mode at fit start
            for student in self.students.values():
                freeze_batch_norm(student)
        target = self.ensemble_logits(x)
        loss = torch.stack(
            [ensemble_distillation_loss(s(x), target, self.hp.temperature) for s in self.students.values()]
        ).sum()
        self.loss_sum = self.loss_sum.to(loss.device) + loss.detach()
        self.loss_steps += 1
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.students.parameters(), lr=self.hp.distill_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(self.hp.distill_steps, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @torch.no_grad()
    def restore_client_bn_stats(self) -> None:
        """Put the clients' averaged BatchNorm running statistics back into the students (``"restore"``)."""
        for architecture, saved in self.client_bn_stats.items():
            for layer, buffers in zip(batch_norm_layers(self.students[architecture]), saved, strict=True):
                for name, buffer in layer.named_buffers():
                    buffer.copy_(buffers[name].to(buffer.device))

    def on_train_end(self) -> None:
        assert isinstance(self.base, FedAvgServer)
        self.restore_client_bn_stats()
        for architecture, student in self.students.items():
            if any(a == architecture for a, _ in self.teachers):
                self.base.global_by_architecture[architecture] = clone_state(student.state_dict())

    def metrics(self) -> dict[str, float]:
        """``distill_loss``: the mean distillation loss (summed over students) of the round."""
        return {"distill_loss": float(self.loss_sum) / self.loss_steps} if self.loss_steps else {}

    def refinement_state(self) -> dict[str, Any]:
        # Students are re-initialised from the base's averages every round: nothing to carry.
        return {}

    def load_refinement_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`refinement_state`)."""


class FedDFServer(ServerPlugin):
    """FedDF (paper form): a base method's per-architecture averages, refined by ensemble distillation.

    ``base`` is the weight-averaging method whose clients and averaging it refines (default FedAvg).
    """

    Hparams = FedDFServerHparams
    capabilities = Capabilities(heterogeneous_models=True, needs_public_data=True)
    upload_type = WeightsPayload
    download_type = WeightsPayload
    evaluation = ("clients", "server")
    refinement_needs_public_data = True
    refinement_heterogeneous_models = True

    def build_refinement(self) -> ServerRefinement:
        return EnsembleDistillation(self.hp)


__all__ = ["EnsembleDistillation", "FedDFServer", "FedDFServerHparams"]
