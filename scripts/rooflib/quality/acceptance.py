"""Accepting a candidate deployment (a quantization) against a base: speed, perplexity, tool calls."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rooflib.core import conf, fileio, http_client, printing, redaction
from rooflib.core.errors import ServerError, UsageError
from rooflib.quality import perplexity, toolcalls
from rooflib.server import model_listing, served
from rooflib.serving import profiles
from rooflib.sizing import model_shape

SCRIPTS = Path(__file__).resolve().parents[2]  # the command lines accept runs: serve.py and bench.py
TEMPLATE = Path(__file__).resolve().parents[1] / "render" / "templates" / "accept_log_entry.md.j2"
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
        yield conf.normalize_url(source)
        return
    port = profiles.free_port()
    log_path = log_dir / f"serve-{port}.log"
    printing.progress(f"starting profile {source} on port {port} (log {log_path})")
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
        return fileio.parse_json(done.stdout), None
    except ValueError:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return None, f"bench gave no result ({redaction.redact(last, api_key)})"


def measure_side(side: dict[str, Any], url: str, api_key: str | None, args, text: str,
                 window: int | None, stride: int | None, toolcall_catalog: tuple[dict[str, Any], list[str]]) -> None:
    """Fill in one side's perplexity, smoke and bench, in that order (Ctrl-C keeps what is done);
    `toolcall_catalog` is the smoke's catalog with the user's cases and their names."""
    side["url"] = url
    with http_client.client(url, api_key, args.timeout) as http:
        entry = model_listing.served_model(http, side["wanted_model"])
        model, max_model_len = entry["id"], model_listing.max_model_len(entry, url)
        side["model"], side["root"] = model, entry.get("root") or model
        printing.progress(f"{side['role']}: perplexity on {url} ({model})")
        side["ppl"] = perplexity.measure(http, args.api, model, text, window, stride, max_model_len)
        if side["ppl"]["stopped"] == "interrupted":
            raise KeyboardInterrupt
        if side["ppl"]["stopped"]:
            raise ServerError(f"perplexity stopped: {side['ppl']['stopped']}")
        if not args.skip_smoke:
            printing.progress(f"{side['role']}: tool-call smoke")
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
        printing.progress(f"{side['role']}: bench {' '.join(bench_args(args))}")
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
            quant = model_shape.checkpoint_quant(config)
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
