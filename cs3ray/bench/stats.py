"""A figure over rounds: its median, a 95% interval, and what that says about a target.

A ratio's interval is Student's t interval of the mean of the rounds' log ratios, taken back to a
ratio (a geometric mean's interval: a ratio of 2 and one of 0.5 are equally far from 1); a
difference's (a paired delta in %, a hit rate) is Student's t on the raw values. With few rounds
it is wide, and that is the point: a target inside it is `inconclusive`, not met by luck. The
point figure stays the median of the rounds, what every bench printed so far.

A target is `{"at_least": x}` or `{"at_most": x}` (a bare number means at least), so the JSON
says which side is good.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

METHOD = ("median of the rounds; 95% interval: Student's t on the mean of the rounds' log ratios "
          "(differences: on the raw values)")
# Two-sided 95% quantiles of Student's t by degrees of freedom (rounds - 1); the normal's past 30.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}
MET, NOT_MET, INCONCLUSIVE = "met", "not met", "inconclusive"
NO_WORSE, WORSE = "no worse", "worse"
NAN_INTERVAL = (math.nan, math.nan)


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom."""
    return _T95.get(df, 1.96)


def mean_interval(values: Iterable[float]) -> tuple[float, float]:
    """The 95% t interval of the mean of values measured once per round (at least 2 finite; else NaNs)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if len(xs) < 2:
        return NAN_INTERVAL
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    mean = statistics.fmean(xs)
    return mean - half, mean + half


def ratio_interval(ratios: Iterable[float]) -> tuple[float, float]:
    """The 95% interval of a ratio measured once per round (at least 2 positive rounds; else NaNs)."""
    low, high = mean_interval(math.log(r) for r in ratios if r is not None and r > 0 and math.isfinite(r))
    return (low, high) if math.isnan(low) else (math.exp(low), math.exp(high))


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


def noninferiority(interval: tuple[float, float], margin: float) -> str:
    """A paired difference (worse is higher, e.g. a loss delta in %) against a margin: `no worse` when
    the interval's upper bound is within it, `worse` when its lower bound is past it, else inconclusive."""
    low, high = interval
    if math.isnan(low) or math.isnan(high):
        return INCONCLUSIVE
    if high <= margin:
        return NO_WORSE
    return WORSE if low > margin else INCONCLUSIVE


def summarize(name: str, values: list[float], difference: bool = False) -> dict[str, Any]:
    """`{name: median, name_interval: [low, high], name_rounds: [...]}` for a result's JSON: a ratio's
    interval on the log scale, a difference's (`difference=True`: may be zero or negative) on the raw one."""
    low, high = (mean_interval if difference else ratio_interval)(values)
    return {name: statistics.median(values), f"{name}_interval": [low, high], f"{name}_rounds": list(values)}


def exact(name: str, value: float) -> dict[str, Any]:
    """A figure that does not vary between rounds (bytes counted, not timed): its interval is the point."""
    return {name: value, f"{name}_interval": [value, value], f"{name}_rounds": [value]}


def bound(target: float | dict[str, float]) -> tuple[float, bool]:
    """(bound, higher_is_better) of a target: `{"at_least": x}`, `{"at_most": x}` or a bare x (at least)."""
    if isinstance(target, dict):
        return (target["at_most"], False) if "at_most" in target else (target["at_least"], True)
    return float(target), True


def judge(result: dict[str, Any], targets: dict[str, float | dict[str, float]]) -> dict[str, str]:
    """Every target's verdict from the result's `X_interval` entries (`verdicts` in a bench's JSON)."""
    return {k: verdict(tuple(result[f"{k}_interval"]), *bound(t)) for k, t in targets.items()}


def stated(target: float | dict[str, float]) -> str:
    """`>= 0.98` or `<= 50`: a target as a table or title says it."""
    value, higher = bound(target)
    return f"{'>=' if higher else '<='} {value:g}"


def verdict_line(result: dict[str, Any], digits: int = 2) -> str:
    """`name 0.97 [0.95, 0.99] (>= 0.98): inconclusive; ...` for every target of a result."""
    return "; ".join(f"{k} {shown(result, k, digits)} ({stated(result['targets'][k])}): {v}"
                     for k, v in result["verdicts"].items())


def shown(result: dict[str, Any], name: str, digits: int = 2) -> str:
    """`0.97 [0.95, 0.99]`: a ratio and its interval for a table."""
    low, high = result[f"{name}_interval"]
    value = f"{result[name]:.{digits}f}"
    return value if math.isnan(low) else f"{value} [{low:.{digits}f}, {high:.{digits}f}]"
