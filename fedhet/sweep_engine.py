"""The search engine behind ``fedhet sweep``: W&B's sweep schema, proposed offline.

Why fedhet has its own: W&B's open-source engine (the ``sweeps`` package) declares ``numpy<2``
and would downgrade numpy under torch when installed with its dependencies, so it cannot come
with ``pip install -e .``. The sweep *format* stays W&B's, so one YAML runs with ``fedhet sweep``
and with ``wandb agent``; what this module reimplements is small and follows W&B's rules exactly:

- **parameters**: ``value``, ``values`` (+ ``probabilities``), ``parameters`` (a nested group,
  proposed as a dict under its key) and every ``distribution`` of W&B's schema, each with W&B's
  defaults and W&B's inference when ``distribution`` is absent (integer ``min``/``max``:
  ``int_uniform``; a float among them: ``uniform``);
- **grid**: the product of the discrete parameters (``values``, ``value``, ``int_uniform`` as
  ``min..max``, ``q_uniform`` as W&B's ``arange(min, max, q)``), parameters in name order, the
  last varying fastest; points already run are skipped;
- **random**: every parameter drawn through its quantile function from a generator seeded by
  the sweep seed and the run's index, so a seed gives the same sampled configs on any machine;
- **bayes**: Optuna's TPE sampler (a Bayesian optimiser, tree-structured Parzen estimator;
  W&B's server uses a Gaussian process, so the proposals differ, the search space does not),
  asked afresh for each run with the finished runs as its history and the running ones as
  "constant liars" (so parallel runs do not all go to the same point). Continuous parameters are
  searched on their quantile scale (W&B's bayes search normalises them the same way), so a
  log-uniform learning rate is searched on its log scale.

A parameter's value is always a plain Python value (int, float, str, list, dict, None), written
into ``--key=value`` exactly as W&B's agent writes it.

It knows nothing of runs or processes, so a tuning stage can drive it directly::

    space = parse_parameters({"method.init_args.lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 1e-1}})
    trials = []
    for index in range(budget):
        params = propose("bayes", space, trials, seed=derive(seed, index), goal="maximize")
        trials.append(Trial(params, validation_score(params)))
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import yaml

from fedhet.errors import ConfigError

#: Joins the names of nested parameters internally: W&B's delimiter (``[`` cannot occur in a
#: parameter name), so that nested parameters sort, and so enumerate, exactly as in W&B's engine.
NEST = ".wbnest[599c28ca25da]."
#: The top-level keys of W&B's sweep schema (``sweeps/config/schema.json``, ``properties``).
SWEEP_KEYS = (
    "apiVersion", "kind", "controller", "description", "program", "job", "image_uri", "entity", "project",
    "method", "command", "name", "run_cap", "metric", "metrics", "scheduler", "early_terminate", "parameters",
)
METHODS = ("grid", "random", "bayes")
#: The keys of W&B's ``metric:`` (``impute``: what a failed run counts as in bayes search).
METRIC_KEYS = ("name", "goal", "target", "impute", "impute_while_running")
Q_DEFAULT = 1.0
#: Each distribution's keys besides ``distribution`` and their defaults (``...``: required).
DISTRIBUTIONS: dict[str, dict[str, Any]] = {
    "constant": {"value": ...},
    "categorical": {"values": ...},
    "categorical_w_probabilities": {"values": ..., "probabilities": ...},
    "int_uniform": {"min": ..., "max": ...},
    "uniform": {"min": ..., "max": ...},
    "q_uniform": {"min": ..., "max": ..., "q": Q_DEFAULT},
    "log_uniform": {"min": ..., "max": ...},
    "log_uniform_values": {"min": ..., "max": ...},
    "q_log_uniform": {"min": ..., "max": ..., "q": Q_DEFAULT},
    "q_log_uniform_values": {"min": ..., "max": ..., "q": Q_DEFAULT},
    "inv_log_uniform": {"min": ..., "max": ...},
    "inv_log_uniform_values": {"min": ..., "max": ...},
    "normal": {"mu": 0.0, "sigma": 1.0},
    "q_normal": {"mu": 0.0, "sigma": 1.0, "q": Q_DEFAULT},
    "log_normal": {"mu": 0.0, "sigma": 1.0},
    "q_log_normal": {"mu": 0.0, "sigma": 1.0, "q": Q_DEFAULT},
    "beta": {"a": 1.0, "b": 1.0},
    "q_beta": {"a": 1.0, "b": 1.0, "q": Q_DEFAULT},
}
#: Distributions whose ``min`` must be > 0 (they take logarithms of the limit values).
POSITIVE_MIN = ("log_uniform_values", "q_log_uniform_values", "inv_log_uniform_values")
#: What a grid can enumerate (W&B's grid search allows the same).
GRID_KINDS = ("constant", "categorical", "int_uniform", "q_uniform")
#: Quantiles kept off 0 and 1 so that unbounded distributions (normal, log-normal) stay finite.
EPS = 1e-12


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _clean(value: float) -> float:
    """A float without the binary noise of ``k * q`` (``0.30000000000000004`` -> ``0.3``)."""
    return float(f"{value:.12g}")


def value_key(value: Any) -> str:
    """A value's identity for de-duplicating grid points (W&B's ``yaml_hash``: ``3.0`` equals ``3``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return hashlib.md5(yaml.safe_dump(value, default_flow_style=True, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class Param:
    """One searched (or constant) parameter: ``name`` (nested levels joined by ``NEST``), its kind and settings."""

    name: str
    kind: str
    config: dict[str, Any]

    @property
    def label(self) -> str:
        return self.name.replace(NEST, ".parameters.")

    # quantile function and its inverse ---------------------------------------------------------
    def ppf(self, u: float) -> Any:
        """The value at quantile ``u`` in [0, 1] (W&B's ``HyperParameter.ppf`` for every kind)."""
        c, kind = self.config, self.kind
        u = min(max(float(u), 0.0), 1.0)
        if kind == "constant":
            return c["value"]
        if kind == "categorical":
            values = c["values"]  # the smallest index whose cdf reaches u (scipy's randint.ppf)
            return values[min(max(math.ceil(u * len(values)) - 1, 0), len(values) - 1)]
        if kind == "categorical_w_probabilities":
            cumulative = list(itertools.accumulate(c["probabilities"]))
            index = next((i for i, p in enumerate(cumulative) if u < p), len(cumulative) - 1)
            return c["values"][index]
        if kind == "int_uniform":
            span = c["max"] - c["min"] + 1
            return c["min"] + min(max(math.ceil(u * span) - 1, 0), span - 1)
        base = kind[2:] if kind.startswith("q_") else kind
        if base == "uniform":
            x = c["min"] + u * (c["max"] - c["min"])
        elif base in ("log_uniform", "log_uniform_values"):
            lo, hi = (c["min"], c["max"]) if base == "log_uniform" else (math.log(c["min"]), math.log(c["max"]))
            x = math.exp(lo + u * (hi - lo))
        elif kind == "inv_log_uniform":  # exp(-U(min, max)): a value in [e^-max, e^-min]
            x = math.exp(-(c["min"] + (1.0 - u) * (c["max"] - c["min"])))
        elif kind == "inv_log_uniform_values":  # 1/x log-uniform in [1/max, 1/min]
            lo, hi = -math.log(c["max"]), -math.log(c["min"])
            x = math.exp(-(lo + (1.0 - u) * (hi - lo)))
        elif base in ("normal", "log_normal"):
            z = NormalDist().inv_cdf(min(max(u, EPS), 1.0 - EPS))
            x = c["mu"] + c["sigma"] * z
            x = math.exp(x) if base == "log_normal" else x
        elif base == "beta":
            from scipy import stats

            x = float(stats.beta.ppf(u, c["a"], c["b"]))
        else:  # pragma: no cover - parse_parameters admits only the kinds above
            raise ValueError(kind)
        return self._quantise(x) if kind.startswith("q_") else float(x)

    def _quantise(self, x: float) -> int | float:
        """``round(x / q) * q``; an integer when ``q`` is one (W&B's rule)."""
        q = self.config["q"]
        value = round(x / q) * q
        return int(value) if _is_int(q) else _clean(float(value))

    def cdf(self, value: Any) -> float:
        """The quantile of ``value`` (for continuous kinds): how bayes reads a finished run back."""
        c, kind = self.config, self.kind
        base = kind[2:] if kind.startswith("q_") else kind
        x = float(value)
        if base == "uniform":
            u = (x - c["min"]) / (c["max"] - c["min"])
        elif base in ("log_uniform", "log_uniform_values"):
            lo, hi = (c["min"], c["max"]) if base == "log_uniform" else (math.log(c["min"]), math.log(c["max"]))
            u = (math.log(x) - lo) / (hi - lo) if x > 0 else 0.0
        elif kind == "inv_log_uniform":
            u = 1.0 - (-math.log(x) - c["min"]) / (c["max"] - c["min"]) if x > 0 else 0.0
        elif kind == "inv_log_uniform_values":
            lo, hi = -math.log(c["max"]), -math.log(c["min"])
            u = 1.0 - (-math.log(x) - lo) / (hi - lo) if x > 0 else 0.0
        elif base == "normal":
            u = NormalDist(c["mu"], c["sigma"]).cdf(x) if c["sigma"] > 0 else 0.5
        elif base == "log_normal":
            u = NormalDist(c["mu"], c["sigma"]).cdf(math.log(x)) if x > 0 and c["sigma"] > 0 else 0.5
        elif base == "beta":
            from scipy import stats

            u = float(stats.beta.cdf(x, c["a"], c["b"]))
        else:  # pragma: no cover
            raise ValueError(kind)
        return min(max(u, 0.0), 1.0)

    # grid --------------------------------------------------------------------------------------
    def grid_values(self) -> list[Any]:
        """The values a grid enumerates (W&B's: ``int_uniform`` ``min..max``, ``q_uniform`` ``arange(min, max, q)``)."""
        c = self.config
        if self.kind == "constant":
            return [c["value"]]
        if self.kind == "categorical":
            return list(c["values"])
        if self.kind == "int_uniform":
            return list(range(c["min"], c["max"] + 1))
        if self.kind == "q_uniform":
            steps = math.ceil((c["max"] - c["min"]) / c["q"] - 1e-9)
            values = [c["min"] + i * c["q"] for i in range(steps)]
            ints = all(_is_int(v) for v in (c["min"], c["max"], c["q"]))
            return [int(v) if ints else _clean(float(v)) for v in values]
        raise ConfigError(
            f"sweep parameter {self.label!r}: grid search enumerates values, value, int_uniform or q_uniform, "
            f"not {self.kind}; use method: random or bayes"
        )


def _param(name: str, config: Any) -> Param | None:
    """One parameter of W&B's schema, defaults filled; ``None`` for a nested group (``parameters:``)."""
    where = f"sweep parameter {name.replace(NEST, '.parameters.')!r}"
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where} must be a mapping such as {{values: [...]}} or {{min: 0.001, max: 0.1}}")
    config = dict(config)
    kind = config.pop("distribution", None)
    if kind is None:
        if "parameters" in config:
            if set(config) != {"parameters"}:
                extra = sorted(set(config) - {"parameters"})
                raise ConfigError(f"{where}: a nested group holds only parameters:, not {extra}")
            return None
        if "value" in config:
            kind = "constant"
        elif "values" in config:
            kind = "categorical_w_probabilities" if "probabilities" in config else "categorical"
        elif "min" in config and "max" in config:
            kind = "int_uniform" if _is_int(config["min"]) and _is_int(config["max"]) else "uniform"
        else:
            raise ConfigError(
                f"{where} needs value, values, min and max, a distribution or a nested parameters: group"
            )
    if kind not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {kind!r}; W&B's are {', '.join(DISTRIBUTIONS)}")
    fields = DISTRIBUTIONS[kind]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: {kind} takes {', '.join(fields)}, not {', '.join(map(str, unknown))}")
    missing = [k for k, default in fields.items() if default is ... and k not in config]
    if missing:
        raise ConfigError(f"{where}: {kind} needs {' and '.join(missing)}")
    filled = {k: config.get(k, default) for k, default in fields.items()}
    for key in ("min", "max", "mu", "sigma", "q", "a", "b"):
        if key in filled and not _is_number(filled[key]):
            raise ConfigError(f"{where}: {key} must be a finite number, not {filled[key]!r}")
    if kind == "int_uniform" and not (_is_int(filled["min"]) and _is_int(filled["max"])):
        raise ConfigError(f"{where}: int_uniform needs integer min and max, not {filled['min']!r}, {filled['max']!r}")
    if "min" in filled and filled["min"] >= filled["max"]:
        raise ConfigError(f"{where}: min {filled['min']} is not less than max {filled['max']}")
    if kind in POSITIVE_MIN and filled["min"] <= 0:
        raise ConfigError(f"{where}: {kind} needs min > 0 (limit values, logged); use log_uniform for exponents")
    if "q" in filled and filled["q"] <= 0:
        raise ConfigError(f"{where}: q must be > 0, not {filled['q']}")
    for key in ("sigma", "a", "b"):
        if key in filled and filled[key] < 0:
            raise ConfigError(f"{where}: {key} must be >= 0, not {filled[key]}")
    if "values" in filled and (not isinstance(filled["values"], list) or not filled["values"]):
        raise ConfigError(f"{where}: values must be a non-empty list")
    if kind == "categorical_w_probabilities":
        probabilities = filled["probabilities"]
        if (
            not isinstance(probabilities, list)
            or len(probabilities) != len(filled["values"])
            or not all(_is_number(p) and p >= 0 for p in probabilities)
            or not math.isclose(sum(probabilities), 1.0, rel_tol=0, abs_tol=1e-6)
        ):
            raise ConfigError(f"{where}: probabilities must be one number >= 0 per value, summing to 1")
    return Param(name, kind, filled)


def parse_parameters(parameters: Any, prefix: str = "") -> list[Param]:
    """The ``parameters:`` section as a flat list, sorted by name (the order of W&B's engine)."""
    if not isinstance(parameters, Mapping) or not parameters:
        raise ConfigError("sweep config: parameters: must name at least one parameter")
    out: list[Param] = []
    for key in sorted(parameters, key=str):
        name = str(key)
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(ch.isalnum() or ch in "_.-" for ch in name):
            raise ConfigError(f"sweep parameter {name!r}: a name is letters, digits, '_', '.' and '-' (W&B's rule)")
        param = _param(prefix + name, parameters[key])
        if param is None:
            out += parse_parameters(parameters[key]["parameters"], prefix + name + NEST)
        else:
            out.append(param)
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Flat names back to nested dicts: a nested group arrives as one dict under its key.

    Plain parameters come first, then the groups (the order of W&B's ``to_config``, hence of
    the ``--key=value`` flags).
    """
    out: dict[str, Any] = {name: value for name, value in flat.items() if NEST not in name}
    for name, value in flat.items():
        if NEST not in name:
            continue
        *path, last = name.split(NEST)
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def flatten(params: Mapping[str, Any], space: Sequence[Param]) -> dict[str, Any] | None:
    """A run's (nested) values back as ``{flat name: value}`` for ``space``; ``None`` when one is missing."""
    out: dict[str, Any] = {}
    for param in space:
        node: Any = params
        for part in param.name.split(NEST):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        out[param.name] = node
    return out


# ---------------------------------------------------------------------------------------------- the sweep config
def check_spec(spec: Any, where: str = "sweep config") -> list[Param]:
    """Check a sweep config against W&B's schema (what fedhet reads of it); its parameters, parsed."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be a mapping with method, parameters and command")
    unknown = [str(k) for k in spec if k not in SWEEP_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; W&B's sweep keys are {', '.join(SWEEP_KEYS)}")
    if spec.get("method") not in METHODS:
        raise ConfigError(f"{where}: method must be grid, random or bayes, not {spec.get('method')!r}")
    if not isinstance(spec.get("parameters"), Mapping) or not spec["parameters"]:
        raise ConfigError(f"{where}: parameters: must name at least one parameter")
    metric = spec.get("metric")
    if metric is not None:
        if not isinstance(metric, Mapping) or not isinstance(metric.get("name"), str) or not metric["name"]:
            raise ConfigError(f"{where}: metric: needs a name, e.g. metric: {{name: acc_inter, goal: maximize}}")
        if metric.get("goal", "minimize") not in ("minimize", "maximize"):
            raise ConfigError(f"{where}: metric.goal must be minimize or maximize, not {metric.get('goal')!r}")
        unknown = [str(k) for k in metric if k not in METRIC_KEYS]
        if unknown:
            raise ConfigError(f"{where}: metric: unknown key {unknown[0]!r}; W&B's are {', '.join(METRIC_KEYS)}")
        if "target" in metric and not _is_number(metric["target"]):
            raise ConfigError(f"{where}: metric.target must be a number, not {metric['target']!r}")
        if metric.get("impute", "worst") not in ("worst", "best", "latest"):
            raise ConfigError(f"{where}: metric.impute must be worst, best or latest, not {metric.get('impute')!r}")
    if spec["method"] == "bayes" and not isinstance(metric, Mapping):
        raise ConfigError(f"{where}: bayes search needs metric: {{name: ..., goal: maximize}}")
    cap = spec.get("run_cap")
    if cap is not None and not (_is_int(cap) and cap > 0):
        raise ConfigError(f"{where}: run_cap must be a whole number > 0, not {cap!r}")
    command = spec.get("command")
    if command is not None and not isinstance(command, list):
        raise ConfigError(f"{where}: command: must be a list, e.g. [${{env}}, ${{interpreter}}, -m, fedhet, fit, ...]")
    early = spec.get("early_terminate")
    if early is not None and not (isinstance(early, Mapping) and early.get("type") == "hyperband"):
        raise ConfigError(f"{where}: early_terminate: W&B supports only type: hyperband")
    space = parse_parameters(spec["parameters"])
    if spec["method"] == "grid":
        for param in space:
            param.grid_values()  # one line naming a parameter a grid cannot enumerate
    return space


# ---------------------------------------------------------------------------------------------- proposals
@dataclass
class Trial:
    """What the engine knows of a run: its values, its metric (``None`` when it has none) and its state."""

    params: dict[str, Any]
    value: float | None = None
    state: str = "finished"  # finished, failed or running


def grid_next(space: Sequence[Param], trials: Sequence[Trial]) -> dict[str, Any] | None:
    """The first grid point (parameters in name order, the last varying fastest) no trial has taken."""
    seen = set()
    for trial in trials:
        flat = flatten(trial.params, space)
        if flat is not None:
            seen.add(tuple(value_key(flat[p.name]) for p in space))
    for point in itertools.product(*(p.grid_values() for p in space)):
        if tuple(value_key(v) for v in point) not in seen:
            return nest({p.name: v for p, v in zip(space, point, strict=True)})
    return None


def grid_size(space: Sequence[Param]) -> int:
    """How many points a grid has (the product of the value counts)."""
    return math.prod(len(p.grid_values()) for p in space)


def random_point(space: Sequence[Param], seed: int) -> dict[str, Any]:
    """One draw of every parameter (in name order) from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    # one uniform draw per parameter, constants included, in name order: W&B's random search
    # (``random.uniform(0, 1)`` through each quantile function), so a seeded draw is W&B's draw
    return nest({p.name: p.ppf(rng.random()) for p in space})


def load_optuna() -> Any:
    """Optuna (installed with fedhet), or one line saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "bayes search needs Optuna, which fedhet's install brings: pip install optuna (docs/sweeps.md)"
        ) from None
    return optuna


def _index_of(param: Param, value: Any) -> int | None:
    key = value_key(value)
    return next((i for i, v in enumerate(param.config["values"]) if value_key(v) == key), None)


def optuna_distributions(space: Sequence[Param]) -> dict[str, Any]:
    """Optuna's distribution of every searched parameter (:func:`optuna_point` maps a proposal back).

    Categorical ones by index, integers as integers, continuous ones on their quantile scale (log
    kinds on their log scale, as W&B's bayes search normalises them).
    """
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    distributions: dict[str, Any] = {}
    for p in space:
        if p.kind == "constant":
            continue
        if p.kind in ("categorical", "categorical_w_probabilities"):
            distributions[p.name] = CategoricalDistribution(list(range(len(p.config["values"]))))
        elif p.kind == "int_uniform":
            distributions[p.name] = IntDistribution(p.config["min"], p.config["max"])
        else:
            distributions[p.name] = FloatDistribution(0.0, 1.0)
    return distributions


def optuna_point(space: Sequence[Param], asked: Mapping[str, Any]) -> dict[str, Any]:
    """The parameter values (nested as W&B nests them) of an Optuna proposal on :func:`optuna_distributions`."""
    flat: dict[str, Any] = {}
    for p in space:
        if p.kind == "constant":
            flat[p.name] = p.config["value"]
        elif p.kind in ("categorical", "categorical_w_probabilities"):
            flat[p.name] = p.config["values"][asked[p.name]]
        elif p.kind == "int_uniform":
            flat[p.name] = int(asked[p.name])
        else:
            flat[p.name] = p.ppf(asked[p.name])
    return nest(flat)


def optuna_internal(space: Sequence[Param], flat: Mapping[str, Any]) -> dict[str, Any] | None:
    """The searched values in :func:`optuna_distributions`' terms (``None``: a value outside the space)."""
    out: dict[str, Any] = {}
    for p in space:
        if p.kind == "constant":
            continue
        value = flat.get(p.name)
        if p.kind in ("categorical", "categorical_w_probabilities"):
            out[p.name] = _index_of(p, value)
            if out[p.name] is None:
                return None
        elif p.kind == "int_uniform":
            if not _is_number(value) or not p.config["min"] <= value <= p.config["max"]:
                return None
            out[p.name] = int(value)
        else:
            if not _is_number(value):
                return None
            out[p.name] = p.cdf(value)
    return out


def bayes_point(space: Sequence[Param], trials: Sequence[Trial], goal: str, seed: int) -> dict[str, Any]:
    """The next point Optuna's TPE sampler proposes, given the trials so far (deterministic for a seed).

    A study is rebuilt in memory from ``trials`` on every call (a few ms for hundreds of trials),
    so the proposal depends only on the history and ``seed``: a resumed sweep continues as the
    uninterrupted one would. Finished trials without a finite metric count as failed (TPE
    ignores them); running ones are "constant liars" (TPE assumes them poor until they end).
    """
    import warnings

    optuna = load_optuna()
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = optuna_distributions(space)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's ExperimentalWarning for constant_liar on older versions
        sampler = optuna.samplers.TPESampler(seed=seed % 2**32, constant_liar=True)
        study = optuna.create_study(direction="maximize" if goal == "maximize" else "minimize", sampler=sampler)
        for trial in trials:
            flat = flatten(trial.params, space)
            point = optuna_internal(space, flat) if flat is not None else None
            if point is None:
                continue  # a run of another search space (cannot inform this one)
            if trial.state == "running":
                state, value = TrialState.RUNNING, None
            elif trial.state == "finished" and trial.value is not None and math.isfinite(trial.value):
                state, value = TrialState.COMPLETE, float(trial.value)
            else:
                state, value = TrialState.FAIL, None
            study.add_trial(create_trial(params=point, distributions=distributions, state=state, value=value))
        asked = study.ask(distributions).params if distributions else {}
    return optuna_point(space, asked)


def propose(
    method: str, space: Sequence[Param], trials: Sequence[Trial], seed: int, goal: str = "minimize"
) -> dict[str, Any] | None:
    """The next run's values for ``method`` (``None`` when a grid is exhausted).

    ``seed`` should differ per proposal (``fedhet sweep`` uses the sweep seed and the run's
    index), so that random draws differ between runs and repeat between sweeps.
    """
    if method == "grid":
        return grid_next(space, trials)
    if method == "random":
        return random_point(space, seed)
    if method == "bayes":
        return bayes_point(space, trials, goal, seed)
    raise ConfigError(f"sweep config: method must be grid, random or bayes, not {method!r}")
