"""The plugin in the real Claude Code CLI, as a new user gets it (tests/claude_code.py pins the client).

The user's machine has Python, git and the client, nothing else: a HOME of its own with a space in
its path, a PATH without the project's venv and without `task`, and the model API is a scripted fake
on loopback. Asked through a skill, the fake model runs the Bash commands the expanded skill
documents, so these tests see what the user would: the plugin validated, added from a git
repository, installed, its hook making the runtime, and the skill's `task` commands running
pre-approved, from folders with and without spaces, to a `vram` answer.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

import claude_code
from conftest import IN_CI
from fake_http import Events, serving
from test_readme import install_commands
from vllm_server import REPO

pytestmark = pytest.mark.external

# The first command the skills document, with ${CLAUDE_SKILL_DIR} expanded by the client.
LIST_COMMAND = re.compile(r'^task -t "(?P<taskfile>[^"\n]+/roofline-toolbox/Taskfile\.yml)" --list$', re.M)
VRAM_ARGS = "vram MODEL=qwen3-32b GPU=h100 CTX=32768 -- --json"


@pytest.fixture(scope="module")
def claude() -> Path:
    try:
        return claude_code.ensure(install_npm_if_missing=IN_CI)
    except claude_code.ClaudeCodeUnavailable as exc:
        if IN_CI:
            pytest.fail(f"Claude Code CLI unavailable in CI: {exc}", pytrace=False)
        pytest.skip(f"Claude Code CLI unavailable: {exc}")


def blocks(body: dict) -> Iterator[dict]:
    """Every content block of a Messages API request, in order (a plain string is one text block)."""
    for message in body["messages"]:
        content = message["content"]
        yield from content if isinstance(content, list) else [{"type": "text", "text": content}]


def block_text(block: dict) -> str:
    """A text block's text, or a tool result's output."""
    content = block.get("content", block.get("text", ""))
    return content if isinstance(content, str) else "\n".join(c.get("text", "") for c in content)


def texts(body: dict) -> str:
    return "\n".join(block_text(b) for b in blocks(body))


def tool_results(body: dict) -> list[tuple[str, bool]]:
    """(output, is_error) of each tool result in the conversation, in order."""
    return [(block_text(b), bool(b.get("is_error"))) for b in blocks(body) if b.get("type") == "tool_result"]


@dataclass
class FakeModel:
    """Anthropic's Messages API, scripted: where the conversation holds the expanded skill, run its
    `--list` command, then `vram` with the same Taskfile; otherwise, or after both, say "done"."""
    requests: list[dict] = field(default_factory=list)

    def reply(self, body: dict) -> dict:
        documented = LIST_COMMAND.search(texts(body))
        done = len(tool_results(body))
        if not documented or done >= 2:
            return {"type": "text", "text": "done"}
        # The vram command as the skill documents its commands: the Taskfile path in double quotes.
        command = documented.group(0) if done == 0 else f'task -t "{documented["taskfile"]}" {VRAM_ARGS}'
        return {"type": "tool_use", "id": f"toolu_{done}", "name": "Bash",
                "input": {"command": command, "description": "Run a Roofline task"}}

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method != "POST" or not path.startswith("/v1/messages"):
            return 404, {"type": "error", "error": {"type": "not_found_error", "message": path}}
        if path.startswith("/v1/messages/count_tokens"):
            return 200, {"input_tokens": 1}
        self.requests.append(body)
        block = self.reply(body)
        stop = "tool_use" if block["type"] == "tool_use" else "end_turn"
        message = {"id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant", "model": body["model"],
                   "content": [block], "stop_reason": stop, "stop_sequence": None,
                   "usage": {"input_tokens": 1, "output_tokens": 1}}
        if not body.get("stream"):
            return 200, message
        start = {**block, "input": {}} if block["type"] == "tool_use" else {"type": "text", "text": ""}
        delta = ({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                 if block["type"] == "tool_use" else {"type": "text_delta", "text": block["text"]})
        return 200, Events([
            {"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
            {"type": "content_block_start", "index": 0, "content_block": start},
            {"type": "content_block_delta", "index": 0, "delta": delta},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
             "usage": {"output_tokens": 1}},
            {"type": "message_stop"},
        ])


@contextmanager
def git_http(root: Path) -> Iterator[str]:
    """Serve the bare repositories under `root` over git's smart HTTP protocol (`git http-backend`),
    which the shallow clone Claude Code makes of a marketplace needs."""
    class GitHandler(BaseHTTPRequestHandler):
        def _backend(self):
            path, _, query = self.path.partition("?")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(root), "GIT_HTTP_EXPORT_ALL": "1",
                   "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
                   "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                   "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                   "GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
            out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
            end_of_head = re.search(rb"\r?\n\r?\n", out)  # CGI: headers, a blank line, the body
            head, payload = (out[:end_of_head.start()], out[end_of_head.end():]) if end_of_head else (out, b"")
            headers = [line.split(": ", 1) for line in head.decode().splitlines() if ": " in line]
            status = next((int(v.split()[0]) for k, v in headers if k.lower() == "status"), 200)
            self.send_response(status)
            for name, value in headers:
                if name.lower() != "status":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _backend

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), GitHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=Roofline tests", "-c", "user.email=tests@example.invalid",
                    "-c", "commit.gpgsign=false", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory) -> Iterator[str]:
    """The working tree as it is now (committed or not), as a git repository served over HTTP."""
    root = tmp_path_factory.mktemp("git")
    work = root / "roofline"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source, copy = REPO / name, work / name
        if not (source.is_symlink() or source.is_file()):
            continue  # deleted in the working tree
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            copy.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, copy)
    git("init", "-q", cwd=work)
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "working tree", cwd=work)
    git("clone", "-q", "--bare", str(work), str(root / "served" / "roofline.git"), cwd=root)
    with git_http(root / "served") as url:
        yield f"{url}/roofline.git"


@dataclass
class Machine:
    """A user's machine: its own HOME, Python, git and `claude` on PATH, the fake model API."""
    home: Path
    env: dict[str, str]
    model: FakeModel

    def run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, cwd=cwd or self.home,
                              timeout=600)


@contextmanager
def clean_machine(root: Path, claude: Path, **env: str) -> Iterator[Machine]:
    """A HOME with a space under `root`; on PATH only `claude`, git and python3, the interpreter this
    venv was made from (a Python with no project packages); `env` added to the environment."""
    home = root / "user home"
    tools = root / "bin"
    home.mkdir()
    tools.mkdir()
    for name, exe in (("claude", claude), ("git", shutil.which("git")),
                      ("python3", Path(sys.base_prefix) / "bin" / "python3")):
        (tools / name).symlink_to(exe)
    path = f"{tools}:/usr/bin:/bin"
    assert shutil.which("task", path=path) is None, "the clean machine must not have task"
    model = FakeModel()
    with serving(model.handle) as api:
        yield Machine(home, {"HOME": str(home), "PATH": path, "LANG": "C.UTF-8",
                             "CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_BASE_URL": api,
                             "ANTHROPIC_API_KEY": "sk-ant-fake-for-tests",
                             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", **env},
                      model)


def install_plugin(machine: Machine, repo_url: str) -> None:
    """The README's commands, <repo> being the git URL."""
    commands = [line for line in install_commands() if line.startswith("claude ")]
    assert commands == ["claude plugin marketplace add <repo>", "claude plugin install roofline@roofline-skills"]
    for line in commands:
        result = machine.run(*shlex.split(line.replace("<repo>", repo_url)))
        assert result.returncode == 0, result.stdout + result.stderr


def ask_skill(machine: Machine, cwd: Path) -> dict:
    """Invoke the English skill with `claude -p` (no prompt can be answered) and return its result."""
    machine.model.requests.clear()
    result = machine.run("claude", "-p", "/roofline:roofline-perf does qwen3-32b with a 32k context fit on an H100?",
                         "--output-format", "json", cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def machine(tmp_path_factory, claude) -> Iterator[Machine]:
    with clean_machine(tmp_path_factory.mktemp("clean machine"), claude) as machine:
        yield machine


@pytest.fixture(scope="module")
def installed(machine, repo_url) -> Machine:
    install_plugin(machine, repo_url)
    return machine


@pytest.mark.parametrize("target", [".", ".claude-plugin/plugin.json"])  # the marketplace with its plugin; the plugin
def test_plugin_validate_finds_no_warnings(machine, target):
    result = machine.run("claude", "plugin", "validate", "--strict", "--json", str(REPO / target))
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["success"], result.stdout
    assert report["manifest"]["warnings"] == [] and report["contents"] == []
    assert report["provides"]["skills"] == ["roofline:roofline-perf", "roofline:roofline-perf-ru"]
    # The plugin directory's own catalog checks (not the plugin's validity) want a listing icon only.
    assert {f["code"] for f in report["directory"]["findings"]} <= {"ICON_MISSING"}


def test_plugin_installs_from_a_git_repository(installed, repo_url):
    known = json.loads((installed.home / ".claude" / "plugins" / "known_marketplaces.json").read_text())
    assert known["roofline-skills"]["source"] == {"source": "git", "url": repo_url}
    listed = json.loads(installed.run("claude", "plugin", "list", "--json").stdout)
    [plugin] = [p for p in listed if p["id"] == "roofline@roofline-skills"]
    assert plugin["enabled"] is True


@pytest.mark.parametrize("folder", ["project", "my project"])
def test_skill_runs_its_tasks_preapproved_on_a_clean_machine(installed, folder):
    """`task ... --list` then `task ... vram`, with task and the packages from the hook's venv only."""
    work = installed.home / folder
    work.mkdir()
    answer = ask_skill(installed, work)
    assert answer["is_error"] is False and answer["permission_denials"] == []
    catalog = json.dumps(installed.model.requests[0])  # the skills the client offers the model
    assert re.search(r"roofline:roofline-perf\b(?!-)", catalog) and "roofline:roofline-perf-ru" in catalog
    [task_list, vram] = tool_results(installed.model.requests[-1])
    assert not task_list[1] and "* vram:" in task_list[0], task_list[0]
    assert not vram[1], vram[0]
    assert json.loads(vram[0])["kv_bytes_per_token"] == 262144
    [venv_task] = (installed.home / ".claude" / "plugins" / "data").glob("*/venv/bin/task")
    assert " " in str(venv_task)  # the skill dir and the venv are under a HOME with a space


def test_offline_the_session_starts_and_claude_is_told_what_to_install(tmp_path, claude, repo_url):
    with clean_machine(tmp_path, claude, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_CONFIG_FILE=os.devnull,
                       PIP_NO_CACHE_DIR="1") as offline:  # nothing listens on port 9
        install_plugin(offline, repo_url)
        ask_skill(offline, offline.home)
        context = texts(offline.model.requests[0])
    assert "roofline: could not set up its Python runtime in " in context
    assert "install by hand: python3 -m pip install 'httpx>=0.27'" in context


def test_hook_offline_says_in_one_line_what_to_install(tmp_path):
    data, env_file = tmp_path / "plugin data", tmp_path / "session.env"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CLAUDE_PLUGIN_DATA": str(data),
           "CLAUDE_ENV_FILE": str(env_file), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1"}  # nothing listens on port 9
    python = Path(sys.base_prefix) / "bin" / "python3"
    result = subprocess.run([str(python), str(REPO / "hooks" / "python_runtime.py")], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stderr == ""
    [line] = result.stdout.splitlines()
    message = json.loads(line)["systemMessage"]
    assert "\n" not in message and "install by hand: python3 -m pip install" in message
    assert "'httpx>=0.27'" in message and " go-task-bin==3.54.0 " in message  # quoted for the shell where needed
    assert not env_file.exists()


def test_hook_installs_what_pyproject_depends_on():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert (REPO / "hooks" / "requirements.txt").read_text().split() == declared


def test_plugin_version_is_the_release_version():
    """A release bumps both (README "Releases"); Claude Code offers an update only when plugin.json's changes."""
    plugin = json.loads((REPO / ".claude-plugin" / "plugin.json").read_text())
    assert plugin["version"] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
