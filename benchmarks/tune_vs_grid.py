#!/usr/bin/env python3
"""Runs to the SLO: tune against a grid of the same settings (vLLM auto_tune style), on the CPU vLLM.

Each case starts from the cpu-tiny profile with one setting made wrong on purpose (the cases of
tests/test_tune.py: a running limit far too low, a KV cache far too small, prefix caching off
under a shared-prefix load). tune.py runs on it as a user would (a subprocess, --json) with its
budget; its runs, wall time and final SLO figure are recorded. The grid is what vLLM's
benchmarks/auto_tune/auto_tune.sh does (vllm-project/vllm@3ed2c21: restart the server and run one
benchmark at every point of a fixed grid, in nested loops): every combination of max_num_seqs,
the KV cache size and prefix caching (the settings the cases make wrong; a blind grid does not know
which one is), the same workload and seed, in order, until a point reaches tune's result: every
SLO target met when tune met them, else an SLO figure at least as low as tune's. Each grid point
costs an engine start and a run, as each trial of tune does.

Goal (issue 23): in every case tune needs fewer runs than the grid to the same or better SLO figure.

Examples:
  tune_vs_grid.py
  tune_vs_grid.py --cases running_limit --json

Exit codes: 0 tune needed fewer runs in every case, 1 it did not in some case, 2 bad arguments,
3 an engine or tune failed.
"""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from rooflib.core import cli, conf, printing  # noqa: E402
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, ServerError, UsageError  # noqa: E402
from rooflib.load import benchrun  # noqa: E402
from rooflib.serving import profiles, trials  # noqa: E402
from rooflib.serving import tune as tuning  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """A starting profile (cpu-tiny with `sets`), the workload and SLO (bench's flags), the
    setting made wrong on purpose, and tune's budget in runs."""
    sets: tuple[str, ...]
    load: tuple[str, ...]
    wrong: str
    runs: int = 6


# Prefill-heavy loads (long prompts, 16 tokens out): on the tiny CPU model the API server, not
# the engine, is the bottleneck for long outputs (tests/test_metrics.py, QUEUEING_PROMPTS).
CASES = {
    "running_limit": Case(("max_num_seqs=1", "enable_prefix_caching=false"),
                          ("-n", "16", "-c", "16", "--input-tokens", "256", "--output-tokens", "128",
                           "--slo-ttft-p95-ms", "2000"), "max_num_seqs"),
    "kv_cache": Case(("env={}", "max_model_len=1024", f"kv_cache_memory_bytes={4 * MIB}",
                      "enable_prefix_caching=false"),
                     ("-n", "16", "-c", "16", "--input-tokens", "512", "--output-tokens", "256",
                      "--slo-ttft-p95-ms", "2000"), "kv_cache_memory_bytes"),
    "prefix_cache_off": Case(("enable_prefix_caching=false",),
                             ("-n", "16", "-c", "4", "--input-tokens", "2048", "--shared-prefix", "1920",
                              "--output-tokens", "16", "--slo-ttft-p95-ms", "300"), "enable_prefix_caching"),
}
COMMON = ("--timeout", "300", "--seed", "0")

# The grid: max_num_seqs x KV cache size x prefix caching, in nested loops as auto_tune.sh does.
GRID = {"max_num_seqs": (1, 16), "kv_cache_memory_bytes": (4 * MIB, 64 * MIB), "enable_prefix_caching": (False, True)}


def start_profile(case: Case) -> dict[str, Any]:
    profile = profiles.load_profile(profiles.find_profile("cpu-tiny"))
    for item in case.sets:
        key, value = profiles.parse_override(item)
        profile[key] = value
    return profiles.validate(profile)


def set_up_engine() -> None:
    """The CPU vLLM and the tiny model (cached after the first time), as `task setup-cpu-vllm` does."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "setup_cpu_vllm.py"), "--models", "tiny-qwen3"],
                          stdout=subprocess.DEVNULL)
    if done.returncode:
        raise ServerError("setting up the CPU vLLM failed: run `task infer:setup-cpu-vllm` to see why")


def run_tune(case: Case, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(SCRIPTS / "tune.py"), "--profile", "cpu-tiny", "--json", "--out", str(out),
           "--budget-runs", str(case.runs), *[arg for item in case.sets for arg in ("--set", item)], *case.load, *COMMON]
    printing.progress("tune_vs_grid: " + " ".join(cmd[1:]))
    began = time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1):
        raise ServerError(f"tune.py exited {done.returncode}")
    doc = json.loads(done.stdout)
    return {**doc, "measured_wall_s": time.monotonic() - began}


def reached(run: dict[str, Any], tuned: dict[str, Any]) -> bool:
    """A grid point is as good as tune's result: every target met when tune met them, else an SLO
    figure (the one furthest over its target at the start) at least as low as tune's."""
    if tuned["slo_holds"]:
        return not trials.missed(run)
    start = tuned["trials"][0]["figures"]
    figure = max(start, key=lambda name: (start[name]["measured"] or math.inf) / start[name]["target"])
    best = tuned["trials"][0]["figures"][figure]["measured"]
    for row in tuned["trials"]:
        if row["decision"] == trials.KEPT:
            best = row["figures"][figure]["measured"]
    value = run["slo"][figure]["measured"]
    return value is not None and value <= best


def run_grid(case: Case, tuned: dict[str, Any], out: Path) -> dict[str, Any]:
    profile = start_profile(case)
    args = benchrun.build_parser().parse_args([*case.load, *COMMON])
    options = benchrun.make_options(args, conf.settings_from_args(args))  # as tune.py reads them
    points = [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]
    began, runs, hit = time.monotonic(), 0, None
    for n, point in enumerate(points, 1):
        candidate = {**profile, **point, "env": {}}  # the KV size from kv_cache_memory_bytes alone
        printing.progress(f"tune_vs_grid: grid point {n}/{len(points)}: {point}")
        try:
            engine = tuning.start_engine(candidate, profiles.free_port(), out / f"grid-{n}.log", 600)
        except ServerError as exc:
            printing.progress(f"tune_vs_grid: grid point {n} did not start: {exc}")
            runs += 1
            continue
        try:
            run = tuning.bench_once(engine.url, None, options, out / f"grid-{n}.json")
        finally:
            tuning.stop_engine(engine)
        runs += 1
        if reached(run, tuned):
            hit = {"point": point, "figures": trials.figures(None, run)}
            break
    return {"points": len(points), "runs": runs, "wall_s": time.monotonic() - began, "reached": hit}


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to run")
    p.add_argument("--out", default="tune-vs-grid", help="folder for the runs and engine logs")
    args = p.parse_args(argv)

    def body() -> int:
        names = [name.strip() for name in args.cases.split(",") if name.strip()]
        unknown = [name for name in names if name not in CASES]
        if unknown:
            raise UsageError(f"unknown case {unknown[0]!r}: use {', '.join(CASES)}")
        set_up_engine()
        rows = []
        for name in names:
            case, out = CASES[name], Path(args.out) / name
            out.mkdir(parents=True, exist_ok=True)
            tuned = run_tune(case, out / "tune")
            grid = run_grid(case, tuned, out)
            final = {k: v["measured"] for k, v in (tuned["trials"][0]["figures"]).items()}
            for row in tuned["trials"]:
                if row["decision"] == trials.KEPT:
                    final = {k: v["measured"] for k, v in row["figures"].items()}
            rows.append({"case": name, "wrong": case.wrong, "tune_runs": tuned["runs"],
                         "tune_wall_s": tuned["measured_wall_s"], "tune_kept": tuned["changes"],
                         "tune_slo_holds": tuned["slo_holds"], "tune_figures": final,
                         "grid_runs": grid["runs"], "grid_points": grid["points"], "grid_wall_s": grid["wall_s"],
                         "grid_reached": grid["reached"],
                         "fewer_runs": grid["reached"] is None or tuned["runs"] < grid["runs"]})
        lines = [f"{'case':<18}{'tune runs':>10}{'tune wall':>11}{'grid runs':>11}{'grid wall':>11}  tune kept / grid point"]
        for r in rows:
            grid_runs = f"{r['grid_runs']}" if r["grid_reached"] else f">{r['grid_runs']}"
            kept = ", ".join(f"{c['setting']} {c['from']} -> {c['to']}" for c in r["tune_kept"]) or "nothing"
            lines.append(f"{r['case']:<18}{r['tune_runs']:>10}{tuning.clock(r['tune_wall_s']):>11}{grid_runs:>11}"
                         f"{tuning.clock(r['grid_wall_s']):>11}  {kept} / "
                         f"{r['grid_reached']['point'] if r['grid_reached'] else 'never reached in the grid'}")
        ok = all(r["fewer_runs"] for r in rows)
        lines.append(f"tune needed fewer runs than the grid in {sum(r['fewer_runs'] for r in rows)} of {len(rows)} cases"
                     f" (goal: all)")
        report = {"cases": rows, "grid": {k: list(v) for k, v in GRID.items()}, "ok": ok}
        printed = printing.emit(report, "\n".join(lines), args.output)
        return printed or (EXIT_OK if ok else EXIT_CHECK_FAILED)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
