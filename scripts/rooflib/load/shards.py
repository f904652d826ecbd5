"""One bench run over several machines: which part a shard sends (--shard I/N), when the shards
start (--start-at), and what a shard says of its clock so that the merge can put every shard's
requests on one time axis.

Every shard builds the same workload from the same seed and takes its part of it with
runner.share, the split --workers makes on one machine: requests I, I + N, ... and its share of the
concurrency; an open loop's arrivals are drawn once for the whole run, so the shards together send
the stated rate on the stated schedule. The start is a wall-clock time every shard waits for after
its warm-up: no coordinator, only the machines' clocks, which NTP keeps together. A shard records
its clock: the offset from its monotonic clock (the one its timestamps are taken on) to the wall
clock, the kernel's own estimate of the wall clock's error (adjtimex: what NTP or chrony told it),
and the kernel it runs on (shards on one kernel share one clock exactly).
"""
from __future__ import annotations

import ctypes
import datetime
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rooflib.core.errors import UsageError

# How far ahead a start may be: a start days away is a typo (milliseconds for seconds, a year).
LONGEST_WAIT_S = 86400.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
TIME_ERROR = 5  # adjtimex's answer when the clock is not synchronized


@dataclass(frozen=True)
class Shard:
    """Part `index` (0-based, as Kubernetes' JOB_COMPLETION_INDEX) of `count`."""
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard | None:
    """--shard I/N ('' when not given: None)."""
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not int(match[2]) or int(match[1]) >= int(match[2]) or int(match[2]) > 1024:
        raise UsageError(f"--shard takes I/N with 0 <= I < N <= 1024 (I is the 0-based index, as "
                         f"$JOB_COMPLETION_INDEX), got {text!r}")
    return Shard(int(match[1]), int(match[2]))


def parse_start_at(text: str, now_s: float) -> float | None:
    """--start-at: a Unix time in seconds or an ISO 8601 time with its zone (2026-05-01T12:00:00Z);
    '' when not given (None). A time more than a day ahead is refused as a typo."""
    if not text:
        return None
    try:
        at = float(text)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise UsageError(f"--start-at takes a Unix time (1767268800) or an ISO time with its zone "
                             f"(2026-01-01T12:00:00Z), got {text!r}")
        if moment.tzinfo is None:
            raise UsageError(f"--start-at {text!r} has no time zone: the shards' machines may not share one; "
                             "end it with Z (UTC) or +HH:MM")
        at = moment.timestamp()
    if not at > 0 or at - now_s > LONGEST_WAIT_S:
        raise UsageError(f"--start-at {text!r} is more than a day ahead (or not a time): give the start of this run")
    return at


def iso(seconds: float) -> str:
    """A Unix time as ISO 8601 UTC, to the millisecond."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="milliseconds")


def run_id(seed: int, start_at_s: float, count: int) -> str:
    """The run id every shard of one run derives alike (request ids bench-<run id>-<index>, the
    prompts' head, the merge's check that its inputs belong together): from what they share."""
    return hashlib.sha256(f"{seed}/{start_at_s!r}/{count}".encode()).hexdigest()[:8]


class _Timex(ctypes.Structure):
    """The head of Linux's struct timex (the kernel writes the rest into `tail`)."""
    _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                ("tail", ctypes.c_byte * 256)]


def kernel_clock() -> dict[str, Any]:
    """The kernel's word on its wall clock (adjtimex, read-only): synchronized or not, and its
    estimated and maximum error in ms; None figures where it cannot be asked (not Linux)."""
    try:  # the C library the interpreter already has loaded: no search for it
        timex = _Timex()
        state = ctypes.CDLL(None, use_errno=True).adjtimex(ctypes.byref(timex))
    except (OSError, AttributeError):
        return {"synchronized": None, "est_error_ms": None, "max_error_ms": None}
    if state < 0:
        return {"synchronized": None, "est_error_ms": None, "max_error_ms": None}
    return {"synchronized": state != TIME_ERROR, "est_error_ms": timex.esterror / 1e3,
            "max_error_ms": timex.maxerror / 1e3}


def clock() -> dict[str, Any]:
    """This process's clocks: the offset that turns its monotonic timestamps into wall-clock ones,
    the kernel that keeps them, and the kernel's estimate of their error. The offset is the wall
    clock read between two monotonic readings, from the closest pair of five: a process preempted
    between two reads (a busy machine) would otherwise shift every timestamp by the time it lost."""
    brackets = []
    for _ in range(5):
        before, wall, after = time.perf_counter_ns(), time.time_ns(), time.perf_counter_ns()
        brackets.append((after - before, wall - (before + after) // 2))
    offset = min(brackets)[1]
    try:
        boot = BOOT_ID.read_text(encoding="ascii").strip()
    except OSError:
        boot = None
    return {"wall_minus_monotonic_ns": offset, "kernel": boot, **kernel_clock()}


def section(shard: Shard | None, start_at_s: float | None, measured_from_ns: int | None,
            reading: dict[str, Any] | None, requests: int, concurrency: int | None, records: str) -> dict[str, Any] | None:
    """A shard's own section of its result: what it sent, how late it started, its clock, and the
    name of its records file (the merge looks for it beside the result)."""
    if shard is None:
        return None
    late_ms = None
    if start_at_s is not None and measured_from_ns is not None:
        late_ms = ((measured_from_ns + reading["wall_minus_monotonic_ns"]) / 1e9 - start_at_s) * 1e3
    return {"index": shard.index, "count": shard.count, "start_at": iso(start_at_s) if start_at_s else None,
            "start_at_s": start_at_s, "started_late_ms": late_ms, "requests": requests, "concurrency": concurrency,
            "clock": reading, "records": Path(records).name if records else None}
