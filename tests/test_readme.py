"""The README's quick start: two commands, the second is exactly what CI runs, the first works."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
import subprocess

from vllm_server import REPO, task_exe


def quick_start_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_quick_start_has_two_commands_and_ci_runs_the_second():
    main_job, test_suite = quick_start_commands()
    ci_lines = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1] == test_suite
    assert "export CI=true" in ci_lines


def test_main_job_runs_offline_on_the_embedded_default(tmp_path):
    main_job = quick_start_commands()[0]
    task_part = main_job.rsplit("&& ", 1)[1]
    args = shlex.split(task_part)
    assert args[0] == "task"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}  # no network
    result = subprocess.run([task_exe(), "-d", str(REPO), *args[1:]], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("FITS (marginal): qwen3-32b on NVIDIA H100 SXM 80GB (TP=1)")
