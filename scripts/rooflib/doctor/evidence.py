"""The doctor's typed evidence: what was measured, passed one way from the probes to the verdict.

Times are milliseconds. Nothing here computes a verdict; budget.py does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SYMPTOMS = ("first-token", "streaming", "errors", "throughput", "all")
# Which side the user gives when the SLO's two figures conflict (a smaller batch: faster tokens,
# a longer queue): "queue" accepts a longer wait for faster tokens, "speed" slower tokens.
TRADE_SIDES = ("queue", "speed")


@dataclass(frozen=True)
class Targets:
    """The user's SLO: TTFT and TPOT p95, the gap between streamed text p95, the failure share."""
    ttft_p95_ms: float
    tpot_p95_ms: float
    gap_p95_ms: float
    error_share: float
    given: tuple[str, ...] = ()   # the targets the user stated (the others are the chat defaults)


@dataclass(frozen=True)
class Route:
    """A trivial route's time to the response head, on a kept-alive connection and on a new one."""
    path: str
    status: int | None
    reused_ms: float | None
    new_ms: float | None
    connect_ms: float | None
    error: str | None = None


@dataclass(frozen=True)
class Stream:
    """One streamed probe request, as the client saw it."""
    status: int | None
    error: str | None               # the error kind (request_outcome.ERROR_KINDS) or None
    detail: str                     # the error's cause, from the server's error body when it sent one
    connect_ms: float
    head_ms: float | None           # sent -> the response head
    ttft_ms: float | None           # sent -> the first text
    e2e_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    tokens_per_event: tuple[int, ...]   # tokens each text event carried
    events_per_read: tuple[int, ...]    # text events in each delivery: reads within 2 ms are one
    text_gaps_ms: tuple[float, ...]     # gaps between the deliveries of text
    request_bytes: int = 0              # the request's body
    prompt_bytes: int = 0               # its prompt text (UTF-8), the rest being the request's fields


@dataclass(frozen=True)
class Probe:
    """The short active probe: its load said in words, the trivial routes, the streams, and the
    answer to one request just over the context limit (when it was sent)."""
    load: str
    routes: tuple[Route, ...]
    streams: tuple[Stream, ...]
    over_limit: Stream | None = None
    endpoint: str = "completions"
    replica_of_stream: tuple[str | None, ...] = ()   # the replica URL that served each stream
    loop_lag_p95_ms: float | None = None  # how late the probe's own event loop woke (its timestamps are that late)


@dataclass(frozen=True)
class StatusCount:
    handler: str
    status: str     # "2xx", "4xx", "5xx" (prometheus-fastapi-instrumentator's classes) or a code
    count: float


@dataclass(frozen=True)
class Failures:
    """What failed in the window, by the server's own counters."""
    statuses: tuple[StatusCount, ...]
    finished: dict[str, float] = field(default_factory=dict)  # vLLM finished_reason -> requests
    engine_counts: bool = False   # the engine counts its finished requests (vllm:request_success_total)
    request_bytes: float = 0.0    # http_request_size_bytes over the inference routes: their sum
    sized_requests: float = 0.0   # and how many requests it counts
    admission: dict[str, float] = field(default_factory=dict)  # vLLM admission limit -> requests it turned away

    @property
    def request_bytes_mean(self) -> float | None:
        return self.request_bytes / self.sized_requests if self.sized_requests > 0 else None


@dataclass(frozen=True)
class Fit:
    """Step time against requests running: per-token time = intercept + slope x running."""
    intercept_ms: float
    slope_ms: float
    points: int
    running_low: float
    running_high: float
    r2: float


@dataclass(frozen=True)
class Engine:
    """The engine's own figures over the window (engine_metrics.report), the ones the budget reads."""
    engine: str
    seconds: float | None
    requests: int
    ttft_mean: float | None
    ttft_p95: float | None
    queue_mean: float | None
    queue_p95: float | None
    prefill_mean: float | None
    tpot_mean: float | None
    tpot_p95: float | None
    itl_mean: float | None
    itl_p95: float | None
    itl_p99: float | None
    e2e_mean: float | None
    running_mean: float | None
    running_peak: float | None
    waiting_mean: float | None
    waiting_peak: float | None
    kv_usage_max: float | None
    kv_cache_tokens: int | None
    preemptions: float | None
    prompt_tokens_mean: float | None
    output_tokens_mean: float | None
    gen_tok_s: float | None
    endpoint: str | None
    report: dict[str, Any] = field(repr=False, default_factory=dict)   # the whole report, for the JSON
    # The window's TTFT histogram: (upper bound in seconds, requests at or under it), +Inf last.
    ttft_buckets: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Setting:
    """An engine setting with its value and how it is known (deployment.Known, flattened)."""
    flag: str
    value: Any
    source: str     # exported | inferred | unknown | given
    how: str
    at_least: bool = False

    def said(self) -> str:
        if self.value is None:
            return f"{self.flag} unknown ({self.how})"
        value = f"at least {self.value:,}" if self.at_least and isinstance(self.value, int) else \
            f"{self.value:,}" if isinstance(self.value, int) and not isinstance(self.value, bool) else f"{self.value}"
        return f"{self.flag} is {value} ({self.source}: {self.how})"


@dataclass(frozen=True)
class Segment:
    """A part of the symptom's figure: its size (ms, or a share of requests for failures), its
    share of the figure, and how it was measured."""
    name: str
    size: float
    share: float
    measured: str


@dataclass(frozen=True)
class Owner:
    """Who can change a segment: an engine setting (`setting`), or a component outside the engine."""
    component: str
    setting: Setting | None = None


@dataclass(frozen=True)
class Finding:
    """A cause: the segment it explains, its owner, the value to set (or the action), why, what to
    expect, and the evidence."""
    segment: str
    cause: str
    evidence: str
    owner: Owner
    proposed: Any
    action: str
    reason: str
    effect: str
    confidence: str
