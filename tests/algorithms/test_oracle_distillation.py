"""One-step oracles of the lock-step public-data distillation methods FedMD, FedDF, RHFL, FedMatch.

FedMD (Li and Wang, NeurIPS-W 2019, "Communicate / Aggregate / Distribute / Digest / Revisit";
FCCL+'s benchmark code for the details): per public batch every participant computes its logits
in train mode, the consensus is their mean (the receiver included), and each participant steps
on the L1 (the code; the paper's MSE as the option) between its logits and the consensus; then
each revisits its private data with cross-entropy. FedDF in its heterogeneous form (Lin et al.,
NeurIPS 2020, Algorithm 1): the same frame with ``T^2 KL(softmax(ens/T) || softmax(z/T))`` to the
ensemble's mean logits and SGD with weight decay 1e-5 (the benchmark's distillation optimizer).

Two BatchNorm clients of different initialisations collaborate on two public batches with SGD
(``public_optimizer="sgd"``: the loss's scale and weights reach the parameters, which Adam's
first, sign-like step would hide), then take two local SGD steps of cross-entropy. Every
parameter and buffer is compared with the oracle to 1e-6.

RHFL (Fang and Ye, CVPR 2022; FCCL+'s benchmark): three participants, each matching every peer's
softmax weighted by that peer's confidence ``w_j``; locally the symmetric cross-entropy; the
uploaded mean private loss; and the server's client confidence re-weighting from two rounds of
losses. FedMatch (Jeong et al., ICLR 2021, in fedhet's documented heterogeneous adaptation): the
consistency KL to the helpers' mean softmax plus the B-normalised cross-entropy of the strongly
augmented view to their confident pseudo-labels (the augmentation itself is fedhet's
``strong_augment``, drawn from the step's global RNG as the phase draws it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import RHFL, FedDF, FedMatch, FedMD
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.algorithms.fedmatch import strong_augment
from fedhet.algorithms.rhfl import ClientConfidencePayload, PrivateLossPayload
from tests.algorithms.oracle import (
    RngRecorder,
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    collaborative_step,
    prefixed,
    server_step,
    sgd_step,
    unlabelled_loader,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedmd", "feddf", "rhfl", "fedmatch"}

M, CHANNELS, B = 4, 1, 6
PUBLIC_LR, LOCAL_LR, LOCAL_STEPS, T = 0.1, 0.1, 2, 2.0
LOCAL = {"optimizer": "sgd", "lr": LOCAL_LR, "weight_decay": 0.0}
CASES = {
    "fedmd_l1": lambda: FedMD(public_optimizer="sgd", public_lr=PUBLIC_LR, **LOCAL),
    "fedmd_mse": lambda: FedMD(public_optimizer="sgd", public_lr=PUBLIC_LR, digest_loss="mse", **LOCAL),
    "feddf": lambda: FedDF(public_lr=PUBLIC_LR, temperature=T, **LOCAL),  # SGD, weight decay 1e-5 by default
}


def digest(case: str, z, target):
    """The step's loss towards the detached consensus ``target``."""
    if case == "fedmd_l1":
        return (z - target).abs().mean()
    if case == "fedmd_mse":
        return ((z - target) ** 2).mean()
    p = torch.softmax(target / T, 1)
    return T**2 * (p * (torch.log(p) - torch.log_softmax(z / T, 1))).sum(1).mean()


@pytest.mark.parametrize("case", sorted(CASES))
def test_public_distillation_matches_the_oracle(case):
    """Collaboration on two public batches, then two local steps, of two clients."""
    algorithm = CASES[case]()
    clients = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(2)]
    initial = [clone(c.client_state()) for c in clients]
    public = [batch(50 + i, size=B)[0] for i in range(2)]
    collaborative_step(algorithm, clients, unlabelled_loader(public))

    nets = [TinyBNNet(CHANNELS, M, seed=10 + cid) for cid in range(2)]
    decay = 1e-5 if case == "feddf" else 0.0
    for x in public:
        for net in nets:
            net.train()
        logits = [net(x) for net in nets]
        consensus = torch.stack([z.detach() for z in logits]).mean(0)
        for net, z in zip(nets, logits, strict=True):
            digest(case, z, consensus).backward()
            sgd_step(net.parameters(), PUBLIC_LR, weight_decay=decay)
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        assert_moved(initial[cid], client.client_state(), f"{case} client {cid} collaboration")
        assert_states_close(client.client_state(), prefixed(net.state_dict(), "model."), f"{case} client {cid}")

    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        x, y = batch(cid)
        client_step(client, None, (x, y), epochs=LOCAL_STEPS, upload=False)
        for _ in range(LOCAL_STEPS):
            net.train()
            F.cross_entropy(net(x), y).backward()
            sgd_step(net.parameters(), LOCAL_LR)
        assert_states_close(client.client_state(), prefixed(net.state_dict(), "model."), f"{case} client {cid} local")


# ---------------------------------------------------------------------- RHFL (Fang and Ye, CVPR 2022)
def test_rhfl_matches_the_oracle():
    """Peer KL weighted by the peers' confidence, SCE locally, the uploaded loss, and CCR's weights."""
    alpha, beta, ccr_beta = 0.3, 0.8, 0.5
    confidence = [0.2, 0.3, 0.5]
    algorithm = RHFL(
        public_optimizer="sgd", public_lr=PUBLIC_LR, sce_alpha=alpha, sce_beta=beta, ccr_beta=ccr_beta, **LOCAL
    )
    clients = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(3)]
    for client, w in zip(clients, confidence, strict=True):
        client.on_receive(ClientConfidencePayload(weight=torch.tensor(w)))
    public = [batch(50 + i, size=B)[0] for i in range(2)]
    collaborative_step(algorithm, clients, unlabelled_loader(public))

    nets = [TinyBNNet(CHANNELS, M, seed=10 + cid) for cid in range(3)]
    for x in public:  # participant i: sum_{j != i} w_j KL(softmax(z_j) || softmax(z_i)), peers detached
        for net in nets:
            net.train()
        logits = [net(x) for net in nets]
        for i, net in enumerate(nets):
            loss = 0.0
            for j, z in enumerate(logits):
                if j != i:
                    p = torch.softmax(z.detach(), 1)
                    loss = loss + confidence[j] * (p * (torch.log(p) - torch.log_softmax(logits[i], 1))).sum(1).mean()
            loss.backward()
            sgd_step(net.parameters(), PUBLIC_LR)
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        assert_states_close(client.client_state(), prefixed(net.state_dict(), "model."), f"RHFL client {cid}")

    def sce(logits, y):  # alpha CE + beta RCE, the one-hot clamped to [1e-4, 1], predictions to [1e-7, 1]
        p = torch.softmax(logits, 1).clamp(1e-7, 1.0)
        rce = -(p * torch.log(F.one_hot(y, M).float().clamp(1e-4, 1.0))).sum(1).mean()
        return alpha * F.cross_entropy(logits, y) + beta * rce

    uploads, losses = [], []
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        x, y = batch(cid)
        payload = client_step(
            client, ClientConfidencePayload(weight=torch.tensor(confidence[cid])), (x, y), epochs=LOCAL_STEPS
        )
        for _ in range(LOCAL_STEPS):
            net.train()
            sce(net(x), y).backward()
            sgd_step(net.parameters(), LOCAL_LR)
        assert_states_close(client.client_state(), prefixed(net.state_dict(), "model."), f"RHFL client {cid} local")
        net.eval()
        with torch.no_grad():
            loss = sce(net(x), y)
        assert abs(float(payload.loss) - float(loss)) < 1e-6, f"uploaded loss {float(payload.loss)} != {float(loss)}"
        uploads.append(ClientUpload(cid, "tiny", payload))
        losses.append(float(loss))

    # CCR: q_i = (l_i^(e-1) - l_i^e) / l_i^e, a_i = 1/(K-1) + beta q_i / sum q, w = softmax(a)
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=3,
            num_classes=M,
            architectures=("tiny",) * 3,
            seed=5,
            initial_client_state=lambda cid: clone(clients[cid].client_state()),
        )
    )
    server_step(server, 0, uploads)
    assert all(server.download_for(cid) is None for cid in range(3))  # one loss each: no confidence yet
    later = [losses[0] * 0.9, losses[1] * 0.5, losses[2] * 0.8]
    second = [ClientUpload(cid, "tiny", PrivateLossPayload(loss=torch.tensor(v))) for cid, v in enumerate(later)]
    server_step(server, 1, second)
    q = torch.tensor([(a - b) / b for a, b in zip(losses, later, strict=True)], dtype=torch.float64)
    expected = torch.softmax(1 / 2 + ccr_beta * q / q.sum(), 0)
    got = torch.stack([server.download_for(cid).weight for cid in range(3)]).double()
    assert torch.allclose(got, expected, atol=1e-6), f"CCR weights {got.tolist()} != {expected.tolist()}"


# ---------------------------------------------------------------------- FedMatch (Jeong et al., ICLR 2021; adapted)
def test_fedmatch_matches_the_oracle():
    """Consistency KL to the helpers' mean softmax plus their confident pseudo-labels on the strong view."""
    threshold, pseudo_weight, consistency_weight = 0.3, 0.7, 1.3
    algorithm = FedMatch(
        public_optimizer="sgd",
        public_lr=PUBLIC_LR,
        threshold=threshold,
        pseudo_label_weight=pseudo_weight,
        consistency_weight=consistency_weight,
        **LOCAL,
    )
    clients = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M) for cid in range(3)]
    public = [batch(50 + i, size=B)[0] for i in range(2)]
    recorder = RngRecorder()
    collaborative_step(algorithm, clients, unlabelled_loader(public), recorder=recorder)

    nets = [TinyBNNet(CHANNELS, M, seed=10 + cid) for cid in range(3)]
    confident = 0
    for x, rng in zip(public, recorder.states, strict=True):
        for net in nets:
            net.train()
        logits = [net(x) for net in nets]
        probs = [torch.softmax(z.detach(), 1) for z in logits]
        torch.set_rng_state(rng)  # the strong view: the phase's augmentation from the step's global RNG
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        strong = strong_augment(x.shape[-1])(x, generator)
        for i, net in enumerate(nets):
            helpers = sum(p for j, p in enumerate(probs) if j != i) / (len(nets) - 1)
            loss = consistency_weight * (helpers * (torch.log(helpers) - torch.log_softmax(logits[i], 1))).sum(1).mean()
            confidence, labels = helpers.max(1)
            mask = (confidence > threshold).float()
            confident += int(mask.sum())
            ce = F.cross_entropy(net(strong), labels, reduction="none")
            loss = loss + pseudo_weight * (ce * mask).sum() / len(x)
            loss.backward()
            sgd_step(net.parameters(), PUBLIC_LR)
    assert confident > 0, "no pseudo-label passed the threshold: the oracle would not test that term"
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        assert_states_close(client.client_state(), prefixed(net.state_dict(), "model."), f"FedMatch client {cid}")
