"""A concurrency sweep's points: the levels to run, each point's summary, the knee."""
from __future__ import annotations

from typing import Any, Sequence

from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_SERVER, UsageError
from rooflib.load import bench_options


def parse_levels(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]: positive, increasing, no repeats."""
    try:
        levels = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--sweep-c (SWEEP_C) must be whole numbers separated by commas, got {text!r}")
    if not levels or any(c < 1 or c > bench_options.LIMITS["concurrency"] for c in levels):
        raise UsageError(f"--sweep-c (SWEEP_C) needs concurrencies between 1 and {bench_options.LIMITS['concurrency']}, got {text!r}")
    return sorted(set(levels))


def point_summary(concurrency: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"concurrency": concurrency, "verdict": result["verdict"], "reasons": result["verdict_reasons"],
            "requests": result["config"]["num_requests"], "completed": result["requests"]["completed"],
            "failed": result["requests"]["failed"], **{k: result["throughput"][k] for k in
                                                        ("req_s", "output_tok_s", "total_tok_s")},
            "ttft_ms": result["ttft_ms"], "tpot_ms": result["tpot_ms"], "itl_ms": result["itl_ms"],
            "e2e_ms": result["e2e_ms"], "client_valid": result["client"]["valid"],
            "workload": result["workload"], "samples": result["samples"]}


UNMEASURED = ("INVALID", "ERROR")  # runs that say nothing about the server at that concurrency


def first_unmeasured(points: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The lowest concurrency whose run was invalid (its client's figures distorted) or errored."""
    return min((p for p in points if p["verdict"] in UNMEASURED), key=lambda p: p["concurrency"], default=None)


def knee(points: Sequence[dict[str, Any]], has_slo: bool) -> dict[str, Any] | None:
    """The largest concurrency whose run passed (SLO met, no failures, valid client), below any
    unmeasured one: a pass above a run that measured nothing does not show the SLO held there."""
    if not has_slo:
        return None
    stop = first_unmeasured(points)
    passing = [p for p in points if p["verdict"] == "PASS" and (stop is None or p["concurrency"] < stop["concurrency"])]
    return max(passing, key=lambda p: p["concurrency"]) if passing else None


def knee_caveat(points: Sequence[dict[str, Any]], found: dict[str, Any] | None) -> str | None:
    """Why the knee stops where it does, when an unmeasured run caps it."""
    stop = first_unmeasured(points)
    if stop is None:
        return None
    above = [p["concurrency"] for p in points if p["verdict"] == "PASS" and p["concurrency"] > stop["concurrency"]]
    text = f"{unmeasured_cause(stop)}: the knee cannot be named above it"
    if above:
        text += f"; the passes at C = {', '.join(map(str, above))} are not counted"
    return text + "; rerun that point"


def unmeasured_cause(point: dict[str, Any]) -> str:
    """"C = 4 was INVALID (cause)": the cause as the point's own bench run gave it (a busy client,
    other processes on its machine, stalls, failed requests)."""
    why = point["reasons"][0] if point["reasons"] else "no reason recorded"
    return f"C = {point['concurrency']} was {point['verdict']} ({why})"


def no_knee_reason(points: Sequence[dict[str, Any]]) -> str:
    """Why a sweep with an SLO has no knee: no valid point at all, or none that met the SLO."""
    stop = first_unmeasured(points)
    if stop is not None and not any(p["concurrency"] < stop["concurrency"] for p in points):
        return f"no valid point: {unmeasured_cause(stop)}"
    return "no concurrency met the SLO" + (f" below C = {stop['concurrency']}" if stop else "")


def exit_code(report: dict[str, Any]) -> int:
    points = report["points"]
    if report["interrupted"]:
        return EXIT_INTERRUPTED
    if points and all(p["verdict"] == "ERROR" for p in points):
        return EXIT_SERVER
    if any(p["verdict"] == "INVALID" for p in points):
        return EXIT_INVALID
    if report["slo_set"] and not report["knee"]:
        return EXIT_CHECK_FAILED
    if not report["slo_set"] and any(p["verdict"] != "NO SLO" for p in points):
        return EXIT_CHECK_FAILED
    return EXIT_OK
