"""The shards of one bench run (bench --shard I/N) merged into one result, the result one client
would have written had it sent every request: figures from every shard's per-request records.

The percentiles are those of the union of the records (never an average of the shards'
percentiles); throughput is over the union window, from the first request sent by any shard to the
last token any shard received, on the wall clock (each shard's monotonic timestamps plus the
offset it read between its two clocks); the verdict comes from the same analysis as a single
run's (rooflib/load/analysis.py), with the client's self-check of every shard: the merged run is
valid when every shard's client kept up. Each shard's start against --start-at, its clock and its
client's figures are stated in "merge".
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import fileio, stats
from rooflib.core.errors import UsageError
from rooflib.load.analysis import analyse
from rooflib.load.request_outcome import Outcome
from rooflib.server.slo_targets import Targets

MAX_RESULT_BYTES = 256 * 1024 ** 2
MAX_RECORDS_BYTES = 16 * 1024 ** 3
# A shard that began its measured requests later than this share of the run, after --start-at,
# left the run short of its stated load for that long: said in the warnings.
LATE_SHARE = 0.01
# What the merge reads of a shard's result, and of its "shard" section.
RESULT_KEYS = ("config", "workload", "requests", "client", "server", "verdict", "warnings", "interrupted")
SHARD_KEYS = ("index", "count", "requests", "concurrency", "started_late_ms", "clock", "records")


@dataclass
class ShardResult:
    """One shard's result document (bench --json-out), its file, and its records."""
    path: str
    doc: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def shard(self) -> dict[str, Any]:
        return self.doc["shard"]

    @property
    def name(self) -> str:
        return f"shard {self.shard['index']}/{self.shard['count']}"


@dataclass
class RecordedOutcome(Outcome):
    """A request read back from a --records line, on the wall clock (the shard's monotonic times
    plus its clock offset). Its figures are the recorded ones, rounded as written, so that the
    merged percentiles are exactly those of the records."""
    figures: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ttft_ms(self) -> float:
        return self.figures["ttft_ms"]

    @property
    def e2e_ms(self) -> float:
        return self.figures["e2e_ms"]

    @property
    def tpot_ms(self) -> float | None:
        return self.figures["tpot_ms"]

    @property
    def ttft_answer_ms(self) -> float | None:
        return self.figures.get("ttft_answer_ms")

    def chunk_gaps_ms(self) -> list[float]:
        times = self.figures["chunk_ms"]
        return [later - earlier for earlier, later in zip(times, times[1:])]


def outcome_of(record: dict[str, Any], wall_minus_monotonic_ns: int) -> RecordedOutcome:
    """The outcome a --records line describes, moved onto the wall clock; KeyError, TypeError or
    ValueError when the line is not a request record."""
    sent = int(record["sent_ns"]) + wall_minus_monotonic_ns
    chunk_ms = record.get("chunk_ms") or []
    delay = record.get("schedule_delay_ms")
    figures = {key: record.get(key) for key in ("ttft_ms", "e2e_ms", "tpot_ms", "ttft_answer_ms")}
    if record["ok"] and (figures["ttft_ms"] is None or not chunk_ms):
        raise ValueError("a completed request without its times")
    return RecordedOutcome(
        index=int(record["index"]), turn=int(record.get("turn") or 0), warmup=bool(record["warmup"]),
        scheduled_ns=None if delay is None else sent - round(delay * 1e6), sent_ns=sent,
        connect_ms=record.get("connect_ms") or 0.0, status=record.get("status"),
        error=None if record["ok"] else str(record.get("error")), detail=record.get("detail") or "",
        token_times=[sent + round(ms * 1e6) for ms in chunk_ms], chunk_tokens=list(record.get("chunk_tokens") or []),
        prompt_tokens=record.get("prompt_tokens"), completion_tokens=record.get("completion_tokens"),
        usage_reported=bool(record.get("usage_reported", True)), finish_reason=record.get("finish_reason"),
        cached_tokens=record.get("cached_tokens"), settled=True, requested_tokens=record.get("requested_tokens"),
        prompt_target=record.get("prompt_target"), reasoning_seen="reasoning_tokens" in record,
        answer_at=record.get("answer_at"), items=record.get("items"), perfect_tokens=record.get("perfect_tokens"),
        figures={**figures, "chunk_ms": chunk_ms})


def read_result(path: str) -> ShardResult:
    """A shard's result file, with its records read from the file its "shard" section names,
    beside it; a UsageError when either is not what bench --shard writes."""
    text = fileio.read_bounded(path, "shard result", MAX_RESULT_BYTES)
    try:
        doc = fileio.parse_json(text)
    except ValueError:
        raise UsageError(f"{path} is not JSON: give the files bench --shard wrote with --json-out")
    if not isinstance(doc, dict) or doc.get("kind") != "bench" or not isinstance(doc.get("shard"), dict):
        raise UsageError(f"{path} is not a shard's result: give the --json-out files of bench --shard I/N runs")
    missing = [key for key in RESULT_KEYS if key not in doc] + [f"shard.{key}" for key in SHARD_KEYS
                                                                 if key not in doc["shard"]]
    if missing or not isinstance(doc["shard"]["clock"], dict) or "wall_minus_monotonic_ns" not in doc["shard"]["clock"]:
        raise UsageError(f"{path} is a shard's result without {', '.join(missing) or 'shard.clock'} (cut short, or "
                         "written by another version of bench): run that shard again")
    result = ShardResult(path, doc)
    name = result.shard.get("records")
    if not name:
        raise UsageError(f"{path}: {result.name} wrote no --records: its requests cannot be merged")
    records = Path(path).parent / name
    result.records = read_records(str(records), result.name)
    return result


def read_records(path: str, who: str) -> list[dict[str, Any]]:
    """A shard's --records file."""
    if not Path(path).is_file():
        raise UsageError(f"{who}'s records {path} are not there: keep each shard's --records file beside its result")
    return [row for _, row in fileio.read_json_lines(path, f"{who}'s records", MAX_RECORDS_BYTES)]


def expand(paths: Sequence[str]) -> list[str]:
    """The shard results named: files as given, a folder as the shard results in it (its other
    JSON files, a merged result say, are left out)."""
    found = []
    for path in paths:
        folder = Path(path)
        if not folder.is_dir():
            found.append(path)
            continue
        for file in sorted(folder.glob("*.json")):
            try:
                doc = fileio.parse_json(fileio.read_bounded(file, "result", MAX_RESULT_BYTES))
            except (UsageError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("shard"), dict):
                found.append(str(file))
    if not found:
        raise UsageError(f"no shard results in {', '.join(paths) or 'nothing'}: give the --json-out files of "
                         "bench --shard I/N runs, or the folder that holds them")
    return found


def check_together(results: Sequence[ShardResult]) -> None:
    """Every shard of one run, once each, with records that are its own; else a UsageError
    that names what is missing or mixed."""
    first = results[0]
    count = first.shard["count"]
    for result in results[1:]:
        if result.doc["config"].get("run_id") != first.doc["config"].get("run_id"):
            raise UsageError(f"{result.path} is of run {result.doc['config'].get('run_id')}, {first.path} of run "
                             f"{first.doc['config'].get('run_id')}: merge the shards of one run (one --start-at)")
        differ = [key for key in sorted(set(result.doc["workload"]) | set(first.doc["workload"]))
                  if key != "shard" and result.doc["workload"].get(key) != first.doc["workload"].get(key)]
        if differ or result.shard["count"] != count:
            raise UsageError(f"{result.path} and {first.path} ran different workloads "
                             f"({', '.join(differ) or 'shard count'}): merge the shards of one run")
    indexes = sorted(r.shard["index"] for r in results)
    missing = sorted(set(range(count)) - set(indexes))
    doubled = sorted({i for i in indexes if indexes.count(i) > 1})
    if missing or doubled:
        raise UsageError(f"a merge needs each of the {count} shards once: "
                         + "; ".join(filter(None, [missing and f"missing {', '.join(map(str, missing))}",
                                                   doubled and f"given twice {', '.join(map(str, doubled))}"])))
    for result in results:
        check_records(result)


def check_records(result: ShardResult) -> None:
    """A shard's records are its own requests (I, I + N, ...), as many as its result counts."""
    index, count = result.shard["index"], result.shard["count"]
    foreign = [r for r in result.records if not isinstance(r, dict) or r.get("index", -1) % count != index]
    measured = sum(1 for r in result.records if isinstance(r, dict) and not r.get("warmup"))
    if foreign or measured != result.doc["requests"]["sent"]:
        raise UsageError(f"{result.shard['records']} is not {result.name}'s records ({len(result.records)} lines, "
                         f"{measured} measured for its {result.doc['requests']['sent']} requests"
                         + (f", request {foreign[0].get('index') if isinstance(foreign[0], dict) else '?'} is "
                            "another shard's" if foreign else "") + "): keep each shard's records with its result")


def outcomes_of(results: Sequence[ShardResult]) -> list[RecordedOutcome]:
    """Every shard's requests on the wall clock, in the run's request order."""
    outcomes = []
    for result in results:
        offset = result.shard["clock"]["wall_minus_monotonic_ns"]
        for number, record in enumerate(result.records, 1):
            try:
                outcomes.append(outcome_of(record, offset))
            except (KeyError, TypeError, ValueError) as exc:
                raise UsageError(f"{result.shard['records']} line {number} is not a request record ({exc})")
    return sorted(outcomes, key=lambda o: (o.index, o.turn))


def merge(results: Sequence[ShardResult], records_path: str | None = None) -> dict[str, Any]:
    """The merged result document, as bench --json writes one, with "merge" (each shard's start,
    clock and client) and "records" (every request, on the wall clock, for --records)."""
    results = sorted(results, key=lambda r: r.shard["index"])
    check_together(results)
    first = results[0]
    count = first.shard["count"]
    config = {**first.doc["config"], "load": f"{first.doc['config']['load']}, over {count} shards", "shard": None,
              "records": records_path, "shards": count,
              "started_at": min(r.doc["config"]["started_at"] for r in results)}
    outcomes = outcomes_of(results)
    result = analyse(outcomes, config, [], 0.0, 0.0, any(r.doc["interrupted"] for r in results),
                     slo=Targets(config.get("slo_ttft_p95_ms"), config.get("slo_tpot_p95_ms")),
                     client=merged_client(results, outcomes, config), latency_slo_ms=config.get("slo_latency_p95_ms"))
    result["workload"] = {key: value for key, value in first.doc["workload"].items() if key != "shard"}
    result["startup_s"] = max((r.doc.get("startup_s") or 0.0 for r in results), default=None)
    last = max(results, key=finished_at)
    # The server counted every shard's requests: the shard that finished last saw them all in its
    # /metrics window, which opened before any shard's measured start (scrapes come before the warm-up).
    result["server"] = {**last.doc["server"], "from": f"{last.name}'s scrapes, before its warm-up and after the "
                        "run's last request: every shard's traffic is in them"}
    result["timeline"] = last.doc.get("timeline")
    window_ms = (result["throughput"]["duration_s"] or 0.0) * 1e3
    spread = clock_spread_ms(results)
    result["warnings"] += merge_warnings(results, window_ms, spread)
    result["shard"] = None
    result["merge"] = {"shards": [shard_summary(r) for r in results], "clock_spread_bound_ms": spread,
                       "clocks": len({clock_of(r) for r in results}),
                       "window": window(outcomes),
                       "method": "percentiles of the union of the shards' records; throughput over the union window "
                                 "on the wall clock; valid when every shard's client was"}
    result["records"] = [{**record, "sent_ns": record["sent_ns"] + r.shard["clock"]["wall_minus_monotonic_ns"],
                          "shard": r.shard["index"]} for r in results for record in r.records]
    result["records"].sort(key=lambda record: (record["index"], record.get("turn") or 0))
    return result


def merged_client(results: Sequence[ShardResult], outcomes: Sequence[Outcome], config: dict[str, Any]) -> dict[str, Any]:
    """The client section of a merged run: every shard judged its own client against its own
    figures, so the run is valid when each was; the lag and stalls shown are the worst shard's,
    the open loop's schedule delay is pooled over every request."""
    clients = [(r.name, r.doc["client"]) for r in results]
    worst = max((c for _, c in clients), key=lambda c: c["loop_lag_ms"]["p99"] or 0.0)
    distorted: dict[str, list[str]] = {}
    for name, client in clients:
        for figure, why in client["distorted"].items():
            distorted.setdefault(figure, []).append(f"{name}: {why}")
    schedule = stats.summarize((o.sent_ns - o.scheduled_ns) / 1e6 for o in outcomes
                               if not o.warmup and o.scheduled_ns is not None and not config.get("concurrency"))
    return {"valid": all(c["valid"] for _, c in clients),
            "invalid_reasons": [f"{name}: {reason}" for name, c in clients for reason in c["invalid_reasons"]],
            "loop_lag_ms": worst["loop_lag_ms"], "lag_threshold_ms": worst["lag_threshold_ms"],
            "lag_limits_ms": worst["lag_limits_ms"],
            "distorted": {figure: "; ".join(whys) for figure, whys in distorted.items()},
            "schedule_delay_ms": schedule, "stalls": max((c["stalls"] for _, c in clients), key=lambda s: s["share"]),
            "cpu_util": max(c["cpu_util"] for _, c in clients), "transport": worst["transport"],
            "of": f"the self-checks of {len(clients)} shards, each against its own figures; loop lag and stalls "
                  "of the worst shard, CPU of the busiest"}


def finished_at(result: ShardResult) -> int:
    """When a shard's last request ended, on the wall clock (ns)."""
    offset = result.shard["clock"]["wall_minus_monotonic_ns"]
    return max((r["sent_ns"] + offset + round((r.get("e2e_ms") or 0.0) * 1e6) for r in result.records), default=0)


def clock_spread_ms(results: Sequence[ShardResult]) -> float | None:
    """How far two shards' clocks may disagree, by their kernels' own error bounds: 0 when every
    shard ran on one kernel (one clock); None when a clock is not synchronized or cannot say."""
    bounds = {clock_of(r): r.shard["clock"]["max_error_ms"] if r.shard["clock"]["synchronized"] else None
              for r in results}
    if len(bounds) == 1:
        return 0.0
    if None in bounds.values():
        return None
    return sum(sorted(bounds.values(), reverse=True)[:2])


def clock_of(result: ShardResult) -> str:
    """The clock a shard's timestamps came from: its kernel's (shards on one machine share it),
    or its own when its kernel is unknown."""
    return result.shard["clock"]["kernel"] or result.name


def merge_warnings(results: Sequence[ShardResult], window_ms: float, spread_ms: float | None) -> list[str]:
    """Shards that started late, clocks that may disagree."""
    warnings = []
    for result in results:
        late = result.shard["started_late_ms"]
        if late is not None and late > LATE_SHARE * window_ms:
            warnings.append(f"{result.name} began its measured requests {late:.0f} ms after --start-at (its warm-up "
                            "or start-up ran past it): for that long the run sent less than its stated load")
    if spread_ms is None:
        unsynced = [r.name for r in results if r.shard["clock"]["synchronized"] is not True]
        warnings.append(f"the clocks of {', '.join(unsynced)} are not known to be synchronized (their kernels say no "
                        "NTP, or cannot say): the shards' requests may sit apart on the time axis, and the window the "
                        "throughput is taken over may be off by as much; latencies are not affected")
    elif spread_ms > LATE_SHARE * window_ms:
        warnings.append(f"the shards' clocks may disagree by up to {spread_ms:.0f} ms (their kernels' error bounds): "
                        f"the {window_ms / 1e3:.1f} s window and the throughput are known to that; latencies are not affected")
    return warnings


def shard_summary(result: ShardResult) -> dict[str, Any]:
    """What the merged result states of each shard: its files, part, start, clock and client."""
    client = result.doc["client"]
    return {"index": result.shard["index"], "file": result.path, "records": result.shard["records"],
            "requests": result.shard["requests"], "concurrency": result.shard["concurrency"],
            "started_late_ms": result.shard["started_late_ms"], "clock": result.shard["clock"],
            "verdict": result.doc["verdict"], "interrupted": result.doc["interrupted"],
            "client": {key: client[key] for key in ("valid", "invalid_reasons", "loop_lag_ms", "lag_threshold_ms",
                                                    "stalls", "cpu_util")},
            "warnings": result.doc["warnings"]}


def window(outcomes: Sequence[Outcome]) -> dict[str, str | None]:
    """The union window of the measured requests, first sent to last token, in ISO UTC."""
    done = [o for o in outcomes if not o.warmup and o.ok]
    if not done:
        return {"from": None, "to": None}

    def moment(ns: int) -> str:
        return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(timespec="milliseconds")
    return {"from": moment(min(o.sent_ns for o in done)), "to": moment(max(o.token_times[-1] for o in done))}
