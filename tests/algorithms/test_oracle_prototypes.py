"""One-step oracles of the class-statistic methods FedProto, FD, FedProc, FedGH and FedTGP, against plain PyTorch.

FedProto (Tan et al., AAAI 2022, Eq. 4-8): a client uploads the per-class mean features of its
training data (eval mode, after training) with its class counts; the server weights client
``i``'s prototype of class ``j`` by ``|D_ij| / N_j`` (Eq. 6); a client then trains on
``CE(f(x), y) + lam MSE(z(x), Cbar^(y))`` over the samples whose class has a global prototype
(Eq. 8, MSE averaged over elements as in HtFLlib). FD (Jeong et al. 2018, Section 2): the same
with per-class mean *logits*, averaged uniformly over the clients holding the class, and
``gamma D(f(x), global[y])`` with ``D`` the MSE to the raw logits (HtFLlib, the default) or the
paper's cross-entropy to their softmax.

Two BatchNorm clients (client 1 holds classes 0 and 1 only) take two SGD steps of CE (nothing
received yet) and upload; the server aggregates; client 0 takes two steps with the regulariser.
Every client entry, the uploads and the download are compared with the oracle to 1e-6.

FedProc (Mu et al., FGCS 2023; the FCCL+ authors' code) is FedAvg whose clients also upload
class-mean features; from round 1 on they train on ``alpha_t InfoNCE(z; prototypes, tau) +
(1 - alpha_t) CE`` with cosine similarities and ``alpha_t = 1 - t / (T - 1)``. FedGH (Yi et al.,
ACM MM 2023, Algorithm 1): clients take the global head, train CE and upload class-mean features;
the server trains the head on the (prototype, class) pairs with plain SGD. FedTGP (Zhang et al.,
AAAI 2024, Eq. 4-9): the server trains ``G = fc(relu(W e + b))`` by SGD on the adaptive-margin
contrastive loss over the uploaded prototypes; clients add ``lam MSE(z, G^y)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import FD, FedGH, FedProc, FedProto, FedTGP
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

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedproto", "fd", "fedproc", "fedgh", "fedtgp"}

LR, LAM, GAMMA, STEPS = 0.1, 0.7, 0.4, 2
CASES = {
    "fedproto": lambda: FedProto(lr=LR, lam=LAM),
    "fd_mse": lambda: FD(lr=LR, gamma=GAMMA),
    "fd_ce": lambda: FD(lr=LR, gamma=GAMMA, distillation="ce"),
    # the authors' code and HtFLlib: the means of what the training steps computed (train mode, every epoch)
    "fedproto_steps": lambda: FedProto(lr=LR, lam=LAM, class_means_from="training_steps"),
    "fd_steps": lambda: FD(lr=LR, gamma=GAMMA, class_means_from="training_steps"),
}


def client_data(cid: int):
    """Client 1 holds classes 0 and 1 only (so classes 2 and 3 have one contributor)."""
    x, y = batch(cid)
    return (x, y % 2) if cid == 1 else (x, y)


def statistic(case: str, net, x):
    """(statistic, logits): the features for FedProto, the logits for FD."""
    z = net.forward_features(x)
    logits = net.forward_head(z)
    return (z if case.startswith("fedproto") else logits), logits


def oracle_client(case: str, state: dict, data, global_means=None, present=None, seen=None) -> dict:
    """``STEPS`` SGD steps of CE plus the regulariser towards ``global_means[y]`` where ``present[y]``.

    ``seen`` (a list) receives each step's statistic, as the step computed it (train mode, before its update).
    """
    net = TinyBNNet(CHANNELS, M)
    net.load_state_dict(without_prefix(state, "model."))
    x, y = data
    for _ in range(STEPS):
        net.train()
        s, logits = statistic(case, net, x)
        if seen is not None:
            seen.append(s.detach().clone())
        loss = F.cross_entropy(logits, y)
        if global_means is not None:
            known = present[y]
            target = global_means[y[known]]
            if case == "fd_ce":
                reg = -(torch.softmax(target, 1) * torch.log_softmax(s[known], 1)).sum(1).mean()
            else:
                reg = ((s[known] - target) ** 2).mean()
            loss = loss + (LAM if case.startswith("fedproto") else GAMMA) * reg
        loss.backward()
        sgd_step(net.parameters(), LR)
    return {**state, **prefixed(net.state_dict(), "model.")}


@torch.no_grad()
def oracle_upload(case: str, state: dict, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class means of the statistic over the training data in eval mode, and the class counts."""
    net = TinyBNNet(CHANNELS, M)
    net.load_state_dict(without_prefix(state, "model."))
    net.eval()
    x, y = data
    s, _ = statistic(case, net, x)
    counts = torch.bincount(y, minlength=M)
    means = torch.stack([s[y == c].mean(0) if counts[c] else torch.zeros(s.shape[1]) for c in range(M)])
    return means, counts


def oracle_upload_from_steps(seen, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class means of the statistics the training steps computed (all steps pooled), and the data's counts."""
    statistics = torch.cat(seen)
    labels = data[1].repeat(len(seen))
    counts = torch.bincount(data[1], minlength=M)
    means = torch.stack(
        [statistics[labels == c].mean(0) if counts[c] else torch.zeros(statistics.shape[1]) for c in range(M)]
    )
    return means, counts


def oracle_server(case: str, sent) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: ``sum_i |D_ij| / N_j C_i^(j)`` (FedProto); FD: the plain mean over the clients holding ``j``."""
    values = torch.stack([v for v, _ in sent]).double()
    counts = torch.stack([c for _, c in sent]).double()
    weights = counts if case.startswith("fedproto") else (counts > 0).double()
    total = weights.sum(0)
    means = (weights[:, :, None] * values).sum(0) / total.clamp_min(1)[:, None]
    return means.float(), total > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_class_statistic_method_matches_the_oracle(case):
    """Uploads after a CE round, the aggregate, and the regularised next round, each against the oracle."""
    algorithm = CASES[case]()
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("tiny",) * 2,
            seed=5,
            initial_client_state=lambda cid: clone(modules[cid].client_state()),
            data_format=FORMAT,
            label_counts=torch.stack([torch.bincount(client_data(c)[1], minlength=M) for c in range(2)]),
        )
    )
    uploads, sent = [], []
    for cid, module in enumerate(modules):
        state = clone(module.client_state())
        payload = client_step(module, server.download_for(cid), client_data(cid), num_examples=6, epochs=STEPS)
        seen: list[torch.Tensor] = []
        expected = oracle_client(case, state, client_data(cid), seen=seen)
        assert_moved(state, module.client_state(), f"{case} client {cid}")
        assert_states_close(module.client_state(), expected, f"{case} client {cid}")
        if case.endswith("_steps"):
            means, counts = oracle_upload_from_steps(seen, client_data(cid))
        else:
            means, counts = oracle_upload(case, expected, client_data(cid))
        assert_states_close(
            {"values": payload.values, "counts": payload.counts}, {"values": means, "counts": counts}, "upload"
        )
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append((means, counts))

    server_step(server, 0, uploads)
    download = server.download_for(0)
    global_means, present = oracle_server(case, sent)
    assert_states_close(
        {"values": download.values, "present": download.counts > 0},
        {"values": global_means, "present": present},
        f"{case} download",
    )

    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, state=state, epochs=STEPS, upload=False)
    expected = oracle_client(case, state, client_data(0), global_means, present)
    assert_states_close(modules[0].client_state(), expected, f"{case} client 0 in round 1")


# ---------------------------------------------------------------------- FedProc (Mu et al., FGCS 2023)
def test_fedproc_matches_the_oracle():
    """A CE round, weights and prototypes averaged, then ``alpha_t InfoNCE + (1 - alpha_t) CE``."""
    tau, examples = 0.5, (8, 6)
    algorithm = FedProc(lr=LR, temperature=tau)
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("tiny",) * 2,
            seed=5,
            initial_client_state=lambda cid: clone(modules[cid].client_state()),
            data_format=FORMAT,
        )
    )

    def oracle(download, data, prototypes=None, available=None, alpha=0.0):
        net = TinyBNNet(CHANNELS, M)
        net.load_state_dict(download.weights)
        x, y = data
        for _ in range(STEPS):
            net.train()
            z = net.forward_features(x)
            loss = F.cross_entropy(net.forward_head(z), y)
            if prototypes is not None:
                unit = prototypes[available] / prototypes[available].norm(dim=1, keepdim=True)
                similarity = (z / z.norm(dim=1, keepdim=True)) @ unit.t() / tau
                positive = torch.cumsum(available.long(), 0)[y] - 1  # y's row among the available prototypes
                proto = F.cross_entropy(similarity, positive)
                loss = alpha * proto + (1 - alpha) * loss
            loss.backward()
            sgd_step(net.parameters(), LR)
        return net.state_dict()

    uploads, sent, sent_weights = [], [], []
    for cid, module in enumerate(modules):
        download = server.download_for(cid)
        state = clone(module.client_state())
        payload = client_step(module, download, client_data(cid), num_examples=examples[cid], epochs=STEPS)
        weights = oracle(download, client_data(cid))
        assert_moved(state, module.client_state(), f"FedProc client {cid}")
        assert_states_close(module.client_state(), {**state, **prefixed(weights, "model.")}, f"FedProc client {cid}")
        means, counts = oracle_upload("fedproto", prefixed(weights, "model."), client_data(cid))
        assert_states_close(payload.weights, weights, f"FedProc client {cid} weights")
        assert_states_close(
            {"values": payload.prototypes, "counts": payload.counts}, {"values": means, "counts": counts}, "upload"
        )
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append((means, counts))
        sent_weights.append(weights)

    server_step(server, 0, uploads)
    download = server.download_for(0)
    assert_states_close(download.weights, example_weighted_mean(sent_weights, examples), "FedProc global weights")
    prototypes, available = oracle_server("fedproto", sent)  # example-weighted class means (the default)
    assert_states_close(
        {"values": download.prototypes, "present": download.counts > 0},
        {"values": prototypes, "present": available},
        "FedProc global prototypes",
    )

    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, total_rounds=4, state=state, epochs=STEPS)
    weights = oracle(download, client_data(0), prototypes, available, alpha=1 - 1 / 3)  # alpha_t = 1 - t / (T - 1)
    assert_states_close(
        modules[0].client_state(), {**state, **prefixed(weights, "model.")}, "FedProc client 0, round 1"
    )


# ---------------------------------------------------------------------- FedGH (Yi et al., ACM MM 2023)
def test_fedgh_matches_the_oracle():
    """Clients take the global head and train CE; the server trains the head on the prototypes with SGD."""
    server_lr = 0.5
    algorithm = FedGH(lr=LR, server_lr=server_lr, server_epochs=2, server_batch_size=4)
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    initial_head = without_prefix(clone(modules[0].client_state()), "model.head.")
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("tiny",) * 2,
            seed=5,
            initial_client_state=lambda cid: clone(modules[cid].client_state()),
            data_format=FORMAT,
        )
    )

    def oracle(state, head, data):
        weights = {**without_prefix(state, "model."), **prefixed(head, "head.")}
        return oracle_client("fedproto", prefixed(weights, "model."), data)

    uploads, sent = [], []
    for cid, module in enumerate(modules):
        download = server.download_for(cid)
        assert_states_close(download.weights, initial_head, "FedGH round-0 head (client 0's initial head)")
        state = clone(module.client_state())
        payload = client_step(module, download, client_data(cid), num_examples=6, epochs=STEPS)
        expected = oracle(state, initial_head, client_data(cid))
        assert_moved(state, module.client_state(), f"FedGH client {cid}")
        assert_states_close(module.client_state(), expected, f"FedGH client {cid}")
        means, counts = oracle_upload("fedproto", expected, client_data(cid))
        assert_states_close({"values": payload.values}, {"values": means}, "FedGH upload")
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append((means, counts))

    (recorder,) = server_step(server, 0, uploads)
    head = torch.nn.Linear(8, M)
    head.load_state_dict(initial_head)
    assert len(recorder.batches) == 4  # 6 (prototype, class) pairs in batches of 4 and 2, two passes
    pairs = {
        (round(float(p.sum()), 5), int(c))
        for means, counts in sent
        for p, c in zip(means, range(M), strict=True)
        if counts[c]
    }
    for prototypes, labels in recorder.batches:
        assert {(round(float(p.sum()), 5), int(c)) for p, c in zip(prototypes, labels, strict=True)} <= pairs
        F.cross_entropy(head(prototypes), labels).backward()
        sgd_step(head.parameters(), server_lr)
    download = server.download_for(0)
    assert_states_close(download.weights, head.state_dict(), "FedGH trained head")

    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, state=state, epochs=STEPS, upload=False)
    expected = oracle(state, head.state_dict(), client_data(0))
    assert_states_close(modules[0].client_state(), expected, "FedGH client 0, round 1")


# ---------------------------------------------------------------------- FedTGP (Zhang et al., AAAI 2024)
def test_fedtgp_matches_the_oracle():
    """Prototypes up, the adaptive margin and SGD on the margin contrastive loss, the pull to ``G^y`` next round."""
    server_lr, lam = 0.5, 2.0
    algorithm = FedTGP(lr=LR, lam=lam, server_lr=server_lr, server_epochs=2, server_batch_size=4)
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("tiny",) * 2,
            seed=5,
            initial_client_state=lambda cid: clone(modules[cid].client_state()),
            data_format=FORMAT,
        )
    )
    initial = clone(server.state_dict())
    uploads, sent = [], []
    for cid, module in enumerate(modules):
        assert server.download_for(cid) is None  # nothing before the first server phase
        state = clone(module.client_state())
        payload = client_step(module, None, client_data(cid), num_examples=6, epochs=STEPS)
        expected = oracle_client("fedproto", state, client_data(cid))
        assert_states_close(module.client_state(), expected, f"FedTGP client {cid}")
        means, counts = oracle_upload("fedproto", expected, client_data(cid))
        assert_states_close({"values": payload.values}, {"values": means}, "FedTGP upload")
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append((means, counts))

    (recorder,) = server_step(server, 0, uploads)
    # Eq. 7: delta = min(max_c min_{c' != c} ||Q^c - Q^c'||, tau), Q^c the plain mean over the holders
    q, present = oracle_server("fd_mse", sent)  # uniform per-class mean
    gaps = torch.cdist(q.double(), q.double()) + torch.diag(torch.full((M,), float("inf")))
    margin = min(float(gaps.min(1).values.max()), 100.0)
    embeddings = initial["prototypes.embeddings.weight"].clone().requires_grad_(True)
    layers = {k: initial[f"prototypes.{k}"].clone().requires_grad_(True) for k in ("middle.0.weight", "middle.0.bias")}
    layers.update({k: initial[f"prototypes.{k}"].clone().requires_grad_(True) for k in ("fc.weight", "fc.bias")})
    params = [embeddings, *layers.values()]

    def global_prototypes():
        hidden = torch.relu(embeddings @ layers["middle.0.weight"].t() + layers["middle.0.bias"])
        return hidden @ layers["fc.weight"].t() + layers["fc.bias"]

    for prototypes, labels in recorder.batches:  # Eq. 8, SGD
        g = global_prototypes()
        d = ((prototypes[:, None, :] - g[None, :, :]) ** 2).sum(-1).sqrt()
        F.cross_entropy(-(d + margin * F.one_hot(labels, M)), labels).backward()
        sgd_step(params, server_lr)
    got = server.state_dict()
    assert abs(float(got["margin"]) - margin) < 1e-5, f"margin {float(got['margin'])} != {margin}"
    expected_server = {"prototypes.embeddings.weight": embeddings, "seen": present}
    expected_server.update({f"prototypes.{k}": v for k, v in layers.items()})
    assert_states_close({k: got[k] for k in expected_server}, expected_server, "FedTGP server")
    download = server.download_for(0)
    with torch.no_grad():
        g = global_prototypes()
    assert_states_close({"values": download.values}, {"values": g}, "FedTGP global prototypes")

    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, state=state, epochs=STEPS, upload=False)
    net = TinyBNNet(CHANNELS, M)
    net.load_state_dict(without_prefix(state, "model."))
    x, y = client_data(0)
    for _ in range(STEPS):  # CE + lam MSE(z, G^y) (every class has a global prototype)
        net.train()
        z = net.forward_features(x)
        (F.cross_entropy(net.forward_head(z), y) + lam * ((z - g[y]) ** 2).mean()).backward()
        sgd_step(net.parameters(), LR)
    assert_states_close(modules[0].client_state(), prefixed(net.state_dict(), "model."), "FedTGP client 0, round 1")
