"""Live fault deployments (issue #22): a real CPU vLLM per fault class, started with the profile
override that causes it and loaded while `metrics --url URL --window N --json` reads it, as a user
would (the window ends when the load ends). The diagnosis must name the root cause with its setting and current
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
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import bench
import httpx
import pytest
from calibration_server import CalibrationServer, Schedule
from fault_server import response as fake_response
from slow_proxy import Behaviour, proxy
from test_metrics import QUEUEING_PROMPTS, send_load

REPO = Path(__file__).resolve().parents[2]
METRICS = REPO / "scripts" / "metrics.py"
# Run outside task (as here), a diagnosis prints its commands in the toolbox's own call form.
TOOLBOX_CALL = f"task -t {REPO / 'skills' / 'roofline-toolbox' / 'Taskfile.yml'} "
# Targets no CPU run misses: these deployments are about limits and caches, not CPU speed.
CPU_SLO = ["--slo-ttft-p95-ms", "600000", "--slo-tpot-p95-ms", "600000"]
# A hang guard only: each window is ended as soon as its load has ended (windowed).
WINDOW_LIMIT_S = 900


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


def windowed(url: str, load: Callable[[], None]) -> dict:
    """`metrics --url URL --window ... --json` in its own process: `load()` starts once its first
    scrape is in (it then says "measuring for"), and SIGTERM, which metrics takes as Ctrl-C, ends
    the window once `load()` has returned (metrics still reports the window so far, exit 130; not
    SIGINT itself, which a process started from a background job inherits ignored). The window
    then holds the whole load however long a busy machine takes over it, and nothing after it."""
    process = subprocess.Popen([sys.executable, str(METRICS), "--url", url, "--window", str(WINDOW_LIMIT_S), "--json",
                                *CPU_SLO], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stderr.readline()
        assert "measuring for" in first, first
        load()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, f"exit {process.returncode}, not Ctrl-C's 130: {err[-800:]}"
    report = json.loads(out)
    assert report["interrupted"] is True
    return report


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
    """Each `verify` command exactly as printed, any window in it cut to 2 s, with go-task's -x
    after `task` (the script's own exit code, not go-task's 201), run in `folder` (not the
    repository: the call must work from anywhere; the files it writes land there). A bench must
    answer every request with text (the tiny model always speaks) and exit 0 (PASS: the targets
    are CPU-proof) or 4, INVALID, when its own client was too delayed to measure (on a busy 2-core
    machine any process beside a streaming engine stalls): a verdict of the run, which its result
    file must give. compare must exit 0 (B better or no different) or 1 (B worse or mixed)."""
    assert diagnosis["verify"], "no verify command"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in diagnosis["verify"]:
        assert command.startswith(TOOLBOX_CALL), command
        short = re.sub(r"(WINDOW=|--window[ =])\d+", r"\g<1>2", command)
        done = subprocess.run(["bash", "-c", "task -x " + short[len("task "):]], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=900)  # a hang guard
        assert "Traceback" not in done.stderr, (command, done.stderr[-800:])
        if command.startswith(TOOLBOX_CALL + "bench "):
            assert f" INFER_URL={url} " in command, command  # the server it read, whatever the reader's default
            assert done.returncode in (0, 4), (command, done.returncode, done.stderr[-800:])
            result = json.loads((folder / re.search(r"--json-out (\S+)", command)[1]).read_text())
            requests = int(re.search(r"BENCH_N=(\d+)", command)[1])
            assert (result["requests"]["completed"], result["requests"]["failed"]) == (requests, 0), result["requests"]
            if done.returncode == 4:
                assert result["verdict"] == "INVALID" and not result["client"]["valid"], result["verdict_reasons"]
        else:
            assert command.startswith(TOOLBOX_CALL + "compare "), command
            assert done.returncode in (0, 1), (command, done.returncode, done.stderr[-800:])


# --------------------------------------------------------------------------------------------
# One deployment per fault class

def queue_share(report: dict) -> float:
    return report["queue_ms"]["mean"] / report["e2e_ms"]["mean"]


def queued_window(server) -> dict:
    """The window of 16 prompts sent at once to 2 slots: each waits for the ones before it, about
    3.5 services of 4.5 (a share of 0.78) when they reach the engine together. They reach it as
    fast as a busy API server hands them over: longer prompts (QUEUEING_PROMPTS) until the
    engine's queue holds more than the diagnosis' 20% of the time (it held 64% at 2,048 tokens)."""
    for prompt_tokens in QUEUEING_PROMPTS:
        report = windowed(server.url, lambda: send_load(server.url, server.model, 16, 16, prompt_tokens, 16, seed=11))
        if queue_share(report) > 0.2:
            break
    return report


@pytest.mark.real_vllm
def test_a_running_limit_too_low_is_the_root_cause(limited, tmp_path):
    report = queued_window(limited)
    assert report["e2e_ms"]["n"] == 16 and queue_share(report) > 0.2, f"queued {queue_share(report):.0%} of the time"
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
    report = windowed(small_kv.url, lambda: send_load(small_kv.url, small_kv.model, 16, 16, 512, 256, seed=13))
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
# A proxy in front: time outside the engine, by kind (bench --probe /health through the proxy).
#
# Which kinds the diagnosis names rests on the engine's histogram buckets: the client must be
# above the engine's bucket at every percentile, by more than its own loop lag. On a busy 2-core
# machine a real CPU vLLM's TTFT for one 64-token prompt reached 1 to 2.5 s, one bucket wider
# than any delay a test can afford: so the kinds are checked against an engine whose times the
# test knows (the calibration server, its vLLM histograms holding exactly its own times), and the
# real vLLM behind the same proxies is checked for what no load can change (the delay is in the
# client's figures and not in the engine's, the buffered streams came in one read). The kinds
# behind a real vLLM: `task bench:outside-engine` (benchmarks/outside_engine.py).

# Beyond the proxy's delay the client sees only loopback, the proxy's copy and the wake-ups of
# this process's threads: a few ms on a quiet machine, 183 ms on average at load 20 on 2 cores
# (two busy loops beside three test workers). The engine's buckets below 1 s are at most 0.25 s
# wide. 1 s keeps every threshold of the diagnosis (above the bucket by more than the client's
# loop lag; the first token's excess within 25% of the last one's; a part named from 20%) above
# that noise.
KNOWN_DELAY_S = 1.0
# 40 ms to the first token, then 20 ms a token: 32 tokens in 660 ms.
KNOWN_SCHEDULE = Schedule(ttft_ms=40, itl_ms=20)
# Through a buffering proxy the client's e2e must stay in the engine's bucket (else what the path
# adds after the last token is named too): 40 + 31 x 33 ms ends 1,063 ms after arrival, never
# earlier (the writes keep an absolute schedule), 437 ms below the top of vLLM's bucket of 1 to
# 1.5 s: 2.4 times the path's own time at load 20 (KNOWN_DELAY_S).
BUFFERED_SCHEDULE = Schedule(ttft_ms=40, itl_ms=33)
# vLLM's bucket bounds (vllm/v1/metrics/loggers.py, as a 0.32 scrape shows them).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# The paths whose times the cross-check reads: delayed alone, to it they are a delay on every path,
# at a fraction of the cost (bench's own calls, /tokenize for each prompt and /metrics, would each
# wait it out too).
READ_PATHS = ("/v1/completions", "/health")
# Behind a real vLLM only lower bounds are checked, which a busy machine only makes likelier: the
# delay need not outgrow the engine's buckets, only the trivial round trip in the gateway case
# (1 to 30 ms through the proxy on a busy 2-core machine).
REAL_DELAY_S = 0.3


def histogram(name: str, bounds: tuple[float, ...], seconds: list[float]) -> list[str]:
    labels = 'engine="0",model_name="calibration"'
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{le}"}} {sum(s <= le for s in seconds)}' for le in bounds]
    lines += [f'{name}_bucket{{{labels},le="+Inf"}} {len(seconds)}', f"{name}_sum{{{labels}}} {sum(seconds)}",
              f"{name}_count{{{labels}}} {len(seconds)}"]
    return lines


class KnownEngine(CalibrationServer):
    """The calibration server with /health and the /metrics of a vLLM whose TTFT and e2e
    histograms hold exactly its own times: from each request's arrival to its first and its last
    write (its truth). bench scrapes before the first request and after the last (no timeline),
    when every stream has ended."""

    def handle(self, transport, method: str, path: str, headers: dict[str, str], body: bytes, arrived: int,
               arrived_by: str) -> None:
        if method == "GET" and path == "/health":
            transport.write(fake_response(200, b""))
        elif method == "GET" and path == "/metrics":
            streams = [t for t in self.truth.values() if t["writes_ns"]]
            ttft = [(t["writes_ns"][0] - t["arrived_ns"]) / 1e9 for t in streams]
            e2e = [(t["writes_ns"][-1] - t["arrived_ns"]) / 1e9 for t in streams]
            page = histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS, ttft) + \
                histogram("vllm:e2e_request_latency_seconds", E2E_BUCKETS, e2e)
            transport.write(fake_response(200, ("\n".join(page) + "\n").encode(), "text/plain; version=0.0.4"))
        else:
            super().handle(transport, method, path, headers, body, arrived, arrived_by)


@pytest.fixture(scope="module")
def known_engine():
    with KnownEngine(KNOWN_SCHEDULE) as server:
        yield server


# The premise of every check through a proxy: this process measured its clocks well inside the
# delay. A run whose own event loop fell further behind than this (p99; fresh-clone runs beside two
# busy loops met 1.5 s) measured the machine, not the path: it is sent again, 3 times at most, and
# the tests assert on the last.
CLIENT_LAG_PREMISE_MS = 0.25 * KNOWN_DELAY_S * 1e3
OUTPUT_TOKENS = 32


def bench_through(url: str, behaviour: Behaviour, capsys, schedule: Schedule | None = None) -> dict:
    for _ in range(3):
        with proxy(url, behaviour) as proxied:
            bench.main(["--json", "--url", proxied, "-n", "6", "-c", "1", "--warmup", "0", "--input-tokens", "64",
                        "--output-tokens", str(OUTPUT_TOKENS), "--timeline-interval", "0", "--probe", "/health",
                        *CPU_SLO])
        result = json.loads(capsys.readouterr().out)
        assert result["requests"]["completed"] == 6, result["requests"]["first_errors"]
        if machine_lag_ms(result, schedule) < CLIENT_LAG_PREMISE_MS and not (
                schedule is not None and engine_buckets_hide_the_delay(result)):
            break
    return result


def engine_buckets_hide_the_delay(result: dict) -> bool:
    """Whether the engine's own times fell in a bucket as wide as the delay at some percentile. The
    client's figure is the engine's plus the delay, so it clears the engine's bucket only where that
    bucket is narrower than the delay: the CI run on 7c45e9d met one stream of six whose engine TTFT
    went past 1 s (p95 and p99 in vLLM's bucket of 1 to 2.5 s, the client's 2,048 and 2,313 ms within
    it), so the fixed latency was not named though the exact means agreed (TTFT 1,006 ms and e2e
    1,060 ms over the engine). That run measured the engine stalling on a busy machine, not the path:
    it is sent again, as a lagging client is."""
    rows = [row for key in result["server"]["cross_check"]["percentiles"].values() for row in key.values()]
    return any(high is None or high - low >= KNOWN_DELAY_S * 1e3 for low, high in (r["server_bucket_ms"] for r in rows))


def machine_lag_ms(result: dict, schedule: Schedule | None) -> float:
    """How far the machine, not the proxy, moved this run's clocks: the client's own loop lag (p99)
    and, behind the known engine, how late the engine ended its streams against its schedule and
    how far apart the client's first and last tokens' lateness over the engine's came (the
    proxy's thread copying each chunk on a starved CPU, late for the last token or, when it
    stalled on the first, for the first: TTFT 1,443 ms over the engine and e2e 1,131 ms beside two
    busy loops and a tune test, its loop lag 3 ms). Beside eight busy loops and a tune test,
    runs met 843 and 954 ms along the stream (TTFT 1,059 and 1,083 ms over the engine, e2e 1,902
    and 2,037 ms) with the client's loop lag at 61 and 79 ms, and an engine p99 e2e of 8.5 s for a
    660 ms schedule: its wide buckets there hide a 1 s delay from the percentile check, and the
    first and last tokens' excesses disagree, so nothing or the network alone was named (a
    fresh-clone run beside two busy loops failed so too)."""
    lags = [result["client"]["loop_lag_ms"]["p99"] or 0.0]
    if schedule is not None:
        planned_e2e_ms = schedule.ttft_ms + (OUTPUT_TOKENS - 1) * schedule.itl_ms
        lags += [result["server"]["metrics"]["e2e_ms"]["mean"] - planned_e2e_ms,
                 abs(excess_ms(result, "e2e_ms") - excess_ms(result, "ttft_ms"))]
    return max(lags)


def causes(result: dict) -> dict[str, dict]:
    """The outside-engine findings by cause. On a busy machine a stalled client (this process) now
    and then reads a whole stream at once: such a partial buffering finding (medium confidence,
    some streams only) is left out."""
    found = {f["cause"]: f for f in result["server"]["cross_check"]["findings"] if f["kind"] == "outside_engine"}
    if "buffering" in found and found["buffering"]["confidence"].startswith("medium"):
        del found["buffering"]
    return found


def told(result: dict, found: dict[str, dict] | None = None) -> str:
    """What the fixed-latency gate read (and the causes found), for a failure's message: short, as
    pytest cuts a long one."""
    sizes = ", ".join(f"{cause} {finding['size_ms'] or 0:.0f} ms" for cause, finding in (found or {}).items())
    named = f"found {sizes or 'nothing'}; " if found is not None else ""
    return (named + f"TTFT {excess_ms(result, 'ttft_ms'):.1f} ms and e2e {excess_ms(result, 'e2e_ms'):.1f} ms over the engine, "
            f"client loop lag p99 {result['client']['loop_lag_ms']['p99']} ms, {result['requests']['one_read']} "
            f"streams in one read, percentiles {result['server']['cross_check']['percentiles']}")


def excess_ms(result: dict, key: str) -> float:
    """The client's mean TTFT or e2e less the engine's exact mean (its histogram's sum / count)."""
    return result[key]["mean"] - result["server"]["metrics"][key]["mean"]


def assert_about_the_delay(result: dict, size_ms: float, less_ms: float = 0.0) -> None:
    """At least the proxy's delay (every request waits it out; less `less_ms` where a part of it
    is named apart), and no more than the client measured beyond the engine (the mean e2e excess,
    which holds the delay and the path's own time: a fresh-clone run beside two busy loops added
    739 ms to a 1 s delay, so no fixed margin over the delay holds on a loaded machine)."""
    assert KNOWN_DELAY_S * 1e3 - less_ms <= size_ms <= excess_ms(result, "e2e_ms") + 1.0, (size_ms, told(result))


def assert_outside_engine_is_the_root_cause(result: dict, cause: str) -> None:
    diagnosis = diagnosis_of(result["server"]["metrics"])
    assert_root_cause(diagnosis, "outside_engine", None, None)
    # A partial buffering finding (causes) comes first when there is one, however small.
    root = diagnosis["root_cause"]
    assert root["cause"] == cause or (root["cause"], root["confidence"][:6]) == ("buffering", "medium"), root


def test_a_proxy_delaying_every_request_is_a_fixed_latency_of_the_network(known_engine, capsys):
    result = bench_through(known_engine.url, Behaviour(delay_s=KNOWN_DELAY_S, delayed_prefix=READ_PATHS), capsys,
                           KNOWN_SCHEDULE)
    assert result["server"]["probe"]["min_ms"] >= KNOWN_DELAY_S * 1e3  # /health is delayed too
    found = causes(result)
    # Real requests also pay the path's own time that the trivial probe does not (the stream's
    # chunks, this process's thread wake-ups): 334 ms of a 1,334 ms excess in a fresh-clone run
    # beside two busy loops, over the 20% from which a part is named. The diagnosis then says real
    # requests lose that much more than a trivial one, which is true there; the proxy's delay
    # itself must still be the network's, never the gateway's. A gateway part is the excess less
    # the probe's p50, so the asserts below (probe >= the delay, the network's part >= the delay)
    # keep the delay out of it: a probe that missed the delay would leave all of it to the gateway.
    assert set(found) - {"gateway"} == {"fixed_latency", "network"}, told(result, found)
    assert_about_the_delay(result, found["fixed_latency"]["size_ms"])
    # The trivial request pays all of the delay: the network's part is its measured round trip.
    assert_about_the_delay(result, found["network"]["size_ms"])
    assert found["network"]["size_ms"] <= result["server"]["probe"]["p50_ms"] + 1.0, told(result)
    assert_outside_engine_is_the_root_cause(result, "fixed_latency")


def test_a_gateway_delaying_inference_routes_is_named_apart_from_the_network(known_engine, capsys):
    result = bench_through(known_engine.url, Behaviour(delay_s=KNOWN_DELAY_S, delayed_prefix="/v1/"), capsys,
                           KNOWN_SCHEDULE)
    probe_ms = result["server"]["probe"]["p50_ms"]
    found = causes(result)
    assert set(found) == {"fixed_latency", "gateway"}, f"probe p50 {probe_ms:.0f} ms, {told(result, found)}"
    assert_about_the_delay(result, found["fixed_latency"]["size_ms"])
    assert_about_the_delay(result, found["gateway"]["size_ms"], less_ms=probe_ms)  # the trivial round trip is not its
    assert_outside_engine_is_the_root_cause(result, "fixed_latency")


def test_a_proxy_buffering_the_stream_is_named(capsys):
    with KnownEngine(BUFFERED_SCHEDULE) as engine:
        result = bench_through(engine.url, Behaviour(buffer=True), capsys)
    assert result["requests"]["one_read"] == 6
    found = causes(result)
    assert set(found) == {"buffering"} and found["buffering"]["confidence"].startswith("high"), found
    # The first token waited for the last: the engine's time from its first token to its last (its
    # 31 intervals, each write as late as the machine made it), less the moment the client took
    # between the two in its one read.
    engine = result["server"]["metrics"]
    assert found["buffering"]["size_ms"] == pytest.approx(engine["e2e_ms"]["mean"] - engine["ttft_ms"]["mean"], abs=20)
    assert_outside_engine_is_the_root_cause(result, "buffering")


@pytest.mark.real_vllm
def test_a_delay_in_front_of_a_real_vllm_is_the_clients_and_not_the_engines(cached, capsys):
    result = bench_through(cached.url, Behaviour(delay_s=REAL_DELAY_S, delayed_prefix=READ_PATHS), capsys)
    assert result["server"]["probe"]["min_ms"] >= REAL_DELAY_S * 1e3
    # The client's clock starts before the proxy holds the request, the engine's after: the means
    # of the same requests differ by the delay at least, at the first token and at the last.
    assert excess_ms(result, "ttft_ms") >= REAL_DELAY_S * 1e3 and excess_ms(result, "e2e_ms") >= REAL_DELAY_S * 1e3


@pytest.mark.real_vllm
def test_a_delay_on_the_inference_routes_of_a_real_vllm_spares_the_trivial_request(cached, capsys):
    result = bench_through(cached.url, Behaviour(delay_s=REAL_DELAY_S, delayed_prefix="/v1/"), capsys)
    assert excess_ms(result, "ttft_ms") >= REAL_DELAY_S * 1e3
    # /health is not delayed: delayed, no round trip of it could be shorter than the delay.
    assert result["server"]["probe"]["p50_ms"] < REAL_DELAY_S * 1e3, result["server"]["probe"]


@pytest.mark.real_vllm
def test_a_proxy_buffering_a_real_vllm_delivers_each_stream_in_one_read(cached, capsys):
    result = bench_through(cached.url, Behaviour(buffer=True), capsys)
    assert result["requests"]["one_read"] == 6
    # The proxy sends nothing before the engine's last token: the client's first token comes after it.
    assert result["ttft_ms"]["mean"] > result["server"]["metrics"]["e2e_ms"]["mean"]
    assert "buffering" in causes(result)
