"""Pretrain the small style generator on the public photo crops; save and load it as an artifact.

FedKTL needs a frozen *pretrained* generator, and target machines cannot download StyleGAN-XL
(reference ``fedktl.md`` section 9.3). ``fedhet pretrain-generator`` therefore trains
:class:`~fedhet.generators.stylegan.StyleGenerator` once, as a GAN, on the embedded ``photos``
crops (natural photographs disjoint from every digit domain, so the generator carries knowledge
that is *not* the client task, as in the paper's Table 6), and the federated runs only load it.

Training (StyleGAN2's recipe, shrunk to minutes on two CPU cores): non-saturating logistic loss,
lazy R1 penalty on real images every ``r1_every`` discriminator steps (``gamma`` = 0.05), Adam
(lr 0.0025, betas (0, 0.99)) for both networks, an exponential moving average of the generator
weights (what is saved, StyleGAN's ``G_ema``), batch 32 of ``[-1, 1]``-scaled crops. It is a
Lightning module with manual optimisation (two optimisers) fitted by one Trainer epoch of
``steps`` batches, with Lightning's progress bar. All randomness comes from the seed: the model
initialisation, the batch order and the noise draws; the same seed gives the same weights on the
same machine and library versions.

Artifact, under ``<cache>/generators/`` (``$FEDHET_CACHE`` or ``~/.cache/fedhet``):

* ``<name>.pt``: the EMA generator's state dict only (loaded with ``weights_only=True``);
* ``<name>.json``: architecture config, training settings, wall time and the sha256 of
  ``<name>.pt`` (written last, so a half-written artifact is never taken for a complete one);
  loading verifies the checksum;
* ``<name>.png``: an 8x8 grid of samples for a human to check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.core.state import atomic_torch_save, safe_torch_load
from fedhet.errors import CheckpointError, ConfigError, TrainingError
from fedhet.generators.base import DEFAULT_GENERATOR, check_artifact_name, generators_dir
from fedhet.generators.stylegan import Discriminator, StyleGenerator, StyleGeneratorAdapter, StyleGeneratorConfig
from fedhet.seeding import derive_seed, seeded

__all__ = [
    "ARTIFACT_FORMAT",
    "DEFAULT_STEPS",
    "GeneratorPretraining",
    "build_command",
    "discriminator_logistic_loss",
    "ema_update",
    "generator_nonsaturating_loss",
    "load_artifact",
    "pretrain_command",
    "pretrain_generator",
    "r1_penalty",
    "save_sample_grid",
]

log = logging.getLogger("fedhet")

ARTIFACT_FORMAT = 1
"""Version of the artifact layout; bump when the sidecar or the architecture changes."""

DEFAULT_STEPS = 1500
"""Default training steps (one discriminator and one generator update each): 0.26 CPU-seconds per
step at batch 16, i.e. minutes on two idle CPU cores (docs/generators.md has the measured time)."""


# --------------------------------------------------------------------------------------------
# Losses (pure functions)
# --------------------------------------------------------------------------------------------


def discriminator_logistic_loss(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    """``mean softplus(-D(x)) + mean softplus(D(G(z)))``: the discriminator's logistic GAN loss."""
    return F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()


def generator_nonsaturating_loss(fake_logits: Tensor) -> Tensor:
    """``mean softplus(-D(G(z)))``: the non-saturating generator loss (Goodfellow et al., 2014)."""
    return F.softplus(-fake_logits).mean()


def r1_penalty(real_logits: Tensor, real_images: Tensor) -> Tensor:
    """``mean_i ||d D(x_i) / d x_i||^2`` over the batch (Mescheder et al., 2018), differentiable.

    ``real_images`` must require grad and ``real_logits`` must be computed from them.
    """
    (gradients,) = torch.autograd.grad(real_logits.sum(), real_images, create_graph=True)
    return gradients.square().sum(dim=tuple(range(1, gradients.ndim))).mean()


@torch.no_grad()
def ema_update(average: nn.Module, current: nn.Module, decay: float) -> None:
    """``average <- decay * average + (1 - decay) * current``, parameter by parameter (buffers copied)."""
    for averaged, value in zip(average.parameters(), current.parameters(), strict=False):
        averaged.lerp_(value, 1.0 - decay)
    for averaged, value in zip(average.buffers(), current.buffers(), strict=False):
        averaged.copy_(value)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


class GeneratorPretraining(pl.LightningModule):
    """GAN training of a :class:`StyleGenerator` against a :class:`Discriminator` (manual optimisation).

    Args:
        config: generator/discriminator architecture.
        lr: Adam learning rate of both networks.
        r1_gamma: weight ``gamma`` of the R1 penalty ``gamma / 2 * ||grad D(x)||^2``.
        r1_every: apply R1 every this many steps, scaled by the interval (StyleGAN2's lazy regularisation).
        ema_decay: per-step decay of the generator's moving average (the saved weights).
    """

    def __init__(
        self,
        config: StyleGeneratorConfig,
        lr: float = 0.0025,
        r1_gamma: float = 0.05,
        r1_every: int = 4,
        ema_decay: float = 0.995,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.config = config
        self.generator = StyleGenerator(config)
        self.discriminator = Discriminator(config)
        self.generator_ema = deepcopy(self.generator).requires_grad_(False)
        self.lr = lr
        self.r1_gamma = r1_gamma
        self.r1_every = max(1, r1_every)
        self.ema_decay = ema_decay

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.0, 0.99)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=betas),
        ]

    def _noise(self, n: int) -> Tensor:
        return torch.randn(n, self.config.z_dim).to(self.device)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        generator_optimizer, discriminator_optimizer = self.optimizers()  # type: ignore[misc]
        real = batch
        n = real.shape[0]

        # Discriminator step (with lazy R1 on the real batch).
        self.discriminator.requires_grad_(True)
        with torch.no_grad():
            fake = self.generator(self._noise(n))
        apply_r1 = self.r1_gamma > 0 and batch_idx % self.r1_every == 0
        real = real.detach().requires_grad_(apply_r1)
        real_logits = self.discriminator(real)
        d_loss = discriminator_logistic_loss(real_logits, self.discriminator(fake))
        total = d_loss
        if apply_r1:
            total = total + r1_penalty(real_logits, real) * (self.r1_gamma / 2 * self.r1_every)
        discriminator_optimizer.zero_grad(set_to_none=True)
        self.manual_backward(total)
        discriminator_optimizer.step()

        # Generator step: the discriminator is frozen so no gradient is computed for it.
        self.discriminator.requires_grad_(False)
        g_loss = generator_nonsaturating_loss(self.discriminator(self.generator(self._noise(n))))
        generator_optimizer.zero_grad(set_to_none=True)
        self.manual_backward(g_loss)
        generator_optimizer.step()
        ema_update(self.generator_ema, self.generator, self.ema_decay)

        if not torch.isfinite(d_loss.detach()) or not torch.isfinite(g_loss.detach()):
            raise TrainingError(
                f"generator pretraining diverged at step {batch_idx} (non-finite loss); lower the learning rate"
            )
        self.log_dict({"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}, prog_bar=True, on_step=True)


class _RepeatedPasses:
    """``steps`` real batches (images only) drawn by repeated passes of a shuffling loader."""

    def __init__(self, loader: Any, steps: int) -> None:
        self.loader = loader
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Tensor]:
        produced = 0
        while produced < self.steps:
            for images, _ in self.loader:
                yield images
                produced += 1
                if produced == self.steps:
                    return


# --------------------------------------------------------------------------------------------
# Artifact
# --------------------------------------------------------------------------------------------


def build_command(name: str = DEFAULT_GENERATOR, cache_dir: str | Path | None = None) -> str:
    """The shell command that builds artifact ``name`` (for error messages)."""
    command = "fedhet pretrain-generator"
    if name != DEFAULT_GENERATOR:
        command += f" --name {name}"
    if cache_dir is not None:
        command += f" --cache_dir {cache_dir}"
    return command


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _artifact_paths(name: str, cache_dir: str | Path | None) -> tuple[Path, Path, Path]:
    directory = generators_dir(cache_dir)
    return directory / f"{name}.pt", directory / f"{name}.json", directory / f"{name}.png"


def load_artifact(name: str = DEFAULT_GENERATOR, cache_dir: str | Path | None = None) -> StyleGeneratorAdapter:
    """Load the pretrained generator ``name`` from ``<cache_dir>/generators/`` after checking its sha256.

    Raises:
        ConfigError: the artifact does not exist (the message names the command that builds it).
        CheckpointError: the weights do not match the recorded checksum, or the files are corrupt.
    """
    weights, sidecar, _ = _artifact_paths(check_artifact_name(name), cache_dir)
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
    if _sha256(weights) != expected:
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


def pretrain_generator(
    name: str = DEFAULT_GENERATOR,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    image_size: int = 32,
    cache_dir: str | Path | None = None,
    force: bool = False,
    batch_size: int = 16,
    lr: float = 0.0025,
    r1_gamma: float = 0.05,
    ema_decay: float = 0.995,
    config: StyleGeneratorConfig | None = None,
    data_seed: int = 0,
    accelerator: str = "cpu",
    progress: bool = True,
) -> Path:
    """Train the small style generator on the public photo crops and save it as artifact ``name``.

    If the artifact exists with the same settings it is reused (so a config can call this
    unconditionally); with different settings ``force`` must be set to overwrite it.

    Args:
        name: artifact name (``load_generator(name)`` loads it).
        steps: training steps (one discriminator and one generator update each).
        seed: seed of initialisation, batch order and noise.
        image_size: generated (and training) image side: 32, or 16 for a four times cheaper run.
        cache_dir: cache root holding ``generators/`` (default ``$FEDHET_CACHE`` or ``~/.cache/fedhet``).
        force: overwrite an existing artifact trained with other settings.
        batch_size: real and fake images per step.
        lr: Adam learning rate of both networks.
        r1_gamma: R1 penalty weight.
        ema_decay: per-step decay of the saved generator's moving average.
        config: architecture (default :class:`StyleGeneratorConfig` at ``image_size``).
        data_seed: build seed of the embedded photo crops.
        accelerator: Lightning accelerator (``"cpu"`` keeps results identical across machines).
        progress: show Lightning's progress bar.

    Returns:
        Path of the weights file ``<cache_dir>/generators/<name>.pt``.

    Raises:
        ConfigError: bad settings, or an artifact with other settings exists and ``force`` is off.
    """
    from fedhet.data import TensorBatchLoader, load_dataset
    from fedhet.federation.trainer import silence_lightning

    check_artifact_name(name)
    if steps < 1 or batch_size < 2:
        raise ConfigError(f"pretraining needs steps >= 1 and batch_size >= 2, got {steps} and {batch_size}")
    if config is None:
        config = StyleGeneratorConfig(resolution=image_size)
    elif config.resolution != image_size:
        raise ConfigError(
            f"config.resolution {config.resolution} differs from image_size {image_size}; make them equal"
        )
    weights, sidecar, samples = _artifact_paths(name, cache_dir)
    settings = {
        "steps": steps,
        "seed": seed,
        "image_size": image_size,
        "batch_size": batch_size,
        "lr": lr,
        "r1_gamma": r1_gamma,
        "ema_decay": ema_decay,
        "data": "photos",
        "data_seed": data_seed,
    }
    if sidecar.is_file() and weights.is_file() and not force:
        try:
            existing = json.loads(sidecar.read_text(encoding="utf-8"))
        except ValueError:
            existing = {}
        if existing.get("training") == settings and existing.get("config") == config.to_dict():
            log.info("generator '%s' already built with these settings: %s", name, weights)
            return weights
        raise ConfigError(
            f"generator '{name}' already exists at '{weights}' with other settings; "
            "pass --force to overwrite it or choose another --name"
        )

    photos = load_dataset("photos", None, data_seed, image_size).train
    loader = TensorBatchLoader(
        photos,
        batch_size=batch_size,
        shuffle=True,
        seed=derive_seed(seed, "generator", "batches"),
        drop_last=True,
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
    )
    silence_lightning()
    started = time.perf_counter()
    with seeded(derive_seed(seed, "generator", "init")):
        module = GeneratorPretraining(config, lr=lr, r1_gamma=r1_gamma, ema_decay=ema_decay)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        num_sanity_val_steps=0,
    )
    with seeded(derive_seed(seed, "generator", "train"), device=module.device):
        trainer.fit(module, train_dataloaders=_RepeatedPasses(loader, steps))
    wall_s = time.perf_counter() - started

    generator = module.generator_ema.cpu()
    atomic_torch_save({k: v.detach().clone() for k, v in generator.state_dict().items()}, weights)
    meta = {
        "format": ARTIFACT_FORMAT,
        "name": name,
        "kind": "fedhet StyleGenerator (EMA weights)",
        "config": config.to_dict(),
        "training": settings,
        "wall_s": round(wall_s, 1),
        "torch": torch.__version__,
        "sha256": _sha256(weights),
    }
    _atomic_write_text(sidecar, json.dumps(meta, indent=2) + "\n")
    save_sample_grid(StyleGeneratorAdapter(deepcopy(generator)), samples, seed=seed)
    log.info("trained generator '%s' in %.0f s", name, wall_s)
    return weights


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _build_parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog="fedhet pretrain-generator",
        description="Pretrain FedKTL's small style generator on the embedded public photo crops (once per machine).",
        exit_on_error=False,
        default_meta=False,
    )
    parser.add_argument("--name", type=str, default=DEFAULT_GENERATOR, help="artifact name (load_generator(name))")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation, batch order and noise")
    parser.add_argument("--image_size", type=int, default=32, help="image side: 32, or 16 for a cheaper generator")
    parser.add_argument("--cache_dir", type=str | None, default=None, help="cache root (default $FEDHET_CACHE)")
    parser.add_argument("--force", type=bool, default=False, help="overwrite an artifact built with other settings")
    return parser


def pretrain_command(args: Sequence[str]) -> str:
    """Run ``fedhet pretrain-generator`` with ``args``; return the line to print.

    Raises:
        ConfigError: unparsable arguments or bad settings.
    """
    from jsonargparse import ArgumentError

    # ``--force`` alone means ``--force true`` (jsonargparse wants a value for booleans).
    expanded = [item for arg in args for item in (["--force", "true"] if arg == "--force" else [arg])]
    parser = _build_parser()
    try:
        options = parser.parse_args(expanded)
    except ArgumentError as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(f"{message}; see 'fedhet pretrain-generator --help'") from None
    weights = pretrain_generator(
        name=options.name,
        steps=options.steps,
        seed=options.seed,
        image_size=options.image_size,
        cache_dir=options.cache_dir,
        force=options.force,
    )
    return f"generator '{options.name}': {weights} (samples: {weights.with_suffix('.png')})"
