"""Hand-computed checks of the aggregation rules and regularisers."""

import pytest
import torch

from fedhet.functional import aggregate_class_means, class_means, linear_term, proximal_term, weighted_average


def test_weighted_average_hand_values():
    """The weighted average of two states by hand; an integer buffer keeps its common value and dtype."""
    a = {"w": torch.tensor([0.0, 2.0]), "b": torch.tensor(1.0), "n": torch.tensor(4)}
    b = {"w": torch.tensor([4.0, 6.0]), "b": torch.tensor(5.0), "n": torch.tensor(4)}
    out = weighted_average([a, b], [1, 3])
    # (1*0 + 3*4)/4 = 3, (1*2 + 3*6)/4 = 5, (1*1 + 3*5)/4 = 4
    assert torch.equal(out["w"], torch.tensor([3.0, 5.0]))
    assert torch.equal(out["b"], torch.tensor(4.0))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 4


def test_weighted_average_three_clients_fractional_weights():
    """Weights are normalised: 10/20/70 give 0.1/0.2/0.7."""
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, {"w": torch.tensor([7.0])}]
    out = weighted_average(states, [10, 20, 70])
    assert out["w"].item() == pytest.approx(0.1 * 1 + 0.2 * 2 + 0.7 * 7)


def test_weighted_average_rejects_bad_weights():
    """A zero total weight or a weight count that differs from the states is a ValueError."""
    with pytest.raises(ValueError):
        weighted_average([{"w": torch.zeros(1)}], [0])
    with pytest.raises(ValueError):
        weighted_average([{"w": torch.zeros(1)}], [1, 2])


def test_aggregate_class_means_with_missing_classes():
    """Class means are averaged over the clients holding each class, absent rows ignored."""
    # client 1 holds classes 0 and 1 (1 and 2 examples); client 2 holds class 0 (3 examples) only;
    # nobody holds class 2.
    v1 = torch.tensor([[1.0, 1.0], [5.0, 5.0], [0.0, 0.0]])
    v2 = torch.tensor([[3.0, -1.0], [99.0, 99.0], [42.0, 42.0]])  # absent rows carry garbage
    c1, c2 = torch.tensor([1, 2, 0]), torch.tensor([3, 0, 0])
    means, present = aggregate_class_means([v1, v2], [c1, c2], "count")
    # class 0: (1*[1,1] + 3*[3,-1]) / 4 = [2.5, -0.5]; class 1: only client 1 -> [5, 5]
    assert torch.allclose(means, torch.tensor([[2.5, -0.5], [5.0, 5.0], [0.0, 0.0]]))
    assert present.tolist() == [True, True, False]
    uniform, _ = aggregate_class_means([v1, v2], [c1, c2], "uniform")
    # class 0: plain mean over the two holders ([1,1] + [3,-1]) / 2 = [2, 0]
    assert torch.allclose(uniform[0], torch.tensor([2.0, 0.0]))
    assert torch.allclose(uniform[1], torch.tensor([5.0, 5.0]))


def test_class_means():
    """Per-class means and counts by hand, absent classes zero."""
    values = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 5.0]])
    means, counts = class_means(values, torch.tensor([0, 0, 2]), 3)
    assert torch.equal(means, torch.tensor([[2.0, 1.0], [0.0, 0.0], [5.0, 5.0]]))
    assert counts.tolist() == [2, 0, 1]


def test_proximal_term_and_gradient():
    """The proximal term is the squared distance and its gradient 2 (w - w_t)."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    ref = torch.tensor([0.5, 0.0])
    term = proximal_term([w], [ref])
    assert term.item() == pytest.approx(0.25 + 4.0)
    term.backward()
    assert torch.allclose(w.grad, 2 * (w.detach() - ref))


def test_linear_term_and_gradient():
    """FedDyn's <g, w> sums over parameters; its gradient is g, and g itself gets none."""
    w, v = torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)
    g = [torch.tensor([0.5, -1.0], requires_grad=True), torch.tensor([[2.0]])]
    term = linear_term([w, v], g)
    assert term.item() == pytest.approx(0.5 - 2.0 + 6.0)
    term.backward()
    assert torch.equal(w.grad, torch.tensor([0.5, -1.0])) and torch.equal(v.grad, torch.tensor([[2.0]]))
    assert g[0].grad is None
