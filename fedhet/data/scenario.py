"""Federated scenarios: who holds which data, as Lightning data modules.

A scenario turns datasets into per-client splits once (``setup``), deterministically from its
``seed``, and then hands out loaders: a client's shuffled training batches, evaluation batches
for any split, and the public batches of public-data methods. Two families exist:

* :class:`DomainShiftScenario` (FCCL+ convention): every client belongs to a domain, holds a
  uniform random private subset of that domain's train pool, and is evaluated on every
  domain's test set (intra- and inter-domain accuracy).
* :class:`LabelSkewScenario` (HtFLlib/PFLlib convention): one dataset partitioned by label
  (Dirichlet, pathological, ...), each client's share split 75/25 into local train/test, plus
  held-out global validation and test sets.

Seeds: ``data_seed`` builds generated datasets (the embedded digits), ``seed`` draws every
split and partition. Keeping them apart lets a seed sweep vary partitions without rebuilding
or changing the test sets, as with a real dataset.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.pytorch import LightningDataModule

from fedhet.data.augment import BatchAugment, Compose, RandomCropPad, RandomHorizontalFlip
from fedhet.data.datasets import load_dataset
from fedhet.data.partitioners import (
    DirichletPartitioner,
    Partitioner,
    class_balanced_shards,
    sample_private_subsets,
    split_fraction,
    stratified_sample,
)
from fedhet.data.tensors import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TensorBatchLoader,
    TensorData,
    concat_tensor_data,
)
from fedhet.errors import DataError
from fedhet.seeding import derive_seed

__all__ = [
    "ClientData",
    "ClientDataModule",
    "DomainShiftScenario",
    "FederatedScenario",
    "LabelSkewScenario",
]

logger = logging.getLogger(__name__)

EVAL_SPLITS = ("val", "test")


class SealedSplit:
    """A test split that may not be read: its size is known, any access to its data raises.

    A tuning trial runs with the test splits sealed (``federation.seal_test``), so that no
    hyperparameter can be chosen on test numbers, by the tuner or by a method or metric that
    reads a test set by accident: the read stops the run, and the tuning with it, with one line
    naming the split (a read of test data is a bug to fix, not an outcome of the trial's values).
    """

    def __init__(self, what: str, size: int) -> None:
        self.what = what
        self.size = size

    def __len__(self) -> int:  # the size is metadata (``describe``), not test data
        return self.size

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("what", "size"):
            raise AttributeError(name)
        raise self.refusal()

    def __iter__(self) -> Any:
        raise self.refusal()

    def __getitem__(self, index: Any) -> Any:
        raise self.refusal()

    def refusal(self) -> DataError:
        return DataError(
            f"{self.what} was read while the test splits are sealed (federation.seal_test: a tuning "
            "trial selects on validation only); evaluate on test after tuning, with seal_test false"
        )


@dataclass(frozen=True, eq=False)
class ClientData:
    """Everything one client holds.

    Attributes:
        client_id: index of the client, ``0..num_clients-1``.
        domain: name of the client's domain (label skew: the dataset name).
        train: the client's private training data.
        val: the client's validation data (domain shift: its domain's validation set).
        test: the client's test data (domain shift: its domain's test set; label skew: its
            local test split).
    """

    client_id: int
    domain: str
    train: TensorData
    val: TensorData
    test: TensorData


@dataclass
class _Built:
    """What ``setup`` computes; the base class serves every accessor from it."""

    clients: list[ClientData]
    domains: list[str]
    client_domains: list[int]
    num_classes: int
    eval_sets: dict[str, dict[str, TensorData]]
    split_indices: dict[str, np.ndarray] = field(default_factory=dict)


def _weak_augment(image_size: int) -> Compose:
    """RandomCrop(pad 4 at 32 px, scaled with the image size) + horizontal flip."""
    return Compose([RandomCropPad(max(1, round(4 * image_size / 32))), RandomHorizontalFlip()])


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise DataError(f"{name} must be >= 1, got {value}")


class FederatedScenario(LightningDataModule):
    """Base class of federated scenarios: per-client data, evaluation sets and public data.

    Subclasses implement :meth:`_build`; everything else (loaders, accessors, ``describe``)
    lives here, so a new scenario is one method. All accessors call :meth:`setup` first, which
    is idempotent.

    Args:
        image_size: side of the square images clients see.
        batch_size: client training batch size.
        eval_batch_size: batch size of evaluation loaders.
        public: registered name of the public (unlabelled) dataset, a list of names (their
            pools mixed in equal shares: FCCL+'s public-data study, or an in-domain probe), or
            ``None``.
        public_size: number of public images (a seeded random subset of the public pool).
        public_batch_size: batch size of the public loader.
        seed: seed of every split, partition and subset.
        data_seed: build seed of generated datasets (embedded digits and photos).
        root: folder of paper datasets in their official on-disk layout.
        augment: apply RandomCrop(pad 4) + horizontal flip to client training batches.
    """

    kind: ClassVar[str] = ""
    """``"domain_shift"`` or ``"label_skew"``: decides which metrics apply (design section 4)."""

    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def __init__(
        self,
        *,
        image_size: int,
        batch_size: int,
        eval_batch_size: int,
        public: str | list[str] | None,
        public_size: int,
        public_batch_size: int,
        seed: int,
        data_seed: int,
        root: str | None,
        augment: bool,
    ) -> None:
        super().__init__()
        _positive(
            image_size=image_size,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            public_batch_size=public_batch_size,
        )
        if public is not None and public_size < 1:
            raise DataError(f"public_size must be >= 1, got {public_size}: or set public: null")
        if isinstance(public, list) and (not public or len(set(public)) != len(public) or public_size < len(public)):
            raise DataError(
                f"public={public} must list distinct dataset names, at most public_size={public_size} of them"
            )
        self.image_size = image_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.public = public
        self.public_size = public_size
        self.public_batch_size = public_batch_size
        self.seed = seed
        self.data_seed = data_seed
        self.root = root
        self.augment = augment
        self._built: _Built | None = None
        self._public_data: TensorData | None = None
        self.test_sealed = False

    # ---------------------------------------------------------------------------------------
    # Building
    # ---------------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Build every split (once; later calls return immediately)."""
        del stage  # the same splits serve fit, validate and test
        if self._built is not None:
            return
        built = self._build()
        public = self._load_public()
        self._built, self._public_data = built, public
        logger.info(
            "%s: %d clients, domains %s, %d classes, public=%s",
            type(self).__name__,
            len(built.clients),
            built.domains,
            built.num_classes,
            None if public is None else len(public),
        )

    @abstractmethod
    def _build(self) -> _Built:
        """Load the datasets and compute every client's splits."""

    def _load_public(self) -> TensorData | None:
        if self.public is None:
            return None
        names = [self.public] if isinstance(self.public, str) else list(self.public)
        # equal shares of public_size per named pool; the first pools take the remainder
        shares = [self.public_size // len(names) + (i < self.public_size % len(names)) for i in range(len(names))]
        parts = []
        for name, share in zip(names, shares, strict=False):
            pool = load_dataset(name, self.root, self.data_seed, self.image_size).train
            if share > len(pool):
                raise DataError(
                    f"public_size={self.public_size} asks {share} images of public dataset {name!r}, "
                    f"which has {len(pool)}: lower public_size"
                )
            key = "public-subset" if len(names) == 1 else f"public-subset/{name}"
            rng = np.random.default_rng(derive_seed(self.seed, key))
            parts.append(pool.subset(np.sort(rng.choice(len(pool), share, replace=False))).x)
        # Labelled sets (cifar100, tiny_imagenet, digit domains) double as public data: their
        # labels are dropped so no public-data method can use them by accident (FCCL+ never does).
        shapes = {name: tuple(part.shape[1:]) for name, part in zip(names, parts, strict=False)}
        if len(set(shapes.values())) > 1:
            raise DataError(f"public datasets {names} have different image shapes {shapes}: mix datasets of one shape")
        x = torch.cat(parts)
        return TensorData(x=x, y=torch.full((len(x),), -1, dtype=torch.long))

    @property
    def _state(self) -> _Built:
        self.setup()
        assert self._built is not None
        return self._built

    def _client(self, client_id: int) -> ClientData:
        clients = self._state.clients
        if not 0 <= client_id < len(clients):
            raise DataError(f"client id {client_id} out of range: use 0..{len(clients) - 1}")
        return clients[client_id]

    # ---------------------------------------------------------------------------------------
    # Shape of the scenario
    # ---------------------------------------------------------------------------------------

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return len(self._state.clients)

    @property
    def num_classes(self) -> int:
        """Number of classes of the (shared) label space."""
        return self._state.num_classes

    @property
    def in_channels(self) -> int:
        """Image channels (3 for every built-in dataset)."""
        return self._state.clients[0].train.image_shape[0]

    @property
    def domains(self) -> list[str]:
        """Evaluation domains: domain names (domain shift) or ``[dataset]`` (label skew)."""
        return list(self._state.domains)

    def client_data(self, client_id: int) -> ClientData:
        """Return the data of client ``client_id`` (its test split a :class:`SealedSplit` when sealed)."""
        client = self._client(client_id)
        if self.test_sealed:
            return replace(client, test=SealedSplit(f"client {client_id}'s test split", len(client.test)))
        return client

    def client_domain_index(self, client_id: int) -> int:
        """Return the index in :attr:`domains` of the client's own domain."""
        self._client(client_id)
        return self._state.client_domains[client_id]

    def eval_sets(self, split: str) -> dict[str, TensorData]:
        """Return the shared evaluation sets of ``split`` (``"val"`` or ``"test"``).

        Domain shift: one set per domain, in :attr:`domains` order (the columns of the
        client x domain accuracy matrix). Label skew: ``{"global": held-out set}``.
        """
        if split not in EVAL_SPLITS:
            raise DataError(f"unknown evaluation split {split!r}: use one of {list(EVAL_SPLITS)}")
        sets = dict(self._state.eval_sets[split])
        if split == "test" and self.test_sealed:
            return {name: SealedSplit(f"the {name} test set", len(data)) for name, data in sets.items()}
        return sets

    @property
    def evaluation_splits(self) -> tuple[str, ...]:
        """The splits clients and servers are scored on, in column order (validation alone when sealed)."""
        return ("val",) if self.test_sealed else ("test", "val")

    def seal_test(self) -> None:
        """Seal every test split, each client's and the shared ones, for a tuning trial (:class:`SealedSplit`).

        The splits are built as usual first, so a sealed run has the same partition, validation
        sets and initialisation as an open run of the same seed.
        """
        self.setup()
        self.test_sealed = True

    def public_data(self) -> TensorData | None:
        """Return the public unlabelled images (labels -1), or ``None`` without public data."""
        self.setup()
        return self._public_data

    def split_indices(self) -> dict[str, np.ndarray]:
        """Return the index arrays behind every split, for audits and disjointness tests.

        Keys are ``"<source>:<split>"``; indices with the same ``<source>`` point into the same
        array (e.g. ``"mnist-train:client0/train"`` and ``"mnist-train:mnist/val"``).
        """
        return {key: value.copy() for key, value in self._state.split_indices.items()}

    # ---------------------------------------------------------------------------------------
    # Loaders
    # ---------------------------------------------------------------------------------------

    def train_augment(self) -> BatchAugment | None:
        """The augmentation of client training batches (``None`` unless ``augment``)."""
        return _weak_augment(self.image_size) if self.augment else None

    def train_loader(self, client_id: int, seed: int) -> TensorBatchLoader:
        """Return client ``client_id``'s shuffled training loader, its order drawn from ``seed``.

        A last batch of exactly one image is dropped, because BatchNorm cannot train on it.
        """
        data = self._client(client_id).train
        return TensorBatchLoader(
            data,
            batch_size=self.batch_size,
            shuffle=True,
            seed=seed,
            drop_last=len(data) > 1 and len(data) % self.batch_size == 1,
            mean=self.mean,
            std=self.std,
            augment=self.train_augment(),
        )

    def eval_loader(self, data: TensorData) -> TensorBatchLoader:
        """Return an in-order, unaugmented loader over ``data`` with ``eval_batch_size``."""
        return TensorBatchLoader(
            data,
            batch_size=self.eval_batch_size,
            shuffle=False,
            seed=0,
            mean=self.mean,
            std=self.std,
        )

    def public_loader(self, seed: int, drop_last: bool = False) -> TensorBatchLoader | None:
        """Return the shuffled, weakly augmented public loader, or ``None`` without public data.

        Each batch is augmented once (RandomCrop pad 4 + horizontal flip, as in FCCL+'s code)
        and is the same for every client that iterates a loader with the same ``seed``, which
        lock-step methods need: row ``b`` must be the same image for all clients.

        Args:
            seed: seed of the batch order and augmentation.
            drop_last: drop a final short batch (FCCL+'s cross-correlation needs large batches).
        """
        data = self.public_data()
        if data is None:
            return None
        return TensorBatchLoader(
            data,
            batch_size=self.public_batch_size,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
            mean=self.mean,
            std=self.std,
            augment=_weak_augment(self.image_size),
        )

    def client_datamodule(self, client_id: int) -> ClientDataModule:
        """Return a data module of one client, to train a client module standalone."""
        self._client(client_id)
        return ClientDataModule(self, client_id)

    # ---------------------------------------------------------------------------------------
    # Summary
    # ---------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Return a JSON-able summary: sizes, domain and class counts per client, eval sets."""
        state = self._state
        public = self._public_data
        return {
            "scenario": type(self).__name__,
            "kind": self.kind,
            "num_clients": len(state.clients),
            "num_classes": state.num_classes,
            "image_size": self.image_size,
            "in_channels": self.in_channels,
            "domains": list(state.domains),
            "seed": self.seed,
            "data_seed": self.data_seed,
            "clients": [
                {
                    "client_id": client.client_id,
                    "domain": client.domain,
                    "train": len(client.train),
                    "val": len(client.val),
                    "test": len(client.test),
                    "train_class_counts": client.train.class_counts(state.num_classes),
                }
                for client in state.clients
            ],
            "eval_sets": {
                split: {name: len(data) for name, data in sets.items()}
                for split, sets in state.eval_sets.items()
            },
            "public": None if public is None else {"name": self.public, "size": len(public)},
            **self._describe_extra(),
        }

    def _describe_extra(self) -> dict[str, Any]:
        """Scenario-specific entries of :meth:`describe`."""
        return {}


class ClientDataModule(LightningDataModule):
    """One client's data as a plain Lightning data module (train, val and test loaders).

    Lets a client LightningModule be trained and evaluated on its own with a stock ``Trainer``
    or ``LightningCLI``, outside the federated loop.

    Args:
        scenario: the scenario that owns the data.
        client_id: the client.
        seed: seed of the training order (default: derived from the scenario seed and id).
    """

    def __init__(self, scenario: FederatedScenario, client_id: int, seed: int | None = None) -> None:
        super().__init__()
        self.scenario = scenario
        self.client_id = client_id
        self.seed = derive_seed(scenario.seed, "client-datamodule", client_id) if seed is None else seed

    def setup(self, stage: str | None = None) -> None:
        """Build the scenario (idempotent)."""
        self.scenario.setup(stage)

    def train_dataloader(self) -> TensorBatchLoader:
        """Shuffled, optionally augmented training batches of the client."""
        return self.scenario.train_loader(self.client_id, self.seed)

    def val_dataloader(self) -> TensorBatchLoader:
        """The client's validation set, in order."""
        return self.scenario.eval_loader(self.scenario.client_data(self.client_id).val)

    def test_dataloader(self) -> TensorBatchLoader:
        """The client's test set, in order."""
        return self.scenario.eval_loader(self.scenario.client_data(self.client_id).test)


class DomainShiftScenario(FederatedScenario):
    """Clients grouped by domain (FCCL+ Digits / Office style).

    Client ``c`` is in domain ``c // clients_per_domain``.

    Per domain: a stratified validation set of ``val_per_domain`` images comes out of the train
    pool first; the clients of the domain then get disjoint uniform random private subsets of
    what is left (FCCL+ draws them with a permutation, unstratified). Every client of a domain
    shares the domain's validation and test sets.

    The defaults are the embedded Digits-offline benchmark with FCCL+ Tab. V private sizes for
    MNIST/USPS (150/80) and CPU-sized ones for the two larger domains.

    Args:
        domains: registered dataset names, one per domain, in evaluation order.
        clients_per_domain: number of clients of every domain.
        private_sizes: private training images per client, one entry per domain; ``None``
            splits each domain's remaining pool evenly among its clients.
        val_per_domain: validation images per domain (stratified, disjoint from private data).
        test_per_domain: test images per domain (stratified subset); ``None`` = the full split.
        public: public dataset name, a list of names (mixed in equal shares) or ``None``.
        public_size: number of public images.
        image_size: side of the square images.
        batch_size: client training batch size.
        public_batch_size: public loader batch size.
        eval_batch_size: evaluation batch size.
        seed: seed of validation sets, private subsets and test subsets.
        data_seed: build seed of the embedded datasets.
        root: folder of paper datasets.
        augment: RandomCrop(pad 4) + horizontal flip on client training batches.
    """

    kind: ClassVar[str] = "domain_shift"

    def __init__(
        self,
        domains: list[str] = ["mnist", "uci", "mnistm", "syn"],  # noqa: B006 - copied below
        clients_per_domain: int = 1,
        private_sizes: list[int] | None = [150, 80, 1500, 1000],  # noqa: B006 - copied below
        val_per_domain: int = 200,
        test_per_domain: int | None = None,
        public: str | list[str] | None = "photos",
        public_size: int = 5000,
        image_size: int = 32,
        batch_size: int = 64,
        public_batch_size: int = 256,
        eval_batch_size: int = 512,
        seed: int = 0,
        data_seed: int = 0,
        root: str | None = None,
        augment: bool = False,
    ) -> None:
        super().__init__(
            image_size=image_size,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            public=public,
            public_size=public_size,
            public_batch_size=public_batch_size,
            seed=seed,
            data_seed=data_seed,
            root=root,
            augment=augment,
        )
        self.domain_names = list(domains)
        _positive(clients_per_domain=clients_per_domain)
        if not self.domain_names or len(set(self.domain_names)) != len(self.domain_names):
            raise DataError(f"domains must be a non-empty list of distinct names, got {self.domain_names}")
        if private_sizes is not None and len(private_sizes) != len(self.domain_names):
            raise DataError(
                f"private_sizes has {len(private_sizes)} entries for {len(self.domain_names)} "
                f"domains {self.domain_names}: give one size per domain (or null for whole pools)"
            )
        if val_per_domain < 0 or (test_per_domain is not None and test_per_domain < 1):
            raise DataError(
                f"val_per_domain={val_per_domain} must be >= 0 and test_per_domain={test_per_domain} "
                ">= 1 (or null for the full test split)"
            )
        self.clients_per_domain = clients_per_domain
        self.private_sizes = None if private_sizes is None else list(private_sizes)
        self.val_per_domain = val_per_domain
        self.test_per_domain = test_per_domain
        self.save_hyperparameters()

    def _build(self) -> _Built:
        clients: list[ClientData] = []
        client_domains: list[int] = []
        eval_sets: dict[str, dict[str, TensorData]] = {"val": {}, "test": {}}
        indices: dict[str, np.ndarray] = {}
        num_classes = 0
        for domain_index, name in enumerate(self.domain_names):
            splits = load_dataset(name, self.root, self.data_seed, self.image_size)
            if splits.num_classes == 0:
                raise DataError(f"dataset {name!r} is unlabelled and cannot be a client domain: remove it from domains")
            if num_classes and splits.num_classes != num_classes:
                raise DataError(
                    f"domain {name!r} has {splits.num_classes} classes but earlier domains have "
                    f"{num_classes}: domains must share one label space"
                )
            num_classes = splits.num_classes
            pool_labels = splits.train.labels_numpy()
            if self.val_per_domain > len(pool_labels):
                raise DataError(
                    f"val_per_domain={self.val_per_domain} exceeds the {len(pool_labels)} train "
                    f"images of domain {name!r}: lower val_per_domain"
                )
            val_rng = np.random.default_rng(derive_seed(self.seed, "val", name))
            val_index, remaining = stratified_sample(pool_labels, self.val_per_domain, val_rng)
            sizes = self._private_sizes(domain_index, name, len(remaining))
            subsets = sample_private_subsets(
                pool_labels[remaining], sizes, derive_seed(self.seed, "private", name)
            )
            test = splits.test
            test_index = np.arange(len(test))
            if self.test_per_domain is not None:
                if self.test_per_domain > len(test):
                    raise DataError(
                        f"test_per_domain={self.test_per_domain} exceeds the {len(test)} test "
                        f"images of domain {name!r}: lower it or use null for the full split"
                    )
                test_rng = np.random.default_rng(derive_seed(self.seed, "test", name))
                test_index, _ = stratified_sample(test.labels_numpy(), self.test_per_domain, test_rng)
                test = test.subset(test_index)
            val = splits.train.subset(val_index)
            eval_sets["val"][name] = val
            eval_sets["test"][name] = test
            indices[f"{name}-train:{name}/val"] = val_index
            indices[f"{name}-test:{name}/test"] = test_index
            for subset in subsets:
                client_id = len(clients)
                train_index = remaining[subset]
                indices[f"{name}-train:client{client_id}/train"] = train_index
                clients.append(
                    ClientData(client_id, name, splits.train.subset(train_index), val, test)
                )
                client_domains.append(domain_index)
        return _Built(clients, list(self.domain_names), client_domains, num_classes, eval_sets, indices)

    def _private_sizes(self, domain_index: int, name: str, available: int) -> list[int]:
        """Private sizes of the clients of one domain, checked against what the pool holds."""
        count = self.clients_per_domain
        if self.private_sizes is None:
            if available < count:
                raise DataError(
                    f"domain {name!r} has {available} train images left for {count} clients: "
                    "lower clients_per_domain or val_per_domain"
                )
            return [available // count + (i < available % count) for i in range(count)]
        size = self.private_sizes[domain_index]
        if size * count > available:
            raise DataError(
                f"domain {name!r} has {available} train images after {self.val_per_domain} "
                f"validation images, but {count} client(s) x {size} were asked: lower "
                "private_sizes, clients_per_domain or val_per_domain"
            )
        return [size] * count


class LabelSkewScenario(FederatedScenario):
    """One dataset partitioned by label among clients (HtFLlib / PFLlib / FedKTL style).

    Steps, all seeded: (1) the pool is train+test pooled (PFLlib) or the train split;
    (2) stratified global test and validation sets are held out (the global test comes from the
    official test split when not pooling); (3) the partitioner splits the rest among clients;
    (4) each client's share is split into local test (``local_test_fraction``, HtFLlib's 75/25)
    and local train, and a ``local_val_fraction`` of local train becomes local validation. The
    local splits are stratified by class where the counts allow.

    Args:
        dataset: registered dataset name.
        num_clients: number of clients.
        partitioner: how the pool is divided (default ``DirichletPartitioner(beta=0.1)``, a
            jsonargparse ``lazy_instance`` so ``--scenario.partitioner.init_args.beta=0.5``
            works without naming the class; partitioners are stateless, so sharing it is safe).
        pool_train_test: pool train and test before splitting (PFLlib convention).
        global_test_size: held-out global test images; ``None`` = as many as the official test
            split has (the whole official test split when not pooling).
        global_val_size: held-out global validation images (model selection, never test).
        local_test_fraction: fraction of each client's share used as its local test split.
        local_val_fraction: fraction of each client's local train part used for validation.
        public: public dataset name, a list of names (mixed in equal shares) or ``None``.
        public_size: number of public images.
        image_size: side of the square images.
        batch_size: client training batch size.
        public_batch_size: public loader batch size.
        eval_batch_size: evaluation batch size.
        seed: seed of held-out sets, partition and local splits.
        data_seed: build seed of the embedded datasets.
        root: folder of paper datasets.
        augment: RandomCrop(pad 4) + horizontal flip on client training batches.
        local_test: ``"share"`` (default): each client's local test split is
            ``local_test_fraction`` of its own share, so it follows the client's label skew
            (HtFLlib). ``"test_shards"``: the global test set is dealt out class-stratified into
            disjoint, class-balanced shards, one per client, and each client's whole share is
            training data (FedMD-CG's L.acc protocol, spec ``reference/fedmdcg.md`` section 5);
            needs ``pool_train_test: false`` and ignores ``local_test_fraction``.
    """

    kind: ClassVar[str] = "label_skew"

    def __init__(
        self,
        dataset: str = "mnist",
        num_clients: int = 10,
        partitioner: Partitioner = lazy_instance(DirichletPartitioner, beta=0.1),  # noqa: B008 - jsonargparse's lazy default
        pool_train_test: bool = True,
        global_test_size: int | None = 500,
        global_val_size: int = 250,
        local_test_fraction: float = 0.25,
        local_val_fraction: float = 0.1,
        public: str | list[str] | None = None,
        public_size: int = 5000,
        image_size: int = 32,
        batch_size: int = 64,
        public_batch_size: int = 256,
        eval_batch_size: int = 512,
        seed: int = 0,
        data_seed: int = 0,
        root: str | None = None,
        augment: bool = False,
        local_test: Literal["share", "test_shards"] = "share",
    ) -> None:
        super().__init__(
            image_size=image_size,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            public=public,
            public_size=public_size,
            public_batch_size=public_batch_size,
            seed=seed,
            data_seed=data_seed,
            root=root,
            augment=augment,
        )
        _positive(num_clients=num_clients)
        if global_val_size < 0 or (global_test_size is not None and global_test_size < 1):
            raise DataError(
                f"global_val_size={global_val_size} must be >= 0 and global_test_size="
                f"{global_test_size} >= 1 (or null)"
            )
        fractions = {"local_test_fraction": local_test_fraction, "local_val_fraction": local_val_fraction}
        for name, fraction in fractions.items():
            if not 0.0 <= fraction < 1.0:
                raise DataError(f"{name} must be in [0, 1), got {fraction}")
        self.dataset = dataset
        self.num_clients_requested = num_clients
        # describe() is a method, so on a jsonargparse lazy default it also runs the deferred
        # __init__: the partitioner is a complete object from here on.
        self.partitioner_config = partitioner.describe()
        self.partitioner = partitioner
        self.pool_train_test = pool_train_test
        self.global_test_size = global_test_size
        self.global_val_size = global_val_size
        self.local_test_fraction = local_test_fraction
        self.local_val_fraction = local_val_fraction
        if local_test not in ("share", "test_shards"):
            raise DataError(f"local_test={local_test!r}: use 'share' or 'test_shards'")
        if local_test == "test_shards" and pool_train_test:
            raise DataError("local_test='test_shards' deals out the official test split: set pool_train_test: false")
        self.local_test = local_test
        self.save_hyperparameters()

    def _build(self) -> _Built:
        splits = load_dataset(self.dataset, self.root, self.data_seed, self.image_size)
        if splits.num_classes == 0:
            raise DataError(f"dataset {self.dataset!r} is unlabelled: choose a labelled dataset")
        rng = np.random.default_rng(derive_seed(self.seed, "global-holdout"))
        test_size = len(splits.test) if self.global_test_size is None else self.global_test_size
        if self.pool_train_test:
            pool = concat_tensor_data([splits.train, splits.test])
            pool_labels = pool.labels_numpy()
            self._check_holdout(test_size + self.global_val_size, len(pool), "pooled train+test")
            test_index, rest = stratified_sample(pool_labels, test_size, rng)
            global_test = pool.subset(test_index)
            test_source = "pool"
        else:
            pool = splits.train
            pool_labels = pool.labels_numpy()
            self._check_holdout(test_size, len(splits.test), "official test split")
            self._check_holdout(self.global_val_size, len(pool), "train split")
            test_index, _ = stratified_sample(splits.test.labels_numpy(), test_size, rng)
            global_test = splits.test.subset(test_index)
            rest = np.arange(len(pool))
            test_source = "test"
        val_local, rest_after_val = stratified_sample(pool_labels[rest], self.global_val_size, rng)
        val_index, rest = rest[val_local], rest[rest_after_val]
        parts = self.partitioner.partition(
            pool_labels[rest], self.num_clients_requested, derive_seed(self.seed, "partition")
        )
        indices: dict[str, np.ndarray] = {
            f"{test_source}:global/test": test_index,
            "pool:global/val": val_index,
        }
        clients: list[ClientData] = []
        shards = (
            class_balanced_shards(global_test.labels_numpy(), len(parts), derive_seed(self.seed, "test-shards"))
            if self.local_test == "test_shards"
            else None
        )
        for client_id, part in enumerate(parts):
            share = rest[part]
            local_rng = np.random.default_rng(derive_seed(self.seed, "local-split", client_id))
            fraction = 0.0 if shards is not None else self.local_test_fraction
            test_local, train_local = split_fraction(pool_labels[share], fraction, local_rng)
            val_local, train_only = split_fraction(
                pool_labels[share[train_local]], self.local_val_fraction, local_rng
            )
            train_index = share[train_local][train_only]
            client_val_index = share[train_local][val_local]
            indices[f"pool:client{client_id}/train"] = train_index
            indices[f"pool:client{client_id}/val"] = client_val_index
            if shards is None:
                client_test_index = share[test_local]
                indices[f"pool:client{client_id}/test"] = client_test_index
                client_test = pool.subset(client_test_index)
            else:
                indices[f"{test_source}:client{client_id}/test"] = test_index[shards[client_id]]
                client_test = global_test.subset(shards[client_id])
            clients.append(
                ClientData(
                    client_id,
                    self.dataset,
                    pool.subset(train_index),
                    pool.subset(client_val_index),
                    client_test,
                )
            )
        eval_sets = {"val": {"global": pool.subset(val_index)}, "test": {"global": global_test}}
        return _Built(clients, [self.dataset], [0] * len(clients), splits.num_classes, eval_sets, indices)

    def _describe_extra(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "partitioner": self.partitioner_config}

    def _check_holdout(self, wanted: int, available: int, source: str) -> None:
        if wanted > available:
            raise DataError(
                f"dataset {self.dataset!r}: {wanted} held-out images asked from the {available} "
                f"of its {source}: lower global_test_size or global_val_size"
            )
