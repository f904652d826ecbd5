"""What an engine's /metrics says, as a report: the latency quantiles, rates, token lengths,
utilisation and the deployment's own settings of one snapshot (since server start) or of a window
between two (snapshots.difference), with its diagnosis (rooflib/server/diagnosis.py). What it
stands on are its siblings: prometheus_text (parsing the text format), quantiles (exact histogram
quantiles), metric_names (the vLLM and SGLang names of each generation), snapshots (one scrape's
figures, their difference and merge), slo_targets, media (pooling APIs, the multimodal cache),
metric_sources (a URL, a saved file or a Prometheus server) and report_text (the report as text).
metrics.py is their command line; bench.py and rooflib/server/served.py read servers through them.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Mapping, Sequence

from rooflib.server import diagnosis, known_settings
from rooflib.server.deployment import EXPORTED, Known, Served
from rooflib.server.known_settings import bytes_text as _bytes
from rooflib.server.media import BENCH_ENDPOINT, multimodal_cache, pooling_traffic
from rooflib.server.metric_names import HISTOGRAMS, TOKEN_COUNTS
from rooflib.server.quantiles import QUANTILES, histogram_quantile, quantile_bucket
from rooflib.server.reading import Reading
from rooflib.server.slo_targets import Targets
from rooflib.server.snapshots import difference


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
           slo: Targets | None = None, served: Served | None = None,
           client_peak_in_flight: int | None = None) -> dict[str, Any]:
    """The report of one snapshot (since server start) or of a `difference` (a window), with
    its diagnosis; `served` is what a live server said about its own settings;
    `client_peak_in_flight` the most requests a bench over the window had in flight at once."""
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
        result[f"{concept}_sampled_mean"] = gauge.get("mean") if gauge else None
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
    result["client_peak_in_flight"] = client_peak_in_flight
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


def window(before: dict[str, Any], after: dict[str, Any], during: Sequence[dict[str, Any]] = (),
           gpu: Mapping[str, Any] | None = None, slo: Targets | None = None) -> dict[str, Any]:
    """The report of the interval between two snapshots (see `difference`)."""
    return report(difference(before, after, during), gpu, slo)


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


# setting -> the report's gauge of SGLang's that exports it (see metric_names.GAUGES).
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
