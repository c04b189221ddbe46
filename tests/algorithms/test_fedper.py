"""FedPer: the base layers are averaged from a common start; every head stays its client's own."""

from __future__ import annotations

import torch

from fedhet.algorithms import FedPer
from fedhet.core.payloads import WeightsPayload
from tests.algorithms.helpers import TinyLinear, context, upload


def _client(body: float, head: float):
    return FedPer().build_client(TinyLinear(body=torch.full((2, 2), body), head=torch.full((2, 2), head)), 2)


def test_round_zero_sends_client_zeros_base_and_the_server_averages_bases_by_examples():
    """Every client starts from client 0's base (no head); bases 1 and 5 with 1 and 3 examples average to 4."""
    clients = [_client(1.0, 7.0), _client(2.0, 8.0)]
    server = FedPer().build_server()
    server.setup_server(context(initial=lambda cid: clients[cid].state_dict()))
    first = server.download_for(1)
    assert set(first.weights) == {"body.weight"} and torch.equal(first.weights["body.weight"], torch.ones(2, 2))
    uploads = [upload(cid, WeightsPayload(weights={"body.weight": torch.full((2, 2), b)}, num_examples=n))
               for cid, (b, n) in enumerate(((1.0, 1), (5.0, 3)))]  # fmt: skip
    server.aggregate(0, uploads)
    assert torch.equal(server.download_for(0).weights["body.weight"], torch.full((2, 2), 4.0))
    assert server.server_models() == {}


def test_a_client_takes_the_base_and_keeps_its_head_and_uploads_its_base_only():
    """The download overwrites the base layers only; the upload is the base without the head."""
    client = _client(2.0, 8.0)
    client.on_receive(WeightsPayload(weights={"body.weight": torch.full((2, 2), 4.0)}))
    assert torch.equal(client.model.body.weight, torch.full((2, 2), 4.0))
    assert torch.equal(client.model.head.weight, torch.full((2, 2), 8.0))
    sent = client.make_upload([])
    assert set(sent.weights) == {"body.weight"} and torch.equal(sent.weights["body.weight"], torch.full((2, 2), 4.0))
    client.on_receive(None)  # nothing received (a round without download): the model is unchanged
    assert torch.equal(client.model.body.weight, torch.full((2, 2), 4.0))
