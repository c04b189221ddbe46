"""FedProto: clients share per-class prototypes (mean features) instead of models.

Paper: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI 2022 (Eq. 4-8, Algorithm 1). Hyperparameter default from FedKTL's baseline table
(lambda = 0.1, HtFLlib).

Upload: per-class mean features of the client's training data, ``C_i^(j)``, for the classes it
holds, with the per-class counts (``ClassStatsPayload``).
Download: the global prototypes ``C-bar^(j)`` of every class some client holds.
Server phase: closed-form. Paper Eq. 6 weights client ``i``'s prototype of class ``j`` by
``|D_{i,j}| / N_j`` (``proto_weighting="count"``, the default); HtFLlib takes the unweighted mean
over the clients holding the class (``"uniform"``). Classes missing on a client are ignored.
Client state kept across rounds: the local model and optimizer state (models are never shared).
Local objective: ``CE(f(x), y) + lambda * MSE(z(x), C-bar^(y))`` over the samples whose class has
a global prototype (paper Eq. 8; MSE averaged over feature elements as in HtFLlib).
Deviations from paper/official code: by default prototypes are computed in an eval-mode pass
over the training data after local training (``class_means_from="eval_pass"``: Eq. 5's mean of
the uploaded model's embeddings). The authors' code and HtFLlib's ``clientproto.py`` average the
embeddings their training steps computed, in train mode and over every local epoch (the
extra pass is skipped); ``class_means_from="training_steps"`` does that. (Earlier versions of this
docstring said HtFLlib also used an eval pass; its FedGH and FedTGP do, its FedProto does not.)
Evaluation uses the client's own classifier head, not nearest-prototype classification (which
HtFLlib uses); both are personalised predictions of the same model. Heterogeneous backbones
emit one feature dimension through ``feature_dim`` (HtFLlib's ``-fd``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhet.algorithms.base import Algorithm, Capabilities, ServerPhase
from fedhet.algorithms.shared.common import ClassMeanRegularizedHparams, ClassMeanServer, FedProtoClient, Weighting
from fedhet.core.payloads import ClassStatsPayload
from fedhet.hparams import knob


@dataclass(frozen=True)
class FedProtoHparams(ClassMeanRegularizedHparams):
    """FedProto's hyperparameters (``lam`` is the paper's lambda, the prototype regulariser's weight)."""

    proto_weighting: Weighting = knob("count", "global prototype weighting: count (paper Eq. 6) or uniform (HtFLlib)")


class FedProto(Algorithm):
    """FedProto (heterogeneous models; needs one feature dimension)."""

    Hparams = FedProtoHparams
    client_type = FedProtoClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = ClassStatsPayload

    def build_server(self) -> ServerPhase:
        return ClassMeanServer(self.hp.proto_weighting)


__all__ = ["FedProto", "FedProtoHparams"]
