#!/usr/bin/env python3
"""The doctor's load-latency trade-off against a sweep on the same server (the CPU vLLM).

1. On cpu-tiny with its default running cap, users come and go (3 always, 24 more for a while)
   while `doctor --symptom streaming` reads a window: its fit of token time against requests
   running (per-token time = a + b x running) is read with no target (a first look).
2. A TPOT p95 target is set between the light and the heavy load's token times; `doctor` runs
   again under the same traffic and proposes the `--max-num-seqs` that meets it (the cap), with
   the per-token time it predicts there.
3. The sweep: the server restarted at half the cap, the cap and twice the cap, each loaded by a
   closed loop that keeps every slot full (twice the cap in flight), and `bench` measures TPOT p95.
The check: at the proposed cap the measured TPOT p95 meets the target; the figures of every point
say how far the fit's prediction is from the measurement.

Examples:
  tradeoff_check.py
  tradeoff_check.py --json-out tradeoff.json

Exit codes: 0 the proposed cap meets the target when applied, 1 it does not (or no cap was
proposed), 2 bad arguments, 3 an engine did not start.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

from live_traffic import traffic  # noqa: E402
from vllm_server import running_vllm  # noqa: E402

from rooflib.core import cli, printing  # noqa: E402
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK  # noqa: E402

LOAD = {"prompt_words": 60, "output_tokens": 128, "think_s": 0.05}


def doctor_under_surge(url: str, model: str, slo_ms: float) -> dict[str, Any]:
    def surge() -> None:
        time.sleep(2)
        with traffic(url, model, concurrency=24, seed=5, **LOAD):
            time.sleep(8)
    thread = threading.Thread(target=surge)
    with traffic(url, model, concurrency=3, **LOAD):
        thread.start()
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "doctor.py"), "--url", url, "--json",
                               "--symptom", "streaming", "--window", "14", "--slo-tpot-p95-ms", f"{slo_ms:.2f}"],
                              capture_output=True, text=True, timeout=900)
        thread.join()
    return json.loads(done.stdout)


def bench_tpot_p95(url: str, concurrency: int) -> float | None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--url", url, "--json",
                           "-c", str(concurrency), "-n", str(4 * concurrency), "--input-tokens", "100",
                           "--output-tokens", "128", "--timeline-interval", "0"],
                          capture_output=True, text=True, timeout=1800)
    result = json.loads(done.stdout) if done.stdout else {}
    return (result.get("tpot_ms") or {}).get("p95")


def measure(log_dir: Path) -> dict[str, Any]:
    with running_vllm(log_dir) as server:
        first = doctor_under_surge(server.url, server.model, 100000)
        fit = first["fit"]
        tpot = first["engine"]["tpot_ms"]
        tail = tpot["p95"] / tpot["mean"] if tpot.get("p95") and tpot.get("mean") else 1.0
        target = (fit["intercept_ms"] + fit["slope_ms"] * 0.4 * fit["running_high"]) * tail
        second = doctor_under_surge(server.url, server.model, target)
    root = second.get("root") or {}
    cap = root.get("proposed") if root.get("cause") == "batch_too_large" else None
    points = []
    for point in sorted({max(1, cap // 2), cap, 2 * cap}) if cap else []:
        with running_vllm(log_dir, sets=[f"max_num_seqs={point}"]) as server:
            measured = bench_tpot_p95(server.url, 2 * point)
        model = second["fit"] or fit
        predicted = (model["intercept_ms"] + model["slope_ms"] * point) * tail
        points.append({"max_num_seqs": point, "tpot_p95_ms": measured, "predicted_p95_ms": round(predicted, 2),
                       "meets": measured is not None and measured <= target})
    return {"kind": "tradeoff_check", "fit_first": fit, "fit": second.get("fit"), "target_ms": round(target, 2),
            "first_line": second.get("first_line"), "proposed_cap": cap, "points": points,
            "met_at_cap": any(p["meets"] for p in points if p["max_num_seqs"] == cap)}


def human_text(result: dict[str, Any]) -> str:
    lines = [result["first_line"] or "no root cause", f"TPOT p95 target {result['target_ms']} ms; proposed cap "
             f"{result['proposed_cap']}"]
    lines += [f"  max_num_seqs {p['max_num_seqs']:>4}: measured TPOT p95 {p['tpot_p95_ms']} ms, predicted "
              f"{p['predicted_p95_ms']} ms, {'meets' if p['meets'] else 'misses'} the target" for p in result["points"]]
    return "\n".join(lines)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        with tempfile.TemporaryDirectory() as tmp:
            result = measure(Path(tmp))
        return printing.emit(result, human_text(result), args.output) or (
            EXIT_OK if result["met_at_cap"] else EXIT_CHECK_FAILED)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
