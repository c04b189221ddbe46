"""Adapters for user-supplied pretrained generators: Stable Diffusion's VAE and StyleGAN pickles.

The paper's generators (reference ``fedktl.md`` section 4.4) cannot be downloaded on offline
machines; users who have them locally load them through these adapters. Nothing here ever
downloads: missing files are a one-line :class:`~fedhet.errors.ConfigError` at load time.

* :class:`DiffusersVAEAdapter` (``"stable-diffusion:<dir>"``, optional extra
  ``pip install 'fedhet[diffusers]'``): the VAE decoder of a Stable Diffusion directory is
  ``G_s``; the latent ``w`` is the VAE latent ``[4, 64, 64]`` flattened (16,384 values for SD
  v1.5), and ``sample_w`` draws it from ``N(0, I)`` in the VAE's scaled latent space.
  **Deviation:** the paper feeds ``z_T`` through the text-conditioned latent diffusion model
  (fixed prompt, tens of UNet denoising steps) before the VAE decoder; that costs minutes per
  image on a CPU and needs the text encoder (``transformers``), so this adapter decodes the
  latent directly. W is then Gaussian, which section 9.3 notes is less faithful than a learned
  mapping; prefer ``embedded-stylegan`` or a StyleGAN pickle.
* :class:`StyleGANPickleAdapter` (``"stylegan-pkl:<path>"``): ``G_ema`` of a StyleGAN2-ADA,
  StyleGAN3 or StyleGAN-XL network pickle. ``sample_w(n) = G.mapping(z, c)[:, 0]`` (random
  one-hot ``c`` for class-conditional networks) and
  ``synthesize(w) = G.synthesis(w repeated num_ws times, noise_mode='const', force_fp32=True)``,
  clamped to ``[-1, 1]`` (the reference's ``(x + 1) / 2`` to ``[0, 1]`` is left to FedKTL's image
  post-processing, since the fedhet interface is ``[-1, 1]``). **A pickle cannot be loaded with
  ``weights_only=True``**: unpickling runs code named by the file, so load only pickles from a
  source you trust. The StyleGAN code (``dnnlib``, ``torch_utils``; for StyleGAN-XL also
  ``pg_modules``) must be importable, because the pickles reference its classes.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhet.errors import CheckpointError, ConfigError
from fedhet.generators.base import GeneratorAdapter

__all__ = ["DiffusersVAEAdapter", "StyleGANPickleAdapter"]

_VAE_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


class DiffusersVAEAdapter(GeneratorAdapter):
    """Stable Diffusion's VAE decoder as ``G_s`` on flattened ``N(0, I)`` latents (see module docstring).

    Args:
        directory: a local Stable Diffusion pipeline directory (holding ``vae/``) or a bare
            ``AutoencoderKL`` directory (``config.json`` plus ``diffusion_pytorch_model.*``).
    """

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        try:
            from diffusers import AutoencoderKL
        except ImportError:
            raise ConfigError(
                "the 'stable-diffusion:<dir>' generator needs the optional diffusers package; "
                "install it with: pip install 'fedhet[diffusers]'"
            ) from None
        root = Path(directory).expanduser()
        vae_dir = root / "vae" if (root / "vae").is_dir() else root
        if not (vae_dir / "config.json").is_file() or not any((vae_dir / f).is_file() for f in _VAE_WEIGHTS):
            raise ConfigError(
                f"no Stable Diffusion VAE in '{root}': expected vae/config.json and vae/{_VAE_WEIGHTS[0]} "
                "(or .bin) from a local copy of the model; nothing is downloaded"
            )
        use_safetensors = (vae_dir / _VAE_WEIGHTS[0]).is_file()
        try:
            self.vae = AutoencoderKL.from_pretrained(vae_dir, local_files_only=True, use_safetensors=use_safetensors)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"could not load the VAE in '{vae_dir}' ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                "check that the directory is a complete diffusers model"
            ) from None
        config = self.vae.config
        self.scaling_factor = float(getattr(config, "scaling_factor", 0.18215))
        downsampling = 2 ** (len(config.block_out_channels) - 1)
        self.resolution = int(config.sample_size)
        self.latent_shape = (
            int(config.latent_channels),
            self.resolution // downsampling,
            self.resolution // downsampling,
        )
        self.latent_dim = self.latent_shape[0] * self.latent_shape[1] * self.latent_shape[2]
        self.out_channels = int(config.out_channels)
        self.freeze()

    def sample_w(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        return self.draw_noise(n, self.latent_dim, generator)

    def synthesize(self, w: Tensor) -> Tensor:
        self.check_latents(w)
        latents = w.reshape(w.shape[0], *self.latent_shape) / self.scaling_factor
        return self.vae.decode(latents.to(self.vae.dtype)).sample.float().clamp(-1.0, 1.0)


class StyleGANPickleAdapter(GeneratorAdapter):
    """``G_ema`` of a trusted StyleGAN2/3 network pickle (see module docstring: not weights-only).

    Args:
        path: the ``.pkl`` file; its dict's ``"G_ema"`` (or the unpickled object itself) must
            expose ``mapping``, ``synthesis``, ``z_dim``, ``w_dim`` and ``img_resolution``.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        file = Path(path).expanduser()
        if not file.is_file():
            raise ConfigError(f"StyleGAN pickle '{file}' not found; pass stylegan-pkl:<path to a local .pkl>")
        try:
            with open(file, "rb") as handle:
                # Not weights_only: a network pickle stores its classes; only trusted files (module docstring).
                loaded: Any = pickle.load(handle)  # noqa: S301
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"StyleGAN pickle '{file}' needs the module '{exc.name}'; put the StyleGAN code "
                "(dnnlib, torch_utils) on PYTHONPATH"
            ) from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise CheckpointError(
                f"StyleGAN pickle '{file}' is corrupt or incompatible ({type(exc).__name__})"
            ) from None
        network = loaded.get("G_ema") if isinstance(loaded, dict) else loaded
        missing = [a for a in ("mapping", "synthesis", "z_dim", "w_dim", "img_resolution") if not hasattr(network, a)]
        if not isinstance(network, nn.Module) or missing:
            raise CheckpointError(
                f"'{file}' holds no StyleGAN generator (need a 'G_ema' module with mapping, synthesis, z_dim, "
                f"w_dim, img_resolution; missing: {missing or 'not an nn.Module'})"
            )
        self.network = network.float()
        self.latent_dim = int(network.w_dim)
        self.resolution = int(network.img_resolution)
        self.out_channels = int(getattr(network, "img_channels", 3))
        self.z_dim = int(network.z_dim)
        self.c_dim = int(getattr(network, "c_dim", 0))
        num_ws = getattr(network, "num_ws", None) or getattr(network.synthesis, "num_ws", None)
        if num_ws is None:
            raise CheckpointError(f"'{file}': the generator exposes no num_ws; is it a StyleGAN2/3 G_ema?")
        self.num_ws = int(num_ws)
        self.freeze()

    def sample_w(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        z = self.draw_noise(n, self.z_dim, generator)
        conditioning = torch.zeros(n, self.c_dim, device=self.device)
        if self.c_dim > 0:
            # Class-conditional networks (StyleGAN-XL): one random class per latent, as the reference.
            source = generator.device if generator is not None else torch.device("cpu")
            classes = torch.randint(self.c_dim, (n,), generator=generator, device=source).to(self.device)
            conditioning[torch.arange(n, device=self.device), classes] = 1.0
        return self.network.mapping(z, conditioning)[:, 0]

    def synthesize(self, w: Tensor) -> Tensor:
        self.check_latents(w)
        ws = w[:, None, :].repeat(1, self.num_ws, 1)
        return self.network.synthesis(ws, noise_mode="const", force_fp32=True).float().clamp(-1.0, 1.0)
