"""metrics.py on what vLLM serves besides text generation: the pooling APIs' requests (embeddings,
score, rerank, classify, pooling), which generate no token, and the multimodal processor cache.

vllm-0.32-pooling.txt is written from vLLM 0.32.0's source, not recorded (its header says how); the
multimodal cases set the cache counters of the recorded vllm-0.32-after.txt.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import metrics
import pytest

from rooflib.server import engine_metrics, report_text, slo_targets, snapshots

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
MODEL = 'engine="0",model_name="tiny-qwen3"'


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def with_mm_cache(queries: int, hits: int) -> str:
    """The recorded text server's scrape with its multimodal cache counters set."""
    scrape = text("vllm-0.32-after.txt")
    for name, value in (("queries", queries), ("hits", hits)):
        series = f"vllm:mm_cache_{name}_total{{{MODEL}}}"
        scrape = scrape.replace(f"{series} 0.0", f"{series} {value}.0")
    return scrape


def with_route(scrape: str, route: str, count: int) -> str:
    """A scrape with one more http_requests_total series, for `route`."""
    return scrape + f'http_requests_total{{handler="{route}",method="POST",status="2xx"}} {count}.0\n'


def report(scrape: str, **slo: float) -> tuple[dict, str]:
    r = engine_metrics.report(snapshots.snapshot(scrape, "scrape.txt"), slo=slo_targets.Targets(**slo))
    return r, report_text.format_report(r)


@pytest.mark.parametrize("scrape, requests, only, cache", [
    # A pooling server: 24 embeddings and 8 score calls, no token generated.
    (text("vllm-0.32-pooling.txt"), {"embeddings": 24, "score": 8}, True, None),
    # Every route of the pooling APIs counts under its API (the three rerank routes as one).
    (with_route(with_route(with_route(text("vllm-0.32-pooling.txt"), "/v1/rerank", 3), "/v2/rerank", 2),
                "/classify", 5),
     {"embeddings": 24, "score": 8, "rerank": 5, "classify": 5}, True, None),
    # A text server: neither pooling nor media.
    (text("vllm-0.32-after.txt"), None, None, None),
    # Embeddings beside generation: pooling, but not only pooling.
    (with_route(text("vllm-0.32-after.txt"), "/v1/embeddings", 6), {"embeddings": 6}, False, None),
    # Images: 40 looked up in the processor cache, 30 found.
    (with_mm_cache(40, 30), None, None, (40, 30, 0.75)),
    # Looked up and never found: a rate of 0, not n/a.
    (with_mm_cache(12, 0), None, None, (12, 0, 0.0)),
])
def test_pooling_requests_and_the_multimodal_cache_are_read(scrape, requests, only, cache):
    r, said = report(scrape)
    if requests is None:
        assert r["pooling"] is None and "pooling:" not in said
    else:
        assert (r["pooling"]["requests"], r["pooling"]["total"], r["pooling"]["only"]) == \
            (requests, sum(requests.values()), only)
        assert f"pooling: {sum(requests.values())} requests" in said
    if cache is None:
        assert r["multimodal_cache"] is None and "multimodal processor cache" not in said
    else:
        queries, hits, rate = cache
        assert (r["multimodal_cache"]["queries"], r["multimodal_cache"]["hits"]) == (queries, hits)
        assert r["multimodal_cache"]["hit_rate"] == pytest.approx(rate)
        assert f"multimodal processor cache: {hits} of {queries} items hit ({rate:.1%}" in said


def test_pooling_only_traffic_has_no_token_rows_and_no_decode_finding():
    """Pooling requests generate nothing: the TPOT, ITL and decode rows are left out, TTFT is the
    whole request, and even targets of 1 ms on tokens find no decode problem or stall."""
    r, said = report(text("vllm-0.32-pooling.txt"), tpot_p95_ms=1.0, itl_p95_ms=1.0)
    table = said.split("  running")[0]
    assert re.search(r"^  TTFT ", table, re.MULTILINE) and re.search(r"^  e2e ", table, re.MULTILINE)
    for row in ("ITL", "TPOT", "decode"):
        assert not re.search(rf"^  {row} ", table, re.MULTILINE), row
    assert r["diagnosis"]["findings"] == []
    assert "stall" not in said.lower().replace("no token gap", "")
    assert "no decode phase" in r["pooling"]["meaning"]


def test_slow_pooling_requests_are_a_prefill_finding_not_a_decode_one():
    r, _ = report(text("vllm-0.32-pooling.txt"), ttft_p95_ms=10.0, tpot_p95_ms=1.0, itl_p95_ms=1.0)
    assert [f["kind"] for f in r["diagnosis"]["findings"]] == ["prefill"]
    # The proof benches the API the traffic used (most of it embeddings), with no output length.
    assert r["endpoint"] == "embeddings"
    before, after, _ = r["diagnosis"]["verify"]
    assert "--endpoint embeddings" in before and "--endpoint embeddings" in after and "BENCH_OUT" not in before


def test_a_window_counts_the_pooling_requests_and_cache_lookups_in_it():
    """Between two scrapes 6 embeddings requests came and no token was generated: only pooling."""
    before = snapshots.snapshot(with_mm_cache(10, 5))
    after = snapshots.snapshot(with_route(with_mm_cache(40, 30), "/v1/embeddings", 6))
    r = engine_metrics.report(snapshots.difference(before, after))
    assert r["pooling"]["requests"] == {"embeddings": 6} and r["pooling"]["only"]
    assert (r["multimodal_cache"]["queries"], r["multimodal_cache"]["hits"]) == (30, 25)


def test_replicas_add_their_pooling_requests():
    one = snapshots.snapshot(text("vllm-0.32-pooling.txt"), "a")
    two = snapshots.snapshot(with_route(text("vllm-0.32-pooling.txt"), "/v1/score", 4), "b")
    r = engine_metrics.report(snapshots.merge([one, two]))
    assert r["pooling"]["requests"] == {"embeddings": 48, "score": 20}


def test_json_carries_pooling_and_media_as_one_document(capsys):
    assert metrics.main(["--file", str(FIXTURES / "vllm-0.32-pooling.txt"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pooling"]["requests"] == {"embeddings": 24, "score": 8} and out["multimodal_cache"] is None
