"""The Prometheus text format, as engines serve it on /metrics: samples by name and their `# TYPE`,
checked so that what is not metrics (an HTML page, an empty or a truncated scrape) is refused with
one clear line (InvalidScrape) rather than read as zeros.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Mapping


class InvalidScrape(Exception):
    """The text is not usable Prometheus metrics of vLLM or SGLang: exit 4, one line."""


@dataclass
class Exposition:
    """Samples by name: {name: [(labels, value), ...]}; `types` from `# TYPE` lines."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)')


_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _labels(line: str, start: int) -> tuple[dict[str, str], int]:
    """Parse `{a="1",b="2"}` from line[start] == '{'; return the labels and the index after '}'."""
    labels: dict[str, str] = {}
    pos = start + 1
    while True:
        while pos < len(line) and line[pos] == " ":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        match = _LABEL.match(line, pos)
        if not match:
            raise ValueError("bad label set")
        value = match.group(2)
        if "\\" in value:
            value = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)
        labels[match.group(1)] = value
        pos = match.end()
        if not match.group(3) and not line.startswith("}", pos):
            raise ValueError("bad label set")


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    match = _NAME.match(line)
    if not match:
        raise ValueError("no metric name")
    name, pos, labels = match.group(0), match.end(), {}
    if line.startswith("{", pos):
        labels, pos = _labels(line, pos)
    parts = line[pos:].split()
    if not 1 <= len(parts) <= 2 or (line[pos:pos + 1] not in (" ", "\t")):
        raise ValueError("expected a value (and an optional timestamp) after the name")
    return name, labels, float(parts[0])


def parse_exposition(text: str) -> Exposition:
    """Parse the Prometheus text format; reject what is not metrics with one clear line."""
    if not text.strip():
        raise InvalidScrape("the scrape is empty: the server sent no metrics "
                            "(vLLM with --disable-log-stats? SGLang without --enable-metrics?)")
    head = text.lstrip()[:500].lower()
    if head.startswith("<") or "<html" in head:
        raise InvalidScrape("this is an HTML page, not Prometheus metrics: point at the engine's "
                            "own port (vLLM /metrics, SGLang /metrics with --enable-metrics)")
    result = Exposition()
    not_finite: set[str] = set()
    lines = text.split("\n")
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 4 and words[1] == "TYPE":
                result.types[words[2]] = words[3].strip()
            continue
        try:
            name, labels, value = _sample(line)
        except ValueError as exc:
            cut = number == len(lines) and not text.endswith("\n")
            if cut:
                raise InvalidScrape(f"the scrape is truncated: its last line is cut ({line[:80]!r}); "
                                    "scrape again or save the whole response")
            raise InvalidScrape(f"line {number} is not Prometheus text format ({exc}): {line[:80]!r}")
        if not math.isfinite(value):  # valid in the format, but no figure: left out, and said so
            not_finite.add(name)
            continue
        result.samples.setdefault(name, []).append((labels, value))
    if not_finite:
        result.warnings.append(f"the server sent NaN or Inf for {', '.join(sorted(not_finite)[:5])}"
                               f"{' and others' if len(not_finite) > 5 else ''}: those samples are left out")
    _check_histograms(result)
    if not text.endswith("\n"):
        result.warnings.append("the scrape does not end with a newline: it may be truncated")
    return result


def _check_histograms(exposition: Exposition) -> None:
    """A histogram series without its +Inf bucket or _count means the text was cut short."""
    for family, kind in exposition.types.items():
        if kind != "histogram":
            continue
        buckets = exposition.samples.get(family + "_bucket", [])
        series = {_series_key(labels) for labels, _ in buckets}
        complete = {_series_key(labels) for labels, _ in buckets if labels.get("le") == "+Inf"}
        counted = {_series_key(labels) for labels, _ in exposition.samples.get(family + "_count", [])}
        if series - complete or series - counted:
            raise InvalidScrape(f"the scrape is truncated: histogram {family} lacks its +Inf bucket "
                                "or _count; scrape again or save the whole response")


def _series_key(labels: Mapping[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
