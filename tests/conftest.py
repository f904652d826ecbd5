"""Shared fixtures. The real-engine fixtures start one CPU vLLM and one CPU SGLang per test session.

Tests that need a real engine take `vllm_server` (the default cpu-tiny server), `vllm_pooling_server`
(cpu-tiny-pooling, a tiny encoder for embeddings and score), `vllm_vlm_server` (cpu-tiny-vlm, a
tiny BLIP-2 model for chat with an image) or use
`vllm_factory` for one with other flags (`with vllm_factory(sets=["max_num_seqs=2"]) as srv:`);
for SGLang `sglang_server` (cpu-tiny-sglang) and `sglang_factory`. When the engine cannot be
started, they skip with one line locally and FAIL under CI=true: in CI the real-server tests must run.
"""
from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
# The calibration server, a test instrument, lives with the benchmarks (it is not installed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_server import running_sglang
from vllm_server import ServerUnavailable, running_vllm, running_vllm_pooling, running_vllm_vlm, task_exe

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The markers of tests against a real engine (pyproject.toml), and how a failure names them.
REAL_ENGINE_MARKERS = {"real_vllm": "real-vLLM", "real_sglang": "real-SGLang"}
# Under `task test` the toolbox's own plumbing variable is already set (empty): go-task does not
# override a variable the environment has, so the tasks the tests run would not see theirs.
os.environ.pop("ROOFLINE_TASK_API_KEY", None)
# The CPU engines the tests start share this machine's cores with each other, the tests' clients
# and whatever else runs. vLLM's CPU worker binds its threads by default to all the cores but the
# ones it keeps for its own other processes (VLLM_CPU_OMP_THREADS_BIND=auto, one core kept on x86:
# vllm/utils/ompmultiprocessing.py), so on 2 cores every engine of the suite computed on core 0
# ("reserved_cpus=[1]" in each engine's log). A fresh-clone run beside two busy loops (load average
# 34) then had a new engine's worker spend ten minutes importing torch on that core, until its start
# timed out. Unbound, with one thread each (a tiny model gains nothing from more), the kernel
# places them on either core.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    """Ctrl-C reaches the scripts the tests start and signal: a suite a shell started in the
    background without job control (`cmd &`, nohup) inherits SIGINT ignored, every process it
    starts would too (an ignored signal stays ignored across exec), and Python then installs no
    KeyboardInterrupt. A handler, unlike SIG_IGN, is reset to the default in the children."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _unavailable(reason: str, engine: str = "vLLM"):
    if IN_CI:
        pytest.fail(f"real {engine} unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"real {engine} unavailable: {reason}")


@contextmanager
def _started(log_dir: Path, starter=running_vllm, engine: str = "vLLM", **kwargs):
    try:
        cm = starter(log_dir, **kwargs)
        server = cm.__enter__()
    except ServerUnavailable as exc:
        _unavailable(str(exc), engine)
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def task() -> str:
    """The `task` (go-task) the project installs (go-task-bin): missing, the install is broken."""
    return task_exe()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """The cpu-tiny profile served by a real vLLM: `.url`, `.model`, `.log()`."""
    with _started(tmp_path_factory.mktemp("vllm")) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_pooling_server(tmp_path_factory):
    """The cpu-tiny-pooling profile (a tiny BERT encoder) served by a real vLLM: embeddings and score."""
    with _started(tmp_path_factory.mktemp("vllm-pooling"), running_vllm_pooling) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_vlm_server(tmp_path_factory):
    """The cpu-tiny-vlm profile (a tiny BLIP-2 model) served by a real vLLM: chat with an image."""
    with _started(tmp_path_factory.mktemp("vllm-vlm"), running_vllm_vlm) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_factory(tmp_path_factory):
    """Start another real vLLM: `with vllm_factory(sets=[...], model="tiny-llama") as srv:`."""
    def factory(**kwargs):
        return _started(tmp_path_factory.mktemp("vllm"), **kwargs)
    return factory


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory):
    """The cpu-tiny-sglang profile served by a real SGLang (CPU engine): `.url`, `.model`, `.log()`."""
    with _started(tmp_path_factory.mktemp("sglang"), running_sglang, "SGLang") as server:
        yield server


@pytest.fixture(scope="session")
def sglang_factory(tmp_path_factory):
    """Start another real SGLang: `with sglang_factory(sets=["max_num_seqs=2"]) as srv:`."""
    def factory(**kwargs):
        return _started(tmp_path_factory.mktemp("sglang"), running_sglang, "SGLang", **kwargs)
    return factory


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    """A test that opens pages in Chromium needs a program the test set-up installs.

    Under `pytest -n N --dist loadgroup` (what `task test` runs) each group runs in one worker:
    every test of a session server (vLLM's, SGLang's) shares one worker, so the server starts once
    and no other test loads it while a test reads its counters; the other tests go by file, so a
    file's module-scoped servers (a fleet, the trained model) start once too. (A group per test
    for the tests that share no fixture spread tune's tests over the workers: the suite then took
    54 min instead of 44 on the loaded 2-core machine, and a tune test beside two others chose
    another lever.)"""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "browser" in names:
            item.add_marker(pytest.mark.external)
        group = ("vllm-session-server" if "vllm_server" in names else
                 "sglang-session-server" if "sglang_server" in names else item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skipped real-vLLM or real-SGLang test is a failure, whatever made it skip."""
    outcome = yield
    report = outcome.get_result()
    real = next((label for marker, label in REAL_ENGINE_MARKERS.items() if item.get_closest_marker(marker)), None)
    if IN_CI and report.skipped and real:
        report.outcome = "failed"
        report.longrepr = f"{real} test skipped in CI: {report.longrepr}"
