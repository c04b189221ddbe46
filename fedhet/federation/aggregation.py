"""How the weight-averaging servers combine a round's uploads (``federation.aggregator``).

FedAvg's example-weighted mean lets one client move the global model anywhere. The established
Byzantine-robust rules replace that mean, one setting for every weight-averaging method (FedAvg,
FedProx, MOON, FedRS, FedPer, LG-FedAvg, FML, FedType: every server that averages with
:class:`~fedhet.algorithms.shared.common.SubmoduleAveragingServer`'s own ``aggregate``), as Flower
ships them as strategies:

* ``mean``: the example-weighted mean (FedAvg; the default, bit-identical to before);
* ``median``: coordinate-wise median (Flower's ``FedMedian``);
* ``trimmed_mean``: coordinate-wise mean after cutting ``int(beta * n)`` values at each end
  (Flower's ``FedTrimmedAvg``, ``beta`` its ``beta``);
* ``krum``: the upload with the lowest Krum score for ``f`` assumed Byzantine clients, or
  Multi-Krum, the example-weighted mean of the ``m`` lowest (Flower's ``Krum`` with
  ``num_malicious_clients=f``, ``num_clients_to_keep=m``).

The math is in :mod:`fedhet.functional.aggregation`; here only the choice and its checks. A
server that combines uploads its own way (FedDyn, SCAFFOLD, FedProc, prototype and
distillation methods) refuses any rule but ``mean`` at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from fedhet.errors import ConfigError
from fedhet.functional import coordinate_median, krum, trimmed_mean, weighted_average

AggregationRuleName = Literal["mean", "median", "trimmed_mean", "krum"]
RULES = ("mean", "median", "trimmed_mean", "krum")


@dataclass(frozen=True)
class Aggregator:
    """A rule combining one group's uploaded state dicts into the new global state.

    Attributes:
        rule: ``"mean"``, ``"median"``, ``"trimmed_mean"`` or ``"krum"`` (see the module).
        beta: ``trimmed_mean``'s fraction cut at each end, in ``[0, 0.5)`` (Flower's default 0.2).
        f: ``krum``'s assumed number of Byzantine clients per round.
        m: ``krum``'s number of clients kept: 1 is Krum, more is Multi-Krum.
    """

    rule: AggregationRuleName = "mean"
    beta: float = 0.2
    f: int = 1
    m: int = 1

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"federation.aggregator.rule={self.rule!r}: use one of {', '.join(RULES)}")
        if not 0.0 <= float(self.beta) < 0.5:
            raise ConfigError(f"federation.aggregator.beta={self.beta}: give a fraction in [0, 0.5)")
        if int(self.f) < 0 or int(self.m) < 1:
            raise ConfigError(
                f"federation.aggregator f={self.f}, m={self.m}: f must be >= 0 and m >= 1 (m = 1 is Krum)"
            )

    @property
    def robust(self) -> bool:
        """Whether this rule differs from the plain weighted mean."""
        return self.rule != "mean"

    def __call__(self, states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
        """The new global state from one group's uploads (``weights``: their example counts or 1)."""
        if self.rule == "mean":
            return weighted_average(states, weights)
        if self.rule == "median":
            return coordinate_median(states)
        if self.rule == "trimmed_mean":
            return trimmed_mean(states, float(self.beta))
        # with fewer uploads than m (a small round), keep them all
        return krum(states, weights, int(self.f), min(int(self.m), len(states)))[0]
