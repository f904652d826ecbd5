"""One URL, several engines: what a balancer in front of replicas does to their /metrics.

Behind a balancer each scrape of the same URL may come from another engine: counters then fall
and rise and the start time changes back and forth, so no difference of two scrapes is one
engine's. A restart changes the start time once and stays; a balancer keeps changing it.
"""
from __future__ import annotations

from typing import Any, Sequence

from rooflib.server import snapshots


def mixed_engines(snaps: Sequence[dict[str, Any]]) -> str:
    """Why consecutive snapshots of one URL cannot be one engine's ('' when they can)."""
    changes = sum(1 for a, b in zip(snaps, snaps[1:]) if snapshots.restarted(a, b))
    starts = {round(s["start_time"], 3) for s in snaps if s.get("start_time")}
    if len(starts) > 1 and changes > 1:
        return (f"consecutive scrapes came from {len(starts)} engines (their start times differ and counters fell "
                f"{changes} times): a balancer answers this URL")
    if changes > 1:
        return f"counters fell {changes} times between consecutive scrapes: more than one engine answers this URL"
    return ""


def unblended(delta: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """A window's report, or, when its scrapes came from several engines, the report with that as
    its one finding: no figure of it is one engine's, so no engine setting is judged from it."""
    reason = delta.get("mixed_engines")
    if not reason:
        return report
    finding = {"kind": "mixed_engines", "evidence": f"{reason}; its figures mix the engines' counters",
               "confidence": "high: the counters fell between scrapes", "caused_by": None, "setting": None,
               "current": None, "current_source": None}
    lever = {"setting": None, "current": None, "current_source": None, "proposed": None,
             "reason": "each engine's own /metrics is one engine's", "effect": "figures and a diagnosis per engine",
             "text": "give each engine's own URL (--url per replica, or PROMETHEUS for a fleet): each engine's own "
                     "/metrics is one engine's; expect figures and a diagnosis per engine"}
    report["warnings"].append(reason)
    return {**report, "mixed_engines": reason,
            "diagnosis": {"root_cause": finding, "findings": [finding], "plan": [lever], "verify": []}}
