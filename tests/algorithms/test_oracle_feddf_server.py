"""FedDF (paper form, ``feddf_server``) one-step oracle: client steps and a distilling server round.

Lin, Kong, Stich & Jaggi, NeurIPS 2020, Algorithm 1 (heterogeneous form, Section 4): three
BatchNorm clients of two architectures (``a``, ``a``, ``b``; two initialisations of one network)
each run one local SGD step of the base method (FedAvg) from the downloaded model of their
architecture; the server averages the uploads within each architecture (``sum_k n_k / n w_k``,
running statistics included), then distils every architecture's average for ``S`` steps on
unlabeled public batches towards the mean logits of *all* the models just received:

    L = sum_students T^2 KL(softmax(mean_k z_k / T) || softmax(z_student / T))  (batch mean)

with Adam (a fresh optimizer each round) whose rate is cosine-annealed over the round's steps,
``lr_t = lr (1 + cos(pi t / S)) / 2``. The teachers run in eval mode, the students in train mode
(``student_bn="train"``, the paper's code); fedhet's ``student_bn`` knob (documented in
``fedhet/algorithms/feddf_server.py`` and ``docs/feddf_server.md``, not in the paper) runs them
with their BatchNorm in eval mode (``"frozen"``) or puts the clients' averaged running statistics
back after the distillation (``"restore"``). Every parameter and buffer of the clients, the
uploads and both architectures' downloads, and the round's ``distill_loss`` metric (the only place
the ``T^2`` factor shows: Adam's step is invariant to a constant loss scale), are compared with the
plain-PyTorch oracle below to 1e-6.

Settings that make a wrong choice visible: ``T = 2`` (a temperature applied on one side only moves
the students), example counts 6 / 4 / 8 (uniform averaging differs), two architectures (an ensemble
of only the student's own architecture differs), three steps (the cosine schedule's second and third
rates differ from the first).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms import FedAvg, FedDFServer
from fedhet.algorithms.base import ClientUpload, ServerContext
from tests.algorithms.oracle import (
    AdamOracle,
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
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
ORACLE_COVERS = {"feddf_server"}

M, CHANNELS = 4, 1
ARCHITECTURES = ("a", "a", "b")
EXAMPLES = (6, 4, 8)  # each client's batch size, hence its num_examples (FedAvg's weights)
LOCAL_LR = 0.1
STEPS, DISTILL_LR, T = 3, 0.01, 2.0
PUBLIC = [batch(50 + i, size=5)[0] for i in range(STEPS)]  # one unlabeled public batch per step
INIT_SEED = {"a": 100, "b": 200}


def initial_state(architecture: str) -> dict[str, torch.Tensor]:
    """The architecture's initial network, its conv (before the BatchNorm) rescaled.

    The same function (see :func:`scaled_before_batch_norm`): it keeps the conv bias's float32
    rounding-noise gradient in train-mode BatchNorm far below Adam's ``eps``.
    """
    net = TinyBNNet(CHANNELS, M, seed=INIT_SEED[architecture])
    return scaled_before_batch_norm(net.state_dict(), [("conv", "bn")])


def make_context() -> ServerContext:
    """Three clients of architectures a, a, b, their initial states, the network factory, the public batches."""
    x = torch.cat(PUBLIC)
    public = DataLoader(TensorDataset(x, torch.full((len(x),), -1)), batch_size=len(PUBLIC[0]), shuffle=False)
    return ServerContext(
        num_clients=3,
        num_classes=M,
        architectures=ARCHITECTURES,
        seed=5,
        initial_client_state=lambda cid: prefixed(initial_state(ARCHITECTURES[cid]), "model."),
        model_factory=lambda architecture, seed: TinyBNNet(CHANNELS, M, seed=seed),
        public_loader=lambda seed: public,
    )


def net_from(state: dict[str, torch.Tensor]) -> TinyBNNet:
    """A TinyBNNet holding ``state``."""
    net = TinyBNNet(CHANNELS, M)
    net.load_state_dict(state)
    return net


# ---------------------------------------------------------------------- the oracle
def oracle_client(download: dict[str, torch.Tensor], data) -> dict[str, torch.Tensor]:
    """FedAvg's local step (McMahan et al.): the download, train mode, one SGD step of cross-entropy."""
    x, y = data
    net = net_from(download).train()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    sgd_step(net.parameters(), LOCAL_LR)
    return clone(net.state_dict())


def kl_t2(student: torch.Tensor, ensemble: torch.Tensor) -> torch.Tensor:
    """``T^2 mean_j sum_c p_c (log p_c - log q_c)``, ``p = softmax(ens / T)``, ``q = softmax(z / T)``."""
    p = torch.softmax(ensemble / T, 1)
    return T**2 * (p * (torch.log(p) - torch.log_softmax(student / T, 1))).sum(1).mean()


def oracle_distill(averages: dict[str, dict], teachers: list[dict], student_bn: str) -> tuple[dict, float]:
    """Algorithm 1's server distillation: the distilled state per architecture and the mean summed loss."""
    models = [net_from(s).eval() for s in teachers]
    students = {arch: net_from(state) for arch, state in averages.items()}
    params = [p for arch in sorted(students) for p in students[arch].parameters()]
    adam = AdamOracle(params, DISTILL_LR)
    losses = []
    for t, x in enumerate(PUBLIC):
        with torch.no_grad():
            ensemble = sum(model(x) for model in models) / len(models)  # mean logits of every upload
        total = 0.0
        for student in students.values():
            student.train()
            if student_bn == "frozen":
                student.bn.eval()
            total = total + kl_t2(student(x), ensemble)
        total.backward()
        losses.append(float(total.detach()))
        adam.lr = DISTILL_LR * (1 + math.cos(math.pi * t / STEPS)) / 2  # cosine annealing to 0 over S steps
        adam.step()
    distilled = {arch: clone(student.state_dict()) for arch, student in students.items()}
    if student_bn == "restore":  # the clients' averaged running statistics put back
        for arch, state in distilled.items():
            for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
                state[key] = averages[arch][key].clone()
    return distilled, sum(losses) / len(losses)


# ---------------------------------------------------------------------- the test
@pytest.mark.parametrize("student_bn", ["train", "frozen", "restore"])
def test_feddf_server_matches_the_oracle(student_bn):
    """One round: the clients' FedAvg steps, per-architecture averaging, S distillation steps; then the downloads."""
    algorithm = FedDFServer(
        base=FedAvg(optimizer="sgd", lr=LOCAL_LR, momentum=0.0, weight_decay=0.0),
        distill_steps=STEPS,
        distill_lr=DISTILL_LR,
        temperature=T,
        student_bn=student_bn,
    )
    server = algorithm.build_server()
    server.setup_server(make_context())

    uploads, expected_uploads = [], []
    for cid, architecture in enumerate(ARCHITECTURES):
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        download = server.download_for(cid)
        assert_states_close(download.weights, initial_state(architecture), f"client {cid} initial download")
        data = batch(cid, size=EXAMPLES[cid])
        payload = client_step(module, download, data)
        expected = oracle_client(initial_state(architecture), data)
        assert_states_close(module.client_state(), prefixed(expected, "model."), f"client {cid} after its step")
        assert_states_close(payload.weights, expected, f"client {cid} upload")
        assert payload.num_examples == EXAMPLES[cid]
        uploads.append(ClientUpload(cid, architecture, payload))
        expected_uploads.append(expected)

    server_step(server, 0, uploads)
    averages = {
        "a": example_weighted_mean(expected_uploads[:2], EXAMPLES[:2]),
        "b": example_weighted_mean(expected_uploads[2:], EXAMPLES[2:]),
    }
    distilled, mean_loss = oracle_distill(averages, expected_uploads, student_bn)
    for cid, architecture in ((0, "a"), (2, "b")):
        got = server.download_for(cid).weights
        assert_moved(averages[architecture], got, f"architecture {architecture}'s distillation")
        # the rescaled conv's BatchNorm variance is ~1e6: compared relative to its size (float32 ulp)
        assert_states_close(got, distilled[architecture], f"architecture {architecture}'s download", rtol=1e-6)
        if student_bn != "train":  # the knob's promise: the clients' statistics leave the distillation unchanged
            for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
                assert torch.equal(got[key], averages[architecture][key]), key
    got_loss = server.metrics()["distill_loss"]
    # float32 sums in another order: 1.3e-5 apart on an AVX-512 machine; a wrong weight or term is far outside
    assert got_loss == pytest.approx(mean_loss, rel=1e-4), f"distill_loss {got_loss} != {mean_loss}"

    # the next round starts from the distilled model of the client's own architecture
    module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10), M)
    data = batch(7, size=EXAMPLES[0])
    client_step(module, server.download_for(0), data, round_idx=1)
    expected = oracle_client(copy.deepcopy(distilled["a"]), data)
    assert_states_close(module.client_state(), prefixed(expected, "model."), "client 0 in the next round", rtol=1e-6)
    assert set(without_prefix(module.client_state(), "model.")) == set(expected)
