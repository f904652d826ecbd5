"""The passive window: /metrics of each server scraped once a second while the probe runs.

One URL may be a balancer in front of several engines: then consecutive scrapes come from
different engines (another start time, or counters that fell), and no figure of that URL may be
read as one engine's. `mixed` says so; the replicas' own URLs give figures per replica.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rooflib.core import printing
from rooflib.core.errors import ServerError
from rooflib.server import metric_sources, prometheus_text, snapshots
from rooflib.server.prometheus_text import Exposition
from rooflib.server.replicas import mixed_engines


@dataclass(frozen=True)
class Scrape:
    exposition: Exposition = field(repr=False)
    snap: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Window:
    """One server's window: its first and last scrape, every snapshot between, and why its
    scrapes cannot be one engine's ('' when they can)."""
    url: str
    first: Scrape
    last: Scrape
    snaps: tuple[dict[str, Any], ...]
    mixed: str

    @property
    def seconds(self) -> float:
        return (self.last.snap["time"] or 0) - (self.first.snap["time"] or 0)

    def delta(self) -> dict[str, Any]:
        return snapshots.difference(self.snaps[0], self.snaps[-1], self.snaps[1:-1])


def scrape(url: str, api_key: str | None, timeout: float) -> Scrape:
    text, at = metric_sources.scrape(url, api_key, timeout)
    exposition = prometheus_text.parse_exposition(text)
    return Scrape(exposition, snapshots.snapshot(exposition, url, at))


def collect(urls: Sequence[str], api_key: str | None, timeout: float, seconds: float,
            during: Callable[[], Any], doing: str = "while the probe runs"
            ) -> tuple[list[Window], Any, BaseException | None, bool]:
    """Scrape every URL, run `during()` in a thread, scrape once a second until `seconds` have
    passed and it returned, scrape again. Returns the windows, what `during` returned (or the
    exception it raised) and whether Ctrl-C ended the window early; `doing` ends the progress line."""
    firsts = [scrape(url, api_key, timeout) for url in urls]
    series: list[list[dict[str, Any]]] = [[f.snap] for f in firsts]
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = during()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, never lost
            outcome["error"] = exc
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    deadline = time.monotonic() + seconds
    printing.progress(f"measuring for {seconds:g} s {doing} (Ctrl-C ends early and still reports)...")
    interrupted = False
    lasts = firsts
    missed = 0
    try:
        while time.monotonic() < deadline or worker.is_alive():
            time.sleep(1)
            try:
                lasts = [scrape(url, api_key, timeout) for url in urls]
            except ServerError:  # a sample the server did not answer (busy, or limited): the next one may
                missed += 1
                continue
            for i, last in enumerate(lasts):
                series[i].append(last.snap)
    except KeyboardInterrupt:
        interrupted = True
    if missed:
        printing.progress(f"{missed} of the window's scrapes went unanswered; the window uses the others")
    windows = [Window(url, firsts[i], lasts[i], tuple(series[i]), mixed_engines(series[i]))
               for i, url in enumerate(urls)]
    return windows, outcome.get("value"), outcome.get("error"), interrupted
