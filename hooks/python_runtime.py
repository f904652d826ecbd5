#!/usr/bin/env python3
"""SessionStart hook of the roofline plugin: the Python runtime the skills' `task` commands need.

Claude Code installs a plugin's files but no Python packages, so on the first session (and again
when requirements.txt changes with a plugin update) this creates a venv in the plugin's persistent
data folder ($CLAUDE_PLUGIN_DATA/venv) with the packages in requirements.txt, go-task among them.
Every session it appends to $CLAUDE_ENV_FILE the line that puts $CLAUDE_PLUGIN_DATA/bin first on
PATH. That folder holds one command, `task`: the venv's go-task with PYTHON set to the venv's
python, so `task -t ".../Taskfile.yml" ...` runs the scripts with their packages, while the
session's own `python3`, `pip` and PYTHON stay the user's.
When the venv cannot be made (offline, no venv module), it says so in one line, naming what to
install by hand, and the session starts anyway; the next session tries again.

Standard library only: it runs before any dependency exists. Linux and macOS (a venv's bin/,
fcntl); on Windows it only names the packages to install by hand.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().with_name("requirements.txt")
# Written after a complete install: a copy of the requirements the venv was made from.
STAMP = "roofline-requirements.txt"


def by_hand() -> str:
    packages = " ".join(shlex.quote(r) for r in REQUIREMENTS.read_text().split())
    return f"install by hand: python3 -m pip install {packages} (the `task` command must end up on PATH)"


def run(cmd: list[str]) -> None:
    """Run one install step; on failure raise with the last line it printed."""
    result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        lines = (result.stderr + result.stdout).strip().splitlines() or [f"exit {result.returncode}"]
        raise RuntimeError(f"`{Path(cmd[0]).name} {' '.join(cmd[1:3])}` failed: {lines[-1].strip()}")


def ensure_venv(venv: Path) -> bool:
    """Make the venv unless an install of these very requirements is complete; True if it made one."""
    wanted = REQUIREMENTS.read_text()
    stamp = venv / STAMP
    # exists() follows links: a venv whose base Python went away (an upgrade) is made again.
    if stamp.is_file() and stamp.read_text() == wanted and all((venv / "bin" / name).exists()
                                                               for name in ("python", "task")):
        return False
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
         "--quiet", "--retries", "1", "--timeout", "30", "-r", str(REQUIREMENTS)])
    stamp.write_text(wanted)
    return True


def write_task_command(path: Path, venv_bin: Path) -> None:
    path.write_text("#!/bin/sh\n"
                    "# roofline plugin: go-task from the plugin's venv, with that venv's python for the scripts\n"
                    f"export PYTHON={shlex.quote(str(venv_bin / 'python'))}\n"
                    f'exec {shlex.quote(str(venv_bin / "task"))} "$@"\n')
    path.chmod(0o755)


def say(line: str) -> None:
    """One line for the user (systemMessage) and for Claude (additionalContext)."""
    print(json.dumps({"systemMessage": line,
                      "hookSpecificOutput": {"hookEventName": "SessionStart", "additionalContext": line}}))


def main() -> int:
    data = os.environ.get("CLAUDE_PLUGIN_DATA")
    env_file = os.environ.get("CLAUDE_ENV_FILE")
    if not data or not env_file:
        say(f"roofline: this Claude Code gave the plugin's hook no CLAUDE_PLUGIN_DATA/CLAUDE_ENV_FILE; {by_hand()}")
        return 0
    if sys.version_info < (3, 10):
        say(f"roofline: the skills need Python 3.10 or later and python3 is {sys.version.split()[0]}; "
            "install a newer Python 3 as python3")
        return 0
    if os.name == "nt":
        say(f"roofline: the plugin's runtime hook does not support Windows yet; {by_hand()}")
        return 0
    import fcntl  # POSIX only, hence here

    venv, commands = Path(data) / "venv", Path(data) / "bin"
    try:
        commands.mkdir(parents=True, exist_ok=True)
        # Two sessions starting at once must not build the same venv together.
        with open(Path(data) / "venv.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            made = ensure_venv(venv)
            write_task_command(commands / "task", venv / "bin")
    except (OSError, RuntimeError) as exc:
        say(f"roofline: could not set up its Python runtime in {venv} ({exc}); {by_hand()}")
        return 0
    with open(env_file, "a") as out:
        out.write(f'export PATH={shlex.quote(str(commands))}:"$PATH"\n')
    if made:
        say(f"roofline: installed its Python runtime (task, httpx, tiktoken, jinja2, pyyaml) in {venv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
