"""What the diagnosis reads of one engine's report, typed: engine_metrics.report builds its JSON
figures, then `Reading.of` takes the ones the findings and levers judge. The JSON stays the
agent's; the diagnosis never looks anything up by a string key.

Times are milliseconds, as in the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

QUANTILE_NAMES = ("p50", "p95", "p99")


@dataclass(frozen=True)
class Latency:
    """A histogram's figures (engine_metrics._latency): its quantiles and mean, the requests it
    counted, and what is known of each quantile's place: the bucket it lies in, only a floor
    (the +Inf bucket) or only a ceiling (the first bucket; the quantile itself is then None)."""
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    n: int = 0
    bucket_ms: Mapping[str, tuple[float, float | None]] = field(default_factory=dict)
    at_least: Mapping[str, float] = field(default_factory=dict)
    at_most: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, row: Mapping[str, Any] | None) -> Latency:
        row = row or {}
        return cls(**{name: row.get(name) for name in (*QUANTILE_NAMES, "mean")}, n=row.get("n") or 0,
                   bucket_ms={name: tuple(bounds) for name, bounds in (row.get("bucket_ms") or {}).items()},
                   at_least=dict(row.get("at_least") or {}), at_most=dict(row.get("at_most") or {}))

    def quantile(self, name: str) -> float | None:
        return {"p50": self.p50, "p95": self.p95, "p99": self.p99}[name]


@dataclass(frozen=True)
class Slo:
    """The targets the findings judge against (p95, ms), and whether the user gave them."""
    ttft_p95_ms: float
    tpot_p95_ms: float
    itl_p95_ms: float
    given: bool


@dataclass(frozen=True)
class CacheConfig:
    """vLLM's vllm:cache_config_info, as engine_metrics.deployment_config reads it (all None
    where the server exports none, as SGLang does)."""
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str | None = None
    prefix_caching: bool | None = None
    max_model_len: int | None = None

    @classmethod
    def of(cls, dep: Mapping[str, Any] | None) -> CacheConfig:
        dep = dep or {}
        return cls(dep.get("block_size"), dep.get("gpu_memory_utilization"), dep.get("kv_cache_memory_bytes"),
                   dep.get("kv_cache_dtype"), {"True": True, "False": False}.get(dep.get("prefix_caching") or ""),
                   dep.get("max_model_len"))


@dataclass(frozen=True)
class Reading:
    """One engine's figures over a window (`mode` "window") or since its start ("since_start")."""
    engine: str                          # "vllm" or "sglang"
    mode: str
    seconds: float | None                # the window's length
    slo: Slo
    endpoint: str | None                 # bench's --endpoint for most requests: chat, completions, embeddings, score
    requests: int                        # finished in the window
    # Latencies of the finished requests
    queue_ms: Latency
    e2e_ms: Latency
    ttft_ms: Latency
    prefill_ms: Latency
    decode_ms: Latency
    itl_ms: Latency
    tpot_ms: Latency
    # Lengths (tokens) of the finished requests
    prompt_tokens_mean: float | None
    output_tokens_mean: float | None
    tokens_per_request: float | None     # prompt + output: the KV one request holds at its end
    # Occupancy: gauge samples, and Little's law over the window's histograms
    running_mean: float | None
    running_peak: float | None
    waiting_mean: float | None
    waiting_peak: float | None
    running_while_waiting: float | None  # the most that ran in a sample where others waited
    gauge_samples: int
    client_peak_in_flight: int | None    # a bench's own count at its busiest (None without one)
    requests_per_step: float | None
    # The KV cache
    kv_cache_tokens: int | None
    kv_cache_usage_max: float | None
    preemptions: float | None
    prefix_cache_hit_rate: float | None
    prefix_cache_queries: float | None
    # Throughput
    gen_tok_s: float | None
    bandwidth_util: float | None
    cache_config: CacheConfig

    @classmethod
    def of(cls, report: Mapping[str, Any]) -> Reading:
        """From engine_metrics.report's figures (its JSON, before the diagnosis is added)."""
        slo = report["slo"]
        return cls(
            engine=report["engine"], mode=report["mode"], seconds=report.get("seconds"),
            slo=Slo(slo["ttft_p95_ms"], slo["tpot_p95_ms"], slo["itl_p95_ms"], report.get("slo_source") == "given"),
            endpoint=report.get("endpoint"), requests=report.get("requests") or 0,
            **{name: Latency.of(report.get(name)) for name in (
                "queue_ms", "e2e_ms", "ttft_ms", "prefill_ms", "decode_ms", "itl_ms", "tpot_ms")},
            **{name: report.get(name) for name in (
                "prompt_tokens_mean", "output_tokens_mean", "tokens_per_request", "running_mean", "running_peak",
                "waiting_mean", "waiting_peak", "running_while_waiting", "client_peak_in_flight",
                "requests_per_step", "kv_cache_tokens",
                "kv_cache_usage_max", "preemptions", "prefix_cache_hit_rate", "prefix_cache_queries", "gen_tok_s",
                "bandwidth_util")},
            gauge_samples=report.get("gauge_samples") or 0,
            cache_config=CacheConfig.of(report.get("deployment")))
