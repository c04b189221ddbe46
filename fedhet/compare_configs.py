"""Are the shipped configs of one scenario folder comparable? The settings they must share, and where they differ.

Configs in one folder of ``configs/experiments/`` are rows of one comparison: a user runs two
of them and compares the numbers. That is only fair if they differ in the method and its own
hyperparameters, and nothing else: same client optimizer (optimizer, learning rate, momentum,
weight decay), same ``federation.lr_schedule``, same local budget (``trainer``), rounds, seed,
round-loop settings and data (``scenario``). :func:`folder_differences` loads every config of a
folder through the command line's own parser (``fedhet fit --config``), instantiates it, and
lists the settings in which a config departs from the folder's most common value.

What is the method's own, and so never compared: its ``init_args`` apart from the client
optimizer (its loss weights, server budgets, public-phase optimizer ...); the public-data keys of
the scenario for a method that uses no public data; the model family, which is compared among
the methods that allow heterogeneous models and, separately, among those needing one
architecture (weight averaging); ``feature_dim``, compared among the methods exchanging
features; reporting and execution settings (``federation.target_accuracy``, the executor, the
state store, W&B, the run directory). An intended difference (an ablation row in the folder) is
declared with a reason per key in ``allowed`` and is then left out of the report; a declared
difference that no longer differs is reported too, so allow-lists do not go stale.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Keys that describe how a run is executed or reported, not what it trains.
NOT_COMPARED = (
    "config",
    "run_dir",
    "wandb.",
    "federation.target_accuracy",
    "federation.executor",
    "federation.state_store",
    "federation.disk_threshold",
    "__path__",
)

#: Scenario keys that only matter to methods using public data.
PUBLIC_KEYS = ("scenario.init_args.public",)


@dataclass(frozen=True)
class Difference:
    """One setting in which a config departs from its folder's most common value."""

    config: str
    key: str
    value: Any
    common: Any

    def __str__(self) -> str:
        return f"{self.key}={self.value!r} (folder: {self.common!r})"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list):
        return {prefix: tuple(_plain(v) for v in value)}
    return {prefix: _plain(value)}


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value == int(value) and abs(value) < 1e15:
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def comparable_settings(path: str | Path) -> dict[str, Any]:
    """The settings of one config that its folder's configs must share, as ``{dotted key: value}``.

    Parsed and instantiated exactly as ``fedhet fit --config PATH`` does (defaults filled in).
    """
    from fedhet.config import build_parser, instantiate, parse_config, prepare_args
    from fedhet.models import resolve_family

    parser = build_parser()
    config = parse_config(parser, prepare_args(["--config", str(path)]))
    objects = instantiate(parser, config)
    method = objects.method
    caps = method.capabilities
    flat = {
        key: value
        for key, value in _flatten(config.as_dict()).items()
        if not key.startswith(("method.", "models", "feature_dim")) and not key.startswith(NOT_COMPARED)
    }
    if not caps.needs_public_data:
        flat = {k: v for k, v in flat.items() if not k.startswith(PUBLIC_KEYS)}
    for key, value in method.client_optimizer().values().items():
        flat[f"client_optimizer.{key}"] = _plain(value)
    # the family in client order (client i gets family[i % len(family)])
    group = "heterogeneous" if caps.heterogeneous_models else "one_architecture"
    flat[f"models[{group} methods]"] = tuple(resolve_family(objects.models))
    if caps.common_feature_dim:
        flat["feature_dim[feature-exchanging methods]"] = config.feature_dim
    return flat


def folder_differences(
    folder: str | Path,
    allowed: Mapping[str, Mapping[str, str]] | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[Difference], list[str]]:
    """Differences of a folder's configs from the folder's most common values, and stale allow-list entries.

    Args:
        folder: a folder of experiment configs (``*.yaml``, not recursive).
        allowed: ``{config file name: {key: reason}}``: declared, intended differences.
        settings: precomputed :func:`comparable_settings` per file name (loaded when ``None``).
    """
    folder = Path(folder)
    allowed = allowed or {}
    if settings is None:
        settings = {path.name: comparable_settings(path) for path in sorted(folder.glob("*.yaml"))}
    keys = sorted({key for values in settings.values() for key in values})
    differences: list[Difference] = []
    differing: set[tuple[str, str]] = set()
    for key in keys:
        present = {name: values[key] for name, values in settings.items() if key in values}
        if len(present) < 2:
            continue
        counts = Counter(repr(v) for v in present.values())
        common_repr, _ = counts.most_common(1)[0]
        common = next(v for v in present.values() if repr(v) == common_repr)
        for name, value in present.items():
            if repr(value) != common_repr:
                differing.add((name, key))
                if key not in allowed.get(name, {}):
                    differences.append(Difference(name, key, value, common))
    stale = [
        f"{name}: {key} is allowed to differ ({reason}) but does not"
        for name, entries in allowed.items()
        for key, reason in entries.items()
        if (name, key) not in differing
    ]
    return differences, stale


def report(folder: str | Path, differences: Sequence[Difference], stale: Sequence[str] = ()) -> str:
    """One line: ``folder: a.yaml: key=value (folder: common), ...; b.yaml: ...`` (empty when comparable)."""
    if not differences and not stale:
        return ""
    by_config: dict[str, list[str]] = {}
    for difference in differences:
        by_config.setdefault(difference.config, []).append(str(difference))
    parts = [f"{name}: {', '.join(items)}" for name, items in sorted(by_config.items())]
    parts += list(stale)
    return f"{Path(folder).name}: " + "; ".join(parts)
