"""The pretrained generator's artifact: where it lives, how it is written, checked, loaded and locked.

Artifact ``<name>``, under ``<cache>/generators/`` (``$FEDHET_CACHE`` or ``~/.cache/fedhet``):

* ``<name>.pt``: the EMA generator's state dict only (loaded with ``weights_only=True``);
* ``<name>.json``: architecture config, training settings, wall time and the sha256 of
  ``<name>.pt`` (written last, so a half-written artifact is never taken for a complete one);
  loading verifies the checksum;
* ``<name>.png``: an 8x8 grid of samples for a human to check.

Building holds an exclusive lock on ``<cache>/generators/.<name>.lock`` (``fcntl.flock`` where the
platform has it) and every file is written to a temporary file and renamed (``os.replace``), so
two processes that need the same missing artifact at once build it once and both load it whole.
Training is :mod:`fedhet.generators.pretrain`; the command, :mod:`fedhet.generators.command`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch

from fedhet.core.state import atomic_torch_save, safe_torch_load
from fedhet.errors import CheckpointError, ConfigError
from fedhet.files import atomic_write_text
from fedhet.generators.base import DEFAULT_GENERATOR, check_artifact_name, generators_dir
from fedhet.generators.stylegan import StyleGenerator, StyleGeneratorAdapter, StyleGeneratorConfig
from fedhet.seeding import derive_seed

__all__ = [
    "ARTIFACT_FORMAT",
    "artifact_paths",
    "build_command",
    "build_lock",
    "load_artifact",
    "save_sample_grid",
    "sha256_file",
    "write_artifact",
]

log = logging.getLogger("fedhet")

ARTIFACT_FORMAT = 1
"""Version of the artifact layout; bump when the sidecar or the architecture changes."""


def build_command(name: str = DEFAULT_GENERATOR, cache_dir: str | Path | None = None) -> str:
    """The shell command that builds artifact ``name`` (for error messages)."""
    command = "fedhet pretrain-generator"
    if name != DEFAULT_GENERATOR:
        command += f" --name {name}"
    if cache_dir is not None:
        command += f" --cache_dir {cache_dir}"
    return command


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def artifact_paths(name: str, cache_dir: str | Path | None) -> tuple[Path, Path, Path]:
    """``(<name>.pt, <name>.json, <name>.png)`` under ``<cache_dir>/generators/``."""
    directory = generators_dir(cache_dir)
    return directory / f"{name}.pt", directory / f"{name}.json", directory / f"{name}.png"


def load_artifact(name: str = DEFAULT_GENERATOR, cache_dir: str | Path | None = None) -> StyleGeneratorAdapter:
    """Load the pretrained generator ``name`` from ``<cache_dir>/generators/`` after checking its sha256.

    Raises:
        ConfigError: the artifact does not exist (the message names the command that builds it).
        CheckpointError: the weights do not match the recorded checksum, or the files are corrupt.
    """
    weights, sidecar, _ = artifact_paths(check_artifact_name(name), cache_dir)
    command = build_command(name, cache_dir)
    if not sidecar.is_file() or not weights.is_file():
        raise ConfigError(
            f"pretrained generator '{name}' not found in '{weights.parent}'; build it once with: {command}"
        )
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
        config = StyleGeneratorConfig(**meta["config"])
        expected = str(meta["sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"generator metadata '{sidecar}' is corrupt ({type(exc).__name__}); rebuild with: {command} --force"
        ) from None
    if sha256_file(weights) != expected:
        raise CheckpointError(
            f"generator weights '{weights}' do not match the sha256 recorded in '{sidecar}' (corrupt or modified); "
            f"rebuild with: {command} --force"
        )
    state = safe_torch_load(weights, f"generator '{name}' weights")
    generator = StyleGenerator(config)
    try:
        generator.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"generator weights '{weights}' do not fit the recorded architecture ({type(exc).__name__}); "
            f"rebuild with: {command} --force"
        ) from None
    return StyleGeneratorAdapter(generator)


@torch.no_grad()
def save_sample_grid(
    adapter: Any, path: str | Path, rows: int = 8, cols: int = 8, seed: int = 0, scale: int = 2
) -> Path:
    """Write a ``rows x cols`` PNG grid of ``adapter``'s samples (fixed latents from ``seed``)."""
    from fedhet.data.montage import save_montage
    from fedhet.data.tensors import TensorData

    rng = torch.Generator().manual_seed(derive_seed(seed, "generator", "samples"))
    images = adapter.synthesize(adapter.sample_w(rows * cols, generator=rng)).cpu()
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    labels = torch.full((pixels.shape[0],), -1, dtype=torch.int64)
    return save_montage(TensorData(x=pixels, y=labels), path, rows=rows, cols=cols, scale=scale)

def write_artifact(
    name: str,
    generator: StyleGenerator,
    config: StyleGeneratorConfig,
    settings: dict[str, Any],
    wall_s: float,
    paths: tuple[Path, Path, Path],
    seed: int,
) -> None:
    """Save a trained generator as artifact ``name``: weights, sample grid, then the sidecar.

    The sidecar (architecture, training settings, wall time, the weights' sha256) is written
    last, so a half-written artifact is never taken for a complete one.
    """
    weights, sidecar, samples = paths
    atomic_torch_save({k: v.detach().clone() for k, v in generator.state_dict().items()}, weights)
    meta = {
        "format": ARTIFACT_FORMAT,
        "name": name,
        "kind": "fedhet StyleGenerator (EMA weights)",
        "config": config.to_dict(),
        "training": settings,
        "wall_s": round(wall_s, 1),
        "torch": torch.__version__,
        "sha256": sha256_file(weights),
    }
    save_sample_grid(StyleGeneratorAdapter(deepcopy(generator)), samples, seed=seed)
    atomic_write_text(sidecar, json.dumps(meta, indent=2) + "\n")  # last: marks the artifact complete


@contextlib.contextmanager
def build_lock(directory: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<directory>/.<name>.lock`` (``fcntl.flock``; a no-op without it).

    The OS releases the lock when its holder exits, so a killed build never blocks the next one.
    Re-entrant within a process (:func:`~fedhet.generators.pretrain.ensure_artifact` holds it around
    :func:`~fedhet.generators.pretrain.pretrain_generator`).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = (directory / f".{name}.lock").resolve()
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the atomic renames still keep files whole
        yield
        return
    if path in _HELD_LOCKS:
        yield
        return
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building generator '%s'", name)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        _HELD_LOCKS.add(path)
        try:
            yield
        finally:
            _HELD_LOCKS.discard(path)
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


_HELD_LOCKS: set[Path] = set()
