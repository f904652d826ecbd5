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
the format of scripts/catalog/toolcall_cases.yaml (their `cases:`, and `tools:` they need).
The report is a log entry in the bench-protocol format (headed Markdown, rendered with jinja2
from scripts/templates/accept_log_entry.md.j2); --log FILE appends it (else $BENCH_LOG).

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

import datetime
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import perplexity  # noqa: E402
import profiles  # noqa: E402
import served  # noqa: E402
import sizing  # noqa: E402
import toolcalls  # noqa: E402
from common import ServerError, UsageError  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
TEMPLATE = SCRIPTS / "templates" / "accept_log_entry.md.j2"
# A short bench moves by a few % between identical runs (two runs of one model on a busy CPU:
# -13%); a slowdown beyond this is worth a warning, a quantized model should be faster.
SLOWER_WARN_PCT = 5.0
# Words in a served model's name that mark a 4-bit weight-only checkpoint, when no config is readable.
FOUR_BIT_NAME = r"(?i)(awq|gptq|int4|w4a16|4bit)"


# ---------------------------------------------------------------- deployments

def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


@contextmanager
def deployment(source: str, log_dir: Path, start_timeout_s: float) -> Iterator[str]:
    """A URL as it is, or a profile served by serve.py on a free port for the duration."""
    if is_url(source):
        yield common.normalize_url(source)
        return
    port = profiles.free_port()
    log_path = log_dir / f"serve-{port}.log"
    common.progress(f"starting profile {source} on port {port} (log {log_path})")
    url = f"http://127.0.0.1:{port}"
    with profiles.running([sys.executable, str(SCRIPTS / "serve.py"), "--profile", source, "--port", str(port)],
                       url, log_path, start_timeout_s):
        yield url


# ---------------------------------------------------------------- measurements

def bench_args(args) -> list[str]:
    return ["-n", str(args.bench_n), "-c", str(args.bench_c), "--input-tokens", str(args.bench_in),
            "--output-tokens", str(args.bench_out)]


def run_bench(url: str, model: str, api_key: str | None, extra: list[str]) -> tuple[dict | None, str | None]:
    """bench.py --json as a subprocess: (result, None), or (None, why it gave none)."""
    cmd = [sys.executable, str(SCRIPTS / "bench.py"), "--url", url, "--model", model, *extra, "--json"]
    env = {**os.environ, **({"ROOFLINE_TASK_API_KEY": api_key} if api_key else {})}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        return common.parse_json(done.stdout), None
    except ValueError:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return None, f"bench gave no result ({common.redact(last, api_key)})"


def measure_side(side: dict[str, Any], url: str, api_key: str | None, args, text: str,
                 window: int | None, stride: int | None, toolcall_catalog: tuple[dict[str, Any], list[str]]) -> None:
    """Fill in one side's perplexity, smoke and bench, in that order (Ctrl-C keeps what is done);
    `toolcall_catalog` is the smoke's catalog with the user's cases and their names."""
    side["url"] = url
    with common.client(url, api_key, args.timeout) as http:
        entry = common.served_model(http, side["wanted_model"])
        model, max_model_len = entry["id"], common.max_model_len(entry, url)
        side["model"], side["root"] = model, entry.get("root") or model
        common.progress(f"{side['role']}: perplexity on {url} ({model})")
        side["ppl"] = perplexity.measure(http, args.api, model, text, window, stride, max_model_len)
        if side["ppl"]["stopped"] == "interrupted":
            raise KeyboardInterrupt
        if side["ppl"]["stopped"]:
            raise ServerError(f"perplexity stopped: {side['ppl']['stopped']}")
        if not args.skip_smoke:
            common.progress(f"{side['role']}: tool-call smoke")
            catalog, user_cases = toolcall_catalog
            try:
                cases = toolcalls.select_cases(catalog, "", False)
                cases += [name for name in user_cases if name not in cases]
                report = toolcalls.run_smoke(http, model, cases, args.repeat, args.max_tokens, False, 0, catalog)
                report["user_cases"] = user_cases
                report["verdict"], report["reasons"] = toolcalls.verdict(report)
                side["smoke"] = report
                if report["interrupted"]:
                    raise KeyboardInterrupt
            except toolcalls.ConfigError as exc:
                side["smoke_error"] = str(exc)
    if not args.skip_bench:
        common.progress(f"{side['role']}: bench {' '.join(bench_args(args))}")
        side["bench"], side["bench_error"] = run_bench(url, model, api_key, bench_args(args))


def infer_scheme(cand: dict[str, Any]) -> tuple[str, str]:
    """(scheme, why) from what the candidate serves: a profile's --quantization, the config.json
    behind its /v1/models root, or its name; fp8's levels, the strictest, when none says."""
    if not is_url(cand["source"]):
        try:
            profile = profiles.load_profile(profiles.find_profile(cand["source"]))
        except UsageError:
            profile = {}
        quant = served.quant_of_profile(profile)
        if quant:
            return (served.scheme_of(quant) or "fp8",
                    f"the profile {cand['source']} serves it with --quantization {profile['quantization']}")
    why = "the candidate was not reached"
    if cand.get("root"):
        config, where = served.root_config(cand["root"])
        if config is not None:
            quant = sizing.checkpoint_quant(config)
            method = (config.get("quantization_config") or {}).get("quant_method")
            if served.scheme_of(quant):
                return served.scheme_of(quant), f"its config.json ({where}) declares {method} weights ({quant})"
            return "fp8", f"its config.json ({where}) declares no quantization ({quant}): fp8's levels, the strictest"
        why = where
        name = f"{cand['model']} {cand['root']}"
        if re.search(FOUR_BIT_NAME, name):
            return "4bit", f"its name {cand['model']!r} says 4-bit and no config.json is readable here ({why})"
    return "fp8", (f"its quantization is unknown ({why}): fp8's levels, the strictest; pass --scheme 4bit "
                   "for an AWQ/GPTQ candidate")


# ---------------------------------------------------------------- verdict and report

def pct_change(base: float | None, cand: float | None) -> float | None:
    return (cand / base - 1) * 100 if base and cand is not None else None


def judge(base: dict[str, Any], cand: dict[str, Any], ppl_result: dict[str, Any] | None,
          interrupted: bool) -> tuple[str, list[str], list[str]]:
    """(verdict, reasons, notes) from both sides' measurements."""
    fails, warns, notes = [], [], []
    if ppl_result is None:
        fails.append("perplexity not compared (not measured on both sides)")
    else:
        text = f"perplexity {ppl_result['change_pct']:+.2f}%"
        if ppl_result["ci95_pct"]:
            text += f" (95% CI up to {ppl_result['ci95_pct'][1]:+.2f}%)"
        levels = ppl_result["levels"]
        if ppl_result["verdict"] == "FAIL":
            fails.append(f"{text}: above the {levels['name']} fail level +{levels['fail_pct']}%")
        elif ppl_result["verdict"] == "WARN":
            warns.append(f"{text}: above the {levels['name']} warn level +{levels['warn_pct']}%")
        if ppl_result["ci95_pct"] is None:
            notes.append("the two servers tokenize the text differently: compared by bytes, without an interval")
    if cand.get("smoke_error"):
        fails.append(f"candidate smoke could not run: {cand['smoke_error']}")
    elif cand.get("smoke"):
        failing = [c["case"] for c in cand["smoke"]["cases"] if c["status"] in ("FAIL", "ERROR")]
        if base.get("smoke"):
            split = toolcalls.compare_baseline(cand["smoke"]["cases"], base["smoke"])
            if split["regressions"]:
                fails.append("tool-call smoke regressions (pass on base, fail on candidate): "
                             + ", ".join(split["regressions"]))
            if split["model_limitations"]:
                fails.append("tool-call smoke fails on both (model limitation, not quantization damage): "
                             + ", ".join(split["model_limitations"]))
        elif failing:
            fails.append("tool-call smoke fails on the candidate: " + ", ".join(failing))
        if cand["smoke"]["verdict"] == "FAIL" and not failing:
            fails += [f"tool-call smoke: {reason}" for reason in cand["smoke"]["reasons"]]
        if cand["smoke"]["verdict"] == "WARN":
            warns.append("tool-call smoke warnings on the candidate")
    if base.get("smoke_error"):
        notes.append(f"base smoke could not run: {base['smoke_error']}")
    for side in (base, cand):
        if side.get("bench_error"):
            notes.append(f"{side['role']}: {side['bench_error']}")
    speed = pct_change(throughput(base), throughput(cand))
    if speed is not None and speed < -SLOWER_WARN_PCT:
        warns.append(f"the candidate is slower: output tok/s {speed:+.1f}%")
    if interrupted:
        fails.append("interrupted: partial results")
    verdict = "FAIL" if fails else "WARN" if warns else "PASS"
    return verdict, fails + warns, notes


def throughput(side: dict[str, Any]) -> float | None:
    return ((side.get("bench") or {}).get("throughput") or {}).get("output_tok_s")


def p95(side: dict[str, Any], key: str) -> float | None:
    return ((side.get("bench") or {}).get(key) or {}).get("p95")


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def smoke_cell(side: dict[str, Any]) -> str:
    if side.get("smoke_error"):
        return "config error"
    report = side.get("smoke")
    if not report:
        return "-"
    passed = sum(c["status"] in ("PASS", "WARN") for c in report["cases"])
    return f"{report['verdict']} ({passed}/{len(report['cases'])} cases)"


def result_rows(base: dict[str, Any], cand: dict[str, Any], ppl_result: dict[str, Any] | None) -> list[dict[str, str]]:
    def signed(value: float | None) -> str:
        return "-" if value is None else f"{value:+.2f}%"

    b_ppl, c_ppl = base.get("ppl") or {}, cand.get("ppl") or {}
    change = "-"
    if ppl_result:
        change = signed(ppl_result["change_pct"])
        if ppl_result["ci95_pct"]:
            change += f" (95% CI {ppl_result['ci95_pct'][0]:+.2f}% .. {ppl_result['ci95_pct'][1]:+.2f}%)"
    rows = [
        {"measure": "perplexity", "base": fmt(b_ppl.get("ppl"), 4), "candidate": fmt(c_ppl.get("ppl"), 4), "change": change},
        {"measure": "bits per byte", "base": fmt(b_ppl.get("bits_per_byte"), 4),
         "candidate": fmt(c_ppl.get("bits_per_byte"), 4),
         "change": signed(pct_change(b_ppl.get("bits_per_byte"), c_ppl.get("bits_per_byte")))},
        {"measure": "scored tokens (ids sha256)",
         "base": f"{fmt(b_ppl.get('scored_tokens'))} ({(b_ppl.get('token_ids_sha256') or '-')[:12]})",
         "candidate": f"{fmt(c_ppl.get('scored_tokens'))} ({(c_ppl.get('token_ids_sha256') or '-')[:12]})",
         "change": "same tokens" if b_ppl.get("token_ids_sha256") == c_ppl.get("token_ids_sha256") else "differ"},
        {"measure": "tool-call smoke", "base": smoke_cell(base), "candidate": smoke_cell(cand), "change": "-"},
        {"measure": "output tok/s", "base": fmt(throughput(base), 1), "candidate": fmt(throughput(cand), 1),
         "change": signed(pct_change(throughput(base), throughput(cand)))},
    ]
    for key, label in (("ttft_ms", "TTFT p95 (ms)"), ("tpot_ms", "TPOT p95 (ms)")):
        rows.append({"measure": label, "base": fmt(p95(base, key)), "candidate": fmt(p95(cand, key)),
                     "change": signed(pct_change(p95(base, key), p95(cand, key)))})
    return rows


# ---------------------------------------------------------------- command line

def build_parser():
    p = common.parser(__doc__)
    p.add_argument("--base", default="", help="the trusted deployment: URL or serve profile (else $BASE)")
    p.add_argument("--candidate", default="", help="the deployment to accept: URL or serve profile (else $CANDIDATE)")
    p.add_argument("--text", default="", help=f"UTF-8 text to score (else $TEXT, else the bundled {perplexity.SAMPLE_TEXT.name})")
    p.add_argument("--base-model", default="", help="served model name on BASE (else the first listed)")
    p.add_argument("--candidate-model", default="", help="served model name on CANDIDATE (else the first listed)")
    p.add_argument("--scheme", default="", help="perplexity levels: fp8, int8, 4bit (default: from the candidate's "
                                                "quantization, see above)")
    p.add_argument("--cases-dir", default="", help="a folder of your own tool-call cases (*.yaml, the format of "
                                                   "scripts/catalog/toolcall_cases.yaml) run in the smoke (else $TOOLCALL_CASES)")
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
    p.add_argument("--start-timeout", type=common.timeout_arg, default=900.0, help="seconds to wait for a profile's server")
    p.add_argument("--env-file", default=None, help="settings file (default: ./inference.env)")
    p.add_argument("--timeout", type=common.timeout_arg, default=120.0, help="seconds to wait per request")
    common.add_output_args(p)
    return p


@common.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # Settings are read here, inside run_main: a bad inference.env is one line, exit 2.
        settings = common.settings_from_args(args)
        api_key = common.api_key(settings)
        log = settings.get("BENCH_LOG", args.log)
        if log:
            common.check_writable(log, "--log (BENCH_LOG)")
        sources = {role: settings.get(role.upper(), getattr(args, role)) for role in ("base", "candidate")}
        missing = [role.upper() for role, source in sources.items() if not source]
        if missing:
            raise UsageError(f"{' and '.join(missing)} not given: pass BASE=<url|profile> CANDIDATE=<url|profile>")
        scheme = args.scheme
        levels = perplexity.gate(scheme or "fp8", args.warn_pct, args.fail_pct)  # bad levels fail before any run
        catalog = common.load_catalog("toolcall_cases")
        cases_dir = settings.get("TOOLCALL_CASES", args.cases_dir)
        toolcall_catalog = toolcalls.with_user_cases(catalog, cases_dir) if cases_dir else (catalog, [])
        path, text = perplexity.resolve_text(args)
        for source in sources.values():
            # A profile is read now: a missing one fails before the base is measured, and the
            # keys it carries are registered (a failed start quotes the engine's log).
            if not is_url(source):
                profiles.load_profile(profiles.find_profile(source))
        sides = {role: {"role": role, "source": source, "url": None, "model": None,
                        "wanted_model": getattr(args, f"{role}_model") or None}
                 for role, source in sources.items()}
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        interrupted, failure = False, None
        window, stride = args.window, args.stride
        with tempfile.TemporaryDirectory(prefix="roofline-accept-") as log_dir:
            try:
                for side in sides.values():
                    with deployment(side["source"], Path(log_dir), args.start_timeout) as url:
                        measure_side(side, url, api_key, args, text, window, stride, toolcall_catalog)
                    # The candidate is scored with the base's windows, so the two pair token by token.
                    window, stride = side["ppl"]["window"], side["ppl"]["stride"]
            except KeyboardInterrupt:
                interrupted = True
            except ServerError as exc:  # a server down or crashing: report what was measured
                failure = f"{side['role']} ({side['source']}): {exc}"
        base, cand = sides["base"], sides["candidate"]
        if scheme:
            scheme_used = {"scheme": levels["scheme"], "inferred": False, "why": "given (--scheme)"}
        else:
            inferred, why = infer_scheme(cand)
            levels = perplexity.gate(inferred, args.warn_pct, args.fail_pct)
            scheme_used = {"scheme": levels["scheme"], "inferred": True, "why": why}
        common.progress(f"accept: {levels['name']} levels, {scheme_used['why']}")
        ppl_result = None
        if base.get("ppl") and cand.get("ppl"):
            ppl_result = perplexity.compare(base["ppl"], cand["ppl"], levels, 64)
        verdict, reasons, notes = judge(base, cand, ppl_result, interrupted)
        notes.insert(0, f"perplexity levels: {levels['name']} (warn +{levels['warn_pct']}%, fail +{levels['fail_pct']}%)"
                        f"{': inferred, ' if scheme_used['inferred'] else ', '}{scheme_used['why']}")
        user_cases = toolcall_catalog[1]
        if user_cases:
            notes.append(f"your tool-call cases from {cases_dir}: {', '.join(user_cases)}")
        if failure:
            verdict, reasons = "FAIL", [f"server failed: {failure}"] + reasons
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
        entry = common.render_log_entry(result, TEMPLATE)
        # The result is printed first: a log that cannot be written then loses nothing.
        printed = common.emit(result | {"log_entry": entry}, entry, args.output)
        if log:
            if common.write_outputs([("--log", log, common.log_with_entry(log, entry))]):
                return common.EXIT_OUTPUT
            common.progress(f"accept: log entry appended to {log}")
        if printed:
            return printed
        if interrupted:
            return common.EXIT_INTERRUPTED
        if failure:
            return common.EXIT_SERVER
        return common.EXIT_CHECK_FAILED if verdict == "FAIL" else common.EXIT_OK

    return common.run_main(body)


def summary(side: dict[str, Any]) -> dict[str, Any]:
    """A side for the JSON document: the per-token values and smoke transcripts left out."""
    run = {k: v for k, v in (side.get("ppl") or {}).items() if k not in ("token_nll", "windows")}
    smoke = side.get("smoke")
    if smoke:
        smoke = {**smoke, "cases": [{k: v for k, v in c.items() if k != "runs"} for c in smoke["cases"]]}
    bench = {k: v for k, v in (side.get("bench") or {}).items() if k != "records"} or None
    return {"source": side["source"], "url": side["url"], "model": side["model"], "ppl": run or None,
            "smoke": smoke, "smoke_error": side.get("smoke_error"), "bench": bench,
            "bench_error": side.get("bench_error")}


if __name__ == "__main__":
    sys.exit(main())
