"""Exact quantiles of a Prometheus histogram, as PromQL's histogram_quantile computes them from
cumulative buckets, and the bucket each one falls in: a quantile in the +Inf bucket is only a floor,
one in the first bucket only a ceiling, so a report can say which of its figures are bounds.
"""
from __future__ import annotations

import math
from typing import Iterable

QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The q-quantile of cumulative (upper bound, count) buckets, as PromQL histogram_quantile.

    Linear interpolation inside the bucket (from 0 for the first one); a rank in the +Inf
    bucket returns the largest finite bound (a floor: see `quantile_bucket`); NaN when there
    are no observations, fewer than two buckets, or no +Inf bucket.
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = _prepared(buckets)
    if ordered is None:
        return math.nan
    bounds, counts = ordered
    rank = q * counts[-1]
    index = _rank_index(rank, counts)
    if index == len(counts) - 1:
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[index - 1] if index > 0 else 0.0
    below = counts[index - 1] if index > 0 else 0.0
    if counts[index] == below:  # q = 0 over an empty first bucket: Go's 0/0 gives NaN
        return math.nan
    return start + (bounds[index] - start) * (rank - below) / (counts[index] - below)


def quantile_bucket(q: float, buckets: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The (lower, upper) bounds of the bucket the q-quantile falls in; None when undefined.

    An upper bound of +Inf means histogram_quantile's value is only a floor; a lower bound of 0
    (the first bucket) means the value is interpolated from an assumed 0, so only a ceiling.
    """
    ordered = _prepared(buckets)
    if ordered is None or not 0 <= q <= 1:
        return None
    bounds, counts = ordered
    index = _rank_index(q * counts[-1], counts)
    return (bounds[index - 1] if index > 0 else min(0.0, bounds[0])), bounds[index]


def _rank_index(rank: float, counts: list[float]) -> int:
    """The first bucket whose cumulative count reaches the rank (the +Inf one is not searched)."""
    return next((i for i in range(len(counts) - 1) if counts[i] >= rank), len(counts) - 1)


def _prepared(buckets: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]] | None:
    """Sorted, merged, monotonic bounds and counts; None where Prometheus answers NaN."""
    ordered = sorted(buckets, key=lambda b: b[0])
    if not ordered or not math.isinf(ordered[-1][0]):
        return None
    bounds: list[float] = []
    counts: list[float] = []
    for bound, count in ordered:  # buckets with the same bound are added up
        if bounds and bounds[-1] == bound:
            counts[-1] += count
        else:
            bounds.append(bound)
            counts.append(count)
    if len(bounds) < 2:
        return None
    previous = counts[0]
    for i in range(1, len(counts)):  # float noise (relative 1e-12) is smoothed away
        delta = abs(counts[i] - previous)
        if delta and delta / counts[i] <= 1e-12:
            counts[i] = previous
        elif delta:
            previous = counts[i]
    for i in range(1, len(counts)):  # other decreases are forced monotonic
        counts[i] = max(counts[i], counts[i - 1])
    if counts[-1] == 0:
        return None
    return bounds, counts
