"""The levers vram offers: each change to a deployment that moves its KV space or context (a vLLM
flag and the vram setting that checks it), its effect alone, the cheapest combination that fits
one request, and how far the context limit can go on the KV space. Each is the estimate run
again on the changed inputs, so a lever says what it gives, not a rule of thumb.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Mapping

from rooflib.sizing.estimate import HIGHER_GPU_UTIL, _stage_capacity, estimate, longest_context
from rooflib.sizing.kv_cache import kv_dtype_bytes
from rooflib.sizing.memory_budget import GIB, Inputs
from rooflib.sizing.model_shape import QUANT_BYTES
from rooflib.sizing.weights import weight_quant


def _gpu_has_fp8(gpu: Mapping[str, Any]) -> bool:
    return gpu.get("fp8_dense_tflops") is not None


@dataclass(frozen=True)
class Lever:
    """One change to the deployment: the vLLM flag, the same setting for vram (task variables),
    what it needs beyond the flag, what it gives up (`cost`: 1 a setting, 2 KV precision, 3
    context or 8-bit weights, 6 4-bit weights, which the skill takes only when nothing else fits,
    10 a GPU more) and the Inputs field it sets."""
    name: str
    flag: str
    setting: str
    cost: int
    field: str
    value: Any
    needs: str = ""

    def applied(self, inp: Inputs) -> Inputs:
        return replace(inp, **{self.field: self.value})


def lever_list(inp: Inputs, base: Mapping[str, Any]) -> list[Lever]:
    """The changes that exist for this setup, cheapest first."""
    m, vllm = inp.model, inp.engine == "vllm"
    out = []
    util = base.get("gpu_util")
    if vllm and not base["kv_space_fixed"] and util and util < HIGHER_GPU_UTIL:
        out.append(Lever("gpu-memory-utilization", f"--gpu-memory-utilization {HIGHER_GPU_UTIL}",
                         f"GPU_UTIL={HIGHER_GPU_UTIL}", 1, "gpu_util", HIGHER_GPU_UTIL))
    seqs = base.get("max_num_seqs")
    if vllm and not base["kv_space_fixed"] and seqs and seqs > 64:
        out.append(Lever("max-num-seqs", f"--max-num-seqs {seqs // 4}", f"MAX_NUM_SEQS={seqs // 4}", 1,
                         "max_num_seqs", seqs // 4))
    if kv_dtype_bytes(m, inp.kv_dtype) > 1:
        out.append(Lever("kv-cache-dtype", "--kv-cache-dtype fp8", "KV_DTYPE=fp8", 2, "kv_dtype", "fp8"))
    ctx = base["ctx"]
    fit = base.get("max_model_len_that_fits")
    shorter = fit if not base["fits"] and fit else ctx // 2
    if shorter >= 1 and shorter < ctx:
        out.append(Lever("max-model-len", f"--max-model-len {shorter}", f"CTX={shorter}", 3, "ctx", shorter))
    room = base.get("context_room")
    if base["fits"] and room and room["four_requests_tokens"] > ctx:
        # Raised to where ROOM_REQUESTS requests still fit at once, not to the one-request bound:
        # there the server starts but holds one request of that length at a time.
        longer = room["four_requests_tokens"]
        out.append(Lever("raise-max-model-len", f"--max-model-len {longer}", f"CTX={longer}", 3, "ctx", longer))
    quant = weight_quant(m, inp.quant)
    if QUANT_BYTES[quant] > 1 and _gpu_has_fp8(inp.gpu):
        out.append(Lever("fp8-weights", "--quantization fp8", "QUANT=fp8", 3, "quant", "fp8"))
    if QUANT_BYTES[quant] > 0.6:
        out.append(Lever("4-bit-weights", "--quantization awq_marlin", "QUANT=awq", 6, "quant", "awq",
                         needs="an AWQ checkpoint of the model"))
    bigger_tp = inp.tp * 2
    if m.heads % bigger_tp == 0 and (m.mla or m.kv_heads % bigger_tp == 0 or bigger_tp % m.kv_heads == 0):
        out.append(Lever("tensor-parallel-size", f"--tensor-parallel-size {bigger_tp}", f"TP={bigger_tp}", 10,
                         "tp", bigger_tp, needs=f"{bigger_tp * inp.pp} GPUs"))
    return out


def levers(inp: Inputs, base: Mapping[str, Any], typical: int | None = None) -> list[dict[str, Any]]:
    """Each lever alone, from this setup: its flag and setting, and its effect on KV tokens, max
    concurrency and requests of `typical` tokens at once (per GPU)."""
    rows = []
    for lever in lever_list(inp, base):
        variant = lever.applied(inp)
        r = estimate(variant)
        rows.append({"lever": lever.name, "change": lever.flag, "setting": lever.setting, "needs": lever.needs or None,
                     "kv_cache_tokens": r["kv_cache_tokens"],
                     "kv_cache_tokens_delta": r["kv_cache_tokens"] - base["kv_cache_tokens"],
                     "ctx": r["ctx"], "max_concurrency": r["max_concurrency"], "fits": r["fits"],
                     "typical_concurrency": concurrency_at(variant, r, typical) if typical else None,
                     "typical_tokens": min(typical, r["ctx"]) if typical else None,
                     "gpus": variant.tp * variant.pp})
    return rows


def concurrency_at(inp: Inputs, result: Mapping[str, Any], tokens: int) -> float | None:
    """Requests of `tokens` tokens the same KV space holds at once (vLLM's block count per request)."""
    if result["kv_cache_gib"] <= 0:
        return None
    space = int(result["kv_cache_gib"] * GIB)
    return estimate(replace(inp, ctx=min(tokens, result["ctx"]), kv_cache_bytes=space))["max_concurrency"]


# Requests at once the context room states beside one request (its field four_requests_tokens):
# at one, a raised limit starts but serves one request of that length at a time.
ROOM_REQUESTS = 4


def context_room(inp: Inputs, result: Mapping[str, Any]) -> dict[str, Any] | None:
    """How far the context limit in force (CTX, or a server's max_model_len) can go on this KV
    space, vLLM only: the longest max_model_len that holds one request, above which vLLM refuses
    to start, and the longest that holds ROOM_REQUESTS at once; both within the model's own
    position limit (derived_max_len), which vLLM enforces as well.

    vLLM's start-up check (vllm/v1/core/kv_cache_utils.py, check_enough_kv_cache_memory and
    get_kv_cache_configs, vLLM 0.32): "To serve at least one request with the model's max seq len
    (N), (X GiB KV cache is needed, which is larger than the available KV cache memory (Y GiB)";
    before the V1 engine: "The model's max seq len (N) is larger than the maximum number of tokens
    that can be stored in KV cache (M)" (vllm/worker/worker.py raise_if_cache_size_invalid).
    """
    if inp.ctx is None or inp.engine != "vllm" or result["kv_cache_gib"] <= 0:
        return None
    b, specs, _ = _stage_capacity(inp, result["pp_stage"], result["ctx"])
    one, several = (longest_context(inp, specs, b, b["kv_space_bytes"], requests) for requests in (1, ROOM_REQUESTS))
    return {"max_model_len": result["ctx"], "one_request_tokens": one, "four_requests_tokens": several,
            "model_limit_tokens": inp.model.max_len}


def cheapest_fix(inp: Inputs, base: Mapping[str, Any], shortest_ctx: int = 1) -> dict[str, Any] | None:
    """The combination of levers with the least cost (then the fewest) that fits one request: the
    levers other than max-model-len together, each at most once and one weight format, then a
    max-model-len cut to the longest that fits when the context alone is still too long (never
    below `shortest_ctx`)."""
    choices = [lever for lever in lever_list(inp, base) if lever.name != "max-model-len"]
    best = None
    for size in range(len(choices) + 1):
        for combo in itertools.combinations(choices, size):
            if sum(lever.field == "quant" for lever in combo) > 1:
                continue
            variant = inp
            for lever in combo:
                variant = lever.applied(variant)
            result = estimate(variant)
            picked = list(combo)
            if not result["fits"]:
                fit = result.get("max_model_len_that_fits") or 0
                if fit < shortest_ctx:
                    continue
                cut = Lever("max-model-len", f"--max-model-len {fit}", f"CTX={fit}", 3, "ctx", fit)
                variant, picked = cut.applied(variant), picked + [cut]
                result = estimate(variant)
            key = (sum(lever.cost for lever in picked), len(picked))
            if best is None or key < best[0]:
                best = (key, picked, variant, result)
    if best is None:
        return None
    _, picked, variant, result = best
    return {"levers": [lever.name for lever in picked], "change": " ".join(lever.flag for lever in picked),
            "setting": " ".join(lever.setting for lever in picked),
            "needs": "; ".join(lever.needs for lever in picked if lever.needs) or None,
            "ctx": result["ctx"], "max_concurrency": result["max_concurrency"], "gpus": variant.tp * variant.pp}
