#!/usr/bin/env python3
"""Compare two bench runs (or two sweeps) of the same workload: per-metric change with a 95%
bootstrap confidence interval, and a plain verdict for B against A.

Reads bench.py --json (or sweep.py --json) documents. Each carries its per-request samples
("samples": TTFT, TPOT, e2e per completed request), so percentiles can be resampled: the
interval is the 2.5th..97.5th percentile of the change over 2,000 bootstrap rounds (both runs
resampled; runs of more than 1,000 requests resample the order statistic instead, the same
distribution by the normal approximation of the binomial). A metric is better or worse when
its interval excludes 0, else no significant difference. Throughput is one figure per run:
shown, never tested. Runs of different workloads (requests, lengths, load shape, dataset
checksum) are refused with what differs; the model and server may differ, that is the A/B. When
the workload itself is under test (unique prompts against prompts that share a prefix, for a
prefix-cache question), --variable names the setting that may differ: the result records its
value in A and B ("variables") and the verdict says them.

Examples:
  compare.py base.json candidate.json
  compare.py sweep-fp16.json sweep-fp8.json --json
  compare.py a.json b.json --label-a "TP=1" --label-b "TP=2"
  compare.py unique.json shared.json --variable shared_prefix

Exit codes: 0 B is better or not significantly different, 1 B is worse or mixed, 2 bad input
(unreadable file, not a bench or sweep document, different workloads), 130 interrupted.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from rooflib.core import cli, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from rooflib.load.comparison import compare, label, load


def human(doc: dict[str, Any]) -> str:
    lines = [f"A: {doc['a']['label']} ({doc['a']['file']})", f"B: {doc['b']['label']} ({doc['b']['file']})",
             f"{'metric':<28}{'A':>10}{'B':>10}{'change':>9}  {'95% CI':<17} verdict"]
    for row in doc["metrics"]:
        ci = f"[{row['ci95_pct'][0]:+.1f}, {row['ci95_pct'][1]:+.1f}]%" if row["ci95_pct"] else "-"
        lines.append(f"{row['name']:<28}{row['a']:>10.2f}{row['b']:>10.2f}{row['change_pct']:>+8.1f}%  {ci:<17} "
                     f"{row['verdict']}")
    lines += [f"warning: {w}" for w in doc["warnings"]]
    lines.append(verdict_line(doc))
    return "\n".join(lines)


def verdict_line(doc: dict[str, Any]) -> str:
    """`Verdict: B is better`; with variables under test, each side with their values:
    `Verdict: B (shared_prefix 500) is better than A (shared_prefix 0)`."""
    def side(name: str) -> str:
        values = ", ".join(f"{key} {pair[name.lower()]}" for key, pair in doc["variables"].items())
        return f"{name} ({values})" if values else name
    a, b = side("A"), side("B")
    if doc["verdict"] == "no significant difference":
        return f"Verdict: no significant difference between {a} and {b}"
    against = " than " if doc["verdict"] in ("better", "worse") else " against "
    return f"Verdict: {b} is {doc['verdict']}" + (against + a if doc["variables"] else "")


def run(args: Any) -> int:
    for name, path in (("A", args.a), ("B", args.b)):
        if not path:  # the task passes A and B even when they are not set
            raise UsageError(f"{name} is not given: pass two files written by bench.py --json or sweep.py --json "
                             "(task compare A=base.json B=candidate.json)")
    a, b = load(args.a), load(args.b)
    doc = compare(a, b, (args.a, args.b), (label(a, args.label_a), label(b, args.label_b)), variables=args.variable)
    printed = printing.emit(doc, human(doc), args.output)
    return printed or (EXIT_CHECK_FAILED if doc["verdict"] in ("worse", "mixed") else EXIT_OK)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    p.add_argument("a", help="the baseline: bench.py --json or sweep.py --json output")
    p.add_argument("b", help="the candidate, same workload")
    p.add_argument("--label-a", default="", help="name of A in the report (default: model @ url)")
    p.add_argument("--label-b", default="", help="name of B in the report")
    p.add_argument("--variable", action="append", default=[],
                   help="a workload setting under test that may differ between A and B (e.g. shared_prefix); repeatable")
    args = p.parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
