#!/usr/bin/env python3
"""How long a big bench.py run waits before its first request, against the calibration server.

Runs bench.py with -n 100,000 (a --duration run: it stops sending after --duration seconds) and
reads `startup_s`: seconds from the start of the run to the first request on the wire, prompt
building included. Goal (issue 14): a run of tens of thousands of requests starts within
seconds (below --goal-s). Before the requests were made on demand, 100,000 prompts of 2,048
tokens were all fitted through /tokenize first.

Examples:
  bench_startup.py
  bench_startup.py -n 20000 --input-tokens 512 --json

Exit codes: 0 within the goal, 1 slower, 2 bad arguments, 3 the server or bench failed.
"""
from __future__ import annotations

import sys
from typing import Sequence

import bench_accuracy  # beside this script; it puts scripts/ on the path
import calibration_server
from bench_accuracy import SCRIPTS

from rooflib.core import cli, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    p.add_argument("-n", type=int, default=100_000, help="requests in the run")
    p.add_argument("--input-tokens", type=int, default=2048)
    p.add_argument("--duration", type=float, default=3.0, help="seconds of sending")
    p.add_argument("--goal-s", type=float, default=5.0, help="the most seconds to the first request")
    args = p.parse_args(argv)

    def body() -> int:
        with calibration_server.spawned(["--ttft-ms", "10", "--itl-ms", "5"]) as url:
            result = bench_accuracy.run_bench(
                [sys.executable, str(SCRIPTS / "bench.py"), "--url", url, "--json", "-n", str(args.n), "-c", "64",
                 "--duration", str(args.duration), "--input-tokens", str(args.input_tokens), "--output-tokens", "4"],
                "bench_startup")
        report = {"requests": args.n, "input_tokens": args.input_tokens, "startup_s": result["startup_s"],
                  "goal_s": args.goal_s, "sent": result["requests"]["sent"],
                  "prompt_tokens": result["requests"]["prompt_tokens"], "ok": result["startup_s"] <= args.goal_s}
        text = (f"{args.n} requests of {args.input_tokens} tokens: first request after {result['startup_s']:.2f} s "
                f"(goal <= {args.goal_s:g} s); {report['sent']} sent in {args.duration:g} s, prompt lengths "
                f"{report['prompt_tokens']['min']}..{report['prompt_tokens']['max']}")
        printed = printing.emit(report, text, args.output)
        return printed or (EXIT_OK if report["ok"] else EXIT_CHECK_FAILED)
    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
