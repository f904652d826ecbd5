"""What the server says while bench.py loads it: a /metrics timeline, the client-vs-server
cross-check of TTFT and e2e, and a probe of a trivial endpoint that sizes network and proxy time.

The timeline (bench JSON "timeline", read by other tools: keep the keys):
  {"interval_s": 2.0, "samples": [{"t_s", "running", "waiting", "kv_cache_usage_perc",
   "preemptions", "prefix_cache_hit_rate", "prompt_tok_s", "generation_tok_s"}, ...]}
t_s counts from the scrape just before the run (warm-up included); preemptions are
cumulative since then; rates and the hit rate cover the interval since the previous sample;
any value may be null (not exported by this engine).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from queue import Empty
from typing import Any, Sequence

import httpx

from rooflib.core import http_client, signals
from rooflib.core.errors import ServerError, UsageError
from rooflib.server import engine_metrics

PERCENTILES = ("p50", "p95", "p99")


class Timeline:
    """Scrapes /metrics every `interval_s` from a child process until stopped, and parses the
    pages after the run: a scrape parsed in the client's process would hold the interpreter
    lock for milliseconds and delay the timestamps of arriving tokens. The scrape before the
    run opens the timeline and the scrape after it (once the server has counted the last
    tokens) closes it, so its rates add up to the run's server-side window exactly."""

    def __init__(self, base_url: str, api_key: str | None, interval_s: float):
        self.base_url, self.api_key, self.interval_s = base_url, api_key, interval_s
        self.snapshots: list[tuple[float, dict[str, Any]]] = []
        self.errors: list[str] = []
        context = multiprocessing.get_context("spawn")
        self._stop, self._pages = context.Event(), context.Queue()
        self._process: Any = None
        self._context = context
        self._start = 0.0

    def start(self, first: dict[str, Any]) -> "Timeline":
        self._start = time.monotonic()  # CLOCK_MONOTONIC: the same clock in the child
        self.snapshots.append((0.0, first))
        process = self._context.Process(
            target=scrape_pages, daemon=True, name="metrics-timeline",
            args=(self.base_url, self.api_key, self.interval_s, self._start, self._stop, self._pages))
        with signals.signals_blocked(*signals.STOP_SIGNALS):  # until the child ignores them
            process.start()
            self._process = process
        return self

    def stop(self) -> None:
        """Stop scraping and parse what was scraped."""
        if self._process is None:  # start failed: nothing runs
            return
        self._stop.set()
        pages, deadline = None, time.monotonic() + 30 + self.interval_s
        while pages is None and time.monotonic() < deadline:
            try:
                pages = self._pages.get(timeout=0.5)
            except Empty:
                if not self._process.is_alive():  # killed with the group: nothing is coming
                    break
        if pages is None:
            pages, self.errors = [], ["the scraping process sent nothing back"]
        self._process.join(5)
        for at, text, wall, error in pages:
            try:
                if error:
                    raise ServerError(error)
                self.snapshots.append((at, engine_metrics.snapshot(text, self.base_url, wall)))
            except (ServerError, UsageError, engine_metrics.InvalidScrape) as exc:
                self.errors.append(f"t={at:.1f}s: {exc}")

    def result(self, final: dict[str, Any] | None) -> dict[str, Any]:
        """The timeline document, closed by `final` (the scrape after the run)."""
        if final is not None:
            self.snapshots.append((time.monotonic() - self._start, final))
        return {"interval_s": self.interval_s, "samples": timeline_samples(self.snapshots),
                **({"errors": self.errors[:3]} if self.errors else {})}

    def during(self) -> list[dict[str, Any]]:
        return [snap for _, snap in self.snapshots]


def scrape_pages(base_url: str, api_key: str | None, interval_s: float, start: float, stop, pages) -> None:
    """The child process: GET /metrics every interval until `stop`, then send the pages
    [(t since start, text, unix time, error)] back at once."""
    # Ctrl-C or SIGTERM to the process group stops the run; the parent then stops us and takes
    # the pages. A parent that is gone (killed) leaves us an orphan: stop then too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Blocked since Timeline.start: one that came while we started up is dropped now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.STOP_SIGNALS)
    parent = os.getppid()
    got, tick = [], 1
    while not stop.wait(max(0.0, start + tick * interval_s - time.monotonic())) and os.getppid() == parent:
        at = time.monotonic() - start
        try:
            text, wall = engine_metrics.scrape(base_url, api_key, timeout=max(1.0, interval_s))
            got.append((at, text, wall, None))
        except (ServerError, UsageError) as exc:
            got.append((at, "", None, str(exc)))
        tick += 1
    pages.put(got)


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

def cross_check(delta: dict[str, Any], client: dict[str, dict[str, Any]], loop_lag_p99: float | None,
                probe: dict[str, Any] | None) -> dict[str, Any]:
    """Client TTFT/e2e percentiles against the bucket of the server's histogram (same window)
    that holds the same percentile. Within the bucket: agreement. Above it at every
    percentile: time spent outside the engine, at least `excess_ms`; below it: the server's
    histogram holds other requests too (other traffic) or the client lost time it should have
    measured. `probe` (a trivial endpoint's round trip) splits the excess into network/proxy
    and API-server time."""
    checks, findings = {}, []
    for concept, key in (("ttft", "ttft_ms"), ("e2e", "e2e_ms")):
        hist = delta["histograms"].get(concept)
        if not hist or not hist.get("counts") or not client[key].get("n"):
            continue
        buckets = list(zip(hist["le"], hist["counts"]))
        rows = {}
        for p in PERCENTILES:
            bounds = engine_metrics.quantile_bucket(int(p[1:]) / 100, buckets)
            value = client[key][p]
            if bounds is None or value is None:
                continue
            low, high = bounds[0] * 1e3, bounds[1] * 1e3
            side = "above" if value > high else "below" if value < low else "within"
            rows[p] = {"client": value, "server_bucket_ms": [low, None if high == float("inf") else high],
                       "side": side, "excess_ms": value - high if side == "above" else
                       (value - low if side == "below" else 0.0)}
        if not rows:
            continue
        sides = {r["side"] for r in rows.values()}
        checks[key] = rows
        name = "TTFT" if concept == "ttft" else "e2e"
        if sides == {"above"}:
            excess = min(r["excess_ms"] for r in rows.values())
            findings.append(outside_engine(name, excess, loop_lag_p99, probe))
        elif sides == {"below"}:
            findings.append(f"{name}: the client measured less than the engine at every percentile "
                            f"(by at least {-max(r['excess_ms'] for r in rows.values()):.1f} ms): the server's "
                            "histograms hold other traffic too, so they are not this run's")
    return {"percentiles": checks, "findings": findings}


def outside_engine(name: str, excess: float, loop_lag_p99: float | None, probe: dict[str, Any] | None) -> str:
    """Which side is off when the client is slower than the engine by `excess` ms or more."""
    text = (f"{name}: the client measured at least {excess:.1f} ms more than the engine at every "
            "percentile: time outside the engine")
    if loop_lag_p99 is not None and loop_lag_p99 >= excess:
        return text + f"; the client's own loop lag (p99 {loop_lag_p99:.1f} ms) can explain it"
    if probe and probe.get("p50_ms") is not None:
        network = probe["p50_ms"]
        rest = excess - network
        return (text + f"; a trivial request ({probe['path']}) takes {network:.1f} ms round trip, so network "
                f"and proxy explain about {min(network, excess):.1f} ms"
                + (f" and the API server (HTTP, tokenizing, detokenizing) the other {rest:.1f} ms" if rest > 0 else ""))
    return text + " (proxy, gateway, network, or the API server's HTTP and tokenizing): --probe sizes the network part"


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
