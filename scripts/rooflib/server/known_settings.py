"""What the diagnosis (diagnosis.py) reads beside the figures: the rules of thumb and the engines'
flags its findings and levers use; numbers for people (milliseconds, percentages, histogram
quantiles as the bucket they are known to lie in), here for engine_metrics' report and the findings
to agree; and each setting a finding or lever names as a deployment.Known, exported by the server,
inferred from the metrics (the evidence is said), or unknown.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from rooflib.server.deployment import EXPORTED, INFERRED, UNKNOWN, Known, Served
from rooflib.server.reading import Latency, Reading

# Rules of thumb the findings use (the skill's diagnosis table; change them together).
QUEUE_SHARE = 0.2           # requests spend a fifth or more of their time waiting for a slot
KV_FULL = 0.9               # KV usage at which vLLM/SGLang start to hold requests back
KV_ROOM = 0.5               # KV usage below which the cache has room for a waiting request
PREFIX_LOW = 0.2            # prefix-cache hit rate below which long prompts are mostly recomputed
PREFIX_LONG_PROMPT = 512    # mean prompt tokens from which recomputing a shared prefix costs real prefill
STALL_RATIO = 4             # an ITL p99 this many times the mean gap: tokens wait behind prefills
LARGE_BATCH = 64            # running requests from which a smaller batch is a decode lever
FREE_SLOTS = 2              # slots of an exported cap never taken while requests waited: the cap did not hold
                            # them (a gauge may read the cap less the one request that just finished)
HAIR = 0.05                 # a mean of requests this little above a whole number is that number (a floor, never over the cap)
KV_HEADROOM = 0.95          # the largest --gpu-memory-utilization a lever proposes
KV_STEP = 0.03              # how far one lever raises it
LIGHT_C, LIGHT_N = 2, 16    # a verify bench on a live server: light beside the users' traffic

# vLLM's own defaults for --max-num-seqs, smallest first (vllm/engine/arg_utils.py,
# _set_default_max_num_seqs_and_batched_tokens_args: 128 per GPU on CPU-class platforms, 256 or
# 1024 on GPUs by memory). No metric exports the value a server runs with.
VLLM_DEFAULT_MAX_NUM_SEQS = (128, 256, 1024)

# Engine flags the findings and levers name (vLLM / SGLang, as serve.py renders the profile keys).
FLAGS = {
    "vllm": {"seqs": "--max-num-seqs", "batched": "--max-num-batched-tokens", "tp": "--tensor-parallel-size",
             "dp": "--data-parallel-size", "spec": "--speculative-config", "prefix": "--enable-prefix-caching",
             "util": "--gpu-memory-utilization", "kv_bytes": "--kv-cache-memory-bytes", "kv_dtype": "--kv-cache-dtype",
             "quant": "--quantization"},
    "sglang": {"seqs": "--max-running-requests", "batched": "--chunked-prefill-size", "tp": "--tp-size",
               "dp": "--dp-size", "spec": "--speculative-algorithm", "prefix": "--disable-radix-cache",
               "util": "--mem-fraction-static", "kv_bytes": "--max-total-tokens", "kv_dtype": "--kv-cache-dtype",
               "quant": "--quantization"},
}
# The setting that fixes the KV cache's size outright (FLAGS' kv_bytes): vLLM's --kv-cache-memory-bytes,
# SGLang's --max-total-tokens, a cap in tokens on what --mem-fraction-static leaves
# (_apply_token_constraints in python/sglang/srt/mem_cache/kv_cache_configurator.py, SGLang 0.5.23).
EXPLICIT_KV = {"vllm": "kv_cache_memory_bytes", "sglang": "max_total_tokens"}
# The FP8 KV-cache dtype each engine names (vLLM --kv-cache-dtype fp8; SGLang fp8_e4m3).
FP8_KV = {"vllm": "fp8", "sglang": "fp8_e4m3"}

# Which finding is the root when several have no cause above them: the one whose chain holds
# the most of the user's time first (a queue before slow prefills before slow tokens; prompts split
# over engine steps, a measured cause, before a low hit rate whose gain the prompts decide).
RANK = ("outside_engine", "kv_cache", "running_limit", "queue", "prefix_cache_off", "prefill", "prefix_unstable",
        "decode")


# ---------------------------------------------------------------------------------------------
# Numbers for people

def ms(value: float | None, bound: str = "") -> str:
    """Milliseconds for people; `bound` ">=" or "<=" marks a quantile that is only a floor or ceiling."""
    if value is None:
        return "n/a"
    return f"{bound}{value / 1000:.3g} s" if value >= 1000 else f"{bound}{value:.3g} ms"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _span(low: float, high: float) -> str:
    """A bucket's bounds in one unit, to 3 digits: `20-40 ms`, `10-20 s`, `6.89-11.2 ms` (SGLang's
    per-stage histogram has exponential bounds such as 6.88748 ms)."""
    if high >= 1000:
        return f"{low / 1000:.3g}-{high / 1000:.3g} s"
    return f"{low:.3g}-{high:.3g} ms"


def quantile_text(row: Latency, name: str) -> str:
    """A quantile for people: the bucket it lies in, as that is all a classic histogram knows
    (histogram_quantile's interpolation inside it is an assumption); only the upper bound in the
    first bucket, only the lower in the +Inf one; the value itself where no bucket is known
    (Prometheus computed it)."""
    if name in row.at_most:
        return ms(row.at_most[name], "<=")
    if name in row.at_least:
        return ms(row.quantile(name), ">=")
    bucket = row.bucket_ms.get(name)
    if bucket and row.quantile(name) is not None:
        return _span(*bucket)
    return ms(row.quantile(name))


def over_target(row: Latency, name: str, target: float | None) -> bool:
    """The quantile is above the target (its interpolated value; a ceiling at or below the
    target is not above it)."""
    value = row.quantile(name)
    return bool(target) and value is not None and value > target


def above_target(row: Latency, name: str, target: float, label: str) -> str:
    """`TTFT p95 2.5-5 s > target 2 s`; where the bucket holds the target too, the interpolated
    value that puts the quantile above it is said."""
    text = f"{label} {name} {quantile_text(row, name)}"
    bucket = row.bucket_ms.get(name)
    if bucket and bucket[0] < target:
        text += f" (about {ms(row.quantile(name))} by interpolation)"
    return f"{text} > {label} target {ms(target)}"


def tokens_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def bytes_text(value: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value:g} B"


def value_text(setting: str, value: Any) -> str:
    if value is None:
        return "unknown"
    if setting == "kv_cache_memory_bytes":
        return bytes_text(value)
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else f"{value}"


# ---------------------------------------------------------------------------------------------
# The deployment's settings: exported, inferred or unknown

def settings(r: Reading, served: Served | None = None) -> dict[str, Known]:
    """Each setting the findings and levers name, from what the server exports (its own answers
    win over the scrape's labels), else inferred from the report's figures, else unknown."""
    dep = r.cache_config
    found: dict[str, Known] = {}
    # setting -> (its vllm:cache_config_info label, the value deployment_config read there)
    scraped = {"block_size": ("block_size", dep.block_size),
               "gpu_memory_utilization": ("gpu_memory_utilization", dep.gpu_memory_utilization),
               "kv_cache_memory_bytes": ("kv_cache_memory_bytes", dep.kv_cache_memory_bytes),
               "cache_dtype": ("cache_dtype", dep.kv_cache_dtype),
               "prefix_caching": ("enable_prefix_caching", dep.prefix_caching)}
    for name, (label, value) in scraped.items():
        if value is not None:
            found[name] = Known(value, EXPORTED, f"vllm:cache_config_info {label}")
    if dep.max_model_len:
        found["max_model_len"] = Known(dep.max_model_len, EXPORTED, "vllm:cache_config_info kv_cache_size_tokens "
                                                                         "/ kv_cache_max_concurrency")
    if r.kv_cache_tokens:
        found["kv_cache_tokens"] = Known(r.kv_cache_tokens, EXPORTED, "vllm:cache_config_info kv_cache_size_tokens"
                                         if r.engine == "vllm" else "sglang:max_total_num_tokens")
    found.update(served.settings if served else {})
    active = found.get("max_num_active_seqs")
    if active and "max_num_seqs" in found and active.value < found["max_num_seqs"].value:
        # vLLM 0.32 admits at most this many into RUNNING; engine_flags then names its flag.
        found["max_num_seqs"] = active
    for name, infer in (("max_num_seqs", _infer_max_num_seqs), ("max_num_batched_tokens", _infer_batched),
                        ("prefix_caching", _infer_prefix_caching)):
        if name not in found:
            found[name] = infer(r)
    return found


def engine_flags(r: Reading, s: Mapping[str, Known]) -> Mapping[str, str]:
    """The engine's FLAGS; the running cap's is --max-num-active-seqs where the server set that
    below --max-num-seqs (vLLM 0.32: it gates admission into RUNNING, max_num_seqs only sizes the
    model runner; vllm/config/scheduler.py)."""
    active = s.get("max_num_active_seqs")
    return {**FLAGS[r.engine], "seqs": "--max-num-active-seqs"} if active and s["max_num_seqs"] is active \
        else FLAGS[r.engine]


def _kv_room(r: Reading) -> bool:
    """The KV cache had room while requests waited: no preemption, usage below KV_FULL, and (over
    a window) the requests that ran at a time held less than half of it."""
    if r.preemptions or (r.kv_cache_usage_max or 0) >= KV_FULL:
        return False
    held = held_tokens(r)
    return held is None or not r.kv_cache_tokens or held < r.kv_cache_tokens / 2


def held_tokens(r: Reading) -> float | None:
    """KV tokens the running requests held on average over a window (Little's law)."""
    if r.mode != "window" or not r.running_mean or not r.tokens_per_request:
        return None
    return r.running_mean * r.tokens_per_request


def _infer_max_num_seqs(r: Reading) -> Known:
    """A floor under the cap on running requests, when requests waited while the KV cache had
    room. No figure counts more requests running at once than the cap, and none is sure to count
    the cap itself: vLLM publishes its gauges after a step's finished requests left and before the
    next step admits others (vllm/v1/core/sched/scheduler.py, make_stats at the end of
    update_from_output), so a sample that falls in a long prefill step reads the cap less the
    requests that just finished; and a step spent prefilling lowers the requests per step."""
    waited = r.running_while_waiting or (r.mode == "window" and ((r.waiting_mean or 0) >= 1 or _queued(r)))
    floors = _running_floors(r) if waited and _kv_room(r) else []
    if floors:
        value, how = max(floors, key=lambda floor: floor[0])
        return Known(value, INFERRED, how, at_least=True)
    if r.running_peak:
        # No request waited for a slot (or the KV cache held them): every count of requests
        # running at once is still a floor under the cap.
        return Known(int(r.running_peak), INFERRED, (
            f"{r.running_peak:g} requests ran at once at the busiest of {r.gauge_samples} gauge samples, none "
            "held back by the cap"), at_least=True)
    if r.engine == "vllm":
        return Known(None, UNKNOWN, "no metric exports it (vLLM's /server_info does with VLLM_SERVER_DEV_MODE=1); "
                                    "vLLM defaults: " + "/".join(map(str, VLLM_DEFAULT_MAX_NUM_SEQS)) + " by platform")
    return Known(None, UNKNOWN, "no metric exports it; SGLang's /get_server_info does (read with --url on a "
                                "live server)")


def queue_share(r: Reading) -> float | None:
    """The share of the finished requests' e2e they spent queued (the histograms' means)."""
    return r.queue_ms.mean / r.e2e_ms.mean if r.queue_ms.mean is not None and r.e2e_ms.mean else None


def _queued(r: Reading) -> bool:
    """Requests spent QUEUE_SHARE or more of their time waiting (the queue histogram): they
    waited, though on average fewer than one at a time where the window also holds idle time."""
    return (queue_share(r) or 0.0) >= QUEUE_SHARE


def _running_floors(r: Reading) -> list[tuple[int, str]]:
    """(floor, evidence) of each figure that counts requests running at once: the busiest gauge
    sample, and the requests per engine step (one token each); Little's law over the window when
    neither is there (a request that started before the window adds all its time to the window's
    sums: a mean a hair above a whole number is that number)."""
    floors = []
    if r.running_peak:
        floors.append((int(r.running_peak), (
            f"{r.running_peak:g} running at the busiest of {r.gauge_samples} gauge samples, KV usage at most "
            f"{pct(r.kv_cache_usage_max)}; a sample misses the requests admitted in the step it falls in")))
    per_step = r.requests_per_step
    if per_step:
        # At most one token a request a step, yet a fresh-clone run of --max-num-seqs 2 read 2.00
        # (a hair above 2) over a window under load: rounded up whole, that was "at least 3".
        floors.append((math.ceil(per_step - HAIR), (
            f"{per_step:.2f} requests per engine step on average, one generated token each by "
            "vllm:generation_tokens_total over the steps of vllm:iteration_tokens_total; a step that only prefilled "
            "lowers it")))
    if not floors and r.mode == "window" and r.running_mean and r.waiting_mean:
        floors.append((math.ceil(r.running_mean - HAIR), (
            f"{r.running_mean:.1f} requests ran at a time on average while {r.waiting_mean:.1f} waited "
            "(Little's law over the window)")))
    return floors


def _infer_batched(r: Reading) -> Known:
    """vLLM's per-step token budget is in no metric, and no figure shows it: vLLM 0.32 counts a
    prompt's computed tokens in vllm:iteration_tokens_total all at once, in the step that finishes
    its prefill (IterationStats.update_from_output, vllm/v1/metrics/stats.py), so the largest
    "step" there is a prompt (less its cache hits), not the budget it was split by."""
    return Known(None, UNKNOWN, "no metric exports it (vLLM's /server_info does with VLLM_SERVER_DEV_MODE=1; "
                                "vllm:iteration_tokens_total counts a chunked prompt in the step that finishes it)")


def _infer_prefix_caching(r: Reading) -> Known:
    if r.prefix_cache_hit_rate:
        return Known(True, INFERRED,
                     f"prompts hit the prefix cache ({pct(r.prefix_cache_hit_rate)} of prompt tokens)")
    return Known(None, UNKNOWN, "not exported" + (" (SGLang's radix cache is on unless --disable-radix-cache)"
                                                  if r.engine == "sglang" else ""))


def current_text(known: Known | None, name: str = "") -> str:
    """A setting's value for people: `2`, `at least 2` (a floor), `unknown`."""
    value = value_text(name, known.value if known else None)
    return f"at least {value}" if known and known.at_least else value


def said(known: Known, name: str = "") -> str:
    """`at least 2 (inferred: 1.87 requests ...)`: a setting with where it came from;
    `unknown (not exported)`."""
    if known.value is None:
        return f"unknown ({known.how})"
    return f"{current_text(known, name)} ({known.source}: {known.how})"
