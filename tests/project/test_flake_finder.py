"""The flake finder names each test by the node id that reruns it (tools/flake_finder.py)."""
from __future__ import annotations

from pathlib import Path

import flake_finder
import pytest


@pytest.mark.parametrize("classname, name, expected", [
    ("tests.core.test_stats", "test_percentile", "tests/core/test_stats.py::test_percentile"),
    ("tests.server.test_fleet.TestRealFleet", "test_load_on_one_replica_is_named_as_imbalance@tests/server/test_fleet.py",
     "tests/server/test_fleet.py::TestRealFleet::test_load_on_one_replica_is_named_as_imbalance"),
    ("tests.doctor.test_doctor_live", "test_a_fixed_delay@vllm-session-server",
     "tests/doctor/test_doctor_live.py::test_a_fixed_delay"),
    ("tests.load.test_bench_apis", "test_pooling[embeddings-0]@tests/load/test_bench_apis.py",
     "tests/load/test_bench_apis.py::test_pooling[embeddings-0]"),
    ("tests.core.test_stats", "test_url[user@host]", "tests/core/test_stats.py::test_url[user@host]"),
    ("tests.gone.test_moved.TestX", "test_y", "tests/gone/test_moved/TestX.py::test_y"),
])
def test_a_junit_case_is_named_by_its_node_id(classname: str, name: str, expected: str):
    assert flake_finder.node_id(classname, name) == expected


def test_a_round_reads_failures_errors_and_skips_by_node_id(tmp_path: Path):
    report = tmp_path / "round.xml"
    report.write_text("""<testsuites><testsuite>
      <testcase classname="tests.server.test_fleet.TestRealFleet" name="test_a@tests/server/test_fleet.py" time="81.5">
        <failure message="AssertionError: assert 3 == 2&#10;more">trace</failure></testcase>
      <testcase classname="tests.core.test_stats" name="test_b" time="0.2"><error message="">boom</error></testcase>
      <testcase classname="tests.core.test_stats" name="test_c" time="0.1"><skipped message="no engine"/></testcase>
      <testcase classname="tests.core.test_stats" name="test_d" time="1.0"/>
    </testsuite></testsuites>""")
    tests, failed, skipped, durations = flake_finder.read_junit(report)
    assert tests == 4
    assert failed == {"tests/server/test_fleet.py::TestRealFleet::test_a": "AssertionError: assert 3 == 2",
                      "tests/core/test_stats.py::test_b": "error"}
    assert skipped == ["tests/core/test_stats.py::test_c"]
    assert durations["tests/server/test_fleet.py::TestRealFleet::test_a"] == 81.5


@pytest.mark.parametrize("exit_code, said, not_said", [
    (0, "No test failed in any round.", "did not run"),
    (5, "Round 1 did not run its tests to the end: pytest exit 5 (no test selected)", "No test failed"),
    (4, "Round 1 did not run its tests to the end: pytest exit 4 (usage error)", "No test failed"),
])
def test_a_round_that_did_not_run_its_tests_is_not_called_clean(exit_code: int, said: str, not_said: str):
    text = flake_finder.human_text(flake_finder.summary([flake_finder.Round(seconds=16.0, exit_code=exit_code)]))
    assert said in text and not_said not in text, text


def test_an_interrupted_round_is_said_and_not_called_clean():
    text = flake_finder.human_text(flake_finder.summary([], interrupted=True))
    assert "Interrupted during round 1: only the rounds above finished." in text and "No test failed" not in text, text
