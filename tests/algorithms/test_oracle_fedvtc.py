"""FedVTC one-step oracle: the alternating local round, the server, the VTC sync and fine-tuning.

Two clients run one federated round (one mini-batch: step A trains ``f_k`` on ``CE + L_tc``
with ``psi_k``, ``sigma_k`` frozen; step B trains ``psi_k`` and ``sigma_k`` on ``L_tc`` with a fresh
forward; Niu et al., Algorithm 1 and Eqs. 2-6); the server averages prototypes over owners and
``sigma`` over uploaders; client 0 runs round 2 from the download; both upload ``psi_k`` in
``vtc_sync``, and client 0 fine-tunes on its synthetic set after the broadcast. Every parameter
and buffer is compared with the plain-PyTorch oracle below to 1e-6, for the defaults and every
documented switch (``prior_sd``, ``kl_weight``, ``alternate``, the fine-tuning modes ...).

fedhet's documented resolutions (``fedhet/algorithms/fedvtc.py``, ``docs/fedvtc.md``), which the
oracle follows: the reconstruction target is the de-normalised image and decoded images are
normalised before entering ``g_k`` (spec 8 #10); ``sigma`` is a trained ``log sigma`` exchanged as
``sigma``; ``KL(N(z, sigma^2) || N(c^y, tau^2 I))`` with ``tau = prior_sd`` and weight
``kl_weight``; the class-normalised sums of Eqs. 4-5; the DM features run ``g_k`` in train mode;
the synthetic set decodes ``v ~ N(c^y, sigma^2)`` with the VTC in eval mode. The reparameterisation
noise comes from the global RNG (one ``randn_like`` per ``L_tc``, step A's first); the oracle restores
the RNG state recorded as each training step starts.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms import FedVTC
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from fedhet.seeding import derive_seed, seeded
from tests.algorithms.oracle import (
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    prefixed,
    server_step,
    sgd_step,
    without_prefix,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedvtc"}

M, SIZE, P = 4, 8, 8  # classes, image side, latent size p = C0 * (SIZE/4)^2 with C0 = 2
MEAN, STD = 0.3, 0.5  # the scenario's normalisation (non-trivial: pixels and model inputs differ)
FORMAT = DataFormat(image_size=SIZE, channels=1, mean=(MEAN,), std=(STD,), num_classes=M)
LABELS = ([0, 0, 1, 1, 1, 3], [2, 2, 3, 3, 0, 2], [1, 0, 3, 0, 1, 1])
TINY = dict(latent_channels=2, vtc_channels=(2, 3, 2), lr=0.05, synthetic_per_class=2, finetune_rounds=1,
            finetune_epochs=2, finetune_batch_size=4, dm_weight=0.3)  # fmt: skip


class TinyNeckNet(nn.Module):
    """conv + BN + ReLU + pool (8 features) -> Linear neck (p = 8) -> Linear head: a FeatureClassifier."""

    num_backbone_features = 8
    num_features = P

    def __init__(self, seed: int) -> None:
        super().__init__()
        with seeded(seed):
            self.conv = nn.Conv2d(1, 2, 3, padding=1)
            self.bn = nn.BatchNorm2d(2)
            self.neck = nn.Linear(8, P)
            self.head = nn.Linear(P, M)
        self.num_classes = M

    def forward_features(self, x: Tensor) -> Tensor:
        return self.neck(F.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 2).flatten(1))

    def forward_head(self, z: Tensor) -> Tensor:
        return self.head(z)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def data(index: int) -> tuple[Tensor, Tensor]:
    """Six fixed images with skewed labels."""
    return batch(index, size=6, image=SIZE)[0], torch.tensor(LABELS[index])


def class_mean_sum(values: Tensor, y: Tensor, reduction: str) -> Tensor:
    """Eqs. 4-5: ``sum_y 1/|B^y| sum_{i in B^y} values_i`` over the classes present (or the batch mean)."""
    if reduction == "batch_mean":
        return values.mean()
    return sum(values[y == c].mean() for c in y.unique())


class OracleVTCClient:
    """A FedVTC client in plain PyTorch: ``f_k`` (TinyNeckNet), ``psi_k`` and ``log sigma_k``, prototypes."""

    def __init__(self, state: dict[str, Tensor], template: nn.Module, vtc_template: nn.Module, hp) -> None:
        self.net = copy.deepcopy(template)
        self.net.load_state_dict(without_prefix(state, "model."))
        self.vtc = copy.deepcopy(vtc_template)
        self.vtc.load_state_dict(without_prefix(state, "vtc."))
        self.log_sigma = state["latent.log_sigma"].clone().requires_grad_(True)
        self.prototypes = state["latent.prototypes"].clone()
        self.synthetic_seed = state["latent.synthetic_seed"].clone()
        self.hp = hp

    def state(self) -> dict[str, Tensor]:
        return {
            **prefixed(clone(self.net.state_dict()), "model."),
            **prefixed(clone(self.vtc.state_dict()), "vtc."),
            "latent.log_sigma": self.log_sigma.detach().clone(),
            "latent.prototypes": self.prototypes.clone(),
            "latent.synthetic_seed": self.synthetic_seed.clone(),
        }

    def l_tc(self, x: Tensor, y: Tensor, z: Tensor, with_dm: bool) -> Tensor:
        """``L_tc`` = class-normalised sum of ``L_rc + beta KL + lambda L_dm`` (Eqs. 2-6)."""
        hp = self.hp
        sigma, tau = self.log_sigma.exp(), hp["prior_sd"]
        prior = self.prototypes[y]
        v = z + sigma * torch.randn_like(z)  # reparameterisation, Eq. 2
        generated = self.vtc(v)
        per_elem = (lambda t: t.mean(1)) if hp["element_reduction"] == "mean" else (lambda t: t.sum(1))
        rc = per_elem((generated - (x * STD + MEAN)).pow(2).flatten(1))  # against de-normalised pixels
        ratio = sigma**2 / tau**2
        kl = 0.5 * (((z - prior) ** 2).sum(1) / tau**2 + (ratio - 1 - torch.log(ratio)).sum())
        kl = kl / P if hp["element_reduction"] == "mean" else kl
        per_sample = rc + hp["kl_weight"] * kl
        if hp["dm_weight"] and with_dm:
            features = self.net.forward_features((generated - MEAN) / STD)  # decoded images normalised
            per_sample = per_sample + hp["dm_weight"] * per_elem((features - prior) ** 2)
        return class_mean_sum(per_sample, y, hp["reduction"])

    def federated_round(self, x: Tensor, y: Tensor, rng: list[Tensor], download) -> None:
        hp = self.hp
        if download is not None:
            self.prototypes[download["classes"]] = download["prototypes"]
            with torch.no_grad():
                self.log_sigma.copy_(download["sigma"].log())
        torch.set_rng_state(rng[0])
        # (A) psi, sigma frozen: f trains on CE + L_tc (modules in train mode)
        self.net.train()
        self.vtc.train().requires_grad_(False)
        self.log_sigma.requires_grad_(False)
        z = self.net.forward_features(x)
        loss = F.cross_entropy(self.net.forward_head(z), y) + self.l_tc(x, y, z, hp["dm_trains_extractor"])
        loss.backward()
        sgd_step(self.net.parameters(), TINY["lr"])
        if hp["alternate"] == "epoch":
            torch.set_rng_state(rng[1])
        # (B) f frozen: psi and sigma train on L_tc with a fresh forward
        self.net.requires_grad_(False)
        self.vtc.requires_grad_(True)
        self.log_sigma.requires_grad_(True)
        with torch.no_grad():
            z = self.net.forward_features(x)
        self.l_tc(x, y, z, True).backward()
        sgd_step([*self.vtc.parameters(), self.log_sigma], TINY["lr"])
        self.net.requires_grad_(True)

    @torch.no_grad()
    def upload(self, x: Tensor, y: Tensor) -> dict:
        """Class means of ``g(x)`` in eval mode over the training set, and ``sigma``."""
        self.net.eval()
        z = self.net.forward_features(x).double()
        classes = y.unique()
        protos = torch.stack([z[y == c].mean(0) for c in classes]).float()
        self.net.train()
        return {"classes": classes, "prototypes": protos, "sigma": self.log_sigma.exp().clone()}

    def finetune(self, stage_seed: int, seen: list) -> None:
        """Decode ``S/C`` latents per class with ``psi`` (eval mode), fine-tune ``f`` with CE on them.

        ``seen`` are the mini-batches fedhet's fit drew (their order is the DataLoader's shuffle,
        which Lightning's fetching consumes; not the method's arithmetic): each must be rows of the
        oracle's synthetic set, and the oracle trains on them in that order.
        """
        hp = self.hp
        if int(self.synthetic_seed) < 0:
            self.synthetic_seed.fill_(derive_seed(stage_seed, "fedvtc-synthetic"))
        labels = torch.arange(M).repeat_interleave(TINY["synthetic_per_class"])
        noise = torch.randn(len(labels), P, generator=torch.Generator().manual_seed(int(self.synthetic_seed)))
        with torch.no_grad():
            v = self.prototypes[labels] + self.log_sigma.exp() * noise
            images = (self.vtc.eval()(v) - MEAN) / STD
        self.vtc.train()
        if hp["finetune_mode"] == "literal_fullbatch":
            batches = [(images, labels)]
        else:
            batches = []
            for xb, yb in seen:
                rows = [int(((images - img).abs().flatten(1).amax(1) <= 1e-6).nonzero()[0]) for img in xb]
                assert torch.equal(labels[rows], yb), "a fine-tuning batch holds rows of another synthetic set"
                batches.append((images[rows], labels[rows]))
            steps = TINY["finetune_epochs"] * math.ceil(len(labels) / TINY["finetune_batch_size"])
            assert len(batches) == steps and sorted(sum((r.tolist() for _, r in batches), [])) == sorted(
                labels.tolist() * TINY["finetune_epochs"]
            )
        lr = hp["finetune_lr"] or TINY["lr"]
        for xb, yb in batches:
            self.net.train()
            if hp["finetune_bn"] == "frozen":
                self.net.bn.eval()
            F.cross_entropy(self.net(xb), yb).backward()
            sgd_step(self.net.parameters(), lr)


DEFAULTS = dict(
    prior_sd=1.0,
    kl_weight=1.0,
    alternate="batch",
    dm_weight=TINY["dm_weight"],
    dm_trains_extractor=True,
    element_reduction="sum",
    reduction="class_mean_sum",
    finetune_mode="epochs",
    finetune_bn="train",
    finetune_lr=None,
)
SWITCHES = {
    "defaults": {},
    "prior_sd_kl_weight": {"prior_sd": 0.5, "kl_weight": 0.3},
    "alternate_epoch": {"alternate": "epoch"},
    "dm_in_step_b_only": {"dm_trains_extractor": False},
    "mean_elements_batch_mean": {"element_reduction": "mean", "reduction": "batch_mean"},
    "literal_fullbatch": {"finetune_mode": "literal_fullbatch", "finetune_lr": 0.2},
    "finetune_bn_frozen": {"finetune_bn": "frozen"},
}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_fedvtc_matches_the_oracle(switch):
    """Round 1 on two clients, the server, round 2 on client 0, the VTC sync, fine-tuning: all to 1e-6."""
    hp = {**DEFAULTS, **SWITCHES[switch]}
    algorithm = FedVTC(**{**TINY, **SWITCHES[switch]})
    algorithm.configure(FORMAT)
    modules = [algorithm.build_client(TinyNeckNet(seed=10 + cid), M) for cid in range(2)]
    template, vtc_template = TinyNeckNet(seed=0), algorithm.build_vtc()
    states = [clone(m.client_state()) for m in modules]
    counts = torch.stack([torch.bincount(torch.tensor(LABELS[c]), minlength=M) for c in range(2)])
    context = ServerContext(
        num_clients=2, num_classes=M, architectures=("tiny",) * 2, seed=5,
        initial_client_state=lambda cid: clone(states[cid]), data_format=FORMAT, label_counts=counts,
        model_factory=lambda architecture, seed: TinyNeckNet(seed),
    )  # fmt: skip
    server = algorithm.build_server()
    server.total_rounds = 2  # what the loop sets: the run's federated rounds
    server.setup_server(context)
    oracles = [OracleVTCClient(states[c], template, vtc_template, hp) for c in range(2)]

    # ---- round 1 (index 0): every client, the download before any upload (zero prototypes, sigma = tau)
    uploads, expected = [], []
    for cid, module in enumerate(modules):
        rng: dict[str, list[Tensor]] = {}
        download = server.download_for(cid)
        payload = client_step(module, download, data(cid), 0, 2, rng=rng)
        d = {"classes": download.classes, "prototypes": download.prototypes, "sigma": download.sigma}
        oracles[cid].federated_round(*data(cid), rng["local"], d)
        assert_moved(states[cid], module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), oracles[cid].state(), f"client {cid} after round 1")
        up = oracles[cid].upload(*data(cid))
        assert torch.equal(payload.classes, up["classes"])
        assert_states_close(
            {"p": payload.prototypes, "s": payload.sigma}, {"p": up["prototypes"], "s": up["sigma"]}, "upload"
        )
        uploads.append(ClientUpload(cid, "tiny", payload))
        expected.append(up)

    # ---- the server: prototypes averaged over the owners, sigma over the uploaders (unweighted)
    server_step(server, 0, uploads)
    protos = torch.zeros(M, P)
    for c in range(M):
        owners = [u["prototypes"][u["classes"] == c][0] for u in expected if (u["classes"] == c).any()]
        if owners:
            protos[c] = torch.stack([o.double() for o in owners]).mean(0).float()
    sigma = torch.stack([u["sigma"].double() for u in expected]).mean(0).float()
    download = server.download_for(0)
    owned = torch.nonzero(counts[0] > 0).flatten()
    assert torch.equal(download.classes, owned)
    assert_states_close({"p": download.prototypes, "s": download.sigma}, {"p": protos[owned], "s": sigma}, "download")

    # ---- round 2 (index 1) on client 0 from the download
    rng = {}
    client_step(modules[0], download, data(2), 1, 2, rng=rng, upload=False)
    oracles[0].federated_round(*data(2), rng["local"], {"classes": owned, "prototypes": protos[owned], "sigma": sigma})
    assert_states_close(modules[0].client_state(), oracles[0].state(), "client 0 after round 2")

    # ---- vtc_sync: every psi_k uploaded and averaged uniformly (BN buffers too), then broadcast with all prototypes
    server.phase = "vtc_sync"
    sync = [ClientUpload(c, "tiny", client_step(modules[c], None, data(c), 0, 2, phase="vtc_sync")) for c in range(2)]
    server_step(server, 0, sync)
    psi = {}
    for key, value in oracles[0].vtc.state_dict().items():
        mean = (value.double() + oracles[1].vtc.state_dict()[key].double()) / 2
        psi[key] = mean.float() if value.is_floating_point() else mean.round().to(value.dtype)
    broadcast = server.download_for(0)
    assert_states_close(broadcast.vtc, psi, "averaged VTC")

    # ---- fine-tuning on client 0 (its stage seed is the driver's 1000)
    server.phase = "finetune"
    seen: dict[str, list] = {}
    client_step(modules[0], broadcast, data(0), 0, 1, phase="finetune", upload=False, batches=seen)
    oracles[0].vtc.load_state_dict(psi)
    oracles[0].prototypes = protos.clone()
    with torch.no_grad():
        oracles[0].log_sigma.copy_(sigma.log())
    oracles[0].finetune(1000, seen["finetune"])
    assert_states_close(modules[0].client_state(), oracles[0].state(), "client 0 after fine-tuning")


def test_sigma_is_a_standard_deviation_and_the_kl_scales_with_tau_squared():
    """At ``tau = 0.5`` the closed-form KL of the oracle is torch.distributions' (the oracle's own check)."""
    z, c = torch.tensor([[1.0, -0.5]]), torch.tensor([[0.2, 0.1]])
    sigma, tau = torch.tensor([0.3, 0.8]), 0.5
    ratio = sigma**2 / tau**2
    closed = 0.5 * (((z - c) ** 2).sum(1) / tau**2 + (ratio - 1 - torch.log(ratio)).sum())
    reference = torch.distributions.kl_divergence(
        torch.distributions.Normal(z, sigma), torch.distributions.Normal(c, torch.full_like(c, tau))
    ).sum(1)
    assert torch.allclose(closed, reference, atol=1e-6)
    assert math.isfinite(float(closed))
