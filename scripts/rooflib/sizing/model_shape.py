"""A model's shape from its config.json: its layers and the cache each keeps, attention (MLA
included), the MLP and experts, a vision tower, the checkpoint's weight format and the context
limit vLLM derives. The weights, the KV cache, the memory budget and the roofline all count from
this shape, so config.json is read in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from rooflib.core.errors import UsageError

# Bytes per weight of a quantized linear layer, scales included (group 128 for AWQ/GPTQ: an fp16
# scale and a 4-bit zero per group; MXFP4: an 8-bit scale per 32; NVFP4: an fp8 scale per 16).
QUANT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0,
               "int4": 0.5 + 2.5 / 128, "mxfp4": 4.25 / 8, "nvfp4": 4.5 / 8}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# rope_scaling types whose factor does not raise vLLM's max_model_len limit
# (vllm/config/model.py _get_and_verify_max_len).
ROPE_TYPES_KEEPING_LIMIT = ("su", "longrope", "llama3", "default")


@dataclass(frozen=True)
class Layer:
    """One decoder layer's cache: `full`, `sliding` (window), `linear` (fixed state per request)."""
    kind: str
    window: int = 0


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    layers: tuple[Layer, ...]
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    max_len: int
    dtype_bytes: int
    tie_embeddings: bool
    quant: str                      # the checkpoint's own: bf16, fp16, fp8, int4, mxfp4, ...
    attention_unquantized: bool = False  # modules_to_not_convert keeps attention in bf16/fp16
    mla: tuple[int, int, int, int, int] | None = None  # q_lora, kv_lora, qk_nope, qk_rope, v_head
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layers: tuple[bool, ...] = ()
    dense_intermediate: int = 0     # MLP width of the non-MoE layers of a MoE model
    linear_state: tuple[int, int, int, int, int] | None = None  # conv kernel, k heads, k dim, v heads, v dim
    extra_params: float = 0.0       # vision tower and the like, counted in the weights only
    multimodal: bool = False        # has an encoder vLLM profiles (vision_config) besides the language model
    vision: VisionTower | None = None  # the vision encoder's shape, where vision_config gives it
    encoder_only: bool = False      # a BERT-style pooling model: bidirectional attention, no KV cache
    gated_mlp: bool = True          # gate, up and down projections (SwiGLU); False: up and down (BERT's GELU MLP)
    position_embeddings: int = 0    # rows of learned position and token-type embeddings (BERT-style)
    checkpoint_bytes: int | None = None  # measured (local safetensors / Hub index) when known
    params_b: float | None = None   # the model card's figure, for the catalog check


# Encoder-only (BERT-style) model types vLLM serves as pooling models with bidirectional attention
# (vLLM 0.32.0: BertModel, RobertaModel, XLMRobertaModel and their *ForSequenceClassification in
# vllm/model_executor/models/registry.py, bert.py and roberta.py; EncoderOnlyAttention has no KV
# cache spec: vllm/model_executor/layers/attention/encoder_only_attention.py).
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
# The most pixels Qwen2-VL and Qwen2.5-VL checkpoints let one image have: max_pixels 12,845,056 in
# their preprocessor_config.json (Qwen/Qwen2.5-VL-7B-Instruct@cc594898137f460bfe9f0759e9844b3ce807cfb5),
# which vLLM's budget reads (get_image_size_with_most_features, vllm/model_executor/models/qwen2_vl.py,
# vLLM 0.32.0): 16,384 tokens of 28 x 28 pixels. config.json does not carry it.
QWEN_VL_MAX_PIXELS = 12_845_056


@dataclass(frozen=True)
class VisionTower:
    """A vision-language model's vision encoder from its vision_config: the parameters vLLM loads
    beside the language model (encoder blocks, patch and position embeddings, the projector to the
    language model), and what one image costs: its most tokens for the language model and the
    encoder's patches behind each token."""
    params: float
    width: int
    intermediate: int
    gated_mlp: bool
    patches_per_token: int
    tokens_per_image: int
    out_hidden: int


def vision_tower(config: Mapping[str, Any]) -> VisionTower | None:
    """The vision encoder of a config.json with a vision_config, None without one or without its
    depth and width. Two layouts: dynamic resolution with merged patches (Qwen2-VL, Qwen2.5-VL:
    spatial_merge_size, a PatchMerger MLP to the language model's width, up to QWEN_VL_MAX_PIXELS per
    image) and a fixed-size ViT (CLIP or SigLIP in LLaVA: image_size / patch_size squared patches, one
    token each, a two-layer projector). LLaVA-NeXT's tiling of large images is not modelled."""
    vc = config.get("vision_config")
    if not isinstance(vc, Mapping):
        return None
    layers = int(vc.get("num_hidden_layers") or vc.get("depth") or 0)
    width = int(vc.get("embed_dim") or vc.get("hidden_size") or 0)
    if not layers or not width:
        return None
    intermediate = int(vc.get("intermediate_size") or width * float(vc.get("mlp_ratio") or 4))
    gated = str(vc.get("hidden_act", "")) == "silu"
    patch = int(vc.get("patch_size") or 14)
    channels = int(vc.get("in_chans") or vc.get("in_channels") or vc.get("num_channels") or 3)
    text_hidden = int(_text_config(config)["hidden_size"])
    out = int(vc.get("out_hidden_size") or text_hidden)
    blocks = layers * (4 * width * width + (3 if gated else 2) * width * intermediate)
    embed = channels * patch * patch * int(vc.get("temporal_patch_size") or 1) * width
    merge = int(vc.get("spatial_merge_size") or 1)
    if merge > 1:
        merged = width * merge * merge
        projector = merged * merged + merged * out
        tokens, patches = QWEN_VL_MAX_PIXELS // (patch * merge) ** 2, merge * merge
    else:
        side = int(vc.get("image_size") or 336) // patch
        embed += side * side * width
        projector = width * out + out * out
        # Gemma 3 pools its 64 x 64 patches into mm_tokens_per_image (256) tokens.
        tokens = int(config.get("mm_tokens_per_image") or side * side)
        patches = max(1, side * side // tokens)
    return VisionTower(params=float(blocks + embed + projector), width=width, intermediate=intermediate,
                       gated_mlp=gated, patches_per_token=patches, tokens_per_image=tokens, out_hidden=out)


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    text = dict(config)
    text.update(config.get("text_config") or {})
    return text


def _layer_kinds(cfg: Mapping[str, Any], n_layers: int) -> tuple[Layer, ...]:
    window = cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    model_type = cfg.get("model_type", "")
    if isinstance(types, list) and len(types) == n_layers:
        kinds = ["sliding" if "sliding" in t else "linear" if ("linear" in t or "mamba" in t) else "full"
                 for t in types]
    elif cfg.get("full_attention_interval"):
        step = cfg["full_attention_interval"]
        kinds = ["full" if (i + 1) % step == 0 else "linear" for i in range(n_layers)]
    elif model_type in ("gemma2", "gpt_oss"):
        kinds = ["sliding" if i % 2 == 0 else "full" for i in range(n_layers)]
    elif model_type.startswith("gemma3"):
        pattern = cfg.get("sliding_window_pattern") or 6
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)]
    elif window and cfg.get("use_sliding_window", True):  # Qwen2/3 carry a window they do not use
        kinds = ["sliding"] * n_layers
    else:
        kinds = ["full"] * n_layers
    return tuple(Layer(k, window if k == "sliding" else 0) for k in kinds)


def derived_max_len(cfg: Mapping[str, Any]) -> int:
    """The longest max_model_len vLLM accepts for this config (vllm/config/model.py
    _get_and_verify_max_len): max_position_embeddings, times rope_scaling's factor unless its type
    is su/longrope/llama3; for YaRN the factor multiplies original_max_position_embeddings."""
    limit = int(cfg.get("max_position_embeddings") or 4096)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type") if isinstance(rope, Mapping) else None
    if not kind or kind in ROPE_TYPES_KEEPING_LIMIT:
        return limit
    base = rope.get("original_max_position_embeddings") or limit if kind == "yarn" else limit
    return int(base * float(rope.get("factor") or 1.0))


def apply_hf_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with vLLM's --hf-overrides applied: top-level keys replaced (nested dicts
    merged); a key the text_config of a multimodal config also holds is replaced there too."""
    def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
                else value
        return out
    merged = merge(config, overrides)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        merged["text_config"] = merge(text, {k: v for k, v in overrides.items() if k in text})
    return merged


def checkpoint_quant(config: Mapping[str, Any]) -> str:
    """The weight format a checkpoint's own quantization_config declares."""
    qc = config.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if not method:
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return {"float16": "fp16", "float32": "fp32"}.get(dtype, "bf16")
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "bitsandbytes"):
        return "int8" if qc.get("bits") == 8 else "int4"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        bits = [g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)]
        return "int4" if 4 in bits else "fp8"
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).lower()
        return "nvfp4" if "fp4" in algo else "fp8"
    if method in QUANT_BYTES:
        return method
    if method in ("fbgemm_fp8", "ptpc_fp8", "fp8"):
        return "fp8"
    return "bf16"


def model_from_config(config: Mapping[str, Any], name: str, source: str,
                      checkpoint_bytes: int | None = None, params_b: float | None = None,
                      extra_params_b: float = 0.0) -> Model:
    cfg = _text_config(config)
    try:
        n_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{source} is not a decoder config.json (num_hidden_layers, hidden_size, "
                         "num_attention_heads missing): pass a causal LM's config")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = (int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), int(cfg.get("qk_nope_head_dim") or 128),
               int(cfg.get("qk_rope_head_dim") or 64), int(cfg.get("v_head_dim") or 128))
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    intermediate = int(cfg.get("intermediate_size") or 4 * hidden)
    moe_layers: tuple[bool, ...] = ()
    shared = 0
    dense_intermediate = intermediate
    if experts:
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        step = int(cfg.get("interleave_moe_layer_step") or cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i >= first_dense and (i + 1) % step == 0 and i not in dense_only for i in range(n_layers))
        expert_intermediate = int(cfg.get("moe_intermediate_size") or intermediate)
        if cfg.get("shared_expert_intermediate_size"):
            shared = int(cfg["shared_expert_intermediate_size"])
        elif cfg.get("n_shared_experts"):
            shared = int(cfg["n_shared_experts"]) * expert_intermediate
        elif cfg.get("model_type") == "llama4":
            shared = expert_intermediate
        dense_intermediate = int(cfg.get("intermediate_size_mlp") or intermediate)
    else:
        expert_intermediate = 0
    linear_state = None
    if cfg.get("linear_num_value_heads"):
        linear_state = (int(cfg.get("linear_conv_kernel_dim") or 4), int(cfg["linear_num_key_heads"]),
                        int(cfg["linear_key_head_dim"]), int(cfg["linear_num_value_heads"]),
                        int(cfg["linear_value_head_dim"]))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    vision = vision_tower(config)
    model = Model(
        name=name, source=source, layers=_layer_kinds(cfg, n_layers), hidden=hidden, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=int(cfg.get("vocab_size") or 32000),
        intermediate=intermediate, max_len=derived_max_len(cfg),
        dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        quant=checkpoint_quant({**cfg, **config}), mla=mla, experts=experts,
        attention_unquantized=any("attn" in str(name) for name in
                                  (config.get("quantization_config") or {}).get("modules_to_not_convert") or []),
        top_k=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
        expert_intermediate=expert_intermediate, shared_intermediate=shared, moe_layers=moe_layers,
        dense_intermediate=dense_intermediate, linear_state=linear_state, params_b=params_b, vision=vision,
        extra_params=extra_params_b * 1e9 or (vision.params if vision else 0.0), checkpoint_bytes=checkpoint_bytes,
        multimodal=bool(config.get("vision_config") or extra_params_b
                        or any("ForConditionalGeneration" in str(a) for a in config.get("architectures") or [])))
    return replace(model, **_encoder_only_fields(cfg))


def _encoder_only_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What sets a BERT-style pooling model (ENCODER_MODEL_TYPES) apart from a decoder: no LM head,
    an MLP of two matrices (GELU), learned position and token-type embeddings, and a float32
    checkpoint loaded in float16 (vLLM loads float32 in 16 bits, float16 for a pooling model where
    the platform has it: _resolve_auto_dtype, vllm/config/model.py, vLLM 0.32.0)."""
    if cfg.get("model_type") not in ENCODER_MODEL_TYPES:
        return {}
    fields: dict[str, Any] = {"encoder_only": True, "gated_mlp": False, "position_embeddings":
                              int(cfg.get("max_position_embeddings") or 0) + int(cfg.get("type_vocab_size") or 0)}
    if checkpoint_quant(cfg) == "fp32":
        fields.update(quant="fp16", dtype_bytes=2)
    return fields
