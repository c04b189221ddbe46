"""One-step oracles of the lock-step public-data distillation methods FedMD and FedDF, against plain PyTorch.

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
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import FedDF, FedMD
from tests.algorithms.oracle import (
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    collaborative_step,
    prefixed,
    sgd_step,
    unlabelled_loader,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedmd", "feddf"}

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
