"""roofline.py: physics of decode and prefill against hand-derived figures."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import roofline

from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_USAGE
from rooflib.sizing import memory_budget, resolve
from rooflib.sizing import physics as phys


def physics(model: str, gpu: str = "h100", tp: int = 1, **kw) -> phys.Physics:
    return phys.Physics(memory_budget.Inputs(model=resolve.resolve_model(model), gpu=resolve.resolve_gpu(gpu, None), tp=tp, **kw))


def test_llama8b_h100_batch1_is_the_weight_read():
    # 7.5 B non-embedding parameters + the LM head, bf16: 15.0 GB / 3.35 TB/s = 4.48 ms.
    step = physics("llama-3.1-8b").decode(1, 1)
    assert step["weight_bytes_per_gpu"] == pytest.approx(15.0e9, rel=0.01)
    assert step["step_ms_bound"] == pytest.approx(4.48, abs=0.02)
    assert step["bound_by"] == "memory"


@pytest.mark.parametrize("kv_dtype, bytes_per_token", [("auto", 131_072), ("fp8", 65_536)])
def test_kv_read_grows_by_bytes_per_token_over_bandwidth(kv_dtype, bytes_per_token):
    p = physics("llama-3.1-8b", kv_dtype=kv_dtype)
    slope = (p.decode(1, 10_001)["step_ms_bound"] - p.decode(1, 1)["step_ms_bound"]) / 10_000
    assert slope == pytest.approx(bytes_per_token / 3.35e12 * 1e3, rel=1e-6)


def test_sliding_window_layers_read_only_the_window():
    p = physics("gpt-oss-120b")
    short, long = p.decode(1, 128)["kv_bytes_per_gpu"], p.decode(1, 100_128)["kv_bytes_per_gpu"]
    # 18 full layers grow with the context, 18 sliding layers stay at 128 tokens.
    assert long - short == 100_000 * 18 * 2 * 8 * 64 * 2


def test_moe_reads_the_experts_a_batch_touches():
    assert phys.expected_experts(128, 8, 1) == pytest.approx(8)
    assert phys.expected_experts(128, 8, 4096) == pytest.approx(128)
    p = physics("qwen3-30b-a3b")
    assert p.decode(1, 1)["weight_bytes_per_gpu"] < p.decode(64, 1)["weight_bytes_per_gpu"] / 5


def test_decode_turns_compute_bound_at_the_ridge():
    # bf16 weights: 2 FLOPs per weight byte per sequence, so the ridge 989e12/3.35e12 ~ 295 sequences.
    assert 280 <= physics("llama-3.1-8b").compute_bound_batch(1) <= 300


def test_prefill_counts_causal_attention():
    p = physics("llama-2-7b", quant="fp8")
    result = p.prefill(2048)
    linear = 2 * p.active_linear_params * 2048
    attention = 32 * 4 * 32 * 128 * 2048 * 2049 / 2
    assert result["flops_per_gpu"] == pytest.approx(linear + attention)
    assert result["bound_by"] == "compute"


def test_tp_adds_allreduce_time_and_splits_bytes():
    one, four = physics("llama-3.3-70b", tp=1).decode(1, 1), physics("llama-3.3-70b", tp=4).decode(1, 1)
    assert four["weight_bytes_per_gpu"] == pytest.approx(one["weight_bytes_per_gpu"] / 4, rel=0.01)
    assert four["comm_ms"] > 0 == one["comm_ms"]


def test_cli_json(capsys):
    code = roofline.main(["--model", "qwen3-32b", "--gpu", "h100", "--batch", "8", "--prompt-tokens", "2048", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["decode"]["batch"] == 8 and result["prefill"]["prompt_tokens"] == 2048
    assert result["table"][0]["batch"] == 1
    assert result["decode"]["step_ms_bound"] <= result["decode"]["step_ms_expected"]


def test_cli_needs_bandwidth(capsys):
    assert roofline.main(["--model", "qwen3-32b", "--gpu-gb", "80"]) == EXIT_USAGE
    assert "needs a catalog GPU" in capsys.readouterr().err


def test_fp8_vs_awq_direction_follows_the_kernels():
    # Qwen3-32B on one H100 at 1,024 tokens: 4-bit reads half FP8's bytes, so it wins at batch 1;
    # at batch 128 its Marlin GEMM (16-bit tensor cores, 0.6x cuBLAS) loses to FP8's tensor cores.
    fp8, awq = physics("qwen3-32b", quant="fp8"), physics("qwen3-32b", quant="awq")
    assert awq.decode(1, 1024)["step_ms_expected"] < fp8.decode(1, 1024)["step_ms_expected"]
    assert awq.decode(128, 1024)["step_ms_expected"] > fp8.decode(128, 1024)["step_ms_expected"]
    assert awq.prefill(2048)["ttft_ms_expected"] > 2 * fp8.prefill(2048)["ttft_ms_expected"]
    # the bound stays physics: 4-bit weights at the bf16 peak, no kernel factor
    assert awq.flops_peak == 989e12 and awq.decode(128, 1024)["step_ms_bound"] < fp8.decode(128, 1024)["step_ms_bound"]


def test_expected_runs_linear_layers_and_attention_one_after_the_other():
    p = physics("llama-3.1-8b")
    step = p.decode(64, 8192)
    assert step["step_ms_expected"] >= (step["memory_ms"] / 0.9) + 0.2


def test_roofline_bench_checks_the_fp8_vs_4bit_direction(tmp_path, capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "roofline_bounds.py"
    spec = importlib.util.spec_from_file_location("roofline_bounds", path)
    roofline_bounds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roofline_bounds)
    assert roofline_bounds.main(["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {d["measured_winner"] for d in result["directions"]} == {"4-bit", "fp8"}
    assert result["wrong_directions"] == 0
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("cases: []\ndirections:\n  - {id: x, model: llama-3.1-8b, gpu: h100-sxm, batch: 1, context: 1024,"
                     " int4_speedup: 0.5, fp8_speedup: 1.5, source: test}\n")
    assert roofline_bounds.main(["--fixture", str(wrong)]) == EXIT_CHECK_FAILED
    assert "WRONG DIRECTION" in capsys.readouterr().out


def test_roofline_names_the_batch_from_which_fp8_beats_4bit(capsys):
    inp = memory_budget.Inputs(model=resolve.resolve_model("qwen3-32b"), gpu=resolve.resolve_gpu("h100", None), quant="awq")
    crossover = phys.fp8_crossover_batch(inp, 1024)
    fp8, awq = physics("qwen3-32b", quant="fp8"), physics("qwen3-32b", quant="awq")
    assert 1 < crossover < 128
    assert fp8.decode(crossover, 1024)["step_ms_expected"] < awq.decode(crossover, 1024)["step_ms_expected"]
    assert fp8.decode(crossover - 1, 1024)["step_ms_expected"] >= awq.decode(crossover - 1, 1024)["step_ms_expected"]
    a100 = memory_budget.Inputs(model=resolve.resolve_model("qwen3-32b"), gpu=resolve.resolve_gpu("a100-80gb", None), quant="awq")
    assert phys.fp8_crossover_batch(a100, 1024) is None  # no FP8 tensor cores: FP8 is weight-only there too
    assert roofline.main(["--model", "qwen3-32b", "--gpu", "h100", "--quant", "awq"]) == 0
    assert f"the same model in FP8 is expected faster from batch {crossover}" in capsys.readouterr().out
