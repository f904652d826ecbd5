"""One scrape's figures, normalized across vLLM and SGLang (summed over engines and DP ranks, one TP
rank of each), and what snapshots make together: several replicas merged as one server, and the
difference between two scrapes of one server, a restart in between found and said, as Prometheus
treats a counter reset.
"""
from __future__ import annotations

from typing import Any, Sequence

from rooflib.core.errors import UsageError
from rooflib.server import fleet
from rooflib.server.metric_names import (
    COUNTERS,
    ENDPOINT_COUNTERS,
    ENDPOINTS,
    ENGINE_LABELS,
    GAUGES,
    HISTOGRAMS,
    choose_metrics,
)
from rooflib.server.prometheus_text import Exposition, InvalidScrape, _series_key, parse_exposition


def _engine(exposition: Exposition) -> str:
    counts = {engine: sum(1 for name in exposition.samples if name.startswith(engine + ":"))
              for engine in ENGINE_LABELS}
    if not any(counts.values()):
        example = next(iter(exposition.samples), "nothing")
        raise InvalidScrape(f"these metrics are neither vLLM's nor SGLang's (no vllm: or sglang: "
                            f"names; first is {example}): point at the engine's port, not another exporter")
    return max(counts, key=counts.get)


def _selected(engine: str, rows: list[tuple[dict[str, str], float]]) -> list[tuple[dict[str, str], float]]:
    """SGLang repeats scheduler series once per TP rank of the same DP group: keep rank 0.

    With priority scheduling it adds per-priority series beside an aggregate whose `priority`
    label is empty (seen in third-party test data of SGLang scrapes): keep the aggregate.
    """
    if engine != "sglang":
        return rows
    kept = [(labels, value) for labels, value in rows
            if labels.get("tp_rank", "0") == "0" and labels.get("attn_tp_rank", "0") == "0"]
    if any(labels.get("priority") == "" for labels, _ in kept):
        kept = [(labels, value) for labels, value in kept if labels.get("priority", "") == ""]
    return kept


def snapshot(text: str | Exposition, source: str = "", at: float | None = None) -> dict[str, Any]:
    """The normalized figures of one vLLM or SGLang scrape, summed over engines / DP ranks.

    {engine, source, time, start_time, models, engines, histograms: {concept: {metric, le,
    counts, sum, count}}, counters: {concept: {metric, value, series}}, gauges: {concept:
    {metric, value, max}}, cache_config, warnings}. `le` holds float('inf'): emit reports,
    not snapshots, as JSON.
    """
    exposition = text if isinstance(text, Exposition) else parse_exposition(text)
    engine = _engine(exposition)
    snap: dict[str, Any] = {"engine": engine, "source": source, "time": at, "histograms": {},
                            "counters": {}, "gauges": {}, "warnings": list(exposition.warnings)}
    models, engines = set(), set()
    for name, rows in exposition.samples.items():
        if name.startswith(engine + ":"):
            for labels, _ in rows:
                models.add(labels.get("model_name") or labels.get("name") or "")
                engines.add(labels.get("engine") or labels.get("dp_rank") or "")
    snap["models"] = sorted(m for m in models if m)
    snap["engines"] = max(1, len(engines - {""}))
    if len(snap["models"]) > 1:
        snap["warnings"].append(f"several models on one page ({', '.join(snap['models'])}): "
                                "their figures are added together")
    chosen = choose_metrics(engine, exposition.samples)
    for concept, metric in chosen["histograms"].items():
        snap["histograms"][concept] = _histogram(exposition, engine, metric, snap["warnings"])
    for concept, metric in chosen["counters"].items():
        rows = _selected(engine, exposition.samples[metric])
        snap["counters"][concept] = {"metric": metric, "value": sum(v for _, v in rows), "series": len(rows)}
    for concept, metric in chosen["gauges"].items():
        values = [v for _, v in _selected(engine, exposition.samples[metric])]
        if not values:
            continue
        value = sum(values) if GAUGES[concept][1] == "sum" else sum(values) / len(values)
        snap["gauges"][concept] = {"metric": metric, "value": value, "max": max(values)}
    requests_metric, route_label = ENDPOINT_COUNTERS[engine]
    for labels, value in exposition.samples.get(requests_metric, []):
        concept = ENDPOINTS.get(labels.get(route_label, ""))
        if concept:
            counter = snap["counters"].setdefault(concept, {"metric": requests_metric, "value": 0.0, "series": 0})
            counter["value"] += value
            counter["series"] += 1
    _cached_tokens_from_histograms(snap)
    info = exposition.samples.get("vllm:cache_config_info")
    snap["cache_config"] = dict(info[0][0]) if info else {}
    snap["start_time"] = _start_time(exposition, engine)
    return snap


def _cached_tokens_from_histograms(snap: dict[str, Any]) -> None:
    """SGLang counts cached prompt tokens in sglang:cached_tokens_total from the first cache hit on
    (a labelled counter's series appears at its first increment, prometheus_client's multiprocess
    mode); until then, and in any case the same figure, its prompt-token histograms give them."""
    hists = snap["histograms"]
    if "prefix_hits" in snap["counters"] or not {"prompt_len", "uncached_prompt_len"} <= set(hists):
        return
    snap["counters"]["prefix_hits"] = {
        "metric": f"{hists['prompt_len']['metric']}_sum - {hists['uncached_prompt_len']['metric']}_sum",
        "value": hists["prompt_len"]["sum"] - hists["uncached_prompt_len"]["sum"], "series": 1}


def _rows(exposition: Exposition, engine: str, metric: str, suffix: str) -> list[tuple[dict[str, str], float]]:
    """The `suffix` samples of `metric` (a family, or some series of one: fleet.split_series)."""
    family, wanted = fleet.split_series(metric)
    rows = exposition.samples.get(family + suffix, [])
    return _selected(engine, [(labels, value) for labels, value in rows
                              if all(labels.get(k) == v for k, v in wanted.items())])


def _histogram(exposition: Exposition, engine: str, metric: str, warnings: list[str]) -> dict[str, Any]:
    """Buckets of every series added up (PromQL `sum by (le)`); None counts if layouts differ."""
    series: dict[tuple, dict[float, float]] = {}
    for labels, value in _rows(exposition, engine, metric, "_bucket"):
        series.setdefault(_series_key(labels), {})[float(labels.get("le", "nan"))] = value
    layouts = {tuple(sorted(b)) for b in series.values()}
    total = {"metric": metric, "le": None, "counts": None,
             "sum": sum(v for _, v in _rows(exposition, engine, metric, "_sum")),
             "count": sum(v for _, v in _rows(exposition, engine, metric, "_count"))}
    if len(layouts) > 1:
        warnings.append(f"{metric}: engines use different buckets, so no quantiles are computed")
        return total
    if layouts:
        bounds = sorted(next(iter(layouts)))
        total["le"] = bounds
        total["counts"] = [sum(b[le] for b in series.values()) for le in bounds]
    return total


def _start_time(exposition: Exposition, engine: str) -> float | None:
    """When the server started: process_start_time_seconds, else the oldest `_created` sample."""
    starts = exposition.samples.get("process_start_time_seconds")
    if starts:
        return min(v for _, v in starts)
    created = [v for name, rows in exposition.samples.items()
               if name.startswith(engine + ":") and name.endswith("_created") for _, v in rows]
    return min(created) if created else None


def merge(snapshots: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several replicas as one server: counters and buckets added, gauges added or averaged."""
    if len(snapshots) == 1:
        return snapshots[0]
    engines = {s["engine"] for s in snapshots}
    if len(engines) > 1:
        raise UsageError("the URLs mix vLLM and SGLang servers: aggregate one engine at a time")
    merged: dict[str, Any] = {
        "engine": engines.pop(), "source": ", ".join(s["source"] for s in snapshots),
        "time": max((s["time"] for s in snapshots if s["time"] is not None), default=None),
        "start_time": min((s["start_time"] for s in snapshots if s["start_time"]), default=None),
        "models": sorted({m for s in snapshots for m in s["models"]}),
        "engines": sum(s["engines"] for s in snapshots), "histograms": {}, "counters": {}, "gauges": {},
        "cache_config": {}, "warnings": [w for s in snapshots for w in s["warnings"]],
    }
    for concept in HISTOGRAMS:
        parts = [s["histograms"][concept] for s in snapshots if concept in s["histograms"]]
        if parts:
            merged["histograms"][concept] = _add_histograms(parts, merged["warnings"])
    for concept in [*COUNTERS, *dict.fromkeys(ENDPOINTS.values())]:
        parts = [s["counters"][concept] for s in snapshots if concept in s["counters"]]
        if parts:
            merged["counters"][concept] = {"metric": parts[0]["metric"], "value": sum(p["value"] for p in parts),
                                           "series": sum(p["series"] for p in parts)}
    for concept, (_, how) in GAUGES.items():
        parts = [s["gauges"][concept] for s in snapshots if concept in s["gauges"]]
        if parts:
            values = [p["value"] for p in parts]
            merged["gauges"][concept] = {"metric": parts[0]["metric"], "max": max(p["max"] for p in parts),
                                         "value": sum(values) if how == "sum" else sum(values) / len(values)}
    return merged


def _add_histograms(parts: Sequence[dict[str, Any]], warnings: list[str]) -> dict[str, Any]:
    total = {"metric": parts[0]["metric"], "le": parts[0]["le"], "counts": parts[0]["counts"],
             "sum": sum(p["sum"] for p in parts), "count": sum(p["count"] for p in parts)}
    if any(p["le"] != total["le"] or p["counts"] is None for p in parts):
        warnings.append(f"{total['metric']}: servers use different buckets, so no quantiles are computed")
        total["le"] = total["counts"] = None
    elif total["counts"] is not None:
        total["counts"] = [sum(values) for values in zip(*(p["counts"] for p in parts))]
    return total


def difference(before: dict[str, Any], after: dict[str, Any],
               during: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What happened between two snapshots of the same server(s): counters and buckets as
    increases, gauges as at the end with their peak and mean over `before`, `during` and `after`.

    A counter that went down, or a new start time, means the server restarted in between:
    then, as Prometheus does for a counter reset, the increase is the value after the restart
    (`after` alone), and a warning says so.
    """
    if before["engine"] != after["engine"]:
        raise UsageError("the two scrapes come from different engines: compare scrapes of one server")
    delta = {key: after[key] for key in ("engine", "source", "models", "engines", "cache_config", "start_time")}
    delta["warnings"] = list(after["warnings"])
    delta["time"] = after["time"]
    delta["seconds"] = (after["time"] - before["time"]
                        if after["time"] is not None and before["time"] is not None else None)
    reset = restarted(before, after)
    if reset:
        delta["warnings"].append(f"the server restarted between the scrapes ({reset}): "
                                 "figures cover the time since the restart")
        before = {"histograms": {}, "counters": {}}
    delta["histograms"] = {}
    for concept, hist in after["histograms"].items():
        old = before["histograms"].get(concept)
        if old is None:
            delta["histograms"][concept] = hist
            continue
        if old["le"] != hist["le"] or hist["counts"] is None:
            delta["warnings"].append(f"{hist['metric']}: buckets changed between scrapes, no quantiles")
            delta["histograms"][concept] = {**hist, "le": None, "counts": None,
                                            "sum": hist["sum"] - old["sum"], "count": hist["count"] - old["count"]}
            continue
        delta["histograms"][concept] = {
            "metric": hist["metric"], "le": hist["le"],
            "counts": [a - b for a, b in zip(hist["counts"], old["counts"])],
            "sum": hist["sum"] - old["sum"], "count": hist["count"] - old["count"]}
    delta["counters"] = {concept: {**c, "value": c["value"] - before["counters"].get(concept, {"value": 0})["value"]}
                         for concept, c in after["counters"].items()}
    delta["gauges"] = {}
    sampled = [*during, after] if reset else [before, *during, after]
    for concept, gauge in after["gauges"].items():
        peak = max(s["gauges"][concept]["max"] for s in sampled if concept in s["gauges"])
        running = [s["gauges"][concept]["value"] for s in sampled if concept in s["gauges"]]
        delta["gauges"][concept] = {**gauge, "max": peak, "peak_value": max(running), "samples": len(running),
                                    "mean": sum(running) / len(running)}
    # The running count of each sample in which requests waited: its plateau is the running cap.
    delta["running_while_waiting"] = [s["gauges"]["running"]["value"] for s in sampled
                                      if "running" in s["gauges"] and s["gauges"].get("waiting", {}).get("value", 0) > 0]
    return delta


def restarted(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Why the two snapshots cannot be subtracted, or '' when they can."""
    if before["start_time"] and after["start_time"] and abs(before["start_time"] - after["start_time"]) > 1e-3:
        return "its start time changed"
    for concept, counter in after["counters"].items():
        if counter["value"] < before["counters"].get(concept, {"value": 0})["value"]:
            return f"{counter['metric']} went down"
    for concept, hist in after["histograms"].items():
        if hist["count"] < before["histograms"].get(concept, {"count": 0})["count"]:
            return f"{hist['metric']}_count went down"
    return ""
