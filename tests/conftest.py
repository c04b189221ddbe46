"""Shared fixtures: tiny scenarios built from the embedded data, CPU Trainer templates.

Tests never touch the network: W&B is disabled and the embedded data cache goes to a
temporary directory unless ``FEDHET_CACHE`` is already set.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("MKL_DYNAMIC", "FALSE")  # fixed BLAS thread counts: identical numbers on a busy machine

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("FEDHET_CACHE", tempfile.mkdtemp(prefix="fedhet-test-cache-"))
# The suite runs on two xdist workers (pyproject.toml), which share 2 cores: one intra-op thread each.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))


def loop_args(kwargs: dict) -> dict:
    """``FederationLoop`` keyword arguments with the round-loop settings among them gathered into ``settings``.

    Test helpers take settings such as ``participation=2`` next to the loop's own arguments;
    the loop takes them as one :class:`~fedhet.federation.FederationSettings`.
    """
    import inspect

    from fedhet.federation import FederationSettings

    fields = set(inspect.signature(FederationSettings).parameters)
    settings = {key: kwargs[key] for key in kwargs if key in fields}
    rest = {key: value for key, value in kwargs.items() if key not in fields}
    return {**rest, "settings": FederationSettings(**settings)} if settings else rest


def tiny_domain_shift(**overrides):
    """A three-domain Digits scenario of 32 private images per client, with 64 public photos."""
    from fedhet.data import DomainShiftScenario

    kwargs = dict(
        domains=["mnist", "uci", "mnistm"],
        private_sizes=[32, 32, 32],
        val_per_domain=20,
        test_per_domain=40,
        public="photos",
        public_size=64,
        image_size=16,
        batch_size=16,
        public_batch_size=32,
        eval_batch_size=256,
        seed=0,
    )
    kwargs.update(overrides)
    return DomainShiftScenario(**kwargs)


def tiny_label_skew(**overrides):
    """A three-client Dirichlet(0.5) MNIST scenario with small global test and validation sets."""
    from fedhet.data import DirichletPartitioner, LabelSkewScenario

    kwargs = dict(
        dataset="mnist",
        num_clients=3,
        partitioner=DirichletPartitioner(beta=0.5, min_size=20),
        global_test_size=100,
        global_val_size=50,
        image_size=16,
        batch_size=16,
        eval_batch_size=256,
        seed=0,
    )
    kwargs.update(overrides)
    return LabelSkewScenario(**kwargs)


SCENARIOS = {"domain_shift": tiny_domain_shift, "label_skew": tiny_label_skew}


@pytest.fixture
def cpu_trainer():
    """A one-epoch CPU Trainer template."""
    from fedhet.federation.trainer import TrainerTemplate

    return TrainerTemplate(max_epochs=1, accelerator="cpu")


def tiny_overrides(scenario: str = "domain_shift") -> list[str]:
    """Command-line overrides that shrink an experiment config to seconds on CPU."""
    if scenario == "domain_shift":
        return [
            "--scenario.domains=[mnist, uci, mnistm]",
            "--scenario.private_sizes=[32, 32, 32]",
            "--scenario.val_per_domain=20",
            "--scenario.test_per_domain=40",
            "--scenario.image_size=16",
            "--scenario.batch_size=16",
            "--trainer.max_epochs=1",
            "--trainer.accelerator=cpu",
            "--models=tiny2",
        ]
    return [
        "--scenario.num_clients=3",
        "--scenario.global_test_size=100",
        "--scenario.global_val_size=50",
        "--scenario.image_size=16",
        "--scenario.partitioner.init_args.min_size=20",
        "--trainer.max_epochs=1",
        "--trainer.accelerator=cpu",
        "--models=tiny2",
    ]


@pytest.fixture
def fake_fit(tmp_path, monkeypatch):
    """The tuning tests' trials, local and on Ray, run the stand-in ``test_tuning.FAKE_FIT``, not fedhet fit.

    Returns the script's path: a test rewrites it to make a trial fail or stop.
    """
    import sys

    from fedhet.tuning import RowStudy
    from tests.test_tuning import FAKE_FIT

    script = tmp_path / "fake_fit.py"
    script.write_text(FAKE_FIT)
    original = RowStudy.command

    def command(self: RowStudy, number: int, params: dict) -> list[str]:
        return [sys.executable, str(script), *original(self, number, params)[4:]]

    monkeypatch.setattr(RowStudy, "command", command)
    return script
