"""The two errors every layer raises and the exit codes every command line shares.

Exit codes (a script may give 1 and 4 a narrower meaning in its --help):
  0 ok, 1 check failed (does not fit, SLO missed, smoke failed), 2 usage or configuration error,
  3 server unreachable or failing, 4 run invalid, 5 the result was printed but an output file
  (--records, --log, --json-out) could not be written, 130 interrupted by Ctrl-C or SIGTERM
  (partial results printed and written).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_SERVER = 3
EXIT_INVALID = 4
EXIT_OUTPUT = 5
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad input or configuration: exit 2 with a one-line message."""


class ServerError(Exception):
    """The server is unreachable or answers with an error: exit 3."""
