"""Where the time goes: the symptom's figure split into the parts of the request path.

Each part is measured, not assumed (the probe's own timings, the engine's histograms over the
same window), and the root is the part that holds most of the figure:

  first-token  TTFT = connect + front (what a missing route pays: before routing) + route (what
               the inference route adds before the engine: a gateway, the API server's parsing
               and tokenizing) + queue + prefill (the engine's histograms) + first delivery (the
               first text held after the engine made it)
  streaming    TPOT p95 against its target (the engine's token time); else the gap between text
               arrivals = the engine's time per token x tokens per event (the engine's stream
               interval) x events per read (a layer that buffers), and what else holds text
  errors       the failed share of requests by status and route (the server's counters), the
               requests the engine aborted, and the probe's own failures
  throughput   the tokens per second against what the engine holds back (a queue while it has
               room) or the offered load
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rooflib.doctor.evidence import Engine, Failures, Fit, Probe, Segment, Setting, Stream, Targets
from rooflib.doctor.failures import failed_share, gave_up
from rooflib.server import quantiles

ABANDONED_FLOOR = 2   # requests at the window's edges can end in one counter before the other
from rooflib.server.known_settings import QUEUE_SHARE


@dataclass(frozen=True)
class Facts:
    """Everything the budgets read, gathered once (doctor.run)."""
    symptom: str
    targets: Targets
    engine: Engine
    probe: Probe
    failures: Failures
    settings: Mapping[str, Setting]
    fit: Fit | None
    fit_note: str
    url: str
    mixed: str = ""
    diagnosis: Mapping[str, Any] = field(default_factory=dict)   # the engine's own (engine_metrics.report)


@dataclass(frozen=True)
class Budget:
    """One figure of the symptom and its parts."""
    symptom: str
    figure: str
    value: float | None
    target: float | None
    unit: str                 # "ms", "share" or "tok/s"
    segments: tuple[Segment, ...]
    misses: bool
    note: str = ""

    @property
    def largest(self) -> Segment | None:
        """The part that holds most of the figure. The probe's own loop lag ("client") is time the
        doctor adds to its timestamps, no user's: the root only where nothing else is measured, else
        said beside the root."""
        users = [s for s in self.segments if s.name != "client" and s.size > 0]
        return max(users or self.segments, key=lambda s: s.size, default=None)

    def users_share(self, segment: Segment) -> float:
        """A part's share of what users wait: the figure less the probe's own loop lag, so that a
        busy machine's stalls in the doctor do not shrink the parts that are the users'."""
        lag = sum(s.size for s in self.segments if s.name == "client")
        users = (self.value or 0.0) - lag
        return segment.size / users if segment.name != "client" and users > 0 else segment.share


def median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def ok_streams(probe: Probe) -> list[Stream]:
    return [s for s in probe.streams if s.error is None and s.ttft_ms is not None]


def _segments(parts: Sequence[tuple[str, float | None, str]], total: float) -> tuple[Segment, ...]:
    return tuple(Segment(name, max(0.0, size), max(0.0, size) / total if total else 0.0, how)
                 for name, size, how in parts if size is not None)


# ---------------------------------------------------------------------------------------------
# first-token

def front_ms(probe: Probe) -> tuple[float | None, str]:
    """What every request pays before the server routes it: a missing route's time to head on a
    kept-alive connection (else /health's)."""
    for route in sorted(probe.routes, key=lambda r: r.status != 404):
        if route.reused_ms is not None:
            return route.reused_ms, f"{route.path} (HTTP {route.status}) answers its head in {route.reused_ms:.1f} ms " \
                                    "on a kept-alive connection"
    return None, "no trivial route answered"


def buffered(stream: Stream) -> bool:
    """All of a stream's text came in one read: something held it (and its head) to the end."""
    return len(stream.events_per_read) == 1 and stream.events_per_read[0] > 2


def held_ms(stream: Stream, head_ms: float | None, engine_ttft: float | None) -> float | None:
    """How long the first text waited after the engine made it: its arrival less the time to the
    head (what a buffered stream's head would have taken: `head_ms`) and the engine's mean TTFT."""
    head = head_ms if buffered(stream) else stream.head_ms
    if head is None or engine_ttft is None or stream.ttft_ms is None:
        return None
    return stream.ttft_ms - head - engine_ttft


def setup_ms(probe: Probe) -> float | None:
    """What a new connection pays after its TCP connect before its first answer, beyond a kept-alive
    one (a TLS handshake, an accept queue, a proxy's per-connection work): the least of the trivial
    routes'. Every new connection pays that cost, so the least still shows it, while a busy
    machine's stalls land on some connections only (their median once came to 1.87 s, more than
    the probe request's whole TTFT of 1.30 s)."""
    paid = [max(0.0, r.new_ms - (r.connect_ms or 0.0) - r.reused_ms) for r in probe.routes
            if r.new_ms is not None and r.reused_ms is not None]
    return min(paid) if paid else None


def engine_parts(e: Engine, room_ms: float) -> tuple[float | None, float | None, str]:
    """The engine's queue and prefill within a probe request's TTFT: the window's means, or where
    their sum is more than what the probe's own TTFT leaves after its head (the users' requests
    took longer than the probe's, as a busy machine's stalls make them), that room split in the
    window's ratio, so that the parts never outgrow the figure they divide."""
    if e.ttft_mean is None:
        return e.queue_mean, None, ""
    queue = min(e.queue_mean or 0.0, e.ttft_mean) if e.queue_mean is not None else None
    prefill = e.ttft_mean - (queue or 0.0)
    room = max(0.0, room_ms)
    if e.ttft_mean <= room:
        return queue, prefill, ""
    scale = room / e.ttft_mean  # > room >= 0 here
    return (None if queue is None else queue * scale, prefill * scale,
            f"; scaled to the probe's own {room:.0f} ms after its head (the window's engine TTFT mean, "
            f"{e.ttft_mean:.0f} ms, is longer)")


def engine_ceiling_ms(e: Engine, streams: int) -> float | None:
    """The most the engine can have taken to the first token of the median of `streams` probe
    requests: they are among the window's, so at least half of them are at or under the window's
    (streams + 1) // 2-th slowest TTFT, and that one at or under its histogram bucket's upper bound
    (None where that bucket is +Inf or no histogram was read)."""
    total = e.ttft_buckets[-1][1] if e.ttft_buckets else 0.0
    if streams < 1 or total < 1:
        return None
    rank = max(0.0, total - (streams + 1) // 2 + 1)
    bucket = quantiles.quantile_bucket(rank / total, e.ttft_buckets)
    return None if bucket is None or math.isinf(bucket[1]) else bucket[1] * 1000


def engine_spread(e: Engine, rest_ms: float | None, streams: int) -> tuple[float, float]:
    """How much of what the probe's TTFT leaves after its head, the engine's mean TTFT and its own
    loop lag is still the engine's, and up to what engine TTFT: a probe request is one of the
    window's, as slow as its p95 (one prefill stalled on a busy machine) or, where the probe's own
    requests were the window's slowest (they add to a light load), as its slowest ones; only what is
    beyond that was held outside."""
    if not rest_ms or rest_ms <= 0 or e.ttft_mean is None or e.ttft_p95 is None:
        return 0.0, e.ttft_p95 or 0.0
    ceiling = max(e.ttft_p95, engine_ceiling_ms(e, streams) or 0.0)
    return min(rest_ms, max(0.0, ceiling - e.ttft_mean)), ceiling


def grown(queue: float | None, prefill: float | None, extra_ms: float) -> tuple[float | None, float | None]:
    """Queue and prefill with `extra_ms` more, shared in their ratio."""
    engine = (queue or 0.0) + (prefill or 0.0)
    if engine <= 0:
        return queue, (prefill or 0.0) + extra_ms
    return (None if queue is None else queue * (1 + extra_ms / engine),
            None if prefill is None else prefill * (1 + extra_ms / engine))


def first_token(f: Facts) -> Budget:
    streams = ok_streams(f.probe)
    e = f.engine
    if not streams:
        return Budget("first-token", "TTFT", None, f.targets.ttft_p95_ms, "ms", (), False,
                      "no probe request streamed text: see errors")
    connect = median([s.connect_ms for s in streams]) or 0.0
    ttft = median([s.ttft_ms for s in streams]) or 0.0
    front, front_how = front_ms(f.probe)
    streamed = [s for s in streams if not buffered(s)]
    head = median([s.head_ms for s in streamed])
    setup = setup_ms(f.probe)
    route = None if head is None or front is None else head - front - (setup or 0.0)
    queue, prefill, engine_how = engine_parts(e, ttft - (head if head is not None else (front or 0.0) + (setup or 0.0)))
    held = median([held_ms(s, head if head is not None else front, e.ttft_mean) for s in streams])
    client = None if held is None else min(max(held, 0.0), f.probe.loop_lag_p95_ms or 0.0)
    held = None if held is None else held - (client or 0.0)
    slower, ceiling = engine_spread(e, held, len(streams))
    if slower:
        queue, prefill = grown(queue, prefill, slower)
        held = (held or 0.0) - slower
        engine_how += (f"; with {slower:.0f} ms more, as the probe's own request was slower in the engine than the "
                       f"window's mean (up to {ceiling:.0f} ms: " + ("its p95)" if ceiling == e.ttft_p95 else
                                                                  "the bucket of its slowest requests, the probe's)"))
    total = connect + ttft
    parts = [("connect", connect, "the probe's TCP connect, a new connection per request"),
             ("connection_setup", setup, "a trivial route's first answer on a new connection, beyond its connect and "
                                         "a kept-alive connection's answer"),
             ("front", front, front_how),
             ("route", route, f"the inference route's head took {head or 0:.1f} ms, {route or 0:.1f} ms more than "
                              "what a missing route pays"),
             ("queue", queue, "the engine's queue time over the window (its histogram's mean)" + engine_how),
             ("prefill", prefill, "the engine's TTFT less its queue time over the window" + engine_how),
             ("first_delivery", held, f"the first text came {ttft:.1f} ms after sending; the head, the engine's "
                                      f"TTFT ({e.ttft_mean or 0:.1f} ms mean, {e.ttft_p95 or 0:.1f} ms p95) and "
                                      "the probe's loop lag explain the rest"
                                      + (f"; {len(streams) - len(streamed)} of {len(streams)} streams came whole in "
                                         "one read" if len(streamed) < len(streams) else "")),
             ("client", client, f"the probe's own event loop ran up to {f.probe.loop_lag_p95_ms or 0:.1f} ms late (p95)")]
    segments = _segments(parts, total)
    outside = sum(s.size for s in segments if s.name in ("connect", "connection_setup", "front", "route",
                                                         "first_delivery"))
    p95_seen = (e.ttft_p95 or 0.0) + outside if e.ttft_p95 is not None else p95([s.ttft_ms for s in streams])
    return Budget("first-token", "TTFT (a probe request's median)", total, f.targets.ttft_p95_ms, "ms", segments,
                  bool(p95_seen and p95_seen > f.targets.ttft_p95_ms),
                  f"TTFT p95 as users see it: about {p95_seen or 0:.0f} ms (the engine's p95 plus the time outside it)")


# ---------------------------------------------------------------------------------------------
# streaming

def tokens_per_event(streams: Sequence[Stream]) -> float | None:
    """The tokens a middle event carries (the first event carries the first token, the last the rest):
    the fewest, as an API server that falls behind its client merges the events not yet read (vLLM's
    RequestOutputCollector), so a loaded one sends 64 where its interval is 32 (a probe's middle
    events of 32, 32, 64, 64 have a median of 48)."""
    middle = [t for s in streams for t in s.tokens_per_event[1:-1] if t > 0]
    if not middle:  # a short stream: its events after the first
        middle = [t for s in streams for t in s.tokens_per_event[1:] if t > 0]
    return min(middle) if middle else None


def events_per_read(streams: Sequence[Stream]) -> float | None:
    """Text events per read after the first, the median (a stream's last two events often share
    a read); a stream that came whole in one read counts all its events."""
    reads = [n for s in streams for n in s.events_per_read[1:]]
    singles = [len(s.tokens_per_event) for s in streams if buffered(s)]
    every = reads + singles
    return statistics.median(every) if every else None


def per_token_ms(f: Facts, streams: Sequence[Stream]) -> tuple[float | None, str]:
    """One token's time at the engine, p95 (the figure is a p95 gap too)."""
    if f.engine.itl_p95:
        return f.engine.itl_p95, "the engine's gap between tokens over the window, p95"
    if f.engine.itl_mean:
        return f.engine.itl_mean, "the engine's mean gap between tokens over the window"
    client = [(s.e2e_ms - s.ttft_ms) / (s.completion_tokens - 1) for s in streams
              if s.e2e_ms is not None and s.ttft_ms is not None and (s.completion_tokens or 0) > 1]
    return (max(client), "the probe's own time per token, its slowest stream") if client else (None, "no tokens timed")


def text_waits(f: Facts, streams: Sequence[Stream]) -> list[float]:
    """Every wait for text a reader sees after the first token: the gaps between reads that
    brought text, and the first text of a stream that came whole in one read, held beyond the
    engine's TTFT (its first token waited for its last)."""
    waits = [g for s in streams for g in s.text_gaps_ms]
    head = median([s.head_ms for s in streams if not buffered(s)]) or front_ms(f.probe)[0]
    for s in streams:
        held = held_ms(s, head, f.engine.ttft_mean)
        if buffered(s) and held is not None and held > 0:
            waits.append(held)
    return waits


LAG_SHARE = 0.25   # text this much slower than the engine's token pace was held on the way


def end_lag_ms(f: Facts, streams: Sequence[Stream]) -> float | None:
    """How much later the probe's streams ended than the engine's pace explains (median): the time
    from the first text to the last less the engine's mean gap between tokens times the gaps. It
    does not depend on the lengths of the traffic's requests, only on the engine's token time."""
    pace = f.engine.itl_mean
    lags = [(s.e2e_ms - s.ttft_ms) - pace * (s.completion_tokens - 1) for s in streams
            if pace and s.e2e_ms is not None and s.ttft_ms is not None and (s.completion_tokens or 0) > 1
            and not buffered(s)]
    return median(lags)


def paced_ms(f: Facts, streams: Sequence[Stream]) -> float | None:
    """The time the engine's pace gives a probe stream from its first text to its last (median)."""
    pace = f.engine.itl_mean
    return median([pace * (s.completion_tokens - 1) for s in streams if pace and (s.completion_tokens or 0) > 1])


HELD_OUTSIDE_DECODE = ("stream_interval", "delivery")


def streaming(f: Facts) -> Budget:
    """The gap between text arrivals, unless the engine's own TPOT misses its target and nothing
    outside the token time holds most of the gap: a stream interval of 32 makes the gap 32 tokens'
    time however slow each token is, so a busy machine's slow decode does not hide it."""
    gaps = text_gap(f)
    tpot = f.engine.tpot_p95
    if tpot is not None and tpot > f.targets.tpot_p95_ms and not (gaps.misses and gaps.largest is not None
                                                                  and gaps.largest.name in HELD_OUTSIDE_DECODE):
        return Budget("streaming", "TPOT p95 (the engine's time per output token)", tpot, f.targets.tpot_p95_ms,
                      "ms", (Segment("decode", tpot, 1.0, "the engine's TPOT histogram over the window"),), True)
    return gaps


def text_gap(f: Facts) -> Budget:
    e, streams = f.engine, ok_streams(f.probe)
    engine_token, how = per_token_ms(f, streams)
    waits = text_waits(f, streams)
    gap = p95(waits)
    if engine_token is None or gap is None:
        return Budget("streaming", "text gap p95 (between text arrivals)", gap, f.targets.gap_p95_ms, "ms", (), False,
                      "the probe streamed too few tokens to time the gaps")
    tpe = tokens_per_event(streams) or 1.0
    epr = events_per_read(streams) or 1.0
    batched = epr if epr >= 2 else 1.0
    # The gap is the time per token times the tokens an event carries times the events a
    # delivery brings: each factor holds its share of the gap (a stream interval of 32 holds
    # 31/32 of it whatever the time per token is), and what is left is one token's time.
    interval = gap * (tpe - 1) / tpe
    delivery = gap / tpe * (batched - 1) / batched
    per_token = gap / (tpe * batched)
    decode = min(per_token, engine_token)
    rest = per_token - decode
    lag, paced = end_lag_ms(f, streams), paced_ms(f, streams)
    client = min(rest, f.probe.loop_lag_p95_ms or 0.0)
    rest -= client
    # The text came much slower than the engine made its tokens: the rest was held on the way (a
    # layer that passes events on slower than they come, one by one), not in the engine.
    if lag is not None and paced and lag > LAG_SHARE * paced:
        delivery, rest = delivery + rest, 0.0
    stalls = rest if e.itl_p99 is not None and e.itl_mean and e.itl_p99 >= 4 * e.itl_mean else 0.0
    parts = [("decode", decode, how),
             ("stream_interval", interval, f"events carried {tpe:g} tokens each (the usage in every chunk)"),
             ("delivery", delivery, f"{epr:g} events came in each read that brought text (median); the streams "
                                    f"ended {lag or 0:.0f} ms later than the engine's token pace gives"),
             ("stalls", stalls, f"the engine's ITL p99 {e.itl_p99 or 0:.0f} ms against a mean of {e.itl_mean or 0:.0f} ms"),
             ("client", client, f"the probe's own event loop ran up to {f.probe.loop_lag_p95_ms or 0:.1f} ms late (p95)"),
             ("other", rest - stalls, "what the engine, the events and the reads do not explain")]
    return Budget("streaming", "text gap p95 (between text arrivals)", gap, f.targets.gap_p95_ms, "ms",
                  _segments(parts, gap), gap > f.targets.gap_p95_ms,
                  f"{len(waits)} waits for text over {len(streams)} probe streams")


# ---------------------------------------------------------------------------------------------
# errors

def errors(f: Facts) -> Budget:
    """The failed share: what the server counted (by status and route, aborted requests) and what
    the probe met that the server did not count (a layer in front answered it)."""
    failed, total, by = failed_share(f.failures)
    aborted = f.failures.finished.get("abort", 0.0)
    probe_failed = [s for s in f.probe.streams if s.error]
    probe_total = len(f.probe.streams)
    parts: list[tuple[str, float | None, str]] = []
    if total:
        parts += [(f"rejected: {key}", count / total, f"{count:.0f} of {total:.0f} requests on the inference routes "
                                                       "(http_requests_total)") for key, count in by.items()]
    abandoned = gave_up(f.failures)
    if total and aborted + abandoned > ABANDONED_FLOOR:
        parts.append(("aborted", (aborted + abandoned) / total, (
            f"{abandoned:.0f} of {total:.0f} requests the inference routes answered never finished in the engine "
            f"(http_requests_total against vllm:request_success_total), {aborted:.0f} aborted by the engine")))
        aborted += abandoned
    server_share = (failed + aborted) / total if total else 0.0
    probe_share = len(probe_failed) / probe_total if probe_total else 0.0
    if probe_failed and probe_share > server_share:
        kinds = sorted({s.error or "" for s in probe_failed})
        parts.append((f"probe: {', '.join(kinds)}", probe_share,
                      f"{len(probe_failed)} of {probe_total} probe requests failed, more than the server counted"))
    share = max(server_share, probe_share)
    segments = tuple(Segment(name, size, size / share if share else 0.0, how) for name, size, how in parts)
    return Budget("errors", "failed share of requests", share, f.targets.error_share, "share", segments,
                  share > f.targets.error_share,
                  f"{total:.0f} requests on the inference routes in the window (the probe's own left out)" if total
                  else "no requests of the users on the inference routes in the window: the probe's own")


# ---------------------------------------------------------------------------------------------
# throughput

def throughput(f: Facts) -> Budget:
    """What holds tokens per second back: the share of each request's time spent waiting for a
    slot (a queue while the engine could run more is its limit, not the load)."""
    e = f.engine
    if not e.e2e_mean or e.queue_mean is None:
        return Budget("throughput", "queued share (of request time)", None, QUEUE_SHARE, "share", (), False,
                      "no finished requests in the window")
    queued = e.queue_mean / e.e2e_mean
    parts = [("queue", queued, f"requests waited {e.queue_mean:.0f} ms of their {e.e2e_mean:.0f} ms "
                               f"({e.waiting_mean or 0:.1f} waiting at a time)"),
             ("offered_load", 1 - queued, f"{e.running_mean or 0:.1f} requests running at a time, "
                                          f"{e.gen_tok_s or 0:,.0f} tok/s generated")]
    return Budget("throughput", "queued share (of request time)", queued, QUEUE_SHARE, "share",
                  _segments(parts, 1.0), queued >= QUEUE_SHARE, f"{e.gen_tok_s or 0:,.0f} tok/s generated")


BUDGETS = {"first-token": first_token, "streaming": streaming, "errors": errors, "throughput": throughput}


def budgets(f: Facts) -> list[Budget]:
    """The symptom's budget; for `all`, every symptom's, those that miss their target first
    (failures before time: a failed request has no latency)."""
    if f.symptom != "all":
        return [BUDGETS[f.symptom](f)]
    found = [make(f) for make in BUDGETS.values()]
    order = {"errors": 0, "first-token": 1, "streaming": 2, "throughput": 3}
    return sorted(found, key=lambda b: (not b.misses, order[b.symptom]))
