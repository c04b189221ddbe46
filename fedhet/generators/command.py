"""``fedhet pretrain-generator``: the command that trains and saves FedKTL's small generator.

It parses its options with jsonargparse (``--help`` from the same declarations) and calls
:func:`fedhet.generators.pretrain.pretrain_generator`; bad options are one
:class:`~fedhet.errors.ConfigError` line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedhet.errors import ConfigError
from fedhet.generators.base import DEFAULT_GENERATOR
from fedhet.generators.pretrain import DEFAULT_STEPS, EMBEDDED_RECIPES, POOL_GENERATOR, pretrain_generator

__all__ = ["pretrain_command"]


def _build_parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog="fedhet pretrain-generator",
        description=(
            "Pretrain FedKTL's small style generator on embedded public images (once per machine; "
            f"FedKTL also builds {' and '.join(EMBEDDED_RECIPES)} by itself on first use)."
        ),
        exit_on_error=False,
        default_meta=False,
    )
    parser.add_argument("--name", type=str, default=DEFAULT_GENERATOR, help="artifact name (load_generator(name))")
    parser.add_argument("--steps", type=int | None, default=None, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation, batch order and noise")
    parser.add_argument("--image_size", type=int, default=32, help="image side: 32, or 16 for a cheaper generator")
    parser.add_argument("--cache_dir", type=str | None, default=None, help="cache root (default $FEDHET_CACHE)")
    parser.add_argument("--force", type=bool, default=False, help="overwrite an artifact built with other settings")
    parser.add_argument(
        "--sources",
        type=list[str] | None,
        default=None,
        help=f"embedded datasets of the pool (default: the name's recipe, e.g. {POOL_GENERATOR}: "
        f"{' '.join(EMBEDDED_RECIPES[POOL_GENERATOR].sources)}; other names: photos)",
    )
    parser.add_argument(
        "--augment", type=bool | None, default=None, help="source-balanced, augmented batches (default: the recipe's)"
    )
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
        progress=None,
        sources=options.sources,
        augment=options.augment,
    )
    return f"generator '{options.name}': {weights} (samples: {weights.with_suffix('.png')})"
