#!/usr/bin/env python3
"""Check that the roofline never promises more than physics: bound <= every published measurement.

Reads tests/fixtures/roofline_measurements.yaml (published decode and time-to-first-token
latencies, each cited) and computes roofline.py's pure bound for the same model, GPU, TP, batch
and context. A bound above a measurement would mean the tool claims something faster than was
ever achieved: that fails the check. The ratio measured / bound shows how far real serving sits
from the physics (1.3-2x is healthy for dense models; big MoE at batch 1 sits far above).

Examples:
  python benchmarks/roofline_bounds.py
  python benchmarks/roofline_bounds.py --json
  task bench:roofline

Exit codes: 0 every bound at or below its measurement, 1 some bound above, 2 bad fixture.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import common  # noqa: E402
import physics  # noqa: E402
import sizing  # noqa: E402
import yaml  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "roofline_measurements.yaml"


def bound_ms(case: dict[str, Any]) -> float:
    inp = sizing.Inputs(model=sizing.resolve_model(case["model"]), gpu=sizing.resolve_gpu(case["gpu"], None),
                        tp=case.get("tp", 1), kv_dtype=case.get("kv_dtype", "auto"), quant=case.get("quant", "auto"))
    model = physics.Physics(inp)
    if case["kind"] == "prefill":
        return model.prefill(case["context"])["ttft_ms_bound"]
    return model.decode(case["batch"], case["context"])["step_ms_bound"]


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--fixture", default=str(FIXTURE), help="measurements file")
    common.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        rows = []
        for case in yaml.safe_load(Path(args.fixture).read_text())["cases"]:
            bound = bound_ms(case)
            rows.append({"id": case["id"], "kind": case["kind"], "measured_ms": case["measured_ms"],
                         "bound_ms": round(bound, 3), "measured_over_bound": round(case["measured_ms"] / bound, 2),
                         "ok": bound <= case["measured_ms"], "source": case["source"]})
        violations = [row for row in rows if not row["ok"]]
        lines = [f"{'case':<44} {'kind':<8} {'measured ms':>11} {'bound ms':>9} {'ratio':>6}"]
        lines += [f"{r['id']:<44} {r['kind']:<8} {r['measured_ms']:>11.2f} {r['bound_ms']:>9.2f} "
                  f"{r['measured_over_bound']:>5.2f}x{'' if r['ok'] else '  BOUND ABOVE MEASUREMENT'}" for r in rows]
        lines.append(f"bound <= measured in {len(rows) - len(violations)}/{len(rows)} cases")
        common.emit({"cases": rows, "violations": len(violations)}, "\n".join(lines), args.json)
        return common.EXIT_CHECK_FAILED if violations else common.EXIT_OK

    return common.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
