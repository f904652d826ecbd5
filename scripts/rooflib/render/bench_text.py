"""A bench result as the console reads it (the table in vLLM `bench serve`'s layout, the client's
self-check, the server's view and the verdict), and as bench.py and merge.py publish it: printed,
then its records and log entry written.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rooflib.core import fileio, printing
from rooflib.core.errors import EXIT_OK
from rooflib.load import analysis, images
from rooflib.load.benchrun import TEMPLATE
from rooflib.server import diagnosis, gpu_telemetry


def human_text(result: dict[str, Any]) -> str:
    """The console table (vLLM `bench serve` layout for easy comparison)."""
    lines = [*_summary_lines(result), f"{'':-<72}",
             f"{'ms':<16}{'p50':>9}{'p95':>9}{'p99':>9}{'mean':>9}{'min':>9}{'max':>9}{'n':>7}"]
    if analysis.generates(result["config"]):
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL (chunk)"),
                           ("itl_token_ms", "ITL (token)"), ("e2e_ms", "E2E")):
            lines.append(_row(label, result[key]))
    else:  # a pooling API: one answer per request, its latency
        lines.append(_row("Latency", result["e2e_ms"]))
        if result["latency_per_input_token_ms"]:
            lines.append(_row("Latency/in tok", result["latency_per_input_token_ms"]))
    reasoning = result.get("reasoning")
    if reasoning:
        for key, label in (("ttft_answer_ms", "TTFT answer"), ("tpot_reasoning_ms", "TPOT reasoning"),
                           ("tpot_answer_ms", "TPOT answer"), ("reasoning_tokens", "reasoning tok"),
                           ("answer_tokens", "answer tok")):
            lines.append(_row(label, reasoning[key]))
    lines.append(f"{'':-<72}")
    if result.get("sessions"):
        lines += session_lines(result["sessions"]) + [f"{'':-<72}"]
    if result.get("images"):
        lines += images.summary(result["images"]) + [f"{'':-<72}"]
    lines += _client_lines(result) + _server_lines(result) + _verdict_lines(result)
    return "\n".join(lines)


def session_lines(reuse: dict[str, Any]) -> list[str]:
    """Prefix reuse by turn: the share of the prompt tokens a perfect prefix cache would serve
    (all of the previous turn's prompt and answer) and the share the server said it served."""
    def share(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"
    lines = [f"Prefix reuse by turn, {reuse['sessions']} sessions (share of prompt tokens from the cache):",
             f"{'turn':<6}{'n':>5}{'prompt mean':>12}{'perfect':>9}{'server':>9}{'of perfect':>11}{'TTFT p50/p95 ms':>18}"]
    for row in [*reuse["by_turn"], reuse["total"]]:
        ttft = row["ttft_ms"]
        mean = None if row["prompt_tokens"] is None or not row["requests"] else row["prompt_tokens"] / row["requests"]
        lines.append(f"{row['turn'] or 'all':<6}{row['requests']:>5}{printing.fmt_number(mean, 0):>12}"
                     f"{share(row['perfect_share']):>9}{share(row['cached_share']):>9}{share(row['cached_of_perfect']):>11}"
                     f"{printing.fmt_number(ttft['p50'], 1) + ' / ' + printing.fmt_number(ttft['p95'], 1):>18}")
    if reuse["total"]["cached_tokens"] is None:
        lines.append("server: no answer carried usage.prompt_tokens_details.cached_tokens (vLLM sends it with "
                     "--enable-prompt-tokens-details)")
    if reuse.get("server_hit_rate") is not None:
        lines.append(f"{'Server prefix-cache hit rate:':<34}{share(reuse['server_hit_rate'])} over the run (/metrics), "
                     f"perfect {share(reuse['total']['perfect_share'])}")
    return lines


def _summary_lines(result: dict[str, Any]) -> list[str]:
    """What ran against what, and how much got through."""
    cfg, req, thr = result["config"], result["requests"], result["throughput"]
    if analysis.generates(cfg):
        rates = [f"{'Output token throughput (tok/s):':<34}{printing.fmt_number(thr['output_tok_s'])}",
                 f"{'Total token throughput (tok/s):':<34}{printing.fmt_number(thr['total_tok_s'])}",
                 f"{'Output tokens (total, short):':<34}{req['output_tokens']['total']}, {req['output_tokens']['short']}"]
    else:
        rates = [f"{'Input token throughput (tok/s):':<34}{printing.fmt_number(thr['input_tok_s'])}"]
        if thr.get("pairs_s") is not None:
            rates.append(f"{'Pair throughput (pairs/s):':<34}{printing.fmt_number(thr['pairs_s'])}")
    return [f"{' Roofline bench ':=^72}",
            f"{'Server / model:':<34}{cfg['url']} / {cfg['model']}",
            f"{'Load:':<34}{cfg['load']}",
            f"{'Workload:':<34}{workload_line(cfg)} ({cfg['endpoint']}, prompts by {cfg['prompt_tokenizer']})",
            f"{'Requests completed / failed:':<34}{req['completed']} / {req['failed']}"
            + (f"  ({', '.join(f'{k} {v}' for k, v in req['errors'].items())})" if req["errors"] else ""),
            f"{'Duration (s):':<34}{printing.fmt_number(thr['duration_s'])}",
            f"{'Request throughput (req/s):':<34}{printing.fmt_number(thr['req_s'])}", *rates]


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
    if result.get("shard"):
        lines.append(f"{'Shard:':<34}{shard_line(result['shard'], result['shard']['count'])}")
    merged = result.get("merge")
    if merged:
        count = len(merged["shards"])
        lines += [f"{'Shard:':<34}{shard_line(shard, count)}; client "
                  f"{'valid' if shard['client']['valid'] else 'INVALID'}, lag p99 "
                  f"{printing.fmt_number(shard['client']['loop_lag_ms']['p99'])} ms" for shard in merged["shards"]]
        spread = merged["clock_spread_bound_ms"]
        lines.append(f"{'Clocks:':<34}" + ("one, the shards ran on one machine" if merged["clocks"] == 1 else
                     f"{merged['clocks']} for {count} shards, apart by " + ("an unknown amount (one is not synchronized)"
                     if spread is None else f"up to {printing.fmt_number(spread, 1)} ms (their kernels' bounds)")))
    return lines


def shard_line(shard: dict[str, Any], count: int) -> str:
    """A shard's part, how late it started against --start-at, and its clock."""
    late = shard["started_late_ms"]
    clock = shard["clock"]
    error = ("clock not synchronized" if clock["synchronized"] is False else "clock sync unknown"
             if clock["synchronized"] is None else f"clock max error {printing.fmt_number(clock['max_error_ms'], 1)} ms")
    return (f"{shard['index']}/{count}, {shard['requests']} requests"
            + (f", {shard['concurrency']} in flight" if shard["concurrency"] else "")
            + (f", measured from {printing.fmt_number(late, 1)} ms after --start-at" if late is not None else "")
            + f"; {error}")


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
    documents = f", {cfg['documents']} documents per query" if cfg.get("documents") else ""
    if cfg["workload"] != "synthetic":
        return f"{cfg['workload']} {Path(cfg['dataset']).name}{documents}"
    if cfg.get("agent_turns"):
        return (f"first message {cfg['input_tokens']}, tool results {cfg['tool_tokens'] or 256} / output "
                f"{cfg['output_dist'] or cfg['output_tokens']} tokens"
                + (f", {cfg['turn_gap_s']:g} s between turns" if cfg["turn_gap_s"] else ""))
    if not analysis.generates(cfg):
        return f"texts of {cfg['input_dist'] or cfg['input_tokens']} tokens{documents}"
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


def publish(result: dict[str, Any], output: printing.Output, records_path: str | None, log: str | None,
            who: str = "bench") -> int:
    """Print the result (its "records" taken out), then write --records and --log: the exit code
    (`who`: the command line, for its progress line)."""
    records = result.pop("records")
    # The result is printed first: a file that cannot be written then loses nothing.
    printed = printing.emit(result, human_text(result), output)
    files = []
    if records_path:
        files.append(("--records", records_path, printing.json_lines(records)))
    if log:
        files.append(("--log", log, fileio.log_with_entry(log, printing.render_log_entry(result, TEMPLATE))))
    written = fileio.write_outputs(files)
    if log and written == EXIT_OK:
        printing.progress(f"{who}: log entry appended to {log}")
    return printed or written or analysis.exit_code(result)
