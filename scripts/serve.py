#!/usr/bin/env python3
"""Render and run the engine command (vLLM or SGLang) described by a YAML profile.

A profile (roofline-toolbox/profiles/NAME.yaml, or a path) names the engine, the model and the
engine settings. This script checks it (unknown keys, wrong types, contradictions), renders the
exact command line, and either prints it (--dry-run) or runs it in the foreground until the
engine exits or Ctrl-C stops it (Ctrl-C is passed on, so the engine shuts down cleanly).

Examples:
  serve.py --profile cpu-tiny --dry-run
  serve.py --profile qwen3-32b-fp8-h100 --dry-run --json
  serve.py --profile cpu-tiny --port 8011 --set max_num_seqs=2
  serve.py --profile ./my-profile.yaml --port 8000

Exit codes: 0 ok (else the engine's own exit status), 2 bad profile / port in use / engine
missing, 130 interrupted.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import cli, conf, printing
from rooflib.core.errors import EXIT_INTERRUPTED, UsageError
from rooflib.serving import profiles


def build_parser():
    p = cli.parser(__doc__)
    p.add_argument("--profile", default="", help="profile name or YAML path (else $INFER_PROFILE, inference.env)")
    p.add_argument("--port", type=int, default=None, help="port to serve on (0 or unset: the profile's, else the engine's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile key, e.g. --set max_num_seqs=2 (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("--env-file", default=None, help="settings file (default ./inference.env)")
    printing.add_output_args(p)
    return p


def resolve(args) -> dict[str, Any]:
    settings = conf.settings_from_args(args)
    name = settings.get("INFER_PROFILE", args.profile)
    if not name:
        raise UsageError("no profile: pass INFER_PROFILE=<name> (see roofline-toolbox/profiles/) or --profile")
    path, profile = profiles.with_overrides(name, args.set)
    hidden = profiles.secrets(profile)
    argv, env = profiles.render(profile, args.port)
    return {"profile": str(path), "engine": profile["engine"], "model_path": profiles.expand(profile["model"]),
            "host": profile.get("host", "127.0.0.1"), "port": int(argv[argv.index("--port") + 1]),
            "command": argv, "env": env, "cached_model": "{cache}" in profile["model"], "secrets": hidden}


def shown(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as printed: the profile's secrets (of any length) as ***, and not listed."""
    hidden = plan["secrets"]
    env = dict(zip(plan["env"], profiles.masked(list(plan["env"].values()), hidden)))
    return {key: value for key, value in plan.items() if key != "secrets"} | {
        "command": profiles.masked(plan["command"], hidden), "env": env}


def shell_line(plan: dict[str, Any]) -> str:
    # Keys are names (render checks them); values are quoted: a copied line runs no value.
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan["env"].items())
    return (env + " " if env else "") + shlex.join(plan["command"])


# The set-up task that builds each engine's CPU test build and the tiny models in the cache.
SETUP_TASK = {"vllm": "setup-cpu-vllm", "sglang": "setup-cpu-sglang"}


def launch(plan: dict[str, Any]) -> subprocess.Popen:
    profiles.check_port_free(plan["host"], plan["port"])
    setup = SETUP_TASK[plan["engine"]]
    if plan["cached_model"] and not Path(plan["model_path"], "config.json").exists():
        raise UsageError(f"local model {plan['model_path']} is not built: run `task {setup}` first")
    try:
        # Own process group, so that stop() reaches the engine's worker processes too.
        return subprocess.Popen(plan["command"], env={**os.environ, **plan["env"]}, start_new_session=True)
    except FileNotFoundError:
        raise UsageError(f"engine Python {plan['command'][0]!r} not found: install {plan['engine']} "
                         f"or set ROOFLINE_ENGINE_PYTHON (for the CPU test engine: task {setup})")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the engine as cleanly as Ctrl-C

    def body() -> int:
        if args.output.file and not args.dry_run:
            raise UsageError("--json-out needs --dry-run: the plan (the command serve would run) is its JSON document")
        plan = resolve(args)
        url = f"http://{plan['host']}:{plan['port']}"
        printed = shown(plan)
        if args.dry_run:
            return printing.emit({**printed, "url": url, "shell": shell_line(printed)}, shell_line(printed), args.output)
        proc = launch(plan)
        printing.progress(f"$ {shell_line(printed)}")
        try:
            return proc.wait()
        except KeyboardInterrupt:
            profiles.stop(proc)
            return EXIT_INTERRUPTED

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
