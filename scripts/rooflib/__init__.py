"""Roofline's library: the command lines in scripts/ are thin layers over it.

Layers (tests/project/test_house.py checks them): a command line imports the domain packages and core;
a domain package (load, server, sizing, quality, serving, render) imports core and other domain
packages, never a command line; core imports nothing of the project outside core.
"""
import sys

try:
    import httpx  # noqa: F401
    import yaml  # noqa: F401
except ImportError as exc:  # the same message for every script, before any of them uses one
    print(f"error: Python package {exc.name!r} is missing: Claude Code plugin: start a new session (its hook "
          "installs the runtime; if it could not, it printed the command to run); skills folder: "
          "`python3 -m pip install httpx tiktoken jinja2 pyyaml go-task-bin==3.54.0`; clone: `pip install -e .`",
          file=sys.stderr)
    sys.exit(2)
