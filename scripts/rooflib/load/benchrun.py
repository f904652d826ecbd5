"""One bench run, end to end: options into a config, the workload, the run, the server's view, the result.

bench.py and sweep.py are its command lines; the flags and settings they share are defined here.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import random
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from rooflib.core import cli, conf, http_client, printing, signals
from rooflib.core.errors import EXIT_USAGE, ServerError, UsageError
from rooflib.load import images, sessions, shards, workloads
from rooflib.load.analysis import analyse, has_sessions
from rooflib.load.apis import APIS
from rooflib.load.asyncclient import Target
from rooflib.load.promptgen import WORDS, TokenCounter, build_prompts, fallback_counter, server_counter
from rooflib.load.runner import Plan, RequestSource, RunResult, arrival_offsets, run_in_loop, run_workers, share
from rooflib.server import deployment, fleet, gpu_telemetry, watch
from rooflib.server.deployment import Served
from rooflib.server.slo_targets import Targets

TEMPLATE = Path(__file__).resolve().parents[1] / "render" / "templates" / "bench_log_entry.md.j2"


LIMITS = {"num_requests": 1_000_000, "concurrency": 100_000, "input_tokens": 10_000_000,
          "output_tokens": 1_000_000}


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


@dataclass(frozen=True)
class BenchOptions:
    """One run's settings, read and checked once (make_options), passed down as they are."""
    num_requests: int
    num_requests_given: bool  # else a dataset's or trace's size
    concurrency: int | None   # None: an open loop or a trace without a cap
    rate: float | None
    input_tokens: int
    output_tokens: int
    slo: Targets
    burstiness: float
    duration_s: float | None
    warmup: int
    warmup_given: bool  # else as many as the concurrency
    shared_prefix: int
    workers: int
    multi_turn: int
    timeout_s: float
    seed: int
    speed: float
    trace_block_tokens: int
    timeline_interval_s: float
    probe: str | None
    endpoint: str
    workload: str  # synthetic, prompts, sharegpt or trace
    dataset: str | None
    input_dist: str | None
    output_dist: str | None
    log: str | None
    extra_body: dict[str, Any]
    over_limit: bool = False  # send requests over max_model_len: the server's rejections are measured
    prometheus: str | None = None  # read the GPUs' DCGM series there after the run
    prometheus_auth: fleet.Credentials = field(default_factory=fleet.Credentials, repr=False)  # never recorded
    shard: shards.Shard | None = None  # this process sends part I of N of the run (--shard)
    start_at: float | None = None      # the measured phase starts at this Unix time, in s (--start-at)
    records: str | None = None         # --records: the per-request lines go to this file
    slo_latency_p95_ms: float | None = None  # request latency (e2e) p95 target: the pooling APIs' SLO
    documents: int = 0                 # score: documents paired with each request's text (--documents)
    agent_turns: int = 0               # synthetic agent sessions of this many turns (--agent-turns; 0: none)
    tool_tokens: str | None = None     # their tool results' lengths, a distribution (--tool-tokens; default 256)
    turn_gap_s: float = 0.0            # their wait before each later turn (--turn-gap)
    shuffle_history: bool = False      # the shuffled control of sessions (--shuffle-history)
    images: images.ImageOptions = images.ImageOptions()  # chat prompts with images (--images, rooflib/load/images.py)

    @property
    def sessions(self) -> bool:
        """Whether the run sends sessions of turns, each with its history (agent sessions, --multi-turn)."""
        return has_sessions(self.recorded())

    def recorded(self) -> dict[str, Any]:
        """The settings as the result's `config` records them (saved results and compare.py read
        it): the SLO as two numbers; extra_body comes last, from execute."""
        return {"num_requests": self.num_requests, "concurrency": self.concurrency, "rate": self.rate,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "slo_ttft_p95_ms": self.slo.ttft_p95_ms, "slo_tpot_p95_ms": self.slo.tpot_p95_ms,
                "slo_latency_p95_ms": self.slo_latency_p95_ms, "documents": self.documents or None,
                "burstiness": self.burstiness, "duration_s": self.duration_s, "warmup": self.warmup,
                "shared_prefix": self.shared_prefix, "workers": self.workers, "multi_turn": self.multi_turn,
                "timeout_s": self.timeout_s, "seed": self.seed, "speed": self.speed,
                "trace_block_tokens": self.trace_block_tokens, "timeline_interval_s": self.timeline_interval_s,
                "probe": self.probe, "endpoint": self.endpoint, "workload": self.workload, "dataset": self.dataset,
                "input_dist": self.input_dist, "output_dist": self.output_dist, "log": self.log,
                "over_limit": self.over_limit, "prometheus": self.prometheus,
                "shard": None if self.shard is None else str(self.shard), "images": self.images.recorded(),
                "start_at": None if self.start_at is None else shards.iso(self.start_at), "records": self.records,
                "agent_turns": self.agent_turns or None, "tool_tokens": self.tool_tokens,
                "turn_gap_s": self.turn_gap_s or None, "shuffle_history": self.shuffle_history}

    def at_concurrency(self, concurrency: int, num_requests: int) -> "BenchOptions":
        """The same run at another concurrency (a sweep's point), checked: the warm-up follows
        the concurrency unless it was given."""
        return check_options(replace(
            self, concurrency=concurrency, num_requests=num_requests, num_requests_given=True,
            warmup=self.warmup if self.warmup_given else concurrency))


def as_flags(options: BenchOptions) -> list[str]:
    """The options as bench's flags, every setting written out (a pod reads no inference.env):
    bench run with them reads the same options back. Not the ones a run of several machines sets
    for each (--shard, --start-at, --records, --log) nor --prometheus (its credentials would travel)."""
    dataset = (f"--{options.workload}", options.dataset) if options.dataset else ("--prompts", None)
    pairs = [("-n", options.num_requests if options.num_requests_given else None), ("-c", options.concurrency),
             ("--rate", options.rate), ("--input-tokens", options.input_tokens),
             ("--output-tokens", options.output_tokens), ("--slo-ttft-p95-ms", options.slo.ttft_p95_ms),
             ("--slo-tpot-p95-ms", options.slo.tpot_p95_ms), ("--slo-latency-p95-ms", options.slo_latency_p95_ms),
             ("--documents", options.documents or None), ("--burstiness", options.burstiness),
             ("--duration", options.duration_s), ("--warmup", options.warmup if options.warmup_given else None),
             ("--shared-prefix", options.shared_prefix), ("--workers", options.workers),
             ("--multi-turn", options.multi_turn), ("--timeout", options.timeout_s), ("--seed", options.seed),
             ("--speed", options.speed), ("--trace-block-tokens", options.trace_block_tokens),
             ("--timeline-interval", options.timeline_interval_s), ("--probe", options.probe),
             ("--endpoint", options.endpoint), dataset, ("--input-dist", options.input_dist),
             ("--output-dist", options.output_dist),
             ("--extra-body", json.dumps(options.extra_body) if options.extra_body else None),
             ("--agent-turns", options.agent_turns or None), ("--tool-tokens", options.tool_tokens),
             ("--turn-gap", options.turn_gap_s or None)]
    flags = [part for flag, value in pairs if value is not None for part in (flag, str(value))]
    return flags + (["--over-limit"] if options.over_limit else []) + (
        ["--shuffle-history"] if options.shuffle_history else []) + options.images.flags()


def make_options(args: Any, settings: conf.Settings) -> BenchOptions:
    """Validated run settings (flag > environment > inference.env > default)."""
    return check_options(read_options(args, settings))


def read_options(args: Any, settings: conf.Settings) -> BenchOptions:
    """Each flag or setting read once, as its type, within its limits; combinations are check_options'."""
    n_given = settings.get("BENCH_N", args.num_requests)
    n = cli.number("-n/--num-requests (BENCH_N)", n_given, int, 1, LIMITS["num_requests"], default=32)
    rate = cli.number("--rate (requests/s)", args.rate, float, 1e-6, 1e6)
    sources = [name for name in ("prompts", "sharegpt", "trace", "sessions") if getattr(args, name)]
    if len(sources) > 1:
        raise UsageError(f"--{sources[0]} and --{sources[1]} both give the requests: choose one")
    c_default = None if rate or args.trace else 8
    c = cli.number("-c/--concurrency (BENCH_C)", settings.get("BENCH_C", args.concurrency), int, 1, LIMITS["concurrency"], default=c_default)
    prometheus = settings.get("PROMETHEUS", args.prometheus, "")
    return BenchOptions(
        num_requests=n, num_requests_given=n_given not in (None, ""), concurrency=c, rate=rate,
        input_tokens=cli.number("--input-tokens (BENCH_IN)", settings.get("BENCH_IN", args.input_tokens), int, 1, LIMITS["input_tokens"], default=2048),
        output_tokens=cli.number("--output-tokens (BENCH_OUT)", settings.get("BENCH_OUT", args.output_tokens), int, 1, LIMITS["output_tokens"], default=256),
        slo=Targets(cli.number("--slo-ttft-p95-ms (SLO_TTFT_P95_MS)", settings.get("SLO_TTFT_P95_MS", args.slo_ttft_p95_ms), float, 1e-3, None),
                    cli.number("--slo-tpot-p95-ms (SLO_TPOT_P95_MS)", settings.get("SLO_TPOT_P95_MS", args.slo_tpot_p95_ms), float, 1e-3, None)),
        burstiness=cli.number("--burstiness", args.burstiness, float, 1e-3, 1e3, default=1.0),
        duration_s=cli.number("--duration (s)", args.duration, float, 1e-3, 7 * 86400),
        warmup=cli.number("--warmup", args.warmup, int, 0, LIMITS["num_requests"], default=c or 0),
        warmup_given=args.warmup not in (None, ""),
        shared_prefix=cli.number("--shared-prefix", args.shared_prefix, int, 0, LIMITS["input_tokens"], default=0),
        workers=cli.number("--workers", args.workers, int, 1, 256, default=1),
        multi_turn=cli.number("--multi-turn", args.multi_turn, int, 1, 1000, default=1),
        timeout_s=cli.number("--timeout", args.timeout, float, 1e-3, None, default=30.0),
        seed=cli.number("--seed", args.seed, int, 0, None, default=0),
        speed=cli.number("--speed", args.speed, float, 1e-6, 1e6, default=1.0),
        trace_block_tokens=cli.number("--trace-block-tokens", args.trace_block_tokens, int, 1, 1_000_000,
                                      default=workloads.MOONCAKE_BLOCK_TOKENS),
        timeline_interval_s=cli.number("--timeline-interval (s)", args.timeline_interval, float, 0, 3600, default=2.0),
        probe=args.probe or None,
        endpoint=args.endpoint,
        workload=sources[0] if sources else "synthetic",
        dataset=getattr(args, sources[0]) if sources else None,
        input_dist=args.input_dist or None,
        output_dist=args.output_dist or None,
        log=settings.get("BENCH_LOG", args.log, None),
        extra_body=parse_extra_body(args.extra_body),
        over_limit=args.over_limit,
        prometheus=prometheus or None,
        prometheus_auth=fleet.credentials(settings) if prometheus else fleet.Credentials(),
        # sweep's parser has no --shard: its points run one after another on one machine
        shard=shards.parse_shard(getattr(args, "shard", "")),
        start_at=shards.parse_start_at(getattr(args, "start_at", ""), time.time()),
        records=args.records or None,
        slo_latency_p95_ms=cli.number("--slo-latency-p95-ms (SLO_LATENCY_P95_MS)",
                                      settings.get("SLO_LATENCY_P95_MS", args.slo_latency_p95_ms), float, 1e-3, None),
        documents=cli.number("--documents", args.documents, int, 1, 10_000,
                             default=1 if args.endpoint == "score" else 0),
        agent_turns=cli.number("--agent-turns", args.agent_turns, int, 1, 1000, default=0),
        tool_tokens=args.tool_tokens or None,
        turn_gap_s=cli.number("--turn-gap (s)", args.turn_gap, float, 0, 86400, default=0.0),
        shuffle_history=args.shuffle_history,
        images=images.read_options(args.images, args.image_size, args.image_dir))


def parse_extra_body(text: str) -> dict[str, Any]:
    """--extra-body: a JSON object merged into every request body ({} when not given)."""
    try:
        body = json.loads(text) if text else {}
        if not isinstance(body, dict):
            raise ValueError
    except ValueError:
        raise UsageError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")
    return body


def check_options(options: BenchOptions) -> BenchOptions:
    """The options, when their combination makes sense; else a UsageError naming what to drop."""
    if options.probe and not options.probe.startswith("/"):
        raise UsageError(f"--probe takes a path such as /health or /v1/models, got {options.probe!r}")
    if options.shared_prefix > options.input_tokens:
        raise UsageError(f"--shared-prefix {options.shared_prefix} is longer than --input-tokens {options.input_tokens}")
    dists = options.input_dist or options.output_dist
    if options.workload != "synthetic" and (dists or options.shared_prefix or options.multi_turn > 1
                                            or options.agent_turns):
        raise UsageError(f"--{options.workload} gives the prompts and lengths: drop --input-dist, --output-dist, "
                         "--shared-prefix, --multi-turn and --agent-turns")
    if options.workload == "trace" and options.rate:
        raise UsageError("--trace sends at the trace's own times: use --speed, not --rate")
    for dist, what in ((options.input_dist, "--input-dist"), (options.output_dist, "--output-dist")):
        if dist:
            workloads.parse_distribution(dist, what)
    if dists and options.multi_turn > 1:
        raise UsageError("--multi-turn sends --input-tokens per turn: drop --input-dist/--output-dist")
    images.check(options.images, options.endpoint, options.sessions)
    return check_parts(check_pooling(check_sessions(options)))


def check_sessions(options: BenchOptions) -> BenchOptions:
    """The options, when they fit agent sessions: chat, no other way of making prompts, the
    generator's settings only with the generator, the shuffled control only with sessions."""
    if options.agent_turns and (options.multi_turn > 1 or options.input_dist or options.shared_prefix):
        raise UsageError("--agent-turns makes the sessions: a first message of --input-tokens, then tool results of "
                         "--tool-tokens; drop --multi-turn, --input-dist and --shared-prefix")
    if (options.tool_tokens or options.turn_gap_s) and not options.agent_turns:
        raise UsageError("--tool-tokens and --turn-gap shape the synthetic sessions of --agent-turns: add it, or drop them")
    if options.tool_tokens:
        workloads.parse_distribution(options.tool_tokens, "--tool-tokens")
    if options.shuffle_history and not options.sessions:
        raise UsageError("--shuffle-history is the control of a sessions run: add --sessions, --agent-turns or --multi-turn")
    if options.sessions and not APIS[options.endpoint].chat_template:
        raise UsageError(f"--{'multi-turn' if options.multi_turn > 1 else 'sessions and --agent-turns'} need "
                         "--endpoint chat, responses or messages: a session is a list of messages")
    return options


def check_pooling(options: BenchOptions) -> BenchOptions:
    """The options, when they fit the API: a pooling API (embeddings, score) answers once, so it
    has no TTFT or TPOT and no output lengths; only score pairs documents."""
    if options.documents and options.endpoint != "score":
        raise UsageError(f"--documents pairs documents with a query for --endpoint score, not {options.endpoint}")
    if APIS[options.endpoint].generates:
        return options
    if options.slo.ttft_p95_ms is not None or options.slo.tpot_p95_ms is not None:
        raise UsageError(f"--endpoint {options.endpoint} answers once, with no TTFT or TPOT: "
                         "set --slo-latency-p95-ms (the request latency) instead")
    if options.output_dist:
        raise UsageError(f"--endpoint {options.endpoint} generates no tokens: drop --output-dist")
    if options.endpoint == "score" and options.workload == "trace":
        raise UsageError("--endpoint score pairs each text with --documents others: use --input-tokens or --prompts, "
                         "not --trace")
    return options


def check_parts(options: BenchOptions) -> BenchOptions:
    """The options, when the run splits into its shards and workers: each gets a share of the
    concurrency and of the requests, and shards share a start time."""
    shard = options.shard
    if shard and options.start_at is None:
        raise UsageError("--shard needs --start-at: the shards start their measured requests together at "
                         "that time, and derive the run's identity from it")
    if shard and options.concurrency is not None and shard.count > options.concurrency:
        raise UsageError(f"--shard {shard} splits a concurrency of {options.concurrency} over {shard.count} shards: "
                         "each shard needs at least one stream; raise -c or use fewer shards")
    if shard and options.num_requests_given and shard.count > options.num_requests:
        raise UsageError(f"--shard {shard}: {options.num_requests} requests cannot be split over {shard.count} shards")
    streams = options.concurrency if options.concurrency is None or not shard else options.concurrency // shard.count
    if options.workers > 1 and streams is not None and options.workers > streams:
        raise UsageError(f"--workers {options.workers} exceeds the concurrency {streams}"
                         f"{' of this shard' if shard else ''}: each worker needs a share")
    return options


def describe_load(options: BenchOptions, n: int) -> str:
    rate, c = options.rate, options.concurrency
    if options.workload == "trace":
        load = f"trace replay at {options.speed:g}x" + (f", at most {c} in flight" if c else "")
    elif rate:
        load = (f"open loop {rate:g} req/s, "
                f"{'Poisson' if options.burstiness == 1 else 'gamma burstiness ' + format(options.burstiness, 'g')}"
                + (f", at most {c} in flight" if c else ""))
    else:
        load = f"closed loop, {c} in flight"
    unit = f"conversations of {options.multi_turn} turns" if options.multi_turn > 1 else \
        f"agent sessions of {options.agent_turns} turns" if options.agent_turns else \
        "sessions" if options.workload == "sessions" else "requests"
    if options.shuffle_history:
        unit += " (history shuffled: the control)"
    return load + (f", {n} {unit}" + (f" or {options.duration_s:g} s" if options.duration_s else "")
                   + (f", {options.warmup} warm-up" if options.warmup else ""))


def build_parser(sharded: bool = False):
    """bench's and sweep's flags; `sharded` adds --shard and --start-at (bench only: a sweep's
    points run one after another)."""
    p = cli.parser(__doc__)
    cli.add_server_args(p)
    printing.add_output_args(p)
    p.add_argument("--model", default="", help="served model name (else $INFER_MODEL, else the first in /v1/models)")
    p.add_argument("-n", "--num-requests", default="", help="measured requests (else $BENCH_N, 32; a dataset's or trace's size); the cap of a --duration run")
    p.add_argument("-c", "--concurrency", default="", help="requests in flight (else $BENCH_C, 8; with --rate or --trace: a cap, none by default)")
    p.add_argument("--input-tokens", default="", help="prompt tokens, exact by the server's tokenizer (else $BENCH_IN, 2048)")
    p.add_argument("--output-tokens", default="", help="output tokens per request, forced by ignore_eos (else $BENCH_OUT, 256; a dataset's default)")
    p.add_argument("--input-dist", default="", help="prompt lengths drawn per request: fixed:N, uniform:LO,HI, normal:MEAN,SD, lognormal:P50,P95")
    p.add_argument("--output-dist", default="", help="output lengths drawn per request (same forms as --input-dist)")
    p.add_argument("--prompts", default="", help='JSONL of {"prompt": ...} or {"messages": [...]}, optional "output_tokens"')
    p.add_argument("--sharegpt", default="", help="ShareGPT conversations (JSON array or JSONL): every human turn, with its history")
    p.add_argument("--trace", default="", help="replay a Mooncake/BurstGPT JSONL trace at its own times (see --speed)")
    add_session_args(p)
    images.add_args(p)
    p.add_argument("--speed", default="", help="trace replay speed, and what recorded session gaps are divided by: "
                   "2 = twice as fast (default 1)")
    p.add_argument("--trace-block-tokens", default="", help="tokens per trace hash id (default 512, Mooncake's)")
    p.add_argument("--slo-ttft-p95-ms", default="", help="SLO: TTFT p95 at most this (else $SLO_TTFT_P95_MS)")
    p.add_argument("--slo-tpot-p95-ms", default="", help="SLO: TPOT p95 at most this (else $SLO_TPOT_P95_MS)")
    p.add_argument("--log", default="", help="append a log entry to this Markdown file (else $BENCH_LOG)")
    p.add_argument("--rate", default="", help="open loop: requests per second on an absolute schedule")
    p.add_argument("--burstiness", default="", help="open-loop gamma shape: 1 = Poisson, <1 burstier, >1 steadier (default 1)")
    p.add_argument("--duration", default="", help="stop sending after this many seconds (in-flight requests finish)")
    p.add_argument("--warmup", default="", help="warm-up requests at the same concurrency, not counted (default: the concurrency)")
    p.add_argument("--endpoint", choices=list(APIS), default="completions",
                   help="API to load: completions, chat, responses (OpenAI Responses), messages (Anthropic Messages) "
                   "stream text; embeddings and score (rerank) answer once, measured by their latency")
    p.add_argument("--documents", default="", help="score: documents paired with each request's text, each one "
                   "--input-tokens long (default 1); the pairs per second count them")
    p.add_argument("--slo-latency-p95-ms", default="", help="SLO: request latency (e2e) p95 at most this, the target of "
                   "embeddings and score (else $SLO_LATENCY_P95_MS)")
    p.add_argument("--shared-prefix", default="", help="the first K prompt tokens are the same in every request (prefix-cache case; default 0)")
    p.add_argument("--multi-turn", default="", help="chat conversations of this many turns: -n counts conversations, "
                   "each turn adds a user message of --input-tokens to the history and the answers (default 1)")
    p.add_argument("--records", default="", help="write one JSON line per request to this file")
    p.add_argument("--workers", default="", help="client processes sharing the load, when one core cannot keep up (default 1)")
    p.add_argument("--timeline-interval", default="", help="seconds between /metrics scrapes during the run (default 2; 0: none, "
                   "as each scrape costs the server a moment)")
    p.add_argument("--prometheus", default="", help="Prometheus base URL (else $PROMETHEUS): after the run, read the "
                   "GPUs' DCGM exporter series over the run's window (basic auth from $PROMETHEUS_USER and "
                   "$PROMETHEUS_PASSWORD)")
    p.add_argument("--probe", default="", help="time a trivial GET (e.g. /health) to split client-vs-engine gaps into network and server")
    p.add_argument("--seed", default="", help="seed for prompts and arrivals (default 0)")
    p.add_argument("--extra-body", default="", help="JSON object merged into every request body")
    p.add_argument("--over-limit", action="store_true", help="send requests longer than the model's max_model_len "
                   "as they are: the server's rejections are counted, with the error body's cause, as your users' "
                   "requests would be")
    if sharded:
        p.add_argument("--shard", default="", help="send part I of N of this run (0 <= I < N, as $JOB_COMPLETION_INDEX): "
                       "requests I, I+N, ..., a share of the concurrency, the run's schedule; needs --start-at and "
                       "--records, and merge.py joins the N results")
        p.add_argument("--start-at", default="", help="start the measured requests at this time, after the warm-up: "
                       "a Unix time or ISO 8601 with its zone (2026-01-01T12:00:00Z); every shard waits for it")
    p.epilog += ("\n--timeout is per request: a stream that receives nothing for that long counts as a timeout.")
    return p


def add_session_args(p) -> None:
    """The agent sessions' flags (rooflib/load/sessions.py)."""
    p.add_argument("--sessions", default="", help="replay recorded agent sessions (JSONL of turns, rooflib/load/sessions.py): "
                   "each turn resends the session's history; -n counts sessions")
    p.add_argument("--agent-turns", default="", help="synthetic agent sessions of this many turns: a first message of "
                   "--input-tokens, then a tool result of --tool-tokens every turn; -n counts sessions")
    p.add_argument("--tool-tokens", default="", help="--agent-turns: each tool result's length, as --input-dist (default 256)")
    p.add_argument("--turn-gap", default="", help="--agent-turns: seconds a session waits before each later turn (default 0)")
    p.add_argument("--shuffle-history", action="store_true", help="the control of a sessions run: each turn's "
                   "messages first, its history after them shuffled, so no prompt starts as the last one did")


VERIFY_SAMPLE = 16


def calibrate_maker(counter: TokenCounter, seed: int, run_id: str) -> workloads.PromptMaker | None:
    """Find the words that are one token each after the run's head (one tokenizer call per
    word); None when too few are, or they do not add up. The head is drawn from the run id: new
    for every run, the same in every shard of one (their prompts, a shared prefix too, are one run's)."""
    head = " ".join(random.Random(run_id).choice(WORDS) for _ in range(3))
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
