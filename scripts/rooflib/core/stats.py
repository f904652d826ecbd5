"""Statistics of a measured sample, shared by the load generator (rooflib/load), compare and
the report: percentiles by linear interpolation between order statistics (numpy's default
method, the definition every result's "percentiles" states) and a sample's summary.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence


def at_rank(sorted_values: Sequence[float], rank: float) -> float:
    """The value at a fractional rank (0 .. n - 1) of sorted values, interpolated between its two neighbours."""
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile of sorted values (numpy's default method)."""
    if not sorted_values:
        raise ValueError("no values")
    return at_rank(sorted_values, (len(sorted_values) - 1) * q / 100.0)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p95/p99/mean/min/max/n of a sample (None values when it is empty)."""
    data = sorted(values)
    if not data:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "min": None, "max": None, "n": 0}
    return {"p50": percentile(data, 50), "p95": percentile(data, 95), "p99": percentile(data, 99),
            "mean": sum(data) / len(data), "min": data[0], "max": data[-1], "n": len(data)}
