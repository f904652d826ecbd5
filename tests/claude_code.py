#!/usr/bin/env python3
"""The real Claude Code CLI for the plugin tests, installed from the npm registry at a pinned version.

`ensure()` installs `@anthropic-ai/claude-code@VERSION` with npm into the project's cache
(<cache>/claude-code-VERSION, cache as in scripts/serve.py) unless that version is already there,
and returns the `claude` executable. Run as a script it does the same and prints the path.
Needs `npm` and the npm registry the first time. Where npm is missing, `ensure(install_npm_if_missing=True)`
(what the tests do under CI=true) installs Debian's npm with apt-get first; otherwise it raises
ClaudeCodeUnavailable, in one line (the tests then skip locally and fail under CI=true).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from rooflib.serving.engine_setup import locked

from rooflib.core.conf import cache_dir

# The client the plugin tests run against; bump it on purpose, with the tests passing.
VERSION = "2.1.332"
PACKAGE = "@anthropic-ai/claude-code"


class ClaudeCodeUnavailable(Exception):
    pass


def prefix() -> Path:
    return cache_dir() / f"claude-code-{VERSION}"


def installed_version(claude: Path) -> str:
    if not claude.exists():
        return ""
    result = subprocess.run([str(claude), "--version"], capture_output=True, text=True, timeout=60)
    return result.stdout.split(" ", 1)[0] if result.returncode == 0 else ""


def install_npm() -> None:
    """Debian's npm (it brings node), as root on a machine with apt-get, as CI images are."""
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "npm"]):
        subprocess.run(cmd, capture_output=True, timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def ensure(install_npm_if_missing: bool = False) -> Path:
    # Test sessions of several checkouts share the cache: one installs, the others wait.
    with locked(cache_dir() / "claude-code.lock"):
        return install(install_npm_if_missing)


def install(install_npm_if_missing: bool) -> Path:
    claude = prefix() / "node_modules" / ".bin" / "claude"
    if installed_version(claude) == VERSION:
        return claude
    if not shutil.which("npm") and install_npm_if_missing:
        install_npm()
    npm = shutil.which("npm")
    if not npm:
        raise ClaudeCodeUnavailable(f"npm is not installed: it installs {PACKAGE}@{VERSION} for the plugin tests")
    prefix().mkdir(parents=True, exist_ok=True)
    result = subprocess.run([npm, "install", "--prefix", str(prefix()), "--no-audit", "--no-fund",
                             f"{PACKAGE}@{VERSION}"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0 or installed_version(claude) != VERSION:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ClaudeCodeUnavailable(f"npm install {PACKAGE}@{VERSION} failed: {last}")
    return claude


if __name__ == "__main__":
    try:
        print(ensure(install_npm_if_missing=True))
    except ClaudeCodeUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3)
