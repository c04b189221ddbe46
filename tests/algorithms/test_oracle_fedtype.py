"""FedType one-step oracle: conformal calibration, asymmetric reciprocal distillation, proxy FedAvg.

FedType (Wang et al., ICML 2024) as fedhet implements it (``fedhet/algorithms/fedtype.py``; the
paper is not among the seeds, so the module docstring is the specification):

* at the start of every local update each model's split-conformal threshold is calibrated on the
  client's training data in eval mode: LAC scores ``s = 1 - p_y(x)``, the threshold the
  ``ceil((n + 1)(1 - alpha))``-th smallest score (1 when that rank exceeds ``n``);
* per batch, in train mode, each sample's prediction set is ``{c : 1 - p_c(x) <= threshold}`` (an
  empty set counts as all ``C`` classes); the proxy teaches the private model where its set is
  strictly smaller, the private model teaches the proxy otherwise;
* loss ``CE(private) + CE(proxy) + kd_weight * mean_i [w_pp KL(p_proxy || p_private) +
  w_pq KL(p_private || p_proxy)]``, the teacher's distribution a constant, one SGD step on both
  models, each model's gradient clipped on its own;
* upload the proxy; the server's download is the example-weighted mean of the proxies (FedAvg),
  the initial proxy before any aggregation.

Two clients (TinyBNNet private models, a ``cnn_tiny`` proxy with BatchNorm) run round 0 for two
steps from the initial proxy, the server averages, and client 0 runs round 1 from the download.
Every parameter and buffer, both uploads and the download are compared with the oracle to 1e-6;
the oracle checks that both directions of distillation occur, so a swapped or one-sided weight fails.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.algorithms import get_algorithm
from fedhet.algorithms.base import ClientUpload, ServerContext
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
from tests.algorithms.test_oracle_fedftg import CHANNELS, FORMAT, M
from tests.algorithms.test_oracle_partial import clip_each

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedtype"}

LR, WEIGHT_DECAY, KD_WEIGHT, STEPS = 0.2, 1e-3, 0.7, 2
EXAMPLES = (8, 6)


def threshold(net: torch.nn.Module, x: Tensor, y: Tensor, alpha: float) -> Tensor:
    """Split-conformal threshold of ``net`` on ``(x, y)`` in eval mode (LAC score ``1 - p_y``)."""
    net.eval()
    with torch.no_grad():
        scores = 1.0 - torch.softmax(net(x), 1)[torch.arange(len(y)), y]
    net.train()
    rank = math.ceil((len(scores) + 1) * (1 - alpha))
    return torch.ones(()) if rank > len(scores) else torch.sort(scores).values[rank - 1]


def set_sizes(logits: Tensor, tau: Tensor) -> Tensor:
    """``|{c : 1 - p_c <= tau}|`` per sample (0: an empty set)."""
    return ((1.0 - torch.softmax(logits.detach(), 1)) <= tau).sum(1)


def least_certain_if_empty(sizes: Tensor) -> Tensor:
    """An empty set counted as all ``C`` classes."""
    return torch.where(sizes == 0, M, sizes)


def kl(target_logits: Tensor, logits: Tensor) -> Tensor:
    """``KL(softmax(target) || softmax(logits))`` per sample; the target a constant."""
    log_p = torch.log_softmax(target_logits.detach(), 1)
    return (log_p.exp() * (log_p - torch.log_softmax(logits, 1))).sum(1)


def oracle_round(state, proxy_template, download, data, max_grad_norm, alpha, seen: list) -> dict[str, Tensor]:
    """One local update of both models from the kept ``state`` and the downloaded proxy.

    ``seen`` receives, per step, who taught each sample and whether an empty set decided it.
    """
    private = TinyBNNet(CHANNELS, M)
    private.load_state_dict(without_prefix(state, "model."))
    proxy = copy.deepcopy(proxy_template)
    proxy.load_state_dict(download)
    x, y = data
    tau_private, tau_proxy = threshold(private, x, y, alpha), threshold(proxy, x, y, alpha)  # once per update
    for _ in range(STEPS):
        private.train()
        proxy.train()
        z_private, z_proxy = private(x), proxy(x)
        size_proxy, size_private = set_sizes(z_proxy, tau_proxy), set_sizes(z_private, tau_private)
        proxy_teaches = (least_certain_if_empty(size_proxy) < least_certain_if_empty(size_private)).float()
        seen.append((proxy_teaches, proxy_teaches != (size_proxy < size_private).float()))
        distill = proxy_teaches * kl(z_proxy, z_private) + (1 - proxy_teaches) * kl(z_private, z_proxy)
        loss = F.cross_entropy(z_private, y) + F.cross_entropy(z_proxy, y) + KD_WEIGHT * distill.mean()
        loss.backward()
        if max_grad_norm is not None:
            clip_each([list(private.parameters()), list(proxy.parameters())], max_grad_norm)
        sgd_step([*private.parameters(), *proxy.parameters()], LR, WEIGHT_DECAY)
    return {**state, **prefixed(clone(private.state_dict()), "model."), **prefixed(clone(proxy.state_dict()), "proxy.")}


@pytest.mark.parametrize(("max_grad_norm", "alpha"), [(None, 0.3), (0.5, 0.3), (None, 0.9)])
def test_fedtype_matches_the_oracle(max_grad_norm, alpha):
    """Two clients' round 0 from the initial proxy, the proxies' FedAvg, client 0's round 1.

    At ``alpha = 0.9`` the thresholds are low enough that some prediction sets are empty, and
    counting an empty set as the most certain would change who teaches (checked).
    """
    algorithm = get_algorithm("fedtype")(
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        kd_weight=KD_WEIGHT,
        conformal_alpha=alpha,
        proxy_model="cnn_tiny",
        max_grad_norm=max_grad_norm,
    )
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    states = [clone(m.client_state()) for m in modules]
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("tiny",) * 2,
            seed=5,
            initial_client_state=lambda cid: clone(states[cid]),
            data_format=FORMAT,
        )
    )
    proxy_template = copy.deepcopy(modules[0].proxy)
    initial_proxy = without_prefix(states[0], "proxy.")
    seen: list[tuple[Tensor, Tensor]] = []
    uploads, sent = [], []
    for cid, module in enumerate(modules):
        download = server.download_for(cid)
        assert_states_close(download.weights, initial_proxy, f"client {cid}'s first download (the initial proxy)")
        data = batch(cid)
        payload = client_step(module, download, data, num_examples=EXAMPLES[cid], epochs=STEPS)
        expected = oracle_round(states[cid], proxy_template, initial_proxy, data, max_grad_norm, alpha, seen)
        assert_moved(states[cid], module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), expected, f"client {cid} after round 0")
        assert_states_close(payload.weights, without_prefix(expected, "proxy."), f"client {cid}'s upload")
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append(without_prefix(expected, "proxy."))
    server_step(server, 0, uploads)
    download = server.download_for(0)
    averaged = example_weighted_mean(sent, EXAMPLES)
    assert_states_close(download.weights, averaged, "the download (FedAvg of the proxies)")

    state = clone(modules[0].client_state())
    client_step(modules[0], download, batch(2), round_idx=1, state=state, epochs=STEPS, upload=False)
    expected = oracle_round(state, proxy_template, averaged, batch(2), max_grad_norm, alpha, seen)
    assert_states_close(modules[0].client_state(), expected, "client 0 after round 1")
    taught = torch.cat([t for t, _ in seen])
    assert 0 < taught.sum() < len(taught), f"one-sided distillation only ({taught.tolist()}): pick another alpha"
    if alpha == 0.9:
        assert any(bool(e.any()) for _, e in seen), "no empty prediction set decided who teaches: pick another alpha"
