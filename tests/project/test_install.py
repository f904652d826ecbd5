"""`task install` copies the skills so that the documented commands work from the installed copy."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import install_skills
import pytest
from markdown_doc import Doc, markdown_files
from vllm_server import REPO, task_exe


def run(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    """Run `task` as a user would: a fresh HOME, this venv's python3 and task first on PATH."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home)}
    return subprocess.run([task_exe(), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The skills installed with the documented project task into a fresh folder."""
    target = tmp_path_factory.mktemp("skills")
    result = run(["-d", str(REPO), "install", f"TARGET={target}"], cwd=target, home=target)
    assert result.returncode == 0, result.stderr
    return target


@pytest.fixture()
def elsewhere(tmp_path) -> Path:
    """A working folder unrelated to the repository and the install."""
    return tmp_path


def test_install_lays_out_skills_and_toolbox_without_links(installed):
    assert {p.name for p in installed.iterdir()} == {"roofline-perf", "roofline-perf-ru", "roofline-toolbox"}
    assert (installed / "roofline-toolbox" / "scripts" / "rooflib" / "core" / "cli.py").is_file()
    assert (installed / "roofline-toolbox" / "profiles" / "cpu-tiny.yaml").is_file()
    assert (installed / "roofline-toolbox" / "k8s" / "bench-job.yaml.j2").is_file()  # task bench-job renders it
    assert not [p for p in installed.rglob("*") if p.is_symlink()]
    assert not list(installed.rglob("__pycache__"))


def test_install_ships_only_what_the_tasks_run(installed):
    # The list is written out so that a new script is a decision, not an accident.
    scripts = installed / "roofline-toolbox" / "scripts"
    assert sorted(p.name for p in scripts.glob("*.py")) == [
        "accept.py", "bench.py", "bench_job.py", "compare.py", "doctor.py", "merge.py", "metrics.py", "ppl.py",
        "report.py", "roofline.py", "serve.py", "setup_cpu_sglang.py", "setup_cpu_vllm.py", "smoke_toolcall.py", "sweep.py", "tiny_model.py",
        "tune.py", "vram.py"]
    assert sorted(p.name for p in scripts.iterdir() if p.is_dir()) == ["data", "rooflib"]
    shipped = {str(p.relative_to(scripts)) for p in (scripts / "rooflib").rglob("*") if p.is_file()}
    assert shipped == {str(p.relative_to(REPO / "scripts")) for p in (REPO / "scripts" / "rooflib").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts}


def test_every_installed_script_starts_from_the_install(installed, elsewhere):
    scripts = installed / "roofline-toolbox" / "scripts"
    taskfile = (installed / "roofline-toolbox" / "Taskfile.yml").read_text(encoding="utf-8")
    commands = sorted(set(re.findall(r"\{\{\.SCRIPTS \| q\}\}/([a-z_]+\.py)", taskfile)))
    assert commands
    for script in (scripts / name for name in commands):
        result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                                cwd=elsewhere, timeout=60)
        assert result.returncode == 0 and "Examples:" in result.stdout, f"{script.name}: {result.stderr}"


def test_installed_references_resolve(installed):
    for path in markdown_files(installed):
        doc = Doc.read(path)
        for target in doc.links():
            if target.startswith(("http://", "https://", "#")):
                continue
            assert (path.parent / target.partition("#")[0]).exists(), f"{path}: {target}"


def test_documented_serve_dry_run_works_from_the_install(installed, elsewhere):
    taskfile = installed / "roofline-perf" / ".." / "roofline-toolbox" / "Taskfile.yml"
    result = run(["-t", str(taskfile), "serve", "INFER_PROFILE=cpu-tiny", "--", "--dry-run", "--json"],
                 cwd=elsewhere, home=elsewhere)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["profile"] == str(installed / "roofline-toolbox" / "profiles" / "cpu-tiny.yaml")
    assert "--served-model-name" in plan["command"]


def test_documented_vram_works_from_the_install(installed, elsewhere):
    taskfile = installed / "roofline-perf" / ".." / "roofline-toolbox" / "Taskfile.yml"
    result = run(["-t", str(taskfile), "vram", "MODEL=qwen3-32b", "GPU=h100", "CTX=32768", "--", "--json"],
                 cwd=elsewhere, home=elsewhere)
    assert result.returncode in (0, 1), result.stderr  # 1 = does not fit: still a full answer
    assert json.loads(result.stdout)["kv_bytes_per_token"] == 262144


def test_install_replaces_an_earlier_install(installed, capsys):
    stale = installed / "roofline-perf" / "stale.md"
    stale.write_text("left over from an older version\n")
    assert install_skills.main(["--target", str(installed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["installed"][0] == str(installed / "roofline-perf")
    assert not stale.exists()


def test_install_leaves_a_foreign_folder_alone(tmp_path, capsys):
    foreign = tmp_path / "roofline-perf"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    assert install_skills.main(["--target", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "not a Roofline install" in error
    assert (foreign / "notes.txt").read_text() == "mine\n"
    assert not (tmp_path / "roofline-toolbox").exists()


def test_install_rejects_a_file_as_target(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("")
    assert install_skills.main(["--target", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_help_shows_examples():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "install_skills.py"), "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert "Examples:" in result.stdout and "Exit codes:" in result.stdout


def test_plugin_marketplace_lists_the_repository_as_one_plugin():
    """`/plugin marketplace add <repo>` + `/plugin install roofline@roofline-skills` install the whole
    repository (source ./), so the toolbox and scripts the skills call come with them."""
    marketplace = json.loads((REPO / ".claude-plugin" / "marketplace.json").read_text())
    plugin = json.loads((REPO / ".claude-plugin" / "plugin.json").read_text())
    # Names Claude Code reserves for Anthropic's own marketplaces (code.claude.com plugin-marketplaces).
    assert marketplace["name"] not in {"claude-code-marketplace", "claude-code-plugins", "claude-plugins-official",
                                       "agent-skills", "anthropic-agent-skills", "anthropic-plugins"}
    [entry] = marketplace["plugins"]
    assert entry["source"] == "./" and entry["name"] == plugin["name"] == "roofline"
    assert marketplace["owner"]["name"]
    skills = {p.parent.name for p in (REPO / "skills").glob("*/SKILL.md")}
    assert skills == {"roofline-perf", "roofline-perf-ru"}
    # The toolbox the skills go through is a real folder beside them: `claude plugin validate` reads
    # no symlink in skills/ (and warns about one), and an install copies it as it is.
    toolbox = REPO / "skills" / "roofline-perf" / ".." / "roofline-toolbox"
    assert (toolbox / "Taskfile.yml").is_file() and not toolbox.is_symlink()
    assert not [p for p in (REPO / "skills").rglob("*") if p.is_symlink()]


def test_documented_commands_quote_the_skill_dir():
    """${CLAUDE_SKILL_DIR} holds the user's home folder, which may have a space: every command and
    the allowed-tools rule keep it inside double quotes."""
    docs = [*REPO.glob("skills/*/SKILL.md"), *REPO.glob("skills/*/references/*.md"), REPO / "README.md"]
    uses = [(path.name, line) for path in docs for line in path.read_text().splitlines() if "${CLAUDE_SKILL_DIR}" in line]
    assert len(uses) > 20
    for name, line in uses:
        for use in re.finditer(r"\S*\$\{CLAUDE_SKILL_DIR\}\S*", line):
            assert use.group(0).startswith(('"${CLAUDE_SKILL_DIR}', '`"${CLAUDE_SKILL_DIR}')), f"{name}: {line}"
