"""The house rules a newcomer can check against the code (README, "Architecture").

scripts/ holds only command lines (what a Taskfile runs, and what those run by path); the library
is the package scripts/rooflib. Layers: command line -> domain packages (load, server, sizing,
quality, serving, render) -> core. A command line never imports another one; the library never
imports a command line; core imports nothing of the project outside core; nothing imports in a
circle; nothing under scripts/ edits sys.path; no file names a path of a development machine; no
function is longer than 60 lines; no closure in the load layer changes its enclosing function's state.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from vllm_server import REPO

SCRIPTS = REPO / "scripts"
PACKAGE = SCRIPTS / "rooflib"
TASKFILES = (REPO / "Taskfile.yml", REPO / "skills" / "roofline-toolbox" / "Taskfile.yml")
DOMAINS = {"load", "server", "sizing", "quality", "serving", "render"}


def clis() -> set[str]:
    """The command lines: the scripts a Taskfile runs, and the scripts those run by path."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in TASKFILES)
    found = set(re.findall(r"(?:\{\{\.SCRIPTS \| q\}\}|/scripts)/([a-z_]+)\.py", text))
    for name in list(found):
        tree = ast.parse((SCRIPTS / f"{name}.py").read_text(encoding="utf-8"))
        found |= {node.value[:-3] for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and node.value.endswith(".py") and (SCRIPTS / node.value).is_file()}
    return found


def module_name(path) -> str:
    """`rooflib.load.runner` for scripts/rooflib/load/runner.py, `bench` for scripts/bench.py."""
    parts = path.relative_to(SCRIPTS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = sorted([*SCRIPTS.glob("*.py"), *PACKAGE.rglob("*.py")])
MODULES = {module_name(path): path for path in FILES}


def imports(module: str) -> set[str]:
    """The project modules `module` imports: command lines by name, library modules by dotted name."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name in MODULES and name != module}


def layer(module: str) -> str:
    """"cli", "core", a domain package's name, or "package" (rooflib's own __init__)."""
    parts = module.split(".")
    if parts[0] != "rooflib":
        return "cli"
    return parts[1] if len(parts) > 1 else "package"


def test_the_taskfiles_name_the_clis_we_expect():
    assert {"vram", "roofline", "bench", "sweep", "metrics", "accept", "ppl", "smoke_toolcall", "serve",
            "setup_cpu_vllm", "tiny_model"} <= clis()
    assert not clis() - set(MODULES), "a Taskfile runs a script that does not exist"


def test_scripts_holds_only_command_lines():
    extra = {path.stem for path in SCRIPTS.glob("*.py")} - clis()
    assert not extra, f"{sorted(extra)} in scripts/ are not run by a task: a library module goes in rooflib/, a tool in tools/"


def test_every_library_folder_is_a_layer():
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").is_file()}
    assert folders == DOMAINS | {"core"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    own = layer(module)
    for name in imports(module):
        other = layer(name)
        assert other != "cli", f"{module} imports the command line {name}: move the shared part into rooflib"
        if own == "core":
            assert other in ("core", "package"), f"rooflib.core module {module} imports {name}: core depends on nothing above it"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_under_scripts_edits_sys_path(module):
    text = MODULES[module].read_text(encoding="utf-8")
    assert "sys.path" not in text, f"{module} edits sys.path: a command line finds rooflib beside it"


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


def test_every_command_line_is_a_main_wearing_entry():
    for name in sorted(clis() - {"tiny_model"}):  # tiny_model runs under the engine's Python, without rooflib
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        mains = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
        assert mains and any(ast.unparse(d) == "cli.entry" for d in mains[0].decorator_list), f"{name}.py: @cli.entry def main(argv)"


def test_no_file_names_a_development_machine():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    # Written so as not to match itself; the tool library is a dot-folder, not an attribute
    # (`torch.library`).
    pattern = re.compile(r"/w[o]rk/|shared/(?:research|notes)|(?:^|[\s/\"'`(])\.l[i]brary\b")
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
                             "tests/core/test_common.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    passed = [line for line in result.stdout.splitlines() if " PASSED " in line]
    assert result.returncode == 0 and len(passed) > 2, result.stdout[-2000:]
    assert {line.split()[0] for line in passed} in ({"[gw0]"}, {"[gw1]"}), passed
    assert all(line.rstrip().endswith("@tests/core/test_common.py") for line in passed), passed


LONGEST_FUNCTION = 60  # lines, decorators not counted
LONG_FOR_NOW = {("rooflib/server/engine_metrics.py", "report")}  # rewritten on the diagnosis branch


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_longer_than_sixty_lines():
    offenders = []
    for path in sorted(SCRIPTS.rglob("*.py")):
        name = path.relative_to(SCRIPTS).as_posix()
        for function in functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines = function.end_lineno - function.lineno + 1
            if lines > LONGEST_FUNCTION and (name, function.name) not in LONG_FOR_NOW:
                offenders.append(f"{name}:{function.lineno} {function.name} ({lines} lines)")
    assert not offenders, "split into well-named functions: " + ", ".join(offenders)


MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "add", "discard", "update", "setdefault"}


def bound_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names a function binds: its parameters and what it (or a function inside it) assigns."""
    arguments = function.args
    names = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                             *filter(None, [arguments.vararg, arguments.kwarg])]}
    return names | {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}


def enclosing_state(outer: ast.FunctionDef | ast.AsyncFunctionDef, inner: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """What `inner`, defined in `outer`, changes of `outer`'s variables: a `nonlocal`, an item or
    attribute assigned, or a list, dict or set changed in place."""
    outers = bound_names(outer) - bound_names(inner)
    found = [f"nonlocal {', '.join(node.names)}" for node in ast.walk(inner) if isinstance(node, ast.Nonlocal)]
    for node in ast.walk(inner):
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            base = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            base = node.func.value
        else:
            continue
        if isinstance(base, ast.Name) and base.id in outers:
            found.append(ast.unparse(node))
    return found


def test_no_nested_function_in_the_load_layer_holds_run_state():
    """A closure that changes its enclosing function's variables hides a run's state: a small
    class, or plain functions taking the state, say what it is (issue #21)."""
    offenders = []
    for path in sorted((PACKAGE / "load").rglob("*.py")):
        for outer in functions(ast.parse(path.read_text(encoding="utf-8"))):
            for inner in functions(outer):
                if inner is not outer:
                    offenders += [f"{path.name}: {outer.name}.{inner.name}: {what}" for what in enclosing_state(outer, inner)]
    assert not offenders, offenders
