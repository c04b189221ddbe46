"""FCCL+ one-step oracle: the collaboration and the local update of two clients, against plain PyTorch.

Two BatchNorm clients of different initialisations collaborate on two public batches (Huang et
al., TPAMI 2023, Algorithm 1 lines 3-9: each forwards the batch once in train mode, the server
averages the logits ``Z`` and the instance-similarity logits ``S`` over all participants, and
each steps on ``L_FCCM(Z_i, Zbar) + omega L_FISL(S_i, Sbar)``, Eq. 1-6), then each takes two
local steps on ``CE + tau^2 FNTD(z, z_{theta^{e-1}}; tau)`` (Eq. 13-14) with its initial model as
the teacher, which afterwards becomes the snapshot of the trained model. Every parameter and
buffer (the teacher's included) is compared with the oracle to 1e-6.

Where fedhet follows the authors' code (``WenkeHuang/FCCL``, ``fccl+/``), so does the oracle:
the cross-correlation uses the unbiased per-dimension std plus ``1e-5``, off-diagonal target -1
with lambda 0.0051; the similarity temperature is 0.02; ``tau^2`` multiplies FNTD, whose
probabilities are the softmax over all classes with the target entry removed (not renormalised);
the teacher runs in train mode (its BatchNorm statistics move); the collaborative Adam is new for
every public batch (``"fresh_each_step"``) or one per round (``"per_round"``); the local
optimizer is Adam 1e-3 with L2 weight decay 1e-5 (the code) or SGD (the second case).

``head.bias`` takes no part in FCCM in exact arithmetic (standardising each logit column over
the batch removes it) and FISL reads the features, so its collaborative gradient is float32
rounding noise that Adam turns into steps of up to ``lr``; the oracle checks that bound and then
adopts the method's value (the conv bias before BatchNorm is rescaled away instead,
:func:`~tests.algorithms.oracle.scaled_before_batch_norm`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.algorithms.fccl import FCCL
from fedhet.algorithms.fccl_plus import FCCLPlus
from tests.algorithms.oracle import (
    AdamOracle,
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    collaborative_step,
    prefixed,
    scaled_before_batch_norm,
    sgd_step,
    unlabelled_loader,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fccl_plus", "fccl"}

M, CHANNELS, B = 4, 1, 6
TAU, OMEGA, MU_SIM, LAMBDA, EPS = 3.0, 3.0, 0.02, 0.0051, 1e-5
PUBLIC_LR = 1e-3
LOCAL_STEPS = 2

CASES = {
    # the defaults: a fresh collaborative Adam per public batch, local Adam 1e-3 with weight decay 1e-5
    "code_defaults": {},
    # one collaborative Adam per round (its second step reads the first's moments), local SGD
    "per_round_sgd": {"collaborative_optimizer": "per_round", "optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0},
    # FCCM alone (Tab. X's "w/o FISL") and the homogeneous variant: equal-weight average after collaborating
    "no_fisl_averaged": {"use_fisl": False, "average_after_collaboration": True},
}


def make_net(seed: int) -> TinyBNNet:
    """A TinyBNNet with its conv rescaled before the BatchNorm (Adam would amplify the conv bias's noise)."""
    net = TinyBNNet(CHANNELS, M, seed=seed)
    net.load_state_dict(scaled_before_batch_norm(net.state_dict(), [("conv", "bn")]))
    return net


# ---------------------------------------------------------------------- the oracle's losses (from the paper)
def standardize(z: Tensor) -> Tensor:
    """Each logit column z-scored over the batch, unbiased std plus eps (Eq. 1, code form)."""
    return (z - z.mean(0)) / (z.std(0, unbiased=True) + EPS)


def fccm(z: Tensor, zbar: Tensor) -> Tensor:
    """``sum_u (1 - M_uu)^2 + lambda sum_{u!=v} (M_uv + 1)^2``, ``M = Phi(Z)^T Phi(Zbar) / B`` (Eq. 1-2)."""
    matrix = standardize(z).t() @ standardize(zbar) / z.shape[0]
    eye = torch.eye(matrix.shape[0], dtype=torch.bool)
    return ((1 - matrix.diagonal()) ** 2).sum() + LAMBDA * ((matrix[~eye] + 1) ** 2).sum()


def similarity_logits(h: Tensor) -> Tensor:
    """Cosine similarities over mu, each row without its own image: ``[B, B-1]`` (Eq. 3-4)."""
    unit = h / h.norm(dim=1, keepdim=True)
    s = unit @ unit.t() / MU_SIM
    rows = [torch.cat([s[i, :i], s[i, i + 1 :]]) for i in range(s.shape[0])]
    return torch.stack(rows)


def fisl(s: Tensor, sbar: Tensor) -> Tensor:
    """``KL(softmax(Sbar) || softmax(S))``, summed per row, averaged over the batch (Eq. 5)."""
    p_bar = torch.softmax(sbar, 1)
    return (p_bar * (torch.log(p_bar) - torch.log_softmax(s, 1))).sum(1).mean()


def fntd(student: Tensor, teacher: Tensor, y: Tensor) -> Tensor:
    """``tau^2 sum_{u != y} p_T^u log(p_T^u / p_S^u)`` over the batch mean, softmax over all classes (Eq. 13)."""
    p_t = torch.softmax(teacher / TAU, 1)
    log_p_s = torch.log_softmax(student / TAU, 1)
    non_target = 1.0 - F.one_hot(y, M).float()
    return TAU**2 * (non_target * p_t * (torch.log(p_t) - log_p_s)).sum(1).mean()


# ---------------------------------------------------------------------- the oracle's steps
def oracle_collaboration(nets: list, public: list[Tensor], per_round: bool, omega: float = OMEGA) -> None:
    """Algorithm 1 lines 3-9 on ``nets`` in place: one step per public batch, every net on the same batch."""
    adams = [AdamOracle(net.parameters(), PUBLIC_LR) for net in nets]
    for x in public:
        if not per_round:
            adams = [AdamOracle(net.parameters(), PUBLIC_LR) for net in nets]
        outputs = []
        for net in nets:
            net.train()
            h = net.forward_features(x)
            outputs.append((net.forward_head(h), similarity_logits(h)))
        zbar = torch.stack([z.detach() for z, _ in outputs]).mean(0)
        sbar = torch.stack([s.detach() for _, s in outputs]).mean(0)
        for (z, s), adam in zip(outputs, adams, strict=True):
            (fccm(z, zbar) + omega * fisl(s, sbar)).backward()
            adam.step()


def oracle_local(net, teacher, data, hp: dict) -> None:
    """``LOCAL_STEPS`` steps of ``CE + FNTD`` (Eq. 14) with the teacher in train mode; then teacher <- net."""
    x, y = data
    adam = AdamOracle(net.parameters(), 1e-3, weight_decay=1e-5) if "optimizer" not in hp else None
    for _ in range(LOCAL_STEPS):
        net.train()
        teacher.train()
        logits = net(x)
        with torch.no_grad():
            teacher_logits = teacher(x)
        (F.cross_entropy(logits, y) + fntd(logits, teacher_logits, y)).backward()
        if adam is not None:
            adam.step()
        else:
            sgd_step(net.parameters(), hp["lr"])
    teacher.load_state_dict(net.state_dict())


@pytest.mark.parametrize("case", sorted(CASES))
def test_fccl_plus_matches_the_oracle(case):
    """Collaboration (two public batches) then two local steps of two clients, every entry to 1e-6."""
    hp = CASES[case]
    algorithm = FCCLPlus(**hp)
    clients = [algorithm.build_client(make_net(10 + cid), M) for cid in range(2)]
    initial = [clone(client.client_state()) for client in clients]
    public = [batch(50 + i, size=B)[0] for i in range(2)]

    # --- the collaborative phase
    collaborative_step(algorithm, clients, unlabelled_loader(public))
    nets = [make_net(10 + cid) for cid in range(2)]
    teachers = [copy.deepcopy(net).requires_grad_(False) for net in nets]
    omega = OMEGA if hp.get("use_fisl", True) else 0.0
    oracle_collaboration(nets, public, per_round=hp.get("collaborative_optimizer") == "per_round", omega=omega)
    averaged = hp.get("average_after_collaboration", False)
    if averaged:  # every model takes the equal-weight mean (integer buffers rounded); the teachers stay
        states = [net.state_dict() for net in nets]
        mean = {k: torch.stack([st[k].double() for st in states]).mean(0) for k in states[0]}
        for net in nets:
            net.load_state_dict({k: v.round().to(states[0][k].dtype) if not states[0][k].is_floating_point()
                                 else v.to(states[0][k].dtype) for k, v in mean.items()})
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        got = client.client_state()
        assert_moved(initial[cid], got, f"client {cid} collaboration")
        # zero gradient in exact arithmetic (the head's bias; the conv's bias, which the BatchNorm after it
        # removes): Adam turns the rounding noise into steps of up to lr whose sign depends on the CPU's kernels
        # (1.5e-5 apart on an AVX-512 machine), so each is bounded by one step per batch, then adopted
        for key, parameter in (("model.head.bias", net.head.bias), ("model.conv.bias", net.conv.bias)):
            if not averaged:
                assert (got[key] - initial[cid][key]).abs().max() <= len(public) * PUBLIC_LR * 1.001, key
            with torch.no_grad():
                parameter.copy_(got[key])
        expected = {**prefixed(net.state_dict(), "model."), **prefixed(teachers[cid].state_dict(), "previous_model.")}
        assert_states_close(got, expected, f"client {cid} after collaborating")

    # --- the local update (the teacher theta^{e-1} is the initial model in round 0)
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        before = clone(client.client_state())
        client_step(client, None, batch(cid), epochs=LOCAL_STEPS, upload=False)
        oracle_local(net, teachers[cid], batch(cid), hp)
        got = client.client_state()
        assert_moved(before, got, f"client {cid} local update")
        expected = {**prefixed(net.state_dict(), "model."), **prefixed(teachers[cid].state_dict(), "previous_model.")}
        assert_states_close(got, expected, f"client {cid} after the local update")


# ---------------------------------------------------------------------- FCCL (CVPR 2022), the same collaboration
def kl_from(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """``KL(softmax(teacher) || softmax(student))`` at temperature 1, batch mean (FCCL+ Eq. 19)."""
    p = torch.softmax(teacher_logits, 1)
    return (p * (torch.log(p) - torch.log_softmax(student_logits, 1))).sum(1).mean()


def test_fccl_matches_the_oracle():
    """Pretraining (one Adam CE step), FCCM-only collaboration, then two local rounds of CE + both KLs."""
    algorithm = FCCL(pretrain_epochs=1)
    clients = [algorithm.build_client(make_net(10 + cid), M) for cid in range(2)]
    nets = [make_net(10 + cid) for cid in range(2)]
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        client_step(client, None, batch(cid), phase="pretrain", upload=False)
        adam = AdamOracle(net.parameters(), 1e-3)  # pretraining: Adam 1e-3, no weight decay
        net.train()
        F.cross_entropy(net(batch(cid)[0]), batch(cid)[1]).backward()
        adam.step()
    previous = [copy.deepcopy(net).requires_grad_(False) for net in nets]
    pretrained = [copy.deepcopy(net).requires_grad_(False) for net in nets]

    def expected(cid: int) -> dict:
        return {
            **prefixed(nets[cid].state_dict(), "model."),
            **prefixed(previous[cid].state_dict(), "previous_model."),
            **prefixed(pretrained[cid].state_dict(), "pretrained_model."),
            "pretrained": torch.tensor(True),
        }

    for cid, client in enumerate(clients):
        assert_states_close(client.client_state(), expected(cid), f"FCCL client {cid} after pretraining")

    public = [batch(50 + i, size=B)[0] for i in range(2)]
    collaborative_step(algorithm, clients, unlabelled_loader(public), round_idx=0)
    adams = None
    for x in public:  # FCCM only, a fresh Adam per batch
        adams = [AdamOracle(net.parameters(), PUBLIC_LR) for net in nets]
        for net in nets:
            net.train()
        logits = [net(x) for net in nets]
        zbar = torch.stack([z.detach() for z in logits]).mean(0)
        for z, adam in zip(logits, adams, strict=True):
            fccm(z, zbar).backward()
            adam.step()
    for cid, (client, net) in enumerate(zip(clients, nets, strict=True)):
        with torch.no_grad():  # head.bias: no FCCM gradient in exact arithmetic (see the module docstring)
            net.head.bias.copy_(client.client_state()["model.head.bias"])
        assert_states_close(client.client_state(), expected(cid), f"FCCL client {cid} after collaborating")

    for round_idx in range(2):  # round 1: the previous-round teacher differs from the pre-trained one
        x, y = batch(round_idx)
        client_step(clients[0], None, (x, y), round_idx=round_idx, epochs=LOCAL_STEPS, upload=False)
        adam = AdamOracle(nets[0].parameters(), 1e-3, weight_decay=1e-5)
        for _ in range(LOCAL_STEPS):
            for module in (nets[0], previous[0], pretrained[0]):
                module.train()  # the teachers in train mode, as the code
            logits = nets[0](x)
            with torch.no_grad():
                prev_logits, pre_logits = previous[0](x), pretrained[0](x)
            (F.cross_entropy(logits, y) + kl_from(prev_logits, logits) + kl_from(pre_logits, logits)).backward()
            adam.step()
        previous[0].load_state_dict(nets[0].state_dict())
        assert_states_close(clients[0].client_state(), expected(0), f"FCCL client 0 after local round {round_idx}")
