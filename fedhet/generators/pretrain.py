"""Pretrain the small style generator on embedded public images; save, build on first use, load.

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

Two embedded recipes (:data:`EMBEDDED_RECIPES`) can be built by name, and are built
automatically the first time :func:`~fedhet.generators.load_generator` needs them
(:func:`ensure_artifact`; one log line says so and how long it takes, with progress):

* ``embedded-stylegan``: the 5,000 ``photos`` crops, as above (the default generator);
* ``embedded-stylegan-pool``: a broader unlabelled pool, every embedded image source that the
  MNIST scenarios' clients do not hold (the *training* splits of ``uci``, ``mnistm`` and ``syn``,
  and the ``photos`` crops), drawn source-balanced and augmented (:func:`augment_pool_batch`).

The artifact's files, checksum, loading and build lock are :mod:`fedhet.generators.artifacts`;
the GAN losses :mod:`fedhet.functional.gan`; the ``fedhet pretrain-generator`` command
:mod:`fedhet.generators.command`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.errors import ConfigError, TrainingError
from fedhet.functional.gan import (
    discriminator_logistic_loss,
    ema_update,
    generator_nonsaturating_loss,
    r1_penalty,
)
from fedhet.generators.artifacts import artifact_paths, build_command, build_lock, write_artifact
from fedhet.generators.base import DEFAULT_GENERATOR, check_artifact_name
from fedhet.generators.stylegan import Discriminator, StyleGenerator, StyleGeneratorConfig
from fedhet.seeding import derive_seed, seeded

__all__ = [
    "AUTO_PRETRAIN_ENV",
    "DEFAULT_STEPS",
    "EMBEDDED_RECIPES",
    "POOL_GENERATOR",
    "EmbeddedRecipe",
    "GeneratorPretraining",
    "augment_pool_batch",
    "ensure_artifact",
    "pretrain_generator",
]

log = logging.getLogger("fedhet")

DEFAULT_STEPS = 1500
"""Default training steps (one discriminator and one generator update each): 0.26 CPU-seconds per
step at batch 16, i.e. minutes on two idle CPU cores (docs/generators.md has the measured time)."""

SECONDS_PER_STEP = 0.27
"""Measured single-thread CPU seconds per step at 32x32, batch 16 (for the estimate logged before a build)."""

POOL_GENERATOR = "embedded-stylegan-pool"
"""Name of the generator pretrained on the broader augmented pool (:data:`EMBEDDED_RECIPES`)."""

AUTO_PRETRAIN_ENV = "FEDHET_AUTO_PRETRAIN"
"""Set to ``0`` to make a missing embedded artifact an error instead of building it on first use."""

POOL_AUGMENT = "affine-colour-v1"
"""Version tag of :func:`augment_pool_batch`, recorded in the artifact's settings."""


@dataclass(frozen=True)
class EmbeddedRecipe:
    """How an embedded generator artifact is built: its data sources, augmentation and steps.

    Attributes:
        sources: embedded datasets whose *training* splits form the unlabelled pool.
        augment: augment each batch with :func:`augment_pool_batch` (and draw the sources
            balanced); ``False`` is the original photo-crop recipe, batch for batch.
        steps: training steps.
        summary: one phrase for the log line announcing a build.
    """

    sources: tuple[str, ...]
    augment: bool
    steps: int = DEFAULT_STEPS
    summary: str = ""


EMBEDDED_RECIPES: dict[str, EmbeddedRecipe] = {
    DEFAULT_GENERATOR: EmbeddedRecipe(("photos",), False, summary="5,000 public photo crops"),
    POOL_GENERATOR: EmbeddedRecipe(
        ("uci", "mnistm", "syn", "photos"),
        True,
        summary="an augmented pool of UCI, MNIST-M, font-digit and photo images (no MNIST-domain image)",
    ),
}
"""The artifacts fedhet can build by itself (on first use or with ``fedhet pretrain-generator --name``).

``embedded-stylegan-pool`` holds no image of the ``mnist`` domain (train or test). MNIST-M is
built from MNIST split B, disjoint from the ``mnist`` domain's split A, so the clients of the
MNIST label-skew scenarios never hold one of its digits; it must not be used where clients
hold ``uci``, ``mnistm`` or ``syn`` (the multi-domain Digits scenarios)."""


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


def augment_pool_batch(images: Tensor, generator: torch.Generator) -> Tensor:
    """Augment a batch ``[B, 3, H, W]`` in ``[0, 1]`` for the pool generator (per-sample randomness).

    * a random affine view: zoom ``U(1, 1.25)`` (a crop of 64-100 % of the side), rotation
      ``U(-10, 10)`` degrees, shift up to 10 % of the side, with reflected borders (no black frame
      for the generator to learn);
    * colour: a random permutation of the RGB channels, inversion with probability 0.5 (white-on-black
      digits also appear black-on-white), contrast ``U(0.7, 1.3)`` about the image mean and brightness
      ``U(-0.1, 0.1)``, clamped to ``[0, 1]``.
    """
    batch = images.shape[0]
    if batch == 0:
        return images

    def uniform(low: float, high: float, *shape: int) -> Tensor:
        return torch.rand(batch, *shape, generator=generator) * (high - low) + low

    zoom = uniform(1.0, 1.25)
    angle = uniform(-10.0, 10.0) * (math.pi / 180.0)
    shift = uniform(-0.2, 0.2, 2)  # affine_grid coordinates span [-1, 1]: 0.2 is 10 % of the side
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta.to(images), list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="reflection", align_corners=False)

    permutation = torch.argsort(torch.rand(batch, images.shape[1], generator=generator), dim=1)
    out = out.gather(1, permutation.to(out.device)[:, :, None, None].expand_as(out))
    invert = (torch.rand(batch, generator=generator) < 0.5).to(out.device)[:, None, None, None]
    out = torch.where(invert, 1.0 - out, out)
    contrast = uniform(0.7, 1.3).to(out)[:, None, None, None]
    brightness = uniform(-0.1, 0.1).to(out)[:, None, None, None]
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    return ((out - mean) * contrast + mean + brightness).clamp_(0.0, 1.0)


class _PoolBatches:
    """``steps`` batches in ``[-1, 1]`` drawn from several uint8 image pools (a pure function of ``seed``).

    Each image's source is drawn uniformly (so a small source counts as much as a large one),
    then an image of it uniformly, then the batch goes through :func:`augment_pool_batch`.
    """

    def __init__(self, pools: Sequence[Tensor], steps: int, batch_size: int, seed: int, augment: bool) -> None:
        self.pools = list(pools)
        self.steps = steps
        self.batch_size = batch_size
        self.seed = seed
        self.augment = augment

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Tensor]:
        rng = torch.Generator().manual_seed(self.seed)
        first = self.pools[0]
        for _ in range(self.steps):
            source = torch.randint(len(self.pools), (self.batch_size,), generator=rng)
            batch = torch.empty(self.batch_size, *first.shape[1:])
            for k, pool in enumerate(self.pools):
                members = (source == k).nonzero().flatten()
                picks = torch.randint(len(pool), (len(members),), generator=rng)
                batch[members] = pool[picks].float() / 255.0
            if self.augment:
                batch = augment_pool_batch(batch, rng)
            yield batch * 2.0 - 1.0


class _ProgressLines(pl.Callback):
    """Log ``step n/N (p%), elapsed, ETA`` about every 10 % of the steps (when no progress bar is shown)."""

    def __init__(self, name: str, steps: int) -> None:
        self.name = name
        self.steps = steps
        self.every = max(1, steps // 10)
        self.started = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        done = min(self.steps, batch_idx + 1)  # one epoch of ``steps`` batches
        if done % self.every and done != self.steps:
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (self.steps - done)
        log.info(
            "pretraining generator '%s': step %d/%d (%d%%), %s elapsed, ETA %s",
            self.name,
            done,
            self.steps,
            round(100 * done / self.steps),
            _duration(elapsed),
            _duration(eta),
        )


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _recipe_for(name: str) -> EmbeddedRecipe:
    """The recipe of an embedded artifact name; any other name gets the photo-crop recipe."""
    return EMBEDDED_RECIPES.get(name, EMBEDDED_RECIPES[DEFAULT_GENERATOR])


def pretrain_generator(
    name: str = DEFAULT_GENERATOR,
    steps: int | None = None,
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
    progress: bool | None = True,
    sources: Sequence[str] | None = None,
    augment: bool | None = None,
) -> Path:
    """Train the small style generator on embedded public images and save it as artifact ``name``.

    If the artifact exists with the same settings it is reused (so a config can call this
    unconditionally); with different settings ``force`` must be set to overwrite it.

    Args:
        name: artifact name (``load_generator(name)`` loads it); the names of
            :data:`EMBEDDED_RECIPES` select their data, augmentation and steps by default.
        steps: training steps (one discriminator and one generator update each); default: the recipe's.
        seed: seed of initialisation, batch order and noise.
        image_size: generated (and training) image side: 32, or 16 for a four times cheaper run.
        cache_dir: cache root holding ``generators/`` (default ``$FEDHET_CACHE`` or ``~/.cache/fedhet``).
        force: overwrite an existing artifact trained with other settings.
        batch_size: real and fake images per step.
        lr: Adam learning rate of both networks.
        r1_gamma: R1 penalty weight.
        ema_decay: per-step decay of the saved generator's moving average.
        config: architecture (default :class:`StyleGeneratorConfig` at ``image_size``).
        data_seed: build seed of the embedded images.
        accelerator: Lightning accelerator (``"cpu"`` keeps results identical across machines).
        progress: ``True``: Lightning's progress bar; ``False``: nothing; ``None``: the bar on a
            terminal, otherwise a log line about every 10 % of the steps.
        sources: embedded datasets whose training splits are the data (default: the recipe's,
            ``("photos",)`` for names outside :data:`EMBEDDED_RECIPES`).
        augment: source-balanced batches with :func:`augment_pool_batch` (default: the recipe's).

    Returns:
        Path of the weights file ``<cache_dir>/generators/<name>.pt``.

    Raises:
        ConfigError: bad settings, or an artifact with other settings exists and ``force`` is off.
    """
    from fedhet.data import list_datasets

    check_artifact_name(name)
    recipe = _recipe_for(name)
    steps = recipe.steps if steps is None else steps
    sources = tuple(recipe.sources if sources is None else sources)
    augment = recipe.augment if augment is None else augment
    if steps < 1 or batch_size < 2:
        raise ConfigError(f"pretraining needs steps >= 1 and batch_size >= 2, got {steps} and {batch_size}")
    unknown = [source for source in sources if source not in list_datasets()]
    if not sources or unknown:
        raise ConfigError(f"unknown generator data sources {unknown or '(none)'}; choose from {list_datasets()}")
    if config is None:
        config = StyleGeneratorConfig(resolution=image_size)
    elif config.resolution != image_size:
        raise ConfigError(
            f"config.resolution {config.resolution} differs from image_size {image_size}; make them equal"
        )
    weights, sidecar, samples = artifact_paths(name, cache_dir)
    settings: dict[str, Any] = {
        "steps": steps,
        "seed": seed,
        "image_size": image_size,
        "batch_size": batch_size,
        "lr": lr,
        "r1_gamma": r1_gamma,
        "ema_decay": ema_decay,
        "data": "+".join(sources),
        "data_seed": data_seed,
    }
    if augment:
        settings["augment"] = POOL_AUGMENT  # absent for the original recipe: its artifacts stay reusable
    with build_lock(weights.parent, name):
        return _pretrain_locked(
            name,
            settings,
            config,
            sources,
            augment,
            weights,
            sidecar,
            samples,
            force=force,
            accelerator=accelerator,
            progress=progress,
        )


def _pretrain_locked(
    name: str,
    settings: dict[str, Any],
    config: StyleGeneratorConfig,
    sources: tuple[str, ...],
    augment: bool,
    weights: Path,
    sidecar: Path,
    samples: Path,
    force: bool,
    accelerator: str,
    progress: bool | None,
) -> Path:
    """:func:`pretrain_generator` under the artifact's build lock: reuse, refuse or train and save."""
    from fedhet.core.quiet import silence_lightning
    from fedhet.data import TensorBatchLoader, load_dataset

    steps, seed, image_size = settings["steps"], settings["seed"], settings["image_size"]
    batch_size, data_seed = settings["batch_size"], settings["data_seed"]
    lr, r1_gamma, ema_decay = settings["lr"], settings["r1_gamma"], settings["ema_decay"]
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

    if sources == ("photos",) and not augment:
        # the original recipe, batch for batch (its artifacts keep their checksums)
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
        batches: Any = _RepeatedPasses(loader, steps)
    else:
        pools = [load_dataset(source, None, data_seed, image_size).train.x for source in sources]
        batches = _PoolBatches(pools, steps, batch_size, derive_seed(seed, "generator", "pool-batches"), augment)
    show_bar = sys.stderr.isatty() if progress is None else progress
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
        enable_progress_bar=show_bar,
        num_sanity_val_steps=0,
        callbacks=[_ProgressLines(name, steps)] if progress is None and not show_bar else None,
    )
    with seeded(derive_seed(seed, "generator", "train"), device=module.device):
        trainer.fit(module, train_dataloaders=batches)
    wall_s = time.perf_counter() - started

    write_artifact(name, module.generator_ema.cpu(), config, settings, wall_s, (weights, sidecar, samples), seed)
    log.info("trained generator '%s' in %.0f s", name, wall_s)
    return weights


def ensure_artifact(name: str, cache_dir: str | Path | None = None) -> Path:
    """Return the weights of artifact ``name``, pretraining it first if it is an embedded recipe not built yet.

    Only the names of :data:`EMBEDDED_RECIPES` are built; other names are left to
    :func:`load_artifact`'s error. One log line announces the build, its data and an estimate of
    its duration; progress follows (Lightning's bar on a terminal, otherwise a line per 10 %), and a
    last line gives the time taken. Concurrent callers serialise on a lock: one builds, the others
    wait and reuse its artifact.

    Raises:
        ConfigError: the artifact is missing and ``$FEDHET_AUTO_PRETRAIN`` is ``0`` (the message
            names the command that builds it), or bad settings.
    """
    weights, sidecar, _ = artifact_paths(check_artifact_name(name), cache_dir)
    if (sidecar.is_file() and weights.is_file()) or name not in EMBEDDED_RECIPES:
        return weights
    if os.environ.get(AUTO_PRETRAIN_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        raise ConfigError(
            f"pretrained generator '{name}' not found in '{weights.parent}' and {AUTO_PRETRAIN_ENV}=0; "
            f"build it once with: {build_command(name, cache_dir)}"
        )
    with build_lock(weights.parent, name):
        if sidecar.is_file() and weights.is_file():  # built by another process while we waited
            return weights
        recipe = EMBEDDED_RECIPES[name]
        estimate = recipe.steps * SECONDS_PER_STEP
        log.info(
            "FedKTL generator '%s' is not built yet: pretraining it once on %s (%d steps, about %s on an idle "
            "CPU core; '%s' does the same) into %s",
            name,
            recipe.summary,
            recipe.steps,
            _duration(estimate),
            build_command(name, cache_dir),
            weights.parent,
        )
        started = time.perf_counter()
        pretrain_generator(name, cache_dir=cache_dir, progress=None)
        log.info("FedKTL generator '%s' built in %s", name, _duration(time.perf_counter() - started))
    return weights


