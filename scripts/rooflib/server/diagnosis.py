"""The diagnosis of an engine's metrics report (engine_metrics.report, read as a typed
reading.Reading): one root cause, what it causes, one plan of levers checked against the
deployment, and the commands that verify it.

Causes and what they cause, as the findings chain them (`caused_by`):
  outside_engine    time spent outside the engine (proxy, network): TTFT and e2e gaps the engine
                    does not see (a client-against-server check names it; /metrics alone cannot)
  kv_cache          the KV cache is too small for the load -> preemptions -> queue -> TTFT;
                    a low prefix-cache hit rate (prefix_evicted); recomputation stalls tokens (decode)
  running_limit     the cap on running requests holds them while the KV cache has room -> queue -> TTFT
  prefix_cache_off  prefix caching is off on long prompts -> prefill -> TTFT, token stalls (decode)
  prefix_unstable   caching is on and long prompts hit nothing: their start varies (client side)
  prefill           long prefills -> TTFT; tokens stall behind them -> ITL/TPOT (decode)
  queue             requests wait for a slot (a root only when no limit can be named yet)
  decode            tokens slower than the target: big batches, or memory-bound decode

Every setting a finding or lever names is a deployment.Known: exported by the server
(vllm:cache_config_info, SGLang's sglang:max_total_num_tokens, context_len and page_size, /v1/models,
vLLM's /server_info, SGLang's /get_server_info), inferred here from the metrics (the evidence is said), or unknown. A lever reads
"setting: current -> proposed (current: exported|inferred|unknown)", gives the reason for the value
and the effect on the user's figures, and is never printed for what is already in place. The
plan holds one lever per setting, the root cause's first, so it never says both "raise" and
"lower" of one setting.

Numbers for people live here too (milliseconds, percentages, histogram quantiles as the bucket
they are known to lie in), for engine_metrics' report and the findings to agree.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Mapping, Sequence

from rooflib.core import taskcall
from rooflib.load.apis import APIS
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


def _over(row: Latency, name: str, target: float | None) -> bool:
    """The quantile is above the target (its interpolated value; a ceiling at or below the
    target is not above it)."""
    value = row.quantile(name)
    return bool(target) and value is not None and value > target


def _above(row: Latency, name: str, target: float, label: str) -> str:
    """`TTFT p95 2.5-5 s > target 2 s`; where the bucket holds the target too, the interpolated
    value that puts the quantile above it is said."""
    text = f"{label} {name} {quantile_text(row, name)}"
    bucket = row.bucket_ms.get(name)
    if bucket and bucket[0] < target:
        text += f" (about {ms(row.quantile(name))} by interpolation)"
    return f"{text} > {label} target {ms(target)}"


def _tokens(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def bytes_text(value: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value:g} B"


def _value(setting: str, value: Any) -> str:
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
        # vLLM 0.32 admits at most this many into RUNNING; _flags then names its flag.
        found["max_num_seqs"] = active
    for name, infer in (("max_num_seqs", _infer_max_num_seqs), ("max_num_batched_tokens", _infer_batched),
                        ("prefix_caching", _infer_prefix_caching)):
        if name not in found:
            found[name] = infer(r)
    return found


def _flags(r: Reading, s: Mapping[str, Known]) -> Mapping[str, str]:
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
    held = _held_tokens(r)
    return held is None or not r.kv_cache_tokens or held < r.kv_cache_tokens / 2


def _held_tokens(r: Reading) -> float | None:
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
    waited = r.running_while_waiting or (r.mode == "window" and (r.waiting_mean or 0) >= 1)
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
        floors.append((math.ceil(per_step), (
            f"{per_step:.2f} requests per engine step on average, one generated token each by "
            "vllm:generation_tokens_total over the steps of vllm:iteration_tokens_total; a step that only prefilled "
            "lowers it")))
    if not floors and r.mode == "window" and r.running_mean and r.waiting_mean:
        floors.append((math.ceil(r.running_mean - 0.05), (
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


def _current(known: Known | None, name: str = "") -> str:
    """A setting's value for people: `2`, `at least 2` (a floor), `unknown`."""
    value = _value(name, known.value if known else None)
    return f"at least {value}" if known and known.at_least else value


def said(known: Known, name: str = "") -> str:
    """`at least 2 (inferred: 1.87 requests ...)`: a setting with where it came from;
    `unknown (not exported)`."""
    if known.value is None:
        return f"unknown ({known.how})"
    return f"{_current(known, name)} ({known.source}: {known.how})"


# ---------------------------------------------------------------------------------------------
# Findings

def _finding(kind: str, evidence: str, confidence: str, caused_by: str | None = None,
             setting: str | None = None, known: Known | None = None) -> dict[str, Any]:
    return {"kind": kind, "evidence": evidence, "confidence": confidence, "caused_by": caused_by,
            "setting": setting, "current": known.value if known else None,
            "current_source": known.source if known else None}


HIGH = "high: histograms and counters of finished requests"


def _limit(r: Reading, s: Mapping[str, Known]) -> tuple[str | None, str, str]:
    """Why requests wait: (kind, evidence, confidence); kind None when these figures cannot tell
    the KV cache from the running-requests cap.

    Evidence that cannot miss the peak comes first: preemptions (a counter), Little's law over a
    window (from the histograms of finished requests), the KV size the deployment exports against
    the mean request. Gauges are samples a busy server may answer only after the load."""
    kv_max, footprint, kv_tokens = r.kv_cache_usage_max, r.tokens_per_request, r.kv_cache_tokens
    fit = kv_tokens / footprint if kv_tokens and footprint else None
    seqs = s["max_num_seqs"]
    if r.preemptions:
        return "kv_cache", f"{r.preemptions:g} preemptions", "high: the preemption counter cannot miss one"
    held = _held_tokens(r)
    if held is not None and kv_tokens:
        little = (f"the {r.running_mean:.1f} requests running on average (Little's law over the window) held "
                  f"about {held:,.0f} of {kv_tokens:,} KV tokens ({footprint:,.0f} per request)")
        if held >= kv_tokens / 2 or (kv_max or 0) >= KV_FULL:
            return "kv_cache", little, "high: histograms of the window and the exported cache size"
        return "running_limit", little, ("high" if seqs.source == EXPORTED else "medium") + \
            ": Little's law over the window" + ("" if seqs.source == EXPORTED else ", the cap inferred")
    if fit is not None and seqs.value and seqs.source == EXPORTED and seqs.value < fit and (kv_max or 0) < KV_FULL:
        return "running_limit", (f"the KV cache holds {fit:.1f} requests of {footprint:,.0f} tokens, more than "
                                 "the cap"), "high: the exported cap and cache size"
    if kv_max is not None and kv_max < KV_ROOM and (r.waiting_peak or 0) > 0:
        return "running_limit", (f"{r.waiting_peak:g} requests waited while the KV cache was at most {pct(kv_max)} "
                                 "full: it had room, so only the cap on running requests can hold them"), \
            "medium: gauge samples, but a cache this empty cannot be what holds them"
    if fit is not None and fit < VLLM_DEFAULT_MAX_NUM_SEQS[0]:
        return "kv_cache", (f"requests waited; unless the running cap (not exported) is below {fit:.0f}, "
                            "the KV cache is the limit"), \
            "medium: the exported cache size and the finished requests' lengths; confirm under load with WINDOW=30"
    if kv_max is not None and kv_max >= KV_FULL:
        return "kv_cache", f"KV usage up to {pct(kv_max)}", f"high: a gauge sample saw it {pct(kv_max)} full"
    if r.mode == "window" and kv_max is not None and (r.running_peak or r.waiting_peak):
        return "running_limit", f"KV usage at most {pct(kv_max)} while requests waited", \
            f"low: {r.gauge_samples} gauge samples can miss the peak; measure with WINDOW=30 under load"
    return None, "", ""


def _kv_finding(r: Reading, s: Mapping[str, Known], evidence: str, confidence: str) -> dict[str, Any]:
    flags, name = FLAGS[r.engine], EXPLICIT_KV[r.engine]
    explicit, size = s.get(name), s.get("kv_cache_tokens")
    if explicit and r.engine == "sglang" and not (size and size.value >= explicit.value):
        explicit = None  # SGLang's cap holds only where the memory left more: the fraction sized it
    setting, name, known = (flags["kv_bytes"], name, explicit) if explicit else \
        (flags["util"], "", s.get("gpu_memory_utilization") or Known(None, UNKNOWN, "not exported"))
    fit = size.value / r.tokens_per_request if size and r.tokens_per_request else None
    holds = ""
    if size:
        holds = f": {size.value:,} KV tokens" + (f", {fit:.1f} requests of {r.tokens_per_request:,.0f} tokens"
                                                 if fit is not None else "")
    usage = f"; KV usage up to {pct(r.kv_cache_usage_max)}" if r.kv_cache_usage_max else ""
    return _finding("kv_cache", f"{setting} is {said(known, name)}{holds}; the KV cache is too small for the load: "
                                f"{evidence}{usage}", confidence, setting=setting, known=known)


def findings(r: Reading, s: Mapping[str, Known]) -> list[dict[str, Any]]:
    """Every finding with its cause, unordered (see `ordered`)."""
    flags, slo = _flags(r, s), r.slo
    queue, e2e, ttft = r.queue_ms, r.e2e_ms, r.ttft_ms
    share = queue.mean / e2e.mean if queue.mean is not None and e2e.mean else None
    queued = (share is not None and share >= QUEUE_SHARE) or (not e2e.n and (r.waiting_peak or 0) > 0)
    found = []
    limit, evidence, confidence = _limit(r, s) if queued or r.preemptions or (r.waiting_peak or 0) > 0 \
        else (None, "", "")
    if limit == "kv_cache":
        found.append(_kv_finding(r, s, evidence, confidence))
    if r.preemptions:
        per_request = f", {r.preemptions / r.requests:.2g} per finished request" if r.requests else ""
        found.append(_finding("preemptions", f"{r.preemptions:g} preemptions{per_request}: requests lost their "
                                             "KV blocks and were computed again", HIGH, "kv_cache"))
    if limit == "running_limit":
        seqs = s["max_num_seqs"]
        cap = (f"{flags['seqs']} is {said(seqs)}" if seqs.value
               else f"{flags['seqs']} (unknown: {seqs.how}) caps the running requests") + (
            " (or --max-num-active-seqs, vLLM 0.32+, where set below it)" if r.engine == "vllm" and
            seqs.source != EXPORTED else "")
        found.append(_finding("running_limit", f"{cap}; requests wait while the KV cache has room: {evidence}",
                              confidence, setting=flags["seqs"], known=seqs))
    if queued:
        found.append(_finding("queue", (
            f"requests wait for a slot: queue mean {ms(queue.mean)} = {pct(share)} of e2e (p95 "
            f"{quantile_text(queue, 'p95')}); TTFT p95 {quantile_text(ttft, 'p95')}" + (
                "" if limit else "; these figures cannot tell the KV cache from the running-requests cap")),
            HIGH if limit else "low: which limit holds the requests is not known", limit))
    found += _prefix_findings(r, s, flags, limit == "kv_cache")
    prefix_root = next((f["kind"] for f in found if f["kind"].startswith("prefix_")), None)
    if not queued and _over(ttft, "p95", slo.ttft_p95_ms):
        steps = _prefill_steps(r, s)
        # Prompts split over several engine steps are a measured cause of their own: it leads a low
        # hit rate whose gain depends on what the prompts share (the cache being off still leads).
        cause = None if steps and prefix_root == "prefix_unstable" else prefix_root
        found.append(_finding("prefill", (
            f"{_above(ttft, 'p95', slo.ttft_p95_ms, 'TTFT')} with little queueing (queue {pct(share)} of e2e)"
            + (f": prefill mean {ms(r.prefill_ms.mean)}" if r.prefill_ms.mean is not None else "")
            + f", prompts of {_tokens(r.prompt_tokens_mean)} tokens on average"
            + (f", {steps} engine steps each under {flags['batched']} {said(s['max_num_batched_tokens'])}"
               if steps else "")), HIGH, cause,
            flags["batched"] if steps else None, s["max_num_batched_tokens"] if steps else None))
    decode = _decode_finding(r, s, flags, next((f["kind"] for f in found if f["kind"] == "prefill"), prefix_root))
    return found + ([decode] if decode else [])


def _prefill_steps(r: Reading, s: Mapping[str, Known]) -> int | None:
    """The engine steps a mean prompt takes when vLLM's per-step token budget splits it (None when
    one step holds it, or the budget is not known)."""
    batched, prompt = s["max_num_batched_tokens"].value, r.prompt_tokens_mean
    if r.engine != "vllm" or not batched or not prompt or prompt <= batched:
        return None
    return math.ceil(prompt / batched)


def _prefix_findings(r: Reading, s: Mapping[str, Known], flags: Mapping[str, str],
                     kv_full: bool) -> list[dict[str, Any]]:
    """Long prompts recomputed: the cache is off, their starts differ (client), or the full KV
    cache (`kv_full`: its finding is made) evicts them."""
    prompt, rate, caching = r.prompt_tokens_mean, r.prefix_cache_hit_rate, s["prefix_caching"]
    if not prompt or prompt < PREFIX_LONG_PROMPT:
        return []
    if caching.value is False:
        known = Known(True, caching.source, caching.how) if r.engine == "sglang" else caching
        return [_finding("prefix_cache_off", (
            f"{flags['prefix']} is {said(known)}: prompts of {prompt:,.0f} tokens on average are computed in full; "
            "whether they share a prefix cannot be seen with the cache off"),
            "medium: the setting is exported; the gain depends on how much of each prompt is shared",
            setting=flags["prefix"], known=known)]
    if rate is None or rate >= PREFIX_LOW:
        return []
    queried = f" of {r.prefix_cache_queries:,.0f} prompt tokens looked up" if r.prefix_cache_queries else ""
    on = f"prefix caching on ({caching.source}: {caching.how})" if caching.value else \
        "prefix caching not known to be off"
    if rate > 0 and kv_full:
        return [_finding("prefix_evicted", (
            f"prefix-cache hit rate {pct(rate)}{queried} with {prompt:,.0f}-token prompts and {on}, while the KV "
            "cache is full: cached prefixes are evicted before the next request can use them"),
            "medium: a full cache evicts; prompts that share little would look the same", "kv_cache")]
    block = s.get("block_size")
    unit = f"its first {block.value}-token block" if block and block.value else "its first block"
    return [_finding("prefix_unstable", (
        f"prefix-cache hit rate {pct(rate)}{queried} with {prompt:,.0f}-token prompts and {on}: "
        + (f"no prompt shares even {unit} with an earlier one, so their start varies (client side: a "
           "timestamp, request id or user name before the shared instructions); the cache matches whole "
           "blocks from token 0" if rate == 0 else
           "prompts share little from token 0: the shared part is short, or something early in it varies")),
        "medium: a shared system prompt that starts each prompt would hit; the client's prompts decide",
        known=caching if caching.value else None)]


def _decode_finding(r: Reading, s: Mapping[str, Known], flags: Mapping[str, str],
                    prefill_cause: str | None) -> dict[str, Any] | None:
    """Tokens slower than the targets: TPOT p95 against the TPOT target, ITL p95 against the ITL
    target. Gaps far longer than the mean while long prompts are prefilled are stalls behind
    prefills (their cause); a large batch is a batch-size trade; otherwise decode is memory-bound."""
    slo, itl, tpot = r.slo, r.itl_ms, r.tpot_ms
    slow = [_above(tpot, "p95", slo.tpot_p95_ms, "TPOT")] if _over(tpot, "p95", slo.tpot_p95_ms) else []
    slow += [_above(itl, "p95", slo.itl_p95_ms, "ITL")] if _over(itl, "p95", slo.itl_p95_ms) else []
    if not slow:
        return None
    gap_mean = itl.mean or tpot.mean
    tail = itl.p99 if itl.p99 is not None else itl.p95
    long_prompts = (r.prompt_tokens_mean or 0) >= PREFIX_LONG_PROMPT
    stalls = bool(gap_mean and tail and tail >= STALL_RATIO * gap_mean and long_prompts)
    running = r.running_mean or r.running_peak or 0
    text = "; ".join(slow)
    if stalls:
        cause = prefill_cause or ("kv_cache" if r.preemptions else None)
        why = (f"tokens stall behind prefills: ITL p99 {quantile_text(itl, 'p99')} against a mean gap of "
               f"{ms(gap_mean)}, prompts of {_tokens(r.prompt_tokens_mean)} tokens")
        decides = " (faster prefill fixes both; ITL p50 against p99 tells stalls from a slow batch)" if cause else ""
        return _finding("decode", f"{text}: {why}{decides}", HIGH, cause,
                        None if cause or r.engine != "vllm" else flags["batched"],
                        None if cause or r.engine != "vllm" else s["max_num_batched_tokens"])
    if running >= LARGE_BATCH:
        return _finding("decode", f"{text} with {running:.0f} requests running: each step serves a large batch", HIGH,
                        setting=flags["seqs"], known=s["max_num_seqs"])
    return _finding("decode", (f"{text} with {running:.1f} requests running on average: decode is bound by "
                               f"reading weights and KV per step; generation {_tokens(r.gen_tok_s)} tok/s, "
                               f"bandwidth utilisation {pct(r.bandwidth_util)}"), HIGH)


def ordered(found: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The root (the first finding with no cause above it, by RANK), then what it causes, then
    the other findings with theirs."""
    rank = {kind: i for i, kind in enumerate(RANK)}
    roots = sorted((f for f in found if not f["caused_by"] or not any(g["kind"] == f["caused_by"] for g in found)),
                   key=lambda f: rank.get(f["kind"], len(RANK)))
    result: list[dict[str, Any]] = []

    def add(finding: dict[str, Any]) -> None:
        if finding not in result:
            result.append(finding)
            for caused in found:
                if caused["caused_by"] == finding["kind"]:
                    add(caused)
    for root in roots:
        add(root)
    return result


# ---------------------------------------------------------------------------------------------
# The plan

def _lever(setting: str | None, known: Known | None, proposed: Any, reason: str, effect: str,
           action: str = "", name: str = "", toward: str = "higher") -> dict[str, Any]:
    """One lever; `action` is its text when no setting carries it, `toward` the direction it
    names when no value can be proposed."""
    if setting:
        text = (f"{setting}: {_current(known, name)} -> {_value(name, proposed) if proposed is not None else toward} "
                f"(current: {known.source if known else UNKNOWN}): {reason}; expect {effect}")
    else:
        text = f"{action}: {reason}; expect {effect}"
    return {"setting": setting, "current": known.value if known else None,
            "current_source": known.source if known else (UNKNOWN if setting else None),
            "proposed": proposed, "reason": reason, "effect": effect, "text": text}


def _in_flight(r: Reading, s: Mapping[str, Known]) -> float | None:
    """Requests the traffic keeps in the server (Little's law): running plus waiting over a window;
    since start, the cap times (queue + service) / service, what the cap runs while busy."""
    if r.mode == "window" and r.running_mean is not None and r.waiting_mean is not None:
        return r.running_mean + r.waiting_mean
    cap, queue, service = s["max_num_seqs"].value, r.queue_ms.mean, _service_ms(r)
    return cap * (queue + service) / service if cap and queue is not None and service else None


def _peak_in_flight(r: Reading) -> float:
    """Requests running plus waiting at the busiest gauge sample."""
    return (r.running_peak or 0) + (r.waiting_peak or 0)


def _service_ms(r: Reading) -> float | None:
    """A request's mean time running: prefill and decode (vLLM); e2e less queue where no decode
    histogram is exported (SGLang)."""
    prefill, decode = r.prefill_ms.mean, r.decode_ms.mean
    if prefill is not None and decode is not None:
        return prefill + decode
    e2e, queue = r.e2e_ms.mean, r.queue_ms.mean
    return e2e - queue if r.engine == "sglang" and e2e is not None and queue is not None else None


def _power_of_two(value: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, value))))


def _kv_fit(r: Reading) -> int | None:
    return int(r.kv_cache_tokens // r.tokens_per_request) if r.kv_cache_tokens and \
        r.tokens_per_request else None


def levers(finding: Mapping[str, Any], r: Reading, s: Mapping[str, Known]) -> list[dict[str, Any]]:
    """The levers of one finding, in the order to try; none for a consequence its cause's levers fix."""
    make = {"outside_engine": _outside_levers, "kv_cache": _kv_levers, "running_limit": _running_levers,
            "queue": _queue_levers,
            "prefix_cache_off": _prefix_off_levers, "prefix_unstable": _prefix_unstable_levers,
            "prefill": _prefill_levers, "decode": _decode_levers}
    if finding["caused_by"] or finding["kind"] not in make:
        return []
    return make[finding["kind"]](finding, r, s, _flags(r, s))


def _outside_levers(f, r, s, flags) -> list[dict[str, Any]]:
    return [_lever(None, None, None, "the client saw more time than the engine: a proxy, gateway, network or "
                   "the API server holds it", "the network's share (the probe's round trip) and the rest",
                   action="split the gap from where the users are: " + _task("bench", flags=["--probe", "/health"]))]


def _kv_levers(f, r, s, flags) -> list[dict[str, Any]]:
    size, per = r.kv_cache_tokens, r.tokens_per_request
    demand = max(_in_flight(r, s) or 0, _peak_in_flight(r))
    needed = demand * per if demand and per else None
    fit = _kv_fit(r)
    holds = f"{fit} requests of {per:,.0f} tokens fit now" if fit is not None else "more requests fit"
    result = []
    known = Known(f["current"], f["current_source"], "") if f["current_source"] else None
    if f["setting"] == flags["kv_bytes"] and f["current"]:
        factor = math.ceil(needed / size) if needed and size and needed > size else 2
        proposed = f["current"] * factor
        reason = (f"the {demand:.1f} requests in flight need about {needed:,.0f} KV tokens, the cache holds {size:,}"
                  if factor > 2 or (needed and size and needed > size) else
                  "preemptions show moments when the requests in flight needed more than the cache holds (a mean "
                  "over the interval hides them): twice the size is a first step")
        result.append(_lever(f["setting"], known, proposed, reason,
                             f"{factor}x the KV tokens ({holds}); preemptions stop once the requests in flight fit "
                             f"(if the device has the memory: {_task('vram')} sizes it)", name=EXPLICIT_KV[r.engine]))
    elif f["current"] is None or f["current"] < KV_HEADROOM:
        step = round(min(f["current"] + KV_STEP, KV_HEADROOM), 2) if f["current"] is not None else None
        result.append(_lever(f["setting"], known, step,
                             "more of the device's memory for the KV cache, a small step: the rest holds "
                             "activations and graphs", f"more KV tokens ({holds}); each 0.01 is 1% of the device's "
                                                       f"memory ({_task('vram')} with GPU_UTIL sizes it)"))
    dtype = s.get("cache_dtype")
    if not dtype or not str(dtype.value).startswith("fp8"):
        result.append(_lever(flags["kv_dtype"], dtype, FP8_KV[r.engine],
                             "FP8 KV entries take half the bytes of BF16 ones",
                             (f"about twice the KV tokens ({size:,} -> {2 * size:,})" if size else
                              "about twice the KV tokens") + f"; check accuracy with {_task('accept')}"))
    tp = s.get("tensor_parallel_size")
    result.append(_lever(flags["tp"], tp, tp.value * 2 if tp and tp.value else None,
                         "the weights split over twice the GPUs, freeing memory for KV on each",
                         "more KV tokens per replica at the cost of twice the GPUs"))
    seqs, running = s["max_num_seqs"], max(r.running_mean or 0, r.running_peak or 0)
    if r.preemptions and fit and running > fit and (seqs.value is None or seqs.value > fit):
        result.append(_lever(flags["seqs"], seqs, max(1, fit),
                             f"admit only what the KV cache holds ({fit} requests of your length)",
                             "no preemptions; the rest waits in the queue instead (TTFT rises), when memory "
                             "cannot grow"))
    return result


def _running_levers(f, r, s, flags) -> list[dict[str, Any]]:
    seqs = s["max_num_seqs"]
    in_flight = _in_flight(r, s)
    fit = _kv_fit(r)
    if not in_flight:
        return [_lever(flags["seqs"], seqs, None, "the cap holds requests while the KV cache has room",
                       "less queueing; WINDOW=30 under load measures how many requests are in flight")]
    # The cap holds the peak, not the mean: requests that arrive together (a burst, a batch job)
    # wait behind a cap at their mean however short the burst.
    peak = _peak_in_flight(r)
    busiest = f", {peak:g} at the busiest of {r.gauge_samples} gauge samples" if peak > in_flight else ""
    proposed = _power_of_two(max(in_flight, peak))
    capped = fit is not None and fit < proposed
    if capped:
        proposed = fit
    if seqs.value and seqs.value >= proposed:
        return [_lever(None, None, None, f"the {in_flight:.1f} requests in flight on average{busiest} fit under the "
                       f"cap of {_current(seqs)}: requests wait in bursts the gauge samples missed",
                       "the peak the cap meets, and whether the bursts are the traffic's norm",
                       action=_task("metrics", [("WINDOW", 30)]) + " while the load peaks")]
    queue, service = r.queue_ms.mean, _service_ms(r)
    rate = f"{r.requests / r.seconds:.2g} req/s x {ms(r.e2e_ms.mean)} each, queue included" \
        if r.mode == "window" and r.seconds and r.requests and r.e2e_ms.mean else "the cap while busy"
    result = [_lever(flags["seqs"], seqs, proposed, (
        f"the traffic keeps about {in_flight:.1f} requests in the server (Little's law: {rate}){busiest}; "
        + (f"the KV cache holds {fit} of {r.tokens_per_request:,.0f} tokens" if capped else
           "the next power of two lets all of them run" + (f", and the KV cache holds {fit:,} of "
                                                            f"{r.tokens_per_request:,.0f} tokens" if fit else ""))),
        f"queue wait (mean {ms(queue)}) near 0 and TTFT near prefill time, if arrivals stay as measured and each "
        f"request still runs about {ms(service)}; a larger batch makes each token slower (TPOT mean "
        f"{ms(r.tpot_ms.mean or r.itl_ms.mean)} now)")]
    batched = s["max_num_batched_tokens"]
    if r.engine == "vllm" and batched.value and batched.value < proposed:
        result.append(_lever(flags["batched"], batched, proposed,
                             "vLLM refuses to start with max_num_batched_tokens below max_num_seqs "
                             "(vllm/config/scheduler.py)", f"a step can hold one token of each of {proposed} requests"))
    if capped:
        result.append(_lever(None, None, None, f"{in_flight:.1f} requests in flight, {fit} fit in the KV cache",
                             "the rest runs on the new replica",
                             action=f"add a replica or data-parallel engine ({flags['dp']})"))
    return result


def _queue_levers(f, r, s, flags) -> list[dict[str, Any]]:
    return [_lever(None, None, None, "a window under load tells a full KV cache from the running-requests cap",
                   "the root cause, KV cache or cap, with its setting",
                   action=_task("metrics", [("WINDOW", 30)]) + " while the load is on"),
            _lever(None, None, None, "the load is more than one server runs at once",
                   "queue wait falls as the load spreads",
                   action=f"add replicas or data-parallel engines ({flags['dp']})")]


def _prefix_off_levers(f, r, s, flags) -> list[dict[str, Any]]:
    on = "drop the flag" if r.engine == "sglang" else True
    current = Known(f["current"], f["current_source"], "")
    return [_lever(f["setting"], current, on, (
        f"prompts of {_tokens(r.prompt_tokens_mean)} tokens are computed in full; a shared start (system prompt, "
        "tools, history) is computed once and then read from the cache"),
        "prefill time and TTFT fall by the share of each prompt that is shared (unknown while the cache is off: "
        "the hit rate after the change tells it)")]


def _prefix_unstable_levers(f, r, s, flags) -> list[dict[str, Any]]:
    return [_lever(None, None, None, (
        "the cache reuses only an identical start; put the shared instructions, tools and history first and "
        "byte-identical in every request, and move timestamps, ids and user names after them"),
        "hit rate up to the shared share of each prompt, and TTFT down by as much; resend one prompt twice and "
        "vllm:prefix_cache_hits_total (SGLang: sglang:cached_tokens_total) grows by its shared length",
        action="make the prompts' start stable (client side)")]


def _prefill_levers(f, r, s, flags) -> list[dict[str, Any]]:
    result = []
    batched, prompt, steps = s["max_num_batched_tokens"], r.prompt_tokens_mean, _prefill_steps(r, s)
    if steps:
        proposed = _power_of_two(prompt)
        result.append(_lever(flags["batched"], batched, proposed,
                             f"prompts of {prompt:,.0f} tokens take {steps} steps each",
                             "each prompt prefills in one step, so TTFT falls; tokens of running requests stall "
                             "longer behind it (ITL p99 rises)"))
    tp = s.get("tensor_parallel_size")
    result.append(_lever(flags["tp"], tp, tp.value * 2 if tp and tp.value else None,
                         "prefill is compute-bound: twice the GPUs share its work",
                         "prefill time and TTFT down by up to half (less what the GPUs spend talking)"))
    result.append(_lever(None, None, None, "FP8 tensor cores (compute capability 8.9+) prefill faster than BF16",
                         f"faster prefill and TTFT; check accuracy with {_task('accept')}",
                         action=f"FP8 weights ({flags['quant']} fp8)"))
    return result


def _decode_levers(f, r, s, flags) -> list[dict[str, Any]]:
    if f["setting"] == flags["batched"]:
        known = s["max_num_batched_tokens"]
        return [_lever(f["setting"], known, max(known.value // 2, 512) if known.value else None,
                       "smaller prefill chunks interrupt decoding for less time",
                       "shorter stalls (ITL p99 down), each prompt in more steps (TTFT up)", toward="lower")]
    if f["setting"] == flags["seqs"]:
        known, running = s["max_num_seqs"], r.running_mean or r.running_peak
        return [_lever(f["setting"], known, _power_of_two(running / 2), "a smaller batch reads the KV of fewer "
                       "requests per step", "faster tokens for each request, less throughput in all; the rest queues")]
    return [_lever(None, None, None, "at small batch most of each step is reading weights",
                   "more tokens per step per request (speculative decoding gains fall as batch grows)",
                   action=f"speculative decoding ({flags['spec']})"),
            _lever(None, None, None, "fewer bytes read per token",
                   f"faster decode; check accuracy with {_task('accept')}",
                   action=f"FP8 weights ({flags['quant']} fp8)")]


def plan(found: Sequence[Mapping[str, Any]], r: Reading, s: Mapping[str, Known]) -> list[dict[str, Any]]:
    """The findings' levers in order, one per setting (and per action): the first, the root's,
    wins, so the plan never raises and lowers one setting."""
    result, seen = [], set()
    for finding in found:
        for lever in levers(finding, r, s):
            key = lever["setting"] or lever["text"].split(": ")[0]  # the action
            if key not in seen:
                seen.add(key)
                result.append(lever)
    return result


# ---------------------------------------------------------------------------------------------
# The proof

def _task(name: str, variables: Sequence[tuple[str, Any]] = (), flags: Sequence[str] = ()) -> str:
    """A task call in the form of the Taskfile that ran this (core/taskcall.py): runnable as printed."""
    return taskcall.from_environment().command(name, variables, flags)


def verify(r: Reading, url: str | None, root: Mapping[str, Any] | None) -> list[str]:
    """A light bench (LIGHT_C at a time, LIGHT_N requests: a live server keeps serving its users)
    at the traffic's lengths and endpoint before and after the change, and the compare that
    judges them. Half of each prompt shared stands for the traffic's shared start (an assumption
    the user replaces with the system prompt's length): with caching off the change is the
    server's flag, so both benches share it (the same workload, one the cache can serve); with
    unstable prompts the change is the client's, so only the second does, and compare names
    shared_prefix as the variable under test."""
    pooling = r.endpoint in APIS and not APIS[r.endpoint].generates  # one answer: no output length, TTFT or TPOT
    variables: list[tuple[str, Any]] = [("INFER_URL", url)] if url else []
    if r.prompt_tokens_mean:
        variables.append(("BENCH_IN", max(1, round(r.prompt_tokens_mean))))
    if r.output_tokens_mean and not pooling:
        variables.append(("BENCH_OUT", max(1, round(r.output_tokens_mean))))
    variables += [("BENCH_C", LIGHT_C), ("BENCH_N", LIGHT_N)]
    if r.slo.given and not pooling:
        variables += [("SLO_TTFT_P95_MS", f"{r.slo.ttft_p95_ms:g}"), ("SLO_TPOT_P95_MS", f"{r.slo.tpot_p95_ms:g}")]
    before = ["--endpoint", r.endpoint] if r.endpoint and r.endpoint != "completions" else []  # bench's default
    after, compare_flags = list(before), []
    shared = ["--shared-prefix", str(int(r.prompt_tokens_mean // 2))] if r.prompt_tokens_mean else []
    if shared and root and root["kind"] == "prefix_cache_off":
        before, after = before + shared, after + shared
    elif shared and root and root["kind"] == "prefix_unstable":
        after, compare_flags = after + shared, ["--variable", "shared_prefix"]
    return [_task("bench", variables, [*before, "--json-out", "before.json"]),
            _task("bench", variables, [*after, "--json-out", "after.json"]),
            _task("compare", [("A", "before.json"), ("B", "after.json")], compare_flags)]


# ---------------------------------------------------------------------------------------------
# The diagnosis

def diagnose(r: Reading, s: Mapping[str, Known], url: str | None = None) -> dict[str, Any]:
    """{root_cause, findings (root first, then what it causes, then the others), plan, verify}."""
    found = ordered(findings(r, s))
    root = found[0] if found else None
    return {"root_cause": root, "findings": found, "plan": plan(found, r, s),
            "verify": verify(r, url, root) if root else []}


def _leading(own: list[dict[str, Any]], first: list[dict[str, Any]], engine: Mapping[str, Any]) -> dict[str, Any]:
    """Findings that stand before the engine's (the first is the root) and their levers before its plan."""
    return {"root_cause": own[0], "findings": own + list(engine["findings"]), "plan": first + list(engine["plan"]),
            "verify": list(engine["verify"])}


def with_fleet(fleet_findings: Sequence[Mapping[str, Any]], engine: Mapping[str, Any]) -> dict[str, Any]:
    """The fleet's findings (scripts/fleet.py) before the engine's: a replica down, a mismatch or
    the balancer is the root; their levers lead the plan."""
    if not fleet_findings:
        return dict(engine)
    own = [{k: v for k, v in f.items() if k != "levers"} for f in fleet_findings]
    first = [_lever(None, None, None, f["cause"], "see the finding's figures per replica", action=lever)
             for f in fleet_findings for lever in f["levers"]]
    return _leading(own, first, engine)


def with_outside(outside: Sequence[Mapping[str, Any]], engine: Mapping[str, Any],
                 engine_ttft_ms: float | None = None) -> dict[str, Any]:
    """The time the client saw outside the engine (bench's cross-check, rooflib/server/watch.py)
    with the engine's findings. Every request waits for it whatever the engine does, so it is the
    root (with its `cause` and `size_ms`, its remedy first in the plan) unless the engine's own
    root costs more: when the engine's mean TTFT (`engine_ttft_ms`: queue and prefill) is longer
    than the largest outside time, the engine's root stays first and the outside time follows."""
    # The largest part first: it is the root (a small partial buffering is no root beside a fixed delay).
    found = sorted((f for f in outside if f["kind"] == "outside_engine"), key=lambda f: -(f["size_ms"] or 0))
    if not found:
        return dict(engine)
    own = [{k: v for k, v in f.items() if k != "remedy"} for f in found]
    levers = [_lever(None, None, None, f"about {f['size_ms'] or 0:.0f} ms of each request outside the engine "
                     f"({f['cause']})", f"the client's TTFT and e2e up to {f['size_ms'] or 0:.0f} ms nearer the engine's",
                     action=f["remedy"]) for f in found]
    outside_ms = max(f["size_ms"] or 0 for f in found)
    if engine["root_cause"] and engine_ttft_ms is not None and engine_ttft_ms > outside_ms:
        return {**engine, "findings": list(engine["findings"]) + own, "plan": list(engine["plan"]) + levers}
    return _leading(own, levers, engine)


def format_diagnosis(d: Mapping[str, Any]) -> list[str]:
    """The human form: the root cause first (its kind, setting and current value), what it
    causes indented under it, the other findings, one numbered plan, the verify commands."""
    if not d["root_cause"]:
        return ["Diagnosis: no bottleneck found in these figures."]
    lines = []
    causes = {f["kind"]: f for f in d["findings"]}
    for i, finding in enumerate(d["findings"]):
        depth, above = 0, finding["caused_by"]
        while above in causes and depth < len(causes):
            depth, above = depth + 1, causes[above]["caused_by"]
        head = "Root cause: " if i == 0 else ("  " * depth + "-> " if depth else "Also: ")
        lines.append(f"{head}[{finding['kind']}] {finding['evidence']} (confidence {finding['confidence']})")
    lines.append("Plan (one change at a time, in this order):")
    lines += [f"  {i}. {lever['text']}" for i, lever in enumerate(d["plan"], 1)]
    if d["verify"]:
        lines.append("Verify (the same bench before and after the change, then compare):")
        lines += [f"  {command}" for command in d["verify"]]
    return lines


def known_json(s: Mapping[str, Known]) -> dict[str, dict[str, Any]]:
    return {name: asdict(known) for name, known in s.items()}
