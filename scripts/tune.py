#!/usr/bin/env python3
"""From a diagnosis to a verified change: restart a serving profile with one change at a time, keep what measurably helps.

Given a profile tune may start and stop (task serve's profiles, with --set overrides), a workload
(bench's flags: lengths, --prompts, --sharegpt, --trace, --multi-turn, --shared-prefix; or --like
URL: the prompt and output lengths and the requests in flight of a live server's metrics window),
an SLO and a budget: serve the profile, warm up, bench the baseline; read the diagnosis of that
run; apply the plan's first lever tune may try as one profile change; restart, bench the same
workload with the same seed, compare. A change is kept only when the 95% bootstrap interval of
the change in the SLO figure that misses lies wholly below zero and no other SLO figure breaks
(that is a trade-off: reported, not kept); else it is reverted. Again until the SLO holds, no
lever is left or the budget is spent. Where the diagnosis names nothing tune can try for the
figure that misses (or its change did not move it), the settings that figure depends on are
searched: TPOT, max_num_seqs down to the cap the per-token model gives, then smaller prefill
chunks; TTFT, the running cap up to what the load keeps in flight, prefix caching on, a larger
prefill budget; requests rejected as too long (bench --over-limit), max_model_len up. A setting
with a range (max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
kv_cache_memory_bytes, max_model_len) is searched: bracketed, then bisected, each next value where
the line through the measured points meets the target. A kept change after which one server makes
fewer tokens a second than the baseline served (the load offered) is reported with the replicas
that keep up; with --give speed it is a trade-off, not kept. A change the vram model says will
not start is not run (with --gpu, or a profile that fixes the KV space), unless its verdict is
marginal (then it says why it tries). KV or weight precision and more GPUs are proposed, never tried.

Against a server tune did not start (--url, no profile) it only measures and proposes: it never
restarts a server it did not start.

Writes to --out: baseline.json and trial-N.json (bench --json documents, for compare and
report), engine-N.log, profile.yaml (the winning profile), profile.diff (against the start),
tune.json, report.html (the trials on one chart); --log appends an entry to a bench log.
Progress goes to stderr, one line per phase, with an ETA from the budget and the engine's start
time measured on the first start (each trial restarts the engine).

Examples:
  tune.py --profile cpu-tiny --set max_num_seqs=1 --slo-ttft-p95-ms 2000 -n 16 -c 16 --input-tokens 512 --output-tokens 16
  tune.py --profile qwen3-32b-fp8-h100 --gpu h100 --slo-ttft-p95-ms 500 --slo-tpot-p95-ms 50 --budget-runs 8
  tune.py --profile ./staging.yaml --like http://prod:8000 --like-window 60 --slo-ttft-p95-ms 800 --budget-minutes 90
  tune.py --profile cpu-tiny --endpoint chat --shared-prefix 1536 --input-tokens 2048 --slo-ttft-p95-ms 300 --json
  tune.py --profile cpu-tiny --set max_num_seqs=256 -n 96 -c 48 --input-tokens 300 --output-tokens 150 --slo-tpot-p95-ms 7
  tune.py --profile cpu-tiny --set max_model_len=512 --input-tokens 768 --over-limit --slo-ttft-p95-ms 3000
  tune.py --url http://gpu-box:8000 -n 64 -c 16 --slo-ttft-p95-ms 500      # measure and propose only
  task infer:tune INFER_PROFILE=cpu-tiny SLO_TTFT_P95_MS=2000 TUNE_RUNS=6 -- --set max_num_seqs=1

Exit codes: 0 the SLO holds at the end (kept changes, if any, are in profile.yaml), 1 it still
misses (no lever left or the budget spent; measure-only: it misses), 2 usage error (no SLO, a bad
profile, a port in use, no engine Python), 3 the start profile's engine did not start or died
during the baseline, or the server is unreachable, 5 the result is printed but a file of --out,
--log or --json-out could not be written, 130 interrupted (the trials done are printed and
written, and no engine is left running).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import cli, conf, fileio, printing, signals
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError
from rooflib.load import bench_options, benchrun
from rooflib.render import report_html, report_inputs
from rooflib.serving import levers, profiles, trials
from rooflib.serving import tune as tuning
from rooflib.sizing import resolve

DEFAULT_RUNS = 6
GIVE = ("queue", "speed")  # what the user gives when token speed and queue wait conflict


def build_parser():
    p = bench_options.build_parser()
    p.description, p.epilog = cli.split_doc(__doc__)
    p.add_argument("--profile", default="", help="profile name or YAML path that tune starts and stops "
                                                 "(else $INFER_PROFILE); without one, --url is measured only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile key before the baseline, e.g. --set max_num_seqs=2 (repeatable)")
    p.add_argument("--port", default="",
                   help="port the engine serves on (default: a free one below the ephemeral range)")
    p.add_argument("--budget-runs", default="", help=f"bench runs at most, the baseline included (else $TUNE_RUNS; "
                                                     f"default {DEFAULT_RUNS} when no --budget-minutes)")
    p.add_argument("--budget-minutes", default="", help="minutes at most, engine starts included (else $TUNE_MINUTES)")
    p.add_argument("--out", default="", help="folder for the runs, profile.yaml, the diff and report.html "
                                             "(else $TUNE_OUT, default ./tune-<time>)")
    p.add_argument("--gpu", default="", help="the GPU, for the vram model's check of each change (else $GPU); "
                                             "not needed when the profile fixes the KV space")
    p.add_argument("--gpu-gb", default="", help="or its marketed memory in GB (else $GPU_GB)")
    p.add_argument("--like", default="", metavar="URL", help="a live server whose traffic the workload copies: "
                                                             "prompt and output lengths, requests in flight")
    p.add_argument("--like-window", default="", help="seconds of the live server's metrics window (default 30)")
    p.add_argument("--startup-timeout", default="", help="seconds an engine may take to answer /health (default 900)")
    p.add_argument("--give", default="", help="when token speed and queue wait conflict, which the user gives: queue "
                                              "(a change that meets the SLO while one server falls behind the load is "
                                              "kept and said) or speed (it is a trade-off, not kept) (else $GIVE; "
                                              "default queue)")
    return p


def options_of(args: Any, settings: conf.Settings) -> bench_options.BenchOptions:
    """bench's options (the workload, the SLO), the live traffic's shape with --like."""
    options = bench_options.make_options(args, settings)
    if not trials.targets(options.slo):
        raise UsageError("tune needs an SLO to judge changes by: --slo-ttft-p95-ms and/or --slo-tpot-p95-ms "
                         "(SLO_TTFT_P95_MS, SLO_TPOT_P95_MS)")
    if args.records:
        raise UsageError("tune writes every run to its --out folder: drop --records")
    return like_traffic(args, settings, options) if args.like else options


def like_traffic(args: Any, settings: conf.Settings, options: bench_options.BenchOptions) -> bench_options.BenchOptions:
    """The options with the live server's traffic shape in place of the lengths and concurrency."""
    given = [flag for flag, value in (("--input-tokens", settings.get("BENCH_IN", args.input_tokens)),
                                      ("--output-tokens", settings.get("BENCH_OUT", args.output_tokens)),
                                      ("-c", settings.get("BENCH_C", args.concurrency))) if value]
    if given or options.workload != "synthetic":
        raise UsageError(f"--like gives the lengths and concurrency: drop {', '.join(given) or '--' + options.workload}")
    window = cli.number("--like-window (s)", args.like_window, float, 1, 3600, default=30.0)
    url = conf.normalize_url(args.like)
    printing.progress(f"tune: reading {url}/metrics over {window:g} s (it is only read)")
    # INFER_API_KEY, as for any server tune reads
    shape = tuning.live_traffic_shape(url, conf.api_key(settings), window, options.timeout_s)
    printing.progress(f"tune: the live traffic: {shape['input_tokens']} prompt and {shape['output_tokens']} output "
                      f"tokens a request, {shape['concurrency']} in flight")
    return bench_options.check_options(dataclasses.replace(
        options, **shape, warmup=options.warmup if options.warmup_given else shape["concurrency"]))


def sizing_of(args: Any, settings: conf.Settings, profile: dict[str, Any]) -> levers.Sizing | None:
    gpu_name, gpu_gb = settings.get("GPU", args.gpu), cli.number("--gpu-gb (GPU_GB)", settings.get("GPU_GB", args.gpu_gb), float)
    gpu = resolve.resolve_gpu(gpu_name, gpu_gb) if gpu_name or gpu_gb is not None else None
    if gpu is None and levers.kv_space_bytes(profile) is None:
        return None
    return levers.Sizing(resolve.resolve_model(profiles.expand(profile["model"])), gpu)


def setup_of(args: Any, settings: conf.Settings, options: bench_options.BenchOptions, profile_name: str) -> tuning.Setup:
    _, profile = profiles.with_overrides(profile_name, args.set)
    runs = cli.number("--budget-runs (TUNE_RUNS)", settings.get("TUNE_RUNS", args.budget_runs), int, 1, 10_000)
    minutes = cli.number("--budget-minutes (TUNE_MINUTES)", settings.get("TUNE_MINUTES", args.budget_minutes), float)
    port = cli.number("--port", args.port, int, 1, 65535) or profiles.free_port()
    profiles.check_port_free(profile.get("host", "127.0.0.1"), port)  # before the first line of progress
    out = Path(settings.get("TUNE_OUT", args.out) or time.strftime("tune-%Y%m%d-%H%M%S"))
    give = settings.get("GIVE", args.give, "queue")
    if give not in GIVE:
        raise UsageError(f"--give must be {' or '.join(GIVE)}, got {give!r}")
    return tuning.Setup(profile=profile, source=profile_name, port=port, bench=options, give=give,
                        budget=tuning.Budget(runs if runs or minutes else DEFAULT_RUNS, minutes), out=out,
                        sizing=sizing_of(args, settings, profile),
                        startup_timeout_s=cli.number("--startup-timeout", args.startup_timeout, float, 1, 86_400,
                                                     default=900.0))


def figure_text(figure: dict[str, Any]) -> str:
    text = printing.fmt_number(figure.get("measured"), 1)
    if figure.get("ci95_pct"):
        low, high = figure["ci95_pct"]
        text += f" ({figure['change_pct']:+.0f}% [{low:+.0f}, {high:+.0f}])"
    return text


def human_text(doc: dict[str, Any]) -> str:
    names = list(doc["slo"])
    head = "".join(f"{trials.FIGURES[n][2] + ' ms':<28}" for n in names)
    lines = [f"SLO: {', '.join(f'{trials.FIGURES[n][2]} <= {t:g} ms' for n, t in doc['slo'].items())}; load: {doc['load']}",
             f"{'#':>2}  {'change':<40}{head}{'decision':<15}why"]
    for row in doc["trials"]:
        change = "baseline" if row["setting"] is None else \
            f"{row['setting']} {levers.shown(row['setting'], row['from'])} -> {levers.shown(row['setting'], row['to'])}"
        cells = "".join(f"{figure_text(row['figures'][n]) if n in row['figures'] else '-':<28}" for n in names)
        lines.append(f"{row['n']:>2}  {change:<40}{cells}{row['decision']:<15}{row['why']}")
        if row.get("note"):
            lines.append(f"    note: {row['note']}")
    if doc["mode"] == "measure_only":
        lines.append(f"Measured only: {doc['url']} was not started by tune, so it is never restarted.")
        proposal = doc["proposal"]
        if doc["slo_holds"]:
            lines.append("The SLO holds: nothing to change.")
        else:
            lines.append("Proposed change: " + (
                f"{proposal['setting']} {levers.shown(proposal['setting'], proposal['from'])} -> "
                f"{levers.shown(proposal['setting'], proposal['to'])}: {proposal['reason']}"
                if proposal else "none that a server setting makes: see the diagnosis (task infer:metrics)"))
        if doc["verify"]:
            lines += ["Verify it (the same bench before and after, then compare):"] + [f"  {c}" for c in doc["verify"]]
    else:
        lines.append(f"Stopped: {doc['stopped']['text']}")
        lines.append(f"Runs: {doc['runs']} in {tuning.clock(doc['wall_s'])} (engine start {tuning.clock(doc['engine_start_s'])})")
        lines.append("Kept: " + (", ".join(f"{c['setting']} {levers.shown(c['setting'], c['from'])} -> "
                                           f"{levers.shown(c['setting'], c['to'])}" for c in doc["changes"]) or "nothing"))
        if doc.get("trade_off"):
            lines.append(f"Trade-off: {doc['trade_off']}")
        if doc["diff"]:
            lines += doc["diff"].rstrip("\n").splitlines()
    lines += [f"Not tried: {line}" for line in doc["passed_over"]]
    lines += [f"Beside the result (no setting tune tries acts on it): {line}" for line in doc.get("beside") or []]
    lines.append(f"Files: {doc['out']}/" + ("" if doc["mode"] == "measure_only" else
                                            " (profile.yaml, profile.diff, tune.json, report.html, the runs)"))
    if doc["interrupted"]:
        lines.append("interrupted: the trials done so far")
    return "\n".join(lines)


def files_of(doc: dict[str, Any], tuned: bool) -> list[tuple[str, str, str]]:
    out = Path(doc["out"])
    result = report_inputs.Result("tune", str(out / "tune.json"), doc)
    sections = [report_html.answers_section([result]), *report_html.build_sections([result], None)]
    stamp = doc["started_at"]
    files = [("--out", str(out / "tune.json"), printing.json_text(doc)),
             ("--out", str(out / "report.html"), report_html.render_html(sections, [result], stamp))]
    if tuned:
        files += [("--out", str(out / "profile.yaml"), tuning.profile_yaml(doc["winning_profile"])),
                  ("--out", str(out / "profile.diff"), doc["diff"])]
    return files


def run(args: Any, settings: conf.Settings, server: Any) -> int:
    options = options_of(args, settings)
    if options.log:
        fileio.check_writable(options.log, "--log (BENCH_LOG)")
    profile_name = settings.get("INFER_PROFILE", args.profile)
    if profile_name and args.url:
        raise UsageError("give --profile (tune starts and restarts it) or --url (measured only), not both")
    if profile_name:
        setup = setup_of(args, settings, options, profile_name)
        setup.out.mkdir(parents=True, exist_ok=True)
        doc = tuning.tune(setup)
    else:
        out = Path(settings.get("TUNE_OUT", args.out) or time.strftime("tune-%Y%m%d-%H%M%S"))
        out.mkdir(parents=True, exist_ok=True)
        doc = tuning.measure(server.base_url, server.api_key, options, out)
    with signals.SignalHold("tune") as hold:  # the trials are written whatever comes now
        hold.start()
        printed = printing.emit(doc, human_text(doc), args.output)
        files = files_of(doc, doc["mode"] == "tune")
        if options.log:
            files.append(("--log", options.log, fileio.log_with_entry(options.log,
                                                                      printing.render_log_entry(doc, tuning.TEMPLATE))))
        written = fileio.write_outputs(files)
    if doc["interrupted"]:
        return EXIT_INTERRUPTED
    return printed or written or (EXIT_OK if doc["slo_holds"] else EXIT_CHECK_FAILED)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    return benchrun.run_with_settings(build_parser().parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
