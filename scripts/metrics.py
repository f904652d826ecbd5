#!/usr/bin/env python3
"""Read a vLLM or SGLang server's Prometheus metrics and name the root cause of what is slow.

Reads /metrics from one or more servers (--url, auto-detects vLLM or SGLang), from saved
scrapes (--file), or asks a Prometheus server for a whole fleet (--prometheus). Reports TTFT,
ITL, TPOT, e2e, queue, prefill and decode time (p50/p95/p99, as Prometheus' histogram_quantile
computes them), running and waiting requests, KV-cache usage, preemptions, prefix-cache hit
rate, prompt and generation tok/s, MFU and bandwidth utilisation (vLLM with
--enable-mfu-metrics and --gpu), then one diagnosis: the root cause first (its setting and the
setting's current value), what it causes indented under it (a full KV cache -> preemptions ->
queue; the running-requests cap -> queue; prefix caching off or unhit -> prefill -> token
stalls), the other findings, then one plan of levers ("setting: current -> proposed (current:
exported | inferred | unknown)", each with its reason and expected effect, never one for what is
already set, never "raise" and "lower" of one setting) and the commands that verify it: the same
`task infer:bench` before and after the change, at the traffic's lengths, endpoint and
concurrency, and the `task infer:compare` that judges them. No finding means no bottleneck seen.

Since server start (one scrape) the quantiles mix all history since the engine started; over a
window (--window 30: two scrapes, gauges sampled each second) they cover only the requests that
finished in it. Latency findings are judged against targets: --slo-ttft-p95-ms / --slo-tpot-p95-ms
(or SLO_TTFT_P95_MS / SLO_TPOT_P95_MS, as for task bench); a target not given takes the starting
default for interactive chat (TTFT p95 2 s on a long prompt, TPOT p95 50 ms), and the report says
so (JSON slo_source: given, default or partly default). ITL p95 is judged against its own target,
--slo-itl-p95-ms (SLO_ITL_P95_MS), twice the TPOT target unless given. The deployment's settings
come from vllm:cache_config_info (KV-cache tokens and blocks, kv_cache_memory_bytes,
gpu_memory_utilization, prefix caching, block size), sglang:max_running_requests and, with --url,
from the server itself: /v1/models (max_model_len), vLLM's /server_info (max_num_seqs,
max_num_batched_tokens; served only with VLLM_SERVER_DEV_MODE=1), SGLang's /get_server_info.
What none exports is inferred with its evidence (max_num_seqs from the running count while
requests waited and the KV cache had room; max_num_batched_tokens from the largest engine step)
or reported as unknown (JSON `settings`). Each finding states its confidence: gauges are samples
that can miss the peak, counters and histograms cannot. Prompt and output lengths are those of
the finished requests (vllm:request_prompt_tokens). A quantile is printed as the histogram bucket
it lies in (`10-20 s`), the most a classic histogram tells; in the first bucket only its bound
(`<=10 ms`: JSON leaves it null and gives the bound in `at_most`). SGLang support follows its
documented metric names (recorded formats, not a live server).

With --prometheus the window is a PromQL range (rate/increase, histogram_quantile over summed
buckets) for the fleet and `by (instance)` for each replica, and fleet findings come first:
replica_down, config_mismatch, imbalance, add_replica, prefix_split (scripts/fleet.py). A path
prefix goes in the URL (http://host/prometheus); basic auth comes from PROMETHEUS_USER and
PROMETHEUS_PASSWORD, never from a flag, and is never printed.

Examples:
  metrics.py --url http://127.0.0.1:8000
  metrics.py --url http://127.0.0.1:8000 --window 30 --json
  metrics.py --url http://10.0.0.1:8000 --url http://10.0.0.2:8000 --window 60
  metrics.py --file scrape.txt
  metrics.py --file before.txt --file after.txt --window 60
  metrics.py --url http://127.0.0.1:8000 --watch 10
  metrics.py --prometheus http://prometheus:9090 --window 300 --match 'model_name="qwen3-8b"'
  PROMETHEUS_USER=ops PROMETHEUS_PASSWORD=... metrics.py --prometheus https://mon.example/prometheus --json
  metrics.py --url http://127.0.0.1:8000 --gpu H100 --slo-ttft-p95-ms 500 --slo-tpot-p95-ms 50

Functions for other scripts live in engine_metrics.py (errors: common.ServerError, engine_metrics.InvalidScrape):
  scrape(url, api_key=None) -> (text, unix_time)   GET <url>/metrics
  parse_exposition(text) -> Exposition             Prometheus text format, any exporter
  snapshot(text, source="", at=None) -> dict       normalized vLLM/SGLang figures of one scrape
  window(before, after, during=(), gpu=None, slo=None) -> report   the interval between snapshots
  report(snap, gpu=None, slo=None) -> report       one snapshot (since server start)
  difference(before, after), merge(snapshots)      the interval / several replicas, as a snapshot
  histogram_quantile(q, buckets), quantile_bucket(q, buckets)   Prometheus' classic quantile
  prometheus_snapshot(url, seconds, match="", auth=fleet.Credentials())   the same figures from a
                                                   Prometheus server, fleet and `replicas`
  Targets(ttft_p95_ms, tpot_p95_ms, itl_p95_ms)    SLOs for the prefill and decode findings
  report(snap, served=deployment.server_settings(url, engine))   with what the server says of itself
A report is a JSON-ready dict: engine, ttft_ms, itl_ms, tpot_ms, e2e_ms, queue_ms, prefill_ms,
decode_ms (each p50, p95, p99, mean, n), running, waiting, kv_cache_usage, preemptions,
prefix_cache_hit_rate, prompt_tok_s, gen_tok_s, prompt_tokens_mean, output_tokens_mean, mfu,
bandwidth_util, deployment (the cache_config_info settings), settings (each setting's value,
source: exported/inferred/unknown, and how), slo, slo_source, diagnosis: {root_cause, findings
(each kind, evidence, confidence, caused_by, setting, current, current_source), plan (each
setting, current, current_source, proposed, reason, effect, text), verify (commands)}, warnings.
With --prometheus also: fleet (prometheus, window_s, replicas, up, down), replicas (each
replica's report plus instance, job, model, state, config), and fleet findings first in
diagnosis.findings (scope "fleet", cause, replicas, per_replica), their levers first in the plan.

Exit codes: 0 report printed (with or without findings), 2 usage error (bad flag, missing
file, unknown GPU, a --match Prometheus rejects as PromQL, series without the instance or
model_name label), 3 server or Prometheus unreachable or answering an HTTP error (401, 404),
4 the answer is not usable metrics (HTML page, empty or truncated scrape, neither vLLM nor
SGLang, no vllm: or sglang: series in Prometheus),
130 interrupted by Ctrl-C or SIGTERM (the window measured so far is still reported).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence


sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import deployment  # noqa: E402
import diagnosis  # noqa: E402
import fleet  # noqa: E402
from common import UsageError  # noqa: E402
import engine_metrics  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    # --help leaves out the docstring's section for other scripts (the Python API).
    p = common.parser(__doc__.split("Functions for other scripts")[0] + __doc__[__doc__.index("Exit codes"):])
    p.add_argument("--url", action="append", default=[],
                   help="server base URL or its /metrics URL; repeat (or comma-separate) for replicas "
                        f"(else $INFER_URL, {common.ENV_FILE_NAME}, {common.DEFAULT_URL}); "
                        "--file and --prometheus take precedence")
    p.add_argument("--file", action="append", default=[],
                   help="a saved scrape ('-' for stdin); give two (before, after) for a window")
    p.add_argument("--prometheus", default="", help="Prometheus base URL, with its path prefix if any: ask "
                                                    "it with PromQL for the fleet and each replica (else "
                                                    "$PROMETHEUS; basic auth from $PROMETHEUS_USER and "
                                                    "$PROMETHEUS_PASSWORD)")
    p.add_argument("--match", default="", help="PromQL label matchers for --prometheus, e.g. 'model_name=\"x\"'")
    p.add_argument("--window", default="", help="seconds between two scrapes (the interval of two files; "
                                                "the range for --prometheus, whole seconds, default 300)")
    p.add_argument("--watch", default="", help="refresh every N seconds until Ctrl-C (JSON: one line each)")
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes (0: never)")
    p.add_argument("--gpu", default="", help="GPU name from scripts/catalog/gpus.yaml, for MFU (else $GPU)")
    p.add_argument("--slo-ttft-p95-ms", default="", help="TTFT p95 target for the prefill finding "
                                                         "(else $SLO_TTFT_P95_MS)")
    p.add_argument("--slo-tpot-p95-ms", default="", help="TPOT p95 target for the decode finding "
                                                         "(else $SLO_TPOT_P95_MS)")
    p.add_argument("--slo-itl-p95-ms", default="", help="ITL p95 target for the decode finding "
                                                        "(else $SLO_ITL_P95_MS; default twice the TPOT target)")
    p.add_argument("--env-file", default=None,
                   help=f"settings file (default: ./{common.ENV_FILE_NAME}, or $INFER_ENV_FILE)")
    p.add_argument("--timeout", type=common.timeout_arg, default=30.0, help="seconds to wait for each answer")
    common.add_output_args(p)
    return p


@dataclass
class Options:
    urls: list[str]
    api_key: str | None
    files: list[str]
    prometheus: str
    prometheus_auth: fleet.Credentials
    match: str
    window: float | None
    watch: float | None
    count: int
    gpu: Mapping[str, Any] | None
    slo: engine_metrics.Targets
    timeout: float
    output: common.Output


def options(args: argparse.Namespace) -> Options:
    settings = common.settings_from_args(args)
    files = [f for f in args.file if f]
    prometheus = settings.get("PROMETHEUS", args.prometheus, "")
    given = ",".join(args.url)
    urls, api_key = [], None
    # INFER_URL is often set for every task: a file or Prometheus given explicitly wins over it.
    if not files and not prometheus:
        raw = settings.get("INFER_URL", given, common.DEFAULT_URL)
        for piece in re.split(r"[,\s]+", raw):
            if piece:
                url, api_key = common.server_settings(argparse.Namespace(url=piece, env_file=args.env_file))
                urls.append(url)
    if files and prometheus:
        raise UsageError("give --file or --prometheus, not both")
    if len(files) > 2:
        raise UsageError("give one --file (since start) or two (before and after), not more")
    if len(files) == 1 and args.window:
        raise UsageError("--window with --file needs two files, the scrapes before and after the window")
    gpu_name = settings.get("GPU", args.gpu, "")
    gpu = common.find_in_catalog(common.load_catalog("gpus"), gpu_name, "GPU")[1] if gpu_name else None
    watch = common.number("--watch", args.watch, float)
    if watch and (files or prometheus):
        raise UsageError("--watch reads live servers: use it with --url")
    return Options(
        urls=urls, api_key=api_key, files=files, prometheus=prometheus,
        prometheus_auth=fleet.credentials(settings) if prometheus else fleet.Credentials(), match=args.match,
        window=common.number("--window", args.window, float), watch=watch, count=max(0, args.count), gpu=gpu,
        slo=engine_metrics.Targets(common.number("SLO_TTFT_P95_MS", settings.get("SLO_TTFT_P95_MS", args.slo_ttft_p95_ms), float),
                    common.number("SLO_TPOT_P95_MS", settings.get("SLO_TPOT_P95_MS", args.slo_tpot_p95_ms), float),
                    common.number("SLO_ITL_P95_MS", settings.get("SLO_ITL_P95_MS", args.slo_itl_p95_ms), float)),
        timeout=args.timeout, output=args.output)


def scrape_all(opts: Options) -> list[dict[str, Any]]:
    snaps = []
    for url in opts.urls:
        text, at = engine_metrics.scrape(url, opts.api_key, opts.timeout)
        snaps.append(engine_metrics.snapshot(text, url, at))
    return snaps


def served_by(opts: Options, snaps: Sequence[dict[str, Any]]) -> list[deployment.Served]:
    """What each server says about its own settings (read once: settings do not change while it runs)."""
    return [deployment.server_settings(url, snap["engine"], opts.api_key, opts.timeout)
            for url, snap in zip(opts.urls, snaps)]


def window_reports(opts: Options, seconds: float, hold: common.SignalHold, before: list[dict[str, Any]] | None = None
                   ) -> tuple[list[dict[str, Any]], bool, list[dict[str, Any]]]:
    """Scrape (unless `before` is given), sample the gauges each second for `seconds`, scrape
    again; Ctrl-C ends early. From the end of the window a Ctrl-C or SIGTERM waits in `hold`
    (the caller keeps it until the report is out) and ends the window all the same. Returns the
    window of each replica, whether interrupted, and the last scrape (the next window's start)."""
    before = before or scrape_all(opts)
    during: list[list[dict[str, Any]]] = []
    interrupted = False
    deadline = time.monotonic() + seconds
    common.progress(f"measuring for {seconds:g} s (Ctrl-C ends early and still reports)...")
    try:
        while time.monotonic() < deadline - 1:
            time.sleep(1)
            during.append(scrape_all(opts))
        time.sleep(max(0.0, deadline - time.monotonic()))
        hold.start()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (common.run_main)
        interrupted = True
        hold.start()
    after = scrape_all(opts)
    replicas = [engine_metrics.difference(before[i], after[i], [d[i] for d in during]) for i in range(len(after))]
    return replicas, interrupted or bool(hold.noted), after


def results(opts: Options, replicas: list[dict[str, Any]], served: Sequence[deployment.Served] = ()
            ) -> tuple[dict[str, Any], str]:
    """The aggregated report (with per-replica reports when several) and its human text;
    `served` holds each live server's own settings."""
    reports = [engine_metrics.report(s, opts.gpu, opts.slo, served[i] if served else None)
               for i, s in enumerate(replicas)]
    if len(replicas) == 1:
        return reports[0], engine_metrics.format_report(reports[0])
    merged = _merge_deltas(replicas) if "seconds" in replicas[0] else engine_metrics.merge(replicas)
    total = engine_metrics.report(merged, opts.gpu, opts.slo)
    total["replicas"] = reports
    text = engine_metrics.format_report(total) + "\nPer replica:\n" + "\n".join(engine_metrics.format_replica_line(r) for r in reports)
    return total, text


def fleet_results(opts: Options) -> tuple[dict[str, Any], str]:
    """The fleet's report from Prometheus, each replica's, and the fleet findings first."""
    snap = engine_metrics.prometheus_snapshot(opts.prometheus, opts.window or 300.0, opts.match, opts.prometheus_auth,
                                              opts.timeout)
    total = engine_metrics.report(snap, opts.gpu, opts.slo)
    replicas = []
    for replica in snap["replicas"]:
        replicas.append({**engine_metrics.report(replica, opts.gpu, opts.slo), **replica["fleet"]})
    found = fleet.findings(replicas, diagnosis.FLAGS[snap["engine"]], diagnosis.QUEUE_SHARE, diagnosis.PREFIX_LONG_PROMPT)
    total["replicas"] = replicas
    total["fleet"] = {"prometheus": snap["source"], "window_s": snap["seconds"], "replicas": len(replicas),
                      "up": sum(1 for r in replicas if r["state"] == "up"),
                      "down": [r["instance"] for r in replicas if r["state"] != "up"]}
    total["diagnosis"] = diagnosis.with_fleet(found, total["diagnosis"])
    text = engine_metrics.format_report(total) + "\nPer replica:\n" + "\n".join(engine_metrics.format_replica_line(r) for r in replicas)
    return total, text


def _merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows of several replicas as one; a gauge's peak is the sum of the replicas' peaks
    (an upper bound: the replicas may have peaked at different moments)."""
    merged = engine_metrics.merge(deltas)
    merged["seconds"] = max((d["seconds"] for d in deltas if d["seconds"]), default=None)
    for concept in merged["gauges"]:
        merged["gauges"][concept]["peak_value"] = sum(
            d["gauges"][concept]["peak_value"] for d in deltas if concept in d["gauges"])
    return merged


def _from_files(opts: Options) -> list[dict[str, Any]]:
    snaps = [engine_metrics.snapshot(engine_metrics.read_file(path), path) for path in opts.files]
    if len(snaps) == 1:
        return snaps
    snaps[0]["time"], snaps[1]["time"] = 0.0, opts.window  # the interval between the two files
    delta = engine_metrics.difference(snaps[0], snaps[1])
    delta["source"] = f"{opts.files[0]} -> {opts.files[1]}"
    if not opts.window:
        delta["seconds"] = None
        delta["warnings"].append("no --window given: rates need the seconds between the two scrapes")
    return [delta]


def run(opts: Options) -> int:
    if opts.prometheus:
        result, text = fleet_results(opts)
    elif opts.files:
        result, text = results(opts, _from_files(opts))
    elif opts.watch:
        return watch(opts)
    elif opts.window:
        with common.SignalHold("metrics") as hold:
            replicas, interrupted, _ = window_reports(opts, opts.window, hold)
            result, text = results(opts, replicas, served_by(opts, replicas))
            result["interrupted"] = interrupted
            if interrupted:
                text += f"\ninterrupted: the window ended after {common.fmt_number(result.get('seconds'), 1)} s"
            printed = common.emit(result, text, opts.output)
        return printed or (common.EXIT_INTERRUPTED if interrupted else common.EXIT_OK)
    else:
        snaps = scrape_all(opts)
        result, text = results(opts, snaps, served_by(opts, snaps))
    return common.emit(result, text, opts.output)


def watch(opts: Options) -> int:
    """Print the report of each interval of `opts.watch` seconds until Ctrl-C (or `count`); the
    --json-out file holds the latest."""
    refreshes, last, written, served = 0, None, common.EXIT_OK, None
    while True:
        with common.SignalHold("metrics") as hold:
            replicas, interrupted, last = window_reports(opts, opts.watch, hold, last)
            refreshes += 1
            served = served or served_by(opts, replicas)
            result, text = results(opts, replicas, served)
            if opts.output.json:
                print(common.json_text(result, indent=None), end="", flush=True)
            else:
                print(f"--- {time.strftime('%H:%M:%S')}\n{text}", flush=True)
            if opts.output.file:
                written = common.write_outputs([("--json-out", opts.output.file, common.json_text(result))]) or written
        if interrupted or refreshes == opts.count:
            return written


@common.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        try:
            return run(options(args))
        except (engine_metrics.InvalidScrape, fleet.UnusableAnswer) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return common.EXIT_INVALID

    return common.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
