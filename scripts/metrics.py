#!/usr/bin/env python3
"""Read a vLLM or SGLang server's Prometheus metrics and name the bottleneck.

Reads /metrics from one or more servers (--url, auto-detects vLLM or SGLang), from saved
scrapes (--file), or asks a Prometheus server for a whole fleet (--prometheus). Reports TTFT,
ITL, TPOT, e2e, queue, prefill and decode time (p50/p95/p99, as Prometheus' histogram_quantile
computes them), running and waiting requests, KV-cache usage, preemptions, prefix-cache hit
rate, prompt and generation tok/s, MFU and bandwidth utilisation (vLLM with
--enable-mfu-metrics and --gpu), then a diagnosis: each finding names the bottleneck, the
numbers behind it and the levers, in this order: queue or prefill, decode, KV-cache or
max-num-seqs limit, preemptions, prefix-cache hits. No finding means no bottleneck seen.

Since server start (one scrape) the quantiles mix all history since the engine started; over a
window (--window 30: two scrapes, gauges sampled each second) they cover only the requests that
finished in it. Latency findings are judged against targets: --slo-ttft-p95-ms / --slo-tpot-p95-ms
(or SLO_TTFT_P95_MS / SLO_TPOT_P95_MS, as for task bench); a target not given takes the starting
default for interactive chat (TTFT p95 2 s on a long prompt, TPOT p95 50 ms), and the report says
so (JSON slo_source: given, default or partly default). vLLM's own settings from
vllm:cache_config_info (KV-cache tokens and blocks, kv_cache_memory_bytes, gpu_memory_utilization,
max concurrency) are printed and named by the findings they cause; max-num-seqs is exported by no
metric and is reported as unknown. Each finding states its confidence: gauges are samples that
can miss the peak, counters and histograms cannot. A quantile that falls in the first histogram
bucket is only known to be at most that bucket's bound: JSON leaves it null and gives the bound in
`at_most`. SGLang support follows its documented metric names (recorded formats, not a live server).

With --prometheus the window is a PromQL range (rate/increase, histogram_quantile over summed
buckets) for the fleet and `by (instance)` for each replica, and fleet findings come first:
replica_down, config_mismatch, imbalance, add_replica, prefix_split (rooflib/server/fleet.py). A path
prefix goes in the URL (http://host/prometheus); basic auth comes from PROMETHEUS_USER and
PROMETHEUS_PASSWORD, never from a flag, and is never printed. The same Prometheus is asked about the
GPUs: NVIDIA's DCGM exporter series, joined to each replica by pod or host, give each GPU's
activity, memory, power, clock and errors and the GPU findings (gpu_xid, gpu_throttled,
gpu_memory_other_process, gpu_memory_bound, gpu_idle_queue; rooflib/server/gpu_telemetry.py), or
say plainly that there is no GPU telemetry; fields the exporter does not export are listed, not
guessed.

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

Functions for other scripts live in rooflib/server/engine_metrics.py (errors: ServerError, engine_metrics.InvalidScrape):
  scrape(url, api_key=None) -> (text, unix_time)   GET <url>/metrics
  parse_exposition(text) -> Exposition             Prometheus text format, any exporter
  snapshot(text, source="", at=None) -> dict       normalized vLLM/SGLang figures of one scrape
  window(before, after, during=(), gpu=None, slo=None) -> report   the interval between snapshots
  report(snap, gpu=None, slo=None) -> report       one snapshot (since server start)
  difference(before, after), merge(snapshots)      the interval / several replicas, as a snapshot
  histogram_quantile(q, buckets), quantile_bucket(q, buckets)   Prometheus' classic quantile
  prometheus_snapshot(url, seconds, match="", auth=fleet.Credentials())   the same figures from a
                                                   Prometheus server, fleet and `replicas`
  Targets(ttft_p95_ms, tpot_p95_ms)                SLOs for the prefill and decode findings
A report is a JSON-ready dict: engine, ttft_ms, itl_ms, tpot_ms, e2e_ms, queue_ms, prefill_ms,
decode_ms (each p50, p95, p99, mean, n), running, waiting, kv_cache_usage, preemptions,
prefix_cache_hit_rate, prompt_tok_s, gen_tok_s, mfu, bandwidth_util, deployment (the
cache_config_info settings), slo, slo_source, diagnosis (bottleneck, evidence, confidence, levers),
warnings. With --prometheus also: fleet (prometheus, window_s, replicas, up, down), replicas (each
replica's report plus instance, job, model, state, config), fleet findings in diagnosis
(scope "fleet", cause, replicas, per_replica), and gpu_telemetry (exported, note, absent, replicas
with their GPUs and figures, findings, plan).

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
from typing import Any, Mapping, Sequence

from rooflib.core import catalogs, cli, conf, fileio, printing, signals
from rooflib.core.errors import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, UsageError
from rooflib.server import engine_metrics, fleet, gpu_telemetry


def build_parser() -> argparse.ArgumentParser:
    # --help leaves out the docstring's section for other scripts (the Python API).
    p = cli.parser(__doc__.split("Functions for other scripts")[0] + __doc__[__doc__.index("Exit codes"):])
    p.add_argument("--url", action="append", default=[],
                   help="server base URL or its /metrics URL; repeat (or comma-separate) for replicas "
                        f"(else $INFER_URL, {conf.ENV_FILE_NAME}, {conf.DEFAULT_URL}); "
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
    p.add_argument("--env-file", default=None,
                   help=f"settings file (default: ./{conf.ENV_FILE_NAME}, or $INFER_ENV_FILE)")
    p.add_argument("--timeout", type=cli.timeout_arg, default=30.0, help="seconds to wait for each answer")
    printing.add_output_args(p)
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
    output: printing.Output


def options(args: argparse.Namespace) -> Options:
    settings = conf.settings_from_args(args)
    files = [f for f in args.file if f]
    prometheus = settings.get("PROMETHEUS", args.prometheus, "")
    given = ",".join(args.url)
    urls, api_key = [], None
    # INFER_URL is often set for every task: a file or Prometheus given explicitly wins over it.
    if not files and not prometheus:
        raw = settings.get("INFER_URL", given, conf.DEFAULT_URL)
        for piece in re.split(r"[,\s]+", raw):
            if piece:
                url, api_key = conf.server_settings(argparse.Namespace(url=piece, env_file=args.env_file))
                urls.append(url)
    if files and prometheus:
        raise UsageError("give --file or --prometheus, not both")
    if len(files) > 2:
        raise UsageError("give one --file (since start) or two (before and after), not more")
    if len(files) == 1 and args.window:
        raise UsageError("--window with --file needs two files, the scrapes before and after the window")
    gpu_name = settings.get("GPU", args.gpu, "")
    gpu = catalogs.find_in_catalog(catalogs.load_catalog("gpus"), gpu_name, "GPU")[1] if gpu_name else None
    watch = cli.number("--watch", args.watch, float)
    if watch and (files or prometheus):
        raise UsageError("--watch reads live servers: use it with --url")
    return Options(
        urls=urls, api_key=api_key, files=files, prometheus=prometheus,
        prometheus_auth=fleet.credentials(settings) if prometheus else fleet.Credentials(), match=args.match,
        window=cli.number("--window", args.window, float), watch=watch, count=max(0, args.count), gpu=gpu,
        slo=engine_metrics.Targets(cli.number("SLO_TTFT_P95_MS", settings.get("SLO_TTFT_P95_MS", args.slo_ttft_p95_ms), float),
                    cli.number("SLO_TPOT_P95_MS", settings.get("SLO_TPOT_P95_MS", args.slo_tpot_p95_ms), float)),
        timeout=args.timeout, output=args.output)


def scrape_all(opts: Options) -> list[dict[str, Any]]:
    snaps = []
    for url in opts.urls:
        text, at = engine_metrics.scrape(url, opts.api_key, opts.timeout)
        snaps.append(engine_metrics.snapshot(text, url, at))
    return snaps


def window_reports(opts: Options, seconds: float, hold: signals.SignalHold, before: list[dict[str, Any]] | None = None
                   ) -> tuple[list[dict[str, Any]], bool, list[dict[str, Any]]]:
    """Scrape (unless `before` is given), sample the gauges each second for `seconds`, scrape
    again; Ctrl-C ends early. From the end of the window a Ctrl-C or SIGTERM waits in `hold`
    (the caller keeps it until the report is out) and ends the window all the same. Returns the
    window of each replica, whether interrupted, and the last scrape (the next window's start)."""
    before = before or scrape_all(opts)
    during: list[list[dict[str, Any]]] = []
    interrupted = False
    deadline = time.monotonic() + seconds
    printing.progress(f"measuring for {seconds:g} s (Ctrl-C ends early and still reports)...")
    try:
        while time.monotonic() < deadline - 1:
            time.sleep(1)
            during.append(scrape_all(opts))
        time.sleep(max(0.0, deadline - time.monotonic()))
        hold.start()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (cli.run_main)
        interrupted = True
        hold.start()
    after = scrape_all(opts)
    replicas = [engine_metrics.difference(before[i], after[i], [d[i] for d in during]) for i in range(len(after))]
    return replicas, interrupted or bool(hold.noted), after


def results(opts: Options, replicas: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The aggregated report (with per-replica reports when several) and its human text."""
    reports = [engine_metrics.report(s, opts.gpu, opts.slo) for s in replicas]
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
    found = fleet.findings(replicas, engine_metrics.FLAGS[snap["engine"]], engine_metrics.QUEUE_SHARE, engine_metrics.PREFIX_LONG_PROMPT)
    total["replicas"] = replicas
    total["fleet"] = {"prometheus": snap["source"], "window_s": snap["seconds"], "replicas": len(replicas),
                      "up": sum(1 for r in replicas if r["state"] == "up"),
                      "down": [r["instance"] for r in replicas if r["state"] != "up"]}
    total["diagnosis"] = found + total["diagnosis"]
    total["gpu_telemetry"] = gpu_telemetry.from_prometheus(
        opts.prometheus, opts.prometheus_auth, snap["seconds"], {r["instance"]: r for r in replicas}, snap["engine"],
        opts.match, opts.timeout)
    text = engine_metrics.format_report(total) + "\nPer replica:\n" + "\n".join(engine_metrics.format_replica_line(r) for r in replicas)
    return total, text + "\n" + "\n".join(gpu_telemetry.format_lines(total["gpu_telemetry"]))


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
        with signals.SignalHold("metrics") as hold:
            replicas, interrupted, _ = window_reports(opts, opts.window, hold)
            result, text = results(opts, replicas)
            result["interrupted"] = interrupted
            if interrupted:
                text += f"\ninterrupted: the window ended after {printing.fmt_number(result.get('seconds'), 1)} s"
            printed = printing.emit(result, text, opts.output)
        return printed or (EXIT_INTERRUPTED if interrupted else EXIT_OK)
    else:
        result, text = results(opts, scrape_all(opts))
    return printing.emit(result, text, opts.output)


def watch(opts: Options) -> int:
    """Print the report of each interval of `opts.watch` seconds until Ctrl-C (or `count`); the
    --json-out file holds the latest."""
    refreshes, last, written = 0, None, EXIT_OK
    while True:
        with signals.SignalHold("metrics") as hold:
            replicas, interrupted, last = window_reports(opts, opts.watch, hold, last)
            refreshes += 1
            result, text = results(opts, replicas)
            if opts.output.json:
                print(printing.json_text(result, indent=None), end="", flush=True)
            else:
                print(f"--- {time.strftime('%H:%M:%S')}\n{text}", flush=True)
            if opts.output.file:
                written = fileio.write_outputs([("--json-out", opts.output.file, printing.json_text(result))]) or written
        if interrupted or refreshes == opts.count:
            return written


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        try:
            return run(options(args))
        except (engine_metrics.InvalidScrape, fleet.UnusableAnswer) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INVALID

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
