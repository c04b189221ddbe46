"""FedGen one-step oracle: client steps, the server's head averaging and generator fit, the next client step.

Zhu, Hong & Zhou, ICML 2021 (Eq. 4-7, Algorithm 1), in fedhet's documented heterogeneous form
(HtFLlib's head sharing; ``fedhet/algorithms/fedgen.py`` records each choice):

* round 0: no generator has been trained, so each client takes one SGD step of plain
  cross-entropy and uploads its head ``Linear(K', C)`` with its per-class label counts;
* the server averages the heads by examples, ``sum_k n_k / n h_k``, and fits the generator
  ``G(z, y) = fc(ReLU(BN(fc1([z, onehot(y)]))))``, ``z ~ U[0, 1)``, with Adam (fresh each round)
  for ``generator_steps`` batches of labels drawn from the round's summed label counts, on

      CE(sum_k a_k(y) h_k(G(z, y)), y) + lambda_div exp(-mean_ij |z_i - z_j|^2_mean |G_i - G_j|_mean)

  with ``a_k(y) = n_k^y / sum_j n_j^y`` (the paper's per-class shares; ``"samples"``:
  ``n_k / n``, HtFLlib), the generator in train mode (its BatchNorm statistics move);
* round 1: client 0 receives the averaged head, the generator's parameters and the global label
  counts, and steps on ``CE(f(x), y) + lambda_gen CE(h(G(z, y^)), y^)`` (``y^`` from the global
  counts; the generator in train mode, no gradient into it) plus, when ``latent_kl_weight`` is on,
  the official code's ``KL(softmax(h(G(z, y)) / T) || softmax(f(x) / T))`` on the batch's labels.

Where fedhet departs from the official code, the oracle follows fedhet's recorded choice (the
method's docstring): one cross-entropy of the weighted logits (the paper's Eq. 4 and HtFLlib; the
official ``train_generator`` sums per-head cross-entropies weighted by ``a_k(y)``), labels drawn
from ``p^(y)`` (the paper and HtFLlib; the official code draws them uniformly), the clients'
generator in train mode (HtFLlib; the official client evaluates it in eval mode).

The global RNG draws of the steps (the generator's uniform noise, the client's label draws) are
replayed from the states :class:`RngRecorder` took as each step started, in the method's order;
the server's labels from the round's server seed. Every parameter and buffer of the clients, the
uploads, the download and the server (head, generator with its BatchNorm statistics, the label
counts, the round counter) and the generator-loss metrics are compared to 1e-6.

Settings that make a wrong choice visible: the clients' label counts differ per class and from
their example shares (so label-share, example-share and uniform ensemble weights all differ),
examples 6 / 4 / 8 (uniform head averaging differs), ``lambda_div = 0.7``, ``lambda_gen = 0.6``,
the latent KL at weight 2 and ``T = 0.5``, three generator steps, and ten label draws in round 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms import FedGen
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.seeding import seeded
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

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedgen"}

M, CHANNELS, FEATURES = 4, 1, TinyBNNet.num_features
LABELS = ([0, 0, 0, 0, 1, 2], [2, 2, 3, 3], [0, 3, 3, 3, 3, 2, 3, 0])
COUNTS = torch.tensor([[4, 1, 1, 0], [0, 0, 2, 2], [2, 0, 1, 5]])  # summed [6, 1, 4, 7]: far from uniform
LOCAL_LR, SERVER_SEED = 0.1, 77
NOISE, HIDDEN, GEN_LR, GEN_STEPS, GEN_BATCH = 3, 5, 0.05, 3, 4
DIVERSITY, GENERATED = 0.7, 0.6


NEXT_LABELS = [0, 0, 1, 2, 3, 3, 0, 2, 0, 1]  # client 0's batch of round 1: ten label draws of y^


def data(cid: int, labels: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Client ``cid``'s fixed batch: its labels (or ``labels``), random images."""
    y = torch.tensor(LABELS[cid] if labels is None else labels)
    x = torch.randn(len(y), CHANNELS, 8, 8, generator=torch.Generator().manual_seed(cid + 10 * len(y)))
    return x, y


class Generator(nn.Module):
    """The generator as the paper's feature-space ``G(z, y)``: ``[z, onehot(y)] -> Linear -> BN -> ReLU -> Linear``.

    Same parameter names as fedhet's, so its state loads; the forward is written here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Sequential(nn.Linear(NOISE + M, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU())
        self.fc = nn.Linear(HIDDEN, FEATURES)

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        h = torch.cat([z, F.one_hot(y, M).float()], 1) @ self.fc1[0].weight.t() + self.fc1[0].bias
        return self.fc(torch.relu(self.fc1[1](h)))


def head(state: dict[str, Tensor], features: Tensor) -> Tensor:
    """A linear head ``h(f) = W f + b``."""
    return features @ state["weight"].t() + state["bias"]


def diversity(z: Tensor, g: Tensor) -> Tensor:
    """Eq. (7) as the official ``DiversityLoss('l1')``: ``exp(-mean_ij mean_d (z_i - z_j)^2 * mean_d |g_i - g_j|)``."""
    d_z = ((z[:, None] - z[None]) ** 2).mean(2)
    d_g = (g[:, None] - g[None]).abs().mean(2)
    return torch.exp(-(d_z * d_g).mean())


# ---------------------------------------------------------------------- the oracle
def oracle_client(state: dict[str, Tensor], batch, download=None, rng: Tensor | None = None, hp=None) -> dict:
    """One SGD step of the client objective from ``state`` (the download's head replacing the client's)."""
    x, y = batch
    net = TinyBNNet(CHANNELS, M)
    net.load_state_dict(state)
    net.train()
    if download is not None:
        net.head.load_state_dict(download["head"])
    logits = net(x)
    loss = F.cross_entropy(logits, y)
    if download is not None:
        generator = Generator().train()  # train mode: the batch's statistics, as the method runs it
        generator.load_state_dict(download["generator"], strict=False)  # parameters only are sent
        torch.set_rng_state(rng)
        if hp["latent_kl_weight"]:  # official user_latent_loss: the batch's own labels through G, then the head
            with torch.no_grad():
                target = net.head(generator(torch.rand(len(y), NOISE), y))
            p = torch.softmax(target / hp["T"], 1)
            kl = (p * (torch.log(p) - torch.log_softmax(logits / hp["T"], 1))).sum(1).mean()
            loss = loss + hp["latent_kl_weight"] * kl
        labels = torch.multinomial(download["label_counts"].double(), len(y), replacement=True)  # y^ ~ p(y)
        with torch.no_grad():
            features = generator(torch.rand(len(y), NOISE), labels)
        loss = loss + GENERATED * F.cross_entropy(net.head(features), labels)
    loss.backward()
    sgd_step(net.parameters(), LOCAL_LR)
    return clone(net.state_dict())


def oracle_server(heads: list[dict], counts: Tensor, examples, generator_state: dict, rng: list[Tensor], hp):
    """Head averaging and the generator's fit; returns (head, generator state, labels, first and last loss)."""
    average = example_weighted_mean(heads, examples)
    counts = counts.double()
    if hp["ensemble_weighting"] == "label":  # a_k(y) = n_k^y / sum_j n_j^y
        a = (counts / counts.sum(0)).float()
    else:  # n_k / n for every class
        n = torch.tensor(examples, dtype=torch.float64)
        a = (n / n.sum())[:, None].expand_as(counts).float()
    with seeded(SERVER_SEED):  # the round's labels, drawn from the round's summed counts
        labels = torch.multinomial(counts.sum(0), GEN_STEPS * GEN_BATCH, replacement=True)
    generator = Generator()
    generator.load_state_dict(without_prefix(generator_state, "generator."))
    generator.train()
    adam = AdamOracle(generator.parameters(), GEN_LR)
    losses = []
    for step in range(GEN_STEPS):
        y = labels[step * GEN_BATCH : (step + 1) * GEN_BATCH]
        torch.set_rng_state(rng[step])
        z = torch.rand(len(y), NOISE)
        g = generator(z, y)
        ensemble = sum(a[k, y][:, None] * head(h, g) for k, h in enumerate(heads))
        loss = F.cross_entropy(ensemble, y) + DIVERSITY * diversity(z, g)
        loss.backward()
        adam.step()
        losses.append(float(loss.detach()))
    return average, prefixed(clone(generator.state_dict()), "generator."), labels, losses


# ---------------------------------------------------------------------- the test
CASES = {
    "label_weights_latent_kl": {"ensemble_weighting": "label", "latent_kl_weight": 2.0, "T": 0.5},
    "label_weights": {"ensemble_weighting": "label", "latent_kl_weight": 0.0, "T": 1.0},
    "sample_weights": {"ensemble_weighting": "samples", "latent_kl_weight": 0.0, "T": 1.0},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fedgen_matches_the_oracle(case):
    """Round 0's client steps, the server round, and client 0's regularised step of round 1."""
    hp = CASES[case]
    algorithm = FedGen(
        optimizer="sgd",
        lr=LOCAL_LR,
        momentum=0.0,
        weight_decay=0.0,
        noise_dim=NOISE,
        generator_hidden_dim=HIDDEN,
        generator_lr=GEN_LR,
        generator_steps=GEN_STEPS,
        generator_batch_size=GEN_BATCH,
        diversity_weight=DIVERSITY,
        ensemble_weighting=hp["ensemble_weighting"],
        generated_weight=GENERATED,
        latent_kl_weight=hp["latent_kl_weight"],
        latent_kl_temperature=hp["T"],
    )
    initial = clone(algorithm.build_client(TinyBNNet(CHANNELS, M, seed=100), M).client_state())
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=3,
            num_classes=M,
            architectures=("tiny",) * 3,
            seed=5,
            initial_client_state=lambda cid: clone(initial),
            label_counts=COUNTS + 1,
        )
    )
    # the generator's first layer (before its BatchNorm) rescaled: same function, see scaled_before_batch_norm
    before = scaled_before_batch_norm(server.server_state(), [("generator.fc1.0", "generator.fc1.1")], 1e4)
    server.load_server_state(before)
    assert server.download_for(0) is None  # no generator trained yet

    # ---- round 0: plain cross-entropy steps; uploads of heads and label counts
    modules, uploads, states = [], [], []
    for cid in range(3):
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        start = clone(without_prefix(module.client_state(), "model."))
        payload = client_step(module, None, data(cid))
        expected = oracle_client(start, data(cid))
        assert_states_close(module.client_state(), prefixed(expected, "model."), f"client {cid} after its step")
        assert_states_close(payload.weights, without_prefix(expected, "head."), f"client {cid} uploaded head")
        assert torch.equal(payload.label_counts, COUNTS[cid]), f"client {cid} label counts {payload.label_counts}"
        upload = ClientUpload(cid, "tiny", payload)
        server.check_upload(upload)
        modules.append(module)
        uploads.append(upload)
        states.append(expected)

    # ---- the server round
    recorders = server_step(server, 0, uploads, seed=SERVER_SEED)
    heads = [without_prefix(s, "head.") for s in states]
    examples = [len(y) for y in LABELS]
    generator_before = {k: v for k, v in before.items() if k.startswith("generator.")}
    average, generator_after, labels, losses = oracle_server(
        heads, COUNTS, examples, generator_before, recorders[0].states, hp
    )
    assert torch.equal(torch.cat([b[0] for b in recorders[0].batches]), labels), "the generator's labels"
    expected_server = {
        **prefixed(average, "global_head."),
        **generator_after,
        "client_label_counts": COUNTS,
        "rounds_trained": torch.tensor(1),
    }
    assert_moved(generator_before, generator_after, "the generator's fit")
    # the rescaled layer's BatchNorm variance is ~1e6: compared relative to its size (float32 ulp)
    assert_states_close(server.server_state(), expected_server, "server", rtol=1e-6)
    metrics = server.metrics()
    assert metrics["generator_loss_first"] == pytest.approx(losses[0], abs=1e-6)
    assert metrics["generator_loss"] == pytest.approx(losses[-1], abs=1e-6)

    download = server.download_for(0)
    sent = {"head": average, "generator": without_prefix(generator_after, "generator."), "label_counts": COUNTS.sum(0)}
    assert_states_close(download.head, sent["head"], "downloaded head")
    parameters = {k: v for k, v in sent["generator"].items() if "running" not in k and "num_batches" not in k}
    assert_states_close(download.generator, parameters, "downloaded generator", rtol=1e-6)
    assert torch.equal(download.label_counts, sent["label_counts"])

    # ---- round 1: client 0 with the generator's regulariser (and the latent KL when on)
    rng: dict[str, list[Tensor]] = {}
    client_step(modules[0], download, data(0, NEXT_LABELS), round_idx=1, rng=rng)
    expected = oracle_client(states[0], data(0, NEXT_LABELS), sent, rng["local"][0], hp)
    assert_moved(prefixed(states[0], "model."), modules[0].client_state(), "client 0's second step")
    assert_states_close(modules[0].client_state(), prefixed(expected, "model."), "client 0 in round 1")
