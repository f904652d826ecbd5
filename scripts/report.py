#!/usr/bin/env python3
"""Render result files as one self-contained HTML page (inline SVG charts) or a short text summary.

Reads what the other tasks write with --json: bench, sweep, compare, accept, metrics, vram and
roofline results (each names its "kind"; older files without one are recognised by their keys),
plus bench's per-request records (--records FILE.jsonl). The page has no scripts, fetches nothing
(no fonts, no images) and opens from disk offline; each chart has a caption naming the workload
and the server, and a table of its data. A first section answers in one sentence per result
(its verdict, the figure behind it, what to do; a warning where a roofline is set against a run
of another model). Verdicts come next (compare, accept), then:
  sweep     TTFT and TPOT p50/p95/p99 against concurrency (or rate: several bench files), SLO
            lines, the knee; throughput against TPOT; invalid points hollow, failed ones crossed;
  bench     TTFT, TPOT and ITL distributions (CDF, with --records); the request timeline above
            the server timeline (running, waiting, KV usage, preemptions) on one time axis;
  physics   measured time per output token against the roofline bound for that batch
            (a bench or sweep with a roofline file);
  sizing    the GPU memory budget as a stacked bar (weights, activation, graphs, KV) and the levers.
Charts draw at most a few hundred marks (thinned or sampled, and said so); tables keep the counts.
Results of different workloads (prompt/output tokens, endpoint) cannot share a chart: exit 2.

Examples:
  report.py sweep.json --out report.html
  report.py bench.json --records requests.jsonl --out run.html
  report.py compare.json accept.json --format text
  report.py sweep.json roofline.json vram.json --out sizing.html --json
  task infer:report REPORT_OUT=report.html RECORDS=requests.jsonl -- bench.json

Exit codes: 0 written, 2 usage error (no file, an empty or unreadable file, a result of another
kind or schema version, different workloads on one chart), 130 interrupted (nothing written).
"""
from __future__ import annotations

import datetime
import sys
from typing import Sequence

from rooflib.core import cli, fileio, printing
from rooflib.core.errors import UsageError
from rooflib.render.report_html import answers_section, build_sections, render_html, render_text
from rooflib.render.report_inputs import MAX_INPUT_BYTES, parse_records, parse_result


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def build_parser():
    p = cli.parser(__doc__)
    p.add_argument("files", nargs="*", help="result files (--json output of bench, sweep, compare, accept, "
                                            "metrics, vram, roofline)")
    p.add_argument("--records", default="", help="bench's --records file (JSON lines) for distributions and "
                                                 "the request timeline")
    p.add_argument("--format", default="", choices=["", "html", "text"], help="html (default) or text")
    p.add_argument("--out", default="", help="write here (atomically); default report.html for html, "
                                             "stdout for text")
    printing.add_output_args(p)
    return p


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # files may come after --records

    def body() -> int:
        if not args.files:
            raise UsageError("no result files given: pass the --json output of a task, e.g. report.py sweep.json")
        results = [parse_result(fileio.read_bounded(path, "result", MAX_INPUT_BYTES), path) for path in args.files]
        records = None
        if args.records:
            records = parse_records(fileio.read_bounded(args.records, "records", MAX_INPUT_BYTES), args.records)
        sections = [answers_section(results), *build_sections(results, records)]
        fmt_ = args.format or "html"
        out = args.out or ("report.html" if fmt_ == "html" else "")
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        text = render_html(sections, results, now) if fmt_ == "html" else render_text(sections)
        if out:
            fileio.write_atomic(out, text)
            charts = sum(len(s.charts) for s in sections)
            printing.progress(f"report: {plural(len(sections), 'section')}, {plural(charts, 'chart')} written to {out}")
        summary = {"kind": "report", "schema_version": 1, "format": fmt_, "out": out or None,
                   "inputs": [{"file": r.path, "kind": r.kind} for r in results],
                   "sections": [{"title": s.title, "verdict": s.verdict, "reasons": s.reasons,
                                 "facts": [{"name": k, "value": v} for k, v in s.facts], "charts": [c.id for c in s.charts]} for s in sections]}
        human = text if not out else render_text(sections) if fmt_ == "html" else f"written to {out}"
        return printing.emit(summary, human, args.output)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
