"""FedCG one-step oracle: both client stages (extractor, latent cGAN) and the KD server round.

Written from the paper (Wu et al., "FedCG: Leverage Conditional GAN for Protecting Privacy and
Maintaining Competitive Performance in Federated Learning", IJCAI 2022) with fedhet's documented
choices (``fedhet/algorithms/fedcg.py``: FedMD-CG's client schedule and SGD, its server
settings), which the oracle follows too:

* on receipt ``D_i <- D`` and ``G_i <- G`` (the generator is shared in FedCG); ``G`` is kept frozen;
* stage 1, SGD on ``[F_i, D_i]`` in train mode: ``CE(D_i(F_i(x)), y) + gamma(r) MSE(F_i(x), G(z, y))``
  with ``G`` in eval mode, ``z ~ N(0, I)``, ``gamma(r) = (r / (R - 1))^3`` (0 in round 0);
* stage 2, per batch, with ``F_i`` frozen in eval mode: one Adam step of the latent conditional
  discriminator ``s(h, y) = sigmoid(W [h, onehot(y)] + b)`` on
  ``-mean log s(F_i(x), y) - mean log(1 - s(G_i(z, y), y))`` (``G_i``'s output a constant), then,
  with the updated discriminator and the same ``G_i(z, y)``, one Adam step of ``G_i`` on
  ``-mean log s(G_i(z, y), y)`` (non-saturating); the Adam states carry across rounds;
* the server averages ``(G_i, D_i)`` with ``n_i / n`` and distils the ensemble for ``server_steps``
  Adam steps on ``G`` (train mode) and ``D``: ``T^2 mean_b KL(softmax(sum_i n_i/n D_i(G_i(z, y)) / T)
  || softmax(D(G(z, y)) / T))`` (``"hinton"``; ``"paper"`` drops ``T^2``, ``"code"`` divides by ``C``),
  teachers in eval mode, one noise batch shared by every generator, labels drawn from the summed
  class counts by the server's seeded loader.

Three clients run round 0, the server aggregates, and client 0 runs round 1 from the download
(``gamma = 1/8`` with ``R = 3``) with its carried Adam states. Every parameter and buffer
(``F_i``, ``D_i``, ``G_i``, the discriminator, the server's ``G`` and ``D``) is compared with the
oracle to 1e-6, for the defaults and the documented switches. The discriminator's fresh
initialisation draws from the global RNG, which a test process does not fix, so the clients are
built under fixed seeds and the numbers are the same on every run (scanning 40 other
initialisations, one left a 2e-6 difference: the ``code`` form's KL divided by ``C`` at ``T = 3``
gives Adam gradients small enough that float rounding shows).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms import get_algorithm
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.seeding import derive_seed, seeded
from tests.algorithms.oracle import (
    AdamOracle,
    TinyBNNet,
    assert_moved,
    assert_states_close,
    client_step,
    clone,
    example_weighted_mean,
    prefixed,
    scaled_before_batch_norm,
    server_step,
    sgd_step,
    without_prefix,
)
from tests.algorithms.test_oracle_fedmdcg import (
    CHANNELS,
    EXAMPLES,
    FEATURES,
    FORMAT,
    GENERATOR_BN_PAIRS,
    M,
    OracleGenerator,
    loaded,
    skewed_batch,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedcg"}

SERVER_SEED, TOTAL_ROUNDS = 31, 3
#: four server steps and a strong coupled decay: Adam's first step is ``lr sign(g)`` whatever the
#: gradient's scale, so with fewer steps and a weak decay a wrong weight or temperature barely shows
TINY = dict(
    local_steps=2,
    server_steps=4,
    server_batch_size=5,
    noise_dim=3,
    generator_hidden=(6, 5),
    generator_lr=0.01,
    generator_weight_decay=1e-3,
    server_lr=0.01,
    server_weight_decay=1e-2,
    server_temperature=3.0,
    lr=0.1,
    weight_decay=1e-3,
)
DEFAULTS = dict(
    conditional_discriminator=True, noise="gaussian", server_loss_form="hinton", server_weight_decay_mode="coupled"
)
SWITCHES = {
    "defaults": {},
    "unconditional_uniform": {"conditional_discriminator": False, "noise": "uniform"},
    "paper_form_decoupled": {"server_loss_form": "paper", "server_weight_decay_mode": "decoupled"},
    "code_form": {"server_loss_form": "code"},
}


def draw_noise(count: int, hp) -> Tensor:
    """``N(0, I)`` or ``U[0, 1)`` from the global RNG."""
    return torch.randn(count, TINY["noise_dim"]) if hp["noise"] == "gaussian" else torch.rand(count, TINY["noise_dim"])


def kl_teacher_first(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """Per-sample ``KL(softmax(teacher / T) || softmax(student / T))``, the teacher a constant."""
    log_t = F.log_softmax(teacher.detach() / temperature, 1)
    return (log_t.exp() * (log_t - F.log_softmax(student / temperature, 1))).sum(1)


class OracleClient:
    """A FedCG client in plain PyTorch: ``[F_i, D_i]``, ``G_i``, the latent discriminator, two Adams."""

    def __init__(self, state: dict[str, Tensor], hp) -> None:
        self.hp = hp
        self.net = loaded(TinyBNNet(CHANNELS, M), without_prefix(state, "model."))
        self.generator = loaded(
            OracleGenerator(TINY["noise_dim"], TINY["generator_hidden"]), without_prefix(state, "generator.")
        )
        extra = M if hp["conditional_discriminator"] else 0
        self.disc = nn.Sequential(nn.Linear(FEATURES + extra, 1))
        self.disc.load_state_dict(without_prefix(state, "discriminator.body."))
        kwargs = {"lr": TINY["generator_lr"], "weight_decay": TINY["generator_weight_decay"]}
        self.adam_d = AdamOracle(self.disc.parameters(), **kwargs)
        self.adam_g = AdamOracle(self.generator.parameters(), **kwargs)

    def state(self) -> dict[str, Tensor]:
        return {
            **prefixed(clone(self.net.state_dict()), "model."),
            **prefixed(clone(self.generator.state_dict()), "generator."),
            **prefixed(clone(self.disc.state_dict()), "discriminator.body."),
        }

    def score(self, features: Tensor, y: Tensor) -> Tensor:
        if self.hp["conditional_discriminator"]:
            features = torch.cat([features, F.one_hot(y, M).float()], 1)
        return torch.sigmoid(self.disc(features))

    def round(self, data, rng: dict[str, list[Tensor]], round_idx: int, download) -> None:
        x, y = data
        received = None
        if download is not None:
            self.net.head.load_state_dict(download["classifier"])
            self.generator.load_state_dict(download["generator"])
            received = loaded(
                OracleGenerator(TINY["noise_dim"], TINY["generator_hidden"]), download["generator"]
            ).eval()
        gamma = (round_idx / (TOTAL_ROUNDS - 1)) ** 3
        for state in rng["model"]:  # stage 1: [F_i, D_i] by SGD in train mode
            torch.set_rng_state(state)
            self.net.train()
            features = self.net.forward_features(x)
            loss = F.cross_entropy(self.net.forward_head(features), y)
            if received is not None and gamma > 0:
                with torch.no_grad():
                    generated = received(y, draw_noise(len(y), self.hp))
                loss = loss + gamma * ((features - generated) ** 2).mean()
            loss.backward()
            sgd_step(self.net.parameters(), TINY["lr"], TINY["weight_decay"])
        for state in rng["generator"]:  # stage 2: the latent cGAN, F_i frozen in eval mode
            torch.set_rng_state(state)
            self.net.eval()
            self.generator.train()
            with torch.no_grad():
                real = self.net.forward_features(x)
            fake = self.generator(y, draw_noise(len(y), self.hp))
            d_loss = -torch.log(self.score(real, y)).mean() - torch.log(1 - self.score(fake.detach(), y)).mean()
            d_loss.backward()
            self.adam_d.step()
            g_loss = -torch.log(self.score(fake, y)).mean()
            g_loss.backward()
            self.adam_g.step()
            self.adam_d.zero_grad()  # the generator step's gradients of s are not the discriminator's


def oracle_server(uploads: list[dict], rng: list[Tensor], hp) -> tuple[dict, dict]:
    """Example-weighted average of ``(G_i, D_i)``, then ``server_steps`` Adam steps of the ensemble KD."""
    n = [u["n"] for u in uploads]
    generator = loaded(
        OracleGenerator(TINY["noise_dim"], TINY["generator_hidden"]),
        example_weighted_mean([u["generator"] for u in uploads], n),
    )
    classifier = loaded(nn.Linear(FEATURES, M), example_weighted_mean([u["classifier"] for u in uploads], n))
    teachers = [
        (
            loaded(OracleGenerator(TINY["noise_dim"], TINY["generator_hidden"]), u["generator"]).eval(),
            loaded(nn.Linear(FEATURES, M), u["classifier"]).eval(),
        )
        for u in uploads
    ]
    share = torch.tensor(n, dtype=torch.float32) / sum(n)
    counts = sum(u["counts"] for u in uploads).double()
    B, steps, T = TINY["server_batch_size"], TINY["server_steps"], TINY["server_temperature"]
    sampler = torch.Generator().manual_seed(derive_seed(SERVER_SEED, "fedmdcg-labels"))
    labels = torch.multinomial(counts, steps * B, True, generator=sampler)
    adam = AdamOracle(
        [*generator.parameters(), *classifier.parameters()],
        TINY["server_lr"],
        TINY["server_weight_decay"],
        decoupled=hp["server_weight_decay_mode"] == "decoupled",
    )
    scale = {"hinton": T * T, "paper": 1.0, "code": 1.0 / M}[hp["server_loss_form"]]
    for step in range(steps):
        torch.set_rng_state(rng[step])
        y = labels[step * B : (step + 1) * B]
        generator.train()
        z = draw_noise(B, hp)
        student = classifier(generator(y, z))
        with torch.no_grad():
            ensemble = sum(w * d_i(g_i(y, z)) for w, (g_i, d_i) in zip(share, teachers, strict=True))
        loss = scale * kl_teacher_first(student, ensemble, T).mean()
        loss.backward()
        adam.step()
    return clone(generator.state_dict()), clone(classifier.state_dict())


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_fedcg_matches_the_oracle(switch):
    """Round 0 on three clients, the server round, round 1 on client 0: every state to 1e-6."""
    run_case(switch)


def run_case(switch: str, seed: int = 0) -> None:
    """The three steps of the module docstring with ``SWITCHES[switch]``, each against the oracle."""
    hp = {**DEFAULTS, **SWITCHES[switch]}
    algorithm = get_algorithm("fedcg")(**TINY, **SWITCHES[switch])
    algorithm.configure(FORMAT)
    modules, states = [], []
    for cid in range(3):
        with seeded(seed + cid):  # the discriminator's fresh initialisation draws from the global RNG
            module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        state = scaled_before_batch_norm(module.client_state(), GENERATOR_BN_PAIRS)
        module.load_client_state(state)
        modules.append(module)
        states.append(state)
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=3,
            num_classes=M,
            architectures=("tiny",) * 3,
            seed=5,
            initial_client_state=lambda cid: clone(states[0]),
            data_format=FORMAT,
            model_factory=lambda architecture, seed: TinyBNNet(CHANNELS, M, seed=seed),
        )
    )
    assert server.download_for(0) is None

    oracles, uploads, expected = [], [], []
    optimizer_states: list[dict] = [{}, {}, {}]
    for cid, module in enumerate(modules):
        rng: dict[str, list[Tensor]] = {}
        data = skewed_batch(cid)
        payload = client_step(
            module, None, data, 0, TOTAL_ROUNDS, num_examples=EXAMPLES[cid], rng=rng, optimizers=optimizer_states[cid]
        )
        oracle = OracleClient(states[cid], hp)
        oracle.round(data, rng, 0, None)
        assert_moved(states[cid], module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), oracle.state(), f"client {cid} after round 0", rtol=1e-6)
        assert_states_close(payload.generator, without_prefix(oracle.state(), "generator."), "uploaded G_i", rtol=1e-6)
        assert_states_close(payload.classifier, without_prefix(oracle.state(), "model.head."), "uploaded D_i")
        counts = torch.bincount(data[1], minlength=M)
        assert torch.equal(payload.label_counts, counts)
        oracles.append(oracle)
        uploads.append(ClientUpload(cid, "tiny", payload))
        expected.append(
            {
                "generator": without_prefix(oracle.state(), "generator."),
                "classifier": without_prefix(oracle.state(), "model.head."),
                "counts": counts,
                "n": EXAMPLES[cid],
            }
        )

    recorders = server_step(server, 0, uploads, seed=SERVER_SEED)
    g_state, d_state = oracle_server(expected, recorders[0].states, hp)
    download = server.download_for(0)
    assert_states_close(download.generator, g_state, "global G", rtol=1e-6)
    assert_states_close(download.classifier, d_state, "global D")
    total = sum(e["counts"] for e in expected)
    assert torch.equal(download.label_counts, total)

    rng = {}
    client_step(modules[0], download, skewed_batch(3), 1, TOTAL_ROUNDS, rng=rng, optimizers=optimizer_states[0])
    oracles[0].round(skewed_batch(3), rng, 1, {"generator": g_state, "classifier": d_state, "counts": total})
    assert_states_close(modules[0].client_state(), oracles[0].state(), "client 0 after round 1", rtol=1e-6)
