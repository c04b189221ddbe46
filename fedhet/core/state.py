"""State helpers below the method contract and the round loop: copying, cloning, saving weights.

Method files, the loop and the generators all use these; they live here, beneath all of them,
so that no layer has to import another sideways (and no import cycle needs hiding).
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import torch

from fedhet.errors import CheckpointError
from fedhet.files import atomic_write_bytes


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then rename over ``path``.

    The object is serialised in memory first and written with one plain ``write``: torch's zip
    writer turns a full disk into ``RuntimeError: ... unexpected pos``, a plain write into
    ``ENOSPC``, which :func:`fedhet.files.atomic_write` reports in one line (temporary file removed).
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getbuffer())


def safe_torch_load(path: Path, what: str) -> Any:
    """``torch.load(weights_only=True)`` with a one-line error for missing or corrupt files."""
    if not path.is_file():
        raise CheckpointError(f"{what} not found at '{path}'; check the path or start a new run")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(
            f"{what} at '{path}' is corrupt or not a fedhet file ({type(exc).__name__}); "
            "delete it and resume from an earlier run directory, or start a new run"
        ) from None


def _clone_to_cpu(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _clone_to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_to_cpu(v) for v in value]
    return copy.deepcopy(value)


def clone_state(state: dict[str, Any]) -> dict[str, Any]:
    """A detached CPU copy of a (nested) state dict, safe to store while the module is reused."""
    return _clone_to_cpu(state)


def copy_state_into(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``module.load_state_dict(state)`` semantics at a fraction of the cost, for weight swapping.

    The round loop swaps client weights into live modules several times per client and round;
    ``load_state_dict`` walks the module tree with hooks and checks and costs about 3 ms for a
    small ResNet, copying tensor by tensor into ``state_dict(keep_vars=True)`` about 0.6 ms.
    Anything unusual (missing or unexpected keys, a shape mismatch) falls back to
    ``load_state_dict`` so errors read exactly as PyTorch's.
    """
    own = module.state_dict(keep_vars=True)
    if own.keys() != state.keys() or any(own[k].shape != state[k].shape for k in own):
        module.load_state_dict(state)
        return
    with torch.no_grad():
        for key, tensor in own.items():
            tensor.copy_(state[key])
