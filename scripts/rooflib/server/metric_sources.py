"""Where an engine's figures come from: its /metrics page (a base URL or the /metrics URL itself,
its size bounded), a saved scrape (or stdin), or a Prometheus server that scrapes a fleet, asked for
the same figures over a range, fleet-wide and per replica.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import httpx

from rooflib.core import conf, http_client
from rooflib.core.errors import ServerError, UsageError
from rooflib.server import fleet
from rooflib.server.metric_names import ENDPOINT_COUNTERS, ENDPOINTS, GAUGES, choose_metrics
from rooflib.server.prometheus_text import InvalidScrape
from rooflib.server.quantiles import QUANTILES


def metrics_url(url: str) -> str:
    """The /metrics URL of a server given by its base URL (or by the /metrics URL itself)."""
    url = conf.normalize_url(url)
    return url if url.endswith("/metrics") else url + "/metrics"


MAX_SCRAPE_BYTES = 256 << 20  # a vLLM scrape is ~100 KB per model; far more is not a metrics page


def scrape(url: str, api_key: str | None = None, timeout: float = 30.0,
           transport: httpx.BaseTransport | None = None) -> tuple[str, float]:
    """GET the /metrics page of `url` (a base URL or the /metrics URL); (text, unix time)."""
    target = metrics_url(url)
    base, path = target.rsplit("/", 1)
    with http_client.client(base, api_key, timeout, max_connections=1, transport=transport) as http:
        with http_client.answered(target, timeout), http.stream("GET", "/" + path) as response:
            body, size = [], 0
            for piece in response.iter_bytes():
                body.append(piece)
                size += len(piece)
                if size > MAX_SCRAPE_BYTES:
                    raise InvalidScrape(f"{target} sent more than {MAX_SCRAPE_BYTES:,} bytes: not a metrics page")
    text = b"".join(body).decode(response.encoding or "utf-8", errors="replace")
    if response.status_code == 404:
        raise ServerError(f"GET {target} answered HTTP 404: no metrics there "
                          "(vLLM serves /metrics on its API port; SGLang needs --enable-metrics)")
    if response.status_code >= 400:
        raise ServerError(f"GET {target} answered HTTP {response.status_code}: {text[:120].strip()}")
    return text, time.time()


def read_file(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"metrics file {path} does not exist: save a scrape with "
                         "`curl -s http://HOST:PORT/metrics > scrape.txt`")
    return file.read_text(encoding="utf-8", errors="replace")


def prometheus_snapshot(base_url: str, seconds: float, match: str = "",
                        auth: fleet.Credentials = fleet.Credentials(), timeout: float = 30.0,
                        transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """Ask a Prometheus server (HTTP API /api/v1/query) about the last `seconds` of a fleet.

    Returns what `difference` returns, for `report`: the fleet's figures, with the quantiles
    Prometheus computed (histogram_quantile over summed bucket rates) under `prometheus`, and
    under `replicas` the same for each instance plus its `fleet` facts (instance, job, model,
    state: up / down / not_scraped, config: its cache settings).
    """
    seconds = float(fleet.range_seconds(seconds))  # rates divide by the range that was asked about
    with fleet.Prometheus(base_url, auth, timeout, transport) as prom:
        engine, names = fleet.engine_names(prom, match)
        chosen = choose_metrics(engine, names)
        kinds = {concept: how for concept, (_, how) in GAUGES.items()}
        scope = ", ".join(part for part in (match, fleet.RANK_ZERO[engine]) if part)
        total = {key: prom.values(expr).get("") for key, expr in
                 fleet.queries(chosen, kinds, QUANTILES, seconds, scope).items()}
        each = fleet.each_value(prom, fleet.queries(chosen, kinds, QUANTILES, seconds, scope, per_instance=True))
        members = fleet.replicas(prom, _presence_metric(chosen), scope, seconds)
        configs = fleet.configs(prom, engine, names, scope, seconds)
        routes = _route_counts(prom, engine, match, seconds)
    models = sorted({m.model for m in members if m.model})
    snap = _prometheus_figures(engine, prom.url, seconds, chosen, total, models)
    _add_route_counts(snap, engine, {concept: sum(by.values()) for concept, by in routes.items()})
    snap["replicas"] = []
    for member in members:
        replica = _prometheus_figures(engine, member.instance, seconds, chosen, each.get(member.instance, {}),
                                      [member.model] if member.model else [])
        _add_route_counts(replica, engine, {concept: by[member.instance] for concept, by in routes.items()
                                            if member.instance in by})
        replica["fleet"] = {"instance": member.instance, "job": member.job, "model": member.model,
                            "state": member.state, "config": configs.get(member.instance, {})}
        snap["replicas"].append(replica)
    return snap


def _route_counts(prom: fleet.Prometheus, engine: str, match: str, seconds: float) -> dict[str, dict[str, float]]:
    """{concept: {instance: requests}} of the API server's requests by route over the range (the
    ENDPOINTS this tool reads: chat, completions, the pooling APIs). The route counter carries the
    scrape's labels (job, instance) but no engine or model label, so a --match on those finds none."""
    metric, label = ENDPOINT_COUNTERS[engine]
    sel = fleet.selector(match, **{label: "|".join(ENDPOINTS)})
    counts: dict[str, dict[str, float]] = {}
    for row in prom.query(f"sum by ({label}, instance) (increase({metric}{sel}[{fleet.range_of(seconds)}]))"):
        concept, value = ENDPOINTS.get(row["metric"].get(label, "")), float(row["value"][1])
        if concept and math.isfinite(value):
            by = counts.setdefault(concept, {})
            instance = row["metric"].get("instance", "")
            by[instance] = by.get(instance, 0.0) + value
    return counts


def _add_route_counts(snap: dict[str, Any], engine: str, counts: Mapping[str, float]) -> None:
    for concept, value in counts.items():
        snap["counters"][concept] = {"metric": ENDPOINT_COUNTERS[engine][0], "value": value, "series": 1}


def _presence_metric(chosen: dict[str, dict[str, str]]) -> str:
    """A series every replica serves all the time: the running gauge, else any chosen one."""
    if "running" in chosen["gauges"]:
        return chosen["gauges"]["running"]
    if chosen["counters"]:
        return next(iter(chosen["counters"].values()))
    if chosen["histograms"]:
        return fleet.split_series(next(iter(chosen["histograms"].values())))[0] + "_count"
    raise InvalidScrape("Prometheus holds engine series but none of the figures this tool reads")


def _prometheus_figures(engine: str, source: str, seconds: float, chosen: dict[str, dict[str, str]],
                        values: Mapping[str, float | None], models: list[str]) -> dict[str, Any]:
    snap: dict[str, Any] = {"engine": engine, "source": source, "time": time.time(), "seconds": seconds,
                            "start_time": None, "models": models, "engines": 1, "cache_config": {},
                            "histograms": {}, "counters": {}, "gauges": {}, "prometheus": {},
                            "warnings": ["quantiles from Prometheus' histogram_quantile over rate(): "
                                         "one equal to a bucket's top bound may be a floor"]}
    if len(models) > 1:
        snap["warnings"].append(f"several models ({', '.join(models)}): figures are added together; "
                                "select one with --match 'model_name=\"...\"'")
    for concept, metric in chosen["histograms"].items():
        n, mean = values.get(f"{concept}.n") or 0.0, values.get(f"{concept}.mean")
        snap["histograms"][concept] = {"metric": metric, "le": None, "counts": None,
                                       "count": n, "sum": (mean or 0.0) * n}
        snap["prometheus"][concept] = {name: values.get(f"{concept}.{name}") for name in [*QUANTILES, "mean"]}
    for concept, metric in chosen["counters"].items():
        snap["counters"][concept] = {"metric": metric, "value": values.get(f"counter.{concept}") or 0.0,
                                     "series": int(values.get(f"counter.{concept}.series") or 1)}
    for concept, metric in chosen["gauges"].items():
        value = values.get(f"gauge.{concept}")
        if value is not None:
            snap["gauges"][concept] = {"metric": metric, "value": value,
                                       "max": values.get(f"gauge.{concept}.max") or value,
                                       "peak_value": values.get(f"gauge.{concept}.peak") or value}
    return snap
