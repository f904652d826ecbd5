"""smoke_toolcall.py: the schema validator, stream merging, every check against a fake vLLM that
calls tools correctly (and breaks on request), and the real CPU vLLM's random-weight model."""
from __future__ import annotations

import json

import pytest
import smoke_toolcall as smoke
from fake_toolcall_server import fake_toolcall_server

from rooflib.core import catalogs
from rooflib.quality import toolcalls

CATALOG = catalogs.load_catalog("toolcall_cases")
EVENT = CATALOG["tools"]["create_event"]["parameters"]
GOOD_EVENT = {"title": "x", "start": "2025-03-14T15:00", "duration_minutes": 45, "attendees": ["a"],
              "location": {"name": "HQ", "lat": 1.5, "lon": -2}}


@pytest.mark.parametrize("change, error", [
    ({}, None),
    ({"duration_minutes": 45.0}, None),  # JSON Schema: 45.0 is an integer
    ({"duration_minutes": "45"}, "$.duration_minutes: expected integer, got string"),
    ({"duration_minutes": True}, "$.duration_minutes: expected integer, got boolean"),
    ({"duration_minutes": 0}, "violates minimum 1"),
    ({"attendees": "a, b"}, "$.attendees: expected array, got string"),
    ({"attendees": []}, "fewer than 1 items"),
    ({"start": "March 14"}, "does not match"),
    ({"priority": "urgent"}, "is not one of ['low', 'normal', 'high']"),
    ({"all_day": "false"}, "$.all_day: expected boolean"),
    ({"location": {"name": "HQ", "lat": "37.77", "lon": 1}}, "$.location.lat: expected number"),
    ({"location": {"name": "HQ", "lat": 1}}, "$.location: missing required 'lon'"),
    ({"colour": "red"}, "unexpected property 'colour'"),
])
def test_schema_errors_on_the_event_tool(change, error):
    errors = toolcalls.schema_errors({**GOOD_EVENT, **change}, EVENT)
    if error is None:
        assert errors == []
    else:
        assert any(error in e for e in errors), errors


def test_schema_errors_missing_required_and_combinators():
    assert toolcalls.schema_errors({}, EVENT)[:2] == ["$: missing required 'title'", "$: missing required 'start'"]
    either = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert toolcalls.schema_errors(None, either) == [] and toolcalls.schema_errors(3, either) == ["$: matches none of anyOf"]
    assert toolcalls.schema_errors(None, {"type": ["string", "null"]}) == []


@pytest.mark.parametrize("actual, expected, same", [
    ("dallas", "Dallas", True),
    ("San Francisco", "san-francisco", True),
    ("Dallas, TX", "Dallas", False),
    ('Q3 "budget" review — ünïcödé', 'Q3 "budget" review — ünïcödé', True),
    ("Q3 budget review - unicode", 'Q3 "budget" review — ünïcödé', False),
    (45, 45, True), ("45", 45, False), (False, False, True), (0, False, False),
    (["a@x", "b@x"], ["a@x", "b@x"], True), ("a@x, b@x", ["a@x", "b@x"], False),
    ({"name": "HQ", "lat": 37.77}, {"name": "hq", "lat": 37.77}, True),
])
def test_value_matches_bfcl_style(actual, expected, same):
    assert toolcalls.value_matches(actual, expected) is same


def test_merge_stream_keys_by_index_and_accepts_batched_deltas():
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        # Two calls started in one chunk (other servers batch; vLLM sends one per chunk).
        {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x": '}},
            {"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"total_tokens": 3}},
    ]
    answer = toolcalls.merge_stream(chunks)
    assert answer.tool_calls == [{"id": "a", "name": "f", "arguments": '{"x": 1}'},
                                 {"id": "b", "name": "g", "arguments": "{}"}]
    assert answer.finish_reasons == ["tool_calls"] and answer.stream_problems == []


def test_merge_stream_reports_a_repeated_name():
    delta = {"tool_calls": [{"index": None, "function": {"name": "f", "arguments": "{}"}}]}
    answer = toolcalls.merge_stream([{"choices": [{"delta": delta}]}] * 2)
    assert answer.tool_calls[0]["arguments"] == "{}{}"
    assert answer.stream_problems == [toolcalls.Check("WARN", "call 0: the name was streamed 2 times")]


def run(capsys, url, *extra):
    code = smoke.main(["--url", url, "--json", *extra])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out else None), out.err


def test_a_correct_server_passes_every_case(capsys):
    with fake_toolcall_server() as url:
        code, report, _ = run(capsys, url, "--repeat", "2", "--long", "--long-words", "200")
    assert code == 0 and report["verdict"] == "PASS", report["reasons"]
    assert {c["case"]: c["status"] for c in report["cases"]} == {name: "PASS" for name in CATALOG["cases"]}
    assert all(c["passed"] == 2 for c in report["cases"])
    assert report["stats"]["trigger_f1"] == 1.0 and report["stats"]["schema_accuracy"] == 1.0


@pytest.mark.parametrize("fault, case, reason", [
    ("leak_markup", "single_auto", "plain: expected a call to get_current_weather, got no tool call (content: \"<tool_call>"),
    ("leak_markup", "irrelevance", None),
    ("string_integer", "complex_schema", "plain: create_event: arguments violate the schema: $.duration_minutes: expected integer, got string \"45\""),
    ("stream_diverges", "single_auto", "stream: get_current_weather: wrong values: city=\"Dallasville\", expected \"Dallas\""),
    ("stream_diverges", "parameterless", None),
    ("over_trigger", "irrelevance", "plain: expected no tool call, got 1 (web_search)"),
])
def test_each_fault_fails_its_case_with_the_reason(capsys, fault, case, reason):
    with fake_toolcall_server(fault) as url:
        code, report, _ = run(capsys, url, "--repeat", "1", "--cases", case)
    (result,) = report["cases"]
    if reason is None:  # the fault does not touch this case
        assert (code, result["status"]) == (0, "PASS")
    else:
        assert (code, result["status"], report["verdict"]) == (1, "FAIL", "FAIL")
        assert result["reason"].startswith(reason), result["reason"]


def test_stream_that_differs_from_the_plain_answer_is_named(capsys):
    with fake_toolcall_server("stream_diverges") as url:
        code, report, _ = run(capsys, url, "--repeat", "1", "--cases", "tool_choice_named")
    checks = [c["reason"] for c in report["cases"][0]["runs"][0]["checks"]]
    assert code == 1
    assert any(r.startswith("stream: merged calls [[\"get_current_weather\", {\"city\": \"Seattleville\"") for r in checks), checks


def test_server_without_tool_calling_is_a_configuration_error(capsys):
    with fake_toolcall_server("no_tool_parser") as url:
        code, report, err = run(capsys, url)
    assert code == 2 and report == {"error": err.removeprefix("error: ").rstrip("\n"), "exit_code": 2}
    assert err.count("\n") == 1
    assert err.startswith('error: the server does not have tool calling enabled (HTTP 400: "auto" tool choice requires '
                          "--enable-auto-tool-choice and --tool-call-parser to be set): restart the server")
    assert "--enable-auto-tool-choice --tool-call-parser <parser>" in err


def test_baseline_names_regressions_and_model_limitations(capsys, tmp_path):
    with fake_toolcall_server("over_trigger") as url:
        _, base, _ = run(capsys, url, "--repeat", "1")
    saved = tmp_path / "base.json"
    saved.write_text(json.dumps(base))
    with fake_toolcall_server("over_trigger", "string_integer") as url:
        code, report, _ = run(capsys, url, "--repeat", "1", "--baseline", str(saved))
        assert smoke.main(["--url", url, "--repeat", "1", "--baseline", str(saved)]) == 1
    human = capsys.readouterr().out
    assert code == 1
    assert report["baseline"] == {"file": str(saved), "regressions": ["complex_schema"],
                                  "model_limitations": ["irrelevance"]}
    assert "regressions against the baseline: complex_schema" in report["reasons"]
    assert f"against baseline {saved}: regressions: complex_schema; failing on both (model limitation): irrelevance" in human


@pytest.mark.parametrize("args, message", [
    (["--cases", "single_auto,nope"], "error: unknown case 'nope': known cases are single_auto, parallel"),
    (["--model", "other"], "error: model 'other' is not served by http://127.0.0.1"),
    (["--baseline", "/nonexistent/base.json"], "error: cannot read baseline /nonexistent/base.json"),
    (["--repeat", "0"], "error: --repeat and --max-tokens must be at least 1"),
])
def test_usage_errors_are_one_line_exit_2(capsys, args, message):
    with fake_toolcall_server() as url:
        code, _, err = run(capsys, url, *args)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1


def test_no_parallel_skips_the_parallel_case(capsys):
    with fake_toolcall_server() as url:
        code, report, _ = run(capsys, url, "--repeat", "1", "--cases", "parallel,single_auto", "--no-parallel")
    assert code == 0 and [c["status"] for c in report["cases"]] == ["SKIP", "PASS"]


def test_unreachable_server_is_exit_3(capsys):
    code, _, err = run(capsys, "http://127.0.0.1:9")
    assert code == 3 and err.startswith("error: cannot reach http://127.0.0.1:9/v1/models")


@pytest.mark.real_vllm
def test_random_weight_model_fails_with_specific_reasons(vllm_server, capsys):
    code, report, _ = run(capsys, vllm_server.url, "--repeat", "2", "--max-tokens", "48")
    results = {c["case"]: c for c in report["cases"]}
    assert code == 1 and report["verdict"] == "FAIL" and report["model"] == "tiny-qwen3"
    # Under auto the random model answers with nonsense text, never the due call.
    for case, tool in [("single_auto", "get_current_weather"), ("parallel", "get_current_weather"),
                       ("multiple_select", "web_search"), ("complex_schema", "create_event"),
                       ("parameterless", "get_server_time")]:
        assert results[case]["status"] == "FAIL"
        assert results[case]["reason"].startswith(f"plain: expected a call to {tool}, got no tool call (content: "), \
            results[case]["reason"]
    assert results["tool_result_followup"]["status"] == "FAIL"
    assert "expected '98' in the answer" in results["tool_result_followup"]["reason"]
    # Guided decoding (required / named) starts a call that max_tokens cuts off as invalid JSON.
    for case in ("tool_choice_required", "tool_choice_named"):
        assert results[case]["status"] == "FAIL" and results[case]["reason"], results[case]
    assert all(c["reason"] for c in report["cases"] if c["status"] == "FAIL")


def test_ctrl_c_reports_the_finished_cases(capsys, monkeypatch):
    real_run_repeat = toolcalls.run_repeat

    def interrupt_on_the_third_case(http, case, *args):
        if case["description"].startswith("choosing the right tool"):
            raise KeyboardInterrupt
        return real_run_repeat(http, case, *args)

    monkeypatch.setattr(toolcalls, "run_repeat", interrupt_on_the_third_case)
    with fake_toolcall_server() as url:
        code, report, _ = run(capsys, url, "--repeat", "1")
    assert code == 130 and report["interrupted"] and report["verdict"] == "FAIL"
    assert [c["case"] for c in report["cases"]] == ["single_auto", "parallel"]
    assert report["reasons"] == ["interrupted after 2 case(s): partial results"]
