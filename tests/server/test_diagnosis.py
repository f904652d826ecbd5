"""diagnosis.py (with known_settings.py, findings.py and plan.py): one root cause, what it causes,
one plan that never contradicts itself nor asks for what is already set, and verify commands that
run as printed. On the saved scrapes of tests/fixtures/metrics and on window snapshots built here,
one per kind of finding, in the shape snapshots.difference() gives; deployment.py on the
answers vLLM's /server_info and SGLang's /get_server_info give (their shapes from the engines'
source), and on a real vLLM.
"""
from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from pathlib import Path

import httpx
import metrics
import pytest
from vllm_server import task_exe

from rooflib.core import conf, printing, taskcall
from rooflib.load import bench_options
from rooflib.server import (
    deployment,
    diagnosis,
    engine_metrics,
    findings,
    known_settings,
    plan,
    report_text,
    slo_targets,
    snapshots,
    watch,
)
from rooflib.server.reading import Latency, Reading

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
FINDING_KEYS = {"kind", "evidence", "confidence", "caused_by", "setting", "current", "current_source"}
LEVER_KEYS = {"setting", "current", "current_source", "proposed", "reason", "effect", "text"}

# vLLM 0.32's bucket bounds (vllm/v1/metrics/loggers.py and buckets.py).
TTFT_BOUNDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BOUNDS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0]
TOKEN_BOUNDS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
STEP_BOUNDS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def fixture_report(*names: str, seconds: float | None = None) -> dict:
    snaps = [snapshots.snapshot((FIXTURES / name).read_text(), name) for name in names]
    if len(snaps) == 1:
        return engine_metrics.report(snaps[0])
    snaps[0]["time"], snaps[1]["time"] = 0.0, seconds
    return engine_metrics.report(snapshots.difference(*snaps))


def histogram(metric: str, observations: list[float], bounds: list[float]) -> dict:
    return {"metric": metric, "le": [*map(float, bounds), math.inf],
            "counts": [float(sum(1 for o in observations if o <= le)) for le in bounds] + [float(len(observations))],
            "sum": float(sum(observations)), "count": float(len(observations))}


CACHE_CONFIG = {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                "gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": "None", "num_gpu_blocks": "20000",
                "kv_cache_size_tokens": "320000", "kv_cache_max_concurrency": "40.0"}


def window(*, n: int = 60, seconds: float = 60.0, queue: float = 0.0, prefill: float = 0.1, decode: float = 2.0,
           itl: list[float] | None = None, tpot: float = 0.02, prompt: int = 1600, output: int = 100,
           prompt_counter: float | None = None, steps: list[float] | None = None, hits: float = 0.5,
           running: tuple[float, float] = (0, 0), waiting: tuple[float, float] = (0, 0), kv: float = 0.1,
           preemptions: float = 0, plateau: tuple[float, ...] = (), cache_config: dict | None = None,
           endpoint: str = "completion") -> dict:
    """A vLLM window of `n` requests finished in `seconds`, each queued, prefilled and decoded
    for the given seconds, with the given lengths; gauges as (last value, peak); engine steps of
    the peak running count each, unless given."""
    ttft = queue + prefill
    batch = max(1, running[1])
    hists = {
        "ttft": histogram("vllm:time_to_first_token_seconds", [ttft] * n, TTFT_BOUNDS),
        "itl": histogram("vllm:inter_token_latency_seconds", itl or [tpot] * (n * (output - 1)), ITL_BOUNDS),
        "tpot": histogram("vllm:request_time_per_output_token_seconds", [tpot] * n, ITL_BOUNDS),
        "e2e": histogram("vllm:e2e_request_latency_seconds", [queue + prefill + decode] * n, REQUEST_BOUNDS),
        "queue": histogram("vllm:request_queue_time_seconds", [queue] * n, REQUEST_BOUNDS),
        "prefill": histogram("vllm:request_prefill_time_seconds", [prefill] * n, REQUEST_BOUNDS),
        "decode": histogram("vllm:request_decode_time_seconds", [decode] * n, REQUEST_BOUNDS),
        "prompt_len": histogram("vllm:request_prompt_tokens", [prompt] * n, TOKEN_BOUNDS),
        "output_len": histogram("vllm:request_generation_tokens", [output] * n, TOKEN_BOUNDS),
        "step_tokens": histogram("vllm:iteration_tokens_total", steps or [float(batch)] * (n * output // batch),
                                 STEP_BOUNDS),
    }
    queried = prompt_counter if prompt_counter is not None else float(prompt * n)
    counters = {"prompt_tokens": queried, "generation_tokens": float(output * n), "preemptions": float(preemptions),
                "prefix_queries": queried, "prefix_hits": queried * hits,
                f"{endpoint}_requests": float(n)}
    gauges = {"running": running, "waiting": waiting, "kv_cache_usage": (kv, kv)}
    return {"engine": "vllm", "source": "synthetic", "models": ["m"], "engines": 1, "time": seconds,
            "seconds": seconds, "start_time": 0.0, "warnings": [], "cache_config": cache_config or CACHE_CONFIG,
            "histograms": hists,
            "counters": {k: {"metric": k, "value": v, "series": 1} for k, v in counters.items()},
            "gauges": {k: {"metric": k, "value": v[0], "max": v[1], "peak_value": v[1], "samples": 30}
                       for k, v in gauges.items()},
            "running_while_waiting": list(plateau)}


@pytest.fixture(autouse=True)
def called_from_the_project(monkeypatch):
    """The commands a diagnosis prints take the form of the Taskfile that ran it: here the
    project's, as `task infer:metrics` from the repository passes it."""
    monkeypatch.setenv(taskcall.ENV_TASK, "infer:metrics")
    monkeypatch.setenv(taskcall.ENV_ROOT, str(REPO / "Taskfile.yml"))
    monkeypatch.setenv(taskcall.ENV_CWD, str(REPO))


def diagnosed(snap: dict, slo=slo_targets.Targets(), served: deployment.Served | None = None) -> dict:
    r = engine_metrics.report(snap, slo=slo, served=served)
    assert_one_plan(r)
    return r


def kinds(r: dict) -> list[str]:
    return [f["kind"] for f in r["diagnosis"]["findings"]]


def assert_one_plan(r: dict) -> None:
    """The contract: the root first, findings and levers with exactly the agreed keys, causes that
    are findings, one lever per setting (no "raise" and "lower" of one), none for what is set."""
    d = json.loads(printing.json_text(r["diagnosis"]))
    assert set(d) == {"root_cause", "findings", "plan", "verify"}
    assert d["root_cause"] == (d["findings"][0] if d["findings"] else None)
    for finding in d["findings"]:
        assert set(finding) == FINDING_KEYS and finding["evidence"] and finding["confidence"]
        assert finding["caused_by"] is None or finding["caused_by"] in {f["kind"] for f in d["findings"]}
        assert finding["current_source"] in ("exported", "inferred", "unknown", None)
    settings = [lever["setting"] for lever in d["plan"] if lever["setting"]]
    assert len(settings) == len(set(settings)), settings
    for lever in d["plan"]:
        assert set(lever) == LEVER_KEYS and lever["text"] and lever["reason"] and lever["effect"]
        if lever["setting"]:
            assert lever["current"] is None or lever["proposed"] != lever["current"], lever["text"]
            assert lever["text"].startswith(f"{lever['setting']}: ") and f"(current: {lever['current_source']})" in lever["text"]
    caching = r["settings"]["prefix_caching"]["value"]
    assert not any("prefix caching is on" in lever["text"] for lever in d["plan"])
    if caching:
        assert not any(lever["setting"] in ("--enable-prefix-caching", "--disable-radix-cache") for lever in d["plan"])
    assert (d["verify"] == []) == (d["root_cause"] is None)


# --------------------------------------------------------------------------------------------
# The saved scrapes

@pytest.mark.parametrize("names, seconds, root, setting, current", [
    # KV 97% full with 12 retractions: no "raise --max-running-requests" beside "lower" it.
    (("sglang-0.5-tp2.txt",), None, "kv_cache", "--mem-fraction-static", None),
    (("vllm-0.32-preempt-after.txt",), None, "kv_cache", "--kv-cache-memory-bytes", 4194304),
    (("vllm-0.32-preempt-before.txt", "vllm-0.32-preempt-after.txt"), 11.92, "kv_cache", "--kv-cache-memory-bytes",
     4194304),
    (("vllm-0.32-queue-before.txt", "vllm-0.32-queue-after.txt"), 17.87, "running_limit", "--max-num-seqs", 2),
    (("vllm-0.32-queue-after.txt",), None, "queue", None, None),
    (("vllm-v0.txt",), None, "kv_cache", "--gpu-memory-utilization", None),
])
def test_saved_scrapes_lead_with_the_right_root_and_one_plan(names, seconds, root, setting, current):
    r = fixture_report(*names, seconds=seconds)
    assert_one_plan(r)
    found = r["diagnosis"]["root_cause"]
    assert (found["kind"], found["setting"], found["current"]) == (root, setting, current)
    first = next(line for line in report_text.format_report(r).splitlines() if line.startswith(("Root", "Diag")))
    assert first.startswith(f"Root cause: [{root}] " + (f"{setting} is " if setting else ""))


@pytest.mark.parametrize("names, seconds", [(("sglang-0.5-tp2.txt",), None),
                                            (("vllm-0.32-preempt-after.txt",), None),
                                            (("vllm-0.32-preempt-before.txt", "vllm-0.32-preempt-after.txt"), 11.92)])
def test_a_full_kv_cache_never_asks_for_more_running_requests(names, seconds):
    """The before-stop review: [queue] said raise the running cap, [decode] and [preemptions]
    lower it. The queue is the full cache's consequence: the plan grows the cache, and lowers
    the cap only to what the cache holds."""
    r = fixture_report(*names, seconds=seconds)
    assert kinds(r)[:3] == ["kv_cache", "preemptions", "queue"]
    caps = [lever for lever in r["diagnosis"]["plan"] if lever["setting"] in ("--max-num-seqs", "--max-running-requests")]
    assert all(lever["proposed"] is not None and lever["proposed"] <= 2 for lever in caps), caps
    assert not any("make sure prefix caching" in lever["text"] or "raise --max" in lever["text"]
                   for lever in r["diagnosis"]["plan"])


@pytest.mark.parametrize("client_peak, proposed, said", [
    # The gauge samples of this window read 0 running and 0 waiting (the load came between them):
    # without the client's count, the size doubles as a first step.
    (None, 8 * MIB, "twice the size is a first step"),
    # A bench that had 16 out at once sizes it for them: 16 x 768 tokens over the 2,048 it holds.
    (16, 24 * MIB, "the requests in flight (16 at once at the busiest moment of the bench's own requests, 2.3 on "
                   "average) need about 12,288 KV tokens, the cache holds 2,048"),
])
def test_the_kv_cache_is_sized_for_the_most_requests_the_client_had_in_flight(client_peak, proposed, said):
    snaps = [snapshots.snapshot((FIXTURES / name).read_text(), name)
             for name in ("vllm-0.32-preempt-before.txt", "vllm-0.32-preempt-after.txt")]
    snaps[0]["time"], snaps[1]["time"] = 0.0, 11.92
    r = engine_metrics.report(snapshots.difference(*snaps), client_peak_in_flight=client_peak)
    assert_one_plan(r)
    assert (r["running_peak"], r["waiting_peak"]) == (0, 0)
    lever = r["diagnosis"]["plan"][0]
    assert (lever["setting"], lever["current"], lever["proposed"]) == ("--kv-cache-memory-bytes", 4 * MIB, proposed)
    assert said in lever["reason"], lever["reason"]


def test_sglang_low_hits_under_a_full_cache_are_evictions_not_a_switch_to_turn_on():
    r = fixture_report("sglang-0.5-tp2.txt")
    evicted = next(f for f in r["diagnosis"]["findings"] if f["kind"] == "prefix_evicted")
    assert evicted["caused_by"] == "kv_cache" and "evicted" in evicted["evidence"]
    assert r["settings"]["prefix_caching"] == {"value": True, "source": "inferred",
                                               "how": "prompts hit the prefix cache (5.0% of prompt tokens)",
                                               "at_least": False}


def test_quantiles_are_shown_as_the_bucket_they_lie_in():
    """The queue window's TTFT p95 interpolates to 18.7 s inside the 10-20 s bucket while e2e p99
    is 14.9 s: as buckets, 10-20 s and 10-15 s, they no longer contradict each other."""
    r = fixture_report("vllm-0.32-queue-before.txt", "vllm-0.32-queue-after.txt", seconds=17.87)
    assert r["ttft_ms"]["p95"] == pytest.approx(18666.7, abs=0.1) and r["e2e_ms"]["p99"] == pytest.approx(14900)
    assert known_settings.quantile_text(Latency.of(r["ttft_ms"]), "p95") == "10-20 s"
    assert known_settings.quantile_text(Latency.of(r["e2e_ms"]), "p99") == "10-15 s"
    assert known_settings.quantile_text(Latency.of(r["itl_ms"]), "p50") == "<=10 ms"
    row = next(line for line in report_text.format_report(r).splitlines() if line.startswith("  TTFT"))
    assert row.split()[1:4] == ["5-7.5", "s", "10-20"]


def test_lengths_come_from_the_finished_requests():
    """vLLM counts prompt tokens when it prefills them: 15 prefilled, 6 finished gave
    "4,000-token prompts" for 1,600-token ones. The request histograms count finished ones."""
    r = diagnosed(window(n=6, prompt=1600, prompt_counter=15 * 1600.0))
    assert r["prompt_tokens_mean"] == 1600 and r["output_tokens_mean"] == 100
    assert r["lengths_from"] == "vllm:request_prompt_tokens" and r["tokens_per_request"] == 1700
    assert "of 1,600 prompt + 100 output tokens on average" in report_text.format_report(r)


# --------------------------------------------------------------------------------------------
# Each kind, on a window built for it

def test_a_healthy_window_has_no_finding_and_says_so():
    r = diagnosed(window())
    assert kinds(r) == [] and r["diagnosis"]["plan"] == []
    assert report_text.format_report(r).endswith("Diagnosis: no bottleneck found in these figures.")


def stalled(**extra) -> dict:
    """The user's case: 1,600-token prompts with a shared system prompt and prefix caching off,
    1-3 running, TTFT p95 over 2 s, and tokens stalled behind the long prefills."""
    itl = [0.02] * 5000 + [1.2] * 300  # most gaps 20 ms, one in 18 a prefill's 1.2 s
    config = {**CACHE_CONFIG, "enable_prefix_caching": "False"}
    return window(n=50, prefill=2.2, decode=8.0, itl=itl, tpot=0.08, running=(2, 3), hits=0.0,
                  cache_config=config, **extra)


def test_prefix_caching_off_is_the_root_of_slow_prefill_and_token_stalls():
    r = diagnosed(stalled())
    assert kinds(r) == ["prefix_cache_off", "prefill", "decode"]
    off, prefill, decode = r["diagnosis"]["findings"]
    assert (off["setting"], off["current"], off["current_source"]) == ("--enable-prefix-caching", False, "exported")
    assert prefill["caused_by"] == "prefix_cache_off" and decode["caused_by"] == "prefill"
    assert "tokens stall behind prefills" in decode["evidence"] and "ITL p95 1-2.5 s" in decode["evidence"]
    lever = r["diagnosis"]["plan"][0]
    assert lever["text"].startswith("--enable-prefix-caching: False -> True (current: exported)")
    # no "lower --max-num-seqs" for slow tokens with 2 running
    assert "--max-num-seqs" not in [lever["setting"] for lever in r["diagnosis"]["plan"]]
    # The change is the server's flag: the same workload before and after, one that shares a prefix.
    before, after, compare = r["diagnosis"]["verify"]
    assert "--shared-prefix 800" in before and "--shared-prefix 800" in after
    assert compare == "task infer:compare A=before.json B=after.json"


def test_caching_on_with_no_hit_is_the_clients_prompts_not_a_switch():
    r = diagnosed(window(hits=0.0))
    assert kinds(r) == ["prefix_unstable"]
    unstable = r["diagnosis"]["root_cause"]
    assert unstable["setting"] is None and "first 16-token block" in unstable["evidence"]
    assert r["diagnosis"]["plan"][0]["text"].startswith("make the prompts' start stable (client side)")
    # The change is the client's prompts: only the second bench shares a prefix, and compare is told.
    before, after, compare = r["diagnosis"]["verify"]
    assert "--shared-prefix" not in before and "--shared-prefix 800" in after
    assert task_command(compare)[-4:] == ["before.json", "after.json", "--variable", "shared_prefix"]


def test_exported_cap_with_room_in_the_kv_cache_is_the_running_limit():
    served = deployment.Served("http://h:8000", {
        "max_num_seqs": deployment.Known(4, "exported", "vLLM /server_info scheduler_config.max_num_seqs"),
        "max_num_batched_tokens": deployment.Known(8, "exported", "vLLM /server_info scheduler_config.max_num_batched_tokens")})
    r = diagnosed(window(n=60, queue=6.0, prompt=200, running=(4, 4), waiting=(20, 24)), served=served)
    assert kinds(r) == ["running_limit", "queue"]
    root = r["diagnosis"]["root_cause"]
    assert (root["current"], root["current_source"]) == (4, "exported") and root["confidence"].startswith("high")
    seqs, batched = r["diagnosis"]["plan"][:2]
    # 60 requests in 60 s, each 8.1 s in the server: about 8.1 in flight on average (Little's law),
    # but 4 running and 24 waiting at the busiest sample: the cap holds the peak of 28 -> 32
    assert (seqs["setting"], seqs["current"], seqs["proposed"]) == ("--max-num-seqs", 4, 32)
    assert "8.1 requests in the server" in seqs["reason"] and "28 at the busiest" in seqs["reason"]
    assert (batched["setting"], batched["current"], batched["proposed"]) == ("--max-num-batched-tokens", 8, 32)
    # A light bench beside the users' traffic, not the traffic's own concurrency.
    assert r["diagnosis"]["verify"][0].startswith("task infer:bench INFER_URL=http://h:8000 BENCH_IN=200 BENCH_OUT=100 "
                                                  "BENCH_C=2 BENCH_N=16 -- ")


def test_a_burst_the_gauges_missed_is_sized_by_the_time_it_waited_behind_the_cap():
    """SGLang's running-limit case in a fresh-clone run beside two busy loops: 12 requests at once
    against a cap of 2 finished in a 2 s burst inside a 10 s window, and every gauge sample missed
    it. Over the window 0.8 were in flight on average, which fits under the cap; while the cap held
    them each waited 2.5 services first, so 2 x (2.5 + 1) = 7 were in the server: 8 lets them run."""
    r = diagnosed(window(n=12, seconds=10.0, queue=0.5, prefill=0.05, decode=0.15, prompt=512, output=4),
                  served=exported_cap(2))
    assert kinds(r)[0] == "running_limit"
    seqs = r["diagnosis"]["plan"][0]
    assert (seqs["setting"], seqs["current"], seqs["proposed"]) == ("--max-num-seqs", 2, 8), seqs["text"]
    assert "the server held about 7.0 requests while the cap made them wait" in seqs["reason"], seqs["reason"]
    assert "0.8 in the server on average over the whole 10 s window" in seqs["reason"], seqs["reason"]


def exported_cap(value: int) -> deployment.Served:
    return deployment.Served("http://h:8000", {"max_num_seqs": deployment.Known(
        value, "exported", "vLLM /server_info scheduler_config.max_num_seqs")})


def prefill_held(*, plateau: tuple[float, ...], running: tuple[float, float], kv_requests: float = 155.0) -> dict:
    """Tune's baseline in CI: four users of 2,048-token prompts (1,920 shared) on the CPU build's
    cap of 128 with prefix caching off; TTFT p95 over 1 s, a third of it queued. The KV cache
    holds `kv_requests` of them (2,064 tokens each)."""
    kv_tokens = round(kv_requests * 2064)
    return window(n=16, seconds=20.0, queue=0.45, prefill=0.4, decode=0.3, prompt=2048, output=16, hits=0.0,
                  running=running, waiting=(0, 2), plateau=plateau,
                  cache_config={**CACHE_CONFIG, "enable_prefix_caching": "False", "kv_cache_size_tokens": str(kv_tokens),
                                "kv_cache_max_concurrency": str(kv_tokens / 4096)})


def test_requests_that_wait_with_the_exported_cap_far_from_reached_wait_for_the_prefills_ahead():
    """Four in flight never reach a cap of 128: what holds a request is the step's token budget
    the prefills ahead of it spend (vLLM admits no waiting request once it is 0), so the queue is
    the prefills', and their cause, the cache being off, is the root, not the cap."""
    r = diagnosed(prefill_held(plateau=(3, 2, 3), running=(2, 4)), slo=slo_targets.Targets(300),
                  served=exported_cap(128))
    assert kinds(r) == ["prefix_cache_off", "prefill", "queue"]
    _, prefill, queue = r["diagnosis"]["findings"]
    assert (prefill["caused_by"], queue["caused_by"]) == ("prefix_cache_off", "prefill")
    assert prefill["evidence"].startswith("requests waited while at most 4 ran of the 128 that --max-num-seqs allows "
                                          "(vLLM /server_info scheduler_config.max_num_seqs) and the KV cache had room")
    assert queue["evidence"].startswith("requests wait for the prefills ahead: ")
    plan_settings = [lever["setting"] for lever in r["diagnosis"]["plan"]]
    assert plan_settings[0] == "--enable-prefix-caching" and "--max-num-seqs" not in plan_settings


def test_on_sglang_the_same_queue_names_its_flags_and_the_kv_it_reserves():
    snap = {**prefill_held(plateau=(3, 2, 3), running=(2, 4)), "engine": "sglang"}
    served = deployment.Served("http://h:30000", {
        "max_num_seqs": deployment.Known(48, "exported", "SGLang /get_server_info max_running_requests"),
        "max_num_batched_tokens": deployment.Known(8192, "exported", "SGLang /get_server_info chunked_prefill_size")})
    r = diagnosed(snap, served=served)
    prefill = next(f for f in r["diagnosis"]["findings"] if f["kind"] == "prefill")
    assert prefill["evidence"].startswith("requests waited while at most 4 ran of the 48 that --max-running-requests "
                                          "allows (SGLang /get_server_info max_running_requests)")
    assert "(--chunked-prefill-size 8,192 (exported" in prefill["evidence"]
    assert "SGLang also while the KV it reserves for the running requests' next tokens leaves room" in prefill["evidence"]
    assert [f["kind"] for f in r["diagnosis"]["findings"]][-2:] == ["prefill", "queue"]


@pytest.mark.parametrize("cap, plateau, running, kv_requests, root", [
    (128, (3, 2, 3), (2, 4), 155, "prefix_cache_off"),  # 124 slots never taken
    (6, (3, 2, 3), (2, 4), 155, "prefix_cache_off"),    # 2 never taken: a gauge misses at most one
    (5, (3, 2, 3), (2, 4), 155, "running_limit"),       # 1 never seen taken: the one that just finished
    (4, (4, 4, 3), (4, 4), 155, "running_limit"),       # at the cap while others wait
    (128, (3, 2, 3), (2, 4), 5, "kv_cache"),            # slots free, but no KV room for two more
])
def test_the_cap_holds_requests_only_where_every_count_of_them_running_comes_near_it(cap, plateau, running,
                                                                                     kv_requests, root):
    r = diagnosed(prefill_held(plateau=plateau, running=running, kv_requests=kv_requests), served=exported_cap(cap))
    assert r["diagnosis"]["root_cause"]["kind"] == root


def test_an_admission_cap_below_max_num_seqs_is_the_running_limit_named_by_its_own_flag():
    """vLLM 0.32's --max-num-active-seqs admits fewer into RUNNING than --max-num-seqs sizes the
    runner for: raising --max-num-seqs would change nothing."""
    served = deployment.server_settings("http://h:8000", "vllm", transport=server({
        "/v1/models": {"data": [{"id": "m", "max_model_len": 4096}]}, "/server_info": {"vllm_config": {
            **VLLM_SERVER_INFO["vllm_config"],
            "scheduler_config": {"max_num_seqs": 256, "max_num_active_seqs": 4, "max_num_batched_tokens": 2048}}}}))
    r = diagnosed(window(n=60, queue=6.0, prompt=200, running=(4, 4), waiting=(20, 24)), served=served)
    root, lever = r["diagnosis"]["root_cause"], r["diagnosis"]["plan"][0]
    assert (root["kind"], root["setting"], root["current"], root["current_source"]) == \
        ("running_limit", "--max-num-active-seqs", 4, "exported")
    assert (lever["setting"], lever["current"]) == ("--max-num-active-seqs", 4) and lever["proposed"] > 4
    assert "at most max_num_seqs 256" in r["settings"]["max_num_seqs"]["how"]


def test_requests_running_while_others_wait_put_a_floor_under_the_cap():
    r = diagnosed(window(queue=6.0, prompt=200, running=(2, 2), waiting=(9, 9), plateau=(2, 2, 2)))
    root = r["diagnosis"]["root_cause"]
    assert (root["kind"], root["current"], root["current_source"]) == ("running_limit", 2, "inferred")
    assert "--max-num-seqs is at least 2 (inferred: 2 running at the busiest of 30 gauge samples, KV usage at " \
           "most 10.0%" in root["evidence"]
    # vLLM 0.32 can cap admission lower with its own flag: the evidence names it where not exported.
    assert "(or --max-num-active-seqs, vLLM 0.32+, where set below it)" in root["evidence"]
    assert r["settings"]["max_num_seqs"]["at_least"] is True


def test_gauges_sampled_in_long_prefills_read_the_cap_less_the_finished_ones():
    """The live deployment of --max-num-seqs 2 under 16 prompts of 2,048 tokens with 16 output
    tokens each: vLLM publishes its gauges after a step's finished request left and before the
    next step admits another, so samples in the long prefill steps read 1 running. The 137 steps
    that made tokens generated 256 of them: 1.87 requests a step, so the cap is at least 2."""
    steps = [2049.0] * 16 + [2.0] * 104 + [1.0] * 17
    r = diagnosed(window(n=16, seconds=15.0, queue=1.5, prefill=0.19, decode=0.25, prompt=2048, output=16,
                         running=(0, 1), waiting=(0, 14), plateau=(1, 1, 1, 1), steps=steps))
    root = r["diagnosis"]["root_cause"]
    assert (root["kind"], root["current"], root["current_source"]) == ("running_limit", 2, "inferred")
    assert root["evidence"].startswith("--max-num-seqs is at least 2 (inferred: 1.87 requests per engine step")
    # 2.1 in flight on average, but 1 running and 14 waiting at once: 15 -> 16.
    assert r["diagnosis"]["plan"][0]["text"].startswith("--max-num-seqs: at least 2 -> 16 (current: inferred)")


def test_requests_that_queued_a_share_of_their_time_put_a_floor_under_the_cap():
    """A fresh-clone run beside two busy loops: 16 requests against --max-num-seqs 2 queued a
    third of their time, yet the window's idle seconds left fewer than one waiting on average, and
    no gauge sample caught one running. The queue histogram says they waited, so Little's law
    over the window (2.3 s running each, 16 in 20 s: 1.84 at a time) is the floor: at least 2."""
    snap = window(n=16, seconds=20.0, queue=1.0, prefill=0.3, decode=2.0, prompt=3072, output=16)
    del snap["histograms"]["step_tokens"]
    r = diagnosed(snap)
    assert r["waiting_mean"] < 1 and r["running_peak"] == 0
    root = r["diagnosis"]["root_cause"]
    assert (root["kind"], root["current"], root["current_source"]) == ("running_limit", 2, "inferred")
    assert "1.8 requests ran at a time on average while 0.8 waited (Little's law over the window)" in root["evidence"]


def test_draft_tokens_accepted_by_speculative_decoding_are_not_requests():
    """Three tokens a request per step, two of them accepted drafts: two requests a step, not six."""
    snap = window(queue=6.0, prompt=200, running=(1, 1), waiting=(9, 9), plateau=(1,), steps=[6.0] * 1000)
    snap["counters"]["spec_accepted"] = {"metric": "vllm:spec_decode_num_accepted_tokens_total", "value": 4000.0,
                                         "series": 1}
    r = diagnosed(snap)
    assert r["requests_per_step"] == 2.0 and r["diagnosis"]["root_cause"]["current"] == 2


def test_requests_per_step_a_hair_over_the_cap_are_the_cap():
    """A fresh-clone run of --max-num-seqs 2 under load read 2.00 requests per engine step, a hair
    above 2 (vLLM makes one token a request a step without drafts): the floor is 2, not 3."""
    snap = window(queue=6.0, prompt=200, running=(1, 1), waiting=(9, 9), plateau=(1,), steps=[2.0] * 1000)
    snap["counters"]["generation_tokens"]["value"] = 2003.0
    r = diagnosed(snap)
    root = r["diagnosis"]["root_cause"]
    assert r["requests_per_step"] == 2.003 and (root["current"], root["current_source"]) == (2, "inferred")
    assert "at least 2 (inferred: 2.00 requests per engine step" in root["evidence"]


def test_requests_filling_the_kv_cache_are_the_kv_limit_not_the_cap():
    r = diagnosed(window(queue=6.0, prompt=8000, output=1000, running=(30, 30), waiting=(10, 10), kv=0.95))
    assert kinds(r)[:2] == ["kv_cache", "queue"]
    assert r["diagnosis"]["root_cause"]["setting"] == "--gpu-memory-utilization"
    levers = {lever["setting"]: lever for lever in r["diagnosis"]["plan"]}
    assert (levers["--gpu-memory-utilization"]["current"], levers["--gpu-memory-utilization"]["proposed"]) == (0.9, 0.93)
    assert levers["--kv-cache-dtype"]["proposed"] == "fp8" and "--max-num-seqs" not in levers


def test_an_fp8_kv_cache_is_not_proposed_again():
    r = diagnosed(window(queue=6.0, prompt=8000, output=1000, running=(30, 30), waiting=(10, 10), kv=0.95,
                         cache_config={**CACHE_CONFIG, "cache_dtype": "fp8"}))
    assert "--kv-cache-dtype" not in [lever["setting"] for lever in r["diagnosis"]["plan"]]


def test_slow_tokens_of_a_large_batch_trade_batch_size():
    r = diagnosed(window(n=600, tpot=0.08, decode=8.0, prompt=300))
    assert kinds(r) == ["decode"]
    decode = r["diagnosis"]["root_cause"]
    assert decode["setting"] == "--max-num-seqs" and "TPOT p95 75-100 ms" in decode["evidence"]
    assert "with 81 requests running" in decode["evidence"]  # Little's law: 600 x 8.1 s in 60 s
    assert r["diagnosis"]["plan"][0]["text"].startswith("--max-num-seqs: unknown -> 64 (current: unknown)")


def test_slow_tokens_of_a_small_batch_are_memory_bound():
    r = diagnosed(window(tpot=0.08, decode=0.8, n=6, prompt=300))
    decode = r["diagnosis"]["root_cause"]
    assert decode["setting"] is None and "decode is bound by reading weights and KV per step" in decode["evidence"]
    assert [lever["text"].split(":")[0] for lever in r["diagnosis"]["plan"]] == [
        "speculative decoding (--speculative-config)", "FP8 weights (--quantization fp8)"]


def batched_budget(tokens: int) -> deployment.Served:
    """vLLM's /server_info in dev mode: the per-step token budget, exported."""
    return deployment.Served("http://h:8000", {"max_num_batched_tokens": deployment.Known(
        tokens, "exported", "vLLM /server_info scheduler_config.max_num_batched_tokens")})


def test_the_largest_engine_step_is_a_prompt_not_the_per_step_budget():
    """vLLM 0.32 counts a chunked prompt's tokens in the step that finishes it: steps of 2,048
    under 4,000-token prompts are 4,000-token prompts less their cache hits, not a 2,048 budget.
    Exported, the budget gives the lever."""
    steps = [2048.0] * 40 + [8.0] * 400
    r = diagnosed(window(prompt=4000, prefill=3.0, steps=steps))
    assert r["settings"]["max_num_batched_tokens"]["source"] == "unknown"
    assert "--max-num-batched-tokens" not in [lever["setting"] for lever in r["diagnosis"]["plan"]]
    r = diagnosed(window(prompt=4000, prefill=3.0, steps=steps), served=batched_budget(2048))
    assert kinds(r) == ["prefill"]
    lever = r["diagnosis"]["plan"][0]
    assert lever["text"].startswith("--max-num-batched-tokens: 2,048 -> 4,096 (current: exported): prompts of 4,000 "
                                    "tokens take 2 steps each")


def test_prompts_split_over_engine_steps_lead_a_low_hit_rate():
    """Long prompts that share nothing and a per-step budget that splits each: the steps are the
    measured cause of the slow prefill (the budget's lever first); the hit rate follows under Also."""
    r = diagnosed(window(prompt=4000, prefill=3.0, hits=0.0), served=batched_budget(2048))
    assert kinds(r) == ["prefill", "prefix_unstable"]
    root = r["diagnosis"]["root_cause"]
    assert (root["setting"], root["current"], root["caused_by"]) == ("--max-num-batched-tokens", 2048, None)
    assert "2 engine steps each under --max-num-batched-tokens 2,048 (exported" in root["evidence"]
    assert r["diagnosis"]["plan"][0]["setting"] == "--max-num-batched-tokens"
    # One step holds each prompt: the low hit rate stays the root, and the slow prefill its consequence.
    r = diagnosed(window(prompt=1600, prefill=3.0, hits=0.0), served=batched_budget(2048))
    assert kinds(r) == ["prefix_unstable", "prefill"]


def test_a_root_outside_the_engine_comes_first():
    outside = findings._finding("outside_engine", "the client saw 300 ms more than the engine", "high: both sides")
    queue = findings._finding("queue", "requests wait", "low")
    found = findings.ordered([queue, outside])
    assert [f["kind"] for f in found] == ["outside_engine", "queue"]
    slo = {"ttft_p95_ms": 2000, "tpot_p95_ms": 100, "itl_p95_ms": 200}
    levers = plan.plan(found, Reading.of({"engine": "vllm", "mode": "window", "slo": slo}), {})
    assert [lever["text"].split(": ")[0] for lever in levers] == [
        "split the gap from where the users are", "task infer:metrics WINDOW=30 while the load is on",
        "add replicas or data-parallel engines (--data-parallel-size)"]


def test_time_outside_the_engine_leads_the_diagnosis_of_a_bench_run():
    """bench's cross-check: every request 300 ms later at the client than in the engine, all of
    it in a trivial request's round trip. The client waits for it whatever the engine does."""
    snap = window(hits=0.0)
    late = {key: {"p50": ms, "p95": ms, "p99": ms, "mean": ms, "n": 60} for key, ms in (("ttft_ms", 400.0),
                                                                                         ("e2e_ms", 2400.0))}
    checked = watch.cross_check(snap, {**late, "one_read": 0}, 0.1, {"path": "/health", "p50_ms": 300.0})
    engine = diagnosed(snap)
    assert engine["ttft_ms"]["mean"] == pytest.approx(100, rel=0.3)  # less than the 300 ms outside
    d = diagnosis.with_outside(checked["findings"], engine["diagnosis"], engine["ttft_ms"]["mean"])
    assert [(f["kind"], f.get("cause")) for f in d["findings"]] == [
        ("outside_engine", "fixed_latency"), ("outside_engine", "network"), ("prefix_unstable", None)]
    assert d["root_cause"]["size_ms"] == pytest.approx(300) and "remedy" not in d["root_cause"]
    assert d["plan"][0]["text"].startswith("find the hop that adds it: the network and gateway findings split it: "
                                           "about 300 ms of each request outside the engine (fixed_latency)")
    assert d["plan"][-1]["text"].startswith("make the prompts' start stable (client side)")
    assert diagnosis.with_outside([], diagnosed(snap)["diagnosis"])["root_cause"]["kind"] == "prefix_unstable"


def test_time_outside_the_engine_shorter_than_the_engines_own_wait_follows_the_engines_root():
    """tune's CPU baseline: 16 requests on a running cap of 1 queue for seconds in the engine, while
    its starved API server hands a few streams over in one read (about 300 ms each): the cap is
    the root, the buffering an "also" whose remedy comes after the engine's plan."""
    engine = diagnosed(window(n=60, queue=6.0, prompt=200, running=(1, 1), waiting=(15, 15)))
    outside = [{"kind": "outside_engine", "cause": "buffering", "size_ms": 320.0, "confidence": "medium: some streams",
                "evidence": "15 of 16 streams came in one read at the end", "remedy": "turn off response buffering",
                "caused_by": None, "setting": None, "current": None, "current_source": None}]
    d = diagnosis.with_outside(outside, engine["diagnosis"], engine["ttft_ms"]["mean"])
    assert d["root_cause"] == engine["diagnosis"]["root_cause"] and d["root_cause"]["kind"] == "running_limit"
    assert [f["kind"] for f in d["findings"]] == kinds(engine) + ["outside_engine"]
    assert d["plan"][:-1] == engine["diagnosis"]["plan"]
    assert d["plan"][-1]["text"].startswith("turn off response buffering: about 320 ms of each request outside")
    # The same 320 ms against an engine that answers in 100 ms is the root.
    quick = diagnosed(window(hits=0.0))
    assert diagnosis.with_outside(outside, quick["diagnosis"], quick["ttft_ms"]["mean"])["root_cause"]["cause"] == \
        "buffering"


# --------------------------------------------------------------------------------------------
# The verify commands run as printed

def task_command(line: str) -> list[str]:
    """The script command `task --dry` runs for a printed `task infer:...` line."""
    result = subprocess.run([task_exe(), "--verbose", "--dry", *shlex.split(line)[1:]], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ran = re.search(r'task: \[(?:infer:)?\w+\] (.+)', result.stderr + result.stdout)[1]
    return shlex.split(ran)


def test_verify_commands_are_real_bench_and_compare_runs():
    r = diagnosed(stalled(endpoint="chat"), slo=slo_targets.Targets(1500, 40))
    before, after, compare = r["diagnosis"]["verify"]
    for line in (before, after):
        argv = task_command(line)
        args = bench_options.build_parser().parse_args(argv[argv.index(str(REPO / "scripts" / "bench.py")) + 1:])
        options = bench_options.make_options(args, conf.settings_from_args(args))
        assert (options.input_tokens, options.output_tokens, options.slo.ttft_p95_ms) == (1600, 100, 1500)
    assert args.output.file == "after.json" and args.shared_prefix == "800" and args.endpoint == "chat"
    assert task_command(compare)[-2:] == ["before.json", "after.json"]


# --------------------------------------------------------------------------------------------
# What the server says about itself

VLLM_SERVER_INFO = {"vllm_config": {
    "scheduler_config": {"max_num_seqs": 2, "max_num_batched_tokens": 2048},
    "cache_config": {"enable_prefix_caching": False, "block_size": 128},
    "model_config": {"max_model_len": 4096}, "parallel_config": {"tensor_parallel_size": 1}},
    "vllm_env": {}, "system_env": {}}
# SGLang answers its ServerArgs with the scheduler's info: the API key among them.
SGLANG_SERVER_INFO = {"max_running_requests": None, "chunked_prefill_size": 8192, "disable_radix_cache": False,
                      "page_size": 1, "context_length": None, "tp_size": 2, "mem_fraction_static": 0.88,
                      "api_key": "sk-secret", "max_total_num_tokens": 262144, "internal_states": [], "version": "0.5.0"}


def server(answers: dict) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        return httpx.Response(200, json=answers[path]) if path in answers else httpx.Response(404, text="Not Found")
    return httpx.MockTransport(answer)


def test_vllm_server_info_gives_the_settings_no_metric_exports():
    served = deployment.server_settings("http://h:8000", "vllm", transport=server({
        "/v1/models": {"data": [{"id": "m", "max_model_len": 4096}]}, "/server_info": VLLM_SERVER_INFO}))
    assert {k: v.value for k, v in served.settings.items()} == {
        "max_num_seqs": 2, "max_num_batched_tokens": 2048, "prefix_caching": False, "block_size": 128,
        "max_model_len": 4096, "tensor_parallel_size": 1}
    assert served.settings["max_num_seqs"].how == "vLLM /server_info scheduler_config.max_num_seqs"


def test_without_dev_mode_vllm_says_only_its_max_model_len():
    served = deployment.server_settings("http://h:8000", "vllm", transport=server({
        "/v1/models": {"data": [{"id": "m", "max_model_len": 4096}]}}))
    assert list(served.settings) == ["max_model_len"]


@pytest.mark.parametrize("failures, status, asked, settings, said", [
    ([httpx.ReadTimeout("timed out")], 200, 2, ["max_model_len", "max_num_seqs"], ""),  # a busy server, once
    ([httpx.ReadTimeout("timed out")] * 2, 200, 2, ["max_model_len"], "/server_info did not answer twice"),
    ([], 503, 2, ["max_model_len"], "answered HTTP 503"),
    ([], 404, 1, ["max_model_len"], ""),  # no dev mode: the route is not there, asked once
])
def test_a_server_info_that_does_not_answer_is_asked_again_and_stderr_says_why(failures, status, asked, settings,
                                                                               said, capsys):
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        calls.append(request.url.path)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return httpx.Response(status, json=VLLM_SERVER_INFO)
    served = deployment.server_settings("http://h:8000", "vllm", timeout=1.0, transport=httpx.MockTransport(answer))
    assert (len(calls), [name for name in settings if name in served.settings]) == (asked, settings)
    assert set(served.settings) >= set(settings) and ("max_num_seqs" in served.settings) == ("max_num_seqs" in settings)
    err = capsys.readouterr().err
    assert (said in err if said else err == ""), err


def test_sglang_server_info_is_read_field_by_field_and_its_key_never_kept():
    served = deployment.server_settings("http://h:30000", "sglang", transport=server({
        "/v1/models": {"data": [{"id": "m"}]}, "/get_server_info": SGLANG_SERVER_INFO}))
    assert {k: v.value for k, v in served.settings.items()} == {
        "max_num_batched_tokens": 8192, "prefix_caching": True, "block_size": 1, "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.88, "engine_version": "0.5.0"}
    assert "sk-secret" not in repr(served)


@pytest.mark.real_vllm
def test_a_real_vllm_in_dev_mode_exports_its_cap_and_the_diagnosis_uses_it(vllm_factory, capsys):
    with vllm_factory(sets=["max_num_seqs=2", "enable_prefix_caching=false"], env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        assert metrics.main(["--url", srv.url, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    settings = r["settings"]
    assert settings["max_num_seqs"] == {"value": 2, "source": "exported",
                                        "how": "vLLM /server_info scheduler_config.max_num_seqs", "at_least": False}
    assert settings["prefix_caching"]["value"] is False and settings["max_model_len"]["value"] == 4096
    assert settings["max_num_batched_tokens"]["source"] == "exported"
    assert r["deployment"]["max_num_seqs"] == 2
