"""What the CPU engine set-ups share (setup_cpu_vllm.py, setup_cpu_sglang.py): a lock over the
cache, an install step whose output goes to stderr and whose failure is one line, and the tiny
local models (scripts/tiny_model.py) both engines serve, built once into <cache>/models/v2/.
"""
from __future__ import annotations

import fcntl
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

from rooflib.core import printing
from rooflib.core.conf import cache_dir
from rooflib.core.errors import ServerError

# name -> tiny_model.py arguments
MODELS = {
    "tiny-qwen3": ["--arch", "qwen3"],
    "tiny-llama": ["--arch", "llama"],
    "tiny-gemma3": ["--arch", "gemma3"],
    "tiny-deepseek": ["--arch", "deepseek"],
    "tiny-qwen3-trained": ["--arch", "qwen3", "--train-steps", "80"],
    "tiny-bert": ["--arch", "bert"],  # a pooling model: embeddings and score (profile cpu-tiny-pooling)
    "tiny-blip2": ["--arch", "blip2"],  # a vision-language model: chat with an image (profile cpu-tiny-vlm)
}
# v2: the models always speak (tiny_model.py: no token that decodes to no text). A cache that holds
# the older ones (at <cache>/models/<name>) gets these built beside them.
MODELS_GENERATION = "v2"
# The lock both set-ups take while they build a model (setup_cpu_vllm holds it for its whole run).
MODELS_LOCK = "setup.lock"


@contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def run(cmd: list[str], what: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
    """One install step: its output on stderr (the progress a user watches), a failure one line."""
    printing.progress(f"{what}: {' '.join(cmd)}")
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env, cwd=cwd)
    if result.returncode != 0:
        raise ServerError(f"{what} failed with status {result.returncode} (output above)")


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / MODELS_GENERATION / name


def ensure_model(name: str, python: Path, builder: Path) -> Path:
    """The tiny model `name`, built by `builder` (scripts/tiny_model.py, beside the set-up that
    runs it) under `python` (an engine's, which has torch and transformers)."""
    out = model_dir(name)
    if not (out / "config.json").exists():
        run([str(python), str(builder), "--out", str(out), *MODELS[name]], f"building {name}")
    return out
