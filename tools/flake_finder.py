#!/usr/bin/env python3
"""Find flaky tests: run the real-server tests N times under load and list every test that failed.

Each round runs pytest on the tests marked real_vllm or real_sglang (or the --select given) the way
`task test` runs them (three workers, grouped), while busy loops (by default two, one per core of
a 2-core machine) compete for the CPU, as a shared CI runner or a developer's laptop would. It
reads each round's JUnit XML and reports every test that failed or errored at least once, with
its first failure line, and the slowest tests of all rounds (where the suite's time goes).

Examples:
  flake_finder.py                         # 3 rounds of the real-vLLM and real-SGLang tests, two busy loops
  flake_finder.py --rounds 5 --busy 2 --json-out flakes.json
  flake_finder.py --rounds 2 --select "tests/serving/test_tune.py -k running_limit"
  flake_finder.py --rounds 3 -- tests/doctor/test_doctor_live.py -k rejected

Exit codes: 0 no test failed in any round, 1 some test failed at least once (listed) or a round
did not run its tests (pytest's exit code said why, e.g. 5: no test selected), 2 usage error, 130
interrupted (the rounds run so far are still reported).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

# A project tool, not shipped: it imports the library from the scripts folder.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from rooflib.core import cli, printing  # noqa: E402
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SELECTION = "-m 'real_vllm or real_sglang'"
SLOWEST = 20
# pytest-xdist's --dist loadgroup appends "@<group>" to a test's name; a parameter's "@" sits inside [].
XDIST_GROUP = re.compile(r"@[^\[\]]*$")
# pytest's exit codes past 0 (all passed) and 1 (some failed): the round's tests were not all judged.
PYTEST_EXIT = {2: "interrupted", 3: "internal error", 4: "usage error", 5: "no test selected"}


@dataclass
class Round:
    seconds: float
    exit_code: int
    tests: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # test id -> first line of its failure
    skipped: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)


def node_id(classname: str, name: str) -> str:
    """The test's pytest node id, runnable as printed, from a JUnit case: the classname is the module's
    dotted path and then its class, if any (tests.server.test_fleet.TestRealFleet), so the module is
    the longest prefix that names a file."""
    parts, test = classname.split("."), XDIST_GROUP.sub("", name)
    for cut in range(len(parts), 0, -1):
        if (REPO / Path(*parts[:cut])).with_suffix(".py").is_file():
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], test])
    return f"{'/'.join(parts)}.py::{test}"


def read_junit(path: Path) -> tuple[int, dict[str, str], list[str], dict[str, float]]:
    """(tests, failed id -> first line, skipped ids, id -> seconds) of one JUnit XML report."""
    failed, skipped, durations = {}, [], {}
    tests = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        tests += 1
        test_id = node_id(case.get("classname", ""), case.get("name", ""))
        durations[test_id] = float(case.get("time") or 0)
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is not None:
                failed[test_id] = (bad.get("message") or tag).strip().splitlines()[0][:300] if (
                    bad.get("message") or "").strip() else tag
        if case.find("skipped") is not None:
            skipped.append(test_id)
    return tests, failed, skipped, durations


@contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes that spin on the CPU until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def run_round(selection: Sequence[str], workers: int, report: Path) -> Round:
    cmd = [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadgroup", "-q", "-p", "no:cacheprovider",
           f"--junitxml={report}", *selection]
    started = time.monotonic()
    # CI=true: a real-server test that skips is a failure here too (tests/conftest.py).
    code = subprocess.run(cmd, cwd=REPO, stdout=sys.stderr, stderr=sys.stderr, env={**os.environ, "CI": "true"}).returncode
    result = Round(seconds=time.monotonic() - started, exit_code=code)
    if report.exists():
        result.tests, result.failed, result.skipped, result.durations = read_junit(report)
    return result


def summary(rounds: Sequence[Round], interrupted: bool = False) -> dict:
    """Every test that failed at least once (how often, and its first failure), and the slowest."""
    flaky: dict[str, dict] = {}
    for i, done in enumerate(rounds, 1):
        for test_id, line in done.failed.items():
            entry = flaky.setdefault(test_id, {"test": test_id, "failed_rounds": [], "first_failure": line})
            entry["failed_rounds"].append(i)
    slowest: dict[str, float] = {}
    for done in rounds:
        for test_id, seconds in done.durations.items():
            slowest[test_id] = max(slowest.get(test_id, 0.0), seconds)
    top = sorted(slowest.items(), key=lambda item: -item[1])[:SLOWEST]
    return {"kind": "flake_finder", "rounds": [{"seconds": round(r.seconds, 1), "exit_code": r.exit_code,
                                                "tests": r.tests, "failed": len(r.failed), "skipped": len(r.skipped)}
                                               for r in rounds],
            "failed_at_least_once": sorted(flaky.values(), key=lambda e: e["test"]),
            "skipped": sorted({t for r in rounds for t in r.skipped}),
            "slowest": [{"test": t, "seconds": round(s, 1)} for t, s in top], "interrupted": interrupted}


def unjudged_rounds(result: dict) -> list[tuple[int, int]]:
    """(round, pytest exit code) of each round whose pytest did not run its tests to the end."""
    return [(i, r["exit_code"]) for i, r in enumerate(result["rounds"], 1) if r["exit_code"] not in (0, 1)]


def human_text(result: dict) -> str:
    lines = [f"round {i}: {r['tests']} tests, {r['failed']} failed, {r['skipped']} skipped, {r['seconds']:.0f} s "
             f"(pytest exit {r['exit_code']})" for i, r in enumerate(result["rounds"], 1)]
    flaky = result["failed_at_least_once"]
    unjudged = unjudged_rounds(result)
    lines += [f"Round {i} did not run its tests to the end: pytest exit {code} ({PYTEST_EXIT.get(code, 'see its output')})"
              for i, code in unjudged]
    if result["interrupted"]:
        lines.append(f"Interrupted during round {len(result['rounds']) + 1}: only the rounds above finished.")
    if flaky or not (unjudged or result["interrupted"]):
        lines.append(f"Failed at least once: {len(flaky)}" if flaky else "No test failed in any round.")
    lines += [f"  {e['test']} (rounds {', '.join(map(str, e['failed_rounds']))}): {e['first_failure']}" for e in flaky]
    if result["skipped"]:
        lines.append(f"Skipped: {len(result['skipped'])} (a skipped real-server test is a failure in CI)")
    lines.append(f"Slowest {len(result['slowest'])} tests (seconds, the longest of any round):")
    lines += [f"  {e['seconds']:7.1f}  {e['test']}" for e in result["slowest"]]
    return "\n".join(lines)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="how many times to run the tests (default 3)")
    p.add_argument("--busy", type=int, default=2, help="busy loops beside them (default 2)")
    p.add_argument("--workers", type=int, default=3, help="pytest-xdist workers, as task test runs (default 3)")
    p.add_argument("--select", default="", help=f"pytest's arguments that select the tests (default {DEFAULT_SELECTION!r})")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                   help="the selection as separate arguments after --, as task test:flakes passes them")
    printing.add_output_args(p)
    args = p.parse_args(argv)
    selection = shlex.split(args.select) + args.pytest_args or shlex.split(DEFAULT_SELECTION)

    def body() -> int:
        if args.rounds < 1 or args.busy < 0 or args.workers < 1:
            raise UsageError("--rounds and --workers must be at least 1, --busy at least 0")
        rounds: list[Round] = []
        interrupted = False
        with tempfile.TemporaryDirectory() as tmp, busy_loops(args.busy):
            try:
                for i in range(1, args.rounds + 1):
                    printing.progress(f"round {i} of {args.rounds} with {args.busy} busy loops: "
                                      f"pytest {' '.join(selection)}")
                    rounds.append(run_round(selection, args.workers, Path(tmp) / f"round-{i}.xml"))
            except KeyboardInterrupt:
                interrupted = True
        result = summary(rounds, interrupted)
        printed = printing.emit(result, human_text(result), args.output)
        if printed:
            return printed
        if interrupted:
            return EXIT_INTERRUPTED
        bad = result["failed_at_least_once"] or result["skipped"] or unjudged_rounds(result)
        return EXIT_CHECK_FAILED if bad else EXIT_OK

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
