"""Frozen pretrained generators for FedKTL: one interface, several sources.

* :class:`GeneratorAdapter` (:mod:`fedhet.generators.base`): the interface FedKTL depends on;
  :func:`load_generator` (:mod:`fedhet.generators.loading`): loading by name.
* :mod:`fedhet.generators.stylegan`: the small style-based generator and its discriminator.
* :mod:`fedhet.generators.pretrain`: GAN training on the embedded public photo crops, or on a
  broader augmented pool, and building on first use; :mod:`fedhet.generators.artifacts`: the
  checksummed artifact (files, loading, build lock); :mod:`fedhet.generators.command`:
  ``fedhet pretrain-generator``.
* :mod:`fedhet.generators.adapters`: Stable Diffusion's VAE decoder (optional ``diffusers``
  extra) and StyleGAN2/3 network pickles.

See ``docs/generators.md``.
"""

from fedhet.generators.artifacts import load_artifact, save_sample_grid
from fedhet.generators.base import DEFAULT_GENERATOR, GeneratorAdapter, generators_dir
from fedhet.generators.loading import load_generator
from fedhet.generators.pretrain import EMBEDDED_RECIPES, POOL_GENERATOR, ensure_artifact, pretrain_generator
from fedhet.generators.stylegan import StyleGenerator, StyleGeneratorAdapter, StyleGeneratorConfig

__all__ = [
    "DEFAULT_GENERATOR",
    "EMBEDDED_RECIPES",
    "POOL_GENERATOR",
    "GeneratorAdapter",
    "StyleGenerator",
    "StyleGeneratorAdapter",
    "StyleGeneratorConfig",
    "ensure_artifact",
    "generators_dir",
    "load_artifact",
    "load_generator",
    "pretrain_generator",
    "save_sample_grid",
]
