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
from __future__ import annotations

import sys
from argparse import SUPPRESS
from pathlib import Path
from typing import Any, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import vram  # noqa: E402

EFFICIENCY = {  # the "expected" line; research: shared/research/roofline-anchors.md section 2
    "nvidia": {"hbm": 0.90, "gemm": 0.75},
    "amd": {"hbm": 0.80, "gemm": 0.60},
}
LINK_EFFICIENCY = 0.80
ALLREDUCE_LATENCY_S = 8e-6
STEP_OVERHEAD_S = 0.2e-3
DEFAULT_PROMPT_TOKENS = 1024
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens touch in one layer, routing uniformly at random."""
    if not experts:
        return 0.0
    return experts * (1 - (1 - top_k / experts) ** tokens)


def peak_flops(gpu: Mapping[str, Any], quant: str) -> tuple[float, str]:
    """Dense peak FLOP/s for the precision the GEMMs run in (FP8/FP4 only where the GPU has it)."""
    if quant in ("nvfp4", "mxfp4") and gpu.get("fp4_dense_tflops"):
        return gpu["fp4_dense_tflops"] * 1e12, "fp4"
    if quant in ("fp8", "int8", "nvfp4", "mxfp4") and gpu.get("fp8_dense_tflops"):
        return gpu["fp8_dense_tflops"] * 1e12, "fp8"
    return gpu["bf16_dense_tflops"] * 1e12, "bf16"


class Physics:
    """Per-GPU bytes and FLOPs of one model under one setup."""

    def __init__(self, inp: vram.Inputs):
        self.inp = inp
        m = self.m = inp.model
        self.quant = vram.weight_quant(m, inp.quant)
        self.p = vram.count_params(m)
        qb = vram.QUANT_BYTES[self.quant]
        hp = float(min(m.dtype_bytes, 2))
        linear = hp if self.quant == "mxfp4" else qb
        self.tp = inp.tp
        # Weights every step reads whatever the batch: attention, dense MLP, shared experts,
        # replicated projections, the LM head (tied: the embedding matrix).
        self.fixed_weight_bytes = ((self.p.attention + self.p.dense_mlp + self.p.shared) * linear
                                   + self.p.embed * hp) / self.tp + self.p.replicated * hp
        self.expert_bytes = self.p.expert_each * qb / self.tp
        self.moe_layers = sum(m.moe_layers)
        kv_bytes = vram.kv_dtype_bytes(m, inp.kv_dtype)
        self.layer_token_bytes = vram.layer_token_bytes(m, inp.tp, kv_bytes, inp.kv_dtype.lower())
        self.attention_layers = [layer for layer in m.layers if layer.kind != "linear"]
        linear_layers = len(m.layers) - len(self.attention_layers)
        self.state_bytes = vram.linear_state_bytes(m, inp.tp) * linear_layers if m.linear_state else 0
        self.active_linear_params = (self.p.attention + self.p.dense_mlp + self.p.shared + self.p.replicated
                                     + self.p.embed + self.moe_layers * m.top_k * self.p.expert_each)
        self.flops_peak, self.flops_precision = peak_flops(inp.gpu, self.quant)
        self.bandwidth = inp.gpu["bandwidth_tb_s"] * 1e12
        self.link = (inp.gpu.get("interconnect_gb_s") or 32) * 1e9
        self.eff = EFFICIENCY.get(inp.gpu.get("vendor", "nvidia"), EFFICIENCY["nvidia"])

    def _attended(self, context: int) -> int:
        """Tokens each attention layer reads at `context` (sliding layers stop at the window)."""
        return sum(min(context, layer.window) if layer.kind == "sliding" else context for layer in self.attention_layers)

    def _causal_pairs(self, prompt: int) -> int:
        """(query, key) pairs of causal attention over a prompt, summed over attention layers."""
        def pairs(window: int) -> int:
            if not window or prompt <= window:
                return prompt * (prompt + 1) // 2
            return window * (window + 1) // 2 + (prompt - window) * window
        return sum(pairs(layer.window if layer.kind == "sliding" else 0) for layer in self.attention_layers)

    def _attention_flops_per_token(self, attended: int) -> float:
        m = self.m
        if m.mla:  # absorbed MLA decode: scores over kv_lora + rope, values over kv_lora
            return 2 * m.heads * (2 * m.mla[1] + m.mla[3]) * attended
        return 4 * m.heads * m.head_dim * attended

    def _allreduce_s(self, tokens: int) -> tuple[float, int]:
        """Ring all-reduce time (bandwidth only) and count: two per layer under TP."""
        if self.tp == 1:
            return 0.0, 0
        count = 2 * len(self.m.layers)
        message = tokens * self.m.hidden * 2
        return count * 2 * (self.tp - 1) / self.tp * message / self.link, count

    def decode(self, batch: int, context: int) -> dict[str, Any]:
        experts = expected_experts(self.m.experts, self.m.top_k, batch)
        weights = self.fixed_weight_bytes + self.moe_layers * experts * self.expert_bytes
        kv = batch * (self.layer_token_bytes * self._attended(context) + 2 * self.state_bytes)
        flops = (2 * self.active_linear_params * batch
                 + batch * self._attention_flops_per_token(self._attended(context))) / self.tp
        t_mem, t_flops = (weights + kv) / self.bandwidth, flops / self.flops_peak
        comm, count = self._allreduce_s(batch)
        bound = max(t_mem, t_flops) + comm
        expected = (max(t_mem / self.eff["hbm"], t_flops / self.eff["gemm"]) + comm / LINK_EFFICIENCY
                    + count * ALLREDUCE_LATENCY_S + STEP_OVERHEAD_S)
        return {"batch": batch, "context_tokens": context, "weight_bytes_per_gpu": weights,
                "kv_bytes_per_gpu": kv, "flops_per_gpu": flops, "memory_ms": t_mem * 1e3,
                "compute_ms": t_flops * 1e3, "comm_ms": comm * 1e3, "step_ms_bound": bound * 1e3,
                "step_ms_expected": expected * 1e3, "tokens_per_s_per_user_bound": 1 / bound,
                "tokens_per_s_total_bound": batch / bound, "tokens_per_s_total_expected": batch / expected,
                "bound_by": "compute" if t_flops > t_mem else "memory"}

    def prefill(self, prompt_tokens: int) -> dict[str, Any]:
        m = self.m
        experts = expected_experts(m.experts, m.top_k, prompt_tokens)
        weights = self.fixed_weight_bytes + self.moe_layers * experts * self.expert_bytes
        flops = (2 * self.active_linear_params * prompt_tokens
                 + self._attention_flops_per_token(self._causal_pairs(prompt_tokens))) / self.tp
        t_mem, t_flops = weights / self.bandwidth, flops / self.flops_peak
        comm, count = self._allreduce_s(prompt_tokens)
        bound = max(t_mem, t_flops) + comm
        expected = (max(t_mem / self.eff["hbm"], t_flops / self.eff["gemm"]) + comm / LINK_EFFICIENCY
                    + count * ALLREDUCE_LATENCY_S + STEP_OVERHEAD_S)
        return {"prompt_tokens": prompt_tokens, "flops_per_gpu": flops, "weight_bytes_per_gpu": weights,
                "compute_ms": t_flops * 1e3, "memory_ms": t_mem * 1e3, "comm_ms": comm * 1e3,
                "ttft_ms_bound": bound * 1e3, "ttft_ms_expected": expected * 1e3,
                "bound_by": "compute" if t_flops > t_mem else "memory"}

    def compute_bound_batch(self, context: int, limit: int = 1 << 17) -> int | None:
        """The smallest batch whose decode step is compute-bound at this context, if any."""
        def compute_bound(batch: int) -> bool:
            step = self.decode(batch, context)
            return step["compute_ms"] >= step["memory_ms"]
        high = 1
        while not compute_bound(high):
            high *= 2
            if high > limit:
                return None
        low = high // 2 + 1 if high > 1 else 1
        while low < high:
            mid = (low + high) // 2
            if compute_bound(mid):
                high = mid
            else:
                low = mid + 1
        return high


def roofline(inp: vram.Inputs, memory: Mapping[str, Any] | None = None, batch: int | None = None,
             prompt_tokens: int | None = None) -> dict[str, Any]:
    """Decode and prefill bounds, a batch table up to what the KV cache holds, the crossover batch."""
    vram.check_inputs(inp)
    phys = Physics(inp)
    prompt = prompt_tokens or min(DEFAULT_PROMPT_TOKENS, inp.ctx or inp.model.max_len)
    most = max(1, int(memory["max_concurrency"] * (memory["ctx"] / prompt))) if memory else BATCHES[-1]
    batches = sorted({b for b in BATCHES if b <= most} | ({batch} if batch else set()) | {1})
    chosen = batch or 1
    return {
        "gpu": inp.gpu.get("name"), "tp": inp.tp, "weights_quant": phys.quant,
        "flops_precision": phys.flops_precision, "peak_tflops": phys.flops_peak / 1e12,
        "bandwidth_tb_s": phys.bandwidth / 1e12,
        "decode": phys.decode(chosen, prompt),
        "prefill": phys.prefill(prompt),
        "table": [phys.decode(b, prompt) for b in batches],
        "compute_bound_from_batch": phys.compute_bound_batch(prompt),
        "max_batch_in_kv_cache": most if memory else None,
        "assumptions": {"hbm_efficiency": phys.eff["hbm"], "gemm_efficiency": phys.eff["gemm"],
                        "link_efficiency": LINK_EFFICIENCY, "allreduce_latency_us": ALLREDUCE_LATENCY_S * 1e6,
                        "step_overhead_ms": STEP_OVERHEAD_S * 1e3},
    }


def summary_lines(r: Mapping[str, Any]) -> list[str]:
    d, p = r["decode"], r["prefill"]
    lines = [f"  roofline  ({r['bandwidth_tb_s']:g} TB/s, {r['peak_tflops']:g} TFLOP/s {r['flops_precision']} dense; "
             "bound = physics, expected = with stated efficiencies)",
             f"    decode, batch {d['batch']} at {d['context_tokens']:,} tokens: >= {d['step_ms_bound']:.2f} ms/token "
             f"(expected {d['step_ms_expected']:.2f}), <= {d['tokens_per_s_per_user_bound']:.0f} tok/s per user, {d['bound_by']}-bound",
             f"    prefill of {p['prompt_tokens']:,} tokens: >= {p['ttft_ms_bound']:.1f} ms (expected {p['ttft_ms_expected']:.1f}), "
             f"{p['bound_by']}-bound"]
    crossover = r["compute_bound_from_batch"]
    lines.append(f"    decode turns compute-bound at batch {crossover:,}" if crossover else
                 "    decode stays memory-bound at any batch")
    return lines


def render(r: Mapping[str, Any]) -> str:
    lines = summary_lines(r)
    lines.append("    batch   step ms (bound / expected)   tok/s per user   tok/s total (bound / expected)")
    for row in r["table"]:
        lines.append(f"    {row['batch']:>5}   {row['step_ms_bound']:>9.2f} / {row['step_ms_expected']:<9.2f}"
                     f"        {row['tokens_per_s_per_user_bound']:>9.0f}   {row['tokens_per_s_total_bound']:>12,.0f} / "
                     f"{row['tokens_per_s_total_expected']:,.0f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(__doc__)
    vram.add_model_args(p)
    p.add_argument("--batch", default=SUPPRESS, help="decode batch for the headline figures (BATCH, default 1)")
    p.add_argument("--prompt-tokens", default=SUPPRESS,
                   help=f"prompt length = decode context (PROMPT_TOKENS, default {DEFAULT_PROMPT_TOKENS})")
    common.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        s = common.settings_from_args(args)
        inp = vram.inputs_from_args(args)
        if not inp.gpu.get("bandwidth_tb_s"):
            raise common.UsageError("the roofline needs a catalog GPU (GPU=h100, ...): GPU_GB alone has no bandwidth")
        batch = vram.parse_number("BATCH", s.get("BATCH", vram.flag(args, "batch")))
        prompt = vram.parse_number("PROMPT_TOKENS", s.get("PROMPT_TOKENS", vram.flag(args, "prompt_tokens")))
        memory = vram.estimate(inp)
        result = roofline(inp, memory, batch, prompt)
        result |= {"kind": "roofline", "schema_version": 1, "model": inp.model.name}
        header = f"{inp.model.name} on {inp.gpu.get('name')} (TP={inp.tp}, weights {result['weights_quant']})"
        common.emit(result, header + "\n" + render(result), args.json)
        return common.EXIT_OK

    return common.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
