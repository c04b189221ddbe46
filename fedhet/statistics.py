"""Paired differences over seeds and the verdicts a results page computes from them.

A claim of a paper ("FedMD-CG beats FedPer on L.acc") is checked on a page by running both rows
at the same seeds (the same partition and initialisation for both) and looking at the per-seed
differences. The page reports their mean, a 95 % Student-t interval and a per-seed tally, and the
verdict follows from the interval alone, so no verdict is ever typed by hand:

* **holds**: the whole interval is above 0;
* **fails**: the whole interval is below 0 (the opposite holds);
* **inconclusive**: the interval contains 0, or there are fewer than two paired seeds.

Why a t interval over seeds and not a bootstrap: with 3-5 seeds a bootstrap interval is too
narrow (it cannot see beyond the seeds it has); the t interval is exact for normal differences
and honest about how little five seeds say.

Pure Python (no torch, no scipy): the t quantile comes from the closed form of Student's t
distribution for integer degrees of freedom (Abramowitz and Stegun 26.7.3-4) by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

HOLDS, FAILS, INCONCLUSIVE = "holds", "fails", "inconclusive"
#: no seed has both rows yet (a page still running): not a verdict, and not counted as one
NOT_RUN = "not run"


def t_central_probability(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``df`` (integer >= 1) degrees of freedom.

    >>> round(t_central_probability(2.776445, 4), 4)
    0.95
    >>> round(t_central_probability(1.0, 1), 4)  # Cauchy: 2/pi * atan(1)
    0.5
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if t <= 0.0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2 == 1:
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 3) // 2 + 1):  # 1 + 2/3 cos^2 + (2*4)/(3*5) cos^4 + ...
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ...
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_quantile(level: float, df: int) -> float:
    """The two-sided critical value ``t`` with ``P(|T| <= t) = level`` (e.g. 4.303 for 95 % and df 2).

    >>> round(t_quantile(0.95, 2), 3), round(t_quantile(0.95, 4), 3), round(t_quantile(0.95, 30), 3)
    (4.303, 2.776, 2.042)
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    low, high = 0.0, 1.0
    while t_central_probability(high, df) < level:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_central_probability(mid, df) < level:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


@dataclass(frozen=True)
class PairedDifference:
    """``better - than`` per common seed, with its mean, t interval, tally and verdict."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    low: float
    high: float
    wins: int
    level: float
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seeds": list(self.seeds), "differences": list(self.differences)}


def paired_difference(
    better: Mapping[int, float], than: Mapping[int, float], level: float = 0.95
) -> PairedDifference:
    """Compare two rows seed by seed (only seeds both have); the verdict of ``better > than``.

    >>> d = paired_difference({0: 3.0, 1: 5.0, 2: 4.0}, {0: 1.0, 1: 2.0, 2: 2.0})
    >>> d.differences, d.mean, d.wins, d.verdict
    ((2.0, 3.0, 2.0), 2.3333, 3, 'holds')
    >>> round(d.low, 3), round(d.high, 3)  # 2.333 -+ 4.303 * 0.5774 / sqrt(3)
    (0.899, 3.768)
    """
    seeds = tuple(sorted(set(better) & set(than)))
    differences = tuple(better[s] - than[s] for s in seeds)
    n = len(differences)
    if n == 0:
        return PairedDifference((), (), math.nan, -math.inf, math.inf, 0, level, NOT_RUN)
    mean = sum(differences) / n
    wins = sum(d > 0 for d in differences)
    if n < 2:
        low, high = -math.inf, math.inf
    else:
        sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
        half = t_quantile(level, n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    verdict = HOLDS if low > 0.0 else FAILS if high < 0.0 else INCONCLUSIVE
    return PairedDifference(seeds, differences, round(mean, 4), low, high, wins, level, verdict)


__all__ = ["FAILS", "HOLDS", "INCONCLUSIVE", "NOT_RUN", "PairedDifference", "paired_difference", "t_quantile"]
