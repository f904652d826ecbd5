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

"Max concurrency" counts requests of the FULL context (CTX). The answer also gives how many fit
at once at a typical length (--typical-tokens, TYPICAL, default 2,048: prompt and answer of a
chat turn with some history), which is what "users" usually means. A verdict within 25% of one
full-context request (0.8x to 1.25x) or 1 GiB of KV space (twice the estimate's error) is
marginal: the answer says so and which gpu_memory_utilization flips it.

--url URL sizes the model a running vLLM serves (without MODEL; the task passes INFER_URL when
MODEL is empty): /v1/models gives the model's root (its config.json is read from the Hugging Face
id, or from the path when this machine can read it) and max_model_len (CTX); /metrics gives
vllm:cache_config_info (block size, gpu_memory_utilization, KV-cache tokens), and the server's
own KV-cache size is printed beside the estimate. Without GPU or GPU_GB the server's KV tokens
fix the KV space. When the root is a path on the server, pass MODEL (a catalog name, the Hugging
Face id, or a local copy of its config.json) with --url.

Examples:
  vram.py --model qwen3-32b --gpu h100 --ctx 32768
  vram.py --model Qwen/Qwen3-32B-FP8 --gpu H100 --kv-dtype fp8 --json
  vram.py --model deepseek-r1 --gpu h200 --tp 8 --ctx 65536
  vram.py --model ~/.cache/roofline/models/tiny-llama --kv-cache-bytes 1073741824 --platform cpu --ctx 2048
  vram.py --model llama-3.1-70b --gpu-gb 48 --tp 2 --engine sglang
  vram.py --model qwen3-32b --gpu h100 --ctx 32768 --typical-tokens 4096
  vram.py --model qwen3-32b --gpu-gb 80 --ctx 131072 --kv-dtype fp8 --tp 2 \
          --rope-scaling '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
  vram.py --model ./my-model/config.json --gpu-gib 22.08 --ctx 8192
  vram.py --url http://10.0.0.5:8000 --gpu h100
  task infer:vram MODEL=qwen3-32b GPU=h100 CTX=32768 KV_DTYPE=fp8
  task infer:vram INFER_URL=http://10.0.0.5:8000 GPU=h100 TYPICAL=4096

Exit codes: 0 fits (at least one request of CTX tokens), 1 does not fit (the levers say what
would), 2 bad input (unknown model or GPU, CTX beyond the model's limit, TP that does not divide
the heads, a number out of range, JSON that does not parse, a served model whose config is not
readable here), 3 fetching config.json or the server failed.
JSON keys beyond the budget: kv_cache_tokens_low/high, max_concurrency_low/high, non_kv_spread_gib,
marginal, marginal_reason, flips_at_gpu_util, multimodal, expert_parallel, typical, server.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping, Sequence

from rooflib.core import cli, conf, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from rooflib.server import served
from rooflib.sizing import estimate, physics
from rooflib.sizing.estimate import Inputs

TYPICAL_TOKENS = 2048  # prompt + answer of a chat turn with some history: the default "typical" request
MARGINAL_RATIO = (0.8, 1.25)  # full-context requests: a verdict this close to 1x is marginal
MARGINAL_KV_GIB = 1.0  # or this close in KV space: twice the estimate's stated +-0.5 GiB


def _gib(value: float) -> str:
    return f"{value:.2f} GiB"


def typical_concurrency(inp: Inputs, result: Mapping[str, Any], typical: int) -> dict[str, Any]:
    """Requests of `typical` tokens the same KV space holds at once (vLLM's block count per request)."""
    space = int(max(0.0, result["kv_cache_gib"]) * estimate.GIB)
    at = estimate.estimate(dataclasses.replace(inp, ctx=min(typical, result["ctx"]), kv_cache_bytes=space))
    return {"tokens": typical, "max_concurrency": at["max_concurrency"]}


def flip_util(inp: Inputs, result: Mapping[str, Any]) -> float | None:
    """The nearest gpu_memory_utilization (0.50-0.99, in steps of 0.01) that flips the verdict."""
    if result["kv_space_fixed"] or not result.get("gpu_util"):
        return None
    step = -0.01 if result["fits"] else 0.01
    util = round(result["gpu_util"] + step, 2)
    while 0.5 <= util <= 0.99:
        if estimate.estimate(dataclasses.replace(inp, gpu_util=util))["fits"] != result["fits"]:
            return util
        util = round(util + step, 2)
    return None


def near_one_request(inp: Inputs, result: Mapping[str, Any]) -> None:
    """A verdict close to 1x full-context requests is marginal even when the estimate's range holds
    it (sizing marks the flips inside the range): say which utilization flips it."""
    ratio = result["max_concurrency"]
    per_request = result["kv_cache_gib"] / ratio if ratio > 0 else None
    margin = result["kv_cache_gib"] - per_request if per_request else None
    close = MARGINAL_RATIO[0] <= ratio < MARGINAL_RATIO[1] or (margin is not None and abs(margin) <= MARGINAL_KV_GIB)
    flip = flip_util(inp, result) if close or result["marginal"] else None
    result["flips_at_gpu_util"] = flip
    if close and not result["marginal"]:
        said = f"{ratio:.2f}x requests of the full context ({margin:+.2f} GiB of KV space beyond one request)"
        if flip:
            said += (f"; it does not fit at gpu_memory_utilization {flip:g}" if result["fits"]
                     else f"; it fits from gpu_memory_utilization {flip:g}")
        result["marginal"], result["marginal_reason"] = True, said + ": measure on the server (its log's \"Maximum concurrency\")"


def served_inputs(args, transport: Any = None) -> tuple[dict[str, Any], estimate.ServerDefaults]:
    """What the server at --url says: its description for the answer, and the MODEL, CTX, GPU_UTIL,
    block size and KV dtype it serves with (and, without a GPU, its KV space) for sizing to take
    where the user gives none."""
    settings = conf.settings_from_args(args)
    facts = served.served_facts(conf.normalize_url(args.url), conf.api_key(settings))
    info, dep = facts["cache_config"], facts["deployment"]
    model = settings.get("MODEL", args.model)
    if not model:
        config, where = served.root_config(facts["root"], transport)
        if config is None:
            raise UsageError(f"cannot size {facts['model']}: {where}; pass MODEL=<catalog name, Hugging Face "
                                    "id or a local copy of its config.json> with --url")
    defaults = estimate.ServerDefaults(
        model=facts["root"], ctx=facts["max_model_len"] or None, gpu_util=dep.get("gpu_memory_utilization"),
        block_size=dep.get("block_size") or None, kv_dtype=info.get("cache_dtype") or None)
    no_gpu = not settings.get("GPU", args.gpu) and not settings.get("GPU_GB", args.gpu_gb)
    if no_gpu and args.kv_cache_bytes is None and args.kv_cache_gib is None:
        if not dep.get("kv_cache_tokens"):
            raise UsageError("the server exports no vllm:cache_config_info: pass GPU=<name> or GPU_GB to size it")
        # No GPU named: the server's own KV tokens fix the KV space (no budget to estimate).
        m = estimate.resolve_model(model or defaults.model, transport)
        tp = cli.number("TP", settings.get("TP", args.tp)) or 1
        kv_dtype = settings.get("KV_DTYPE", args.kv_dtype) or defaults.kv_dtype or "auto"
        per_layer = estimate.layer_token_bytes(m, tp, estimate.kv_dtype_bytes(m, kv_dtype), kv_dtype.lower())
        attention_layers = sum(1 for layer in m.layers if layer.kind != "linear")
        defaults = dataclasses.replace(defaults, kv_cache_bytes=dep["kv_cache_tokens"] * per_layer * attention_layers,
                                       platform="cpu")
    return ({"url": facts["url"], "model": facts["model"], "root": facts["root"],
             "max_model_len": facts["max_model_len"], "deployment": dep}, defaults)


def render(r: Mapping[str, Any]) -> str:
    """The human answer: verdict first, then the budget, the KV cache, the levers, the roofline."""
    per = f"TP={r['tp']}" + (f" PP={r['pp']}" if r["pp"] > 1 else "")
    verdict = ("FITS" if r["fits"] else "DOES NOT FIT") + (" (marginal)" if r.get("marginal") else "")
    lines = [f"{verdict}: {r['model']} on {r['gpu']} ({per}), {r['engine']}, {r['ctx']:,} tokens per request: "
             f"max concurrency {r['max_concurrency']:.2f}x requests of the full {r['ctx']:,} tokens"]
    typical = r.get("typical")
    if typical:
        lines.append(f"  at a typical {typical['tokens']:,} tokens per request (TYPICAL, default {TYPICAL_TOKENS:,}): "
                     f"{typical['max_concurrency']:,.1f} requests at once")
    server = r.get("server")
    if server:
        dep = server["deployment"]
        said = (f"{dep['kv_cache_tokens']:,} KV tokens, {dep['max_concurrency_at_max_model_len']:.2f}x at its "
                f"max-model-len {server['max_model_len'] or 'n/a'}") if dep.get("kv_cache_tokens") else "no cache_config_info"
        lines.append(f"  server    {server['url']} serves {server['model']} (root {server['root']}): {said}"
                     + (f", KV cache sized by {dep['kv_cache_sized_by']}" if dep.get("kv_cache_sized_by") else ""))
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
    server, defaults = served_inputs(args, transport) if args.url else (None, estimate.ServerDefaults())
    inp = estimate.inputs_from_args(args, transport, defaults)
    result = estimate.estimate(inp)
    if server and inp.gpu.get("id") == "cpu":
        result["gpu"] = "the server's device (KV space from its metrics)"
    result["levers"] = estimate.levers(inp, result)
    result["fix"] = None if result["fits"] else estimate.smallest_fix(inp, result)
    typical = cli.number("TYPICAL", conf.settings_from_args(args).get("TYPICAL", args.typical_tokens)) \
        or TYPICAL_TOKENS
    result["typical"] = typical_concurrency(inp, result, typical) if result["kv_cache_gib"] > 0 else None
    near_one_request(inp, result)
    result["server"] = server
    result |= {"kind": "vram", "schema_version": 1}
    return result, inp


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    estimate.add_model_args(p)
    p.add_argument("--no-roofline", action="store_true", help="leave out the roofline summary")
    p.add_argument("--typical-tokens", help=f"a typical request's tokens, prompt + answer (TYPICAL, default "
                                            f"{TYPICAL_TOKENS:,}): how many such requests fit at once")
    p.add_argument("--url", default="", help="size the model a running vLLM serves (its /v1/models and /metrics); "
                                             "the task passes INFER_URL when MODEL is empty")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        result, inp = run(args)
        if not args.no_roofline and inp.gpu.get("bandwidth_tb_s"):
            result["roofline"] = physics.roofline(inp, result)
        printed = printing.emit(result, render(result), args.output)
        return printed or (EXIT_OK if result["fits"] else EXIT_CHECK_FAILED)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
