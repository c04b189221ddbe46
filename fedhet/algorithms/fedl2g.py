"""FedL2G: a learned global guidance per class, trained so that following it helps each client's own objective.

Paper: Zhang et al., "Adaptive Guidance for Local Training in Heterogeneous Federated Learning"
(FedL2G, arXiv 2410.06490); HtFLlib ``clientl2g_feat.py`` / ``serverl2g_feat.py`` (``FedL2G-feat``)
and ``clientl2g_logit.py`` / ``serverl2g_logit.py`` (``FedL2G-logit``), one file here because the two
differ only in the statistic the guidance pulls on.

The server keeps one guidance vector ``g_c`` per class: a feature vector (``fedl2g_feat``,
``[C, K']``) or a logit vector (``fedl2g_logit``, ``[C, C]``), initialised ``N(0, 1)`` (HtFLlib's
``nn.Embedding``). A round on a client:

1. ``local`` stage: the usual budget on ``CE(f(x), y) + w MSE(s(x), g_y)`` (``s`` = features or
   logits, :func:`fedhet.functional.guidance.guidance_loss`, ``w = guide_weight``), client gradients
   clipped at ``max_grad_norm`` (HtFLlib: 100);
2. ``meta`` stage (learning to guide): ``meta_study_batches`` study batches, then
   ``meta_quiz_batches`` quiz batches from a fresh shuffle of the client's data; one virtual SGD
   step ``theta' = theta - eta grad_theta mean_study[CE + w MSE(s, g_y)]`` (kept differentiable in
   ``g``), then the gradient of ``mean_quiz CE(f_theta'(x), y)`` with respect to ``g``: how the
   guidance should change so that following it lowers the client's *original* objective on data
   the step did not see. The virtual step is discarded (the model keeps its local-stage weights).

Upload: that gradient (``ClassStatsPayload``, ``[C, D]`` float32) with ``counts[c] = 1`` for the
classes of the study batches (the rows that carry a gradient; HtFLlib sends the non-zero rows).
Download: the guidance ``g`` (``ClassStatsPayload``, ``counts = 1`` for every class), from round 0
(HtFLlib's clients follow the random initial guidance in round 0 too).
Server phase: closed-form, :func:`fedhet.functional.guidance.guidance_update`: per class the plain
mean of the sent rows over the clients that sent one, the ``[C, D]`` gradient clipped at norm
``server_max_grad_norm`` (HtFLlib: 100), one SGD step with ``server_lr`` (HtFLlib ``-slr``).
Client state kept across rounds: the model and optimizer state (models are never shared).
Prediction: the client's own model.

Deviations from paper/official code:

* Quiz data: HtFLlib holds the first ``meta_quiz_batches * batch_size`` training examples out of
  local training as a fixed quiz set. fedhet's scenarios give a client one training split, so the
  meta stage draws study and then quiz batches from one fresh shuffle of the whole split each round
  (disjoint within the round while the split has ``meta_study_batches + meta_quiz_batches``
  batches; a smaller client's loader wraps round into a reshuffled pass), and local training uses
  all the data.
* The virtual step is plain SGD with the local learning rate (as scheduled this round by
  ``federation.lr_schedule``) and weight decay, whatever the local optimizer (HtFLlib's ``higher``
  step uses the local SGD optimizer, which is the same there: SGD without momentum). BatchNorm
  layers run in train mode as in HtFLlib, but on copies of the running statistics: the meta stage
  changes nothing in the client's model.
* HtFLlib's stored ``main.py`` does not declare the FedL2G arguments; the defaults here
  (``meta_study_batches = meta_quiz_batches = 1``, ``warm_up_rounds = 0``, ``server_lr = 0.01``,
  HtFLlib's ``-slr`` default) are this implementation's choices. During the ``warm_up_rounds``
  first rounds clients only run the meta stage (HtFLlib's warm-up).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientUpload,
    LocalStage,
    ServerContext,
    ServerPhase,
    hparams_for,
)
from fedhet.algorithms.shared.common import SeparatelyClippedClient, head_weights
from fedhet.core.payloads import ClassStatsPayload, Payload
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional.guidance import guidance_loss, guidance_update
from fedhet.hparams import (
    Hyperparameters,
    LocalOptimizer,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    int_uniform,
    knob,
    log_uniform,
)
from fedhet.seeding import derive_seed, seeded

Level = Literal["feature", "logit"]
LOCAL = "local"
META = "meta"


@dataclass(frozen=True)
class FedL2GHparams(LocalOptimizer):
    """FedL2G's hyperparameters (HtFLlib's names; both variants read the same ones)."""

    guide_weight: NonNegativeFloat = knob(
        1.0, "weight of the pull MSE(s(x), g_y) towards the guidance (HtFLlib: 1)", log_uniform(1e-2, 10.0)
    )
    meta_study_batches: PositiveInt = knob(1, "study batches of the virtual step (HtFLlib -msb)", int_uniform(1, 4))
    meta_quiz_batches: PositiveInt = knob(
        1, "quiz batches scored after the virtual step (HtFLlib -mqb)", int_uniform(1, 4)
    )
    max_grad_norm: PositiveFloat | None = knob(100.0, "clip the client's gradient norm in local training; None: off")
    server_lr: PositiveFloat = knob(
        0.01, "SGD learning rate of the guidance on the server (HtFLlib -slr)", log_uniform(1e-3, 1.0)
    )
    server_max_grad_norm: PositiveFloat | None = knob(100.0, "clip the aggregated guidance gradient's norm; None: off")
    warm_up_rounds: NonNegativeInt = knob(0, "first rounds in which clients only learn to guide (HtFLlib -wur)")



class _Batches:
    """A fixed list of batches as one loader (Lightning would take a plain list for several loaders)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _Split(nn.Module):
    """``x -> (features, logits)`` of a wrapped backbone, so one functional call gives both."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        features = self.inner.forward_features(x)
        return features, self.inner.forward_head(features)


class FedL2GClient(SeparatelyClippedClient):
    """Local training pulled towards the received guidance, then the meta stage that computes its gradient.

    Subclasses set :attr:`level`: which statistic the guidance pulls on (features or logits).
    ``max_grad_norm`` clips the model's gradient (its one clipping group), then Lightning's own.
    """

    Hparams = FedL2GHparams
    level: ClassVar[Level] = "feature"

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.guide: Tensor | None = None
        #: the meta stage's result: the guidance gradient, rows of the classes studied marked 1
        self.guide_upload: ClassStatsPayload | None = None
        self._study: list[Batch] = []
        self._quiz: list[Batch] = []

    @property
    def automatic_optimization(self) -> bool:  # type: ignore[override]
        """The meta stage steps no parameter (it computes a gradient of the guidance), under any Trainer."""
        return self.stage != META

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = value  # the stage decides (the runtime sets the same value)

    def statistic(self, features: Tensor, logits: Tensor) -> Tensor:
        """What the guidance pulls on: the features (``fedl2g_feat``) or the logits (``fedl2g_logit``)."""
        return features if self.level == "feature" else logits

    def local_stages(self) -> Sequence[LocalStage]:
        # one pass over the meta stage's own loader (the study then the quiz batches); a step budget
        # would never end, since manual optimisation counts optimizer steps and this stage takes none
        meta = LocalStage(META, epochs=1, manual=True)
        if self.phase == "federation" and self.round_idx < self.hp.warm_up_rounds:
            return (meta,)
        return (LocalStage(LOCAL), meta)

    def stage_dataloader(self, private: Iterable[Any], seed: int) -> Iterable[Any]:
        """The meta stage: the first ``meta_study_batches + meta_quiz_batches`` batches of the shuffled private data.

        A client with fewer batches starts another (reshuffled) pass over its data for the rest.
        """
        if self.stage != META:
            return private
        wanted = self.hp.meta_study_batches + self.hp.meta_quiz_batches
        batches: list[Any] = []
        while len(batches) < wanted:
            before = len(batches)
            for item in private:
                batches.append(item)
                if len(batches) == wanted:
                    break
            if len(batches) == before:
                raise TrainingError("FedL2G's meta stage got an empty training loader; the client has no data")
        return _Batches(batches)

    def on_receive(self, download: Payload | None) -> None:
        self.guide = download.values if isinstance(download, ClassStatsPayload) else None

    def guided_loss(self, features: Tensor, logits: Tensor, y: Tensor, guide: Tensor | None) -> Tensor:
        """``CE(logits, y) + w MSE(s, guide[y])`` (cross-entropy alone without a guidance)."""
        loss = F.cross_entropy(logits, y)
        if guide is not None:
            loss = loss + self.hp.guide_weight * guidance_loss(self.statistic(features, logits), guide, y)
        return loss

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        features = self.model.forward_features(x)
        logits = self.model.forward_head(features)
        guide = None if self.guide is None else self.guide.to(features.device)
        return self.guided_loss(features, logits, y, guide)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.stage == META:
            # never stepped: its (scheduled) learning rate and weight decay are the virtual step's
            return torch.optim.SGD(self.model.parameters(), lr=self.hp.lr, weight_decay=self.hp.weight_decay)
        return self.local_optimizer(p for p in self.parameters() if p.requires_grad)

    # ------------------------------------------------------------------ the meta stage
    def on_train_start(self) -> None:
        if self.stage == META:
            self._study, self._quiz = [], []
            self.guide_upload = None

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        if self.stage != META:
            return super().training_step(batch, batch_idx)
        x, y = batch
        studying = len(self._study) < self.hp.meta_study_batches
        (self._study if studying else self._quiz).append((x.detach(), y.detach()))
        if not studying and len(self._quiz) == self.hp.meta_quiz_batches and self.guide is not None:
            loss = self.learn_to_guide(self._study, self._quiz)
        else:
            with torch.no_grad():  # what this batch scores now (the loss the meter reports)
                features, logits = self.forward_on_copies(x)
                guide = None if self.guide is None else self.guide.to(x.device)
                loss = self.guided_loss(features, logits, y, guide if studying else None)
        self.log_train_loss(loss)
        return loss

    def forward_on_copies(self, x: Tensor, params: Mapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``(features, logits)`` in the current mode with ``params`` (default: the model's), on copies of the buffers.

        BatchNorm in train mode updates the running statistics it is given; the meta stage gives
        it copies, so it changes nothing in the client's model.
        """
        split = _Split(self.model)
        buffers = {name: b.detach().clone() for name, b in split.named_buffers()}
        return functional_call(split, {**(params or {}), **buffers}, (x,))

    def virtual_step_settings(self) -> tuple[float, float]:
        """``(eta, weight decay)`` of the virtual step: the meta stage's optimizer as scheduled this round."""
        if self._trainer is not None and self.trainer.optimizers:
            group = self.trainer.optimizers[0].param_groups[0]
            return float(group["lr"]), float(group["weight_decay"])
        return self.hp.lr, self.hp.weight_decay

    def learn_to_guide(self, study: Sequence[Batch], quiz: Sequence[Batch]) -> Tensor:
        """Store ``d/dg mean_quiz CE(f_theta'(x), y)`` with ``theta' = theta - eta grad mean_study loss(theta, g)``.

        Returns the quiz loss after the virtual step (detached).
        """
        assert self.guide is not None
        device = study[0][0].device
        guide = self.guide.to(device).detach().clone().requires_grad_(True)
        params = {name: p for name, p in _Split(self.model).named_parameters() if p.requires_grad}
        names = list(params)
        eta, weight_decay = self.virtual_step_settings()
        with torch.enable_grad():  # the study pass differentiates the model's own parameters, those in ``params``
            study_loss = torch.stack([self.guided_loss(*self.forward_on_copies(x), y, guide) for x, y in study]).mean()
            grads = torch.autograd.grad(study_loss, [params[n] for n in names], create_graph=True, allow_unused=True)
            stepped = {
                n: params[n] if g is None else params[n] - eta * (g + weight_decay * params[n])
                for n, g in zip(names, grads, strict=True)
            }
            quiz_loss = torch.stack([F.cross_entropy(self.forward_on_copies(x, stepped)[1], y) for x, y in quiz]).mean()
            (guide_grad,) = torch.autograd.grad(quiz_loss, guide)
        labels = torch.cat([y for _, y in study]).cpu()
        rows = (torch.bincount(labels, minlength=self.num_classes) > 0).long()
        values = (guide_grad.detach() * rows.to(device).unsqueeze(1)).float().cpu()
        self.guide_upload = ClassStatsPayload(values=values, counts=rows)
        return quiz_loss.detach()

    def make_upload(self, train_batches: Iterable[Batch]) -> ClassStatsPayload | None:
        return self.guide_upload


class FedL2GFeatClient(FedL2GClient):
    """The guidance pulls on the feature vector ``forward_features(x)``."""

    level = "feature"


class FedL2GLogitClient(FedL2GClient):
    """The guidance pulls on the logits."""

    level = "logit"


class FedL2GServer(ServerPhase):
    """Holds the guidance ``g`` and takes one clipped SGD step per round on the clients' mean gradient.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedL2GHparams
    level: ClassVar[Level] = "feature"

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.num_classes = 0
        self.dim = 0
        self.label_counts: Tensor | None = None
        self.guide = torch.zeros(0, 0)
        self.present = torch.zeros(0, dtype=torch.bool)

    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        self.num_classes = context.num_classes
        self.label_counts = context.label_counts
        if self.level == "logit":
            self.dim = context.num_classes
        else:
            head = head_weights(context.initial_client_state(0))
            if "weight" not in head:
                raise ConfigError("FedL2G-feat needs client models with a linear 'head' (FeatureClassifier)")
            self.dim = int(head["weight"].shape[1])
        with seeded(derive_seed(context.seed, "fedl2g-guide", self.level)):
            self.guide = torch.randn(self.num_classes, self.dim)  # nn.Embedding's N(0, 1), as HtFLlib
        self.present = torch.zeros(self.num_classes, dtype=torch.bool)

    def check_upload(self, upload: ClientUpload) -> None:
        """``[num_classes, dim]`` float32 gradients, 0/1 row marks only for classes the client holds."""
        payload = upload.expect(ClassStatsPayload, "guidance gradients")
        held = None if self.label_counts is None else self.label_counts[upload.client_id]
        payload.validate_shape(self.num_classes, self.dim, upload.sender, dtype=torch.float32, held=held)
        if bool((payload.counts > 1).any()):
            raise TrainingError(f"{upload.sender} sent guidance row marks other than 0 and 1")

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        self.guide, self.present = guidance_update(
            self.guide,
            [u.payload.values for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
            self.hp.server_lr,
            self.hp.server_max_grad_norm,
        )

    def download_for(self, client_id: int) -> ClassStatsPayload:
        return ClassStatsPayload(values=self.guide.clone(), counts=torch.ones(self.num_classes, dtype=torch.long))

    def metrics(self) -> dict[str, float]:
        """``guided_classes``: classes whose guidance moved this round."""
        return {"guided_classes": float(self.present.sum())}

    def server_state(self) -> dict[str, Any]:
        return {"guide": self.guide, "present": self.present}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.guide = state["guide"].clone()
        self.present = state["present"].clone()


class FedL2GFeatServer(FedL2GServer):
    """Feature-level guidance: ``[C, K']``."""

    level = "feature"


class FedL2GLogitServer(FedL2GServer):
    """Logit-level guidance: ``[C, C]``."""

    level = "logit"


class FedL2GFeat(Algorithm):
    """FedL2G with feature-level guidance (HtFLlib ``FedL2G-feat``; needs one feature dimension)."""

    Hparams = FedL2GHparams
    client_type = FedL2GFeatClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = ClassStatsPayload

    def build_server(self) -> ServerPhase:
        return FedL2GFeatServer(self.hp)


class FedL2GLogit(Algorithm):
    """FedL2G with logit-level guidance (HtFLlib ``FedL2G-logit``)."""

    Hparams = FedL2GHparams
    client_type = FedL2GLogitClient
    capabilities = Capabilities(heterogeneous_models=True)
    upload_type = ClassStatsPayload
    download_type = ClassStatsPayload

    def build_server(self) -> ServerPhase:
        return FedL2GLogitServer(self.hp)


__all__ = [
    "FedL2GClient",
    "FedL2GFeat",
    "FedL2GFeatClient",
    "FedL2GFeatServer",
    "FedL2GHparams",
    "FedL2GLogit",
    "FedL2GLogitClient",
    "FedL2GLogitServer",
    "FedL2GServer",
]
