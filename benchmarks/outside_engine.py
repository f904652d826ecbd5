#!/usr/bin/env python3
"""Time outside the engine behind a real CPU vLLM: does bench name each proxy in front by its kind?

Starts the cpu-tiny vLLM (prefix caching on, as tests/server/test_diagnosis_live.py's `cached`)
and puts the suite's proxy (tests/slow_proxy.py) in front of it three ways: a fixed delay on every
path (expected: fixed_latency and network), the same delay on the inference routes only
(fixed_latency and gateway), and response buffering (buffering). Through each, bench.py --probe
/health (6 requests of 64 tokens in and 32 out, one at a time, targets no CPU run misses) and the
outside-engine findings of its cross-check, with their sizes, the engine's TTFT p99 and the
client's loop-lag p99: what decides them. rooflib/server/watch.py names a kind only where the
client is above the engine's histogram bucket at every percentile, by more than its own loop
lag; on a busy 2-core machine the tiny model's TTFT for one 64-token prompt reached 1 to 2.5 s,
vLLM's widest bucket below 5 s, and a 1 s delay no longer cleared it.

The suite checks the kinds against an engine whose times it knows (the calibration server with
vLLM's histograms of its own times) and, behind the real vLLM, only what load cannot change; this
is the live check, as quiet or as busy as the machine it runs on.

Goal: every scenario names exactly its kinds, and the fixed latency is within 30% above the delay.

Examples:
  outside_engine.py
  outside_engine.py --delay-s 2 --json

Exit codes: 0 every scenario named as expected, 1 some not, 2 bad arguments, 3 the engine or
bench failed.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import bench_accuracy  # beside this script; it puts scripts/ on the path
from bench_accuracy import SCRIPTS

from rooflib.core import cli, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, ServerError, UsageError

# The suite's instruments: the CPU vLLM starter and the proxy.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from slow_proxy import Behaviour, proxy  # noqa: E402
from vllm_server import ServerUnavailable, running_vllm  # noqa: E402

CPU_SLO = ["--slo-ttft-p95-ms", "600000", "--slo-tpot-p95-ms", "600000"]
MARGIN = 0.3  # the fixed latency may exceed the delay by the API server's own time, up to this share


def scenarios(delay_s: float) -> dict[str, tuple[Behaviour, set[str]]]:
    return {"network": (Behaviour(delay_s=delay_s), {"fixed_latency", "network"}),
            "gateway": (Behaviour(delay_s=delay_s, delayed_prefix="/v1/"), {"fixed_latency", "gateway"}),
            "buffering": (Behaviour(buffer=True), {"buffering"})}


def measure(url: str, name: str, behaviour: Behaviour, expected: set[str], delay_s: float) -> dict[str, Any]:
    """One scenario: bench through the proxy, the kinds it named and what decided them."""
    with proxy(url, behaviour) as proxied:
        result = bench_accuracy.run_bench(
            [sys.executable, str(SCRIPTS / "bench.py"), "--url", proxied, "--json", "-n", "6", "-c", "1", "--warmup",
             "0", "--input-tokens", "64", "--output-tokens", "32", "--timeline-interval", "0", "--probe", "/health",
             *CPU_SLO], f"outside_engine {name}")
    found = {f["cause"]: f["size_ms"] for f in result["server"]["cross_check"]["findings"]
             if f["kind"] == "outside_engine"}
    fixed = found.get("fixed_latency")
    sized = fixed is None or delay_s * 1e3 <= fixed <= (1 + MARGIN) * delay_s * 1e3
    return {"scenario": name, "expected": sorted(expected),
            "found": {cause: round(size or 0.0, 1) for cause, size in found.items()},
            "engine_ttft_p99_ms": result["server"]["metrics"]["ttft_ms"]["p99"],
            "client_loop_lag_p99_ms": result["client"]["loop_lag_ms"]["p99"],
            "probe_p50_ms": result["server"]["probe"]["p50_ms"], "ok": set(found) == expected and sized}


def line(row: dict[str, Any]) -> str:
    found = ", ".join(f"{cause} {size:.0f} ms" for cause, size in row["found"].items()) or "nothing"
    return (f"{'ok  ' if row['ok'] else 'MISS'} {row['scenario']:<10} expected {', '.join(row['expected'])}; "
            f"found {found} (engine TTFT p99 {printing.fmt_number(row['engine_ttft_p99_ms'], 0)} ms, client loop "
            f"lag p99 {printing.fmt_number(row['client_loop_lag_p99_ms'], 1)} ms, /health "
            f"{printing.fmt_number(row['probe_p50_ms'], 1)} ms)")


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    p.add_argument("--delay-s", type=float, default=1.0, help="the proxy's delay (network and gateway)")
    args = p.parse_args(argv)

    def body() -> int:
        if args.delay_s <= 0:
            raise UsageError("--delay-s must be above 0")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with running_vllm(Path(tmp), sets=["enable_prefix_caching=true"]) as server:
                    rows = [measure(server.url, name, behaviour, expected, args.delay_s)
                            for name, (behaviour, expected) in scenarios(args.delay_s).items()]
            except ServerUnavailable as exc:
                raise ServerError(str(exc))
        report = {"delay_s": args.delay_s, "scenarios": rows, "ok": all(row["ok"] for row in rows)}
        printed = printing.emit(report, "\n".join(line(row) for row in rows), args.output)
        return printed or (EXIT_OK if report["ok"] else EXIT_CHECK_FAILED)
    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
