"""Start and stop a real vLLM (CPU build) for the tests, through `task serve` as a user would.

`running_vllm(...)` is a context manager: it runs setup (cached venv + tiny model), picks a free
loopback port, starts `task serve INFER_PROFILE=cpu-tiny PORT=<port> -- --set ...`, waits for
/health, yields a `Server`, then stops the engine with SIGINT (what Ctrl-C sends) and waits.
When the engine cannot be set up or started, it raises `ServerUnavailable` with one line that
says why; conftest turns that into a skip locally and a failure in CI.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence


from rooflib.core.errors import ServerError
from rooflib.serving import engine_setup, profiles

REPO = Path(__file__).resolve().parent.parent
TOOLBOX = REPO / "roofline-toolbox" / "Taskfile.yml"
STARTUP_TIMEOUT_S = float(os.environ.get("ROOFLINE_VLLM_STARTUP_TIMEOUT", "600"))


class ServerUnavailable(Exception):
    pass


@dataclass
class Server:
    url: str
    model: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def task_exe() -> str:
    """The `task` beside this Python (go-task-bin in the venv), else the one on PATH."""
    exe = Path(sys.executable).with_name("task")
    found = str(exe) if exe.exists() else shutil.which("task")
    if not found:
        raise ServerUnavailable("`task` is not installed: pip install -e '.[test]' (it brings go-task-bin)")
    return found


def setup(models: Sequence[str] = ("tiny-qwen3",)) -> dict:
    """Install the CPU vLLM and build the models (cached after the first run)."""
    cmd = [task_exe(), "-t", str(TOOLBOX), "setup-cpu-vllm", "--", "--json", "--models", *models]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServerUnavailable(f"setting up the CPU vLLM failed ({tail}); run `task infer:setup-cpu-vllm` to see why")
    return json.loads(result.stdout)


@contextmanager
def running_vllm(log_dir: Path, sets: Sequence[str] = (), model: str = "tiny-qwen3",
                 env: dict[str, str] | None = None) -> Iterator[Server]:
    """A real vLLM serving `model` (a name from engine_setup.MODELS) with profile overrides."""
    setup([model])
    overrides = list(sets)
    if model != "tiny-qwen3":
        overrides += [f"model={{cache}}/models/{engine_setup.MODELS_GENERATION}/{model}", f"served_model_name={model}"]
    with serving("cpu-tiny", overrides, log_dir, "vLLM", model, env, STARTUP_TIMEOUT_S) as server:
        yield server


@contextmanager
def running_vllm_pooling(log_dir: Path) -> Iterator[Server]:
    """A real vLLM serving the tiny BERT encoder (profile cpu-tiny-pooling): /v1/embeddings, /score."""
    setup(["tiny-bert"])
    with serving("cpu-tiny-pooling", [], log_dir, "vLLM", "tiny-bert", None, STARTUP_TIMEOUT_S) as server:
        yield server


@contextmanager
def running_vllm_vlm(log_dir: Path) -> Iterator[Server]:
    """A real vLLM serving the tiny BLIP-2 model (profile cpu-tiny-vlm): chat with an image."""
    setup(["tiny-blip2"])
    with serving("cpu-tiny-vlm", [], log_dir, "vLLM", "tiny-blip2", None, STARTUP_TIMEOUT_S) as server:
        yield server


@contextmanager
def serving(profile: str, sets: Sequence[str], log_dir: Path, engine: str, model: str,
            env: dict[str, str] | None, startup_timeout_s: float) -> Iterator[Server]:
    """`task serve` of `profile` with `sets` on a free port, until the block ends; the port is
    then free again. Only a failed start is ServerUnavailable: errors inside the block stay theirs."""
    port = profiles.free_port()
    log_path = log_dir / f"{engine.lower()}-{port}.log"
    cmd = [task_exe(), "-t", str(TOOLBOX), "serve", f"INFER_PROFILE={profile}", f"PORT={port}", "--"]
    for item in sets:
        cmd += ["--set", item]
    url = f"http://127.0.0.1:{port}"
    stack = ExitStack()
    try:
        stack.enter_context(profiles.running(cmd, url, log_path, startup_timeout_s, cwd=log_dir,
                                             env={**os.environ, **(env or {})}))
    except ServerError as exc:
        raise ServerUnavailable(f"{engine} did not start: {exc}")
    with stack:
        yield Server(url=url, model=model, log_path=log_path)
    assert_port_released(port, engine)


def assert_port_released(port: int, engine: str, timeout_s: float = 30) -> None:
    """After Ctrl-C the engine (its own process group, under serve.py) must be gone too."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{engine} still listens on port {port} {timeout_s:.0f} s after SIGINT: serve.py did not stop it")
        time.sleep(0.5)
