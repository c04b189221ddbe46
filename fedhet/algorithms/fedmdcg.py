"""FedMD-CG: decoupled models, local conditional generators of latent features, crossed data-free KD.

Paper: Luo, Wang, Li, Lan, Gao, Shu, "Privacy-Preserving Federated Learning with Consistency via
Knowledge Distillation Using Conditional Generator" (Eq. 1-12, Algorithm 1 in App. B, App. C/E);
code ``lkyddd/FedMD-CG`` (LightFed); spec ``reference/fedmdcg.md``.

Each client model is split into a private feature extractor ``F_i`` (``model.forward_features``)
and a classifier ``D_i`` (``model.head``; with ``lenet5`` the paper's three FC layers). Each
client also keeps a conditional generator ``G_i(z, y)`` of latent features.

Upload: ``(G_i, D_i)`` (generator parameters and BatchNorm buffers, classifier state) and the
client's per-class training counts ``c_i`` (:class:`GeneratorClassifierPayload`). ``F_i`` never
leaves the client.
Download: the global ``(G, D)`` and the global per-class counts (``p(y)``), from the end of round
0 on (the paper's round 1 is plain CE and keeps the local classifier).
Server phase: trainable (:class:`~fedhet.algorithms.shared.generators.GeneratorClassifierServer`, shared
with FedCG). ``(G, D)`` is the example-weighted average of
the uploads, then refined for ``server_steps`` Adam steps on the crossed distillation
``L_kl,1 + L_kl,2 + L_kl,3`` with class-level weights ``tau_{i,y}`` (Eq. 10-12, ``KDC_agg``), or
FedCG's ensemble distillation (``KD_agg``), or not at all (``AVE_agg``): Table 3's switches.
Client state kept across rounds: ``F_i``, ``D_i`` (overwritten by the download at the start of
the next round), ``G_i`` (never replaced by ``G``), and both optimizers' states (the runtime
carries each stage's optimizer, as the code's once-created SGD and Adam).
Local objective, two stages of ``local_steps`` mini-batches each (Algorithm 1 lines 7-14):

1. model update (``F_i``, ``D_i`` trained; ``G`` frozen, eval mode):
   ``CE + r*l1*CE(D_i(G(z', y^)), y^) + r*l2*MSE(F_i(x), G(z, y)) + r*l3*KL(D_i(G(z, y)) || D_i(F_i(x)))``,
   ``y^ ~ p(y)``, ``r`` the ramp ``((round-1)/R)^d`` (0 in the first round);
2. generator update (``G_i`` trained; ``F_i``, ``D_i`` frozen, eval mode):
   ``KL(D_i(F_i(x)) || D_i(G_i(z, y))) + l4*MSE(G_i(z, y), F_i(x)) + l5*CE(D_i(G_i(z, y)), y) + l6*L_div``.

Evaluation (the paper's metrics): L.acc is each client's model after local training and before
the download (``clients_before_download``, reported as ``acc_local`` on class-balanced local
test shards, scenario option ``local_test: test_shards``); G.acc is the "virtual global model",
the ``n_i``-weighted average of every client's whole model, built by the loop from the stored
states for evaluation only (``virtual_global``, reported as ``acc_server``; the method's
``evaluation_models``). All clients start from one initialisation (``initialisation_of``), as
in the code; G.acc needs it.

Conflicts between paper [P] and code [C], and how they are resolved (spec sections 3, 9):

* KL directions (B1): teacher-first ``KL(target || student)`` (the code; standard KD) by default,
  ``kl_direction="as_printed"`` for the paper's order.
* Temperatures (B2): the paper states none, so every KL uses ``T = 1`` by default; the code's
  ``T = 10`` for stage 1 and the server is ``client_temperature=10, server_temperature=10``.
* Noise (B3): ``N(0, I)`` [P]; ``noise="uniform"`` is the code's ``U[0, 1)``.
* Server noise (B4): one ``(z, y)`` fed to every generator [P]; ``share_server_noise=False`` [C].
* Stage 2 (B5): ``local_steps`` fresh mini-batches [P], not the code's pass over a growing cache.
* Label counter (B6): the full static training histogram (data are static, so the counter of
  seen labels converges to it); classes nobody holds get ``tau = 0`` and are never sampled.
* Ramp (B7): ``((r-1)/R)^1`` [P]; ``ramp="code"`` is ``(step/(R-1))^3``. All lambdas 1 [P]
  (the code's ``lambda_2 = 0.1`` is a config value).
* MSE (pitfall 6): the mean over batch and dimensions (code), not the squared norm, so lambda = 1
  does not let a 400-dimensional sum swamp the CE.
* Diversity (pitfall 5): ``L_div^2`` with the code's mean-based distances
  (``diversity_norm="mean"``); ``"paper"`` is the literal norms, whose ``exp`` underflows.
* Server KL (B11): ``server_loss_form`` is one knob for both server arms (``KDC_agg`` and
  ``KD_agg`` reduce their KLs the same way, so Table 3's rows compare aggregations, not
  reductions): ``"paper"`` (default) sums the per-sample KL over classes at ``T = 1`` as the
  paper writes it; ``"code"`` is the code's division by ``C``; ``"hinton"`` multiplies the paper
  form by ``T^2``. Every form takes the batch mean. The code's ``L_kl,3`` bug (``softmax``
  passed as log-probabilities) is not reproduced: all three terms are true KLs.
* Server optimizer knobs (declared with search spaces, for the tuning stage): ``server_lr``,
  ``server_temperature``, ``server_weight_decay`` and ``server_weight_decay_mode``
  (``"coupled"``: Adam's L2, the paper's and code's; ``"decoupled"``: AdamW). Why they matter:
  in the code form at ``T = 10`` the KL gradient is so small that a coupled weight decay of 1e-4
  is 1.7-77x larger (issue 32), so Adam's normalised steps mostly shrink ``G`` and ``D``.
  Client-side flags (``client_temperature``, ``generator_temperature``, the lambdas) never reach
  the server's loss, and the server's never reach the clients' losses (tested); ``kl_direction``
  alone is read by both sides.
* BatchNorm (B13): ``G`` trains in train mode on the server; ``G_i`` teachers and the frozen ``G``
  on clients run in eval mode; BN buffers are uploaded and averaged with the weights.
* Server optimizer: Adam(3e-4, wd 1e-4) [P], created fresh every round (the code keeps one Adam
  for the whole run; the paper does not say).
* Classifier depth (B8): the paper's three FC layers (``lenet5``), not the code's two linear ones.
* Weight decay 1e-4 on every optimizer [P] (the code's local SGD has none).
* ``knowledge_transfer="feature"`` keeps only ``L->mse`` in stage 1 (Table 3's ``AVE_agg``
  feature-only row); ``"feature_logit"`` is the full stage 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    ClientModule,
    ClientStates,
    CollaborativePhase,
    DataFormat,
    RunPhase,
    ServerPhase,
)
from fedhet.algorithms.shared.common import AveragedClientModels
from fedhet.algorithms.shared.generators import (
    ConditionalFeatureGenerator,
    GeneratorClassifierClient,
    GeneratorClassifierMethod,
    GeneratorClassifierPayload,
    GeneratorClassifierServer,
    ServerDistillationHparams,
)
from fedhet.functional import distillation_kl_loss, label_aware_diversity_loss, ramp_weight
from fedhet.functional.conditional_generators import DiversityKind, DiversityNorm, RampForm
from fedhet.hparams import (
    Hyperparameters,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    categorical,
    knob,
    log_uniform,
)

KnowledgeTransfer = Literal["feature_logit", "feature"]


@dataclass(frozen=True)
class FedMDCGHparams(ServerDistillationHparams):
    """FedMD-CG's hyperparameters (all lambdas 1 in the paper; the code's values in parentheses)."""

    generated_batch_size: PositiveInt = knob(64, "labels drawn from p(y) per stage-1 step for L->ce (64)")
    lambda_generated_ce: NonNegativeFloat = knob(1.0, "lambda_1, weight of L->ce (1)", log_uniform(1e-2, 10.0))
    lambda_feature_mse: NonNegativeFloat = knob(
        1.0, "lambda_2, weight of L->mse (1; code 0.1)", log_uniform(1e-2, 10.0)
    )
    lambda_logit_kl: NonNegativeFloat = knob(1.0, "lambda_3, weight of L->kl (1)", log_uniform(1e-2, 10.0))
    lambda_generator_mse: NonNegativeFloat = knob(1.0, "lambda_4, weight of L<-mse (1)", log_uniform(1e-2, 10.0))
    lambda_generator_ce: NonNegativeFloat = knob(1.0, "lambda_5, weight of L<-ce (1)", log_uniform(1e-2, 10.0))
    lambda_diversity: NonNegativeFloat = knob(1.0, "lambda_6, weight of L_div (1)", log_uniform(1e-2, 10.0))
    generator_kl_weight: NonNegativeFloat = knob(1.0, "weight of L<-kl (1 in Eq. 9)")
    diversity: DiversityKind = knob(
        "div2", "diversity loss: div2 (paper), div1, div0 or none", categorical("div2", "div1", "div0", "none")
    )
    diversity_norm: DiversityNorm = knob("mean", "diversity distances: mean (code) or paper (literal norms)")
    ramp: RampForm = knob("paper", "stage-1 ramp: paper (((r-1)/R)^d) or code ((step/(R-1))^3)")
    ramp_power: PositiveFloat = knob(1.0, "d, the power of the paper's ramp (1)")
    client_temperature: PositiveFloat = knob(1.0, "T of L->kl (1; code 10)", log_uniform(0.5, 20.0))
    generator_temperature: PositiveFloat = knob(1.0, "T of L<-kl (1, as the code)", log_uniform(0.5, 20.0))
    knowledge_transfer: KnowledgeTransfer = knob(
        "feature_logit", "stage 1: feature_logit (full) or feature (L->mse only, Table 3's AVE_agg rows)"
    )


class FedMDCGClient(GeneratorClassifierClient):
    """Stage 1 (Eq. 4): CE plus the ramped transfer from ``G``; stage 2 (Eq. 9): ``G_i`` mimics ``F_i``.

    Reads the lambdas, ``diversity`` (the loss's form), ``diversity_norm``, ``ramp``,
    ``ramp_power``, ``kl_direction``, the temperatures, ``generated_batch_size`` and
    ``knowledge_transfer`` (:class:`FedMDCGHparams`).
    """

    Hparams = FedMDCGHparams

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        generator: ConditionalFeatureGenerator,
        hp: Any = None,
        **overrides: Any,
    ) -> None:
        super().__init__(model, num_classes, generator, hp, **overrides)
        self.last_parts: dict[str, float] = {}

    # ------------------------------------------------------------------ losses
    def ramp(self) -> float:
        """The stage-1 ramp factor of this round (0 in the first round)."""
        return ramp_weight(self.round_idx, max(self.total_rounds, 1), self.hp.ramp, self.hp.ramp_power)

    def model_update_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Stage 1, Eq. 4: CE plus the ramped transfer from the frozen global generator."""
        hp = self.hp
        features = self.model.forward_features(x)
        logits = self.model.forward_head(features)
        loss = F.cross_entropy(logits, y)
        ramp = self.ramp()
        if not self.has_global or ramp == 0.0:
            return loss
        self.global_generator.eval()
        with torch.no_grad():
            generated, _ = self.global_generator(y)
        if hp.lambda_feature_mse:
            loss = loss + ramp * hp.lambda_feature_mse * F.mse_loss(features, generated)
        if hp.knowledge_transfer == "feature":
            return loss
        if hp.lambda_logit_kl:
            target = self.model.forward_head(generated).detach()  # [C] B14: only D_i(F_i(x)) is pulled
            kl = distillation_kl_loss(logits, target, hp.client_temperature, hp.kl_direction)
            loss = loss + ramp * hp.lambda_logit_kl * kl
        if hp.lambda_generated_ce and self.label_distribution is not None:
            distribution = self.label_distribution.to(x.device)
            labels = torch.multinomial(distribution, hp.generated_batch_size, replacement=True)
            with torch.no_grad():
                sampled, _ = self.global_generator(labels)
            ce = F.cross_entropy(self.model.forward_head(sampled), labels)
            loss = loss + ramp * hp.lambda_generated_ce * ce
        return loss

    def generator_update_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Stage 2, Eq. 9: ``G_i`` mimics ``F_i`` and is classified right by the frozen ``D_i``."""
        hp = self.hp
        self.model.eval()
        self.generator.train()
        with torch.no_grad():
            features = self.model.forward_features(x)
            target_logits = self.model.forward_head(features)
        generated, noise = self.generator(y)
        logits = self.model.forward_head(generated)
        kl = distillation_kl_loss(logits, target_logits, hp.generator_temperature, hp.kl_direction)
        mse = F.mse_loss(generated, features)
        ce = F.cross_entropy(logits, y)
        onehot = F.one_hot(y, self.num_classes)
        diversity = label_aware_diversity_loss(generated, noise, onehot, hp.diversity, hp.diversity_norm)
        self.last_parts = {k: float(v.detach()) for k, v in (("kl", kl), ("mse", mse), ("ce", ce), ("div", diversity))}
        return (
            hp.generator_kl_weight * kl
            + hp.lambda_generator_mse * mse
            + hp.lambda_generator_ce * ce
            + hp.lambda_diversity * diversity
        )


class FedMDCG(GeneratorClassifierMethod):
    """FedMD-CG (label skew; extractors may differ when they share ``feature_dim`` and the classifier)."""

    Hparams = FedMDCGHparams
    client_type = FedMDCGClient

    def build_server(self) -> ServerPhase:
        return GeneratorClassifierServer(self.make_generator, self.hp)


class PaperProtocol(Algorithm):
    """Any method evaluated as FedMD-CG's paper evaluates its baselines (L.acc and G.acc).

    The base method is unchanged; only what is measured changes: every client starts from one
    initialisation, ``acc_local`` is each client's model after local training and before the
    download (L.acc), and ``acc_server`` the virtual global model (G.acc), built by the loop for
    evaluation only. ``method: {class_path: fedhet.algorithms.fedmdcg.PaperProtocol, init_args:
    {base: {class_path: fedhet.algorithms.LGFedAvg, init_args: {lr: 0.05}}}}``.

    It has no hyperparameters of its own: ``hp`` is the base's.

    Args:
        base: the method evaluated.
    """

    Hparams = Hyperparameters

    def __init__(self, base: Algorithm) -> None:
        super().__init__()
        self.base = base
        self.hp = base.hp
        self.capabilities = base.capabilities  # type: ignore[misc]
        self.upload_type = base.upload_type  # type: ignore[misc]
        self.download_type = base.download_type  # type: ignore[misc]
        self.evaluation = ("clients_before_download", "server")  # type: ignore[misc]
        self.virtual_global = AveragedClientModels()

    def initialisation_of(self, client_id: int) -> int:
        return 0

    def evaluation_models(self, server: ServerPhase, clients: ClientStates) -> dict[str, nn.Module]:
        return self.virtual_global(clients)

    @property
    def name(self) -> str:
        return self.base.name

    def configure(self, data_format: DataFormat) -> None:
        super().configure(data_format)
        self.base.configure(data_format)

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return self.base.build_client(model, num_classes)

    def build_server(self) -> ServerPhase:
        return self.base.build_server()

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase | None:
        return self.base.build_collaborative_phase(clients)

    def collaborative_epochs(self) -> int:
        return self.base.collaborative_epochs()

    def phases(self) -> Sequence[RunPhase]:
        return self.base.phases()


__all__ = [
    "ConditionalFeatureGenerator",
    "FedMDCG",
    "FedMDCGClient",
    "FedMDCGHparams",
    "GeneratorClassifierPayload",
    "PaperProtocol",
]
