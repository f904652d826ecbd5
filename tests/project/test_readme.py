"""The README's quick start: two commands, the second is exactly what CI runs, the first works."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
import subprocess

import pytest

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


def install_commands() -> list[str]:
    """The shell commands of the README's "Installing the skills" section, in order."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Installing the skills", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```bash\n(.+?)\n```", section, re.S) for line in block.splitlines()]


@pytest.mark.external  # pip installs the runtime from the package index into a fresh venv
def test_install_section_skills_folder_commands_run(tmp_path):
    """The skills-folder commands as written, on a python3 with nothing installed and a HOME with a
    space; then the skills' documented vram command from the installed copy."""
    pip_line, install_line = [line for line in install_commands() if not line.startswith("claude ")]
    assert pip_line.startswith("python3 -m pip install ") and install_line.startswith("task install ")
    home = tmp_path / "user home"
    home.mkdir()
    python = tmp_path / "python"  # stands for the user's python3: this venv's base Python, bare
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", str(python)], check=True)
    env = {"PATH": f"{python / 'bin'}:/usr/bin:/bin", "HOME": str(home), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def bash(line: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env={**env, **extra}, cwd=cwd,
                              timeout=600)

    for line, cwd in ((pip_line, home), (install_line, REPO)):
        result = bash(line, cwd)
        assert result.returncode == 0, f"{line}: {result.stderr}"
    skill_dir = home / ".claude" / "skills" / "roofline-perf"
    result = bash('task -t "${CLAUDE_SKILL_DIR}/../roofline-toolbox/Taskfile.yml" vram MODEL=qwen3-32b GPU=h100 CTX=32768',
                  home, CLAUDE_SKILL_DIR=str(skill_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("FITS (marginal): qwen3-32b on NVIDIA H100 SXM 80GB (TP=1)")
