"""Named heterogeneous model families, declared as data in ``families.yaml``.

A family is an ordered list of registered model names; client ``i`` gets ``family[i % len(family)]``
(HtFLlib's convention), so HtFE-img-8 with 20 clients gives each architecture to 2 or 3 clients.
Families live in YAML rather than code so that a new heterogeneity setting is a data change, and
so the paper groups (HtFLlib's HtFE-img-*) can be kept verbatim and diffed against the source.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from fedhet.errors import ConfigError
from fedhet.models._registry import create_model, is_model, list_models
from fedhet.models.base import FeatureClassifier
from fedhet.seeding import derive_seed

__all__ = [
    "ModelFamily",
    "create_client_model",
    "get_family",
    "is_homogeneous",
    "list_families",
    "model_for_client",
    "resolve_family",
]


@dataclass(frozen=True)
class ModelFamily:
    """One entry of ``families.yaml``.

    Attributes:
        name: canonical name (lowercase, underscores).
        models: registered model names, in client order.
        description: what the family is for.
        source: where it comes from (paper, library file, fedhet spec).
        aliases: other accepted names (the paper spellings, e.g. ``HtFE8``).
    """

    name: str
    models: tuple[str, ...]
    description: str = ""
    source: str = ""
    aliases: tuple[str, ...] = ()


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


@functools.lru_cache(maxsize=1)
def _families() -> dict[str, ModelFamily]:
    """Read ``families.yaml`` once, lazily (importing ``fedhet.models`` reads no file)."""
    text = resources.files("fedhet.models").joinpath("families.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    families: dict[str, ModelFamily] = {}
    for name, entry in raw.items():
        models = entry.get("models") if isinstance(entry, dict) else None
        if not models or not all(isinstance(m, str) for m in models):
            # A broken package file, not a user error.
            raise ValueError(f"families.yaml: family {name!r} needs a non-empty list of model names")
        families[name] = ModelFamily(
            name=name,
            models=tuple(models),
            description=str(entry.get("description", "")).strip(),
            source=str(entry.get("source", "")),
            aliases=tuple(entry.get("aliases", ())),
        )
    return families


def _lookup() -> dict[str, str]:
    table = {}
    for family in _families().values():
        table[_normalise(family.name)] = family.name
        for alias in family.aliases:
            table[_normalise(alias)] = family.name
    return table


def list_families() -> list[str]:
    """Return the sorted canonical names of the declared families."""
    return sorted(_families())


def get_family(name: str) -> ModelFamily:
    """Return the declared family ``name`` (any case, ``-`` or ``_``, or a paper alias such as ``HtFE8``).

    Raises:
        ConfigError: no family has that name; the message lists the families.
    """
    canonical = _lookup().get(_normalise(name))
    if canonical is None:
        close = difflib.get_close_matches(_normalise(name), list(_lookup()), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(dict.fromkeys(_lookup()[c] for c in close))}? " if close else ""
        raise ConfigError(
            f"unknown model family {name!r}; {hint}known families: {', '.join(list_families())}"
            " (or give an explicit list of model names)"
        )
    return _families()[canonical]


def resolve_family(spec: str | Sequence[str]) -> list[str]:
    """Turn a family spec from a config into the list of model names, validating every name.

    Args:
        spec: a family name or alias (``"cpu4"``, ``"HtFE-img-8"``), a single registered model name
            (a homogeneous family of one), or an explicit list of model names.

    Returns:
        The model names in client order.

    Raises:
        ConfigError: unknown family, unknown model name, or an empty list.

    Example:
        >>> resolve_family("tiny2")
        ['cnn_tiny', 'mlp_tiny']
        >>> resolve_family(["cnn_tiny", "cnn_tiny"])
        ['cnn_tiny', 'cnn_tiny']
    """
    if isinstance(spec, str):
        if is_model(spec) and _normalise(spec) not in _lookup():
            return [spec]
        models = list(get_family(spec).models)
    else:
        models = list(spec)
        if not models:
            raise ConfigError("the model family is an empty list; give a family name or at least one model name")
    for name in models:
        if not isinstance(name, str) or not is_model(name):
            close = difflib.get_close_matches(str(name), list_models(), n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"unknown model {name!r} in model family; {hint}run `fedhet list` or check"
                " fedhet.models.list_models() for the registered names"
            )
    return models


def model_for_client(family: Sequence[str], client_id: int) -> str:
    """Return the architecture of client ``client_id``: ``family[client_id % len(family)]`` (HtFLlib)."""
    if not family:
        raise ConfigError("the model family is empty; give at least one model name")
    if client_id < 0:
        raise ValueError(f"client_id must be non-negative, got {client_id}")
    return family[client_id % len(family)]


def is_homogeneous(family: Sequence[str]) -> bool:
    """Return whether every client gets the same architecture (what FedAvg-style averaging needs).

    Model options (``feature_dim``, ``width``) are applied to every client alike, so the names
    decide it.
    """
    return len(set(family)) == 1


def create_client_model(
    family: Sequence[str],
    client_id: int,
    num_classes: int,
    seed: int,
    in_channels: int = 3,
    **kwargs: Any,
) -> FeatureClassifier:
    """Build client ``client_id``'s model with its own reproducible initialisation.

    The initialisation seed is ``derive_seed(seed, "model_init", client_id)``: it depends only on
    the experiment seed and the client, so a resumed or a Ray run builds the same weights, and
    clients sharing an architecture start from different weights (HtFLlib seeds every client
    with 0, which makes them identical; pass the same ``seed`` to ``create_model`` for that).

    Args:
        family: the resolved family (see :func:`resolve_family`).
        client_id: the client index (``0 .. n_clients - 1``).
        num_classes: number of logits.
        seed: the experiment seed.
        in_channels: image channels.
        **kwargs: model options for every client (``feature_dim=512`` reproduces HtFLlib's shared
            feature size; see :func:`create_model`).
    """
    name = model_for_client(family, client_id)
    return create_model(name, num_classes, in_channels, seed=derive_seed(seed, "model_init", client_id), **kwargs)
