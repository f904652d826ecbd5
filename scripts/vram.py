#!/usr/bin/env python3
"""Does a model fit on a GPU, how many tokens of KV cache, how many concurrent requests: as vLLM computes it.

The model is a catalog name (scripts/rooflib/catalog/models.yaml, works offline), a Hugging Face repo id
(config.json is fetched once with httpx, HF_TOKEN if set, and cached), or a local folder /
config.json. The GPU is a catalog name (scripts/rooflib/catalog/gpus.yaml) or --gpu-gb.

vLLM's accounting (vllm/v1/worker/gpu_worker.py, vllm/v1/core/kv_cache_utils.py): the budget is
gpu_memory_utilization x TOTAL memory; weights, the activation peak of the profile batch
(max_num_batched_tokens, max_num_seqs x vocab logits), non-torch memory and (vLLM >= 0.21) the
CUDA-graph estimate come out of it; what is left is split into blocks of `block_size` tokens per
KV-cache group (sliding-window, Mamba/linear-attention and full-attention layers are grouped as
vLLM groups them), and "Maximum concurrency" counts the blocks one request of max_model_len needs.
Weights and the activation terms are estimates: every answer carries a low..high range of KV
tokens, the sum of each term's stated spread (range_sources: weights, activation peak, non-torch,
CUDA graphs or eager mode), and wider where the model does not cover the setup and says so
(outside_model): a multimodal model without vision_config, expert-parallel buffers, an AMD GPU
(ROCm), WSL2 (--wsl). A vision_config's encoder is modelled (vision_encoder): its weights, and the
profile run's dummy images (as many as max_num_batched_tokens holds, at least one of the most tokens)
whose activations and encoder-cache outputs join the activation peak.
A BERT-style pooling model (bert, roberta, xlm-roberta: embeddings, score, rerank) has no KV cache:
the answer (model_kind "pooling") is its weights, the profile batch, the memory left, and what bounds
requests instead: one engine step of max_num_seqs requests and max_num_batched_tokens tokens (raised
to max_model_len: no chunked prefill), at the context limit and at TYPICAL.
A verdict that flips inside the range (or with a 0.01 change of gpu_memory_utilization) is marked
marginal with the setting that decides it. Given the KV space (--kv-cache-bytes, like vLLM's
--kv-cache-memory-bytes), tokens and concurrency are exact.
SGLang: KV = total x mem_fraction_static - weights - context overhead, no blocks (its documented
GPU formula; the CPU engine the tests run sizes its pool from the machine's free memory instead,
so this formula is not checked here).

The answer leads with what fits: the weights, one request of the full context (CTX, default the
model's limit), the longest max-model-len that fits one request, and how many requests of a
typical length fit at once (--typical-tokens, TYPICAL, default 2,048: prompt and answer of a chat
turn with some history, never longer than the context limit in force, CTX or the server's
max-model-len), which is what "users" usually means; then what it assumes (the vLLM release whose
defaults it uses, per-GPU figures, a catalog alias). With a context limit given (CTX, or the
server's with --url), `context_room` says how far it can be raised on this KV space: the longest
max-model-len that holds one request (vLLM refuses to start above it) and the longest that holds 4
at once, both within the model's own limit; a lever raises it to the second when that is longer.
kv_cache_tokens divides by a request length only for full-attention models: for sliding-window and
hybrid ones it is vLLM's max concurrency x max-model-len (kv_cache_tokens_meaning says which). A
fit of fewer than 2 full-context requests at once, a miss of 0.8x or more, or a verdict that
flips inside the estimate's range is marginal: the answer says so and which
gpu_memory_utilization flips it. Levers are vLLM flags (with the task setting that checks each);
`fix` is the cheapest combination that fits (settings first, then KV precision, a shorter context
and weight precision, a GPU more last).

--url URL sizes the model a running vLLM serves (without MODEL; the task passes INFER_URL when
MODEL is empty): /v1/models gives the model's root (its config.json is read from the Hugging Face
id, or from the path when this machine can read it) and max_model_len (CTX); /metrics gives
vllm:cache_config_info (block size, gpu_memory_utilization, num_gpu_blocks). The server's own
pool (num_gpu_blocks x block bytes) wins: with GPU or GPU_GB the estimate's error against it is
stated (model_check) and the answer and levers rest on the pool; without, the pool fixes the KV
space. When the root is a path on the server, pass MODEL (a catalog name, the Hugging Face id, or
a local copy of its config.json) with --url.

Examples:
  vram.py --model qwen3-32b --gpu h100 --ctx 32768
  vram.py --model Qwen/Qwen3-32B-FP8 --gpu H100 --kv-dtype fp8 --json
  vram.py --model deepseek-r1 --gpu h200 --tp 8 --ctx 65536
  vram.py --model ~/.cache/roofline/models/tiny-llama --kv-cache-bytes 1073741824 --platform cpu --ctx 2048
  vram.py --model llama-3.1-70b --gpu-gb 48 --tp 2 --engine sglang
  vram.py --model qwen3-32b --gpu h100 --ctx 32768 --typical-tokens 4096
  vram.py --model qwen3-32b --gpu-gb 80 --ctx 131072 --kv-dtype fp8 --tp 2 --rope-scaling '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
  vram.py --model qwen2.5-7b-awq --gpu rtx-4090 --ctx 32768 --wsl
  vram.py --model ./my-model/config.json --gpu-gib 22.08 --ctx 8192
  vram.py --url http://10.0.0.5:8000 --gpu h100
  task infer:vram MODEL=qwen3-32b GPU=h100 CTX=32768 KV_DTYPE=fp8
  task infer:vram INFER_URL=http://10.0.0.5:8000 GPU=h100 TYPICAL=4096

Exit codes: 0 fits (at least one request of CTX tokens), 1 does not fit (the levers say what
would), 2 bad input (unknown model or GPU, CTX beyond the model's limit, TP that does not divide
the heads, a number out of range, JSON that does not parse, a served model whose config is not
readable here), 3 fetching config.json or the server failed.
JSON keys beyond the budget: model_kind (generative or pooling), vision_encoder, kv_cache_tokens_low/high,
max_concurrency_low/high, non_kv_more_gib,
non_kv_less_gib, range_sources, outside_model, kv_cache_tokens_meaning, max_model_len_that_fits,
context_room, typical, assumptions, marginal, marginal_reason, flips_at_gpu_util, levers, fix,
multimodal, expert_parallel, server, model_check.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from rooflib.core import cli, conf, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from rooflib.server import served
from rooflib.sizing import estimate, flags, levers, physics, resolve
from rooflib.sizing.memory_budget import GIB, Inputs

TYPICAL_TOKENS = 2048  # prompt + answer of a chat turn with some history: the default "typical" request
# When a verdict is marginal, in requests of the full context at once (max_concurrency). A fit
# that holds fewer than MARGINAL_REQUESTS serves one long request at a time: a second queues, and
# a small error in the estimate or another process on the GPU takes the one away. A miss from
# MARGINAL_SHORT up is a setting away from fitting. The rest of the rule is estimate.uncertainty's:
# a headroom inside the estimate's own error band (the verdict flips inside the printed range, or
# with 0.01 of gpu_memory_utilization). A count of GiB is no rule: 1 GiB of KV space is 500
# requests of a tiny model's context and a fraction of one of a 70B model's.
MARGINAL_REQUESTS = 2
MARGINAL_SHORT = 0.8


def _gib(value: float) -> str:
    return f"{value:.2f} GiB"


def _space(gib: float) -> str:
    """A KV-space amount in GiB, or in MiB where GiB would round a small model's figures to 0.00."""
    return f"{gib:.2f} GiB" if abs(gib) >= 0.1 else f"{gib * 1024:.1f} MiB"


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
    """A fit of fewer than MARGINAL_REQUESTS full-context requests, or a miss of MARGINAL_SHORT or
    more, is marginal even when the estimate's range holds the verdict (sizing marks the flips
    inside the range): say which utilization flips it."""
    ratio = result["max_concurrency"]
    close = ratio < MARGINAL_REQUESTS if result["fits"] else ratio >= MARGINAL_SHORT
    flip = flip_util(inp, result) if close or result["marginal"] else None
    result["flips_at_gpu_util"] = flip
    if close and not result["marginal"]:
        margin = result["kv_cache_gib"] - result["kv_cache_gib"] / ratio
        if result["fits"]:
            said = f"fewer than {MARGINAL_REQUESTS}; {_space(margin)} of KV space beyond one request"
        elif ratio < 1:
            said = f"at least {MARGINAL_SHORT:g} of one; {_space(-margin)} of KV space short of one request"
        else:  # every block, but vLLM holds one back (memory_budget.reserved_null_blocks)
            said = (f"one request needs every block and vLLM keeps one for itself; "
                    f"{result['max_model_len_that_fits']:,} tokens fit")
        said = f"{ratio:.2f}x requests of the full context ({said})"
        if flip:
            said += (f"; it does not fit at gpu_memory_utilization {flip:g}" if result["fits"]
                     else f"; it fits from gpu_memory_utilization {flip:g}")
        result["marginal"], result["marginal_reason"] = True, said + ": measure on the server (its log's \"Maximum concurrency\")"


def tokens_meaning(r: Mapping[str, Any]) -> str:
    """What kv_cache_tokens is for this model's kind of layers, and whether it divides by a length."""
    if r["engine"] == "sglang" or r["layer_kinds"] == ["full"]:
        return ("the pool every request shares: requests of L tokens at once = kv_cache_tokens / L "
                "(what \"typical\" prints)")
    return ("vLLM's max concurrency x max-model-len, not a pool to divide by a request length (sliding-window "
            "layers hold their window, linear-attention layers a fixed state): read \"typical\" instead")


def assumptions(inp: Inputs, r: Mapping[str, Any], asked_model: str | None) -> list[str]:
    """What the answer takes for granted beyond the inputs: engine defaults, per-GPU figures, an alias."""
    out = []
    if r.get("model_check"):
        out.append("the KV pool is the server's own (num_gpu_blocks x block bytes, vllm:cache_config_info): tokens "
                   "and concurrency are exact; the levers move the estimated budget from there")
    elif r["kv_space_fixed"]:
        out.append("the KV space is given, not estimated: tokens and concurrency are exact")
    elif inp.engine == "vllm":
        given = {"gpu_memory_utilization": inp.gpu_util, "max_num_seqs": inp.max_num_seqs,
                 "max_num_batched_tokens": inp.max_num_batched_tokens}
        values = {"gpu_memory_utilization": r["gpu_util"], "max_num_seqs": r["max_num_seqs"],
                  "max_num_batched_tokens": r["max_num_batched_tokens"]}
        defaults = [f"{name} {values[name]:g}" for name, value in given.items() if value is None]
        out.append(f"vLLM {inp.vllm_version} accounting (--vllm-version)"
                   + (f" and its defaults on this GPU: {', '.join(defaults)}" if defaults else ""))
    else:
        out.append(f"SGLang: mem_fraction_static {r['gpu_util']:g}" + (" (its default for this GPU)" if inp.gpu_util is None else ""))
    if r["tp"] * r["pp"] > 1:
        out.append(f"memory, weights, KV bytes and tokens are per GPU (each of the {r['tp'] * r['pp']} GPUs holds "
                   "its share of the weights and of the KV heads)")
    else:
        out.append("memory, weights, KV bytes and tokens are per GPU")
    if asked_model and asked_model.lower() != r["model"].lower() and not Path(asked_model).expanduser().exists() \
            and r["model_source"] != f"{resolve.HF_URL}/{asked_model}":
        out.append(f"MODEL {asked_model} is sized as the catalog's {r['model']} (an alias: the same config.json shape, "
                   f"{r['model_source']})")
    return out


def served_inputs(args, transport: Any = None) -> tuple[dict[str, Any], flags.ServerDefaults]:
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
    defaults = flags.ServerDefaults(
        model=facts["root"], ctx=facts["max_model_len"] or None, gpu_util=dep.get("gpu_memory_utilization"),
        block_size=dep.get("block_size") or None, kv_dtype=info.get("cache_dtype") or None)
    no_gpu = not settings.get("GPU", args.gpu) and not settings.get("GPU_GB", args.gpu_gb) \
        and not settings.get("GPU_GIB", args.gpu_gib)
    if no_gpu and args.kv_cache_bytes is None and args.kv_cache_gib is None:
        if not (dep.get("num_gpu_blocks") and dep.get("block_size")):
            raise UsageError("the server exports no vllm:cache_config_info: pass GPU=<name> or GPU_GB to size it")
        # No GPU named: the server's own pool fixes the KV space (no budget to estimate).
        m = resolve.resolve_model(model or defaults.model, transport)
        bare = Inputs(model=m, gpu={}, tp=cli.number("TP", settings.get("TP", args.tp)) or 1,
                      kv_dtype=settings.get("KV_DTYPE", args.kv_dtype) or defaults.kv_dtype or "auto")
        defaults = dataclasses.replace(defaults, platform="cpu",
                                       kv_cache_bytes=dep["num_gpu_blocks"] * estimate.block_bytes(bare, dep["block_size"]))
    return ({"url": facts["url"], "model": facts["model"], "root": facts["root"],
             "max_model_len": facts["max_model_len"], "deployment": dep}, defaults)


def checked_against_server(inp: Inputs, result: dict[str, Any], dep: Mapping[str, Any]) -> tuple[Inputs, dict[str, Any]]:
    """The server's own pool (num_gpu_blocks x block bytes) wins over the estimated budget: the
    budget is shifted by the difference (kv_space_offset_bytes), so the answer and the levers rest
    on the real pool, and the estimate's error against it is stated (model_check)."""
    block = estimate.block_bytes(inp, result["block_size"])
    blocks = dep["num_gpu_blocks"]
    # The server holds `blocks` whole blocks: its space lies between blocks and blocks + 1 of them.
    pool = (blocks + 0.5) * block
    measured_inp = dataclasses.replace(inp, kv_space_offset_bytes=pool - result["kv_cache_gib"] * GIB)
    measured = estimate.estimate(measured_inp)
    tokens = measured["kv_cache_tokens"]
    measured["model_check"] = {
        "server_kv_gib": blocks * block / GIB, "server_kv_tokens": tokens, "server_num_gpu_blocks": blocks,
        "estimated_kv_gib": result["kv_cache_gib"], "estimated_kv_tokens": result["kv_cache_tokens"],
        "estimated_kv_tokens_low": result["kv_cache_tokens_low"], "estimated_kv_tokens_high": result["kv_cache_tokens_high"],
        "error": (result["kv_cache_tokens"] - tokens) / tokens if tokens else None,
        "in_range": result["kv_cache_tokens_low"] <= tokens <= result["kv_cache_tokens_high"],
        "estimated_fits": result["fits"]}
    return measured_inp, measured


def render(r: Mapping[str, Any]) -> str:
    """The human answer: what fits first (weights, the full context, the longest context, requests
    at the typical length), the assumptions, then the budget, the KV cache, the levers, the roofline."""
    if r["model_kind"] == "pooling":
        return "\n".join(pooling_lines(r))
    lines = _headline(r) + [f"  assumes       {text}" for text in r["assumptions"]]
    lines += _server_lines(r) + _budget_lines(r) + _lever_lines(r)
    if r.get("roofline"):
        lines += physics.summary_lines(r["roofline"])
    return "\n".join(lines)


def _server_lines(r: Mapping[str, Any]) -> list[str]:
    """What a server at --url allocated, and the estimate's error against it."""
    check = r.get("model_check")
    if check:
        error = f"{check['error']:+.1%}" if check["error"] is not None else "n/a"
        return [f"  server        {r['server']['url']} allocated {check['server_kv_tokens']:,} KV tokens "
                f"({check['server_num_gpu_blocks']:,} blocks, {_gib(check['server_kv_gib'])}); the model estimated "
                f"{check['estimated_kv_tokens']:,} ({error}, range {check['estimated_kv_tokens_low']:,}-"
                f"{check['estimated_kv_tokens_high']:,}: {'inside' if check['in_range'] else 'outside'}); "
                "this answer uses the server's pool"]
    if not r.get("server"):
        return []
    server, dep = r["server"], r["server"]["deployment"]
    said = (f"{dep['kv_cache_tokens']:,} KV tokens, {dep['max_concurrency_at_max_model_len']:.2f}x at its "
            f"max-model-len {server['max_model_len'] or 'n/a'}") if dep.get("kv_cache_tokens") else "no cache_config_info"
    return [f"  server        {server['url']} serves {server['model']} (root {server['root']}): {said}"
            + (f", KV cache sized by {dep['kv_cache_sized_by']}" if dep.get("kv_cache_sized_by") else "")]


def _budget_lines(r: Mapping[str, Any]) -> list[str]:
    """The memory budget, the KV cache and what its tokens mean, the range and why, marginal."""
    weights = f"weights {_gib(r['weights_gib'])} ({r['weights_quant']}, {_gib(r['weights_total_gib'])} in all)"
    if r["kv_space_fixed"]:
        lines = [f"  memory    KV space fixed at {_gib(r['kv_cache_gib'])} per GPU (no profiling); {weights}"]
    else:
        lines = [f"  memory    {_gib(r['gpu_memory_gib'])} x {r['gpu_util']} = {_gib(r['gpu_memory_gib'] * r['gpu_util'])}; "
                 f"{weights}, activation {_gib(r['activation_gib'])}, non-torch {_gib(r['non_torch_gib'])}, "
                 f"CUDA graphs {_gib(r['cudagraph_gib'])}"
                 + (f"; {r['kv_space_offset_gib']:+.2f} GiB to match the server's pool" if r.get("model_check") else "")]
    kv_line = (f"  KV cache  {_gib(max(0.0, r['kv_cache_gib']))} -> {r['kv_cache_tokens']:,} tokens; "
               f"{r['kv_bytes_per_token']:,} bytes/token per GPU ({r['attention_layers']} attention layers, KV {r['kv_dtype']})")
    if r.get("num_blocks") is not None:
        kv_line += f", {r['num_blocks']:,} blocks of {r['block_size']}"
    lines += [kv_line, f"            tokens: {r['kv_cache_tokens_meaning']}"]
    if r.get("range_sources"):
        lines.append(f"  range     {r['kv_cache_tokens_low']:,}-{r['kv_cache_tokens_high']:,} tokens, "
                     f"{r['max_concurrency_low']:.2f}-{r['max_concurrency_high']:.2f}x "
                     f"(non-KV memory -{r['non_kv_less_gib']:.2f}/+{r['non_kv_more_gib']:.2f} GiB: "
                     + ", ".join(s["source"] for s in r["range_sources"]) + ")")
        lines += [f"            not modelled, the range widens: {why}" for why in r["outside_model"]]
    if r.get("marginal"):
        lines.append(f"  marginal  {r['marginal_reason']}")
    vision = r.get("vision_encoder")
    if vision:
        lines.append(f"  vision    encoder {vision['params_b'] * 1000:,.0f}M parameters "
                     f"({_gib(vision['weights_gib'])} of the weights); the profile run encodes "
                     f"{vision['images_profiled']} image(s) of {vision['tokens_per_image']:,} tokens (encoder budget "
                     f"{vision['budget_tokens']:,} tokens = max(max_num_batched_tokens, one image)): activations "
                     f"{_gib(vision['forward_gib'])}, encoder cache {_gib(vision['cache_gib'])}, in the activation figure")
    if r.get("expert_parallel"):
        lines.append("  expert parallel: experts split over the TP ranks (same bytes per GPU)")
    if r.get("linear_state_bytes_per_request"):
        lines.append(f"            + {r['linear_state_bytes_per_request']:,} bytes of linear-attention state per request")
    return lines


def _lever_lines(r: Mapping[str, Any]) -> list[str]:
    """Each lever as its vLLM flag and vram setting, with requests at once; the cheapest fix."""
    lines = []
    if r.get("levers"):
        typical = r["typical"]["tokens"] if r.get("typical") else min(TYPICAL_TOKENS, r["ctx"])
        lines.append(f"  levers (each alone, from this setup; requests at once at the full context and at {typical:,} tokens):")
        for lever in r["levers"]:
            at_typical = f"{lever['typical_concurrency']:,.1f}" if lever.get("typical_concurrency") is not None else "0"
            lines.append(f"    {lever['change']:<34} {lever['setting']:<22} {lever['max_concurrency']:>7.2f}x at "
                         f"{lever['ctx']:,}, {at_typical} at {lever['typical_tokens']:,}"
                         + ("" if lever["fits"] else "  (still does not fit)")
                         + (f"  needs {lever['needs']}" if lever.get("needs") else ""))
    fix = r.get("fix")
    if fix:
        lines.append(f"  cheapest change that fits: {fix['change']}  ({fix['setting']}: {fix['max_concurrency']:.2f}x "
                     f"at {fix['ctx']:,} on {fix['gpus']} GPU{'s' if fix['gpus'] > 1 else ''})"
                     + (f"; needs {fix['needs']}" if fix.get("needs") else ""))
    elif not r["fits"]:
        lines.append("  no single or combined lever here makes it fit: use more GPUs or a smaller model")
    return lines


def _headline(r: Mapping[str, Any]) -> list[str]:
    """The verdict line, then weights, the full context, the longest context and the typical length."""
    per = f"TP={r['tp']}" + (f" PP={r['pp']}" if r["pp"] > 1 else "")
    notes = (["marginal"] if r.get("marginal") else []) + \
        ([f"not firm: {', '.join(s['source'] for s in r['range_sources'] if s['outside_model'])} not modelled"]
         if r.get("outside_model") else [])
    verdict = ("FITS" if r["fits"] else "DOES NOT FIT") + (f" ({'; '.join(notes)})" if notes else "")
    ctx, longest = r["ctx"], r.get("max_model_len_that_fits")
    budget = r["gpu_memory_gib"] * (r["gpu_util"] or 0)
    weights_fit = r["kv_space_fixed"] or r["weights_gib"] < budget
    if r["fits"]:
        said = f"{r['max_concurrency']:.2f}x requests of the full {ctx:,} tokens at once"
    elif r["kv_cache_gib"] <= 0:
        said = ("the weights alone exceed the budget" if not weights_fit else
                f"weights and overheads exceed the budget by {-r['kv_cache_gib']:.2f} GiB")
    else:
        said = f"the full {ctx:,} tokens per request do not fit ({r['max_concurrency']:.2f}x)" + \
            (f"; up to {longest:,} tokens per request do" if longest else "")
    lines = [f"{verdict}: {r['model']} on {r['gpu']} ({per}), {r['engine']}: {said}"]
    if r["kv_space_fixed"]:
        lines.append(f"  weights       not budgeted: the KV space is given ({_gib(r['kv_cache_gib'])} per device)")
    else:
        lines.append(f"  weights       {'fit' if weights_fit else 'DO NOT FIT'}: {_gib(r['weights_gib'])} per GPU of a "
                     f"{_gib(budget)} budget ({r['weights_quant']})")
    span = (f" (range {r['max_concurrency_low']:.2f}-{r['max_concurrency_high']:.2f}x)"
            if r.get("range_sources") else "")
    lines.append(f"  full context  {ctx:,} tokens: {r['max_concurrency']:.2f}x requests at once{span}, "
                 + ("fits" if r["fits"] else "does not fit"))
    return lines + _context_lines(r)


def _context_lines(r: Mapping[str, Any]) -> list[str]:
    """How long a context fits: how far the context limit in force can be raised when the KV space
    allows more than it (else the longest context that fits), and requests at the typical length."""
    room, longest = r.get("context_room"), r.get("max_model_len_that_fits")

    def limit(tokens: int) -> str:
        return " (the model's limit)" if tokens >= r["model_max_len"] else ""

    if room and room["one_request_tokens"] > r["ctx"]:
        one, several = room["one_request_tokens"], room["four_requests_tokens"]
        lines = [f"  context room  raising --max-model-len from {r['ctx']:,}: up to {one:,} tokens{limit(one)} for one "
                 f"request at a time; up to {several:,}{limit(several)} with {levers.ROOM_REQUESTS} at once"]
    elif longest:
        lines = [f"  longest fit   {longest:,} tokens for one request (--max-model-len {longest})"
                 + (", the model's limit" if longest >= r["model_max_len"] else "")]
    else:
        lines = ["  longest fit   none: not even a short request fits"] if r["engine"] == "vllm" else []
    typical = r.get("typical")
    if typical:
        said = f"{typical['tokens']:,} tokens" + (
            f", the context limit (TYPICAL {typical['asked_tokens']:,} is longer)" if typical["at_context_limit"]
            else f" (TYPICAL, default {TYPICAL_TOKENS:,})")
        lines.append(f"  typical       {typical['max_concurrency']:,.1f} requests at once of {said}")
    return lines


def pooling_lines(r: Mapping[str, Any]) -> list[str]:
    """The answer for a pooling model: the weights, no KV cache, and what bounds requests instead."""
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    budget = r["gpu_memory_gib"] * r["gpu_util"]
    batched, ctx = r["max_num_batched_tokens"], r["ctx"]
    return [
        f"{verdict}: {r['model']} on {r['gpu']} (TP={r['tp']}), vllm: a pooling model, no KV cache",
        f"  weights       {'fit' if r['weights_gib'] < budget else 'DO NOT FIT'}: {_gib(r['weights_gib'])} per GPU "
        f"of a {_gib(budget)} budget ({r['weights_quant']})",
        "  no KV cache   its attention is bidirectional (encoder-only): a request keeps nothing between steps, so "
        "memory does not bound how many run at once",
        f"  per step      {r['requests_per_step']:,} request(s) of the full {ctx:,} tokens, "
        f"{r['typical_requests_per_step']:,} of {r['typical_tokens']:,} (TYPICAL): each input is computed whole in one "
        f"step (no chunked prefill), at most max_num_batched_tokens {batched:,} tokens and max_num_seqs "
        f"{r['max_num_seqs']:,} requests; more requests queue for the next step",
        f"  memory        {_gib(r['gpu_memory_gib'])} x {r['gpu_util']:g} = {_gib(budget)}; weights "
        f"{_gib(r['weights_gib'])}, activation {_gib(r['activation_gib'])} (a batch of {batched:,} tokens), non-torch "
        f"{_gib(r['non_torch_gib'])}, CUDA graphs {_gib(r['cudagraph_gib'])}; {_gib(r['left_gib'])} left that no "
        "request uses (a lower --gpu-memory-utilization gives it to other processes)",
        f"  levers        --max-num-batched-tokens above {batched:,} puts more tokens in a step (more requests per "
        "step, each step longer); --max-model-len below the model's limit lets a step hold more requests of the limit",
    ]


def run(args, transport: Any = None) -> tuple[dict[str, Any], Inputs]:
    server, defaults = served_inputs(args, transport) if args.url else (None, flags.ServerDefaults())
    inp = flags.inputs_from_args(args, transport, defaults)
    settings = conf.settings_from_args(args)
    asked = cli.number("TYPICAL", settings.get("TYPICAL", args.typical_tokens)) or TYPICAL_TOKENS
    if inp.model.encoder_only:
        fit = estimate.pooling_fit(inp, asked)
        return {**dataclasses.asdict(fit), "model_kind": "pooling", "kv_cache": None, "server": server,
                "kind": "vram", "schema_version": 1}, inp
    result = estimate.estimate(inp)
    dep = server["deployment"] if server else {}
    if not result["kv_space_fixed"] and dep.get("num_gpu_blocks") and result["engine"] == "vllm":
        inp, result = checked_against_server(inp, result, dep)
    if server and inp.gpu.get("id") == "cpu":
        result["gpu"] = "the server's device (KV space from its metrics)"
    # vLLM refuses a request longer than max_model_len ("This model's maximum context length is N
    # tokens. However, your prompt contains ...", vllm/renderers/params.py, vLLM 0.32): the typical
    # request is capped at the limit in force (CTX, or the server's).
    typical = min(asked, result["ctx"])
    result["context_room"] = levers.context_room(inp, result)
    result["levers"] = levers.levers(inp, result, typical)
    result["fix"] = None if result["fits"] else levers.cheapest_fix(inp, result, shortest_ctx=typical)
    at_typical = levers.concurrency_at(inp, result, typical)
    result["typical"] = {"tokens": typical, "asked_tokens": asked, "at_context_limit": typical < asked,
                         "max_concurrency": at_typical} if at_typical is not None else None
    result["model_max_len"] = inp.model.max_len
    result["kv_cache_tokens_meaning"] = tokens_meaning(result)
    result["assumptions"] = assumptions(inp, result, settings.get("MODEL", args.model) or None)
    near_one_request(inp, result)
    result["server"] = server
    result |= {"model_kind": "generative", "kind": "vram", "schema_version": 1}
    return result, inp


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    flags.add_model_args(p)
    p.add_argument("--no-roofline", action="store_true", help="leave out the roofline summary")
    p.add_argument("--typical-tokens", help=f"a typical request's tokens, prompt + answer (TYPICAL, default "
                                            f"{TYPICAL_TOKENS:,}): how many such requests fit at once")
    p.add_argument("--url", default="", help="size the model a running vLLM serves (its /v1/models and /metrics); "
                                             "the task passes INFER_URL when MODEL is empty")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        result, inp = run(args)
        if not args.no_roofline and inp.gpu.get("bandwidth_tb_s") and result["model_kind"] == "generative":
            result["roofline"] = physics.roofline(inp, result)
        printed = printing.emit(result, render(result), args.output)
        return printed or (EXIT_OK if result["fits"] else EXIT_CHECK_FAILED)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
