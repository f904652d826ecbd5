"""The flags vram.py and roofline.py share (task variables MODEL, GPU, GPU_GB, TP, ...) and the
Inputs they make; for vram --url, a running server's own settings stand where the user gives none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from rooflib.core import cli, conf
from rooflib.core.errors import UsageError
from rooflib.sizing.memory_budget import DEFAULT_VLLM_VERSION, GIB, SAMPLER_BYTES_PER_LOGIT, Inputs
from rooflib.sizing.resolve import resolve_gpu, resolve_model


def add_model_args(p) -> None:
    """The flags vram and roofline share (task variables MODEL, GPU, GPU_GB, TP, ...).

    Not given and given empty (the Taskfile passes every variable) both mean "not set", as for
    every script (conf.Settings); the defaults are in the help texts.
    """
    p.add_argument("--model", help="catalog name, Hugging Face repo id, or local folder / config.json (MODEL)")
    p.add_argument("--gpu", help="catalog GPU name, e.g. h100, a100-80gb, l40s, mi300x (GPU)")
    p.add_argument("--gpu-gb", help="GPU memory as marketed, e.g. 80 for an 80 GB card, instead of a catalog GPU (GPU_GB); "
                                    "converted to the GiB total CUDA reports as an 80 GB H100 does (79.19)")
    p.add_argument("--gpu-gib", help="GPU memory as vLLM logs its total (total_gpu_memory, 'Free memory on device (x/TOTAL "
                                     "GiB)'), e.g. 79.19 (GPU_GIB); exact where GPU_GB is not (cards with ECC reserve)")
    p.add_argument("--tp", help="tensor-parallel size (TP, default 1)")
    p.add_argument("--pp", help="pipeline-parallel size (PP, default 1)")
    p.add_argument("--ctx", help="tokens per request = max_model_len (CTX, default the model's limit)")
    p.add_argument("--kv-dtype", help="KV-cache dtype: auto, bf16, fp16, fp8 (KV_DTYPE, default auto)")
    p.add_argument("--quant", help="weights: auto (the checkpoint's), bf16, fp8, awq, gptq, mxfp4, nvfp4 (QUANT)")
    p.add_argument("--gpu-util", help="vLLM gpu_memory_utilization / SGLang mem_fraction_static (GPU_UTIL)")
    p.add_argument("--engine", help="vllm or sglang (ENGINE, default vllm)")
    p.add_argument("--max-num-seqs", help="vLLM max_num_seqs (MAX_NUM_SEQS, default by GPU)")
    p.add_argument("--max-num-batched-tokens", help="vLLM max_num_batched_tokens (MAX_NUM_BATCHED_TOKENS, default by GPU)")
    p.add_argument("--kv-cache-bytes", help="fixed KV space per GPU in bytes (vLLM --kv-cache-memory-bytes); skips the budget")
    p.add_argument("--kv-cache-gib", help="the same in GiB (e.g. VLLM_CPU_KVCACHE_SPACE=1 is 1)")
    p.add_argument("--block-size", help="KV block size in tokens (default 16 on GPU, 128 on CPU; 16 for MLA on a CPU without AMX)")
    p.add_argument("--platform", default="gpu", choices=["gpu", "cpu"], help="cpu: the CPU build's defaults (block 128, batch 2048)")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help="vLLM release whose accounting to follow (e.g. 0.10, 0.32)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM --enforce-eager)")
    p.add_argument("--vllm-engine", default="auto", choices=["auto", "v0", "v1"],
                   help="v0: the V0 profiler (VLLM_USE_V1=0, or vLLM 0.8-0.10 on pre-Ampere GPUs); auto: by version")
    p.add_argument("--sampler", default="auto", choices=["auto", *SAMPLER_BYTES_PER_LOGIT],
                   help="top-k/top-p kernel vLLM warms up while profiling (its log names it); auto: the release's default")
    p.add_argument("--entrypoint", default="serve", choices=["serve", "llm"],
                   help="serve: vllm serve's batch defaults; llm: the offline LLM class's (larger profile batch)")
    p.add_argument("--hf-overrides", help="vLLM's --hf-overrides as JSON, applied to config.json (HF_OVERRIDES), "
                                          "e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                          "\"original_max_position_embeddings\": 32768}}'")
    p.add_argument("--rope-scaling", help="shorthand for --hf-overrides '{\"rope_scaling\": JSON}' (ROPE_SCALING); the context "
                                          "limit becomes vLLM's: factor x original_max_position_embeddings for YaRN")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM --enable-expert-parallel: experts split over the TP ranks (same bytes per GPU); "
                        "its all-to-all buffers are not modelled (the range widens)")
    p.add_argument("--wsl", action="store_true",
                   help="the GPU runs under WSL2, shared with the Windows desktop (the range widens)")
    p.add_argument("--language-model-only", action="store_true",
                   help="vLLM --language-model-only: a multimodal checkpoint without its vision tower and encoder profile")
    p.add_argument("--env-file", default=None, help="settings file (default ./inference.env)")


def json_setting(name: str, raw: str | None) -> dict[str, Any] | None:
    """A JSON object from a flag or setting (HF_OVERRIDES, ROPE_SCALING); None when not given."""
    if raw in (None, ""):
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"{name} is not valid JSON ({exc.msg}): quote it, e.g. '{{\"rope_type\": \"yarn\", \"factor\": 4.0}}'")
    if not isinstance(value, dict):
        raise UsageError(f"{name} must be a JSON object, got {raw!r}")
    return value


@dataclass(frozen=True)
class ServerDefaults:
    """What a running server says of its deployment (vram --url), for what the user leaves unset:
    each value stands where no flag, environment variable or inference.env line gives one, and is
    checked as that setting is."""
    model: str | None = None
    ctx: Any = None  # max_model_len as /v1/models gives it
    gpu_util: float | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    kv_cache_bytes: int | None = None  # the server's own KV space, when no GPU is named
    platform: str | None = None  # "cpu" with that KV space: no budget to estimate, the server's block size


def inputs_from_args(args, transport: Any = None, server: ServerDefaults = ServerDefaults()) -> Inputs:
    s = conf.settings_from_args(args)

    def get(name: str) -> str:
        return s.get(name, getattr(args, name.lower()))

    gpu_gb = cli.number("GPU_GB", get("GPU_GB"), float)
    gpu_gib = cli.number("GPU_GIB", get("GPU_GIB"), float)
    kv_gib = cli.number("--kv-cache-gib", args.kv_cache_gib, float)
    kv_bytes = cli.number("--kv-cache-bytes", args.kv_cache_bytes or server.kv_cache_bytes, int)
    if kv_gib is not None:
        kv_bytes = int(kv_gib * GIB)
    gpu_name = get("GPU")
    platform = server.platform or args.platform
    if platform == "cpu" and not gpu_name and gpu_gb is None and gpu_gib is None:
        gpu = {"id": "cpu", "name": "CPU", "memory_gib": 0}
        if kv_bytes is None:
            raise UsageError("--platform cpu needs the KV space: --kv-cache-gib (VLLM_CPU_KVCACHE_SPACE) or --kv-cache-bytes")
    else:
        gpu = resolve_gpu(gpu_name, gpu_gb, gpu_gib)
    overrides = json_setting("HF_OVERRIDES", get("HF_OVERRIDES")) or {}
    rope = json_setting("ROPE_SCALING", get("ROPE_SCALING"))
    if rope is not None:
        overrides = {**overrides, "rope_scaling": rope}
    model = resolve_model(get("MODEL") or server.model, transport, hf_overrides=overrides)
    if args.language_model_only:
        model = replace(model, extra_params=0.0, multimodal=False, vision=None)
    return Inputs(
        model=model, gpu=gpu,
        tp=cli.number("TP", get("TP")) or 1, pp=cli.number("PP", get("PP")) or 1,
        ctx=cli.number("CTX", get("CTX") or server.ctx), kv_dtype=get("KV_DTYPE") or server.kv_dtype or "auto",
        quant=get("QUANT") or "auto", gpu_util=cli.number("GPU_UTIL", get("GPU_UTIL") or server.gpu_util, float),
        engine=(get("ENGINE") or "vllm").lower(),
        max_num_seqs=cli.number("MAX_NUM_SEQS", get("MAX_NUM_SEQS")),
        max_num_batched_tokens=cli.number("MAX_NUM_BATCHED_TOKENS", get("MAX_NUM_BATCHED_TOKENS")),
        kv_cache_bytes=kv_bytes, block_size=cli.number("--block-size", args.block_size or server.block_size),
        platform=platform, vllm_version=args.vllm_version, enforce_eager=args.enforce_eager,
        entrypoint=args.entrypoint, vllm_engine=args.vllm_engine, sampler=args.sampler,
        expert_parallel=args.enable_expert_parallel, wsl=args.wsl)
