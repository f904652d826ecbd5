"""What an engine's /metrics says: Prometheus text parsing, the vLLM and SGLang metric names of each
generation, snapshots and their difference, exact histogram quantiles, the report with its
diagnosis (rooflib/server/diagnosis.py), and reading a URL, a saved file or a Prometheus server. metrics.py is its
command line; bench.py and rooflib/server/served.py read servers through it.
"""
from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx

from rooflib.core import conf, http_client
from rooflib.core.errors import ServerError, UsageError
from rooflib.server import diagnosis, fleet, known_settings
from rooflib.server.deployment import EXPORTED, Known, Served
from rooflib.server.known_settings import bytes_text as _bytes
from rooflib.server.known_settings import ms as _ms
from rooflib.server.known_settings import pct as _pct
from rooflib.server.known_settings import quantile_text
from rooflib.server.reading import Latency, Reading

QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


class InvalidScrape(Exception):
    """The text is not usable Prometheus metrics of vLLM or SGLang: exit 4, one line."""


@dataclass
class Exposition:
    """Samples by name: {name: [(labels, value), ...]}; `types` from `# TYPE` lines."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)')


_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _labels(line: str, start: int) -> tuple[dict[str, str], int]:
    """Parse `{a="1",b="2"}` from line[start] == '{'; return the labels and the index after '}'."""
    labels: dict[str, str] = {}
    pos = start + 1
    while True:
        while pos < len(line) and line[pos] == " ":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        match = _LABEL.match(line, pos)
        if not match:
            raise ValueError("bad label set")
        value = match.group(2)
        if "\\" in value:
            value = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)
        labels[match.group(1)] = value
        pos = match.end()
        if not match.group(3) and not line.startswith("}", pos):
            raise ValueError("bad label set")


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    match = _NAME.match(line)
    if not match:
        raise ValueError("no metric name")
    name, pos, labels = match.group(0), match.end(), {}
    if line.startswith("{", pos):
        labels, pos = _labels(line, pos)
    parts = line[pos:].split()
    if not 1 <= len(parts) <= 2 or (line[pos:pos + 1] not in (" ", "\t")):
        raise ValueError("expected a value (and an optional timestamp) after the name")
    return name, labels, float(parts[0])


def parse_exposition(text: str) -> Exposition:
    """Parse the Prometheus text format; reject what is not metrics with one clear line."""
    if not text.strip():
        raise InvalidScrape("the scrape is empty: the server sent no metrics "
                            "(vLLM with --disable-log-stats? SGLang without --enable-metrics?)")
    head = text.lstrip()[:500].lower()
    if head.startswith("<") or "<html" in head:
        raise InvalidScrape("this is an HTML page, not Prometheus metrics: point at the engine's "
                            "own port (vLLM /metrics, SGLang /metrics with --enable-metrics)")
    result = Exposition()
    not_finite: set[str] = set()
    lines = text.split("\n")
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 4 and words[1] == "TYPE":
                result.types[words[2]] = words[3].strip()
            continue
        try:
            name, labels, value = _sample(line)
        except ValueError as exc:
            cut = number == len(lines) and not text.endswith("\n")
            if cut:
                raise InvalidScrape(f"the scrape is truncated: its last line is cut ({line[:80]!r}); "
                                    "scrape again or save the whole response")
            raise InvalidScrape(f"line {number} is not Prometheus text format ({exc}): {line[:80]!r}")
        if not math.isfinite(value):  # valid in the format, but no figure: left out, and said so
            not_finite.add(name)
            continue
        result.samples.setdefault(name, []).append((labels, value))
    if not_finite:
        result.warnings.append(f"the server sent NaN or Inf for {', '.join(sorted(not_finite)[:5])}"
                               f"{' and others' if len(not_finite) > 5 else ''}: those samples are left out")
    _check_histograms(result)
    if not text.endswith("\n"):
        result.warnings.append("the scrape does not end with a newline: it may be truncated")
    return result


def _check_histograms(exposition: Exposition) -> None:
    """A histogram series without its +Inf bucket or _count means the text was cut short."""
    for family, kind in exposition.types.items():
        if kind != "histogram":
            continue
        buckets = exposition.samples.get(family + "_bucket", [])
        series = {_series_key(labels) for labels, _ in buckets}
        complete = {_series_key(labels) for labels, _ in buckets if labels.get("le") == "+Inf"}
        counted = {_series_key(labels) for labels, _ in exposition.samples.get(family + "_count", [])}
        if series - complete or series - counted:
            raise InvalidScrape(f"the scrape is truncated: histogram {family} lacks its +Inf bucket "
                                "or _count; scrape again or save the whole response")


def _series_key(labels: Mapping[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The q-quantile of cumulative (upper bound, count) buckets, as PromQL histogram_quantile.

    Linear interpolation inside the bucket (from 0 for the first one); a rank in the +Inf
    bucket returns the largest finite bound (a floor: see `quantile_bucket`); NaN when there
    are no observations, fewer than two buckets, or no +Inf bucket.
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = _prepared(buckets)
    if ordered is None:
        return math.nan
    bounds, counts = ordered
    rank = q * counts[-1]
    index = _rank_index(rank, counts)
    if index == len(counts) - 1:
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[index - 1] if index > 0 else 0.0
    below = counts[index - 1] if index > 0 else 0.0
    if counts[index] == below:  # q = 0 over an empty first bucket: Go's 0/0 gives NaN
        return math.nan
    return start + (bounds[index] - start) * (rank - below) / (counts[index] - below)


def quantile_bucket(q: float, buckets: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The (lower, upper) bounds of the bucket the q-quantile falls in; None when undefined.

    An upper bound of +Inf means histogram_quantile's value is only a floor; a lower bound of 0
    (the first bucket) means the value is interpolated from an assumed 0, so only a ceiling.
    """
    ordered = _prepared(buckets)
    if ordered is None or not 0 <= q <= 1:
        return None
    bounds, counts = ordered
    index = _rank_index(q * counts[-1], counts)
    return (bounds[index - 1] if index > 0 else min(0.0, bounds[0])), bounds[index]


def _rank_index(rank: float, counts: list[float]) -> int:
    """The first bucket whose cumulative count reaches the rank (the +Inf one is not searched)."""
    return next((i for i in range(len(counts) - 1) if counts[i] >= rank), len(counts) - 1)


def _prepared(buckets: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]] | None:
    """Sorted, merged, monotonic bounds and counts; None where Prometheus answers NaN."""
    ordered = sorted(buckets, key=lambda b: b[0])
    if not ordered or not math.isinf(ordered[-1][0]):
        return None
    bounds: list[float] = []
    counts: list[float] = []
    for bound, count in ordered:  # buckets with the same bound are added up
        if bounds and bounds[-1] == bound:
            counts[-1] += count
        else:
            bounds.append(bound)
            counts.append(count)
    if len(bounds) < 2:
        return None
    previous = counts[0]
    for i in range(1, len(counts)):  # float noise (relative 1e-12) is smoothed away
        delta = abs(counts[i] - previous)
        if delta and delta / counts[i] <= 1e-12:
            counts[i] = previous
        elif delta:
            previous = counts[i]
    for i in range(1, len(counts)):  # other decreases are forced monotonic
        counts[i] = max(counts[i], counts[i - 1])
    if counts[-1] == 0:
        return None
    return bounds, counts


HISTOGRAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "ttft": {"vllm": ("vllm:time_to_first_token_seconds",),
             "sglang": ("sglang:time_to_first_token_seconds",)},
    # vLLM's time_per_output_token_seconds measured the gap between tokens (ITL) until its
    # rename in 0.11 (PR #24110); SGLang's likewise until PR #3988/#4914.
    "itl": {"vllm": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
            "sglang": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")},
    # SGLang exports per-request TPOT from 0.5.23 on (python/sglang/srt/observability/
    # metrics_collector.py of the sglang 0.5.23 wheel); SGLang main of 2026-08 does not.
    "tpot": {"vllm": ("vllm:request_time_per_output_token_seconds",),
             "sglang": ("sglang:request_time_per_output_token_seconds",)},
    "e2e": {"vllm": ("vllm:e2e_request_latency_seconds",),
            "sglang": ("sglang:e2e_request_latency_seconds",)},
    "queue": {"vllm": ("vllm:request_queue_time_seconds",), "sglang": ("sglang:queue_time_seconds",)},
    # SGLang observes stage prefill_forward once per request, from its first forward to the end
    # of its prefill, chunks included (set_prefill_finished_time in python/sglang/srt/observability/
    # req_time_stats.py, SGLang 0.5.23 and main 2026-08): what vLLM's prefill time measures.
    "prefill": {"vllm": ("vllm:request_prefill_time_seconds",),
                "sglang": ('sglang:per_stage_req_latency_seconds{stage="prefill_forward"}',)},
    "decode": {"vllm": ("vllm:request_decode_time_seconds",), "sglang": ()},
    # Token counts of each finished request (vllm/v1/metrics/loggers.py; SGLang with
    # --collect-tokens-histogram, python/sglang/srt/metrics/collector.py) and of each engine step
    # (vLLM only: prompt tokens computed plus tokens generated), for the lengths the diagnosis
    # uses and the step size that shows max_num_batched_tokens.
    "prompt_len": {"vllm": ("vllm:request_prompt_tokens",), "sglang": ("sglang:prompt_tokens_histogram",)},
    "output_len": {"vllm": ("vllm:request_generation_tokens",), "sglang": ("sglang:generation_tokens_histogram",)},
    "step_tokens": {"vllm": ("vllm:iteration_tokens_total",), "sglang": ()},
    # The prompt tokens each finished request did not find in the radix cache (SGLang 0.5.23 and
    # main 2026-08, observe_one_finished_request in metrics_collector.py): with prompt_len, the
    # cached tokens, which sglang:cached_tokens_total counts only from the first hit on.
    "uncached_prompt_len": {"vllm": (), "sglang": ("sglang:uncached_prompt_tokens_histogram",)},
}
TOKEN_COUNTS = ("prompt_len", "output_len", "step_tokens", "uncached_prompt_len")

# The API server counts requests by route: the endpoint the traffic uses. vLLM: http_requests_total
# of prometheus-fastapi-instrumentator, label handler; SGLang (0.5.23, main 2026-08):
# sglang:http_requests_total, label endpoint, counted as a request arrives.
ENDPOINT_COUNTERS = {"vllm": ("http_requests_total", "handler"), "sglang": ("sglang:http_requests_total", "endpoint")}
# The routes of vLLM's pooling APIs and the API each serves (vLLM 0.32.0: vllm/entrypoints/pooling/
# embed/api_router.py, scoring/api_router.py, classify/api_router.py, pooling/api_router.py). Their
# requests answer once with embeddings, scores or classes and generate no token: the engine
# finishes them as stopped with their pooled output (vllm/v1/core/sched/scheduler.py).
POOLING_ROUTES = {"/v1/embeddings": "embeddings", "/score": "score", "/v1/score": "score", "/rerank": "rerank",
                  "/v1/rerank": "rerank", "/v2/rerank": "rerank", "/classify": "classify", "/pooling": "pooling"}
POOLING_APIS = tuple(dict.fromkeys(POOLING_ROUTES.values()))
ENDPOINTS = {"/v1/chat/completions": "chat_requests", "/v1/completions": "completion_requests",
             **{route: f"{api}_requests" for route, api in POOLING_ROUTES.items()}}


COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "prompt_tokens": {"vllm": ("vllm:prompt_tokens_total",), "sglang": ("sglang:prompt_tokens_total",)},
    "generation_tokens": {"vllm": ("vllm:generation_tokens_total",),
                          "sglang": ("sglang:generation_tokens_total",)},
    # SGLang calls a preemption a retraction.
    "preemptions": {"vllm": ("vllm:num_preemptions_total",),
                    "sglang": ("sglang:num_retracted_requests_total",)},
    # vLLM counts looked-up and found prompt tokens; SGLang counts cached tokens among all
    # prompt tokens (that SGLang's prompt_tokens include the cached ones is inferred).
    "prefix_queries": {"vllm": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
                       "sglang": ("sglang:prompt_tokens_total",)},
    "prefix_hits": {"vllm": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
                    "sglang": ("sglang:cached_tokens_total",)},
    # vLLM >= 0.31 with --enable-mfu-metrics (vllm/v1/metrics/perf.py, PerfMetricsProm).
    "flops": {"vllm": ("vllm:estimated_flops_per_gpu_total",), "sglang": ()},
    "read_bytes": {"vllm": ("vllm:estimated_read_bytes_per_gpu_total",), "sglang": ()},
    "write_bytes": {"vllm": ("vllm:estimated_write_bytes_per_gpu_total",), "sglang": ()},
    # Draft tokens accepted by speculative decoding (vllm/v1/spec_decode/metrics.py): a request
    # gains them beside its one token per step.
    "spec_accepted": {"vllm": ("vllm:spec_decode_num_accepted_tokens_total",), "sglang": ()},
    # vLLM's multimodal processor cache, counted in items (images, audio clips): an item found in
    # it was processed before (resized, cut into patches by the model's Hugging Face processor) and
    # is not processed again (vllm/v1/metrics/loggers.py, fed by vllm/renderers/base.py stat_mm_cache;
    # its size is --mm-processor-cache-gb, 4 GiB per API and engine process: vllm/config/multimodal.py,
    # vLLM 0.32.0).
    "mm_cache_queries": {"vllm": ("vllm:mm_cache_queries_total",), "sglang": ()},
    "mm_cache_hits": {"vllm": ("vllm:mm_cache_hits_total",), "sglang": ()},
}


# concept -> (candidates per engine, how series of several engines/ranks combine)
GAUGES: dict[str, tuple[dict[str, tuple[str, ...]], str]] = {
    "running": ({"vllm": ("vllm:num_requests_running",), "sglang": ("sglang:num_running_reqs",)}, "sum"),
    "waiting": ({"vllm": ("vllm:num_requests_waiting",), "sglang": ("sglang:num_queue_reqs",)}, "sum"),
    # vLLM's own log line averages KV usage over data-parallel engines; the max is kept too.
    "kv_cache_usage": ({"vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                        "sglang": ("sglang:token_usage",)}, "mean"),
    # Older engines only: vLLM V0's hit-rate gauge (-1 when prefix caching is off) and SGLang's
    # hit rate of the last prefill batch; used when the counters are missing.
    "prefix_hit_rate": ({"vllm": ("vllm:gpu_prefix_cache_hit_rate",), "sglang": ("sglang:cache_hit_rate",)},
                        "mean"),
    "retracted_now": ({"vllm": (), "sglang": ("sglang:num_retracted_reqs",)}, "sum"),
    "queue_latency_last_s": ({"vllm": (), "sglang": ("sglang:avg_request_queue_latency",)}, "mean"),
    "kv_capacity_tokens": ({"vllm": (), "sglang": ("sglang:max_total_num_tokens",)}, "sum"),
    # SGLang's settings as gauges (SGLang 0.5.23 and main 2026-08): the context limit and the
    # radix cache's page size, in tokens.
    "context_len": ({"vllm": (), "sglang": ("sglang:context_len",)}, "mean"),
    "page_size": ({"vllm": (), "sglang": ("sglang:page_size",)}, "mean"),
    # Throughput of the last logging interval: vLLM V0 (removed ~0.7) and SGLang; used only
    # when the token counters give no rate (a single scrape without a known start time).
    "prompt_throughput": ({"vllm": ("vllm:avg_prompt_throughput_toks_per_s",), "sglang": ()}, "sum"),
    "gen_throughput": ({"vllm": ("vllm:avg_generation_throughput_toks_per_s",),
                        "sglang": ("sglang:gen_throughput",)}, "sum"),
}


ENGINE_LABELS = {"vllm": "vLLM", "sglang": "SGLang"}


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


def choose_metrics(engine: str, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """For each concept, the first candidate name present: {histograms|counters|gauges: {concept: name}}."""
    present = set(names)

    def first(candidates: Sequence[str], suffix: str = "") -> str | None:
        return next((name for name in candidates if fleet.split_series(name)[0] + suffix in present), None)

    chosen = {"histograms": {c: first(n[engine], "_bucket") for c, n in HISTOGRAMS.items()},
              "counters": {c: first(n[engine]) for c, n in COUNTERS.items()},
              "gauges": {c: first(n[engine]) for c, (n, _) in GAUGES.items()}}
    return {kind: {c: name for c, name in found.items() if name} for kind, found in chosen.items()}


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
    increases, gauges as at the end with their peak over `before`, `during` and `after`.

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
        delta["gauges"][concept] = {**gauge, "max": peak, "peak_value": max(running), "samples": len(running)}
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


@dataclass
class Targets:
    """Latency targets (SLOs) that the prefill and decode findings are judged against; a target
    not given takes the starting default (DEFAULT_TARGETS), and `source` says which did. The ITL
    target, unless given, is ITL_PER_TPOT times the TPOT target and does not count in `source`."""
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    itl_p95_ms: float | None = None

    def resolved(self) -> dict[str, Any]:
        given = {"ttft_p95_ms": self.ttft_p95_ms, "tpot_p95_ms": self.tpot_p95_ms}
        targets = {k: v if v is not None else DEFAULT_TARGETS[k] for k, v in given.items()}
        defaulted = [k for k, v in given.items() if v is None]
        source = "given" if not defaulted else "default" if len(defaulted) == len(given) else "partly default"
        itl = self.itl_p95_ms if self.itl_p95_ms is not None else ITL_PER_TPOT * targets["tpot_p95_ms"]
        return {**targets, "itl_p95_ms": itl, "source": source, "defaulted": defaulted}


# Starting targets when the user states none (interactive chat): TTFT p95 under 2 s on a long
# prompt, TPOT p95 under 50 ms (20 tok/s per user; chat reads comfortably at 20-40 tok/s).
# They are a default to confirm with the user, never their SLO: the report says so.
DEFAULT_TARGETS = {"ttft_p95_ms": 2000.0, "tpot_p95_ms": 50.0}
# ITL counts every gap between tokens, so a stall that TPOT averages over a request shows in its
# p95: twice the TPOT target (100 ms by default, a pause a reader of streamed text notices).
ITL_PER_TPOT = 2.0


def _latency(hist: dict[str, Any] | None, precomputed: Mapping[str, float | None] | None = None) -> dict[str, Any]:
    """p50/p95/p99/mean in ms, n, the metric used, and which quantiles are only floors.

    `precomputed` holds quantiles and the mean, in seconds, that Prometheus already computed.
    """
    empty = {"p50": None, "p95": None, "p99": None, "mean": None, "n": 0, "metric": None,
             "at_least": {}, "at_most": {}, "bucket_ms": {}}
    if not hist:
        return empty
    result = {**empty, "metric": hist["metric"], "n": int(round(hist["count"]))}
    if hist["count"] > 0:
        result["mean"] = hist["sum"] / hist["count"] * 1000
    if precomputed:
        result.update({name: None if precomputed.get(name) is None else precomputed[name] * 1000
                       for name in [*QUANTILES, "mean"]})
    if hist["counts"] is not None:
        buckets = list(zip(hist["le"], hist["counts"]))
        for name, q in QUANTILES.items():
            value = histogram_quantile(q, buckets)
            result[name] = None if math.isnan(value) else value * 1000
            bucket = quantile_bucket(q, buckets)
            if result[name] is not None and bucket:
                result["bucket_ms"][name] = [bucket[0] * 1000, None if math.isinf(bucket[1]) else bucket[1] * 1000]
                if math.isinf(bucket[1]):
                    result["at_least"][name] = result[name]
                elif bucket[0] == 0:
                    # In the first bucket the interpolation starts from an assumed 0: only the
                    # bucket's upper bound is measured, so the quantile itself stays unset.
                    result["at_most"][name] = bucket[1] * 1000
                    result[name] = None
    return result


def report(snap: dict[str, Any], gpu: Mapping[str, Any] | None = None,
           slo: Targets | None = None, served: Served | None = None) -> dict[str, Any]:
    """The report of one snapshot (since server start) or of a `difference` (a window), with
    its diagnosis; `served` is what a live server said about its own settings."""
    windowed = "seconds" in snap
    seconds = snap["seconds"] if windowed else (
        snap["time"] - snap["start_time"] if snap.get("time") and snap.get("start_time") else None)
    counters, gauges = snap["counters"], snap["gauges"]

    def count(concept: str) -> float | None:
        return counters[concept]["value"] if concept in counters else None

    def per_second(concept: str) -> float | None:
        value = count(concept)
        return value / seconds if value is not None and seconds else None

    result: dict[str, Any] = {
        "kind": "metrics", "schema_version": 1,
        "engine": snap["engine"], "source": snap["source"], "models": snap["models"],
        "engines": snap["engines"], "mode": "window" if windowed else "since_start",
        "seconds": seconds, "warnings": list(snap["warnings"]),
    }
    for concept in (c for c in HISTOGRAMS if c not in TOKEN_COUNTS):
        result[f"{concept}_ms"] = _latency(snap["histograms"].get(concept), snap.get("prometheus", {}).get(concept))
    if "queue" not in snap["histograms"] and "queue_latency_last_s" in gauges:
        result["queue_ms"]["mean"] = gauges["queue_latency_last_s"]["value"] * 1000
        result["queue_ms"]["metric"] = gauges["queue_latency_last_s"]["metric"] + " (last batch)"
    for concept in ("running", "waiting"):
        gauge = gauges.get(concept)
        result[concept] = gauge["value"] if gauge else None
        result[f"{concept}_peak"] = gauge.get("peak_value", gauge["value"]) if gauge else None
    kv = gauges.get("kv_cache_usage")
    result["kv_cache_usage"] = kv["value"] if kv else None
    result["kv_cache_usage_max"] = kv["max"] if kv else None
    result["kv_cache_tokens"] = _int_or_none(snap["cache_config"].get("kv_cache_size_tokens")
                                             or gauges.get("kv_capacity_tokens", {}).get("value"))
    result["preemptions"] = count("preemptions")
    if result["preemptions"] is None and "retracted_now" in gauges:
        result["preemptions"] = gauges["retracted_now"]["value"]
    result["requests"] = result["e2e_ms"]["n"]
    result["prefix_cache_hit_rate"], result["prefix_cache_queries"] = _prefix_hit_rate(snap)
    result["prompt_tok_s"] = per_second("prompt_tokens")
    result["gen_tok_s"] = per_second("generation_tokens")
    for key, concept in (("prompt_tok_s", "prompt_throughput"), ("gen_tok_s", "gen_throughput")):
        if result[key] is None and concept in gauges:
            result[key] = gauges[concept]["value"]
            result["warnings"].append(f"{key} is {gauges[concept]['metric']}, the engine's figure "
                                      "for its last logging interval")
    result["prompt_tokens"] = count("prompt_tokens")
    result.update(_lengths(snap, result["requests"]))
    result["tokens_per_request"] = result["prompt_tokens_mean"] + (result["output_tokens_mean"] or 0) \
        if result["prompt_tokens_mean"] is not None else None
    result["requests_per_step"] = _requests_per_step(snap)
    endpoints = {name: count(f"{name}_requests") or 0 for name in ("chat", "completion")}
    result["endpoint"] = max(endpoints, key=endpoints.get).replace("completion", "completions") \
        if any(endpoints.values()) else None
    pooling, mm_cache = pooling_traffic(counters), multimodal_cache(counters)
    result["pooling"] = asdict(pooling) if pooling else None
    if pooling and pooling.only:  # the API bench loads them with (its --endpoint)
        result["endpoint"] = BENCH_ENDPOINT.get(max(pooling.requests, key=pooling.requests.get))
    result["multimodal_cache"] = asdict(mm_cache) if mm_cache else None
    # Little's law over the requests that finished: time spent running (prefill + decode) or
    # queued, divided by the interval, is the mean number running or waiting.
    busy = _running_seconds(snap["histograms"])
    result["running_mean"] = busy / seconds if busy is not None and seconds else None
    queued = snap["histograms"].get("queue")
    result["waiting_mean"] = queued["sum"] / seconds if queued and seconds else None
    result["gauge_samples"] = max((g.get("samples", 1) for g in gauges.values()), default=0)
    plateau = snap.get("running_while_waiting") or []
    result["running_while_waiting"] = max(plateau) if plateau else None
    result["running_while_waiting_samples"] = len(plateau)
    result.update(_utilisation(snap, seconds, gpu))
    if not windowed:
        result["warnings"].append("since server start: quantiles and rates mix all history; "
                                  "use --window for what happens now")
    result["deployment"] = deployment_config(snap["cache_config"], result["tokens_per_request"])
    targets = (slo or Targets()).resolved()
    result["slo"] = {k: targets[k] for k in ("ttft_p95_ms", "tpot_p95_ms", "itl_p95_ms")}
    result["slo_source"], result["slo_defaulted"] = targets["source"], targets["defaulted"]
    reading = Reading.of(result)
    settings = known_settings.settings(reading, with_gauge_settings(snap, served))
    result["settings"] = diagnosis.known_json(settings)
    if snap["engine"] == "sglang":
        result["deployment"] = sglang_deployment(settings, result["tokens_per_request"])
    if result["deployment"]:
        seqs = settings["max_num_seqs"]
        result["deployment"]["max_num_seqs"] = seqs.value
        result["deployment"]["max_num_seqs_note"] = known_settings.said(seqs) if seqs.value else f"unknown: {seqs.how}"
    result["diagnosis"] = diagnosis.diagnose(reading, settings, served.url if served else None)
    return result


@dataclass(frozen=True)
class PoolingTraffic:
    """The requests of vLLM's pooling APIs (POOLING_ROUTES), by API, as http_requests_total counts
    them: one per HTTP request (a /score or /rerank call with several documents is several engine
    requests). `only`: no token was generated (vllm:generation_tokens_total did not grow), so every
    request the engine finished was a pooling one."""
    requests: dict[str, int]
    total: int
    only: bool
    meaning: str


# What vLLM 0.32.0 observes for a request that generates no token (vllm/v1/metrics/stats.py,
# IterationStats.update_from_output and update_from_finished_request): its one output comes while
# it is prefilling, so TTFT is its time to that output, decode time (last token - first token) and
# TPOT are 0, and no inter-token gap is observed.
POOLING_MEANING = ("pooling requests answer once and generate no token: vLLM records each one's TTFT as its whole "
                   "time to the answer (the input's prefill and the pooling), its decode time and TPOT as 0 and no "
                   "ITL, so there is no decode phase and no token gap to judge; judge them by e2e latency and "
                   "requests/s (task bench --endpoint embeddings or score)")
MIXED_MEANING = ("pooling requests beside generating ones: TTFT, TPOT, decode and e2e mix both (a pooling request's "
                 "TTFT is its whole time, its TPOT and decode time 0), so bench each API apart for its own figures")


# bench's --endpoint for the pooling APIs it loads (rooflib/load/apis.py): /rerank is /score's call.
BENCH_ENDPOINT = {"embeddings": "embeddings", "score": "score", "rerank": "score"}


def pooling_traffic(counters: Mapping[str, Mapping[str, Any]]) -> PoolingTraffic | None:
    """The pooling APIs' requests in the counters, None when there were none."""
    requests = {api: int(counters[f"{api}_requests"]["value"]) for api in POOLING_APIS
                if counters.get(f"{api}_requests", {}).get("value", 0) > 0}
    if not requests:
        return None
    only = counters.get("generation_tokens", {}).get("value") == 0
    return PoolingTraffic(requests, sum(requests.values()), only, POOLING_MEANING if only else MIXED_MEANING)


@dataclass(frozen=True)
class MultimodalCache:
    """vLLM's multimodal processor cache over the window (or since start), in items (images, audio
    clips): vllm:mm_cache_hits_total / vllm:mm_cache_queries_total."""
    queries: int
    hits: int
    hit_rate: float
    meaning: str


MM_CACHE_MEANING = ("the share of the requests' images (and other media items) vLLM found already processed, so the "
                    "model's processor (resizing, cutting into patches) did not run on them again; a new image always "
                    "misses, so a low rate matters only where images repeat (one image, many questions): then "
                    "--mm-processor-cache-gb (4 GiB per API and engine process by default) is too small for them")


def multimodal_cache(counters: Mapping[str, Mapping[str, Any]]) -> MultimodalCache | None:
    """The multimodal processor cache's hit rate, None when no item was looked up."""
    queries = counters.get("mm_cache_queries", {}).get("value", 0)
    if queries <= 0:
        return None
    hits = counters.get("mm_cache_hits", {}).get("value", 0)
    return MultimodalCache(int(queries), int(hits), hits / queries, MM_CACHE_MEANING)


def _lengths(snap: dict[str, Any], requests: int) -> dict[str, Any]:
    """Mean prompt and output tokens of the requests that finished, from their own histograms;
    without them from the token counters (vLLM counts prompt tokens when it prefills them, so
    requests still running add to them; SGLang counts both when a request finishes:
    observe_one_finished_request in python/sglang/srt/metrics/collector.py)."""
    result = {"prompt_tokens_mean": None, "output_tokens_mean": None, "lengths_from": None}
    hists, counters = snap["histograms"], snap["counters"]
    if hists.get("prompt_len", {}).get("count"):
        result["prompt_tokens_mean"] = hists["prompt_len"]["sum"] / hists["prompt_len"]["count"]
        if hists.get("output_len", {}).get("count"):
            result["output_tokens_mean"] = hists["output_len"]["sum"] / hists["output_len"]["count"]
        result["lengths_from"] = hists["prompt_len"]["metric"]
    elif requests and "prompt_tokens" in counters:
        result["prompt_tokens_mean"] = counters["prompt_tokens"]["value"] / requests
        if "generation_tokens" in counters:
            result["output_tokens_mean"] = counters["generation_tokens"]["value"] / requests
        result["lengths_from"] = f"{counters['prompt_tokens']['metric']} / finished requests"
    return result


def _running_seconds(hists: Mapping[str, Any]) -> float | None:
    """The time the finished requests spent running: vLLM's prefill and decode times; SGLang has
    no decode histogram, so its e2e less its queue time (SGLang 0.5.23 and main 2026-08: e2e from
    the tokenizer's receipt, so it holds tokenizing too, a few ms a request)."""
    if "prefill" in hists and "decode" in hists:
        return hists["prefill"]["sum"] + hists["decode"]["sum"]
    if {"e2e", "queue"} <= set(hists) and hists["e2e"]["metric"].startswith("sglang:"):
        return max(0.0, hists["e2e"]["sum"] - hists["queue"]["sum"])
    return None


def _requests_per_step(snap: dict[str, Any]) -> float | None:
    """Requests in an engine step on average: vLLM observes vllm:iteration_tokens_total once per
    step that produced output (vllm/v1/engine/async_llm.py, output_handler: one IterationStats per
    EngineCoreOutputs), in which each request generated one token and the draft tokens accepted
    for it."""
    steps, generated = snap["histograms"].get("step_tokens"), snap["counters"].get("generation_tokens")
    if not steps or not steps["count"] or not generated:
        return None
    accepted = snap["counters"].get("spec_accepted", {}).get("value", 0.0)
    return (generated["value"] - accepted) / steps["count"]


def deployment_config(info: Mapping[str, str], tokens_per_request: float | None) -> dict[str, Any]:
    """The deployment's own settings that vLLM exports in vllm:cache_config_info's labels.

    kv_cache_memory_bytes is set only by an explicit --kv-cache-memory-bytes (or, on CPU, by
    VLLM_CPU_KVCACHE_SPACE) and then overrides gpu_memory_utilization (vllm/config/cache.py).
    kv_cache_max_concurrency is the number of max_model_len requests the cache holds, so their
    ratio gives max_model_len. max-num-seqs is in no metric: unknown here; report() puts in what
    the server exported or the diagnosis inferred.
    """
    if not info:
        return {}
    tokens = _int_or_none(info.get("kv_cache_size_tokens"))
    blocks, block = _int_or_none(info.get("num_gpu_blocks")), _int_or_none(info.get("block_size"))
    if tokens is None and blocks and block:
        tokens = blocks * block
    concurrency = _float_or_none(info.get("kv_cache_max_concurrency"))
    util = _float_or_none(info.get("gpu_memory_utilization"))
    explicit = _int_or_none(info.get("kv_cache_memory_bytes"))
    if explicit:
        sized_by = (f"an explicit --kv-cache-memory-bytes of {_bytes(explicit)} (on CPU also "
                    f"VLLM_CPU_KVCACHE_SPACE), which overrides gpu_memory_utilization"
                    f"{f' {util:g}' if util is not None else ''}")
    elif util is not None:
        sized_by = f"--gpu-memory-utilization {util:g}"
    else:
        sized_by = None
    return {
        "block_size": block, "num_gpu_blocks": blocks, "kv_cache_tokens": tokens,
        "kv_cache_memory_bytes": explicit, "gpu_memory_utilization": util,
        "max_concurrency_at_max_model_len": concurrency,
        "max_model_len": round(tokens / concurrency) if tokens and concurrency else None,
        "requests_of_mean_length": tokens / tokens_per_request if tokens and tokens_per_request else None,
        "mean_request_tokens": tokens_per_request,
        "kv_cache_dtype": info.get("cache_dtype"), "prefix_caching": info.get("enable_prefix_caching"),
        "kv_cache_sized_by": sized_by, "max_num_seqs": None,
        "max_num_seqs_note": "unknown: no metric exports it (vLLM defaults: "
                             + "/".join(map(str, known_settings.VLLM_DEFAULT_MAX_NUM_SEQS)) + " by platform)",
    }


# setting -> the report's gauge of SGLang's that exports it (see GAUGES).
SGLANG_GAUGE_SETTINGS = {"max_model_len": "context_len", "block_size": "page_size"}


def with_gauge_settings(snap: dict[str, Any], served: Served | None) -> Served | None:
    """`served` with the settings SGLang exports as gauges added (what the server itself
    answered wins): its context limit and page size. vLLM's come with vllm:cache_config_info."""
    gauges = snap["gauges"]
    scraped = {setting: Known(int(gauges[name]["value"]), EXPORTED, gauges[name]["metric"])
               for setting, name in SGLANG_GAUGE_SETTINGS.items() if gauges.get(name, {}).get("value", 0) >= 1}
    if not scraped:
        return served
    return Served(served.url if served else "", {**scraped, **(served.settings if served else {})})


def sglang_deployment(s: Mapping[str, Known], tokens_per_request: float | None) -> dict[str, Any]:
    """The deployment line's figures for SGLang, from what it exports: the KV pool in tokens
    (sglang:max_total_num_tokens), its page size, context limit and the settings /get_server_info gives."""
    def value(name: str) -> Any:
        return s[name].value if name in s else None
    tokens, page, length, util = (value(n) for n in ("kv_cache_tokens", "block_size", "max_model_len",
                                                     "gpu_memory_utilization"))
    if not tokens:
        return {}
    caching, cap = value("prefix_caching"), value("max_total_tokens")
    sized_by = f"--mem-fraction-static {util:g}" if util else None
    if cap and tokens >= cap:  # the cap holds only where the memory left more (known_settings.EXPLICIT_KV)
        sized_by = f"--max-total-tokens {cap:,}" + (f", within what {sized_by} leaves" if sized_by else "")
    return {
        "source": "SGLang: sglang:max_total_num_tokens and /get_server_info", "engine": "sglang",
        "block_size": page, "num_gpu_blocks": tokens // page if page else None, "kv_cache_tokens": tokens,
        "kv_cache_memory_bytes": None, "gpu_memory_utilization": util, "kv_cache_sized_by": sized_by,
        "max_concurrency_at_max_model_len": tokens / length if length else None, "max_model_len": length,
        "requests_of_mean_length": tokens / tokens_per_request if tokens_per_request else None,
        "mean_request_tokens": tokens_per_request, "kv_cache_dtype": value("cache_dtype"),
        "prefix_caching": None if caching is None else ("on" if caching else "off"), "max_num_seqs": None,
        "max_num_seqs_note": "unknown", "attention_backend": value("attention_backend"),
        "engine_version": value("engine_version"),
    }


def _float_or_none(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _int_or_none(text: Any) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _prefix_hit_rate(snap: dict[str, Any]) -> tuple[float | None, float | None]:
    queries = snap["counters"].get("prefix_queries", {}).get("value")
    hits = snap["counters"].get("prefix_hits", {}).get("value")
    if queries is not None and hits is not None:
        return (hits / queries if queries > 0 else None), queries
    gauge = snap["gauges"].get("prefix_hit_rate")
    if gauge and gauge["value"] >= 0:  # vLLM V0 reports -1 when prefix caching is off
        return gauge["value"], None
    return None, None


def _utilisation(snap: dict[str, Any], seconds: float | None, gpu: Mapping[str, Any] | None) -> dict[str, Any]:
    """MFU and bandwidth utilisation from vLLM's estimated FLOPs and bytes per GPU."""
    result = {"gpu": gpu.get("name") if gpu else None, "mfu": None, "bandwidth_util": None,
              "tflops_per_gpu": None, "tb_s_per_gpu": None}
    flops = snap["counters"].get("flops")
    if not flops or not seconds or flops["value"] <= 0:
        return result
    per_gpu = 1 / (seconds * max(1, flops["series"]))  # the counters are per GPU, one per engine
    moved = sum(snap["counters"][c]["value"] for c in ("read_bytes", "write_bytes") if c in snap["counters"])
    result["tflops_per_gpu"] = flops["value"] * per_gpu / 1e12
    result["tb_s_per_gpu"] = moved * per_gpu / 1e12
    if gpu and gpu.get("bf16_dense_tflops"):
        result["mfu"] = result["tflops_per_gpu"] / gpu["bf16_dense_tflops"]
    if gpu and gpu.get("bandwidth_tb_s"):
        result["bandwidth_util"] = result["tb_s_per_gpu"] / gpu["bandwidth_tb_s"]
    return result


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _kv_size(r: dict[str, Any]) -> str:
    return f" of {r['kv_cache_tokens']:,} tokens" if r.get("kv_cache_tokens") else ""


def window(before: dict[str, Any], after: dict[str, Any], during: Sequence[dict[str, Any]] = (),
           gpu: Mapping[str, Any] | None = None, slo: Targets | None = None) -> dict[str, Any]:
    """The report of the interval between two snapshots (see `difference`)."""
    return report(difference(before, after, during), gpu, slo)


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


ROWS = [("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "e2e"), ("queue", "queue"),
        ("prefill", "prefill"), ("decode", "decode")]
# Rows that only generated tokens fill: left out when every request was a pooling one.
GENERATION_ROWS = ("itl", "tpot", "decode")


def format_report(r: dict[str, Any]) -> str:
    where = r["source"] + (f" ({', '.join(r['models'])})" if r["models"] else "")
    if r["mode"] == "window":
        span = f"over {r['seconds']:g} s" if r["seconds"] else "between two scrapes"
    else:
        span = "since server start" + (f" ({_uptime(r['seconds'])} ago)" if r["seconds"] else "")
    lines = [f"{ENGINE_LABELS[r['engine']]} at {where}, {span}"
             + (f", {r['engines']} engines" if r["engines"] > 1 else "")]
    lines.append(f"  {'':8}{'p50':>10}{'p95':>10}{'p99':>10}{'mean':>10}{'n':>8}  metric")
    pooling_only = bool(r.get("pooling") and r["pooling"]["only"])
    for concept, label in ROWS:
        row = r[f"{concept}_ms"]
        if row["metric"] is None or (pooling_only and concept in GENERATION_ROWS):
            continue
        cells = "".join(f"{quantile_text(Latency.of(row), q):>10}" for q in QUANTILES)
        lines.append(f"  {label:8}{cells}{_ms(row['mean']):>10}{row['n']:>8}  {row['metric']}")
    lines.append(
        f"  running {_gauge(r, 'running')}, waiting {_gauge(r, 'waiting')}"
        f", KV cache {_pct(r['kv_cache_usage'])} (max {_pct(r['kv_cache_usage_max'])}{_kv_size(r)})"
        f", preemptions {_num(r['preemptions'])}, prefix-cache hits {_pct(r['prefix_cache_hit_rate'])}")
    lengths = (f" of {_rate(r['prompt_tokens_mean'])} prompt + {_rate(r['output_tokens_mean'])} output tokens "
               f"on average ({r['lengths_from']})") if r["prompt_tokens_mean"] is not None else ""
    lines.append(f"  prompt {_rate(r['prompt_tok_s'])} tok/s, generation {_rate(r['gen_tok_s'])} tok/s, "
                 f"{r['requests']} requests finished{lengths}")
    lines += _media_lines(r)
    if r["tflops_per_gpu"] is not None:
        on = f" of {r['gpu']}" if r["gpu"] else " (pass --gpu for MFU)"
        lines.append(f"  per GPU {r['tflops_per_gpu']:.3g} TFLOP/s, {r['tb_s_per_gpu'] * 1000:.3g} GB/s: "
                     f"MFU {_pct(r['mfu'])}, bandwidth {_pct(r['bandwidth_util'])}{on}")
    if r.get("deployment"):
        lines.append(_deployment_line(r["deployment"]))
    for warning in r["warnings"]:
        lines.append(f"  note: {warning}")
    lines.append(_targets_line(r))
    lines += diagnosis.format_diagnosis(r["diagnosis"])
    return "\n".join(lines)


def _media_lines(r: dict[str, Any]) -> list[str]:
    """The pooling APIs' requests and what their latencies mean; the multimodal processor cache."""
    lines = []
    pooling, cache = r.get("pooling"), r.get("multimodal_cache")
    if pooling:
        routes = ", ".join(f"{api} {count:,}" for api, count in pooling["requests"].items())
        lines.append(f"  pooling: {pooling['total']:,} requests ({routes}; http_requests_total): {pooling['meaning']}")
    if cache:
        lines.append(f"  multimodal processor cache: {cache['hits']:,} of {cache['queries']:,} items hit "
                     f"({_pct(cache['hit_rate'])}; vllm:mm_cache_hits_total / vllm:mm_cache_queries_total): "
                     f"{cache['meaning']}")
    return lines


def _deployment_line(dep: dict[str, Any]) -> str:
    """The deployment's own settings, as vllm:cache_config_info (or SGLang) exports them."""
    parts, engine = [], dep.get("engine", "vllm")
    if dep["kv_cache_tokens"]:
        unit = "pages" if engine == "sglang" else "blocks"
        blocks = f" ({dep['num_gpu_blocks']:,} {unit} of {dep['block_size']})" if dep["num_gpu_blocks"] else ""
        parts.append(f"KV cache {dep['kv_cache_tokens']:,} tokens{blocks}"
                     + (f" sized by {dep['kv_cache_sized_by']}" if dep["kv_cache_sized_by"] else ""))
    if dep["requests_of_mean_length"] is not None:
        parts.append(f"{dep['requests_of_mean_length']:.1f} requests of the mean length "
                     f"({dep['mean_request_tokens']:,.0f} tokens)")
    if dep["max_concurrency_at_max_model_len"] is not None:
        limit = "context-length" if engine == "sglang" else "max-model-len"
        parts.append(f"{dep['max_concurrency_at_max_model_len']:,.1f} requests at {limit} {dep['max_model_len'] or 'n/a'}")
    cache = "radix cache" if engine == "sglang" else "prefix caching"
    parts.append(f"KV dtype {dep['kv_cache_dtype'] or 'n/a'}, {cache} {dep['prefix_caching'] or 'n/a'}")
    parts.append(f"{known_settings.FLAGS[engine]['seqs'].lstrip('-')} {dep['max_num_seqs_note']}")
    if engine == "sglang":
        parts.append(f"attention backend {dep['attention_backend'] or 'n/a'}, SGLang {dep['engine_version'] or 'n/a'}")
    return f"  deployment ({dep.get('source', 'vllm:cache_config_info')}): " + "; ".join(parts)


def _targets_line(r: dict[str, Any]) -> str:
    slo = r["slo"]
    text = (f"  targets: TTFT p95 {_ms(slo['ttft_p95_ms'])}, TPOT p95 {_ms(slo['tpot_p95_ms'])}, "
            f"ITL p95 {_ms(slo['itl_p95_ms'])}")
    if r["slo_source"] == "given":
        return text + " (given)"
    return (text + f" ({'starting defaults' if r['slo_source'] == 'default' else 'partly starting defaults: '}"
            f"{'' if r['slo_source'] == 'default' else ', '.join(r['slo_defaulted'])}"
            " for interactive chat, not your SLO: confirm them with the user, or pass --slo-ttft-p95-ms "
            "and --slo-tpot-p95-ms)")


def format_replica_line(r: dict[str, Any]) -> str:
    state = f" ({r['state'].upper()})" if r.get("state", "up") != "up" else ""
    ttft, itl = quantile_text(Latency.of(r["ttft_ms"]), "p95"), quantile_text(Latency.of(r["itl_ms"]), "p95")
    return (f"  {r['source']}{state}: TTFT p95 {ttft}, ITL p95 {itl}, "
            f"running {_num(r['running'])}, waiting {_num(r['waiting'])}, KV {_pct(r['kv_cache_usage'])}, "
            f"preemptions {_num(r['preemptions'])}, findings: "
            f"{', '.join(f['kind'] for f in r['diagnosis']['findings']) or 'none'}")


def _gauge(r: dict[str, Any], name: str) -> str:
    """`waiting 0 (peak 0 in 2 samples; mean 3.9 by the queue-time histogram: ...)`: the value
    at the last scrape, the peak of the sampled values, and the Little's-law mean, which comes
    from the histograms of finished requests and so counts moments the samples missed."""
    extra = []
    samples = r.get("gauge_samples") or 1
    if r["mode"] == "window" and r[name + "_peak"] is not None:
        extra.append(f"peak {r[name + '_peak']:g} in {samples} sample{'s' if samples > 1 else ''}")
    mean = r[name + "_mean"]
    if mean is not None:
        source = "queue-time" if name == "waiting" else "prefill + decode time"
        over = "over the window" if r["mode"] == "window" else "since start"
        extra.append(f"mean {mean:.2g} {over} by the {source} histograms")
    text = _num(r[name]) + (" at the last scrape" if extra else "")
    if extra:
        text += f" ({'; '.join(extra)}"
        peak = r[name + "_peak"] if r["mode"] == "window" else r[name]
        missed = mean is not None and peak is not None and mean > peak
        text += ": the samples missed the busy moments)" if missed else ")"
    return text


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _uptime(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
