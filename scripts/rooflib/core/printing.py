"""Output of a result: one JSON document on stdout (--json) or the human text, and --json-out FILE.

Progress goes to stderr, so that stdout stays one document an agent can parse.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping

from rooflib.core.errors import EXIT_OK, UsageError
from rooflib.core.fileio import check_writable, write_outputs


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


def json_lines(rows: Any) -> str:
    """Rows as JSON lines (bench's --records), NaN as null."""
    return "".join(json.dumps(json_safe(row)) + "\n" for row in rows)


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
    """A bench or accept result as a Markdown log entry (scripts/rooflib/render/templates/*.md.j2)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template.parent)),
                             autoescape=False, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["num"] = fmt_number
    return env.get_template(template.name).render(r=result)
