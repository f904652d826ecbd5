"""The call form of printed commands: the Taskfile that ran the script, runnable as printed."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from vllm_server import task_exe

from rooflib.core import taskcall

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


@pytest.mark.parametrize("env, prefix", [
    # the project's include, run from the repository: the short form
    ({"ROOFLINE_TASK": "infer:bench", "ROOFLINE_ROOT_TASKFILE": "/p/Taskfile.yml", "ROOFLINE_USER_WORKING_DIR": "/p"},
     "task infer:"),
    # the same include, run from another folder: the root Taskfile named
    ({"ROOFLINE_TASK": "infer:bench", "ROOFLINE_ROOT_TASKFILE": "/p/Taskfile.yml", "ROOFLINE_USER_WORKING_DIR": "/q"},
     "task -t /p/Taskfile.yml infer:"),
    # the skill's call: the toolbox itself
    ({"ROOFLINE_TASK": "bench", "ROOFLINE_ROOT_TASKFILE": "/s/roofline-toolbox/Taskfile.yml",
      "ROOFLINE_USER_WORKING_DIR": "/s/roofline-toolbox"}, "task -t /s/roofline-toolbox/Taskfile.yml "),
    # a path with a space is quoted for the shell
    ({"ROOFLINE_TASK": "bench", "ROOFLINE_ROOT_TASKFILE": "/my skills/Taskfile.yml", "ROOFLINE_USER_WORKING_DIR": "/"},
     "task -t '/my skills/Taskfile.yml' "),
    # no task ran the script: the toolbox's call form
    ({}, f"task -t {REPO / 'skills' / 'roofline-toolbox' / 'Taskfile.yml'} "),
])
def test_the_call_form_follows_the_taskfile_that_ran_the_script(env, prefix):
    assert taskcall.from_environment(env, SCRIPTS).prefix == prefix


def test_values_are_quoted_for_the_shell():
    command = taskcall.TaskCall("task ").command("bench", [("INFER_URL", "http://h:1/a b"), ("BENCH_C", 2)],
                                                 ["--json-out", "before.json"])
    assert command == "task bench INFER_URL='http://h:1/a b' BENCH_C=2 -- --json-out before.json"
    assert shlex.split(command)[2] == "INFER_URL=http://h:1/a b"


def test_a_task_run_passes_its_own_call_form_to_the_script(tmp_path):
    """Through the project's include and through the toolbox, the script sees what go-task knows."""
    for taskfile, name, expected in ((REPO / "Taskfile.yml", "infer:doctor", "infer:doctor"),
                                     (REPO / "roofline-toolbox" / "Taskfile.yml", "doctor", "doctor")):
        done = subprocess.run([task_exe(), "--dry", "--verbose", "-t", str(taskfile), name], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert f"ROOFLINE_TASK={shlex.quote(expected)}" in done.stderr + done.stdout, done.stderr[-500:]
