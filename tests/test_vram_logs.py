"""The GPU startup-log fixture behind benchmarks/vram_accuracy.py: every case cited, complete, and
evaluable; the benchmark's bookkeeping (held back, sources) adds up. The accuracy target itself is
the benchmark's to check (task bench:vram), not a unit test's."""
from __future__ import annotations

import importlib.util
import json
from functools import cache

import pytest
import yaml

from vllm_server import REPO

FIXTURE = REPO / "tests" / "fixtures" / "vllm_startup_logs.yaml"
CASES = yaml.safe_load(FIXTURE.read_text())["cases"]
REQUIRED = ("id", "source", "vllm_version", "model", "tp", "gpu_util", "max_model_len", "kv_dtype",
            "logged_kv_tokens", "log")


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


def test_summary_counts_every_case_once(capsys):
    bench = load_benchmark()
    code = bench.main(["--json"])
    report = json.loads(capsys.readouterr().out)
    summary = report["summary"]
    assert code in (0, 1) and len(report["cases"]) == len(CASES)
    assert summary["counted"] + summary["held_back"] == len(CASES)
    assert summary["within"] == sum(1 for row in report["cases"] if row["ok"] and not row["held_back"])
    assert sum(1 for row in report["cases"] if row["held_back"]) == summary["held_back"]


def test_a_case_whose_logged_gib_contradicts_its_tokens_is_held_back():
    """vllm#13061 logs 8.69 GiB but tokens that fit in less: the budget came from another rank."""
    case = next(case for case in CASES if case["id"] == "vllm-13061-r1-distill-qwen-14b-2x4090")
    assert "held_back" not in case
    assert "not the logged 81,536" in load_benchmark().evaluate(case)["held_back"]
