"""The findings of the diagnosis (diagnosis.py): each cause the figures show, with its evidence,
its confidence, the setting it names and the cause above it (`caused_by`), and their order, the
root first, then what it causes.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from rooflib.server.deployment import EXPORTED, UNKNOWN, Known
from rooflib.server.known_settings import (
    EXPLICIT_KV,
    FLAGS,
    FREE_SLOTS,
    KV_FULL,
    KV_ROOM,
    LARGE_BATCH,
    PREFIX_LONG_PROMPT,
    PREFIX_LOW,
    QUEUE_SHARE,
    RANK,
    STALL_RATIO,
    VLLM_DEFAULT_MAX_NUM_SEQS,
    above_target,
    engine_flags,
    held_tokens,
    ms,
    over_target,
    pct,
    quantile_text,
    queue_share,
    said,
    tokens_text,
)
from rooflib.server.reading import Reading

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
    held = held_tokens(r)
    little = ""
    if held is not None and kv_tokens:
        little = (f"the {r.running_mean:.1f} requests running on average (Little's law over the window) held "
                  f"about {held:,.0f} of {kv_tokens:,} KV tokens ({footprint:,.0f} per request)")
        if held >= kv_tokens / 2 or (kv_max or 0) >= KV_FULL:
            return "kv_cache", little, "high: histograms of the window and the exported cache size"
    taken = _most_running(r)
    if seqs.source == EXPORTED and seqs.value and taken is not None and seqs.value - taken >= FREE_SLOTS \
            and (kv_max or 0) < KV_FULL:
        # Slots were free: the KV cache or the step's token budget held them, the cache where it
        # has no room for the next requests of the mean size.
        if fit is not None and fit < taken + FREE_SLOTS:
            return "kv_cache", (f"at most {taken:.0f} ran of the {seqs.value} the cap allows, with no room in the "
                                "cache for two more"), \
                "medium: the exported cap and cache size against the finished requests' lengths"
        return "prefill", _budget_evidence(r, s, taken), \
            "high: the exported cap against every count of requests running at once"
    if little:
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


def _most_running(r: Reading) -> float | None:
    """The most requests any figure saw running at once: the busiest gauge sample, one where others
    waited, the mean over the window (Little's law)."""
    counts = [c for c in (r.running_peak, r.running_while_waiting, r.running_mean) if c is not None]
    return max(counts) if counts else None


def _budget_evidence(r: Reading, s: Mapping[str, Known], taken: float) -> str:
    """Why requests waited with slots free: the engine starts a waiting request only when its
    step's token budget has room after the running requests (vLLM's scheduler stops admitting at a
    budget of 0, vllm/v1/core/sched/scheduler.py; SGLang's PrefillAdder at --chunked-prefill-size
    and the KV it reserves for the running requests' next tokens), and long prompts fill it."""
    flags = engine_flags(r, s)
    budget = f"{flags['batched']} {said(s['max_num_batched_tokens'])}"
    return (f"requests waited while at most {taken:.0f} ran of the {s['max_num_seqs'].value} that "
            f"{flags['seqs']} allows ({s['max_num_seqs'].how}) and the KV cache had room: a waiting request "
            f"starts only when a step's token budget ({budget}) has room left by the prefills of the "
            "requests ahead of it" + (" (SGLang also while the KV it reserves for the running requests' next "
                                      "tokens leaves room)" if r.engine == "sglang" else ""))


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
    flags, slo = engine_flags(r, s), r.slo
    queue, e2e, ttft = r.queue_ms, r.e2e_ms, r.ttft_ms
    share = queue_share(r)
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
            f"requests wait {'for the prefills ahead' if limit == 'prefill' else 'for a slot'}: queue mean "
            f"{ms(queue.mean)} = {pct(share)} of e2e (p95 "
            f"{quantile_text(queue, 'p95')}); TTFT p95 {quantile_text(ttft, 'p95')}" + (
                "" if limit else "; these figures cannot tell the KV cache from the running-requests cap")),
            HIGH if limit else "low: which limit holds the requests is not known", limit))
    found += _prefix_findings(r, s, flags, limit == "kv_cache")
    prefix_root = next((f["kind"] for f in found if f["kind"].startswith("prefix_")), None)
    # Requests held by prefills (limit "prefill") make the prefill finding whatever the targets say:
    # it is the cause of their queue.
    if (limit == "prefill" and queued) or (not queued and over_target(ttft, "p95", slo.ttft_p95_ms)):
        steps = prefill_steps(r, s)
        # Prompts split over several engine steps are a measured cause of their own: it leads a low
        # hit rate whose gain depends on what the prompts share (the cache being off still leads).
        cause = None if steps and prefix_root == "prefix_unstable" else prefix_root
        found.append(_finding("prefill", (
            (f"{evidence}; TTFT p95 {quantile_text(ttft, 'p95')}" if limit == "prefill" and queued else
             f"{above_target(ttft, 'p95', slo.ttft_p95_ms, 'TTFT')} with little queueing (queue {pct(share)} of e2e)")
            + (f": prefill mean {ms(r.prefill_ms.mean)}" if r.prefill_ms.mean is not None else "")
            + f", prompts of {tokens_text(r.prompt_tokens_mean)} tokens on average"
            + (f", {steps} engine steps each under {flags['batched']} {said(s['max_num_batched_tokens'])}"
               if steps else "")), HIGH, cause,
            flags["batched"] if steps else None, s["max_num_batched_tokens"] if steps else None))
    decode = _decode_finding(r, s, flags, next((f["kind"] for f in found if f["kind"] == "prefill"), prefix_root))
    return found + ([decode] if decode else [])


def prefill_steps(r: Reading, s: Mapping[str, Known]) -> int | None:
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
    slow = [above_target(tpot, "p95", slo.tpot_p95_ms, "TPOT")] if over_target(tpot, "p95", slo.tpot_p95_ms) else []
    slow += [above_target(itl, "p95", slo.itl_p95_ms, "ITL")] if over_target(itl, "p95", slo.itl_p95_ms) else []
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
               f"{ms(gap_mean)}, prompts of {tokens_text(r.prompt_tokens_mean)} tokens")
        decides = " (faster prefill fixes both; ITL p50 against p99 tells stalls from a slow batch)" if cause else ""
        return _finding("decode", f"{text}: {why}{decides}", HIGH, cause,
                        None if cause or r.engine != "vllm" else flags["batched"],
                        None if cause or r.engine != "vllm" else s["max_num_batched_tokens"])
    if running >= LARGE_BATCH:
        return _finding("decode", f"{text} with {running:.0f} requests running: each step serves a large batch", HIGH,
                        setting=flags["seqs"], known=s["max_num_seqs"])
    return _finding("decode", (f"{text} with {running:.1f} requests running on average: decode is bound by "
                               f"reading weights and KV per step; generation {tokens_text(r.gen_tok_s)} tok/s, "
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
