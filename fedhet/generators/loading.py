"""Loading a frozen generator by name: the one module that knows every generator source.

It sits above :mod:`fedhet.generators.base` (the interface), :mod:`~fedhet.generators.stylegan`,
:mod:`~fedhet.generators.pretrain` and :mod:`~fedhet.generators.adapters`, which import only the
interface, so the package has no import cycle (``adapters`` is imported on demand because its
sources need optional dependencies).
"""

from __future__ import annotations

from pathlib import Path

from fedhet.generators.artifacts import load_artifact
from fedhet.generators.base import DEFAULT_GENERATOR, GeneratorAdapter, check_artifact_name
from fedhet.generators.pretrain import ensure_artifact
from fedhet.generators.stylegan import StyleGeneratorAdapter


def load_generator(name: str = DEFAULT_GENERATOR, cache_dir: str | Path | None = None) -> GeneratorAdapter:
    """Load a frozen generator by name (see the module docstring for the names).

    The embedded artifacts (``"embedded-stylegan"``, ``"embedded-stylegan-pool"``) are pretrained
    on first use when missing (one log line says so, with progress; minutes on a CPU core), unless
    ``$FEDHET_AUTO_PRETRAIN`` is ``0``. Other artifact names and user-supplied sources are never built.

    Args:
        name: ``"embedded-stylegan"``, ``"embedded-stylegan-pool"`` / another pretrained artifact
            name, ``"untrained"``, ``"stable-diffusion:<dir>"`` or ``"stylegan-pkl:<path>"``.
        cache_dir: cache root holding ``generators/`` (default ``$FEDHET_CACHE`` or ``~/.cache/fedhet``).

    Raises:
        ConfigError: unknown or missing generator (a missing embedded one only with
            ``$FEDHET_AUTO_PRETRAIN=0``), or a missing optional dependency.
        CheckpointError: the artifact's checksum or contents do not match.
    """
    if name == "untrained":
        return StyleGeneratorAdapter.untrained()
    if name.startswith("stable-diffusion:"):
        from fedhet.generators.adapters import DiffusersVAEAdapter

        return DiffusersVAEAdapter(name.split(":", 1)[1])
    if name.startswith("stylegan-pkl:"):
        from fedhet.generators.adapters import StyleGANPickleAdapter

        return StyleGANPickleAdapter(name.split(":", 1)[1])
    ensure_artifact(check_artifact_name(name), cache_dir)
    return load_artifact(name, cache_dir)
