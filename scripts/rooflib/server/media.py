"""What vLLM serves besides text generation, as the report states it: the requests of its pooling
APIs (embeddings, score, rerank, classify, pooling), which generate no token and so leave no decode
phase to judge, and its multimodal processor cache's hit rate; each with what its figures mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from rooflib.server.metric_names import POOLING_APIS


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
