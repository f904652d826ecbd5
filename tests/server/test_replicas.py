"""One URL answered by several engines (a balancer): no window of it is read as one engine's; the
same URL given twice is one engine."""
from __future__ import annotations

from pathlib import Path

import metrics
import pytest

from rooflib.load import benchrun
from rooflib.server import engine_metrics, replicas, snapshots

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def snap(name: str, at: float) -> dict:
    return snapshots.snapshot((FIXTURES / name).read_text(), "http://balancer:8000", at)


@pytest.mark.parametrize("names, mixed", [
    # one engine over a window: its counters only grow
    (["vllm-0.32-before.txt", "vllm-0.32-before.txt", "vllm-0.32-after.txt"], False),
    # a restart: counters fall once and stay (a difference from the restart on is one engine's)
    (["vllm-0.32-after.txt", "vllm-0.32-idle.txt", "vllm-0.32-idle.txt"], False),
    # a balancer over a busy and an idle replica: they alternate
    (["vllm-0.32-after.txt", "vllm-0.32-idle.txt", "vllm-0.32-after.txt", "vllm-0.32-idle.txt"], True),
])
def test_scrapes_that_alternate_between_engines_are_mixed(names, mixed):
    reason = replicas.mixed_engines([snap(name, float(i)) for i, name in enumerate(names)])
    assert bool(reason) == mixed, reason


def test_a_mixed_window_has_that_as_its_one_finding_and_no_engine_lever():
    snaps = [snap(n, float(i)) for i, n in enumerate(["vllm-0.32-after.txt", "vllm-0.32-idle.txt",
                                                         "vllm-0.32-after.txt"])]
    delta = snapshots.difference(snaps[0], snaps[-1], snaps[1:-1])
    delta["mixed_engines"] = replicas.mixed_engines(snaps)
    r = replicas.unblended(delta, engine_metrics.report(delta))
    assert r["diagnosis"]["root_cause"]["kind"] == "mixed_engines" and len(r["diagnosis"]["findings"]) == 1
    assert [lever["setting"] for lever in r["diagnosis"]["plan"]] == [None]
    assert r["mixed_engines"] in r["warnings"]


@pytest.mark.parametrize("names, shown", [
    (["vllm-0.32-before.txt", "vllm-0.32-before.txt", "vllm-0.32-after.txt"], True),
    (["vllm-0.32-after.txt", "vllm-0.32-idle.txt", "vllm-0.32-after.txt", "vllm-0.32-idle.txt"], False),
])
def test_bench_shows_no_server_figure_from_scrapes_of_several_engines(names, shown):
    """bench's scrapes before, during (its timeline) and after the run: behind a balancer they
    came from different replicas, so it shows no server figure and says why."""
    snaps = [snap(name, float(i)) for i, name in enumerate(names)]
    delta, why = benchrun.server_delta(snaps[0], snaps[-1], snaps[1:-1])
    assert (delta is not None, why == "") == (shown, shown)
    assert shown or why.startswith("consecutive scrapes came from 2 engines") and "bench each replica's own URL" in why


def test_the_same_url_given_twice_is_one_engine(monkeypatch):
    """INFER_URL set for every task, and --url given too (the reported case counted two engines)."""
    monkeypatch.setenv("INFER_URL", "http://127.0.0.1:8000")
    args = metrics.build_parser().parse_args(["--url", "http://127.0.0.1:8000/", "--url", "http://127.0.0.1:8000/v1"])
    assert metrics.options(args).urls == ["http://127.0.0.1:8000"]
