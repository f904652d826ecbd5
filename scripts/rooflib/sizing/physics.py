"""Roofline physics behind `task roofline` and the summary of `task vram`: bytes, FLOPs, bounds.

Decode step at batch B (per GPU): bytes read (weights the step touches + the KV cache of B
requests at PROMPT_TOKENS of context) over HBM bandwidth, or FLOPs over dense peak when that is
larger, plus the TP all-reduce bytes over the interconnect. Prefill: FLOPs (linear layers +
causal attention) over dense peak, or the weight read when that is larger. MoE: FLOPs use the
active experts; bytes use the expected number of distinct experts a batch touches. "bound" is
pure physics; "expected" applies the stated efficiency factors, runs the linear layers and
attention one after the other (they are separate kernels), and charges 4-bit weight-only
kernels (AWQ/GPTQ through Marlin) their real cost: see W4A16_GEMM_SHARE.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rooflib.sizing.kv_cache import kv_dtype_bytes, layer_token_bytes, linear_state_bytes
from rooflib.sizing.memory_budget import Inputs, check_inputs
from rooflib.sizing.model_shape import QUANT_BYTES
from rooflib.sizing.weights import count_params, weight_quant

EFFICIENCY = {  # the "expected" line: references/en/roofline.md, "Expected"
    "nvidia": {"hbm": 0.90, "gemm": 0.75},
    "amd": {"hbm": 0.80, "gemm": 0.60},
}
# 4-bit weight-only (W4A16: AWQ, GPTQ, compressed-tensors int4) kernels dequantize the weights in
# registers and multiply on the 16-bit tensor cores: they read 4x fewer bytes than bf16, but get no
# FP8 peak, and at large batch they run below the same GPU's 16-bit cuBLAS. Marlin's own bench.py
# in vLLM PR #2497 (https://github.com/vllm-project/vllm/pull/2497, comment of 2024-01-24): 3.12x
# faster than fp16 at batch 1, 1.01x at 128, 0.60-0.74x from 256 to 4000 (the kernel plateaus
# at 141 TFLOP/s; for batches above 64 it repeats its batch-64 tile, IST-DASLab/marlin#2). Marlin
# is Ampere code without Hopper's wgmma (https://github.com/IST-DASLab/marlin_artifact README).
# FP8 (W8A8) instead runs the FP8 tensor cores: 1.40x bf16 at batch 1024 on B200 (vLLM PR
# #19566, https://github.com/vllm-project/vllm/pull/19566). So 4-bit wins where the step is a
# weight read (small batch) and loses to FP8 where it is a GEMM (large batch, prefill).
W4A16_GEMM_SHARE = 0.6
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

    def __init__(self, inp: Inputs):
        self.inp = inp
        m = self.m = inp.model
        self.quant = weight_quant(m, inp.quant)
        self.p = count_params(m)
        qb = QUANT_BYTES[self.quant]
        hp = float(min(m.dtype_bytes, 2))
        linear = hp if self.quant == "mxfp4" else qb
        self.tp = inp.tp
        # Weights every step reads whatever the batch: attention, dense MLP, shared experts,
        # replicated projections, the LM head (tied: the embedding matrix).
        self.fixed_weight_bytes = ((self.p.attention + self.p.dense_mlp + self.p.shared) * linear
                                   + self.p.embed * hp) / self.tp + self.p.replicated * hp
        self.expert_bytes = self.p.expert_each * qb / self.tp
        self.moe_layers = sum(m.moe_layers)
        kv_bytes = kv_dtype_bytes(m, inp.kv_dtype)
        self.layer_token_bytes = layer_token_bytes(m, inp.tp, kv_bytes, inp.kv_dtype.lower())
        self.attention_layers = [layer for layer in m.layers if layer.kind != "linear"]
        linear_layers = len(m.layers) - len(self.attention_layers)
        self.state_bytes = linear_state_bytes(m, inp.tp) * linear_layers if m.linear_state else 0
        self.active_linear_params = (self.p.attention + self.p.dense_mlp + self.p.shared + self.p.replicated
                                     + self.p.embed + self.moe_layers * m.top_k * self.p.expert_each)
        self.flops_peak, self.flops_precision = peak_flops(inp.gpu, self.quant)
        self.bandwidth = inp.gpu["bandwidth_tb_s"] * 1e12
        self.link = (inp.gpu.get("interconnect_gb_s") or 32) * 1e9
        self.eff = EFFICIENCY.get(inp.gpu.get("vendor", "nvidia"), EFFICIENCY["nvidia"])
        self.bf16_peak = inp.gpu["bf16_dense_tflops"] * 1e12
        # the achievable share of flops_peak the linear layers' kernel reaches at large batch
        self.linear_gemm_eff = self.eff["gemm"] * (W4A16_GEMM_SHARE if self.quant == "int4" else 1.0)

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

    def _linear_expected_s(self, weight_bytes: float, flops: float) -> float:
        """Linear layers: the weight read or the GEMM, at the kernel's achievable rates."""
        return max(weight_bytes / (self.bandwidth * self.eff["hbm"]), flops / (self.flops_peak * self.linear_gemm_eff))

    def _attention_expected_s(self, kv_bytes: float, flops: float) -> float:
        """Attention: the KV read or its FLOPs, which run in 16 bits whatever the weights are."""
        return max(kv_bytes / (self.bandwidth * self.eff["hbm"]), flops / (self.bf16_peak * self.eff["gemm"]))

    def decode(self, batch: int, context: int) -> dict[str, Any]:
        experts = expected_experts(self.m.experts, self.m.top_k, batch)
        weights = self.fixed_weight_bytes + self.moe_layers * experts * self.expert_bytes
        kv = batch * (self.layer_token_bytes * self._attended(context) + 2 * self.state_bytes)
        linear_flops = 2 * self.active_linear_params * batch / self.tp
        attention_flops = batch * self._attention_flops_per_token(self._attended(context)) / self.tp
        flops = linear_flops + attention_flops
        t_mem, t_flops = (weights + kv) / self.bandwidth, flops / self.flops_peak
        comm, count = self._allreduce_s(batch)
        bound = max(t_mem, t_flops) + comm
        expected = (self._linear_expected_s(weights, linear_flops) + self._attention_expected_s(kv, attention_flops)
                    + comm / LINK_EFFICIENCY + count * ALLREDUCE_LATENCY_S + STEP_OVERHEAD_S)
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
        linear_flops = 2 * self.active_linear_params * prompt_tokens / self.tp
        attention_flops = self._attention_flops_per_token(self._causal_pairs(prompt_tokens)) / self.tp
        flops = linear_flops + attention_flops
        t_mem, t_flops = weights / self.bandwidth, flops / self.flops_peak
        comm, count = self._allreduce_s(prompt_tokens)
        bound = max(t_mem, t_flops) + comm
        expected = (self._linear_expected_s(weights, linear_flops) + self._attention_expected_s(0.0, attention_flops)
                    + comm / LINK_EFFICIENCY + count * ALLREDUCE_LATENCY_S + STEP_OVERHEAD_S)
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


def fp8_crossover_batch(inp: Inputs, context: int, limit: int = 4096) -> int | None:
    """For 4-bit weight-only weights on a GPU with FP8 tensor cores: the smallest batch from which
    the same model in FP8 has the shorter expected decode step (None: 4-bit stays faster)."""
    int4 = Physics(inp)
    if int4.quant != "int4" or not inp.gpu.get("fp8_dense_tflops"):
        return None
    fp8 = Physics(dataclasses.replace(inp, quant="fp8"))

    def fp8_wins(batch: int) -> bool:
        return fp8.decode(batch, context)["step_ms_expected"] < int4.decode(batch, context)["step_ms_expected"]

    if not fp8_wins(limit):
        return None
    low, high = 1, limit
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fp8_wins(mid) else (mid + 1, high)
    return low


def roofline(inp: Inputs, memory: Mapping[str, Any] | None = None, batch: int | None = None,
             prompt_tokens: int | None = None) -> dict[str, Any]:
    """Decode and prefill bounds, a batch table up to what the KV cache holds, the crossover batch."""
    check_inputs(inp)
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
        "fp8_faster_from_batch": fp8_crossover_batch(inp, prompt),
        "fp8_tensor_cores": bool(inp.gpu.get("fp8_dense_tflops")),
        "max_batch_in_kv_cache": most if memory else None,
        "assumptions": {"hbm_efficiency": phys.eff["hbm"], "gemm_efficiency": phys.eff["gemm"],
                        "linear_gemm_efficiency": round(phys.linear_gemm_eff, 3),
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
    if r["weights_quant"] == "int4":
        share = r["assumptions"]["linear_gemm_efficiency"] / r["assumptions"]["gemm_efficiency"]
        text = (f"    4-bit weight-only (AWQ/GPTQ, Marlin): GEMMs on 16-bit tensor cores at {share:g} of their rate; ")
        fp8_from = r.get("fp8_faster_from_batch")
        if fp8_from:
            text += f"the same model in FP8 is expected faster from batch {fp8_from:,} at this context"
        elif r["fp8_tensor_cores"]:
            text += "it stays faster than FP8 up to batch 4,096 at this context"
        else:
            text += "this GPU has no FP8 tensor cores (FP8 runs weight-only here too)"
        lines.append(text)
    return lines
