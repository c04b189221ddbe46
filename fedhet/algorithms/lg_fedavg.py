"""LG-FedAvg: local representations, a global classifier head averaged FedAvg-style.

Paper: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", arXiv:2001.01523, 2020 (Algorithm 1). Heterogeneous form and
defaults of HtFLlib (``serverlg.py`` / ``clientlg.py``), the implementation FedKTL's Table 1 ran
(no method hyperparameters, FedKTL App. C).

Upload: the client's classifier head ``nn.Linear(K', C)`` (``WeightsPayload``): ``K'*C + C``
floats (FedKTL Table 5), with the client's number of training examples.
Download: the averaged head, from the end of round 0 on (before that clients keep their own).
Server phase: closed-form, ``head <- sum_k n_k / n * head_k`` over the round's participants
(:func:`fedhet.functional.weighted_average`, HtFLlib's ``uploaded_weights``).
Client state kept across rounds: the whole model (the feature extractor never leaves the
client) and its optimizer state; the head is overwritten by each download.
Local objective: cross-entropy on the whole model.
Deviations from paper/official code: the paper's global part is the top layers chosen per
architecture; heterogeneous backbones share only the final linear head, as in HtFLlib (every
backbone emits ``feature_dim`` features; fedhet's ``feature_proj`` picks HtFLlib's pooling or a
linear neck).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    OptimizerName,
    ServerContext,
    ServerPhase,
)
from fedhet.algorithms.fedavg import model_weights
from fedhet.federation.payloads import Payload, WeightsPayload
from fedhet.federation.state import copy_state_into
from fedhet.federation.trainer import clone_state
from fedhet.functional import weighted_average
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat

HEAD_PREFIX = "head."


def head_weights(module_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The classifier head's weights inside a client module's state dict (keys without ``model.head.``)."""
    return {k[len(HEAD_PREFIX) :]: v for k, v in model_weights(module_state).items() if k.startswith(HEAD_PREFIX)}


class LGFedAvgClient(ClientModule):
    """Cross-entropy locally; swaps the global head into its own model at each round start."""

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            copy_state_into(self.model.head, download.weights)

    def make_upload(self, train_batches: Iterable[Batch]) -> WeightsPayload:
        return WeightsPayload(weights=clone_state(self.model.head.state_dict()))


class LGFedAvgServer(ServerPhase):
    """Holds the global head; aggregates the participants' heads by example-weighted averaging."""

    def __init__(self) -> None:
        self.reference: dict[str, Tensor] = {}
        self.global_head: dict[str, Tensor] | None = None

    def setup(self, context: ServerContext) -> None:
        # Client 0's initial head only fixes the expected keys and shapes; it is never sent.
        self.reference = head_weights(context.initial_client_state(0))

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        for upload in uploads:
            assert isinstance(upload.payload, WeightsPayload)
            upload.payload.validate_against(self.reference, f"client {upload.client_id}")
        self.global_head = weighted_average(
            [u.payload.weights for u in uploads],  # type: ignore[attr-defined]
            [u.payload.num_examples for u in uploads],
        )

    def download_for(self, client_id: int) -> WeightsPayload | None:
        return None if self.global_head is None else WeightsPayload(weights=self.global_head)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.global_head is None else {"global_head": self.global_head}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        head = state.get("global_head")
        self.global_head = None if head is None else dict(head)


class LGFedAvg(Algorithm):
    """LG-FedAvg in HtFLlib's heterogeneous form (shared head; needs one feature dimension).

    Args:
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def __init__(
        self,
        optimizer: OptimizerName = "sgd",
        lr: PositiveFloat = 0.01,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        # Same as Algorithm's; restated so that the parser checks the ranges of these values.
        super().__init__(optimizer, lr, momentum, weight_decay)

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return LGFedAvgClient(model, num_classes, **self.optimizer_kwargs())

    def build_server(self) -> ServerPhase:
        return LGFedAvgServer()
