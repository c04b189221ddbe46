"""FedKD: a private teacher and a shared student distil into each other; student updates go SVD-compressed.

Paper: Wu et al., "Communication-efficient federated learning via knowledge distillation",
Nature Communications 13, 2032 (2022) (Eq. 1-6; adaptive mutual distillation, hidden-state
distillation, dynamic-rank SVD gradient compression). Official code ``wuch15/FedKD`` ``run.py``;
heterogeneous form and defaults from HtFLlib ``clientkd.py`` / ``serverkd.py`` and FedKTL's
baseline table (App. C: student learning rate 0.01, ``T_start = T_end = 0.95``).

Upload: the student's round update ``S_end - S_start``, every matrix (conv kernels flattened to
``out x in*kh*kw``) replaced by its truncated SVD factors ``U_k, sigma_k, V_k^T`` keeping the
round's energy threshold; vectors go dense (``SVDStatePayload``; the measured bytes are the
factors' sizes). ``compressed_quantity="weights"`` uploads the compressed student weights
instead (HtFLlib).
Download: the server's student, compressed the same way at the same energy (HtFLlib).
Server phase: closed-form; decompress every upload, average (uniform, as both codes;
``student_weighting="samples"`` for FedAvg weights), add the mean update to the global student.
Client state kept across rounds: the teacher, the student, the hidden-state map ``W_h`` and the
optimizer state.
Local objective: teacher ``CE_t + w KL(p_s||p_t) + w MSE(H_t, W_h H_s)``, student
``CE_s + w KL(p_t||p_s) + w MSE(H_t, W_h H_s)``, ``w = 1 / (CE_t + CE_s)``
(:func:`fedhet.functional.adaptive_mutual_distillation`); ``H`` are the backbones' feature
vectors (HtFLlib's ``rep``) and ``W_h`` a private bias-free linear map from the student's to the
teacher's feature size. Evaluation uses the teacher.
Deviations from paper/official code: energy of round ``t`` is ``T_start + (t+1)/R (T_end -
T_start)`` (official code; HtFLlib lags one round). The rank keeps *at least* the energy
(``cumsum >= T``); both codes' loop ends with rank 0, i.e. an all-zero matrix, when every singular
value is needed. Factors are sent only when smaller than the matrix. Conv kernels are factorised
as ``out x (in*kh*kw)`` matrices; HtFLlib factorises each 3x3 kernel slice separately (no
saving), the official code only has 2-D weights. The download is the compressed global student
rather than the official code's compressed aggregated update, so clients that skipped rounds
still receive the current student (HtFLlib's choice). The adaptive weight is a constant for
back-propagation and each model's KL target is detached; HtFLlib back-propagates both losses
(with the hidden term counted twice) through both models and the weight. The KL is per sample
(``kl_reduction="batchmean"``); HtFLlib's ``nn.KLDivLoss()`` also divides by the number of classes
(``"mean"``). The student takes ``student_lr`` (HtFLlib parses ``mentee_learning_rate`` but uses
the teacher's rate). BatchNorm buffers of the student, if any, travel dense (the codes share
parameters only); the default ``simple_cnn`` student has none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    ServerContext,
    ServerPhase,
    hparams_for,
)
from fedhet.algorithms.shared.common import (
    SeparatelyClippedClient,
    SharedModelHparams,
    SharedWeighting,
    build_shared_model,
    state_with_prefix,
)
from fedhet.core.payloads import Payload, check_tensor
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import TrainingError
from fedhet.functional import (
    adaptive_mutual_distillation,
    compress_state,
    decompress_state,
    energy_schedule,
    weighted_average,
)
from fedhet.functional.mutual_learning import KLReduction
from fedhet.hparams import Fraction, Hyperparameters, PositiveFloat, knob, log_uniform, uniform

CompressedQuantity = Literal["update", "weights"]
STUDENT_PREFIX = "student."


@dataclass(frozen=True)
class SVDStatePayload(Payload):
    """A state dict with its matrices as truncated SVD factors (FedKD's compressed student).

    ``low_rank[name] = {"u": [m, k], "s": [k], "v": [k, n]}`` stands for the tensor ``name``
    reshaped to ``[m, n]``; ``dense`` holds everything sent as is. ``energy`` (metadata, not
    counted) is the threshold the sender used, which the server reuses for the download.
    """

    low_rank: dict[str, dict[str, Tensor]] = dataclasses.field(default_factory=dict)
    dense: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    energy: float = 1.0

    def validate_against(self, reference: Mapping[str, Tensor], sender: str) -> None:
        """The entries rebuild exactly the reference's keys, shapes and dtypes (values were found finite first).

        Dense entries have the reference's shape and dtype; a factorised entry is a floating
        matrix of the reference (``[rows, cols]`` after flattening) with ``u [rows, k]``,
        ``s [k]``, ``v [k, cols]`` in its dtype and ``1 <= k <= min(rows, cols)``; ``energy`` is
        in ``(0, 1]``. :meth:`ClientUpload.expect` checked the values before.
        """
        names = set(self.low_rank) | set(self.dense)
        if names != set(reference) or set(self.low_rank) & set(self.dense):
            raise TrainingError(
                f"{sender} sent a compressed student whose entries differ from the global student "
                f"(missing {sorted(set(reference) - names)[:3]}, unexpected {sorted(names - set(reference))[:3]})"
            )
        if not isinstance(self.energy, (int, float)) or not 0.0 < float(self.energy) <= 1.0:
            raise TrainingError(f"{sender} sent an SVD energy of {self.energy!r}, expected a number in (0, 1]")
        for name, tensor in self.dense.items():
            expected = reference[name]
            check_tensor(sender, f"dense.{name}", tensor, tuple(expected.shape), expected.dtype, "the global student")
        for name, factors in self.low_rank.items():
            shape, dtype = reference[name].shape, reference[name].dtype
            if not reference[name].is_floating_point() or len(shape) < 2:
                raise TrainingError(f"{sender} sent SVD factors of '{name}', which the global student holds dense")
            rows, cols = shape[0], reference[name].numel() // shape[0]
            if not isinstance(factors, Mapping) or set(factors) != {"u", "s", "v"}:
                raise TrainingError(f"{sender} sent factors of '{name}' without exactly u, s and v")
            rank = factors["s"].shape[0] if isinstance(factors["s"], Tensor) and factors["s"].dim() == 1 else -1
            if not 1 <= rank <= min(rows, cols):
                raise TrainingError(
                    f"{sender} sent 'low_rank.{name}.s' of shape {tuple(getattr(factors['s'], 'shape', ()))}, "
                    f"expected a rank between 1 and {min(rows, cols)}"
                )
            check_tensor(sender, f"low_rank.{name}.s", factors["s"], (rank,), dtype, "the global student")
            check_tensor(sender, f"low_rank.{name}.u", factors["u"], (rows, rank), dtype, "the global student")
            check_tensor(sender, f"low_rank.{name}.v", factors["v"], (rank, cols), dtype, "the global student")

    def decompressed(self, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The full state dict the factors stand for, shaped like ``reference``."""
        return decompress_state(self.low_rank, self.dense, {k: v.shape for k, v in reference.items()})


def compress_student(state: Mapping[str, Tensor], energy: float) -> SVDStatePayload:
    """Compress a student state dict (or update) at ``energy`` into a payload."""
    low_rank, dense = compress_state(state, energy)
    return SVDStatePayload(low_rank=low_rank, dense=dense, energy=energy)


@dataclass(frozen=True)
class FedKDHparams(SharedModelHparams):
    """FedKD's hyperparameters (FedKTL App. C: student lr 0.01, T_start = T_end = 0.95; HtFLlib: clipping at 10)."""

    max_grad_norm: PositiveFloat | None = knob(10.0, "per-model gradient clipping norm (HtFLlib: 10); None: off")
    student_model: str = knob(
        "simple_cnn", "registered model name of the shared student (FedKTL: the smallest zoo model)"
    )
    student_lr: PositiveFloat = knob(
        0.01, "learning rate of the student and the hidden-state map (FedKTL App. C: 0.01)", log_uniform(1e-4, 1.0)
    )
    t_start: Fraction = knob(0.95, "SVD energy threshold of the first round (FedKTL App. C: 0.95)", uniform(0.8, 1.0))
    t_end: Fraction = knob(0.95, "SVD energy threshold of the last round (FedKTL App. C: 0.95)", uniform(0.8, 1.0))
    compressed_quantity: CompressedQuantity = knob(
        "update", "what is compressed: update (paper, code) or weights (HtFLlib)"
    )
    student_weighting: SharedWeighting = knob("uniform", "averaging of students: uniform (both codes) or samples")
    kl_reduction: KLReduction = knob("batchmean", "batchmean (per-sample KL) or mean (HtFLlib's element mean)")


class FedKDClient(SeparatelyClippedClient):
    """Private teacher (evaluated), shared student and private hidden-state map, distilled mutually.

    ``hp.lr`` trains the teacher, ``hp.student_lr`` the student and ``W_h``, in one optimizer.

    Args:
        model: the private teacher backbone (possibly heterogeneous).
        num_classes: number of classes.
        student: the shared student (one architecture for all clients).
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams = FedKDHparams

    def __init__(
        self, model: nn.Module, num_classes: int, student: nn.Module, hp: Any = None, **overrides: Any
    ) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.student = student
        # HtFLlib's W_h: student features -> teacher features, private to the client.
        self.hidden_map = nn.Linear(int(student.num_features), int(model.num_features), bias=False)  # type: ignore[arg-type]
        self.student_at_start: dict[str, Tensor] = {}

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        teacher_hidden = self.model.forward_features(x)
        student_hidden = self.student.forward_features(x)
        teacher_loss, student_loss = adaptive_mutual_distillation(
            self.model.forward_head(teacher_hidden),
            self.student.forward_head(student_hidden),
            teacher_hidden,
            self.hidden_map(student_hidden),
            y,
            self.hp.kl_reduction,
        )
        return teacher_loss + student_loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        teacher = [p for p in self.model.parameters() if p.requires_grad]
        student = [p for p in [*self.student.parameters(), *self.hidden_map.parameters()] if p.requires_grad]
        groups: Any = [{"params": teacher}, {"params": student, "lr": self.hp.student_lr}]
        return self.local_optimizer(groups)

    def clip_groups(self) -> Iterator[list[Tensor]]:
        """Parameter groups clipped separately (teacher, student, ``W_h``; as HtFLlib)."""
        yield list(self.model.parameters())
        yield list(self.student.parameters())
        yield list(self.hidden_map.parameters())

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, SVDStatePayload):
            copy_state_into(self.student, download.decompressed(self.student.state_dict()))
        self.student_at_start = clone_state(self.student.state_dict())

    def round_energy(self) -> float:
        """This round's energy threshold (``T_start`` -> ``T_end`` over the run)."""
        return energy_schedule(self.round_idx, self.total_rounds, self.hp.t_start, self.hp.t_end)

    def make_upload(self, train_batches: Iterable[Batch]) -> SVDStatePayload:
        current = clone_state(self.student.state_dict())
        if self.hp.compressed_quantity == "update":
            start = self.student_at_start or current
            # floating entries travel as updates; integer counters (BatchNorm) as values
            current = {k: v - start[k].to(v.device) if v.is_floating_point() else v for k, v in current.items()}
        return compress_student(current, self.round_energy())


class FedKDServer(ServerPhase):
    """Holds the global student; averages decompressed student updates (or weights).

    It reads ``compressed_quantity`` (what clients upload) and ``student_weighting``.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedKDHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.global_student: dict[str, Tensor] = {}
        self.energy = 1.0
        self.download: SVDStatePayload | None = None

    def setup_server(self, context: ServerContext) -> None:
        self.global_student = state_with_prefix(context.initial_client_state(0), STUDENT_PREFIX)

    def check_upload(self, upload: ClientUpload) -> None:
        """SVD factors and dense tensors that rebuild exactly the global student (keys, shapes, dtypes)."""
        upload.expect(SVDStatePayload, "a compressed student (SVDStatePayload)").validate_against(
            self.global_student, upload.sender
        )

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        states = [u.payload.decompressed(self.global_student) for u in uploads]  # type: ignore[attr-defined]
        weights = [u.payload.num_examples if self.hp.student_weighting == "samples" else 1 for u in uploads]
        mean = weighted_average(states, weights)
        if self.hp.compressed_quantity == "update":
            mean = {
                k: (v + mean[k].to(v.dtype)) if v.is_floating_point() else mean[k]
                for k, v in self.global_student.items()
            }
        self.global_student = mean
        self.energy = max(float(u.payload.energy) for u in uploads)  # type: ignore[attr-defined]
        self.download = compress_student(self.global_student, self.energy)

    def download_for(self, client_id: int) -> SVDStatePayload | None:
        return self.download

    def metrics(self) -> dict[str, float]:
        return {"energy": self.energy}

    def server_state(self) -> dict[str, Any]:
        return {"global_student": self.global_student, "energy": self.energy, "has_download": self.download is not None}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.global_student = dict(state["global_student"])
        self.energy = float(state["energy"])
        self.download = compress_student(self.global_student, self.energy) if state["has_download"] else None


class FedKD(Algorithm):
    """FedKD (heterogeneous private teachers, one shared student architecture)."""

    Hparams = FedKDHparams
    client_type = FedKDClient
    capabilities = Capabilities(heterogeneous_models=True)
    upload_type = SVDStatePayload
    download_type = SVDStatePayload

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        student = build_shared_model(
            self.hp.student_model, num_classes, self.image_channels(), self.hp.shared_init_seed, "fedkd-student"
        )
        return FedKDClient(model, num_classes, student, self.hp)

    def build_server(self) -> ServerPhase:
        return FedKDServer(self.hp)


__all__ = ["FedKD", "FedKDClient", "FedKDHparams", "FedKDServer", "SVDStatePayload", "compress_student"]
