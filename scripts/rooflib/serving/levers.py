"""From a diagnosis to one profile change: which lever of the plan `tune` may try, as which profile
key, and whether the vram model says the changed profile starts at all.

The diagnosis (engine_metrics' report, "diagnosis") names each lever by the engine flag it sets:
{"setting": "--max-num-seqs", "current": 1, "current_source": "inferred", "proposed": 8, "text": ...}.
tune tries the first lever whose flag a serving profile sets (profiles.render_vllm/render_sglang
turn the keys back into those flags) and that changes only how the engine schedules and sizes its
memory. Levers that change the model's numbers (KV or weight precision) or the hardware (more
GPUs) are proposals for the user: tune says so and does not run them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rooflib.core.errors import UsageError
from rooflib.server.deployment import EXPORTED, Known, Served
from rooflib.serving import profiles
from rooflib.sizing import estimate

# Engine flag as the diagnosis names it -> the profile key that sets it (profiles.render_vllm and
# render_sglang: SGLang's --max-running-requests is max_num_seqs, --chunked-prefill-size is
# max_num_batched_tokens, --mem-fraction-static is gpu_memory_utilization, --context-length is
# max_model_len, its radix cache is the prefix cache).
TUNABLE = {
    "vllm": {"--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens",
             "--gpu-memory-utilization": "gpu_memory_utilization", "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
             "--max-model-len": "max_model_len", "--enable-prefix-caching": "enable_prefix_caching"},
    "sglang": {"--max-running-requests": "max_num_seqs", "--chunked-prefill-size": "max_num_batched_tokens",
               "--mem-fraction-static": "gpu_memory_utilization", "--context-length": "max_model_len",
               "--disable-radix-cache": "enable_prefix_caching"},
}
ACCURACY = "changes the model's numbers: check accuracy first with task infer:accept, then bench it"
HARDWARE = "needs more GPUs than the profile runs on: tune does not add hardware"
LEFT_TO_THE_USER = {"--kv-cache-dtype": ACCURACY, "--quantization": ACCURACY, "--speculative-config": ACCURACY,
                    "--speculative-algorithm": ACCURACY, "--tensor-parallel-size": HARDWARE, "--tp-size": HARDWARE,
                    "--data-parallel-size": HARDWARE, "--dp-size": HARDWARE}
# Settings with a range of values, searched (bracket and bisect), not tried once.
RANGES = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_bytes",
          "max_model_len")


# Profile key -> the diagnosis's name of the setting (rooflib/server/diagnosis.py, settings()).
DIAGNOSIS_NAMES = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                   "enable_prefix_caching": "prefix_caching", "max_model_len": "max_model_len",
                   "gpu_memory_utilization": "gpu_memory_utilization",
                   "kv_cache_memory_bytes": "kv_cache_memory_bytes", "kv_cache_dtype": "cache_dtype",
                   "tensor_parallel_size": "tensor_parallel_size"}


def served_with(profile: Mapping[str, Any], url: str, source: str) -> Served:
    """What an engine started from `profile` runs with, for the diagnosis: each setting the profile
    sets is on the engine's command line, as sure as what a server exports. A setting it leaves out
    is the engine's default: the diagnosis reads it from /metrics or infers it, as for any server."""
    how = f"the engine's command line (profile {source})"
    return Served(url, {name: Known(profile[key], EXPORTED, how) for key, name in DIAGNOSIS_NAMES.items()
                        if profile.get(key) is not None})


@dataclass(frozen=True)
class Change:
    """One profile change: `key` from `current` (None: the engine's default) to `proposed`."""
    key: str
    flag: str
    current: Any
    proposed: Any
    reason: str

    def applied(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        return {**profile, self.key: self.proposed}

    def describe(self) -> str:
        return f"{self.key} {shown(self.key, self.current)} -> {shown(self.key, self.proposed)}"


def shown(key: str, value: Any) -> str:
    if value is None:
        return "(engine default)"
    if key == "kv_cache_memory_bytes":
        return f"{value / (1 << 20):g} MiB"
    return str(value)


@dataclass(frozen=True)
class Choice:
    """The first lever tune can try (None when no lever is left), and why the others before it
    were passed over, one line each."""
    change: Change | None
    passed_over: tuple[str, ...]


def first_change(diagnosis: Mapping[str, Any] | None, profile: Mapping[str, Any], done: Sequence[str]) -> Choice:
    """The plan's first lever that sets a profile key not in `done`, as a Change from the
    profile's own value; levers left to the user, and changes the profile refuses, passed over."""
    engine = profile["engine"]
    passed = []
    for lever in (diagnosis or {}).get("plan") or []:
        flag = lever.get("setting")
        if not flag:
            passed.append(f"{lever['text']} (not a server setting: yours to do)")
            continue
        if flag in LEFT_TO_THE_USER:
            passed.append(f"{lever['text']} (not tried: {LEFT_TO_THE_USER[flag]})")
            continue
        key = TUNABLE[engine].get(flag)
        if key is None:
            passed.append(f"{lever['text']} (not tried: no profile key sets {flag})")
            continue
        if key in done:
            continue
        proposed = proposed_value(key, lever.get("proposed"))
        if proposed is None:
            passed.append(f"{lever['text']} (not tried: the diagnosis gives no value to try)")
            continue
        current = profile.get(key, lever.get("current"))
        change = Change(key, flag, current, proposed, lever["text"])
        try:
            profiles.validate(change.applied(profile))
        except UsageError as exc:
            passed.append(f"{lever['text']} (not tried: the profile refuses it: {exc})")
            continue
        return Choice(change, tuple(passed))
    return Choice(None, tuple(passed))


def proposed_value(key: str, proposed: Any) -> Any:
    """The profile value of a lever's proposal. Prefix caching: vLLM's lever proposes True,
    SGLang's "drop the flag" (--disable-radix-cache), which is the profile's True too."""
    if key == "enable_prefix_caching":
        return proposed is not None and proposed is not False
    if isinstance(proposed, (int, float)) and not isinstance(proposed, bool):
        return proposed
    return None


# ---------------------------------------------------------------------------------------------
# Will it start? The vram model (sizing/estimate.py) on the changed profile.

GIB = 1 << 30


@dataclass(frozen=True)
class Sizing:
    """What the vram model needs beside a profile: the model's config and the GPU (None on the
    CPU build, where the profile fixes the KV space)."""
    model: estimate.Model
    gpu: Mapping[str, Any] | None


@dataclass(frozen=True)
class StartCheck:
    """The vram model's word on a profile: fits True/False, None when it cannot tell (no GPU
    named and no fixed KV space); `marginal` when its verdict flips inside its own error."""
    fits: bool | None
    marginal: bool
    text: str


def kv_space_bytes(profile: Mapping[str, Any]) -> int | None:
    """The KV space a profile fixes: VLLM_CPU_KVCACHE_SPACE (whole GiB, the CPU build: it replaces
    --kv-cache-memory-bytes there, CpuPlatform.check_and_update_config in vllm/platforms/cpu.py,
    vLLM 0.32), else kv_cache_memory_bytes."""
    space = (profile.get("env") or {}).get("VLLM_CPU_KVCACHE_SPACE")
    if space not in (None, ""):
        try:
            return int(space) * GIB
        except ValueError:
            raise UsageError(f"profile env VLLM_CPU_KVCACHE_SPACE must be whole GiB (vLLM reads it with int()), "
                             f"got {space!r}")
    return profile.get("kv_cache_memory_bytes")


def start_check(profile: Mapping[str, Any], sizing: Sizing | None) -> StartCheck:
    fixed = kv_space_bytes(profile)
    if sizing is None or (sizing.gpu is None and fixed is None):
        return StartCheck(None, False, "not checked: name the GPU (--gpu) for the vram model")
    inputs = estimate.Inputs(
        model=sizing.model, gpu=dict(sizing.gpu or {"id": "cpu", "name": "CPU", "memory_gib": 0}),
        tp=profile.get("tensor_parallel_size", 1), pp=profile.get("pipeline_parallel_size", 1),
        ctx=profile.get("max_model_len"), kv_dtype=profile.get("kv_cache_dtype", "auto"),
        quant=profile.get("quantization", "auto"), gpu_util=profile.get("gpu_memory_utilization"),
        engine=profile["engine"], max_num_seqs=profile.get("max_num_seqs"),
        max_num_batched_tokens=profile.get("max_num_batched_tokens"),
        kv_cache_bytes=fixed if sizing.gpu is None or "kv_cache_memory_bytes" in profile else None,
        platform="cpu" if sizing.gpu is None else "gpu", enforce_eager=bool(profile.get("enforce_eager")))
    try:
        r = estimate.estimate(inputs)
    except UsageError as exc:
        return StartCheck(False, False, f"the vram model refuses it: {exc}")
    text = (f"{r['kv_cache_tokens']:,} KV tokens, {r['max_concurrency']:.2f} requests of {r['ctx']:,} tokens at once"
            + (f" (marginal: {r['marginal_reason']})" if r["marginal"] else ""))
    return StartCheck(r["fits"], r["marginal"], text)
