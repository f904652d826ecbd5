#!/usr/bin/env python3
"""Quantization acceptance in one command: perplexity change, tool-call smoke and a short bench.

BASE is the deployment you trust (say BF16) and CANDIDATE the one to accept (say FP8); each is a
server URL or a serve profile (roofline-toolbox/profiles/), which is started on a free local port,
measured and stopped, one after the other (so both fit on one GPU). On each side: perplexity on
TEXT through the API (ppl.py, the same windows on both), the tool-call smoke (smoke_toolcall.py)
and a short load test (bench.py --json, run as a subprocess). Then one verdict with its reasons:
  FAIL  the perplexity rise is above the scheme's fail level, or the candidate fails the smoke
        ("a quantized model that fails smoke does not go to production"; cases failing on the
        base too are named as model limitations);
  WARN  the rise is between the warn and fail levels, smoke warnings, or the candidate is more
        than 5% slower (output tok/s);
  PASS  otherwise.
The perplexity levels follow the candidate's quantization, read from what it serves: a profile's
--quantization, else the quantization_config of the config.json behind the candidate's /v1/models
`root` (a Hugging Face id, or a path this machine can read), else its name; awq, gptq and
compressed-tensors int4 (W4A16) take the 4bit levels, fp8 takes fp8's; unknown or unquantized
takes fp8's, the strictest. The report says which levels it used and why; --scheme overrides.
--cases-dir DIR (TOOLCALL_CASES) adds the user's own tool-call cases to the smoke: every *.yaml in DIR, in
the format of scripts/rooflib/catalog/toolcall_cases.yaml (their `cases:`, and `tools:` they need).
The report is a log entry in the bench-protocol format (headed Markdown, rendered with jinja2
from scripts/rooflib/render/templates/accept_log_entry.md.j2); --log FILE appends it (else $BENCH_LOG).

Examples:
  accept.py --base http://127.0.0.1:8000 --candidate http://127.0.0.1:8001 --text my_traffic.txt
  accept.py --base http://127.0.0.1:8000 --candidate qwen3-32b-fp8-h100 --scheme fp8 --log bench-log.md
  accept.py --base URL --candidate URL --scheme 4bit --bench-n 64 --bench-c 16 --json
  accept.py --base URL --candidate URL --cases-dir my_agent_cases/
  task infer:accept BASE=http://127.0.0.1:8000 CANDIDATE=http://127.0.0.1:8001 TEXT=my.txt

Exit codes: 0 PASS or WARN, 1 FAIL, 2 usage error (no BASE/CANDIDATE, bad text, a server without
logprobs), 3 a server unreachable or failing, 5 the report is printed but --log could not be written,
130 interrupted by Ctrl-C or SIGTERM (what was measured is still reported).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import catalogs, cli, conf, fileio, printing
from rooflib.core.errors import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_SERVER,
    ServerError,
    UsageError,
)
from rooflib.quality import perplexity, toolcalls
from rooflib.quality.acceptance import (
    TEMPLATE,
    bench_args,
    deployment,
    infer_scheme,
    is_url,
    judge,
    measure_side,
    result_rows,
    summary,
)
from rooflib.serving import profiles

# ---------------------------------------------------------------- command line

def build_parser():
    p = cli.parser(__doc__)
    p.add_argument("--base", default="", help="the trusted deployment: URL or serve profile (else $BASE)")
    p.add_argument("--candidate", default="", help="the deployment to accept: URL or serve profile (else $CANDIDATE)")
    p.add_argument("--text", default="", help=f"UTF-8 text to score (else $TEXT, else the bundled {perplexity.SAMPLE_TEXT.name})")
    p.add_argument("--base-model", default="", help="served model name on BASE (else the first listed)")
    p.add_argument("--candidate-model", default="", help="served model name on CANDIDATE (else the first listed)")
    p.add_argument("--scheme", default="", help="perplexity levels: fp8, int8, 4bit (default: from the candidate's "
                                                "quantization, see above)")
    p.add_argument("--cases-dir", default="", help="a folder of your own tool-call cases (*.yaml, the format of "
                                                   "scripts/rooflib/catalog/toolcall_cases.yaml) run in the smoke (else $TOOLCALL_CASES)")
    p.add_argument("--warn-pct", type=float, default=None, help="override the scheme's warn level (%%)")
    p.add_argument("--fail-pct", type=float, default=None, help="override the scheme's fail level (%%)")
    p.add_argument("--api", choices=perplexity.APIS, default="vllm", help="how ppl asks for prompt logprobs")
    p.add_argument("--window", type=int, default=None, help="ppl window (unset: as ppl.py decides from the base server)")
    p.add_argument("--stride", type=int, default=None, help="ppl stride (unset: a quarter of the window)")
    p.add_argument("--repeat", type=int, default=3, help="smoke repeats per case")
    p.add_argument("--max-tokens", type=int, default=512, help="smoke max_tokens per answer")
    p.add_argument("--bench-n", type=int, default=32, help="bench requests per side")
    p.add_argument("--bench-c", type=int, default=8, help="bench concurrency")
    p.add_argument("--bench-in", type=int, default=1024, help="bench prompt tokens")
    p.add_argument("--bench-out", type=int, default=128, help="bench output tokens")
    p.add_argument("--skip-smoke", action="store_true", help="no tool-call smoke (a model that does not call tools)")
    p.add_argument("--skip-bench", action="store_true", help="no bench")
    p.add_argument("--log", default="", help="append the entry to this Markdown file (else $BENCH_LOG)")
    p.add_argument("--start-timeout", type=cli.timeout_arg, default=900.0, help="seconds to wait for a profile's server")
    p.add_argument("--env-file", default=None, help="settings file (default: ./inference.env)")
    p.add_argument("--timeout", type=cli.timeout_arg, default=120.0, help="seconds to wait per request")
    printing.add_output_args(p)
    return p


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    # Settings are read here, inside run_main: a bad inference.env is one line, exit 2.
    settings = conf.settings_from_args(args)
    api_key = conf.api_key(settings)
    log = settings.get("BENCH_LOG", args.log)
    if log:
        fileio.check_writable(log, "--log (BENCH_LOG)")
    sources = read_sources(args, settings)
    levels = perplexity.gate(args.scheme or "fp8", args.warn_pct, args.fail_pct)  # bad levels fail before any run
    catalog = catalogs.load_catalog("toolcall_cases")
    cases_dir = settings.get("TOOLCALL_CASES", args.cases_dir)
    toolcall_catalog = toolcalls.with_user_cases(catalog, cases_dir) if cases_dir else (catalog, [])
    path, text = perplexity.resolve_text(args)
    read_profiles(sources)
    sides = {role: {"role": role, "source": source, "url": None, "model": None,
                    "wanted_model": getattr(args, f"{role}_model") or None}
             for role, source in sources.items()}
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    interrupted, failure = measure_sides(sides, args, api_key, text, toolcall_catalog)
    base, cand = sides["base"], sides["candidate"]
    levels, scheme_used = levels_used(args, levels, cand)
    printing.progress(f"accept: {levels['name']} levels, {scheme_used['why']}")
    ppl_result, verdict, reasons, notes = judged(base, cand, levels, scheme_used, interrupted, failure)
    user_cases = toolcall_catalog[1]
    if user_cases:
        notes.append(f"your tool-call cases from {cases_dir}: {', '.join(user_cases)}")
    result = {
        "kind": "accept", "schema_version": 1,
        "started_at": started, "verdict": verdict, "reasons": reasons, "notes": notes,
        "interrupted": interrupted, "ppl_change": ppl_result, "scheme": scheme_used,
        "config": {"text": path, "text_bytes": len(text.encode("utf-8")), "api": args.api, "levels": levels,
                   "window": (base.get("ppl") or {}).get("window"), "stride": (base.get("ppl") or {}).get("stride"),
                   "smoke_repeat": args.repeat, "skip_smoke": args.skip_smoke, "skip_bench": args.skip_bench,
                   "cases_dir": cases_dir or None, "user_cases": user_cases,
                   "bench_args": bench_args(args)},
        "base": summary(base), "candidate": summary(cand),
    }
    result["rows"] = result_rows(base, cand, ppl_result)
    return print_and_log(result, log, args.output, failure)


def read_sources(args: argparse.Namespace, settings: conf.Settings) -> dict[str, str]:
    """BASE and CANDIDATE: each a URL or a serve profile."""
    sources = {role: settings.get(role.upper(), getattr(args, role)) for role in ("base", "candidate")}
    missing = [role.upper() for role, source in sources.items() if not source]
    if missing:
        raise UsageError(f"{' and '.join(missing)} not given: pass BASE=<url|profile> CANDIDATE=<url|profile>")
    return sources


def read_profiles(sources: dict[str, str]) -> None:
    """A profile is read now: a missing one fails before the base is measured, and the keys it
    carries are registered (a failed start quotes the engine's log)."""
    for source in sources.values():
        if not is_url(source):
            profiles.load_profile(profiles.find_profile(source))


def measure_sides(sides: dict[str, dict[str, Any]], args: argparse.Namespace, api_key: str | None, text: str,
                  toolcall_catalog: tuple[dict[str, Any], list[str]]) -> tuple[bool, str | None]:
    """Measure the base, then the candidate, each deployed for its turn: (interrupted, the server
    failure that stopped them, if one did)."""
    window, stride = args.window, args.stride
    with tempfile.TemporaryDirectory(prefix="roofline-accept-") as log_dir:
        try:
            for side in sides.values():
                with deployment(side["source"], Path(log_dir), args.start_timeout) as url:
                    measure_side(side, url, api_key, args, text, window, stride, toolcall_catalog)
                # The candidate is scored with the base's windows, so the two pair token by token.
                window, stride = side["ppl"]["window"], side["ppl"]["stride"]
        except KeyboardInterrupt:
            return True, None
        except ServerError as exc:  # a server down or crashing: report what was measured
            return False, f"{side['role']} ({side['source']}): {exc}"
    return False, None


def levels_used(args: argparse.Namespace, levels: dict[str, Any],
                cand: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The perplexity levels to judge by, and which scheme they are and why: --scheme's, else
    the candidate's quantization's."""
    if args.scheme:
        return levels, {"scheme": levels["scheme"], "inferred": False, "why": "given (--scheme)"}
    inferred, why = infer_scheme(cand)
    levels = perplexity.gate(inferred, args.warn_pct, args.fail_pct)
    return levels, {"scheme": levels["scheme"], "inferred": True, "why": why}


def judged(base: dict[str, Any], cand: dict[str, Any], levels: dict[str, Any], scheme_used: dict[str, Any],
           interrupted: bool, failure: str | None) -> tuple[dict[str, Any] | None, str, list[str], list[str]]:
    """The perplexity change, the verdict, its reasons and the notes (the levels used first)."""
    ppl_result = None
    if base.get("ppl") and cand.get("ppl"):
        ppl_result = perplexity.compare(base["ppl"], cand["ppl"], levels, 64)
    verdict, reasons, notes = judge(base, cand, ppl_result, interrupted)
    notes.insert(0, f"perplexity levels: {levels['name']} (warn +{levels['warn_pct']}%, fail +{levels['fail_pct']}%)"
                    f"{': inferred, ' if scheme_used['inferred'] else ', '}{scheme_used['why']}")
    if failure:
        verdict, reasons = "FAIL", [f"server failed: {failure}"] + reasons
    return ppl_result, verdict, reasons, notes


def print_and_log(result: dict[str, Any], log: str | None, output: printing.Output, failure: str | None) -> int:
    """Print the log entry (or the JSON document), append it to the log: the exit code."""
    entry = printing.render_log_entry(result, TEMPLATE)
    # The result is printed first: a log that cannot be written then loses nothing.
    printed = printing.emit(result | {"log_entry": entry}, entry, output)
    if log:
        if fileio.write_outputs([("--log", log, fileio.log_with_entry(log, entry))]):
            return EXIT_OUTPUT
        printing.progress(f"accept: log entry appended to {log}")
    if printed:
        return printed
    if result["interrupted"]:
        return EXIT_INTERRUPTED
    if failure:
        return EXIT_SERVER
    return EXIT_CHECK_FAILED if result["verdict"] == "FAIL" else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
