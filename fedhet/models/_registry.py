"""Model registry: ``@register_model`` entrypoints, ``create_model`` and ``list_models`` (timm's pattern).

Models are looked up by name from configs instead of ``eval``-ing strings (HtFLlib) or dispatching
on ``if``/``elif`` chains, so a typo fails at start-up with a suggestion, and a new backbone is one
decorated function.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from fedhet.errors import ConfigError
from fedhet.models.base import FeatureClassifier
from fedhet.seeding import seeded

__all__ = ["create_model", "is_model", "list_models", "model_tags", "register_model"]

_F = TypeVar("_F", bound=Callable[..., FeatureClassifier])

_model_entrypoints: dict[str, Callable[..., FeatureClassifier]] = {}
_model_tags: dict[str, frozenset[str]] = {}

# Options every FeatureClassifier accepts (see FeatureClassifier._init_head); entrypoints forward
# them through **kwargs instead of repeating them.
_COMMON_OPTIONS = ("feature_dim", "feature_proj")
# Arguments create_model passes itself; not user options.
_RESERVED = ("num_classes", "in_channels")


@overload
def register_model(fn: _F, *, tags: Iterable[str] = ()) -> _F: ...


@overload
def register_model(fn: None = None, *, tags: Iterable[str] = ()) -> Callable[[_F], _F]: ...


def register_model(fn: _F | None = None, *, tags: Iterable[str] = ()) -> _F | Callable[[_F], _F]:
    """Register a model entrypoint under its function name.

    The entrypoint takes ``(num_classes, in_channels=3, <model options>, **kwargs)`` and returns a
    :class:`FeatureClassifier`; ``**kwargs`` carries the options common to all models
    (``feature_dim``, ``feature_proj``). Its keyword parameters are the options ``create_model``
    accepts for that name, so a misspelt option is rejected before anything is built.

    Args:
        fn: the entrypoint (when used as ``@register_model``).
        tags: labels for ``list_models(tag=...)``: ``"cpu"`` marks CPU-sized models (tens of
            thousands of parameters), ``"torchvision"``, ``"htfllib"``, ``"fccl"`` their origin.

    Example:
        >>> @register_model(tags=("cpu",))
        ... def my_cnn(num_classes: int, in_channels: int = 3, **kwargs):  # doctest: +SKIP
        ...     return MyCNN(num_classes, in_channels, **kwargs)
    """

    def decorator(entrypoint: _F) -> _F:
        name = entrypoint.__name__
        if name in _model_entrypoints:
            # A programming error in the zoo itself, not a user error: fail loudly at import.
            raise ValueError(f"model {name!r} is registered twice")
        _model_entrypoints[name] = entrypoint
        _model_tags[name] = frozenset(tags)
        return entrypoint

    return decorator(fn) if fn is not None else decorator


def list_models(pattern: str | None = None, tag: str | None = None) -> list[str]:
    """Return the sorted names of registered models.

    Args:
        pattern: optional shell-style wildcard (``"resnet*"``), matched with :func:`fnmatch.fnmatch`.
        tag: optional tag the models must carry (``"cpu"`` for the CPU-sized zoo).
    """
    names = sorted(_model_entrypoints)
    if pattern is not None:
        names = [n for n in names if fnmatch.fnmatch(n, pattern)]
    if tag is not None:
        names = [n for n in names if tag in _model_tags[n]]
    return names


def is_model(name: str) -> bool:
    """Return whether ``name`` is a registered model."""
    return name in _model_entrypoints


def model_tags(name: str) -> frozenset[str]:
    """Return the tags a registered model was registered with (``ConfigError`` if unknown)."""
    _check_name(name)
    return _model_tags[name]


def _check_name(name: str) -> None:
    if name in _model_entrypoints:
        return
    close = difflib.get_close_matches(str(name), list(_model_entrypoints), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(
        f"unknown model {name!r}; {hint}run `fedhet list` or check fedhet.models.list_models()"
        " for the registered names"
    )


def _model_options(name: str) -> list[str]:
    params = inspect.signature(_model_entrypoints[name]).parameters.values()
    own = [p.name for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD]
    return [p for p in own if p not in _RESERVED] + list(_COMMON_OPTIONS)


def create_model(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    seed: int | None = None,
    **kwargs: Any,
) -> FeatureClassifier:
    """Build a registered model, optionally with a reproducible initialisation of its own.

    With ``seed`` set, the weights are drawn under :func:`torch.random.fork_rng` after
    ``torch.manual_seed(seed)``: the result depends only on ``(name, arguments, seed)``, and the
    caller's global RNG stream is left exactly as it was, so creating client models never shifts
    data order or augmentation. Give each client its own seed (``derive_seed(seed, "init", cid)``,
    see :func:`fedhet.models.create_client_model`) so that clients sharing an architecture do not
    start from identical weights, unlike HtFLlib, which calls ``torch.manual_seed(0)`` per client.

    Args:
        name: a registered model name (see :func:`list_models`).
        num_classes: number of output logits.
        in_channels: number of input image channels (1 for grey-scale digits, 3 for colour).
        seed: initialisation seed; ``None`` draws from (and advances) the global torch RNG.
        **kwargs: model options, e.g. ``width`` for CPU models, ``feature_dim`` / ``feature_proj``
            for every model (see :class:`FeatureClassifier`).

    Returns:
        The model, in training mode, on the CPU.

    Raises:
        ConfigError: unknown name or option, or invalid sizes; the message names the fix.

    Example:
        >>> model = create_model("cnn_tiny", num_classes=10, seed=0)
        >>> model(torch.zeros(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """
    _check_name(name)
    allowed = _model_options(name)
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"unknown option {unknown[0]!r} for model {name!r}; {hint}accepted options: {', '.join(allowed)}"
        )
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be a positive integer, got {num_classes!r}; fix the model num_classes")
    if not isinstance(in_channels, int) or in_channels < 1:
        raise ConfigError(f"in_channels must be a positive integer, got {in_channels!r}; fix the model in_channels")
    entrypoint = _model_entrypoints[name]
    if seed is None:
        return entrypoint(num_classes=num_classes, in_channels=in_channels, **kwargs)
    # Parameters are created on the CPU, so only the CPU generator is seeded and restored.
    with seeded(seed):
        return entrypoint(num_classes=num_classes, in_channels=in_channels, **kwargs)
