"""Every SGLang path against a live SGLang (its CPU engine, built by setup_cpu_sglang.py: the
released 0.5.23 or SGLang main from the source tree, serving tiny-qwen3 through `task serve
INFER_PROFILE=cpu-tiny-sglang`): /metrics read since start and over a window against its own
histograms, the deployment line from /get_server_info, bench through SGLang's /tokenize with its
usage and cached tokens, the prefix probe on the radix cache, smoke-toolcall and ppl (/generate),
then the diagnosis of two faults made on purpose, each naming the SGLang flag with its current value.

Loads are small: SGLang's torch-native attention on two busy cores serves a few tokens a second per
request (how long a window lasts does not matter: Ctrl-C ends it when the load has ended).
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import bench
import httpx
import metrics
import ppl
import pytest
import sglang_server
import smoke_toolcall
from markdown_doc import SKILLS, Doc
from test_diagnosis_live import (assert_plan_agrees, assert_root_cause, diagnosis_of, queue_share, queued_window,
                                 windowed)
from test_metrics import reference_quantile, send_load

from rooflib.core import http_client
from rooflib.quality import perplexity
from rooflib.server import engine_metrics, metric_sources, quantiles, slo_targets, snapshots

REPO = Path(__file__).resolve().parents[2]
# Targets no CPU run misses: these tests are about what SGLang says, not CPU speed.
CPU_SLO = slo_targets.Targets(ttft_p95_ms=600_000, tpot_p95_ms=600_000)
pytestmark = pytest.mark.real_sglang


@pytest.fixture(scope="module")
def built() -> dict:
    """What setup_cpu_sglang.py built (version, built_from, the venv's python)."""
    return sglang_server.setup()


def server_info(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=60).json()


def measured(url: str, load) -> dict:
    """The window report of `load()` between two scrapes, and the raw second scrape's buckets."""
    text, at = metric_sources.scrape(url)
    before = snapshots.snapshot(text, url, at)
    load()
    text, at = metric_sources.scrape(url)
    return engine_metrics.window(before, snapshots.snapshot(text, url, at), slo=CPU_SLO)


# --------------------------------------------------------------------------------------------
# The served profile, and what SGLang says of itself

def test_task_serve_runs_the_profile_and_sglang_says_what_it_runs(sglang_server, built):
    assert re.search(r"\$ SGLANG_USE_CPU_ENGINE=1 \S+/sglang-cpu/bin/python -m sglang\.launch_server ", sglang_server.log())
    info = server_info(sglang_server.url)
    assert (info["version"], info["attention_backend"], info["device"]) == (built["sglang"], "torch_native", "cpu")
    assert (info["mem_fraction_static"], info["max_total_tokens"], info["context_length"]) == (0.3, 131072, 4096)
    models = httpx.get(f"{sglang_server.url}/v1/models", timeout=60).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-qwen3", 4096)]


def test_a_window_reads_sglangs_histograms_exactly(sglang_server):
    r = measured(sglang_server.url, lambda: send_load(sglang_server.url, sglang_server.model, 4, 2, 64, 8, seed=21))
    # One observation per request in every per-request histogram, prefill (per-stage) included.
    assert r["e2e_ms"]["n"] == r["ttft_ms"]["n"] == r["queue_ms"]["n"] == r["prefill_ms"]["n"] == 4
    assert r["prefill_ms"]["metric"] == 'sglang:per_stage_req_latency_seconds{stage="prefill_forward"}'
    # SGLang counts prompt and generated tokens as each request finishes.
    assert (r["prompt_tokens_mean"], r["output_tokens_mean"]) == (64, 8)
    assert r["gen_tok_s"] * r["seconds"] == pytest.approx(32)
    assert r["endpoint"] == "completions"  # sglang:http_requests_total, label endpoint
    assert r["preemptions"] == 0 and r["diagnosis"]["root_cause"] is None
    # 0.5.23 exports per-request TPOT; SGLang main of 2026-08 does not.
    assert (r["tpot_ms"]["metric"] is not None) == (server_info(sglang_server.url)["version"] != "0.0.0.dev0")


def test_quantiles_since_start_are_those_of_the_scraped_buckets(sglang_server):
    # Its own requests first: a server no test has sent to yet exports no histogram buckets at all.
    send_load(sglang_server.url, sglang_server.model, 4, 2, 32, 4, seed=23)
    text, _ = metric_sources.scrape(sglang_server.url)
    r = engine_metrics.report(snapshots.snapshot(text, sglang_server.url))
    buckets: dict[float, float] = {}
    for line in text.splitlines():  # read apart from the parser: name, le and value only
        found = re.match(r'sglang:e2e_request_latency_seconds_bucket\{.*le="([^"]+)".*\} (\S+)$', line)
        if found:
            buckets[float(found[1])] = buckets.get(float(found[1]), 0.0) + float(found[2])
    assert r["e2e_ms"]["n"] == buckets[math.inf] > 0
    for name, q in quantiles.QUANTILES.items():
        expected = reference_quantile(q, sorted(buckets.items())) * 1000
        if name in r["e2e_ms"]["at_most"]:  # the first bucket: only its bound is said
            assert r["e2e_ms"]["at_most"][name] >= expected
        else:
            assert r["e2e_ms"][name] == pytest.approx(expected)


def test_metrics_window_until_ctrl_c(sglang_server):
    report = windowed(sglang_server.url, lambda: send_load(sglang_server.url, sglang_server.model, 3, 3, 32, 4, seed=22))
    assert report["mode"] == "window" and report["e2e_ms"]["n"] == 3 and report["engine"] == "sglang"


def test_the_deployment_line_and_settings_come_from_get_server_info(sglang_server, capsys):
    assert metrics.main(["--url", sglang_server.url]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("deployment ("))
    version = server_info(sglang_server.url)["version"]
    assert "KV cache 131,072 tokens (131,072 pages of 1) sized by --max-total-tokens 131,072, within what " \
           "--mem-fraction-static 0.3 leaves" in line
    assert "32.0 requests at context-length 4096" in line and "radix cache on" in line
    assert ("max-running-requests 4,096 (exported: SGLang /get_server_info internal_states[0]."
            "effective_max_running_requests_per_dp (SGLang's own choice") in line
    assert line.endswith(f"attention backend torch_native, SGLang {version}")
    assert metrics.main(["--url", sglang_server.url, "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["max_model_len"]["value"] == 4096 and settings["block_size"]["value"] == 1
    fraction = settings["gpu_memory_utilization"]
    assert (fraction["value"], fraction["how"]) == (0.3, "SGLang /get_server_info mem_fraction_static")


# --------------------------------------------------------------------------------------------
# bench, the prefix probe, smoke-toolcall, ppl

def run_bench(capsys, url: str, *argv: str) -> dict:
    code = bench.main(["--url", url, "--json", "--warmup", "0", "--timeline-interval", "0", *argv])
    result = json.loads(capsys.readouterr().out)
    assert code in (0, 4), result.get("verdict_reasons")  # 4: INVALID, a client too delayed on a busy machine
    assert result["requests"]["completed"] == result["requests"]["sent"], result["requests"]["first_errors"]
    return result


def test_bench_counts_with_sglangs_tokenizer_and_its_usage(sglang_server, capsys):
    result = run_bench(capsys, sglang_server.url, "-n", "6", "-c", "2", "--input-tokens", "96",
                       "--output-tokens", "8", "--shared-prefix", "64")
    requests = result["requests"]
    assert result["config"]["prompt_tokenizer"] == "server /tokenize"
    assert requests["prompt_tokens"]["min"] == requests["prompt_tokens"]["max"] == 96  # usage agrees
    assert requests["output_tokens"]["total"] == 48 and requests["output_tokens"]["short"] == 0
    # --enable-cache-report: usage.prompt_tokens_details.cached_tokens, the shared 64 of every request
    # after the first (the first two when they prefill together)
    assert requests["cached_prompt_tokens"] in (4 * 64, 5 * 64)
    server = result["server"]
    assert server["info"]["owned_by"] == "sglang" and server["info"]["engine_version"]
    assert server["metrics"]["generation_tokens"] == 48
    hits = server["metrics"]["prefix_cache_hit_rate"] * server["metrics"]["prompt_tokens"]
    assert hits == pytest.approx(requests["cached_prompt_tokens"])  # the server's count is the client's
    # The client's clock starts before the engine's: never a bucket below the server's, where the two
    # estimators read the same request. The client interpolates at rank (n-1)q (0-based) and the
    # histogram holds rank ceil(qn): with 6 requests p95 is 0.75 of the way from the 5th to the 6th,
    # whose bucket may start above that (a fresh-clone run saw TTFT p95 below).
    n = requests["completed"]
    below = [p for figure in server["cross_check"]["percentiles"].values() for p, row in figure.items()
             if row["side"] == "below"]
    assert server["cross_check"]["percentiles"]
    assert all((n - 1) * int(p[1:]) / 100 < math.ceil(int(p[1:]) / 100 * n) - 1 for p in below), below


def test_bench_chat_counts_the_chat_template_through_sglangs_tokenize(sglang_server, capsys):
    result = run_bench(capsys, sglang_server.url, "-n", "2", "-c", "2", "--input-tokens", "64",
                       "--output-tokens", "4", "--endpoint", "chat")
    # SGLang 0.5.23's /tokenize takes messages: the count holds the template, as the usage does.
    assert result["config"]["prompt_tokenizer"] == "server /tokenize"
    assert result["requests"]["prompt_tokens"]["mismatched"] == 0


def test_the_prefix_probe_hits_the_radix_cache(sglang_server):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "metrics.py"), "--url", sglang_server.url,
                           "--prefix-probe", "--json"], capture_output=True, text=True, timeout=600)
    probed = json.loads(done.stdout)
    assert (done.returncode, probed["verdict"], probed["cause"]) == (0, "can_hit", None), probed["evidence"]
    assert (probed["block_size"], probed["block_size_source"]) == (1, "sglang:page_size")
    second = probed["requests"][1]
    # All but the last token (SGLang never reuses it), by usage and by the server's counters.
    assert second["cached_tokens"] == probed["cacheable_tokens"] == probed["prompt_tokens"] - 1 == second["server"]["hits"]


def test_smoke_toolcall_fails_the_random_model_with_reasons(sglang_server, capsys):
    code = smoke_toolcall.main(["--url", sglang_server.url, "--json", "--max-tokens", "24"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["verdict"] == "FAIL" and report["model"] == "tiny-qwen3"
    results = {c["case"]: c for c in report["cases"]}
    # --tool-call-parser qwen25 parses nothing out of nonsense text: each case says what it expected.
    assert results["single_auto"]["reason"].startswith("plain: expected a call to get_current_weather, got no tool call")
    assert all(c["reason"] for c in report["cases"] if c["status"] == "FAIL")


def test_ppl_through_generate_equals_transformers(sglang_server, built, capsys):
    code = ppl.main(["--url", sglang_server.url, "--api", "sglang", "--json", "--timeout", "600"])
    run = json.loads(capsys.readouterr().out)
    assert code == 0 and run["api"] == "sglang", run.get("stopped")
    with http_client.client(sglang_server.url, timeout=600) as http:
        prefix, ids = perplexity.tokenize(http, "sglang", run["model"], (REPO / "scripts" / "data" / "sample.txt").read_text())
    assert perplexity.ids_sha256(prefix + ids) == run["token_ids_sha256"]
    plan = [[w["begin"], w["end"], w["end"] - w["scored"]] for w in run["windows"]]
    job = {"model_dir": built["models"]["tiny-qwen3"], "sequence": prefix + ids, "windows": plan}
    done = subprocess.run([built["python"], str(REPO / "tests" / "hf_reference_nll.py")], input=json.dumps(job),
                          capture_output=True, text=True, check=True)
    reference = math.exp(sum(json.loads(done.stdout)) / run["scored_tokens"])
    assert abs(run["ppl"] / reference - 1) < 0.001, (run["ppl"], reference)


# --------------------------------------------------------------------------------------------
# Faults made on purpose: the diagnosis names the SGLang flag and its current value

@pytest.fixture(scope="module")
def limited(sglang_factory):
    """--max-running-requests 2, the radix cache off."""
    with sglang_factory(sets=["max_num_seqs=2", "enable_prefix_caching=false"]) as server:
        yield server


@pytest.fixture(scope="module")
def small_kv(sglang_factory):
    """A KV pool of 2,048 tokens (--max-total-tokens; the fraction's budget stays)."""
    with sglang_factory(sets=["max_model_len=1024", sglang_server.extra_args("--max-total-tokens", "2048")]) as server:
        yield server


def test_a_running_limit_too_low_is_named_with_its_value(limited):
    # As vLLM's: prompts long enough that the engine queues them however slowly a busy API server
    # hands them over. 12 prompts of 512 tokens reached SGLang's scheduler one at a time in a
    # fresh-clone run beside two busy loops (#queue-req 0 or 1 in every prefill it logged; queue
    # 4.8 ms of a 128 ms mean).
    report = queued_window(limited)
    assert report["e2e_ms"]["n"] == 16 and queue_share(report) > 0.2, f"queued {queue_share(report):.0%} of the time"
    diagnosis = diagnosis_of(report)
    assert_root_cause(diagnosis, "running_limit", "--max-running-requests", 2)
    assert diagnosis["root_cause"]["evidence"].startswith(
        "--max-running-requests is 2 (exported: SGLang /get_server_info max_running_requests)")
    assert_plan_agrees(diagnosis, {"--max-running-requests": 2, "--disable-radix-cache": True})
    lever = diagnosis["plan"][0]
    assert lever["setting"] == "--max-running-requests" and lever["proposed"] > 2  # Little's law, not "higher"


def test_a_kv_pool_too_small_is_named_with_its_value(small_kv):
    # 16 requests of 128 + 256 tokens against a pool of 2,048: answers long enough that the load
    # outlasts the window's scrapes (with 64 tokens a loaded run's window lasted 1.8 s between two
    # idle samples, and nothing was named).
    report = windowed(small_kv.url, lambda: send_load(small_kv.url, small_kv.model, 16, 16, 128, 256, seed=24))
    assert report["kv_cache_tokens"] == 2048 and report["e2e_ms"]["n"] == 16
    diagnosis = diagnosis_of(report)
    # What the window saw, when it names nothing (a fresh-clone run beside two busy loops once did).
    assert diagnosis["root_cause"], {key: report.get(key) for key in (
        "seconds", "gauge_samples", "running_peak", "waiting_peak", "kv_cache_usage_max", "preemptions")}
    assert_root_cause(diagnosis, "kv_cache", "--max-total-tokens", 2048)
    assert diagnosis["root_cause"]["evidence"].startswith(
        "--max-total-tokens is 2,048 (exported: SGLang /get_server_info max_total_tokens): 2,048 KV tokens")
    assert diagnosis["plan"][0]["text"].startswith("--max-total-tokens: 2,048 -> ")


# --------------------------------------------------------------------------------------------
# The skills' SGLang metric names are real

SGLANG_NAME = re.compile(r"sglang:[a-z0-9_]+")
# Names the docs give as earlier names, replaced before SGLang 0.5 (PRs #3988, #4914).
SGLANG_REMOVED = {"sglang:time_per_output_token_seconds"}


def collector_source(python: str) -> str:
    """The installed SGLang's metrics collector (the module that declares every sglang: metric)."""
    found = subprocess.run([python, "-c", "import importlib.util as u; "
                            "print(u.find_spec('sglang').submodule_search_locations[0])"],
                           capture_output=True, text=True, timeout=120, check=True)
    return (Path(found.stdout.strip()) / "srt" / "observability" / "metrics_collector.py").read_text()


def test_documented_sglang_metric_names_are_served_or_declared(sglang_server, built):
    """The names in the skill's references and its recording rules."""
    documented = set()
    for path in (SKILLS / "roofline-perf").rglob("*.md"):
        doc = Doc.read(path)
        documented |= set(SGLANG_NAME.findall(" ".join(doc.inline_code) + " ".join(c for _, c in doc.code_blocks)))
    documented |= set(SGLANG_NAME.findall((SKILLS / "roofline-perf" / "references" / "prometheus" /
                                           "sglang-rules.yml").read_text()))
    served = set(re.findall(r"^(sglang:[a-z0-9_]+?)(?:_bucket|_sum|_count)?[{ ]",
                            httpx.get(f"{sglang_server.url}/metrics", timeout=60).text, re.M))
    declared = set(re.findall(r'name="(sglang:[a-z0-9_]+)"', collector_source(built["python"])))
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in documented}
    assert SGLANG_REMOVED <= families and not SGLANG_REMOVED & declared
    # A labelled counter appears at its first increment (cached tokens, retractions): declared is enough.
    assert families - SGLANG_REMOVED <= served | declared, sorted(families - SGLANG_REMOVED - served - declared)
