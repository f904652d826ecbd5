"""The plan of the diagnosis (diagnosis.py) and its proof: the levers of each finding, checked
against the deployment, one per setting with the root cause's first; and the bench and compare
commands that verify the change, in the form of the Taskfile that ran this.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from rooflib.core import taskcall
from rooflib.load.apis import APIS
from rooflib.server.deployment import UNKNOWN, Known
from rooflib.server.findings import prefill_steps
from rooflib.server.known_settings import (
    EXPLICIT_KV,
    FP8_KV,
    KV_HEADROOM,
    KV_STEP,
    LIGHT_C,
    LIGHT_N,
    current_text,
    engine_flags,
    ms,
    tokens_text,
    value_text,
)
from rooflib.server.reading import Reading

# ---------------------------------------------------------------------------------------------
# The plan

def make_lever(setting: str | None, known: Known | None, proposed: Any, reason: str, effect: str,
               action: str = "", name: str = "", toward: str = "higher") -> dict[str, Any]:
    """One lever; `action` is its text when no setting carries it, `toward` the direction it
    names when no value can be proposed."""
    if setting:
        text = (f"{setting}: {current_text(known, name)} -> "
                f"{value_text(name, proposed) if proposed is not None else toward} "
                f"(current: {known.source if known else UNKNOWN}): {reason}; expect {effect}")
    else:
        text = f"{action}: {reason}; expect {effect}"
    return {"setting": setting, "current": known.value if known else None,
            "current_source": known.source if known else (UNKNOWN if setting else None),
            "proposed": proposed, "reason": reason, "effect": effect, "text": text}


def _in_flight(r: Reading, s: Mapping[str, Known]) -> float | None:
    """Requests the traffic keeps in the server (Little's law): running plus waiting over a window;
    since start, what the cap runs while busy (_in_flight_while_capped)."""
    if r.mode == "window" and r.running_mean is not None and r.waiting_mean is not None:
        return r.running_mean + r.waiting_mean
    return _in_flight_while_capped(r, s)


def _in_flight_while_capped(r: Reading, s: Mapping[str, Known]) -> float | None:
    """Requests in the server while the running cap held them: it ran `cap` at a time for the mean
    service each, and each request first waited the mean queue time: cap x (queue + service) /
    service (Little's law over the busy time). A window's mean counts its idle seconds too, and a
    window around a short burst has many of them."""
    cap, queue, service = s["max_num_seqs"].value, r.queue_ms.mean, _service_ms(r)
    return cap * (queue + service) / service if cap and queue is not None and service else None


def busiest(gauge_peak: float, client_peak: int | None, gauge_samples: int | None) -> tuple[float, str]:
    """Requests in flight at the busiest moment seen, and where it was seen: running plus waiting
    at the busiest gauge sample, or a bench's own count when it saw more (it sees every request
    start and end; the gauges are sampled seconds apart, and a loaded machine can scrape them
    after the load)."""
    if (client_peak or 0) > gauge_peak:
        return client_peak, f"{client_peak} at once at the busiest moment of the bench's own requests"
    return gauge_peak, f"{gauge_peak:g} at the busiest of {gauge_samples} gauge samples"


def _busiest(r: Reading) -> tuple[float, str]:
    return busiest((r.running_peak or 0) + (r.waiting_peak or 0), r.client_peak_in_flight, r.gauge_samples)


def _service_ms(r: Reading) -> float | None:
    """A request's mean time running: prefill and decode (vLLM); e2e less queue where no decode
    histogram is exported (SGLang)."""
    prefill, decode = r.prefill_ms.mean, r.decode_ms.mean
    if prefill is not None and decode is not None:
        return prefill + decode
    e2e, queue = r.e2e_ms.mean, r.queue_ms.mean
    return e2e - queue if r.engine == "sglang" and e2e is not None and queue is not None else None


def power_of_two(value: float) -> int:
    """The smallest power of two at or above `value` (at least 1)."""
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
    return make[finding["kind"]](finding, r, s, engine_flags(r, s))


def _outside_levers(f, r, s, flags) -> list[dict[str, Any]]:
    return [make_lever(None, None, None, "the client saw more time than the engine: a proxy, gateway, network or "
                       "the API server holds it", "the network's share (the probe's round trip) and the rest",
                       action="split the gap from where the users are: "
                       + _task("bench", flags=["--probe", "/health"]))]


def _kv_levers(f, r, s, flags) -> list[dict[str, Any]]:
    size, per = r.kv_cache_tokens, r.tokens_per_request
    mean, (peak, where) = _in_flight(r, s) or 0, _busiest(r)
    demand = max(mean, peak)
    flight = f"{where}, {mean:.1f} on average" if peak > mean else f"{demand:.1f} on average"
    needed = demand * per if demand and per else None
    fit = _kv_fit(r)
    holds = f"{fit} requests of {per:,.0f} tokens fit now" if fit is not None else "more requests fit"
    result = []
    known = Known(f["current"], f["current_source"], "") if f["current_source"] else None
    if f["setting"] == flags["kv_bytes"] and f["current"]:
        factor = math.ceil(needed / size) if needed and size and needed > size else 2
        proposed = f["current"] * factor
        reason = (f"the requests in flight ({flight}) need about {needed:,.0f} KV tokens, the cache holds {size:,}"
                  if factor > 2 or (needed and size and needed > size) else
                  "preemptions show moments when the requests in flight needed more than the cache holds (a mean "
                  "over the interval hides them): twice the size is a first step")
        result.append(make_lever(f["setting"], known, proposed, reason,
                                 f"{factor}x the KV tokens ({holds}); preemptions stop once the requests in flight fit "
                                 f"(if the device has the memory: {_task('vram')} sizes it)",
                                 name=EXPLICIT_KV[r.engine]))
    elif f["current"] is None or f["current"] < KV_HEADROOM:
        step = round(min(f["current"] + KV_STEP, KV_HEADROOM), 2) if f["current"] is not None else None
        result.append(make_lever(f["setting"], known, step,
                                 "more of the device's memory for the KV cache, a small step: the rest holds "
                                 "activations and graphs", f"more KV tokens ({holds}); each 0.01 is 1% of the device's "
                                                           f"memory ({_task('vram')} with GPU_UTIL sizes it)"))
    dtype = s.get("cache_dtype")
    if not dtype or not str(dtype.value).startswith("fp8"):
        result.append(make_lever(flags["kv_dtype"], dtype, FP8_KV[r.engine],
                                 "FP8 KV entries take half the bytes of BF16 ones",
                                 (f"about twice the KV tokens ({size:,} -> {2 * size:,})" if size else
                                  "about twice the KV tokens") + f"; check accuracy with {_task('accept')}"))
    tp = s.get("tensor_parallel_size")
    result.append(make_lever(flags["tp"], tp, tp.value * 2 if tp and tp.value else None,
                             "the weights split over twice the GPUs, freeing memory for KV on each",
                             "more KV tokens per replica at the cost of twice the GPUs"))
    seqs, running = s["max_num_seqs"], max(r.running_mean or 0, r.running_peak or 0)
    if r.preemptions and fit and running > fit and (seqs.value is None or seqs.value > fit):
        result.append(make_lever(flags["seqs"], seqs, max(1, fit),
                                 f"admit only what the KV cache holds ({fit} requests of your length)",
                                 "no preemptions; the rest waits in the queue instead (TTFT rises), when memory "
                                 "cannot grow"))
    return result


def _running_levers(f, r, s, flags) -> list[dict[str, Any]]:
    seqs = s["max_num_seqs"]
    window_mean = in_flight = _in_flight(r, s)
    fit = _kv_fit(r)
    if not in_flight:
        return [make_lever(flags["seqs"], seqs, None, "the cap holds requests while the KV cache has room",
                           "less queueing; WINDOW=30 under load measures how many requests are in flight")]
    # The cap holds the peak, not the mean: requests that arrive together (a burst, a batch job)
    # wait behind a cap at their mean however short the burst.
    peak, where = _busiest(r)
    if seqs.value and seqs.value >= power_of_two(max(in_flight, peak)):
        # Requests waited behind a cap their mean fits under: a window's mean counts its idle
        # seconds too (a window around a short burst has many), the time they waited does not.
        in_flight = max(in_flight, _in_flight_while_capped(r, s) or 0)
    at_busiest = f", {where}" if peak > in_flight else ""
    proposed = power_of_two(max(in_flight, peak))
    capped = fit is not None and fit < proposed
    if capped:
        proposed = fit
    if seqs.value and seqs.value >= proposed:
        return [make_lever(None, None, None, f"the {in_flight:.1f} requests in flight on average{at_busiest} fit "
                           f"under the cap of {current_text(seqs)}: requests wait in bursts the gauge samples missed",
                           "the peak the cap meets, and whether the bursts are the traffic's norm",
                           action=_task("metrics", [("WINDOW", 30)]) + " while the load peaks")]
    queue, service = r.queue_ms.mean, _service_ms(r)
    rate = f"{r.requests / r.seconds:.2g} req/s x {ms(r.e2e_ms.mean)} each, queue included" \
        if r.mode == "window" and r.seconds and r.requests and r.e2e_ms.mean else "the cap while busy"
    kept = f"the traffic keeps about {in_flight:.1f} requests in the server (Little's law: {rate})"
    if in_flight > window_mean:
        kept = (f"the server held about {in_flight:.1f} requests while the cap made them wait (it ran "
                f"{current_text(seqs)} at a time for {ms(service)} each, and each request waited {ms(queue)} first; "
                f"{window_mean:.1f} in the server on average over the whole {r.seconds:.0f} s window)")
    result = [make_lever(flags["seqs"], seqs, proposed, (
        f"{kept}{at_busiest}; "
        + (f"the KV cache holds {fit} of {r.tokens_per_request:,.0f} tokens" if capped else
           "the next power of two lets all of them run" + (f", and the KV cache holds {fit:,} of "
                                                            f"{r.tokens_per_request:,.0f} tokens" if fit else ""))),
        f"queue wait (mean {ms(queue)}) near 0 and TTFT near prefill time, if arrivals stay as measured and each "
        f"request still runs about {ms(service)}; a larger batch makes each token slower (TPOT mean "
        f"{ms(r.tpot_ms.mean or r.itl_ms.mean)} now)")]
    batched = s["max_num_batched_tokens"]
    if r.engine == "vllm" and batched.value and batched.value < proposed:
        result.append(make_lever(flags["batched"], batched, proposed,
                                 "vLLM refuses to start with max_num_batched_tokens below max_num_seqs "
                                 "(vllm/config/scheduler.py)",
                                 f"a step can hold one token of each of {proposed} requests"))
    if capped:
        result.append(make_lever(None, None, None, f"{in_flight:.1f} requests in flight, {fit} fit in the KV cache",
                                 "the rest runs on the new replica",
                                 action=f"add a replica or data-parallel engine ({flags['dp']})"))
    return result


def _queue_levers(f, r, s, flags) -> list[dict[str, Any]]:
    return [make_lever(None, None, None, "a window under load tells a full KV cache from the running-requests cap",
                       "the root cause, KV cache or cap, with its setting",
                       action=_task("metrics", [("WINDOW", 30)]) + " while the load is on"),
            make_lever(None, None, None, "the load is more than one server runs at once",
                       "queue wait falls as the load spreads",
                       action=f"add replicas or data-parallel engines ({flags['dp']})")]


def _prefix_off_levers(f, r, s, flags) -> list[dict[str, Any]]:
    on = "drop the flag" if r.engine == "sglang" else True
    current = Known(f["current"], f["current_source"], "")
    return [make_lever(f["setting"], current, on, (
        f"prompts of {tokens_text(r.prompt_tokens_mean)} tokens are computed in full; a shared start (system prompt, "
        "tools, history) is computed once and then read from the cache"),
        "prefill time and TTFT fall by the share of each prompt that is shared (unknown while the cache is off: "
        "the hit rate after the change tells it)")]


def _prefix_unstable_levers(f, r, s, flags) -> list[dict[str, Any]]:
    return [make_lever(None, None, None, (
        "the cache reuses only an identical start; put the shared instructions, tools and history first and "
        "byte-identical in every request, and move timestamps, ids and user names after them"),
        "hit rate up to the shared share of each prompt, and TTFT down by as much; resend one prompt twice and "
        "vllm:prefix_cache_hits_total (SGLang: sglang:cached_tokens_total) grows by its shared length",
        action="make the prompts' start stable (client side)")]


def _prefill_levers(f, r, s, flags) -> list[dict[str, Any]]:
    result = []
    batched, prompt, steps = s["max_num_batched_tokens"], r.prompt_tokens_mean, prefill_steps(r, s)
    if steps:
        proposed = power_of_two(prompt)
        result.append(make_lever(flags["batched"], batched, proposed,
                                 f"prompts of {prompt:,.0f} tokens take {steps} steps each",
                                 "each prompt prefills in one step, so TTFT falls; tokens of running requests stall "
                                 "longer behind it (ITL p99 rises)"))
    tp = s.get("tensor_parallel_size")
    result.append(make_lever(flags["tp"], tp, tp.value * 2 if tp and tp.value else None,
                             "prefill is compute-bound: twice the GPUs share its work",
                             "prefill time and TTFT down by up to half (less what the GPUs spend talking)"))
    result.append(make_lever(None, None, None, "FP8 tensor cores (compute capability 8.9+) prefill faster than BF16",
                             f"faster prefill and TTFT; check accuracy with {_task('accept')}",
                             action=f"FP8 weights ({flags['quant']} fp8)"))
    return result


def _decode_levers(f, r, s, flags) -> list[dict[str, Any]]:
    if f["setting"] == flags["batched"]:
        known = s["max_num_batched_tokens"]
        return [make_lever(f["setting"], known, max(known.value // 2, 512) if known.value else None,
                           "smaller prefill chunks interrupt decoding for less time",
                           "shorter stalls (ITL p99 down), each prompt in more steps (TTFT up)", toward="lower")]
    if f["setting"] == flags["seqs"]:
        known, running = s["max_num_seqs"], r.running_mean or r.running_peak
        return [make_lever(f["setting"], known, power_of_two(running / 2),
                           "a smaller batch reads the KV of fewer requests per step",
                           "faster tokens for each request, less throughput in all; the rest queues")]
    return [make_lever(None, None, None, "at small batch most of each step is reading weights",
                       "more tokens per step per request (speculative decoding gains fall as batch grows)",
                       action=f"speculative decoding ({flags['spec']})"),
            make_lever(None, None, None, "fewer bytes read per token",
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
