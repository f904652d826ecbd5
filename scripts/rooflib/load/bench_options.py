"""bench's and sweep's options: the flags they share, read once (flag > environment >
inference.env > default) into a frozen BenchOptions, checked as a whole, and written back out as
flags for a run on another machine.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rooflib.core import cli, conf, printing
from rooflib.core.errors import UsageError
from rooflib.load import images, shards, workloads
from rooflib.load.analysis import has_sessions
from rooflib.load.apis import APIS
from rooflib.server import fleet
from rooflib.server.slo_targets import Targets

LIMITS = {"num_requests": 1_000_000, "concurrency": 100_000, "input_tokens": 10_000_000,
          "output_tokens": 1_000_000}


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
