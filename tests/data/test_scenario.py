"""Domain-shift and label-skew scenarios: split sizes, disjointness, loaders, errors."""

from __future__ import annotations

import json
from collections import defaultdict

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from fedhet.data import (
    DirichletPartitioner,
    DomainShiftScenario,
    LabelSkewScenario,
    PathologicalPartitioner,
    TensorBatchLoader,
)
from fedhet.data.tensors import DomainSplits
from fedhet.errors import DataError


def assert_disjoint_within_sources(indices: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """No index appears in two splits drawn from the same source array; return the unions."""
    by_source: dict[str, list[np.ndarray]] = defaultdict(list)
    for key, value in indices.items():
        by_source[key.split(":")[0]].append(value)
    unions = {}
    for source, parts in by_source.items():
        merged = np.concatenate(parts)
        assert len(np.unique(merged)) == len(merged), f"overlapping splits in {source}"
        unions[source] = merged
    return unions


@pytest.fixture(scope="module")
def domain_shift(embedded: dict[str, DomainSplits]) -> DomainShiftScenario:
    """Eight clients, two per Digits domain, with their private sizes and 1000 public photos."""
    scenario = DomainShiftScenario(clients_per_domain=2, private_sizes=[150, 80, 600, 500], public_size=1000)
    scenario.setup()
    return scenario


def test_domain_shift_defaults_match_the_benchmark(embedded: dict[str, DomainSplits]) -> None:
    """The default domain-shift scenario has the benchmark's domains, client sizes and test sets."""
    scenario = DomainShiftScenario()
    assert scenario.kind == "domain_shift"
    assert scenario.domains == ["mnist", "uci", "mnistm", "syn"]
    assert scenario.num_clients == 4 and scenario.num_classes == 10 and scenario.in_channels == 3
    assert [len(scenario.client_data(c).train) for c in range(4)] == [150, 80, 1500, 1000]
    assert {name: len(data) for name, data in scenario.eval_sets("test").items()} == {
        "mnist": 1000,
        "uci": 500,
        "mnistm": 1000,
        "syn": 1000,
    }
    assert all(len(data) == 200 for data in scenario.eval_sets("val").values())
    public = scenario.public_data()
    assert public is not None and len(public) == 5000 and (public.y == -1).all()


def test_domain_shift_clients_of_a_domain_share_eval_sets(domain_shift: DomainShiftScenario) -> None:
    """Clients of one domain share that domain's test and validation sets."""
    assert domain_shift.num_clients == 8
    for client_id in range(8):
        data = domain_shift.client_data(client_id)
        domain_index = client_id // 2
        assert domain_shift.client_domain_index(client_id) == domain_index
        assert data.domain == domain_shift.domains[domain_index]
        assert data.test is domain_shift.eval_sets("test")[data.domain]
        assert data.val is domain_shift.eval_sets("val")[data.domain]
    sizes = [len(domain_shift.client_data(c).train) for c in range(8)]
    assert sizes == [150, 150, 80, 80, 600, 600, 500, 500]


def test_domain_shift_splits_are_disjoint(domain_shift: DomainShiftScenario, embedded: dict[str, DomainSplits]) -> None:
    """Client, validation, test and public splits never share an image, and the served data is the recorded one."""
    indices = domain_shift.split_indices()
    assert_disjoint_within_sources(indices)
    # the recorded indices really are the served images
    mnist_pool = embedded["mnist"].train
    assert torch.equal(domain_shift.client_data(1).train.x, mnist_pool.x[indices["mnist-train:client1/train"]])
    val_counts = np.bincount(domain_shift.eval_sets("val")["syn"].labels_numpy(), minlength=10)
    assert val_counts.tolist() == [20] * 10  # stratified validation set


def test_domain_shift_subsets_and_resizing(embedded: dict[str, DomainSplits]) -> None:
    """Without private sizes a client gets the whole pool; test sets are balanced; images are resized."""
    scenario = DomainShiftScenario(
        domains=["uci", "syn"], private_sizes=None, test_per_domain=100, val_per_domain=50, public=None, image_size=16
    )
    assert scenario.public_data() is None and scenario.public_loader(0) is None
    assert len(scenario.client_data(0).train) == 1297 - 50  # whole remaining pool
    test = scenario.eval_sets("test")["syn"]
    assert len(test) == 100 and np.bincount(test.labels_numpy()).tolist() == [10] * 10
    assert scenario.client_data(1).train.x.shape[1:] == (3, 16, 16)


def test_seed_changes_splits_but_not_the_data(embedded: dict[str, DomainSplits]) -> None:
    """The seed changes the client splits but not the fixed test split."""
    kwargs = dict(domains=["mnist"], private_sizes=[100], public=None)
    first = DomainShiftScenario(seed=0, **kwargs).split_indices()
    again = DomainShiftScenario(seed=0, **kwargs).split_indices()
    other = DomainShiftScenario(seed=1, **kwargs).split_indices()
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["mnist-train:client0/train"], other["mnist-train:client0/train"])
    assert np.array_equal(first["mnist-test:mnist/test"], other["mnist-test:mnist/test"])  # fixed test split


def test_public_list_mixes_pools_in_equal_shares(embedded: dict[str, DomainSplits]) -> None:
    """A list of public pools is mixed in equal shares (the remainder to the first), unlabelled."""
    kwargs = dict(domains=["uci"], private_sizes=[10], public_size=301, image_size=16)
    mixed = DomainShiftScenario(public=["uci", "photos"], **kwargs).public_data()
    assert mixed is not None and len(mixed) == 301 and (mixed.y == -1).all()
    # 151 UCI images first (the remainder goes to the first pool), then 150 photos
    base = {k: v for k, v in kwargs.items() if k != "public_size"}
    whole_uci = DomainShiftScenario(public="uci", public_size=1297, **base)
    uci_pool = {bytes(image.numpy()) for image in whole_uci.public_data().x}
    assert all(bytes(image.numpy()) in uci_pool for image in mixed.x[:151])
    photos = DomainShiftScenario(public="photos", public_size=5000, **base)
    photo_pool = {bytes(image.numpy()) for image in photos.public_data().x}
    assert all(bytes(image.numpy()) in photo_pool for image in mixed.x[151:])
    again = DomainShiftScenario(public=["uci", "photos"], **kwargs).public_data()
    assert torch.equal(mixed.x, again.x)


def test_domain_shift_errors(embedded: dict[str, DomainSplits]) -> None:
    """Impossible sizes, mismatched lists, unknown or unlabelled domains are one-line DataErrors."""
    with pytest.raises(DataError, match="lower private_sizes, clients_per_domain or val_per_domain"):
        DomainShiftScenario(domains=["mnist"], private_sizes=[900], public=None).setup()
    with pytest.raises(DataError, match="give one size per domain"):
        DomainShiftScenario(domains=["mnist", "uci"], private_sizes=[10])
    with pytest.raises(DataError, match="unknown dataset 'svhn'"):
        DomainShiftScenario(domains=["svhn"], private_sizes=[10]).setup()
    with pytest.raises(DataError, match="unlabelled and cannot be a client domain"):
        DomainShiftScenario(domains=["photos"], private_sizes=[10], public=None).setup()
    with pytest.raises(DataError, match="public_size=6000 asks 6000 images of public dataset 'photos', which has"):
        DomainShiftScenario(domains=["uci"], private_sizes=[10], public_size=6000).setup()
    with pytest.raises(DataError, match="must list distinct dataset names"):
        DomainShiftScenario(domains=["uci"], private_sizes=[10], public=["uci", "uci"])
    with pytest.raises(DataError, match="test_per_domain=600 exceeds"):
        DomainShiftScenario(domains=["uci"], private_sizes=[10], test_per_domain=600, public=None).setup()
    with pytest.raises(DataError, match="client id 4 out of range"):
        DomainShiftScenario(domains=["uci"], private_sizes=[10], public=None).client_data(4)
    with pytest.raises(DataError, match="unknown evaluation split"):
        DomainShiftScenario(domains=["uci"], private_sizes=[10], public=None).eval_sets("train")


@pytest.mark.parametrize("pool_train_test", [True, False])
def test_label_skew_splits_are_disjoint_and_cover_the_pool(
    embedded: dict[str, DomainSplits], pool_train_test: bool
) -> None:
    """Label-skew splits are disjoint, cover the pool, and give each client 25% test and 10% validation."""
    partitioner = DirichletPartitioner(0.5, min_size=20)
    scenario = LabelSkewScenario(num_clients=5, partitioner=partitioner, pool_train_test=pool_train_test)
    assert scenario.kind == "label_skew" and scenario.domains == ["mnist"]
    unions = assert_disjoint_within_sources(scenario.split_indices())
    pool_size = 2000 if pool_train_test else 1000  # embedded mnist: 1000 train + 1000 test
    assert np.array_equal(np.sort(unions["pool"]), np.arange(pool_size))
    assert len(scenario.eval_sets("test")["global"]) == 500
    assert len(scenario.eval_sets("val")["global"]) == 250
    assert np.bincount(scenario.eval_sets("test")["global"].labels_numpy()).tolist() == [50] * 10
    for client_id in range(5):
        data = scenario.client_data(client_id)
        share = len(data.train) + len(data.val) + len(data.test)
        assert len(data.test) == int(np.ceil(0.25 * share))
        assert len(data.val) == int(np.ceil(0.1 * (share - len(data.test))))
        assert scenario.client_domain_index(client_id) == 0


def test_label_skew_local_splits_follow_the_client_distribution(embedded: dict[str, DomainSplits]) -> None:
    """A client's local test set holds only classes of its own training split."""
    scenario = LabelSkewScenario(num_clients=10, partitioner=PathologicalPartitioner(classes_per_client=2))
    for client_id in range(10):
        data = scenario.client_data(client_id)
        train_classes = set(data.train.labels_numpy().tolist())
        assert len(train_classes) == 2
        assert set(data.test.labels_numpy().tolist()) <= train_classes  # stratified local test


def test_label_skew_errors(embedded: dict[str, DomainSplits]) -> None:
    """Too large global sets, unreachable partitions or a bad test fraction are one-line DataErrors."""
    with pytest.raises(DataError, match="lower global_test_size or global_val_size"):
        LabelSkewScenario(global_test_size=1900, global_val_size=200).setup()
    with pytest.raises(DataError, match="in 3 draws .*raise beta, lower min_size or num_clients"):
        LabelSkewScenario(num_clients=20, partitioner=DirichletPartitioner(0.05, min_size=55, max_retries=3)).setup()
    with pytest.raises(DataError, match="needs 30 x 50 clients = 1500 samples but has 1250"):
        LabelSkewScenario(num_clients=50, partitioner=DirichletPartitioner(0.05, min_size=30)).setup()
    with pytest.raises(DataError, match="local_test_fraction must be in"):
        LabelSkewScenario(local_test_fraction=1.0)
    with pytest.raises(DataError, match="unlabelled"):
        LabelSkewScenario(dataset="photos").setup()


def test_describe_is_json_able(domain_shift: DomainShiftScenario, embedded: dict[str, DomainSplits]) -> None:
    """A scenario's description (clients, domains, counts, public data) serialises to JSON."""
    described = json.loads(json.dumps(domain_shift.describe()))
    assert described["kind"] == "domain_shift" and described["num_clients"] == 8
    assert described["clients"][2]["domain"] == "uci" and described["clients"][2]["train"] == 80
    assert sum(described["clients"][2]["train_class_counts"]) == 80
    assert described["public"] == {"name": "photos", "size": 1000}
    label_skew = LabelSkewScenario(num_clients=3, global_test_size=None)
    described = json.loads(json.dumps(label_skew.describe()))
    assert described["partitioner"]["name"] == "DirichletPartitioner"
    assert described["eval_sets"]["test"] == {"global": 1000}


def test_loaders(domain_shift: DomainShiftScenario) -> None:
    """Train loaders are seeded float batches; evaluation loaders keep the set's order."""
    train = domain_shift.train_loader(0, seed=5)
    assert isinstance(train, TensorBatchLoader) and len(train) == 3  # 150 images, batch 64
    x, y = next(iter(train))
    assert x.shape == (64, 3, 32, 32) and x.dtype == torch.float32
    again = next(iter(domain_shift.train_loader(0, seed=5)))[1]
    assert torch.equal(y, again)
    evaluation = domain_shift.eval_loader(domain_shift.eval_sets("test")["uci"])
    assert len(evaluation) == 1 and torch.equal(next(iter(evaluation))[1], domain_shift.eval_sets("test")["uci"].y)
    public = domain_shift.public_loader(seed=1)
    assert public is not None and len(public) == 4  # 1000 images, batch 256
    first = [x for x, _ in public]
    same = [x for x, _ in domain_shift.public_loader(seed=1)]  # every client sees the same augmented batch
    assert all(torch.equal(a, b) for a, b in zip(first, same, strict=True))
    unaugmented = TensorBatchLoader(domain_shift.public_data(), 256, shuffle=True, seed=1)
    assert not torch.equal(first[0], next(iter(unaugmented))[0])  # weak augmentation is applied


def test_train_loader_never_ends_with_a_single_image_batch(embedded: dict[str, DomainSplits]) -> None:
    """A trailing batch of a single image is dropped from training (BatchNorm)."""
    scenario = DomainShiftScenario(domains=["uci"], private_sizes=[65], public=None, batch_size=64)
    loader = scenario.train_loader(0, seed=0)
    assert [len(y) for _, y in loader] == [64]


class _LinearClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3 * 16 * 16, 10)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_client_datamodule_trains_standalone(embedded: dict[str, DomainSplits]) -> None:
    """A client's LightningDataModule trains and tests a model under a plain Trainer."""
    scenario = DomainShiftScenario(
        domains=["mnist", "syn"], private_sizes=[64, 64], public=None, image_size=16, augment=True
    )
    datamodule = scenario.client_datamodule(1)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_LinearClassifier(), datamodule=datamodule)
    assert trainer.global_step == 1
    results = trainer.test(_LinearClassifier(), datamodule=datamodule, verbose=False)
    assert set(results[0]) == {"test_loss"}
