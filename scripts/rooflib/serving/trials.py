"""One trial of tune judged against the configuration it would replace, and the next value of a
setting with a range (bracket and bisect), from what the trials so far decided.

A trial is kept only when the 95% bootstrap interval of the change in the SLO figure it targets
(compare's, rooflib/load/comparison.py) lies wholly below zero (lower latency is better), no
request failed, and no other SLO figure that held before misses now; a change that fixes one
figure and breaks another is a trade-off, reported and not kept. A range setting is searched:
the diagnosis's value first; while a value is kept and the SLO still misses, the next one twice as
far (bracketing); once a value went too far (a trade-off, a failed start, a crash, failed requests),
the middle of the last kept value and that one (bisecting); a value that brings no significant gain
ends it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rooflib.core import printing
from rooflib.server.engine_metrics import Targets
from rooflib.serving.levers import RANGES

KEPT, REVERTED, TRADE_OFF = "kept", "reverted", "trade-off"
NO_START, CRASHED, RUN_FAILED = "did not start", "engine crashed", "run failed"
REQUESTS_FAILED = "requests failed"
NOT_RUN, INTERRUPTED = "not run", "interrupted"
# A value the engine cannot serve at: past the range's good side, so the search bisects back.
TOO_FAR = (TRADE_OFF, NO_START, CRASHED, RUN_FAILED, REQUESTS_FAILED)

# SLO name (bench's "slo" section) -> (the run's section, statistic, words); compare names the row "ttft_ms.p95".
FIGURES = {"ttft_p95_ms": ("ttft_ms", "p95", "TTFT p95"), "tpot_p95_ms": ("tpot_ms", "p95", "TPOT p95")}

# The highest --gpu-memory-utilization a search goes to: the rest of the device holds activations
# and graphs (the diagnosis proposes 0.95 at most for the same reason).
MAX_GPU_UTIL = 0.95
UTIL_STEP = 0.05
MIB = 1 << 20


def targets(slo: Targets) -> dict[str, float]:
    """The targets the user set, by name (a target not set is not judged)."""
    return {name: value for name, value in (("ttft_p95_ms", slo.ttft_p95_ms), ("tpot_p95_ms", slo.tpot_p95_ms))
            if value is not None}


def missed(run: Mapping[str, Any]) -> list[str]:
    """The SLO figures a bench run misses, as its own "slo" section judged them (a figure with no
    completed request misses)."""
    return [name for name, check in run["slo"].items() if not check["met"]]


def worst(run: Mapping[str, Any]) -> str | None:
    """The missed figure furthest over its target: what the next change must improve."""
    def over(name: str) -> float:
        check = run["slo"][name]
        return math.inf if check["measured"] is None else check["measured"] / check["target"]
    return max(missed(run), key=over, default=None)


def figures(comparison: Mapping[str, Any] | None, run: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each SLO figure of a run: measured, target, met, and (against the run it would replace)
    the change in % with its 95% interval."""
    rows = {row["name"]: row for row in (comparison or {}).get("metrics") or []}
    out = {}
    for name, check in run["slo"].items():
        section, stat, _ = FIGURES[name]
        row = rows.get(f"{section}.{stat}") or {}
        out[name] = {**check, "change_pct": row.get("change_pct"), "ci95_pct": row.get("ci95_pct")}
    return out


@dataclass(frozen=True)
class Verdict:
    decision: str
    why: str


def _interval(row: Mapping[str, Any]) -> str:
    low, high = row["ci95_pct"]
    return f"{row['change_pct']:+.1f}% (95% CI {low:+.1f}% .. {high:+.1f}%)"


def failures(requests: Mapping[str, Any]) -> str:
    """How many requests failed, of which kinds, and the first one's error: what to look for in the
    engine log."""
    failed = requests["failed"]
    kinds = ", ".join(f"{count} {kind}" for kind, count in (requests.get("errors") or {}).items())
    first = (requests.get("first_errors") or [None])[0]
    return (f"{failed} of {failed + requests['completed']} requests failed" + (f" ({kinds})" if kinds else "")
            + (f"; the first: {first}" if first else ""))


def judge(comparison: Mapping[str, Any], before: Mapping[str, Any], after: Mapping[str, Any], target: str) -> Verdict:
    """Keep, revert, or report a trade-off: `after` against `before` on the SLO figure `target`."""
    label = FIGURES[target][2]
    if after["requests"]["failed"]:
        return Verdict(REQUESTS_FAILED, failures(after["requests"]))
    row = figures(comparison, after)[target]
    if row["ci95_pct"] is None:
        return Verdict(REVERTED, f"{label} cannot be compared (fewer than two requests on a side)")
    if row["ci95_pct"][1] >= 0:
        return Verdict(REVERTED, f"{label} {_interval(row)}: the interval does not lie wholly below 0")
    broken = [name for name in missed(after) if name != target and name not in missed(before)]
    if broken:
        words = "; ".join(f"{FIGURES[n][2]} {printing.fmt_number(after['slo'][n]['measured'], 1)} ms > target "
                          f"{after['slo'][n]['target']:g} ms" for n in broken)
        return Verdict(TRADE_OFF, f"{label} {_interval(row)}, but {words}")
    return Verdict(KEPT, f"{label} {_interval(row)}")


# ---------------------------------------------------------------------------------------------
# The search of a range setting

@dataclass(frozen=True)
class Tried:
    value: Any
    decision: str


def next_value(key: str, start: Any, proposed: Any, tried: Sequence[Tried]) -> Any:
    """The next value of `key` to try, None when the search is over. `start` is the value before
    the search (it misses the SLO), `proposed` the diagnosis's value, `tried` the values so far."""
    if not tried:
        return proposed
    last = tried[-1]
    if key not in RANGES or start is None or last.decision not in (KEPT, *TOO_FAR):
        return None
    good = next((t.value for t in reversed(tried) if t.decision == KEPT), start)
    too_far = next((t.value for t in reversed(tried) if t.decision in TOO_FAR), None)
    if too_far is None:
        return further(key, good, 1 if proposed > start else -1)
    return between(key, good, too_far)


def further(key: str, value: Any, direction: int) -> Any:
    """One bracketing step beyond `value`: twice (or half) as much; utilization by a step."""
    if key == "gpu_memory_utilization":
        step = round(value + direction * UTIL_STEP, 2)
        return step if UTIL_STEP <= step <= MAX_GPU_UTIL and step != value else None
    step = value * 2 if direction > 0 else value // 2
    if key == "kv_cache_memory_bytes":
        step = max(MIB, step // MIB * MIB)
    return step if step >= 1 and step != value else None


def between(key: str, low: Any, high: Any) -> Any:
    """The middle of two values (geometric for counts and sizes), None when nothing lies between."""
    if key == "gpu_memory_utilization":
        middle = round((low + high) / 2, 2)
    else:
        middle = round(math.sqrt(low * high))
        if key == "kv_cache_memory_bytes":
            middle = middle // MIB * MIB
    return middle if min(low, high) < middle < max(low, high) else None
