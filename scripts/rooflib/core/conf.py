"""Settings: one order of resolution for every script.

Command-line flag (the task passes task arguments as flags), then the process environment, then
`inference.env` in the current directory, then the built-in default.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Mapping

from rooflib.core.errors import UsageError
from rooflib.core.fileio import MAX_SETTINGS_BYTES, read_bounded
from rooflib.core.redaction import MIN_MASKED_CHARS, SECRET_SETTINGS, add_secret

DEFAULT_URL = "http://127.0.0.1:8000"
ENV_FILE_NAME = "inference.env"
REPO_ROOT = Path(__file__).resolve().parents[3]
# In the repository scripts/ sits beside roofline-toolbox/; in an installed copy
# (scripts/install_skills.py) it sits inside it, next to profiles/ and k8s/.
TOOLBOX_DIR = REPO_ROOT if (REPO_ROOT / "profiles").is_dir() else REPO_ROOT / "roofline-toolbox"
PROFILES_DIR = TOOLBOX_DIR / "profiles"


_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")


def parse_env_file(text: str) -> dict[str, str]:
    """Parse `KEY=VALUE` lines (dotenv style): comments, blank lines, `export`, quotes.

    Values are never evaluated by a shell: `$(...)` stays literal text.
    """
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if not match:
            raise UsageError(f"{ENV_FILE_NAME} line {number} is not KEY=VALUE: fix or remove it")
        key, value = match.groups()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        else:
            value = re.sub(r"\s+#.*$", "", value)
        values[key] = value
    return values


def load_env_file(path: str | os.PathLike | None = None) -> dict[str, str]:
    """Read `inference.env` (or `path`, or $INFER_ENV_FILE); a missing default file is empty.
    The secrets in it are registered (add_secret) as it is read."""
    explicit = path or os.environ.get("INFER_ENV_FILE")
    file = Path(explicit) if explicit else Path.cwd() / ENV_FILE_NAME
    if not file.exists():
        if explicit:
            raise UsageError(f"env file {file} does not exist: create it or drop --env-file")
        return {}
    values = parse_env_file(read_bounded(file, "env file", MAX_SETTINGS_BYTES))
    for name in SECRET_SETTINGS:
        add_secret(values.get(name))
    return values


class Settings:
    """Resolve a named setting: flag value, then environment, then inference.env, then default.

    An empty flag value means "not given", because the Taskfile passes every task variable as a
    flag, empty when the user did not set it.
    """

    def __init__(self, env_file: Mapping[str, str], environ: Mapping[str, str] | None = None):
        self.env_file = env_file
        self.environ = os.environ if environ is None else environ

    def get(self, name: str, flag_value: Any = None, default: Any = None) -> Any:
        if flag_value not in (None, ""):
            return flag_value
        if self.environ.get(name):
            return self.environ[name]
        if self.env_file.get(name):
            return self.env_file[name]
        return default

    def source(self, name: str, flag_value: Any = None) -> str:
        """Where a setting came from, for `--verbose` style reports."""
        if flag_value not in (None, ""):
            return "argument"
        if self.environ.get(name):
            return "environment"
        if self.env_file.get(name):
            return ENV_FILE_NAME
        return "default"


def cache_dir() -> Path:
    """The project's cache: the CPU vLLM venv, the tiny models, fetched model configs."""
    return Path(os.environ.get("ROOFLINE_CACHE_DIR") or Path.home() / ".cache" / "roofline")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(load_env_file(getattr(args, "env_file", None)))


def normalize_url(url: str) -> str:
    """Base URL without a trailing slash or `/v1`: scripts add `/v1/...` themselves."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", url):
        raise UsageError(f"URL {url!r} is not http(s)://host[:port]: set INFER_URL like {DEFAULT_URL}")
    return url[:-3] if url.endswith("/v1") else url


def api_key(settings: Settings) -> str | None:
    """INFER_API_KEY: the task argument (the Taskfile hands `INFER_API_KEY=...` over as
    ROOFLINE_TASK_API_KEY), the environment or inference.env; None when not set."""
    key = settings.get("INFER_API_KEY", os.environ.get("ROOFLINE_TASK_API_KEY")) or None
    add_secret(key)
    return key


def server_settings(args: argparse.Namespace, settings: Settings | None = None) -> tuple[str, str | None]:
    """The (base URL, API key) to use; the key is never printed. Pass the settings already
    read, so inference.env is read once."""
    settings = settings or settings_from_args(args)
    url = settings.get("INFER_URL", getattr(args, "url", ""), DEFAULT_URL)
    key = api_key(settings)
    # e.g. `task VAR='http://host/{{.INFER_API_KEY}}'`, which go-task expands. A key too short to
    # mask (add_secret) is not looked for either: "abc" is in many a URL.
    if key and len(key) >= MIN_MASKED_CHARS and key in url:
        raise UsageError("the server URL contains the API key: give the key only as INFER_API_KEY")
    return normalize_url(url), key
