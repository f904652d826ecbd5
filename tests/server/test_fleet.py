"""metrics.py --prometheus (rooflib/server/fleet.py) against a REAL Prometheus, behind a path prefix and
basic auth, scraping two REAL CPU vLLM replicas: each test induces one fleet picture, the finding
must name it and the replica, and the PromQL figures of each replica must agree with reading its
/metrics directly. Then bad input, the shipped scrape config and rules (promtool), and SGLang's
label set of a TP-2 deployment through a fake Prometheus API (a live SGLang replica beside a vLLM
one is in test_fleet_mixed.py).
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import metrics
import pytest
from markdown_doc import SKILLS
from prometheus_server import running_prometheus
from test_metrics import QUEUEING_PROMPTS, send_load
from vllm_server import ServerUnavailable

from rooflib.server import (
    engine_metrics,
    known_settings,
    media,
    metric_names,
    metric_sources,
    quantiles,
    snapshots,
)
from rooflib.server import fleet as fleet_findings
from rooflib.serving import profiles

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SCRAPE_S = 1
LEAD_S = 4 * SCRAPE_S  # flat time before each load, in which the PromQL window opens (window_of)
SHIPPED = SKILLS / "roofline-perf" / "references" / "prometheus"
# Different KV-cache sizes on purpose: the configuration finding must name them.
KV_BYTES = {"a": 33554432, "b": 16777216}


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"real fleet unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"real fleet unavailable: {reason}")


def instance(url: str) -> str:
    return url.removeprefix("http://")


@pytest.fixture(scope="module")
def fleet(vllm_factory, tmp_path_factory):
    """Replicas a and b (max_num_seqs=2, prefix caching, different KV sizes) and a Prometheus."""
    stacks = {name: ExitStack() for name in KV_BYTES}

    def start(name: str):
        sets = ["max_num_seqs=2", "enable_prefix_caching=true", "env={}", f"kv_cache_memory_bytes={KV_BYTES[name]}"]
        return stacks[name].enter_context(vllm_factory(sets=sets))

    try:
        with ThreadPoolExecutor(2) as pool:
            servers = dict(zip(KV_BYTES, pool.map(start, KV_BYTES)))
        # One request each before Prometheus starts: vLLM's API server makes its per-route counter
        # (http_requests_total{handler="/v1/completions"}) at a route's first request, and increase()
        # over a window in which a series was born misses its first count. A replica first loaded
        # inside a test's window (b, in the second test) then read no route through Prometheus while
        # a direct scrape read 12 (the flake finder's round 2). A server in service has its series.
        for server in servers.values():
            send_load(server.url, server.model, 1, 1, 16, 2)
        with running_prometheus(tmp_path_factory.mktemp("prometheus"),
                                [instance(s.url) for s in servers.values()], SCRAPE_S) as prom:
            scraped_since(prom, [instance(s.url) for s in servers.values()], time.time())
            yield {"servers": servers, "prometheus": prom, "stacks": stacks}
    except ServerUnavailable as exc:
        _unavailable(str(exc))
    finally:
        for stack in stacks.values():
            stack.close()


def ask(prom, monkeypatch, capsys, *argv: str, url: str | None = None, password: str | None = None):
    """metrics.main --prometheus ... --json: (exit code, JSON or None, stderr)."""
    monkeypatch.setenv("PROMETHEUS_USER", prom.user)
    monkeypatch.setenv("PROMETHEUS_PASSWORD", password or prom.password)
    code = metrics.main(["--prometheus", url or prom.url, "--json", *argv])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


@dataclass
class Measured:
    """A load seen two ways: each replica's window report (and its bucket increases,
    `histograms`) from two direct scrapes of its /metrics, and the times a PromQL window needs."""
    direct: dict[str, dict]
    start: float              # unix time: the counters are flat from before it until the load
    first: dict[str, float]   # per instance: a successful scrape between start + LEAD_S and the load
    last: dict[str, float]    # per instance: a successful scrape after the load
    at: float                 # unix time: the instant to ask Prometheus about, each replica up (settled)


def measured(fleet, load) -> Measured:
    """`load()` between two direct scrapes of each live replica, and the flat Prometheus scrapes
    around it."""
    urls = fleet.get("live") or [s.url for s in fleet["servers"].values()]
    instances = [instance(url) for url in urls]
    start = time.time()  # the previous load's final values were scraped before it returned
    before = {url: snapshots.snapshot(*_scrape(url)) for url in urls}
    # A busy machine may fail scrapes (up == 0): a successful one LEAD_S after `start` is waited
    # for, so a window opening anywhere in between holds a flat sample before the load.
    first = scraped_since(fleet["prometheus"], instances, start + LEAD_S)
    load()
    loaded = time.time()
    after = {url: snapshots.snapshot(*_scrape(url)) for url in urls}
    # A window of 20 intervals keeps increase()'s extrapolation small (see assert_agrees).
    time.sleep(max(0.0, start + 20 * SCRAPE_S - time.time()))
    last, at = settled_scrapes(fleet["prometheus"], instances, loaded)  # the final values
    direct = {}
    for url in urls:
        delta = snapshots.difference(before[url], after[url])
        direct[instance(url)] = {**engine_metrics.report(delta), "histograms": delta["histograms"]}
    return Measured(direct, start, first, last, at)


def window_of(m: Measured) -> int:
    """The --window (whole seconds, as PromQL takes it) that ends at m.at and opens SCRAPE_S after
    `start`, give or take half a second of rounding: inside the flat lead."""
    return round(m.at - m.start - SCRAPE_S)


REAL_PROMETHEUS_INIT = fleet_findings.Prometheus.__init__


def evaluated_at(monkeypatch, at: float) -> None:
    """Every PromQL query of the metrics runs that follow in this test is evaluated at `at` (unix
    time), not at the moment metrics reads its clock: by then a newer scrape may have come, and a
    busy replica that missed the 1 s scrape timeout (up == 0) would read as down."""
    def pinned(self, *args, **kwargs):
        REAL_PROMETHEUS_INIT(self, *args, **kwargs)
        self.at = at
    monkeypatch.setattr(fleet_findings.Prometheus, "__init__", pinned)


def ask_over(fleet, m: Measured, monkeypatch, capsys) -> tuple[dict, int]:
    """metrics --prometheus --json over the window of `m`, evaluated at m.at: (the report, its --window)."""
    evaluated_at(monkeypatch, m.at)
    seconds = window_of(m)
    code, report, err = ask(fleet["prometheus"], monkeypatch, capsys, "--window", str(seconds))
    assert code == 0, err
    return report, seconds


def queued_load(fleet, monkeypatch, capsys, servers: list, seed: int) -> tuple[Measured, dict, int]:
    """`measured` around 12 requests at once to each of `servers` (max_num_seqs 2), and the
    Prometheus report of that window (and its --window), repeated with longer prompts until each
    of them queued. The load is prefill-heavy (test_metrics.QUEUEING_PROMPTS says why): with long
    outputs a starved API server, not the engine, held requests back, and the engine's queue
    stayed nearly empty (12 x 64-token prompts drained with no queue on a loaded 2-core machine)."""
    for prompt_tokens in QUEUEING_PROMPTS:
        def load() -> None:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda s: send_load(s.url, s.model, 12, 12, prompt_tokens, 16, seed=seed), servers))
        m = measured(fleet, load)
        report, seconds = ask_over(fleet, m, monkeypatch, capsys)
        replicas = by_instance(report)
        if all(fleet_findings.queued(replicas[instance(s.url)], known_settings.QUEUE_SHARE) for s in servers):
            break
    return m, report, seconds


def scraped_since(prom, instances: list[str], since: float, job: str = "vllm") -> dict[str, float]:
    """Wait (60 s at most past `since`) until the latest scrape of each instance began after
    `since` (unix time) and succeeded: on a busy machine a /metrics page may take longer than the
    scrape timeout (up == 0), and then the next scrape is waited for. Returns each one's time."""
    deadline = time.monotonic() + max(0.0, since - time.time()) + 60
    selector = f'{{job="{job}"}}' if job else ""
    while True:
        rows = prom.get("/api/v1/query", query=f"up{selector}[{5 * SCRAPE_S}s]").json()["data"]["result"]
        latest = {row["metric"]["instance"]: row["values"][-1] for row in rows}  # [time, value]
        waiting = [i for i in instances if i not in latest or latest[i][0] <= since or latest[i][1] != "1"]
        if not waiting:
            return {i: float(latest[i][0]) for i in instances}
        assert time.monotonic() < deadline, f"no fresh successful scrape of {waiting}: {latest}"
        time.sleep(0.2 * SCRAPE_S)


def settled_scrapes(prom, instances: list[str], since: float, job: str = "vllm") -> tuple[dict[str, float], float]:
    """scraped_since, and `at`, the latest of those scrapes: an instant at which each instance's
    latest scrape succeeded. A scrape that began before `at` lands up to the scrape timeout later
    (SCRAPE_S), and may have failed: `at` is confirmed once that time has passed, else the next
    scrapes are waited for."""
    while True:
        latest = scraped_since(prom, instances, since, job)
        at = max(latest.values())
        time.sleep(max(0.0, at + 2 * SCRAPE_S - time.time()))
        selector = f'{{job="{job}"}}' if job else ""
        rows = prom.get("/api/v1/query", query=f"up{selector}", time=f"{at:.3f}").json()["data"]["result"]
        up = {row["metric"]["instance"]: row["value"][1] for row in rows}
        if all(up.get(i) == "1" for i in instances):
            return latest, at
        since = at


def _scrape(url: str) -> tuple[str, str, float]:
    text, at = metric_sources.scrape(url)
    return text, url, at


def by_instance(report: dict) -> dict[str, dict]:
    return {r["instance"]: r for r in report["replicas"]}


def assert_agrees(from_prometheus: dict, m: Measured, name: str) -> None:
    """PromQL over the window against the difference of two direct scrapes of replica `name`.

    increase() and rate() take the difference between the first and the last sample in the range
    and extrapolate it towards the range's edges ("The increase is extrapolated to cover the full
    time range as specified in the range vector selector",
    https://prometheus.io/docs/prometheus/latest/querying/functions/#increase): never below that
    difference, never above range / (last - first sample) times it. The window holds the flat
    samples m.first and m.last around the load, so a count lies in [exact, exact x stretch], a
    ratio of two (a mean, a hit rate) within a factor of stretch, and a quantile moves only as far
    as stretch moves its rank."""
    direct = m.direct[name]
    stretch = from_prometheus["seconds"] / (m.last[name] - m.first[name])
    counted = [("requests", direct["requests"], from_prometheus["requests"]),
               ("prompt tokens", direct["prompt_tokens"], from_prometheus["prompt_tokens"]),
               ("generated tokens", direct["gen_tok_s"] * direct["seconds"],
                from_prometheus["gen_tok_s"] * from_prometheus["seconds"])]
    for what, expected, got in counted:
        assert expected * (1 - 1e-9) <= got <= expected * stretch * (1 + 1e-9), (what, expected, got, stretch)
    assert from_prometheus["endpoint"] == direct["endpoint"]  # the API server's requests by route
    for row in ("e2e_ms", "queue_ms", "ttft_ms"):
        if direct[row]["n"]:
            mean = direct[row]["mean"]
            assert mean / stretch * (1 - 1e-9) <= from_prometheus[row]["mean"] <= mean * stretch * (1 + 1e-9), row
            buckets = list(zip(*(direct["histograms"][row.removesuffix("_ms")][k] for k in ("le", "counts"))))
            low = quantiles.quantile_bucket(0.5 / stretch, buckets)[0] * 1000
            high = quantiles.quantile_bucket(min(1.0, 0.5 * stretch), buckets)[1] * 1000
            assert low * 0.999 <= from_prometheus[row]["p50"] <= high * 1.001, row
    if direct["prefix_cache_queries"]:
        assert from_prometheus["prefix_cache_hit_rate"] == pytest.approx(direct["prefix_cache_hit_rate"],
                                                                         rel=stretch - 1, abs=0.01)


def kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["diagnosis"]["findings"]]


def named(report: dict, kind: str) -> dict:
    found = [f for f in report["diagnosis"]["findings"] if f["kind"] == kind]
    assert found, (f"no {kind} finding in {kinds(report)}; replicas: "
                   f"{[(r['instance'], r['requests'], r['queue_ms'], r['waiting_peak']) for r in report['replicas']]}")
    return found[0]


@pytest.mark.real_vllm
@pytest.mark.external  # Prometheus, from tests/install_prometheus.sh
class TestRealFleet:
    """In order: imbalance, the whole fleet queueing, prefix hits split, bad input, a replica down."""

    def test_load_on_one_replica_is_named_as_imbalance(self, fleet, monkeypatch, capsys):
        a, b = fleet["servers"]["a"], fleet["servers"]["b"]
        m, r, seconds = queued_load(fleet, monkeypatch, capsys, [a], seed=11)
        finding = named(r, "imbalance")
        assert finding["replicas"] == [instance(a.url), instance(b.url)]
        assert finding["per_replica"][instance(b.url)]["requests"] == 0
        assert "add_replica" not in kinds(r)
        assert r["diagnosis"]["root_cause"] == r["diagnosis"]["findings"][0]
        config = named(r, "config_mismatch")
        assert {"kv_cache_memory_bytes", "num_gpu_blocks"} <= set(config["per_replica"][instance(a.url)])
        assert config["per_replica"][instance(b.url)]["kv_cache_memory_bytes"] == str(KV_BYTES["b"])
        replicas = by_instance(r)
        for name in m.direct:
            assert_agrees(replicas[name], m, name)
        assert r["fleet"] == {"prometheus": fleet["prometheus"].url, "window_s": float(seconds),
                              "replicas": 2, "up": 2, "down": []}

    def test_queue_on_every_replica_asks_for_one_more(self, fleet, monkeypatch, capsys):
        servers = list(fleet["servers"].values())
        m, r, _ = queued_load(fleet, monkeypatch, capsys, servers, seed=12)
        finding = named(r, "add_replica")
        assert sorted(finding["replicas"]) == sorted(instance(s.url) for s in servers)
        assert any(lever["text"].startswith("add one replica (2 to 3) and measure again")
                   for lever in r["diagnosis"]["plan"])
        assert "imbalance" not in kinds(r)
        replicas = by_instance(r)
        for name in m.direct:
            assert_agrees(replicas[name], m, name)

    def test_sessions_spread_over_replicas_split_prefix_hits(self, fleet, monkeypatch, capsys):
        servers = list(fleet["servers"].values())

        def sessions() -> None:
            # Four sessions of four turns sharing a 896-token prefix (7 cached blocks of 128),
            # turns alternating between the replicas: each replica computes every prefix once.
            for turn in range(4):
                for session in range(4):
                    server = servers[turn % 2]
                    send_load(server.url, server.model, 1, 1, 1000, 4, shared_prefix=896, seed=20 + session)

        m = measured(fleet, sessions)
        r, _ = ask_over(fleet, m, monkeypatch, capsys)
        finding = named(r, "prefix_split")
        assert sorted(finding["replicas"]) == sorted(instance(s.url) for s in servers)
        replicas = by_instance(r)
        for name, report in m.direct.items():
            assert report["prefix_cache_hit_rate"] > 0
            assert_agrees(replicas[name], m, name)

    def test_bad_input_fails_in_one_line_without_the_password(self, fleet, monkeypatch, capsys):
        prom = fleet["prometheus"]
        root = prom.url.removesuffix("/prom")
        cases = [
            (["--match", 'model_name=~"("'], {}, 2, "Prometheus rejected the query"),
            (["--match", 'job="nothing"'], {}, 4, "holds no vllm: or sglang: series"),
            ([], {"password": "wrong-password"}, 3, "HTTP 401"),
            ([], {"url": root}, 3, "path prefix"),
            ([], {"url": f"http://127.0.0.1:{profiles.free_port()}"}, 3, "cannot reach"),
        ]
        for argv, options, code, message in cases:
            got, _, err = ask(prom, monkeypatch, capsys, *argv, **options)
            assert got == code and message in err and len(err.strip().splitlines()) == 1, (argv, err)
            assert prom.password not in err and "wrong-password" not in err

    def test_stopped_replica_is_named_down(self, fleet, monkeypatch, capsys):
        a, b = fleet["servers"]["a"], fleet["servers"]["b"]
        fleet["stacks"]["b"].close()
        fleet["live"] = [a.url]
        m = measured(fleet, lambda: send_load(a.url, a.model, 4, 2, 64, 16, seed=13))
        r, _ = ask_over(fleet, m, monkeypatch, capsys)
        finding = named(r, "replica_down")
        assert finding["replicas"] == [instance(b.url)] and "up == 0" in finding["evidence"]
        assert r["fleet"]["down"] == [instance(b.url)] and r["fleet"]["up"] == 1
        assert_agrees(by_instance(r)[instance(a.url)], m, instance(a.url))


# --------------------------------------------------------------------------------------------
# What a real Prometheus cannot be made to do on demand: answer HTML; SGLang's label set.

def test_prometheus_answering_html_fails_in_one_line(capsys):
    class Login(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><html><body>Sign in</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Login)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = metrics.main(["--prometheus", f"http://127.0.0.1:{server.server_port}", "--json"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 4 and "HTML page" in err and len(err.strip().splitlines()) == 1


SGLANG_NAMES = ["sglang:time_to_first_token_seconds_bucket", "sglang:e2e_request_latency_seconds_bucket",
                "sglang:queue_time_seconds_bucket", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                "sglang:token_usage", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                "sglang:cached_tokens_total", "sglang:max_total_num_tokens", "sglang:context_len"]


def fake_sglang_prometheus(labels: dict[str, str], asked: list[str], up: dict[str, int] | None = None):
    """A Prometheus API holding two SGLang replicas (labels as SGLang 0.5 sets them, see
    tests/fixtures/metrics/sglang-0.5-tp2.txt): r1 queues and r2 idles; their KV sizes differ.
    `up` is what the targets' up series say (both 1 unless given)."""
    up = {"r1:30000": 1, "r2:30000": 1} if up is None else up
    per_instance = {"r1:30000": {"e2e": 40, "queue": 3.0, "waiting": 9, "tokens": 500000},
                    "r2:30000": {"e2e": 2, "queue": 0.0, "waiting": 0, "tokens": 250000}}

    def rows(value) -> list[dict]:
        return [{"metric": {**labels, "instance": name}, "value": [0, str(value(figures))]}
                for name, figures in per_instance.items()]

    def answer(request: httpx.Request) -> httpx.Response:
        query = request.url.params["query"]
        asked.append(query)
        if "max_total_num_tokens" in query and "last_over_time" in query:
            result = rows(lambda f: f["tokens"])
        elif query.startswith("count by (__name__)"):
            result = [{"metric": {"__name__": n}, "value": [0, "1"]} for n in SGLANG_NAMES]
        elif query.startswith("count by (job, instance"):
            result = rows(lambda f: 1)
        elif query.startswith("sum by (endpoint, instance)"):  # requests by route: r1 chats, r2 embeds
            result = [{"metric": {**labels, "endpoint": route, "instance": name}, "value": [0, str(n)]}
                      for name, route, n in (("r1:30000", "/v1/chat/completions", 40),
                                             ("r2:30000", "/v1/embeddings", 12), ("r2:30000", "/health", 7))]
        elif query.startswith("up{"):
            result = [{"metric": {"job": "sglang", "instance": n}, "value": [0, str(v)]} for n, v in up.items()]
        elif "by (instance)" in query or "le, instance" in query:
            if "e2e_request_latency_seconds_count" in query and "increase" in query and "/" not in query:
                result = rows(lambda f: f["e2e"])
            elif "queue_time_seconds_sum" in query:
                result = rows(lambda f: f["queue"])
            elif "e2e_request_latency_seconds_sum" in query:
                result = rows(lambda f: 4.0)
            elif "num_queue_reqs" in query:
                result = rows(lambda f: f["waiting"])
            else:
                result = rows(lambda f: 0)
        else:
            result = [{"metric": {}, "value": [0, "1"]}]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})

    return answer


def test_sglang_label_set_through_prometheus():
    asked: list[str] = []
    labels = {"job": "sglang", "model_name": "qwen", "engine_type": "unified", "tp_rank": "0"}
    snap = metric_sources.prometheus_snapshot("http://prom:9090/prometheus", 60,
                                       transport=httpx.MockTransport(fake_sglang_prometheus(labels, asked)))
    assert snap["engine"] == "sglang" and [r["fleet"]["instance"] for r in snap["replicas"]] == ["r1:30000", "r2:30000"]
    assert snap["replicas"][1]["fleet"]["config"]["sglang:max_total_num_tokens"] == "250000"
    ranks = '{tp_rank=~"0|", attn_tp_rank=~"0|"}'  # TP ranks repeat the scheduler's series: rank 0 only
    assert f'histogram_quantile(0.95, sum by (le, instance) (rate(sglang:time_to_first_token_seconds_bucket{ranks}[60s])))' in asked
    assert f'sum by (instance) (sglang:num_queue_reqs{ranks})' in asked
    assert asked[0].startswith("count by (__name__)") and not any("vllm:" in q for q in asked[1:])
    reports = [{**engine_metrics.report(r), **r["fleet"]} for r in snap["replicas"]]
    found = metrics.fleet.findings(reports, known_settings.FLAGS["sglang"], known_settings.QUEUE_SHARE,
                                   known_settings.PREFIX_LONG_PROMPT)
    assert [f["kind"] for f in found] == ["config_mismatch", "imbalance"]
    assert found[1]["replicas"] == ["r1:30000", "r2:30000"]
    assert "--mem-fraction-static" in found[0]["evidence"]


def test_rates_divide_by_the_whole_seconds_of_the_range_asked_about():
    asked: list[str] = []
    transport = httpx.MockTransport(fake_sglang_prometheus({"job": "sglang", "model_name": "qwen"}, asked))
    snap = metric_sources.prometheus_snapshot("http://prom:9090", 59.6, transport=transport)
    ranges = {q[q.index("[") + 1:q.index("]")] for q in asked if "[" in q}
    assert ranges == {"60s"} and snap["seconds"] == 60.0
    assert engine_metrics.report(snap)["gen_tok_s"] == 1 / 60  # the fake answers 1 to a fleet-wide increase()


def test_lost_and_long_dead_targets_are_named_down():
    up = {"r1:30000": 1, "r3:30000": 0}  # r2 served in the window but is no longer a target
    transport = httpx.MockTransport(fake_sglang_prometheus({"job": "sglang", "model_name": "qwen"}, [], up))
    snap = metric_sources.prometheus_snapshot("http://prom:9090", 60, transport=transport)
    states = {r["fleet"]["instance"]: r["fleet"]["state"] for r in snap["replicas"]}
    assert states == {"r1:30000": "up", "r2:30000": "not_scraped", "r3:30000": "down"}
    reports = [{**engine_metrics.report(r), **r["fleet"]} for r in snap["replicas"]]
    found = metrics.fleet.findings(reports, known_settings.FLAGS["sglang"], known_settings.QUEUE_SHARE,
                                   known_settings.PREFIX_LONG_PROMPT)
    down = [f for f in found if f["kind"] == "replica_down"]
    assert [f["replicas"] for f in down] == [["r2:30000"], ["r3:30000"]]
    assert "no longer a scrape target" in down[0]["evidence"] and "up == 0" in down[1]["evidence"]


def test_credentials_in_the_url_are_refused_unprinted(capsys):
    code = metrics.main(["--prometheus", "http://ops:hunter2@prom:9090", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "PROMETHEUS_PASSWORD" in err and "hunter2" not in err


def test_series_without_model_name_fail_in_one_line(capsys, monkeypatch):
    asked: list[str] = []
    transport = httpx.MockTransport(fake_sglang_prometheus({"job": "sglang", "name": "/models/qwen"}, asked))
    real_client = httpx.Client
    monkeypatch.setattr(metrics.fleet.httpx, "Client", lambda **kw: real_client(**{**kw, "transport": transport}))
    code = metrics.main(["--prometheus", "http://prom:9090", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "no `model_name` label" in err and "`name`" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# The shipped scrape config and recording rules are valid for Prometheus' own checker.

@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        _unavailable("promtool is not installed: run sh tests/install_prometheus.sh")
    return found


@pytest.mark.external
@pytest.mark.parametrize("kind, name", [("config", "prometheus.yml"), ("rules", "vllm-rules.yml"),
                                        ("rules", "sglang-rules.yml")])
def test_shipped_prometheus_files_pass_promtool(promtool, kind, name):
    result = subprocess.run([promtool, "check", kind, str(SHIPPED / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shipped_rules_use_the_names_the_tool_reads():
    text = (SHIPPED / "vllm-rules.yml").read_text() + (SHIPPED / "sglang-rules.yml").read_text()
    for engine in ("vllm", "sglang"):
        for concept in ("ttft", "itl", "e2e"):
            assert metric_names.HISTOGRAMS[concept][engine][0] + "_bucket" in text
        assert metric_names.HISTOGRAMS["queue"][engine][0] + "_sum" in text
        assert metric_names.GAUGES["waiting"][0][engine][0] in text
    assert "sum by (le, instance, model_name)" in text


def test_russian_skill_links_the_same_prometheus_files():
    # One copy of the files, in the English skill; no link inside skills/ (Claude Code's plugin
    # validation does not follow one), so the Russian page points there.
    russian = (SKILLS / "roofline-perf-ru" / "references" / "prometheus.md").read_text(encoding="utf-8")
    for path in SHIPPED.iterdir():
        assert f"(../../roofline-perf/references/prometheus/{path.name})" in russian


def test_requests_by_route_come_through_prometheus_per_replica():
    """The API server's route counter (no model label) read by route and instance: the fleet's
    endpoint is chat, a replica that served only embeddings is said to be pooling traffic."""
    asked: list[str] = []
    transport = httpx.MockTransport(fake_sglang_prometheus({"job": "sglang", "model_name": "qwen"}, asked))
    snap = metric_sources.prometheus_snapshot("http://prom:9090", 60, match='job="sglang"', transport=transport)
    assert any(q.startswith('sum by (endpoint, instance) (increase(sglang:http_requests_total{job="sglang", endpoint=~"')
               for q in asked), asked
    assert (snap["counters"]["chat_requests"]["value"], snap["counters"]["embeddings_requests"]["value"]) == (40, 12)
    assert "health_requests" not in snap["counters"]
    by_replica = {r["fleet"]["instance"]: r["counters"] for r in snap["replicas"]}
    assert by_replica["r1:30000"]["chat_requests"]["value"] == 40 and "embeddings_requests" not in by_replica["r1:30000"]
    assert engine_metrics.report(snap)["endpoint"] == "chat"
    assert media.pooling_traffic(by_replica["r2:30000"]).requests == {"embeddings": 12}
