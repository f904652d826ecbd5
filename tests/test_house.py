"""The house rules a newcomer can check against the code (README, "Architecture").

A command-line script (a CLI: what a Taskfile runs) imports modules, never another CLI; modules
never import a CLI; nothing imports in a circle; no file names a path of a development machine.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from vllm_server import REPO

SCRIPTS = REPO / "scripts"
TASKFILES = (REPO / "Taskfile.yml", REPO / "skills" / "roofline-toolbox" / "Taskfile.yml")


def clis() -> set[str]:
    """The scripts a Taskfile runs, by module name."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in TASKFILES)
    return set(re.findall(r"(?:\{\{\.SCRIPTS \| q\}\}|/scripts)/([a-z_]+)\.py", text))


def imports(module: str) -> set[str]:
    """The project modules `module` imports (scripts/*.py only)."""
    tree = ast.parse((SCRIPTS / f"{module}.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {name for name in names if (SCRIPTS / f"{name}.py").is_file()}


MODULES = sorted(path.stem for path in SCRIPTS.glob("*.py"))


def test_the_taskfiles_name_the_clis_we_expect():
    assert {"vram", "roofline", "bench", "sweep", "metrics", "accept", "ppl", "smoke_toolcall", "serve"} <= clis()
    assert not clis() - set(MODULES), "a Taskfile runs a script that does not exist"


@pytest.mark.parametrize("module", MODULES)
def test_no_script_imports_a_cli(module):
    assert not imports(module) & clis(), f"{module}.py imports a command-line script: move the shared part to a module"


def test_no_import_circle():
    graph = {module: imports(module) for module in MODULES}
    seen: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import circle: " + " -> ".join((*path, module))
        if module in seen:
            return
        for name in sorted(graph[module]):
            visit(name, (*path, module))
        seen.add(module)

    for module in MODULES:
        visit(module, ())


def test_no_file_names_a_development_machine():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"/w[o]rk/|shared/(?:research|notes)|\.l[i]brary")  # written so as not to match itself
    offenders = []
    for name in tracked:
        path = REPO / name
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 5_000_000:
            text = path.read_text(encoding="utf-8", errors="replace")
            offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not offenders, "cite a public source or a document in the repository instead: " + ", ".join(offenders[:5])


def test_task_test_keeps_a_file_in_one_worker():
    """`task test` runs `-n 3 --dist loadgroup` with the groups tests/conftest.py gives: a file's
    tests in one worker, so its module-scoped servers start once (pytest 9.2 broke this once)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                             "tests/test_common.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    passed = [line for line in result.stdout.splitlines() if " PASSED " in line]
    assert result.returncode == 0 and len(passed) > 2, result.stdout[-2000:]
    assert {line.split()[0] for line in passed} in ({"[gw0]"}, {"[gw1]"}), passed
    assert all(line.rstrip().endswith("@tests/test_common.py") for line in passed), passed
