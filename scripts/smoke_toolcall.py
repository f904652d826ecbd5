#!/usr/bin/env python3
"""Tool-call smoke test of a served model: does it call the right tool with valid arguments?

Runs the cases of scripts/rooflib/catalog/toolcall_cases.yaml against /v1/chat/completions at
temperature 0, each --repeat times: a single call (plain and streamed), parallel calls, choosing
among four tools, no call when none fits, the answer after a tool result, nested and typed
arguments with quotes and unicode, a tool without parameters, tool_choice required / named /
none, and with --long a long context. Checks per answer: a call where one is due and none where
none is due; the right name; `arguments` parses as JSON and validates against the tool's schema;
the expected values; streamed deltas merged by index equal the plain answer (at temperature 0 the
two must agree); no tool markup (<tool_call>, [TOOL_CALLS], ...) in the content. A case passes
when at least 80% of its repeats pass. Finish-reason conventions only warn (vLLM PR #25054).

A server started without tool calling is a configuration error, not a broken model: vLLM needs
`--enable-auto-tool-choice --tool-call-parser <parser>` (hermes for Qwen2.5/Qwen3, llama3_json
for Llama 3.x, mistral, ...), SGLang `--tool-call-parser <parser>` (qwen25, llama3, ...). The
same deployment, quantized and not, is compared with --baseline: cases that passed on the
baseline and fail now are regressions; cases failing on both are model limitations.

Examples:
  smoke_toolcall.py --url http://127.0.0.1:8000
  smoke_toolcall.py --repeat 5 --json > candidate.json
  smoke_toolcall.py --url http://gpu:8000 --baseline base.json     # name the regressions
  smoke_toolcall.py --cases single_auto,parallel --no-parallel      # Llama 3.x: no parallel calls
  task infer:smoke-toolcall INFER_URL=http://127.0.0.1:8000 -- --json

Exit codes: 0 pass (warnings allowed), 1 a case failed or regressed, 2 configuration or usage
error (tool calling not enabled, unknown model or case, bad baseline file), 3 server unreachable,
130 interrupted by Ctrl-C or SIGTERM (the finished cases are reported).
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from rooflib.core import catalogs, cli, conf, http_client, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError
from rooflib.quality import toolcalls
from rooflib.server import model_listing


def human_text(report: dict[str, Any], url: str) -> str:
    lines = [f"tool-call smoke: {url}  model {report['model']}  repeats {report['repeat']}", ""]
    width = max((len(r["case"]) for r in report["cases"]), default=0)
    for r in report["cases"]:
        runs = f"{r['passed']}/{r['repeats']}" if r["repeats"] else "-"
        lines.append(f"  {r['case']:<{width}}  {r['status']:<5}  {runs:>5}  {r['reason']}".rstrip())
    stats = report["stats"]

    def pct(value):
        return "n/a" if value is None else f"{value:.0%}"

    lines += ["", f"trigger F1 {pct(stats['trigger_f1'])} (precision {pct(stats['trigger_precision'])}, "
                  f"recall {pct(stats['trigger_recall'])}), schema accuracy {pct(stats['schema_accuracy'])} "
                  f"over {stats['answers_with_calls']} answers with calls"]
    base = report.get("baseline")
    if base:
        lines.append(f"against baseline {base['file']}: regressions: {', '.join(base['regressions']) or 'none'}; "
                     f"failing on both (model limitation): {', '.join(base['model_limitations']) or 'none'}")
    lines.append(f"verdict: {report['verdict']}" + (f" ({len(report['reasons'])} reason(s))" if report["reasons"] else ""))
    case_ids = {r["case"] for r in report["cases"]}
    lines += [f"  {reason}" for reason in report["reasons"] if reason.split(":")[0] not in case_ids]
    return "\n".join(lines)


def build_parser():
    p = cli.parser(__doc__)
    cli.add_server_args(p)
    p.add_argument("--model", default="", help="served model name (else $INFER_MODEL, else the first of /v1/models)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each case at temperature 0")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all but --long ones)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="max_tokens per answer (raise it for thinking models, e.g. 4096)")
    p.add_argument("--no-parallel", action="store_true", help="skip the parallel case (Llama 3.x per the vLLM docs)")
    p.add_argument("--long", action="store_true", help="also run the long-context case")
    p.add_argument("--long-words", type=int, default=3000, help="words of filler before the long-context case")
    p.add_argument("--baseline", default="", help="a saved --json run to compare with: names the regressions")
    printing.add_output_args(p)
    return p


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # Settings are read here, inside run_main: a bad URL or inference.env line is one line, exit 2.
        url, api_key = conf.server_settings(args)
        if args.repeat < 1 or args.max_tokens < 1:
            raise UsageError("--repeat and --max-tokens must be at least 1")
        catalog = catalogs.load_catalog("toolcall_cases")
        case_ids = toolcalls.select_cases(catalog, args.cases, args.long)
        baseline = toolcalls.load_baseline(args.baseline) if args.baseline else None
        wanted = conf.settings_from_args(args).get("INFER_MODEL", args.model)
        with http_client.client(url, api_key, args.timeout) as http:
            model = model_listing.served_model(http, wanted)["id"]
            report = toolcalls.run_smoke(http, model, case_ids, args.repeat, args.max_tokens, args.no_parallel,
                               args.long_words, catalog)
        report["url"] = url
        if baseline is not None:
            report["baseline"] = {"file": args.baseline, **toolcalls.compare_baseline(report["cases"], baseline)}
        report["verdict"], report["reasons"] = toolcalls.verdict(report)
        printed = printing.emit(report, human_text(report, url), args.output)
        if report["interrupted"]:
            return printed or EXIT_INTERRUPTED
        return printed or (EXIT_CHECK_FAILED if report["verdict"] == toolcalls.FAIL else EXIT_OK)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
