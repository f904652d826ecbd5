"""The sizing model's answer behind `task vram` and `task roofline`: KV tokens, max concurrency,
whether one request of the context fits, and the range the spread of the non-KV terms allows; for
a pooling model, what one engine step holds.

Both CLIs (vram.py, roofline.py) import the sizing modules and physics; neither imports the other.
The parts sit beside this module: model_shape (config.json -> shape), resolve (finding a model and
a GPU), weights, kv_cache and memory_budget; levers (the changes that make a setup fit) and flags
(the flags vram and roofline share) build on it.

The accounting it follows, vLLM's and SGLang's, is stated for users in vram.py's --help; each
function cites the engine source it reproduces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rooflib.core.errors import UsageError
from rooflib.sizing.kv_cache import (
    KVSpec,
    kv_capacity,
    kv_dtype_bytes,
    kv_groups,
    layer_specs,
    layer_token_bytes,
    linear_state_bytes,
    max_len_that_fits,
)
from rooflib.sizing.memory_budget import (
    GIB,
    Inputs,
    activation_bytes,
    budget,
    check_inputs,
    cudagraph_bytes,
    non_torch_bytes,
    reserved_null_blocks,
    version_tuple,
    vllm_defaults,
)
from rooflib.sizing.model_shape import QUANT_BYTES
from rooflib.sizing.weights import stage_layers, weight_bytes, weight_quant


def block_bytes(inp: Inputs, block_size: int) -> int:
    """Bytes one KV block takes on one GPU (of the first pipeline stage), as vLLM pages it: a
    server's num_gpu_blocks times this is its KV pool."""
    specs = layer_specs(inp.model, inp.tp, inp.pp, kv_dtype_bytes(inp.model, inp.kv_dtype), block_size,
                        inp.kv_dtype.lower())
    return kv_groups(specs)[0][1] * specs[0].page_bytes


def _stage_capacity(inp: Inputs, stage: int, ctx: int) -> tuple[dict[str, Any], list[KVSpec], dict[str, Any]]:
    b = budget(inp, stage)
    specs = layer_specs(inp.model, inp.tp, inp.pp, kv_dtype_bytes(inp.model, inp.kv_dtype), b["block_size"],
                        inp.kv_dtype.lower(), stage=stage)
    report = "derived" if version_tuple(inp.vllm_version) >= (0, 14) else "blocks"
    return b, specs, kv_capacity(specs, max(0.0, b["kv_space_bytes"]), ctx, b["max_num_batched_tokens"], report)


def longest_context(inp: Inputs, specs: Sequence[KVSpec], b: Mapping[str, Any], kv_space: float,
                    requests: int = 1) -> int:
    """The longest max_model_len, within the model's limit, at which `kv_space` holds `requests`
    requests at once, with the blocks vLLM holds back left out (reserved_null_blocks)."""
    return max_len_that_fits(specs, kv_space, inp.model.max_len, b["max_num_batched_tokens"], requests,
                             reserved_null_blocks(inp))


def estimate(inp: Inputs) -> dict[str, Any]:
    """The whole answer: budget, KV bytes per token, tokens, concurrency, fits.

    With pipeline parallelism every stage sizes its own pool and vLLM keeps the smallest block
    count (kv_cache_utils.get_kv_cache_configs): the binding stage is the one reported.
    """
    check_inputs(inp)
    m = inp.model
    ctx = inp.ctx or m.max_len
    stage = 0
    if inp.engine == "vllm":
        stages = [_stage_capacity(inp, s, ctx) for s in range(inp.pp)]
        stage = min(range(inp.pp), key=lambda s: stages[s][2]["num_blocks"])
        b, specs, cap = stages[stage]
    else:
        b = budget(inp)
    token_bytes = layer_token_bytes(m, inp.tp, kv_dtype_bytes(m, inp.kv_dtype), inp.kv_dtype.lower())
    layers = stage_layers(m, inp.pp, stage)
    attention_layers = sum(1 for layer in layers if layer.kind != "linear")
    result: dict[str, Any] = {
        "model": m.name, "model_source": m.source, "gpu": inp.gpu.get("name"), "engine": inp.engine,
        "tp": inp.tp, "pp": inp.pp, "ctx": ctx, "kv_dtype": inp.kv_dtype, "weights_quant": b["quant"],
        "gpu_memory_gib": b["total_bytes"] / GIB, "gpu_util": b.get("gpu_util"),
        "max_num_seqs": b.get("max_num_seqs"), "max_num_batched_tokens": b.get("max_num_batched_tokens"),
        "weights_total_gib": b["weights_total_bytes"] / GIB, "weights_gib": b["weights_bytes"] / GIB,
        "activation_gib": b["activation_bytes"] / GIB, "non_torch_gib": b["non_torch_bytes"] / GIB,
        "cudagraph_gib": b["cudagraph_bytes"] / GIB, "kv_cache_gib": b["kv_space_bytes"] / GIB,
        "kv_space_fixed": inp.kv_cache_bytes is not None, "kv_space_offset_gib": b.get("kv_space_offset_bytes", 0.0) / GIB,
        "pp_stage": stage,
        "kv_bytes_per_token": token_bytes * attention_layers,
        "attention_layers": attention_layers, "layer_kinds": sorted({layer.kind for layer in m.layers}),
    }
    if m.linear_state:
        result["linear_state_bytes_per_request"] = linear_state_bytes(m, inp.tp) * (len(layers) - attention_layers)
    space = max(0.0, b["kv_space_bytes"])
    report = "derived" if version_tuple(inp.vllm_version) >= (0, 14) else "blocks"

    def capacity(kv_space: float) -> tuple[int, float]:
        """(KV tokens, max concurrency) for a KV space, as this engine would log them."""
        if inp.engine == "sglang":
            tokens = int(max(0.0, kv_space) // (token_bytes * attention_layers))
            return tokens, tokens / ctx
        cap_at = kv_capacity(specs, max(0.0, kv_space), ctx, b["max_num_batched_tokens"], report)
        return cap_at["kv_cache_tokens"], cap_at["max_concurrency"]

    if inp.engine == "sglang":
        tokens, concurrency = capacity(space)
        result.update(kv_cache_tokens=tokens, max_concurrency=concurrency, num_blocks=None, block_size=1)
    else:
        result.update(kv_cache_tokens=cap["kv_cache_tokens"], max_concurrency=cap["max_concurrency"],
                      num_blocks=cap["num_blocks"], block_size=cap["block_size"], kv_cache_groups=cap["groups"])
        result["max_model_len_that_fits"] = longest_context(inp, specs, b, space)
    # vLLM starts only if one request of max_model_len fits beside the blocks it holds back.
    result["fits"] = b["kv_space_bytes"] > 0 and result["max_concurrency"] >= 1 \
        and result.get("max_model_len_that_fits", ctx) >= ctx
    result.update(multimodal=m.multimodal, expert_parallel=inp.expert_parallel, vision_encoder=_vision_json(inp, b))
    result.update(uncertainty(inp, b, result, capacity,
                              lambda kv_space: longest_context(inp, specs, b, kv_space)
                              if inp.engine == "vllm" else int(kv_space // (token_bytes * attention_layers))))
    return result


@dataclass(frozen=True)
class PoolingFit:
    """An encoder-only pooling model (embeddings, score, rerank) on one GPU, as vLLM 0.32.0 sizes it.

    Its attention is bidirectional, so it has no KV cache (EncoderOnlyAttention has no KV cache spec,
    vllm/model_executor/layers/attention/encoder_only_attention.py) and no chunked prefill
    (ModelConfig.is_chunked_prefill_supported, vllm/config/model.py): each request's whole input is
    computed in one engine step, so max_num_batched_tokens is raised to at least max_model_len
    (EngineArgs, vllm/engine/arg_utils.py) and a smaller value is refused (SchedulerConfig.
    verify_max_model_len). The profile run is one forward of max_num_batched_tokens and the pooler
    over its requests (GPUModelRunner.profile_run, _dummy_pooler_run). What bounds concurrency is a
    step: at most max_num_seqs requests and max_num_batched_tokens tokens; the memory the budget
    leaves holds nothing that grows with requests."""
    model: str
    model_source: str
    gpu: str
    tp: int
    ctx: int
    weights_quant: str
    gpu_memory_gib: float
    gpu_util: float
    weights_gib: float
    activation_gib: float
    non_torch_gib: float
    cudagraph_gib: float
    left_gib: float
    max_num_seqs: int
    max_num_batched_tokens: int
    requests_per_step: int
    typical_tokens: int
    typical_requests_per_step: int
    fits: bool


def pooling_fit(inp: Inputs, typical: int) -> PoolingFit:
    """The memory budget of a pooling model and the requests one engine step holds at the context
    limit and at `typical` tokens."""
    check_inputs(inp)
    if inp.engine != "vllm" or inp.kv_cache_bytes is not None or inp.platform != "gpu":
        raise UsageError(f"{inp.model.name} is a pooling model (no KV cache): vram sizes it for vLLM on a GPU, "
                         "without ENGINE=sglang, --kv-cache-bytes or --platform cpu")
    m, ctx = inp.model, inp.ctx or inp.model.max_len
    d = vllm_defaults(inp)
    batched = inp.max_num_batched_tokens or max(ctx, d["max_num_batched_tokens"])
    if batched < ctx:
        raise UsageError(f"MAX_NUM_BATCHED_TOKENS={batched} is below CTX={ctx}: a pooling model computes each input "
                         "in one step, and vLLM refuses to start (\"max_num_batched_tokens ... is smaller than "
                         "max_model_len\"); raise it or lower CTX")
    quant = weight_quant(m, inp.quant)
    weights = weight_bytes(m, quant, inp.tp)["per_gpu"]
    version = version_tuple(inp.vllm_version)
    activation = activation_bytes(m, inp.tp, batched, d["max_num_seqs"], quant, "pytorch", samples=False)
    non_torch = non_torch_bytes(inp, version)
    graphs = cudagraph_bytes(m) if version >= (0, 21) and not inp.enforce_eager else 0.0
    total = float(inp.gpu.get("memory_gib") or 0) * GIB
    left = total * d["gpu_util"] - weights - activation - non_torch - graphs
    seqs = d["max_num_seqs"]
    short = min(typical, ctx)
    return PoolingFit(
        model=m.name, model_source=m.source, gpu=str(inp.gpu.get("name")), tp=inp.tp, ctx=ctx, weights_quant=quant,
        gpu_memory_gib=total / GIB, gpu_util=d["gpu_util"], weights_gib=weights / GIB,
        activation_gib=activation / GIB, non_torch_gib=non_torch / GIB, cudagraph_gib=graphs / GIB,
        left_gib=left / GIB, max_num_seqs=seqs, max_num_batched_tokens=batched,
        requests_per_step=min(seqs, batched // ctx), typical_tokens=short,
        typical_requests_per_step=min(seqs, batched // short), fits=left >= 0)


def _vision_json(inp: Inputs, b: Mapping[str, Any]) -> dict[str, Any] | None:
    """The vision encoder's part of the answer: its size, the profile's images and their memory."""
    enc, m = b.get("encoder"), inp.model
    if enc is None:
        return None
    return {"params_b": m.vision.params / 1e9, "weights_gib": m.extra_params * min(m.dtype_bytes, 2) / inp.tp / GIB,
            "tokens_per_image": enc.tokens_per_image, "budget_tokens": enc.budget_tokens,
            "images_profiled": enc.images, "cache_gib": enc.cache_bytes / GIB, "forward_gib": enc.forward_bytes / GIB}


@dataclass(frozen=True)
class Spread:
    """One reason the non-KV memory of a budget may differ from the estimate: by up to `more`
    bytes more (fewer KV tokens) or `less` bytes less (more KV tokens). `outside`: a setup the
    model does not cover, so the range, not the point, is the answer."""
    source: str
    more: float
    less: float
    why: str
    outside: bool = False


# How far each non-KV term may be off, from what vLLM logs for it (the logs are cited in
# tests/fixtures/vllm_startup_logs.yaml; benchmarks/vram_accuracy.py prints both figures per log).
# Weights: "Model loading took" is within 0.5% of the computed size for 16- and 8-bit checkpoints;
# 4-bit formats carry scales, zero points, layers kept in 16 bits and kernel padding that vary by
# recipe, and their logs read 0-2.9% above it at TP 1 (4.4% for gpt-oss at TP 4).
WEIGHTS_SPREAD = {"16-bit": (0.005, 0.005), "8-bit": (0.01, 0.01), "4-bit": (0.03, 0.01)}  # (more, less)
# The activation peak is first-order (one profile batch and the sampler rows): +-15%.
ACTIVATION_SPREAD = 0.15
# Allocator rounding and what else the profiler sees grow: 0.3 GiB either way.
FIXED_SPREAD = 0.3 * GIB
# CUDA-graph memory vLLM >= 0.21 subtracts is its own estimate ("Estimated CUDA graph memory:
# X GiB total"): 0.22-0.78 GiB for dense models in public logs, ~0.4-2 GiB for MoE and hybrid ones.
CUDAGRAPH_SPREAD = {"dense": (0.3 * GIB, 0.3 * GIB), "moe": (1.0 * GIB, 0.6 * GIB)}  # (more, less)
# With TP or PP every rank sizes its own pool and vLLM keeps the smallest (kv_cache_utils.
# get_kv_cache_configs): vllm#21348 (TP4) logged 1.15% fewer tokens than its rank 0's KV GiB gives.
RANKS_KV_SHARE = 0.015
# --enforce-eager: no graphs, no torch.compile; the eager logs of the benchmark sit up to 0.5 GiB
# either side of the estimate (vllm PR #20665's first stage: 0.48 GiB less).
EAGER_SPREAD = 0.5 * GIB
# A multimodal checkpoint's profile run also encodes dummy images at the encoder-cache budget
# (gpu_model_runner "Encoder cache will be initialized with a budget of N tokens"), and the
# vision tower's size is the model card's: the Gemma 3 logs read 0.4-0.6 GiB more weights and a
# 0.3 GiB higher peak than their text-only Gemma 2 siblings.
MULTIMODAL_SPREAD = (1.0 * GIB, 0.3 * GIB)
# Where vision_config gives the encoder's shape its profile peak is modelled (EncoderProfile), to
# the first order of the language model's activation term: +-50%, no public log checks it yet.
ENCODER_SPREAD = 0.5
# --enable-expert-parallel: the all-to-all buffers (DeepEP's VLLM_DEEPEP_BUFFER_SIZE_MB, 1024 by
# default, vllm/envs.py) and, with graphs, larger CUDA graphs (~5 GiB estimated in TP4 + EP logs).
EXPERT_PARALLEL_BUFFERS = 1.0 * GIB
EXPERT_PARALLEL_CUDAGRAPHS = 5.0 * GIB
# WSL2: the Windows desktop shares the card and WDDM moves memory in and out (the kvcache-lab
# RTX 4080 log in the benchmark: 1.3 of 16 GiB in use by Windows at start-up).
WSL_SPREAD = 1.0 * GIB
# ROCm: the non-torch memory (hipBLASLt, RCCL, AITER workspaces) and graph memory of ROCm builds
# are not modelled; the one ROCm log of the held-back check in the project's issue #24 held 30% of
# the estimated KV cache, so the low end allows for that.
ROCM_KV_SHARE = 0.3


# gpu_memory_utilization the lever raises to: the headroom left (4 GiB of an 80 GB card) still
# holds the CUDA context and NCCL buffers vLLM's budget leaves out (vllm/v1/worker/gpu_worker.py).
HIGHER_GPU_UTIL = 0.95


def _weights_class(quant: str) -> str:
    return "4-bit" if QUANT_BYTES[quant] < 1 else "8-bit" if QUANT_BYTES[quant] == 1 else "16-bit"


def spread_sources(inp: Inputs, b: Mapping[str, Any]) -> list[Spread]:
    """Each reason the non-KV memory may be off, with its bytes either way (none when the KV
    space is given or measured on a running server: then tokens and concurrency are exact)."""
    if inp.kv_cache_bytes is not None or inp.kv_space_offset_bytes is not None:
        return []
    m, vllm = inp.model, inp.engine == "vllm"
    kind = _weights_class(b["quant"])
    more, less = WEIGHTS_SPREAD[kind]
    out = [Spread("weights", more * b["weights_bytes"], less * b["weights_bytes"],
                  f"{kind} weights: vLLM's loaded size against the computed one"),
           Spread("fixed", FIXED_SPREAD, FIXED_SPREAD, "allocator rounding and start-up memory outside the terms")]
    if b["activation_bytes"]:
        spread = ACTIVATION_SPREAD * b["activation_bytes"]
        out.append(Spread("activation", spread, spread, "the profile run's peak (forward of "
                                                        "max_num_batched_tokens, sampler rows) is first-order"))
    non_torch = b["non_torch_bytes"]
    if inp.tp == 1:  # 0.05 or 0.25 GiB by release (non_torch_bytes): +-0.2 GiB covers either
        out.append(Spread("non-torch", 0.2 * GIB, min(non_torch, 0.2 * GIB),
                          "cuBLAS and attention workspaces vary by release"))
    else:
        # Custom all-reduce is off on more than two PCIe-only GPUs (vllm/distributed/device_communicators/
        # custom_all_reduce.py), so its buffers may be absent; symmetric memory is 2.07-2.17 GiB when on.
        spread = 0.3 * GIB if non_torch > 1.0 * GIB else non_torch
        out.append(Spread("non-torch", spread, spread, "all-reduce buffers at TP > 1 depend on the interconnect"))
    if inp.tp * inp.pp > 1:
        out.append(Spread("ranks", RANKS_KV_SHARE * max(0.0, b["kv_space_bytes"]), 0.0,
                          "the smallest rank's pool binds at TP or PP > 1"))
    if b["cudagraph_bytes"]:
        more, less = CUDAGRAPH_SPREAD["moe" if m.experts or m.linear_state else "dense"]
        out.append(Spread("cuda-graphs", more, less, "vLLM subtracts its own CUDA-graph estimate (>= 0.21), "
                                                     "0.2-2 GiB by model in public logs"))
    elif vllm and inp.enforce_eager:
        out.append(Spread("eager", EAGER_SPREAD, EAGER_SPREAD, "--enforce-eager: the profile run without graphs or "
                                                               "torch.compile; eager logs sit up to 0.5 GiB either side"))
    enc = b.get("encoder")
    if vllm and enc:
        spread = ENCODER_SPREAD * (enc.forward_bytes + enc.cache_bytes)
        out.append(Spread("vision-encoder", spread, spread, "the vision encoder's profile peak (its dummy images' "
                          "activations and encoder-cache outputs) is first-order"))
    elif vllm and m.multimodal:
        out.append(Spread("multimodal", *MULTIMODAL_SPREAD, "the vision encoder's profile run (dummy images) and the "
                          "vision tower's exact size are not modelled", outside=True))
    if vllm and inp.expert_parallel:
        graphs = EXPERT_PARALLEL_CUDAGRAPHS - b["cudagraph_bytes"] if b["cudagraph_bytes"] else 0.0
        out.append(Spread("expert-parallel", EXPERT_PARALLEL_BUFFERS + graphs, 0.0, "expert-parallel all-to-all "
                          "buffers (DeepEP: 1 GiB each by default) and its larger CUDA graphs are not modelled",
                          outside=True))
    if inp.wsl:
        out.append(Spread("wsl", WSL_SPREAD, WSL_SPREAD, "WSL2: the Windows desktop shares the GPU and WDDM pages "
                          "its memory", outside=True))
    if inp.gpu.get("vendor") == "amd":
        out.append(Spread("rocm", (1 - ROCM_KV_SHARE) * max(0.0, b["kv_space_bytes"]), 0.0,
                          "ROCm: its non-torch and graph memory are not modelled; a ROCm log held 30% of the "
                          "estimated KV cache", outside=True))
    return out


def uncertainty(inp: Inputs, b: Mapping[str, Any], result: Mapping[str, Any], capacity, longest_fitting) -> dict[str, Any]:
    """The range of KV tokens the spread of the non-KV terms allows, and whether the verdict is
    marginal: it flips inside that range or with a 0.01 change of gpu_memory_utilization (the
    setting that decides it is named, with a value that fits at the low end)."""
    space, total, util = b["kv_space_bytes"], b["total_bytes"], b.get("gpu_util") or 0.0
    sources = spread_sources(inp, b)
    more, less = sum(s.more for s in sources), sum(s.less for s in sources)

    def verdict(kv_space: float) -> tuple[int, float, bool]:
        tokens, concurrency = capacity(kv_space)
        return tokens, concurrency, kv_space > 0 and concurrency >= 1 and longest_fitting(kv_space) >= result["ctx"]

    low, high = verdict(space - more), verdict(space + less)
    out = {"kv_cache_tokens_low": low[0], "kv_cache_tokens_high": high[0], "max_concurrency_low": low[1],
           "max_concurrency_high": high[1], "non_kv_more_gib": more / GIB, "non_kv_less_gib": less / GIB,
           "range_sources": [{"source": s.source, "more_gib": round(s.more / GIB, 3), "less_gib": round(s.less / GIB, 3),
                              "why": s.why, "outside_model": s.outside} for s in sources],
           "outside_model": [s.why for s in sources if s.outside], "marginal": False, "marginal_reason": None}
    reasons = []
    if low[2] != high[2]:
        reasons.append(f"the verdict flips inside the estimate's range (-{more / GIB:.2f}/+{less / GIB:.2f} GiB of KV space)")
    if not result["kv_space_fixed"] and util:
        down, up = verdict(space - 0.01 * total), verdict(space + 0.01 * total)
        if down[2] != result["fits"] or up[2] != result["fits"]:
            flip = f"{util - 0.01:.2f}" if down[2] != result["fits"] else f"{util + 0.01:.2f}"
            reasons.append(f"gpu_memory_utilization decides it ({util:.2f} {'fits' if result['fits'] else 'does not fit'}, "
                           f"{flip} {'does not' if result['fits'] else 'does'})")
    if reasons:
        safe = []
        if not result["kv_space_fixed"] and util:
            need = _space_for_one_request(capacity, space + more + total)
            if need is not None:
                safe_util = math.ceil((util + (need + more - space) / total) * 100) / 100
                if safe_util <= HIGHER_GPU_UTIL:
                    safe.append(f"--gpu-memory-utilization {max(safe_util, util):.2f}")
        fitting_len = longest_fitting(max(0.0, space - more))
        if fitting_len and fitting_len < result["ctx"]:
            safe.append(f"--max-model-len {fitting_len}")
        out["marginal"] = True
        out["marginal_reason"] = "; ".join(reasons) + (f"; fits at the low end with {' or '.join(safe)}" if safe else "")
    return out


def _space_for_one_request(capacity, upper: float) -> float | None:
    """The smallest KV space (bytes, to 1 MiB) at which one request of max_model_len fits."""
    low, high = 0.0, upper
    if capacity(high)[1] < 1:
        return None
    while high - low > 1 << 20:
        mid = (low + high) / 2
        low, high = (mid, high) if capacity(mid)[1] < 1 else (low, mid)
    return high
