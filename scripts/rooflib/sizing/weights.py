"""The weights of a model on one GPU: its parameters by part (attention, MLP, experts, embeddings),
the weight format asked for, and the bytes each GPU holds under tensor and pipeline parallelism,
with the layers split over the stages as vLLM splits them.
"""
from __future__ import annotations

from dataclasses import dataclass

from rooflib.core.errors import UsageError
from rooflib.sizing.model_shape import QUANT_BYTES, Layer, Model

QUANT_ALIASES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                 "half": "fp16", "fp32": "fp32", "float32": "fp32", "fp8": "fp8", "int8": "int8",
                 "w8a8": "int8", "awq": "int4", "gptq": "int4", "int4": "int4", "awq_marlin": "int4",
                 "gptq_marlin": "int4", "bitsandbytes": "int4", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


@dataclass(frozen=True)
class Params:
    embed: float
    lm_head: float
    attention: float      # split by TP
    replicated: float     # on every TP rank (MLA's down-projections)
    dense_mlp: float
    experts: float        # routed experts, all of them
    expert_each: float    # one routed expert of one layer
    shared: float

    @property
    def total(self) -> float:
        return self.embed + self.lm_head + self.attention + self.replicated + self.dense_mlp + self.experts + self.shared


def count_params(m: Model) -> Params:
    attention = replicated = 0.0
    for layer in m.layers:
        if layer.kind == "linear" and m.linear_state:
            kernel, kh, kd, vh, vd = m.linear_state
            attention += m.hidden * (2 * kh * kd + 2 * vh * vd + 2 * vh) + (2 * kh * kd + vh * vd) * kernel + vh * vd * m.hidden
        elif m.mla:
            q_lora, kv_lora, nope, rope, v = m.mla
            q = m.hidden * q_lora + q_lora * m.heads * (nope + rope) if q_lora else m.hidden * m.heads * (nope + rope)
            replicated += (m.hidden * q_lora if q_lora else 0) + m.hidden * (kv_lora + rope)
            attention += q - (m.hidden * q_lora if q_lora else 0) + kv_lora * m.heads * (nope + v) + m.heads * v * m.hidden
        else:
            attention += m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
    moe = sum(m.moe_layers)
    expert_each = 3 * m.hidden * m.expert_intermediate
    dense_layers = len(m.layers) - moe
    mlp_width = m.dense_intermediate if m.experts else m.intermediate
    embed = float((m.vocab + m.position_embeddings) * m.hidden)
    no_head = m.tie_embeddings or m.encoder_only  # a pooling model has no LM head
    return Params(embed=embed, lm_head=0.0 if no_head else embed, attention=attention,
                  replicated=replicated + moe * m.hidden * m.experts,
                  dense_mlp=(3.0 if m.gated_mlp else 2.0) * m.hidden * mlp_width * dense_layers,
                  experts=float(moe * m.experts * expert_each), expert_each=float(expert_each),
                  shared=3.0 * m.hidden * m.shared_intermediate * moe)


def weight_quant(m: Model, quant: str) -> str:
    wanted = QUANT_ALIASES.get((quant or "auto").lower())
    if wanted is None:
        raise UsageError(f"unknown QUANT {quant!r}: use one of auto, bf16, fp16, fp8, int8, awq, gptq, mxfp4, nvfp4")
    return m.quant if wanted == "auto" else wanted


def marlin_expert_padding(m: Model) -> float:
    """Growth of MXFP4 experts on GPUs without FP4 (the Marlin path): hidden rounded up to 256 and
    intermediate to 128 (vllm/model_executor/layers/fused_moe/oracle/mxfp4.py); gpt-oss: +9%."""
    def up(value: int, step: int) -> int:
        return -(-value // step) * step
    return up(m.hidden, 256) * up(m.expert_intermediate, 128) / (m.hidden * m.expert_intermediate)


def pp_partition(n_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage as vLLM splits them (vllm/distributed/utils.py get_pp_indices):
    equal shares, the remainder going to the stages before the last (which holds the LM head)."""
    parts = [n_layers // pp] * pp
    for i in range(2, n_layers % pp + 2):
        parts[-i] += 1
    return parts


def stage_layers(m: Model, pp: int, stage: int) -> tuple[Layer, ...]:
    parts = pp_partition(len(m.layers), pp)
    start = sum(parts[:stage])
    return m.layers[start:start + parts[stage]]


def weight_bytes(m: Model, quant: str, tp: int = 1, pp: int = 1, native_fp4: bool = True,
                 stage: int = 0) -> dict[str, float]:
    """Checkpoint bytes and the bytes on one GPU of pipeline stage `stage` (the embedding on the
    first stage, the LM head on the last, a tied one on both)."""
    p = count_params(m)
    qb = QUANT_BYTES[quant]
    hp = float(min(m.dtype_bytes, 2))
    attention_bytes = hp if quant == m.quant and m.attention_unquantized else qb
    mlp_bytes = hp if quant == "mxfp4" else qb     # gpt-oss: MXFP4 experts, the rest bf16
    expert_bytes = qb * (marlin_expert_padding(m) if quant == "mxfp4" and not native_fp4 and m.experts else 1.0)
    layer_bytes = p.attention * attention_bytes + (p.dense_mlp + p.shared) * mlp_bytes + p.experts * expert_bytes
    head_bytes = (p.embed + p.lm_head + m.extra_params) * hp
    total = layer_bytes + p.replicated * hp + head_bytes
    scale = 1.0
    if m.checkpoint_bytes and quant == m.quant:
        scale = m.checkpoint_bytes / total       # measured size: trust it, keep the split's proportions
        layer_bytes, total = layer_bytes * scale, float(m.checkpoint_bytes)
    share = len(stage_layers(m, pp, stage)) / len(m.layers)
    if pp == 1:
        head = head_bytes
    else:
        head = ((p.embed + m.extra_params) * hp if stage == 0 else 0.0) + \
               ((p.lm_head or p.embed) * hp if stage == pp - 1 else 0.0)
    per_gpu = (layer_bytes * share + head * scale) / tp + p.replicated * hp * share
    return {"total": total, "per_gpu": per_gpu}
