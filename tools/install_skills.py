#!/usr/bin/env python3
"""Install the Roofline skills into a skills folder (Claude Code's ~/.claude/skills by default).

Copies roofline-perf and roofline-perf-ru (each with its references) and, beside them,
roofline-toolbox with its Taskfile, profiles, Kubernetes template, the command lines its tasks run, the library package
they import (scripts/rooflib, with its catalogs and templates) and the sample data; nothing else, so that the command the skills
document, `task -t "${CLAUDE_SKILL_DIR}/../roofline-toolbox/Taskfile.yml" <task>`, works from the
installed copy. An earlier install is replaced; a folder of the same name that is not Roofline's
is left alone (exit 2). The tasks need python3 with httpx, tiktoken, jinja2, pyyaml and go-task
(`python3 -m pip install httpx tiktoken jinja2 pyyaml go-task-bin==3.54.0`); unlike the Claude
Code plugin, whose hook installs them, a skills folder has no way to do it itself.

Examples:
  install_skills.py
  install_skills.py --target ./.claude/skills
  install_skills.py --target /tmp/skills --json

Exit codes: 0 installed, 2 bad target (a file, or a folder that is not a Roofline install).
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Sequence

# A project tool, not shipped: it imports the library from the scripts folder it installs.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from rooflib.core import (
    cli,  # noqa: E402
    printing,  # noqa: E402
)
from rooflib.core.errors import UsageError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SKILLS = ("roofline-perf", "roofline-perf-ru")
TOOLBOX = "roofline-toolbox"
RUNTIME = "httpx tiktoken jinja2 pyyaml go-task-bin==3.54.0"
DEFAULT_TARGET = "~/.claude/skills"
# What an earlier install of each folder contains; anything else under that name is not ours.
SIGNATURE = {**{name: f"SKILL.md:name: {name}" for name in SKILLS}, TOOLBOX: "Taskfile.yml:Roofline toolbox"}
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")
PACKAGE = "rooflib"  # the library the command lines import, with its catalogs and templates
SAMPLE_DATA = "data"  # the sample inputs the command lines default to and the docs name


def shipped_scripts(source: Path = REPO) -> list[str]:
    """The command lines the toolbox's tasks run, and the ones they run by path, by file name.

    The library package ships whole beside them (`PACKAGE`); the project's own tools (this
    installer, under tools/) and test instruments (under benchmarks/) do not ship.
    """
    scripts = source / "scripts"
    taskfile = (source / "skills" / TOOLBOX / "Taskfile.yml").read_text(encoding="utf-8")
    todo = re.findall(r"\{\{\.SCRIPTS \| q\}\}/([A-Za-z0-9_]+\.py)", taskfile)
    todo += [str(path.relative_to(scripts)) for path in (scripts / PACKAGE).rglob("*.py")]
    shipped: set[str] = set()
    while todo:
        name = todo.pop()
        if name in shipped:
            continue
        shipped.add(name)
        tree = ast.parse((scripts / name).read_text(encoding="utf-8"))
        # A command line another one runs by path ("tiny_model.py") ships with it.
        todo += [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and node.value.endswith(".py") and (scripts / node.value).is_file()]
    return sorted(name for name in shipped if "/" not in name)


def is_roofline_install(folder: Path, name: str) -> bool:
    file_name, marker = SIGNATURE[name].split(":", 1)
    path = folder / file_name
    return path.is_file() and marker in path.read_text(encoding="utf-8", errors="replace")


def check_target(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise UsageError(f"--target {target} is a file, not a folder")
    for name in (*SKILLS, TOOLBOX):
        existing = target / name
        if (existing.exists() or existing.is_symlink()) and not is_roofline_install(existing, name):
            raise UsageError(f"{existing} exists and is not a Roofline install: move it away or pick another --target")


def stage(name: str, staging: Path, source: Path = REPO) -> None:
    """Build one installed folder under `staging` (real files, no links)."""
    if name in SKILLS:
        shutil.copytree(source / "skills" / name, staging, ignore=_IGNORE)
        return
    staging.mkdir()
    shutil.copy2(source / "skills" / TOOLBOX / "Taskfile.yml", staging / "Taskfile.yml")
    for folder in ("profiles", "k8s"):  # serving profiles; the Kubernetes Job template (task bench-job)
        shutil.copytree(source / "skills" / TOOLBOX / folder, staging / folder, ignore=_IGNORE)
    (staging / "scripts").mkdir()
    for name in shipped_scripts(source):
        shutil.copy2(source / "scripts" / name, staging / "scripts" / name)
    for folder in (PACKAGE, SAMPLE_DATA):
        shutil.copytree(source / "scripts" / folder, staging / "scripts" / folder, ignore=_IGNORE)


def install(target: Path, source: Path = REPO) -> list[str]:
    """Copy the three folders into `target`, each replaced whole, and return what was installed."""
    check_target(target)
    target.mkdir(parents=True, exist_ok=True)
    installed = []
    for name in (*SKILLS, TOOLBOX):
        staging = target / f".{name}.installing"
        shutil.rmtree(staging, ignore_errors=True)
        stage(name, staging, source)
        final = target / name
        if final.is_symlink() or final.is_file():
            final.unlink()
        elif final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        installed.append(str(final))
    return installed


def build_parser():
    p = cli.parser(__doc__)
    p.add_argument("--target", default="", help=f"skills folder to install into (empty: {DEFAULT_TARGET})")
    printing.add_output_args(p)
    return p


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        target = Path(os.path.expanduser(args.target or DEFAULT_TARGET)).absolute()
        installed = install(target)
        taskfile = target / TOOLBOX / "Taskfile.yml"
        result = {"target": str(target), "installed": installed,
                  "try": f"task -t {shlex.quote(str(taskfile))} --list"}
        human = (f"Installed {', '.join(Path(p).name for p in installed)} into {target}\n"
                 f"Try: {result['try']}\n"
                 f"The tasks need, once: python3 -m pip install {RUNTIME}")
        return printing.emit(result, human, args.output)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
