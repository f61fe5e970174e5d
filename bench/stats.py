"""Small, pure statistics for benchmark figures: medians, ranges, percentiles, ratios.

No numpy: the harness must run (and be tested) with the standard library alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def _clean(values: Iterable[float]) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError("values: at least one value is needed")
    for v in out:
        if math.isnan(v):
            raise ValueError("values: NaN is not a measurement")
    return out


def median(values: Iterable[float]) -> float:
    """The middle value (mean of the two middle values for an even count)."""
    xs = sorted(_clean(values))
    n = len(xs)
    mid = n // 2
    return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default, "linear")."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"p: must be in [0, 100], got {p}")
    xs = sorted(_clean(values))
    if len(xs) == 1:
        return xs[0]
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Summary:
    """Median and min–max of repeated runs of one measurement."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        xs = _clean(values)
        return cls(median(xs), min(xs), max(xs), len(xs))

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the runs were (0 when the median is 0)."""
        return (self.high - self.low) / self.median if self.median else 0.0


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; a zero denominator is an error, never infinity."""
    if denominator == 0:
        raise ZeroDivisionError("ratio: the baseline measured 0; the ratio is undefined")
    return numerator / denominator


def paired_ratios(candidate: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Run-by-run ratios of alternated runs (candidate[i] / baseline[i]), for the spread of
    the ratio itself; the pairs are adjacent in time, so drift hits both members alike."""
    if len(candidate) != len(baseline):
        raise ValueError(f"paired_ratios: {len(candidate)} candidate runs but "
                         f"{len(baseline)} baseline runs")
    return [ratio(c, b) for c, b in zip(candidate, baseline)]
