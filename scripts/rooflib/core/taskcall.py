"""How the reader calls a task: the commands a diagnosis prints must run as printed.

The toolbox's tasks that print commands pass go-task's own {{.TASK}} ("bench", or "infer:bench"
when a project Taskfile includes the toolbox), {{.ROOT_TASKFILE}} and {{.USER_WORKING_DIR}} in the
environment of the command line (inline, so that an outer task's values never win). From them:
  included, run from the root Taskfile's folder:  task infer:bench ...
  included, run from elsewhere:                   task -t /path/Taskfile.yml infer:bench ...
  the toolbox itself (a skill's call):            task -t /path/roofline-toolbox/Taskfile.yml bench ...
A command line run without task gets the toolbox's call form, the Taskfile found beside the
scripts (an installed copy) or in the repository.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

ENV_TASK = "ROOFLINE_TASK"
ENV_ROOT = "ROOFLINE_ROOT_TASKFILE"
ENV_CWD = "ROOFLINE_USER_WORKING_DIR"
SCRIPTS = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TaskCall:
    """`prefix + task name` is a runnable call: 'task infer:' or 'task -t /x/Taskfile.yml '."""
    prefix: str

    def command(self, name: str, variables: Sequence[tuple[str, Any]] = (), flags: Sequence[str] = ()) -> str:
        """`task ... bench INFER_URL=... -- --json-out x.json`, each value quoted for the shell."""
        parts = [f"{self.prefix}{name}", *(f"{key}={shlex.quote(str(value))}" for key, value in variables)]
        return " ".join(parts + (["--", *flags] if flags else []))


def toolbox_taskfile(scripts: Path = SCRIPTS) -> Path:
    """The toolbox's Taskfile: beside the scripts folder in an installed copy, in
    skills/roofline-toolbox in the repository."""
    installed = scripts.parent / "Taskfile.yml"
    if installed.exists() and (scripts.parent / "profiles").exists():
        return installed
    return scripts.parent / "skills" / "roofline-toolbox" / "Taskfile.yml"


def from_environment(env: Mapping[str, str] | None = None, scripts: Path = SCRIPTS) -> TaskCall:
    env = os.environ if env is None else env
    task, root, cwd = env.get(ENV_TASK, ""), env.get(ENV_ROOT, ""), env.get(ENV_CWD, "")
    if not task or not root:
        return TaskCall(f"task -t {shlex.quote(str(toolbox_taskfile(scripts)))} ")
    namespace = task.rpartition(":")[0]
    prefix = f"{namespace}:" if namespace else ""
    root_path = Path(root)
    if namespace and cwd and Path(cwd).resolve() == root_path.parent.resolve() and root_path.name in (
            "Taskfile.yml", "Taskfile.yaml", "taskfile.yml", "taskfile.yaml"):
        return TaskCall(f"task {prefix}")
    return TaskCall(f"task -t {shlex.quote(root)} {prefix}")
