"""rooflib/core/stats.py: the percentile definition every result states (numpy's linear interpolation) and a
sample's summary, shared by bench, sweep, compare and report."""
from __future__ import annotations

import pytest

from rooflib.core import stats


def test_percentile_is_linear_like_numpy():
    data = [1.0, 2.0, 3.0, 4.0]
    assert stats.percentile(data, 50) == 2.5
    assert stats.percentile(data, 95) == pytest.approx(3.85)
    assert stats.percentile(data, 0) == 1.0 and stats.percentile(data, 100) == 4.0
    assert stats.percentile([7.0], 99) == 7.0


def test_summarize_counts_and_empty():
    s = stats.summarize([3, 1, 2])
    assert (s["p50"], s["min"], s["max"], s["mean"], s["n"]) == (2, 1, 3, 2, 3)
    assert stats.summarize([]) == {"p50": None, "p95": None, "p99": None, "mean": None,
                                 "min": None, "max": None, "n": 0}
