"""FedL2G one-step oracle (feature- and logit-level): local steps, the meta-gradient and the guidance update.

Written from the paper (Zhang et al., arXiv 2410.06490) with HtFLlib's choices recorded in
``fedhet/algorithms/fedl2g.py``: local loss ``CE + w MSE(s(x), g_y)`` with the model's gradient
clipped to a norm; then, on a study batch ``A`` and a quiz batch ``B``, one differentiable SGD
step ``theta' = theta - eta (grad_theta L_A(theta, g) + wd theta)`` and the upload
``d/dg CE(f_theta'(x_B), y_B)`` on the rows of the classes in ``A``; the server averages each
class's rows over the clients that sent one, clips the whole gradient and takes an SGD step.

The meta-gradient is computed here with a hand-written functional forward of the tiny network
(``F.conv2d``, ``F.batch_norm`` in train mode, ``F.linear``), not with fedhet's code path. Two of three
clients run a round (two local steps on batches ``A`` then ``B`` of three images, then the meta
stage), the server steps, client 0 runs the next round from the new guidance. Every parameter and
buffer (the meta stage must leave BatchNorm statistics alone), the uploads and the guidance are
compared to 1e-6; both clipping norms are set low enough to act.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import FedL2GFeat, FedL2GLogit
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from tests.algorithms.oracle import (
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    prefixed,
    server_step,
    sgd_step,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

ORACLE_COVERS = {"fedl2g_feat", "fedl2g_logit"}

M, CHANNELS, SIZE = 4, 1, 8
FORMAT = DataFormat(image_size=SIZE, channels=CHANNELS, mean=(0.0,), std=(1.0,), num_classes=M)
HP = dict(
    lr=0.1,
    weight_decay=1e-3,
    guide_weight=0.5,
    max_grad_norm=0.5,  # acts: the first steps' gradient norms are above it
    server_lr=0.3,
    server_max_grad_norm=0.02,  # acts on the aggregated guidance gradient
)
METHODS = {"feature": FedL2GFeat, "logit": FedL2GLogit}


def make_context(algorithm) -> ServerContext:
    """Three clients of one architecture, each holding five examples of every class."""
    initial = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=100), M).client_state()
    return ServerContext(
        num_clients=3,
        num_classes=M,
        architectures=("tiny",) * 3,
        seed=5,
        initial_client_state=lambda cid: clone(initial),
        data_format=FORMAT,
        label_counts=torch.full((3, M), 5),
    )


def tiny_functional(params: dict, buffers: dict, x):
    """TinyBNNet's forward in train mode from explicit tensors: ``(features, logits)``."""
    h = F.conv2d(x, params["conv.weight"], params["conv.bias"], padding=1)
    mean, var = buffers["bn.running_mean"].clone(), buffers["bn.running_var"].clone()
    h = F.batch_norm(h, mean, var, params["bn.weight"], params["bn.bias"], training=True)
    features = F.adaptive_avg_pool2d(torch.relu(h), 2).flatten(1)
    return features, F.linear(features, params["head.weight"], params["head.bias"])


def statistic(level: str, features, logits):
    """What the guidance pulls on at ``level``."""
    return features if level == "feature" else logits


def oracle_local_step(net, guide, x, y, level: str) -> None:
    """One local step: ``CE + w mean((s - g_y)^2)``, gradient norm clipped, SGD with weight decay."""
    net.train()
    features = net.forward_features(x)
    logits = net.forward_head(features)
    pull = ((statistic(level, features, logits) - guide[y]) ** 2).mean()
    loss = F.cross_entropy(logits, y) + HP["guide_weight"] * pull
    loss.backward()
    params = list(net.parameters())
    norm = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in params))
    scale = HP["max_grad_norm"] / (norm + 1e-6)
    if scale < 1:
        for p in params:
            p.grad.mul_(scale)
    sgd_step(params, HP["lr"], HP["weight_decay"])


def oracle_meta_gradient(net, guide, study, quiz, level: str):
    """``d/dg CE(f_theta'(x_quiz), y_quiz)`` with ``theta'`` one differentiable SGD step on the study loss."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in net.named_parameters()}
    buffers = dict(net.named_buffers())
    g = guide.detach().clone().requires_grad_(True)
    (xs, ys), (xq, yq) = study, quiz
    features, logits = tiny_functional(params, buffers, xs)
    pull = ((statistic(level, features, logits) - g[ys]) ** 2).mean()
    study_loss = F.cross_entropy(logits, ys) + HP["guide_weight"] * pull
    grads = torch.autograd.grad(study_loss, list(params.values()), create_graph=True)
    stepped = {
        k: p - HP["lr"] * (grad + HP["weight_decay"] * p) for (k, p), grad in zip(params.items(), grads, strict=True)
    }
    quiz_loss = F.cross_entropy(tiny_functional(stepped, buffers, xq)[1], yq)
    (grad_g,) = torch.autograd.grad(quiz_loss, g)
    rows = torch.zeros(M, dtype=torch.long)
    rows[ys] = 1
    return grad_g * rows.unsqueeze(1), rows


def oracle_server(guide, grads, rows):
    """Per class the plain mean over the clients that sent the row, clipped as one tensor, SGD."""
    mean = torch.zeros_like(guide)
    for c in range(M):
        senders = [g[c] for g, r in zip(grads, rows, strict=True) if r[c] > 0]
        if senders:
            mean[c] = torch.stack(senders).mean(0)
    scale = min(1.0, HP["server_max_grad_norm"] / (float(mean.norm()) + 1e-6))
    return guide - HP["server_lr"] * mean * scale


@pytest.mark.parametrize("level", sorted(METHODS))
def test_fedl2g_matches_the_oracle(level):
    """Two clients' rounds, their guidance gradients, the server's step and client 0's next round."""
    algorithm = METHODS[level](**HP)
    algorithm.configure(FORMAT)
    server = algorithm.build_server()
    server.setup_server(make_context(algorithm))
    guide = server.download_for(0).values.clone()
    assert guide.shape == (M, 8 if level == "feature" else M)
    modules, nets, grads, rows, uploads = [], [], [], [], []
    for cid in range(2):  # client 2 sits the round out
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        net = copy.deepcopy(module.model)
        before = clone(module.client_state())
        payload = client_step(module, server.download_for(cid), batch(cid), num_examples=6, batch_size=3)
        x, y = batch(cid)
        study, quiz = (x[:3], y[:3]), (x[3:], y[3:])
        for xb, yb in (study, quiz):  # the local stage: one pass, batches A then B
            oracle_local_step(net, guide, xb, yb, level)
        grad, row = oracle_meta_gradient(net, guide, study, quiz, level)
        assert_moved(before, module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), prefixed(net.state_dict(), "model."), f"client {cid} state")
        assert_states_close({"counts": payload.counts}, {"counts": row}, f"client {cid} guided rows")
        assert_states_close({"grad": payload.values}, {"grad": grad}, f"client {cid} guidance gradient")
        assert float(grad.abs().max()) > 1e-4, "a zero meta-gradient proves nothing"
        modules.append(module)
        nets.append(net)
        grads.append(grad)
        rows.append(row)
        uploads.append(ClientUpload(cid, "tiny", payload))

    server_step(server, 0, uploads)
    new_guide = oracle_server(guide, grads, rows)
    download = server.download_for(1)
    assert_states_close({"guide": download.values}, {"guide": new_guide}, "guidance after the server step")
    assert_moved({"guide": guide}, {"guide": download.values}, "guidance", least=1e-5)

    client_step(modules[0], download, batch(5), round_idx=1, state=modules[0].client_state(), batch_size=3)
    x, y = batch(5)
    for xb, yb in ((x[:3], y[:3]), (x[3:], y[3:])):
        oracle_local_step(nets[0], new_guide, xb, yb, level)
    assert_states_close(modules[0].client_state(), prefixed(nets[0].state_dict(), "model."), "client 0 next round")


def test_warm_up_rounds_only_learn_to_guide():
    """During warm-up the client runs the meta stage alone; afterwards local training first."""
    client = FedL2GFeat(warm_up_rounds=2, meta_study_batches=2, meta_quiz_batches=3).build_client(
        TinyBNNet(CHANNELS, M), M
    )
    client.round_idx = 1
    assert [(s.name, s.epochs, s.manual) for s in client.local_stages()] == [("meta", 1, True)]
    client.round_idx = 2
    assert [s.name for s in client.local_stages()] == ["local", "meta"]
