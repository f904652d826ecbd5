"""Shared plumbing for the Roofline scripts: settings, HTTP client, output, errors.

Every script is `main(argv) -> int` over pure functions; this module holds the few things they
all need, so that no script copies them:

- settings resolve in one order: command-line flag (the task passes task arguments as flags),
  process environment, `inference.env` in the current directory, built-in default;
- one httpx client factory (auth header, timeouts, connection limits), never printing the key;
- `--json` output: one JSON document on stdout, progress on stderr;
- errors mapped to exit codes and one-line messages, no tracebacks (`run_main`).

Exit codes shared by all scripts (a script may give 1 and 4 a narrower meaning in its --help):
  0 ok, 1 check failed (does not fit, SLO missed, smoke failed), 2 usage or configuration error,
  3 server unreachable or failing, 4 run invalid, 130 interrupted (partial results written).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

try:
    import httpx
    import yaml  # noqa: F401  (imported here so that a missing dependency fails the same way everywhere)
except ImportError as exc:
    print(f"error: Python package {exc.name!r} is missing: run `pip install -e .` in the Roofline checkout",
          file=sys.stderr)
    sys.exit(2)

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_SERVER = 3
EXIT_INVALID = 4
EXIT_INTERRUPTED = 130

DEFAULT_URL = "http://127.0.0.1:8000"
ENV_FILE_NAME = "inference.env"
REPO_ROOT = Path(__file__).resolve().parent.parent
# In the repository scripts/ sits beside roofline-toolbox/; in an installed copy
# (scripts/install_skills.py) it sits inside it, next to profiles/.
PROFILES_DIR = (REPO_ROOT if (REPO_ROOT / "profiles").is_dir() else REPO_ROOT / "roofline-toolbox") / "profiles"


class UsageError(Exception):
    """Bad input or configuration: exit 2 with a one-line message."""


class ServerError(Exception):
    """The server is unreachable or answers with an error: exit 3."""


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
    """Read `inference.env` (or `path`, or $INFER_ENV_FILE); a missing default file is empty."""
    explicit = path or os.environ.get("INFER_ENV_FILE")
    file = Path(explicit) if explicit else Path.cwd() / ENV_FILE_NAME
    if not file.exists():
        if explicit:
            raise UsageError(f"env file {file} does not exist: create it or drop --env-file")
        return {}
    return parse_env_file(file.read_text(encoding="utf-8"))


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


def number(what: str, raw: Any, kind: type = int, low: float | None = None, high: float | None = None,
           default: Any = None) -> Any:
    """A number from a flag, the environment or inference.env; `default` when not given (None or "").

    Every script validates its numbers here, so all say the same thing about a bad one. `low`
    is inclusive; without it a whole number must be at least 1 and a float above 0. Floats must
    be finite; whole numbers may be written `32_768`.
    """
    if raw in (None, ""):
        return default
    if low is None and kind is int:
        low = 1
    try:
        value = kind(str(raw).replace("_", "")) if kind is int else kind(raw)
    except (TypeError, ValueError):
        raise UsageError(f"{what} must be a {'whole ' if kind is int else ''}number, got {raw!r}")
    if kind is float and not math.isfinite(value):
        raise UsageError(f"{what} must be a finite number, got {raw!r}")
    too_low = value <= 0 if low is None else value < low
    if too_low or (high is not None and value > high):
        bound = (f"between {low or 0:g} and {high:g}" if high is not None
                 else "above 0" if low is None else f"at least {low:g}")
        raise UsageError(f"{what} must be {bound}, got {raw!r}")
    return value


def cache_dir() -> Path:
    """The project's cache: the CPU vLLM venv, the tiny models, fetched model configs."""
    return Path(os.environ.get("ROOFLINE_CACHE_DIR") or Path.home() / ".cache" / "roofline")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(load_env_file(getattr(args, "env_file", None)))


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout (progress goes to stderr)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """--url / --env-file / --timeout. The API key never travels as a flag (see server_settings)."""
    parser.add_argument("--url", default="",
                        help=f"server base URL (else $INFER_URL, {ENV_FILE_NAME}, {DEFAULT_URL})")
    parser.add_argument("--env-file", default=None,
                        help=f"settings file (default: ./{ENV_FILE_NAME}, or $INFER_ENV_FILE)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the server per request")


def normalize_url(url: str) -> str:
    """Base URL without a trailing slash or `/v1`: scripts add `/v1/...` themselves."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", url):
        raise UsageError(f"URL {url!r} is not http(s)://host[:port]: set INFER_URL like {DEFAULT_URL}")
    return url[:-3] if url.endswith("/v1") else url


def server_settings(args: argparse.Namespace, settings: Settings | None = None) -> tuple[str, str | None]:
    """The (base URL, API key) to use; the key is never printed. Pass the settings already
    read, so inference.env is read once."""
    settings = settings or settings_from_args(args)
    url = normalize_url(settings.get("INFER_URL", getattr(args, "url", ""), DEFAULT_URL))
    # The Taskfile hands a task argument INFER_API_KEY=... over as ROOFLINE_TASK_API_KEY.
    api_key = settings.get("INFER_API_KEY", os.environ.get("ROOFLINE_TASK_API_KEY")) or None
    return url, api_key


def client(base_url: str, api_key: str | None = None, timeout: float = 30.0,
           max_connections: int = 16, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(
        base_url=base_url, headers=headers, transport=transport,
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
    )


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def get_json(http: httpx.Client, path: str, **kwargs: Any) -> Any:
    """GET/POST helper that turns transport and HTTP failures into ServerError lines."""
    method = "POST" if "json" in kwargs else "GET"
    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {http.base_url}{path}: {type(exc).__name__}: {exc}".rstrip(": "))
    if response.status_code >= 400:
        raise ServerError(f"{method} {path} answered HTTP {response.status_code}: {response.text[:200].strip()}")
    try:
        return response.json()
    except ValueError:
        raise ServerError(f"{method} {path} did not answer JSON (is {http.base_url} an inference server?)")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit(result: Any, human: str, as_json: bool) -> None:
    """Print the result: JSON document or human text, on stdout."""
    if as_json:
        json.dump(result, sys.stdout, indent=2, ensure_ascii=False, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(human if human.endswith("\n") else human + "\n")
    sys.stdout.flush()


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the examples in the epilog as written and show defaults, where there is one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", False, []):
            return action.help or ""
        return super()._get_help_string(action)


def split_doc(doc: str) -> tuple[str, str]:
    """A script's docstring as --help text: the first line describes, the rest (examples, exit
    codes) is the epilog."""
    first, _, rest = doc.strip().partition("\n")
    return first, rest.strip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error style: one line naming the bad argument, exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def parser(doc: str) -> argparse.ArgumentParser:
    description, epilog = split_doc(doc)
    return ArgumentParser(description=description, epilog=epilog, formatter_class=HelpFormatter)


def run_main(body: Callable[[], int], secret: str | None = None) -> int:
    """Run a script body and map errors to one line on stderr and an exit code."""
    try:
        return body()
    except UsageError as exc:
        print(f"error: {redact(str(exc), secret)}", file=sys.stderr)
        return EXIT_USAGE
    except ServerError as exc:
        print(f"error: {redact(str(exc), secret)}", file=sys.stderr)
        return EXIT_SERVER
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


CATALOG_DIR = Path(__file__).resolve().parent / "catalog"


def load_catalog(kind: str) -> dict[str, dict[str, Any]]:
    """An embedded catalog, scripts/catalog/<kind>.yaml: {id: {..., aliases: [...], source: ...}}."""
    with open(CATALOG_DIR / f"{kind}.yaml", encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _catalog_key(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "", name.lower())


def find_in_catalog(catalog: Mapping[str, Mapping[str, Any]], name: str, what: str) -> tuple[str, Mapping[str, Any]]:
    """Look a name up by id or alias, ignoring case and punctuation ("H100 SXM" = "h100-sxm").

    An unknown name is a UsageError that suggests the closest names, or lists them all.
    """
    import difflib

    index = {}
    for key, entry in catalog.items():
        for alias in [key, *entry.get("aliases", [])]:
            index[_catalog_key(alias)] = key
    wanted = _catalog_key(name)
    if wanted in index:
        return index[wanted], catalog[index[wanted]]
    close = difflib.get_close_matches(wanted, index, n=3, cutoff=0.6)
    hint = ("did you mean " + ", ".join(sorted({index[c] for c in close}))) if close else \
        "known: " + ", ".join(sorted(catalog))
    raise UsageError(f"unknown {what} {name!r}: {hint}")


def pick_model(listing: dict[str, Any], wanted: str | None, where: str) -> tuple[dict[str, Any], list[str]]:
    """From a /v1/models document: the entry of `wanted` (INFER_MODEL) or the first one, and all names.

    An unknown name is a UsageError listing what is served; an empty listing is the server's
    state (still loading), a ServerError.
    """
    models = [m for m in listing.get("data") or [] if isinstance(m, dict) and m.get("id")]
    if not models:
        raise ServerError(f"{where}/v1/models lists no model: is the server still loading?")
    names = [m["id"] for m in models]
    if wanted and wanted not in names:
        raise UsageError(f"model {wanted!r} is not served by {where}: set INFER_MODEL (or --model) to one of "
                         f"{', '.join(names)}")
    return (models[names.index(wanted)] if wanted else models[0]), names


def served_model(http: httpx.Client, wanted: str | None = None) -> dict[str, Any]:
    """The /v1/models entry of `wanted`, or of the first model listed (vLLM's carry max_model_len)."""
    return pick_model(get_json(http, "/v1/models"), wanted, str(http.base_url).rstrip("/"))[0]


def read_json_file(path: str, what: str, hint: str) -> Any:
    """A saved JSON document (a baseline, an earlier run); unreadable or not JSON is a UsageError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}")
    except ValueError:
        raise UsageError(f"{what} {path} is not JSON: {hint}")
