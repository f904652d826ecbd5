"""accept.py: the verdict and its reasons from fakes (a correct deployment and a damaged one), the
log entry's headed format, bad input, and one real run: a URL base against a profile candidate."""
from __future__ import annotations

import json
import math
from contextlib import contextmanager

import accept
import fake_ppl_server
import fake_toolcall_server
import pytest
from fake_http import serving

from rooflib.quality import acceptance


@contextmanager
def deployment(*faults: str, nats: float = 0.0, root: str | None = None):
    """A fake vLLM that both calls tools and scores text; `nats` raises every token's NLL;
    `root` is the /v1/models root (what vLLM loaded: a Hugging Face id or a path)."""
    tools = fake_toolcall_server.handler(set(faults))
    scorer = fake_ppl_server.handler("vllm", 4096, False, False, lambda position: -nats, [])

    def handle(method, path, body):
        status, payload = tools(method, path, body)
        if path == "/v1/models" and root:
            payload = {**payload, "data": [{**payload["data"][0], "root": root}]}
        return (status, payload) if status != 404 else scorer(method, path, body)

    with serving(handle) as url:
        yield url


def run(capsys, *args):
    code = accept.main([*args, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out else None), out.err


FAST = ["--skip-bench", "--repeat", "1", "--window", "400"]


def test_damaged_candidate_fails_with_every_reason_and_logs_an_entry(capsys, tmp_path):
    log = tmp_path / "bench-log.md"
    log.write_text("## an earlier entry\n")
    with deployment() as base, deployment("string_integer", nats=0.03) as candidate:
        code, result, _ = run(capsys, "--base", base, "--candidate", candidate, "--log", str(log), *FAST)
    assert code == 1 and result["verdict"] == "FAIL"
    assert math.isclose(result["ppl_change"]["change_pct"], (math.exp(0.03) - 1) * 100)
    assert result["reasons"][0].startswith("perplexity +3.05% (95% CI up to +3.05%): above the FP8")
    assert result["reasons"][0].endswith("fail level +2.0%")
    assert result["reasons"][1] == "tool-call smoke regressions (pass on base, fail on candidate): complex_schema"
    entry = log.read_text()
    assert entry.startswith("## an earlier entry\n\n## ")
    headings = [line for line in entry.splitlines() if line.startswith("#")]
    assert headings[1].endswith("· fake-toolcaller -> fake-toolcaller · accept · FAIL")
    assert headings[2:] == ["### Date", "### Server", "### Config", "### Results", "### Verdict", "### Notes"]
    assert "| perplexity | " in entry and "| +3.05% (95% CI +3.05% .. +3.05%) |" in entry
    assert "| tool-call smoke | PASS (10/10 cases) | FAIL (9/10 cases) | - |" in entry
    assert result["log_entry"] == entry.split("\n\n", 1)[1]


def test_identical_deployments_pass(capsys):
    with deployment() as base, deployment() as candidate:
        code, result, _ = run(capsys, "--base", base, "--candidate", candidate, *FAST)
    assert (code, result["verdict"], result["reasons"]) == (0, "PASS", [])
    assert result["ppl_change"]["change_pct"] == 0.0 and result["ppl_change"]["ci95_pct"] == [0.0, 0.0]
    assert result["candidate"]["ppl"]["window"] == result["base"]["ppl"]["window"] == 400


def test_a_small_rise_under_a_4bit_scheme_passes_and_under_fp8_warns(capsys):
    with deployment() as base, deployment(nats=0.015) as candidate:
        _, fp8, _ = run(capsys, "--base", base, "--candidate", candidate, *FAST)
        code, four_bit, _ = run(capsys, "--base", base, "--candidate", candidate, "--scheme", "4bit", *FAST)
    assert fp8["verdict"] == "WARN" and fp8["reasons"][0].endswith("above the FP8 (W8A8-FP8, FP8-dynamic) warn level +1.0%")
    assert (code, four_bit["verdict"]) == (0, "PASS")


def test_candidate_without_tool_calling_fails_on_configuration(capsys):
    with deployment() as base, deployment("no_tool_parser") as candidate:
        code, result, _ = run(capsys, "--base", base, "--candidate", candidate, *FAST)
    assert code == 1
    assert result["reasons"] == [
        "candidate smoke could not run: the server does not have tool calling enabled (HTTP 400: \"auto\" tool "
        "choice requires --enable-auto-tool-choice and --tool-call-parser to be set): " + acceptance.toolcalls.CONFIG_HINT]


def test_judge_names_model_limitations_and_a_slower_candidate():
    base = {"role": "base", "smoke": {"cases": [{"case": "parallel", "status": "FAIL"}], "verdict": "FAIL"},
            "bench": {"throughput": {"output_tok_s": 100.0}}}
    cand = {"role": "candidate", "smoke": {"cases": [{"case": "parallel", "status": "FAIL"}], "verdict": "FAIL",
                                           "reasons": []},
            "bench": {"throughput": {"output_tok_s": 90.0}}}
    levels = {"name": "FP8", "warn_pct": 1.0, "fail_pct": 2.0}
    ppl_ok = {"change_pct": 0.1, "ci95_pct": [0.0, 0.2], "verdict": "PASS", "levels": levels}
    verdict, reasons, _ = acceptance.judge(base, cand, ppl_ok, interrupted=False)
    assert verdict == "FAIL"
    assert reasons == ["tool-call smoke fails on both (model limitation, not quantization damage): parallel",
                       "the candidate is slower: output tok/s -10.0%"]
    verdict, reasons, _ = acceptance.judge({**base, "smoke": None}, {**cand, "smoke": None}, ppl_ok, interrupted=True)
    assert verdict == "FAIL" and reasons == ["interrupted: partial results", "the candidate is slower: output tok/s -10.0%"]


@pytest.mark.parametrize("args, message", [
    ([], "error: BASE and CANDIDATE not given: pass BASE=<url|profile> CANDIDATE=<url|profile>"),
    (["--base", "http://127.0.0.1:9"], "error: CANDIDATE not given"),
    (["--base", "x", "--candidate", "y", "--text", "/nonexistent.txt"], "error: cannot read TEXT /nonexistent.txt"),
    (["--base", "x", "--candidate", "y", "--scheme", "fp3"], "error: unknown quantization scheme 'fp3'"),
])
def test_usage_errors_are_one_line_exit_2(capsys, monkeypatch, args, message):
    monkeypatch.delenv("BASE", raising=False)
    monkeypatch.delenv("CANDIDATE", raising=False)
    code, _, err = run(capsys, *args)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.real_vllm
def test_real_vllm_url_base_against_a_profile_candidate(vllm_server, capsys, tmp_path):
    log = tmp_path / "log.md"
    code, result, _ = run(capsys, "--base", vllm_server.url, "--candidate", "cpu-tiny", "--repeat", "1",
                          "--max-tokens", "32", "--window", "512", "--bench-n", "4", "--bench-c", "2",
                          "--bench-in", "64", "--bench-out", "16", "--log", str(log))
    # The same random-weight model on both sides: no perplexity change, smoke failing on both.
    assert code == 1 and result["verdict"] == "FAIL"
    assert abs(result["ppl_change"]["change_pct"]) < 0.05
    assert result["base"]["ppl"]["token_ids_sha256"] == result["candidate"]["ppl"]["token_ids_sha256"]
    assert any(r.startswith("tool-call smoke fails on both (model limitation, not quantization damage): single_auto")
               for r in result["reasons"]), result["reasons"]
    for side in ("base", "candidate"):
        assert result[side]["bench"]["throughput"]["output_tok_s"] > 0, result[side]["bench_error"]
    assert result["candidate"]["source"] == "cpu-tiny" and result["candidate"]["url"].startswith("http://127.0.0.1:")
    assert "| output tok/s |" in log.read_text() and "· tiny-qwen3 -> tiny-qwen3 · accept · FAIL" in log.read_text()


def test_an_unreachable_candidate_still_reports_the_base(capsys):
    with deployment() as base:
        code, result, _ = run(capsys, "--base", base, "--candidate", "http://127.0.0.1:9", *FAST)
    assert code == 3 and result["verdict"] == "FAIL"
    assert result["reasons"][0].startswith("server failed: candidate (http://127.0.0.1:9): cannot reach http://127.0.0.1:9/v1/models")
    assert result["base"]["ppl"]["ppl"] > 1 and result["base"]["smoke"]["verdict"] == "PASS"
    assert "| perplexity | 152.8680 | - | - |" in result["log_entry"]


# quantization_config as AutoAWQ writes it (Qwen/Qwen2.5-7B-Instruct-AWQ's config.json)
AWQ_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "torch_dtype": "float16",
              "quantization_config": {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                                      "quant_method": "awq", "version": "gemm", "zero_point": True}}


def test_an_awq_candidate_is_judged_by_the_4bit_levels_its_config_declares(capsys, tmp_path):
    folder = tmp_path / "Qwen2.5-7B-Instruct-AWQ"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(AWQ_CONFIG))
    with deployment() as base, deployment(nats=0.015, root=str(folder)) as candidate:
        code, result, err = run(capsys, "--base", base, "--candidate", candidate, *FAST)
    # +1.5%: a warning under FP8's levels, a pass under 4-bit's (3%/5%)
    assert (code, result["verdict"]) == (0, "PASS")
    assert result["scheme"] == {"scheme": "4bit", "inferred": True,
                                "why": f"its config.json ({folder / 'config.json'}) declares awq weights (int4)"}
    assert result["notes"][0].startswith("perplexity levels: 4-bit") and ": inferred, its config.json" in result["notes"][0]
    assert "accept: 4-bit" in err


def test_an_unreadable_server_path_falls_back_to_fp8_and_says_why(capsys):
    with deployment() as base, deployment(nats=0.015, root="/models/served-on-the-server") as candidate:
        _, result, _ = run(capsys, "--base", base, "--candidate", candidate, *FAST)
    assert result["verdict"] == "WARN" and result["scheme"]["scheme"] == "fp8"
    assert "a path on the server that this machine cannot read" in result["scheme"]["why"]
    assert "pass --scheme 4bit for an AWQ/GPTQ candidate" in result["scheme"]["why"]
    with deployment() as base, deployment(nats=0.015, root="/models/Qwen3-32B-AWQ") as candidate:
        _, named, _ = run(capsys, "--base", base, "--candidate", candidate, *FAST)
    assert named["scheme"]["scheme"] == "4bit" and "its name" in named["scheme"]["why"]


def test_scheme_given_overrides_the_inference(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(AWQ_CONFIG))
    with deployment() as base, deployment(nats=0.015, root=str(tmp_path)) as candidate:
        _, result, _ = run(capsys, "--base", base, "--candidate", candidate, "--scheme", "fp8", *FAST)
    assert result["verdict"] == "WARN" and result["scheme"] == {"scheme": "fp8", "inferred": False, "why": "given (--scheme)"}


def test_the_users_own_tool_call_cases_are_a_step_of_acceptance(capsys, tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "weather.yaml").write_text("""cases:
  my_dallas_weather:
    description: our agent's weather question
    tools: [get_current_weather]
    tool_choice: auto
    messages:
      - {role: user, content: "What is the weather in Dallas, Texas in Fahrenheit?"}
    expect:
      calls: [{name: get_current_weather, args: {city: [Dallas], unit: [fahrenheit]}}]
""")
    with deployment() as base, deployment() as candidate:
        code, result, _ = run(capsys, "--base", base, "--candidate", candidate, "--cases-dir", str(cases), *FAST)
    assert code == 0 and result["config"]["user_cases"] == ["my_dallas_weather"]
    mine = [c for c in result["candidate"]["smoke"]["cases"] if c["case"] == "my_dallas_weather"]
    assert mine and mine[0]["status"] == "PASS"
    assert any(note.startswith(f"your tool-call cases from {cases}: my_dallas_weather") for note in result["notes"])
    (cases / "broken.yaml").write_text("cases:\n  no_expect: {description: x, tools: [get_current_weather], "
                                       "tool_choice: auto, messages: []}\n")
    code, _, err = run(capsys, "--base", "http://127.0.0.1:9", "--candidate", "http://127.0.0.1:9",
                        "--cases-dir", str(cases))
    assert code == 2 and "case 'no_expect' lacks expect" in err and err.count("\n") == 1
