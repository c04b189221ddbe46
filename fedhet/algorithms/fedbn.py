"""FedBN: FedAvg that keeps every client's BatchNorm layers local.

Paper: Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021 (Algorithm 1): the server averages every parameter except those of
BatchNorm layers, which each client keeps and trains for its own feature distribution.

Upload: the model's weights minus its BatchNorm layers (affine parameters and running statistics).
Download: the average of those weights, per architecture.
Server phase: closed-form example-weighted averaging (FedAvg's) of the non-BatchNorm weights.
Client state kept across rounds: the whole model (its BatchNorm layers are the personal part).
Deviations from paper/official code: none. There is no global model to score (``acc_server``):
its BatchNorm layers would be nobody's.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, Capabilities, ServerContext
from fedhet.algorithms.shared.common import SubmoduleAveragingServer, SubmoduleSharingClient, batch_norm_state_keys
from fedhet.core.payloads import WeightsPayload


class FedBNClient(SubmoduleSharingClient):
    """Cross-entropy locally; uploads and receives everything but its BatchNorm layers."""

    def shared_state(self) -> dict[str, Tensor]:
        local = batch_norm_state_keys(self.model)
        return {key: value for key, value in super().shared_state().items() if key not in local}


class FedBNServer(SubmoduleAveragingServer):
    """FedAvg's per-architecture averaging over the non-BatchNorm weights."""

    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        assert context.model_factory is not None, "FedBN's server needs the model factory to find BatchNorm layers"
        for architecture, weights in self.global_by_architecture.items():
            local = batch_norm_state_keys(context.model_factory(architecture, context.seed))
            self.global_by_architecture[architecture] = {k: v for k, v in weights.items() if k not in local}

    def server_models(self) -> dict[str, nn.Module]:
        return {}


class FedBN(Algorithm):
    """FedBN (homogeneous models); its hyperparameters are the shared local optimizer's."""

    client_type = FedBNClient
    capabilities = Capabilities(heterogeneous_models=False)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def build_server(self) -> FedBNServer:
        return FedBNServer()


__all__ = ["FedBN", "FedBNClient", "FedBNServer"]
