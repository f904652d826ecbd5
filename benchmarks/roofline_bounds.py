#!/usr/bin/env python3
"""Check the roofline against published measurements: bounds below them, FP8-vs-4-bit the right way.

Reads tests/fixtures/roofline_measurements.yaml (published decode and time-to-first-token
latencies, each cited) and computes roofline.py's pure bound for the same model, GPU, TP, batch
and context. A bound above a measurement would mean the tool claims something faster than was
ever achieved: that fails the check. The ratio measured / bound shows how far real serving sits
from the physics (1.3-2x is healthy for dense models; big MoE at batch 1 sits far above).

The fixture's `directions` compare FP8 with 4-bit weight-only (AWQ/GPTQ through Marlin) at batch 1
and at large batch: the roofline's expected decode step must name the same winner as the cited
GEMM measurements (4-bit at batch 1, where the step is a weight read; FP8 at large batch, where it
is a GEMM on FP8 tensor cores against Marlin's dequantize-then-bf16).

Examples:
  python benchmarks/roofline_bounds.py
  python benchmarks/roofline_bounds.py --json
  task bench:roofline

Exit codes: 0 every bound at or below its measurement and every direction right, 1 otherwise,
2 bad fixture.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import yaml  # noqa: E402

from rooflib.core import (
    cli,  # noqa: E402
    printing,  # noqa: E402
)
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK  # noqa: E402
from rooflib.sizing import (
    memory_budget,  # noqa: E402
    physics,  # noqa: E402
    resolve,  # noqa: E402
)

FIXTURE = ROOT / "tests" / "fixtures" / "roofline_measurements.yaml"


def physics_for(case: dict[str, Any], quant: str | None = None) -> physics.Physics:
    return physics.Physics(memory_budget.Inputs(
        model=resolve.resolve_model(case["model"]), gpu=resolve.resolve_gpu(case["gpu"], None), tp=case.get("tp", 1),
        kv_dtype=case.get("kv_dtype", "auto"), quant=quant or case.get("quant", "auto")))


def bound_ms(case: dict[str, Any]) -> float:
    model = physics_for(case)
    if case["kind"] == "prefill":
        return model.prefill(case["context"])["ttft_ms_bound"]
    return model.decode(case["batch"], case["context"])["step_ms_bound"]


def direction(case: dict[str, Any]) -> dict[str, Any]:
    """Which of FP8 and 4-bit weight-only the roofline expects faster, against which was measured."""
    fp8, int4 = (physics_for(case, quant).decode(case["batch"], case["context"])["step_ms_expected"]
                 for quant in ("fp8", "awq"))
    measured = "4-bit" if case["int4_speedup"] > case["fp8_speedup"] else "fp8"
    winner = "4-bit" if int4 < fp8 else "fp8"
    return {"id": case["id"], "batch": case["batch"], "fp8_expected_ms": round(fp8, 3), "int4_expected_ms": round(int4, 3),
            "roofline_winner": winner, "measured_winner": measured, "ok": winner == measured, "source": case["source"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--fixture", default=str(FIXTURE), help="measurements file")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        rows = []
        fixture = yaml.safe_load(Path(args.fixture).read_text())
        for case in fixture["cases"]:
            bound = bound_ms(case)
            rows.append({"id": case["id"], "kind": case["kind"], "measured_ms": case["measured_ms"],
                         "bound_ms": round(bound, 3), "measured_over_bound": round(case["measured_ms"] / bound, 2),
                         "ok": bound <= case["measured_ms"], "source": case["source"]})
        violations = [row for row in rows if not row["ok"]]
        lines = [f"{'case':<44} {'kind':<8} {'measured ms':>11} {'bound ms':>9} {'ratio':>6}"]
        lines += [f"{r['id']:<44} {r['kind']:<8} {r['measured_ms']:>11.2f} {r['bound_ms']:>9.2f} "
                  f"{r['measured_over_bound']:>5.2f}x{'' if r['ok'] else '  BOUND ABOVE MEASUREMENT'}" for r in rows]
        lines.append(f"bound <= measured in {len(rows) - len(violations)}/{len(rows)} cases")
        directions = [direction(case) for case in fixture.get("directions", [])]
        wrong = [d for d in directions if not d["ok"]]
        lines += [f"{d['id']:<44} batch {d['batch']:>5}: expected ms fp8 {d['fp8_expected_ms']:.2f} / 4-bit "
                  f"{d['int4_expected_ms']:.2f} -> {d['roofline_winner']} faster; measured {d['measured_winner']}"
                  f"{'' if d['ok'] else '  WRONG DIRECTION'}" for d in directions]
        lines.append(f"FP8-vs-4-bit direction right in {len(directions) - len(wrong)}/{len(directions)} cases")
        printed = printing.emit({"cases": rows, "violations": len(violations), "directions": directions,
                               "wrong_directions": len(wrong)}, "\n".join(lines), args.output)
        return printed or (EXIT_CHECK_FAILED if violations or wrong else EXIT_OK)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
