"""The frozen-generator interface FedKTL's server depends on, and loading a generator by name.

FedKTL (reference ``fedktl.md`` sections 2.2, 4.4 and 9.3) needs a *pretrained* generator split
into a mapping network ``G_m: z -> w`` (whose outputs span the valid latent domain W) and a
synthesis network ``G_s: w -> image``. The server only ever calls :meth:`GeneratorAdapter.sample_w`
(to match the distribution of its projected prototypes to W) and
:meth:`GeneratorAdapter.synthesize` (to turn the per-class latent centroids into images), so every
generator -- the locally pretrained small StyleGAN, a user's StyleGAN2/3 pickle, Stable
Diffusion's VAE decoder, or the untrained test generator -- hides behind this one class.

Names understood by :func:`load_generator`:

* ``"embedded-stylegan"`` (photo crops) and ``"embedded-stylegan-pool"`` (a broader augmented
  pool): the artifacts under ``<cache>/generators/``, pretrained on first use when missing (unless
  ``$FEDHET_AUTO_PRETRAIN=0``);
* any other name given to ``fedhet pretrain-generator --name``: that artifact; missing -> a
  :class:`~fedhet.errors.ConfigError` naming the command that builds it.
* ``"untrained"``: a randomly initialised small style generator from a fixed seed. It carries no
  pre-existing knowledge, so it does **not** reproduce the paper: it exists for tests and for the
  "no pretraining" ablation.
* ``"stable-diffusion:<dir>"``: the VAE decoder of a local Stable Diffusion directory (optional
  ``diffusers`` extra), see :class:`~fedhet.generators.adapters.DiffusersVAEAdapter`.
* ``"stylegan-pkl:<path>"``: ``G_ema`` of a trusted StyleGAN2/3 network pickle, see
  :class:`~fedhet.generators.adapters.StyleGANPickleAdapter`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch import Tensor, nn

from fedhet.errors import ConfigError

__all__ = ["DEFAULT_GENERATOR", "UNTRAINED_SEED", "GeneratorAdapter", "generators_dir"]

DEFAULT_GENERATOR = "embedded-stylegan"
"""Name of the artifact ``fedhet pretrain-generator`` builds by default."""

UNTRAINED_SEED = 20240
"""Fixed initialisation seed of the ``"untrained"`` generator: the same weights in every process."""

_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class GeneratorAdapter(nn.Module, ABC):
    """A frozen generator split into ``sample_w`` (mapping of Gaussian noise) and ``synthesize``.

    Subclasses set :attr:`latent_dim`, :attr:`resolution` and :attr:`out_channels` and call
    :meth:`freeze` at the end of ``__init__``. Parameters never require grad and the module stays
    in eval mode even when a parent module is put in train mode (FedKTL's server module holds the
    generator as a child, and a ``.train()`` on it must not switch BatchNorm/dropout of a
    pretrained generator into training behaviour). Gradients can still flow to an input ``w``
    that requires grad.

    Attributes:
        latent_dim: size of ``w``, the generator's valid latent domain W.
        resolution: side of the generated square images.
        out_channels: channels of the generated images.
    """

    latent_dim: int
    resolution: int
    out_channels: int

    def freeze(self) -> GeneratorAdapter:
        """Stop gradients into the parameters and switch to eval mode; returns ``self``."""
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        return super().train(False)

    def train(self, mode: bool = True) -> GeneratorAdapter:
        """Stay in eval mode whatever ``mode`` is: the generator is frozen (see class docstring)."""
        return super().train(False)

    @property
    def device(self) -> torch.device:
        """Device of the generator's weights (CPU when it has none)."""
        for tensor in (*self.parameters(), *self.buffers()):
            return tensor.device
        return torch.device("cpu")

    def draw_noise(self, n: int, dim: int, generator: torch.Generator | None) -> Tensor:
        """``N(0, I)`` noise ``[n, dim]`` drawn on ``generator``'s device (the CPU RNG when ``None``).

        Drawing on the RNG's own device and moving the result makes the same seed give the same
        latents whether the generator runs on the CPU or a GPU.
        """
        if n < 1:
            raise ConfigError(f"sample_w needs n >= 1 latents, got {n}")
        source = generator.device if generator is not None else torch.device("cpu")
        return torch.randn(n, dim, generator=generator, device=source).to(self.device)

    @abstractmethod
    def sample_w(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """Return ``[n, latent_dim]`` latents ``w = mapping(z)`` with ``z ~ N(0, I)``.

        Args:
            n: number of latents.
            generator: RNG to draw ``z`` from; ``None`` uses torch's (seeded) global RNG.
        """

    @abstractmethod
    def synthesize(self, w: Tensor) -> Tensor:
        """Return ``[n, out_channels, resolution, resolution]`` images in ``[-1, 1]`` for ``w`` ``[n, latent_dim]``."""

    def check_latents(self, w: Tensor) -> None:
        """Raise a one-line :class:`ConfigError` unless ``w`` is ``[n, latent_dim]`` floating point."""
        if w.ndim != 2 or w.shape[1] != self.latent_dim or not w.is_floating_point():
            raise ConfigError(
                f"{type(self).__name__}.synthesize expects float latents of shape [n, {self.latent_dim}], "
                f"got {w.dtype} {tuple(w.shape)}; pass outputs of sample_w or of a projection to latent_dim"
            )

    def extra_repr(self) -> str:
        return f"latent_dim={self.latent_dim}, resolution={self.resolution}, out_channels={self.out_channels}"


def generators_dir(cache_dir: str | Path | None = None) -> Path:
    """Folder of pretrained generator artifacts: ``<cache_dir>/generators`` (default fedhet's cache)."""
    if cache_dir is None:
        from fedhet.data.embedded import cache_dir as fedhet_cache_dir

        return fedhet_cache_dir() / "generators"
    return Path(cache_dir).expanduser() / "generators"


def check_artifact_name(name: str) -> str:
    """Return ``name`` if it can name an artifact file, else raise a one-line :class:`ConfigError`."""
    if not _ARTIFACT_NAME.match(name):
        raise ConfigError(
            f"generator name {name!r} cannot name an artifact; use letters, digits, '-', '_' and '.', "
            "or a prefixed source such as 'stylegan-pkl:<path>' or 'stable-diffusion:<dir>'"
        )
    return name
