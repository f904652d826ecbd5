"""Live fault deployments (issue #22): a real CPU vLLM per fault class, started with the profile
override that causes it and loaded in the background while `metrics --url URL --window N --json`
reads it, as a user would. The diagnosis must name the root cause with its setting and current
value, no lever may contradict another or the deployment, and the `verify` commands must run
against the live server. The prefix probe runs on the same deployments; a proxy in front (a
fixed delay on every path or on the inference routes only, or response buffering) must show in
bench's time outside the engine, by kind.

The diagnosis' contract (metrics --json, and bench's server section):
  {"root_cause": <finding>|null, "findings": [...root first...], "plan": [<lever>...], "verify": [cmds]}
  <finding> = {kind, evidence, confidence, caused_by, setting, current, current_source}
  <lever>   = {setting, current, current_source, proposed, reason, effect, text}

Loads are small and prefill-heavy where they must queue (test_metrics.QUEUEING_PROMPTS says why:
on CPU the API server, not the engine, holds long outputs back).
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import bench
import httpx
import pytest
from slow_proxy import Behaviour, proxy
from test_metrics import send_load

REPO = Path(__file__).resolve().parents[2]
METRICS = REPO / "scripts" / "metrics.py"
# Targets no CPU run misses: these deployments are about limits and caches, not CPU speed.
CPU_SLO = ["--slo-ttft-p95-ms", "600000", "--slo-tpot-p95-ms", "600000"]
WINDOW_S = 15  # each load below took 1 to 8 s on a busy 2-core machine
PROXY_DELAY_S = 0.3


@pytest.fixture(scope="module")
def limited(vllm_factory):
    """At most 2 running requests, prefix caching off."""
    with vllm_factory(sets=["max_num_seqs=2", "enable_prefix_caching=false"]) as server:
        yield server


@pytest.fixture(scope="module")
def small_kv(vllm_factory):
    # env={} drops VLLM_CPU_KVCACHE_SPACE, which would override --kv-cache-memory-bytes.
    with vllm_factory(sets=["env={}", "max_model_len=1024", "kv_cache_memory_bytes=4194304"]) as server:
        yield server


@pytest.fixture(scope="module")
def cached(vllm_factory):
    """Prefix caching on, and usage.prompt_tokens_details.cached_tokens in every answer."""
    with vllm_factory(sets=["enable_prefix_caching=true", 'extra_args=["--enable-prompt-tokens-details"]']) as server:
        yield server


def windowed(url: str, load: Callable[[], None], seconds: int = WINDOW_S) -> dict:
    """`metrics --url URL --window seconds --json` in its own process, `load()` started once its
    first scrape is in (it then says "measuring for"); the load must end inside the window."""
    process = subprocess.Popen([sys.executable, str(METRICS), "--url", url, "--window", str(seconds), "--json", *CPU_SLO],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stderr.readline()
        assert "measuring for" in first, first
        started = time.monotonic()
        load()
        took = time.monotonic() - started
        out, err = process.communicate(timeout=seconds + 120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err[-800:]
    assert took < seconds - 1, f"the load took {took:.0f} s: the {seconds} s window missed its end"
    return json.loads(out)


def prefix_probe(url: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, str(METRICS), "--url", url, "--prefix-probe", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout, done.stderr[-800:]
    return done.returncode, json.loads(done.stdout)


def _number(value: Any) -> float | None:
    """A number as the diagnosis may write it: 2, "2", 4194304, "4 MiB"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*(KiB|MiB|GiB)?\s*", str(value))
    if not match:
        return None
    return float(match.group(1)) * {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[match.group(2)]


def same(value: Any, expected: Any) -> bool:
    """Whether a setting's value, as the diagnosis writes it, is `expected` (a bool, number or text)."""
    if isinstance(expected, bool):
        return str(value).lower() in (("true", "on", "1") if expected else ("false", "off", "0"))
    if isinstance(expected, (int, float)):
        return _number(value) == expected
    return value == expected


def diagnosis_of(report: dict) -> dict:
    diagnosis = report["diagnosis"]
    assert isinstance(diagnosis, dict) and {"root_cause", "findings", "plan", "verify"} <= set(diagnosis), \
        f"not the causal-chain diagnosis of issue #22: {str(diagnosis)[:400]}"
    return diagnosis


def assert_root_cause(diagnosis: dict, kind: str, setting: str | None, current: Any) -> None:
    cause = diagnosis["root_cause"]
    assert cause and cause["kind"] == kind, cause
    assert diagnosis["findings"][0] == cause  # root first
    assert cause["setting"] == setting and same(cause["current"], current), cause


def assert_plan_agrees(diagnosis: dict, deployment: dict[str, Any]) -> None:
    """No lever proposes what is already so; two levers on one setting propose the same value; a
    lever on a setting this deployment set starts from the value it set and changes it."""
    proposed: dict[str, Any] = {}
    for lever in diagnosis["plan"]:
        assert lever["current"] is None or not same(lever["proposed"], lever["current"]), lever
        if lever["setting"] in deployment:
            wanted = deployment[lever["setting"]]
            assert lever["current"] is None or same(lever["current"], wanted), (lever, deployment)
            assert not same(lever["proposed"], wanted), (lever, deployment)
        first = proposed.setdefault(lever["setting"], lever["proposed"])
        assert first == lever["proposed"], f"two levers on {lever['setting']}: {first!r} and {lever['proposed']!r}"


def assert_verify_runs(diagnosis: dict, url: str, folder: Path) -> None:
    """Each `verify` command as printed, against the live server, its windows cut to 2 s, run in
    `folder` (the files they write land there) with go-task's -x (the script's own exit code, not
    go-task's 201). Each must exit 0 (PASS, B better or no different) or 1 (FAIL, B worse or
    mixed); a bench may also exit 4, INVALID, when its own client was too delayed to measure (on
    this busy 2-core machine any process beside a streaming engine stalls), or 3 when every stream
    of the random tiny model carried no text (greedy decoding may loop on byte tokens that decode
    to nothing; which ones depends on the batching): verdicts of the run, which its result file
    must give, not failures to run."""
    assert diagnosis["verify"], "no verify command"
    env = {**os.environ, "INFER_URL": url, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in diagnosis["verify"]:
        short = re.sub(r"(WINDOW=|--window[ =])\d+", r"\g<1>2", command)
        assert short.startswith("task "), command
        local = f"task -x -t {REPO / 'Taskfile.yml'} {short[len('task '):]}"
        done = subprocess.run(["bash", "-c", local], cwd=folder, env=env, capture_output=True, text=True, timeout=180)
        assert "Traceback" not in done.stderr, (command, done.stderr[-800:])
        if done.returncode in (3, 4) and "infer:bench" in command:
            result = json.loads((folder / re.search(r"--json-out (\S+)", command)[1]).read_text())
            if done.returncode == 4:
                assert result["verdict"] == "INVALID" and not result["client"]["valid"], result["verdict_reasons"]
            else:
                assert result["requests"]["errors"] == {"empty_output": result["requests"]["failed"]}, result["requests"]
            continue
        assert done.returncode in (0, 1), (command, done.returncode, done.stderr[-800:])


# --------------------------------------------------------------------------------------------
# One deployment per fault class

@pytest.mark.real_vllm
def test_a_running_limit_too_low_is_the_root_cause(limited, tmp_path):
    report = windowed(limited.url, lambda: send_load(limited.url, limited.model, 16, 16, 2048, 16, seed=11))
    assert report["e2e_ms"]["n"] == 16 and report["queue_ms"]["mean"] > 0.2 * report["e2e_ms"]["mean"]  # it queued
    diagnosis = diagnosis_of(report)
    assert_root_cause(diagnosis, "running_limit", "--max-num-seqs", 2)
    # No metric exports the cap: inferred, it is a floor, and said so. The gauges, sampled between
    # a step's finished request and the next admission, read 1 in the long prefills of these prompts.
    assert diagnosis["root_cause"]["evidence"].startswith("--max-num-seqs is at least 2 (inferred: ")
    assert_plan_agrees(diagnosis, {"--max-num-seqs": 2, "--enable-prefix-caching": False})
    assert_verify_runs(diagnosis, limited.url, tmp_path)


@pytest.mark.real_vllm
def test_prefix_caching_off_under_a_shared_prefix_is_the_root_cause(limited, tmp_path):
    # Two at a time, as many as may run: nothing queues, every prompt shares 896 of its 1,000 tokens.
    report = windowed(limited.url, lambda: send_load(limited.url, limited.model, 8, 2, 1000, 8, shared_prefix=896, seed=12))
    assert report["e2e_ms"]["n"] == 8 and not report["prefix_cache_hit_rate"]
    code, probed = prefix_probe(limited.url)
    assert (code, probed["verdict"], probed["cause"]) == (1, "cannot_hit", "caching_off")
    assert probed["prefix_caching"] == "False" and all(r["server"]["queries"] == 0 for r in probed["requests"])
    diagnosis = diagnosis_of(report)
    assert_root_cause(diagnosis, "prefix_cache_off", "--enable-prefix-caching", False)
    assert_plan_agrees(diagnosis, {"--max-num-seqs": 2, "--enable-prefix-caching": False})
    # The change is the server's flag: the same workload before and after, one that shares a prefix.
    before, after, _ = diagnosis["verify"]
    assert "--shared-prefix 500" in before and before.replace("before", "after") == after
    assert_verify_runs(diagnosis, limited.url, tmp_path)


@pytest.mark.real_vllm
def test_a_kv_cache_too_small_is_the_root_cause(small_kv, tmp_path):
    report = windowed(small_kv.url, lambda: send_load(small_kv.url, small_kv.model, 16, 16, 512, 256, seed=13), 25)
    assert report["kv_cache_tokens"] == 2048 and report["preemptions"] > 0
    diagnosis = diagnosis_of(report)
    assert_root_cause(diagnosis, "kv_cache", "--kv-cache-memory-bytes", 4194304)
    assert_plan_agrees(diagnosis, {"--kv-cache-memory-bytes": 4194304})
    assert_verify_runs(diagnosis, small_kv.url, tmp_path)


SYSTEM_PROMPT = " ".join(["You are the support assistant of a large shop. Answer in short sentences, cite the order "
                          "number, never promise refunds, and hand over to a person when the customer is angry."] * 24)


def unstable_prefix_load(url: str, model: str, requests: int, concurrency: int) -> None:
    """Prompts that start with a request id and a timestamp, then one long shared system prompt:
    the cache works, and no two prompts share their first block."""
    with httpx.Client(base_url=url, timeout=600) as http:
        def one(i: int) -> None:
            prompt = f"[request {random.getrandbits(64):016x} at {time.time():.6f}] {SYSTEM_PROMPT}\nQuestion {i}: where is my order?"
            http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                "ignore_eos": True}).raise_for_status()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))


@pytest.mark.real_vllm
def test_an_unstable_prompt_prefix_is_the_root_cause(cached, tmp_path):
    report = windowed(cached.url, lambda: unstable_prefix_load(cached.url, cached.model, 8, 2))
    assert report["e2e_ms"]["n"] == 8 and report["prefix_cache_hit_rate"] < 0.05
    assert report["prompt_tokens"] / report["requests"] > 512
    # The probe sends the same prompt twice: this cache hits, so the prompts defeat it.
    code, probed = prefix_probe(cached.url)
    assert (code, probed["verdict"], probed["cause"]) == (0, "can_hit", None), probed["evidence"]
    second = probed["requests"][1]
    assert second["cached_tokens"] == probed["cacheable_tokens"] == second["server"]["hits"] > 0
    assert probed["cacheable_tokens"] % probed["block_size"] == 0 and "from its first token" in probed["meaning"]
    diagnosis = diagnosis_of(report)
    # The client's prompts are the cause, not a setting: the evidence says caching is on, as the
    # server exports, and no lever turns it on.
    assert_root_cause(diagnosis, "prefix_unstable", None, True)
    assert "prefix caching on (exported: vllm:cache_config_info enable_prefix_caching)" in \
        diagnosis["root_cause"]["evidence"]
    assert "--enable-prefix-caching" not in [lever["setting"] for lever in diagnosis["plan"]]
    assert_plan_agrees(diagnosis, {"--enable-prefix-caching": True})
    # The change is the client's prompts: only the second bench shares a prefix, and compare is told.
    assert diagnosis["verify"][2].endswith(" -- --variable shared_prefix")
    assert_verify_runs(diagnosis, cached.url, tmp_path)


# --------------------------------------------------------------------------------------------
# A proxy in front: time outside the engine, by kind (bench --probe /health through the proxy)

def bench_through(server, behaviour: Behaviour, capsys) -> dict:
    with proxy(server.url, behaviour) as url:
        bench.main(["--json", "--url", url, "-n", "6", "-c", "1", "--warmup", "0", "--input-tokens", "64",
                    "--output-tokens", "32", "--timeline-interval", "0", "--probe", "/health",
                    "--extra-body", server.plain_words_body()])
    result = json.loads(capsys.readouterr().out)
    assert result["requests"]["completed"] == 6, result["requests"]["first_errors"]
    return result


def causes(result: dict) -> dict[str, dict]:
    """The outside-engine findings by cause. On a busy CPU the API server now and then sends a
    whole stream in one read: such a partial buffering finding (medium confidence) is left out."""
    found = {f["cause"]: f for f in result["server"]["cross_check"]["findings"] if f["kind"] == "outside_engine"}
    if "buffering" in found and found["buffering"]["confidence"].startswith("medium"):
        del found["buffering"]
    return found


def assert_outside_engine_is_the_root_cause(result: dict) -> None:
    diagnosis = diagnosis_of(result["server"]["metrics"])
    assert_root_cause(diagnosis, "outside_engine", None, None)


@pytest.mark.real_vllm
def test_a_proxy_delaying_every_request_is_a_fixed_latency_of_the_network(cached, capsys):
    result = bench_through(cached, Behaviour(delay_s=PROXY_DELAY_S), capsys)
    found = causes(result)
    assert set(found) == {"fixed_latency", "network"}, found
    assert found["fixed_latency"]["size_ms"] == pytest.approx(PROXY_DELAY_S * 1e3, rel=0.3)
    assert found["network"]["size_ms"] == pytest.approx(result["server"]["probe"]["p50_ms"], rel=0.01)
    assert result["server"]["probe"]["p50_ms"] >= PROXY_DELAY_S * 1e3  # /health is delayed too
    assert_outside_engine_is_the_root_cause(result)


@pytest.mark.real_vllm
def test_a_gateway_delaying_inference_routes_is_named_apart_from_the_network(cached, capsys):
    result = bench_through(cached, Behaviour(delay_s=PROXY_DELAY_S, delayed_prefix="/v1/"), capsys)
    found = causes(result)
    assert set(found) == {"fixed_latency", "gateway"}, found
    assert found["gateway"]["size_ms"] == pytest.approx(PROXY_DELAY_S * 1e3, rel=0.3)
    assert result["server"]["probe"]["p50_ms"] < 0.2 * PROXY_DELAY_S * 1e3
    assert_outside_engine_is_the_root_cause(result)


@pytest.mark.real_vllm
def test_a_proxy_buffering_the_stream_is_named(cached, capsys):
    result = bench_through(cached, Behaviour(buffer=True), capsys)
    assert result["requests"]["one_read"] == 6
    found = causes(result)
    assert set(found) == {"buffering"} and found["buffering"]["confidence"].startswith("high"), found
    # The first token waited for the last: about the engine's decode time of 31 tokens.
    decode = result["server"]["metrics"]["decode_ms"]["mean"]
    assert found["buffering"]["size_ms"] == pytest.approx(decode, rel=0.5, abs=20)
    assert_outside_engine_is_the_root_cause(result)
