"""The documentation holds together: links resolve, every `task` command shown exists with the
variables it passes, the skills follow the Agent Skills rules, and English and Russian stay in step.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from markdown_doc import REPO, SKILLS, Doc, english_russian_pairs, markdown_files, skill_dir_of, task_commands

TOOLBOX = REPO / "roofline-toolbox" / "Taskfile.yml"
PROJECT = REPO / "Taskfile.yml"
SKILL_NAMES = ("roofline-perf", "roofline-perf-ru")
# The six frontmatter keys every Agent Skills client accepts (agentskills.io/specification).
PORTABLE_KEYS = {"name", "description", "license", "compatibility", "metadata", "allowed-tools"}
_VAR_REFERENCE = re.compile(r"\.([A-Z][A-Z0-9_]*)\b")

DOCS = markdown_files()
PAIRS = english_russian_pairs()


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


def load_taskfile(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def accepted_variables(taskfile: dict, name: str, seen: frozenset = frozenset()) -> set[str]:
    """Variables a task reads: those its definition references, those of the global vars it
    references, those of the global env (given to every task) and of the tasks it calls."""
    task = taskfile["tasks"][name]
    text = yaml.safe_dump(task)
    names = set(_VAR_REFERENCE.findall(text))
    global_vars = taskfile.get("vars") or {}
    for var in list(names):
        if var in global_vars:
            names |= set(_VAR_REFERENCE.findall(yaml.safe_dump(global_vars[var])))
    names |= set(_VAR_REFERENCE.findall(yaml.safe_dump(taskfile.get("env") or {})))
    for command in task.get("cmds") or []:
        if isinstance(command, dict) and "task" in command and command["task"] not in seen:
            called = command["task"].removeprefix("infer:")
            if called in taskfile["tasks"]:
                names |= accepted_variables(taskfile, called, seen | {name})
    return names


def resolve_task(command) -> tuple[dict, str]:
    """(the Taskfile that defines it, the task name in it) for a documented command."""
    toolbox, project = load_taskfile(TOOLBOX), load_taskfile(PROJECT)
    if command.taskfile:
        path = command.taskfile.replace("${CLAUDE_SKILL_DIR}", str(skill_dir_of(command.source) or ""))
        target = Path(path) if Path(path).is_absolute() else command.source.parent / path
        assert target.is_file(), f"{command.source}: -t {command.taskfile} does not exist"
        assert target.resolve() == TOOLBOX.resolve(), f"{command.line}: unexpected Taskfile {target}"
        return toolbox, command.name
    if command.name.startswith("infer:"):
        return toolbox, command.name.removeprefix("infer:")
    if command.name in project["tasks"]:
        return project, command.name
    # References write `task bench` for the toolbox task and say so at the top.
    return toolbox, command.name


def documented_commands():
    return [(doc_path, command) for doc_path in DOCS for command in task_commands(Doc.read(doc_path))
            if command.name]


def test_the_docs_show_task_commands():
    names = {command.name for _, command in documented_commands()}
    assert {"vram", "metrics", "bench", "sweep", "ppl", "smoke-toolcall", "accept", "install"} <= names


@pytest.mark.parametrize("doc_path, command", documented_commands(),
                         ids=lambda value: value.line if hasattr(value, "line") else str(value.relative_to(REPO)))
def test_documented_task_exists_with_its_variables(doc_path, command):
    taskfile, name = resolve_task(command)
    assert name in taskfile["tasks"], f"{doc_path.relative_to(REPO)}: task {name!r} does not exist: {command.line}"
    unknown = set(command.variables) - accepted_variables(taskfile, name)
    assert not unknown, f"{doc_path.relative_to(REPO)}: task {name} does not read {sorted(unknown)}: {command.line}"


@pytest.mark.parametrize("doc_path", DOCS, ids=_ids(DOCS))
def test_relative_links_resolve(doc_path):
    doc = Doc.read(doc_path)
    for target in doc.links():
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc_path.parent / file_part) if file_part else doc_path
        assert linked.exists(), f"{doc_path.relative_to(REPO)}: broken link {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in Doc.read(linked).anchors(), f"{doc_path.relative_to(REPO)}: no heading for #{anchor}"


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_skill_frontmatter_follows_agent_skills_rules(skill):
    path = SKILLS / skill / "SKILL.md"
    doc = Doc.read(path)
    meta = doc.frontmatter
    assert meta["name"] == skill
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", meta["name"]) and len(meta["name"]) <= 64
    assert set(meta) <= PORTABLE_KEYS, f"keys outside the spec: {set(meta) - PORTABLE_KEYS}"
    assert 0 < len(meta["description"]) <= 1024
    assert "<" not in meta["description"] and ">" not in meta["description"]
    assert len(meta.get("compatibility", "")) <= 500
    assert all(isinstance(v, str) for v in meta["metadata"].values())
    assert len(path.read_text(encoding="utf-8").splitlines()) < 500


def test_russian_skill_says_it_is_the_russian_version():
    english = Doc.read(SKILLS / "roofline-perf" / "SKILL.md").frontmatter
    russian = Doc.read(SKILLS / "roofline-perf-ru" / "SKILL.md").frontmatter
    assert re.search(r"[а-яё]", russian["description"], re.I)
    assert "русск" in russian["description"].lower()
    assert "roofline-perf-ru" in english["description"]
    assert (english["metadata"]["language"], russian["metadata"]["language"]) == ("en", "ru")
    for key in ("license", "allowed-tools"):
        assert english[key] == russian[key]
    assert set(english) == set(russian) and set(english["metadata"]) == set(russian["metadata"])


def test_every_russian_file_has_an_english_one():
    english = {p.relative_to(SKILLS / "roofline-perf") for p in (SKILLS / "roofline-perf").rglob("*.md")}
    russian = {p.relative_to(SKILLS / "roofline-perf-ru") for p in (SKILLS / "roofline-perf-ru").rglob("*.md")}
    assert english == russian
    assert len(english) >= 4


@pytest.mark.parametrize("english_path, russian_path", PAIRS, ids=_ids(p for p, _ in PAIRS))
class TestEnglishRussianPair:
    def test_heading_levels(self, english_path, russian_path):
        english, russian = Doc.read(english_path), Doc.read(russian_path)
        assert [level for level, _ in english.headings()] == [level for level, _ in russian.headings()]

    def test_tables_have_the_same_shape(self, english_path, russian_path):
        english, russian = Doc.read(english_path).tables(), Doc.read(russian_path).tables()
        assert [len(t) for t in english] == [len(t) for t in russian], "rows per table"
        assert [[len(row) for row in t] for t in english] == [[len(row) for row in t] for t in russian]

    def test_code_blocks_are_identical(self, english_path, russian_path):
        assert Doc.read(english_path).code_blocks == Doc.read(russian_path).code_blocks

    def test_inline_code_is_identical(self, english_path, russian_path):
        english, russian = Doc.read(english_path), Doc.read(russian_path)
        assert Counter(english.inline_code) == Counter(russian.inline_code)

    def test_links_point_to_the_same_places(self, english_path, russian_path):
        def targets(doc):  # in-page anchors differ by language; their number must not
            return [t.partition("#")[0] or "#" for t in doc.links()]
        assert targets(Doc.read(english_path)) == targets(Doc.read(russian_path))

    def test_numbers_match(self, english_path, russian_path):
        english, russian = Counter(Doc.read(english_path).numbers()), Counter(Doc.read(russian_path).numbers())
        assert english == russian, f"only in English: {english - russian}; only in Russian: {russian - english}"


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_bench_log_example_follows_the_template(skill):
    """references/bench-protocol.md shows an entry with the sections `bench` renders."""
    template = (REPO / "scripts" / "rooflib" / "render" / "templates" / "bench_log_entry.md.j2").read_text(encoding="utf-8")
    doc = Doc.read(SKILLS / skill / "references" / "bench-protocol.md")
    example = next(content for info, content in doc.code_blocks if info == "markdown")
    assert re.findall(r"^### .+$", example, re.M) == re.findall(r"^### .+$", template, re.M)
    table_header = next(line for line in template.splitlines() if line.startswith("| metric"))
    assert table_header in example.splitlines()


def test_readme_and_skills_list_every_exit_code_the_tools_use():
    from rooflib.core import errors
    codes = sorted(value for name, value in vars(errors).items() if name.startswith("EXIT_"))
    readme = (REPO / "README.md").read_text(encoding="utf-8").split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{code}`" in readme for code in codes), (codes, readme)
    for skill in SKILL_NAMES:
        table = (SKILLS / skill / "SKILL.md").read_text(encoding="utf-8")
        assert all(f"\n| {code} |" in table for code in codes), skill


@pytest.mark.parametrize("task", ["vram", "roofline"])
def test_task_list_marks_example_settings_as_optional_not_as_defaults(task):
    desc = load_taskfile(TOOLBOX)["tasks"][task]["desc"]
    assert "optional e.g. " in desc and "[" not in desc, desc
