"""From outcomes to a run's figures: TTFT, TPOT, ITL, e2e, the client's validity, the SLO verdict."""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_SERVER
from rooflib.core.stats import summarize
from rooflib.load import sessions
from rooflib.load.apis import APIS
from rooflib.load.request_outcome import ERROR_KINDS, Outcome
from rooflib.server.slo_targets import Targets

SCHEMA_VERSION = 1

# The client's event-loop lag delays each timestamp it takes by up to the lag: TTFT, e2e and an
# ITL gap by as much, TPOT (the decode span over the tokens after the first) by the lag over those
# tokens, so TPOT's is judged against the decode span. A lag above both this floor and LAG_SHARE of
# a figure's median may distort that figure.
LAG_FLOOR_MS = 1.0


LAG_SHARE = 0.10


# The verdict stands on these figures' p95: a lag that may distort one makes the run invalid; one
# that may distort only the others is a warning that names them. A pooling API's (embeddings,
# score) stands on its request latency.
VERDICT_FIGURES = ("ttft_ms", "tpot_ms")


POOLING_VERDICT_FIGURES = ("e2e_ms",)


FIGURE_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "e2e"}


# Client stalls (lag above the threshold) may cover at most this share of the run. On a busy
# 2-core machine, task bench:calibrate runs with 3% and 7% of their time in stalls stayed within
# 0.3% of the truth at p50 and p95 (the server stalled with the client: nothing was waiting),
# one with 34% had TTFT p50 21% off. Above STALL_WARN the run says how much it stalled.
STALL_SHARE = 0.10


STALL_WARN = 0.01


EPOLL_ROUNDING_MS = 1.0


DEFINITIONS = {
    "ttft_ms": "request sent -> first chunk with content (role-only chunks excluded) = vLLM TTFT",
    "tpot_ms": "(e2e - ttft)/(output_tokens - 1) per request = vLLM/SGLang TPOT = AIPerf ITL = GuideLLM ITL",
    "itl_ms": "per-chunk gaps between content chunks, pooled = vLLM ITL = AIPerf ICL",
    "itl_token_ms": "each chunk gap divided over the tokens the chunk carried (server usage deltas)",
    "e2e_ms": "request sent -> last content chunk; embeddings and score: request sent -> the answer's last byte "
              "(the request latency)",
    "latency_per_input_token_ms": "embeddings and score: each request's latency divided by its prompt tokens "
                                  "(the server's usage)",
    "pairs_s": "score: (query, document) pairs scored per second",
    "percentiles": "linear interpolation (numpy default), n = samples",
}


def stalls(lag_ms: Sequence[float], threshold: float, wall_s: float) -> dict[str, Any]:
    """The client's stalls: lag samples above the threshold, their total and share of the run.
    The probe takes a sample every 5 ms when the loop is free but one per stall, so a count
    of samples (a p95) hides long stalls: their time does not."""
    long = [x for x in lag_ms if x > threshold]
    total_s = sum(long) / 1e3
    return {"count": len(long), "total_s": total_s, "worst_ms": max(long, default=0.0),
            "share": total_s / wall_s if wall_s else 0.0}


def lag_limits(ttft: dict[str, Any], decode: dict[str, Any], itl: dict[str, Any],
               e2e: dict[str, Any]) -> dict[str, float]:
    """The client lag each measured figure tolerates, in ms: LAG_SHARE of its median (TPOT's of
    the median decode span), at least LAG_FLOOR_MS. A median of 0 (streams that came in one read)
    has no size to judge against: its figure is left out, and the run warns of those streams."""
    medians = {"ttft_ms": ttft["p50"], "tpot_ms": decode["p50"], "itl_ms": itl["p50"], "e2e_ms": e2e["p50"]}
    return {name: max(LAG_FLOOR_MS, LAG_SHARE * median) for name, median in medians.items() if median}


def distorted(lag: dict[str, Any], limits: dict[str, float], lag_ms: Sequence[float],
              wall_s: float) -> dict[str, str]:
    """The figures the client's lag may distort, each with why: its p95 above the figure's limit,
    or stalls above it over STALL_SHARE of the run."""
    found = {}
    for name, limit in limits.items():
        stalled = stalls(lag_ms, limit, wall_s)
        if lag["p95"] is not None and lag["p95"] > limit:
            found[name] = f"lag p95 {lag['p95']:.2f} ms > {limit:.2f} ms"
        elif stalled["share"] > STALL_SHARE:
            found[name] = f"stalls over {limit:.2f} ms in {stalled['share']:.0%} of the run"
    return found


def client_validity(lag: dict[str, Any], limits: dict[str, float], schedule_delay: dict[str, Any],
                    cpu_util: float, lag_ms: Sequence[float] = (), wall_s: float = 0.0,
                    verdict_figures: Sequence[str] = VERDICT_FIGURES) -> tuple[bool, float, list[str]]:
    """Is the client's own delay small against the figures the verdict stands on? (valid,
    threshold ms, reasons). The threshold is the smallest of their limits (lag_limits).

    The verdict stands on p95 figures, so the lag's p95 decides, and so does the share of the
    run the client spent stalled; a p99 above the threshold only earns a warning (see analyse)."""
    judged = [name for name in verdict_figures if name in limits]
    figure = min(judged, key=limits.get) if judged else None
    threshold = limits[figure] if figure else LAG_FLOOR_MS
    median = {"ttft_ms": "the median TTFT", "e2e_ms": "the median request latency"}.get(
        figure, "the median decode span, over which TPOT is taken")
    size = f" ({LAG_SHARE:.0%} of {median})" if figure and threshold > LAG_FLOOR_MS else ""
    reasons = []
    stalled = stalls(lag_ms, threshold, wall_s)
    if stalled["share"] > STALL_SHARE:
        reasons.append(f"the client stalled {stalled['total_s']:.1f} s of the {wall_s:.1f} s run "
                       f"({stalled['share']:.0%}, worst {stalled['worst_ms']:.0f} ms, over {threshold:.2f} ms{size}): "
                       "requests in flight then were timed late; run the client on a quieter core or with --workers")
    if lag["p95"] is not None and lag["p95"] > threshold:
        cause = (f"the client used {cpu_util:.0%} of a core: use --workers" if cpu_util > 0.5 else
                 f"the client used only {cpu_util:.0%} of a core: other processes kept it waiting; "
                 "run it on a quieter machine or core")
        reasons.append(f"client event-loop lag p95 {lag['p95']:.2f} ms > {threshold:.2f} ms{size}; {cause}")
    # A timer may fire up to a millisecond late by asyncio's own rounding: sends that late are on time.
    if schedule_delay["p95"] is not None and schedule_delay["p95"] > threshold + EPOLL_ROUNDING_MS:
        reasons.append(f"open-loop sends ran late: schedule delay p95 {schedule_delay['p95']:.2f} ms "
                       f"> {threshold + EPOLL_ROUNDING_MS:.2f} ms: the client could not keep the rate")
    return not reasons, threshold, reasons


def slo_check(ttft_p95: float | None, tpot_p95: float | None, slo: Targets, latency_p95: float | None = None,
              latency_slo_ms: float | None = None) -> dict[str, Any]:
    """Each target set, against what was measured (latency: the request's e2e)."""
    checks = {}
    for name, target, value in (("ttft_p95_ms", slo.ttft_p95_ms, ttft_p95), ("tpot_p95_ms", slo.tpot_p95_ms, tpot_p95),
                                ("latency_p95_ms", latency_slo_ms, latency_p95)):
        if target is not None:
            checks[name] = {"target": target, "measured": value,
                            "met": value is not None and value <= target}
    return checks


def generates(config: dict[str, Any]) -> bool:
    """Whether the run's API streams generated tokens (else it is a pooling API: embeddings, score)."""
    return APIS[config.get("endpoint") or "completions"].generates


def analyse(outcomes: Sequence[Outcome], config: dict[str, Any], lag_ms: Sequence[float],
            cpu_s: float, wall_s: float, interrupted: bool = False, slo: Targets | None = None,
            client: dict[str, Any] | None = None, latency_slo_ms: float | None = None) -> dict[str, Any]:
    """The run's result document (--json), from per-request outcomes: `config` is the run's
    settings as the document records them, `slo` the targets it is judged against (None: none),
    `latency_slo_ms` the request latency's p95 target. The client's self-check is measured from
    `lag_ms`, `cpu_s` and `wall_s`, unless `client` gives it (a merged run's: the self-checks its
    shards made, rooflib/load/merging.py). A pooling API's requests have a latency (e2e), no TTFT,
    TPOT or ITL."""
    slo = slo or Targets()
    measured = [o for o in outcomes if not o.warmup]
    done = [o for o in measured if o.ok]
    failed = [o for o in measured if not o.ok]
    errors = error_counts(failed)
    streamed = done if generates(config) else []
    ttft = summarize(o.ttft_ms for o in streamed)
    tpot = summarize(o.tpot_ms for o in streamed if o.tpot_ms is not None)
    itl, e2e = summarize(g for o in streamed for g in o.chunk_gaps_ms()), summarize(o.e2e_ms for o in done)
    decode = summarize(o.e2e_ms - o.ttft_ms for o in streamed if o.tpot_ms is not None)
    if client is None:
        client = client_section(measured, config, lag_ms, cpu_s, wall_s, lag_limits(ttft, decode, itl, e2e), errors)
    checks = slo_check(ttft["p95"], tpot["p95"], slo, e2e["p95"], latency_slo_ms)
    verdict, reasons = judge(measured, done, failed, errors, client["valid"], checks)
    return {
        "kind": "bench",
        "schema_version": SCHEMA_VERSION,
        "verdict": verdict,
        "verdict_reasons": client["invalid_reasons"] + reasons if verdict == "INVALID" else reasons,
        "slo": checks,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "reasoning": reasoning_summary(done),
        "itl_ms": itl,
        "itl_token_ms": summarize(g for o in streamed for g in o.token_gaps_ms()),
        "e2e_ms": e2e,
        "latency_per_input_token_ms": None if streamed or not done else summarize(
            o.e2e_ms / o.prompt_tokens for o in done if o.prompt_tokens),
        "throughput": throughput(done, slo, latency_slo_ms, pairs=config.get("endpoint") == "score"),
        "requests": requests_section(outcomes, measured, done, failed, errors, config),
        "config": config,
        "client": client,
        "warnings": request_warnings(done, config) + client_warnings(client, ttft) + reading_warnings(done, e2e),
        "interrupted": interrupted,
        "definitions": DEFINITIONS,
        "samples": samples(done, streamed),
        "sessions": sessions.reuse(measured) if has_sessions(config) else None,
    }


def error_counts(failed: Sequence[Outcome]) -> dict[str, int]:
    """Failed requests by kind of error, the kinds that occurred, in ERROR_KINDS order."""
    errors = {kind: sum(o.error == kind for o in failed) for kind in ERROR_KINDS}
    return {k: v for k, v in errors.items() if v}


def client_section(measured: Sequence[Outcome], config: dict[str, Any], lag_ms: Sequence[float], cpu_s: float,
                   wall_s: float, limits: dict[str, float], errors: dict[str, int]) -> dict[str, Any]:
    """The client's own figures (loop lag, schedule delay, stalls, CPU), whether they leave the
    run valid, and the figures the lag may distort (`limits`: what each figure tolerates)."""
    lag = summarize(lag_ms)
    schedule = summarize((o.sent_ns - o.scheduled_ns) / 1e6 for o in measured
                         if o.scheduled_ns is not None and not config.get("concurrency"))
    cpu_util = cpu_s / wall_s if wall_s else 0.0
    # Worker processes each probe their own loop: their stalls add up over workers x wall time.
    probed_s = wall_s * config.get("workers", 1)
    valid, threshold, invalid_reasons = client_validity(lag, limits, schedule, cpu_util, lag_ms, probed_s,
                                                        VERDICT_FIGURES if generates(config) else POOLING_VERDICT_FIGURES)
    if errors.get("client_fd_limit"):
        valid = False
        # First: it makes the run invalid whatever else the client did (a busy host may also have
        # stalled it), and no other remedy helps before it.
        invalid_reasons.insert(0, f"the client ran out of file descriptors for {errors['client_fd_limit']} requests: "
                                  "raise the limit (ulimit -n 65536) and run again; the server is not at fault")
    return {"valid": valid, "invalid_reasons": invalid_reasons, "loop_lag_ms": lag,
            "lag_threshold_ms": threshold, "lag_limits_ms": limits,
            "distorted": distorted(lag, limits, lag_ms, probed_s), "schedule_delay_ms": schedule,
            "stalls": stalls(lag_ms, threshold, probed_s),
            "cpu_util": cpu_util,
            "transport": "raw asyncio HTTP/1.1, keep-alive, TCP_NODELAY"}


def judge(measured: Sequence[Outcome], done: Sequence[Outcome], failed: Sequence[Outcome],
          errors: dict[str, int], client_valid: bool, checks: dict[str, Any]) -> tuple[str, list[str]]:
    """The verdict and its reasons (failures, missed targets); an INVALID run adds the client's."""
    reasons = []
    if failed:
        reasons.append(f"{len(failed)} of {len(measured)} requests failed ({', '.join(f'{k} {v}' for k, v in errors.items())})")
    reasons += [f"{name} {c['measured']:.1f} ms > {c['target']:g} ms" if c["measured"] is not None
                else f"{name}: nothing measured" for name, c in checks.items() if not c["met"]]
    # Failed requests are facts whatever the client's lag; SLO figures are not when it lagged.
    if errors.get("client_fd_limit"):
        verdict = "INVALID"
    elif measured and not done:
        verdict = "ERROR"
    elif failed:
        verdict = "FAIL"
    elif not client_valid:
        verdict = "INVALID"
    elif reasons:
        verdict = "FAIL"
    else:
        verdict = "PASS" if checks else "NO SLO"
    return verdict, reasons


def meets_slo(outcome: Outcome, slo: Targets, latency_slo_ms: float | None = None) -> bool:
    """Whether one request alone kept within the targets (goodput counts those)."""
    return ((slo.ttft_p95_ms is None or outcome.ttft_ms <= slo.ttft_p95_ms) and
            (slo.tpot_p95_ms is None or outcome.tpot_ms is None or outcome.tpot_ms <= slo.tpot_p95_ms) and
            (latency_slo_ms is None or outcome.e2e_ms <= latency_slo_ms))


def throughput(done: Sequence[Outcome], slo: Targets, latency_slo_ms: float | None = None,
               pairs: bool = False) -> dict[str, Any]:
    """Rates over the span from the first request sent to the last token (or answer) received;
    with `pairs` (score), the pairs scored per second, counted in the answers."""
    duration_s = 0.0
    if done:
        duration_s = (max(o.token_times[-1] for o in done) - min(o.sent_ns for o in done)) / 1e9
    total_out = sum(o.completion_tokens or 0 for o in done)
    total_in = sum(o.prompt_tokens for o in done if o.prompt_tokens is not None)
    slo_set = slo.ttft_p95_ms is not None or slo.tpot_p95_ms is not None or latency_slo_ms is not None
    return {
        "req_s": len(done) / duration_s if duration_s else None,
        "output_tok_s": total_out / duration_s if duration_s else None,
        "total_tok_s": (total_in + total_out) / duration_s if duration_s else None,
        "input_tok_s": total_in / duration_s if duration_s else None,
        "duration_s": duration_s,
        "effective_concurrency": sum(o.e2e_ms for o in done) / 1e3 / duration_s if duration_s else None,
        "peak_in_flight": peak_in_flight(done),
        "goodput_req_s": sum(meets_slo(o, slo, latency_slo_ms) for o in done) / duration_s
        if duration_s and slo_set else None,
        "pairs_s": sum(o.items or 0 for o in done) / duration_s if duration_s and pairs else None,
    }


def peak_in_flight(done: Sequence[Outcome]) -> int:
    """The most requests the client had sent and not yet read to their end at one moment: the
    load's demand on the server at its busiest, which the server's gauge samples, taken seconds
    apart, can miss."""
    ends = [(o.sent_ns, 1) for o in done] + [(o.token_times[-1], -1) for o in done]
    most = now = 0
    for _, step in sorted(ends):  # at a tie the end (-1) sorts first: a request sent as one ends is not two
        now += step
        most = max(most, now)
    return most


def short_outputs(done: Sequence[Outcome], out_tokens: int) -> list[Outcome]:
    """Requests that returned fewer tokens than they asked for (ignore_eos not honoured)."""
    return [o for o in done if (o.completion_tokens or 0) < (o.requested_tokens or out_tokens)]


def prompt_mismatches(done: Sequence[Outcome], config: dict[str, Any]) -> list[int]:
    """Tokens off, by the server's usage, for each prompt not the length it was built to; none with
    images, whose tokens the server's count holds beside the text's (rooflib/load/images.py reports them)."""
    if (config.get("images") or {}).get("per_request"):
        return []
    return [o.prompt_tokens - o.prompt_target for o in done
            if o.prompt_target is not None and o.prompt_tokens is not None and o.prompt_tokens != o.prompt_target]


def cached_counts(done: Sequence[Outcome]) -> list[int]:
    """Cached prompt tokens of each request that hit the prefix cache."""
    return [o.cached_tokens for o in done if o.cached_tokens]


# Only answers that carry usage.prompt_tokens_details.cached_tokens count cached prompt tokens:
# vLLM sends it with --enable-prompt-tokens-details, SGLang with --enable-cache-report.
NO_CACHED_COUNT = ("no answer carried usage.prompt_tokens_details.cached_tokens (vLLM sends it with "
                   "--enable-prompt-tokens-details, SGLang with --enable-cache-report): the server's prefix-cache "
                   "counters (server.metrics.prefix_cache_hit_rate) tell the hits")


def cached_total(done: Sequence[Outcome]) -> int | None:
    """Prompt tokens the server said it took from its prefix cache; None when no answer said
    (0 would claim that nothing hit)."""
    reported = [o.cached_tokens for o in done if o.cached_tokens is not None]
    return sum(reported) if reported else None


def has_sessions(config: dict[str, Any]) -> bool:
    """Whether the run sent sessions of turns, each with its history (agent sessions, --multi-turn)."""
    return config.get("workload") == "sessions" or bool(config.get("agent_turns")) or (config.get("multi_turn") or 1) > 1


def is_synthetic(config: dict[str, Any]) -> bool:
    """Whether the run's prompts were built to chosen lengths (not a dataset's or a trace's)."""
    return config.get("workload", "synthetic") == "synthetic"


def requests_section(outcomes: Sequence[Outcome], measured: Sequence[Outcome], done: Sequence[Outcome],
                     failed: Sequence[Outcome], errors: dict[str, int], config: dict[str, Any]) -> dict[str, Any]:
    """Counts of requests and tokens, and the first errors."""
    out_tokens = config["output_tokens"] if generates(config) else 0
    short = short_outputs(done, out_tokens)
    target_in = config["input_tokens"] if is_synthetic(config) and not config.get("input_dist") \
        and config.get("endpoint") != "score" else None
    prompt_lens = summarize(o.prompt_tokens for o in done if o.prompt_tokens is not None)
    return {
        "sent": len(measured), "completed": len(done), "failed": len(failed), "errors": errors,
        "warmup": len(outcomes) - len(measured),
        "output_tokens": {"requested": out_tokens, "requested_total": sum(o.requested_tokens or out_tokens for o in done),
                          "total": sum(o.completion_tokens or 0 for o in done), "short": len(short),
                          "ignore_eos_honoured": not short},
        "prompt_tokens": {"target": target_in, **{k: v for k, v in prompt_lens.items() if k in ("mean", "min", "max", "n")},
                          "mismatched": len(prompt_mismatches(done, config))},
        "cached_prompt_tokens": cached_total(done),
        "cached_prompt_tokens_note": NO_CACHED_COUNT if done and cached_total(done) is None else None,
        "one_read": len(in_one_read(done)),
        "tokens_per_chunk": summarize(k for o in done for k in o.chunk_tokens),
        "first_errors": [f"#{o.index} {o.error}: {o.detail}" for o in failed[:5]],
        "rejected": rejections(measured, failed),
    }


# Error kinds of a request the server refused (an HTTP 4xx), not one it failed to serve.
REJECTION_KINDS = ("http_4xx", "wrong_model")


# What vLLM ("This model's maximum context length is N tokens") and SGLang ("... is longer than
# the model's context length ...") answer a request longer than max_model_len, lower-cased.
CONTEXT_LENGTH_WORDS = "context length"


def rejection_cause(detail: str) -> str:
    """Why the server refused a request, from its error detail: context_length or other."""
    return "context_length" if CONTEXT_LENGTH_WORDS in detail.lower() else "other"


def rejections(measured: Sequence[Outcome], failed: Sequence[Outcome]) -> dict[str, Any]:
    """The measured requests the server refused (bench --over-limit measures how many): their
    count, share, causes, and the first one's error detail."""
    rejected = [o for o in failed if o.error in REJECTION_KINDS]
    return {"count": len(rejected), "share": len(rejected) / len(measured) if measured else 0.0,
            "by_cause": dict(Counter(rejection_cause(o.detail) for o in rejected)),
            "first_body": rejected[0].detail if rejected else None}


def request_warnings(done: Sequence[Outcome], config: dict[str, Any]) -> list[str]:
    """What the server's answers say about the figures: short outputs, unknown chunk sizes, no
    usage, prompts off their length, prefix-cache hits on unique prompts."""
    warnings = []
    if not generates(config):  # a pooling answer: no output tokens, no chunks
        return ["the server sent no usage: the input tokens and the latency per input token are unknown"] \
            if any(not o.usage_reported for o in done) else []
    short = short_outputs(done, config["output_tokens"])
    if short:
        warnings.append(f"ignore_eos not honoured: {len(short)} of {len(done)} requests returned fewer "
                        f"tokens than asked (finish_reason: "
                        f"{', '.join(sorted({str(o.finish_reason) for o in short}))}); TPOT holds, throughput is lower")
    uneven = [o for o in done if o.usage_reported and sum(o.chunk_tokens) != o.completion_tokens]
    if uneven:
        warnings.append(f"{len(uneven)} requests had chunks of unknown size (no per-chunk usage: SGLang "
                        "without continuous_usage_stats, the Responses and Messages APIs): ITL per token counts one "
                        "token per chunk there")
    if any(not o.usage_reported for o in done):
        warnings.append("the server sent no usage: output tokens counted as content chunks "
                        "(an undercount when a chunk carries several tokens)")
    mismatched = prompt_mismatches(done, config)
    if mismatched and config.get("prompt_tokenizer", "").startswith("server"):
        warnings.append(f"{len(mismatched)} prompts were not the length they were built to by the server's usage "
                        f"(off by {min(mismatched)}..{max(mismatched)} tokens)")
    cached = cached_counts(done)
    if cached and not config.get("shared_prefix") and is_synthetic(config) and not has_sessions(config):
        warnings.append(f"{len(cached)} requests hit the prefix cache although prompts were unique "
                        f"(up to {max(cached)} cached tokens)")
    return warnings


def client_warnings(client: dict[str, Any], ttft: dict[str, Any]) -> list[str]:
    """Client delays too small to make a valid run invalid, but that some figures may carry."""
    if not client["valid"]:
        return []
    warnings = []
    lag, threshold, stalled = client["loop_lag_ms"], client["lag_threshold_ms"], client["stalls"]
    schedule = client["schedule_delay_ms"]
    if lag["p99"] is not None and lag["p99"] > threshold:
        warnings.append(f"client event-loop lag p99 {lag['p99']:.2f} ms > {threshold:.2f} ms: "
                        "p99 figures may include client delay (p95 ones do not)")
    if stalled["share"] > STALL_WARN or stalled["worst_ms"] > max(threshold, 0.5 * (ttft["p50"] or 0)):
        warnings.append(f"the client stalled {stalled['total_s']:.2f} s in all ({stalled['share']:.1%} of the run, "
                        f"worst {stalled['worst_ms']:.0f} ms): requests in flight then may carry that delay "
                        f"(the run stays valid below {STALL_SHARE:.0%} of its time in stalls)")
    if schedule["p99"] is not None and schedule["p99"] > threshold + EPOLL_ROUNDING_MS:
        warnings.append(f"open-loop sends ran late: schedule lag p99 {schedule['p99']:.2f} ms: the slowest "
                        "1% of arrivals were bunched (p95 kept to the schedule)")
    if client["distorted"]:
        warnings.append("the client's own delay may distort " + "; ".join(
            f"{FIGURE_NAMES[name]} ({why})" for name, why in client["distorted"].items())
            + f": a figure tolerates a lag of {LAG_SHARE:.0%} of its median (at least {LAG_FLOOR_MS:g} ms); TTFT and "
            "TPOT, which the verdict stands on, are within theirs")
    return warnings


def in_one_read(done: Sequence[Outcome]) -> list[Outcome]:
    """Streams of several tokens whose tokens all arrived in one read: buffered on the way, or a stalled client."""
    return [o for o in done if (o.completion_tokens or 0) > 1 and o.token_times[0] == o.token_times[-1]]


def reading_warnings(done: Sequence[Outcome], ttft: dict[str, Any]) -> list[str]:
    """How to read the figures: TPOT of streams that came in one read, percentiles of few samples."""
    warnings = []
    one_read = in_one_read(done)
    if one_read:
        warnings.append(f"{len(one_read)} requests received all their output in one read (TPOT 0.0 ms): a proxy "
                        "or the server buffered the stream, or the client stalled; their TPOT is not a decode time")
    if 0 < ttft["n"] < 100:
        warnings.append(f"n = {ttft['n']}: p99 is about the maximum" + (", p95 too" if ttft["n"] < 20 else ""))
    return warnings


def reasoning_summary(done: Sequence[Outcome]) -> dict[str, Any] | None:
    """Reasoning models: time to the first answer token, token counts and TPOT of each part;
    None when no request reasoned."""
    reasoned = [o for o in done if o.reasoning_seen]
    if not reasoned:
        return None
    return {"requests": len(reasoned), "answered": sum(o.answer_at is not None for o in reasoned),
            "ttft_answer_ms": summarize(o.ttft_answer_ms for o in reasoned if o.ttft_answer_ms is not None),
            "reasoning_tokens": summarize(o.reasoning_tokens for o in reasoned),
            "answer_tokens": summarize(o.answer_tokens for o in reasoned),
            "tpot_reasoning_ms": summarize(o.tpot_reasoning_ms for o in reasoned if o.tpot_reasoning_ms is not None),
            "tpot_answer_ms": summarize(o.tpot_answer_ms for o in reasoned if o.tpot_answer_ms is not None)}


def samples(done: Sequence[Outcome], streamed: Sequence[Outcome]) -> dict[str, list[float | None]]:
    """Per-request figures of the completed measured requests, in request order, for
    compare.py's bootstrap (compact: 0.01 ms); `streamed`: those with TTFT and TPOT (none of a
    pooling API's)."""
    def r(value: float | None) -> float | None:
        return None if value is None else round(value, 2)
    return {"ttft_ms": [r(o.ttft_ms) for o in streamed], "tpot_ms": [r(o.tpot_ms) for o in streamed],
            "e2e_ms": [r(o.e2e_ms) for o in done],
            **({"ttft_answer_ms": [r(o.ttft_answer_ms) for o in done]} if any(o.reasoning_seen for o in done) else {})}


def exit_code(result: dict[str, Any]) -> int:
    if result["interrupted"]:
        return EXIT_INTERRUPTED
    return {"ERROR": EXIT_SERVER, "INVALID": EXIT_INVALID,
            "FAIL": EXIT_CHECK_FAILED}.get(result["verdict"], EXIT_OK)
