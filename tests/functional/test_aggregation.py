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


def test_weighted_average_accumulates_in_float64():
    """The mean of float32 states is the float64 weighted sum rounded once to float32, bit for bit."""
    torch.manual_seed(0)
    states = [{"w": torch.rand(1000)} for _ in range(3)]
    exact = sum(s["w"].double() / 3 for s in states).float()
    assert torch.equal(weighted_average(states, [1.0, 1.0, 1.0])["w"], exact)


def test_weighted_average_rounds_integer_buffers():
    """An integer buffer's weighted mean is rounded (0.75 -> 1), not truncated (-> 0)."""
    states = [{"n": torch.tensor(0)}, {"n": torch.tensor(1)}]
    out = weighted_average(states, [1.0, 3.0])["n"]
    assert out.dtype == torch.int64 and int(out) == 1


def test_weighted_average_of_one_state_and_of_small_weights():
    """One client returns its own state; weights summing to less than one are normalised, not refused."""
    state = {"w": torch.tensor([1.0, -2.0])}
    assert torch.equal(weighted_average([state], [1.0])["w"], state["w"])
    assert torch.equal(weighted_average([state, state], [0.25, 0.5])["w"], state["w"])


def test_weighted_average_errors_name_the_problem():
    """Each refusal says what is wrong, with the counts it got."""
    with pytest.raises(ValueError, match=r"^weighted_average needs one weight per state, got 2 states, 1 weights$"):
        weighted_average([{"w": torch.zeros(1)}] * 2, [1.0])
    with pytest.raises(ValueError, match=r"^weighted_average needs a positive total weight$"):
        weighted_average([{"w": torch.zeros(1)}], [0.0])


def test_aggregate_class_means_is_exact_in_float64_and_for_one_client():
    """A class held by one example returns its value exactly (float64), and one client needs no peers."""
    value = torch.tensor([[0.1], [0.7]], dtype=torch.float64)
    out, present = aggregate_class_means([value], [torch.tensor([1, 1])])
    assert torch.equal(out, value) and out.dtype == torch.float64 and present.tolist() == [True, True]


def test_aggregate_class_means_accumulates_in_float64():
    """Count-weighted class means of float32 values: the float64 sum rounded once, bit for bit."""
    torch.manual_seed(0)
    values = [torch.rand(2, 500) for _ in range(3)]
    counts = [torch.tensor([1, 2]), torch.tensor([3, 1]), torch.tensor([7, 5])]
    held = torch.stack(counts).double()
    exact = ((torch.stack(values).double() * held.unsqueeze(-1)).sum(0) / held.sum(0).unsqueeze(-1)).float()
    assert torch.equal(aggregate_class_means(values, counts)[0], exact)


def test_aggregate_class_means_refuses_an_unknown_weighting():
    """The error names the weighting it got and the two it accepts."""
    with pytest.raises(ValueError, match=r"^weighting must be 'count' or 'uniform', got 'mean'$"):
        aggregate_class_means([torch.zeros(1, 1)], [torch.tensor([1])], weighting="mean")


def test_regularisers_of_no_parameters_are_zero_and_lengths_must_match():
    """No parameters: both terms are 0; a reference or gradient state of another length is an error."""
    assert proximal_term([], []).item() == 0.0 and linear_term([], []).item() == 0.0
    with pytest.raises(ValueError):
        proximal_term([torch.ones(1), torch.ones(1)], [torch.zeros(1)])
    with pytest.raises(ValueError):
        linear_term([torch.ones(1)], [torch.zeros(1), torch.zeros(1)])
