"""FedPer: a shared feature extractor (base layers), a personal classifier (head) per client.

Paper: Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019; one of FedMD-CG's partial-sharing baselines (spec
``reference/fedmdcg.md`` section 8).

Upload: every entry of the client's model except ``head`` (``WeightsPayload``), with its number
of training examples.
Download: the example-weighted average of those base layers (from round 0 on: the initial base
is client 0's, so every client starts from one extractor).
Server phase: closed-form, ``base <- sum_k n_k / n * base_k`` (:class:`SubmoduleAveragingServer`
restricted to the non-head entries).
Client state kept across rounds: the whole model (its personal ``head``) and optimizer state;
the base layers are overwritten by each download.
Local objective: cross-entropy on the whole model.
Deviations from paper/official code: none in substance; FedMD-CG's code averages the whole model
and restores each client's classifier afterwards, which is the same computation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, Batch, Capabilities, ClientModule, ServerContext, ServerPhase
from fedhet.algorithms.shared.common import HEAD_PREFIX, SubmoduleAveragingServer
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.core.state import clone_state


def base_layers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The entries of a model state dict outside ``head``."""
    return {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}


class FedPerClient(ClientModule):
    """Cross-entropy locally; takes the global base layers at each round start, keeps its own head."""

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            self.model.load_state_dict(download.weights, strict=False)

    def make_upload(self, train_batches: Iterable[Batch]) -> Payload | None:
        return WeightsPayload(weights=clone_state(base_layers(self.model.state_dict())))


class FedPerServer(SubmoduleAveragingServer):
    """Example-weighted average of the base layers (the whole-model defaults of :class:`SubmoduleAveragingServer`)."""

    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        self.global_by_architecture = {k: base_layers(v) for k, v in self.global_by_architecture.items()}

    def server_models(self) -> dict[str, nn.Module]:
        return {}  # no global head exists


class FedPer(Algorithm):
    """FedPer (homogeneous models: the base layers are averaged)."""

    client_type = FedPerClient
    capabilities = Capabilities(heterogeneous_models=False)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def build_server(self) -> ServerPhase:
        return FedPerServer()
