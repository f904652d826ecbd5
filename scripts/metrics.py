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
gpu_memory_utilization, prefix caching, block size), SGLang's gauges (sglang:max_total_num_tokens,
context_len, page_size) and, with --url, from the server itself: /v1/models (max_model_len), vLLM's
/server_info (max_num_seqs, max_num_batched_tokens; served only with VLLM_SERVER_DEV_MODE=1), SGLang's
/get_server_info (mem_fraction_static, max_running_requests or the cap SGLang chose, chunked_prefill_size,
the radix cache, page size, KV dtype, attention backend, version).
What none exports is inferred with its evidence (max_num_seqs from the running count while
requests waited and the KV cache had room; prefix caching from any hit)
or reported as unknown (JSON `settings`). Each finding states its confidence: gauges are samples
that can miss the peak, counters and histograms cannot. Prompt and output lengths are those of
the finished requests (vllm:request_prompt_tokens). A quantile is printed as the histogram bucket
it lies in (`10-20 s`), the most a classic histogram tells; in the first bucket only its bound
(`<=10 ms`: JSON leaves it null and gives the bound in `at_most`). SGLang's names are those a live
SGLang 0.5.23 serves (its CPU engine, in the tests) and SGLang main of 2026-08 served (recorded).

--prefix-probe asks instead whether the server's prefix cache can hit at all (rooflib/server/prefix_probe.py):
two identical one-token completions of several KV blocks (a fresh nonce first), then the second's
usage cached_tokens, the cache counters around each and both answer times. "Can hit" means a 0%
live hit rate is the prompts (the cache matches from token 0 in whole blocks: a timestamp or id
first defeats it); "cannot hit" says why (caching off, or blocks evicted). At most three scrapes
and two completions of --timeout each.

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
  metrics.py --url http://127.0.0.1:8000 --prefix-probe --json

Functions for other scripts live in rooflib/server/ (errors: ServerError, prometheus_text.InvalidScrape):
  metric_sources.scrape(url, api_key=None) -> (text, unix_time)   GET <url>/metrics
  prometheus_text.parse_exposition(text) -> Exposition            Prometheus text format, any exporter
  snapshots.snapshot(text, source="", at=None) -> dict            normalized vLLM/SGLang figures of one scrape
  engine_metrics.window(before, after, during=(), gpu=None, slo=None) -> report   the interval between snapshots
  engine_metrics.report(snap, gpu=None, slo=None) -> report       one snapshot (since server start)
  snapshots.difference(before, after), snapshots.merge(snaps)     the interval / several replicas, as a snapshot
  quantiles.histogram_quantile(q, buckets), quantile_bucket(q, buckets)   Prometheus' classic quantile
  metric_sources.prometheus_snapshot(url, seconds, match="", auth=fleet.Credentials())   the same figures
                                                                  from a Prometheus server, fleet and `replicas`
  slo_targets.Targets(ttft_p95_ms, tpot_p95_ms, itl_p95_ms)       SLOs for the prefill and decode findings
  engine_metrics.report(snap, served=deployment.server_settings(url, engine))   with what the server says of itself
A report is a JSON-ready dict: engine, ttft_ms, itl_ms, tpot_ms, e2e_ms, queue_ms, prefill_ms,
decode_ms (each p50, p95, p99, mean, n), running, waiting, kv_cache_usage, preemptions,
prefix_cache_hit_rate, prompt_tok_s, gen_tok_s, prompt_tokens_mean, output_tokens_mean, mfu,
bandwidth_util, pooling (the pooling APIs' requests by API from http_requests_total, whether only
pooling ran, and what TTFT/TPOT mean for them), multimodal_cache (the processor cache's queries, hits,
hit rate and meaning), deployment (the cache_config_info settings), settings (each setting's value,
source: exported/inferred/unknown, and how), slo, slo_source, diagnosis: {root_cause, findings
(each kind, evidence, confidence, caused_by, setting, current, current_source), plan (each
setting, current, current_source, proposed, reason, effect, text), verify (commands)}, warnings.
With --prometheus also: fleet (prometheus, window_s, replicas, up, down), replicas (each
replica's report plus instance, job, model, state, config), and fleet findings first in
diagnosis.findings (scope "fleet", cause, replicas, per_replica), their levers first in the plan;
gpu_telemetry (exported, note, absent, replicas with their GPUs and figures, findings, plan).

Exit codes: 0 report printed (with or without findings), 2 usage error (bad flag, missing
file, unknown GPU, a --match Prometheus rejects as PromQL, series without the instance or
model_name label), 3 server or Prometheus unreachable or answering an HTTP error (401, 404),
4 the answer is not usable metrics (HTML page, empty or truncated scrape, neither vLLM nor
SGLang, no vllm: or sglang: series in Prometheus),
130 interrupted by Ctrl-C or SIGTERM (the window measured so far is still reported).
With --prefix-probe: 0 the cache can hit, 1 it cannot (the report says why), 4 no evidence either
way (no cached_tokens in usage, no prefix-cache counters); 2, 3 and 130 as above.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rooflib.core import catalogs, cli, conf, fileio, printing, signals
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, UsageError
from rooflib.server import (
    deployment,
    diagnosis,
    engine_metrics,
    fleet,
    gpu_telemetry,
    known_settings,
    metric_sources,
    prefix_probe,
    prometheus_text,
    report_text,
    slo_targets,
    snapshots,
)
from rooflib.server import replicas as replicas_of


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
    p.add_argument("--prefix-probe", action="store_true",
                   help="send two identical requests and report whether the prefix cache can hit (one --url; "
                        "the model is $INFER_MODEL or the first served)")
    p.add_argument("--gpu", default="", help="GPU name from scripts/rooflib/catalog/gpus.yaml, for MFU (else $GPU)")
    p.add_argument("--slo-ttft-p95-ms", default="", help="TTFT p95 target for the prefill finding "
                                                         "(else $SLO_TTFT_P95_MS)")
    p.add_argument("--slo-tpot-p95-ms", default="", help="TPOT p95 target for the decode finding "
                                                         "(else $SLO_TPOT_P95_MS)")
    p.add_argument("--slo-itl-p95-ms", default="", help="ITL p95 target for the decode finding "
                                                        "(else $SLO_ITL_P95_MS; default twice the TPOT target)")
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
    slo: slo_targets.Targets
    timeout: float
    output: printing.Output
    prefix_probe: bool
    model: str | None


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
                if url not in urls:  # the same URL given twice (INFER_URL and --url) is one engine
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
    if args.prefix_probe and (files or prometheus or watch or args.window or len(urls) != 1):
        raise UsageError("--prefix-probe sends requests to one live server: give it one --url and no "
                         "--file, --prometheus, --watch or --window")
    return Options(
        urls=urls, api_key=api_key, files=files, prometheus=prometheus,
        prometheus_auth=fleet.credentials(settings) if prometheus else fleet.Credentials(), match=args.match,
        window=cli.number("--window", args.window, float), watch=watch, count=max(0, args.count), gpu=gpu,
        slo=slo_targets.Targets(cli.number("SLO_TTFT_P95_MS", settings.get("SLO_TTFT_P95_MS", args.slo_ttft_p95_ms), float),
                    cli.number("SLO_TPOT_P95_MS", settings.get("SLO_TPOT_P95_MS", args.slo_tpot_p95_ms), float),
                    cli.number("SLO_ITL_P95_MS", settings.get("SLO_ITL_P95_MS", args.slo_itl_p95_ms), float)),
        timeout=args.timeout, output=args.output, prefix_probe=args.prefix_probe,
        model=settings.get("INFER_MODEL", "", None))


def scrape_all(opts: Options) -> list[dict[str, Any]]:
    snaps = []
    for url in opts.urls:
        text, at = metric_sources.scrape(url, opts.api_key, opts.timeout)
        snaps.append(snapshots.snapshot(text, url, at))
    return snaps


def served_by(opts: Options, snaps: Sequence[dict[str, Any]]) -> list[deployment.Served]:
    """What each server says about its own settings (read once: settings do not change while it runs)."""
    return [deployment.server_settings(url, snap["engine"], opts.api_key, opts.timeout)
            for url, snap in zip(opts.urls, snaps)]


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
    replicas = []
    for i in range(len(after)):
        delta = snapshots.difference(before[i], after[i], [d[i] for d in during])
        delta["mixed_engines"] = replicas_of.mixed_engines([before[i], *(d[i] for d in during), after[i]])
        replicas.append(delta)
    return replicas, interrupted or bool(hold.noted), after


def results(opts: Options, replicas: list[dict[str, Any]], served: Sequence[deployment.Served] = ()
            ) -> tuple[dict[str, Any], str]:
    """The aggregated report (with per-replica reports when several) and its human text;
    `served` holds each live server's own settings."""
    reports = [replicas_of.unblended(s, engine_metrics.report(s, opts.gpu, opts.slo, served[i] if served else None))
               for i, s in enumerate(replicas)]
    if len(replicas) == 1:
        return reports[0], report_text.format_report(reports[0])
    merged = _merge_deltas(replicas) if "seconds" in replicas[0] else snapshots.merge(replicas)
    total = engine_metrics.report(merged, opts.gpu, opts.slo)
    total["replicas"] = reports
    text = report_text.format_report(total) + "\nPer replica:\n" + "\n".join(report_text.format_replica_line(r) for r in reports)
    return total, text


def fleet_results(opts: Options) -> tuple[dict[str, Any], str]:
    """The fleet's report from Prometheus, each replica's, and the fleet findings first."""
    snap = metric_sources.prometheus_snapshot(opts.prometheus, opts.window or 300.0, opts.match, opts.prometheus_auth,
                                              opts.timeout)
    total = engine_metrics.report(snap, opts.gpu, opts.slo)
    replicas = []
    for replica in snap["replicas"]:
        replicas.append({**engine_metrics.report(replica, opts.gpu, opts.slo), **replica["fleet"]})
    found = fleet.findings(replicas, known_settings.FLAGS[snap["engine"]], known_settings.QUEUE_SHARE,
                           known_settings.PREFIX_LONG_PROMPT)
    total["replicas"] = replicas
    total["fleet"] = {"prometheus": snap["source"], "window_s": snap["seconds"], "replicas": len(replicas),
                      "up": sum(1 for r in replicas if r["state"] == "up"),
                      "down": [r["instance"] for r in replicas if r["state"] != "up"]}
    total["diagnosis"] = diagnosis.with_fleet(found, total["diagnosis"])
    total["gpu_telemetry"] = gpu_telemetry.from_prometheus(
        opts.prometheus, opts.prometheus_auth, snap["seconds"], {r["instance"]: r for r in replicas}, snap["engine"],
        opts.match, opts.timeout)
    total["diagnosis"] = gpu_telemetry.in_chain(total["gpu_telemetry"], total["diagnosis"], snap["engine"])
    text = report_text.format_report(total) + "\nPer replica:\n" + "\n".join(report_text.format_replica_line(r) for r in replicas)
    return total, text + "\n" + "\n".join(gpu_telemetry.format_lines(total["gpu_telemetry"]))


def _merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows of several replicas as one; a gauge's peak is the sum of the replicas' peaks
    (an upper bound: the replicas may have peaked at different moments)."""
    merged = snapshots.merge(deltas)
    merged["seconds"] = max((d["seconds"] for d in deltas if d["seconds"]), default=None)
    for concept in merged["gauges"]:
        merged["gauges"][concept]["peak_value"] = sum(
            d["gauges"][concept]["peak_value"] for d in deltas if concept in d["gauges"])
    return merged


def _from_files(opts: Options) -> list[dict[str, Any]]:
    snaps = [snapshots.snapshot(metric_sources.read_file(path), path) for path in opts.files]
    if len(snaps) == 1:
        return snaps
    snaps[0]["time"], snaps[1]["time"] = 0.0, opts.window  # the interval between the two files
    delta = snapshots.difference(snaps[0], snaps[1])
    delta["source"] = f"{opts.files[0]} -> {opts.files[1]}"
    if not opts.window:
        delta["seconds"] = None
        delta["warnings"].append("no --window given: rates need the seconds between the two scrapes")
    return [delta]


def run(opts: Options) -> int:
    if opts.prefix_probe:
        result = prefix_probe.run(opts.urls[0], opts.api_key, opts.model, opts.timeout)
        printed = printing.emit(result, prefix_probe.format_result(result), opts.output)
        return printed or {"can_hit": EXIT_OK, "cannot_hit": EXIT_CHECK_FAILED}.get(
            result["verdict"], EXIT_INVALID)
    if opts.prometheus:
        result, text = fleet_results(opts)
    elif opts.files:
        result, text = results(opts, _from_files(opts))
    elif opts.watch:
        return watch(opts)
    elif opts.window:
        with signals.SignalHold("metrics") as hold:
            replicas, interrupted, _ = window_reports(opts, opts.window, hold)
            result, text = results(opts, replicas, served_by(opts, replicas))
            result["interrupted"] = interrupted
            if interrupted:
                text += f"\ninterrupted: the window ended after {printing.fmt_number(result.get('seconds'), 1)} s"
            printed = printing.emit(result, text, opts.output)
        return printed or (EXIT_INTERRUPTED if interrupted else EXIT_OK)
    else:
        snaps = scrape_all(opts)
        result, text = results(opts, snaps, served_by(opts, snaps))
    return printing.emit(result, text, opts.output)


def watch(opts: Options) -> int:
    """Print the report of each interval of `opts.watch` seconds until Ctrl-C (or `count`); the
    --json-out file holds the latest."""
    refreshes, last, written, served = 0, None, EXIT_OK, None
    while True:
        with signals.SignalHold("metrics") as hold:
            replicas, interrupted, last = window_reports(opts, opts.watch, hold, last)
            refreshes += 1
            served = served or served_by(opts, replicas)
            result, text = results(opts, replicas, served)
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
        except (prometheus_text.InvalidScrape, fleet.UnusableAnswer) as exc:
            return cli.fail(str(exc), EXIT_INVALID)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
