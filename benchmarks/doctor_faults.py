#!/usr/bin/env python3
"""The doctor's first line on faulty deployments of the real CPU vLLM: in-sample and held out.

Each case is a deployment (cpu-tiny with engine flags, and a proxy in front or not), users'
traffic in the background, and the user's symptom and SLO; `doctor` runs on it as a user would
(a subprocess, --json) and its first line is scored: the part of the path, the cause and the
owner (an engine flag or a component outside the engine) against what was made wrong. In-sample
cases are the fault classes the tests name (tests/doctor/test_doctor_live.py); held-out ones are
faults no test names and no rule was written for (a proxy that holds each event, one that holds
each new connection, a rate limiter in front, clients that give up, prefill chunks far too small).
The score is reported side by side, with the wall time per case.

Examples:
  doctor_faults.py
  doctor_faults.py --cases held-out --json

Exit codes: 0 at least 5 of 6 held-out first lines right (the goal) and every in-sample one,
1 fewer, 2 bad arguments, 3 an engine did not start.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

from live_traffic import traffic  # noqa: E402
from slow_proxy import Behaviour, proxy  # noqa: E402
from vllm_server import running_vllm  # noqa: E402

from rooflib.core import cli, printing  # noqa: E402
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError  # noqa: E402

DOCTOR = REPO / "scripts" / "doctor.py"


@dataclass(frozen=True)
class Case:
    """A deployment (`sets` on cpu-tiny), a proxy in front (or none), the users' traffic, the
    doctor's arguments, and the right root: (segment prefix, cause, owner: a flag or words of the
    component)."""
    sets: tuple[str, ...]
    behaviour: Behaviour | None
    load: dict[str, Any]
    args: tuple[str, ...]
    right: tuple[str, str, str]
    held_out: bool = False


DEFAULT = ()
SHAPED = ("max_model_len=1024", "max_num_seqs=2", 'extra_args=["--stream-interval", "32"]')
STARVED = ("env={}", "max_model_len=1024", "kv_cache_memory_bytes=4194304", "enable_prefix_caching=false")
CHUNKED = ("max_num_seqs=8", "max_num_batched_tokens=32")
USERS = {"concurrency": 2, "prompt_words": 150}
CASES = {
    "fixed delay in front": Case(DEFAULT, Behaviour(delay_s=0.5), USERS, ("--symptom", "first-token",
                                 "--slo-ttft-p95-ms", "400"), ("front", "delay_before_routing", "in front of")),
    "gateway on the inference route": Case(DEFAULT, Behaviour(delay_s=0.5, delayed_prefix="/v1/completions"), USERS,
                                           ("--symptom", "first-token", "--slo-ttft-p95-ms", "400"),
                                           ("route", "inference_route", "gateway")),
    "buffering proxy": Case(DEFAULT, Behaviour(buffer=True), USERS, ("--symptom", "streaming",),
                            ("delivery", "buffering", "buffers responses")),
    "engine stream interval": Case(SHAPED, None, USERS, ("--symptom", "streaming",),
                                   ("stream_interval", "stream_interval", "--stream-interval")),
    "prompts over the context limit": Case(SHAPED, None, {**USERS, "long_share": 0.2, "long_words": 1500},
                                           ("--symptom", "errors"), ("rejected: 4xx", "context_length",
                                                                     "--max-model-len")),
    "queue behind the running cap": Case(SHAPED, None, {"concurrency": 6, "prompt_words": 450, "output_tokens": 16,
                                                        "think_s": 0.05},
                                         ("--symptom", "first-token", "--slo-ttft-p95-ms", "500"),
                                         ("queue", "running_limit", "--max-num-seqs")),
    "KV cache too small": Case(STARVED, None, {"concurrency": 16, "prompt_words": 400, "output_tokens": 256,
                                               "think_s": 0.05},
                               ("--symptom", "first-token", "--slo-ttft-p95-ms", "500", "--window", "12"),
                               ("queue", "kv_cache", "--kv-cache-memory-bytes")),
    "prefix caching off": Case(STARVED, None, {"concurrency": 1, "prompt_words": 450, "output_tokens": 8,
                                               "shared": True},
                               ("--symptom", "first-token", "--slo-ttft-p95-ms", "20", "--probe-concurrency", "1"),
                               ("prefill", "prefix_cache_off", "--enable-prefix-caching")),
    # Held out: no test names these, no rule was written for them.
    "a proxy that holds each event": Case(DEFAULT, Behaviour(drip_s=0.06), USERS, ("--symptom", "streaming",),
                                          ("delivery", "slow_delivery", "between the server and the clients"),
                                          held_out=True),
    "new connections held": Case(DEFAULT, Behaviour(accept_delay_s=0.4), USERS,
                                 ("--symptom", "first-token", "--slo-ttft-p95-ms", "300"),
                                 ("connection_setup", "new_connection_held", "accepts connections"), held_out=True),
    "a rate limiter in front": Case(DEFAULT, Behaviour(limit_every=3, delayed_prefix="/v1/completions"), USERS, ("--symptom", "errors",),
                                    ("probe", "rate_limited", "in front of the engine"), held_out=True),
    "clients that give up": Case(DEFAULT, None, {"concurrency": 3, "prompt_words": 150, "output_tokens": 400,
                                                 "timeout_s": 0.6, "think_s": 0.05},
                                 ("--symptom", "errors",), ("aborted", "client_gave_up", "timeout"), held_out=True),
    "clients asking for a model not served": Case(DEFAULT, None, {**USERS, "model": "gpt-4o-mini"},
                                                  ("--symptom", "errors",), ("rejected: 4xx", "rejected", "clients"),
                                                  held_out=True),
    "prefill chunks far too small": Case(CHUNKED, None, {"concurrency": 2, "prompt_words": 500, "output_tokens": 8},
                                         ("--symptom", "first-token", "--slo-ttft-p95-ms", "300"),
                                         ("prefill", "prefill", "--max-num-batched-tokens"), held_out=True),
}


def doctor(url: str, args: Sequence[str]) -> tuple[dict[str, Any] | None, str]:
    done = subprocess.run([sys.executable, str(DOCTOR), "--url", url, "--json", "--window", "8", *args],
                          capture_output=True, text=True, timeout=900)
    if not done.stdout:
        return None, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    return json.loads(done.stdout), ""


def scored(case: Case, result: dict[str, Any] | None) -> bool:
    root = (result or {}).get("root")
    if not root:
        return False
    setting = root["owner"]["setting"]
    owner = setting["flag"] if setting else root["owner"]["component"]
    segment, cause, who = case.right
    return root["segment"].startswith(segment) and root["cause"] == cause and who in owner


def run_case(name: str, case: Case, server: Any) -> dict[str, Any]:
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(proxy(server.url, case.behaviour)) if case.behaviour else server.url
        load = {"model": server.model, **case.load}
        stack.enter_context(traffic(server.url, **load))
        result, error = doctor(url, case.args)
    right = scored(case, result)
    printing.progress(f"{'held-out' if case.held_out else 'in-sample'} {name}: {'RIGHT' if right else 'wrong'}: "
                      f"{(result or {}).get('first_line', error)}")
    return {"case": name, "held_out": case.held_out, "right": right, "expected": list(case.right),
            "first_line": (result or {}).get("first_line"), "error": error or None,
            "seconds": round(time.monotonic() - started, 1)}


def run_all(names: Sequence[str], log_dir: Path) -> list[dict[str, Any]]:
    """The cases grouped by deployment, so each engine starts once."""
    rows = []
    by_sets: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        by_sets.setdefault(CASES[name].sets, []).append(name)
    for sets, group in by_sets.items():
        with running_vllm(log_dir, sets=sets) as server:
            rows += [run_case(name, CASES[name], server) for name in group]
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def score(held_out: bool) -> dict[str, Any]:
        part = [r for r in rows if r["held_out"] == held_out]
        return {"right": sum(r["right"] for r in part), "cases": len(part)}
    return {"kind": "doctor_faults", "in_sample": score(False), "held_out": score(True), "cases": list(rows)}


def human_text(result: dict[str, Any]) -> str:
    lines = [f"{'held-out' if r['held_out'] else 'in-sample':9} {'RIGHT' if r['right'] else 'wrong':5} "
             f"{r['seconds']:6.1f} s  {r['case']}: {r['first_line'] or r['error']}" for r in result["cases"]]
    for part in ("in_sample", "held_out"):
        lines.append(f"{part.replace('_', '-')}: {result[part]['right']} of {result[part]['cases']} first lines right")
    return "\n".join(lines)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--cases", default="all", help="all, in-sample, held-out, or case names joined by commas")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        groups = {"all": list(CASES), "in-sample": [n for n, c in CASES.items() if not c.held_out],
                  "held-out": [n for n, c in CASES.items() if c.held_out]}
        names = groups.get(args.cases) or [n.strip() for n in args.cases.split(",")]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            raise UsageError(f"unknown case {unknown[0]!r}: one of {', '.join(CASES)}")
        with tempfile.TemporaryDirectory() as tmp:
            result = summary(run_all(names, Path(tmp)))
        printed = printing.emit(result, human_text(result), args.output)
        held, inside = result["held_out"], result["in_sample"]
        met = held["right"] >= min(5, held["cases"]) and inside["right"] == inside["cases"]
        return printed or (EXIT_OK if met else EXIT_CHECK_FAILED)

    return cli.run_main(body)


if __name__ == "__main__":
    os.environ.setdefault("ROOFLINE_VLLM_STARTUP_TIMEOUT", "600")
    sys.exit(main())
