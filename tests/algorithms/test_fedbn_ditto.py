"""FedBN and Ditto, the worked examples of docs/adding_a_method.md: hand-computed behaviour."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from fedhet.algorithms import Ditto, FedBN
from fedhet.algorithms.base import ServerContext
from fedhet.core.payloads import WeightsPayload
from tests.algorithms.helpers import TinyLinear, upload

X, Y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])


class TinyBN(TinyLinear):
    """TinyLinear with a BatchNorm layer between body and head (affine weight 1, bias 0 by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)

    def forward_features(self, x: Tensor) -> Tensor:
        return self.bn(super().forward_features(x))


def test_fedbn_uploads_everything_but_batch_norm():
    """The BatchNorm layer's weight, bias and running statistics never leave the client."""
    client = FedBN().build_client(TinyBN(), 2)
    sent = client.make_upload([(X, Y)])
    assert set(sent.weights) == {"body.weight", "head.weight"}


def test_fedbn_download_leaves_the_clients_batch_norm_alone():
    """A download replaces body and head; the client's own BatchNorm values stay."""
    client = FedBN().build_client(TinyBN(), 2)
    with torch.no_grad():
        client.model.bn.weight.fill_(3.0)
        client.model.bn.running_mean.fill_(0.5)
    client.on_receive(WeightsPayload(weights={"body.weight": 2 * torch.eye(2), "head.weight": torch.ones(2, 2)}))
    assert torch.equal(client.model.body.weight, 2 * torch.eye(2))
    assert torch.equal(client.model.head.weight, torch.ones(2, 2))
    assert torch.equal(client.model.bn.weight, torch.full((2,), 3.0))
    assert torch.equal(client.model.bn.running_mean, torch.full((2,), 0.5))


def test_fedbn_server_averages_the_shared_weights_by_examples_by_hand():
    """Bodies 0 and 4 with 1 and 3 examples average to (0 * 1 + 4 * 3) / 4 = 3; BatchNorm is not on the server."""
    client = FedBN().build_client(TinyBN(), 2)
    server = FedBN().build_server()
    requested = []
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=2,
            architectures=("x", "x"),
            seed=0,
            initial_client_state=lambda cid: client.state_dict(),
            model_factory=lambda architecture, seed: requested.append((architecture, seed)) or TinyBN(),
        )
    )
    assert requested == [("x", 0)]  # the architecture's own network tells which keys are BatchNorm
    assert set(server.download_for(0).weights) == {"body.weight", "head.weight"}
    bodies = (torch.zeros(2, 2), torch.full((2, 2), 4.0))
    uploads = [
        upload(cid, WeightsPayload(weights={"body.weight": body, "head.weight": torch.eye(2)}, num_examples=n))
        for cid, (body, n) in enumerate(zip(bodies, (1, 3), strict=True))
    ]
    server.aggregate(0, uploads)
    assert torch.equal(server.download_for(1).weights["body.weight"], torch.full((2, 2), 3.0))
    assert server.server_models() == {}


def _ditto_client(lam: float):
    client = Ditto(lam=lam).build_client(TinyLinear(), 2)
    client.on_receive(WeightsPayload(weights={"body.weight": torch.eye(2), "head.weight": torch.eye(2)}))
    with torch.no_grad():  # the personal model has moved away from the received w^t by ||.||^2 = 1 + 4 = 5
        client.personal.body.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
        client.personal.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
    return client


def test_ditto_personal_loss_is_cross_entropy_plus_half_lambda_distance_to_the_received_model_by_hand():
    """Personal logits [2, 0]: CE = log(1 + e^-2) = 0.126928; lam/2 * 5 = 1.25 at lam = 0.5."""
    client = _ditto_client(lam=0.5)
    client.stage = "personal"
    assert client.local_loss((X, Y)).item() == pytest.approx(0.126928 + 1.25, abs=1e-6)
    assert client(X).tolist() == [[2.0, 0.0]]  # evaluation scores the personal model


def test_ditto_global_stage_is_plain_cross_entropy_of_the_global_copy():
    """The global copy (identity) gives logits [1, 0]: CE = log(1 + e^-1) = 0.313262, no proximal term."""
    client = _ditto_client(lam=100.0)
    client.stage = "global"
    assert client.local_loss((X, Y)).item() == pytest.approx(0.313262, abs=1e-6)


def test_ditto_each_stage_steps_only_its_own_model():
    """The global stage's optimizer holds the global copy, the personal stage's the personal model."""
    client = _ditto_client(lam=0.5)
    for stage, model in (("global", client.model), ("personal", client.personal)):
        client.stage = stage
        optimizer = client.configure_optimizers()
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert stepped == {id(p) for p in model.parameters()}
    assert [s.name for s in client.local_stages()] == ["global", "personal"]


def test_ditto_client_alone_has_its_methods_defaults():
    """A client built on its own reads Ditto's declared defaults."""
    alone = type(Ditto().build_client(TinyLinear(), 2))(TinyLinear(), 2)
    assert dataclasses.asdict(alone.hp) == dataclasses.asdict(Ditto().hp)
    assert alone.hp.lam == 0.1


def test_ditto_without_a_download_has_no_anchor_and_keeps_its_arguments():
    """Built (lam and num_classes kept), or after a round that received nothing: the personal loss is plain CE."""
    import torch.nn.functional as F

    from fedhet.algorithms.ditto import PERSONAL

    client = Ditto().build_client(TinyLinear(), 3)
    client = type(client)(TinyLinear(), 3, lam=2.0)
    assert client.num_classes == 3 and client.hp.lam == 2.0
    client.on_fit_start()  # a fit before any receive (a plain Trainer) starts without an anchor
    client.stage = PERSONAL
    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([1, 0])
    client.on_receive(None)
    with torch.no_grad():
        client.personal.body.weight.add_(0.5)
    assert client.local_loss((x, y)).item() == pytest.approx(F.cross_entropy(client.personal(x), y).item())
