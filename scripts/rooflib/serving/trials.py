"""One trial of tune judged against the configuration it would replace, and the next value of a
setting with a range (bracket and bisect, toward the target), from what the trials so far decided
and measured.

A trial is kept only when the 95% bootstrap interval of the change in the SLO figure it targets
(compare's, rooflib/load/comparison.py) lies wholly below zero (lower latency is better), no
request failed, and no other SLO figure that held before misses now; a change that fixes one
figure and breaks another is a trade-off, reported and not kept. Runs too short to place the
figure's percentile (a p95 needs 20 requests a side) are judged by the upper quartile instead, and
say so.
Requests the server rejects as longer than its context limit (bench --over-limit) are a figure
too: a change that rejects fewer is kept. A change is also weighed against the load: one server
that makes fewer tokens a second than the baseline served (the load offered) lets the queue grow
without bound; that is said with the change, and is a trade-off when the user gives token speed
rather than queue wait.

A range setting is searched: the first value given; while a value is kept and the figure still
misses, the next one further on (bracketing); once a value went too far (a trade-off, a failed
start, a crash, failed requests, a start the vram model refuses, a figure significantly worse),
one between the last kept value and that one (bisecting); a value that brings no significant gain
ends it. With two measured
(value, figure) points the next value is where the line through them meets the target (secant),
clamped inside the bracket: while bracketing, between the geometric middle of a doubling step and
the doubling step; while bisecting, strictly between the two ends, else their geometric middle.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rooflib.core import printing
from rooflib.load import comparison
from rooflib.server.slo_targets import Targets
from rooflib.serving.levers import RANGES, REJECTED

KEPT, REVERTED, TRADE_OFF, WORSE = "kept", "reverted", "trade-off", "worse"
NO_START, CRASHED, RUN_FAILED = "did not start", "engine crashed", "run failed"
REQUESTS_FAILED = "requests failed"
NOT_RUN, INTERRUPTED = "not run", "interrupted"
# A value the engine cannot serve at (or the vram model says it cannot start with), or one that makes
# the figure significantly worse: past the range's good side, so the search bisects back.
TOO_FAR = (TRADE_OFF, NO_START, CRASHED, RUN_FAILED, REQUESTS_FAILED, NOT_RUN, WORSE)

# SLO name (bench's "slo" section) -> (the run's section, statistic, words); compare names the row "ttft_ms.p95".
FIGURES = {"ttft_p95_ms": ("ttft_ms", "p95", "TTFT p95"), "tpot_p95_ms": ("tpot_ms", "p95", "TPOT p95")}

# The highest --gpu-memory-utilization a search goes to: the rest of the device holds activations
# and graphs (the diagnosis proposes 0.95 at most for the same reason).
MAX_GPU_UTIL = 0.95
UTIL_STEP = 0.05
MIB = 1 << 20
# A server that makes this share of the tokens offered keeps up: below it, by more than a loaded
# machine's run-to-run noise, the queue grows at the offered load.
KEEPS_UP = 0.9


def targets(slo: Targets) -> dict[str, float]:
    """The targets the user set, by name (a target not set is not judged)."""
    return {name: value for name, value in (("ttft_p95_ms", slo.ttft_p95_ms), ("tpot_p95_ms", slo.tpot_p95_ms))
            if value is not None}


def rejected(run: Mapping[str, Any]) -> int:
    """Requests the server refused as longer than its context limit (bench --over-limit sends them)."""
    return (((run.get("requests") or {}).get("rejected") or {}).get("by_cause") or {}).get("context_length", 0)


def missed(run: Mapping[str, Any]) -> list[str]:
    """The figures a bench run misses: requests rejected as too long, then the SLO figures its own
    "slo" section judged missed (a figure with no completed request misses)."""
    return ([REJECTED] if rejected(run) else []) + [name for name, check in run["slo"].items() if not check["met"]]


def measured(run: Mapping[str, Any], name: str) -> float | None:
    """A figure of a run: the requests rejected, or the SLO figure's measured value."""
    return rejected(run) if name == REJECTED else run["slo"][name]["measured"]


def target_of(run: Mapping[str, Any], name: str) -> float:
    return 0.0 if name == REJECTED else run["slo"][name]["target"]


def by_distance(run: Mapping[str, Any]) -> list[str]:
    """The missed figures, furthest over its target first (rejected requests and a figure with no
    completed request: first)."""
    def over(name: str) -> float:
        value = measured(run, name)
        return math.inf if name == REJECTED or value is None else value / target_of(run, name)
    return sorted(missed(run), key=over, reverse=True)


def worst(run: Mapping[str, Any]) -> str | None:
    """The missed figure furthest over its target: what the next change must improve."""
    return next(iter(by_distance(run)), None)


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
    """Keep, revert, or report a trade-off: `after` against `before` on the figure `target`."""
    if after["requests"]["failed"] > rejected(after) or rejected(after) > rejected(before):
        return Verdict(REQUESTS_FAILED, failures(after["requests"]))
    if target == REJECTED:
        return _judge_rejected(before, after)
    label = FIGURES[target][2]
    row = figures(comparison, after)[target]
    if row["ci95_pct"] is None:
        return Verdict(REVERTED, f"{label} cannot be compared (fewer than two requests on a side)")
    if row["ci95_pct"][0] > 0:
        return Verdict(WORSE, f"{label} {_interval(row)}: the interval lies wholly above 0")
    said = f"{label} {_interval(row)}"
    quartile = upper_quartile_instead(before, after, target)
    if quartile is not None:
        row, said = quartile
        if row["ci95_pct"][0] > 0:
            return Verdict(WORSE, f"{said}: the interval lies wholly above 0")
    if row["ci95_pct"][1] >= 0:
        return Verdict(REVERTED, f"{said}: the interval does not lie wholly below 0")
    return _unless_broken(before, after, target, said)


def upper_quartile_instead(before: Mapping[str, Any], after: Mapping[str, Any],
                           target: str) -> tuple[Mapping[str, Any], str] | None:
    """The p75's row and words, where the runs are too short to place the figure's percentile
    (comparison.requests_to_place, the rule by which compare reports a p99). Below that a p95 is
    about the slowest request, and one stall of the machine decides the trial. The p75 still
    measures the tail a short KV cache or running cap makes (the requests that waited), and a
    quarter of the requests lie beyond it: 4 of 16, where a bootstrap resample draws one request 4
    times or more under 2% of the time. The median missed that tail (a KV cache 4 -> 24 MiB under
    16 requests: TTFT p50 -54.9%, 95% CI -70.7% .. +42.0%, reverted). A p95 whose interval lies
    wholly above zero is still worse."""
    section, stat, words = FIGURES[target]
    sa, sb = comparison.samples(before, section), comparison.samples(after, section)
    n, needed = min(len(sa), len(sb)), comparison.requests_to_place(stat)
    if n >= needed or n < 2:
        return None
    row = comparison.metric_row(f"{section}.p75", sa, sb, "p75", random.Random(0))
    return row, (f"{words.replace(stat, 'p75')} {_interval(row)} (judged by the upper quartile: "
                 f"{n} requests a side place no {stat}, which needs {needed})")


def client_stalled(run: Mapping[str, Any]) -> str | None:
    """What distorted the run's client-side figures (bench's INVALID reasons about its client: a
    stalled client times its requests late), or None where the client measured the engine."""
    client = run.get("client") or {}
    if client.get("valid", True):
        return None
    if share := stall_share(run):
        return f"the client stalled {share:.0%} of the run (worst {client['stalls']['worst_ms']:.0f} ms)"
    return (client.get("invalid_reasons") or ["the client distorted its figures"])[0]


def stall_share(run: Mapping[str, Any]) -> float:
    """The share of the run its client spent stalled (bench's client.stalls), 0 where none."""
    return (((run.get("client") or {}).get("stalls") or {}).get("share")) or 0.0


def worth_rerunning(run: Mapping[str, Any]) -> bool:
    """A finished run whose client stalled: measuring the same engine again may find it quieter."""
    return client_stalled(run) is not None and not run["interrupted"] and not run["requests"]["failed"]


def least_stalled(runs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """Of runs of one engine, the one whose client measured it best: valid, else stalled least."""
    return min(runs, key=lambda run: (client_stalled(run) is not None, stall_share(run)))


def stalled_words(before: Mapping[str, Any], after: Mapping[str, Any]) -> str | None:
    """What a verdict was judged on, where a client stall distorted either run (after its reruns):
    the figures then hold the machine's stalls as well as the engine's times."""
    said = [f"{which}: {why}" for which, why in (("the run judged against", client_stalled(before)),
                                                 ("this run", client_stalled(after))) if why]
    return ("judged on runs the client stalled in (" + "; ".join(said) + "): a busy machine's stalls are in "
            "these figures; measure on a quieter one to be sure") if said else None


def _judge_rejected(before: Mapping[str, Any], after: Mapping[str, Any]) -> Verdict:
    """Fewer requests rejected as too long: kept, unless an SLO figure that held now misses."""
    then, now = rejected(before), rejected(after)
    words = f"requests rejected as longer than the context limit: {then} -> {now} of {after['requests']['sent']}"
    if now >= then:
        return Verdict(REVERTED, f"{words}: no fewer")
    return _unless_broken(before, after, REJECTED, words)


def _unless_broken(before: Mapping[str, Any], after: Mapping[str, Any], target: str, words: str) -> Verdict:
    broken = [name for name in missed(after) if name not in (target, REJECTED) and name not in missed(before)]
    if broken:
        said = "; ".join(f"{FIGURES[n][2]} {printing.fmt_number(after['slo'][n]['measured'], 1)} ms > target "
                         f"{after['slo'][n]['target']:g} ms" for n in broken)
        return Verdict(TRADE_OFF, f"{words}, but {said}")
    return Verdict(KEPT, words)


@dataclass(frozen=True)
class Throughput:
    """The output tokens a second one server makes with a change against those the load offers:
    the baseline's (in a closed loop, what the users asked for while nothing held them back)."""
    made_tok_s: float
    offered_tok_s: float

    @property
    def keeps_up(self) -> bool:
        return self.made_tok_s >= KEEPS_UP * self.offered_tok_s

    @property
    def replicas(self) -> int:
        """Servers like this one that together make the tokens offered."""
        return max(1, math.ceil(self.offered_tok_s / self.made_tok_s)) if self.made_tok_s else 0

    def said(self) -> str:
        if self.keeps_up:
            return f"one server makes {self.made_tok_s:,.0f} tok/s against {self.offered_tok_s:,.0f} tok/s offered"
        return (f"one server then makes {self.made_tok_s:,.0f} tok/s against {self.offered_tok_s:,.0f} tok/s offered: "
                f"the queue grows without bound at this load; {self.replicas} replicas keep up")


def throughput(offered_tok_s: float | None, run: Mapping[str, Any]) -> Throughput | None:
    """A run's output tokens a second against the load offered (None when either is unknown)."""
    made = (run.get("throughput") or {}).get("output_tok_s")
    return Throughput(made, offered_tok_s) if made is not None and offered_tok_s else None


def weighed(verdict: Verdict, load: Throughput | None, give: str) -> Verdict:
    """A kept change weighed against the load: one server that falls behind the tokens offered is
    said in its why, and is a trade-off, not kept, when the user gives token speed ("speed")
    rather than queue wait ("queue")."""
    if verdict.decision != KEPT or load is None or load.keeps_up:
        return verdict
    if give == "speed":
        return Verdict(TRADE_OFF, f"{verdict.why}, but {load.said()} (you give token speed, not queue wait)")
    return Verdict(KEPT, f"{verdict.why}; {load.said()}")


# ---------------------------------------------------------------------------------------------
# The search of a range setting

@dataclass(frozen=True)
class Tried:
    value: Any
    decision: str
    figure: float | None = None   # the figure the search moves, as measured at this value


@dataclass(frozen=True)
class Aim:
    """Where a search heads: the target of the figure it moves, and the point it starts from: the
    value in effect before it (None: unknown) and the figure measured there."""
    target: float
    value: float | None
    figure: float | None


def next_value(key: str, start: Any, proposed: Any, tried: Sequence[Tried], aim: Aim | None = None) -> Any:
    """The next value of `key` to try, None when the search is over. `start` is the value before
    the search (it misses the SLO), `proposed` the first value, `tried` the values so far; with
    `aim`, the line through the last two measured points places the next value (secant)."""
    if not tried:
        return proposed
    last = tried[-1]
    if key not in RANGES or start is None or last.decision not in (KEPT, *TOO_FAR):
        return None
    direction = 1 if proposed > start else -1
    good = next((t.value for t in reversed(tried) if t.decision == KEPT), start)
    too_far = next((t.value for t in reversed(tried) if t.decision in TOO_FAR), None)
    guess = secant(key, aim, tried, direction)
    if too_far is None:
        step = further(key, good, direction)
        if step is None:
            return None
        near = between(key, good, step) or step
        return step if guess is None else min(max(guess, min(near, step)), max(near, step))
    middle = between(key, good, too_far)
    inside = guess is not None and min(good, too_far) < guess < max(good, too_far)
    return guess if inside else middle


def secant(key: str, aim: Aim | None, tried: Sequence[Tried], direction: int) -> Any:
    """Where the line through the last two measured (value, figure) points, the start's included,
    meets the target, rounded the way the search goes; None without two points or a slope."""
    if aim is None:
        return None
    start = [(aim.value, aim.figure)] if aim.value is not None and aim.figure is not None else []
    points = start + [(t.value, t.figure) for t in tried if t.figure is not None]
    if len(points) < 2:
        return None
    (x1, f1), (x2, f2) = points[-2:]
    if f1 == f2 or x1 == x2:
        return None
    x = x2 + (aim.target - f2) * (x2 - x1) / (f2 - f1)
    if key == "gpu_memory_utilization":
        return round(x, 2)
    whole = math.ceil(x) if direction > 0 else math.floor(x)
    if key == "kv_cache_memory_bytes":
        whole = whole // MIB * MIB
    return whole if whole >= 1 else None


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
