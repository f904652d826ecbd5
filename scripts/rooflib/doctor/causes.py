"""What causes the part of the path that holds the figure: its owner (an engine setting with
its current value and how it is known, or the component outside the engine), the value to set
with its reason, and the effect to expect.

Inside the engine the engine's own diagnosis (rooflib/server/diagnosis.py) names the limit
(the running cap or the KV cache for a queue, the prefix cache for prefill); outside it the
probe's timings name the component.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from rooflib.doctor import failures, tradeoff
from rooflib.doctor.budget import Budget, Facts, end_lag_ms, events_per_read, median, ok_streams, tokens_per_event
from rooflib.doctor.evidence import Finding, Owner, Segment, Setting

ENGINE = "the engine"
STREAM_FLAG = {"vllm": "--stream-interval", "sglang": "--stream-interval"}
MODEL_LEN_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length"}
SEQS_FLAG = {"vllm": "--max-num-seqs", "sglang": "--max-running-requests"}
# The engines' admission limits, which answer 503 at the engine's door by design (a load balancer
# then retries elsewhere): vLLM 0.32's --max-num-queued-reqs (requests waiting or running) and
# --max-num-queued-tokens (prompt tokens still in prefill), AsyncLLM.check_admission in
# vllm/v1/engine/async_llm.py; SGLang's --max-queued-requests (requests waiting),
# Scheduler._abort_on_queued_limit. Keyed by vllm:admission_rejections_total's reason label.
ADMISSION_FLAG = {"max_num_queued_reqs": {"vllm": "--max-num-queued-reqs", "sglang": "--max-queued-requests"},
                  "max_num_queued_tokens": {"vllm": "--max-num-queued-tokens"}}
# The settings the engine diagnosis names, by the flag it prints (known_settings.FLAGS).
SETTING_OF_FLAG = {"--max-num-seqs": "max_num_seqs", "--max-running-requests": "max_num_seqs",
                   "--max-num-batched-tokens": "max_num_batched_tokens", "--chunked-prefill-size": "max_num_batched_tokens",
                   "--enable-prefix-caching": "prefix_caching", "--disable-radix-cache": "prefix_caching",
                   "--kv-cache-memory-bytes": "kv_cache_memory_bytes", "--gpu-memory-utilization": "gpu_memory_utilization",
                   "--mem-fraction-static": "gpu_memory_utilization", "--tensor-parallel-size": "tensor_parallel_size",
                   "--tp-size": "tensor_parallel_size"}


def setting(f: Facts, name: str, flag: str) -> Setting:
    found = f.settings.get(name)
    if found is None:
        return Setting(flag, None, "unknown", "the server does not say")
    return Setting(flag, found.value, found.source, found.how, found.at_least)


def _outside(segment: Segment, cause: str, evidence: str, component: str, action: str, reason: str, effect: str,
             confidence: str) -> Finding:
    return Finding(segment.name, cause, evidence, Owner(component), None, action, reason, effect, confidence)


# ---------------------------------------------------------------------------------------------
# Outside the engine

def connect(f: Facts, seg: Segment) -> Finding:
    return _outside(seg, "network_distance", f"a TCP connect takes {seg.size:.1f} ms ({seg.share:.0%} of the figure)",
                    "the network between the clients and the server",
                    "keep connections alive in the client, or serve from nearer the clients",
                    "every new connection pays a round trip before the request leaves",
                    f"up to {seg.size:.0f} ms less per request on a kept-alive connection", "high: measured per request")


def connection_setup(f: Facts, seg: Segment) -> Finding:
    return _outside(seg, "new_connection_held", (
        f"a new connection waits {seg.size:.0f} ms after its TCP connect before its first answer, a kept-alive one "
        "does not: the server or a proxy in front does work per connection (a TLS handshake, an accept queue that "
        "fills, per-connection auth)"), f"whatever accepts connections for {f.url}",
        "keep connections alive in the clients (a pool); check the accept backlog, TLS session reuse and the proxy's "
        "per-connection work", "every request on a new connection pays it before it is read",
        f"up to {seg.size:.0f} ms less TTFT for clients that open connections", "high: the same route, new and kept alive")


def front(f: Facts, seg: Segment) -> Finding:
    connect_ms = median([s.connect_ms for s in ok_streams(f.probe)]) or 0.0
    if seg.size <= 2 * connect_ms + 2:
        return _outside(seg, "network_round_trip", (
            f"every request waits {seg.size:.1f} ms before the server answers, about one TCP connect "
            f"({connect_ms:.1f} ms): the round trip of the network"), "the network between the clients and the server",
            "serve from nearer the clients (a replica in their region)", "each request crosses the network twice",
            f"up to {seg.size:.0f} ms less TTFT", "medium: a round trip's size, not its path")
    return _outside(seg, "delay_before_routing", (
        f"every route answers {seg.size:.0f} ms late on a kept-alive connection, a missing one (404) too, while a "
        f"TCP connect takes {connect_ms:.1f} ms: the delay sits in front of the server's routing, not in the network"),
        f"a proxy, balancer or middleware in front of {f.url}",
        "find the hop that holds each request and remove the hold (a rate limiter's delay, an auth call, a proxy "
        "that buffers requests): bench the engine's own port to confirm",
        "the server answers its own routes at once; something before it adds the same time to every request",
        f"TTFT and e2e down by about {seg.size:.0f} ms for every request", "high: a missing route pays it too")


def route(f: Facts, seg: Segment) -> Finding:
    return _outside(seg, "inference_route", (
        f"the inference route answers its head {seg.size:.0f} ms later than a missing route: a gateway on the inference "
        "routes (auth, routing, rate limits) or the API server's own work before the engine (parsing, chat template, "
        "tokenizing)"), "the gateway on the inference routes, or the engine's API server",
        "bench the engine's own port: if the gap goes, the gateway adds it; if it stays, the API server does "
        "(vLLM: --api-server-count runs more API server processes)",
        "the time before the response head is spent before the engine sees the request",
        f"up to {seg.size:.0f} ms less TTFT", "medium: the difference of two heads")


def first_delivery(f: Facts, seg: Segment) -> Finding:
    first_read = [s.events_per_read[0] for s in ok_streams(f.probe) if s.events_per_read]
    if first_read and median(first_read) and median(first_read) > 1:
        return delivery(f, seg)
    return _outside(seg, "api_server_output", (
        f"the first text reached the client {seg.size:.0f} ms beyond the engine's TTFT (up to its p95), in its own "
        "read: the API server's output path (detokenizing, its event loop) or a slow client held it"),
        "the engine's API server (its output path)", "check the API server's CPU (a saturated event loop), or run "
        "more API server processes (vLLM: --api-server-count)", "the engine made the token; it left late",
        f"up to {seg.size:.0f} ms less TTFT", "medium: the engine's TTFT p95 against the probe's median")


def delivery(f: Facts, seg: Segment) -> Finding:
    streams = ok_streams(f.probe)
    tpe = tokens_per_event(streams) or 1
    epr = events_per_read(streams) or 1
    lag = end_lag_ms(f, streams)
    if epr < 2 and lag is not None:
        return _outside(seg, "slow_delivery", (
            f"the text came one event at a time, yet the streams ended {lag:.0f} ms later than the engine's token pace "
            "gives: something between the server and the client passes the stream on slower than the engine sends it"), "a proxy between the server and the clients, or a slow client",
            "find the layer that holds each event (a proxy's flow control or per-chunk work, a client that reads "
            "slowly): bench the engine's own port to confirm", "the engine streams in time; the text is late",
            f"gaps of the engine's token time, about {lag:.0f} ms earlier ends", "medium: the engine's mean gap "
            "between tokens against the probe's streams")
    return _outside(seg, "buffering", (
        f"the server sends {tpe:g} token(s) per event, but the client got {epr:.1f} events per read: a layer between "
        f"the server and the client holds the stream back and passes it on in batches ({seg.size:.0f} ms of the "
        "figure)"), "a proxy or middleware between the server and the clients that buffers responses",
        "turn off response buffering on the streaming routes (nginx: proxy_buffering off, or send X-Accel-Buffering: "
        "no; no compression of text/event-stream)", "the engine streams; the text arrives in bursts",
        "text arrives as the engine sends it: gaps of one event", "high: events counted per read")


def client(f: Facts, seg: Segment) -> Finding:
    return _outside(seg, "client_lag", (
        f"the probe's own event loop woke up to {f.probe.loop_lag_p95_ms or 0:.1f} ms late: its timestamps are that late, "
        "so this part is the measuring machine's, not the server's"), "the machine the doctor runs on",
        "run the doctor again from a quieter machine (or with fewer processes beside it)",
        "a busy client timestamps late", "the figure without the client's own lag", "high: measured in the probe")


def other(f: Facts, seg: Segment) -> Finding:
    return _outside(seg, "unexplained", f"{seg.size:.0f} ms between text arrivals that the engine's token time, its "
                    "events and the reads do not explain", "the client or the API server",
                    "check the client's own CPU and the API server's (a saturated event loop delays every event)",
                    "neither the engine's figures nor the stream's shape hold this time", "an even stream",
                    "low: what is left over")


# ---------------------------------------------------------------------------------------------
# The engine

# The engine diagnosis' findings whose change is not the engine's.
OWNER_OF_KIND = {"prefix_unstable": "the clients' prompts (what comes before their shared part varies)"}


def _from_diagnosis(f: Facts, seg: Segment, kinds: tuple[str, ...]) -> Finding | None:
    """The engine diagnosis' finding of one of `kinds` (first in its order) with its plan's lever."""
    found = next((x for x in f.diagnosis.get("findings", []) if x["kind"] in kinds), None)
    if found is None:
        return None
    plan, root = f.diagnosis.get("plan", []), f.diagnosis.get("root_cause") or {}
    # A finding with no setting owns the plan's first lever only as the diagnosis' root: behind
    # another root the first lever is that root's, not its.
    lever = next((lv for lv in plan if lv["setting"] == found["setting"]), None) if found["setting"] else \
        plan[0] if plan and root.get("kind") == found["kind"] else None
    owner_setting = None
    if found["setting"]:
        name = SETTING_OF_FLAG.get(found["setting"], "")
        known = f.settings.get(name)
        owner_setting = Setting(found["setting"], found["current"], found["current_source"] or "unknown",
                                known.how if known else "", bool(known and known.at_least))
    owner = Owner(OWNER_OF_KIND.get(found["kind"], ENGINE), owner_setting)
    return Finding(seg.name, found["kind"], found["evidence"], owner,
                   lever["proposed"] if lever else None,
                   "" if lever is None or lever["setting"] else lever["text"].split(": ")[0],
                   lever["reason"] if lever else "", lever["effect"] if lever else "", found["confidence"])


def queue(f: Facts, seg: Segment) -> Finding:
    found = _from_diagnosis(f, seg, ("kv_cache", "running_limit", "queue"))
    if found:
        return found
    return Finding(seg.name, "queue", f"requests wait {seg.size:.0f} ms for a slot", Owner(ENGINE), None,
                   "measure under load with a longer window", "", "", "low")


def prefill(f: Facts, seg: Segment) -> Finding:
    found = _from_diagnosis(f, seg, ("prefix_cache_off", "prefix_unstable", "prefill"))
    if found:
        return found
    prompt = f.engine.prompt_tokens_mean or 0
    return Finding(seg.name, "prefill", f"the engine spends {seg.size:.0f} ms computing prompts of {prompt:,.0f} tokens",
                   Owner(ENGINE), None, "shorter prompts, a shared cached prefix, or faster prefill (more GPUs)",
                   "prefill time grows with the prompt", "TTFT down with the prompt's computed part", "medium")


def decode(f: Facts, seg: Segment) -> Finding:
    """Tokens slower than the target: from the step-time model, the running cap that meets it,
    what one server makes at that cap against what arrives, and what the user gives for it."""
    e = f.engine
    seqs = setting(f, "max_num_seqs", SEQS_FLAG.get(e.engine, "--max-num-seqs"))
    ratio = (e.tpot_p95 / e.tpot_mean) if e.tpot_p95 and e.tpot_mean else 1.0
    arriving = e.gen_tok_s if (e.waiting_mean or 0) < 0.5 else None
    cap = tradeoff.cap_for(f.fit, f.targets.tpot_p95_ms, ratio, arriving) if f.fit else None
    running = e.running_mean or e.running_peak or 0
    if f.fit is None or cap is None or cap.cap >= running:
        found = _from_diagnosis(f, seg, ("decode",))
        why = f.fit_note if f.fit is None else (
            "the time per token does not grow with the batch" if f.fit.slope_ms <= 0 else
            f"the fit (per token {f.fit.intercept_ms:.2f} + {f.fit.slope_ms:.3f} ms x running) meets the target only "
            f"below one request" if cap is None else "the fit's cap is above what runs now")
        if found:
            return Finding(found.segment, found.cause, f"{found.evidence}; no smaller batch is proposed: {why}",
                           found.owner, found.proposed, found.action, found.reason, found.effect, found.confidence)
        return Finding(seg.name, "decode", f"TPOT p95 {e.tpot_p95 or 0:.1f} ms > target {f.targets.tpot_p95_ms:g} ms; {why}",
                       Owner(ENGINE), None, "faster decode: a smaller or quantized model, speculative decoding, faster "
                       "hardware", "each step reads the weights and the KV of every running request",
                       "faster tokens", "medium")
    model = f.fit
    fit_text = (f"per-token time = {model.intercept_ms:.2f} + {model.slope_ms:.3f} ms x running (fit over "
                f"{model.points} seconds, {model.running_low:.0f}-{model.running_high:.0f} running, r2 {model.r2:.2f})")
    evidence = (f"TPOT p95 {e.tpot_p95:.1f} ms > target {f.targets.tpot_p95_ms:g} ms with {running:.0f} requests running "
                f"and {e.waiting_mean or 0:.1f} waiting: each step serves too large a batch; {fit_text}")
    reason = f"at {cap.cap} running the fit gives {cap.per_token_ms:.1f} ms per token (p95 about " \
             f"{cap.per_token_ms * ratio:.1f} ms, the window's p95/mean {ratio:.2f})"
    if cap.keeps_up is False:
        effect = (f"TPOT within the target, but one server then makes {cap.tok_s_at_cap:,.0f} tok/s against "
                  f"{cap.arriving_tok_s:,.0f} tok/s arriving: at this load the queue grows without bound; "
                  f"{cap.replicas} replicas at this cap keep up")
    else:
        effect = (f"TPOT within the target; one server makes {cap.tok_s_at_cap:,.0f} tok/s at this cap" +
                  (f", enough for the {cap.arriving_tok_s:,.0f} tok/s arriving" if cap.arriving_tok_s else ""))
    return Finding(seg.name, "batch_too_large", evidence, Owner(ENGINE, seqs), cap.cap, "", reason, effect,
                   f"medium: a fit of {model.points} points")


def stream_interval(f: Facts, seg: Segment) -> Finding:
    streams = ok_streams(f.probe)
    tpe = tokens_per_event(streams) or 1
    flag = STREAM_FLAG.get(f.engine.engine, "--stream-interval")
    known = setting(f, "stream_interval", flag)
    shapes = [list(s.tokens_per_event[:6]) for s in streams[:2]]
    if known.value is None:
        known = Setting(flag, int(tpe), "inferred", f"the probe's events carried {shapes} tokens each, one event per "
                        "read: the engine sends every that many tokens")
    per_token = f.engine.itl_mean or 0
    return Finding(seg.name, "stream_interval", (
        f"streamed text arrives every {tpe:g} tokens (events of {shapes} tokens, each in its own read): the engine "
        f"holds tokens back and sends them in groups, {seg.size:.0f} ms of the gap between text arrivals"),
        Owner(ENGINE, known), 1, "", "the engine then sends each token as it is made (more events: more work for the "
        "API server at high load)", f"text about every {per_token:.0f} ms (a token) instead of a p95 gap of "
        f"{seg.size / seg.share if seg.share else seg.size:.0f} ms; TPOT unchanged", "high: tokens counted per event")


def stalls(f: Facts, seg: Segment) -> Finding:
    found = _from_diagnosis(f, seg, ("decode",))
    if found:
        return found
    return Finding(seg.name, "stalls", f"tokens stall {seg.size:.0f} ms behind prefills", Owner(ENGINE), None,
                   "smaller prefill chunks", "a long prefill holds the running requests' next token",
                   "shorter stalls", "medium")


# ---------------------------------------------------------------------------------------------
# Failures and throughput

def _users_length(f: Facts, limit: int | None, given: int | None) -> tuple[int | None, str]:
    """The prompt length of the requests the server rejects: given by the user, else estimated
    from the sizes the server counted for every request of the window. Each request is its fields
    (`fields` bytes, the probe's own less its prompt) and its prompt (`per_token` bytes a token,
    the probe's prompts'): the accepted ones' prompts are the engine's, the rest is the rejected."""
    if given:
        return given, "as you gave it (--prompt-tokens)"
    failed, total, _ = failures.failed_share(f.failures)
    sized = [s for s in f.probe.streams if s.request_bytes and s.prompt_bytes and s.prompt_tokens]
    mean_bytes, accepted = f.failures.request_bytes_mean, f.engine.prompt_tokens_mean
    if not (failed and total and sized and mean_bytes and accepted):
        return None, "not measurable here: give the users' prompt length with --prompt-tokens"
    per_token = median([s.prompt_bytes / s.prompt_tokens for s in sized]) or 1.0
    fields = median([s.request_bytes - s.prompt_bytes for s in sized]) or 0.0
    share = failed / total
    rejected = ((mean_bytes - fields) / per_token - (1 - share) * accepted) / share
    if limit and rejected <= limit:
        return None, "the request sizes do not show longer prompts: give them with --prompt-tokens"
    return int(rejected), (f"estimated from http_request_size_bytes: requests average {mean_bytes:,.0f} bytes, "
                           f"{share:.0%} are rejected, accepted prompts average {accepted:,.0f} tokens, at "
                           f"{per_token:.1f} bytes a token and {fields:,.0f} bytes of fields (the probe's own)")


def rejected(f: Facts, seg: Segment, given_prompt_tokens: int | None = None) -> Finding:
    """Requests the server refused. HTTP 400 is the context limit when a request just over it
    earns the same refusal and the users' requests are longer than the limit (given, or as their
    sizes show); other refusals are the clients' to read (a wrong model name, bad parameters)."""
    over = f.probe.over_limit
    detail = over.detail if over else ""
    cause = failures.cause_of(detail) if over and over.error else None
    if seg.name.startswith("rejected: 4") and cause == "context_length":
        known = setting(f, "max_model_len", MODEL_LEN_FLAG.get(f.engine.engine, "--max-model-len"))
        limit = known.value or failures.limit_in(detail)
        length, how = _users_length(f, limit, given_prompt_tokens)
        if length is not None or "not measurable" in how:
            return context_limit(f, seg, known, limit, length, how, detail)
        detail, cause = f"{how}, so the context limit is not why", None
    counted = max(f.failures.admission.items(), key=lambda item: item[1], default=None)
    if seg.name.startswith("rejected: 5") and counted and counted[0] in ADMISSION_FLAG:
        return admission_limit(f, seg, counted[0], (
            f"the engine counted {counted[1]:.0f} requests turned away by this limit in the window "
            f"(vllm:admission_rejections_total{{reason=\"{counted[0]}\"}}, the probe's own included)"))
    if seg.name.startswith("probe"):
        failed = [s for s in f.probe.streams if s.error]
        said = failures.cause_of(failed[0].detail) if failed else None
        if said in ADMISSION_FLAG and f.engine.engine in ADMISSION_FLAG[said]:
            return admission_limit(f, seg, said,
                                   f"the probe's requests got HTTP 503 saying \"{failed[0].detail[:160]}\"")
        return outside_failures(f, seg)
    if seg.name.startswith("rejected: 5"):
        return _outside(seg, "server_errors", f"{seg.size:.0%} of requests fail with HTTP 5xx", "the engine process",
                        "read the engine's log for the first exception (an engine core that died answers 503)",
                        "the server fails requests it accepted", "no failures once the cause is fixed", "high")
    return _outside(seg, cause or "rejected", f"{seg.size:.0%} of requests fail ({seg.name[len('rejected: '):]})"
                    + (f"; {detail[:200]}" if detail else ""),
                    "the clients' requests, or a gateway's limits", "read the error bodies the clients get (a model "
                    "name the server does not serve, bad parameters, auth)", "the server refuses them",
                    "no rejections once the requests are right", "medium")


def admission_limit(f: Facts, seg: Segment, reason: str, evidence: str) -> Finding:
    """The engine's own admission limit turns requests away with 503. The value that keeps the
    TTFT target: a request admitted behind k others waits about k / (requests finished a second),
    so the limit on requests is the running cap plus what the server finishes within the target
    less a prefill; the limit on prompt tokens is the target times the prefill rate (vLLM's own
    rule for --max-num-queued-tokens, vllm/config/scheduler.py). A limit already at that value is
    the valve working: the users offer more than one server serves within the target."""
    e, target_s = f.engine, f.targets.ttft_p95_ms / 1000
    known = setting(f, reason, ADMISSION_FLAG[reason].get(e.engine, ADMISSION_FLAG[reason]["vllm"]))
    prefill_s = (e.prefill_mean or 0) / 1000
    if reason == "max_num_queued_reqs":
        # vLLM's limit counts running requests too, SGLang's only the waiting ones.
        seqs = setting(f, "max_num_seqs", SEQS_FLAG.get(e.engine, "--max-num-seqs"))
        cap = (seqs.value or e.running_peak or 0) if e.engine == "vllm" else 0
        named = "" if not cap else f"the running cap {cap:g} plus " if seqs.value else \
            f"the {cap:g} requests running at the peak plus "
        rate = e.requests / e.seconds if e.requests and e.seconds else None
        proposed = max(1, int(cap + max(0.0, target_s - prefill_s) * rate)) if rate else None
        how = (f"{named}the {rate:.2f} requests a second the server finished times the TTFT target less a prefill "
               f"({target_s:g} - {prefill_s:.2f} s)") if rate else "not measurable here: the window finished no request"
    else:
        rate = e.prompt_tokens_mean / prefill_s if e.prompt_tokens_mean and prefill_s else None
        proposed = int(target_s * rate) if rate else None
        how = (f"the TTFT target {target_s:g} s times the prefill rate, {rate:,.0f} prompt tokens a second "
               "(a prompt's mean tokens over its mean prefill)") if rate else \
            "not measurable here: the window prefilled no prompt"
    head = (f"{seg.size:.0%} of requests fail with HTTP 503 at the engine's door: {known.flag} "
            f"{'is ' + str(known.value) if known.value is not None else '(its value is not exported)'} "
            f"turns them away; {evidence}")
    if proposed is not None and known.value is not None and proposed <= known.value:
        return Finding(seg.name, "admission_limit", f"{head}; at {known.value} it already admits what meets the "
                       f"TTFT target ({how}: {proposed})", Owner("the deployment's capacity", known), None,
                       "add replicas behind the load balancer, or lower the offered load: the limit sheds what one "
                       "server cannot serve within the target, as it is meant to",
                       "raising the limit moves the rejected requests into the queue, past the TTFT target",
                       "the rejected share served by the added replicas", "high: the engine's own counter or answer")
    return Finding(seg.name, "admission_limit", f"{head}; the value that keeps the TTFT target: {how}",
                   Owner(ENGINE, known), proposed, "" if proposed else f"raise {known.flag} or remove it",
                   "the limit rejects requests the server could still serve within the TTFT target",
                   "fewer rejections; the requests let in wait in the queue, within the TTFT target",
                   "high: the engine's own counter or answer")


def context_limit(f: Facts, seg: Segment, known: Setting, limit: int | None, length: int | None, how: str,
                  detail: str) -> Finding:
    """The context limit rejects the users' prompts: the power of two that takes them and their
    answers, and whether the KV cache holds one request of it (vLLM refuses to start otherwise)."""
    out = int(f.engine.output_tokens_mean or 0)
    proposed = 1 << math.ceil(math.log2(length + out)) if length else (limit * 2 if limit else None)
    kv = f.engine.kv_cache_tokens
    fits = "" if not (kv and proposed) else (
        f"; it fits the KV cache ({kv:,} tokens: {kv // proposed} requests of {proposed:,} at once)" if kv >= proposed
        else f"; it does NOT fit the KV cache ({kv:,} tokens < {proposed:,}): the engine would refuse to start; "
             "add KV space first (the vram task sizes it)")
    return Finding(seg.name, "context_length", (
        f"{seg.size:.0%} of requests fail with HTTP 400 before the engine runs them: prompts longer than {known.flag} "
        f"{limit} are rejected (a request just over it got: \"{detail[:160]}\"); the users' prompts: "
        f"{length or 'unknown'} tokens, {how}"),
        Owner(ENGINE, known), proposed, "", f"room for the users' prompts and answers{fits}",
        f"the rejected {seg.size:.0%} served (each holds more KV: fewer at once)", "high: the error body and the "
        "status counters")


def outside_failures(f: Facts, seg: Segment) -> Finding:
    """Probe requests that failed while the server counted no such failure: a layer in front of
    the engine answered them (a rate limiter, an auth gateway), or the connection broke on the way."""
    failed = [s for s in f.probe.streams if s.error]
    detail = failed[0].detail if failed else ""
    cause = failures.cause_of(detail) or (failed[0].error if failed else "failed")
    return _outside(seg, cause, (
        f"{seg.size:.0%} of the probe's requests failed ({seg.name[len('probe: '):]}), more than the engine's own "
        f"counters show: something in front of it answered them" + (f"; it said: \"{detail[:160]}\"" if detail else "")),
        "the gateway or proxy in front of the engine", "read its limits (a rate limit per client or key, auth) and "
        "raise them or spread the load", "the engine never saw these requests", "no such failures once the limit "
        "fits the load", "medium: the probe's own requests against the engine's counters")


def aborted(f: Facts, seg: Segment) -> Finding:
    e2e = f.engine.e2e_mean or 0
    return _outside(seg, "client_gave_up", (
        f"{seg.size:.0%} of the requests were abandoned before the end: the client went away (requests that finish "
        f"take {e2e / 1000:.1f} s on average); {seg.measured}"), "the clients (their timeout) or a proxy's read timeout",
        "raise the client's and proxies' timeouts above the requests' e2e p95, or make the requests shorter",
        "an abandoned request spent engine time and delivered nothing", "no abandoned requests",
        "medium: two counters that count a request when it ends")


def offered_load(f: Facts, seg: Segment) -> Finding:
    e = f.engine
    return _outside(seg, "offered_load", (
        f"the server keeps up: {e.running_mean or 0:.1f} requests run at a time and none wait; throughput follows the "
        f"offered load ({e.gen_tok_s or 0:,.0f} tok/s)"), "the load (clients)",
        "send more requests at once to find the ceiling: task sweep", "an idle server makes what it is asked",
        "more tok/s up to the engine's cap", "high")


EXPLAIN: Mapping[str, Callable[[Facts, Segment], Finding]] = {
    "connect": connect, "connection_setup": connection_setup, "front": front, "route": route, "first_delivery": first_delivery, "queue": queue,
    "prefill": prefill, "decode": decode, "stream_interval": stream_interval, "delivery": delivery,
    "stalls": stalls, "client": client, "other": other, "aborted": aborted, "offered_load": offered_load,
}


def explain(f: Facts, budget: Budget, seg: Segment, given_prompt_tokens: int | None = None) -> Finding:
    if seg.name.startswith(("rejected", "probe")):
        return rejected(f, seg, given_prompt_tokens)
    return EXPLAIN[seg.name](f, seg)


def as_json(finding: Finding) -> dict[str, Any]:
    owner = finding.owner
    return {"segment": finding.segment, "cause": finding.cause, "evidence": finding.evidence,
            "owner": {"component": owner.component,
                      "setting": None if owner.setting is None else {
                          "flag": owner.setting.flag, "current": owner.setting.value, "source": owner.setting.source,
                          "how": owner.setting.how, "at_least": owner.setting.at_least}},
            "proposed": finding.proposed, "action": finding.action or None, "reason": finding.reason,
            "effect": finding.effect, "confidence": finding.confidence}
