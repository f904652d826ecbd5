"""Reading and writing files: bounded reads, safe YAML and JSON, atomic writes, the bench log.

Everything a script reads from a user or a network is read with a size bound; everything it writes
goes through `write_atomic` (a temporary file renamed into place, secrets masked).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from rooflib.core.errors import EXIT_OK, EXIT_OUTPUT, UsageError
from rooflib.core.redaction import redact

# Files read from the user's disk are small: a larger one is a mistake (or /dev/zero).
MAX_SETTINGS_BYTES = 1 << 20
MAX_SAVED_BYTES = 256 << 20  # a saved run (ppl keeps a value per token) or baseline


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


def read_json_lines(path: str, what: str, limit: int) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of a JSONL file of at most `limit` bytes, blank lines skipped, read
    line by line (a large run's records are large); what is wrong is a one-line UsageError."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{what} {path} does not exist")
    if file.stat().st_size > limit:
        raise UsageError(f"{what} {path} is larger than {limit / 1024 ** 3:g} GiB: split it")
    rows = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = parse_json(line)
            except ValueError as exc:  # a JSONDecodeError names the fault in .msg; "nested too deeply" has none
                raise UsageError(f"{path}:{number}: not JSON ({getattr(exc, 'msg', exc)}): one JSON object per line")
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{number}: a line must be a JSON object")
            rows.append((number, row))
    return rows


def append_log(path: str, entry: str) -> None:
    """Append (never overwrite) an entry to a bench log, atomically (the log is rewritten
    through a temporary file: an interrupted write leaves the old log whole)."""
    write_atomic(path, log_with_entry(path, entry))


def log_with_entry(path: str, entry: str) -> str:
    """The bench log's text with `entry` appended (a blank line between entries)."""
    file = Path(path)
    old = file.read_text(encoding="utf-8", errors="replace") if file.is_file() else ""
    return old + ("\n" if old else "") + entry


def read_json_file(path: str, what: str, hint: str) -> Any:
    """A saved JSON document (a baseline, an earlier run); unreadable or not JSON is a UsageError."""
    try:
        return parse_json(read_bounded(path, what, MAX_SAVED_BYTES))
    except ValueError:
        raise UsageError(f"{what} {path} is not JSON: {hint}")
