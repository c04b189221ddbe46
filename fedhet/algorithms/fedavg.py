"""FedAvg: weighted averaging of whole models.

Paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017 (Algorithm 1, FederatedAveraging).

Upload: the client's model weights (``WeightsPayload``) and its number of training examples.
Download: the global model weights.
Server phase: closed-form, ``w <- sum_k n_k / n * w_k`` over the round's participants of each
architecture
(:func:`fedhet.functional.weighted_average`), BatchNorm buffers included.
Client state kept across rounds: its optimizer state (momentum), when
``federation.persist_optimizer_state`` is on; the weights are overwritten by each download.
Deviations from paper/official code: the global model starts from client 0's initialisation
(the paper only needs a common start); integer buffers (``num_batches_tracked``) are averaged
and rounded rather than left undefined.
"""

from __future__ import annotations

from fedhet.algorithms.base import (
    Algorithm,
    Capabilities,
    ServerPhase,
)
from fedhet.algorithms.common import MODEL_PREFIX, SubmoduleAveragingServer, SubmoduleSharingClient
from fedhet.core.payloads import WeightsPayload


class FedAvgClient(SubmoduleSharingClient):
    """Cross-entropy locally; starts each round from the global model and uploads the whole model."""

    shared_module = "model"


class FedAvgServer(SubmoduleAveragingServer):
    """Holds the global model of each architecture; aggregates by example-weighted averaging.

    Uploads are averaged within each architecture (FedDF's per-architecture fusion; with one
    architecture this is FedAvg). Every client receives its architecture's global model, which is
    also the server-side model evaluated once per evaluation (``acc_server``).
    """

    def __init__(self) -> None:
        super().__init__(MODEL_PREFIX, "samples", per_architecture=True, send_initial=True)


class FedAvg(Algorithm):
    """FedAvg (homogeneous models only); its hyperparameters are the shared local optimizer's."""

    client_type = FedAvgClient
    capabilities = Capabilities(heterogeneous_models=False)
    upload_type = WeightsPayload
    download_type = WeightsPayload
    evaluation = ("clients", "server")

    def build_server(self) -> ServerPhase:
        return FedAvgServer()
