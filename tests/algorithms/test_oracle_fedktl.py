"""FedKTL one-step oracle: two clients' local steps, the server's round, the next local step, against plain PyTorch.

Zhang et al., CVPR 2024 (Eq. 1-4, Fig. 3) with the official code's choices fedhet follows
(``fedhet/algorithms/fedktl.py`` lists them): two BatchNorm clients take two SGD steps of
ArcFace (``s cos(theta_y + m)`` against the fixed simplex ETF, ``s = 64``, ``m = 0.5``) from the
projection ``h_i`` and upload unit prototypes (each embedding normalised, class-averaged,
re-normalised; client 1 holds two classes only); the server maps the prototypes with
``F = Linear-BN-ReLU-Linear`` and takes four Adam steps (lr 0.01; ``F`` and the learned centroid
table, each clipped to norm 100) on ``MMD^2(F(P_b), G(z)) + lambda MSE(F(P_b), Cent[y_b])``, the
table reset to the exact class means of ``F(P)`` (eval mode) before and after; every class's
centroid goes through the frozen generator, post-processed to the clients' grey, normalised
images. Client 0 then takes two steps adding ``mu MSE(h'_i(f_i(I)), Q)`` on the downloaded pairs,
with ``h'_i`` back at its shared initialisation however it was left. Every parameter and buffer
of both sides, the uploads and the download are compared to 1e-6; 1e-5 for the server's state,
what it sends and the round-1 client (Adam's normalised steps and mu = 50 carry float32 rounding
into ~1e-6), 1e-4 for the images (the generator and the 1/std normalisation amplify it).

The oracle reads the initial states (network, ``h'_i``, ``F``, centroid table) from the objects
it checks, and the ETF, which it verifies is a simplex ETF; it draws the generator's latents and
the pair order from the global RNG state each step started with, in the method's documented
order, and the server batches are the index sets each step received.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms import fedktl
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from fedhet.algorithms.fedktl import FedKTL
from tests.algorithms.oracle import (
    AdamOracle,
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    server_step,
    sgd_step,
    without_prefix,
)
from tests.algorithms.test_fedktl import TinyGenerator

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedktl"}

M, CHANNELS, SIZE = 4, 1, 8
LR, MU, LAMBDA, SCALE, MARGIN, CLIP = 0.05, 50.0, 1.0, 64.0, 0.5, 100.0
SERVER_LR, SERVER_EPOCHS, SERVER_BATCH = 0.01, 2, 4
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
MEAN, STD = 0.5, 0.25
FORMAT = DataFormat(image_size=SIZE, channels=CHANNELS, mean=(MEAN,), std=(STD,), num_classes=M)
STEPS = 2
SERVER_ATOL = 1e-4


def client_data(cid: int) -> tuple[Tensor, Tensor]:
    """Client 0 holds all four classes; client 1 only classes 0 and 1 (so it uploads two prototypes)."""
    x, y = batch(cid)
    return (x, y) if cid == 0 else (x, y % 2)


# ---------------------------------------------------------------------- the oracle, client side
def arcface_ce(projected: Tensor, etf: Tensor, y: Tensor) -> Tensor:
    """CE over ``s cos(theta_c)``, the target ``s cos(acos(cos theta_y) + m)`` (ArcFace against the ETF)."""
    cos = (projected / projected.norm(dim=1, keepdim=True)) @ (etf / etf.norm(dim=0, keepdim=True))
    target = torch.cos(torch.acos(cos.gather(1, y[:, None])) + MARGIN)
    logits = SCALE * torch.where(F.one_hot(y, M).bool(), target, cos)
    return F.cross_entropy(logits, y)


@torch.no_grad()
def clip(params, max_norm: float = CLIP) -> None:
    """Scale the gradients of ``params`` to total L2 norm ``max_norm`` when above it (``max / (norm + 1e-6)``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.mul_(coefficient)


def oracle_client(net, latent_head, etf, data, pairs=None, rng_states=None) -> None:
    """``STEPS`` SGD steps of ``L_A`` (+ ``mu L^M`` on ``pairs``), model and ``h'_i`` clipped separately."""
    x, y = data
    order, cursor = None, 0
    for step in range(STEPS):
        net.train()
        loss = arcface_ce(net(x), etf, y)
        if pairs is not None:
            images, latents = pairs
            torch.set_rng_state(rng_states[step])  # the pair order: one randperm per pass over the pairs
            if order is None or cursor >= len(latents):
                order, cursor = torch.randperm(len(latents)), 0
            take = order[cursor : cursor + min(len(x), len(latents))]
            cursor += len(take)
            loss = loss + MU * F.mse_loss(latent_head(net.forward_features(images[take])), latents[take])
        loss.backward()
        clip(list(net.parameters()))
        clip(list(latent_head.parameters()))
        sgd_step(list(net.parameters()) + list(latent_head.parameters()), LR)


@torch.no_grad()
def oracle_prototypes(net, data) -> tuple[Tensor, Tensor]:
    """``normalize(mean_c normalize(h_i(f_i(x))))`` in eval mode and the per-class counts."""
    x, y = data
    net.eval()
    e = net(x)
    e = e / e.norm(dim=1, keepdim=True)
    counts = torch.bincount(y, minlength=M)
    means = torch.stack([e[y == c].mean(0) if counts[c] else torch.zeros(e.shape[1]) for c in range(M)])
    norms = means.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, means / norms.clamp_min(1e-12), means), counts


# ---------------------------------------------------------------------- the oracle, server side
def mmd2(a: Tensor, b: Tensor) -> Tensor:
    """Biased MMD^2 with ``k(u, v) = sum_k exp(-||u - v||^2 / (2 a_k))``."""

    def k(u, v):
        d = ((u * u).sum(1)[:, None] + (v * v).sum(1)[None, :] - 2 * u @ v.t()).clamp_min(0)  # the code's form
        return sum(torch.exp(-d / (2 * a)) for a in BANDWIDTHS)

    return k(a, a).mean() + k(b, b).mean() - 2 * k(a, b).mean()


@torch.no_grad()
def class_mean_rows(transformer, prototypes, labels, table) -> Tensor:
    """``table[c] = mean_{y_j = c} F(P_j)`` (eval mode) for every class present; returns the classes present."""
    transformer.eval()
    mapped = transformer(prototypes)
    present = torch.zeros(M, dtype=torch.bool)
    for c in labels.unique():
        table[c] = mapped[labels == c].mean(0)
        present[c] = True
    return present


def oracle_server(state: dict, prototypes, labels, recorder, generator) -> tuple[dict, Tensor, Tensor]:
    """Centroids to class means, Adam on ``MMD + lambda MSE`` per recorded batch, centroids again, the images."""
    dim, latent_dim = prototypes.shape[1], generator.latent_dim
    transformer = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, latent_dim))
    transformer.load_state_dict(without_prefix(state, "transformer."))
    transformer[0].bias.requires_grad_(False)  # its exact gradient is zero (a BatchNorm follows)
    table = state["centroids.weight"].clone().requires_grad_(True)
    class_mean_rows(transformer, prototypes, labels, table.data)
    adam = AdamOracle([*transformer.parameters(), table], SERVER_LR)
    assert len(recorder.batches) == SERVER_EPOCHS * 2  # 6 prototypes in batches of 4 and 2, twice
    for rng, index in zip(recorder.states, recorder.batches, strict=True):
        index = torch.stack(index) if isinstance(index, list) else index
        transformer.train()
        mapped = transformer(prototypes[index])
        torch.set_rng_state(rng)
        latents = generator.sample_w(len(index))
        loss = mmd2(mapped, latents) + LAMBDA * F.mse_loss(mapped, table[labels[index]])
        loss.backward()
        clip(list(transformer.parameters()))
        clip([table])
        adam.step()
    present = class_mean_rows(transformer, prototypes, labels, table.data)
    latents = table.detach()[present]
    images = ((generator.synthesize(latents) + 1) / 2).clamp(0, 1).mean(1, keepdim=True)  # RGB -> grey
    new_state = {
        **{f"transformer.{k}": v for k, v in transformer.state_dict().items()},
        "centroids.weight": table.detach(),
        "seen": present,
    }
    return new_state, (images - MEAN) / STD, latents


def test_fedktl_matches_the_oracle(monkeypatch):
    """Clients, uploads, server state, the pairs downloaded, and the next local step, each against the oracle."""
    generator = TinyGenerator()
    monkeypatch.setattr(fedktl, "_load_generator", lambda name: generator)
    algorithm = FedKTL(lr=LR, server_epochs=SERVER_EPOCHS, server_batch_size=SERVER_BATCH, server_lr=SERVER_LR)
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    etf = modules[0].etf.clone()
    # the shared classifier is a simplex ETF: unit columns, pairwise cosine -1/(C-1)
    gram = etf.t() @ etf
    assert torch.allclose(gram, torch.full((M, M), -1 / (M - 1)) + (1 + 1 / (M - 1)) * torch.eye(M), atol=1e-5)
    assert torch.equal(modules[1].etf, etf)
    head0 = clone(modules[0].latent_head.state_dict())
    assert_states_close(modules[1].latent_head.state_dict(), head0, "h'_i of client 1 (shared initialisation)")

    # --- round 0: ArcFace only (no pairs yet), then the prototypes
    nets, uploads, sent = [], [], []
    for cid, module in enumerate(modules):
        state = clone(module.client_state())
        payload = client_step(module, None, client_data(cid), num_examples=6, epochs=STEPS)
        net = TinyBNNet(CHANNELS, M, seed=0)
        net.head = nn.Linear(8, M)
        net.load_state_dict(without_prefix(state, "model."))
        head = nn.Linear(8, generator.latent_dim)
        head.load_state_dict(head0)
        oracle_client(net, head, etf, client_data(cid))
        assert_moved(state, module.client_state(), f"client {cid}")
        assert_states_close(
            module.client_state(), {f"model.{k}": v for k, v in net.state_dict().items()}, f"client {cid}"
        )
        prototypes, counts = oracle_prototypes(net, client_data(cid))
        assert_states_close(
            {"values": payload.values, "counts": payload.counts}, {"values": prototypes, "counts": counts}, "upload"
        )
        nets.append(net)
        uploads.append(ClientUpload(cid, "tiny", payload))
        sent.append((prototypes, counts))

    # --- the server round
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
    # F's first Linear feeds a BatchNorm in train mode, so its bias has no gradient in exact arithmetic; Adam
    # would turn the float32 rounding noise of that zero into steps of ~lr (different in any two correct
    # implementations, and recorded by the BatchNorm's running mean). Frozen, it takes the exact zero step.
    server.transformer[0].bias.requires_grad_(False)
    server_state = clone(server.state_dict())
    (recorder,) = server_step(server, 0, uploads)
    prototypes = torch.cat([p[c > 0] for p, c in sent])
    labels = torch.cat([(c > 0).nonzero().squeeze(1) for _, c in sent])
    expected, images, latents = oracle_server(server_state, prototypes, labels, recorder, generator)
    got = server.state_dict()
    assert_moved(server_state, got, "server")
    # 1e-4: four Adam steps turn float32 rounding of the MMD gradient into steps of 1e-6 to 3e-5, depending on the
    # process's string-hash seed (PYTHONHASHSEED 0 and 1 gave 3.1e-5); a bug moves ~1e-3
    assert_states_close({k: got[k] for k in expected}, expected, "server", atol=SERVER_ATOL)
    download = server.download_for(0)
    assert_states_close({"latents": download.latents}, {"latents": latents}, "downloaded latents", atol=SERVER_ATOL)
    assert_states_close({"images": download.images}, {"images": images}, "downloaded images", atol=1e-4)

    # --- round 1 for client 0: ArcFace + mu * MSE(h'_i(f_i(I)), Q), h'_i reset however it was left
    with torch.no_grad():
        modules[0].latent_head.weight.add_(1.0)
    rng: dict = {}
    state = clone(modules[0].client_state())
    client_step(modules[0], download, client_data(0), round_idx=1, state=state, epochs=STEPS, rng=rng, upload=False)
    head = nn.Linear(8, generator.latent_dim)
    head.load_state_dict(head0)
    oracle_client(nets[0], head, etf, client_data(0), (download.images, download.latents), next(iter(rng.values())))
    assert_moved(state, modules[0].client_state(), "client 0 in round 1")
    expected = {f"model.{k}": v for k, v in nets[0].state_dict().items()}
    # 1e-5: mu = 50 scales the gradients, and with them the float32 noise of the conv bias's exact-zero
    # gradient (a BatchNorm follows it), to ~1e-6 per SGD step; a wrong term moves entries by ~1e-3
    assert_states_close(modules[0].client_state(), expected, "client 0 in round 1", atol=1e-5)
    assert_states_close(modules[0].latent_head.state_dict(), head.state_dict(), "h'_i after round 1", atol=1e-5)
    assert math.isfinite(float(download.latents.sum()))
    assert copy.deepcopy(download.images).shape == (M, CHANNELS, SIZE, SIZE)
