"""What makes a client LightningModule reusable outside the round loop (``docs/reuse.md``).

:class:`fedhet.algorithms.base.ClientModule` uses these once per module and once per upload:
its init arguments become Lightning hyperparameters (so ``load_from_checkpoint`` works), and
every ``make_upload`` a method defines is made safe to call from anywhere, not only from the
runtime (which already called it in eval mode under ``torch.no_grad``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.parsing import collect_init_args
from torch import Tensor, nn

from fedhet.core.payloads import Payload
from fedhet.hparams import plain

__all__ = ["detached_copy", "guarded_upload", "init_hyperparameters"]


def _given_hyperparameters() -> dict[str, Any] | None:
    """The hyperparameters ``LightningCLI`` hands the module it instantiates (``None`` otherwise).

    The CLI records the module's config (the backbone as ``class_path``/``init_args``) so that
    ``load_from_checkpoint(path)`` rebuilds everything; Lightning keeps them in a context variable
    that has no public accessor, hence the guarded lookup.
    """
    from lightning.pytorch.core.mixins import hparams_mixin

    given = getattr(hparams_mixin, "_given_hyperparameters", None)
    return given.get() if given is not None else None


def init_hyperparameters(frame: FrameType | None) -> dict[str, Any]:
    """The plain init arguments of a client's whole ``__init__`` chain, weights left out.

    Modules and tensors (the backbone, a generator, an ETF ...) are weights: the state dict
    restores them and ``load_from_checkpoint`` takes them again as arguments. Range-checked
    jsonargparse numbers become plain numbers so that checkpoints load with ``weights_only``.
    """
    values = _given_hyperparameters()
    if values is None:
        values = {}
        if frame is not None:
            for level in collect_init_args(frame, [], classes=(pl.LightningModule,)):
                values.update(level)
    return {k: plain(v) for k, v in values.items() if not isinstance(v, (nn.Module, Tensor))}


def detached_copy(upload: Payload, owner: nn.Module) -> Payload:
    """``upload`` with every tensor that tracks gradients or shares memory with ``owner`` copied.

    An upload must not change when the module trains on (the runtime reuses one module per
    architecture) nor carry an autograd graph into whoever receives it; tensors the method
    already built fresh (the usual case) are passed through without a copy.
    """
    owned = {t.untyped_storage().data_ptr() for t in (*owner.parameters(), *owner.buffers())}

    def detach(_: str, tensor: Tensor) -> Tensor:
        if tensor.requires_grad or tensor.untyped_storage().data_ptr() in owned:
            return tensor.detach().clone()
        return tensor

    return upload.map_tensors(detach)


def guarded_upload(make_upload: Callable[..., Payload | None]) -> Callable[..., Payload | None]:
    """Wrap a ``make_upload`` so that it is safe to call anywhere: eval mode, no autograd, detached result.

    Called outside ``torch.no_grad`` (directly on a module, not through the runtime), an upload
    computed from the model carried the model's autograd graph; a client that received it back
    (``on_receive``) then back-propagated its next fit's regulariser into that stale graph
    (wrong gradients on the first step, "backward through the graph a second time" on the
    second). In train mode it also updated BatchNorm statistics and used dropout.
    ``torch.no_grad`` rather than ``inference_mode``: received values take part in later losses.
    """

    @functools.wraps(make_upload)
    def guarded(self: nn.Module, train_batches: Iterable[Any]) -> Payload | None:
        modes = [(module, module.training) for module in self.modules()]
        self.eval()
        try:
            with torch.no_grad():
                upload = make_upload(self, train_batches)
        finally:
            for module, training in modes:
                module.training = training
        return None if upload is None else detached_copy(upload, self)

    guarded.__fedhet_guarded__ = True  # type: ignore[attr-defined]
    return guarded
