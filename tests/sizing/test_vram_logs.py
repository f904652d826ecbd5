"""The GPU startup-log fixture behind benchmarks/vram_accuracy.py: every case cited, complete and
evaluable; the benchmark's bookkeeping (split, held back, sources) adds up; and the accuracy on the
fixed logs holds, per split, so a change to the memory model (rooflib/sizing/) that loses accuracy fails here.

In-sample logs must meet the goal (90% within 5% of the logged KV tokens). The held-out logs meet
the share (30 of 33) but not the bound on the worst error (one 0.49 GiB pool, -15.8%; see the
fixture's held-out notes); their floor is today's count, so the held-out figure can only move up.
Both splits must have the logged value inside the printed range in 9 of 10 logs."""
from __future__ import annotations

import importlib.util
from functools import cache

import pytest
import yaml

from vllm_server import REPO

FIXTURE = REPO / "tests" / "fixtures" / "vllm_startup_logs.yaml"
CASES = yaml.safe_load(FIXTURE.read_text())["cases"]
REQUIRED = ("id", "source", "vllm_version", "model", "tp", "gpu_util", "max_model_len", "kv_dtype",
            "logged_kv_tokens", "log")
# Held-out logs within 5% when the held-out split was last extended, and the worst held-out error
# then (the goal's bound is 15%); tighten them when the figures improve.
HELD_OUT_WITHIN_FLOOR = 30
HELD_OUT_WORST_CEILING = 0.16


@cache
def load_benchmark():
    spec = importlib.util.spec_from_file_location("vram_accuracy", REPO / "benchmarks" / "vram_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_case_ids_are_unique():
    ids = [case["id"] for case in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_case_is_cited_complete_and_evaluates(case):
    missing = [key for key in REQUIRED if key not in case]
    assert not missing, f"{case['id']} lacks {missing}"
    assert case["source"].startswith("https://") and case["log"].strip()
    assert ("gpu" in case) != ("gpu_gib" in case), "one of gpu (catalog) or gpu_gib (logged total)"
    assert isinstance(case["logged_kv_tokens"], int) and case["logged_kv_tokens"] >= 0
    row = load_benchmark().evaluate(case)
    assert isinstance(row["predicted_kv_tokens"], int) and row["predicted_kv_tokens"] >= 0


@pytest.mark.parametrize("source, name", [
    ("https://github.com/vllm-project/vllm/issues/10517 (comment by x, 2024-12-02)", "vllm-project/vllm#10517"),
    ("https://github.com/vllm-project/vllm/pull/2031 (description)", "vllm-project/vllm#2031"),
    ('"https://github.com/dennislee22/vLLM-benchmarking/blob/391660d/log/a.log (README Test 4)"',
     "dennislee22/vLLM-benchmarking"),
    ("https://huggingface.co/learn/cookbook/en/page (notebook ...)", "huggingface.co/learn/cookbook/en/page"),
])
def test_cases_are_grouped_by_thread_or_repository(source, name):
    assert load_benchmark().source_of({"source": source}) == name


@cache
def report() -> dict:
    return load_benchmark().summarize(load_benchmark().load_cases(FIXTURE))


def test_summary_counts_every_case_once():
    summary, rows = report()["summary"], report()["cases"]
    assert len(rows) == len(CASES) == summary["cases"]
    for name in ("in_sample", "held_out"):
        part = [row for row in rows if row["split"] == name]
        counted = [row for row in part if not row["held_back"]]
        assert summary[name]["cases"] == len(part) and summary[name]["counted"] == len(counted)
        assert summary[name]["within"] == sum(row["ok"] for row in counted)


def test_the_evidence_is_broad():
    """At least 100 cited logs from 30 independent sources, held-out ones from sources of their own."""
    rows = report()["cases"]
    assert len(rows) >= 100 and report()["summary"]["sources"] >= 30
    in_sample = {row["source_name"] for row in rows if row["split"] == "in_sample"}
    held_out = {row["source_name"] for row in rows if row["split"] == "held_out"}
    assert held_out and not in_sample & held_out


def test_in_sample_logs_meet_the_accuracy_goal():
    part = report()["summary"]["in_sample"]
    assert part["share"] >= 0.90, f"{part['within']}/{part['counted']} in-sample logs within 5%"


def test_held_out_accuracy_does_not_fall():
    part = report()["summary"]["held_out"]
    assert part["within"] >= HELD_OUT_WITHIN_FLOOR, f"{part['within']}/{part['counted']} held-out logs within 5%"
    assert part["share"] >= 0.90, f"{part['within']}/{part['counted']} held-out logs within 5%"
    assert part["worst_abs_error"] <= HELD_OUT_WORST_CEILING, part["worst_abs_error"]
    assert part["goals_missed"] == ([] if part["worst_abs_error"] <= 0.15 else
                                    [f"worst |error| {part['worst_abs_error']:.1%} > 15%"])


def test_the_printed_range_holds_nine_logged_values_in_ten():
    """kv_cache_tokens_low..high, from the stated spread of each non-KV term, brackets what vLLM
    logged in at least 9 of 10 counted logs of each split."""
    for name in ("in_sample", "held_out"):
        part = report()["summary"][name]
        assert part["in_range"] >= 0.90 * part["counted"], (name, part["in_range"], part["counted"])


def test_a_missed_goal_is_named_with_its_figure():
    summary = {"counted": 10, "within": 8, "share": 0.8, "in_range": 7, "worst_abs_error": 0.2}
    assert load_benchmark().goals_missed("held_out", summary) == [
        "80% within 5% < 90%", "70% inside the range < 90%", "worst |error| 20.0% > 15%"]
    rows = [{"id": "x", "split": "held_out", "logged_kv_tokens": 1, "predicted_kv_tokens": 1, "error": 0.0,
             "predicted_kv_tokens_low": 1, "predicted_kv_tokens_high": 1, "logged_kv_gib": None, "held_back": None,
             "predicted_kv_gib": 1.0, "logged_weights_gib": None, "predicted_weights_gib": 1.0,
             "predicted_other_gib": 1.0, "ok": True}]
    part = {**summary, "cases": 10, "held_back": 0, "mean_abs_error": 0.1, "sources": 1, "largest_source": ("s", 10),
            "goals_missed": load_benchmark().goals_missed("held_out", summary)}
    text = load_benchmark().render(rows, {"cases": 10, "sources": 1, "in_sample": {"counted": 0}, "held_out": part})
    assert "range coverage 7/10 (70%, target 90%)" in text
    assert "GOAL MISSED: 80% within 5% < 90%  GOAL MISSED: 70% inside the range < 90%" in text


def test_a_case_whose_logged_gib_contradicts_its_tokens_is_held_back():
    """vllm#13061 logs 8.69 GiB but tokens that fit in less: the budget came from another rank."""
    case = next(case for case in CASES if case["id"] == "vllm-13061-r1-distill-qwen-14b-2x4090")
    assert "held_back" not in case
    assert "not the logged 81,536" in load_benchmark().evaluate(case)["held_back"]
