"""What every command line shares: the argument parser, common flags, and `entry`.

`entry` wraps a script's `main(argv)`: secrets are registered and masked from the first line,
errors become one-line messages with their exit codes (`run_main`), and Ctrl-C or SIGTERM ends
the process with 130 after the partial result is written.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import difflib
import errno
import functools
import json
import math
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

from rooflib.core.conf import DEFAULT_URL, ENV_FILE_NAME, load_env_file
from rooflib.core.errors import (
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_SERVER,
    EXIT_USAGE,
    ServerError,
    UsageError,
)
from rooflib.core.redaction import SECRET_SETTINGS, add_secret, redact, redacted_streams


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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the examples in the epilog as written and show defaults, where there is one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", False, []):
            return action.help or ""
        return super()._get_help_string(action)


def split_doc(doc: str) -> tuple[str, str]:
    """A script's docstring as --help text: the first paragraph describes, the rest (examples,
    exit codes) is the epilog."""
    first, _, rest = doc.strip().partition("\n\n")
    return first, rest.strip()


# Set by `entry` for one run: the command line asked for --json, so an error also goes to stdout.
_json_errors = contextvars.ContextVar("json_errors", default=False)


def fail(message: str, code: int) -> int:
    """Report an error and return its exit code: one `error: ...` line on stderr and, when the
    command line asked for --json, one JSON document on stdout ({"error", "exit_code"}), so an
    agent that parses stdout is never left with nothing."""
    print(f"error: {message}", file=sys.stderr)
    if _json_errors.get():
        sys.stdout.write(json.dumps({"error": message, "exit_code": code}, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    return code


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error style: one line naming the bad argument, a flag close to
    a mistyped one, exit 2."""

    def error(self, message: str):
        hint = self.closest_flags(message)
        self.exit(fail(f"{message}{hint} (see {self.prog} --help)", EXIT_USAGE))

    def closest_flags(self, message: str) -> str:
        """"; did you mean --ctx" for the unrecognized flags of an argparse message ("" if none)."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [flag for action in self._actions for flag in action.option_strings]
        words = [word.split("=", 1)[0] for word in message.split(":", 1)[1].split() if word.startswith("--")]
        close = [match for word in words for match in difflib.get_close_matches(word, known, n=1, cutoff=0.6)]
        return f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""


def parser(doc: str) -> argparse.ArgumentParser:
    description, epilog = split_doc(doc)
    return ArgumentParser(description=description, epilog=epilog, formatter_class=HelpFormatter)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops a script as Ctrl-C does: what was measured is kept


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
        args = sys.argv[1:] if argv is None else argv
        register_known_secrets(args)
        sys.excepthook = _redacting_excepthook
        wants_json = _json_errors.set("--json" in args)
        try:
            with redacted_streams():
                return main(argv)
        finally:
            _json_errors.reset(wants_json)
    return run


def run_main(body: Callable[[], int], secret: str | None = None) -> int:
    """Run a script body and map errors to one line on stderr and an exit code. Everything it
    prints is redacted; SIGTERM is handled as Ctrl-C."""
    add_secret(secret)
    with _guarded_process():
        try:
            return body()
        except UsageError as exc:
            return fail(str(exc), EXIT_USAGE)
        except ServerError as exc:
            return fail(str(exc), EXIT_SERVER)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            return EXIT_OK
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                return fail(f"the client ran out of file descriptors ({exc.strerror}): raise the limit "
                            "(ulimit -n 65536) and run again; the server is not at fault", EXIT_INVALID)
            raise
