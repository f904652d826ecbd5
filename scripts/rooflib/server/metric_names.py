"""The vLLM and SGLang metric names of each concept the report reads (histograms, counters, gauges,
the API server's requests by route), each engine generation's names in order of preference, with the
sources that say what they measure; choose_metrics picks those a page or a Prometheus server has.
An engine's renamed or new metric goes here.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from rooflib.server import fleet

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


def choose_metrics(engine: str, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """For each concept, the first candidate name present: {histograms|counters|gauges: {concept: name}}."""
    present = set(names)

    def first(candidates: Sequence[str], suffix: str = "") -> str | None:
        return next((name for name in candidates if fleet.split_series(name)[0] + suffix in present), None)

    chosen = {"histograms": {c: first(n[engine], "_bucket") for c, n in HISTOGRAMS.items()},
              "counters": {c: first(n[engine]) for c, n in COUNTERS.items()},
              "gauges": {c: first(n[engine]) for c, (n, _) in GAUGES.items()}}
    return {kind: {c: name for c, name in found.items() if name} for kind, found in chosen.items()}
