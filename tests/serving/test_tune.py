"""tune: which lever becomes which profile change, the keep/revert/trade-off judgement on compare's
intervals, the bracket-and-bisect search, the budget, the outputs; then the loop on the real CPU
vLLM from profiles with one setting made wrong on purpose, and its interrupts, crashes and
failed starts.

The diagnoses tune reads are engine_metrics' own, of the saved scrapes in tests/fixtures/metrics
(a running limit, a small KV cache, a healthy window), and of a window with prefix caching off
(tests/fixtures/tune/diagnosis-prefix-cache-off.json, written by the diagnosis from
test_diagnosis.stalled()).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tune_vs_grid
import vllm_server
from fault_server import as_json, fault_server
from vllm_server import REPO

from rooflib.core import stats
from rooflib.load import analysis, comparison
from rooflib.render import report_html, report_inputs
from rooflib.server import deployment, engine_metrics, snapshots
from rooflib.server.slo_targets import Targets
from rooflib.serving import levers, profiles, trials
from rooflib.serving import tune as tuning
from rooflib.sizing import resolve

FIXTURES = REPO / "tests" / "fixtures"
MIB = 1 << 20


# Saved scrapes of the real CPU vLLM, before and after a load, 30 s apart (tests/server/test_diagnosis.py).
SCRAPES = {"running-limit": "vllm-0.32-queue", "kv-cache": "vllm-0.32-preempt", "healthy": "vllm-0.32"}


def diagnosis(name: str) -> dict:
    """The diagnosis of a saved window, as metrics --json gives it; prefix caching off has no saved
    scrape, so its diagnosis (of a synthetic window, test_diagnosis.stalled) is kept as JSON."""
    if name not in SCRAPES:
        return json.loads((FIXTURES / "tune" / f"diagnosis-{name}.json").read_text())
    snaps = [snapshots.snapshot((FIXTURES / "metrics" / f"{SCRAPES[name]}-{when}.txt").read_text(), when)
             for when in ("before", "after")]
    snaps[0]["time"], snaps[1]["time"] = 0.0, 30.0
    return engine_metrics.report(snapshots.difference(*snaps))["diagnosis"]


def cpu_profile(**settings) -> dict:
    profile = profiles.load_profile(profiles.find_profile("cpu-tiny"))
    return profiles.validate({**profile, **settings})


# --------------------------------------------------------------------------------------------
# From a diagnosis to one profile change

def test_the_running_limit_lever_becomes_the_profiles_max_num_seqs():
    choice = levers.first_change(diagnosis("running-limit"), cpu_profile(max_num_seqs=1), done=[])
    assert (choice.change.key, choice.change.current, choice.change.proposed) == ("max_num_seqs", 1, 8)
    assert choice.change.flag == "--max-num-seqs" and choice.passed_over == ()
    assert choice.change.describe() == "max_num_seqs 1 -> 8"


def test_the_kv_lever_is_tried_and_precision_and_gpus_are_left_to_the_user():
    profile = cpu_profile(env={}, kv_cache_memory_bytes=4 * MIB, max_model_len=1024)
    choice = levers.first_change(diagnosis("kv-cache"), profile, done=[])
    assert (choice.change.key, choice.change.proposed) == ("kv_cache_memory_bytes", 8 * MIB)
    assert choice.change.describe() == "kv_cache_memory_bytes 4 MiB -> 8 MiB"
    after = levers.first_change(diagnosis("kv-cache"), profile, done=["kv_cache_memory_bytes"])
    assert after.change is None
    passed = " | ".join(after.passed_over)
    assert "--kv-cache-dtype: auto -> fp8" in passed and "changes the model's numbers" in passed
    assert "--tensor-parallel-size" in passed and "needs more GPUs" in passed
    assert "(not a server setting: yours to do)" in passed


def test_prefix_caching_off_becomes_on_for_vllm_and_for_sglang():
    choice = levers.first_change(diagnosis("prefix-cache-off"), cpu_profile(enable_prefix_caching=False), done=[])
    assert (choice.change.key, choice.change.current, choice.change.proposed) == ("enable_prefix_caching", False, True)
    sglang = diagnosis("prefix-cache-off")
    sglang["plan"][0].update(setting="--disable-radix-cache", proposed="drop the flag")
    profile = {"engine": "sglang", "model": "m", "enable_prefix_caching": False}
    assert levers.first_change(sglang, profile, done=[]).change.proposed is True


def test_the_diagnosis_is_told_each_setting_the_profile_sets_and_not_what_it_leaves_to_the_engine():
    profile = {"engine": "vllm", "model": "m", "max_num_seqs": 1, "enable_prefix_caching": False,
               "kv_cache_memory_bytes": None, "dtype": "bfloat16"}
    served = levers.served_with(profile, "http://127.0.0.1:8000", "cpu-tiny")
    assert served.url == "http://127.0.0.1:8000"
    assert {name: (known.value, known.source) for name, known in served.settings.items()} == {
        "max_num_seqs": (1, "exported"), "prefix_caching": (False, "exported")}
    assert served.settings["max_num_seqs"].how == "the engine's command line (profile cpu-tiny)"
    # What the profile leaves to the engine's defaults comes from the engine's own answer; the
    # command line wins where both say it.
    own = deployment.Served("http://127.0.0.1:8000", {
        "max_num_seqs": deployment.Known(128, "exported", "vLLM /server_info scheduler_config.max_num_seqs"),
        "max_num_batched_tokens": deployment.Known(2048, "exported", "vLLM /server_info scheduler_config.max_num_batched_tokens")})
    served = levers.served_with(profile, "http://127.0.0.1:8000", "cpu-tiny", own)
    assert {name: (known.value, known.how.split(" ")[0]) for name, known in served.settings.items()} == {
        "max_num_seqs": (1, "the"), "prefix_caching": (False, "the"), "max_num_batched_tokens": (2048, "vLLM")}


@pytest.mark.parametrize("profile, env, dev_mode", [
    ({"engine": "vllm"}, {}, "1"),
    ({"engine": "vllm", "host": "localhost"}, {"X": "1"}, "1"),
    ({"engine": "vllm", "host": "0.0.0.0"}, {}, None),       # reachable from elsewhere: dev routes stay off
    ({"engine": "vllm"}, {"VLLM_SERVER_DEV_MODE": "0"}, "0"),  # the profile's own word wins
    ({"engine": "sglang"}, {}, None),                          # /get_server_info needs no dev mode
])
def test_a_vllm_tune_starts_on_this_machine_says_its_defaults_on_server_info(profile, env, dev_mode):
    assert tuning.engine_env(profile, env).get("VLLM_SERVER_DEV_MODE") == dev_mode
    assert tuning.engine_env(profile, env).items() >= env.items()


def test_a_healthy_diagnosis_and_no_diagnosis_give_no_change():
    for d in (diagnosis("healthy"), None):
        assert levers.first_change(d, cpu_profile(), done=[]) == levers.Choice(None, ())


def test_a_lever_the_profile_refuses_is_passed_over_with_the_profiles_reason():
    choice = levers.first_change(diagnosis("running-limit"), cpu_profile(max_num_seqs=1, max_num_batched_tokens=4), [])
    assert choice.change is None
    assert "the profile refuses it: max_num_batched_tokens (4) must be >= max_num_seqs (8)" in choice.passed_over[0]


# --------------------------------------------------------------------------------------------
# The vram model's word on a changed profile

def tiny_sizing(gpu=None) -> levers.Sizing:
    return levers.Sizing(resolve.resolve_model(profiles.expand(cpu_profile()["model"])), gpu)


def test_a_kv_space_too_small_for_one_request_will_not_start():
    fixed = cpu_profile(env={}, kv_cache_memory_bytes=4 * MIB, max_model_len=1024)
    fits = levers.start_check(fixed, tiny_sizing())
    assert fits.fits is True and fits.text.startswith("2,048 KV tokens, 2.00 requests of 1,024 tokens")
    longer = levers.start_check({**fixed, "max_model_len": 4096}, tiny_sizing())
    assert longer.fits is False and not longer.marginal and "0.50 requests of 4,096 tokens" in longer.text


def test_the_cpu_kv_space_variable_replaces_kv_cache_memory_bytes_and_no_gpu_means_not_checked():
    profile = cpu_profile(kv_cache_memory_bytes=4 * MIB)  # VLLM_CPU_KVCACHE_SPACE=1 wins on the CPU build
    assert levers.kv_space_bytes(profile) == 1 << 30
    assert levers.start_check(cpu_profile(env={}), tiny_sizing()).fits is None
    assert levers.start_check(profile, None).text.startswith("not checked")


def test_on_a_gpu_a_utilization_that_leaves_no_kv_room_will_not_start():
    model = resolve.resolve_model("qwen3-32b")
    sizing = levers.Sizing(model, resolve.resolve_gpu("h100"))
    profile = {"engine": "vllm", "model": "Qwen/Qwen3-32B", "max_model_len": 8192}
    assert levers.start_check({**profile, "gpu_memory_utilization": 0.9}, sizing).fits is True
    low = levers.start_check({**profile, "gpu_memory_utilization": 0.5}, sizing)
    assert low.fits is False and not low.marginal and low.text.startswith("0 KV tokens")
    # BF16 weights leave about one 32k request at 0.90: inside the model's own error, so tune tries it
    edge = levers.start_check({**profile, "gpu_memory_utilization": 0.9, "max_model_len": 32768}, sizing)
    assert edge.fits is False and edge.marginal and "fits at the low end with --gpu-memory-utilization 0.92" in edge.text


# --------------------------------------------------------------------------------------------
# Keep, revert, or a trade-off: compare's intervals on the SLO figure

SLO = Targets(ttft_p95_ms=1000, tpot_p95_ms=50)


def run_doc(ttft: list[float], tpot: list[float], failed: int = 0) -> dict:
    """A bench result as analysis makes it, with the SLO section judged against SLO."""
    p95 = {"ttft_ms": stats.percentile(sorted(ttft), 95), "tpot_ms": stats.percentile(sorted(tpot), 95)}
    return {"kind": "bench", "workload": {"requests": len(ttft)}, "verdict": "PASS", "interrupted": False,
            "requests": {"completed": len(ttft), "failed": failed}, "throughput": {"req_s": 1.0, "output_tok_s": 1.0},
            "samples": {"ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": [a + b for a, b in zip(ttft, tpot)]},
            "ttft_ms": {"p95": p95["ttft_ms"]}, "tpot_ms": {"p95": p95["tpot_ms"]},
            "slo": analysis.slo_check(p95["ttft_ms"], p95["tpot_ms"], SLO), "config": {"model": "m", "url": "u"}}


def spread(centre: float, n: int = 32, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [centre * rng.uniform(0.9, 1.1) for _ in range(n)]


def judged(before: dict, after: dict) -> trials.Verdict:
    doc = comparison.compare(before, after, ("a.json", "b.json"), ("a", "b"))
    return trials.judge(doc, before, after, trials.worst(before))


def test_a_change_whose_interval_lies_below_zero_is_kept():
    before, after = run_doc(spread(4000), spread(20)), run_doc(spread(500, seed=1), spread(22, seed=1))
    assert trials.worst(before) == "ttft_p95_ms" and trials.missed(after) == []
    verdict = judged(before, after)
    assert verdict.decision == trials.KEPT and verdict.why.startswith("TTFT p95 -8")


def test_a_change_within_the_noise_is_reverted():
    verdict = judged(run_doc(spread(4000), spread(20)), run_doc(spread(4000, seed=1), spread(20, seed=1)))
    assert verdict.decision == trials.REVERTED and "does not lie wholly below 0" in verdict.why


@pytest.mark.parametrize("requests, before_stalls, after_base, after_stalls, decision, why", [
    # 16 or 19 requests place no p95 (it needs one request beyond it, 20): one stall of the machine
    # would decide it, so the upper quartile is judged, and the why says so.
    (16, 0, 300, 1, trials.KEPT, "TTFT p75 -8"),
    (19, 0, 300, 1, trials.KEPT, "TTFT p75 -8"),
    # 20 place it: two stalls of 20 are the tail the p95 measures, and the change is not kept.
    (20, 0, 300, 2, trials.REVERTED, "TTFT p95 "),
    # A p75 three times slower is worse, though the baseline's one stall hides it in the p95.
    (16, 1, 900, 0, trials.WORSE, "TTFT p75 +1"),
])
def test_runs_too_short_to_place_a_p95_are_judged_by_the_upper_quartile(requests, before_stalls, after_base,
                                                                        after_stalls, decision, why):
    before = run_doc(spread(300 if before_stalls else 2000, requests - before_stalls) + [5000] * before_stalls,
                     spread(20, requests))
    after = run_doc(spread(after_base, requests - after_stalls, seed=1) + [2500] * after_stalls,
                    spread(20, requests, seed=1))
    verdict = judged(before, after)
    assert verdict.decision == decision and verdict.why.startswith(why), verdict
    said = f"(judged by the upper quartile: {requests} requests a side place no p95, which needs 20)"
    assert (said in verdict.why) == (requests < 20), verdict


def test_a_short_run_is_judged_by_the_tail_its_queue_makes_not_by_its_median():
    """The flake finder's KV case (4 -> 24 MiB, 16 requests at once). `waited` is a measured
    baseline (round 3): its requests waited in turn for the cache. `slowed` is a trial that ran them
    at once on a busier machine, its median down 50% (round 2's, whose samples were not kept:
    -54.9%, 95% CI -70.7% .. +42.0%, reverted, the fix lost). The median's interval reaches above
    zero; the upper quartile, the requests that waited, fell beyond doubt."""
    waited = [29, 101, 101, 563, 704, 887, 1473, 2201, 2201, 2201, 2220, 2459, 2724, 3219, 3464, 3483]
    slowed = [60, 120, 150, 300, 450, 520, 700, 900, 1300, 1500, 1550, 1600, 1650, 1700, 1750, 1800]
    doc = comparison.compare(run_doc(waited, spread(20, 16)), run_doc(slowed, spread(20, 16, seed=1)),
                             ("a.json", "b.json"), ("a", "b"))
    median = next(row for row in doc["metrics"] if row["name"] == "ttft_ms.p50")
    assert median["ci95_pct"][1] > 0, median
    verdict = judged(run_doc(waited, spread(20, 16)), run_doc(slowed, spread(20, 16, seed=1)))
    assert verdict.decision == trials.KEPT and verdict.why.startswith("TTFT p75 -"), verdict


def test_a_change_that_breaks_another_slo_figure_is_a_trade_off_not_kept():
    verdict = judged(run_doc(spread(4000), spread(20)), run_doc(spread(500, seed=1), spread(80, seed=1)))
    assert verdict.decision == trials.TRADE_OFF
    assert "but TPOT p95" in verdict.why and "> target 50 ms" in verdict.why


def stalled_run(share: float | None, interrupted: bool = False, failed: int = 0) -> dict:
    """A run whose client stalled `share` of it (bench's INVALID), or measured cleanly (None)."""
    run = run_doc(spread(500), spread(20), failed=failed)
    run["interrupted"] = interrupted
    run["client"] = {"valid": share is None, "stalls": {"share": share or 0.0, "worst_ms": 900.0},
                     "invalid_reasons": [] if share is None else [f"the client stalled {share:.0%} of the run"]}
    return run


@pytest.mark.parametrize("tries, rerun, chosen", [
    ([None], [False], 0),                         # measured cleanly: judged as it is
    ([0.87, 0.4, None], [True, True, False], 2),  # stalled, then stalled less, then clean
    ([0.87, 0.9, 0.95], [True, True, True], 0),   # stalled every time: the least stalled is judged
    ([0.5, None], [True, False], 1),
])
def test_a_run_whose_client_stalled_is_measured_again_and_the_least_stalled_is_judged(tries, rerun, chosen):
    runs = [stalled_run(share) for share in tries]
    assert [trials.worth_rerunning(run) for run in runs] == rerun
    assert trials.least_stalled(runs) is runs[chosen]


def test_a_stalled_run_that_failed_or_was_interrupted_is_not_measured_again():
    assert not trials.worth_rerunning(stalled_run(0.8, interrupted=True))
    assert not trials.worth_rerunning(stalled_run(0.8, failed=2))


def test_a_verdict_on_runs_the_client_stalled_in_says_so():
    """The flake finder's KV case (round 2): the trial's client stalled 87% of its run, worst 2.6 s,
    and twelve of its sixteen first tokens were read at the run's end; the verdict says what it
    was judged on."""
    assert trials.stalled_words(stalled_run(None), stalled_run(None)) is None
    said = trials.stalled_words(stalled_run(0.65), stalled_run(0.87))
    assert said.startswith("judged on runs the client stalled in (the run judged against: the client stalled 65% "
                           "of the run (worst 900 ms); this run: the client stalled 87% of the run (worst 900 ms))")


@pytest.mark.parametrize("shares, calls, judged", [
    ([None], 1, 0),
    ([0.87, 0.4, None], 3, 2),
    ([0.87, 0.9, 0.95, None], 1 + tuning.RERUNS, 0),  # RERUNS more at most
])
def test_tune_benches_a_stalled_run_again_on_the_same_engine(tmp_path, monkeypatch, shares, calls, judged):
    runs = [stalled_run(share) for share in shares]
    for n, run in enumerate(runs):
        run["seed_of_try"] = n
    written = []

    def bench_once(url, api_key, options, path, served=None):
        written.append(path.name)
        run = runs[len(written) - 1]
        path.write_text(json.dumps(run))
        return run

    monkeypatch.setattr(tuning, "bench_once", bench_once)
    monkeypatch.setattr(deployment, "server_settings", lambda *args, **kwargs: None)
    monkeypatch.setattr(levers, "served_with", lambda *args, **kwargs: None)
    options = dataclasses.make_dataclass("Options", ["num_requests", "warmup", "timeout_s"])(16, 16, 5.0)
    setup = tuning.Setup({"engine": "vllm"}, "p.yaml", 0, options, tuning.Budget(3, None), tmp_path, None, 5.0)
    runner = tuning.Runner(setup, lambda line: None)
    runner.engine = tuning.Engine(None, "http://127.0.0.1:1", tmp_path / "engine.log", 1.0)
    result = runner.bench("trial-1", {"engine": "vllm"})
    assert written == ["trial-1.json"] + [f"trial-1.try-{n}.json" for n in range(2, calls + 1)]
    assert result is runs[judged] and json.loads((tmp_path / "trial-1.json").read_text())["seed_of_try"] == judged
    kept = sorted(path.name for path in tmp_path.glob("trial-1.try-*.json"))
    assert kept == ([f"trial-1.try-{n}.json" for n in range(1, calls + 1)] if judged else written[1:])
    if judged:  # the first try, which trial-1.json held until another was judged, is kept beside it
        assert json.loads((tmp_path / "trial-1.try-1.json").read_text())["seed_of_try"] == 0
    assert runner.show.runs == 1  # the reruns measure the same configuration: one run of the budget


def test_a_run_with_failed_requests_is_never_kept_and_says_what_failed():
    after = run_doc(spread(500, seed=1), spread(20, seed=1), failed=3)
    after["requests"] |= {"errors": {"http_5xx": 2, "stream_cut": 1},
                          "first_errors": ["#4 http_5xx: HTTP 500: EngineCore died", "#9 http_5xx: HTTP 500"]}
    verdict = judged(run_doc(spread(4000), spread(20)), after)
    assert verdict == trials.Verdict(trials.REQUESTS_FAILED, "3 of 35 requests failed (2 http_5xx, 1 stream_cut); "
                                                             "the first: #4 http_5xx: HTTP 500: EngineCore died")


@pytest.mark.parametrize("health, alive, serves", [(200, True, True), (503, True, False), (200, False, False)])
def test_after_failed_requests_an_engine_serves_while_it_runs_and_its_health_check_answers(health, alive, serves):
    """An engine whose core died answers /health 503 before its API server exits: that trial is a
    crash, not a value at which requests fail."""
    with fault_server(lambda request: as_json(health, {}) if request.path == "/health" else None) as url, \
            subprocess.Popen(["sleep", "60"] if alive else ["true"]) as proc:
        try:
            assert tuning.serving(tuning.Engine(proc, url, Path("engine.log"), 0.0), within_s=0 if alive else 10) is serves
        finally:
            proc.kill()


def test_the_worst_figure_is_the_one_furthest_over_its_target():
    assert trials.worst(run_doc(spread(1500), spread(200))) == "tpot_p95_ms"
    assert trials.worst(run_doc(spread(500), spread(20))) is None
    assert trials.targets(Targets(tpot_p95_ms=50)) == {"tpot_p95_ms": 50}


# --------------------------------------------------------------------------------------------
# The search of a range setting

def search(key, start, proposed, outcomes: dict) -> list:
    """The values next_value tries when each value's decision is outcomes[value] (else reverted)."""
    tried = []
    while (value := trials.next_value(key, start, proposed, tried)) is not None:
        tried.append(trials.Tried(value, outcomes.get(value, trials.REVERTED)))
        assert len(tried) < 20
    return [t.value for t in tried]


def test_kept_values_are_bracketed_until_one_brings_nothing():
    assert search("max_num_seqs", 1, 8, {8: trials.KEPT, 16: trials.KEPT}) == [8, 16, 32]


def test_a_value_that_goes_too_far_is_bisected_back_towards_the_last_kept():
    assert search("max_num_seqs", 1, 64, {64: trials.TRADE_OFF, 8: trials.KEPT, 23: trials.TRADE_OFF}) == [64, 8, 23, 14]
    assert search("kv_cache_memory_bytes", 4 * MIB, 64 * MIB, {64 * MIB: trials.NO_START}) == [64 * MIB, 16 * MIB]
    assert search("gpu_memory_utilization", 0.8, 0.95, {0.95: trials.CRASHED, 0.88: trials.KEPT}) == [0.95, 0.88, 0.92]
    # A value at which requests fail is one the engine cannot serve at: bisected back, not the end.
    assert search("max_num_seqs", 1, 8, {8: trials.REQUESTS_FAILED, 3: trials.KEPT}) == [8, 3, 5]


def test_a_first_value_without_gain_ends_the_search_and_a_switch_is_tried_once():
    assert search("max_num_seqs", 1, 8, {}) == [8]
    assert search("enable_prefix_caching", False, True, {True: trials.KEPT}) == [True]


def test_the_bracket_stays_in_range():
    assert search("gpu_memory_utilization", 0.85, 0.9, {0.9: trials.KEPT, 0.95: trials.KEPT}) == [0.9, 0.95]
    assert search("max_model_len", 4, 2, {2: trials.KEPT, 1: trials.KEPT}) == [2, 1]


# --------------------------------------------------------------------------------------------
# Budget, live traffic, outputs

def test_the_budget_counts_runs_and_minutes_with_the_engine_start():
    runs = tuning.Budget(runs=6, minutes=None)
    assert runs.spent(5, 0, 60) is None and runs.spent(6, 0, 60) == "the budget of 6 bench runs is spent"
    assert runs.eta_s(2, 100, 60) == 240
    minutes = tuning.Budget(runs=None, minutes=10)
    assert minutes.spent(3, 500, 60) is None
    assert "would pass the budget of 10 minutes (9.0 spent)" in minutes.spent(3, 540, 61)
    assert minutes.eta_s(3, 540, 61) == 60 and tuning.Budget(None, None).eta_s(1, 0, 60) is None


def test_like_the_live_traffic_takes_lengths_and_in_flight_from_a_metrics_window():
    snaps = [snapshots.snapshot((FIXTURES / "metrics" / f"vllm-0.32-queue-{name}.txt").read_text(), name)
             for name in ("before", "after")]
    snaps[0]["time"], snaps[1]["time"] = 0.0, 30.0
    report = engine_metrics.window(*snaps)
    shape = tuning.traffic_shape(report)
    assert shape["input_tokens"] == round(report["prompt_tokens_mean"])
    assert shape["output_tokens"] == round(report["output_tokens_mean"])
    assert shape["concurrency"] == round(report["running_mean"] + report["waiting_mean"]) >= 1
    assert shape["output_tokens"] >= 1
    with pytest.raises(Exception, match="no request finished in the window"):
        tuning.traffic_shape(engine_metrics.report(snaps[1]))
    # Sampled each second (four samples between the scrapes here), the gauges give the figure.
    sampled = engine_metrics.window(*snaps, [snaps[1]] * 4)
    gauges = [snap["gauges"][name]["value"] for snap in (snaps[0], *[snaps[1]] * 5) for name in ("running", "waiting")]
    assert sampled["running_sampled_mean"] + sampled["waiting_sampled_mean"] == pytest.approx(sum(gauges) / 6)
    assert tuning.traffic_shape(sampled)["concurrency"] == max(1, round(sum(gauges) / 6))


@pytest.mark.parametrize("samples, concurrency", [(16, 3), (4, 1)])
def test_like_counts_requests_in_flight_by_the_gauges_sampled_through_the_window(samples, concurrency):
    """Fresh-clone run h1's shape: a closed loop of 3 with 320-token answers, longer than the 15 s
    window beside two busy loops, so few finished in it and Little's law over them read 1; the
    gauges, sampled each second, count the 3. Too few samples leave Little's law."""
    report = {"mode": "window", "requests": 2, "prompt_tokens_mean": 300.0, "output_tokens_mean": 320.0,
              "running_mean": 1.2, "waiting_mean": 0.0, "running_sampled_mean": 2.9, "waiting_sampled_mean": 0.1,
              "gauge_samples": samples}
    assert tuning.traffic_shape(report)["concurrency"] == concurrency


def under_way(load: subprocess.Popen) -> None:
    """Read bench's progress until its first request is done: every worker of its closed loop has
    sent one by then, and the loop goes on until Ctrl-C."""
    for line in load.stderr:
        if "requests done" in line:
            return
    raise AssertionError(f"bench ended before its first request was done (exit {load.wait()})")


@pytest.mark.real_vllm
def test_like_reads_the_shape_of_the_traffic_a_live_vllm_serves(vllm_server):
    """--like against a real vLLM under a known load: the prompt and output lengths it serves, and
    about the requests it holds at a time (a closed loop of 3: never more, at most one between
    requests on the client). Each request decodes 320 tokens, so the engine holds it far longer
    than the client takes between two (with 40 a fresh-clone run beside two busy loops read 1 in
    flight). The window opens once the loop is under way and bench runs on until it has closed
    (Ctrl-C then ends bench, which still reports)."""
    load = subprocess.Popen([sys.executable, str(REPO / "scripts" / "bench.py"), "--url", vllm_server.url, "--json",
                             "-c", "3", "-n", "1000", "--warmup", "0", "--input-tokens", "300",
                             "--output-tokens", "320", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        under_way(load)
        shape = tuning.live_traffic_shape(vllm_server.url, None, 15, 30)
    finally:
        load.send_signal(signal.SIGINT)
        stdout, _ = load.communicate(timeout=300)
    assert load.returncode == 130, load.returncode
    run = json.loads(stdout)
    assert run["requests"]["failed"] == 0 and run["requests"]["prompt_tokens"]["mismatched"] == 0
    assert shape["input_tokens"] == round(run["requests"]["prompt_tokens"]["mean"]) == 300
    assert shape["output_tokens"] == 320
    assert shape["concurrency"] in (2, 3)


def test_the_diff_names_only_what_changed():
    diff = tuning.profile_diff(cpu_profile(max_num_seqs=1), cpu_profile(max_num_seqs=8))
    assert [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++")] == \
        ["-max_num_seqs: 1", "+max_num_seqs: 8"]


def tune_document() -> dict:
    """A tune document as tune.json holds it: a baseline, a kept change, a trade-off, a failed start."""
    def figure(measured, change=None, ci=None):
        return {"ttft_p95_ms": {"measured": measured, "target": 1000.0, "met": measured <= 1000, "change_pct": change,
                                "ci95_pct": ci}}
    rows = [tuning.trial_row(0, None, "baseline", "misses TTFT p95 4000.0 ms > 1000 ms", figures=figure(4000.0)),
            tuning.trial_row(1, levers.Change("max_num_seqs", "--max-num-seqs", 1, 8, "lever"), trials.KEPT,
                             "TTFT p95 -75.0% (95% CI -80.0% .. -70.0%)", figures=figure(1000.0, -75.0, [-80.0, -70.0])),
            tuning.trial_row(2, levers.Change("max_num_seqs", "--max-num-seqs", 8, 16, "lever"), trials.TRADE_OFF,
                             "TTFT p95 -20.0%, but TPOT p95 80 ms > target 50 ms", figures=figure(800.0, -20.0, [-30.0, -10.0])),
            tuning.trial_row(3, levers.Change("max_num_seqs", "--max-num-seqs", 8, 11, "lever"), trials.NO_START,
                             "the server exited with status 1 while starting")]
    return {"kind": "tune", "schema_version": 1, "mode": "tune", "started_at": "2025-01-01T00:00:00+00:00",
            "profile": {"source": "cpu-tiny", "engine": "vllm", "model": "m"}, "workload": None,
            "load": "closed loop, 16 in flight, 16 requests", "slo": {"ttft_p95_ms": 1000.0},
            "budget": {"runs": 6, "minutes": None}, "trials": rows,
            "changes": [{"setting": "max_num_seqs", "from": 1, "to": 8}], "winning_profile": cpu_profile(max_num_seqs=8),
            "diff": tuning.profile_diff(cpu_profile(max_num_seqs=1), cpu_profile(max_num_seqs=8)), "slo_holds": True,
            "stopped": {"reason": "slo_met", "text": "the SLO holds"}, "passed_over": ["--kv-cache-dtype ... (not tried)"],
            "runs": 4, "wall_s": 200.0, "engine_start_s": 30.0, "interrupted": False, "out": "tune-out"}


def test_the_report_draws_every_trial_on_one_chart_with_its_decision():
    result = report_inputs.parse_result(json.dumps(tune_document()), "tune.json")
    sections = report_html.build_sections([result], None)
    assert [s.title for s in sections] == ["Tune: one change at a time"] and sections[0].verdict == "SLO holds"
    chart = sections[0].charts[0]
    assert [m["cls"] for m in chart.svg["marks"]] == ["better", "mixed", "worse"]
    assert chart.svg["marks"][2]["x"] is None  # a failed start has no figure
    assert report_html.answers_section([result]).facts == [
        ("tune tune", "the SLO holds after 4 runs; kept: max_num_seqs 1 → 8; serve profile.yaml")]
    text = report_html.render_text(sections)
    assert "max_num_seqs  1 → 8" in text and "trade-off" in text and "did not start" in text
    assert "<svg" in report_html.render_html(sections, [result], "now")


def test_the_console_table_names_each_change_its_interval_and_the_decision():
    import tune as tune_cli

    text = tune_cli.human_text(tune_document())
    assert "max_num_seqs 1 -> 8" in text and "1000.0 (-75% [-80, -70])" in text and "kept" in text
    assert "Kept: max_num_seqs 1 -> 8" in text and "+max_num_seqs: 8" in text
    assert "Stopped: the SLO holds" in text and "Not tried: --kv-cache-dtype" in text


def test_the_log_entry_lists_the_trials_and_what_was_kept():
    from rooflib.core import printing

    entry = printing.render_log_entry(tune_document(), tuning.TEMPLATE)
    assert entry.startswith("## 2025-01-01T00:00:00+00:00 · tune cpu-tiny · SLO holds")
    assert "| 1 | max_num_seqs | 1 | 8 | kept | TTFT p95 -75.0% (95% CI -80.0% .. -70.0%) |" in entry
    assert "- Kept: max_num_seqs 1 -> 8" in entry and "- not tried: --kv-cache-dtype" in entry


# --------------------------------------------------------------------------------------------
# The command line's one-line errors, before any engine starts

def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "tune.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--profile", "cpu-tiny"], "tune needs an SLO to judge changes by"),
    (["--profile", "cpu-tiny", "--url", "http://127.0.0.1:9", "--slo-ttft-p95-ms", "100"],
     "give --profile (tune starts and restarts it) or --url (measured only), not both"),
    (["--profile", "no-such-profile", "--slo-ttft-p95-ms", "100"], "unknown profile 'no-such-profile'"),
    (["--profile", "cpu-tiny", "--set", "max_num_seqs=0", "--slo-ttft-p95-ms", "100"],
     "profile key max_num_seqs must be a positive integer"),
    (["--profile", "cpu-tiny", "--slo-ttft-p95-ms", "100", "--budget-runs", "0"], "--budget-runs (TUNE_RUNS) must be"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2 and message in one_error_line(done)


def test_a_port_in_use_is_one_line_and_no_engine_starts(tmp_path):
    # A catalog model and a fixed KV space: the vram model needs no download, and nothing is served.
    profile = tmp_path / "p.yaml"
    profile.write_text("engine: vllm\nmodel: Qwen/Qwen3-32B\nenv: {VLLM_CPU_KVCACHE_SPACE: '1'}\n"
                       "python: /nonexistent/python\n")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run_cli("--profile", str(profile), "--port", str(port), "--slo-ttft-p95-ms", "100",
                       "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in one_error_line(done)


def test_like_a_server_whose_window_holds_no_request_is_one_line(tmp_path):
    with fault_server() as url:  # the same recorded scrape each time: nothing finished in between
        done = run_cli("--profile", "cpu-tiny", "--like", url, "--like-window", "1", "--slo-ttft-p95-ms", "100",
                       cwd=tmp_path)
    assert done.returncode == 2 and "no request finished in the window" in done.stderr.splitlines()[-1]


# --------------------------------------------------------------------------------------------
# The real CPU vLLM: from a profile with one setting made wrong on purpose (the cases of
# benchmarks/tune_vs_grid.py, which `task bench:tune` runs against a grid), tune finds and keeps
# the fix within 6 bench runs; with nothing wrong it keeps nothing; interrupts, a crash and a
# profile that cannot start leave no engine behind.

def process_groups() -> set[int]:
    """The process group of every live process (/proc/PID/stat: state, ppid, pgrp after the name;
    a zombie only waits for its parent to read its status)."""
    groups = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                state, _, group = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:3]
                if state != "Z":
                    groups.add(int(group))
        except (OSError, ValueError):
            continue
    return groups


def listeners(port: int) -> set[int]:
    """The processes with a TCP socket listening on `port` (Linux: /proc/net/tcp and tcp6, state
    0A, and each process's file descriptors)."""
    sockets = {f"socket:[{fields[9]}]" for table in ("tcp", "tcp6")
               for fields in (line.split() for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:])
               if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port}
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                found.add(int(proc.name))
        except OSError:
            continue
    return found


def writes_to(pid: int, out: Path) -> bool:
    """Whether the process's output goes to a file under `out` (tune's engine logs; an engine's
    children inherit it)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1").startswith(str(out))
    except OSError:
        return False


def assert_no_engine_left(port: int, out: Path) -> None:
    """No engine tune started listens on the port, and no process is left of any: each ran in its
    own process group, led by the API server whose pid its log names. A process SIGKILL reached as
    tune ended may take a moment to go (60 s: a hang guard, not a bound on how long). The port alone
    is not the evidence: once tune freed it, another test's server may take it (the flake finder's
    round 3: a profile that never started, and something listened on its port), so a listener
    counts when its output goes to one of tune's engine logs."""
    left = [pid for pid in listeners(port) if writes_to(pid, out)]
    assert not left, f"an engine tune started still listens on {port}: {left}"
    leaders = {int(pid) for log in out.glob("engine-*.log")
               for pid in re.findall(r"Started server process \[(\d+)\]", log.read_text(errors="replace"))}
    deadline = time.monotonic() + 60
    while leaders & process_groups() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leaders & process_groups(), "a process of an engine tune started outlived it"


@pytest.fixture(scope="session")
def cpu_vllm() -> None:
    """The CPU vLLM and its tiny model, built: tune starts and stops the engines itself. Where it
    cannot be set up the test skips, which CI counts as a failure (conftest)."""
    try:
        vllm_server.setup()
    except vllm_server.ServerUnavailable as exc:
        pytest.skip(f"real vLLM unavailable: {exc}")


def tune_command(case: tune_vs_grid.Case, out: Path, port: int, *extra: str, profile: str = "cpu-tiny") -> list[str]:
    return [sys.executable, str(REPO / "scripts" / "tune.py"), "--profile", profile, "--port", str(port),
            "--json", "--out", str(out), "--budget-runs", str(case.runs),
            *[arg for item in case.sets for arg in ("--set", item)], *case.load, *tune_vs_grid.COMMON, *extra]


# A hang guard, not a figure: tune bounds itself by runs, and each run may be measured three times
# where the client stalled (RERUNS). A fresh-clone run beside two busy loops on a 2-core AMD EPYC
# without AVX-512 took 2 to 7 minutes a bench and 90 s a start there: a two-run tune measured six
# times needs about 32 minutes, over the 30 this guard was.
TUNE_GUARD_S = 3600


def tuned(case: tune_vs_grid.Case, tmp_path: Path, *extra: str, profile: str = "cpu-tiny") -> tuple[int, dict]:
    port = profiles.free_port()
    done = subprocess.run(tune_command(case, tmp_path / "out", port, *extra, profile=profile), stdout=subprocess.PIPE,
                          text=True, timeout=TUNE_GUARD_S)
    assert_no_engine_left(port, tmp_path / "out")
    return done.returncode, json.loads(done.stdout)


def tuned_to_fix(case: tune_vs_grid.Case, tmp_path: Path) -> tuple[int, dict, Path]:
    """tune on a case with one setting made wrong: (exit code, document, the folder whose out/ holds
    it). Where the trial of that setting was not kept and its client stalled, the machine blurred the
    premise (a fix far larger than a quiet machine's noise): tune said so, and it is measured once
    more. A fresh-clone run on 3e435e6 beside two busy loops: prefix caching on read TTFT p75 +6.8%
    (95% CI -50.0% .. +171.0%), its engine up in 68 s against the baseline's 38 while other workers'
    engines started, and the least stalled of three tries stalled 35% of its run; another run of the
    case read TTFT p95 -73.2% (95% CI -77.6% .. -69.8%)."""
    code, doc = tuned(case, tmp_path)
    if blurred_by_stalls(doc, case.wrong, tmp_path / "out"):
        tmp_path = tmp_path / "quieter"
        code, doc = tuned(case, tmp_path)
    return code, doc, tmp_path


def first_trial(doc: dict, setting: str) -> dict | None:
    """tune's first trial row of `setting`, None where it never tried it."""
    return next((row for row in doc["trials"] if row["setting"] == setting), None)


def blurred_by_stalls(doc: dict, setting: str, out: Path) -> bool:
    """The first trial of `setting` was not kept, and a run it was judged on (its own or the
    baseline's) had a stalled client (trials.client_stalled: bench's client.valid false, its
    requests timed late), which tune's row says."""
    trial = first_trial(doc, setting)
    return (trial is not None and trial["decision"] != trials.KEPT and trial["run"] is not None
            and any(trials.client_stalled(json.loads((out / run).read_text())) is not None
                    for run in (doc["trials"][0]["run"], trial["run"]))
            and "judged on runs the client stalled in" in trial["why"])


def in_a_test(case: tune_vs_grid.Case) -> tune_vs_grid.Case:
    """The benchmark's case on a budget of 3 runs: what a test reads is the first change kept (the
    baseline, the fix, one more try if a busy machine blurs it); a machine too busy for the SLO even
    with the fix would spend the rest of the benchmark's 6 on later levers no assertion reads."""
    return dataclasses.replace(case, runs=min(case.runs, 3))


def kept(doc: dict) -> dict:
    return {c["setting"]: (c["from"], c["to"]) for c in doc["changes"]}


def assert_fixed(code: int, doc: dict, case: tune_vs_grid.Case, out: Path) -> tuple:
    """The setting made wrong is the first change tune kept, within the budget; the exit code says
    whether the SLO holds (on a busier machine the fixed setting may still miss it: the issue asks
    for the fix, the SLO is the machine's). Another setting is kept only where the SLO was still
    missed with the fix in place (tune then rightly goes on to the next lever), never once it held.
    The (start, kept) values of the setting made wrong.

    Where the machine blurred the fix's trial (blurred_by_stalls), kept is None: no client can
    measure the gain then, and what tune must do is say so and keep nothing before it. Fresh-clone
    run e2 on 32c3665 beside two busy loops, both tries of the prefix-caching case: prefix caching on
    read TTFT p75 -86.6% (95% CI -89.9% .. +55.5%) and -9.6% (-37.5% .. +70.6%), the clients
    stalled 39% to 57% of their runs (worst 342 to 926 ms) against TTFTs of 100 to 900 ms. Whether
    tune keeps the fix is a timing a loaded machine changes: `task bench:tune` measures it."""
    assert code == (0 if doc["slo_holds"] else 1) and doc["runs"] <= case.runs and not doc["interrupted"]
    assert doc["trials"][0]["figures"]["ttft_p95_ms"]["met"] is False
    told = [(row["setting"], row["to"], row["decision"], row["why"]) for row in doc["trials"]]
    kept_rows = [row for row in doc["trials"] if row["decision"] == trials.KEPT]
    if case.wrong not in kept(doc) and blurred_by_stalls(doc, case.wrong, out):
        trial = first_trial(doc, case.wrong)
        assert not [row for row in kept_rows if row["n"] < trial["n"]], told
        return trial["from"], None
    assert [row["setting"] for row in kept_rows][:1] == [case.wrong], told
    for before, row in zip(kept_rows, kept_rows[1:]):
        if row["setting"] != case.wrong:
            assert not all(figure["met"] for figure in before["figures"].values()), told
    assert case.wrong in kept(doc), told
    return kept(doc)[case.wrong]


@pytest.mark.real_vllm
def test_a_running_limit_far_too_low_is_raised_and_kept(cpu_vllm, tmp_path):
    """The benchmark's case at a TTFT target of 500 ms, not its 2,000: at a cap of 1 the baseline's
    TTFT p95 is about 15 services of a request of 128 tokens out, which a fresh-clone run beside two
    busy loops measured at 1,852 ms, meeting 2,000 (the premise is a baseline that misses). 500 ms
    leaves the premise to a machine 3.7 times faster than that one."""
    case = in_a_test(tune_vs_grid.CASES["running_limit"])
    case = dataclasses.replace(case, load=(*case.load[:-1], "500"))
    assert case.load[-2:] == ("--slo-ttft-p95-ms", "500")
    code, doc, tmp_path = tuned_to_fix(case, tmp_path)
    start, end = assert_fixed(code, doc, case, tmp_path / "out")
    # Raised to what the traffic keeps in flight (16 offered: the peak, or Little's law's mean; fewer where a busy
    # machine's window is slow): far enough that the SLO holds, or at least half the offered load.
    assert start == 1 and (end is None or end >= 8 or (end >= 2 and doc["slo_holds"])), doc["stopped"]
    # The diagnosis knew the cap from the profile, not by inference from the metrics.
    root = json.loads((tmp_path / "out" / "baseline.json").read_text())["server"]["metrics"]["diagnosis"]["root_cause"]
    assert (root["kind"], root["current"], root["current_source"]) == ("running_limit", 1, "exported")
    assert (tmp_path / "out" / "profile.yaml").read_text().count("max_num_seqs: ") == 1
    assert ("+max_num_seqs: " in (tmp_path / "out" / "profile.diff").read_text()) == (end is not None)
    assert "Tune: one change at a time" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.real_vllm
def test_a_kv_cache_far_too_small_is_grown_and_kept(cpu_vllm, tmp_path):
    case = in_a_test(tune_vs_grid.CASES["kv_cache"])
    code, doc, tmp_path = tuned_to_fix(case, tmp_path)
    start, end = assert_fixed(code, doc, case, tmp_path / "out")
    assert start == 4 * MIB and (end is None or end >= 8 * MIB)


@pytest.mark.real_vllm
def test_prefix_caching_off_under_a_shared_prefix_is_turned_on_and_kept(cpu_vllm, tmp_path):
    case = in_a_test(tune_vs_grid.CASES["prefix_cache_off"])
    code, doc, tmp_path = tuned_to_fix(case, tmp_path)
    assert assert_fixed(code, doc, case, tmp_path / "out") in ((False, True), (False, None))


STALLED_WHY = ("TTFT p75 -9.6% (95% CI -37.5% .. +70.6%): the interval does not lie wholly below 0; judged on runs "
               "the client stalled in (this run: the client stalled 52% of the run (worst 622 ms)): a busy machine's "
               "stalls are in these figures; measure on a quieter one to be sure")


@pytest.mark.parametrize("rows, stalled_runs, expected", [
    # e2's shape: the fix reverted on runs whose client stalled, tune saying so
    ([("enable_prefix_caching", trials.REVERTED, STALLED_WHY), ("max_num_seqs", trials.REVERTED, "")],
     {"baseline", "trial-1"}, (False, None)),
    # reverted on runs no stall touched: tune missed the fix
    ([("enable_prefix_caching", trials.REVERTED, "the interval does not lie wholly below 0")], set(), AssertionError),
    # a stalled client, but the row does not say so
    ([("enable_prefix_caching", trials.REVERTED, "the interval does not lie wholly below 0")], {"trial-1"},
     AssertionError),
    # another setting kept before the blurred fix
    ([("max_num_seqs", trials.KEPT, ""), ("enable_prefix_caching", trials.REVERTED, STALLED_WHY)],
     {"baseline", "trial-1", "trial-2"}, AssertionError),
    ([("enable_prefix_caching", trials.KEPT, STALLED_WHY)], {"trial-1"}, (False, True)),
])
def test_a_fix_blurred_by_the_clients_stalls_is_said_not_kept(tmp_path, rows, stalled_runs, expected):
    names = ["baseline", *[f"trial-{n}" for n in range(1, len(rows) + 1)]]
    for name in names:
        (tmp_path / f"{name}.json").write_text(json.dumps({"client": {"valid": name not in stalled_runs}}))
    missed = {"ttft_p95_ms": {"met": False}}
    doc = {"slo_holds": False, "runs": len(names), "interrupted": False,
           "trials": [{"n": 0, "setting": None, "from": None, "to": None, "decision": "baseline", "why": "",
                       "run": "baseline.json", "figures": missed}]
           + [{"n": n, "setting": setting, "from": False if setting == "enable_prefix_caching" else 1,
               "to": True if setting == "enable_prefix_caching" else 8, "decision": decision, "why": why,
               "run": f"trial-{n}.json", "figures": missed} for n, (setting, decision, why) in enumerate(rows, 1)],
           "changes": [{"setting": setting, "from": False, "to": True} for setting, decision, _ in rows
                       if decision == trials.KEPT and setting == "enable_prefix_caching"]}
    case = dataclasses.replace(tune_vs_grid.CASES["prefix_cache_off"], runs=len(names))
    if expected is AssertionError:
        with pytest.raises(AssertionError):
            assert_fixed(1, doc, case, tmp_path)
    else:
        assert assert_fixed(1, doc, case, tmp_path) == expected


@pytest.mark.real_vllm
def test_with_nothing_wrong_nothing_is_kept_and_it_says_the_slo_holds(cpu_vllm, tmp_path):
    healthy = tune_vs_grid.Case((), ("-n", "8", "-c", "4", "--input-tokens", "256", "--output-tokens", "16",
                                     "--slo-ttft-p95-ms", "60000"), "")
    code, doc = tuned(healthy, tmp_path)
    assert code == 0 and doc["runs"] == 1 and doc["changes"] == []
    assert doc["stopped"] == {"reason": "slo_met", "text": "the SLO holds already: nothing to change"}
    assert [row["decision"] for row in doc["trials"]] == ["baseline"]


def started_trial(proc: subprocess.Popen, name: str) -> list[str]:
    """Read tune's progress until the run of trial `name` begins: the lines so far."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if f"{name}: engine up and warm" in line:
            return lines
    raise AssertionError("tune ended before " + name + ": " + "".join(lines[-5:]))


# What the interrupt and crash tests need is a trial under way: a light run whose TTFT target
# (1 ms) no run meets, so that tune always tries a change (the cap up, for the diagnosis or for
# the figure), whatever the machine's load, and whose run lasts seconds (256 decode steps at
# least), so the signal sent as it begins lands in it.
INTERRUPTED = tune_vs_grid.Case(("max_num_seqs=1", "enable_prefix_caching=false"),
                                ("-n", "4", "-c", "4", "--input-tokens", "64", "--output-tokens", "256",
                                 "--slo-ttft-p95-ms", "1"), "max_num_seqs", runs=3)


@pytest.mark.real_vllm
def test_ctrl_c_mid_trial_keeps_the_finished_trials_and_stops_the_engine(cpu_vllm, tmp_path):
    port, out = profiles.free_port(), tmp_path / "out"
    proc = subprocess.Popen(tune_command(INTERRUPTED, out, port), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    started_trial(proc, "trial-1")
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130
    doc = json.loads(stdout)
    assert doc["interrupted"] and doc["stopped"]["reason"] == "interrupted"
    assert [row["decision"] for row in doc["trials"]] == ["baseline", "interrupted"]
    assert json.loads((out / "tune.json").read_text())["trials"] == doc["trials"]
    assert json.loads((out / "baseline.json").read_text())["kind"] == "bench"
    assert_no_engine_left(port, out)


@pytest.mark.real_vllm
def test_an_engine_that_crashes_mid_trial_is_a_trial_result_and_leaves_nothing_running(cpu_vllm, tmp_path):
    port, out = profiles.free_port(), tmp_path / "out"
    case = dataclasses.replace(INTERRUPTED, runs=2)
    proc = subprocess.Popen(tune_command(case, out, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started_trial(proc, "trial-1")
    # The API server's pid, as uvicorn logs it; killed as the kernel's OOM killer would.
    pid = int(re.search(r"Started server process \[(\d+)\]", (out / "engine-1.log").read_text())[1])
    os.kill(pid, signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=600)
    doc = json.loads(stdout)
    assert proc.returncode == 1 and not doc["interrupted"]
    assert [row["decision"] for row in doc["trials"]] == ["baseline", "engine crashed"]
    # The loop goes on after the crash: to the budget, or to no lever left (a bisect between the
    # start and a crashed neighbour has no value between them).
    assert doc["changes"] == [] and doc["stopped"]["reason"] in ("budget", "no_lever"), doc["stopped"]
    assert_no_engine_left(port, out)


@pytest.mark.real_vllm
def test_a_profile_that_cannot_start_is_one_line(cpu_vllm, tmp_path):
    port = profiles.free_port()
    done = subprocess.run(tune_command(tune_vs_grid.CASES["running_limit"], tmp_path / "out", port,
                                       "--set", 'extra_args=["--no-such-flag"]'),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 3
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: the server exited with status") and "engine-0.log" in error
    assert "Traceback" not in done.stderr and json.loads(done.stdout) == {"error": error.removeprefix("error: "),
                                                                           "exit_code": 3}
    assert_no_engine_left(port, tmp_path / "out")


def measured_with(diagnosis_name: str, profile: dict) -> tuning.Measured:
    """A configuration whose run carries a recorded diagnosis, and misses a TTFT target."""
    run = {"server": {"metrics": {"diagnosis": diagnosis(diagnosis_name)}}, "requests": {"sent": 16, "failed": 0},
           "slo": {"ttft_p95_ms": {"target": 1000.0, "measured": 4000.0, "met": False}}}
    return tuning.Measured(profile, run, "run.json")


def test_the_search_brackets_a_kept_value_then_moves_to_the_next_lever():
    search, start = tuning.Search(), cpu_profile(max_num_seqs=1)
    first = search.next_change(measured_with("running-limit", start))
    assert first.describe() == "max_num_seqs 1 -> 8"
    search.record(first, trials.KEPT)
    kept = measured_with("running-limit", first.applied(start))
    second = search.next_change(kept)
    assert second.describe() == "max_num_seqs 8 -> 16"
    search.record(second, trials.REVERTED)
    assert search.next_change(kept) is None and search.done == ["max_num_seqs"]


def test_a_kv_size_that_does_not_start_is_bisected_and_the_precision_lever_is_only_proposed():
    search, start = tuning.Search(), cpu_profile(env={}, kv_cache_memory_bytes=4 * MIB, max_model_len=1024)
    best = measured_with("kv-cache", start)
    first = search.next_change(best)
    search.record(first, trials.NO_START)
    assert search.next_change(best).describe() == "kv_cache_memory_bytes 4 MiB -> 5 MiB"
    search.record(search.next_change(best), trials.REVERTED)
    assert search.next_change(best) is None
    assert any("--kv-cache-dtype" in line and "not tried" in line for line in search.passed_over)


def test_a_failed_start_is_told_by_the_engines_first_exception_not_its_last_warning(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO starting\n(EngineCore pid=1) ERROR core.py:1510] ValueError: in the worker's prefix\n"
                   "ValueError: To serve at least one request with the model's max seq len (4096), ...\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n"
                   "  warnings.warn('resource_tracker: There appear to be %d '\n")
    assert profiles.why_it_stopped(log).startswith("ValueError: To serve at least one request")
    log.write_text("usage: api_server.py ...\napi_server.py: error: unrecognized arguments: --no-such-flag\n")
    assert profiles.why_it_stopped(log) == "api_server.py: error: unrecognized arguments: --no-such-flag"
    # SGLang's uvicorn could not bind; the timeout after it is the warm-up's request to whatever held the port.
    log.write_text("[2026-12-05 07:36:05] INFO:     Application startup complete.\n"
                   "[2026-12-05 07:36:05] ERROR:    [Errno 98] error while attempting to bind on address "
                   "('127.0.0.1', 40871): address already in use\n"
                   "[2026-12-05 07:36:15] post-warmup freeze_gc failed\nTraceback (most recent call last):\n"
                   "TimeoutError: timed out\n")
    assert profiles.why_it_stopped(log) == ("[Errno 98] error while attempting to bind on address "
                                           "('127.0.0.1', 40871): address already in use")
