#!/usr/bin/env python3
"""Lower bounds from physics: decode step time, prefill time and tokens/s for a model on a GPU.

Decode step at batch B (per GPU): bytes read (weights the step touches + the KV cache of B
requests at PROMPT_TOKENS of context) over HBM bandwidth, or FLOPs over dense peak when that is
larger, plus the TP all-reduce bytes over the interconnect. Prefill of PROMPT_TOKENS: FLOPs
(linear layers + causal attention) over dense peak, or the weight read when that is larger.
MoE: FLOPs use the active experts; bytes use the expected number of distinct experts a batch
touches, E x (1 - (1 - k/E)^B) per layer. Pipeline stages run one after another, so PP does not
shorten a token's path.

"bound" is the pure physics (spec bandwidth and peak, nothing else): a measured time below it
means the measurement is wrong. "expected" applies stated efficiency factors (HBM 90% NVIDIA /
80% AMD, GEMM 75% / 60%, links 80%, 8 us per all-reduce, 0.2 ms per step of scheduling): a
measured time far above it points at a configuration problem.

Examples:
  roofline.py --model llama-3.1-8b --gpu h100 --batch 8 --prompt-tokens 2048
  roofline.py --model deepseek-r1 --gpu h200 --tp 8 --json
  task infer:roofline MODEL=qwen3-32b GPU=h100 BATCH=32 PROMPT_TOKENS=4096

Exit codes: 0 ok, 2 bad input (unknown model or GPU, a number out of range), 3 fetching
config.json failed.
"""

import sys
from typing import Any, Mapping, Sequence

from rooflib.core import cli, conf, printing
from rooflib.core.errors import UsageError
from rooflib.sizing import estimate, flags, physics


def human_text(r: Mapping[str, Any]) -> str:
    lines = physics.summary_lines(r)
    lines.append("    batch   step ms (bound / expected)   tok/s per user   tok/s total (bound / expected)")
    for row in r["table"]:
        lines.append(f"    {row['batch']:>5}   {row['step_ms_bound']:>9.2f} / {row['step_ms_expected']:<9.2f}"
                     f"        {row['tokens_per_s_per_user_bound']:>9.0f}   {row['tokens_per_s_total_bound']:>12,.0f} / "
                     f"{row['tokens_per_s_total_expected']:,.0f}")
    return "\n".join(lines)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    flags.add_model_args(p)
    p.add_argument("--batch", help="decode batch for the headline figures (BATCH, default 1)")
    p.add_argument("--prompt-tokens",
                   help=f"prompt length = decode context (PROMPT_TOKENS, default {physics.DEFAULT_PROMPT_TOKENS})")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        s = conf.settings_from_args(args)
        inp = flags.inputs_from_args(args)
        if not inp.gpu.get("bandwidth_tb_s"):
            raise UsageError("the roofline needs a catalog GPU (GPU=h100, ...): GPU_GB alone has no bandwidth")
        batch = cli.number("BATCH", s.get("BATCH", args.batch))
        prompt = cli.number("PROMPT_TOKENS", s.get("PROMPT_TOKENS", args.prompt_tokens))
        memory = estimate.estimate(inp)
        result = physics.roofline(inp, memory, batch, prompt)
        result |= {"kind": "roofline", "schema_version": 1, "model": inp.model.name}
        header = f"{inp.model.name} on {inp.gpu.get('name')} (TP={inp.tp}, weights {result['weights_quant']})"
        return printing.emit(result, header + "\n" + human_text(result), args.output)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
