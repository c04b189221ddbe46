"""FedMRL one-step oracle: two clients' local steps, the server's average and the next round, against plain PyTorch.

Written from the paper (Yi et al., NeurIPS 2024, Sec. 3 / Algorithm 1): per batch
``R = P([G_ex(x) ; F_ex(x)])``, loss ``m_1 CE(G_hd(R[:, :d_2]), y) + m_2 CE(F_hd(R), y)``, one SGD
step on ``G``, ``F`` and ``P`` together; the server averages the small models ``G`` with the
clients' example counts (FedAvg). Two of three clients take two steps each (weight decay on), the
server averages, client 0 takes two more steps from the new download with its own model and
projector kept. Every parameter and buffer (BatchNorm statistics of both networks included), the
uploads, the download and the predictions are compared to 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import FedMRL
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from tests.algorithms.oracle import (
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    example_weighted_mean,
    prefixed,
    server_step,
    sgd_step,
    without_prefix,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

ORACLE_COVERS = {"fedmrl"}

M, CHANNELS, SIZE = 4, 1, 8
FORMAT = DataFormat(image_size=SIZE, channels=CHANNELS, mean=(0.0,), std=(1.0,), num_classes=M)
EXAMPLES = (8, 6, 10)
STEPS = 2
HP = dict(
    lr=0.1,
    weight_decay=1e-3,
    small_model="cnn_tiny",
    small_feature_dim=4,  # d_2 = 4 < d_1 = 8 (TinyBNNet's features)
    coarse_weight=0.7,
    fine_weight=1.3,
    small_weighting="samples",
)


def make_context(algorithm) -> ServerContext:
    """Three clients of one architecture (the server reads the small model's keys from the initial state)."""
    initial = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=100), M).client_state()
    return ServerContext(
        num_clients=3,
        num_classes=M,
        architectures=("tiny",) * 3,
        seed=5,
        initial_client_state=lambda cid: clone(initial),
        data_format=FORMAT,
    )


class OracleClient:
    """The client's three networks as plain modules, trained by the paper's loss with hand-written SGD."""

    def __init__(self, own: nn.Module, small: nn.Module, state: dict) -> None:
        self.own, self.small = copy.deepcopy(own), copy.deepcopy(small)
        self.own.load_state_dict(without_prefix(state, "model."))
        self.small.load_state_dict(without_prefix(state, "small."))
        weight = state["projector.weight"]
        self.projector = nn.Linear(weight.shape[1], weight.shape[0])
        self.projector.load_state_dict(without_prefix(state, "projector."))

    def receive(self, small_weights: dict) -> None:
        self.small.load_state_dict(small_weights)

    def logits(self, x):
        r = self.projector(torch.cat([self.small.forward_features(x), self.own.forward_features(x)], dim=1))
        d2 = HP["small_feature_dim"]
        return self.small.forward_head(r[:, :d2]), self.own.forward_head(r)

    def step(self, x, y) -> None:
        for net in (self.own, self.small, self.projector):
            net.train()
        coarse, fine = self.logits(x)
        loss = HP["coarse_weight"] * F.cross_entropy(coarse, y) + HP["fine_weight"] * F.cross_entropy(fine, y)
        loss.backward()
        params = [*self.own.parameters(), *self.small.parameters(), *self.projector.parameters()]
        sgd_step(params, HP["lr"], HP["weight_decay"])

    def state(self) -> dict:
        return {
            **prefixed(self.own.state_dict(), "model."),
            **prefixed(self.small.state_dict(), "small."),
            **prefixed(self.projector.state_dict(), "projector."),
        }


def test_fedmrl_matches_the_oracle():
    """Client steps, the example-weighted small-model average, the next round's step and the prediction."""
    algorithm = FedMRL(**HP)
    algorithm.configure(FORMAT)
    server = algorithm.build_server()
    server.setup_server(make_context(algorithm))
    modules, oracles, uploads = [], [], []
    for cid in range(2):  # client 2 sits the round out
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        oracle = OracleClient(module.model, module.small, clone(module.client_state()))
        before = clone(module.client_state())
        download = server.download_for(cid)
        oracle.receive(download.weights)
        payload = client_step(module, download, batch(cid), num_examples=EXAMPLES[cid], epochs=STEPS)
        x, y = batch(cid)
        for _ in range(STEPS):
            oracle.step(x, y)
        assert_moved(before, module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), oracle.state(), f"client {cid} state")
        assert_states_close(payload.weights, oracle.small.state_dict(), f"client {cid} upload (the small model)")
        modules.append(module)
        oracles.append(oracle)
        uploads.append(ClientUpload(cid, "tiny", payload))

    server_step(server, 0, uploads)
    expected = example_weighted_mean([o.small.state_dict() for o in oracles], EXAMPLES[:2])
    download = server.download_for(2)
    assert_states_close(download.weights, expected, "aggregated small model")

    # round 1: client 0 takes the averaged small model, keeps its own model and projector
    client_step(modules[0], download, batch(5), round_idx=1, state=modules[0].client_state(), epochs=STEPS)
    oracles[0].receive(expected)
    x, y = batch(5)
    for _ in range(STEPS):
        oracles[0].step(x, y)
    assert_states_close(modules[0].client_state(), oracles[0].state(), "client 0 in the next round")

    # prediction: the client's head on the fused representation (eval mode)
    for net in (oracles[0].own, oracles[0].small, oracles[0].projector):
        net.eval()
    with torch.no_grad():
        assert_states_close({"logits": modules[0].eval()(x)}, {"logits": oracles[0].logits(x)[1]}, "prediction")
