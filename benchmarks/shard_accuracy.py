#!/usr/bin/env python3
"""Do N shard processes (bench --shard I/N, then merge.py) measure what one bench process measures?

Against the calibration server (benchmarks/calibration_server.py: first token after --ttft-ms, then
one chunk per --itl-ms), one closed-loop workload is sent by one process, then by N shard
processes started together and merged, --rounds times. Both clients measure the same schedule, so
two valid runs agree within the sum of the lag each states it tolerates (client.lag_limits_ms: 10%
of the figure's median, at least 1 ms; TPOT: the decode span's limits over the tokens after the
first). A round is compared only where both clients kept up (their runs are valid) and the server
kept its schedule (its own record of each request: TTFT and e2e p95 within 5% of the plan); a busy
machine stalls one or the other, and such a round is reported as disturbed, not compared.

Two measurements taken one after the other on a shared machine are a benchmark, not a test:
tests/load/test_shards.py checks what no clock changes (the split, the merge's arithmetic over the
shards' records, the run's identity).

Examples:
  shard_accuracy.py                          # 3 rounds: 90 requests x 9 streams, one process vs 3 shards
  shard_accuracy.py --rounds 5 --shards 4 --json

Exit codes: 0 every compared round within the limits, 1 a round outside them or none compared,
2 bad arguments, 3 the server or bench failed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_accuracy  # noqa: E402
import calibration_server  # noqa: E402

from rooflib.core import cli, http_client, printing, stats  # noqa: E402
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, ServerError, UsageError  # noqa: E402

LEAD_S = 6.0  # time for N Python processes to start and warm up on a busy 2-core machine
SCHEDULE_SLACK = 0.05  # the server kept its schedule when its own TTFT and e2e p95 are within 5% of it
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p95"), ("e2e_ms", "p50"), ("e2e_ms", "p95"),
           ("tpot_ms", "p50"), ("tpot_ms", "p95"), ("itl_ms", "p50"))


def bench(url: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / "bench.py"), "--url", url, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> str:
    """A bench process's stdout once it ended with a result (0, or 4: the verdict failed)."""
    out, err = proc.communicate(timeout=120)
    if proc.returncode not in (0, 4):
        raise ServerError(f"bench.py exited {proc.returncode}: {err.strip()[-2000:]}")
    return out


def run_shards(url: str, folder: Path, load: Sequence[str], count: int,
               extra: dict[int, list[str]] | None = None) -> list[Path]:
    """`count` shard processes of one run, started together: their --json-out files."""
    folder.mkdir(parents=True, exist_ok=True)
    start = f"{time.time() + LEAD_S:.3f}"
    procs = [bench(url, *load, "--shard", f"{i}/{count}", "--start-at", start,
                   "--records", str(folder / f"shard-{i}.records.jsonl"), "--json-out", str(folder / f"shard-{i}.json"),
                   *(extra or {}).get(i, [])) for i in range(count)]
    for proc in procs:
        finished(proc)
    return [folder / f"shard-{i}.json" for i in range(count)]


def records_of(files: Sequence[Path]) -> list[dict[str, Any]]:
    """The shards' records, read from beside their results."""
    return [json.loads(line) for file in files
            for line in file.with_name(file.name.replace(".json", ".records.jsonl")).read_text().splitlines()]


def send_both(url: str, folder: Path, load: Sequence[str], count: int) -> dict[str, Any]:
    """The workload sent by one process, then by `count` shards, then merged."""
    single = json.loads(finished(bench(url, *load, "--json", "--records", str(folder / "single.jsonl"))))
    shutil.rmtree(folder / "run", ignore_errors=True)
    files = run_shards(url, folder / "run", load, count)
    merged = subprocess.run([sys.executable, str(SCRIPTS / "merge.py"), str(folder / "run"), "--json-out",
                             str(folder / "merged.json"), "--records", str(folder / "merged.jsonl")],
                            capture_output=True, text=True, timeout=120)
    if merged.returncode not in (0, 4):
        raise ServerError(f"merge.py exited {merged.returncode}: {merged.stderr.strip()[-2000:]}")
    return {"single": single, "merged": json.loads((folder / "merged.json").read_text()),
            "files": files, "folder": folder, "text": merged.stdout}


def kept_schedule(truth: dict[str, Any], sent: dict[str, Any], ttft_ms: float, itl_ms: float,
                  output_tokens: int) -> bool:
    """Whether the calibration server's own TTFT and e2e (first and last write - arrival, its
    truth) stayed on schedule in both runs: the premise of comparing them. Both, because a stall
    during decode leaves every TTFT on time."""
    single = [json.loads(line) for line in (sent["folder"] / "single.jsonl").read_text().splitlines()]
    runs = ((sent["single"]["config"]["run_id"], single), (sent["merged"]["config"]["run_id"], records_of(sent["files"])))
    schedule = {"ttft_ms": ttft_ms, "e2e_ms": ttft_ms + itl_ms * (output_tokens - 1)}
    return all(stats.summarize(bench_accuracy.truth_of(truth, run_id, records)[figure])["p95"]
               <= planned * (1 + SCHEDULE_SLACK) for run_id, records in runs for figure, planned in schedule.items())


def compare_runs(single: dict[str, Any], merged: dict[str, Any], output_tokens: int) -> list[dict[str, Any]]:
    """Each figure of the two runs, their difference and the sum of the limits both runs state."""
    rows = []
    for figure, stat in FIGURES:
        limit = single["client"]["lag_limits_ms"][figure] + merged["client"]["lag_limits_ms"][figure]
        tolerance = limit / (output_tokens - 1) if figure == "tpot_ms" else limit
        difference = merged[figure][stat] - single[figure][stat]
        rows.append({"figure": figure, "stat": stat, "single": single[figure][stat], "merged": merged[figure][stat],
                     "difference": round(difference, 3), "tolerance": round(tolerance, 3),
                     "ok": abs(difference) <= tolerance + 0.01})
    return rows


def human(rounds: list[dict[str, Any]]) -> str:
    lines = []
    for number, run in enumerate(rounds, 1):
        if not run["compared"]:
            lines.append(f"round {number}: disturbed (single valid {run['single_valid']}, merged valid "
                         f"{run['merged_valid']}, server on schedule {run['server_on_schedule']}): not compared")
            continue
        lines.append(f"round {number}:")
        lines += [f"  {r['figure']} {r['stat']}: one process {r['single']:.2f}, shards {r['merged']:.2f}, "
                  f"difference {r['difference']:+.2f} (limit {r['tolerance']:.2f}) {'ok' if r['ok'] else 'OUTSIDE'}"
                  for r in run["rows"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    p.add_argument("--rounds", type=int, default=3, help="times the pair of runs is sent")
    p.add_argument("--shards", type=int, default=3, help="shard processes of the sharded run")
    p.add_argument("-n", type=int, default=90, help="measured requests per run")
    p.add_argument("-c", type=int, default=9, help="concurrent streams per run (split over the shards)")
    p.add_argument("--input-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    args = p.parse_args(argv)

    def body() -> int:
        if args.rounds < 1 or args.shards < 2 or args.c < args.shards or args.output_tokens < 2:
            raise UsageError("--rounds takes 1 or more, --shards 2 or more, -c at least --shards, "
                             "--output-tokens 2 or more")
        load = ["-n", str(args.n), "-c", str(args.c), "--input-tokens", str(args.input_tokens),
                "--output-tokens", str(args.output_tokens), "--timeline-interval", "0"]
        rounds = []
        with calibration_server.spawned(["--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms)]) as url, \
                tempfile.TemporaryDirectory() as tmp:
            for number in range(args.rounds):
                printing.progress(f"shard_accuracy: round {number + 1} of {args.rounds}")
                sent = send_both(url, Path(tmp), load, args.shards)
                with http_client.client(url) as http:
                    truth = http_client.get_json(http, "/calibration/truth")
                on_schedule = kept_schedule(truth, sent, args.ttft_ms, args.itl_ms, args.output_tokens)
                single_valid, merged_valid = sent["single"]["client"]["valid"], sent["merged"]["client"]["valid"]
                compared = single_valid and merged_valid and on_schedule
                rounds.append({"single_valid": single_valid, "merged_valid": merged_valid,
                               "server_on_schedule": on_schedule, "compared": compared,
                               "rows": compare_runs(sent["single"], sent["merged"], args.output_tokens) if compared else []})
        ok = any(r["compared"] for r in rounds) and all(row["ok"] for r in rounds for row in r["rows"])
        printed = printing.emit({"rounds": rounds, "shards": args.shards, "load": " ".join(load), "within_limits": ok},
                                human(rounds) + ("\nwithin limits" if ok else "\nOUTSIDE limits or no round compared"),
                                args.output)
        return printed or (EXIT_OK if ok else EXIT_CHECK_FAILED)
    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
