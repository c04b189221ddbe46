"""Every client module is reusable outside the round loop (issue 16, item 8; ``docs/reuse.md``).

For every registered method, the client the method builds trains under a plain
``lightning.Trainer``, logs ``train/loss`` to the Trainer's logger, checkpoints, and
``type(client).load_from_checkpoint(path, model=..., <other module arguments>)`` restores its
state dict exactly; ``make_upload`` called directly on a module (train mode, gradients on) gives
what the runtime's call gives and leaves the next fit intact.
"""

from __future__ import annotations

import csv
import inspect
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.base import ClientModule, DataFormat
from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload
from fedhet.federation.trainer import silence_lightning
from fedhet.models import create_model
from fedhet.seeding import seeded
from tests.algorithms.helpers import FAST

METHODS = sorted(ALGORITHMS)
NUM_CLASSES = 4
#: Init arguments that are weights, not hyperparameters: passed again to ``load_from_checkpoint``.
WEIGHT_ARGUMENTS = {"model", "generator", "meme", "student", "small", "etf", "proxy", "vtc"}


def client_of(name: str, seed: int = 0) -> ClientModule:
    """The client module registered method ``name`` builds around a ``cnn_tiny`` (4 classes, RGB)."""
    model = create_model("cnn_tiny", num_classes=NUM_CLASSES, in_channels=3, seed=seed)
    algorithm = ALGORITHMS[name](**FAST.get(name, {}))
    # the runtime tells every method the data format before it builds clients (FedVTC sizes its decoder by it)
    algorithm.configure(DataFormat(image_size=16, channels=3, mean=(0.0,) * 3, std=(1.0,) * 3, num_classes=NUM_CLASSES))
    with seeded(seed):  # modules a client adds itself (FedKD's W_h, MOON's projection) draw from it
        return algorithm.build_client(model, NUM_CLASSES)


def loader(seed: int = 0) -> DataLoader:
    """Two batches of four random 16x16 images, every class present (unshuffled)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 3, 16, 16, generator=generator)
    return DataLoader(TensorDataset(x, torch.arange(8) % NUM_CLASSES), batch_size=4)


def trainer(root: Path, **overrides: Any) -> pl.Trainer:
    """A plain CPU ``lightning.Trainer`` (nothing from fedhet's TrainerTemplate), one epoch."""
    silence_lightning()
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "default_root_dir": str(root),
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(overrides)
    return pl.Trainer(**settings)


def weight_arguments(client: ClientModule) -> list[str]:
    """The client's init arguments that are not saved hyperparameters (modules and tensors).

    ``hp`` (the method's object) and ``**overrides`` are spelled out in the saved hyperparameters.
    """
    names = [p for p in inspect.signature(type(client).__init__).parameters if p not in ("self", "hp", "overrides")]
    return [name for name in names if name not in client.hparams]


def assert_same_state(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Same keys, dtypes and values, bit for bit."""
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key


def logged(root: Path, column: str) -> list[float]:
    """The values of ``column`` the CSVLogger under ``root`` wrote."""
    (path,) = root.glob("**/metrics.csv")
    with path.open() as handle:
        return [float(row[column]) for row in csv.DictReader(handle) if row.get(column)]


# ---------------------------------------------------------------------- 1 + 2: checkpoint, reload, log
@pytest.mark.parametrize("name", METHODS)
def test_client_trains_logs_checkpoints_and_reloads_standalone(name: str, tmp_path: Path) -> None:
    """A plain Trainer fits the client, logs train/loss, and load_from_checkpoint restores its state exactly."""
    client = client_of(name)
    assert not any(isinstance(v, (torch.nn.Module, Tensor)) for v in client.hparams.values())
    primitive = (bool, int, float, str, type(None))
    for value in client.hparams.values():  # plain values, or tuples of them (FedVTC's pixel statistics)
        assert type(value) in primitive or (type(value) is tuple and all(type(e) in primitive for e in value))
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints")
    fit = trainer(
        tmp_path, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[checkpoints], enable_checkpointing=True
    )
    fit.fit(client, loader())
    losses = logged(tmp_path, "train/loss_step")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    final = tmp_path / "final.ckpt"
    fit.save_checkpoint(final)

    # the user builds the weights-carrying arguments again (here: the method's own, another seed)
    names = weight_arguments(client)
    assert "model" in names and set(names) <= WEIGHT_ARGUMENTS
    template = client_of(name, seed=1)
    assert not torch.equal(template.model.head.weight, client.model.head.weight)
    # ModelCheckpoint's file (written at the epoch's end), then the one saved after fit (which
    # also holds what on_train_end changed: MOON's flag, FCCL's teacher snapshot)
    for path in (Path(checkpoints.best_model_path), final):
        arguments = {n: getattr(client_of(name, seed=1), n) for n in names}
        restored = type(client).load_from_checkpoint(path, weights_only=True, **arguments)
        assert type(restored) is type(client) and dict(restored.hparams) == dict(client.hparams)
        assert_same_state(restored.state_dict(), torch.load(path, weights_only=True)["state_dict"])
    assert_same_state(restored.state_dict(), client.state_dict())
    x = next(iter(loader(1)))[0]
    with torch.no_grad():
        assert torch.equal(restored.eval()(x), client.eval()(x))


def _declared_stages() -> list[tuple[str, str, str]]:
    """``(method, phase, stage)`` of every local stage a method declares beyond the default one."""
    found = []
    for name in METHODS:
        client = client_of(name)
        for phase in ("federation", *(p.name for p in ALGORITHMS[name](**FAST.get(name, {})).phases())):
            client.phase = phase
            found += [
                (name, phase, s.name) for s in client.local_stages() if (phase, s.name) != ("federation", "local")
            ]
    return found


@pytest.mark.parametrize(("name", "phase", "stage"), _declared_stages())
def test_every_declared_stage_logs_train_loss(name: str, phase: str, stage: str, tmp_path: Path) -> None:
    """Stages other than the default (FCCL's pretraining) log train/loss too under a Trainer with a logger."""
    client = client_of(name)
    client.phase, client.stage = phase, stage
    trainer(tmp_path, logger=CSVLogger(tmp_path), log_every_n_steps=1).fit(client, loader())
    assert len(logged(tmp_path, "train/loss_step")) == 2


def test_logger_less_trainer_logs_nothing(tmp_path: Path) -> None:
    """Without a logger (the round loop's lean Trainers) training_step does not call self.log."""
    client = client_of("fedproto")
    calls: list[str] = []
    client.log = lambda key, *args, **kwargs: calls.append(key)  # type: ignore[method-assign]
    trainer(tmp_path).fit(client, loader())
    assert calls == []


def test_hyperparameters_are_plain_numbers_whatever_the_algorithm_was_given() -> None:
    """Range-typed jsonargparse numbers handed to a client become plain floats in its hparams."""
    import yaml

    from fedhet.algorithms import FedProx
    from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat

    algorithm = FedProx(mu=NonNegativeFloat(0.5), lr=PositiveFloat(0.05), momentum=Momentum(0.9))
    client = algorithm.build_client(create_model("cnn_tiny", num_classes=NUM_CLASSES, seed=0), NUM_CLASSES)
    assert type(client.hp.mu) is float  # the declaration keeps plain numbers wherever they came from
    assert {k: type(client.hparams[k]) for k in ("mu", "lr", "momentum")} == dict.fromkeys(
        ("mu", "lr", "momentum"), float
    )
    assert yaml.safe_load(yaml.safe_dump(dict(client.hparams)))["mu"] == 0.5  # loggers' hparams.yaml


def test_command_line_methods_build_clients_with_plain_hyperparameters() -> None:
    """A method built by ``fedhet fit``'s parser hands plain numbers to its client's hparams."""
    from fedhet.config import build_experiment, build_parser
    from tests.conftest import tiny_overrides

    parser = build_parser()
    config_file = Path(__file__).resolve().parents[2] / "configs/experiments/digits/fedproto.yaml"
    config = parser.parse_args(["--config", str(config_file), *tiny_overrides(), "--method.lam=0.5", "--method.lr=0.2"])
    experiment = build_experiment(parser, config, logging_run=False)
    client = experiment.method.build_client(create_model("cnn_tiny", num_classes=10, seed=0), 10)
    assert client.hparams["lam"] == 0.5 and client.hparams["lr"] == 0.2
    assert all(type(v).__module__ == "builtins" for v in client.hparams.values())


def test_saving_hyperparameters_costs_little_per_module() -> None:
    """Building a client (once per architecture and once per client's initial state) stays cheap."""
    import time

    model = create_model("cnn_tiny", num_classes=NUM_CLASSES, seed=0)
    algorithm = ALGORITHMS["fedproto"]()
    algorithm.build_client(model, NUM_CLASSES)
    start = time.perf_counter()
    for _ in range(50):
        algorithm.build_client(model, NUM_CLASSES)
    assert (time.perf_counter() - start) / 50 < 0.01  # seconds; about 0.3 ms on a laptop core


# ---------------------------------------------------------------------- 3: make_upload anywhere
def _modes(module: torch.nn.Module) -> list[bool]:
    return [m.training for m in module.modules()]


def _storages(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


@pytest.mark.parametrize("name", METHODS)
def test_make_upload_called_directly_matches_the_runtime_and_keeps_the_next_fit_intact(
    name: str, tmp_path: Path
) -> None:
    """Train mode, gradients on, then on_receive(upload) and a fit: the same weights as the runtime's way."""
    direct, runtime_way = client_of(name), client_of(name)
    batches = list(loader())
    direct.train()
    before_modes, before_state = _modes(direct), {k: v.clone() for k, v in direct.state_dict().items()}
    upload = direct.make_upload(batches)  # as a user would call it: no no_grad, train mode
    assert _modes(direct) == before_modes  # modes restored, submodule by submodule
    assert_same_state(direct.state_dict(), before_state)  # no BatchNorm statistics updated

    runtime_way.eval()
    with torch.no_grad():
        expected = runtime_way.make_upload(batches)
    runtime_way.train()
    assert (upload is None) == (expected is None)
    if upload is not None and expected is not None:
        assert type(upload) is type(expected)
        tensors = dict(upload.tensors())
        assert tensors.keys() == dict(expected.tensors()).keys()
        for key, value in expected.tensors():
            assert torch.equal(tensors[key], value), key
        assert not any(t.requires_grad for t in tensors.values())
        assert not {t.untyped_storage().data_ptr() for t in tensors.values()} & _storages(direct)

    for client, payload in ((direct, upload), (runtime_way, expected)):
        client.on_receive(payload)
        torch.manual_seed(0)
        trainer(tmp_path, max_epochs=2).fit(client, loader())  # four steps: a stale graph fails on the second
    assert_same_state(direct.state_dict(), runtime_way.state_dict())


class _AliasingClient(ClientModule):
    """Uploads its live weights without copying them, and a parameter itself: the contract copies them."""

    def make_upload(self, train_batches: Any) -> Payload:
        head = self.model.head.weight
        return ClassStatsPayload(values=head, counts=torch.ones(head.shape[0], dtype=torch.long))


class _WeightsAliasingClient(ClientModule):
    """Uploads ``state_dict()`` views of its live weights."""

    def make_upload(self, train_batches: Any) -> Payload:
        return WeightsPayload(weights=self.model.state_dict())


@pytest.mark.parametrize("cls", [_AliasingClient, _WeightsAliasingClient])
def test_uploads_are_detached_copies_that_later_training_does_not_change(cls: type, tmp_path: Path) -> None:
    """An upload aliasing the module's weights is copied, so the next fit does not rewrite what was sent."""
    client = cls(create_model("cnn_tiny", num_classes=NUM_CLASSES, seed=0), NUM_CLASSES, lr=0.5)
    upload = client.make_upload(loader())
    sent = {k: v.clone() for k, v in upload.tensors()}
    assert not any(t.requires_grad for _, t in upload.tensors())
    trainer(tmp_path).fit(client, loader())
    assert all(torch.equal(t, sent[k]) for k, t in upload.tensors())
    head = sent["values" if cls is _AliasingClient else "weights.head.weight"]
    assert not torch.equal(client.model.head.weight.detach(), head)  # the module did train on


def test_make_upload_restores_modes_when_it_raises() -> None:
    """A failing upload still leaves the module in the mode it was called in."""

    class Failing(ClientModule):
        def make_upload(self, train_batches: Any) -> Payload:
            raise RuntimeError("no data")

    client = Failing(create_model("cnn_tiny", num_classes=NUM_CLASSES, seed=0), NUM_CLASSES).train()
    with pytest.raises(RuntimeError, match="no data"):
        client.make_upload([])
    assert all(_modes(client))
    assert torch.is_grad_enabled()
