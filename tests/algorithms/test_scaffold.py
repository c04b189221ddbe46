"""SCAFFOLD (Karimireddy et al., ICML 2020, Alg. 1, option II): corrected steps, c_i, server x and c.

The corrected local step and option II's ``c_i`` update are checked by hand through the lean
Trainer the runtime builds (the correction is a Lightning hook); the server's ``x`` and ``c``
with a global step size and partial participation by hand; ``c = (1/N) sum_i c_i`` in a run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.scaffold import SCAFFOLD, ScaffoldClient, ScaffoldPayload, ScaffoldServer
from fedhet.errors import ConfigError, TrainingError
from tests.algorithms.helpers import TinyLinear, context, fit, label_skew_run, one_batch_loader, upload

X, Y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
S = 0.268941  # 1 - sigmoid(1): logits [1, 0] for class 0 give p - e0 = [-S, S]
IDENTITY = {"body.weight": torch.eye(2), "head.weight": torch.eye(2)}
C_SERVER = {"body.weight": torch.zeros(2, 2), "head.weight": torch.tensor([[0.1, 0.0], [0.0, 0.2]])}
C_CLIENT = {
    "body.weight": torch.tensor([[0.5, 0.0], [0.0, 0.0]]),
    "head.weight": torch.tensor([[0.0, 0.0], [0.0, -0.3]]),
}


def _client(lr: float = 0.1) -> ScaffoldClient:
    """A client with c_i = C_CLIENT that received x = identity and c = C_SERVER."""
    client = ScaffoldClient(TinyLinear(), num_classes=2, lr=lr)
    with torch.no_grad():
        for name, value in C_CLIENT.items():
            client.control_variate.get_buffer(name).copy_(value)
    client.on_receive(ScaffoldPayload(weights=IDENTITY, control=C_SERVER))
    return client


def test_scaffold_corrected_step_by_hand():
    """One step: y = x - eta (g + c - c_i), the correction applied in the Trainer's step (eta = 0.1)."""
    client = _client()
    fit(client, one_batch_loader(X, Y))
    # g = [[-S, 0], [S, 0]] for both weights; head c - c_i = [[0.1, 0], [0, 0.5]], body [[-0.5, 0], [0, 0]]
    head = torch.eye(2) - 0.1 * torch.tensor([[-S + 0.1, 0.0], [S, 0.5]])  # [[1.016894, 0], [-0.026894, 0.95]]
    body = torch.eye(2) - 0.1 * torch.tensor([[-S - 0.5, 0.0], [S, 0.0]])  # [[1.076894, 0], [-0.026894, 1]]
    assert torch.allclose(client.model.head.weight, head, atol=1e-6)
    assert torch.allclose(client.model.body.weight, body, atol=1e-6)


def test_scaffold_option_two_after_one_step_is_the_local_gradient_and_is_uploaded():
    """K = 1: c_i+ = c_i - c + (x - y)/eta = g(x); the upload carries y and Delta c_i = g(x) - c_i (2x the model)."""
    client = _client()
    fit(client, one_batch_loader(X, Y))
    g = torch.tensor([[-S, 0.0], [S, 0.0]])
    assert torch.allclose(client.control_variate.head.weight, g, atol=1e-6)
    assert torch.allclose(client.control_variate.body.weight, g, atol=1e-6)
    payload = client.make_upload([])
    assert torch.allclose(payload.control["head.weight"], torch.tensor([[-S, 0.0], [S, 0.3]]), atol=1e-6)
    assert torch.allclose(payload.control["body.weight"], torch.tensor([[-S - 0.5, 0.0], [S, 0.0]]), atol=1e-6)
    assert torch.equal(payload.weights["head.weight"], client.model.head.weight.detach())
    assert payload.nbytes() == 2 * 8 * 4  # the model (8 floats) and Delta c (8 floats)
    assert torch.equal(client.client_state()["control_variate.head.weight"], client.control_variate.head.weight)


def test_scaffold_option_two_after_two_steps_is_the_mean_uncorrected_gradient():
    """K = 2: c_i+ = c_i - c + (x - y_2)/(2 eta) = (g(x) + g(y_1)) / 2, the step count read from the Trainer."""
    client = _client()
    fit(client, one_batch_loader(X, Y), max_epochs=2)
    y1 = {
        "head.weight": torch.eye(2) - 0.1 * torch.tensor([[-S + 0.1, 0.0], [S, 0.5]]),
        "body.weight": torch.eye(2) - 0.1 * torch.tensor([[-S - 0.5, 0.0], [S, 0.0]]),
    }
    grads = []
    for weights in (IDENTITY, y1):
        model = TinyLinear(body=weights["body.weight"], head=weights["head.weight"])
        F.cross_entropy(model(X), Y).backward()
        grads.append({"head.weight": model.head.weight.grad, "body.weight": model.body.weight.grad})
    assert client.lr_sum == pytest.approx(0.2)
    for name in ("head.weight", "body.weight"):
        expected = (grads[0][name] + grads[1][name]) / 2
        assert torch.allclose(client.control_variate.get_buffer(name), expected, atol=1e-6), name


def test_scaffold_client_without_a_download_trains_plain_sgd_and_keeps_c_i():
    """A purely local fit (no download) has no correction and leaves c_i untouched."""
    client = _client()
    client.load_client_state(client.client_state())  # a new task, no download
    fit(client, one_batch_loader(X, Y))
    assert torch.allclose(client.model.head.weight, torch.eye(2) - 0.1 * torch.tensor([[-S, 0.0], [S, 0.0]]))
    assert torch.equal(client.control_variate.head.weight, C_CLIENT["head.weight"])


INITIAL = {"model.w": torch.zeros(2), "model.bn.running_mean": torch.zeros(1), "control_variate.w": torch.zeros(2)}


def _upload(client_id: int, w: list[float], buffer: float, delta_c: list[float], n: int = 10):
    weights = {"w": torch.tensor(w), "bn.running_mean": torch.tensor([buffer])}
    return upload(client_id, ScaffoldPayload(weights=weights, control={"w": torch.tensor(delta_c)}, num_examples=n))


def test_scaffold_server_x_and_c_by_hand_with_partial_participation():
    """Server: x += eta_g mean Delta y (eta_g = 0.5); c += |S|/N mean Delta c, N = 4; buffers: uniform mean."""
    server = ScaffoldServer(global_lr=0.5)
    server.setup_server(context(num_clients=4, initial=INITIAL))
    server.aggregate(0, [_upload(0, [2.0, 4.0], 1.0, [1.0, 0.0], n=30), _upload(1, [4.0, 0.0], 3.0, [3.0, 2.0])])
    # mean Delta y = [3, 2]: x = [1.5, 1]; c = 2/4 * mean([1, 0], [3, 2]) = [1, 0.5]
    download = server.download_for(2)
    assert isinstance(download, ScaffoldPayload)
    assert torch.allclose(download.weights["w"], torch.tensor([1.5, 1.0]))
    assert torch.allclose(download.control["w"], torch.tensor([1.0, 0.5]))
    assert download.weights["bn.running_mean"].item() == pytest.approx(2.0)  # example weights would give 1.5
    server.aggregate(1, [_upload(3, [3.5, 1.0], 0.0, [-1.0, 1.0])])
    # Delta y = [2, 0]: x = [1.5, 1] + 0.5 [2, 0] = [2.5, 1]; c = [1, 0.5] + 1/4 [-1, 1] = [0.75, 0.75]
    download = server.download_for(0)
    assert torch.allclose(download.weights["w"], torch.tensor([2.5, 1.0]))
    assert torch.allclose(download.control["w"], torch.tensor([0.75, 0.75]))
    assert download.nbytes() == (2 + 1 + 2) * 4
    restored = ScaffoldServer(global_lr=0.5)
    restored.setup_server(context(num_clients=4, initial=INITIAL))
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.download_for(1).control["w"], download.control["w"])


def test_scaffold_server_rejects_a_malformed_control_variate():
    """A Delta c whose keys or shapes differ from the parameters, or a plain WeightsPayload, is refused."""
    server = ScaffoldServer()
    server.setup_server(context(num_clients=2, initial=INITIAL))
    bad = ScaffoldPayload(
        weights={"w": torch.zeros(2), "bn.running_mean": torch.zeros(1)}, control={"w": torch.zeros(3)}
    )
    with pytest.raises(TrainingError, match="client 0"):
        server.check_upload(upload(0, bad))
    with pytest.raises(TrainingError, match="control variate"):
        server.check_upload(upload(1, ScaffoldPayload(weights=bad.weights, control={})))


def test_scaffold_server_c_is_the_mean_client_control_variate_in_a_run():
    """In a 2-round run with 2 of 3 clients per round, c = (1/N) sum over all clients of their stored c_i."""
    loop, summary = label_skew_run(SCAFFOLD(lr=0.05), participation=2)
    assert "acc_server" in summary["final"]
    control = loop.server.state_by_architecture["cnn_tiny"]
    states = [loop.store.get(cid)["module"] for cid in range(loop.scenario.num_clients)]
    for name, value in control.items():
        mean = torch.stack([s[f"control_variate.{name}"] for s in states]).mean(0)
        assert torch.allclose(value, mean, atol=1e-6), name
    assert any(bool(v.abs().sum() > 0) for v in control.values())


def test_scaffold_refuses_momentum_and_other_optimizers():
    """Option II assumes plain SGD steps: momentum > 0 or Adam fail in one line; the server is a FedAvgServer."""
    with pytest.raises(ConfigError, match="momentum=0"):
        SCAFFOLD(momentum=0.9)
    with pytest.raises(ConfigError, match="optimizer=sgd"):
        SCAFFOLD(optimizer="adam")
    algorithm = SCAFFOLD()
    assert algorithm.hp.global_lr == 1.0 and algorithm.evaluation == ("clients", "server")
    assert isinstance(algorithm.build_server(), FedAvgServer)


def test_scaffold_server_names_each_refusal_in_full():
    """The payload type, the control variate's keys, shapes and dtype: one line each, naming the client."""
    from fedhet.core.payloads import WeightsPayload

    server = SCAFFOLD(global_lr=0.5).build_server()
    assert server.hp.global_lr == 0.5
    server.setup_server(context(num_clients=2, initial=INITIAL))
    weights = {"w": torch.zeros(2), "bn.running_mean": torch.zeros(1)}

    def refusal(payload):
        with pytest.raises(TrainingError) as error:
            server.check_upload(upload(1, payload))
        return str(error.value)

    assert refusal(WeightsPayload(weights=weights)) == (
        "client 1 sent WeightsPayload, expected SCAFFOLD's weights and control variate (ScaffoldPayload)"
    )
    assert refusal(ScaffoldPayload(weights=weights, control={})).startswith(
        "client 1 sent a control variate whose keys differ from the server's c (missing ['w'], unexpected [])"
    )
    assert refusal(ScaffoldPayload(weights=weights, control={"w": torch.zeros(3)})).startswith(
        "client 1 sent 'control.w' of shape (3,), expected (2,)"
    )
    assert refusal(ScaffoldPayload(weights=weights, control={"w": torch.zeros(2).double()})).startswith(
        "client 1 sent 'control.w' as torch.float64 where the server's c holds torch.float32"
    )
    with pytest.raises(ConfigError) as error:
        ScaffoldServer().setup_server(context(num_clients=1, initial={"model.w": torch.zeros(1)}))
    assert str(error.value) == "SCAFFOLD's server needs SCAFFOLD clients (no 'control_variate' in the client state)"


def test_scaffold_client_without_a_download_uploads_a_zero_control_update():
    """Trained without a download, a client sends its weights and a zero Delta c_i shaped like its parameters."""
    client = ScaffoldClient(TinyLinear(), num_classes=2, lr=0.1)
    assert client.num_classes == 2
    fit(client, one_batch_loader(X, Y))
    sent = client.make_upload([])
    assert set(sent.control) == {"body.weight", "head.weight"}
    assert all(torch.equal(value, torch.zeros(2, 2)) for value in sent.control.values())
