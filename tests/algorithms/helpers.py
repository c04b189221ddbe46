"""Shared helpers of the per-method tests: a hand-computable model, server contexts, tiny loops, digests.

``TinyLinear`` is the model every hand-computed number in ``tests/algorithms`` is worked out on:
two input features, a bias-free linear ``body`` (the feature extractor) and a linear ``head``,
both the identity unless a test says otherwise, following the ``FeatureClassifier`` contract
(``forward_features``, ``forward_head``, ``num_features``). With identity weights the features
are the inputs and the logits are the features, so every expected value can be written down.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.core.payloads import Payload
from fedhet.federation import FederationLoop
from fedhet.federation.runtime import LossMeter
from fedhet.federation.trainer import TrainerTemplate, silence_lightning
from fedhet.models import resolve_family
from tests.conftest import SCENARIOS, loop_args, tiny_label_skew

#: SGD settings of the bit-for-bit "limit" runs (FedProx mu=0, MOON mu=0, FedRS alpha=1 against FedAvg).
SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}

#: Budgets whose paper defaults take minutes (pretraining, server epochs) shrink to a few steps in loops.
FAST = {
    "fccl": {"pretrain_epochs": 1},
    "feddf_server": {"distill_steps": 2},
    "fedftg": {"iterations": 2, "batch_size": 8, "noise_dim": 8, "generator_width": 8},
    "fedgen": {"generator_steps": 2},
    "fedgh": {"server_epochs": 2},
    "fedtgp": {"server_epochs": 2},
    "fedktl": {"server_epochs": 2},
    "fedmdcg": {"local_steps": 2, "server_steps": 2, "noise_dim": 8, "generator_hidden": (16, 16)},
    "fedcg": {"local_steps": 2, "server_steps": 2, "noise_dim": 8, "generator_hidden": (16, 16)},
    "fedvtc": {"finetune_rounds": 2, "finetune_epochs": 1, "synthetic_per_class": 4},
}


class TinyLinear(nn.Module):
    """Two features: ``features = body(x)``, ``logits = head(features)``; identity weights by default.

    Args:
        body: ``[2, 2]`` weight of the bias-free feature extractor (default: identity).
        head: ``[C, 2]`` weight of the head (default: the ``2 x 2`` identity).
        head_bias: ``[C]`` bias of the head, or ``None`` for a bias-free head.
    """

    num_features = 2

    def __init__(self, body: Tensor | None = None, head: Tensor | None = None, head_bias: Tensor | None = None) -> None:
        super().__init__()
        head = torch.eye(2) if head is None else head
        self.num_classes = int(head.shape[0])
        self.body = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, self.num_classes, bias=head_bias is not None)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2) if body is None else body)
            self.head.weight.copy_(head)
            if head_bias is not None:
                self.head.bias.copy_(head_bias)

    def forward_features(self, x: Tensor) -> Tensor:
        """``body(x)``, ``x`` flattened to ``[B, 2]`` first (so ``[B, 2, 1, 1]`` images work too)."""
        return self.body(x.flatten(1))

    def forward_head(self, z: Tensor) -> Tensor:
        """``head(z)``."""
        return self.head(z)

    def forward(self, x: Tensor) -> Tensor:
        """``head(body(x))``."""
        return self.forward_head(self.forward_features(x))


def context(
    num_classes: int = 2,
    num_clients: int = 2,
    initial: Mapping[str, Tensor] | Callable[[int], Mapping[str, Tensor]] | None = None,
    seed: int = 0,
    architectures: Sequence[str] | None = None,
    **fields: Any,
) -> ServerContext:
    """A :class:`ServerContext` whose clients all start from ``initial`` (a client module state dict, or one per id).

    ``architectures`` (default: all ``"x"``) also sets the client count; ``fields`` are further
    :class:`ServerContext` fields (``label_counts``, ``model_factory``, ``aggregate_states`` ...).
    """
    state = dict(initial) if isinstance(initial, Mapping) else {}
    initial_state = initial if callable(initial) else (lambda cid: state)
    architectures = tuple(architectures) if architectures is not None else ("x",) * num_clients
    return ServerContext(
        num_clients=len(architectures),
        num_classes=num_classes,
        architectures=architectures,
        seed=seed,
        initial_client_state=initial_state,
        **fields,
    )


def upload(client_id: int, payload: Payload) -> ClientUpload:
    """``payload`` as the server receives it from ``client_id``."""
    return ClientUpload(client_id, "x", payload)


def one_batch_loader(x: Tensor, y: Tensor) -> DataLoader:
    """A loader of exactly one batch ``(x, y)`` (unshuffled), for fits of one step."""
    return DataLoader(TensorDataset(x, y), batch_size=len(x), shuffle=False)


def fit(module: Any, loader: Any, **overrides: Any) -> LossMeter:
    """Fit ``module`` on ``loader`` with a lean CPU Trainer, as the round loop does (one epoch by default).

    Returns the runtime's loss accounting of the fit (mean and steps of the last epoch).
    """
    silence_lightning()
    meter = LossMeter()
    TrainerTemplate(max_epochs=1, accelerator="cpu").build(callbacks=[meter], **overrides).fit(
        module, train_dataloaders=loader
    )
    return meter


def label_skew_run(
    algorithm: Any, rounds: int = 2, seed: int = 0, architectures: Sequence[str] | None = None, **kwargs: Any
) -> tuple[FederationLoop, dict[str, Any]]:
    """Run ``algorithm`` on the tiny label-skew scenario (3 clients, ``cnn_tiny`` each unless given)."""
    scenario = tiny_label_skew()
    scenario.setup()
    architectures = list(architectures or ["cnn_tiny"] * scenario.num_clients)
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
    loop = FederationLoop(algorithm, scenario, architectures, trainer, rounds=rounds, seed=seed, **loop_args(kwargs))
    return loop, loop.run()


def assert_same_global_model(loop_a: FederationLoop, loop_b: FederationLoop) -> None:
    """Both loops' servers hold bit-identical global weights."""
    assert loop_a.server.global_weights.keys() == loop_b.server.global_weights.keys()
    for key, value in loop_a.server.global_weights.items():
        assert torch.equal(value, loop_b.server.global_weights[key]), key


# ---------------------------------------------------------------------- every registered method
def tiny_family(name: str) -> str:
    """The tiny model family a method runs on in tests: ``tiny2`` if heterogeneous, else ``tiny_homo``."""
    return "tiny2" if ALGORITHMS[name].capabilities.heterogeneous_models else "tiny_homo"


def tiny_loop(
    name: str,
    kind: str | None = None,
    family: str | None = None,
    trainer: TrainerTemplate | None = None,
    rounds: int = 2,
    seed: int = 0,
    method_args: dict[str, Any] | None = None,
    **kwargs: Any,
) -> FederationLoop:
    """A loop of registered method ``name`` on a tiny scenario of ``kind`` (default: its first kind).

    Label-skew scenarios get public photos when the method needs public data; methods that
    exchange features get a 16-d linear neck on every backbone. ``method_args`` override the
    method's arguments (after the fast budgets of :data:`FAST`).
    """
    caps = ALGORITHMS[name].capabilities
    kind = kind or caps.scenario_kinds[0]
    family = family or tiny_family(name)
    with_public = caps.needs_public_data and kind == "label_skew"
    public = {"public": "photos", "public_size": 64, "public_batch_size": 32} if with_public else {}
    scenario = SCENARIOS[kind](**public)
    scenario.setup()
    models = resolve_family(family)
    architectures = [models[c % len(models)] for c in range(scenario.num_clients)]
    return FederationLoop(
        ALGORITHMS[name](**{**FAST.get(name, {}), **(method_args or {})}),
        scenario,
        architectures,
        trainer or TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
        seed=seed,
        feature_dim=16 if caps.common_feature_dim else None,
        family_name=family,
        **loop_args(kwargs),
    )


# ---------------------------------------------------------------------- exact state comparison
def _digest(tensor: Tensor) -> str:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    payload = f"{tensor.dtype}{tuple(tensor.shape)}".encode() + raw.numpy().tobytes()
    return hashlib.sha256(payload).hexdigest()


def state_digests(value: Any, prefix: str = "") -> dict[str, str]:
    """One SHA-256 per tensor (dtype, shape and raw bytes) of a nested state, keyed by its path.

    Dicts, lists and tuples are walked (dict keys sorted); numbers, strings and ``None`` are kept
    as their ``repr``. Two states are bit-identical exactly when their digests are equal, and a
    difference names the entry that differs.
    """
    if isinstance(value, Tensor):
        return {prefix or ".": _digest(value)}
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for key in sorted(value, key=str):
            out.update(state_digests(value[key], f"{prefix}.{key}"))
        return out or {prefix or ".": "{}"}
    if isinstance(value, (list, tuple)):
        out = {}
        for index, item in enumerate(value):
            out.update(state_digests(item, f"{prefix}[{index}]"))
        return out or {prefix or ".": "[]"}
    return {prefix or ".": repr(value)}


def differing(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """Keys whose digests differ (or that only one side has), sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def saved_and_loaded(state: Any) -> Any:
    """``state`` after ``torch.save`` and a ``weights_only`` load, as the run directory round-trips checkpoints."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---------------------------------------------------------------------- head and prototype methods
FEATURE_DIM = 16  # K', the common feature size of the heterogeneous loops below
FLOAT_BYTES = 4
COUNT_BYTES = 8  # the int64 count (class id) sent with every held class's prototype


def head_context(num_classes: int, feature_dim: int, head_weight: Tensor | None = None) -> ServerContext:
    """A context whose clients start with a ``Linear(feature_dim, num_classes)`` head (zeros unless given)."""
    weight = head_weight if head_weight is not None else torch.zeros(num_classes, feature_dim)
    state = {"model.body.w": torch.zeros(1), "model.head.weight": weight, "model.head.bias": torch.zeros(num_classes)}
    return context(num_classes=num_classes, initial=state)


def assert_sized_by_client_zeros_head(build: Callable[[], Any], message: str) -> None:
    """A server whose width is client 0's head input: 3 read from a one-client context, a headless model refused.

    Only client 0 has an initial state here, so a server reading another client finds no head.
    """
    import pytest

    from fedhet.errors import ConfigError

    state = dict(head_context(num_classes=2, feature_dim=3).initial_client_state(0))
    server = build()
    server.setup_server(context(num_classes=2, num_clients=1, initial=lambda cid: state if cid == 0 else {}))
    assert server.dim == 3
    with pytest.raises(ConfigError) as error:
        build().setup_server(context(num_classes=2, initial={"model.body.w": torch.zeros(1)}))
    assert str(error.value) == message


def class_stats(values: Any, counts: Any, num_examples: int = 10) -> Payload:
    """A :class:`ClassStatsPayload` from nested lists."""
    from fedhet.core.payloads import ClassStatsPayload

    return ClassStatsPayload(values=torch.tensor(values), counts=torch.tensor(counts), num_examples=num_examples)


def separable_uploads(num_classes: int = 3, feature_dim: int = 4, clients: int = 4) -> list[ClientUpload]:
    """Noisy copies of one well-separated centre per class, every client holding every class but one."""
    generator = torch.Generator().manual_seed(0)
    centres = 3.0 * torch.eye(num_classes, feature_dim)
    uploads = []
    for client in range(clients):
        values = centres + 0.3 * torch.randn(num_classes, feature_dim, generator=generator)
        counts = torch.tensor([5] * num_classes)
        counts[(client + 1) % num_classes] = 0
        uploads.append(upload(client, class_stats(values.tolist(), counts.tolist())))
    return uploads


def heterogeneous_run(
    algorithm: Any, rounds: int = 1, family: Sequence[str] = ("cnn_tiny", "mlp_tiny")
) -> FederationLoop:
    """Run ``algorithm`` on the tiny label-skew scenario with two architectures and a 16-d feature neck."""
    scenario = tiny_label_skew()
    scenario.setup()
    architectures = [family[c % len(family)] for c in range(scenario.num_clients)]
    loop = FederationLoop(
        algorithm,
        scenario,
        architectures,
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
        seed=0,
        feature_dim=FEATURE_DIM,
    )
    loop.run()
    return loop


def held_classes(loop: FederationLoop, client_id: int) -> int:
    """How many classes a client's training split holds."""
    return int(loop.scenario.client_data(client_id).train.y.unique().numel())


def client_after_download(loop: FederationLoop, client_id: int, slot: int) -> Any:
    """The live module client ``client_id`` holds at the start of the next round (in a spare ``slot``)."""
    module = loop.runtime.module(loop.architectures[client_id], slot=slot)
    module.load_client_state(loop.store.get(client_id)["module"])
    module.on_receive(loop.server.download_for(client_id))
    return module


# ---------------------------------------------------------------------- lock-step public-data methods
PUBLIC_CLASSES = 10
PUBLIC_BATCH = 8


def public_clients(algorithm: Any, architectures: Sequence[str] = ("cnn_tiny", "mlp_tiny", "cnn_tiny")) -> list[Any]:
    """Client modules of ``algorithm`` on registered tiny models (10 classes, 3 channels), one seed each."""
    from fedhet.models import create_model

    clients = []
    for index, name in enumerate(architectures):
        torch.manual_seed(index)
        model = create_model(name, num_classes=PUBLIC_CLASSES, in_channels=3, seed=index)
        clients.append(algorithm.build_client(model, PUBLIC_CLASSES))
    return clients


def public_batches(seed: int = 0, steps: int = 1) -> DataLoader:
    """``steps`` identical unlabelled public batches of 8 random 16x16 images (labels -1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(PUBLIC_BATCH, 3, 16, 16, generator=generator)
    dataset = TensorDataset(x.repeat(steps, 1, 1, 1), torch.full((PUBLIC_BATCH * steps,), -1))
    return DataLoader(dataset, batch_size=PUBLIC_BATCH)


def first_images(loader: DataLoader) -> Tensor:
    """The images of a loader's first batch."""
    return next(iter(loader))[0]


def collaborate(algorithm: Any, clients: Sequence[Any], batches: Any, round_idx: int = 0) -> Any:
    """Fit the method's collaborative phase on ``batches`` exactly as the runtime does; returns the phase."""
    phase = algorithm.build_collaborative_phase(clients)
    phase.round_idx, phase.total_rounds = round_idx, 2
    torch.manual_seed(0)
    fit(phase, batches, max_steps=-1, limit_train_batches=None)
    return phase


@torch.no_grad()
def train_mode_logits(clients: Sequence[Any], x: Tensor) -> list[Tensor]:
    """Every client's logits on ``x`` in train mode (as the collaborative phase computes them)."""
    for client in clients:
        client.train()
    return [client(x) for client in clients]


def unlabelled(x: Tensor) -> DataLoader:
    """One public batch ``x`` with the -1 labels of unlabelled data."""
    return one_batch_loader(x, torch.full((len(x),), -1))
