"""vram.py on models beyond text generation: a BERT-style pooling model (no KV cache: the weights, the
profile batch, and one engine step bounding the requests) and a vision-language model's encoder
(its weights from vision_config, the images its profile run encodes and the encoder cache they fill).

The expected figures are counted here from the config shapes, apart from the code under test."""
from __future__ import annotations

import json

import pytest
import vram

from rooflib.core.errors import EXIT_USAGE
from rooflib.sizing import model_shape, resolve

GIB = 1 << 30
# BAAI/bge-m3 (the catalog's bge-m3): XLM-RoBERTa large, 8,194 positions.
BGE_M3_PARAMS = (250_002 + 8_194 + 1) * 1024 + 24 * (4 * 1024 ** 2 + 2 * 1024 * 4096)
# Qwen2.5-VL-7B's vision encoder: 32 SwiGLU blocks of width 1280, the patch embedding (2 frames of
# 14 x 14 x 3), the merger MLP from 4 patches (5,120) to the language model's 3,584.
QWEN25_VL_VISION = 32 * (4 * 1280 ** 2 + 3 * 1280 * 3420) + 3 * 14 * 14 * 2 * 1280 + 5120 ** 2 + 5120 * 3584
# A LLaVA-1.5-7B shape: a Llama-2-7B text model and CLIP ViT-L/14 at 336 pixels (24 x 24 = 576 tokens).
LLAVA = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "torch_dtype": "float16",
         "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                         "vocab_size": 32064, "max_position_embeddings": 4096},
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                           "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                           "hidden_act": "quick_gelu"}}
LLAVA_VISION = 24 * (4 * 1024 ** 2 + 2 * 1024 * 4096) + 3 * 14 * 14 * 1024 + 576 * 1024 + 1024 * 4096 + 4096 ** 2
TINY_BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 256, "intermediate_size": 1024,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 8192, "max_position_embeddings": 512,
             "type_vocab_size": 2, "torch_dtype": "float32"}


def run_json(argv, capsys) -> tuple[int, dict]:
    code = vram.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def config_file(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


# ---- pooling models: no KV cache


def test_bge_m3_on_an_h100_has_no_kv_cache_and_one_step_bounds_its_requests(capsys):
    code, r = run_json(["--model", "BAAI/bge-m3", "--gpu", "h100"], capsys)
    assert code == 0 and r["model_kind"] == "pooling" and r["kv_cache"] is None and r["fits"]
    assert r["weights_quant"] == "fp16"  # float32 on the Hub, loaded in 16 bits
    assert r["weights_gib"] == pytest.approx(BGE_M3_PARAMS * 2 / GIB, rel=1e-6)
    # No chunked prefill: a step holds a whole input, so the budget rises to the context limit.
    assert (r["ctx"], r["max_num_batched_tokens"]) == (8194, 8194)
    assert (r["requests_per_step"], r["typical_tokens"], r["typical_requests_per_step"]) == (1, 2048, 4)
    budget = r["gpu_memory_gib"] * r["gpu_util"]
    assert r["left_gib"] == pytest.approx(budget - r["weights_gib"] - r["activation_gib"] - r["non_torch_gib"]
                                          - r["cudagraph_gib"])


@pytest.mark.parametrize("argv, ctx, batched, per_step, typical, typical_per_step", [
    # The context limit under the default budget: the default stays.
    (["--ctx", "512"], 512, 8192, 16, 512, 16),
    # A typical embedding input of 256 tokens: 32 a step.
    (["--ctx", "512", "--typical-tokens", "256"], 512, 8192, 16, 256, 32),
    # The requests a step holds are capped by max_num_seqs too.
    (["--ctx", "512", "--typical-tokens", "16", "--max-num-seqs", "64"], 512, 8192, 16, 16, 64),
    # A budget of the user's, at least the context limit.
    (["--max-num-batched-tokens", "16388"], 8194, 16388, 2, 2048, 8),
    # A card under 70 GiB: vLLM's smaller default (2,048) is raised to the context limit.
    (["--gpu", "l40s", "--ctx", "4096"], 4096, 4096, 1, 2048, 2),
])
def test_the_requests_a_step_holds_follow_the_budget(argv, ctx, batched, per_step, typical, typical_per_step, capsys):
    gpu = [] if "--gpu" in argv else ["--gpu", "h100"]
    code, r = run_json(["--model", "bge-m3", *gpu, *argv], capsys)
    assert code == 0
    assert (r["ctx"], r["max_num_batched_tokens"], r["requests_per_step"]) == (ctx, batched, per_step)
    assert (r["typical_tokens"], r["typical_requests_per_step"]) == (typical, typical_per_step)


def test_a_bert_config_json_is_a_pooling_model_with_its_own_mlp_and_no_lm_head(tmp_path, capsys):
    code, r = run_json(["--model", config_file(tmp_path, TINY_BERT), "--gpu-gb", "24"], capsys)
    embeddings = (8192 + 512 + 2) * 256
    layers = 2 * (4 * 256 ** 2 + 2 * 256 * 1024)
    assert code == 0 and r["model_kind"] == "pooling"
    assert r["weights_gib"] == pytest.approx((embeddings + layers) * 2 / GIB, rel=1e-6)


def test_the_pooling_answer_says_there_is_no_kv_cache_and_what_bounds_requests(capsys):
    assert vram.main(["--model", "bge-m3", "--gpu", "h100"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("FITS: bge-m3 on NVIDIA H100")
    assert "no KV cache" in said and "one step (no chunked prefill)" in said and "max_num_seqs 1,024" in said


def test_a_pooling_model_too_big_for_the_card_does_not_fit(tmp_path, capsys):
    code, r = run_json(["--model", "bge-m3", "--gpu-gib", "1"], capsys)
    assert code == 1 and not r["fits"] and r["left_gib"] < 0


@pytest.mark.parametrize("argv, message", [
    (["--max-num-batched-tokens", "4096"], "MAX_NUM_BATCHED_TOKENS=4096 is below CTX=8194"),
    (["--engine", "sglang"], "bge-m3 is a pooling model (no KV cache): vram sizes it for vLLM on a GPU"),
    (["--ctx", "9000"], "CTX=9000 is beyond bge-m3's limit of 8194"),
])
def test_pooling_input_vllm_would_refuse_is_one_line(argv, message, capsys):
    code = vram.main(["--model", "bge-m3", "--gpu", "h100", *argv])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USAGE and len(err.splitlines()) == 1 and message in err, err


# ---- vision-language models: the encoder


@pytest.mark.parametrize("model, gpu, params, tokens, budget, images, cache_bytes, forward_bytes", [
    # Qwen2.5-VL-7B: one image of 16,384 tokens (12,845,056 pixels / 28^2) outgrows the 8,192-token
    # budget, which rises to it; 4 patches a token.
    ("qwen2.5-vl-7b", "h100", QWEN25_VL_VISION, 16_384, 16_384, 1,
     16_384 * 3584 * 2, 16_384 * 4 * (3 * 3420 + 3 * 1280) * 2),
    # On an A100 the default budget is 2,048 tokens: still one image.
    ("qwen2.5-vl-7b", "a100-80gb", QWEN25_VL_VISION, 16_384, 16_384, 1,
     16_384 * 3584 * 2, 16_384 * 4 * (3 * 3420 + 3 * 1280) * 2),
    # LLaVA: 576 tokens an image, 8,192 // 576 = 14 images in the budget; the outputs are 4,096 wide.
    ("llava", "h100", LLAVA_VISION, 576, 8192, 14, 14 * 576 * 4096 * 2, 14 * 576 * (2 * 4096 + 3 * 1024) * 2),
])
def test_the_vision_encoder_is_sized_from_vision_config(model, gpu, params, tokens, budget, images, cache_bytes,
                                                        forward_bytes, tmp_path, capsys):
    name = config_file(tmp_path, LLAVA) if model == "llava" else model
    code, r = run_json(["--model", name, "--gpu", gpu, "--ctx", "4096"], capsys)
    enc = r["vision_encoder"]
    assert code == 0 and r["multimodal"]
    assert enc["params_b"] * 1e9 == pytest.approx(params, rel=1e-9)
    assert (enc["tokens_per_image"], enc["budget_tokens"], enc["images_profiled"]) == (tokens, budget, images)
    assert enc["cache_gib"] * GIB == pytest.approx(cache_bytes)
    assert enc["forward_gib"] * GIB == pytest.approx(forward_bytes)
    # The encoder is modelled, so it widens the range without leaving the model.
    assert not r["outside_model"] and "vision-encoder" in [s["source"] for s in r["range_sources"]]


def test_the_profile_peak_holds_the_encoder_outputs_beside_the_larger_activation(capsys):
    r = run_json(["--model", "qwen2.5-vl-7b", "--gpu", "h100", "--ctx", "32768"], capsys)[1]
    text = run_json(["--model", "qwen2.5-vl-7b", "--gpu", "h100", "--ctx", "32768", "--language-model-only"], capsys)[1]
    enc = r["vision_encoder"]
    assert text["vision_encoder"] is None
    assert r["activation_gib"] == pytest.approx(max(text["activation_gib"], enc["forward_gib"]) + enc["cache_gib"])
    assert r["weights_gib"] - text["weights_gib"] == pytest.approx(QWEN25_VL_VISION * 2 / GIB)
    assert r["kv_cache_tokens"] < text["kv_cache_tokens"]


def test_the_vision_line_says_what_the_profile_run_encodes(capsys):
    assert vram.main(["--model", "qwen2.5-vl-7b", "--gpu", "h100", "--ctx", "32768", "--no-roofline"]) == 0
    said = capsys.readouterr().out
    assert "vision    encoder 676M parameters" in said
    assert "encodes 1 image(s) of 16,384 tokens (encoder budget 16,384 tokens" in said


def test_a_catalog_vlm_without_vision_config_stays_outside_the_model():
    model = resolve.resolve_model("gemma-3-27b")
    assert model.multimodal and model.vision is None


def test_pooled_patches_count_in_the_encoders_activations():
    """Gemma 3's SigLIP sees 896 / 14 = 64 x 64 patches and pools them into 256 tokens an image."""
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                              "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                              "head_dim": 256, "vocab_size": 262208},
              "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                                "image_size": 896, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh"}}
    tower = model_shape.vision_tower(config)
    assert (tower.tokens_per_image, tower.patches_per_token, tower.out_hidden) == (256, 16, 2560)
