"""The vLLM metric names the skills give are the ones a real vLLM 0.32 serves, and the names they call
removed are really gone."""
from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import httpx
import pytest

import setup_cpu_vllm
from markdown_doc import SKILLS, Doc

_NAME = re.compile(r"vllm:[a-z_]+")
# Names the docs give as earlier names, renamed or removed before vLLM 0.32.
REMOVED = {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total",
           "vllm:gpu_prefix_cache_hits_total", "vllm:time_per_output_token_seconds"}


def documented_names() -> set[str]:
    names = set()
    for path in (SKILLS / "roofline-perf").rglob("*.md"):
        doc = Doc.read(path)
        text = " ".join(doc.inline_code) + " ".join(content for _, content in doc.code_blocks)
        names |= set(_NAME.findall(text))
    return names


def test_docs_name_the_current_and_the_removed_metrics():
    names = documented_names()
    assert REMOVED <= names
    assert {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds",
            "vllm:request_time_per_output_token_seconds"} <= names


@lru_cache(maxsize=1)
def spec_decode_source() -> str:
    """vLLM 0.32's speculative-decoding metrics module, read from the installed engine. Found from
    the package's folder: finding the submodule imports vLLM and torch, which took over 120 s in a
    fresh-clone run beside two busy loops on a 2-core AMD EPYC."""
    result = subprocess.run([str(setup_cpu_vllm.venv_python()), "-c", "import importlib.util as u; "
                             "print(u.find_spec('vllm').origin)"],
                            capture_output=True, text=True, timeout=120, check=True)
    return (Path(result.stdout.strip()).parent / "v1" / "spec_decode" / "metrics.py").read_text()


@pytest.mark.real_vllm
def test_documented_vllm_metric_names_match_a_real_vllm_0_32(vllm_server):
    scrape = httpx.get(f"{vllm_server.url}/metrics", timeout=30).text
    served = set(re.findall(r"^(vllm:[a-z_]+)", scrape, re.M))
    served_families = served | {re.sub(r"_(bucket|sum|count|created)$", "", name) for name in served}
    for name in sorted(documented_names()):
        if name in REMOVED:
            assert name not in served_families, f"{name} is documented as removed but vLLM 0.32 serves it"
        elif "spec_decode" in name:  # only served with a speculative config: check the source
            assert f'"{name.removesuffix("_total")}"' in spec_decode_source(), name
        else:
            assert name in served_families, f"{name} is documented for vLLM 0.32 but not served"
