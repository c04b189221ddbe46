"""FedAvg: weighted averaging of whole models.

Paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017 (Algorithm 1, FederatedAveraging).

Upload: the client's model weights (``WeightsPayload``) and its number of training examples.
Download: the global model weights.
Server phase: closed-form, ``w <- sum_k n_k / n * w_k`` over the round's participants
(:func:`fedhet.functional.weighted_average`), BatchNorm buffers included.
Client state kept across rounds: its optimizer state (momentum), when
``federation.persist_optimizer_state`` is on; the weights are overwritten by each download.
Deviations from paper/official code: the global model starts from client 0's initialisation
(the paper only needs a common start); integer buffers (``num_batches_tracked``) are averaged
and rounded rather than left undefined.
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
from fedhet.federation.payloads import Payload, WeightsPayload
from fedhet.federation.state import copy_state_into
from fedhet.federation.trainer import clone_state
from fedhet.functional import weighted_average
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat

MODEL_PREFIX = "model."


def model_weights(module_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The backbone's weights inside a client module's state dict (keys without ``model.``)."""
    return {k[len(MODEL_PREFIX) :]: v for k, v in module_state.items() if k.startswith(MODEL_PREFIX)}


class FedAvgClient(ClientModule):
    """Cross-entropy locally; starts each round from the global model."""

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            copy_state_into(self.model, download.weights)

    def make_upload(self, train_batches: Iterable[Batch]) -> WeightsPayload:
        return WeightsPayload(weights=clone_state(self.model.state_dict()))


class FedAvgServer(ServerPhase):
    """Holds the global model; aggregates by example-weighted averaging."""

    def __init__(self) -> None:
        self.global_weights: dict[str, Tensor] = {}

    def setup(self, context: ServerContext) -> None:
        self.global_weights = model_weights(context.initial_client_state(0))

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        for upload in uploads:
            assert isinstance(upload.payload, WeightsPayload)
            upload.payload.validate_against(self.global_weights, f"client {upload.client_id}")
        self.global_weights = weighted_average(
            [u.payload.weights for u in uploads],  # type: ignore[attr-defined]
            [u.payload.num_examples for u in uploads],
        )

    def download_for(self, client_id: int) -> WeightsPayload:
        return WeightsPayload(weights=self.global_weights)

    def state_dict(self) -> dict[str, Any]:
        return {"global_weights": self.global_weights}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_weights = dict(state["global_weights"])


class FedAvg(Algorithm):
    """FedAvg (homogeneous models only).

    Args:
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities = Capabilities(heterogeneous_models=False)
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
        return FedAvgClient(model, num_classes, **self.optimizer_kwargs())

    def build_server(self) -> ServerPhase:
        return FedAvgServer()
