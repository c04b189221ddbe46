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
