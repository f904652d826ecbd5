"""Secrets (API keys, passwords, tokens) masked in everything a process writes."""
from __future__ import annotations

import contextlib
import html
import json
import sys
from typing import Any

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
