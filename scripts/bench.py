#!/usr/bin/env python3
"""Load-test an OpenAI-compatible server (vLLM, SGLang): TTFT, TPOT, ITL, e2e, tok/s, SLO verdict.

Every request streams with temperature 0, `ignore_eos` and `stream_options.include_usage`
(+ `continuous_usage_stats`), so output lengths are exact and counted by the server. Prompts are
exactly --input-tokens long by the server's own tokenizer (/tokenize; else tiktoken, else an
estimate, announced), each with a unique prefix so the prefix cache cannot turn TTFT into a lookup.

Definitions (vLLM names): TTFT = request sent -> first chunk carrying content (never a role-only
chunk); e2e = request sent -> last content chunk; TPOT = (e2e - TTFT) / (output tokens - 1) per
request (= AIPerf ITL, GuideLLM ITL); ITL = per-chunk gaps (vLLM ITL, AIPerf ICL) and per token
(a gap divided over the tokens its chunk carried). Percentiles are linear (numpy default).
Timestamps are taken when bytes arrive (monotonic ns) by a minimal raw-socket HTTP/1.1 client;
SSE is parsed after the stream ends. The client's own event-loop lag is measured: when it may
have distorted the figures, the run is INVALID (exit 4). /metrics is read before and after
(queue vs prefill time, token counts, preemptions, prefix-cache hits) through rooflib/server/engine_metrics.py.
SGLang is supported from its documented formats (checked against recorded streams, not a live
server); its /tokenize takes text only, so chat prompts there do not count the chat template.

Real traffic (rooflib/load/workloads.py has the formats): --prompts JSONL, --sharegpt conversations
(every turn), --input-dist/--output-dist length distributions, --trace (Mooncake/BurstGPT JSONL
replayed on its own absolute schedule, --speed; the schedule lag is reported). Requests are made
when sent, from words the tokenizer counts as one token each (a sample is checked first), so a
100,000-request run starts at once. Reasoning models: TTFT of the first answer token and the
reasoning/answer split of tokens and TPOT. /metrics is scraped every --timeline-interval seconds
("timeline"), and the client's TTFT/e2e are checked against the server's histograms. With
--prometheus (or $PROMETHEUS) the GPUs' DCGM exporter series over the run's window are read from
it as `metrics --prometheus` reads them ("server"."gpu_telemetry": each GPU's activity, memory,
power and clock, and the GPU findings), or the report says why there are none.

Examples:
  bench.py --url http://127.0.0.1:8000 -n 32 -c 8 --input-tokens 2048 --output-tokens 256
  bench.py -n 64 -c 16 --slo-ttft-p95-ms 500 --slo-tpot-p95-ms 50 --log bench-log.md
  bench.py --rate 4 --burstiness 0.5 --duration 60 -n 1000 --json
  bench.py --endpoint chat --shared-prefix 1024 -n 32 -c 8 --records requests.jsonl
  INFER_URL=http://gpu-box:8000 INFER_API_KEY=... bench.py -n 256 -c 64 --workers 2
  bench.py --endpoint chat --sharegpt scripts/data/sharegpt-sample.json -c 4 --probe /health
  bench.py --trace scripts/data/trace-sample.jsonl --speed 2 --json > run.json
  bench.py -n 1000 -c 64 --json-out run.json     # the table on stdout, the JSON document in run.json
  bench.py --input-dist lognormal:400,2000 --output-dist uniform:64,512 -n 200 -c 16
  bench.py -n 256 -c 32 --prometheus http://prometheus:9090 --json-out run.json
  bench.py --input-dist lognormal:3000,12000 -n 200 --over-limit   # how many the server rejects over max_model_len

Exit codes: 0 SLO met (or no SLO set and every request completed), 1 SLO missed or requests
failed, 2 usage error, 3 server unreachable or every request failed, 4 run invalid (the client
may have distorted the figures, or ran out of file descriptors: raise ulimit -n), 5 the result is
printed but --records, --log or --json-out could not be written, 130 interrupted by Ctrl-C or
SIGTERM (partial results still printed and logged).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import cli, conf, fileio, printing, signals
from rooflib.core.errors import EXIT_OK
from rooflib.load import analysis, asyncclient, benchrun
from rooflib.server import diagnosis, gpu_telemetry


def human_text(result: dict[str, Any]) -> str:
    """The console table (vLLM `bench serve` layout for easy comparison)."""
    lines = [*_summary_lines(result), f"{'':-<72}",
             f"{'ms':<16}{'p50':>9}{'p95':>9}{'p99':>9}{'mean':>9}{'min':>9}{'max':>9}{'n':>7}"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL (chunk)"),
                       ("itl_token_ms", "ITL (token)"), ("e2e_ms", "E2E")):
        lines.append(_row(label, result[key]))
    reasoning = result.get("reasoning")
    if reasoning:
        for key, label in (("ttft_answer_ms", "TTFT answer"), ("tpot_reasoning_ms", "TPOT reasoning"),
                           ("tpot_answer_ms", "TPOT answer"), ("reasoning_tokens", "reasoning tok"),
                           ("answer_tokens", "answer tok")):
            lines.append(_row(label, reasoning[key]))
    lines.append(f"{'':-<72}")
    lines += _client_lines(result) + _server_lines(result) + _verdict_lines(result)
    return "\n".join(lines)


def _summary_lines(result: dict[str, Any]) -> list[str]:
    """What ran against what, and how much got through."""
    cfg, req, thr = result["config"], result["requests"], result["throughput"]
    return [f"{' Roofline bench ':=^72}",
            f"{'Server / model:':<34}{cfg['url']} / {cfg['model']}",
            f"{'Load:':<34}{cfg['load']}",
            f"{'Workload:':<34}{workload_line(cfg)} ({cfg['endpoint']}, prompts by {cfg['prompt_tokenizer']})",
            f"{'Requests completed / failed:':<34}{req['completed']} / {req['failed']}"
            + (f"  ({', '.join(f'{k} {v}' for k, v in req['errors'].items())})" if req["errors"] else ""),
            f"{'Duration (s):':<34}{printing.fmt_number(thr['duration_s'])}",
            f"{'Request throughput (req/s):':<34}{printing.fmt_number(thr['req_s'])}",
            f"{'Output token throughput (tok/s):':<34}{printing.fmt_number(thr['output_tok_s'])}",
            f"{'Total token throughput (tok/s):':<34}{printing.fmt_number(thr['total_tok_s'])}",
            f"{'Output tokens (total, short):':<34}{req['output_tokens']['total']}, {req['output_tokens']['short']}"]


def _client_lines(result: dict[str, Any]) -> list[str]:
    """The client's own delays, and how long the first request waited."""
    client = result["client"]
    lag = client["loop_lag_ms"]
    lines = [f"{'Client loop lag p50/p99/max (ms):':<34}{printing.fmt_number(lag['p50'])} / {printing.fmt_number(lag['p99'])} / "
             f"{printing.fmt_number(lag['max'])}  (limit {client['lag_threshold_ms']:.2f}, CPU {printing.fmt_number((client['cpu_util'] or 0) * 100, 0)}%)"]
    stalled = client.get("stalls") or {}
    if stalled.get("count"):
        lines.append(f"{'Client stalls (n, total, worst):':<34}{stalled['count']}, {stalled['total_s']:.2f} s "
                     f"({stalled['share']:.1%} of the run), {stalled['worst_ms']:.0f} ms")
    schedule = client["schedule_delay_ms"]
    if schedule["n"]:
        lines.append(f"{'Schedule lag p50/p99/max (ms):':<34}{printing.fmt_number(schedule['p50'])} / {printing.fmt_number(schedule['p99'])} / "
                     f"{printing.fmt_number(schedule['max'])}  (actual - intended send time)")
    if result.get("startup_s") is not None:
        lines.append(f"{'First request after (s):':<34}{result['startup_s']:.2f}")
    return lines


def _server_lines(result: dict[str, Any]) -> list[str]:
    """What the server's metrics, its timeline, the probe and the diagnosis (as task metrics prints it) said."""
    server = result.get("server") or {}
    lines = [f"{'Server:':<34}{line}" for line in server.get("summary", [])]
    timeline = result.get("timeline")
    if timeline and timeline["samples"]:
        lines.append(f"{'Server timeline:':<34}{timeline_line(timeline)}")
    if server.get("gpu_telemetry"):
        lines += gpu_telemetry.format_lines(server["gpu_telemetry"])
    probe = server.get("probe")
    if probe:
        lines.append(f"{'Probe ' + probe['path'] + ':':<34}" + (f"{probe['p50_ms']:.2f} ms round trip (p50 of {probe['n']})"
                                                                 if probe.get("p50_ms") is not None else probe.get("error", "")))
    diagnosed = (server.get("metrics") or {}).get("diagnosis") or {}
    told = diagnosis.format_diagnosis(diagnosed) if diagnosed.get("root_cause") else []
    # The diagnosis holds every finding of time outside the engine (diagnosis.with_outside): said once, there.
    lines += [f"client vs server: [{finding['cause'] or finding['kind']}] {finding['evidence']}"
              for finding in (server.get("cross_check") or {}).get("findings", [])
              if not (told and finding["kind"] == "outside_engine")]
    return lines + told


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    """The SLO checks, the requests the server rejected, warnings, first errors and the verdict."""
    lines = [f"{'SLO ' + name + ':':<34}{printing.fmt_number(check['measured'], 1)} <= {check['target']:g}: "
             f"{'met' if check['met'] else 'MISSED'}" for name, check in result["slo"].items()]
    rejected = result["requests"]["rejected"]
    if rejected["count"]:
        lines.append(f"Rejected: {rejected['count']} of {result['requests']['sent']} requests ({rejected['share']:.1%}): "
                     + ", ".join(f"{cause} {n}" for cause, n in rejected["by_cause"].items())
                     + f"; first: {rejected['first_body']}")
    lines += [f"warning: {warning}" for warning in result["warnings"]]
    lines += [f"error: {error}" for error in result["requests"]["first_errors"]]
    lines.append(f"{'Verdict:':<34}{result['verdict']}" +
                 (f" ({'; '.join(result['verdict_reasons'])})" if result["verdict_reasons"] else ""))
    if result["interrupted"]:
        lines.append("interrupted: partial results")
    return lines


def _row(label: str, s: dict[str, Any]) -> str:
    return (f"{label:<16}" + "".join(f"{printing.fmt_number(s[k]):>9}" for k in ("p50", "p95", "p99", "mean", "min", "max"))
            + f"{s['n']:>7}")


def workload_line(cfg: dict[str, Any]) -> str:
    if cfg["workload"] != "synthetic":
        return f"{cfg['workload']} {Path(cfg['dataset']).name}"
    return (f"prompt {cfg['input_dist'] or cfg['input_tokens']} / output {cfg['output_dist'] or cfg['output_tokens']} tokens"
            + (f", {cfg['shared_prefix']} shared" if cfg["shared_prefix"] else ""))


def timeline_line(timeline: dict[str, Any]) -> str:
    """Peaks over the scrapes: what the server went through during the run."""
    rows = timeline["samples"]

    def peak(key: str, scale: float = 1.0, digits: int = 0) -> str:
        values = [r[key] for r in rows if r[key] is not None]
        return printing.fmt_number(max(values) * scale, digits) if values else "-"
    return (f"{len(rows)} scrapes every {timeline['interval_s']:g} s: peak running {peak('running')}, waiting "
            f"{peak('waiting')}, KV {peak('kv_cache_usage_perc', 100, 1)}%, gen {peak('generation_tok_s', 1, 1)} tok/s, "
            f"preemptions {printing.fmt_number(rows[-1]['preemptions'], 0)}")


def run(args: Any, settings: conf.Settings, server: asyncclient.Target) -> int:
    options = benchrun.make_options(args, settings)
    for what, path in (("--records", args.records), ("--log (BENCH_LOG)", options.log)):
        if path:
            fileio.check_writable(path, what)
    target = asyncclient.find_target(server, settings.get("INFER_MODEL", args.model) or None, options.timeout_s)
    with signals.SignalHold("bench") as hold:  # from the end of the load: signals held until the result is written
        result = benchrun.execute(target, options, hold)
        return print_and_write(args, options.log, result)


def print_and_write(args: Any, log: str | None, result: dict[str, Any]) -> int:
    """Print the result, then write --records and --log: the exit code."""
    records = result.pop("records")
    # The result is printed first: a file that cannot be written then loses nothing.
    printed = printing.emit(result, human_text(result), args.output)
    files = []
    if args.records:
        files.append(("--records", args.records, "".join(json.dumps(printing.json_safe(r)) + "\n" for r in records)))
    if log:
        files.append(("--log", log, fileio.log_with_entry(log, printing.render_log_entry(result, benchrun.TEMPLATE))))
    written = fileio.write_outputs(files)
    if log and written == EXIT_OK:
        printing.progress(f"bench: log entry appended to {log}")
    return printed or written or analysis.exit_code(result)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = benchrun.build_parser()
    p.description, p.epilog = cli.split_doc(__doc__)
    return benchrun.run_with_settings(p.parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
