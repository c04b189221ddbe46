"""Partitioners and the sampling helpers behind scenario splits."""

from __future__ import annotations

import numpy as np
import pytest

from fedhet.data import (
    BalancedDirichletPartitioner,
    DirichletPartitioner,
    IIDPartitioner,
    Partitioner,
    PathologicalPartitioner,
    sample_private_subsets,
    split_fraction,
    stratified_sample,
)
from fedhet.errors import DataError

LABELS = np.repeat(np.arange(10), 100)  # 1,000 samples, 100 per class
np.random.default_rng(0).shuffle(LABELS)

COVERING = [
    IIDPartitioner(),
    DirichletPartitioner(beta=0.1, min_size=10),
    DirichletPartitioner(beta=1.0, min_size=30),
    PathologicalPartitioner(classes_per_client=2),
    PathologicalPartitioner(classes_per_client=3, balanced=False),
]


def assert_disjoint_sorted(parts: list[np.ndarray]) -> None:
    """The index arrays are int64, sorted, and pairwise disjoint."""
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged)
    for part in parts:
        assert part.dtype == np.int64 and np.all(np.diff(part) > 0)


@pytest.mark.parametrize("partitioner", COVERING, ids=repr)
def test_partition_covers_every_sample_exactly_once(partitioner) -> None:
    """Every partitioner gives each sample to exactly one client, none below min_size."""
    parts = partitioner.partition(LABELS, 10, seed=3)
    assert len(parts) == 10
    assert_disjoint_sorted(parts)
    assert sum(len(p) for p in parts) == len(LABELS)
    assert min(len(p) for p in parts) >= getattr(partitioner, "min_size", 1)


@pytest.mark.parametrize("partitioner", [*COVERING, BalancedDirichletPartitioner(0.5)], ids=repr)
def test_partition_is_deterministic_per_seed(partitioner) -> None:
    """The same seed gives the same partition, another seed a different one."""
    first = partitioner.partition(LABELS, 10, seed=11)
    again = partitioner.partition(LABELS, 10, seed=11)
    other = partitioner.partition(LABELS, 10, seed=12)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_iid_sizes_differ_by_at_most_one() -> None:
    """IID client sizes differ by at most one sample."""
    sizes = [len(p) for p in IIDPartitioner().partition(LABELS[:997], 10, seed=0)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 997


def test_dirichlet_small_beta_is_skewed() -> None:
    """Dirichlet(0.1) gives most of a client's data to one class."""
    parts = DirichletPartitioner(beta=0.1, min_size=10).partition(LABELS, 10, seed=0)
    dominant = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(dominant) > 0.5  # most of a client's data is one class


def test_dirichlet_impossible_min_size_fails_within_bounded_retries() -> None:
    """An unreachable min_size fails after max_retries draws with a one-line fix-it message."""
    tiny = DirichletPartitioner(beta=0.01, min_size=45, max_retries=5)
    with pytest.raises(DataError, match="raise beta, lower min_size or num_clients") as error:
        tiny.partition(LABELS[:500], 10, seed=0)
    assert "in 5 draws" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DataError, match="lower min_size or num_clients"):
        DirichletPartitioner(min_size=200).partition(LABELS, 10, seed=0)


def test_pathological_gives_exactly_k_classes_per_client() -> None:
    """The pathological partitioner gives every client exactly k classes."""
    for k in (1, 2, 3, 5):
        parts = PathologicalPartitioner(classes_per_client=k).partition(LABELS, 20, seed=k)
        assert [len(np.unique(LABELS[p])) for p in parts] == [k] * 20


def test_pathological_errors() -> None:
    """Too many classes per client or too large a min_size are DataErrors."""
    with pytest.raises(DataError, match="lower classes_per_client"):
        PathologicalPartitioner(classes_per_client=11).partition(LABELS, 5, seed=0)
    with pytest.raises(DataError, match="min_size"):
        PathologicalPartitioner(classes_per_client=1, min_size=200).partition(LABELS, 10, seed=0)


def test_balanced_dirichlet_gives_equal_sizes() -> None:
    """The balanced Dirichlet partitioner gives every client the same number of samples."""
    parts = BalancedDirichletPartitioner(omega=0.1).partition(LABELS, 7, seed=0)
    assert_disjoint_sorted(parts)
    assert [len(p) for p in parts] == [1000 // 7] * 7


def test_empty_client_is_a_data_error() -> None:
    """A partition that leaves a client empty is a DataError, whichever partitioner caused it."""
    with pytest.raises(DataError, match="cannot be split among 20 clients"):
        IIDPartitioner().partition(LABELS[:5], 20, seed=0)
    with pytest.raises(DataError, match="lower num_clients or classes_per_client"):
        # class 1 has one sample for two holders
        PathologicalPartitioner(classes_per_client=1).partition(np.array([0, 0, 0, 0, 1]), 4, seed=0)

    class AllToFirst(Partitioner):
        def _split(self, labels, num_clients, rng):
            return [np.arange(len(labels))] + [np.empty(0, np.int64)] * (num_clients - 1)

    with pytest.raises(DataError, match="AllToFirst left client 1 with no data"):
        AllToFirst().partition(LABELS, 3, seed=0)


def test_unlabelled_data_cannot_be_partitioned() -> None:
    """Unlabelled data (labels -1) cannot be partitioned by label."""
    with pytest.raises(DataError, match="unlabelled"):
        IIDPartitioner().partition(np.full(10, -1), 2, seed=0)


def test_sample_private_subsets() -> None:
    """Private subsets have the requested sizes, are disjoint and seeded; too large a request fails."""
    subsets = sample_private_subsets(LABELS, [150, 80, 300], seed=0)
    assert [len(s) for s in subsets] == [150, 80, 300]
    assert_disjoint_sorted(subsets)
    again = sample_private_subsets(LABELS, [150, 80, 300], seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(subsets, again, strict=True))
    with pytest.raises(DataError, match="from a pool of 1000"):
        sample_private_subsets(LABELS, [600, 600], seed=0)


def test_stratified_helpers() -> None:
    """Stratified sampling takes equal shares per class; split_fraction rounds the test share up."""
    rng = np.random.default_rng(0)
    taken, rest = stratified_sample(LABELS, 200, rng)
    assert np.bincount(LABELS[taken]).tolist() == [20] * 10
    assert len(np.union1d(taken, rest)) == 1000 and np.intersect1d(taken, rest).size == 0
    test, train = split_fraction(LABELS[:10], 0.25, rng)
    assert len(test) == 3 and len(train) == 7  # ceil(0.25 * 10), as train_test_split
    with pytest.raises(DataError):
        stratified_sample(LABELS, 1001, rng)


def test_describe_is_json_able() -> None:
    """A partitioner's description lists its settings and serialises to JSON."""
    import json

    description = DirichletPartitioner(beta=0.3).describe()
    assert description == {"name": "DirichletPartitioner", "beta": 0.3, "min_size": 10, "max_retries": 100}
    json.dumps(description)
