"""Hand-computed checks of the Byzantine-robust aggregation rules (median, trimmed mean, Krum, Multi-Krum)."""

import pytest
import torch

from fedhet.functional import coordinate_median, krum, krum_scores, trimmed_mean


def _states(*rows, key="w"):
    return [{key: torch.tensor(r)} for r in rows]


def test_coordinate_median_odd_and_even_counts():
    """Odd n: the middle value per coordinate; even n: the mean of the two middle ones (numpy.median)."""
    odd = coordinate_median(_states([1.0, 10.0], [2.0, -4.0], [9.0, 0.0]))["w"]
    assert torch.equal(odd, torch.tensor([2.0, 0.0]))
    even = coordinate_median(_states([1.0], [2.0], [4.0], [1000.0]))["w"]
    assert torch.equal(even, torch.tensor([3.0]))  # (2 + 4) / 2


def test_coordinate_median_ignores_one_absurd_client_and_keeps_dtypes():
    """One client at 1e30 does not move the median of three; an integer buffer stays an integer."""
    states = [
        {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)},
        {"w": torch.tensor([1e30, -1e30]), "n": torch.tensor(3)},
        {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(5)},
    ]
    out = coordinate_median(states)
    assert torch.equal(out["w"], torch.tensor([3.0, 2.0]))  # sorted columns: (1, 3, 1e30), (-1e30, 2, 4)
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 3


def test_trimmed_mean_hand_values():
    """With n = 5 and beta = 0.2, cut 1 at each end; beta = 0.1 cuts nothing (int(0.5) = 0), as scipy's trim_mean."""
    states = _states([1.0, 50.0], [2.0, 40.0], [3.0, 30.0], [4.0, 20.0], [100.0, -7.0])
    assert torch.equal(trimmed_mean(states, 0.2)["w"], torch.tensor([3.0, 30.0]))  # (2+3+4)/3, (20+30+40)/3
    assert trimmed_mean(states, 0.1)["w"].tolist() == pytest.approx([22.0, 26.6])  # plain means: 110/5, 133/5
    with pytest.raises(ValueError):
        trimmed_mean(states, 0.5)


def test_krum_scores_hand_values():
    """Points 0, 1, 3, 10 with f = 1: each scores its n - f - 2 = 1 nearest squared distance."""
    states = _states([0.0], [1.0], [3.0], [10.0])
    # nearest peers: 0->1 (1), 1->0 (1), 3->1 (4), 10->3 (49)
    assert krum_scores(states, 1).tolist() == [1.0, 1.0, 4.0, 49.0]
    # f = 0: the 2 nearest: 0 -> 1 + 9, 1 -> 1 + 4, 3 -> 4 + 9, 10 -> 49 + 81
    assert krum_scores(states, 0).tolist() == [10.0, 5.0, 13.0, 130.0]


def test_krum_picks_one_upload_and_multi_krum_averages_the_best():
    """Krum returns the lowest-scored state itself; Multi-Krum (m = 2) the example-weighted mean of the two best."""
    states = [{"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])},
              {"w": torch.tensor([50.0, 50.0])}]
    # squared distances: d01 = 1, d02 = 4, d12 = 5, to the outlier >= 4804; f = 1: one nearest each
    # scores 1, 1, 4, 4804: Krum takes client 0 (tie with 1 broken by order)
    chosen, order = krum(states, [1, 1, 1, 1], num_byzantine=1, keep=1)
    assert order == [0] and torch.equal(chosen["w"], torch.tensor([0.0, 0.0]))
    averaged, order = krum(states, [1, 3, 1, 1], num_byzantine=1, keep=2)
    assert order == [0, 1] and torch.equal(averaged["w"], torch.tensor([0.75, 0.0]))  # (1*0 + 3*1) / 4


def test_krum_rejects_bad_settings():
    """A keep outside 1..n and a negative f are ValueErrors."""
    with pytest.raises(ValueError):
        krum(_states([0.0], [1.0]), [1, 1], num_byzantine=0, keep=3)
    with pytest.raises(ValueError):
        krum(_states([0.0], [1.0]), [1, 1], num_byzantine=-1)


def test_coordinate_median_of_five_takes_the_third_value():
    """Of five clients the middle value is the third smallest (index n // 2 = 2)."""
    assert torch.equal(coordinate_median(_states([5.0], [1.0], [4.0], [2.0], [3.0]))["w"], torch.tensor([3.0]))


def test_robust_rules_accept_one_client_and_round_integer_buffers():
    """One client's state comes back unchanged; an integer buffer's mean is rounded (2.5 -> 2, 3.5 -> 4)."""
    one = [{"w": torch.tensor([1.5, -2.0]), "n": torch.tensor(7)}]
    for aggregate in (coordinate_median, lambda s: trimmed_mean(s, 0.0), lambda s: krum(s, [1.0], 0)[0]):
        out = aggregate(one)
        assert torch.equal(out["w"], one[0]["w"]) and int(out["n"]) == 7
    assert torch.equal(krum_scores(one, 0), torch.tensor([0.0], dtype=torch.float64))
    integers = [{"n": torch.tensor(v)} for v in (2, 3)]
    assert int(coordinate_median(integers)["n"]) == 2  # (2 + 3) / 2 = 2.5 rounds to even
    assert int(trimmed_mean([{"n": torch.tensor(v)} for v in (3, 4)], 0.0)["n"]) == 4  # 3.5 -> 4


def test_trimmed_mean_with_beta_zero_is_the_plain_mean():
    """A beta of 0 cuts nothing: the plain mean of every client."""
    assert torch.equal(trimmed_mean(_states([1.0], [2.0], [6.0]), 0.0)["w"], torch.tensor([3.0]))


def test_krum_orders_by_score_not_by_client_index():
    """The selected clients are the lowest-scored ones even when they come last, listed in score order."""
    states = _states([50.0], [1.0], [0.0])  # scores with one nearest peer: 49**2, 1, 1
    aggregate, order = krum(states, [1.0, 1.0, 1.0], num_byzantine=0)
    assert order == [1] and torch.equal(aggregate["w"], torch.tensor([1.0]))  # keep defaults to 1; tie -> index
    _, both = krum(states, [1.0, 1.0, 1.0], num_byzantine=0, keep=3)
    assert both == [1, 2, 0]


def test_robust_rules_errors_name_the_problem():
    """Each refusal says what is wrong and what it got."""
    with pytest.raises(ValueError, match=r"^coordinate_median needs at least one state$"):
        coordinate_median([])
    with pytest.raises(ValueError, match=r"^trimmed_mean needs at least one state$"):
        trimmed_mean([], 0.1)
    with pytest.raises(ValueError, match=r"^trimmed_mean needs beta in \[0, 0.5\), got 0.5$"):
        trimmed_mean(_states([1.0]), 0.5)
    with pytest.raises(ValueError, match=r"^krum needs at least one state$"):
        krum_scores([], 0)
    with pytest.raises(ValueError, match=r"^krum keeps 1 to 2 clients, got keep=3$"):
        krum(_states([1.0], [2.0]), [1.0, 1.0], 0, keep=3)
    with pytest.raises(ValueError, match=r"^krum needs num_byzantine >= 0, got -1$"):
        krum(_states([1.0], [2.0]), [1.0, 1.0], -1)


def test_robust_rules_compute_in_float64():
    """Median of an even count, trimmed mean and Krum scores are computed in float64 (then cast once)."""
    torch.manual_seed(0)
    states = [{"w": torch.rand(500)} for _ in range(4)]
    stacked = torch.stack([s["w"].double() for s in states]).sort(dim=0).values
    assert torch.equal(coordinate_median(states)["w"], ((stacked[1] + stacked[2]) / 2).float())
    assert torch.equal(trimmed_mean(states, 0.25)["w"], stacked[1:3].mean(dim=0).float())
    flat = torch.stack([s["w"].double() for s in states])
    nearest = [min(((flat[i] - flat[j]) ** 2).sum().item() for j in range(4) if j != i) for i in range(4)]
    assert krum_scores(states, 1).tolist() == pytest.approx(nearest, rel=1e-12)
