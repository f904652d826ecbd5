"""What the server says while bench.py loads it: a /metrics timeline, the client-vs-server
cross-check of TTFT and e2e with the time outside the engine by kind, and a probe of a trivial
endpoint that splits that time into network and gateway.

The timeline (bench JSON "timeline", read by other tools: keep the keys):
  {"interval_s": 2.0, "samples": [{"t_s", "running", "waiting", "kv_cache_usage_perc",
   "preemptions", "prefix_cache_hit_rate", "prompt_tok_s", "generation_tok_s"}, ...]}
t_s counts from the scrape just before the run (warm-up included); preemptions are
cumulative since then; rates and the hit rate cover the interval since the previous sample;
any value may be null (not exported by this engine).
"""
from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from queue import Empty
from typing import Any, Sequence

import httpx

from rooflib.core import http_client, signals
from rooflib.core.errors import ServerError, UsageError
from rooflib.server import metric_sources, prometheus_text, quantiles, snapshots

PERCENTILES = ("p50", "p95", "p99")
# The longest bench waits for the timeline's first sample before it sends the load.
READY_TIMEOUT_S = 30.0
# The longest bench waits for the timeline's pages once it has told the scraping process to stop
# (plus one interval: it may be mid-scrape).
PAGES_TIMEOUT_S = 30.0


class Timeline:
    """Scrapes /metrics every `interval_s` from a child process until stopped, and parses the
    pages after the run: a scrape parsed in the client's process would hold the interpreter
    lock for milliseconds and delay the timestamps of arriving tokens. The scrape before the
    run opens the timeline and the scrape after it (once the server has counted the last
    tokens) closes it, so its rates add up to the run's server-side window exactly. start returns
    once the child has taken its first sample: a loaded machine can take seconds to start an
    interpreter, and a load shorter than that would otherwise run with no sample during it."""

    def __init__(self, base_url: str, api_key: str | None, interval_s: float):
        self.base_url, self.api_key, self.interval_s = base_url, api_key, interval_s
        self.snapshots: list[tuple[float, dict[str, Any]]] = []
        self.errors: list[str] = []
        context = multiprocessing.get_context("spawn")
        self._stop, self._ready, self._pages = context.Event(), context.Event(), context.Queue()
        self._process: Any = None
        self._context = context
        self._start = 0.0

    def start(self, first: dict[str, Any]) -> "Timeline":
        self._start = time.monotonic()  # CLOCK_MONOTONIC: the same clock in the child
        self.snapshots.append((0.0, first))
        process = self._context.Process(
            target=scrape_pages, daemon=True, name="metrics-timeline",
            args=(self.base_url, self.api_key, self.interval_s, self._start, self._stop, self._ready, self._pages))
        with signals.signals_blocked(*signals.STOP_SIGNALS):  # until the child ignores them
            process.start()
            self._process = process
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready.wait(0.5) and process.is_alive() and time.monotonic() < deadline:
            pass
        if not self._ready.is_set():
            self.errors.append(f"the scraping process took no sample in {READY_TIMEOUT_S:g} s: the run started "
                               "without it")
        return self

    def stop(self) -> None:
        """Stop scraping and parse what was scraped."""
        if self._process is None:  # start failed: nothing runs
            return
        self._stop.set()
        pages, deadline = None, time.monotonic() + PAGES_TIMEOUT_S + self.interval_s
        while pages is None and time.monotonic() < deadline:
            try:
                pages = self._pages.get(timeout=0.5)
            except Empty:
                if not self._process.is_alive():  # killed with the group: nothing is coming
                    break
        if pages is None:
            pages, self.errors = [], ["the scraping process sent nothing back"]
        else:
            self._process.join(5)  # it exits once its pages are read
        if self._process.is_alive():
            # It ignores SIGTERM, and pages it sends now, unread, hold it in the pipe's write:
            # multiprocessing would wait for it at the interpreter's exit for ever.
            self._process.kill()
        self._process.join()
        for at, text, wall, error in pages:
            try:
                if error:
                    raise ServerError(error)
                self.snapshots.append((at, snapshots.snapshot(text, self.base_url, wall)))
            except (ServerError, UsageError, prometheus_text.InvalidScrape) as exc:
                self.errors.append(f"t={at:.1f}s: {exc}")

    def result(self, final: dict[str, Any] | None) -> dict[str, Any]:
        """The timeline document, closed by `final` (the scrape after the run)."""
        if final is not None:
            self.snapshots.append((time.monotonic() - self._start, final))
        return {"interval_s": self.interval_s, "samples": timeline_samples(self.snapshots),
                **({"errors": self.errors[:3]} if self.errors else {})}

    def during(self) -> list[dict[str, Any]]:
        return [snap for _, snap in self.snapshots]


def scrape_pages(base_url: str, api_key: str | None, interval_s: float, start: float, stop, ready,
                 pages) -> None:
    """The child process: GET /metrics at once (then set `ready`) and every interval after until
    `stop`, then send the pages [(t since start, text, unix time, error)] back at once."""
    # Ctrl-C or SIGTERM to the process group stops the run; the parent then stops us and takes
    # the pages. A parent that is gone (killed) leaves us an orphan: stop then too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Blocked since Timeline.start: one that came while we started up is dropped now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.STOP_SIGNALS)
    parent = os.getppid()
    got = [_scrape_page(base_url, api_key, interval_s, start)]
    ready.set()
    tick = math.floor((time.monotonic() - start) / interval_s) + 1  # the next tick still ahead
    while not stop.wait(max(0.0, start + tick * interval_s - time.monotonic())) and os.getppid() == parent:
        got.append(_scrape_page(base_url, api_key, interval_s, start))
        tick += 1
    pages.put(got)


def _scrape_page(base_url: str, api_key: str | None, interval_s: float, start: float) -> tuple:
    at = time.monotonic() - start
    try:
        text, wall = metric_sources.scrape(base_url, api_key, timeout=max(1.0, interval_s))
        return at, text, wall, None
    except (ServerError, UsageError) as exc:
        return at, "", None, str(exc)


def _value(snap: dict[str, Any], kind: str, concept: str) -> float | None:
    entry = snap[kind].get(concept)
    return None if entry is None else entry["value"]


def timeline_samples(snapshots: Sequence[tuple[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Snapshots -> timeline samples (see the module docstring)."""
    out = []
    first = snapshots[0][1] if snapshots else None
    previous: tuple[float, dict[str, Any]] | None = None
    for t_s, snap in snapshots:
        def since(concept: str, base: dict[str, Any] | None) -> float | None:
            now = _value(snap, "counters", concept)
            then = None if base is None else _value(base, "counters", concept)
            return None if now is None or then is None else now - then

        dt = t_s - previous[0] if previous else 0.0
        base = previous[1] if previous else snap
        hits, queries = since("prefix_hits", base), since("prefix_queries", base)
        preempted = since("preemptions", first)

        def rate(concept: str) -> float | None:
            delta = since(concept, base)
            return None if delta is None else (delta / dt if dt > 0 else 0.0)
        out.append({"t_s": round(t_s, 3), "running": _value(snap, "gauges", "running"),
                    "waiting": _value(snap, "gauges", "waiting"),
                    "kv_cache_usage_perc": _value(snap, "gauges", "kv_cache_usage"),
                    "preemptions": None if preempted is None else int(preempted),
                    "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
                    "prompt_tok_s": rate("prompt_tokens"), "generation_tok_s": rate("generation_tokens")})
        previous = (t_s, snap)
    return out


# ---------------------------------------------------------------------------------------------
# Client against server

# A part of the time outside the engine smaller than this share of it is not named: noise.
MATERIAL_SHARE = 0.2
# A TTFT excess this close to the e2e one (relative) makes the two one fixed added latency
# (or closer than the client's loop lag, when that is larger).
FIXED_AGREEMENT = 0.25


def cross_check(delta: dict[str, Any], client: dict[str, Any], loop_lag_p99: float | None,
                probe: dict[str, Any] | None) -> dict[str, Any]:
    """Client TTFT/e2e percentiles against the bucket of the server's histogram (same window)
    that holds the same percentile. Within the bucket: agreement. Above it at every
    percentile: time spent outside the engine, at least `excess_ms`; below it: the server's
    histograms hold other requests too (other traffic) or the client lost time it should have
    measured. `client` holds bench's ttft_ms and e2e_ms summaries and `one_read`, the streams
    that came in one read; `probe` (a trivial endpoint's round trip) splits the time outside
    the engine (see outside_engine)."""
    checks = {}
    for concept, key in (("ttft", "ttft_ms"), ("e2e", "e2e_ms")):
        rows = _percentile_rows(delta["histograms"].get(concept), client[key])
        if rows:
            checks[key] = rows
    return {"percentiles": checks, "findings": outside_engine(delta, client, checks, loop_lag_p99, probe)}


def _percentile_rows(hist: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if not hist or not hist.get("counts") or not summary.get("n"):
        return {}
    buckets = list(zip(hist["le"], hist["counts"]))
    rows = {}
    for p in PERCENTILES:
        bounds = quantiles.quantile_bucket(int(p[1:]) / 100, buckets)
        value = summary[p]
        if bounds is None or value is None:
            continue
        low, high = bounds[0] * 1e3, bounds[1] * 1e3
        side = "above" if value > high else "below" if value < low else "within"
        rows[p] = {"client": value, "server_bucket_ms": [low, None if high == float("inf") else high],
                   "side": side, "excess_ms": value - high if side == "above" else
                   (value - low if side == "below" else 0.0)}
    return rows


def _finding(cause: str | None, size_ms: float | None, evidence: str, confidence: str, remedy: str,
             kind: str = "outside_engine") -> dict[str, Any]:
    """A finding in the diagnosis' shape; outside the engine there is no server setting to name."""
    return {"kind": kind, "cause": cause, "size_ms": size_ms, "evidence": evidence, "confidence": confidence,
            "remedy": remedy, "caused_by": None, "setting": None, "current": None, "current_source": None}


def _mean_excess(delta: dict[str, Any], client: dict[str, Any], concept: str, key: str) -> float | None:
    """Client mean minus the engine's exact mean (its histogram's sum / count), in ms."""
    hist, mean = delta["histograms"].get(concept), client[key].get("mean")
    if not hist or not hist.get("count") or mean is None:
        return None
    return mean - hist["sum"] / hist["count"] * 1e3


def outside_engine(delta: dict[str, Any], client: dict[str, Any], checks: dict[str, Any],
                   loop_lag_p99: float | None, probe: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Time outside the engine by kind, each a finding of kind outside_engine with a `cause` and
    its size in ms (differences of exact means; the percentile check is the gate):
      buffering      streams that came in one read at the end: a proxy held the tokens back, so
                     the first token waited for the last (TTFT excess beyond the e2e one);
      fixed_latency  the client is later than the engine by about the same time at the first
                     token and at the last: every request pays it once;
      network        the part of it a trivial request's round trip (--probe) explains: the
                     network and any proxy in the path;
      gateway        the rest: what only real requests pay (a gateway's auth and routing, the
                     API server's HTTP and tokenizing);
      client         the client's own event-loop lag covers the gap;
      unsplit        time outside the engine with no --probe to split it.
    Client figures below the engine's at every percentile are kind other_traffic."""
    found = _other_traffic(checks)
    ttft_excess = _mean_excess(delta, client, "ttft", "ttft_ms")
    e2e_excess = _mean_excess(delta, client, "e2e", "e2e_ms")
    buffered, streams = client.get("one_read", 0), client["ttft_ms"].get("n") or 0
    every_stream = buffered == streams > 0
    # Streams held to their end make the client's first token later than the engine's, never
    # earlier: a client ahead of the engine (its histograms hold other traffic) is no buffering.
    if buffered and ttft_excess is not None and ttft_excess > (e2e_excess or 0.0):
        found.append(_buffering(buffered, streams, ttft_excess, e2e_excess))
    # With every stream buffered, TTFT is the stream's end: only e2e can show the rest.
    gated = [key for key, rows in checks.items() if all(r["side"] == "above" for r in rows.values())
             and not (every_stream and key == "ttft_ms")]
    if not gated:
        return found
    floor = min(r["excess_ms"] for key in gated for r in checks[key].values())
    lag = _client_lag(max((x for x in (ttft_excess, e2e_excess) if x is not None), default=floor), loop_lag_p99)
    if lag is not None:
        return found + [lag]
    probed = probe is not None and probe.get("p50_ms") is not None
    # A fixed latency delays the first token (late at every percentile) as much as the last, within
    # FIXED_AGREEMENT of it or the client's own loop lag, whichever is more: the client reads each
    # clock up to that late. Streams that came in one read make first tokens later still, never the
    # last: with some, only the lower bound holds.
    agreement = max(FIXED_AGREEMENT * (e2e_excess or 0.0), loop_lag_p99 or 0.0)
    if ("ttft_ms" in gated and ttft_excess is not None and e2e_excess is not None and e2e_excess > 0
            and ttft_excess >= e2e_excess - agreement and (buffered or ttft_excess <= e2e_excess + agreement)):
        size = e2e_excess
        found.append(_finding("fixed_latency", size, (
            f"every request is about {size:.0f} ms later at the client than in the engine: its last token "
            f"{e2e_excess:.0f} ms over the engine's mean e2e, its first {ttft_excess:.0f} ms over the mean TTFT and "
            "above the engine's bucket at every percentile: a fixed added latency"),
            "high: the exact mean of the same window, and every percentile",
            "find the hop that adds it: " + ("the network and gateway findings split it" if probed
                                             else "rerun with --probe /health")))
    else:
        size = max((e2e_excess if buffered else ttft_excess) or 0.0, floor)
        if not probed:
            found.append(_finding("unsplit", size, (
                f"the client measured about {size:.0f} ms more than the engine at every percentile: time outside "
                "the engine (network, proxy, gateway, or the API server's HTTP and tokenizing)"),
                "high: every percentile", "rerun with --probe /health to split the network from the gateway"))
    return found + (_network_and_gateway(size, probe, loop_lag_p99) if probed else [])


def _client_lag(excess: float, loop_lag_p99: float | None) -> dict[str, Any] | None:
    """The client's own loop lag as the cause, when it covers the exact mean excess (not a
    percentile's margin over its bucket's bound, which can be a hair whatever the excess is: a 1 s
    delay clears a bucket bound by 2 ms)."""
    if loop_lag_p99 is None or loop_lag_p99 < excess:
        return None
    return _finding("client", excess, (
        f"the client measured about {excess:.1f} ms more than the engine on average and above it at every "
        f"percentile, and its own loop lag (p99 {loop_lag_p99:.1f} ms) can explain it"),
        "medium: the lag covers the gap", "rerun with fewer requests per client process (--workers) or on a "
        "quieter machine")


def _other_traffic(checks: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for key, rows in checks.items():
        if all(r["side"] == "below" for r in rows.values()):
            name = "TTFT" if key == "ttft_ms" else "e2e"
            found.append(_finding(None, None, (
                f"{name}: the client measured less than the engine at every percentile (by at least "
                f"{-max(r['excess_ms'] for r in rows.values()):.1f} ms): the server's histograms hold other "
                "traffic too, so they are not this run's"), "high: every percentile",
                "compare on a server this run has to itself", kind="other_traffic"))
    return found


def _buffering(buffered: int, streams: int, ttft_excess: float, e2e_excess: float | None) -> dict[str, Any]:
    return _finding("buffering", ttft_excess - (e2e_excess or 0.0), (
        f"{buffered} of {streams} streams came in one read at the end: the first token waited for the "
        f"last, TTFT {ttft_excess:.0f} ms above the engine's mean while e2e is {e2e_excess or 0:.0f} ms above"),
        "high: every stream came in one read" if buffered == streams else
        "medium: some streams only (a starved API server or a stalled client does that too)",
        # nginx: proxy_buffering, and the X-Accel-Buffering header a response can send
        # (https://nginx.org/en/docs/http/ngx_http_proxy_module.html#proxy_buffering).
        "turn off response buffering on the streaming routes (nginx: proxy_buffering off, or send "
        "X-Accel-Buffering: no)")


def _network_and_gateway(size: float, probe: dict[str, Any], loop_lag_p99: float | None) -> list[dict[str, Any]]:
    """`size` ms outside the engine split by a trivial request's round trip: what every request
    pays (network) and what only real ones do (gateway); a part under MATERIAL_SHARE is not named,
    nor a gateway the client's own loop lag covers (the client reads a real request's clocks up to
    that late, and the probe's alone on its connection)."""
    trivial = probe["p50_ms"]
    network, rest = min(trivial, size), size - trivial
    found = []
    if network >= MATERIAL_SHARE * size:
        found.append(_finding("network", network, (
            f"a trivial request ({probe['path']}) takes {trivial:.1f} ms round trip, so the network and any proxy "
            f"in the path explain about {network:.0f} of the {size:.0f} ms"), "medium: a trivial request's round trip",
            "serve from nearer the clients, or find the proxy that delays every request (the trivial one too)"))
    if rest >= MATERIAL_SHARE * size and rest > (loop_lag_p99 or 0.0):
        found.append(_finding("gateway", rest, (
            f"real requests lose {rest:.0f} ms more than a trivial one ({probe['path']} {trivial:.1f} ms): a gateway "
            "on the inference routes (auth, routing, rate limits) or the API server (HTTP, tokenizing) adds it"),
            "medium: the difference of two round trips",
            "bench the engine's own port: if the gap goes, the gateway adds it; if it stays, the API server"))
    return found


def probe(base_url: str, api_key: str | None, path: str, count: int = 20, timeout: float = 10.0) -> dict[str, Any]:
    """Round trips of a trivial GET (/health, /v1/models) on one keep-alive connection."""
    times = []
    with http_client.client(base_url, api_key, timeout, max_connections=1) as http:
        try:
            http.get(path)  # connect first: the run reuses connections too
            for _ in range(count):
                start = time.perf_counter()
                response = http.get(path)
                times.append((time.perf_counter() - start) * 1e3)
        except httpx.HTTPError as exc:
            return {"path": path, "p50_ms": None, "error": f"{type(exc).__name__}: {exc}"}
    times.sort()
    return {"path": path, "status": response.status_code, "n": len(times), "p50_ms": times[len(times) // 2],
            "min_ms": times[0], "max_ms": times[-1]}
