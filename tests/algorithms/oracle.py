"""Shared pieces of the one-step oracles (``tests/algorithms/test_oracle_<method>.py``).

An oracle test runs one client step (every local stage) and one server step (aggregate, then
every refine stage) of a method *through fedhet's public surface only*: the Algorithm built
with its config keyword arguments, ``build_client`` / ``build_server``, the
:class:`~fedhet.algorithms.base.ClientModule` and :class:`~fedhet.algorithms.base.ServerPhase`
hooks, driven exactly as :class:`fedhet.federation.runtime.ClientRuntime` and
``FederationLoop._server_round`` drive them (mirrored below, because those drivers need a whole
scenario). It then compares every parameter and buffer with a plain-PyTorch re-implementation
of the same step written in the test from the paper's equations. The oracles never call
``fedhet.functional`` and never read a method object's private attributes, so a rewrite of a
method's internals keeps them valid while any change of its arithmetic fails them.

The plain-PyTorch side uses the hand-written optimizers below (:func:`sgd_step`,
:class:`AdamOracle`) rather than ``torch.optim``, so a wrong learning rate, weight decay or
schedule in the method's ``configure_optimizers`` is caught too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import ClientModule, ClientUpload, LocalStage, ServerPhase
from fedhet.core.payloads import Payload
from fedhet.federation.trainer import OptimizerStateCarrier, TrainerTemplate, silence_lightning
from fedhet.seeding import seeded

ATOL = 1e-6


class TinyBNNet(nn.Module):
    """A tiny CNN with BatchNorm (running statistics are state the oracles check too).

    ``conv3x3(C -> 2) -> BN -> ReLU -> avgpool to 2x2 -> flatten (8 features) -> Linear(8, M)``,
    following the ``FeatureClassifier`` contract (``forward_features``, ``forward_head``,
    ``num_features``).
    """

    num_features = 8

    def __init__(self, channels: int = 1, num_classes: int = 4, seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
            self.conv = nn.Conv2d(channels, 2, 3, padding=1)
            self.bn = nn.BatchNorm2d(2)
            self.head = nn.Linear(8, num_classes)
            with torch.no_grad():  # non-trivial affine BN parameters and running statistics
                self.bn.weight.uniform_(0.5, 1.5)
                self.bn.bias.uniform_(-0.2, 0.2)
                self.bn.running_mean.uniform_(-0.1, 0.1)
                self.bn.running_var.uniform_(0.8, 1.2)
        self.num_classes = num_classes

    def forward_features(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return nn.functional.adaptive_avg_pool2d(h, 2).flatten(1)

    def forward_head(self, z: Tensor) -> Tensor:
        return self.head(z)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def batch(seed: int, size: int = 6, channels: int = 1, image: int = 8, num_classes: int = 4) -> tuple[Tensor, Tensor]:
    """A fixed batch of ``size`` images and labels (every class once before repeating)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, channels, image, image, generator=generator)
    y = torch.arange(size) % num_classes
    return x, y[torch.randperm(size, generator=generator)]


# ---------------------------------------------------------------------- driving fedhet
class RngRecorder(Callback):
    """Records the global RNG state as each training step starts (it changes nothing).

    A method that draws noise or labels from the global RNG inside ``training_step`` (FedMD-CG,
    FedVTC) is reproduced by restoring the recorded state and drawing in the same order; what
    Lightning and the DataLoader consume before the step is then irrelevant to the oracle.
    """

    def __init__(self) -> None:
        self.states: list[Tensor] = []
        self.batches: list[Any] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.states.append(torch.get_rng_state())
        self.batches.append([t.detach().clone() for t in batch])


def stage_trainer(stage: LocalStage, template: TrainerTemplate, callbacks: Sequence[Callback] = ()) -> Any:
    """The Trainer the runtime builds for a local stage (``ClientRuntime._stage_trainer``)."""
    if stage.epochs is None and stage.steps is None:
        return template.build(callbacks=callbacks)
    if stage.steps is not None:
        return template.build(callbacks=callbacks, max_epochs=-1, max_steps=stage.steps)
    return template.build(callbacks=callbacks, max_epochs=stage.epochs, max_steps=-1)


def client_step(
    module: ClientModule,
    download: Payload | None,
    data: tuple[Tensor, Tensor],
    round_idx: int = 0,
    total_rounds: int = 4,
    state: Mapping[str, Tensor] | None = None,
    num_examples: int | None = None,
    phase: str = "federation",
    upload: bool = True,
    rng: dict[str, list[Tensor]] | None = None,
    optimizers: dict[str, Any] | None = None,
    batches: dict[str, list[Any]] | None = None,
    epochs: int = 1,
    batch_size: int | None = None,
) -> Payload | None:
    """One client's round as ``ClientRuntime.fit_client`` runs it, on one fixed batch.

    ``load_client_state`` (when ``state`` is given) -> ``on_receive`` -> one lean fit per local
    stage (the stage's name set, manual optimisation as declared, the stage's budget, its
    ``stage_dataloader``) -> ``make_upload``. The one-batch loader is not shuffled, so a budget
    of one epoch is one optimisation step. ``rng`` receives, per stage name, the global RNG state
    at the start of every step (:class:`RngRecorder`). ``optimizers`` is the client's carried
    optimizer state per stage (``federation.persist_optimizer_state``), read and updated in place
    as the runtime does with :class:`OptimizerStateCarrier`; ``None``: fresh optimizers.
    ``batch_size`` cuts the fixed data into unshuffled batches in order (default: one batch).
    """
    silence_lightning()
    if state is not None:
        module.load_client_state(dict(state))
    module.round_idx, module.total_rounds, module.phase = round_idx, total_rounds, phase
    module.on_receive(download)
    template = TrainerTemplate(max_epochs=epochs, accelerator="cpu")  # the trainer: budget (``epochs`` passes)
    stages = list(module.local_stages())
    for index, stage in enumerate(stages):
        module.stage = stage.name
        module.automatic_optimization = not stage.manual
        seed = 1000 + index
        recorder = RngRecorder()
        carrier = OptimizerStateCarrier(optimizers.get(stage.name) if optimizers is not None else None)
        with seeded(seed):
            private = DataLoader(TensorDataset(*data), batch_size=batch_size or len(data[0]), shuffle=False)
            loader = module.stage_dataloader(private, seed)
            stage_trainer(stage, template, [carrier, recorder]).fit(module, train_dataloaders=loader)
        if rng is not None:
            rng[stage.name] = recorder.states
        if batches is not None:  # the batches each step trained on, in order (shuffled stages)
            batches[stage.name] = recorder.batches
        if optimizers is not None:
            optimizers[stage.name] = carrier.states
    module.stage = stages[0].name if stages else "local"
    if not upload:
        return None
    payload = module.make_upload([data])
    if payload is None:
        return None
    return dataclasses.replace(payload, num_examples=num_examples if num_examples is not None else len(data[0]))


def server_step(
    server: ServerPhase, round_idx: int, uploads: Sequence[ClientUpload], seed: int = 77
) -> list[RngRecorder | None]:
    """``FederationLoop._server_round``: aggregate, then fit every refine stage that wants to.

    Refine stage ``i`` gets seed ``seed + i`` (the loop derives them from the run seed the same
    way, index 0 first) and the budget it declares, on a Trainer of the server template's
    defaults (``ServerTrainerTemplate`` builds the same lean Trainer; it takes no callbacks).
    Returns each stage's :class:`RngRecorder` (``None``: skipped).
    """
    silence_lightning()
    server.aggregate(round_idx, uploads)
    template = TrainerTemplate(accelerator="cpu")
    used: list[RngRecorder | None] = []
    for index, stage in enumerate(server.refine_stages()):
        if not stage.should_refine():
            used.append(None)
            continue
        stage_seed = seed + index
        budget = stage.refine_budget()
        recorder = RngRecorder()
        with seeded(stage_seed):
            loader = stage.server_dataloader(stage_seed)
            epochs = budget.epochs if budget.epochs is not None else 1
            flags = (
                {"max_epochs": -1, "max_steps": budget.steps}
                if budget.steps is not None
                else {"max_epochs": epochs, "max_steps": -1}
            )
            template.build(callbacks=[recorder], **flags).fit(stage, train_dataloaders=loader)
        used.append(recorder)
    return used


# ---------------------------------------------------------------------- plain-PyTorch optimisers
@torch.no_grad()
def sgd_step(params: Iterable[Tensor], lr: float, weight_decay: float = 0.0) -> None:
    """``p <- p - lr (grad + wd p)`` for every parameter with a gradient; gradients cleared."""
    for p in params:
        if p.grad is None:
            continue
        p.sub_(lr * (p.grad + weight_decay * p))
        p.grad = None


class AdamOracle:
    """Adam (Kingma & Ba, Algorithm 1, default betas and eps) on a fixed list of parameters."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        decoupled: bool = False,
    ):
        self.params = list(params)
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.decoupled = decoupled  # AdamW (Loshchilov & Hutter): w <- w (1 - lr wd), not wd w in the gradient
        self.state: dict[int, tuple[int, Tensor, Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            t, m, v = self.state.get(i, (0, torch.zeros_like(p), torch.zeros_like(p)))
            t += 1
            if self.decoupled:
                p.mul_(1 - self.lr * self.weight_decay)
                g = p.grad
            else:
                g = p.grad + self.weight_decay * p  # L2 (torch.optim.Adam's weight_decay), not AdamW
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))
            self.state[i] = (t, m, v)
            p.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


# ---------------------------------------------------------------------- comparison
def assert_states_close(
    actual: Mapping[str, Tensor], expected: Mapping[str, Tensor], what: str, atol: float = ATOL, rtol: float = 0.0
) -> None:
    """Same keys, every tensor within ``atol + rtol |expected|`` (integers exactly); the message names the entry."""
    assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
    for key, value in expected.items():
        got = actual[key].detach().cpu()
        value = value.detach().cpu()
        assert got.shape == value.shape, f"{what}[{key}]: shape {tuple(got.shape)} != {tuple(value.shape)}"
        if not value.is_floating_point():
            assert torch.equal(got, value.to(got.dtype)), f"{what}[{key}]: {got} != {value}"
            continue
        excess = (got.double() - value.double()).abs() - rtol * value.double().abs()
        error = excess.max().item() if value.numel() else 0.0
        assert error <= atol, f"{what}[{key}]: max |difference| {error:.3g} > {atol} (+ {rtol} |value|)"


def assert_moved(before: Mapping[str, Tensor], after: Mapping[str, Tensor], what: str, least: float = 1e-4) -> None:
    """Some floating entry moved by more than ``least`` (an oracle of a step that does nothing proves nothing)."""
    moved = max(
        ((after[k].double() - v.double()).abs().max().item() for k, v in before.items() if v.is_floating_point()),
        default=0.0,
    )
    assert moved > least, f"{what}: the step moved nothing (max change {moved:.3g})"


def prefixed(state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """``{prefix + key: value}``."""
    return {prefix + k: v for k, v in state.items()}


def without_prefix(state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries under ``prefix``, the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def clone(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A deep copy of a state dict."""
    return {k: v.detach().clone() for k, v in state.items()}


def example_weighted_mean(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """``sum_k (w_k / sum w) state_k`` per entry in float64; integer entries rounded (FedAvg, McMahan et al.)."""
    total = float(sum(weights))
    out = {}
    for key, first in states[0].items():
        mean = sum(float(w) / total * s[key].double() for s, w in zip(states, weights, strict=True))
        out[key] = mean.to(first.dtype) if first.is_floating_point() else torch.round(mean).to(first.dtype)
    return out


def scaled_before_batch_norm(
    state: Mapping[str, Tensor], layers: Sequence[tuple[str, str]], factor: float = 1e3
) -> dict[str, Tensor]:
    """``state`` with each ``(layer, its BatchNorm)`` pair rescaled by ``factor`` (same function, better conditioned).

    A layer's bias feeding a BatchNorm in train mode has a gradient that is zero in exact
    arithmetic and float32 rounding noise in practice; Adam divides by ``sqrt(v)``, which turns that
    noise into steps of about ``lr``, different in any two correct implementations (and the
    BatchNorm's running mean, used in eval mode, records them). Multiplying the layer's weight and
    bias by ``factor`` (with the BatchNorm's running mean by ``factor`` and running variance by
    ``factor**2``) leaves the network's function in train and eval mode unchanged (up to BN's eps)
    and makes that noise ``factor`` times smaller than Adam's ``eps``.
    """
    out = clone(state)
    for layer, norm in layers:
        out[f"{layer}.weight"] *= factor
        out[f"{layer}.bias"] *= factor
        out[f"{norm}.running_mean"] *= factor
        out[f"{norm}.running_var"] *= factor**2
    return out


def collaborative_step(
    algorithm: Any,
    clients: Sequence[ClientModule],
    loader: Any,
    round_idx: int = 0,
    recorder: RngRecorder | None = None,
    drop_invalid: bool = False,
    value_bound: float | None = None,
) -> Any:
    """The lock-step collaborative phase as ``ClientRuntime._collaborate`` runs it; returns the phase.

    ``algorithm.build_collaborative_phase`` over the live client modules, fitted for
    ``algorithm.collaborative_epochs()`` passes over ``loader`` (not shuffled) on a lean CPU Trainer.
    ``recorder`` (optional) receives the global RNG state each public step started with;
    ``drop_invalid`` and ``value_bound`` are what the runtime sets from ``federation.on_invalid_upload``
    and ``federation.upload_value_bound``.
    """
    silence_lightning()
    phase = algorithm.build_collaborative_phase(list(clients))
    phase.round_idx, phase.total_rounds = round_idx, 4
    phase.drop_invalid, phase.value_bound = drop_invalid, value_bound
    template = TrainerTemplate(accelerator="cpu")
    trainer = template.build(
        callbacks=[recorder] if recorder is not None else [],
        max_epochs=algorithm.collaborative_epochs(),
        max_steps=-1,
        limit_train_batches=None,
    )
    with seeded(2000):
        trainer.fit(phase, train_dataloaders=loader)
    return phase


def unlabelled_loader(images: Sequence[Tensor]) -> DataLoader:
    """One unshuffled batch per entry of ``images`` (labels -1, as public data carries none)."""
    x = torch.cat(list(images))
    return DataLoader(TensorDataset(x, torch.full((len(x),), -1)), batch_size=len(images[0]), shuffle=False)
