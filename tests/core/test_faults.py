"""Every network-facing script against every fault of tests/fault_server.py.

Per (script, fault): the documented exit code, at most one `error:` line and no traceback on
stderr, valid JSON on stdout when a result is printed, results and files kept, the API key
nowhere (stdout, stderr, written files), and no hang: a run that sends the server no request for
far longer than its --timeout allows fails the test (SIGALRM raises through whatever the script is
doing, a busy loop included).

vram is not in the table: the only server it asks is the Hugging Face Hub (a config.json),
which tests/core/test_properties.py covers as a parser.
"""
from __future__ import annotations

import json
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest

import accept
import bench
import metrics
import ppl
import smoke_toolcall
import sweep
from fault_server import FAULTS, KEY, FaultServer, fault_server, paced, refused_url

# A hang is a run that stops making progress, not a slow one: bench and sweep send about 110
# requests here (most of them /tokenize, sizing the prompts), 3 s idle but over 40 s on a loaded CI
# machine. So the bound is on silence: no new request for the row's --timeout (the longest a script
# may wait for one answer) plus QUIET_MARGIN_S for its own work between two requests, and the whole
# run capped at RUN_CAP_S for a script that keeps asking forever.
QUIET_MARGIN_S = 30
RUN_CAP_S = 600
TEXT = " ".join(f"w{i % 7} word{i % 5} text" for i in range(16))


class Hang(BaseException):
    """Raised by the alarm: not an Exception, so no handler in a script swallows it."""


# The faults after which the server says nothing more (or drips for hours): only the client's
# timeout ends them, so the rows of a script that meets them run with --timeout 1. The other rows
# answer at once, but a busy machine may take a while (a healthy answer from this process's own
# fake server, past 1 s): they get 30 s, and so does a script that never asks the broken route.
HANGS = {"never_answers", "slow_drip_head", "chunk_size_negative", "chunk_size_garbage",
         "chunk_line_endless", "content_length_garbage"}


def argv_of(script: str, url: str, tmp: Path, timeout_s: float) -> list[str]:
    text = tmp / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    load = ["-n", "2", "-c", "2", "--warmup", "0", "--input-tokens", "32", "--output-tokens", "4"]
    return {
        "bench": ["--url", url, *load, "--records", str(tmp / "records.jsonl"), "--log", str(tmp / "log.md")],
        "sweep": ["--url", url, "--sweep-c", "2", "-n", "2", "--warmup", "0", "--input-tokens", "32",
                  "--output-tokens", "4", "--log", str(tmp / "log.md")],
        "metrics": ["--url", url],
        "ppl": ["--url", url, "--text", str(text), "--window", "8", "--stride", "4"],
        "smoke_toolcall": ["--url", url, "--repeat", "1", "--cases", "single_auto,irrelevance"],
        "accept": ["--base", url, "--candidate", url, "--text", str(text), "--window", "8", "--stride", "4",
                   "--repeat", "1", "--skip-bench", "--log", str(tmp / "log.md")],
    }[script] + ["--timeout", f"{timeout_s:g}", "--json"]


MAINS = {"bench": bench.main, "sweep": sweep.main, "metrics": metrics.main, "ppl": ppl.main,
         "smoke_toolcall": smoke_toolcall.main, "accept": accept.main}

# What each script documents: 0 ok, 1 check failed, 2 usage/config, 3 server, 4 invalid. The
# faults by what they break; a fault on an endpoint a script does not use leaves it healthy.
GROUPS = {
    "everything": {"http_500_echoing_the_key", "http_401_echoing_the_key", "html_instead_of_json", "json_nested_too_deep",
                   "slow_drip_head", "never_answers", "closes_at_once", "refused"},
    "models": {"models_is_a_list", "models_max_len_string", "models_entry_not_object"},
    "wire": {"chunk_size_negative", "chunk_size_huge", "chunk_size_garbage", "chunk_line_endless",
             "content_length_garbage", "http_429_on_work", "http_401_on_work_echoing_the_key"},
    "stream": {"stream_cut_mid_event", "garbage_sse", "sse_nested_too_deep", "sse_error_echoing_the_key", "completion_tokens_string",
               "choices_item_not_object", "usage_is_a_list"},
    "chat": {"chat_choices_item_not_object", "chat_json_is_a_list"},
    "scoring": {"logprob_string", "logprob_nan", "prompt_logprobs_short", "prompt_logprobs_item_not_object",
                "tokenize_tokens_strings"},
    "metrics": {"metrics_nan", "metrics_html"},
}
# bench and sweep may call a healthy run INVALID (4): the client's own lag on a busy host.
HEALTHY = {"bench": {0, 4}, "sweep": {0, 4}, "metrics": {0}, "ppl": {0}, "smoke_toolcall": {0}, "accept": {0}}
EXPECTED: dict[str, dict[str, set[int]]] = {
    "bench": {"everything": {3}, "models": {3}, "wire": {3}, "stream": {3}},
    "sweep": {"everything": {3}, "models": {3}, "wire": {3}, "stream": {3}},
    "metrics": {"everything": {3}, "html_instead_of_json": {4}, "json_nested_too_deep": {4}, "metrics_html": {4}},
    "ppl": {"everything": {3}, "models": {3}, "wire": {3}, "scoring": {3}},
    # smoke does not read max_model_len; a case whose answers are broken is a failed check (1)
    "smoke_toolcall": {"everything": {3}, "models": {3}, "models_max_len_string": {0}, "wire": {3},
                       "stream": {1}, "chat": {3}},
    "accept": {"everything": {3}, "models": {3}, "wire": {3}, "stream": {1}, "chat": {3}, "scoring": {3}},
}


def expected(script: str, fault: str) -> set[int]:
    table = EXPECTED[script]
    if fault in table:
        return table[fault]
    group = next((name for name, faults in GROUPS.items() if fault in faults), None)
    return table.get(group, HEALTHY[script])


def run_guarded(main, argv: list[str], timeout_s: float, last_request: Callable[[], float]) -> int:
    """main(argv), raising Hang (with where it was) once the server has heard nothing from it for
    timeout_s + QUIET_MARGIN_S, or it has run RUN_CAP_S. A watchdog thread sends the one SIGALRM
    (Python runs the handler in the main thread), so a run that makes progress sees no signal."""
    started, done = time.monotonic(), threading.Event()
    quiet_bound_s = timeout_s + QUIET_MARGIN_S

    def watch() -> None:
        while not done.wait(1.0):
            now = time.monotonic()
            if now - max(started, last_request()) > quiet_bound_s or now - started > RUN_CAP_S:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)
                return

    def alarm(signum, frame):
        now = time.monotonic()
        raise Hang(f"still running after {now - started:.0f} s, the last {now - max(started, last_request()):.0f} s "
                   f"without a request (--timeout {timeout_s:g}), at:\n" + "".join(traceback.format_stack(frame)[-4:]))
    previous = signal.signal(signal.SIGALRM, alarm)
    watchdog = threading.Thread(target=watch, daemon=True)
    watchdog.start()
    try:
        return main(argv)
    finally:
        done.set()
        watchdog.join()
        signal.signal(signal.SIGALRM, previous)


def check_run(script: str, fault: str, code: int, out: str, err: str, tmp: Path) -> None:
    assert code in expected(script, fault), (code, err[-600:])
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1, errors
    result = json.loads(out) if out.strip() else None  # valid JSON (no NaN), whatever the server sent
    failed = result is not None and set(result) == {"error", "exit_code"}
    if code in (2,) or (code == 3 and (result is None or failed)):
        assert errors, f"exit {code} without an error line: {err[-300:]}"
    if failed:  # --json: the error is also the one document on stdout
        assert result == {"error": errors[0].removeprefix("error: "), "exit_code": code}
    written = "".join(p.read_text(errors="replace") for p in tmp.iterdir() if p.is_file())
    for text in (out, err, written):
        assert KEY not in text
    if result is not None and not failed:
        if script == "bench":  # a printed result always has its records and log entry
            lines = (tmp / "records.jsonl").read_text().splitlines()
            assert len(lines) == result["requests"]["sent"] and all(json.loads(line) for line in lines)
            assert "## " in (tmp / "log.md").read_text()
        if script == "ppl" and fault.startswith(("logprob", "prompt_logprobs")):
            assert result["stopped"].startswith("server error") and len(result["windows"]) == 1
        if script == "metrics" and fault == "metrics_nan":
            assert any("NaN or Inf" in w for w in result["warnings"])
    if fault in ("never_answers", "slow_drip_head"):  # a busy server is not an unreachable one
        assert re.search(r"timed out after [0-9.]+ s \(--timeout 1\): .*raise --timeout", out + err), err[-300:]


ROWS = ["healthy", *FAULTS, "refused"]


@pytest.mark.parametrize("script", sorted(MAINS))
def test_every_fault(script, tmp_path, monkeypatch, capsys):
    """One script through the whole table (one test per script keeps the table in one place)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INFER_API_KEY", KEY)
    monkeypatch.delenv("INFER_URL", raising=False)
    assert HANGS <= set(FAULTS)
    failures = []
    for fault in ROWS:
        tmp = tmp_path / fault
        tmp.mkdir()
        timeout_s = 1 if fault in HANGS and expected(script, fault) != HEALTHY[script] else 30
        if fault == "refused":
            code = run_guarded(MAINS[script], argv_of(script, refused_url(), tmp, timeout_s), timeout_s, lambda: 0.0)
        else:
            server = FaultServer(FAULTS.get(fault))
            try:
                code = run_guarded(MAINS[script], argv_of(script, server.url, tmp, timeout_s), timeout_s,
                                   lambda: server.last_request)
            finally:
                server.close()
        out, err = capsys.readouterr()
        try:
            check_run(script, fault, code, out, err, tmp)
        except AssertionError as exc:
            failures.append(f"{fault}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)


def test_running_out_of_file_descriptors_is_the_clients_fault(tmp_path):
    """bench under a limit of 64 open files with 100 streams: INVALID (exit 4) naming `ulimit -n`
    first, not the server unreachable. A busy host may stall the client too: that reason may follow
    (tests/load/test_bench.py has a run with both)."""
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    # Each stream takes seconds, so the first sockets are still open when the client asks for
    # the 65th however slowly a busy host lets it open them.
    with fault_server(paced(0.5)) as url:
        done = subprocess.run([sys.executable, str(Path(bench.__file__)), "--url", url, "-n", "100", "-c", "100",
                               "--warmup", "0", "--input-tokens", "32", "--output-tokens", "2", "--timeout", "5",
                               "--json"], capture_output=True, text=True, preexec_fn=low_limit, timeout=120)
    assert done.returncode == 4, done.stderr[-500:]
    result = json.loads(done.stdout)
    assert result["verdict"] == "INVALID" and result["requests"]["errors"].get("client_fd_limit")
    assert "unreachable" not in result["requests"]["errors"] and "ulimit -n" in result["verdict_reasons"][0]
