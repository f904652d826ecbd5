"""metrics.py: Prometheus parsing, histogram_quantile against an independent reference, every
name generation of vLLM and SGLang, resets, engines summed, bad input; then scenarios on the real
CPU vLLM where each induced picture must be named by the diagnosis (and a healthy server not).

Fixtures (tests/fixtures/metrics/): vllm-0.32-*.txt are recorded from the real CPU vLLM 0.32 (but
vllm-0.32-pooling.txt, written from its source: test_metrics_media.py reads it);
sglang-0.4.txt, sglang-0.5-tp2.txt and vllm-v0.txt are written from the documented formats (their headers
say so); sglang-*-cpu.txt are recorded from live SGLangs (test_sglang_recorded.py reads them).
"""
from __future__ import annotations

import json
import math
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import metrics
import pytest

from rooflib.core import taskcall
from rooflib.core.errors import ServerError
from rooflib.server import (
    engine_metrics,
    metric_sources,
    prometheus_text,
    quantiles,
    report_text,
    slo_targets,
    snapshots,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
H100 = {"name": "NVIDIA H100 SXM", "bf16_dense_tflops": 989.0, "bandwidth_tb_s": 3.35}


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def kinds(r: dict) -> list[str]:
    """The kinds of a report's findings, root cause first."""
    return [f["kind"] for f in r["diagnosis"]["findings"]]


def finding(r: dict, kind: str) -> dict:
    return next(f for f in r["diagnosis"]["findings"] if f["kind"] == kind)


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample, found with a plain text search (not the parser under test)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# --------------------------------------------------------------------------------------------
# histogram_quantile

def reference_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Independent reference: invert the piecewise-linear cumulative curve through (0, 0) and
    each (bound, count) by bisection; beyond the last finite bound, that bound (a floor)."""
    finite = sorted(b for b in buckets if not math.isinf(b[0]))
    total = max(c for le, c in buckets if math.isinf(le))
    rank = q * total
    if rank > finite[-1][1]:
        return finite[-1][0]

    def cdf(x: float) -> float:
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in finite:
            if x <= bound:
                return previous_count + (count - previous_count) * (x - previous_bound) / (bound - previous_bound)
            previous_bound, previous_count = bound, count
        return previous_count

    low, high = 0.0, finite[-1][0]
    for _ in range(200):
        middle = (low + high) / 2
        if cdf(middle) >= rank:
            high = middle
        else:
            low = middle
    return high


VLLM_TTFT_BOUNDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_REQUEST_BOUNDS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                       60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def bucketize(observations: list[float], bounds: list[float]) -> list[tuple[float, float]]:
    return [(le, float(sum(1 for o in observations if o <= le))) for le in bounds] + \
        [(math.inf, float(len(observations)))]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("q", [0.01, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_quantile_matches_reference_and_brackets_the_true_value(seed, q):
    rng = random.Random(seed)
    bounds = VLLM_TTFT_BOUNDS if seed % 2 else VLLM_REQUEST_BOUNDS
    observations = [rng.lognormvariate(rng.uniform(-4, 3), rng.uniform(0.2, 2)) for _ in range(rng.randint(1, 400))]
    buckets = bucketize(observations, bounds)
    assert quantiles.histogram_quantile(q, buckets) == pytest.approx(reference_quantile(q, buckets), rel=1e-9, abs=1e-12)
    # The true quantile of the observations lies in the bucket quantile_bucket names.
    true_value = sorted(observations)[max(0, math.ceil(q * len(observations)) - 1)]
    lower, upper = quantiles.quantile_bucket(q, buckets)
    assert lower <= true_value <= upper


def test_quantile_reproduces_the_vllm_design_doc_example():
    # vLLM docs/design/metrics.md TTFT sample: 140 requests, 13 <= 20 ms, 97 <= 40 ms, 138 <= 80 ms.
    counts = [0, 0, 0, 13, 97, 130, 138, 140]
    buckets = list(zip(VLLM_TTFT_BOUNDS[:8], map(float, counts))) + [(math.inf, 140.0)]
    assert quantiles.histogram_quantile(0.5, buckets) == pytest.approx(0.02 + 0.02 * (70 - 13) / 84)
    assert quantiles.histogram_quantile(0.99, buckets) == pytest.approx(0.086)


def test_quantile_special_cases_follow_prometheus():
    buckets = [(0.1, 1.0), (1.0, 3.0), (math.inf, 10.0)]
    assert quantiles.histogram_quantile(0.9, buckets) == 1.0  # in +Inf: the largest finite bound
    assert quantiles.quantile_bucket(0.9, buckets) == (1.0, math.inf)
    assert quantiles.histogram_quantile(-0.1, buckets) == -math.inf
    assert quantiles.histogram_quantile(1.1, buckets) == math.inf
    assert math.isnan(quantiles.histogram_quantile(math.nan, buckets))
    assert math.isnan(quantiles.histogram_quantile(0.5, [(0.1, 1.0), (1.0, 3.0)]))  # no +Inf bucket
    assert math.isnan(quantiles.histogram_quantile(0.5, [(math.inf, 3.0)]))  # fewer than two buckets
    assert math.isnan(quantiles.histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))  # no observations
    assert math.isnan(quantiles.histogram_quantile(0.0, [(0.1, 0.0), (1.0, 2.0), (math.inf, 2.0)]))  # Go's 0/0
    # Same bound twice: added up; a dip is forced monotonic; a bound <= 0 is returned as is.
    assert quantiles.histogram_quantile(0.5, [(1.0, 1.0), (1.0, 1.0), (2.0, 4.0), (math.inf, 4.0)]) == 1.0
    assert quantiles.histogram_quantile(0.5, [(1.0, 2.0), (2.0, 1.0), (3.0, 4.0), (math.inf, 4.0)]) == 1.0
    assert quantiles.histogram_quantile(0.25, [(-1.0, 2.0), (1.0, 4.0), (math.inf, 8.0)]) == -1.0


# --------------------------------------------------------------------------------------------
# Parsing

def test_parser_reads_escapes_timestamps_special_values_and_openmetrics():
    text = ('# HELP x help with "quotes"\n# TYPE x gauge\n'
            'x{path="a\\"b\\\\c\\nd",empty=""} 1.5e+03 1712345678000\n'
            'y{} NaN\nz +Inf\nw -1.0\n# a comment\n# EOF\n')
    exposition = prometheus_text.parse_exposition(text)
    labels, value = exposition.samples["x"][0]
    assert labels == {"path": 'a"b\\c\nd', "empty": ""} and value == 1500.0
    # NaN and Inf are valid in the format but carry no figure: left out, and said so.
    assert "y" not in exposition.samples and "z" not in exposition.samples
    assert exposition.samples["w"][0][1] == -1.0
    assert any("NaN or Inf for y, z" in warning for warning in exposition.warnings)
    assert exposition.types == {"x": "gauge"}


def test_recorded_vllm_scrape_is_read_exactly():
    text = fixture_text("vllm-0.32-after.txt")
    snap = snapshots.snapshot(text, "recorded")
    assert snap["engine"] == "vllm" and snap["models"] == ["tiny-qwen3"] and snap["engines"] == 1
    assert snap["counters"]["prompt_tokens"]["value"] == sample_value(text, "vllm:prompt_tokens_total")
    assert snap["counters"]["prefix_hits"]["metric"] == "vllm:prefix_cache_hits_total"
    ttft = snap["histograms"]["ttft"]
    assert ttft["count"] == sample_value(text, "vllm:time_to_first_token_seconds_count") == 40
    assert ttft["counts"][-1] == 40 and math.isinf(ttft["le"][-1])
    assert snap["histograms"]["itl"]["metric"] == "vllm:inter_token_latency_seconds"
    assert snap["start_time"] == sample_value(text, "process_start_time_seconds")
    assert snap["cache_config"]["kv_cache_size_tokens"] == "524288"


def test_window_over_two_recorded_scrapes_gives_increases_rates_and_mfu():
    before_text, after_text = fixture_text("vllm-0.32-before.txt"), fixture_text("vllm-0.32-after.txt")
    before = snapshots.snapshot(before_text, "before", at=100.0)
    after = snapshots.snapshot(after_text, "after", at=102.5)
    r = engine_metrics.window(before, after, gpu=H100)
    assert r["mode"] == "window" and r["seconds"] == 2.5 and r["ttft_ms"]["n"] == 16
    gen = sample_value(after_text, "vllm:generation_tokens_total") - sample_value(before_text, "vllm:generation_tokens_total")
    assert gen == 16 * 32
    assert r["gen_tok_s"] == pytest.approx(gen / 2.5)
    flops = (sample_value(after_text, "vllm:estimated_flops_per_gpu_total")
             - sample_value(before_text, "vllm:estimated_flops_per_gpu_total"))
    assert r["mfu"] == pytest.approx(flops / 2.5 / 989e12)
    moved = sum(sample_value(after_text, f"vllm:estimated_{k}_bytes_per_gpu_total")
                - sample_value(before_text, f"vllm:estimated_{k}_bytes_per_gpu_total") for k in ("read", "write"))
    assert r["bandwidth_util"] == pytest.approx(moved / 2.5 / 3.35e12)
    assert r["prefix_cache_hit_rate"] == 0.0  # the 16 prompts of this window were all unique
    assert r["diagnosis"] == {"root_cause": None, "findings": [], "plan": [], "verify": []}


def test_since_start_report_uses_uptime_for_rates():
    text = fixture_text("vllm-0.32-after.txt")
    start = sample_value(text, "process_start_time_seconds")
    r = engine_metrics.report(snapshots.snapshot(text, "x", at=start + 100.0))
    assert r["mode"] == "since_start" and r["seconds"] == pytest.approx(100.0)
    assert r["prompt_tok_s"] == pytest.approx(sample_value(text, "vllm:prompt_tokens_total") / 100.0)
    assert any("since server start" in w for w in r["warnings"])


def with_deprecated_twins(text: str) -> str:
    """A vLLM 0.9.2-0.10 page: the new names plus the deprecated ones with the same values."""
    twins = []
    for line in text.splitlines():
        for new, old in (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                         ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
                         ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
                         ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")):
            if line.startswith(new) and not line.startswith(new + "_created"):
                twins.append(old + line[len(new):])
    return text + "\n".join(twins) + "\n"


def test_a_metric_exposed_under_old_and_new_names_is_counted_once():
    text = fixture_text("vllm-0.32-after.txt")
    plain, twinned = snapshots.snapshot(text), snapshots.snapshot(with_deprecated_twins(text))
    assert twinned["counters"]["prefix_hits"] == plain["counters"]["prefix_hits"]
    assert twinned["histograms"]["itl"] == plain["histograms"]["itl"]
    assert twinned["gauges"]["kv_cache_usage"]["metric"] == "vllm:kv_cache_usage_perc"


def test_old_names_alone_are_used_when_new_ones_are_missing():
    text = with_deprecated_twins(fixture_text("vllm-0.32-after.txt"))
    only_old = "\n".join(line for line in text.splitlines()
                         if not line.startswith(("vllm:inter_token_latency_seconds", "vllm:prefix_cache_",
                                                 "vllm:kv_cache_usage_perc"))) + "\n"
    snap = snapshots.snapshot(only_old)
    assert snap["histograms"]["itl"]["metric"] == "vllm:time_per_output_token_seconds"
    assert snap["counters"]["prefix_hits"]["metric"] == "vllm:gpu_prefix_cache_hits_total"
    assert snap["counters"]["prefix_hits"]["value"] == snapshots.snapshot(text)["counters"]["prefix_hits"]["value"]


def two_engines(text: str) -> str:
    """The same page as if a second data-parallel engine (engine="1") had served the same load."""
    extra = [line.replace('engine="0"', 'engine="1"') for line in text.splitlines()
             if line.startswith("vllm:") and 'engine="0"' in line]
    return text + "\n".join(extra) + "\n"


def test_data_parallel_engines_on_one_page_are_summed():
    text = fixture_text("vllm-0.32-after.txt")
    one, two = snapshots.snapshot(text), snapshots.snapshot(two_engines(text))
    assert two["engines"] == 2
    assert two["counters"]["generation_tokens"]["value"] == 2 * one["counters"]["generation_tokens"]["value"]
    assert two["histograms"]["ttft"]["counts"] == [2 * c for c in one["histograms"]["ttft"]["counts"]]
    assert two["gauges"]["kv_cache_usage"]["value"] == one["gauges"]["kv_cache_usage"]["value"]  # averaged
    # Quantiles of the summed buckets equal those of one engine (same distribution twice).
    assert engine_metrics.report(two)["ttft_ms"]["p95"] == pytest.approx(engine_metrics.report(one)["ttft_ms"]["p95"])


def test_counter_reset_between_scrapes_is_detected_and_said():
    before = snapshots.snapshot(fixture_text("vllm-0.32-after.txt"), at=10.0)
    after = snapshots.snapshot(fixture_text("vllm-0.32-before.txt"), at=20.0)  # fewer requests: a restart
    r = engine_metrics.window(before, after)
    assert any("restarted" in w for w in r["warnings"])
    assert r["ttft_ms"]["n"] == after["histograms"]["ttft"]["count"]  # counted from the restart on
    restarted = dict(after, start_time=after["start_time"] + 60)
    later = snapshots.difference(snapshots.snapshot(fixture_text("vllm-0.32-before.txt")), restarted)
    assert any("start time changed" in w for w in later["warnings"])


@pytest.mark.parametrize("name, engine, figures, found", [
    # KV 97% full with 12 retractions: the queue and the low hit rate follow from it; ITL p95
    # 54 ms is judged against the ITL target (100 ms), not the TPOT one.
    ("sglang-0.5-tp2.txt", "sglang",
     {"running": 48, "waiting": 37, "preemptions": 12, "kv_cache_usage": 0.97, "prefix_cache_hit_rate": 20600 / 412000},
     ["kv_cache", "preemptions", "queue", "prefix_evicted"]),
    ("sglang-0.4.txt", "sglang", {"running": 3, "waiting": 0, "kv_cache_usage": 0.12, "prefix_cache_hit_rate": 0.61}, []),
    ("vllm-v0.txt", "vllm", {"running": 24, "waiting": 9, "preemptions": 57, "kv_cache_usage": 0.99,
                             "prefix_cache_hit_rate": None},
     ["kv_cache", "preemptions", "prefill"]),  # TTFT p95 2.12 s by interpolation: over the default 2 s
    ("vllm-0.32-idle.txt", "vllm", {"running": 0, "waiting": 0, "preemptions": 0, "prefix_cache_hit_rate": None}, []),
])
def test_each_generation_is_read_and_diagnosed(name, engine, figures, found):
    r = engine_metrics.report(snapshots.snapshot(fixture_text(name), name))
    assert r["engine"] == engine
    for key, value in figures.items():
        assert r[key] == (pytest.approx(value) if value is not None else None), key
    assert kinds(r) == found
    assert all(f["evidence"] for f in r["diagnosis"]["findings"])


def recorded_window(name: str) -> dict:
    """The window report of a recorded scenario; its interval is in the after file's header."""
    before, after = fixture_text(f"vllm-0.32-{name}-before.txt"), fixture_text(f"vllm-0.32-{name}-after.txt")
    seconds = float(re.search(r"([0-9.]+) s after the first scrape", after.splitlines()[0]).group(1))
    return engine_metrics.window(snapshots.snapshot(before, at=0.0), snapshots.snapshot(after, at=seconds))


def test_recorded_queue_behind_max_num_seqs_is_named_with_littles_law():
    r = recorded_window("queue")
    assert r["requests"] == 16 and r["tokens_per_request"] == 64 + 256
    assert r["running_mean"] <= 2  # the cap, seen from the histograms alone
    assert kinds(r) == ["running_limit", "queue"]
    root = r["diagnosis"]["root_cause"]
    assert (root["setting"], root["current"], root["current_source"]) == ("--max-num-seqs", 2, "inferred")
    first = report_text.format_report(r).split("Root cause: ", 1)[1]
    assert first.startswith("[running_limit] --max-num-seqs is at least 2 (inferred: 1.98 requests per engine step")
    # Little's law: 0.9 req/s x 9.3 s keep 8.2 requests in the server; the cap goes to the next power of two
    lever = r["diagnosis"]["plan"][0]
    assert (lever["setting"], lever["current"], lever["proposed"]) == ("--max-num-seqs", 2, 16)
    assert "about 8.2 requests in the server" in lever["reason"] and "queue wait (mean 7.24 s) near 0" in lever["effect"]


def test_recorded_preemptions_are_named_as_a_full_kv_cache():
    r = recorded_window("preempt")
    assert r["kv_cache_tokens"] == 2048 and r["preemptions"] > 0
    assert kinds(r) == ["kv_cache", "preemptions", "queue", "prefix_unstable"]
    # the deployment's own setting, read from vllm:cache_config_info, is named as the cause
    assert r["deployment"]["kv_cache_memory_bytes"] == 4194304 and r["deployment"]["max_num_seqs"] is None
    kv = r["diagnosis"]["root_cause"]
    assert (kv["setting"], kv["current"], kv["current_source"]) == ("--kv-cache-memory-bytes", 4194304, "exported")
    assert "--kv-cache-memory-bytes is 4 MiB (exported" in kv["evidence"] and "2,048 KV tokens" in kv["evidence"]
    assert r["diagnosis"]["plan"][0]["text"].startswith("--kv-cache-memory-bytes: 4 MiB -> 8 MiB (current: exported)")


def test_old_generation_metric_names_are_reported_as_used():
    sglang_old = engine_metrics.report(snapshots.snapshot(fixture_text("sglang-0.4.txt")))
    assert sglang_old["itl_ms"]["metric"] == "sglang:time_per_output_token_seconds"
    assert sglang_old["queue_ms"]["mean"] == pytest.approx(4.0)  # the last-batch gauge, in ms
    v0 = engine_metrics.report(snapshots.snapshot(fixture_text("vllm-v0.txt")))
    assert v0["itl_ms"]["metric"] == "vllm:time_per_output_token_seconds"
    assert v0["gen_tok_s"] == pytest.approx(812.3)  # V0's own throughput gauge, said in a warning
    assert any("avg_generation_throughput" in w for w in v0["warnings"])


def test_sglang_ranks_are_not_double_counted():
    text = fixture_text("sglang-0.5-tp2.txt")
    snap = snapshots.snapshot(text)
    assert snap["gauges"]["running"]["value"] == sample_value(text, "sglang:num_running_reqs", tp_rank="0")
    assert snap["counters"]["preemptions"]["value"] == 12


def test_slo_targets_turn_slow_prefill_and_decode_into_findings():
    snap = snapshots.snapshot(fixture_text("sglang-0.4.txt"))
    # SGLang 0.4's ITL p95 is 19 ms: within the ITL target of twice a 10 ms TPOT, over a 15 ms one
    assert kinds(engine_metrics.report(snap, slo=slo_targets.Targets(50.0, 10.0))) == ["prefill"]
    assert kinds(engine_metrics.report(snap, slo=slo_targets.Targets(50.0, 10.0, 15.0))) == ["prefill", "decode"]
    assert kinds(engine_metrics.report(snap, slo=slo_targets.Targets(1000.0, 100.0))) == []


def test_replicas_are_reported_each_and_together(capsys):
    opts = metrics.options(metrics.build_parser().parse_args(["--file", str(FIXTURES / "vllm-0.32-after.txt")]))
    snaps = [snapshots.snapshot(fixture_text("vllm-0.32-after.txt"), f"replica-{i}") for i in (1, 2)]
    total, text = metrics.results(opts, snaps)
    assert total["ttft_ms"]["n"] == 80 and len(total["replicas"]) == 2
    assert "Per replica:" in text and "replica-2: TTFT p95" in text


# --------------------------------------------------------------------------------------------
# Command line and bad input

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = metrics.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_has_the_agreed_keys(capsys):
    code, out, _ = run_cli(capsys, "--file", str(FIXTURES / "vllm-0.32-after.txt"), "--json")
    report = json.loads(out)
    assert code == 0
    for key in ("engine", "running", "waiting", "kv_cache_usage", "preemptions", "prefix_cache_hit_rate",
                "prompt_tok_s", "gen_tok_s", "diagnosis"):
        assert key in report
    assert set(report["diagnosis"]) == {"root_cause", "findings", "plan", "verify"}
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms"):
        assert set(report[key]) >= {"p50", "p95", "p99"}


def test_two_files_with_a_window_give_rates(capsys):
    code, out, _ = run_cli(capsys, "--file", str(FIXTURES / "vllm-0.32-before.txt"),
                           "--file", str(FIXTURES / "vllm-0.32-after.txt"), "--window", "2.5", "--json")
    assert code == 0 and json.loads(out)["gen_tok_s"] == pytest.approx(16 * 32 / 2.5)


def cut_inside_histogram(text: str) -> str:
    """The recorded scrape cut at a line boundary inside the TTFT histogram."""
    lines = text.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith("vllm:time_to_first_token_seconds_bucket"))
    return "".join(lines[:index + 3])


NOT_VLLM = ("# HELP node_cpu_seconds_total Seconds the CPUs spent in each mode.\n# TYPE node_cpu_seconds_total counter\n"
            'node_cpu_seconds_total{cpu="0",mode="idle"} 1234.5\n')


@pytest.mark.parametrize("content, code, message", [
    ("<!doctype html><html><body>Grafana</body></html>", 4, "HTML page"),
    ("", 4, "empty"),
    ("   \n", 4, "empty"),
    (fixture_text("vllm-0.32-after.txt")[:20000], 4, "truncated"),
    (cut_inside_histogram(fixture_text("vllm-0.32-after.txt")), 4, "truncated"),
    (NOT_VLLM, 4, "neither vLLM's nor SGLang's"),
    ("vllm:x{a=1} 2\n", 4, "not Prometheus text format"),
])
def test_bad_scrapes_fail_in_one_line(tmp_path, capsys, content, code, message):
    path = tmp_path / "scrape.txt"
    path.write_text(content)
    status, out, err = run_cli(capsys, "--file", str(path))
    assert status == code and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--file", "/nonexistent/scrape.txt"], "does not exist"),
    (["--file", "a", "--file", "b", "--file", "c"], "not more"),
    (["--url", "http://127.0.0.1:9", "--window", "soon"], "--window must be a number"),
    (["--file", "x", "--watch", "5"], "--watch reads live servers"),
    (["--file", "x", "--window", "5"], "needs two files"),
    (["--url", "ftp://x"], "is not http(s)"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("url, expected", [
    ("http://h:1", "http://h:1/metrics"), ("http://h:1/v1/", "http://h:1/metrics"),
    ("http://h:1/metrics", "http://h:1/metrics"), ("http://h:1/proxy/metrics/", "http://h:1/proxy/metrics"),
])
def test_scrape_asks_exactly_the_metrics_path(url, expected):
    asked = []

    def server(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(200, text=fixture_text("vllm-v0.txt"))
    text, _ = metric_sources.scrape(url, transport=httpx.MockTransport(server))
    assert asked == [expected] and text == fixture_text("vllm-v0.txt")


def test_unreachable_server_and_404_are_server_errors(capsys):
    status, _, err = run_cli(capsys, "--url", "http://127.0.0.1:9")
    assert status == 3 and "cannot reach http://127.0.0.1:9/metrics" in err and err.count("\n") == 1

    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="Not Found")
    with pytest.raises(ServerError, match="HTTP 404: no metrics there"):
        metric_sources.scrape("http://127.0.0.1:8000", transport=httpx.MockTransport(not_found))


# --------------------------------------------------------------------------------------------
# Real CPU vLLM scenarios: each induces one picture; the diagnosis must name it.

def send_load(url: str, model: str, requests: int, concurrency: int, prompt_tokens: int,
              output_tokens: int, shared_prefix: int = 0, seed: int = 0) -> None:
    """Completions with prompts given as token ids (exact lengths); an optional shared prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 8000) for _ in range(shared_prefix)]

    prompts = [prefix + [own.randrange(100, 8000) for _ in range(prompt_tokens - shared_prefix)]
               for own in (random.Random(seed * 100_000 + i) for i in range(requests))]
    # One client with a connection per worker, made before the workers start, so that all
    # requests reach the server at once.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=url, timeout=600, limits=limits) as http:
        def one(prompt: list[int]) -> None:
            http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": output_tokens,
                                                "ignore_eos": True}).raise_for_status()

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, prompts))


# Targets no CPU run misses: these tests are about queues and caches, not CPU latency.
CPU_SLO = slo_targets.Targets(ttft_p95_ms=600_000, tpot_p95_ms=600_000)


def measured(url: str, load) -> dict:
    """The window report of what `load()` did (snapshots before and after, via the public API)."""
    text, at = metric_sources.scrape(url)
    before = snapshots.snapshot(text, url, at)
    load()
    text, at = metric_sources.scrape(url)
    return engine_metrics.window(before, snapshots.snapshot(text, url, at), gpu=H100, slo=CPU_SLO)


@pytest.fixture(scope="class")
def server(vllm_factory):
    """One server for the healthy and prefix-cache scenarios: prefix caching and MFU metrics on."""
    with vllm_factory(sets=["enable_prefix_caching=true", 'extra_args=["--enable-mfu-metrics"]']) as srv:
        yield srv


@pytest.mark.real_vllm
class TestOneServer:
    """Healthy, prefix-cache hits high and low, watch mode and several URLs on one server."""

    def test_healthy_server_raises_no_alarm(self, server):
        r = measured(server.url, lambda: send_load(server.url, server.model, 8, 4, 64, 32, seed=1))
        assert r["ttft_ms"]["n"] == 8 and r["e2e_ms"]["n"] == 8
        assert r["gen_tok_s"] * r["seconds"] == pytest.approx(8 * 32)
        assert r["preemptions"] == 0 and r["diagnosis"]["root_cause"] is None and kinds(r) == []
        assert r["mfu"] > 0 and r["bandwidth_util"] > 0

    def test_shared_prefix_gives_high_hit_rate(self, server):
        # CPU vLLM caches whole 128-token blocks: a 896-token shared prefix is 7 blocks.
        send_load(server.url, server.model, 1, 1, 1000, 8, shared_prefix=896, seed=2)  # warm the cache
        r = measured(server.url, lambda: send_load(server.url, server.model, 8, 4, 1000, 8, shared_prefix=896, seed=2))
        assert r["prefix_cache_hit_rate"] == pytest.approx(896 / 1000, abs=0.01)
        assert kinds(r) == []

    def test_watch_prints_one_json_line_per_refresh(self, server, capsys):
        assert metrics.main(["--url", server.url, "--watch", "1", "--count", "2", "--json"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and all(json.loads(line)["mode"] == "window" for line in lines)

    def test_several_urls_are_reported_each_and_summed(self, server, capsys):
        # Its own requests first: on a server no test has sent to yet every TTFT count is 0.
        send_load(server.url, server.model, 2, 2, 32, 4, seed=6)
        assert metrics.main(["--url", f"{server.url},{server.url}/metrics", "--json"]) == 0
        total = json.loads(capsys.readouterr().out)
        single = total["replicas"][0]
        assert len(total["replicas"]) == 2 and total["ttft_ms"]["n"] == 2 * single["ttft_ms"]["n"] > 0

    def test_unique_long_prompts_give_low_hit_rate_and_a_finding(self, server):
        r = measured(server.url, lambda: send_load(server.url, server.model, 8, 4, 1000, 8, seed=3))
        assert r["prefix_cache_hit_rate"] < 0.05
        # caching is on (exported): the start of the prompts varies, nothing to switch on
        assert kinds(r) == ["prefix_unstable"] and r["settings"]["prefix_caching"]["value"] is True
        assert [lever["setting"] for lever in r["diagnosis"]["plan"]] == [None]




def window_report(url: str, tmp_path, capsys, load) -> dict:
    """metrics --json over saved scrapes before and after the whole `load()`, with the seconds
    between them as the window: it holds the load however long a busy machine takes over it."""
    before, started = metric_sources.scrape(url)
    load()
    after, ended = metric_sources.scrape(url)
    (tmp_path / "before.txt").write_text(before)
    (tmp_path / "after.txt").write_text(after)
    code = metrics.main(["--file", str(tmp_path / "before.txt"), "--file", str(tmp_path / "after.txt"),
                         "--window", f"{ended - started:.3f}", "--json",
                         "--slo-ttft-p95-ms", "600000", "--slo-tpot-p95-ms", "600000"])
    assert code == 0
    return json.loads(capsys.readouterr().out)


# Prompt lengths to try until a load queues in the engine. The load is prefill-heavy (long
# prompts, 16 tokens out) because the tiny CPU model decodes faster than vLLM's API server turns
# its output into responses: with long outputs a starved API server passed requests to the engine
# about as slowly as slots freed (16 x 64-token prompts x 3,072 tokens out on max_num_seqs=2:
# engine queue 0.29 s of a 12.7 s mean), and /metrics went unanswered for 31 s mid-load. A long
# prompt is the engine's work, not the API server's: 16 x 2,048 tokens queued 64% of the mean.
QUEUEING_PROMPTS = (2048, 3072)


@pytest.mark.real_vllm
def test_queue_behind_max_num_seqs_is_named(vllm_factory, tmp_path, capsys):
    # Prefix caching off: the long prompts are computed, which the diagnosis adds as an
    # independent finding after the queue's root cause.
    with vllm_factory(sets=["max_num_seqs=2", "enable_prefix_caching=false"]) as server:
        for prompt_tokens in QUEUEING_PROMPTS:
            r = window_report(server.url, tmp_path, capsys,
                              lambda: send_load(server.url, server.model, 16, 16, prompt_tokens, 16, seed=4))
            if r["queue_ms"]["mean"] > 0.2 * r["e2e_ms"]["mean"]:
                break
    # The finding rests on the histograms, which requests carry when they finish: the time they
    # queued, and the time they ran (Little's law: at most 2 at a time).
    assert r["e2e_ms"]["n"] == 16 and 0 < r["running_mean"] <= 2
    share = r["queue_ms"]["mean"] / r["e2e_ms"]["mean"]
    assert share > 0.2, f"queued {share:.0%} of the time"
    assert kinds(r) == ["running_limit", "queue", "prefix_cache_off"]
    root = r["diagnosis"]["root_cause"]
    assert (root["setting"], root["current"], root["current_source"]) == ("--max-num-seqs", 2, "inferred")
    plan = r["diagnosis"]["plan"]
    assert plan[0]["setting"] == "--max-num-seqs" and plan[0]["proposed"] > 2
    assert plan[-1]["text"].startswith("--enable-prefix-caching: False -> True (current: exported)")


@pytest.mark.real_vllm
def test_preemptions_from_a_small_kv_cache_are_named(vllm_factory):
    # env={} drops VLLM_CPU_KVCACHE_SPACE, which would override --kv-cache-memory-bytes.
    sets = ["env={}", "max_model_len=1024", "kv_cache_memory_bytes=4194304"]
    with vllm_factory(sets=sets) as server:
        r = measured(server.url, lambda: send_load(server.url, server.model, 16, 16, 512, 256, seed=5))
        log = server.log()
    assert re.search(r"KV cache size: 2,048 tokens", log) and r["kv_cache_tokens"] == 2048
    assert r["preemptions"] > 0
    assert kinds(r)[:2] == ["kv_cache", "preemptions"] and "running_limit" not in kinds(r)
    # the deployment's own setting, read from vllm:cache_config_info, is named as the cause
    assert r["deployment"]["kv_cache_memory_bytes"] == 4194304
    kv = r["diagnosis"]["root_cause"]
    assert (kv["setting"], kv["current"]) == ("--kv-cache-memory-bytes", 4194304)
    assert "--kv-cache-memory-bytes is 4 MiB (exported" in kv["evidence"] and "2,048 KV tokens" in kv["evidence"]
    assert r["diagnosis"]["plan"][0]["text"].startswith("--kv-cache-memory-bytes: 4 MiB -> ")


def test_without_targets_the_starting_defaults_judge_and_the_report_says_so():
    snap = snapshots.snapshot(fixture_text("vllm-v0.txt"))
    default, given = engine_metrics.report(snap), engine_metrics.report(snap, slo=slo_targets.Targets(2000, 50))
    assert default["slo_source"] == "default" and given["slo_source"] == "given"
    assert default["slo"] == {"ttft_p95_ms": 2000.0, "tpot_p95_ms": 50.0, "itl_p95_ms": 100.0}
    # the prefill finding is not dropped for want of an SLO
    assert kinds(default) == kinds(given) and "prefill" in kinds(default)
    text = report_text.format_report(default)
    assert "targets: TTFT p95 2 s, TPOT p95 50 ms, ITL p95 100 ms (starting defaults for interactive chat, " \
           "not your SLO" in text
    partly = engine_metrics.report(snap, slo=slo_targets.Targets(tpot_p95_ms=200))
    assert partly["slo_source"] == "partly default" and partly["slo_defaulted"] == ["ttft_p95_ms"]
    # V0's ITL p95 (95 ms) is over an ITL target of 80 ms, not over twice a 200 ms TPOT target
    assert "decode" not in kinds(partly)
    assert "decode" in kinds(engine_metrics.report(snap, slo=slo_targets.Targets(itl_p95_ms=80)))


def test_a_quantile_in_the_first_bucket_is_only_an_upper_bound():
    r = recorded_window("queue")
    itl = r["itl_ms"]
    assert itl["p50"] is None and itl["at_most"] == {"p50": 10.0}  # vLLM's first ITL bucket is 10 ms
    assert itl["mean"] is not None and "<=10 ms" in report_text.format_report(r)
    json.dumps(r)  # JSON-ready


def test_waiting_words_and_numbers_agree_on_two_saved_scrapes():
    r = recorded_window("queue")
    assert r["waiting_peak"] == 0 and r["waiting_mean"] > 3 and r["gauge_samples"] == 2
    line = next(line for line in report_text.format_report(r).splitlines() if line.startswith("  running"))
    assert (f"waiting 0 at the last scrape (peak 0 in 2 samples; mean {r['waiting_mean']:.2g} over the window "
            "by the queue-time histograms: the samples missed the busy moments)") in line


def test_the_deployments_own_settings_are_read_and_printed():
    r = recorded_window("queue")
    dep = r["deployment"]
    assert dep["kv_cache_tokens"] == 524288 and dep["num_gpu_blocks"] == 4096 and dep["block_size"] == 128
    assert dep["kv_cache_memory_bytes"] == 1 << 30 and dep["gpu_memory_utilization"] == 0.92
    assert dep["max_concurrency_at_max_model_len"] == 128.0 and dep["max_model_len"] == 4096
    assert dep["requests_of_mean_length"] == pytest.approx(524288 / 320)
    # no metric exports max-num-seqs: the requests per engine step put a floor under it
    assert dep["max_num_seqs"] == 2 and dep["max_num_seqs_note"].startswith("at least 2 (inferred: 1.98 requests per")
    assert r["settings"]["prefix_caching"] == {"value": True, "source": "exported",
                                               "how": "vllm:cache_config_info enable_prefix_caching",
                                               "at_least": False}
    text = report_text.format_report(r)
    assert "deployment (vllm:cache_config_info): KV cache 524,288 tokens (4,096 blocks of 128) sized by an explicit " \
           "--kv-cache-memory-bytes of 1 GiB" in text
    assert "max-num-seqs at least 2 (inferred: " in text
    since_start = engine_metrics.report(snapshots.snapshot(fixture_text("vllm-0.32-queue-after.txt")))
    assert "max-num-seqs unknown: no metric exports it" in report_text.format_report(since_start)


def small_kv(text: str) -> str:
    """A scrape whose cache_config_info says 2,048 KV tokens from an explicit 4 MiB (the labels
    the real preempt scenario's server exported, on the queue scenario's histograms)."""
    for label, value in (("kv_cache_size_tokens", "2048"), ("num_gpu_blocks", "16"),
                         ("kv_cache_memory_bytes", "4194304"), ("kv_cache_max_concurrency", "2.0")):
        text = re.sub(rf'{label}="[^"]*"', f'{label}="{value}"', text)
    return text


def test_since_start_a_small_kv_cache_is_named_with_its_setting_not_guessed_as_seqs_limit():
    r = engine_metrics.report(snapshots.snapshot(small_kv(fixture_text("vllm-0.32-queue-after.txt"))))
    assert r["mode"] == "since_start" and r["preemptions"] == 0
    assert kinds(r) == ["kv_cache", "queue"]
    kv = r["diagnosis"]["root_cause"]
    assert "4 MiB (exported: vllm:cache_config_info kv_cache_memory_bytes): 2,048 KV tokens, " \
           "6.4 requests of 320 tokens" in kv["evidence"]
    assert "--kv-cache-memory-bytes is 4 MiB (exported" in kv["evidence"]
    assert "unless the running cap (not exported) is below 6" in kv["evidence"] and kv["confidence"].startswith("medium")


def test_since_start_gauges_alone_never_name_the_running_cap():
    r = engine_metrics.report(snapshots.snapshot(fixture_text("vllm-0.32-queue-after.txt")))
    assert kinds(r) == ["queue"]
    assert "cannot tell the KV cache from the running-requests cap" in r["diagnosis"]["root_cause"]["evidence"]
    # Run outside any task, the command is the toolbox's (a skill's) call: runnable as printed.
    toolbox = taskcall.toolbox_taskfile()
    assert r["diagnosis"]["plan"][0]["text"].startswith(f"task -t {toolbox} metrics WINDOW=30 while the load is on")
