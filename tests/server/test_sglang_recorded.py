"""What live SGLang servers answered, read without a server: /metrics and /get_server_info recorded
from SGLang main of 2026-08 and the released 0.5.23 (their CPU engines serving tiny-qwen3; the
headers of tests/fixtures/metrics/sglang-*-cpu.txt say how). The live checks are in
test_sglang_live.py; these keep what differs between the two versions read the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rooflib.server import deployment, engine_metrics, prefix_probe, report_text, snapshots

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
VERSIONS = ("main-2026-08", "0.5.23")


def scrape(version: str) -> str:
    return (FIXTURES / f"sglang-{version}-cpu.txt").read_text()


def server_info(version: str) -> dict:
    return json.loads((FIXTURES / f"sglang-{version}-cpu-get_server_info.json").read_text())


@pytest.mark.parametrize("version", VERSIONS)
def test_each_version_is_read_with_its_per_request_histograms(version):
    r = engine_metrics.report(snapshots.snapshot(scrape(version)))
    assert r["engine"] == "sglang" and r["requests"] == r["ttft_ms"]["n"] > 0
    # Stage prefill_forward of the per-stage histogram is the prefill time of each request.
    assert r["prefill_ms"]["metric"] == 'sglang:per_stage_req_latency_seconds{stage="prefill_forward"}'
    assert r["prefill_ms"]["n"] == r["queue_ms"]["n"] > 0
    # Per-request TPOT: 0.5.23 exports it, SGLang main of 2026-08 not.
    assert (r["tpot_ms"]["metric"] == "sglang:request_time_per_output_token_seconds") == (version == "0.5.23")
    assert r["kv_cache_tokens"] > 0 and r["lengths_from"] == "sglang:prompt_tokens_histogram"


def test_cached_tokens_before_the_first_hit_come_from_the_prompt_histograms():
    # main's recording holds no hit: sglang:cached_tokens_total has no series yet
    snap = snapshots.snapshot(scrape("main-2026-08"))
    assert "sglang:cached_tokens_total" not in scrape("main-2026-08")
    hits = snap["counters"]["prefix_hits"]
    assert hits["value"] == 0 and hits["metric"].endswith("sglang:uncached_prompt_tokens_histogram_sum")
    assert engine_metrics.report(snap)["prefix_cache_hit_rate"] == 0


def test_the_counter_and_the_histograms_agree_once_a_request_hit():
    text = scrape("0.5.23")
    snap = snapshots.snapshot(text)
    assert snap["counters"]["prefix_hits"]["metric"] == "sglang:cached_tokens_total"
    hists = snap["histograms"]
    assert snap["counters"]["prefix_hits"]["value"] == hists["prompt_len"]["sum"] - hists["uncached_prompt_len"]["sum"] > 0


def test_the_route_counter_is_sglangs_with_its_endpoint_label():
    snap = snapshots.snapshot(scrape("0.5.23"))
    assert snap["counters"]["completion_requests"]["metric"] == "sglang:http_requests_total"
    assert engine_metrics.report(snap)["endpoint"] == "completions"


@pytest.mark.parametrize("version", VERSIONS)
def test_context_length_and_page_size_are_exported_settings(version):
    r = engine_metrics.report(snapshots.snapshot(scrape(version)))
    length = r["settings"]["max_model_len"]
    assert (length["value"], length["source"], length["how"]) == (r["deployment"]["max_model_len"], "exported",
                                                                 "sglang:context_len")
    assert r["settings"]["block_size"]["how"] == "sglang:page_size"
    assert prefix_probe.block_size(prefix_probe.counters(scrape(version)))[1] == "sglang:page_size"


@pytest.mark.parametrize("version, backend, cap", [("main-2026-08", "intel_amx", 4096), ("0.5.23", "torch_native", 4096)])
def test_get_server_info_gives_the_cap_sglang_chose_and_never_a_key(version, backend, cap):
    info = server_info(version)
    assert info["max_running_requests"] is None  # not set on the command line
    found = deployment.from_sglang(info)
    assert found["max_num_seqs"].value == cap and "effective_max_running_requests_per_dp" in found["max_num_seqs"].how
    assert (found["attention_backend"].value, found["engine_version"].value) == \
        (backend, "0.0.0.dev0" if version == "main-2026-08" else "0.5.23")
    assert not {"api_key", "admin_api_key", "watermark_key"} & set(found)
    served = deployment.Served("http://h:30000", found)
    r = engine_metrics.report(snapshots.snapshot(scrape(version)), served=served)
    line = report_text.format_report(r)
    assert f"attention backend {backend}" in line and "sized by --mem-fraction-static 0.05" in line
