"""Small statistics for benchmark samples: percentiles, medians with their spread, ratios (stdlib only)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (0 < fraction < 1), interpolated as ``statistics.quantiles`` does.

    Raises:
        ValueError: fewer than two samples.
    """
    if len(samples) < 2:
        raise ValueError("a percentile needs at least two samples")
    cuts = statistics.quantiles(samples, n=1000, method="inclusive")
    return cuts[round(fraction * 1000) - 1]


def latency_ms(samples_ms: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of round-trip samples, in milliseconds."""
    return {
        "p50_ms": round(percentile(samples_ms, 0.50), 3),
        "p99_ms": round(percentile(samples_ms, 0.99), 3),
    }


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of a figure over the rounds, with its smallest and largest value."""

    median: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """Raises: ValueError: no values."""
        if not values:
            raise ValueError("no values")
        return cls(statistics.median(values), min(values), max(values), len(values))


def ratio(ours: float, theirs: float) -> float | None:
    """``ours / theirs``, or None when it means nothing (a zero denominator)."""
    return None if theirs == 0 else ours / theirs
