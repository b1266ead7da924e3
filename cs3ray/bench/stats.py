"""A ratio over rounds: its median, a 95% interval, and what that says about a target.

The interval is Student's t interval of the mean of the rounds' log ratios, taken back to a
ratio (a geometric mean's interval: a ratio of 2 and one of 0.5 are equally far from 1). With
few rounds it is wide, and that is the point: a target inside it is `inconclusive`, not met by
luck. The point figure stays the median of the rounds' ratios, what every bench printed so far.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

METHOD = "median of the rounds; 95% interval: Student's t on the mean of the rounds' log ratios"
# Two-sided 95% quantiles of Student's t by degrees of freedom (rounds - 1); the normal's past 30.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}
MET, NOT_MET, INCONCLUSIVE = "met", "not met", "inconclusive"


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom."""
    return _T95.get(df, 1.96)


def ratio_interval(ratios: Iterable[float]) -> tuple[float, float]:
    """The 95% interval of a ratio measured once per round (at least 2 positive rounds; else NaNs)."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    if len(logs) < 2:
        return math.nan, math.nan
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def verdict(interval: tuple[float, float], bound: float, higher_is_better: bool = True) -> str:
    """`met` when the whole interval is on the good side of `bound`, `not met` when it is all on the other,
    `inconclusive` when it straddles the bound (or could not be computed)."""
    low, high = interval
    if math.isnan(low) or math.isnan(high):
        return INCONCLUSIVE
    if not higher_is_better:
        low, high, bound = -high, -low, -bound
    if low >= bound:
        return MET
    return NOT_MET if high < bound else INCONCLUSIVE


def summarize(name: str, ratios: list[float]) -> dict[str, Any]:
    """`{name: median, name_interval: [low, high], name_rounds: [...]}` for a result's JSON."""
    low, high = ratio_interval(ratios)
    return {name: statistics.median(ratios), f"{name}_interval": [low, high], f"{name}_rounds": list(ratios)}


def judge(result: dict[str, Any], targets: dict[str, float], higher_is_better: dict[str, bool] | None = None) -> dict[str, str]:
    """Every target's verdict from the result's `X_interval` entries (`verdicts` in a bench's JSON)."""
    better = higher_is_better or {}
    return {k: verdict(tuple(result[f"{k}_interval"]), bound, better.get(k, True)) for k, bound in targets.items()}


def shown(result: dict[str, Any], name: str, digits: int = 2) -> str:
    """`0.97 [0.95, 0.99]`: a ratio and its interval for a table."""
    low, high = result[f"{name}_interval"]
    value = f"{result[name]:.{digits}f}"
    return value if math.isnan(low) else f"{value} [{low:.{digits}f}, {high:.{digits}f}]"
