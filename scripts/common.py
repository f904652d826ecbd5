"""Shared plumbing for the Roofline scripts: settings, HTTP client, output, errors.

Every script is `main(argv) -> int` over pure functions; this module holds the few things they
all need, so that no script copies them:

- settings resolve in one order: command-line flag (the task passes task arguments as flags),
  process environment, `inference.env` in the current directory, built-in default;
- one httpx client factory (auth header, timeouts, connection limits), never printing the key;
- output (`Output`, from --json and --json-out): one JSON document on stdout, or the human text
  and the JSON document in a file; progress on stderr;
- errors mapped to exit codes and one-line messages, no tracebacks (`run_main`);
- secrets (the API key and the like) masked in everything the process writes, from the first
  line of every script's `main` (`entry`) and in every file (`write_atomic`).

Exit codes shared by all scripts (a script may give 1 and 4 a narrower meaning in its --help):
  0 ok, 1 check failed (does not fit, SLO missed, smoke failed), 2 usage or configuration error,
  3 server unreachable or failing, 4 run invalid, 5 the result was printed but an output file
  (--records, --log, --json-out) could not be written, 130 interrupted by Ctrl-C or SIGTERM
  (partial results printed and written).
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import errno
import functools
import html
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

try:
    import httpx
    import httpcore  # httpx's own transport layer: the deadline on every read (client)
    import yaml  # noqa: F401  (imported here so that a missing dependency fails the same way everywhere)
except ImportError as exc:
    print(f"error: Python package {exc.name!r} is missing: Claude Code plugin: start a new session (its hook "
          "installs the runtime; if it could not, it printed the command to run); skills folder: "
          "`python3 -m pip install httpx tiktoken jinja2 pyyaml go-task-bin==3.54.0`; clone: `pip install -e .`",
          file=sys.stderr)
    sys.exit(2)

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_SERVER = 3
EXIT_INVALID = 4
EXIT_OUTPUT = 5
EXIT_INTERRUPTED = 130

# Files read from the user's disk are small: a larger one is a mistake (or /dev/zero).
MAX_SETTINGS_BYTES = 1 << 20
MAX_SAVED_BYTES = 256 << 20  # a saved run (ppl keeps a value per token) or baseline

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


def read_bounded(path: str | os.PathLike, what: str, limit: int) -> str:
    """A UTF-8 text file of at most `limit` bytes; a directory, a larger file (or an endless one,
    such as /dev/zero), binary content or an unreadable file is a one-line UsageError."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a directory: give a file")
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}")
    if len(data) > limit:
        raise UsageError(f"{what} {path} is larger than {limit:,} bytes: give a smaller file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text: convert it (iconv -t utf-8) or give another file")


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without anchors and aliases: a few lines of `&a [*b, *b, ...]` expand to
    gigabytes (the "billion laughs"), and a settings file has no need of them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"line {mark.line + 1} uses a YAML alias (*name): write the value out")
        return super().compose_node(parent, index)


def load_yaml(text: str, what: str) -> Any:
    """YAML from a user's file (a profile, a value of it): safe, no aliases; errors are one line."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} is not valid YAML: {' '.join(str(exc).split())[:200]}")


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


@dataclasses.dataclass(frozen=True)
class Output:
    """Where a script's result goes (args.output, from --json and --json-out): stdout gets the JSON
    document with `json`, else the human text; `file`, when given, gets the JSON document either
    way. Through `task` a Ctrl-C adds go-task's own line to stdout; the file holds the JSON alone."""
    json: bool = False
    file: str = ""


class _OutputFlag(argparse.Action):
    """--json and --json-out fill the one Output the script reads (args.output)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        change = {"json": True} if option_string == "--json" else {"file": value}
        setattr(namespace, self.dest, dataclasses.replace(namespace.output, **change))


def json_out_arg(raw: str) -> str:
    """argparse type of --json-out: a path that can take the file, checked before the run ("": none)."""
    if raw:
        try:
            check_writable(raw, "--json-out")
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("--json-out "))
    return raw


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(output=Output())
    parser.add_argument("--json", nargs=0, action=_OutputFlag, dest="output", default=argparse.SUPPRESS,
                        help="print one JSON document on stdout (progress goes to stderr)")
    parser.add_argument("--json-out", metavar="FILE", type=json_out_arg, action=_OutputFlag, dest="output",
                        default=argparse.SUPPRESS,
                        help="also write the JSON document to FILE (atomically, an interrupted run's too); "
                             "stdout keeps the human text unless --json")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """--url / --env-file / --timeout. The API key never travels as a flag (see server_settings)."""
    parser.add_argument("--url", default="",
                        help=f"server base URL (else $INFER_URL, {ENV_FILE_NAME}, {DEFAULT_URL})")
    parser.add_argument("--env-file", default=None,
                        help=f"settings file (default: ./{ENV_FILE_NAME}, or $INFER_ENV_FILE)")
    parser.add_argument("--timeout", type=timeout_arg, default=30.0,
                        help="seconds to wait for the server per request")


def timeout_arg(raw: str) -> float:
    """argparse type of every --timeout: a finite number of seconds, 1 ms to a day."""
    try:
        return number("--timeout", raw, float, 1e-3, 86400.0)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--timeout "))


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


# The end of the current request (time.monotonic), per thread: every socket read ends by then.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
STREAM_DEADLINE_FACTOR = 10  # a streamed answer may take ten times --timeout in all
CONNECT_TIMEOUT_S = 10.0  # at most, to open a connection: a server that listens accepts at once


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose reads end by the request's deadline. httpx's read timeout is per read, so
    a server dripping a byte now and then would hold a request forever without this."""

    def __init__(self, stream: httpcore.NetworkStream):
        self.stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        deadline = _DEADLINE.get()
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise httpcore.ReadTimeout("the answer took longer than its deadline in all")
            timeout = left if timeout is None else min(timeout, left)
        return self.stream.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, timeout)

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _DeadlineStream(self.stream.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class _DeadlineBackend(httpcore.SyncBackend):
    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _DeadlineStream(super().connect_tcp(*args, **kwargs))


class _Client(httpx.Client):
    """httpx.Client with a deadline on each request in all: --timeout for the head and a body
    read at once, ten times that for a streamed body, whatever the server drips."""

    def __init__(self, total_s: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.total_s = total_s

    def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any) -> httpx.Response:
        _DEADLINE.set(time.monotonic() + self.total_s)  # the head (and a whole body not streamed)
        response = super().send(request, stream=stream, **kwargs)
        if stream:  # the streamed body, read after this returns
            _DEADLINE.set(time.monotonic() + self.total_s * STREAM_DEADLINE_FACTOR)
        return response


def client(base_url: str, api_key: str | None = None, timeout: float = 30.0,
           max_connections: int = 16, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    if transport is None:
        transport = httpx.HTTPTransport(limits=limits)
        # httpx has no public way to give its pool a network backend; the pool reads this one.
        transport._pool._network_backend = _DeadlineBackend()  # noqa: SLF001
    return _Client(
        timeout, base_url=base_url, headers=headers, transport=transport,
        timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)), limits=limits,
    )


# Every secret the process knows (API keys, passwords, tokens), in each form it may take in
# text: all text leaving the process passes through redact().
SECRETS: set[str] = set()
# The settings that hold a secret, in the environment or an env file. ROOFLINE_TASK_API_KEY is
# the task argument INFER_API_KEY=...; HF_TOKEN is read by sizing (a gated config.json).
SECRET_SETTINGS = ("INFER_API_KEY", "ROOFLINE_TASK_API_KEY", "PROMETHEUS_PASSWORD", "HF_TOKEN")
# A secret shorter than this is not masked inside other text: replacing "ab" or "EMPTY" (a
# common placeholder key) everywhere would mangle numbers, words and JSON, and a key that short
# protects nothing. It is still never printed where it is known to be a key: the Authorization
# header is never printed, and a profile's key is shown as *** whatever its length (serve.py).
MIN_MASKED_CHARS = 8
MASK = "***"


def secret_forms(secret: str | None) -> set[str]:
    """How a secret appears in text: as is, inside a JSON string (ASCII or not), in a Python
    repr (error messages quote values with !r) and HTML-escaped (report pages); none when it is
    too short to mask (MIN_MASKED_CHARS)."""
    if not secret or len(secret) < MIN_MASKED_CHARS:
        return set()
    return {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1],
            repr(secret)[1:-1], html.escape(secret)}


def add_secret(secret: str | None) -> None:
    SECRETS.update(secret_forms(secret))


def register_known_secrets(argv: Sequence[str]) -> None:
    """Register every secret this process can know before it reads its arguments: the secret
    settings of the environment and of the env file it will read (--env-file in argv, else
    $INFER_ENV_FILE or ./inference.env). Profiles register theirs as they are read."""
    for name in SECRET_SETTINGS:
        add_secret(os.environ.get(name))
    try:  # the last --env-file, as argparse takes it
        load_env_file(next(reversed(flag_values(argv, "--env-file")), None))
    except UsageError:
        pass  # a bad env file: the script says so when it reads its settings


def flag_values(argv: Sequence[str], flag: str) -> list[str]:
    """Every value of `flag` in a command line (`--flag value` or `--flag=value`), in order,
    read without argparse (before it runs, or in an engine's command line)."""
    values = []
    for at, arg in enumerate(argv):
        if arg == flag and at + 1 < len(argv):
            values.append(argv[at + 1])
        elif arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1:])
    return values


def redact(text: str, secret: str | None = None) -> str:
    for known in sorted(SECRETS | secret_forms(secret), key=len, reverse=True):
        text = text.replace(known, MASK)
    return text


class _RedactingStream:
    """stdout/stderr with the known secrets replaced, whatever prints there."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def check_writable(path: str, what: str) -> None:
    """Before a run: would `path` take an output file? A directory, a read-only file or folder,
    or a parent that is a file is a UsageError now, not a lost result later."""
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{what} {path} is a directory: give a file name")
    if file.exists() and not os.access(file, os.W_OK):
        raise UsageError(f"{what} {path} is read-only: give a writable file")
    folder = file.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: the folder {folder} is not writable")


def write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` (secrets redacted) through a temporary file in the same folder
    and a rename: a reader, or a run interrupted here, never sees half a file. A new file gets
    the permissions `open` would give it, an existing one keeps its own."""
    file = Path(path)
    if file.exists() and not file.is_file():  # /dev/null, a FIFO: written through, never replaced
        with open(file, "w", encoding="utf-8") as stream:
            stream.write(redact(text))
        return
    file.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=file.parent, prefix=f".{file.name}.",
                                         suffix=".tmp", delete=False)
    try:
        with handle:
            handle.write(redact(text))
        if file.exists():
            mode = file.stat().st_mode & 0o7777
        else:  # a temporary file is private; an output file is not
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(handle.name, mode)
        os.replace(handle.name, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise


def write_outputs(files: list[tuple[str, str, str]]) -> int:
    """Write (what, path, text) output files after the result was printed: EXIT_OK, or
    EXIT_OUTPUT with one line per file that could not be written."""
    code = EXIT_OK
    for what, path, text in files:
        try:
            write_atomic(path, text)
        except OSError as exc:
            print(f"error: the result is printed above, but {what} {path} was not written: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            code = EXIT_OUTPUT
    return code


def parse_json(data: str | bytes) -> Any:
    """json.loads for text from outside: nesting too deep for the decoder (`[[[[...`) is a
    ValueError like any other malformed JSON, not a RecursionError."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply")


@contextlib.contextmanager
def answered(where: str, timeout_s: float):
    """Around one request to `where` (a URL, or "Prometheus at URL"): a transport failure is one
    ServerError line (exit 3). A timeout says so, after how long and how to raise the limit: a
    server too busy for --timeout is not an unreachable one."""
    started = time.monotonic()
    try:
        yield
    except httpx.ConnectTimeout:  # no connection at all: a longer --timeout would not help
        raise ServerError(f"cannot reach {where}: no connection within {min(timeout_s, CONNECT_TIMEOUT_S):g} s")
    except httpx.TimeoutException:
        raise ServerError(f"{where} timed out after {round(time.monotonic() - started, 1):g} s (--timeout {timeout_s:g}): "
                          "the server is busy or the request is long; raise --timeout (task: add -- --timeout N)")
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {where}: {type(exc).__name__}: {exc}".rstrip(": "))


def get_json(http: httpx.Client, path: str, **kwargs: Any) -> Any:
    """GET/POST helper that turns transport and HTTP failures into ServerError lines."""
    method = "POST" if "json" in kwargs else "GET"
    with answered(f"{http.base_url}{path}", http.timeout.read):
        response = http.request(method, path, **kwargs)
    if response.status_code >= 400:
        raise ServerError(f"{method} {path} answered HTTP {response.status_code}: {response.text[:200].strip()}")
    try:
        return parse_json(response.content)
    except ValueError:
        raise ServerError(f"{method} {path} did not answer JSON (is {http.base_url} an inference server?)")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON has no NaN (a server may send one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def json_text(result: Any, indent: int | None = 2) -> str:
    """The result as one JSON document (valid JSON: NaN becomes null)."""
    return json.dumps(json_safe(result), indent=indent, ensure_ascii=False, default=str, allow_nan=False) + "\n"


def emit(result: Any, human: str, output: Output) -> int:
    """Print the result on stdout in one write (the JSON document or the human text), then write
    the JSON document to output.file: EXIT_OK, or EXIT_OUTPUT with one line when the file could not
    be written (the result is on stdout all the same). A script returns `emit(...) or its code`."""
    document = json_text(result)
    try:
        sys.stdout.write(document if output.json else human if human.endswith("\n") else human + "\n")
        sys.stdout.flush()
    finally:  # also when stdout is gone (a closed pipe) or the write was interrupted
        written = write_outputs([("--json-out", output.file, document)]) if output.file else EXIT_OK
    return written


def fmt_number(value: Any, digits: int = 2) -> str:
    """A figure for a human line or a log entry: "-" for a missing one."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_log_entry(result: Mapping[str, Any], template: Path) -> str:
    """A bench or accept result as a Markdown log entry (scripts/templates/*.md.j2)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template.parent)),
                             autoescape=False, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["num"] = fmt_number
    return env.get_template(template.name).render(r=result)


def append_log(path: str, entry: str) -> None:
    """Append (never overwrite) an entry to a bench log, atomically (the log is rewritten
    through a temporary file: an interrupted write leaves the old log whole)."""
    write_atomic(path, log_with_entry(path, entry))


def log_with_entry(path: str, entry: str) -> str:
    """The bench log's text with `entry` appended (a blank line between entries)."""
    file = Path(path)
    old = file.read_text(encoding="utf-8", errors="replace") if file.is_file() else ""
    return old + ("\n" if old else "") + entry


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


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops a script as Ctrl-C does: what was measured is kept


@contextlib.contextmanager
def redacted_streams():
    """stdout and stderr redacted (once: nested uses wrap nothing more)."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (stream if isinstance(stream, _RedactingStream) else _RedactingStream(stream)
                              for stream in streams)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams


@contextlib.contextmanager
def _guarded_process():
    """While a script body runs: stdout and stderr redacted, SIGTERM handled as Ctrl-C."""
    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal needs it
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        with redacted_streams():
            yield
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _redacting_excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """A traceback (a bug) printed redacted: its message may quote a secret."""
    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))


def entry(main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """Every command line's `main(argv)`: the secrets the process can know are registered and
    stdout and stderr redacted from its first line on, so argparse's usage errors (which quote
    the bad value) and anything printed before run_main are redacted too; a traceback as well."""
    @functools.wraps(main)
    def run(argv: Sequence[str] | None = None) -> int:
        register_known_secrets(sys.argv[1:] if argv is None else argv)
        sys.excepthook = _redacting_excepthook
        with redacted_streams():
            return main(argv)
    return run


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what a supervisor or `kill` sends


class SignalHold:
    """Ctrl-C and SIGTERM held off while a result is completed and written: from start() until
    release() or the end of the `with` block, each is noted (in `noted`), not obeyed, so it cannot
    lose the result; what is left is bounded (one request of --timeout at most). Before start()
    they act as usual. Only the main thread sets signal handlers: elsewhere this holds nothing."""

    def __init__(self, what: str):
        self.what = what
        self.noted: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalHold":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._restore()

    def start(self) -> None:
        """Hold from now on. The handlers are swapped with the signals blocked: one that comes
        meanwhile is noted once they are in place, never lost between the two."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            with signals_blocked(*STOP_SIGNALS):
                self._previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}

    def release(self) -> None:
        """Obey them again; one noted meanwhile is obeyed now (KeyboardInterrupt)."""
        self._restore()
        if self.noted:
            self.noted.clear()
            raise KeyboardInterrupt

    def _note(self, signum: int, frame: Any) -> None:
        self.noted.append(signum)
        progress(f"{self.what}: finishing: the results are being written")

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@contextlib.contextmanager
def signals_blocked(*signums: int):
    """Around starting a child process that ignores these signals itself and then unblocks them:
    it inherits the mask, so a Ctrl-C to the process group while it starts up waits until it
    ignores it (else it dies or prints a traceback). This process gets what came meanwhile after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def run_main(body: Callable[[], int], secret: str | None = None) -> int:
    """Run a script body and map errors to one line on stderr and an exit code. Everything it
    prints is redacted; SIGTERM is handled as Ctrl-C."""
    add_secret(secret)
    with _guarded_process():
        try:
            return body()
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_SERVER
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            return EXIT_OK
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                print(f"error: the client ran out of file descriptors ({exc.strerror}): raise the limit "
                      "(ulimit -n 65536) and run again; the server is not at fault", file=sys.stderr)
                return EXIT_INVALID
            raise


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
    data = listing.get("data") if isinstance(listing, dict) else None
    models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]] \
        if isinstance(data, list) else []
    if not models:
        raise ServerError(f"{where}/v1/models lists no model: is the server still loading?")
    names = [m["id"] for m in models]
    if wanted and wanted not in names:
        raise UsageError(f"model {wanted!r} is not served by {where}: set INFER_MODEL (or --model) to one of "
                         f"{', '.join(names)}")
    return (models[names.index(wanted)] if wanted else models[0]), names


def max_model_len(entry: Mapping[str, Any], where: str) -> int | None:
    """A /v1/models entry's max_model_len (vLLM gives one), checked: a whole number or absent."""
    value = entry.get("max_model_len")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ServerError(f"{where}/v1/models gives max_model_len {str(value)[:40]!r}, not a whole number")
    return value


def served_model(http: httpx.Client, wanted: str | None = None) -> dict[str, Any]:
    """The /v1/models entry of `wanted`, or of the first model listed (vLLM's carry max_model_len)."""
    return pick_model(get_json(http, "/v1/models"), wanted, str(http.base_url).rstrip("/"))[0]


def read_json_file(path: str, what: str, hint: str) -> Any:
    """A saved JSON document (a baseline, an earlier run); unreadable or not JSON is a UsageError."""
    try:
        return parse_json(read_bounded(path, what, MAX_SAVED_BYTES))
    except ValueError:
        raise UsageError(f"{what} {path} is not JSON: {hint}")
