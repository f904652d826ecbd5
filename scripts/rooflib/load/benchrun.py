"""One bench run, end to end: options into a config, the workload, the run, the server's view, the result.

bench.py and sweep.py are its command lines; the flags and settings they share are bench_options'.
"""
from __future__ import annotations

import datetime
import hashlib
import random
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from rooflib.core import cli, conf, http_client, printing, signals
from rooflib.core.errors import EXIT_USAGE, ServerError, UsageError
from rooflib.load import images, sessions, shards, workloads
from rooflib.load.analysis import analyse
from rooflib.load.apis import APIS
from rooflib.load.asyncclient import Target
from rooflib.load.bench_options import BenchOptions, describe_load
from rooflib.load.promptgen import WORDS, TokenCounter, build_prompts, fallback_counter, server_counter
from rooflib.load.runner import Plan, RequestSource, RunResult, arrival_offsets, run_in_loop, run_workers, share
from rooflib.server import deployment, fleet, gpu_telemetry, watch
from rooflib.server.deployment import Served
from rooflib.server.slo_targets import Targets

TEMPLATE = Path(__file__).resolve().parents[1] / "render" / "templates" / "bench_log_entry.md.j2"


def metrics_snapshot(target: Target, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """One scrape of /metrics (rooflib/server/metric_sources.py, snapshots.py): (snapshot, '') or (None, why not)."""
    from rooflib.server import metric_sources, prometheus_text, snapshots

    try:
        text, at = metric_sources.scrape(target.base_url, target.api_key, timeout)
        return snapshots.snapshot(text, target.base_url, at), ""
    except (ServerError, UsageError, prometheus_text.InvalidScrape) as exc:
        return None, str(exc)


def server_side(delta: dict[str, Any] | None, note: str, completed_tokens: int, slo: Targets,
                outside: Sequence[dict[str, Any]] = (), served: Served | None = None,
                peak_in_flight: int | None = None) -> dict[str, Any]:
    """What the server's own metrics say about the run (`delta`: the scrapes' difference): its
    latency histograms, queue vs prefill time, token counters, preemptions, prefix hits, and
    the diagnosis, led by the time the client saw outside the engine (`outside`: the
    cross-check's findings) when there was some; `served`: the settings the engine is known to run
    with (tune knows its profile); `peak_in_flight`: the client's most at once (the demand)."""
    from rooflib.server import diagnosis, engine_metrics

    if delta is None:
        return {"metrics": None, "metrics_note": note or "/metrics unavailable", "summary": []}
    report = engine_metrics.report(delta, slo=slo, served=served, client_peak_in_flight=peak_in_flight)
    report["diagnosis"] = diagnosis.with_outside(outside, report["diagnosis"],
                                                 (report.get("ttft_ms") or {}).get("mean"))
    generated = delta["counters"].get("generation_tokens", {}).get("value")
    keep = ("engine", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms",
            "preemptions", "prefix_cache_hit_rate", "prompt_tokens", "running_peak", "waiting_peak",
            "kv_cache_usage_max", "multimodal_cache", "diagnosis", "warnings")
    figures = {key: report.get(key) for key in keep}
    figures["generation_tokens"] = generated

    def p(row: dict[str, Any], name: str) -> str:
        return printing.fmt_number(row.get(name), 1)
    # Means come from exact sums; quantiles of coarse buckets would not add up.
    lines = [f"TTFT mean {p(report['ttft_ms'], 'mean')} ms = queue {p(report['queue_ms'], 'mean')} + prefill "
             f"{p(report['prefill_ms'], 'mean')} ms; TTFT p50/p95 {p(report['ttft_ms'], 'p50')}/"
             f"{p(report['ttft_ms'], 'p95')} ms, e2e mean {p(report['e2e_ms'], 'mean')} ms ({report['e2e_ms']['n']} requests)",
             f"generation tokens +{printing.fmt_number(generated, 0)} (bench counted {completed_tokens}), "
             f"preemptions +{printing.fmt_number(report['preemptions'], 0)}, prefix-cache hit rate "
             f"{printing.fmt_number(None if report['prefix_cache_hit_rate'] is None else 100 * report['prefix_cache_hit_rate'], 1)}%",
             f"peak running {printing.fmt_number(report['running_peak'], 0)}, waiting {printing.fmt_number(report['waiting_peak'], 0)}, "
             f"KV cache max {printing.fmt_number(None if report['kv_cache_usage_max'] is None else 100 * report['kv_cache_usage_max'], 1)}%"]
    lines += [f"{f['kind']}: {f['evidence']}" for f in report["diagnosis"]["findings"]]
    return {"metrics": {**figures, "lines": lines}, "metrics_note": "", "summary": lines[:2]}


VERIFY_SAMPLE = 16


def run_head(run_id: str) -> str:
    """The words every prompt of a run starts with: drawn from the run id, so new for every run
    (one in a million alike) and the same in every shard of one (their prompts, a shared prefix
    too, are one run's). One generator draws all three: a generator per word repeats its first
    draw, a hundred heads in all, and two runs of one seed then meet each other's prefix cache."""
    draw = random.Random(run_id)
    return " ".join(draw.choice(WORDS) for _ in range(3))


def calibrate_maker(counter: TokenCounter, seed: int, run_id: str) -> workloads.PromptMaker | None:
    """Find the words that are one token each after the run's head (one tokenizer call per
    word); None when too few are, or they do not add up."""
    head = run_head(run_id)
    base = counter.count(head)
    with ThreadPoolExecutor(8 if counter.exact else 1) as pool:
        counts = list(pool.map(lambda word: counter.count(f"{head} {word}"), WORDS))
    units = [word for word, got in zip(WORDS, counts) if got == base + 1]
    if len(units) < 16 or counter.count(" ".join([head, *units])) != base + len(units):
        return None
    return workloads.PromptMaker(units, head, base, seed)


def verify_sample(counter: TokenCounter, load: workloads.Workload) -> list[str]:
    """Count a sample of built prompts with the tokenizer: the mismatches, described."""
    rng = random.Random(load.seed)
    indices = sorted({0, load.count - 1, *(rng.randrange(load.count) for _ in range(VERIFY_SAMPLE - 2))})
    specs = [load.spec(i) for i in indices]
    with ThreadPoolExecutor(8 if counter.exact else 1) as pool:
        got = list(pool.map(lambda spec: counter.count(spec.prompt), specs))
    return [f"#{i}: {n} tokens, built for {spec.prompt_tokens}" for i, spec, n in zip(indices, specs, got)
            if n != spec.prompt_tokens]


def build_workload(target: Target, options: BenchOptions,
                   run_id: str) -> tuple[workloads.Workload, str, list[list[sessions.Turn]] | None]:
    """The run's workload, its prompt-length source (for the report), and the turns of its
    sessions (agent sessions, --multi-turn)."""
    chat = APIS[options.endpoint].chat_template
    kind, dataset = options.workload, options.dataset
    out = options.output_tokens
    if kind in ("prompts", "sharegpt"):
        if kind == "prompts":
            entries = workloads.read_prompts(dataset)
            source = "dataset text (lengths by the server's usage)"
        else:
            local = fallback_counter()
            entries = workloads.read_sharegpt(dataset, local.count)
            source = f"dataset text (lengths by the server's usage; answer lengths by {local.name})"
        count = options.num_requests if options.num_requests_given else len(entries)
        return workloads.Workload(kind, options.warmup + count, out, options.seed, entries=entries), source, None
    with http_client.client(target.base_url, target.api_key, options.timeout_s, max_connections=8) as http:
        counter = server_counter(http, target.model, chat) or fallback_counter()
        if not counter.exact:
            printing.progress(f"bench: the server has no /tokenize; prompt lengths by {counter.name}")
        if kind == "sessions" or options.agent_turns:
            load, turns = session_workload(options, calibrate_maker(counter, options.seed, run_id))
            return load, counter.name, turns
        if kind == "trace":
            rows = workloads.read_trace(dataset)
            count = min(options.num_requests, len(rows)) if options.num_requests_given else len(rows)
            load = workloads.Workload("trace", count, out, options.seed, trace=rows,
                                         block_tokens=options.trace_block_tokens)
        else:
            total = (options.warmup + options.num_requests) * options.multi_turn
            load = workloads.Workload(
                "synthetic", total, out, options.seed,
                input_dist=workloads.parse_distribution(options.input_dist or str(options.input_tokens), "--input-dist"),
                output_dist=workloads.parse_distribution(options.output_dist or str(out), "--output-dist"))
        load.maker = calibrate_maker(counter, options.seed, run_id)
        if load.maker is not None and options.shared_prefix:
            load.shared_tokens = load.maker.fits(options.shared_prefix, 0)
            load.shared_prefix = load.maker.text(load.shared_tokens, 0)
        wrong = verify_sample(counter, load) if load.maker is not None else ["too few one-token words"]
        fixed = load.kind == "synthetic" and load.input_dist.kind == "fixed"
        if wrong and fixed:
            # The slow exact way: every prompt fitted with the tokenizer before the run.
            printing.progress(f"bench: prompt words do not add up ({wrong[0]}): fitting {total} prompts of "
                            f"{options.input_tokens} tokens one by one ({counter.name})")
            prompts = build_prompts(counter, total, options.input_tokens, options.shared_prefix, options.seed)
            entries = [workloads.Entry(prompt=p, prompt_tokens=options.input_tokens) for p in prompts]
            load = workloads.Workload("prompts", total, out, options.seed, entries=entries)
        elif wrong:
            raise UsageError(f"prompts of a chosen length cannot be built with this tokenizer ({wrong[0]}): "
                             "use --input-tokens alone, or --prompts with your own texts")
    turns = None
    if options.multi_turn > 1:  # the conversations' texts, made now: each turn waits for the last answer
        steps = [sessions.Turn((sessions.Message("user", spec.prompt, spec.prompt_tokens),), spec.output_tokens)
                 for spec in map(load.spec, range(load.count))]
        turns = [steps[i:i + options.multi_turn] for i in range(0, len(steps), options.multi_turn)]
        load = workloads.Workload("prompts", len(turns), out, options.seed, entries=[
            workloads.Entry(prompt=t[0].messages[0].content, prompt_tokens=options.input_tokens) for t in turns])
    return load, counter.name, turns


def session_workload(options: BenchOptions,
                     maker: workloads.PromptMaker | None) -> tuple[workloads.Workload, list[list[sessions.Turn]]]:
    """Agent sessions, recorded (--sessions) or synthetic (--agent-turns), with their texts written
    (`maker`: the words that are one token each; None when the tokenizer has too few): the
    workload (one request per session, its first turn) and every session's turns."""
    if maker is None:
        raise UsageError("session messages of a chosen length cannot be written with this tokenizer (too few "
                         "one-token words): give --sessions with \"content\" texts")
    if options.workload == "sessions":
        found = sessions.read_sessions(options.dataset, options.output_tokens)
        found = [replace(s, turns=tuple(replace(t, gap_s=t.gap_s / options.speed) for t in s.turns)) for s in found]
        count = options.num_requests if options.num_requests_given else len(found)
    else:
        found = sessions.synthetic(
            options.warmup + options.num_requests, options.agent_turns, options.input_tokens,
            workloads.parse_distribution(options.tool_tokens or "256", "--tool-tokens"),
            workloads.parse_distribution(options.output_dist or str(options.output_tokens), "--output-dist"),
            options.turn_gap_s, options.seed)
        count = options.num_requests
    turns = sessions.written(found, options.warmup + count, maker)
    load = workloads.Workload("sessions", len(turns), options.output_tokens, options.seed, entries=[
        workloads.Entry(messages=[m.as_chat() for m in t[0].messages], output_tokens=t[0].output_tokens)
        for t in turns])
    return load, turns


def workload_identity(options: BenchOptions, load: workloads.Workload) -> dict[str, Any]:
    """What two runs must share to be compared (compare.py): requests, lengths, load shape."""
    identity = {k: getattr(options, k) for k in ("workload", "endpoint", "concurrency", "rate", "burstiness", "duration_s",
                                    "warmup", "multi_turn", "shared_prefix", "speed")}
    # Agent sessions' settings only when set: the results saved before them compare as they did.
    identity.update({k: getattr(options, k) for k in ("agent_turns", "tool_tokens", "turn_gap_s", "shuffle_history")
                     if getattr(options, k)})
    identity["requests"] = load.count - options.warmup
    if options.shard:  # a part of the run: compared only once merged (merge.py drops this key)
        identity["shard"] = str(options.shard)
    identity["extra_body"] = options.extra_body or None
    identity["documents"] = options.documents or None
    identity.update({"images": options.images.recorded()} if options.images.given else {})  # as agent_turns
    if options.workload == "synthetic":
        identity["input_tokens"] = options.input_dist or options.input_tokens
        identity["output_tokens"] = options.output_dist or options.output_tokens
        identity["seed"] = options.seed
    else:
        data = Path(options.dataset).read_bytes()
        identity["dataset"] = {"name": Path(options.dataset).name, "sha256": hashlib.sha256(data).hexdigest()}
        identity["output_tokens"] = options.output_tokens if options.workload != "trace" else None
    return identity


def execute(target: Target, options: BenchOptions, hold: signals.SignalHold, quiet: bool = False,
            served: Served | None = None) -> dict[str, Any]:
    """Build the workload, run the load (this shard's part of it, with --shard), watch the server,
    analyse: the result document (`served`: the settings the server is known to run with, for the
    diagnosis; else what it says of them).
    A Ctrl-C or SIGTERM while the workload is built raises KeyboardInterrupt (nothing measured); during the
    load it stops the load; from the end of the load it waits in `hold` (started here, kept by the
    caller until the result is printed and written), so that the last scrape and the analysis
    complete the result, which then says interrupted."""
    started = time.perf_counter()
    run_id = shards.run_id(options.seed, options.start_at, options.shard.count) if options.shard \
        else f"{random.Random().getrandbits(32):08x}"
    load, prompt_source, turns = build_workload(target, options, run_id)
    fit_warnings = check_fits(target, options, load, turns)
    indices, plan = own_part(make_plan(target, options, load, turns, run_id), options.shard)
    config = run_config(options, load, target, prompt_source, run_id)
    probed = watch.probe(target.base_url, target.api_key, options.probe) if options.probe else None
    before, note = metrics_snapshot(target, options.timeout_s)
    timeline = watch.Timeline(target.base_url, target.api_key, options.timeline_interval_s) \
        if before is not None and options.timeline_interval_s else None
    # A shard's clocks, read before the load: what puts its timestamps on the wall clock.
    reading = shards.clock() if options.shard else None
    part = f"; shard {options.shard}: {len(plan.requests) - plan.warmup} of the requests" if options.shard else ""
    run = run_load(plan, options, hold, timeline, before, quiet,
                   f"bench: {config['load']}{part} against {target.base_url} ({target.model})")
    for outcome in run.outcomes if indices is not None else ():  # a shard's records name the run's requests
        outcome.index = indices[outcome.index]
    first_sent = min((o.sent_ns for o in run.outcomes if o.sent_ns), default=None)
    # vLLM counts a request's last tokens just after it streamed them: by now it has.
    after, note_after = metrics_snapshot(target, options.timeout_s) if before is not None else (None, note)
    result = analyse(run.outcomes, config, run.loop_lag_ms, run.cpu_s, run.wall_s, run.interrupted, slo=options.slo,
                     latency_slo_ms=options.slo_latency_p95_ms)
    result["workload"] = workload_identity(options, load)
    # Seconds from the start of execute to the first request on the wire: building the
    # workload, probing and the first scrape included (what a 100,000-request run waits).
    result["startup_s"] = None if first_sent is None else first_sent / 1e9 - started
    all_tokens = sum(o.completion_tokens or 0 for o in run.outcomes if o.ok or o.error == "stream_cut")
    during = timeline.during() if timeline else []
    delta, mixed = server_delta(before, after, during)
    result["server"] = server_view(target, options, result, delta, probed, first_sent is not None,
                                   mixed or note or note_after, all_tokens, served)
    if before is not None and after is not None and first_sent is not None and options.prometheus:
        result["server"]["gpu_telemetry"] = gpu_side(options, before, after, during, target.base_url)
    if result["sessions"] is not None:  # beside the perfect cache: the server's own hit rate over the run
        result["sessions"]["server_hit_rate"] = (result["server"]["metrics"] or {}).get("prefix_cache_hit_rate")
    result["timeline"] = timeline.result(after) if timeline else None
    result["images"] = images.section(options.images, run.outcomes, result["server"]["metrics"])
    # A shard's server also serves the other shards: that traffic is the run's, not another's.
    result["warnings"] = fit_warnings + result["warnings"] + ([mixed] if mixed else []) + (
        [] if options.shard else other_traffic(result["server"]["metrics"], all_tokens))
    result["records"] = [o.record() for o in run.outcomes]
    result["shard"] = shards.section(options.shard, options.start_at, run.measured_from_ns, reading,
                                     len(plan.requests) - plan.warmup, plan.concurrency, options.records)
    # One held since the load ended (during the last scrape, say) ends the run all the same.
    result["interrupted"] = run.interrupted or bool(hold.noted)
    return result


def own_part(plan: Plan, shard: shards.Shard | None) -> tuple[list[int] | None, Plan]:
    """The part of the run this process sends: with --shard, the shard's (its request indices in
    the run, and its plan: runner.share, the split --workers makes), else the whole plan."""
    return (None, plan) if shard is None else share(plan, shard.index, shard.count)


def run_config(options: BenchOptions, load: workloads.Workload, target: Target, prompt_source: str,
               run_id: str) -> dict[str, Any]:
    """The result's `config`: the settings as recorded, and what was run against what (a shard's
    too: the whole run's; its part is in the result's `shard`)."""
    return {**options.recorded(), "num_requests": load.count - options.warmup,
            "load": describe_load(options, load.count - options.warmup),
            "url": target.base_url, "model": target.model, "prompt_tokenizer": prompt_source, "run_id": run_id,
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "extra_body": options.extra_body or None}


def server_view(target: Target, options: BenchOptions, result: dict[str, Any], delta: dict[str, Any] | None,
                probed: dict[str, Any] | None, sent: bool, note: str, all_tokens: int,
                served: Served | None) -> dict[str, Any]:
    """The result's `server`: what the server said of itself, its metrics over the run with the
    diagnosis, the probe, and the client's figures against the server's (`sent`: a request went out)."""
    # A score request is several engine requests (one per text, or per pair): its latency has no
    # counterpart in the server's histograms.
    checked = cross_check(delta, result, probed) if delta is not None and sent and options.endpoint != "score" \
        else None
    if served is None and delta is not None:  # what the server says of its settings, as metrics reads it
        served = deployment.server_settings(target.base_url, delta["engine"], target.api_key, options.timeout_s)
    client_peak = (result.get("throughput") or {}).get("peak_in_flight")
    server = {"info": target.info, **server_side(delta, note, all_tokens, options.slo,
                                                 checked["findings"] if checked else [], served, client_peak)}
    server["probe"] = probed
    if checked:
        server["cross_check"] = checked
    return server


def check_fits(target: Target, options: BenchOptions, load: workloads.Workload,
               turns: list[list[sessions.Turn]] | None = None) -> list[str]:
    """A UsageError when the longest request (prompt + output) is over the model's max_model_len;
    with --over-limit, instead, the warning that says how many measured requests are over it (the
    server should reject them). Sessions (`turns`) are judged by their last turn's context."""
    max_len = target.info.get("max_model_len")
    if turns is not None and options.multi_turn == 1:
        return check_session_fits(max_len, options, turns)
    generates = APIS[options.endpoint].generates  # a pooling request's length is its text's
    longest = 0
    if load.input_dist and load.output_dist:
        longest = load.input_dist.upper + load.output_dist.upper * generates
    elif load.trace:
        longest = max(r.input_tokens + r.output_tokens * generates for r in load.trace[:load.count])
    elif options.multi_turn == 1 and load.kind == "prompts" and options.workload == "synthetic":
        longest = options.input_tokens + options.output_tokens * generates
    if not max_len or longest <= max_len:
        return []
    if not options.over_limit:
        raise UsageError(f"{'prompt + output' if generates else 'prompt'} tokens reach {longest}, over the model's "
                         f"max_model_len {max_len}: "
                         "shorten --input-tokens/--output-tokens or their distributions, or pass --over-limit "
                         "to measure how many the server rejects")
    # Counted from lengths alone (known here: the workloads above), and only now: building every
    # prompt would delay a large run's start.
    over = sum(1 for i in range(options.warmup, load.count)
               if load.lengths(i)[0] + load.lengths(i)[1] * generates > max_len)
    return [f"{over} of the {load.count - options.warmup} measured requests are longer than max_model_len "
            f"{max_len} (prompt + output tokens), so they are expected to be rejected (--over-limit)"] if over else []


def check_session_fits(max_len: int | None, options: BenchOptions, turns: list[list[sessions.Turn]]) -> list[str]:
    """check_fits for agent sessions: those whose messages and answers (their lengths known) come to
    more than max_model_len, the template's tokens aside."""
    sizes = [sessions.context_tokens(t) for t in turns[options.warmup:]]
    over = sum(1 for size in sizes if max_len and size is not None and size > max_len)
    if not over:
        return []
    what = f"{over} of the {len(sizes)} sessions outgrow the model's max_model_len {max_len} (messages and answers " \
           f"up to {max(size or 0 for size in sizes)} tokens)"
    if not options.over_limit:
        raise UsageError(f"{what}: use fewer turns, shorter --tool-tokens or --output-tokens, or pass --over-limit "
                         "to measure how many turns the server rejects")
    return [f"{what}, so their last turns are expected to be rejected (--over-limit)"]


def make_plan(target: Target, options: BenchOptions, load: workloads.Workload,
              turns: list[list[sessions.Turn]] | None, run_id: str) -> Plan:
    """What the runner sends: the requests made from the workload, with the load's shape; an
    open loop's arrivals are drawn here, once for the whole run, so that the parts of a run
    (--workers, --shard) send on one schedule."""
    source = RequestSource(load, target, options.endpoint, options.extra_body, run_id, options.documents,
                           images=images.source(options.images, options.seed))
    offsets = load.offsets_s(options.speed)
    if offsets is not None and options.warmup < len(offsets):
        offsets = [o - offsets[options.warmup] for o in offsets]
    elif offsets is None and options.rate:
        offsets = [0.0] * options.warmup + arrival_offsets(len(source) - options.warmup, options.rate,
                                                           options.burstiness, options.seed)
    start_at_ns = None if options.start_at is None else round(options.start_at * 1e9)
    return Plan(source, options.warmup, options.concurrency, options.duration_s,
                turns, offsets, start_at_ns, options.seed if options.shuffle_history else None)


def run_load(plan: Plan, options: BenchOptions, hold: signals.SignalHold, timeline: watch.Timeline | None,
             before: dict[str, Any] | None, quiet: bool, announce: str) -> RunResult:
    """Say `announce`, then send the plan (in worker processes with --workers), the server's
    timeline scraped meanwhile."""
    try:  # a Ctrl-C once the run is announced, or as the timeline starts, still gives a result
        printing.progress(announce)
        if timeline:
            timeline.start(before)
        if options.workers > 1:  # both start `hold` as the run ends
            return run_workers(plan, options.workers, options.timeout_s, hold)
        return run_in_loop(plan, options.timeout_s, quiet=quiet, hold=hold)
    except KeyboardInterrupt:  # came before the run handled it: nothing measured, and that is the result
        hold.start()
        return RunResult([], [], 0.0, 0.0, interrupted=True)
    finally:
        if timeline:
            timeline.stop()


def server_delta(before: dict[str, Any] | None, after: dict[str, Any] | None,
                 during: Sequence[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """What the server counted over the run: the difference of the scrapes around it; (None, why)
    when the scrapes came from several engines (a balancer in front of replicas: no difference of
    them is one engine's, so no server figure is shown); (None, '') without both scrapes."""
    from rooflib.server import replicas, snapshots

    if before is None or after is None:
        return None, ""
    mixed = replicas.mixed_engines([before, *during, after])
    if mixed:
        return None, (f"{mixed}: no server figure of this run is one engine's, so none is shown; bench each "
                      "replica's own URL for its figures")
    return snapshots.difference(before, after, during), ""


def cross_check(delta: dict[str, Any], result: dict[str, Any], probed: dict[str, Any] | None) -> dict[str, Any]:
    """The client's TTFT and e2e against the server's histograms over the run."""
    return watch.cross_check(delta, {"ttft_ms": result["ttft_ms"], "e2e_ms": result["e2e_ms"],
                                     "one_read": result["requests"]["one_read"]},
                             result["client"]["loop_lag_ms"]["p99"], probed)


def gpu_side(options: BenchOptions, before: dict[str, Any], after: dict[str, Any],
             during: Sequence[dict[str, Any]], base_url: str) -> dict[str, Any]:
    """The GPUs under the run's load, from the DCGM exporter series in options.prometheus over the
    run's window (rooflib/server/gpu_telemetry.py); when Prometheus cannot be read, why not: the
    run's result stands either way."""
    from rooflib.server import engine_metrics, snapshots

    report = engine_metrics.report(snapshots.difference(before, after, during))
    try:
        return gpu_telemetry.from_prometheus(options.prometheus, options.prometheus_auth, report["seconds"],
                                             {urllib.parse.urlsplit(base_url).netloc: report}, report["engine"],
                                             timeout=options.timeout_s)
    except (ServerError, UsageError, fleet.UnusableAnswer) as exc:
        return gpu_telemetry.unread(f"GPU telemetry not read: {exc}")


def other_traffic(metrics: dict[str, Any] | None, all_tokens: int) -> list[str]:
    """A warning when the server generated other than the tokens the bench received."""
    generated = (metrics or {}).get("generation_tokens")
    if generated is None or generated == all_tokens:
        return []
    return [f"the server generated {generated:.0f} tokens during the run, the bench received {all_tokens} "
            "(warm-up included): other traffic shared the server (or streams were lost), so this run measured "
            "a mixed load: its latencies and the verdict hold for that mix, and the server-side figures are "
            "not this run's alone"]


def run_with_settings(args: Any, body: Callable[[Any, conf.Settings, Target], int]) -> int:
    """Read the settings (inference.env) and resolve the server (URL, API key) once, for bench
    and sweep alike; errors are redacted with that key."""
    try:
        settings = conf.settings_from_args(args)
        server = Target(*conf.server_settings(args, settings))
    except UsageError as exc:
        return cli.fail(str(exc), EXIT_USAGE)
    return cli.run_main(lambda: body(args, settings, server), secret=server.api_key)
