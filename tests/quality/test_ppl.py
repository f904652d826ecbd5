"""ppl.py: windows, the three APIs against a fake with a known toy model, compare mode and its
levels, bad input, and the real CPU vLLM against transformers on the same trained tiny model."""
from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import ppl
import pytest
import setup_cpu_vllm
from fake_ppl_server import BOS, exact_nll, fake_ppl_server, token_ids
from fault_server import Action, fault_server

from rooflib.core import http_client
from rooflib.core.errors import UsageError
from rooflib.quality import perplexity
from rooflib.serving import engine_setup

SAMPLE = perplexity.SAMPLE_TEXT.read_text(encoding="utf-8")


@pytest.mark.parametrize("total, length, stride", [(10, 20, 5), (10, 10, 3), (11, 10, 3), (1000, 256, 64),
                                                   (1000, 256, 255), (2, 2, 1)])
def test_windows_score_every_position_once_with_the_stride_as_context(total, length, stride):
    plan = perplexity.windows(total, length, stride)
    scored = [p for begin, end, first in plan for p in range(first, end)]
    assert scored == list(range(1, total))
    assert all(end - begin <= length and begin < first for begin, end, first in plan[1:])
    assert all(first - begin == length - stride for begin, end, first in plan[1:-1])
    assert plan[-1][1] == total and (len(plan) == 1) == (total <= length)


def run(capsys, *args):
    code = ppl.main([*args, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out else None), out.err


@pytest.mark.parametrize("engine, api", [("vllm", "vllm"), ("vllm", "vllm-echo"), ("sglang", "sglang")])
@pytest.mark.parametrize("window, stride", [("4000", "1000"), ("300", "100"), ("50", "49")])
def test_each_api_gives_the_exact_perplexity_of_the_toy_model(capsys, engine, api, window, stride):
    ids = token_ids(SAMPLE)
    with fake_ppl_server(engine, max_model_len=100_000) as url:
        code, run_, err = run(capsys, "--url", url, "--api", api, "--window", window, "--stride", stride)
    assert code == 0
    assert run_["tokens"] == len(ids) and run_["scored_tokens"] == len(ids) - 1
    assert run_["token_ids_sha256"] == perplexity.ids_sha256(ids)
    assert math.isclose(run_["nll"], exact_nll(ids), rel_tol=1e-12)
    assert math.isclose(run_["ppl"], math.exp(exact_nll(ids) / (len(ids) - 1)), rel_tol=1e-12)
    assert math.isclose(run_["bits_per_byte"], exact_nll(ids) / math.log(2) / len(SAMPLE.encode()), rel_tol=1e-12)
    assert run_["recheck_nll_delta"] == 0.0
    assert ("longer than one window" in err) == (int(window) < len(ids))


def test_bos_is_put_in_front_so_the_first_text_token_is_scored(capsys):
    requests = []
    with fake_ppl_server(bos=True, requests=requests) as url:
        code, run_, _ = run(capsys, "--url", url, "--window", "500", "--stride", "100")
    ids = token_ids(SAMPLE)
    assert code == 0 and run_["prefix"] == [BOS] and run_["scored_tokens"] == len(ids)
    assert math.isclose(run_["nll"], exact_nll([BOS] + ids), rel_tol=1e-12)
    first = next(r for r in requests if r["path"] == "/v1/completions")
    assert first["prompt"][:3] == [BOS] + ids[:2] and first["prompt_logprobs"] == 0 and first["max_tokens"] == 1


def test_default_window_fits_the_servers_context(capsys):
    with fake_ppl_server(max_model_len=1000) as url:
        code, run_, _ = run(capsys, "--url", url)
    assert code == 0 and (run_["window"], run_["stride"]) == (999, 249)


def test_paired_change_of_a_constant_shift_is_exact():
    base = [1.0] * 640
    change, low, high = perplexity.paired_change(base, [v + 0.01 for v in base], block=64)
    assert math.isclose(change, (math.exp(0.01) - 1) * 100) and math.isclose(low, change) and math.isclose(high, change)
    change, low, high = perplexity.paired_change(base, [v + (0.02 if i % 128 < 64 else 0.0) for i, v in enumerate(base)], 64)
    assert low < change < high and math.isclose(change, (math.exp(0.01) - 1) * 100)


@pytest.mark.parametrize("scheme, nats, verdict", [
    ("fp8", 0.005, "PASS"), ("fp8", 0.015, "WARN"), ("fp8", 0.025, "FAIL"),
    ("W8A8", 0.025, "WARN"), ("awq", 0.025, "PASS"), ("4-bit", 0.06, "FAIL"), ("fp8", -0.05, "PASS"),
])
def test_compare_servers_judges_the_change_by_the_schemes_levels(capsys, scheme, nats, verdict):
    with fake_ppl_server() as base, fake_ppl_server(shift=lambda position: -nats) as candidate:
        code, result, _ = run(capsys, "--compare", base, candidate, "--scheme", scheme, "--window", "400")
    assert math.isclose(result["change_pct"], (math.exp(nats) - 1) * 100, rel_tol=1e-9)
    assert result["metric"] == "perplexity" and result["verdict"] == verdict
    assert code == (1 if verdict == "FAIL" else 0)


def test_compare_saved_runs_and_the_bytes_fallback(capsys, tmp_path):
    with fake_ppl_server() as url:
        _, plain, _ = run(capsys, "--url", url, "--window", "400")
    with fake_ppl_server(bos=True, shift=lambda position: -0.01 * (position % 2)) as url:
        _, with_bos, _ = run(capsys, "--url", url, "--window", "400")
    (tmp_path / "a.json").write_text(json.dumps(plain))
    (tmp_path / "b.json").write_text(json.dumps(with_bos))
    code, result, _ = run(capsys, "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    # BOS on one side only: the token ids differ, so the comparison is per byte and unpaired.
    assert code == 0 and result["metric"].startswith("byte perplexity") and result["ci95_pct"] is None
    expected = (math.exp((with_bos["nll"] - plain["nll"]) / plain["bytes"]) - 1) * 100
    assert math.isclose(result["change_pct"], expected)
    assert "token_nll" not in result["base"]


@pytest.mark.parametrize("setup, args, message", [
    ("empty", [], "error: TEXT {empty} is empty: give a text of your own"),
    (None, ["--text", "/nonexistent.txt"], "error: cannot read TEXT /nonexistent.txt"),
    (None, ["--window", "5000"], "error: --window 5000 does not fit the server's max_model_len 4096: use at most 4095"),
    (None, ["--window", "100", "--stride", "100"], "error: --stride 100 must be smaller than the window (100)"),
    ("no_logprobs", [], "error: the server returned no prompt_logprobs: it is not vLLM; try --api vllm-echo"),
    ("no_logprobs", ["--api", "vllm-echo"], "error: the server returned no logprobs with echo"),
    ("sglang_no_logprobs", ["--api", "sglang"], "error: SGLang /generate returned no meta_info.input_token_logprobs"),
    ("sglang", [], "error: http://127.0.0.1:{port} has no /tokenize endpoint: is it vLLM (--api vllm) or SGLang"),
    ("sglang_small", ["--api", "sglang"], "error: SGLang could not take the whole text in one request (POST /generate "
                                          "answered HTTP 400: "),
    (None, ["--compare", "a.json", "b.json"], "error: cannot read saved run a.json"),
    (None, ["--compare", "x", "y", "--scheme", "fp9"], "error: unknown quantization scheme 'fp9': did you mean fp8"),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, setup, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    engine = "sglang" if setup and setup.startswith("sglang") else "vllm"
    context = 1000 if setup == "sglang_small" else 4096
    with fake_ppl_server(engine, context, no_logprobs=setup in ("no_logprobs", "sglang_no_logprobs")) as url:
        extra = ["--text", str(empty)] if setup == "empty" else []
        code, _, err = run(capsys, "--url", url, *extra, *args)
    port = url.rsplit(":", 1)[1]
    assert code == 2 and err.splitlines()[-1].startswith(message.format(empty=empty, port=port)), err
    assert err.count("error:") == 1


def test_a_window_slower_than_the_timeout_says_so_and_keeps_the_windows_before(capsys):
    """The second window never comes back: ppl gives up after --timeout and keeps the first. 5 s,
    not 1: the same timeout bounds the healthy answers before it (models, tokenize, the first
    window), which a busy machine may keep past 1 s; the hang costs 5 s all the same."""
    completions = []

    def hang_after_the_first_window(request):
        if request.path == "/v1/completions":
            completions.append(request)
            if len(completions) > 1:
                return Action(b"", "hang")
        return None

    with fault_server(hang_after_the_first_window) as url:
        code, run_, _ = run(capsys, "--url", url, "--window", "400", "--stride", "100", "--timeout", "5")
    assert code == 3 and len(run_["windows"]) == 1
    assert re.fullmatch(rf"server error: {url}/v1/completions timed out after [0-9.]+ s \(--timeout 5\): "
                        r".*raise --timeout \(task: add -- --timeout N\)", run_["stopped"]), run_["stopped"]


# One window of 2,048 tokens with prompt logprobs takes about a second on a quiet CPU, and no
# one can say how long on a 2-core host running several engines at load 16 (runs there stopped
# after their first windows with ppl's default 30 s): 600 s only bounds a hang.
REAL_TIMEOUT = ["--timeout", "600"]


@pytest.fixture(scope="module")
def trained_vllm(vllm_factory):
    with vllm_factory(model="tiny-qwen3-trained", sets=["enable_prefix_caching=false"]) as server:
        yield server


@pytest.mark.real_vllm
@pytest.mark.parametrize("window, stride", [(None, None), (256, 64)])
def test_perplexity_through_the_api_equals_transformers(trained_vllm, capsys, window, stride):
    args = ["--url", trained_vllm.url, *REAL_TIMEOUT] + (["--window", str(window), "--stride", str(stride)] if window else [])
    code, run_, err = run(capsys, *args)
    assert code == 0 and run_["model"] == "tiny-qwen3-trained", run_["stopped"] if run_ else err
    with http_client.client(trained_vllm.url, timeout=600) as http:
        prefix, ids = perplexity.tokenize(http, "vllm", run_["model"], SAMPLE)
    sequence = prefix + ids
    assert perplexity.ids_sha256(sequence) == run_["token_ids_sha256"]
    plan = [[w["begin"], w["end"], w["end"] - w["scored"]] for w in run_["windows"]]
    job = {"model_dir": str(engine_setup.model_dir("tiny-qwen3-trained")), "sequence": sequence, "windows": plan}
    done = subprocess.run([str(setup_cpu_vllm.venv_python()), str(Path(__file__).resolve().parents[1] / "hf_reference_nll.py")],
                          input=json.dumps(job), capture_output=True, text=True, check=True)
    reference_nll = sum(json.loads(done.stdout))
    reference_ppl = math.exp(reference_nll / run_["scored_tokens"])
    # Trained on Python sources, scored on English prose: far below the uniform 8192 of random
    # weights, far above what scoring the top token instead of the actual one would give.
    assert 50 < run_["ppl"] < 4096
    assert abs(run_["ppl"] / reference_ppl - 1) < 0.001, (run_["ppl"], reference_ppl)


@pytest.mark.real_vllm
def test_text_longer_than_the_context_is_scored_in_windows(trained_vllm, capsys, tmp_path):
    long_text = tmp_path / "long.txt"
    long_text.write_text((SAMPLE + "\n") * 6, encoding="utf-8")
    code, run_, err = run(capsys, "--url", trained_vllm.url, "--text", str(long_text), *REAL_TIMEOUT)
    assert code == 0, run_["stopped"] if run_ else err
    assert run_["tokens"] > 4096 and len(run_["windows"]) > 1
    assert run_["window"] == 2048 and run_["scored_tokens"] == run_["tokens"] - 1
    assert f"the text is {run_['tokens']:,} tokens, longer than one window of 2,048: scoring" in err


def test_a_crash_mid_run_keeps_what_was_scored(capsys):
    with fake_ppl_server(fail_after=3) as url:
        code, run_, err = run(capsys, "--url", url, "--window", "400", "--stride", "100")
    assert code == 3 and len(run_["windows"]) == 3 and run_["bits_per_byte"] is None
    assert run_["stopped"].startswith("server error: POST /v1/completions answered HTTP 500")
    assert run_["scored_tokens"] == sum(w["scored"] for w in run_["windows"]) == 399 + 2 * 100
    with pytest.raises(UsageError, match="a partial run cannot be compared"):
        perplexity.compare(run_, run_, perplexity.gate("fp8", None, None), 64)


def test_a_server_that_is_not_deterministic_is_flagged(capsys):
    with fake_ppl_server(drift=True) as url:
        code = ppl.main(["--url", url, "--window", "400"])
    out = capsys.readouterr().out
    assert code == 0
    assert "warning: re-scoring the first window moved it by" in out and "--no-enable-prefix-caching" in out
