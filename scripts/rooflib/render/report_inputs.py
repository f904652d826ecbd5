"""The report's inputs: a result file read and checked (its kind, told by its keys in older files,
and its schema version), bench's request records, and a result's workload and server: every
chart's caption names them, and two workloads never share a chart.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from rooflib.core import fileio
from rooflib.core.errors import UsageError
from rooflib.load import analysis

SCHEMA_VERSIONS = {"bench": 1, "sweep": 1, "accept": 1, "metrics": 1, "vram": 1, "roofline": 1, "compare": 1,
                   "tune": 1}
# Older files carry no "kind": each kind is known by keys no other result has.
KIND_KEYS = [("compare", ("metrics", "verdict", "a", "b")), ("accept", ("ppl_change", "base", "candidate")),
             ("sweep", ("points", "levels")), ("bench", ("ttft_ms", "throughput", "requests")),
             ("vram", ("kv_cache_gib", "levers")), ("roofline", ("table", "peak_tflops", "decode")),
             ("metrics", ("diagnosis", "mode"))]
MAX_INPUT_BYTES = 512 * 1024 * 1024


@dataclass
class Result:
    kind: str
    path: str
    doc: dict[str, Any]

    @property
    def label(self) -> str:
        return Path(self.path).stem


# ---------------------------------------------------------------- reading the inputs

def detect_kind(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return None
    if doc.get("kind"):
        return str(doc["kind"])
    return next((kind for kind, keys in KIND_KEYS if all(k in doc for k in keys)), None)


def parse_result(text: str, path: str) -> Result:
    """One result document; an empty file, another kind or schema version is a UsageError."""
    if not text.strip():
        raise UsageError(f"{path} is empty: pass a result file a task wrote with -- --json")
    try:
        doc = fileio.parse_json(text)
    except ValueError:
        raise UsageError(f"{path} is not JSON: pass a result file a task wrote with -- --json")
    kind = detect_kind(doc)
    if kind not in SCHEMA_VERSIONS:
        found = f"of kind {kind!r}" if kind else "not a result"
        raise UsageError(f"{path} is {found}: the report reads {', '.join(SCHEMA_VERSIONS)} results "
                         "(the --json output of those tasks)")
    version = doc.get("schema_version", 1)
    if version != SCHEMA_VERSIONS[kind]:
        raise UsageError(f"{path} is a {kind} result of schema version {version}; this report reads version "
                         f"{SCHEMA_VERSIONS[kind]}: render it with the toolbox that wrote it, or run the task again")
    return Result(kind, path, doc)


def parse_records(text: str, path: str) -> list[dict[str, Any]]:
    """bench --records: one JSON object per line, each with sent_ns."""
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = fileio.parse_json(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "sent_ns" not in record:
            raise UsageError(f"{path} line {number} is not a bench request record: pass bench's --records file")
        records.append(record)
    if not records:
        raise UsageError(f"{path} is empty: pass the file bench wrote with --records")
    return records


# ---------------------------------------------------------------- workloads and labels

def workload_of(result: Result) -> dict[str, Any] | None:
    """What was asked of the server, for results that measured latency under load."""
    doc = result.doc
    if result.kind in ("bench", "sweep"):
        cfg = doc.get("config") or {}
        return {k: cfg.get(k) for k in ("input_tokens", "output_tokens", "endpoint")}
    if result.kind == "compare":
        return doc.get("workload")
    return None


def describe_workload(workload: dict[str, Any] | None) -> str:
    if not workload:
        return "workload not recorded"
    if {"input_tokens", "output_tokens"} <= set(workload) and not analysis.generates(workload):
        return f"texts of {workload['input_tokens']} tokens, {workload['endpoint']}"  # embeddings, score
    if {"input_tokens", "output_tokens"} <= set(workload):
        text = f"{workload['input_tokens']} prompt / {workload['output_tokens']} output tokens"
        return text + (f", {workload['endpoint']}" if workload.get("endpoint") else "")
    return ", ".join(f"{k} {v}" for k, v in workload.items())


def same_workload(results: Sequence[Result], chart: str) -> dict[str, Any] | None:
    """The one workload of the results on a chart; different ones are a UsageError."""
    seen = [(r, workload_of(r)) for r in results]
    first = seen[0]
    for other in seen[1:]:
        if other[1] != first[1]:
            raise UsageError(f"{other[0].path} ({describe_workload(other[1])}) and {first[0].path} "
                             f"({describe_workload(first[1])}) are different workloads on one {chart} chart: "
                             "report them separately")
    return first[1]


def server_of(result: Result) -> str:
    doc = result.doc
    if result.kind == "bench":
        info = (doc.get("server") or {}).get("info") or {}
        cfg = doc.get("config") or {}
        version = info.get("engine_version")
        owner = info.get("owned_by")  # "vllm" or "sglang": /v1/models says which engine answered
        return f"{cfg.get('model') or info.get('model')} at {cfg.get('url')}" + (
            f" ({owner or 'engine'} {version})" if version else "")
    if result.kind == "sweep":
        cfg = doc.get("config") or {}
        return f"{cfg.get('model')} at {cfg.get('url')}"
    return "?"


def servers(results: Iterable[Result]) -> str:
    names = list(dict.fromkeys(server_of(r) for r in results))
    return "; ".join(names)
