#!/usr/bin/env python3
"""Does a model fit on a GPU, how many tokens of KV cache, how many concurrent requests: as vLLM computes it.

The model is a catalog name (scripts/catalog/models.yaml, works offline), a Hugging Face repo id
(config.json is fetched once with httpx, HF_TOKEN if set, and cached), or a local folder /
config.json. The GPU is a catalog name (scripts/catalog/gpus.yaml) or --gpu-gb.

vLLM's accounting (vllm/v1/worker/gpu_worker.py, vllm/v1/core/kv_cache_utils.py): the budget is
gpu_memory_utilization x TOTAL memory; weights, the activation peak of the profile batch
(max_num_batched_tokens, max_num_seqs x vocab logits), non-torch memory and (vLLM >= 0.21) the
CUDA-graph estimate come out of it; what is left is split into blocks of `block_size` tokens per
KV-cache group (sliding-window, Mamba/linear-attention and full-attention layers are grouped as
vLLM groups them), and "Maximum concurrency" counts the blocks one request of max_model_len needs.
Weights and the activation terms are estimates: every answer carries a low..high range of KV
tokens from their spread, and a verdict that flips inside it (or with a 0.01 change of
gpu_memory_utilization) is marked marginal with the setting that decides it. Given the KV space
(--kv-cache-bytes, like vLLM's --kv-cache-memory-bytes), tokens and concurrency are exact.
SGLang: KV = total x mem_fraction_static - weights - context overhead, no blocks (from its
documented formula; SGLang is not run here).

Examples:
  vram.py --model qwen3-32b --gpu h100 --ctx 32768
  vram.py --model Qwen/Qwen3-32B-FP8 --gpu H100 --kv-dtype fp8 --json
  vram.py --model deepseek-r1 --gpu h200 --tp 8 --ctx 65536
  vram.py --model ~/.cache/roofline/models/tiny-llama --kv-cache-bytes 1073741824 --platform cpu --ctx 2048
  vram.py --model llama-3.1-70b --gpu-gb 48 --tp 2 --engine sglang
  vram.py --model qwen3-32b --gpu-gb 80 --ctx 131072 --kv-dtype fp8 --tp 2 \
          --rope-scaling '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
  vram.py --model ./my-model/config.json --gpu-gib 22.08 --ctx 8192
  task infer:vram MODEL=qwen3-32b GPU=h100 CTX=32768 KV_DTYPE=fp8

Exit codes: 0 fits (at least one request of CTX tokens), 1 does not fit (the levers say what
would), 2 bad input (unknown model or GPU, CTX beyond the model's limit, TP that does not divide
the heads, a number out of range, JSON that does not parse), 3 fetching config.json failed.
JSON keys beyond the budget: kv_cache_tokens_low/high, max_concurrency_low/high, non_kv_spread_gib,
marginal, marginal_reason, multimodal, expert_parallel.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import physics  # noqa: E402
import sizing  # noqa: E402
from sizing import Inputs  # noqa: E402


def _gib(value: float) -> str:
    return f"{value:.2f} GiB"


def render(r: Mapping[str, Any]) -> str:
    """The human answer: verdict first, then the budget, the KV cache, the levers, the roofline."""
    per = f"TP={r['tp']}" + (f" PP={r['pp']}" if r["pp"] > 1 else "")
    verdict = ("FITS" if r["fits"] else "DOES NOT FIT") + (" (marginal)" if r.get("marginal") else "")
    lines = [f"{verdict}: {r['model']} on {r['gpu']} ({per}), {r['engine']}, {r['ctx']:,} tokens per request: "
             f"max concurrency {r['max_concurrency']:.2f}x"]
    weights = f"weights {_gib(r['weights_gib'])} ({r['weights_quant']}, {_gib(r['weights_total_gib'])} in all)"
    if r["kv_space_fixed"]:
        lines.append(f"  memory    KV space fixed at {_gib(r['kv_cache_gib'])} per device (no profiling); {weights}")
    else:
        lines.append(f"  memory    {_gib(r['gpu_memory_gib'])} x {r['gpu_util']} = {_gib(r['gpu_memory_gib'] * r['gpu_util'])}; "
                     f"{weights}, activation {_gib(r['activation_gib'])}, non-torch {_gib(r['non_torch_gib'])}, "
                     f"CUDA graphs {_gib(r['cudagraph_gib'])}")
    kv_line = (f"  KV cache  {_gib(max(0.0, r['kv_cache_gib']))} -> {r['kv_cache_tokens']:,} tokens; "
               f"{r['kv_bytes_per_token']:,} bytes/token ({r['attention_layers']} attention layers, KV {r['kv_dtype']})")
    if r.get("num_blocks") is not None:
        kv_line += f", {r['num_blocks']:,} blocks of {r['block_size']}"
    lines.append(kv_line)
    if r.get("non_kv_spread_gib"):
        lines.append(f"  range     {r['kv_cache_tokens_low']:,}-{r['kv_cache_tokens_high']:,} tokens, "
                     f"{r['max_concurrency_low']:.2f}-{r['max_concurrency_high']:.2f}x "
                     f"(weights and overheads +-{r['non_kv_spread_gib']:.2f} GiB)")
    if r.get("marginal"):
        lines.append(f"  marginal  {r['marginal_reason']}")
    if r.get("expert_parallel"):
        lines.append("  expert parallel: experts split over the TP ranks (same bytes per GPU); all-to-all buffers not modelled")
    if r.get("linear_state_bytes_per_request"):
        lines.append(f"            + {r['linear_state_bytes_per_request']:,} bytes of linear-attention state per request")
    if not r["fits"]:
        if r["kv_cache_gib"] <= 0:
            lines.append(f"  no room for any KV cache: weights and overheads exceed the budget by {-r['kv_cache_gib']:.2f} GiB")
        elif r.get("max_model_len_that_fits"):
            lines.append(f"  longest max-model-len that fits one request: {r['max_model_len_that_fits']:,} tokens")
    if r.get("levers"):
        lines.append("  levers (each alone, from this setup):")
        for lever in r["levers"]:
            lines.append(f"    {lever['lever']:<21} {lever['change']:<36} {lever['kv_cache_tokens']:>12,} tokens "
                         f"({lever['kv_cache_tokens_delta']:+,}), {lever['max_concurrency']:.2f}x at {lever['ctx']:,}"
                         + ("" if lever["fits"] else "  (still does not fit)"))
    if r.get("fix"):
        lines.append(f"  smallest change that fits: {r['fix']['change']}")
    elif not r["fits"]:
        lines.append("  no single or combined lever here makes it fit: use more GPUs or a smaller model")
    if r.get("roofline"):
        lines += physics.summary_lines(r["roofline"])
    return "\n".join(lines)


def run(args, transport: Any = None) -> tuple[dict[str, Any], Inputs]:
    inp = sizing.inputs_from_args(args, transport)
    result = sizing.estimate(inp)
    result["levers"] = sizing.levers(inp, result)
    result["fix"] = None if result["fits"] else sizing.smallest_fix(inp, result)
    return result, inp


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(__doc__)
    sizing.add_model_args(p)
    p.add_argument("--no-roofline", action="store_true", help="leave out the roofline summary")
    common.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        result, inp = run(args)
        if not args.no_roofline and inp.gpu.get("bandwidth_tb_s"):
            result["roofline"] = physics.roofline(inp, result)
        common.emit(result, render(result), args.json)
        return common.EXIT_OK if result["fits"] else common.EXIT_CHECK_FAILED

    return common.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
