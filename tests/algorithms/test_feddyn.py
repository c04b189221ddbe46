"""FedDyn (Acar et al., ICLR 2021, Alg. 1): client objective, gradient state, server h and theta, closed forms.

The client objective and its gradient, the gradient-state update, the server's ``h`` and ``theta``
with partial participation, the one-step closed form and first-order optimality, by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.feddyn import FedDyn, FedDynClient, FedDynServer
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError
from tests.algorithms.helpers import TinyLinear, context, fit, label_skew_run, one_batch_loader, upload

X, Y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
IDENTITY = {"body.weight": torch.eye(2), "head.weight": torch.eye(2)}


def _moved_client(alpha: float) -> FedDynClient:
    """Received the identity model; body[0, 0] moved by 1, head[1, 1] by 2; gradient state set by hand."""
    client = FedDynClient(TinyLinear(), num_classes=2, alpha=alpha)
    client.on_receive(WeightsPayload(weights=IDENTITY))
    with torch.no_grad():
        client.model.body.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
        client.model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
        client.gradient_state.body.weight.copy_(torch.tensor([[0.5, 0.0], [0.0, 0.0]]))
        client.gradient_state.head.weight.copy_(torch.tensor([[0.0, 0.0], [0.0, 0.25]]))
    return client


def test_feddyn_client_loss_by_hand():
    """CE - <g, theta> + alpha/2 ||theta - theta^{t-1}||^2 = 0.126928 - 1.75 + 0.25 * 5 with alpha = 0.5."""
    client = _moved_client(alpha=0.5)
    # logits = head body x = [2, 0]: CE = log(1 + e^-2) = 0.126928; <g, theta> = 0.5 * 2 + 0.25 * 3 = 1.75;
    # ||theta - theta^{t-1}||^2 = 1 + 4 = 5
    assert client.local_loss((X, Y)).item() == pytest.approx(0.126928 - 1.75 + 1.25, abs=1e-6)


def test_feddyn_client_gradient_by_hand():
    """The gradient is the CE gradient minus g plus alpha (theta - theta^{t-1}), entry by entry."""
    client = _moved_client(alpha=0.5)
    client.local_loss((X, Y)).backward()
    # p = softmax([2, 0]) = [0.880797, 0.119203]; head: CE (p - e0) f^T with f = [2, 0] gives +-0.238406 in
    # column 0; entry [1, 1]: -g = -0.25, alpha * (3 - 1) = 1 -> 0.75
    head = torch.tensor([[-0.238406, 0.0], [0.238406, 0.75]])
    # body: CE head^T (p - e0) x^T = [[-0.119203, 0], [0.357609, 0]]; entry [0, 0] adds -0.5 + 0.5 * 1 = 0
    body = torch.tensor([[-0.119203, 0.0], [0.357609, 0.0]])
    assert torch.allclose(client.model.head.weight.grad, head, atol=1e-6)
    assert torch.allclose(client.model.body.weight.grad, body, atol=1e-6)


def test_feddyn_gradient_state_update_by_hand_is_declared_state():
    """The state update g -= alpha (theta_k - theta^{t-1}) (Alg. 1) is stored and survives a reload."""
    client = _moved_client(alpha=0.5)
    client.on_train_end()
    # body: 0.5 - 0.5 * 1 = 0; head [1, 1]: 0.25 - 0.5 * 2 = -0.75
    assert torch.allclose(client.gradient_state.body.weight, torch.zeros(2, 2))
    assert torch.allclose(client.gradient_state.head.weight, torch.tensor([[0.0, 0.0], [0.0, -0.75]]))
    state = client.client_state()
    assert torch.equal(state["gradient_state.head.weight"], client.gradient_state.head.weight)
    fresh = FedDynClient(TinyLinear(), num_classes=2, alpha=0.5)
    fresh.load_client_state(state)
    assert torch.equal(fresh.gradient_state.head.weight, torch.tensor([[0.0, 0.0], [0.0, -0.75]]))
    assert fresh.reference == []  # the centre theta^{t-1} is the next download, not kept


def test_feddyn_without_a_download_is_plain_cross_entropy_and_keeps_its_state():
    """A purely local fit (no download) has no dynamic terms and leaves the gradient state alone."""
    client = _moved_client(alpha=0.5)
    client.load_client_state(client.client_state())  # a new task: no centre until a download arrives
    assert client.local_loss((X, Y)).item() == pytest.approx(0.126928, abs=1e-6)
    client.on_train_end()
    assert torch.allclose(client.gradient_state.head.weight, torch.tensor([[0.0, 0.0], [0.0, 0.25]]))


def _server(alpha: float, clients: int, initial: dict[str, torch.Tensor]) -> FedDynServer:
    server = FedDynServer(alpha=alpha)
    server.setup_server(context(num_clients=clients, initial=initial))
    return server


def test_feddyn_server_h_and_theta_by_hand_with_partial_participation():
    """Server: h -= alpha/m sum (theta_k - theta^{t-1}), m = all 3 clients; theta = participant mean - h/alpha."""
    initial = {"model.w": torch.zeros(2), "model.bn.running_mean": torch.zeros(1), "gradient_state.w": torch.zeros(2)}
    server = _server(alpha=0.5, clients=3, initial=initial)
    w = lambda values, buffer, n: WeightsPayload(  # noqa: E731
        weights={"w": torch.tensor(values), "bn.running_mean": torch.tensor([buffer])}, num_examples=n
    )
    server.aggregate(0, [upload(0, w([1.0, 2.0], 1.0, 30)), upload(1, w([3.0, -2.0], 3.0, 10))])
    # sum (theta_k - 0) = [4, 0]; h = -0.5 / 3 * [4, 0] = [-2/3, 0]; mean [2, 0] - h / 0.5 = [10/3, 0]
    assert torch.allclose(server.state_by_architecture["x"]["w"], torch.tensor([-2 / 3, 0.0]))
    theta = server.download_for(2).weights
    assert torch.allclose(theta["w"], torch.tensor([10 / 3, 0.0]))
    # the buffer is the uniform participant mean (example weights would give 1.5), with no h correction
    assert theta["bn.running_mean"].item() == pytest.approx(2.0)
    server.aggregate(1, [upload(1, w([4.0, 1.0], 0.0, 10)), upload(2, w([2.0, 3.0], 0.0, 10))])
    # sum (theta_k - [10/3, 0]) = [-2/3, 4]; h = [-2/3, 0] - 0.5/3 [-2/3, 4] = [-5/9, -2/3]
    # theta = [3, 2] - h / 0.5 = [37/9, 10/3]
    assert torch.allclose(server.state_by_architecture["x"]["w"], torch.tensor([-5 / 9, -2 / 3]))
    assert torch.allclose(server.download_for(0).weights["w"], torch.tensor([37 / 9, 10 / 3]))
    restored = _server(alpha=0.5, clients=3, initial=initial)
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.state_by_architecture["x"]["w"], server.state_by_architecture["x"]["w"])


def _one_local_step(alpha: float, x: torch.Tensor, y: torch.Tensor, lr: float) -> FedDynClient:
    """A client that received the identity model and took one SGD step on ``(x, y)`` in a lean Trainer."""
    client = FedDynClient(TinyLinear(), num_classes=2, alpha=alpha, lr=lr)
    client.on_receive(WeightsPayload(weights=IDENTITY))
    fit(client, one_batch_loader(x, y))
    return client


@pytest.mark.parametrize("alpha", [0.01, 1.0])
def test_feddyn_one_step_closed_form_is_twice_the_fedavg_step_for_any_alpha(alpha):
    """Round 1, full participation, one local SGD step from theta^0: theta^1 = theta^0 - 2 eta mean grad L_k(theta^0).

    At theta^0 with g_k = 0 the dynamic terms have zero gradient, so theta_k = theta^0 - eta grad L_k; the
    state becomes g_k = alpha eta grad L_k, h = -alpha (1/m) sum (theta_k - theta^0) = alpha eta mean grad L_k, and
    theta^1 = (theta^0 - eta mean grad) - h / alpha: alpha cancels and FedDyn takes twice FedAvg's step.
    """
    eta = 0.1
    clients = [
        _one_local_step(alpha, torch.tensor([[1.0, 0.0]]), torch.tensor([0]), eta),
        _one_local_step(alpha, torch.tensor([[0.0, 1.0]]), torch.tensor([1]), eta),
    ]
    # client 0: logits [1, 0], p - e0 = [-0.268941, 0.268941], f = x = [1, 0]: grad = [[-s, 0], [s, 0]]
    # client 1: logits [0, 1], p - e1 = [0.268941, -0.268941], f = x = [0, 1]: grad = [[0, s], [0, -s]]
    s = 0.268941
    grads = [torch.tensor([[-s, 0.0], [s, 0.0]]), torch.tensor([[0.0, s], [0.0, -s]])]
    for client, grad in zip(clients, grads, strict=True):
        # identity head and body: both weights get the same gradient; the state is alpha * eta * grad
        assert torch.allclose(client.gradient_state.head.weight, alpha * eta * grad, atol=1e-6)
        assert torch.allclose(client.gradient_state.body.weight, alpha * eta * grad, atol=1e-6)
    server = FedDynServer(alpha=alpha)
    initial = FedDynClient(TinyLinear(), num_classes=2).state_dict()  # theta^0 = identity, g = 0
    server.setup_server(context(num_clients=2, initial=initial))
    server.aggregate(0, [upload(k, WeightsPayload(weights=c.model.state_dict())) for k, c in enumerate(clients)])
    # 2 * eta * mean grad = 0.1 * [[-s, s], [s, -s]]
    expected = torch.eye(2) - 0.1 * torch.tensor([[-s, s], [s, -s]])  # [[1.026894, -0.026894], ...]
    theta = server.download_for(0).weights
    assert torch.allclose(theta["head.weight"], expected, atol=1e-6)
    assert torch.allclose(theta["body.weight"], expected, atol=1e-6)


def test_feddyn_state_update_is_the_local_gradient_at_the_exact_minimiser():
    """Solved to convergence, the updated state equals grad CE at theta_k (first-order condition)."""
    client = FedDynClient(TinyLinear(), num_classes=2, alpha=1.0, lr=0.5)
    with torch.no_grad():
        client.gradient_state.head.weight.copy_(torch.tensor([[0.3, -0.2], [0.1, 0.4]]))
        client.gradient_state.body.weight.copy_(torch.tensor([[-0.1, 0.2], [0.0, 0.3]]))
    client.on_receive(WeightsPayload(weights=IDENTITY))
    x, y = torch.tensor([[1.0, 0.0], [0.5, 1.0]]), torch.tensor([0, 1])
    fit(client, one_batch_loader(x, y), max_epochs=400)  # full-batch gradient descent, strongly convex objective
    client.zero_grad()
    F.cross_entropy(client.model(x), y).backward()
    assert torch.allclose(client.gradient_state.head.weight, client.model.head.weight.grad, atol=1e-5)
    assert torch.allclose(client.gradient_state.body.weight, client.model.body.weight.grad, atol=1e-5)


def test_feddyn_server_h_is_the_mean_client_gradient_state_in_a_run():
    """In a 2-round run with 2 of 3 clients per round, h = (1/m) sum over all clients of their stored g_k."""
    loop, summary = label_skew_run(FedDyn(alpha=0.1, lr=0.05), participation=2)
    assert "acc_server" in summary["final"]
    h = loop.server.state_by_architecture["cnn_tiny"]
    states = [loop.store.get(cid)["module"] for cid in range(loop.scenario.num_clients)]
    for name, value in h.items():
        mean = torch.stack([s[f"gradient_state.{name}"] for s in states]).mean(0)
        assert torch.allclose(value, mean, atol=1e-6), name
    assert any(bool(v.abs().sum() > 0) for v in h.values())


def test_feddyn_refuses_a_non_positive_alpha_and_reuses_fedavgs_server():
    """An alpha of 0 would divide by zero on the server; the server is a FedAvgServer (acc_server, FedDF)."""
    with pytest.raises(ConfigError, match=r"FedDyn: alpha=0.0 is not a number > 0"):
        FedDyn(alpha=0.0)
    algorithm = FedDyn()
    assert algorithm.hp.alpha == 0.01 and algorithm.evaluation == ("clients", "server")
    assert isinstance(algorithm.build_server(), FedAvgServer)


def test_feddyn_step_size_knobs_are_searched_with_unchanged_defaults():
    """momentum, lr and alpha carry search spaces (docs/diagnoses.md: FedDyn needs them tuned together)."""
    from fedhet.algorithms.feddyn import FedDynHparams
    from fedhet.hparams import sweep_parameters

    space = sweep_parameters(FedDynHparams)
    assert space["method.init_args.momentum"] == {"values": [0.0, 0.5, 0.9]}
    assert space["method.init_args.alpha"] == {"distribution": "log_uniform_values", "min": 0.001, "max": 1.0}
    assert "method.init_args.lr" in space
    hp = FedDyn().hp
    assert (hp.momentum, hp.alpha, hp.lr) == (0.0, 0.01, 0.01)
    with pytest.raises(ConfigError, match="momentum"):
        FedDyn(momentum=1.0)


def test_feddyn_regularises_only_towards_a_received_model_and_names_what_its_server_needs():
    """No download: no centre to pull towards; a server over clients without FedDyn's state is refused by name."""
    client = FedDynClient(TinyLinear(), 2, alpha=0.5)
    assert client.num_classes == 2
    fit(client, one_batch_loader(X, Y))  # reused alone, never given a download: plain cross-entropy
    client.on_receive(None)
    assert client.reference == []
    server = FedDyn(alpha=0.2).build_server()
    assert server.hp.alpha == 0.2
    with pytest.raises(ConfigError) as error:
        server.setup_server(context(num_clients=1, initial={"model.w": torch.zeros(1)}))
    assert str(error.value) == "FedDyn's server needs FedDyn clients (no 'gradient_state' in the client state)"
