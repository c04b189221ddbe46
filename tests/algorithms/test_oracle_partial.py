"""One-step oracles of the partial-sharing methods: Local, FedPer, LG-FedAvg, FedBN, FedRS, Ditto, FML, CCVR.

Each shares a different part of the model, or trains with a different local objective, on top of
FedAvg's example-weighted averaging (McMahan et al.): Local nothing; FedPer (Arivazhagan et al.)
everything but the head; LG-FedAvg (Liang et al., Algorithm 1) the head only, and nothing down
before the first average; FedBN (Li et al., Algorithm 1) everything but the BatchNorm layers
(affine parameters and running statistics); FedRS (Li and Zhan, Sec. 4) the whole model, trained
on the restricted softmax ``CE(alpha_c f(x), y)`` with ``alpha_c = 1`` for the classes a client
holds and ``alpha`` for the others; Ditto (Li et al., Algorithm 1) the global model trained with
CE, then the personal model on ``CE + lam/2 ||v - w^t||^2`` with ``w^t`` the received global model;
FML (Shen et al., Eq. 3-4) the meme model, trained with the private one by deep mutual learning
(``alpha CE + (1 - alpha) KL(p_meme || p)`` and ``beta CE + (1 - beta) KL(p || p_meme)``, each peer's
prediction a constant in the other's loss, each model's gradient clipped on its own); CCVR (Luo et
al., Eq. 3-4) class Gaussians of the features, pooled by the server, from which each client draws
virtual features to calibrate its head with the extractor frozen.

Two of three BatchNorm clients (client 1 holds classes 0 and 1 only) take two SGD steps each
from what they received, the server averages their uploads, and client 0 takes two more steps
from the new download with its kept state. Every client entry, every upload and the download are
compared with the oracle to 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import get_algorithm
from fedhet.algorithms.base import ClientUpload
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
from tests.algorithms.test_oracle_fedftg import CHANNELS, EXAMPLES, FORMAT, M, make_context

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"local", "fedper", "lg_fedavg", "fedbn", "fedrs", "ditto", "fml", "ccvr"}

LR, ALPHA, LAM, STEPS = 0.1, 0.5, 0.7, 2
HPARAMS = {"fedrs": {"alpha": ALPHA}, "ditto": {"lam": LAM}}


def client_data(cid: int):
    """Client 1 holds classes 0 and 1 only (FedRS damps the others); the rest every class."""
    x, y = batch(cid)
    return (x, y % 2) if cid == 1 else (x, y)


def shared(method: str, weights: dict) -> dict:
    """The part of a network's state (keys without ``model.``) the method uploads, in the upload's key names."""
    if method == "local":
        return {}
    if method == "fedper":
        return {k: v for k, v in weights.items() if not k.startswith("head.")}
    if method == "lg_fedavg":
        return {k[len("head.") :]: v for k, v in weights.items() if k.startswith("head.")}
    if method == "fedbn":
        return {k: v for k, v in weights.items() if not k.startswith("bn.")}
    return dict(weights)  # fedrs, ditto: the whole (global) model


def received(method: str, weights: dict, download) -> dict:
    """``weights`` with the downloaded part overwritten (the rest stays the client's own)."""
    if download is None:
        return dict(weights)
    incoming = {("head." + k if method == "lg_fedavg" else k): v for k, v in download.weights.items()}
    return {**weights, **incoming}


def net_with(state: dict) -> TinyBNNet:
    """A TinyBNNet holding ``state``."""
    net = TinyBNNet(CHANNELS, M)
    net.load_state_dict(state)
    return net


def sgd_steps(net, loss_of, data) -> None:
    """``STEPS`` plain SGD steps (train mode) of ``loss_of(net, x, y)``."""
    x, y = data
    for _ in range(STEPS):
        net.train()
        loss_of(net, x, y).backward()
        sgd_step(net.parameters(), LR)


def oracle_client(method: str, state: dict, download, data) -> dict:
    """The client's state after one round, from its kept ``state`` and what it ``download``-ed."""
    net = net_with(received(method, without_prefix(state, "model."), download))
    expected = dict(state)
    if method == "fedrs":  # alpha_c from the client's own label counts, fixed for the fit
        counts = torch.bincount(data[1], minlength=M)
        scale = torch.where(counts > 0, 1.0, ALPHA)
        sgd_steps(net, lambda n, x, y: F.cross_entropy(scale * n(x), y), data)
        expected["class_counts"] = counts
    else:
        sgd_steps(net, lambda n, x, y: F.cross_entropy(n(x), y), data)
    if method == "ditto":  # then the personal model, pulled towards w^t as received
        anchor = [
            p.detach().clone()
            for p in net_with(received(method, without_prefix(state, "model."), download)).parameters()
        ]
        personal = net_with(without_prefix(state, "personal."))

        def personal_loss(n, x, y):
            pull = sum(((p - a) ** 2).sum() for p, a in zip(n.parameters(), anchor, strict=True))
            return F.cross_entropy(n(x), y) + (LAM / 2 * pull if download is not None else 0.0)

        sgd_steps(personal, personal_loss, data)
        expected.update(prefixed(personal.state_dict(), "personal."))
    expected.update(prefixed(net.state_dict(), "model."))
    return expected


@pytest.mark.parametrize("method", sorted(ORACLE_COVERS - {"fml", "ccvr"}))
def test_partial_sharing_method_matches_the_oracle(method):
    """Two clients' round, the aggregate, and client 0's next round, each against the oracle."""
    algorithm = get_algorithm(method)(lr=LR, **HPARAMS.get(method, {}))
    algorithm.configure(FORMAT)
    server = algorithm.build_server()
    server.setup_server(make_context(algorithm))
    modules, uploads, sent = [], [], []
    for cid in range(2):  # client 2 sits the round out
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        state = clone(module.client_state())
        download = server.download_for(cid)
        payload = client_step(module, download, client_data(cid), num_examples=EXAMPLES[cid], epochs=STEPS)
        expected = oracle_client(method, state, download, client_data(cid))
        assert_moved(state, module.client_state(), f"{method} client {cid}")
        assert_states_close(module.client_state(), expected, f"{method} client {cid}")
        upload = shared(method, without_prefix(expected, "model."))
        if method == "local":
            assert payload is None, "Local uploads nothing"
            continue
        assert_states_close(payload.weights, upload, f"{method} client {cid} upload")
        modules.append(module)
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append(upload)

    if method == "local":
        assert server.download_for(0) is None, "Local downloads nothing"
        return
    server_step(server, 0, uploads)
    download = server.download_for(0)
    average = example_weighted_mean(sent, EXAMPLES[:2])
    assert_states_close(download.weights, average, f"{method} download")

    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, state=state, epochs=STEPS, upload=False)
    expected = oracle_client(method, state, copy.deepcopy(download), client_data(0))
    assert_states_close(modules[0].client_state(), expected, f"{method} client 0 in round 1")


# ---------------------------------------------------------------------- FML (Shen et al., Eq. 3-4)
def kl_to(target_logits, logits):
    """``KL(softmax(target) || softmax(logits))`` per sample, batch mean; the target a constant."""
    p = torch.softmax(target_logits.detach(), 1)
    return (p * (torch.log(p) - torch.log_softmax(logits, 1))).sum(1).mean()


@torch.no_grad()
def clip_each(groups, max_norm) -> None:
    """Each group's gradient scaled to total norm ``max_norm`` when above it (``max / (norm + 1e-6)``)."""
    for params in groups:
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).float()
        factor = max_norm / (norm + 1e-6)
        if factor < 1:
            for p in params:
                p.grad.mul_(factor)


@pytest.mark.parametrize("max_grad_norm", [10.0, 0.05])
def test_fml_matches_the_oracle(max_grad_norm):
    """Mutual learning of the private model and the meme, the memes' average, the next round."""
    alpha, beta = 0.3, 0.6
    algorithm = get_algorithm("fml")(lr=LR, alpha=alpha, beta=beta, meme_model="cnn_tiny", max_grad_norm=max_grad_norm)
    algorithm.configure(FORMAT)
    server = algorithm.build_server()
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    server.setup_server(make_context(algorithm))

    def oracle(state, download, data):
        net = net_with(without_prefix(state, "model."))
        meme = copy.deepcopy(modules[0].meme)
        meme.load_state_dict({**without_prefix(state, "meme."), **download.weights})
        x, y = data
        for _ in range(STEPS):
            net.train()
            meme.train()
            private, shared_logits = net(x), meme(x)
            loss = alpha * F.cross_entropy(private, y) + (1 - alpha) * kl_to(shared_logits, private)
            loss = loss + beta * F.cross_entropy(shared_logits, y) + (1 - beta) * kl_to(private, shared_logits)
            loss.backward()
            clip_each([list(net.parameters()), list(meme.parameters())], max_grad_norm)
            sgd_step([*net.parameters(), *meme.parameters()], LR)
        return {**state, **prefixed(net.state_dict(), "model."), **prefixed(meme.state_dict(), "meme.")}

    uploads, sent = [], []
    for cid, module in enumerate(modules):
        state = clone(module.client_state())
        download = server.download_for(cid)
        payload = client_step(module, download, client_data(cid), num_examples=EXAMPLES[cid], epochs=STEPS)
        expected = oracle(state, download, client_data(cid))
        assert_moved(state, module.client_state(), f"FML client {cid}")
        assert_states_close(module.client_state(), expected, f"FML client {cid}")
        assert_states_close(payload.weights, without_prefix(expected, "meme."), f"FML client {cid} upload")
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append(without_prefix(expected, "meme."))
    server_step(server, 0, uploads)
    download = server.download_for(0)
    assert_states_close(download.weights, example_weighted_mean(sent, EXAMPLES[:2]), "FML download")
    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, state=state, epochs=STEPS, upload=False)
    assert_states_close(modules[0].client_state(), oracle(state, download, client_data(0)), "FML client 0, round 1")


# ---------------------------------------------------------------------- CCVR (Luo et al., NeurIPS 2021, Eq. 3-4)
def test_ccvr_matches_the_oracle():
    """Gaussian class statistics up, pooled by Eq. 3-4, then CE and the head calibrated on virtual features."""
    jitter, per_class, calibration_lr = 1e-2, 5, 0.3
    algorithm = get_algorithm("ccvr")(
        lr=LR, jitter=jitter, virtual_per_class=per_class, calibration_lr=calibration_lr, calibration_batch_size=8
    )
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    server = algorithm.build_server()
    server.setup_server(make_context(algorithm))
    data = [batch(cid, size=12) for cid in range(2)]
    data[1] = (data[1][0], data[1][1] % 2)  # client 1 holds classes 0 and 1 only

    def ce_round(state, x, y):
        net = net_with(without_prefix(state, "model."))
        sgd_steps(net, lambda n, a, b: F.cross_entropy(n(a), b), (x, y))
        return net

    uploads, stats = [], []
    for cid, module in enumerate(modules):
        state = clone(module.client_state())
        payload = client_step(module, server.download_for(cid), data[cid], num_examples=12, epochs=STEPS)
        net = ce_round(state, *data[cid])
        assert_states_close(module.client_state(), prefixed(net.state_dict(), "model."), f"CCVR client {cid}")
        net.eval()
        with torch.no_grad():
            z = net.forward_features(data[cid][0]).double()
        y = data[cid][1]
        counts = torch.bincount(y, minlength=M)
        means = torch.stack([z[y == c].mean(0) if counts[c] else torch.zeros(8, dtype=z.dtype) for c in range(M)])
        covs = torch.stack(
            [torch.cov(z[y == c].t()) if counts[c] > 1 else torch.zeros(8, 8, dtype=z.dtype) for c in range(M)]
        )  # unbiased
        assert_states_close(
            {"means": payload.means, "covariances": payload.covariances, "counts": payload.counts},
            {"means": means.float(), "covariances": covs.float(), "counts": counts},
            f"CCVR client {cid} upload",
        )
        uploads.append(ClientUpload(cid, "tiny", payload))
        stats.append((means, covs, counts))

    server_step(server, 0, uploads)
    download = server.download_for(0)
    # Eq. 3: mu = sum n_k mu_k / N
    # Eq. 4: Sigma = sum (n_k - 1)/(N - 1) Sigma_k + sum n_k/(N - 1) mu_k mu_k^T - N/(N - 1) mu mu^T
    pooled_mu, pooled_sigma = torch.zeros(M, 8, dtype=torch.float64), torch.zeros(M, 8, 8, dtype=torch.float64)
    for c in range(M):
        n = [float(s[2][c]) for s in stats]
        total = sum(n)
        mu = sum(nk * s[0][c] for nk, s in zip(n, stats, strict=True)) / total
        sigma = sum(
            (nk - 1) / (total - 1) * s[1][c] + nk / (total - 1) * torch.outer(s[0][c], s[0][c])
            for nk, s in zip(n, stats, strict=True)
            if nk > 0
        )
        pooled_mu[c], pooled_sigma[c] = mu, sigma - total / (total - 1) * torch.outer(mu, mu)
    assert_states_close(
        {"means": download.means, "covariances": download.covariances},
        {"means": pooled_mu.float(), "covariances": pooled_sigma.float()},
        "CCVR pooled Gaussians",
        atol=1e-5,
    )

    state = clone(modules[0].client_state())
    recorded: dict = {}
    client_step(modules[0], download, data[0], round_idx=1, state=state, epochs=STEPS, upload=False, batches=recorded)
    net = ce_round(state, *data[0])
    # the virtual features: per class c, mu_c + L eps with L L^T = Sigma_c + jitter I, eps ~ N(0, I) in float64
    generator = torch.Generator().manual_seed(1001)  # the calibration stage's seed (client_step: 1000 + stage index)
    virtual = []
    for c in range(M):
        sigma = download.covariances[c].double()
        factor = torch.linalg.cholesky(0.5 * (sigma + sigma.t()) + jitter * torch.eye(8, dtype=torch.float64))
        eps = torch.randn(per_class, 8, generator=generator, dtype=torch.float64)
        virtual.append((download.means[c].double() + eps @ factor.t()).float())
    seen = torch.cat([b[0] for b in recorded["calibrate"]])
    labels = torch.cat([b[1] for b in recorded["calibrate"]])
    mine = torch.cat(virtual)
    order_seen, order_mine = seen[:, 0].argsort(), mine[:, 0].argsort()
    assert torch.allclose(seen[order_seen], mine[order_mine], atol=1e-5), "virtual features differ"
    assert torch.equal(labels[order_seen], torch.arange(M).repeat_interleave(per_class)[order_mine])
    head = net.head  # the extractor frozen: only the head steps on the virtual features
    for features, y in recorded["calibrate"]:
        F.cross_entropy(head(features), y).backward()
        sgd_step(head.parameters(), calibration_lr)
    assert_states_close(modules[0].client_state(), prefixed(net.state_dict(), "model."), "CCVR client 0, round 1")
