"""Reading the project's Markdown for the documentation tests: frontmatter, headings, tables, code
blocks, links, inline code, numbers (per language) and the `task ...` commands the docs show.

Only what the docs use is parsed: fenced code blocks with ```, pipe tables, inline links.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SKILLS = REPO / "skills"
# Folders whose Markdown is not ours to check: environments, caches, build output.
SKIPPED_DIRS = {".git", ".venv", "node_modules", ".pytest_cache", "build", "__pycache__"}

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_EN_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_RU_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:[\u00a0\u202f]\d{3})+(?!\d)")
_RU_DECIMAL_COMMA = re.compile(r"(?<=\d),(?=\d)")


def markdown_files(root: Path = REPO) -> list[Path]:
    """Every Markdown file of the repository, links followed only where they stay inside it."""
    found = []
    for path in sorted(root.rglob("*.md")):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.intersection(relative.parts) or any(p.endswith(".egg-info") for p in relative.parts):
            continue
        # roofline-toolbox links to skills/roofline-toolbox: read each file once, by its real path.
        if path.resolve() != path.absolute() and path.resolve().is_relative_to(root):
            continue
        found.append(path)
    return found


def split_frontmatter(text: str) -> tuple[dict, str]:
    if not text.startswith("---\n"):
        return {}, text
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header) or {}, body


@dataclass
class Doc:
    """One Markdown file taken apart; `prose` is the text outside code blocks and inline code."""
    path: Path
    frontmatter: dict
    body: str
    code_blocks: list[tuple[str, str]] = field(default_factory=list)
    inline_code: list[str] = field(default_factory=list)
    prose: str = ""

    @classmethod
    def read(cls, path: Path) -> "Doc":
        frontmatter, body = split_frontmatter(path.read_text(encoding="utf-8"))
        doc = cls(path, frontmatter, body)
        doc.code_blocks = [(info.strip(), content) for info, content in _FENCE.findall(body)]
        without_blocks = _FENCE.sub("", body)
        doc.inline_code = _INLINE_CODE.findall(without_blocks)
        doc.prose = _INLINE_CODE.sub(" ", without_blocks)
        return doc

    @property
    def language(self) -> str:
        return "ru" if "roofline-perf-ru" in self.path.parts else "en"

    def headings(self) -> list[tuple[int, str]]:
        return [(len(marks), text) for marks, text in _HEADING.findall(_FENCE.sub("", self.body))]

    def anchors(self) -> set[str]:
        return {slug(text) for _, text in self.headings()}

    def tables(self) -> list[list[list[str]]]:
        """Each pipe table as rows of cells, the |---| separator row left out."""
        tables, current = [], []
        for line in _FENCE.sub("", self.body).splitlines() + [""]:
            if line.startswith("|"):
                if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                    current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            elif current:
                tables.append(current)
                current = []
        return tables

    def links(self) -> list[str]:
        """Link targets in prose (the inline-code spans removed), in order."""
        return _LINK.findall(self.prose)

    def numbers(self) -> list[str]:
        """Numbers in prose and tables, normalized: 262,144 (en) and 262 144 / 3,35 (ru) both
        become plain digits with a decimal point. URLs are left out (links are compared apart)."""
        text = _LINK.sub(" ", self.prose)
        text = re.sub(r"https?://\S+", " ", text)
        if self.language == "ru":
            text = _RU_THOUSANDS.sub(lambda m: re.sub(r"[\u00a0\u202f]", "", m.group()), text)
            text = _RU_DECIMAL_COMMA.sub(".", text)
        else:
            text = _EN_THOUSANDS.sub(lambda m: m.group().replace(",", ""), text)
        return _NUMBER.findall(text)


def slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@dataclass
class TaskCommand:
    source: Path
    line: str
    taskfile: str | None  # the -t argument, if any
    name: str | None      # None for `task --list` and the like
    variables: list[str]


def task_commands(doc: Doc) -> list[TaskCommand]:
    """`task ...` command lines in code blocks and inline code spans."""
    lines = []
    for info, content in doc.code_blocks:
        if info not in ("", "bash", "sh", "shell", "console"):
            continue
        joined = re.sub(r"\\\n\s*", " ", content)
        lines += [re.sub(r"^\$\s+", "", raw).strip() for raw in joined.splitlines()]
    lines += [span.strip() for span in doc.inline_code]
    commands = []
    for line in lines:
        for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
            if part.startswith("task ") and not re.search(r"[<*]", part):  # placeholders, patterns
                commands.append(parse_task_command(doc.path, part))
    return commands


def parse_task_command(source: Path, line: str) -> TaskCommand:
    words = shlex.split(line, posix=True)[1:]
    if "--" in words:
        words = words[:words.index("--")]
    taskfile, name, variables = None, None, []
    index = 0
    while index < len(words):
        word = words[index]
        if word in ("-t", "--taskfile", "-d", "--dir"):
            if word in ("-t", "--taskfile"):
                taskfile = words[index + 1]
            index += 2
            continue
        if word.startswith("-"):
            pass
        elif re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", word):
            variables.append(word.split("=", 1)[0])
        elif name is None and word != "...":
            name = word
        index += 1
    return TaskCommand(source, line, taskfile, name, variables)


def skill_dir_of(path: Path) -> Path | None:
    """The skill folder a file belongs to (what ${CLAUDE_SKILL_DIR} means there)."""
    for parent in [path.parent, *path.parents]:
        if (parent / "SKILL.md").is_file():
            return parent
    return None


def english_russian_pairs() -> list[tuple[Path, Path]]:
    """Each file of the English skill with the file at the same place in the Russian one."""
    english = SKILLS / "roofline-perf"
    russian = SKILLS / "roofline-perf-ru"
    return [(path, russian / path.relative_to(english)) for path in sorted(english.rglob("*.md"))]
