"""Hostile values through `task` itself, in every variable of every toolbox task, PYTHON included.

PYTHON is a recording program at a path with spaces, quotes, `$(...)` and `;` in it: it writes
the argv and environment it got to a file. Every task is run with every variable set to a value
holding quotes, `$(...)`, backticks, `;`, a newline and spaces; each value must arrive as one
argument, byte for byte, and no shell must run any part of it (a file would appear).

`{{...}}` is go-task's own template syntax: go-task expands it in a `task VAR=value` argument
before the Taskfile sees the value (its design; nothing in a Taskfile can stop it), so such
values must travel through the environment, where they arrive literally. Both facts are tested:
the documentation (references/faults.md) says so.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[2]
TOOLBOX = ROOT / "roofline-toolbox" / "Taskfile.yml"
HOSTILE = "it's \"q\" $(touch {d}/PWNED1) `touch {d}/PWNED2`; touch {d}/PWNED3 | x & y\nline2 *"
PAIR = re.compile(r"(--?[\w-]+) \{\{\.(\w+)(?: \| default \"[^\"]*\")? \| q\}\}")


@pytest.fixture
def recorder(tmp_path):
    """A PYTHON that records its argv: at a path a shell would split and run parts of."""
    folder = tmp_path / "py dir 'q' \"dq\" $(touch PWNED0); x"
    folder.mkdir()
    program = folder / "python"
    program.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                       "with open(os.environ['RECORD'], 'a') as f:\n"
                       "    f.write(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}) + '\\n')\n",
                       encoding="utf-8")
    program.chmod(0o755)
    return program


def toolbox_tasks() -> dict[str, list[tuple[str, str]]]:
    """task name -> the (flag, VARIABLE) pairs its command passes."""
    tasks = yaml.safe_load(TOOLBOX.read_text(encoding="utf-8"))["tasks"]
    # Flags inside {{if ...}}...{{end}} are passed only sometimes (vram's --url when MODEL is empty).
    return {name: PAIR.findall(re.sub(r"\{\{if [^}]*\}\}.*?\{\{end\}\}", "", " ".join(spec["cmds"])))
            for name, spec in tasks.items()}


def run(task, args, tmp_path, env=None):
    record = tmp_path / "record.jsonl"
    record.unlink(missing_ok=True)
    done = subprocess.run([task, "-t", str(TOOLBOX), *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={**os.environ, "RECORD": str(record), **(env or {})})
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_vram_without_a_model_passes_the_server_url_as_one_argument(task, recorder, tmp_path):
    hostile = HOSTILE.format(d=tmp_path)
    (call,) = run(task, ["vram", f"PYTHON={recorder}", f"INFER_URL={hostile}"], tmp_path)
    assert call["argv"][call["argv"].index("--url") + 1] == hostile
    no_shell_ran(tmp_path)


def no_shell_ran(tmp_path: Path) -> None:
    assert not list(tmp_path.rglob("PWNED*")), "a shell ran part of a value"


@pytest.mark.parametrize("name", sorted(toolbox_tasks()))
def test_every_variable_arrives_as_one_literal_argument(task, recorder, tmp_path, name):
    pairs = toolbox_tasks()[name]
    hostile = HOSTILE.format(d=tmp_path)
    values = {var: f"{var}={hostile}" for _, var in pairs}
    args = [name, f"PYTHON={recorder}", *(f"{var}={value}" for var, value in values.items()),
            f"INFER_API_KEY={hostile}", "--", "--extra", "a b;c"]
    (call,) = run(task, args, tmp_path)
    argv = call["argv"]
    for flag, var in pairs:
        assert argv[argv.index(flag) + 1] == values[var], (flag, var)
    assert argv[-2:] == ["--extra", "a b;c"]
    # The key travels in the environment, never on the command line (`ps` shows that).
    assert call["env"]["ROOFLINE_TASK_API_KEY"] == hostile and hostile not in argv
    no_shell_ran(tmp_path)


def test_template_syntax_from_the_environment_arrives_literally(task, recorder, tmp_path):
    secret = "sk-never-expanded"
    env = {"INFER_URL": "http://h/{{.INFER_API_KEY}}", "INFER_MODEL": '{{env "HOME"}}',
           "INFER_API_KEY": secret, "PYTHON": str(recorder)}
    (call,) = run(task, ["bench"], tmp_path, env)
    argv = call["argv"]
    assert argv[argv.index("--url") + 1] == "http://h/{{.INFER_API_KEY}}"
    assert argv[argv.index("--model") + 1] == '{{env "HOME"}}'
    assert secret not in " ".join(argv)


def test_go_task_expands_template_syntax_in_a_command_line_value(task, recorder, tmp_path):
    """go-task's behaviour, documented in references/faults.md: this is why values holding
    `{{` go through the environment, and why a URL holding the key is refused by the scripts."""
    (call,) = run(task, ["bench", f"PYTHON={recorder}", "INFER_MODEL={{.TASK}}"], tmp_path)
    assert call["argv"][call["argv"].index("--model") + 1] == "bench"


def test_a_url_holding_the_key_is_refused(tmp_path, monkeypatch, capsys):
    import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INFER_API_KEY", "sk-expanded-into-the-url")
    assert bench.main(["--url", "http://127.0.0.1:9/sk-expanded-into-the-url"]) == 2
    err = capsys.readouterr().err
    assert "contains the API key" in err and "sk-expanded" not in err


def test_project_taskfile_quotes_python_everywhere():
    for taskfile in (ROOT / "Taskfile.yml", TOOLBOX):
        text = taskfile.read_text(encoding="utf-8")
        assert "{{.PYTHON}}" not in text
        commands = [c for spec in yaml.safe_load(text)["tasks"].values() for c in spec.get("cmds", [])
                    if isinstance(c, str)]
        for command in commands:
            unquoted = re.findall(r"\{\{\.(\w+)(?: \| default \"[^\"]*\")?\}\}", command)
            assert set(unquoted) <= {"CLI_ARGS"}, (taskfile.name, command)
