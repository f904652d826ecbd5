#!/usr/bin/env python3
"""Bench at several concurrencies in one command: the knee and the tok/s vs TPOT trade-off.

Runs bench.py's load once per concurrency in --sweep-c (default 1,4,8,16,32), each with its own
warm-up and unique prompts, then prints one row per point (req/s, output and total tok/s,
TTFT and TPOT p50/p95, verdict) and the knee: the largest concurrency whose run meets the SLO
(SLO_TTFT_P95_MS / SLO_TPOT_P95_MS) with every request completed and a valid client, and below
any run that was invalid or errored (that run measured nothing, so the SLO is unknown there and
above; JSON `knee_caveat` says why). Without an SLO there is no knee, only the trade-off. With --log each point appends its bench log entry.
-n (BENCH_N) counts requests per point, by default 4 x C (at least 16) so that each point runs
several waves; the other options are bench.py's.

Examples:
  sweep.py --url http://127.0.0.1:8000 --slo-ttft-p95-ms 500 --slo-tpot-p95-ms 50
  sweep.py --sweep-c 8,16,32,64 --input-tokens 1024 --output-tokens 128 --json
  SWEEP_C=1,2,4 BENCH_N=16 sweep.py --endpoint chat --log bench-log.md
  sweep.py --sweep-c 1,4,16 --json-out sweep.json   # the table on stdout, the JSON document in sweep.json

Exit codes: 0 a knee was found (or no SLO was set and every point completed), 1 no
concurrency meets the SLO, 2 usage error, 3 server unreachable or failing at every point,
4 a point's run was invalid (client-bound), 5 the report is printed but --log or --json-out could
not be written, 130 interrupted by Ctrl-C or SIGTERM, during a point or between two (the points
done are printed, logged and written to --json-out).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402
import common  # noqa: E402
from common import UsageError  # noqa: E402

DEFAULT_SWEEP = "1,4,8,16,32"


def parse_levels(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]: positive, increasing, no repeats."""
    try:
        levels = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--sweep-c (SWEEP_C) must be whole numbers separated by commas, got {text!r}")
    if not levels or any(c < 1 or c > loadgen.LIMITS["concurrency"] for c in levels):
        raise UsageError(f"--sweep-c (SWEEP_C) needs concurrencies between 1 and {loadgen.LIMITS['concurrency']}, got {text!r}")
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
    """The lowest concurrency whose run was invalid (client-bound) or errored."""
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
    why = "the client could not keep up (client-bound)" if stop["verdict"] == "INVALID" else "its requests errored"
    text = f"C = {stop['concurrency']} was {stop['verdict']} ({why}): the knee cannot be named above it"
    if above:
        text += f"; the passes at C = {', '.join(map(str, above))} are not counted"
    return text + "; rerun that point (a faster client machine, or fewer requests per second)"


def human(report: dict[str, Any]) -> str:
    lines = [f"{'C':>5}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}{'TTFT p50':>10}{'p95':>9}"
             f"{'TPOT p50':>10}{'p95':>8}  verdict"]
    for p in report["points"]:
        lines.append(f"{p['concurrency']:>5}{common.fmt_number(p['req_s']):>9}{common.fmt_number(p['output_tok_s'], 1):>11}"
                     f"{common.fmt_number(p['total_tok_s'], 1):>13}{common.fmt_number(p['ttft_ms']['p50'], 1):>10}"
                     f"{common.fmt_number(p['ttft_ms']['p95'], 1):>9}{common.fmt_number(p['tpot_ms']['p50'], 1):>10}"
                     f"{common.fmt_number(p['tpot_ms']['p95'], 1):>8}  {p['verdict']}")
    k = report["knee"]
    if report.get("knee_caveat"):
        lines.append(f"note: {report['knee_caveat']}")
    if k:
        lines.append(f"Knee: C = {k['concurrency']}: {common.fmt_number(k['total_tok_s'], 1)} total tok/s at TPOT p95 "
                     f"{common.fmt_number(k['tpot_ms']['p95'], 1)} ms, TTFT p95 {common.fmt_number(k['ttft_ms']['p95'], 1)} ms")
    elif report["slo_set"]:
        lines.append("Knee: none: no concurrency met the SLO")
    else:
        lines.append("Knee: set SLO_TTFT_P95_MS and/or SLO_TPOT_P95_MS to find it; the table is the trade-off")
    if report["interrupted"]:
        lines.append("interrupted: the points done so far")
    return "\n".join(lines)


def exit_code(report: dict[str, Any]) -> int:
    points = report["points"]
    if report["interrupted"]:
        return common.EXIT_INTERRUPTED
    if points and all(p["verdict"] == "ERROR" for p in points):
        return common.EXIT_SERVER
    if any(p["verdict"] == "INVALID" for p in points):
        return common.EXIT_INVALID
    if report["slo_set"] and not report["knee"]:
        return common.EXIT_CHECK_FAILED
    if not report["slo_set"] and any(p["verdict"] != "NO SLO" for p in points):
        return common.EXIT_CHECK_FAILED
    return common.EXIT_OK


def point_args(args: argparse.Namespace, concurrency: int, per_point: str | None) -> argparse.Namespace:
    """bench's arguments for one point: its concurrency, and -n (BENCH_N) per point, by default
    4 x C (at least 16), so that each point runs several waves."""
    return argparse.Namespace(**{**vars(args), "concurrency": str(concurrency),
                                 "num_requests": str(per_point or max(16, 4 * concurrency))})


def run(args: Any, settings: common.Settings, server: loadgen.Target) -> int:
    if args.concurrency:
        raise UsageError("sweep sets the concurrency itself: use --sweep-c (SWEEP_C), not -c")
    levels = parse_levels(settings.get("SWEEP_C", args.sweep_c, DEFAULT_SWEEP))
    per_point = settings.get("BENCH_N", args.num_requests, None)
    configs = [loadgen.make_config(point_args(args, c, per_point), settings) for c in levels]  # all checked first
    cfg = configs[0]  # the point being run; the SLO, lengths and log are every point's
    if cfg["log"]:
        common.check_writable(cfg["log"], "--log (BENCH_LOG)")
    points, interrupted, log_error, target = [], False, None, None
    # A Ctrl-C or SIGTERM between two points (a workload being built) ends the sweep with the points
    # done; during a load it stops the load; from the end of a load it waits in `hold` until that
    # point is recorded (loadgen.execute), and then ends the sweep.
    with common.SignalHold("sweep") as hold:
        try:
            target = loadgen.find_target(server, settings.get("INFER_MODEL", args.model) or None, cfg["timeout_s"])
            for cfg in configs:
                common.progress(f"sweep: C = {cfg['concurrency']}")
                result = loadgen.execute(target, cfg, hold)
                result.pop("records")
                points.append(point_summary(cfg["concurrency"], result))
                if cfg["log"] and not log_error:
                    try:  # each point's entry at once (atomically): an interrupted sweep keeps the points done
                        common.append_log(cfg["log"], common.render_log_entry(result, loadgen.TEMPLATE))
                    except OSError as exc:
                        log_error = (f"the result is printed above, but --log {cfg['log']} was not written: "
                                     f"{exc.strerror or exc}")
                if result["interrupted"]:
                    interrupted = True
                    break
                hold.release()  # one held since the load ended is raised here, with the point recorded
        except KeyboardInterrupt:  # between two points, or held until a point was recorded
            interrupted = True
            hold.start()
        has_slo = bool(points) and (cfg["slo_ttft_p95_ms"] is not None or cfg["slo_tpot_p95_ms"] is not None)
        found = knee(points, has_slo)
        report = {"kind": "sweep", "schema_version": 1,
                  "points": points, "knee": found, "knee_caveat": knee_caveat(points, found), "slo_set": has_slo,
                  "slo": {"ttft_p95_ms": cfg["slo_ttft_p95_ms"], "tpot_p95_ms": cfg["slo_tpot_p95_ms"]},
                  "levels": levels, "interrupted": interrupted,
                  "config": {k: cfg[k] for k in ("input_tokens", "output_tokens", "endpoint", "warmup")}
                  | {"url": target.base_url if target else None, "model": target.model if target else None}}
        printed = common.emit(report, human(report), args.output)
    if log_error:
        print(f"error: {log_error}", file=sys.stderr)
        return common.EXIT_OUTPUT
    return printed or exit_code(report)


@common.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = loadgen.build_parser()
    p.description, p.epilog = common.split_doc(__doc__)
    p.add_argument("--sweep-c", default="", help=f"concurrencies to run (else $SWEEP_C, {DEFAULT_SWEEP})")
    return loadgen.run_with_settings(p.parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
