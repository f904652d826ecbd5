"""Ctrl-C (SIGINT) and SIGTERM in the middle of a run, sent to the script and through `task`.

Each script runs against a paced fake server (tests/fault_server.py: healthy answers, slowly),
so that the signal comes mid-run, after the first results (the test waits for the script's own
progress line, or for the fake server to see a request, not for a clock). Then: exit 130, the
JSON on stdout valid and marked interrupted with what was measured, the same document in the
--json-out file, --records and --log complete and parseable, no traceback.

Through `task`: go-task 3.54 does not pass a signal on to the command it runs; it prints
`task: Signal received: ...` on stdout and waits. A terminal (Ctrl-C), GNU `timeout` and most
supervisors signal the whole process group, which reaches the script; that is what is tested
here, with `task -x` (the script's exit code instead of go-task's 201). The go-task line is on
stdout too, before or after the JSON; the --json-out file holds the JSON alone
(references/faults.md says so).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from fault_server import Action, fault_server, paced
from vllm_server import ServerUnavailable, task_exe

from rooflib.core import signals
from rooflib.load import benchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TOOLBOX = ROOT / "roofline-toolbox" / "Taskfile.yml"
BOUND_S = 60  # a run that outlives this after the signal is a hang
TEXT = " ".join(f"w{i % 7} word{i % 5}" for i in range(400))


@pytest.fixture(scope="module")
def server():
    with fault_server(paced(0.05)) as url:
        yield url


def case(script: str, url: str, tmp: Path) -> tuple[list[str], str, str]:
    """(script arguments, the task and its variables, the progress text to wait for)."""
    text = tmp / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    load = ["-n", "400", "-c", "2", "--warmup", "0", "--input-tokens", "32", "--output-tokens", "4"]
    return {
        "bench": (["bench.py", "--url", url, *load, "--records", str(tmp / "records.jsonl"),
                   "--log", str(tmp / "log.md")], "bench", "requests done"),
        "sweep": (["sweep.py", "--url", url, "--sweep-c", "1,2", *load[:2], *load[4:], "--log", str(tmp / "log.md")],
                  "sweep", "requests done"),
        "metrics": (["metrics.py", "--url", url, "--window", "120"], "metrics", "measuring for"),
        "ppl": (["ppl.py", "--url", url, "--text", str(text), "--window", "8", "--stride", "4"], "ppl", "window 10/"),
        "smoke_toolcall": (["smoke_toolcall.py", "--url", url, "--repeat", "30"], "smoke-toolcall", "case parallel"),
        "accept": (["accept.py", "--base", url, "--candidate", url, "--text", str(text), "--window", "8",
                    "--stride", "4", "--skip-bench", "--log", str(tmp / "log.md")], "accept", "window 10/"),
    }[script]


def through_task(args: list[str], task_name: str) -> list[str]:
    """The same run as `task -x <task> -- <flags>` (the URL and text as flags too)."""
    try:
        # --color=false: go-task forces colour when CI=true, and its own line is read below.
        return [task_exe(), "-x", "--color=false", "-t", str(TOOLBOX), task_name, "--", *args[1:]]
    except ServerUnavailable as exc:
        pytest.skip(str(exc))


def interrupt(cmd: list[str], tmp: Path, marker: str | threading.Event, signum: int, twice: bool = False,
              bound_s: float = BOUND_S, delay_s: float = 0.0,
              then: Callable[[], None] = lambda: None) -> tuple[int, str, str]:
    """Run `cmd`, signal its process group once `marker` is on its stderr (or, an event, is set:
    the fake server saw the request it waits for), call `then`; (exit code, stdout, stderr)."""
    out, err = tmp / "stdout", tmp / "stderr"

    def arrived() -> bool:
        return marker.is_set() if isinstance(marker, threading.Event) else marker in err.read_text()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=tmp, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "INFER_API_KEY": "sk-interrupt-key"})
        deadline = time.monotonic() + BOUND_S
        while not arrived() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay_s)
        assert proc.poll() is None, f"ended before the signal: {err.read_text()[-500:]}"
        os.killpg(proc.pid, signum)  # the process group, as a terminal's Ctrl-C does
        then()
        while twice:  # again and again until the result is out: none of them may lose it
            time.sleep(0.02)
            if out.read_text() or proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        try:
            code = proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"still running {bound_s} s after the signal: {err.read_text()[-500:]}")
    return code, out.read_text(), err.read_text()


def check(script: str, code: int, out: str, err: str, tmp: Path, via_task: bool,
          codes: tuple[int, ...] = (130,)) -> None:
    assert code in codes, err[-800:]
    assert "Traceback" not in err, err
    if via_task:  # go-task's own "task: Signal received" line may be on stdout too, before or
        # after the JSON, or (on a busy machine, when go-task ends first) not at all: a race
        out = "\n".join(line for line in out.splitlines() if not line.startswith("task: "))
    result = json.loads(out)
    assert "sk-interrupt-key" not in out + err
    # The --json-out file is the one JSON document alone, go-task's line or not.
    assert json.loads((tmp / "out.json").read_text()) == result
    if script == "bench":
        assert result["interrupted"] and result["requests"]["completed"] >= 1
        lines = (tmp / "records.jsonl").read_text().splitlines()
        assert len(lines) == result["requests"]["sent"] + result["requests"]["warmup"]
        assert all(json.loads(line)["index"] >= 0 for line in lines)
        assert "## " in (tmp / "log.md").read_text()
    elif script == "sweep":
        assert result["interrupted"] and result["points"]
        assert (tmp / "log.md").read_text().count("\n## ") + 1 >= len(result["points"])
    elif script == "ppl":
        assert result["stopped"] == "interrupted" and len(result["windows"]) >= 10
    elif script == "smoke_toolcall":
        assert result["interrupted"] and result["cases"]
    elif script == "accept":
        assert result["interrupted"] and "## " in (tmp / "log.md").read_text()
    elif script == "metrics":
        assert result["interrupted"] and result["seconds"] is not None


SCRIPT_NAMES = ["bench", "sweep", "metrics", "ppl", "smoke_toolcall", "accept"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_interrupted_script_keeps_its_results(server, tmp_path, script, signum):
    args, _, marker = case(script, server, tmp_path)
    code, out, err = interrupt([sys.executable, str(SCRIPTS / args[0]), *args[1:], "--json", "--json-out", "out.json"],
                               tmp_path, marker, signum)
    check(script, code, out, err, tmp_path, via_task=False)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_interrupted_through_task_keeps_its_results(server, tmp_path, script, signum):
    args, task_name, marker = case(script, server, tmp_path)
    code, out, err = interrupt(through_task(args, task_name) + ["--json", "--json-out", "out.json"], tmp_path, marker,
                               signum)
    check(script, code, out, err, tmp_path, via_task=True)


@pytest.mark.parametrize("script", ["bench", "sweep"])
def test_more_ctrl_c_do_not_lose_the_result(server, tmp_path, script):
    args, _, marker = case(script, server, tmp_path)
    code, out, err = interrupt([sys.executable, str(SCRIPTS / args[0]), *args[1:], "--json", "--json-out", "out.json"],
                               tmp_path, marker, signal.SIGINT, twice=True)
    # A Ctrl-C that lands after the result is out ends Python by SIGINT, which a shell also
    # reports as 130; what matters is that the result and the files are all there.
    check(script, code, out, err, tmp_path, via_task=False, codes=(130, -signal.SIGINT))


def test_bench_final_scrape_after_ctrl_c_honours_timeout(tmp_path):
    """/metrics answers once (before the run), then never: after Ctrl-C the last scrape gives up
    after --timeout (5 s here), not the 30 s it used to wait, and the result is still printed. The
    note names the timeout that ended it: how long the shutdown took is the machine's. 5 s, not 1:
    the same --timeout bounds the paced requests (4 tokens 50 ms apart), and beside two busy loops
    both passed 1 s once, so no request completed before the Ctrl-C."""
    slow, scrapes = paced(0.05), []

    def fault(request):
        if request.path == "/metrics":
            scrapes.append(1)
            return Action(b"", "hang") if len(scrapes) > 1 else None
        return slow(request)
    with fault_server(fault) as url:
        args, _, marker = case("bench", url, tmp_path)
        code, out, err = interrupt([sys.executable, str(SCRIPTS / args[0]), *args[1:], "--timeout", "5", "--json",
                                    "--json-out", "out.json"], tmp_path, marker, signal.SIGINT)
    check("bench", code, out, err, tmp_path, via_task=False)
    server = json.loads(out)["server"]
    assert server["metrics"] is None and "metrics" in server["metrics_note"], server
    assert re.search(r"timed out after [0-9.]+ s \(--timeout 5\)", server["metrics_note"]), server


def quick_load(script: str, url: str) -> list[str]:
    """A short unpaced run of bench (8 requests) or sweep (C = 1, 2; 8 each) with --json and
    --json-out out.json, no /metrics timeline: the only scrapes are before and after each load."""
    load = ["--url", url, "-n", "8", "--warmup", "0", "--input-tokens", "16", "--output-tokens", "4",
            "--timeline-interval", "0", "--log", "log.md", "--json", "--json-out", "out.json"]
    return [sys.executable, str(SCRIPTS / f"{script}.py"), *load, *(["--sweep-c", "1,2"] if script == "sweep" else [])]


def log_entries(tmp: Path) -> int:
    return len(re.findall(r"^## ", (tmp / "log.md").read_text(), re.M))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sweep_interrupted_between_points_keeps_the_points_done(tmp_path, signum):
    """The signal lands while the second point builds its prompts (its /tokenize calls are held
    until then), outside any load: the report holds the first point, marked interrupted."""
    streamed, building, go_on = [], threading.Event(), threading.Event()

    def fault(request):
        if request.path == "/v1/completions":
            streamed.append(1)
        elif request.path == "/tokenize" and streamed:  # after the first load: the second point is building
            building.set()
            go_on.wait(BOUND_S)
        return None
    try:
        with fault_server(fault) as url:
            code, out, err = interrupt(quick_load("sweep", url), tmp_path, building, signum, then=go_on.set)
    finally:
        go_on.set()
    assert code == 130 and "Traceback" not in err, err[-800:]
    assert "sweep: C = 2" in err
    report = json.loads(out)
    assert report["interrupted"] and [p["concurrency"] for p in report["points"]] == [1], report["points"]
    assert report["points"][0]["completed"] == 8
    assert json.loads((tmp_path / "out.json").read_text()) == report
    assert log_entries(tmp_path) == 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("script", ["bench", "sweep"])
def test_signal_during_the_last_scrape_keeps_the_whole_result(tmp_path, script, signum):
    """The load is over and /metrics is read once more (held open until the signal has landed):
    the signal waits, the scrape completes, and the result is whole, marked interrupted. sweep
    stops after that point."""
    scrapes, scraping, go_on = [], threading.Event(), threading.Event()

    def fault(request):
        if request.path == "/metrics":
            scrapes.append(1)
            if len(scrapes) == 2:  # the scrape after the (first) load
                scraping.set()
                go_on.wait(BOUND_S)
        return None
    try:
        with fault_server(fault) as url:
            code, out, err = interrupt(quick_load(script, url), tmp_path, scraping, signum, then=go_on.set)
    finally:
        go_on.set()
    assert code == 130 and "Traceback" not in err, err[-800:]
    assert f"{script}: finishing" in err  # held, not obeyed
    result = json.loads(out)
    assert json.loads((tmp_path / "out.json").read_text()) == result
    assert result["interrupted"] and log_entries(tmp_path) == 1
    if script == "bench":
        assert result["requests"]["completed"] == 8 and result["server"]["metrics"] is not None, result["server"]
    else:
        assert [(p["concurrency"], p["completed"]) for p in result["points"]] == [(1, 8)], result["points"]


def test_ctrl_c_as_the_timeline_starts_leaves_no_traceback(server):
    """bench starts its /metrics timeline, a spawned child, as the run starts, and waits for its
    first sample: a Ctrl-C to the process group meanwhile reaches a child still starting up,
    before it can ignore Ctrl-C itself. It must neither die nor print a traceback: the parent
    stops it and takes its pages."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {str(SCRIPTS)!r})
        from rooflib.server import watch
        timeline = watch.Timeline({server!r}, None, 0.1)
        def interrupt():  # at once once the child is spawned: it is not yet up
            while timeline._process is None:
                time.sleep(0.001)
            os.killpg(0, signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            timeline.start({{}})
            time.sleep(30)
            raise SystemExit("the parent missed its Ctrl-C")
        except KeyboardInterrupt:
            pass
        timeline.stop()
        print(timeline._process.exitcode, timeline.errors)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=BOUND_S,
                          start_new_session=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.split() == ["0", "[]"], done.stdout


@pytest.mark.parametrize("delay_s", [0.0, 0.2, 0.5])
def test_ctrl_c_as_bench_workers_start_keeps_the_result(server, tmp_path, delay_s):
    """bench --workers spawns its client processes as the run starts; each takes a while to start
    up (interpreter, imports). A Ctrl-C to the process group then must neither kill one nor make
    it print a traceback: bench prints what was measured (maybe nothing) and exits 130."""
    args, _, _ = case("bench", server, tmp_path)
    cmd = [sys.executable, str(SCRIPTS / args[0]), *args[1:], "--workers", "2", "--json"]
    # The line bench prints as the run starts, before the workers are up.
    code, out, err = interrupt(cmd, tmp_path, " against ", signal.SIGINT, delay_s=delay_s)
    assert code == 130, err[-800:]
    assert "Traceback" not in err, err
    result = json.loads(out)
    assert result["interrupted"], result
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == result["requests"]["sent"] + result["requests"]["warmup"]


def test_a_ctrl_c_just_after_the_run_is_announced_is_an_interrupted_run(monkeypatch):
    """The race behind a fresh-clone failure of the test above (delay 0, exit 130, no JSON): the
    Ctrl-C landed between the " against " line and the run's own handler. The line is now said
    inside it: a Ctrl-C raised as it is said gives the empty, interrupted result bench prints."""
    def interrupted(message: str) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(benchrun.printing, "progress", interrupted)
    with signals.SignalHold("bench") as hold:
        run = benchrun.run_load(None, None, hold, None, None, True, "bench: 4 requests against http://h:8000 (m)")
    assert run.interrupted and run.outcomes == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_as_the_run_loop_closes_is_held(tmp_path, signum):
    """Closing the run's event loop resets SIGINT and SIGTERM to their defaults (KeyboardInterrupt,
    die): a second Ctrl-C or SIGTERM landing right after must not lose what the run measured. The
    first stops the run once the fake server has its first request (bench's loop handles the
    signals by then: it installs its handlers before it sends); the second lands as the loop closes."""
    slow, sending = paced(0.05), threading.Event()

    def fault(request):
        if request.path == "/v1/completions":
            sending.set()
        return slow(request)
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys
        sys.path.insert(0, {str(SCRIPTS)!r})
        import bench
        real_run = asyncio.run

        def run(main):
            try:
                return real_run(main)
            finally:  # the loop is closed
                os.kill(os.getpid(), {int(signum)})
        asyncio.run = run
        sys.exit(bench.main(sys.argv[1:]))
    """)
    with fault_server(fault) as url:
        args, _, _ = case("bench", url, tmp_path)
        code, out, err = interrupt([sys.executable, "-c", script, *args[1:], "--json"], tmp_path, sending, signum)
    assert code == 130 and "Traceback" not in err, err[-800:]
    result = json.loads(out)
    assert result["interrupted"]
    assert "finishing" in err
