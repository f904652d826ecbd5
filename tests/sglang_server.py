"""Start and stop a real SGLang (its CPU engine) for the tests, through `task serve` as a user would.

`running_sglang(...)` is a context manager, as vllm_server.running_vllm: it runs the set-up (the
engine built once into the cache, the tiny model), picks a free loopback port, starts
`task serve INFER_PROFILE=cpu-tiny-sglang PORT=<port> -- --set ...`, waits for /health, yields a
`Server`, then stops the engine with SIGINT (what Ctrl-C sends) and checks that the port is free.
When the engine cannot be set up or started it raises `ServerUnavailable` with one line that
says why; conftest turns that into a skip locally and a failure in CI.
"""
from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from vllm_server import TOOLBOX, Server, ServerUnavailable, serving, task_exe

from rooflib.serving import profiles

PROFILE = "cpu-tiny-sglang"
STARTUP_TIMEOUT_S = float(os.environ.get("ROOFLINE_SGLANG_STARTUP_TIMEOUT", "600"))


def setup() -> dict:
    """Build SGLang's CPU engine and the tiny model (cached after the first run)."""
    cmd = [task_exe(), "-t", str(TOOLBOX), "setup-cpu-sglang", "--", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServerUnavailable(f"building SGLang's CPU engine failed ({tail}); run `task infer:setup-cpu-sglang` to see why")
    return json.loads(result.stdout)


def extra_args(*more: str) -> str:
    """A `--set extra_args=[...]` value: the profile's own extra arguments, then `more` (a --set
    replaces the whole list)."""
    _, profile = profiles.with_overrides(PROFILE, ())
    return "extra_args=" + json.dumps([*profile.get("extra_args", []), *more])


@contextmanager
def running_sglang(log_dir: Path, sets: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[Server]:
    """A real SGLang serving tiny-qwen3 with the profile's keys overridden by `sets`."""
    setup()
    with serving(PROFILE, sets, log_dir, "SGLang", "tiny-qwen3", env, STARTUP_TIMEOUT_S) as server:
        yield server
