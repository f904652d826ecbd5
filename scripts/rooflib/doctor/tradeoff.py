"""The load-latency trade-off: step time against requests running, from the window's samples.

Each second of the window gives one point: the mean gap between tokens over the tokens the
engine generated in that second (the increase of its inter-token histogram's sum over its
count) against the requests running then (the gauge, averaged over the second's two ends).
A least-squares line through them, weighted by tokens, is the step-time model
    per-token time = intercept + slope x running
(decode reads the weights once per step and the KV of every running request). From it: the
largest running cap whose tokens meet a TPOT target, the tokens per second one server makes at
that cap, and whether that keeps up with the tokens arriving.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from rooflib.doctor.evidence import Fit

MIN_TOKENS = 5          # a second with fewer generated tokens gives no point
MIN_POINTS = 4
MIN_SPREAD = 2.0        # running must vary by this many requests for a slope to mean anything


def _gauge(snap: dict[str, Any], concept: str) -> float | None:
    gauge = snap["gauges"].get(concept)
    return gauge["value"] if gauge else None


def points(snaps: Sequence[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(running, mean ms per token, tokens) of each interval between consecutive snapshots."""
    found = []
    for a, b in zip(snaps, snaps[1:]):
        ha, hb = a["histograms"].get("itl"), b["histograms"].get("itl")
        ra, rb = _gauge(a, "running"), _gauge(b, "running")
        if not ha or not hb or ra is None or rb is None:
            continue
        tokens = hb["count"] - ha["count"]
        if tokens < MIN_TOKENS:
            continue
        found.append(((ra + rb) / 2, (hb["sum"] - ha["sum"]) / tokens * 1000, tokens))
    return found


def fit(snaps: Sequence[dict[str, Any]]) -> tuple[Fit | None, str]:
    """The weighted line through the window's points, or None with the reason."""
    pts = points(snaps)
    if len(pts) < MIN_POINTS:
        return None, f"{len(pts)} seconds with tokens generated (a fit needs {MIN_POINTS})"
    xs = [p[0] for p in pts]
    if max(xs) - min(xs) < MIN_SPREAD:
        return None, f"requests running stayed within {min(xs):.0f}-{max(xs):.0f}: too little spread to fit a slope"
    weight = sum(p[2] for p in pts)
    mx = sum(p[0] * p[2] for p in pts) / weight
    my = sum(p[1] * p[2] for p in pts) / weight
    sxx = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
    sxy = sum(p[2] * (p[0] - mx) * (p[1] - my) for p in pts)
    slope = sxy / sxx
    intercept = my - slope * mx
    total = sum(p[2] * (p[1] - my) ** 2 for p in pts)
    residual = sum(p[2] * (p[1] - intercept - slope * p[0]) ** 2 for p in pts)
    r2 = 1 - residual / total if total else 0.0
    return Fit(intercept_ms=intercept, slope_ms=slope, points=len(pts), running_low=min(xs), running_high=max(xs),
               r2=r2), ""


@dataclass(frozen=True)
class Cap:
    """A running cap that meets a per-token target, and what one server does at it."""
    cap: int
    per_token_ms: float          # the model's per-token time at the cap
    tok_s_at_cap: float          # tokens per second one server makes with the cap full
    arriving_tok_s: float | None  # tokens per second the traffic asks for
    keeps_up: bool | None
    replicas: int | None         # servers at this cap that keep up with the arrivals


def cap_for(model: Fit, target_ms: float, tail_ratio: float, arriving_tok_s: float | None) -> Cap | None:
    """The largest cap whose p95 per-token time (the model's mean times `tail_ratio`, the window's
    p95 over its mean) meets `target_ms`; None when even one request is too slow or the time does
    not grow with the batch (a smaller batch then buys nothing)."""
    if model.slope_ms <= 0:
        return None
    mean_target = target_ms / max(tail_ratio, 1.0)
    cap = math.floor((mean_target - model.intercept_ms) / model.slope_ms)
    if cap < 1:
        return None
    per_token = model.intercept_ms + model.slope_ms * cap
    made = cap * 1000 / per_token
    keeps_up = None if arriving_tok_s is None else made >= arriving_tok_s
    replicas = None if arriving_tok_s is None else max(1, math.ceil(arriving_tok_s / made))
    return Cap(cap=cap, per_token_ms=per_token, tok_s_at_cap=made, arriving_tok_s=arriving_tok_s,
               keeps_up=keeps_up, replicas=replicas)
