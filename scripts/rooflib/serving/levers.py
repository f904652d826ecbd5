"""From a diagnosis to one profile change: which lever of the plan `tune` may try, as which profile
key, and whether the vram model says the changed profile starts at all.

The diagnosis (engine_metrics' report, "diagnosis") names each lever by the engine flag it sets:
{"setting": "--max-num-seqs", "current": 1, "current_source": "inferred", "proposed": 8, "text": ...}.
tune tries the first lever whose flag a serving profile sets (profiles.render_vllm/render_sglang
turn the keys back into those flags) and that changes only how the engine schedules and sizes its
memory. Levers that change the model's numbers (KV or weight precision) or the hardware (more
GPUs) are proposals for the user: tune says so and does not run them. A diagnosis lever that moves
a setting the way that worsens the figure tune must improve is passed over for that figure.

Where the diagnosis names nothing tune can try (or its change did not move the figure), the figure
itself is searched (figure_change): the settings each SLO figure depends on, in order, each with a
first value placed by what the run measured (for TPOT, the running cap that the per-token model,
rooflib/doctor/tradeoff.py, gives for the target).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from rooflib.core.errors import UsageError
from rooflib.doctor import tradeoff
from rooflib.doctor.evidence import Fit
from rooflib.load import workloads
from rooflib.server.deployment import EXPORTED, Known, Served
from rooflib.server.plan import busiest, power_of_two
from rooflib.serving import profiles
from rooflib.sizing import estimate, memory_budget, model_shape

# The figures tune moves: bench's SLO names, and the requests the server rejects as longer than its
# context limit (bench --over-limit sends the users' lengths as they are).
TTFT, TPOT, REJECTED = "ttft_p95_ms", "tpot_p95_ms", "rejected"

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


# Profile key -> the diagnosis's name of the setting (rooflib/server/known_settings.py, settings()).
DIAGNOSIS_NAMES = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                   "enable_prefix_caching": "prefix_caching", "max_model_len": "max_model_len",
                   "gpu_memory_utilization": "gpu_memory_utilization",
                   "kv_cache_memory_bytes": "kv_cache_memory_bytes", "kv_cache_dtype": "cache_dtype",
                   "tensor_parallel_size": "tensor_parallel_size"}


def served_with(profile: Mapping[str, Any], url: str, source: str, exported: Served | None = None) -> Served:
    """What an engine started from `profile` runs with, for the diagnosis: each setting the profile
    sets is on the engine's command line, as sure as what a server exports. A setting it leaves out
    is the engine's default: what the engine says of itself (`exported`: its /server_info or
    /get_server_info), else what the diagnosis reads from /metrics or infers, as for any server."""
    how = f"the engine's command line (profile {source})"
    return Served(url, {**(exported.settings if exported else {}),
                        **{name: Known(profile[key], EXPORTED, how) for key, name in DIAGNOSIS_NAMES.items()
                           if profile.get(key) is not None}})


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


# A setting moved this way makes the figure worse: a larger batch slows each token (and a larger
# prefill budget puts more prompt tokens in each decode step); a smaller one holds requests back.
WORSENS = {TPOT: {"max_num_seqs": 1, "max_num_batched_tokens": 1},
           TTFT: {"max_num_seqs": -1, "max_num_batched_tokens": -1}}
FIGURE_WORDS = {TTFT: "TTFT p95", TPOT: "TPOT p95", REJECTED: "requests rejected"}


def worsens(figure: str | None, key: str, current: Any, proposed: Any) -> bool:
    """Whether moving `key` from `current` to `proposed` goes the way that makes `figure` worse."""
    way = WORSENS.get(figure or "", {}).get(key)
    if way is None or not isinstance(current, (int, float)) or not isinstance(proposed, (int, float)):
        return False
    return (proposed - current) * way > 0


@dataclass(frozen=True)
class Choice:
    """The first lever tune can try (None when no lever is left), and why the others before it
    were passed over, one line each."""
    change: Change | None
    passed_over: tuple[str, ...]


def first_change(diagnosis: Mapping[str, Any] | None, profile: Mapping[str, Any], done: Sequence[str],
                 figure: str | None = None) -> Choice:
    """The plan's first lever that sets a profile key not in `done`, as a Change from the
    profile's own value; levers left to the user, changes the profile refuses and (for `figure`,
    the figure to improve) changes that make that figure worse, passed over."""
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
        if worsens(figure, key, current, proposed):
            passed.append(f"{lever['text']} (not tried for {FIGURE_WORDS[figure or '']}: that way makes it worse)")
            continue
        change = Change(key, flag, current, proposed, lever["text"])
        refused = refusal(change, profile)
        if refused:
            passed.append(f"{lever['text']} ({refused})")
            continue
        return Choice(change, tuple(passed))
    return Choice(None, tuple(passed))


def refusal(change: Change, profile: Mapping[str, Any]) -> str | None:
    """Why the profile refuses `change` (profiles.validate's one line), None where it takes it."""
    try:
        profiles.validate(change.applied(profile))
    except UsageError as exc:
        return f"not tried: the profile refuses it: {exc}"
    return None


def proposed_value(key: str, proposed: Any) -> Any:
    """The profile value of a lever's proposal. Prefix caching: vLLM's lever proposes True,
    SGLang's "drop the flag" (--disable-radix-cache), which is the profile's True too."""
    if key == "enable_prefix_caching":
        return proposed is not None and proposed is not False
    if isinstance(proposed, (int, float)) and not isinstance(proposed, bool):
        return proposed
    return None


# ---------------------------------------------------------------------------------------------
# The figure search: the settings an SLO figure depends on, each with a first value placed by
# what the run measured.

@dataclass(frozen=True)
class Placed:
    """A first value for a setting (None: not tried), and why there (or why not; "" says nothing:
    the setting has nothing to do with this run)."""
    value: Any
    reason: str


def flag_of(engine: str, key: str) -> str:
    """The engine flag that sets a profile key (TUNABLE read backwards)."""
    return next(flag for flag, name in TUNABLE[engine].items() if name == key)


def timeline(run: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The run's gauge samples during the load: the first and the last scrape (before and after
    it) read an idle engine, and so does any with nothing running or waiting, a scrape a busy
    machine delayed past the last request (a closed loop of 48 once had only such samples, so tune
    placed no cap)."""
    samples = ((run.get("timeline") or {}).get("samples") or [])[1:-1]
    return [s for s in samples if s.get("running") or s.get("waiting")]


def running_mean(run: Mapping[str, Any], profile: Mapping[str, Any]) -> float | None:
    """Requests running on average during the run: the timeline's gauge (bench's result keeps no
    window mean of it); without a timeline, the requests in flight at the client, under the cap."""
    samples = [s["running"] for s in timeline(run) if s.get("running") is not None]
    if samples:
        return sum(samples) / len(samples)
    in_flight, cap = (run.get("throughput") or {}).get("effective_concurrency"), profile.get("max_num_seqs")
    return min(in_flight, cap) if in_flight and cap else in_flight


def in_effect(key: str, current: Any, run: Mapping[str, Any], profile: Mapping[str, Any]) -> float | None:
    """The value of `key` the run measured the figure at: a running cap above the requests in
    flight is the requests that ran; a value not set (the engine's default) or not a number, None."""
    if key == "max_num_seqs":
        running = running_mean(run, profile)
        return min(running, current) if running and current else running or current
    return current if isinstance(current, (int, float)) and not isinstance(current, bool) else None


def prompt_mean(run: Mapping[str, Any]) -> float | None:
    return ((run.get("requests") or {}).get("prompt_tokens") or {}).get("mean")


def longest_request(run: Mapping[str, Any]) -> int | None:
    """Prompt plus output tokens of the longest request a synthetic single-turn workload sends
    (the lengths bench checks against max_model_len); None for datasets and traces."""
    config = run.get("config") or {}
    if config.get("workload", "synthetic") != "synthetic" or (config.get("multi_turn") or 1) != 1:
        return None
    return sum(workloads.parse_distribution(config.get(dist) or str(config[tokens]), flag).upper
               for dist, tokens, flag in (("input_dist", "input_tokens", "--input-dist"),
                                          ("output_dist", "output_tokens", "--output-dist")))


def fewer_running(run: Mapping[str, Any], profile: Mapping[str, Any]) -> Placed:
    """TPOT: the running cap the per-token model gives for the target (tradeoff.cap_for). One run
    is one point, so the model is per-token time in proportion to the requests running; a fixed
    part of each step makes that cap err high, and the next value of the search (trials.next_value)
    takes the line through the measured points."""
    running, tpot = running_mean(run, profile), run.get("tpot_ms") or {}
    mean, p95, target = tpot.get("mean"), tpot.get("p95"), run["slo"][TPOT]["target"]
    if not running or not mean or not p95:
        return Placed(None, "max_num_seqs: the run shows no requests running or no TPOT to place a cap by")
    offered = (run.get("throughput") or {}).get("output_tok_s")
    model = Fit(intercept_ms=0.0, slope_ms=mean / running, points=1, running_low=running, running_high=running, r2=0.0)
    cap = tradeoff.cap_for(model, target, p95 / mean, offered)
    if cap is None or cap.cap >= running:
        return Placed(None, f"max_num_seqs: no cap below the {running:.1f} requests running meets {target:g} ms "
                            f"by the per-token model ({model.slope_ms:.3f} ms x running)")
    return Placed(cap.cap, (
        f"TPOT p95 {p95:.1f} ms with {running:.1f} requests running: per-token time in proportion to them "
        f"({model.slope_ms:.3f} ms x running, p95/mean {p95 / mean:.2f}) meets {target:g} ms at {cap.cap}; one server "
        f"then makes about {cap.tok_s_at_cap:,.0f} tok/s" + (f" against {offered:,.0f} tok/s now" if offered else "")))


def smaller_chunks(run: Mapping[str, Any], profile: Mapping[str, Any]) -> Placed:
    """TPOT: a prefill budget below the prompts, so that each prompt's prefill is split and a
    decode step carries fewer prompt tokens (never below the running cap: vLLM refuses that)."""
    current, prompt = profile.get("max_num_batched_tokens"), prompt_mean(run)
    if not prompt:
        return Placed(None, "max_num_batched_tokens: the run shows no prompt length to size prefill chunks by")
    below = power_of_two(prompt) // 2
    proposed = max(min(below, current // 2) if current else below, profile.get("max_num_seqs") or 1)
    if current and proposed >= current:
        return Placed(None, f"max_num_batched_tokens: {current} is already at the floor of the running cap")
    return Placed(proposed, f"prompts of {prompt:,.0f} tokens prefill in chunks of at most {proposed}: each decode "
                            "step carries fewer prompt tokens, so tokens stall less behind prefills")


def more_running(run: Mapping[str, Any], profile: Mapping[str, Any]) -> Placed:
    """TTFT: a running cap for what the load keeps in flight (Little's law, at the client), when
    requests waited for a slot: a gauge sample saw some waiting, or the client had more requests
    out at once than the cap lets run (its own count sees the whole load; samples seconds apart
    can all miss it on a loaded machine)."""
    throughput, samples = run.get("throughput") or {}, timeline(run)
    in_flight, client_peak = throughput.get("effective_concurrency"), throughput.get("peak_in_flight") or 0
    cap = profile.get("max_num_seqs") or max((s.get("running") or 0 for s in samples), default=0)
    if not in_flight or not (any(s.get("waiting") for s in samples) or (cap and client_peak > cap)):
        return Placed(None, "max_num_seqs: no request waited for a slot in the run")
    # The peak, not only the mean: requests that arrive together wait behind a cap at their mean.
    gauge_peak = max(((s.get("running") or 0) + (s.get("waiting") or 0) for s in samples), default=0)
    peak, seen = busiest(gauge_peak, client_peak, len(samples))
    proposed = power_of_two(max(in_flight, peak))
    if cap >= proposed:
        return Placed(None, f"max_num_seqs: the {in_flight:.1f} requests in flight ({seen}) fit under {cap:g}")
    return Placed(proposed, f"requests waited for a slot: the load keeps {in_flight:.1f} requests in flight on "
                            f"average (Little's law), {seen}, and {proposed} lets all of them run")


def prefix_cache_on(run: Mapping[str, Any], profile: Mapping[str, Any]) -> Placed:
    """TTFT: a shared start of the prompts computed once, where the profile turns the cache off."""
    if profile.get("enable_prefix_caching") is not False:
        return Placed(None, "")
    return Placed(True, "prefix caching is off: a start the prompts share is computed for every request")


def larger_chunks(run: Mapping[str, Any], profile: Mapping[str, Any]) -> Placed:
    """TTFT: a prefill budget that holds a whole prompt, else twice the budget."""
    current, prompt = profile.get("max_num_batched_tokens"), prompt_mean(run)
    if not current:
        return Placed(None, "max_num_batched_tokens: the profile leaves it to the engine, so its value is not "
                            "known: set it (--set max_num_batched_tokens=N) to have it searched")
    if not prompt:
        return Placed(current * 2, f"twice the prefill budget of {current} tokens a step")
    proposed = max(current * 2, power_of_two(prompt))
    return Placed(proposed, f"prompts of {prompt:,.0f} tokens prefill over {math.ceil(prompt / current)} steps of "
                            f"at most {current} tokens; {proposed} holds one in a step")


def longer_context(run: Mapping[str, Any], profile: Mapping[str, Any]) -> Placed:
    """Rejections: a context limit that holds the users' longest request (whether the KV space
    holds it is the vram model's check of the changed profile, levers.start_check)."""
    current, longest = profile.get("max_model_len"), longest_request(run)
    proposed = power_of_two(longest) if longest else current * 2 if current else None
    if proposed is None or (current and proposed <= current):
        return Placed(None, "max_model_len: the workload's lengths are not known (a dataset or a trace), and the "
                            "profile does not set it")
    return Placed(proposed, f"the server rejects requests longer than max_model_len {current}; "
                            + (f"the longest the users send is {longest:,} tokens" if longest else "twice the limit"))


# The settings each figure depends on, in the order the search tries them.
SEARCHED: dict[str, tuple[tuple[str, Callable[[Mapping[str, Any], Mapping[str, Any]], Placed], ...], ...]] = {
    TPOT: (("max_num_seqs", fewer_running), ("max_num_batched_tokens", smaller_chunks)),
    TTFT: (("max_num_seqs", more_running), ("enable_prefix_caching", prefix_cache_on),
           ("max_num_batched_tokens", larger_chunks)),
    REJECTED: (("max_model_len", longer_context),),
}


def figure_change(figure: str, run: Mapping[str, Any], profile: Mapping[str, Any], done: Sequence[str]) -> Choice:
    """The first setting `figure` depends on that is not in `done` and that the run gives a value
    for, as a Change from the profile's own value; the ones that cannot be tried, passed over."""
    passed = []
    for key, place in SEARCHED.get(figure, ()):
        if key in done or key not in TUNABLE[profile["engine"]].values():
            continue
        placed = place(run, profile)
        if placed.value is None:
            passed += [placed.reason] if placed.reason else []
            continue
        change = Change(key, flag_of(profile["engine"], key), profile.get(key), placed.value,
                        f"{FIGURE_WORDS[figure]} misses its target: {placed.reason}")
        refused = refusal(change, profile)
        if refused:
            passed.append(f"{change.describe()} ({refused})")
            continue
        return Choice(change, tuple(passed))
    return Choice(None, tuple(passed))


# ---------------------------------------------------------------------------------------------
# Will it start? The vram model (sizing/estimate.py) on the changed profile.

GIB = 1 << 30


@dataclass(frozen=True)
class Sizing:
    """What the vram model needs beside a profile: the model's config and the GPU (None on the
    CPU build, where the profile fixes the KV space)."""
    model: model_shape.Model
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
    inputs = memory_budget.Inputs(
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
