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
4 a point's run was invalid (the client's figures distorted: busy, or kept waiting by other
processes), 5 the report is printed but --log or --json-out could not be written, 130
interrupted by Ctrl-C or SIGTERM, during a point or between two (the points done are printed,
logged and written to --json-out).
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from rooflib.core import cli, conf, fileio, printing, signals
from rooflib.core.errors import EXIT_OUTPUT, UsageError
from rooflib.load import asyncclient, bench_options, benchrun
from rooflib.load.apis import APIS
from rooflib.load.sweeps import exit_code, knee, knee_caveat, no_knee_reason, parse_levels, point_summary

DEFAULT_SWEEP = "1,4,8,16,32"


def human(report: dict[str, Any]) -> str:
    lines = [f"{'C':>5}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}{'TTFT p50':>10}{'p95':>9}"
             f"{'TPOT p50':>10}{'p95':>8}  verdict"]
    for p in report["points"]:
        lines.append(f"{p['concurrency']:>5}{printing.fmt_number(p['req_s']):>9}{printing.fmt_number(p['output_tok_s'], 1):>11}"
                     f"{printing.fmt_number(p['total_tok_s'], 1):>13}{printing.fmt_number(p['ttft_ms']['p50'], 1):>10}"
                     f"{printing.fmt_number(p['ttft_ms']['p95'], 1):>9}{printing.fmt_number(p['tpot_ms']['p50'], 1):>10}"
                     f"{printing.fmt_number(p['tpot_ms']['p95'], 1):>8}  {p['verdict']}")
    k = report["knee"]
    if report.get("knee_caveat"):
        lines.append(f"note: {report['knee_caveat']}")
    if k:
        lines.append(f"Knee: C = {k['concurrency']}: {printing.fmt_number(k['total_tok_s'], 1)} total tok/s at TPOT p95 "
                     f"{printing.fmt_number(k['tpot_ms']['p95'], 1)} ms, TTFT p95 {printing.fmt_number(k['ttft_ms']['p95'], 1)} ms")
    elif report["slo_set"]:
        lines.append(f"Knee: none: {no_knee_reason(report['points'])}")
    else:
        lines.append("Knee: set SLO_TTFT_P95_MS and/or SLO_TPOT_P95_MS to find it; the table is the trade-off")
    if report["interrupted"]:
        lines.append("interrupted: the points done so far")
    return "\n".join(lines)


def point_options(options: bench_options.BenchOptions, concurrency: int) -> bench_options.BenchOptions:
    """bench's options for one point: its concurrency, and -n (BENCH_N) per point, by default
    4 x C (at least 16), so that each point runs several waves."""
    per_point = options.num_requests if options.num_requests_given else max(16, 4 * concurrency)
    return options.at_concurrency(concurrency, per_point)


def run(args: Any, settings: conf.Settings, server: asyncclient.Target) -> int:
    if args.concurrency:
        raise UsageError("sweep sets the concurrency itself: use --sweep-c (SWEEP_C), not -c")
    levels = parse_levels(settings.get("SWEEP_C", args.sweep_c, DEFAULT_SWEEP))
    asked = bench_options.read_options(args, settings)
    if not APIS[asked.endpoint].generates:
        raise UsageError(f"sweep finds the knee of TTFT and TPOT, which --endpoint {asked.endpoint} does not have: "
                         "run bench at each concurrency (its latency, requests/s and input tokens/s)")
    planned = [point_options(asked, c) for c in levels]  # all checked first
    options = planned[0]  # the point being run; the SLO, lengths and log are every point's
    if options.log:
        fileio.check_writable(options.log, "--log (BENCH_LOG)")
    points, interrupted, log_error, target = [], False, None, None
    # A Ctrl-C or SIGTERM between two points (a workload being built) ends the sweep with the points
    # done; during a load it stops the load; from the end of a load it waits in `hold` until that
    # point is recorded (benchrun.execute), and then ends the sweep.
    with signals.SignalHold("sweep") as hold:
        try:
            target = asyncclient.find_target(server, settings.get("INFER_MODEL", args.model) or None, options.timeout_s)
            for options in planned:
                printing.progress(f"sweep: C = {options.concurrency}")
                result = benchrun.execute(target, options, hold)
                result.pop("records")
                points.append(point_summary(options.concurrency, result))
                if options.log and not log_error:
                    try:  # each point's entry at once (atomically): an interrupted sweep keeps the points done
                        fileio.append_log(options.log, printing.render_log_entry(result, benchrun.TEMPLATE))
                    except OSError as exc:
                        log_error = (f"the result is printed above, but --log {options.log} was not written: "
                                     f"{exc.strerror or exc}")
                if result["interrupted"]:
                    interrupted = True
                    break
                hold.release()  # one held since the load ended is raised here, with the point recorded
        except KeyboardInterrupt:  # between two points, or held until a point was recorded
            interrupted = True
            hold.start()
        slo = options.slo
        has_slo = bool(points) and (slo.ttft_p95_ms is not None or slo.tpot_p95_ms is not None
                                    or options.slo_latency_p95_ms is not None)
        found = knee(points, has_slo)
        report = {"kind": "sweep", "schema_version": 1,
                  "points": points, "knee": found, "knee_caveat": knee_caveat(points, found), "slo_set": has_slo,
                  "slo": {"ttft_p95_ms": slo.ttft_p95_ms, "tpot_p95_ms": slo.tpot_p95_ms,
                          "latency_p95_ms": options.slo_latency_p95_ms},
                  "levels": levels, "interrupted": interrupted,
                  "config": {"input_tokens": options.input_tokens, "output_tokens": options.output_tokens,
                             "endpoint": options.endpoint, "warmup": options.warmup}
                  | {"url": target.base_url if target else None, "model": target.model if target else None}}
        printed = printing.emit(report, human(report), args.output)
    if log_error:
        print(f"error: {log_error}", file=sys.stderr)
        return EXIT_OUTPUT
    return printed or exit_code(report)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = bench_options.build_parser()
    p.description, p.epilog = cli.split_doc(__doc__)
    p.add_argument("--sweep-c", default="", help=f"concurrencies to run (else $SWEEP_C, {DEFAULT_SWEEP})")
    return benchrun.run_with_settings(p.parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
