#!/usr/bin/env python3
"""The largest exact bench run on this machine: concurrent streams doubled until bench.py (with
--workers) is no longer valid or no longer within its accuracy targets against the calibration server.

Each level runs bench_accuracy.py's measurement (the calibration server on one core, bench.py on
the other, each request matched with the server's own record of when it arrived and when each
chunk was written) at STREAMS concurrent streams, 2 x STREAMS measured requests after a warm-up
wave, 16 output tokens. The server's schedule widens with the streams (ITL = STREAMS / 20,000 s,
at least 20 ms; TTFT = 2 x ITL) so that it writes at most 20,000 chunks a second, what one core of
the calibration server keeps to: the client, not the instrument, is what is tested. A level is
exact when the run is valid (the client's own self-check) and within the targets of
bench_accuracy.py (TTFT p50 and p95 within 10%, ITL p95 within 5% of the server's truth). The
calibration server holds two descriptors per connection: the open-file limit (ulimit -n) caps the
levels this machine can test, and the report says where. Beyond one machine's streams, the load is
split over machines: bench --shard, task bench-job, task merge (references/bench-protocol.md).

Examples:
  bench_scale.py                                    # 1,024 .. 8,192 streams, --workers 2
  bench_scale.py --from 2048 --to 4096 --workers 1 --json
  bench_scale.py --goal 8192

Exit codes: 0 the largest exact level reaches --goal, 1 it does not, 2 bad arguments, 3 the
server or bench failed.
"""
from __future__ import annotations

import argparse
import resource
import sys
from typing import Any, Sequence

import bench_accuracy  # beside this script; it puts scripts/ on the path

from rooflib.core import cli, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError

CHUNKS_PER_S = 20_000  # what the calibration server writes on one core and still keeps its schedule
OUTPUT_TOKENS = 16
DESCRIPTORS_PER_STREAM = 2  # the calibration server dups each connection's socket to peek its timestamps


def server_stream_limit() -> int:
    """The most streams the calibration server can hold under this machine's open-file limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    return (limit - 256) // DESCRIPTORS_PER_STREAM


def levels(start: int, stop: int) -> list[int]:
    found, streams = [], start
    while streams <= stop:
        found.append(streams)
        streams *= 2
    return found


def measure_level(streams: int, workers: int) -> dict[str, Any]:
    """One level: bench_accuracy's rows against the targets and its details, and whether exact."""
    itl_ms = max(20.0, 1000.0 * streams / CHUNKS_PER_S)
    schedule = argparse.Namespace(ttft_ms=2 * itl_ms, itl_ms=itl_ms, input_tokens=64, output_tokens=OUTPUT_TOKENS,
                                  workers=workers, httpx_baseline=False)
    rows, info = bench_accuracy.measure(schedule, streams, 2 * streams)
    valid = info["verdict"] != "INVALID"
    return {"streams": streams, "workers": workers, "itl_ms": itl_ms, "ttft_ms": 2 * itl_ms,
            "exact": valid and all(r["ok"] for r in rows), "valid": valid, "rows": rows, **info}


def line(level: dict[str, Any]) -> str:
    errors = {(r["metric"], r["stat"]): r["error_pct"] for r in level["rows"]}
    lag = level["client"]["loop_lag_ms"]
    return (f"{level['streams']:>6} streams  TTFT p50 {errors[('ttft_ms', 'p50')]:+.2f}%  p95 "
            f"{errors[('ttft_ms', 'p95')]:+.2f}%  ITL p95 {errors[('itl_ms', 'p95')]:+.2f}%  client lag p95 "
            f"{lag['p95']:.2f} ms, CPU {100 * level['client']['cpu_util']:.0f}%  verdict {level['verdict']}  "
            + ("exact" if level["exact"] else "NOT exact"))


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    p.add_argument("--from", dest="start", type=int, default=1024, help="the first level's streams")
    p.add_argument("--to", dest="stop", type=int, default=0, help="the last level tried (default: what the "
                   "open-file limit lets the calibration server hold, at most 16,384)")
    p.add_argument("--workers", type=int, default=2, help="bench.py client processes")
    p.add_argument("--goal", type=int, default=4096, help="streams the largest exact level must reach")
    args = p.parse_args(argv)

    def body() -> int:
        cap = server_stream_limit()
        stop = args.stop or min(cap, 16_384)
        if args.start < 1 or args.workers < 1 or stop < args.start or stop > cap:
            raise UsageError(f"--from {args.start} .. --to {stop}: give 1 <= from <= to <= {cap} (the calibration "
                             f"server's limit under ulimit -n), --workers >= 1")
        runs = []
        for streams in levels(args.start, stop):
            runs.append(measure_level(streams, args.workers))
            printing.progress("bench_scale: " + line(runs[-1]))
            if not runs[-1]["exact"]:
                break
        exact = [r["streams"] for r in runs if r["exact"]]
        largest = max(exact, default=0)
        report = {"largest_exact_streams": largest, "workers": args.workers, "goal": args.goal,
                  "server_stream_limit": cap, "runs": runs}
        text = "\n".join([*(line(r) for r in runs),
                          f"largest exact run: {largest} streams with --workers {args.workers} (goal {args.goal}; "
                          f"the calibration server holds at most {cap} here)"])
        printed = printing.emit(report, text, args.output)
        return printed or (EXIT_OK if largest >= args.goal else EXIT_CHECK_FAILED)
    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
