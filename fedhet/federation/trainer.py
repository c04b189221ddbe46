"""Lean Lightning Trainers for client and server phases, built from one user-facing template.

A fresh Trainer is built per (client, round): construction costs about a millisecond, and a
Trainer shared across different modules is unsupported by Lightning (issue #12789, won't fix).
Every Trainer runs without logger, checkpointing, progress bar, model summary or sanity check;
the round loop does the logging once per round. Lightning rebuilds optimizers on every ``fit``,
so :class:`OptimizerStateCarrier` restores a client's optimizer state at the start of a fit and
captures it at the end (NVFlare's ``RestoreState`` pattern).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy

from fedhet.core.quiet import silence_lightning  # noqa: F401  (re-exported: the loop's callers use it)
from fedhet.core.state import clone_state
from fedhet.errors import ConfigError
from fedhet.hparams import Fraction, NonNegativeFloat, PositiveInt

_LEAN_FLAGS: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


#: How 4-D weights and activations are laid out in memory (``torch.memory_format``).
MemoryFormat = Literal["contiguous", "channels_last"]


def apply_memory_format(module: torch.nn.Module, memory_format: MemoryFormat) -> torch.nn.Module:
    """Lay ``module``'s 4-D parameters and buffers out as ``memory_format``, in place; returns it.

    ``channels_last`` (NHWC) lets oneDNN run convolutions, BatchNorm and pooling without
    reordering to its blocked layouts: 1.2-1.3x faster steps for the small CNNs of the CPU
    configs (``benchmarks/memory_format.py``, docs/performance.md). A convolution whose weight
    is channels-last makes its output channels-last, so inputs need no conversion. The math is
    the same, the summation order is not: numbers differ in the last bits from ``contiguous``,
    which is therefore the default (the results pages' runs). ``Module.to`` keeps every
    ``Parameter`` object, so optimizers built before the call still hold the module's parameters.
    """
    if memory_format == "channels_last":
        module.to(memory_format=torch.channels_last)
    return module


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module.to(device)`` unless its parameters are already there; returns it.

    ``Module.to`` walks every submodule, parameter and buffer even when nothing moves (about
    1.4 ms for a small ResNet); the runtime's live modules stay on the device between fits,
    uploads and evaluations, so the walk is skipped when the first parameter is already there.
    """
    first = next(module.parameters(), None)
    if first is None or first.device != device:
        module.to(device)
    return module


_DISCOVERY_CACHED = False


def cache_callback_discovery() -> None:
    """Scan Lightning's external-callback entry points once per process instead of once per Trainer.

    Every ``Trainer()`` looks up the ``lightning.pytorch.callbacks_factory`` entry points, which
    reads the metadata of every installed distribution: about 6 ms per Trainer here, more than
    the rest of its construction, and paid once per client per round. The entry points cannot
    change while the process runs, so the lookup is cached; the factories are still called for
    every Trainer, so each gets fresh callback instances exactly as before.
    """
    global _DISCOVERY_CACHED
    if _DISCOVERY_CACHED:
        return
    from importlib.metadata import entry_points

    from lightning.pytorch.trainer.connectors import callback_connector

    original = getattr(callback_connector, "_load_external_callbacks", None)
    if original is None:  # a Lightning version without the hook: nothing to cache
        return
    factories: dict[str, list[Any]] = {}

    def load_external_callbacks(group: str) -> list[Any]:
        if group not in factories:
            factories[group] = list(entry_points(group=group))
        callbacks: list[Any] = []
        for factory in factories[group]:
            made = factory.load()()
            callbacks.extend(made if isinstance(made, list) else [made] if made else [])
        return callbacks

    callback_connector._load_external_callbacks = load_external_callbacks  # type: ignore[attr-defined]
    _DISCOVERY_CACHED = True


class CachingCUDAAccelerator(CUDAAccelerator):
    """Lightning's CUDA accelerator without emptying PyTorch's caching allocator around every fit.

    Lightning's ``CUDAAccelerator`` calls ``torch.cuda.empty_cache()`` (and frees cuBLAS's
    workspaces) when a fit starts and again when it ends. A run makes one fit per client and
    round, so every client began with an empty cache and paid a ``cudaMalloc`` for each
    activation, gradient and optimizer buffer of its first steps, buffers the previous client
    had just released: on an H200 fedhet's sequential round took 2x a plain PyTorch loop's
    (``benchmarks/gpu_round.py``). Keeping the cache is what a plain loop does; memory a run no
    longer needs is still reused by the next fit, and ``torch.cuda.empty_cache()`` stays
    available to anyone who needs the memory back.
    """

    def setup(self, trainer: pl.Trainer) -> None:
        self.set_nvidia_flags(trainer.local_rank)

    def teardown(self) -> None:
        """Nothing to release: the allocator's cached blocks serve the next fit."""


class ResidentDeviceStrategy(SingleDeviceStrategy):
    """A single-device strategy that leaves a module where it trained.

    Lightning's strategy moves the module to the device when a fit starts and back to the CPU
    when it ends: two walks over every parameter and buffer, paid once per client per round.
    Here a module already on the device is not moved, and with ``keep_on_device`` (client fits)
    it stays on the device after the fit: the runtime's live module of an architecture serves
    one client after another there, with only the client's state copied in and out (as
    evaluation and uploads already left it). Server stages (``keep_on_device=False``) return to
    the CPU as in Lightning, because server code goes on to use their modules beside CPU
    tensors. It also lays the module out in the template's ``memory_format``
    (:func:`apply_memory_format`), so server stages get it as clients do.
    """

    def __init__(
        self, *args: Any, memory_format: MemoryFormat = "contiguous", keep_on_device: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.memory_format: MemoryFormat = memory_format
        self.keep_on_device = keep_on_device

    def model_to_device(self) -> None:
        assert self.model is not None
        on_device(self.model, self.root_device)
        apply_memory_format(self.model, self.memory_format)

    def teardown(self) -> None:
        if self.root_device.type != "cpu" and not self.keep_on_device:
            super().teardown()
            return
        # Strategy.teardown minus moving the module and optimizers to the CPU: the optimizers are
        # dropped with the Trainer (OptimizerStateCarrier kept CPU copies of their states).
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


class TrainerTemplate:
    """The familiar Trainer keys for every client fit (and server phase) of a run.

    Client modules stay on the device after a fit (:class:`ResidentDeviceStrategy`); a server
    stage's template returns its module to the CPU (:attr:`keep_on_device`).

    Args:
        max_epochs: local epochs per round (the paper's "local epochs").
        max_steps: local steps per round instead of epochs (``-1``: use ``max_epochs``).
        accelerator: ``"cpu"``, ``"gpu"``, ``"auto"`` ...
        devices: devices per client fit; the round loop runs one device per fit.
        precision: Lightning precision string, e.g. ``"32-true"``, ``"bf16-mixed"``.
        gradient_clip_val: clip gradients to this norm (``None``: no clipping).
        accumulate_grad_batches: gradient accumulation.
        limit_train_batches: cap batches per local epoch (int) or a fraction (float).
        deterministic: ``torch.use_deterministic_algorithms`` for each fit; ``"warn"`` uses the
            deterministic kernels where they exist and only warns about an operation that has
            none (on a GPU, ``index_add_`` and scatter-adds), where ``True`` stops the fit.
        memory_format: ``"contiguous"`` or ``"channels_last"``: the layout of every client
            module's 4-D weights, and so of its activations (:func:`apply_memory_format`). On
            CPUs ``channels_last`` makes small CNNs' steps 1.2-1.3x faster, with numbers that
            differ from ``contiguous`` in the last bits.
    """

    def __init__(
        self,
        max_epochs: int = 1,
        max_steps: int = -1,
        accelerator: str = "auto",
        devices: PositiveInt = 1,
        precision: str = "32-true",
        gradient_clip_val: NonNegativeFloat | None = None,
        accumulate_grad_batches: PositiveInt = 1,
        limit_train_batches: PositiveInt | Fraction | None = None,
        deterministic: bool | Literal["warn"] | None = None,
        memory_format: MemoryFormat = "contiguous",
    ) -> None:
        if devices != 1:
            raise ConfigError(
                f"trainer.devices={devices}: each client fit uses one device; run clients in parallel "
                "with federation.executor instead"
            )
        if max_epochs < 1 and max_steps < 1:
            raise ConfigError("trainer.max_epochs and trainer.max_steps are both < 1; set a local budget")
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.accelerator = accelerator
        self.devices = devices
        self.precision = precision
        self.gradient_clip_val = gradient_clip_val
        self.accumulate_grad_batches = accumulate_grad_batches
        self.limit_train_batches = limit_train_batches
        self.deterministic = deterministic
        self.memory_format: MemoryFormat = memory_format

    #: whether a fitted module stays on the accelerator (clients) or returns to the CPU (server stages)
    keep_on_device: bool = True

    def trainer_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments of a lean Trainer, with ``overrides`` (e.g. another budget) applied."""
        flags: dict[str, Any] = {
            **_LEAN_FLAGS,
            "max_epochs": self.max_epochs if self.max_steps < 0 else None,
            "max_steps": self.max_steps,
            "accelerator": self.accelerator,
            "devices": self.devices,
            "precision": self.precision,
            "gradient_clip_val": self.gradient_clip_val,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "limit_train_batches": self.limit_train_batches,
            "deterministic": self.deterministic,
            "limit_val_batches": 0,
        }
        flags.update(overrides)
        if flags["devices"] == 1 and "strategy" not in flags:
            device = self.device()
            flags["strategy"] = ResidentDeviceStrategy(
                device=device, memory_format=self.memory_format, keep_on_device=self.keep_on_device
            )
            flags.pop("devices")
            if device.type == "cuda":
                flags["accelerator"] = CachingCUDAAccelerator()
        return flags

    def build(self, callbacks: Sequence[Callback] = (), **overrides: Any) -> pl.Trainer:
        """A fresh lean Trainer."""
        cache_callback_discovery()
        return pl.Trainer(callbacks=list(callbacks), **self.trainer_kwargs(**overrides))

    def device(self) -> torch.device:
        """The device client fits and evaluation run on.

        An accelerator's device carries its index (``cuda:0``): Lightning's CUDA setup calls
        ``torch.cuda.set_device``, which refuses a bare ``cuda``, and parameters report
        ``cuda:0``, so only an indexed device lets :class:`ResidentDeviceStrategy` see that a
        module is already in place. One device per fit, so the index is the first device's.
        """
        if self.accelerator in ("gpu", "cuda") or (self.accelerator == "auto" and torch.cuda.is_available()):
            return torch.device("cuda", 0)
        if self.accelerator == "mps" or (self.accelerator == "auto" and torch.backends.mps.is_available()):
            return torch.device("mps", 0)
        return torch.device("cpu")


class ServerTrainerTemplate:
    """Hardware and numerics of every trained server stage (the ``server_trainer:`` config block).

    A server stage's *budget* is the method's own (generator steps, distillation steps, server
    epochs ...), declared by :meth:`fedhet.algorithms.base.RefineStage.refine_budget`; this
    template only says where and how stages run. The clients' ``trainer:`` block never applies
    to the server, so ``trainer.max_steps`` or ``limit_train_batches`` cannot cut a server stage short.

    Args:
        accelerator: ``"cpu"``, ``"gpu"``, ``"auto"`` ...
        precision: Lightning precision string, e.g. ``"32-true"``, ``"bf16-mixed"``.
        gradient_clip_val: clip the server stages' gradients to this norm (``None``: no clipping).
        deterministic: ``torch.use_deterministic_algorithms`` for each server fit.
        memory_format: the layout of the modules of every server fit (``trainer.memory_format``).
    """

    def __init__(
        self,
        accelerator: str = "auto",
        precision: str = "32-true",
        gradient_clip_val: float | None = None,
        deterministic: bool | Literal["warn"] | None = None,
        memory_format: MemoryFormat = "contiguous",
    ) -> None:
        self._template = TrainerTemplate(
            accelerator=accelerator,
            precision=precision,
            gradient_clip_val=gradient_clip_val,
            deterministic=deterministic,
            memory_format=memory_format,
        )
        self._template.keep_on_device = False  # server code uses its modules beside CPU tensors after a fit
        self.accelerator = accelerator
        self.precision = precision
        self.gradient_clip_val = gradient_clip_val
        self.deterministic = deterministic
        self.memory_format: MemoryFormat = memory_format

    def build(self, epochs: int | None, steps: int | None) -> pl.Trainer:
        """A fresh lean Trainer with the stage's budget: ``steps`` optimisation steps, else ``epochs`` passes."""
        if steps is not None:
            return self._template.build(max_epochs=-1, max_steps=steps)
        return self._template.build(max_epochs=epochs if epochs is not None else 1, max_steps=-1)

    def device(self) -> torch.device:
        """The device server stages run on."""
        return self._template.device()


class OptimizerStateCarrier(Callback):
    """Restore optimizer state when a fit starts and capture it when training ends.

    Lightning calls ``configure_optimizers`` on every ``fit``, so without this a client's
    momentum or Adam moments would silently restart every round.

    Args:
        states: one optimizer ``state_dict`` per optimizer of the module, or ``None`` for fresh
            optimizers (the first round of a client).
    """

    def __init__(self, states: list[dict[str, Any]] | None) -> None:
        self.states = states

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.states is None:
            return
        if len(self.states) != len(trainer.optimizers):
            self.states = None
            return
        for optimizer, state in zip(trainer.optimizers, self.states, strict=False):
            optimizer.load_state_dict(state)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states = [clone_state(optimizer.state_dict()) for optimizer in trainer.optimizers]
