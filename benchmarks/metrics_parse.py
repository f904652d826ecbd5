#!/usr/bin/env python3
"""How long metrics.py takes to read a 1 MB scrape (parse, normalize, report, diagnose).

Builds a scrape of at least --size-mb from the recorded vLLM 0.32 page by repeating its vllm:
series for more data-parallel engines (engine="1", "2", ...): the shape of a large DP server.
Reports the best and median of --repeat runs. The goal (issue 4) is well under a second.

Examples:
  metrics_parse.py
  metrics_parse.py --size-mb 4 --repeat 10 --json

Exit codes: 0 best time under --budget-s, 1 over it, 2 bad arguments.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from rooflib.core import (
    cli,  # noqa: E402
    printing,  # noqa: E402
)
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError  # noqa: E402
from rooflib.server import engine_metrics, snapshots  # noqa: E402

RECORDED = ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32-after.txt"


def big_scrape(size_bytes: int) -> tuple[str, int]:
    """The recorded page plus copies of its engine="0" series as more engines; (text, engines)."""
    text = RECORDED.read_text()
    engine_lines = [line for line in text.splitlines() if line.startswith("vllm:") and 'engine="0"' in line]
    parts, engines = [text], 1
    while sum(len(p) for p in parts) < size_bytes:
        parts.append("\n".join(line.replace('engine="0"', f'engine="{engines}"') for line in engine_lines) + "\n")
        engines += 1
    return "".join(parts), engines


def measure(text: str, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        engine_metrics.report(snapshots.snapshot(text, "benchmark"))
        times.append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--size-mb", type=float, default=1.0, help="scrape size in MB (10^6 bytes)")
    p.add_argument("--repeat", type=int, default=5, help="runs; the best and the median are reported")
    p.add_argument("--budget-s", type=float, default=1.0, help="the best run must take less than this")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        if args.size_mb <= 0 or args.repeat <= 0 or args.budget_s <= 0:
            raise UsageError("--size-mb, --repeat and --budget-s must be positive")
        text, engines = big_scrape(int(args.size_mb * 1e6))
        times = measure(text, args.repeat)
        result: dict[str, Any] = {
            "bytes": len(text.encode()), "lines": text.count("\n"), "engines": engines,
            "best_s": min(times), "median_s": statistics.median(times), "budget_s": args.budget_s,
            "mb_per_s": len(text.encode()) / 1e6 / min(times), "within_budget": min(times) < args.budget_s}
        human = (f"{result['bytes'] / 1e6:.2f} MB scrape ({result['lines']:,} lines, {engines} engines): "
                 f"best {result['best_s'] * 1000:.0f} ms, median {result['median_s'] * 1000:.0f} ms "
                 f"({result['mb_per_s']:.1f} MB/s); budget {args.budget_s:g} s: "
                 f"{'ok' if result['within_budget'] else 'OVER'}")
        printed = printing.emit(result, human, args.output)
        return printed or (EXIT_OK if result["within_budget"] else EXIT_CHECK_FAILED)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
