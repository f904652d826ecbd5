"""Comparing two bench runs: bootstrap intervals of the change in each figure, and a verdict."""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import fileio, stats
from rooflib.core.errors import UsageError

SCHEMA_VERSION = 1
ROUNDS = 2000
EXACT_UP_TO = 1000  # requests per run resampled one by one; above, the order statistic
MAX_FILE_BYTES = 512 * 1024 ** 2
LATENCIES = ("ttft_ms", "tpot_ms", "e2e_ms", "ttft_answer_ms")
THROUGHPUT = ("output_tok_s", "req_s", "pairs_s")  # pairs_s: score runs only


def load(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path} does not exist: give two files written by bench.py --json or sweep.py --json")
    if file.stat().st_size > MAX_FILE_BYTES:
        raise UsageError(f"{path} is over {MAX_FILE_BYTES >> 20} MiB: not a bench result")
    try:
        doc = fileio.parse_json(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not JSON ({exc}): give the output of bench.py --json")
    if not isinstance(doc, dict) or doc.get("kind") not in ("bench", "sweep"):
        raise UsageError(f"{path} is not a bench or sweep result (no \"kind\": \"bench\"|\"sweep\"): "
                         "rerun bench.py --json > file")
    points = doc["points"] if doc["kind"] == "sweep" else [doc]
    if any("samples" not in p or "workload" not in p for p in points):
        raise UsageError(f"{path} has no per-request samples (written by an older bench.py): rerun it")
    return doc


def differences(a: dict[str, Any], b: dict[str, Any], variables: Sequence[str] = ()) -> list[str]:
    """What differs between two workload descriptions, as 'key: A vs B', but the variables under test."""
    return [f"{key}: {a.get(key)!r} vs {b.get(key)!r}" for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key) and key not in variables]


def variable_values(a: dict[str, Any], b: dict[str, Any], variables: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each variable under test with its value in A and B; a UsageError for a name that is no
    workload setting."""
    unknown = [name for name in variables if name not in a and name not in b]
    if unknown:
        raise UsageError(f"--variable {unknown[0]} is not a workload setting: use one of "
                         + ", ".join(sorted(set(a) | set(b))))
    return {name: {"a": a.get(name), "b": b.get(name)} for name in variables}


def statistic(values: Sequence[float], stat: str) -> float:
    return sum(values) / len(values) if stat == "mean" else stats.percentile(values, float(stat[1:]))


def requests_to_place(stat: str) -> int:
    """Requests a run needs to place the percentile `stat` ("p95"): one lies beyond it (20 for a
    p95, 100 for a p99); with fewer it is about the slowest request."""
    return math.ceil(100 / (100 - float(stat[1:])))


def resampled(values: list[float], stat: str, rng: random.Random) -> float:
    """The statistic of one bootstrap resample (values sorted)."""
    n = len(values)
    if n <= EXACT_UP_TO:
        return statistic(sorted(rng.choices(values, k=n)), stat)
    if stat == "mean":
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values[::max(1, n // 5000)]) / min(n, 5000))
        return rng.gauss(mean, sd / math.sqrt(n))
    # A resample's q-quantile sits at a rank whose spread is the binomial's: sqrt(n q (1 - q)).
    q = float(stat[1:]) / 100
    rank = min(max((n - 1) * q + rng.gauss(0, math.sqrt(n * q * (1 - q))), 0), n - 1)
    return stats.at_rank(values, rank)


def change(a: list[float], b: list[float], stat: str, rng: random.Random) -> tuple[float, list[float]]:
    """(change %, [low, high] 95% bootstrap interval of the change %) of B against A."""
    a, b = sorted(a), sorted(b)
    base = statistic(a, stat)
    point = 100.0 * (statistic(b, stat) - base) / base
    rounds = []
    for _ in range(ROUNDS):
        ra = resampled(a, stat, rng)
        if ra > 0:
            rounds.append(100.0 * (resampled(b, stat, rng) - ra) / ra)
    rounds.sort()
    return point, [stats.percentile(rounds, 2.5), stats.percentile(rounds, 97.5)]


def samples(doc: dict[str, Any], key: str) -> list[float]:
    """A run's measured values of the latency `key` (a request that never reached it has none)."""
    return [v for v in doc["samples"].get(key) or [] if v is not None]


def metric_row(name: str, sa: list[float], sb: list[float], stat: str, rng: random.Random) -> dict[str, Any]:
    """One latency row: the statistic in A and B, the change with its interval, and the verdict."""
    pct, ci = change(sa, sb, stat, rng)
    verdict = ("no significant difference" if ci[0] <= 0 <= ci[1]
               else "better" if ci[1] < 0 else "worse")  # lower latency is better
    return {"name": name, "a": statistic(sorted(sa), stat), "b": statistic(sorted(sb), stat), "change_pct": pct,
            "ci95_pct": ci, "verdict": verdict, "n": [len(sa), len(sb)]}


def metric_rows(a: dict[str, Any], b: dict[str, Any], prefix: str, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for key in LATENCIES:
        sa, sb = samples(a, key), samples(b, key)
        if len(sa) < 2 or len(sb) < 2:
            continue
        stat_names = ["p50", "p95"] + (["p99"] if min(len(sa), len(sb)) >= requests_to_place("p99") else [])
        rows += [metric_row(f"{prefix}{key}.{stat}", sa, sb, stat, rng)
                 for stat in stat_names if statistic(sorted(sa), stat) > 0]
    for key in THROUGHPUT:
        va, vb = a.get("throughput", a).get(key), b.get("throughput", b).get(key)  # sweep points: flat
        if va and vb is not None:
            rows.append({"name": f"{prefix}throughput.{key}", "a": va, "b": vb,
                         "change_pct": 100.0 * (vb - va) / va, "ci95_pct": None,
                         "verdict": "not tested (one figure per run)"})
    return rows


def overall(rows: Sequence[dict[str, Any]]) -> str:
    verdicts = {r["verdict"] for r in rows if r["ci95_pct"] is not None}
    if "better" in verdicts and "worse" in verdicts:
        return "mixed"
    if "better" in verdicts:
        return "better"
    if "worse" in verdicts:
        return "worse"
    return "no significant difference"


def label(doc: dict[str, Any], given: str) -> str:
    return given or f"{doc['config'].get('model')} @ {doc['config'].get('url')}"


def compare(a: dict[str, Any], b: dict[str, Any], files: tuple[str, str], labels: tuple[str, str],
            seed: int = 0, variables: Sequence[str] = ()) -> dict[str, Any]:
    """The comparison document (see the module docstring); UsageError for incompatible runs.
    `variables`: the workload settings under test, which may differ (shared_prefix for a
    prefix-cache A/B); every other one must match."""
    if a["kind"] != b["kind"]:
        raise UsageError(f"{files[0]} is a {a['kind']} and {files[1]} a {b['kind']}: compare like with like")
    rng = random.Random(seed)
    warnings = []
    if a["kind"] == "bench":
        pairs = [("", a, b)]
    else:
        levels_a = [p["concurrency"] for p in a["points"]]
        levels_b = [p["concurrency"] for p in b["points"]]
        if levels_a != levels_b:
            raise UsageError(f"the sweeps ran different concurrencies ({levels_a} vs {levels_b}): "
                             "rerun one with the other's SWEEP_C")
        pairs = [(f"c={pa['concurrency']} ", pa, pb) for pa, pb in zip(a["points"], b["points"])]
    varied = variable_values(pairs[0][1]["workload"], pairs[0][2]["workload"], variables)
    warnings += [f"--variable {name} is {values['a']!r} in both runs: nothing varies but the server"
                 for name, values in varied.items() if values["a"] == values["b"]]
    for prefix, pa, pb in pairs:
        differ = differences(pa["workload"], pb["workload"], variables)
        if differ:
            raise UsageError(f"different workloads{' at ' + prefix.strip() if prefix else ''}: "
                             + "; ".join(differ) + ": rerun one with the other's settings, or name the setting "
                             f"under test (--variable {differ[0].split(':')[0]})")
    for side, name, doc in ((1, "A", a), (2, "B", b)):
        for pair in pairs:
            prefix, point = pair[0].strip(), pair[side]
            where = f"run {name}" + (f" at {prefix}" if prefix else "")
            if point.get("verdict") == "INVALID":
                warnings.append(f"{where} was INVALID (the client may have distorted its figures): "
                                "this comparison inherits that")
            requests = point.get("requests")  # a bench document's section; a sweep point's count
            if requests["failed"] if isinstance(requests, dict) else point.get("failed"):
                warnings.append(f"{where} had failed requests: percentiles cover the completed ones only")
        if doc.get("interrupted"):
            warnings.append(f"run {name} was interrupted: partial results")
    rows = [row for prefix, pa, pb in pairs for row in metric_rows(pa, pb, prefix, rng)]
    return {"kind": "compare", "schema_version": SCHEMA_VERSION, "verdict": overall(rows),
            "a": {"file": files[0], "label": labels[0]}, "b": {"file": files[1], "label": labels[1]},
            "workload": pairs[0][1]["workload"], "variables": varied, "metrics": rows, "warnings": warnings,
            "method": f"bootstrap, {ROUNDS} rounds, 95% percentile interval of (B - A) / A; "
                      "latency metrics only (lower is better)"}
