"""Every number the skills state as a fact is one our own tools reproduce: each claim below runs the
tool (or reads the data or constant it uses) and finds the same number, as written, in the English
and the Russian text."""
from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache

import pytest
import smoke_toolcall
import yaml
from markdown_doc import REPO, Doc

from rooflib.core.catalogs import load_catalog
from rooflib.quality import toolcalls
from rooflib.server import known_settings, slo_targets
from rooflib.sizing import model_shape, physics

SKILL = "SKILL.md"
ROOFLINE = "references/roofline.md"
QUANT = "references/quantization.md"
FLAGS = "references/serving-flags.md"
METRICS = "references/metrics.md"


@lru_cache(maxsize=None)
def tool_json(script: str, *args: str) -> dict:
    """One run of a script with --json; exit 1 ("does not fit") still carries the full answer."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args, "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def vram(*args: str) -> dict:
    return tool_json("vram.py", *args)


def roofline(*args: str) -> dict:
    return tool_json("roofline.py", *args)


QWEN_H100 = ("--model", "qwen3-32b", "--gpu", "h100", "--ctx", "32768")
# The skill's sliding-window example: kv_cache_tokens is not divided by a request length there.
GEMMA_4090 = ("--model", "gemma-3-27b", "--gpu", "rtx-4090", "--quant", "awq", "--ctx", "16384")
LLAMA_ROOFLINE = ("--model", "llama-3.1-8b", "--gpu", "h100", "--batch", "1", "--prompt-tokens", "2048")
# The skill's worked example of "users" at a typical length: a 1,024-token prompt and 256 output tokens.
TYPICAL_REQUEST_TOKENS = 1024 + 256
QWEN_ROOFLINE = ("--model", "qwen3-32b", "--gpu", "h100", "--prompt-tokens", "1024")
# The sizing reference's pooling model and vision-language model.
BGE_H100 = ("--model", "bge-m3", "--gpu", "h100")
QWEN_VL_H100 = ("--model", "qwen2.5-vl-7b", "--gpu", "h100", "--ctx", "32768")
PPL_GATES = yaml.safe_load((REPO / "scripts" / "rooflib" / "catalog" / "ppl_gates.yaml").read_text())

# (claim, the number as the docs write it (normalized), where it is written, what the tool says)
CLAIMS = [
    ("Qwen3-32B KV bytes per token, BF16", "262144", [SKILL, ROOFLINE],
     lambda: vram(*QWEN_H100)["kv_bytes_per_token"]),
    ("Qwen3-32B KV bytes per token, FP8 KV", "131072", [SKILL, ROOFLINE],
     lambda: vram(*QWEN_H100, "--kv-dtype", "fp8")["kv_bytes_per_token"]),
    ("Llama-3.1-8B KV bytes per token, BF16", "131072", [ROOFLINE],
     lambda: vram("--model", "llama-3.1-8b", "--gpu", "h100")["kv_bytes_per_token"]),
    ("DeepSeek-V3 (MLA) KV bytes per token, BF16", "70272", [SKILL, ROOFLINE],
     lambda: vram("--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--ctx", "32768")["kv_bytes_per_token"]),
    ("Qwen3-32B on one H100 at 32768: KV tokens", "38832", [SKILL],
     lambda: vram(*QWEN_H100)["kv_cache_tokens"]),
    ("Qwen3-32B on one H100 at 32768: max concurrency", "1.19", [SKILL],
     lambda: round(vram(*QWEN_H100)["max_concurrency"], 2)),
    ("Qwen3-32B on one H100 at 32768, FP8 KV: KV tokens", "77680", [SKILL],
     lambda: vram(*QWEN_H100, "--kv-dtype", "fp8")["kv_cache_tokens"]),
    ("Qwen3-32B on one H100 at 32768, FP8 KV: max concurrency", "2.37", [SKILL],
     lambda: round(vram(*QWEN_H100, "--kv-dtype", "fp8")["max_concurrency"], 2)),
    ("Qwen3-32B on one H100 at 32768 with GPU_UTIL=0.9: max concurrency (the marginal fit flips)", "0.99", [SKILL],
     lambda: round(vram(*QWEN_H100, "--gpu-util", "0.9")["max_concurrency"], 2)),
    ("Qwen3-32B on one H100 at 32768: requests of 1,280 tokens (1,024 in, 256 out) in its KV cache", "30", [SKILL],
     lambda: int(vram(*QWEN_H100, "--typical-tokens", str(TYPICAL_REQUEST_TOKENS))["typical"]["max_concurrency"])),
    ("Gemma-3-27B AWQ on an RTX 4090 at 16384: KV tokens (concurrency x CTX)", "27301", [SKILL],
     lambda: vram(*GEMMA_4090)["kv_cache_tokens"]),
    ("Gemma-3-27B AWQ on an RTX 4090 at 16384: requests of 2,048 tokens at once", "4.0", [SKILL],
     lambda: round(vram(*GEMMA_4090)["typical"]["max_concurrency"], 1)),
    ("the typical request of that example, tokens", "1280", [SKILL], lambda: TYPICAL_REQUEST_TOKENS),
    ("vLLM 0.32 default gpu_memory_utilization", "0.92", [SKILL, FLAGS],
     lambda: vram(*QWEN_H100)["gpu_util"]),
    ("vLLM serve max_num_seqs on 70 GiB or more", "1024", [SKILL, FLAGS],
     lambda: vram(*QWEN_H100)["max_num_seqs"]),
    ("vLLM serve max_num_seqs below 70 GiB", "256", [SKILL, FLAGS],
     lambda: vram("--model", "qwen3-8b", "--gpu", "l40s", "--ctx", "8192")["max_num_seqs"]),
    ("vLLM serve max_num_batched_tokens on 70 GiB or more", "8192", [SKILL, FLAGS],
     lambda: vram(*QWEN_H100)["max_num_batched_tokens"]),
    ("vLLM serve max_num_batched_tokens from 160 GiB", "16384", [SKILL, FLAGS],
     lambda: vram("--model", "qwen3-32b", "--gpu", "b200", "--ctx", "32768")["max_num_batched_tokens"]),
    ("vLLM serve max_num_seqs on an A100 80GB", "256", [SKILL, FLAGS],
     lambda: vram("--model", "qwen3-8b", "--gpu", "a100-80gb", "--ctx", "8192")["max_num_seqs"]),
    ("vLLM serve max_num_batched_tokens below 70 GiB", "2048", [SKILL, FLAGS],
     lambda: vram("--model", "qwen3-8b", "--gpu", "l40s", "--ctx", "8192")["max_num_batched_tokens"]),
    ("SGLang default mem_fraction_static on an H100", "0.827", [SKILL],
     lambda: vram("--model", "qwen3-8b", "--gpu", "h100", "--engine", "sglang", "--ctx", "8192")["gpu_util"]),
    ("SGLang default mem_fraction_static on an L4", "0.819", [SKILL],
     lambda: vram("--model", "qwen3-8b", "--gpu", "l4", "--engine", "sglang", "--ctx", "8192")["gpu_util"]),
    ("KV block size", "16", [SKILL],
     lambda: vram(*QWEN_H100)["block_size"]),
    ("Llama-3.1-8B H100 decode bound at batch 1, ms", "4.56", [SKILL, ROOFLINE],
     lambda: round(roofline(*LLAMA_ROOFLINE)["decode"]["step_ms_bound"], 2)),
    ("Llama-3.1-8B H100 tokens/s per user bound", "219", [SKILL, ROOFLINE],
     lambda: int(roofline(*LLAMA_ROOFLINE)["decode"]["tokens_per_s_per_user_bound"])),
    ("Llama-3.1-8B H100 prefill bound of 2048 tokens, ms", "32.2", [SKILL, ROOFLINE],
     lambda: round(roofline(*LLAMA_ROOFLINE)["prefill"]["ttft_ms_bound"], 1)),
    ("bge-m3 on one H100: weights, GiB", "1.05", [ROOFLINE], lambda: round(vram(*BGE_H100)["weights_gib"], 2)),
    ("bge-m3 on one H100: memory no request uses, GiB", "70.73", [ROOFLINE],
     lambda: round(vram(*BGE_H100)["left_gib"], 2)),
    ("bge-m3: its context limit, tokens", "8194", [ROOFLINE], lambda: vram(*BGE_H100)["ctx"]),
    ("bge-m3 on one H100: requests of 2,048 tokens per step", "4", [ROOFLINE],
     lambda: vram(*BGE_H100)["typical_requests_per_step"]),
    ("Qwen2-VL / Qwen2.5-VL most pixels an image", "12845056", [ROOFLINE], lambda: model_shape.QWEN_VL_MAX_PIXELS),
    ("Qwen2.5-VL-7B: tokens of the largest image", "16384", [ROOFLINE],
     lambda: vram(*QWEN_VL_H100)["vision_encoder"]["tokens_per_image"]),
    ("Qwen2.5-VL-7B: vision encoder parameters, M", "676",
     [ROOFLINE], lambda: round(vram(*QWEN_VL_H100)["vision_encoder"]["params_b"] * 1000)),
    ("Qwen2.5-VL-7B on one H100: encoder activations, GiB", "1.72", [ROOFLINE],
     lambda: round(vram(*QWEN_VL_H100)["vision_encoder"]["forward_gib"], 2)),
    ("Qwen2.5-VL-7B on one H100: encoder cache, GiB", "0.11", [ROOFLINE],
     lambda: round(vram(*QWEN_VL_H100)["vision_encoder"]["cache_gib"], 2)),
    ("Qwen2.5-VL-7B on one H100 at 32768: KV tokens", "1026672", [ROOFLINE],
     lambda: vram(*QWEN_VL_H100)["kv_cache_tokens"]),
    ("Qwen2.5-VL-7B on one H100 at 32768, language model only: KV tokens", "1054560", [ROOFLINE],
     lambda: vram(*QWEN_VL_H100, "--language-model-only")["kv_cache_tokens"]),
    ("H100 SXM bandwidth, TB/s", "3.35", [ROOFLINE], lambda: load_catalog("gpus")["h100-sxm"]["bandwidth_tb_s"]),
    ("H100 SXM dense BF16 TFLOP/s", "989", [ROOFLINE], lambda: load_catalog("gpus")["h100-sxm"]["bf16_dense_tflops"]),
    ("H100 SXM dense FP8 TFLOP/s", "1979", [ROOFLINE], lambda: load_catalog("gpus")["h100-sxm"]["fp8_dense_tflops"]),
    ("FP8 perplexity warn level, %", "1", [SKILL, QUANT], lambda: PPL_GATES["fp8"]["warn_pct"]),
    ("FP8 perplexity fail level, %", "2", [SKILL, QUANT], lambda: PPL_GATES["fp8"]["fail_pct"]),
    ("INT8 perplexity warn level, %", "1.5", [SKILL, QUANT], lambda: PPL_GATES["int8"]["warn_pct"]),
    ("INT8 perplexity fail level, %", "3", [SKILL, QUANT], lambda: PPL_GATES["int8"]["fail_pct"]),
    ("4-bit perplexity warn level, %", "3", [SKILL, QUANT], lambda: PPL_GATES["4bit"]["warn_pct"]),
    ("4-bit perplexity fail level, %", "5", [SKILL, QUANT], lambda: PPL_GATES["4bit"]["fail_pct"]),
    ("metrics: queue finding at this share of e2e, %", "20", [SKILL], lambda: known_settings.QUEUE_SHARE * 100),
    ("metrics: KV cache counted full at, %", "90", [METRICS], lambda: known_settings.KV_FULL * 100),
    ("metrics: low prefix-cache hit rate below, %", "20", [SKILL], lambda: known_settings.PREFIX_LOW * 100),
    ("metrics: prefix finding from mean prompt tokens", "512", [METRICS], lambda: known_settings.PREFIX_LONG_PROMPT),
    ("smoke: a case passes at this share of repeats, %", "80", [QUANT], lambda: toolcalls.PASS_SHARE * 100),
    ("Qwen3-32B H100 expected decode at batch 1, AWQ, ms", "6.18", [QUANT],
     lambda: round(roofline(*QWEN_ROOFLINE, "--quant", "awq", "--batch", "1")["decode"]["step_ms_expected"], 2)),
    ("Qwen3-32B H100 expected decode at batch 1, FP8, ms", "11.16", [QUANT],
     lambda: round(roofline(*QWEN_ROOFLINE, "--quant", "fp8", "--batch", "1")["decode"]["step_ms_expected"], 2)),
    ("Qwen3-32B H100 expected decode at batch 128, AWQ, ms", "29.99", [QUANT],
     lambda: round(roofline(*QWEN_ROOFLINE, "--quant", "awq", "--batch", "128")["decode"]["step_ms_expected"], 2)),
    ("Qwen3-32B H100 expected decode at batch 128, FP8, ms", "22.46", [QUANT],
     lambda: round(roofline(*QWEN_ROOFLINE, "--quant", "fp8", "--batch", "128")["decode"]["step_ms_expected"], 2)),
    ("Qwen3-32B H100 expected prefill of 1024 tokens, AWQ, ms", "148.9", [QUANT],
     lambda: round(roofline(*QWEN_ROOFLINE, "--quant", "awq")["prefill"]["ttft_ms_expected"], 1)),
    ("Qwen3-32B H100 expected prefill of 1024 tokens, FP8, ms", "45.8", [QUANT],
     lambda: round(roofline(*QWEN_ROOFLINE, "--quant", "fp8")["prefill"]["ttft_ms_expected"], 1)),
    ("W4A16 GEMM share of the 16-bit rate", "0.6", [QUANT, ROOFLINE], lambda: physics.W4A16_GEMM_SHARE),
    ("metrics: default TTFT p95 target, s", "2", [METRICS], lambda: slo_targets.DEFAULT_TARGETS["ttft_p95_ms"] / 1000),
    ("metrics: default TPOT p95 target, ms", "50", [METRICS], lambda: slo_targets.DEFAULT_TARGETS["tpot_p95_ms"]),
    ("metrics: vLLM's smallest default max_num_seqs", "128", [METRICS], lambda: known_settings.VLLM_DEFAULT_MAX_NUM_SEQS[0]),
    ("smoke: repeats per case by default", "3", [QUANT],
     lambda: smoke_toolcall.build_parser().get_default("repeat")),
]


@pytest.mark.parametrize("claim, written, files, measure", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_stated_number_is_what_the_tool_gives(claim, written, files, measure):
    assert float(measure()) == float(written), f"{claim}: the tool gives {measure()}, the docs say {written}"
    for relative in files:
        for skill in ("roofline-perf", "roofline-perf-ru"):
            doc = Doc.read(REPO / "skills" / skill / relative)
            assert written in doc.numbers(), f"{claim}: {written} is not written in skills/{skill}/{relative}"


def test_stated_fix_is_what_vram_gives():
    """The skill's example of a model that does not fit names vram's cheapest fix verbatim."""
    answer = vram("--model", "qwen3-32b", "--gpu", "l40s", "--ctx", "32768")
    assert answer["fits"] is False
    for skill in ("roofline-perf", "roofline-perf-ru"):
        assert answer["fix"]["change"] in Doc.read(REPO / "skills" / skill / SKILL).inline_code
