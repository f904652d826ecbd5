"""A fleet of one vLLM and one SGLang replica (both live CPU engines) scraped by one REAL Prometheus
(jobs vllm and sglang, the latter as the shipped prometheus.yml scrapes it): metrics --prometheus
reads one engine at a time and says so in one line when asked about both; with --match each
engine's replica is read, and the SGLang one's PromQL figures (its per-stage prefill series
included) agree with two direct scrapes of its /metrics.
"""
from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import yaml
from prometheus_server import running_prometheus
from test_fleet import (LEAD_S, SCRAPE_S, SHIPPED, Measured, _unavailable, ask, evaluated_at, instance,
                        scraped_since, settled_scrapes)
from test_metrics import send_load
from vllm_server import ServerUnavailable

from rooflib.server import engine_metrics, metric_sources, snapshots

pytestmark = [pytest.mark.real_vllm, pytest.mark.real_sglang, pytest.mark.external]
SGLANG_SCRAPE_S = 5


@pytest.fixture(scope="module")
def mixed(vllm_factory, sglang_factory, tmp_path_factory):
    """The cpu-tiny vLLM (job vllm), the cpu-tiny-sglang SGLang (job sglang) and a Prometheus."""
    with ExitStack() as stack:
        vllm = stack.enter_context(vllm_factory())
        sglang = stack.enter_context(sglang_factory())
        # SGLang creates a labelled series at its first observation, vLLM at 0 on start: without a
        # request first, increase() has no sample before the load's and counts none of it.
        send_load(sglang.url, sglang.model, 1, 1, 16, 2, seed=30)
        # The shipped job (its relabelling gives SGLang's OpenMetrics names back their colon), slower:
        # on a busy machine SGLang's page may take over the 1 s the vLLM job allows.
        shipped = next(job for job in yaml.safe_load((SHIPPED / "prometheus.yml").read_text())["scrape_configs"]
                       if job["job_name"] == "sglang")
        sglang_job = {**shipped, "scrape_interval": f"{SGLANG_SCRAPE_S}s", "scrape_timeout": f"{SGLANG_SCRAPE_S}s",
                      "static_configs": [{"targets": [instance(sglang.url)]}]}
        try:
            prom = stack.enter_context(running_prometheus(tmp_path_factory.mktemp("prometheus"), [instance(vllm.url)],
                                                          SCRAPE_S, more_jobs=[sglang_job]))
        except ServerUnavailable as exc:
            _unavailable(str(exc))
        scraped_since(prom, [instance(vllm.url)], time.time(), "vllm")
        scraped_since(prom, [instance(sglang.url)], time.time(), "sglang")
        yield {"vllm": vllm, "sglang": sglang, "prometheus": prom}


def measured_one(prom, server, job: str, load) -> Measured:
    """test_fleet.measured for one replica of `job`: `load()` between two direct scrapes, with flat
    Prometheus scrapes around it."""
    name = instance(server.url)
    start = time.time()
    before = snapshots.snapshot(*_scrape(server.url))
    first = scraped_since(prom, [name], start + LEAD_S, job)
    load()
    loaded = time.time()
    after = snapshots.snapshot(*_scrape(server.url))
    time.sleep(max(0.0, start + 4 * SGLANG_SCRAPE_S - time.time()))
    last, at = settled_scrapes(prom, [name], loaded, job)
    delta = snapshots.difference(before, after)
    direct = {name: {**engine_metrics.report(delta), "histograms": delta["histograms"]}}
    return Measured(direct, start, first, last, at)


def _scrape(url: str) -> tuple[str, str, float]:
    text, at = metric_sources.scrape(url)
    return text, url, at


def test_both_engines_at_once_is_one_line_asking_for_a_match(mixed, monkeypatch, capsys):
    code, _, err = ask(mixed["prometheus"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Prometheus holds both vLLM and SGLang series: select one with --match" in err


def test_the_sglang_replica_through_prometheus_agrees_with_its_own_metrics(mixed, monkeypatch, capsys):
    sglang = mixed["sglang"]
    m = measured_one(mixed["prometheus"], sglang, "sglang",
                     lambda: send_load(sglang.url, sglang.model, 3, 3, 64, 4, seed=31))
    evaluated_at(monkeypatch, m.at)
    seconds = round(m.at - m.start - SCRAPE_S)
    code, report, err = ask(mixed["prometheus"], monkeypatch, capsys, "--match", 'job="sglang"', "--window", str(seconds))
    assert code == 0, err
    assert report["engine"] == "sglang"
    [replica] = report["replicas"]
    assert (replica["instance"], replica["state"]) == (instance(sglang.url), "up")
    assert replica["prefill_ms"]["metric"] == 'sglang:per_stage_req_latency_seconds{stage="prefill_forward"}'
    # increase() extrapolates each count to the window's edges (test_fleet.assert_agrees): with
    # SGLang's 5 s scrapes a count lies between the exact one and twice it. A mean is the ratio of
    # two such counts, stretched alike except where Prometheus stops a series' backward
    # extrapolation at zero, which it does per series: SGLang's series start at their first
    # observation, so a sum and its count can be stretched differently. Measured on a busy machine:
    # e2e 2,366 ms against the engine's 2,634 ms (10%); the margin is twice that.
    direct = m.direct[instance(sglang.url)]
    assert 3 <= replica["requests"] <= 6 and 3 <= replica["prefill_ms"]["n"] <= 6
    for row in ("e2e_ms", "ttft_ms", "queue_ms", "prefill_ms"):
        assert replica[row]["mean"] == pytest.approx(direct[row]["mean"], rel=0.2), row


def test_the_vllm_replica_is_read_on_its_own(mixed, monkeypatch, capsys):
    code, report, err = ask(mixed["prometheus"], monkeypatch, capsys, "--match", 'job="vllm"', "--window", "30")
    assert code == 0, err
    assert report["engine"] == "vllm" and [r["instance"] for r in report["replicas"]] == [instance(mixed["vllm"].url)]
