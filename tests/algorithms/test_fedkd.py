"""FedKD: hand-computed adaptive mutual distillation, server averaging of updates, SVD-compressed payloads."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fedkd import FedKD, FedKDClient, FedKDServer, SVDStatePayload
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import TrainingError
from fedhet.federation import FederationLoop
from fedhet.models import create_model
from tests.algorithms.helpers import TinyLinear, context, upload
from tests.algorithms.test_fml import shared_state
from tests.conftest import tiny_label_skew

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def _loop(algorithm, cpu_trainer, rounds=1):
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(algorithm, scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], cpu_trainer, rounds=rounds, seed=0)


def _client(**kwargs) -> FedKDClient:
    """Teacher logits [1, 0], student logits [0, 1] on x = [1, 0]; W_h = 2 I maps student features [1, 0] to [2, 0]."""
    client = FedKDClient(TinyLinear(), 2, student=TinyLinear(head=SWAP), **kwargs)
    with torch.no_grad():
        client.hidden_map.weight.copy_(2 * torch.eye(2))
    return client


def test_fedkd_adaptive_mutual_distillation_loss_by_hand():
    """CE_t + CE_s + w (KL_ts + KL_st + 2 MSE(H_t, W_h H_s)) with w = 1 / (CE_t + CE_s)."""
    client = _client()
    ce_t, ce_s = math.log1p(math.exp(-1.0)), math.log1p(math.e)
    weight = 1.0 / (ce_t + ce_s)
    s = math.e / (1 + math.e)
    kl = 2 * s - 1  # KL((s, 1-s) || (1-s, s)) = (2s - 1) log(s / (1 - s)) and log(s / (1 - s)) = 1
    mse = ((1.0 - 2.0) ** 2 + 0.0) / 2  # H_t = [1, 0], W_h H_s = [2, 0]
    expected = ce_t + ce_s + weight * (2 * kl + 2 * mse)
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_fedkd_weight_is_a_constant_and_each_side_learns_from_a_detached_peer():
    """The teacher's head gradient is (1 + w KL-side) of its own terms only, with w treated as a constant."""
    client = _client()
    client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0]))).backward()
    # teacher logits z = [1, 0], p_t = (s, 1 - s), p_s = (1 - s, s): d/dz [CE_t + w KL(p_s || p_t)]
    # = (p_t - onehot) + w (p_t - p_s); the hidden term reaches the body, not the head
    s = math.e / (1 + math.e)
    weight = 1.0 / (math.log1p(math.exp(-1.0)) + math.log1p(math.e))
    d_logits = torch.tensor([s - 1, 1 - s]) + weight * torch.tensor([2 * s - 1, 1 - 2 * s])
    expected = torch.outer(d_logits, torch.tensor([1.0, 0.0]))
    assert torch.allclose(client.model.head.weight.grad, expected, atol=1e-6)


def test_fedkd_server_adds_the_mean_decompressed_update_by_hand():
    """Global student += uniform mean of the uploaded updates (or example-weighted); energy = the largest sent."""
    initial = {
        "student.w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "student.b": torch.tensor([1.0, 1.0]),
        "model.x": torch.zeros(1),
    }
    first = {"w": torch.ones(2, 2), "b": torch.tensor([2.0, 0.0])}
    second = {"w": torch.full((2, 2), -3.0), "b": torch.tensor([0.0, 4.0])}
    updates = [
        SVDStatePayload(dense=first, energy=0.9, num_examples=30),
        SVDStatePayload(dense=second, energy=0.95, num_examples=10),
    ]
    server = FedKDServer(compressed_quantity="update", student_weighting="uniform")
    server.setup_server(context(initial=initial))
    assert server.download_for(0) is None
    server.aggregate(0, [upload(0, updates[0]), upload(1, updates[1])])
    # uniform mean update: w -1, b [1, 2]
    assert torch.allclose(server.global_student["w"], torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    assert torch.allclose(server.global_student["b"], torch.tensor([2.0, 3.0]))
    assert server.energy == 0.95 and server.metrics() == {"energy": 0.95}
    # a 2 x 2 matrix never compresses (k * (2 + 2 + 1) >= 4): the download is the dense student
    assert torch.equal(server.download_for(1).decompressed(server.global_student)["w"], server.global_student["w"])
    weighted = FedKDServer(compressed_quantity="update", student_weighting="samples")
    weighted.setup_server(context(initial=initial))
    weighted.aggregate(0, [upload(0, updates[0]), upload(1, updates[1])])
    assert torch.allclose(weighted.global_student["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # 0.75 - 0.75 = 0
    weights = FedKDServer(compressed_quantity="weights")
    weights.setup_server(context(initial=initial))
    weights.aggregate(0, [upload(0, updates[0]), upload(1, updates[1])])
    assert torch.allclose(weights.global_student["w"], -torch.ones(2, 2))  # the mean weights replace the student


def test_fedkd_upload_is_the_round_update_of_the_student():
    """With ``compressed_quantity="update"`` the upload is S_end - S_start; an unchanged matrix is sent as rank 0."""
    client = _client(compressed_quantity="update")
    client.on_receive(None)
    with torch.no_grad():
        client.student.head.weight.add_(torch.tensor([[0.5, 0.0], [0.0, -1.0]]))
    sent = client.make_upload([])
    assert torch.allclose(sent.dense["head.weight"], torch.tensor([[0.5, 0.0], [0.0, -1.0]]))
    assert sent.low_rank["body.weight"]["s"].numel() == 0  # nothing moved: no factor at all
    assert torch.equal(sent.decompressed(client.student.state_dict())["body.weight"], torch.zeros(2, 2))


def test_fedkd_shared_model_identical_across_clients_after_download(cpu_trainer):
    """Local training moves the clients' students apart; the download puts them all on the same student."""
    loop = _loop(FedKD(student_model="mlp_tiny", lr=0.05, student_lr=0.05), cpu_trainer)
    loop.run()
    trained = [shared_state(loop, c, "student.", receive=False) for c in range(3)]
    assert any(not torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    received = [shared_state(loop, c, "student.", receive=True) for c in range(3)]
    for other in received[1:]:
        assert other.keys() == received[0].keys()
        assert all(torch.equal(other[k], received[0][k]) for k in other)


def test_fedkd_upload_counts_compressed_factor_sizes():
    """A rank-1 update of each matrix is sent as rank-1 factors: 225 + 43 floats plus 42 dense bias floats."""
    student = create_model("mlp_tiny", num_classes=10, seed=0)  # fc.0 [32, 192], head [10, 32]
    client = FedKDClient(create_model("cnn_tiny", num_classes=10, seed=1), 10, student, t_start=0.95, t_end=0.95)
    client.on_receive(None)
    with torch.no_grad():  # a rank-1 update of each matrix, biases unchanged
        student.fc[0].weight += torch.outer(torch.ones(32), torch.linspace(-1, 1, 192))
        student.head.weight += torch.outer(torch.arange(10.0), torch.ones(32))
    sent = client.make_upload([])
    assert set(sent.low_rank) == {"fc.0.weight", "head.weight"}
    assert all(f["s"].numel() == 1 for f in sent.low_rank.values())
    # rank 1: 1*(32+192+1) = 225 and 1*(10+32+1) = 43 floats; dense biases 32 + 10 floats
    assert sent.nbytes() == (225 + 43 + 32 + 10) * 4
    full = sum(p.numel() for p in student.parameters()) * 4
    assert sent.nbytes() < full
    rebuilt = sent.decompressed(student.state_dict())
    assert torch.allclose(rebuilt["head.weight"], torch.outer(torch.arange(10.0), torch.ones(32)), atol=1e-4)


def test_fedkd_round_uploads_less_than_the_dense_student(cpu_trainer):
    """At energy 0.5 a real round uploads fewer bytes than three dense students."""
    loop = _loop(FedKD(student_model="mlp_tiny", t_start=0.5, t_end=0.5), cpu_trainer)
    summary = loop.run()
    dense = sum(v.numel() * v.element_size() for v in loop.server.global_student.values())
    assert 0 < summary["comm"]["bytes_up"] < 3 * dense


def test_fedkd_server_rejects_malformed_factors(cpu_trainer):
    """Dense entries of the wrong shape and factors that cannot rebuild the matrix are refused."""
    loop = _loop(FedKD(student_model="mlp_tiny"), cpu_trainer)
    reference = loop.server.global_student
    good = {k: torch.zeros_like(v) for k, v in reference.items()}
    payload = SVDStatePayload(dense=good, num_examples=1)
    loop.server.aggregate(0, [upload(0, payload)])  # accepted
    bad = dict(good)
    bad["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(TrainingError, match="shape"):
        loop.server.check_upload(upload(0, SVDStatePayload(dense=bad, num_examples=1)))
    factors = {"u": torch.zeros(10, 2), "s": torch.zeros(2), "v": torch.zeros(3, 32)}
    rest = {k: v for k, v in good.items() if k != "head.weight"}
    low = SVDStatePayload(low_rank={"head.weight": factors}, dense=rest)
    with pytest.raises(TrainingError, match="low_rank.head.weight.v"):
        loop.server.check_upload(upload(0, low))


REFERENCE = {
    "conv": torch.zeros(4, 1, 3),  # a matrix of 4 rows and 3 columns once flattened
    "bias": torch.zeros(4),
    "count": torch.tensor(0),
}


def _factors(rank=2, rows=4, cols=3, dtype=torch.float32):
    return {
        "u": torch.zeros(rows, rank, dtype=dtype),
        "s": torch.ones(rank, dtype=dtype),
        "v": torch.zeros(rank, cols, dtype=dtype),
    }


def _refusal(payload) -> str:
    server = FedKDServer()
    server.setup_server(context(initial={f"student.{k}": v for k, v in REFERENCE.items()}))
    with pytest.raises(TrainingError) as error:
        server.check_upload(upload(1, payload))
    return str(error.value)


def _sent(low_rank=None, **dense):
    entries = {"bias": torch.zeros(4), "count": torch.tensor(0), **dense}
    return SVDStatePayload(low_rank={"conv": _factors()} if low_rank is None else low_rank, dense=entries)


def test_fedkd_server_accepts_factors_up_to_full_rank_of_the_flattened_matrix():
    """A [4, 1, 3] tensor is a 4 x 3 matrix: ranks 1 to 3 are accepted, with the factors of those shapes."""
    server = FedKDServer()
    server.setup_server(context(num_clients=1, initial=lambda cid: {f"student.{k}": v for k, v in REFERENCE.items()}
                                if cid == 0 else {}))  # fmt: skip
    assert set(server.global_student) == set(REFERENCE)  # read from client 0's initial state
    for rank in (1, 3):
        server.check_upload(upload(1, _sent({"conv": _factors(rank)})))


def test_fedkd_server_refuses_entries_that_differ_from_the_global_student():
    """Missing, unexpected and doubly-sent entries are named (three of each at most)."""
    message = "client 1 sent a compressed student whose entries differ from the global student"
    assert _refusal(SVDStatePayload()) == f"{message} (missing ['bias', 'conv', 'count'], unexpected [])"
    wide = FedKDServer()
    wide.setup_server(context(initial={f"student.{k}": torch.zeros(1) for k in "abcde"}))
    with pytest.raises(TrainingError) as error:
        wide.check_upload(upload(1, SVDStatePayload()))
    assert str(error.value) == f"{message} (missing ['a', 'b', 'c'], unexpected [])"
    extra = {name: torch.zeros(1) for name in ("p", "q", "r", "s")}
    assert _refusal(_sent(**extra)) == f"{message} (missing [], unexpected ['p', 'q', 'r'])"
    twice = SVDStatePayload(low_rank={"conv": _factors()}, dense=dict(REFERENCE))
    assert _refusal(twice) == f"{message} (missing [], unexpected [])"


@pytest.mark.parametrize("energy", [0.0, 1.5, "0.5"])
def test_fedkd_server_refuses_an_energy_outside_the_unit_interval(energy):
    """The threshold the download reuses must be a number in (0, 1]."""
    payload = SVDStatePayload(low_rank={"conv": _factors()}, dense=_sent().dense, energy=energy)
    assert _refusal(payload) == f"client 1 sent an SVD energy of {energy!r}, expected a number in (0, 1]"


def test_fedkd_server_names_each_malformed_tensor():
    """Dense entries and each factor are checked for shape and dtype against the global student, by name."""
    dtype_message = "where the global student holds torch.float32; clients must send tensors in the server's dtype"
    assert _refusal(_sent(bias=torch.zeros(4, dtype=torch.float64))).startswith(
        f"client 1 sent 'dense.bias' as torch.float64 {dtype_message}"
    )
    assert _refusal(_sent(bias=torch.zeros(5))).startswith("client 1 sent 'dense.bias' of shape (5,), expected (4,)")
    for factor in ("u", "s", "v"):
        factors = _factors()
        factors[factor] = factors[factor].double()
        assert _refusal(_sent({"conv": factors})).startswith(
            f"client 1 sent 'low_rank.conv.{factor}' as torch.float64 {dtype_message}"
        ), factor
    factors = _factors()
    factors["v"] = torch.zeros(2, 4)
    assert _refusal(_sent({"conv": factors})).startswith(
        "client 1 sent 'low_rank.conv.v' of shape (2, 4), expected (2, 3)"
    )


def test_fedkd_server_refuses_factors_it_cannot_rebuild():
    """Factors of a dense entry, without exactly u, s and v, or of an impossible rank are refused by name."""
    dense = {"conv": torch.zeros(4, 1, 3), "count": torch.tensor(0)}
    vector = SVDStatePayload(low_rank={"bias": _factors(rows=4, cols=1)}, dense=dense)
    assert _refusal(vector) == "client 1 sent SVD factors of 'bias', which the global student holds dense"
    counter = SVDStatePayload(
        low_rank={"count": _factors()}, dense={"conv": torch.zeros(4, 1, 3), "bias": torch.zeros(4)}
    )
    assert _refusal(counter) == "client 1 sent SVD factors of 'count', which the global student holds dense"
    without_v = {k: v for k, v in _factors().items() if k != "v"}
    assert _refusal(_sent({"conv": without_v})) == "client 1 sent factors of 'conv' without exactly u, s and v"
    for s, shape in ((torch.ones(1, 1), "(1, 1)"), (torch.ones(4), "(4,)"), (torch.ones(0), "(0,)"), ([1.0], "()")):
        factors = {**_factors(), "s": s}
        assert _refusal(_sent({"conv": factors})) == (
            f"client 1 sent 'low_rank.conv.s' of shape {shape}, expected a rank between 1 and 3"
        )
    wrong = WeightsPayload(weights=dict(REFERENCE))
    assert _refusal(wrong) == "client 1 sent WeightsPayload, expected a compressed student (SVDStatePayload)"


def test_fedkd_server_state_restores_the_student_the_energy_and_the_download():
    """Before any upload: no download and energy 1 (nothing compressed); after one, a fresh server resumes it."""
    initial = {"student.w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "student.n": torch.tensor(5)}
    server = FedKDServer()
    server.setup_server(context(initial=initial))
    assert server.metrics() == {"energy": 1.0}
    fresh = FedKDServer()
    fresh.setup_server(context(initial=initial))
    fresh.load_server_state(server.server_state())
    assert fresh.download_for(0) is None
    sent = [
        SVDStatePayload(dense={"w": torch.ones(2, 2), "n": torch.tensor(n)}, energy=energy, num_examples=3)
        for n, energy in ((7, 0.9), (9, 0.8))
    ]
    server.aggregate(0, [upload(0, sent[0]), upload(1, sent[1])])
    assert server.global_student["n"].item() == 8  # counters travel as values: their mean, not 5 + 8
    restored = FedKDServer()
    restored.load_server_state(server.server_state())
    assert restored.metrics() == {"energy": 0.9}
    assert all(torch.equal(restored.global_student[k], server.global_student[k]) for k in ("w", "n"))
    download, original = restored.download_for(1), server.download_for(1)
    assert download.energy == original.energy == 0.9
    assert all(torch.equal(download.dense[k], original.dense[k]) for k in original.dense)
    assert all(
        torch.equal(download.low_rank[k][f], original.low_rank[k][f])
        for k in original.low_rank
        for f in ("u", "s", "v")
    )


def test_fedkd_upload_sends_counters_as_values_and_floats_as_updates():
    """``num_batches_tracked`` travels as its value; the weights as their change since the download."""
    client = FedKDClient(TinyLinear(), 2, student=TinyLinear(head=SWAP), student_lr=0.5)
    assert client.num_classes == 2 and client.hp.student_lr == 0.5
    client.student.register_buffer("steps", torch.tensor(4))
    client.on_receive(None)
    with torch.no_grad():
        client.student.head.weight.add_(1.0)
        client.student.steps.add_(3)
    sent = client.make_upload([])
    assert sent.dense["steps"].item() == 7
    assert torch.equal(sent.dense["head.weight"], torch.ones(2, 2))


def test_fedkd_students_follow_the_shared_seed_and_know_the_class_count():
    """Every client's student is drawn from ``shared_init_seed``; another seed, another student."""

    def student(seed):
        client = FedKD(student_model="mlp_tiny", shared_init_seed=seed).build_client(
            create_model("cnn_tiny", num_classes=3), 3
        )
        assert client.num_classes == 3
        return client.student.state_dict()

    a, b, c = student(0), student(0), student(1)
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
