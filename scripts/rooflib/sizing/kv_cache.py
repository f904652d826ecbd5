"""The KV cache as vLLM pages it: the bytes one token costs in one layer, a linear-attention
layer's fixed state, each layer's spec, vLLM's grouping of the layers into pages, and the blocks,
tokens and requests at once a KV space holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from rooflib.core.errors import UsageError
from rooflib.sizing.model_shape import Model
from rooflib.sizing.weights import stage_layers

KV_DTYPES = {"auto": None, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4,
             "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1}


def kv_heads_per_rank(m: Model, tp: int) -> int:
    return 1 if m.mla else max(1, m.kv_heads // tp)


def kv_dtype_bytes(m: Model, kv_dtype: str) -> int:
    key = (kv_dtype or "auto").lower()
    if key not in KV_DTYPES:
        raise UsageError(f"unknown KV_DTYPE {kv_dtype!r}: use auto, bf16, fp16 or fp8")
    return KV_DTYPES[key] or (m.dtype_bytes if m.dtype_bytes <= 2 else 2)


def layer_token_bytes(m: Model, tp: int, kv_bytes: int, kv_dtype: str = "auto") -> int:
    """KV bytes one token costs in one attention layer on one GPU."""
    if m.mla:
        # fp8_ds_mla: 512 fp8 + 4 scales x 4 bytes + 64 bf16 rope = 656 bytes (vllm kv_cache_interface).
        return 656 if kv_dtype == "fp8_ds_mla" else (m.mla[1] + m.mla[3]) * kv_bytes
    return 2 * kv_heads_per_rank(m, tp) * m.head_dim * kv_bytes


def linear_state_bytes(m: Model, tp: int, state_bytes: int = 2) -> int:
    """Conv + recurrent state one request holds in one linear-attention (GDN) layer on one GPU."""
    kernel, kh, kd, vh, vd = m.linear_state
    conv = (kernel - 1) * (2 * kh * kd + vh * vd) // tp
    ssm = vh // tp * kd * vd
    return (conv + ssm) * state_bytes


@dataclass(frozen=True)
class KVSpec:
    kind: str            # full | sliding | linear
    window: int
    page_bytes: int      # one block of block_size tokens (linear: the request's whole state)
    block_size: int


def layer_specs(m: Model, tp: int, pp: int, kv_bytes: int, block_size: int, kv_dtype: str = "auto",
                attention_block_alignment: int = 16, stage: int = 0) -> list[KVSpec]:
    """The KV spec of each layer of one pipeline stage, pages unified as vLLM does."""
    layers = stage_layers(m, pp, stage)
    token = layer_token_bytes(m, tp, kv_bytes, kv_dtype)
    if any(layer.kind == "linear" for layer in layers) and m.linear_state:
        state = linear_state_bytes(m, tp)
        # vLLM raises the attention block size until an attention page holds a Mamba state,
        # then pads the state to that page (platforms' _align_hybrid_block_size).
        block_size = attention_block_alignment * math.ceil(state / (attention_block_alignment * token))
    page = token * block_size
    return [KVSpec(layer.kind, layer.window, page, block_size) for layer in layers]


def _blocks_per_request(spec: KVSpec, max_len: int, max_num_batched_tokens: int) -> int:
    if spec.kind == "linear":
        return 1
    if spec.kind == "sliding":
        return -(-min(spec.window - 1 + max_num_batched_tokens, max_len) // spec.block_size) + 1
    return -(-max_len // spec.block_size)


def kv_groups(specs: Sequence[KVSpec]) -> list[tuple[KVSpec, int]]:
    """vLLM's KV-cache groups as (spec, layers in the group, padding included).

    One spec for every layer: one group. Otherwise layers of one kind are split into groups of
    `group_size` layers (the smallest kind's count, or the largest when that is < 1.5x the
    smallest), the last one padded (kv_cache_utils._get_kv_cache_groups_uniform_page_size).
    """
    buckets: dict[tuple[str, int], list[KVSpec]] = {}
    for spec in specs:
        buckets.setdefault((spec.kind, spec.window), []).append(spec)
    if len(buckets) == 1:
        return [(specs[0], len(specs))]
    counts = [len(b) for b in buckets.values()]
    group_size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for bucket in buckets.values():
        groups += [(bucket[0], group_size)] * -(-len(bucket) // group_size)
    return groups


def kv_capacity(specs: Sequence[KVSpec], kv_space: float, max_len: int, max_num_batched_tokens: int,
                token_report: str = "derived") -> dict[str, Any]:
    """Blocks, tokens and max concurrency from the KV space, as vLLM's startup log reports them.

    token_report "derived" (vLLM >= 0.14): tokens = int(concurrency x max_model_len);
    "blocks" (older): num_blocks // groups x block_size.
    """
    groups = kv_groups(specs)
    bytes_per_block = groups[0][1] * specs[0].page_bytes
    num_blocks = max(0, int(kv_space // bytes_per_block))
    per_request = sum(_blocks_per_request(spec, max_len, max_num_batched_tokens) for spec, _ in groups)
    concurrency = num_blocks / per_request
    min_block = min(spec.block_size for spec, _ in groups)
    tokens = int(concurrency * max_len) if token_report == "derived" else num_blocks // len(groups) * min_block
    return {"num_blocks": num_blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency,
            "groups": len(groups), "block_size": min_block, "blocks_per_request": per_request,
            "bytes_per_block": bytes_per_block}


def max_len_that_fits(specs: Sequence[KVSpec], kv_space: float, limit: int, max_num_batched_tokens: int,
                      requests: int, reserved_blocks: int) -> int:
    """The largest max_model_len (up to `limit`) at which the KV space, less `reserved_blocks`,
    holds `requests` requests at once; with one request, vLLM's estimate_max_model_len."""
    usable = kv_space - reserved_blocks * kv_groups(specs)[0][1] * specs[0].page_bytes
    low, high, best = 1, limit, 0
    while low <= high:
        mid = (low + high) // 2
        if kv_capacity(specs, usable, mid, max_num_batched_tokens)["max_concurrency"] >= requests:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best
