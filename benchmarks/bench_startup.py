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

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import common  # noqa: E402
from common import ServerError  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(__doc__)
    common.add_output_args(p)
    p.add_argument("-n", type=int, default=100_000, help="requests in the run")
    p.add_argument("--input-tokens", type=int, default=2048)
    p.add_argument("--duration", type=float, default=3.0, help="seconds of sending")
    p.add_argument("--goal-s", type=float, default=5.0, help="the most seconds to the first request")
    args = p.parse_args(argv)

    def body() -> int:
        server = subprocess.Popen([sys.executable, str(SCRIPTS / "calibration_server.py"), "--port", "0",
                                   "--ttft-ms", "10", "--itl-ms", "5"], stdout=subprocess.PIPE, text=True)
        try:
            line = server.stdout.readline().strip()
            if not line.startswith("listening on "):
                raise ServerError(f"the calibration server did not start: {line or 'no output'}")
            cmd = [sys.executable, str(SCRIPTS / "bench.py"), "--url", line.split()[-1], "--json",
                   "-n", str(args.n), "-c", "64", "--duration", str(args.duration),
                   "--input-tokens", str(args.input_tokens), "--output-tokens", "4"]
            common.progress("bench_startup: " + " ".join(cmd))
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode not in (0, 4):
                raise ServerError(f"bench.py exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            result = json.loads(done.stdout)
        finally:
            server.terminate()
            server.wait(10)
        report = {"requests": args.n, "input_tokens": args.input_tokens, "startup_s": result["startup_s"],
                  "goal_s": args.goal_s, "sent": result["requests"]["sent"],
                  "prompt_tokens": result["requests"]["prompt_tokens"], "ok": result["startup_s"] <= args.goal_s}
        text = (f"{args.n} requests of {args.input_tokens} tokens: first request after {result['startup_s']:.2f} s "
                f"(goal <= {args.goal_s:g} s); {report['sent']} sent in {args.duration:g} s, prompt lengths "
                f"{report['prompt_tokens']['min']}..{report['prompt_tokens']['max']}")
        common.emit(report, text, args.json)
        return common.EXIT_OK if report["ok"] else common.EXIT_CHECK_FAILED
    return common.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
