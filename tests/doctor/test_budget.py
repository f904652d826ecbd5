"""The doctor's budgets and causes on evidence made by hand: one row per fault class, the root
part of the path, its cause, its owner and the value (the pure functions doctor runs)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rooflib.core.taskcall import TaskCall
from rooflib.doctor import examine, failures, tradeoff
from rooflib.doctor.budget import Facts, setup_ms, tokens_per_event
from rooflib.doctor.evidence import Engine, Failures, Fit, Probe, Route, Setting, StatusCount, Stream, Targets
from rooflib.server import prometheus_text

TARGETS = Targets(ttft_p95_ms=2000, tpot_p95_ms=50, gap_p95_ms=100, error_share=0.01)


def stream(head=5.0, ttft=60.0, tokens=(1,) + (1,) * 63, reads=None, gap=10.0, connect=0.5, status=200,
           error=None, detail="") -> Stream:
    reads = tuple(reads) if reads is not None else (1,) * len(tokens)
    return Stream(status=status, error=error, detail=detail, connect_ms=connect, head_ms=head, ttft_ms=ttft,
                  e2e_ms=ttft + gap * (len(reads) - 1), prompt_tokens=300, completion_tokens=sum(tokens),
                  tokens_per_event=tuple(tokens), events_per_read=reads, text_gaps_ms=(gap,) * (len(reads) - 1),
                  request_bytes=1300, prompt_bytes=1100)


def probe(streams=None, missing_ms=0.6, over=None) -> Probe:
    routes = (Route("/health", 200, 0.5, 1.0, 0.4), Route("/missing", 404, missing_ms, missing_ms + 0.4, 0.4))
    return Probe("test probe", routes, tuple(streams or [stream()] * 6), over_limit=over)


def engine(**figures) -> Engine:
    base = dict(engine="vllm", seconds=20.0, requests=40, ttft_mean=50.0, ttft_p95=80.0, queue_mean=1.0,
                queue_p95=2.0, prefill_mean=49.0, tpot_mean=10.0, tpot_p95=12.0, itl_mean=10.0, itl_p95=12.0,
                itl_p99=14.0, e2e_mean=700.0, running_mean=2.0, running_peak=3.0, waiting_mean=0.0, waiting_peak=0.0,
                kv_usage_max=0.01, kv_cache_tokens=524288, preemptions=0.0, prompt_tokens_mean=300.0,
                output_tokens_mean=64.0, gen_tok_s=180.0, endpoint="completions")
    return Engine(**{**base, **figures})


def facts(symptom="all", probed=None, eng=None, failures=None, settings=None, fit=None, targets=TARGETS,
          diagnosis=None) -> Facts:
    return Facts(symptom=symptom, targets=targets, engine=eng or engine(), probe=probed or probe(),
                 failures=failures or Failures(()), settings=settings or {}, fit=fit, fit_note="no fit",
                 url="http://u:8000", diagnosis=diagnosis or {"findings": [], "plan": []})


def options(symptom="all", prompt_tokens=None) -> examine.Options:
    return examine.Options(url="http://u:8000", replicas=(), api_key=None, model=None, symptom=symptom,
                           targets=TARGETS, give="queue", window_s=1, probe_n=6, probe_c=2,
                           prompt_tokens=prompt_tokens, timeout=5, call=TaskCall("task "))


QUEUE_DIAGNOSIS = {"findings": [{"kind": "running_limit", "evidence": "--max-num-seqs is 2 (exported: x); requests wait",
                                 "confidence": "high", "caused_by": None, "setting": "--max-num-seqs", "current": 2,
                                 "current_source": "exported"}],
                   "plan": [{"setting": "--max-num-seqs", "current": 2, "current_source": "exported", "proposed": 16,
                             "reason": "in flight", "effect": "no queue", "text": "--max-num-seqs: 2 -> 16"}]}
CONTEXT_BODY = "HTTP 400: This model's maximum context length is 1024 tokens. However, you requested 1100 tokens"
REJECTED = Failures((StatusCount("/v1/completions", "2xx", 80), StatusCount("/v1/completions", "4xx", 20)),
                    request_bytes=80 * 1300 + 20 * 7000, sized_requests=100)
# 30 of 100 requests turned away with 503 by vLLM's own admission limit, by its counter.
SHED = Failures((StatusCount("/v1/completions", "2xx", 70), StatusCount("/v1/completions", "5xx", 30)),
                admission={"max_num_queued_reqs": 30.0})
SHED_SETTINGS = {"max_num_seqs": Setting("max_num_seqs", 4, "exported", "/server_info"),
                 "max_num_queued_reqs": Setting("max_num_queued_reqs", 6, "exported", "/server_info")}
QUEUE_FULL = "HTTP 503: The request queue is full."
FIT = Fit(intercept_ms=3.3, slope_ms=0.2, points=20, running_low=40, running_high=124, r2=0.9)

CASES = {
    # name: (facts, symptom, (segment, cause, owner's flag or component, proposed))
    "a fixed delay in front": (
        facts(probed=probe([stream(head=352, ttft=400)] * 6, missing_ms=350), targets=replace(TARGETS, ttft_p95_ms=300)),
        "first-token", ("front", "delay_before_routing", "a proxy, balancer or middleware in front of http://u:8000",
                        None)),
    "a gateway on the inference routes": (
        facts(probed=probe([stream(head=352, ttft=400)] * 6), targets=replace(TARGETS, ttft_p95_ms=300)),
        "first-token", ("route", "inference_route", "the gateway on the inference routes, or the engine's API server",
                        None)),
    "a queue behind the running cap": (
        facts(eng=engine(ttft_mean=3000, ttft_p95=5000, queue_mean=2900, waiting_mean=12), diagnosis=QUEUE_DIAGNOSIS,
              probed=probe([stream(ttft=3100)] * 6)),
        "first-token", ("queue", "running_limit", "--max-num-seqs", 16)),
    "an engine stream interval": (
        facts(probed=probe([stream(tokens=(1, 32, 32, 31), gap=320)] * 6),
              settings={"stream_interval": Setting("stream_interval", 32, "exported", "/server_info")}),
        "streaming", ("stream_interval", "stream_interval", "--stream-interval", 1)),
    "a buffering layer": (
        facts(probed=probe([stream(ttft=700, head=700, reads=(64,))] * 6)),
        "streaming", ("delivery", "buffering", "a proxy or middleware between the server and the clients that buffers "
                                               "responses", None)),
    "a batch too large for the TPOT target": (
        facts(eng=engine(tpot_mean=22.0, tpot_p95=26.0, running_mean=90, running_peak=124, gen_tok_s=4000.0),
              fit=FIT, targets=replace(TARGETS, tpot_p95_ms=7),
              settings={"max_num_seqs": Setting("max_num_seqs", 124, "inferred", "124 ran at once", True)}),
        "streaming", ("decode", "batch_too_large", "--max-num-seqs", 13)),
    "requests over the context limit": (
        facts(failures=REJECTED, probed=probe(over=stream(status=400, error="http_4xx", detail=CONTEXT_BODY)),
              settings={"max_model_len": Setting("max_model_len", 1024, "exported", "/v1/models")}),
        # The rejected fifth average 7,000 bytes: less 200 bytes of fields, 1,855 tokens at the
        # probe's 3.67 bytes a token; with 64 out, the next power of two is 2,048.
        "errors", ("rejected: 4xx on /v1/completions", "context_length", "--max-model-len", 2048)),
    # The cap 4 plus 2 requests a second times (2 s TTFT target - 49 ms prefill): 7 > 6.
    "vLLM's admission limit on requests below what the TTFT target allows": (
        facts(failures=SHED, settings=SHED_SETTINGS),
        "errors", ("rejected: 5xx on /v1/completions", "admission_limit", "--max-num-queued-reqs", 7)),
    # At 20 the limit already lets in more than the target allows: capacity, no value to set.
    "vLLM's admission limit shedding what one server cannot serve in time": (
        facts(failures=SHED, settings={**SHED_SETTINGS, "max_num_queued_reqs": Setting("max_num_queued_reqs", 20,
                                                                                       "exported", "/server_info")}),
        "errors", ("rejected: 5xx on /v1/completions", "admission_limit", "--max-num-queued-reqs", None)),
    # 2 s times 300 prompt tokens in 49 ms: 12,244 tokens.
    "vLLM's admission limit on prompt tokens": (
        facts(failures=replace(SHED, admission={"max_num_queued_tokens": 30.0})),
        "errors", ("rejected: 5xx on /v1/completions", "admission_limit", "--max-num-queued-tokens", 12244)),
    # SGLang counts no statuses: its answer names the limit, which counts the waiting requests
    # only: 2/s x 1.951 s.
    "SGLang's queue limit, by its answer": (
        facts(eng=engine(engine="sglang"), probed=probe([stream(), stream(status=503, error="http_5xx",
                                                                          detail=QUEUE_FULL)] * 3)),
        "errors", ("probe: http_5xx", "admission_limit", "--max-queued-requests", 3)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_root_is_the_part_that_holds_the_figure(name):
    made, symptom, (segment, cause, owner, proposed) = CASES[name]
    made = replace(made, symptom=symptom)
    verdict = examine.decide(options(symptom), made)
    root = verdict.root
    assert root is not None, examine.first_line(verdict)
    got_owner = root.owner.setting.flag if root.owner.setting else root.owner.component
    assert (root.segment, root.cause, got_owner, root.proposed) == (segment, cause, owner, proposed), root
    line = examine.first_line(verdict)
    assert line.startswith(f"Root cause: [{segment}] {cause} (")
    assert (f"-> set {owner} " in line) == (proposed is not None)
    assert verdict.verify and all(command.startswith("task ") for command in verdict.verify)


UNSTABLE_BEHIND_A_CAP = {
    "root_cause": QUEUE_DIAGNOSIS["findings"][0],
    "findings": [*QUEUE_DIAGNOSIS["findings"], {
        "kind": "prefix_unstable", "evidence": "prefix-cache hit rate 0.0% with 600-token prompts",
        "confidence": "medium", "caused_by": None, "setting": None, "current": None, "current_source": None}],
    "plan": [{"setting": None, "current": None, "current_source": None, "proposed": None, "reason": "bursts",
              "effect": "the peak", "text": "task metrics WINDOW=30 while the load peaks: bursts; expect the peak"},
             {"setting": None, "current": None, "current_source": None, "proposed": None, "reason": "identical start",
              "effect": "hits", "text": "make the prompts' start stable (client side): identical start; expect hits"}]}


def test_a_finding_behind_another_root_takes_neither_its_lever_nor_the_engine_as_owner():
    """Slow prefill with prompts whose start varies, while the diagnosis' root is the running cap:
    the prefill part is the clients' prompts, and the cap's first lever is not its action."""
    made = facts(symptom="first-token", eng=engine(ttft_mean=2500, ttft_p95=3000, queue_mean=10, prefill_mean=2490),
                 probed=probe([stream(ttft=2600)] * 6), diagnosis=UNSTABLE_BEHIND_A_CAP)
    root = examine.decide(options("first-token"), made).root
    assert (root.segment, root.cause, root.owner.component) == (
        "prefill", "prefix_unstable", "the clients' prompts (what comes before their shared part varies)")
    assert root.action == "" and root.proposed is None


def test_nothing_over_its_target_is_no_root_cause():
    verdict = examine.decide(options(), facts())
    assert verdict.root is None and examine.first_line(verdict).startswith("Root cause: none for ")
    assert not verdict.verify


def test_the_users_length_given_sizes_the_context_limit_exactly():
    made = replace(CASES["requests over the context limit"][0], symptom="errors")
    verdict = examine.decide(options("errors", prompt_tokens=1500), made)
    assert verdict.root.proposed == 2048 and "fits the KV cache (524,288 tokens: 256 requests" in verdict.root.reason
    assert "--over-limit" in verdict.verify[0] and "BENCH_IN=1500" in verdict.verify[0]


def test_a_limit_the_kv_cache_cannot_hold_is_said_not_to_fit():
    made = replace(CASES["requests over the context limit"][0], symptom="errors", engine=engine(kv_cache_tokens=1500))
    verdict = examine.decide(options("errors", prompt_tokens=1500), made)
    assert "does NOT fit the KV cache (1,500 tokens < 2,048)" in verdict.root.reason


def test_the_queue_grows_without_bound_when_the_cap_cannot_keep_up():
    """TPOT = 3.3 + 0.2 ms x running: a 7 ms p95 target (p95/mean 26/22: a 5.9 ms mean) holds at
    13 running, where one server makes about 2.2k tok/s of the 4k tok/s arriving."""
    cap = tradeoff.cap_for(FIT, 7.0, 26 / 22, 4000.0)
    assert cap.cap == 13 and cap.keeps_up is False and cap.replicas == 2
    assert round(cap.tok_s_at_cap) == round(13 * 1000 / (3.3 + 0.2 * 13))
    verdict = examine.decide(options("streaming"), replace(CASES["a batch too large for the TPOT target"][0],
                                                           symptom="streaming"))
    assert "the queue grows without bound" in verdict.root.effect and "2 replicas" in verdict.root.effect


def test_the_fit_is_the_line_through_the_seconds():
    """Gauges 0, 4, 8, ... at the seconds' ends: the seconds average 2, 6, 10, 14, 18 running, with
    3 + 0.5 ms per running request per token."""
    gauges = [0, 4, 8, 12, 16, 20]
    snaps, total, count = [], 0.0, 0.0
    for i, running in enumerate(gauges):
        if i:
            middle = (gauges[i - 1] + running) / 2
            total, count = total + 100 * (3 + 0.5 * middle) / 1000, count + 100
        snaps.append({"gauges": {"running": {"value": running}}, "histograms": {"itl": {"sum": total, "count": count}}})
    model, note = tradeoff.fit(snaps)
    assert note == "" and model.points == 5
    assert (round(model.intercept_ms, 6), round(model.slope_ms, 6), round(model.r2, 6)) == (3.0, 0.5, 1.0)
    assert (model.running_low, model.running_high) == (2, 18)
    short, why = tradeoff.fit(snaps[:3])
    assert short is None and "2 seconds with tokens generated" in why


def test_the_probes_own_loop_lag_is_said_beside_the_root_never_as_it():
    """A machine so busy that the probe's loop woke 300 ms late (its first text 295 ms after what
    the head and the engine's TTFT explain), and a 100 ms TTFT target the engine's own 140 ms of
    prefill misses: the root is the prefill, the larger lag an 'also'."""
    late = replace(probe([stream(head=5.0, ttft=450.0)] * 6), loop_lag_p95_ms=300.0)
    made = facts("first-token", probed=late, targets=replace(TARGETS, ttft_p95_ms=100),
                 eng=engine(ttft_mean=150.0, ttft_p95=200.0, queue_mean=10.0, prefill_mean=140.0))
    verdict = examine.decide(options("first-token"), made)
    sizes = {s.name: round(s.size) for s in verdict.budgets[0].segments}
    assert sizes["client"] > sizes["prefill"] == 140, sizes
    assert verdict.root is not None and verdict.root.segment == "prefill", examine.first_line(verdict)
    assert "client" in [found.segment for found in verdict.also]


def test_the_probes_own_loop_lag_does_not_hide_the_users_parts_from_also():
    """A fresh-clone run beside two busy loops: the probe's loop ran 400 ms late in a 520 ms TTFT,
    the inference route held 59 ms and the engine's prefill 45. The prefill is 9% of the figure
    but 37% of what users wait (the figure less the probe's lag): it is listed beside the root."""
    late = replace(probe([stream(head=60.0, ttft=520.0)] * 6), loop_lag_p95_ms=400.0)
    made = facts("first-token", probed=late, targets=replace(TARGETS, ttft_p95_ms=20),
                 eng=engine(ttft_mean=45.0, ttft_p95=46.0, queue_mean=1.0, prefill_mean=44.0))
    verdict = examine.decide(options("first-token"), made)
    budget = verdict.budgets[0]
    prefill = next(s for s in budget.segments if s.name == "prefill")
    assert prefill.share < examine.ALSO_SHARE <= budget.users_share(prefill), (prefill, budget.value)
    assert verdict.root is not None and verdict.root.segment == "route", examine.first_line(verdict)
    assert [found.segment for found in verdict.also] == ["prefill", "client"]


def first_token_parts(made: Facts) -> tuple[examine.Verdict, dict[str, float]]:
    """The verdict and its first-token parts by name, which add up to the figure they divide."""
    verdict = examine.decide(options("first-token"), made)
    budget = verdict.budgets[0]
    sizes = {s.name: s.size for s in budget.segments}
    assert sum(sizes.values()) == pytest.approx(budget.value, abs=1.0), sizes
    return verdict, sizes


def test_the_engine_parts_never_outgrow_the_probe_request_they_divide():
    """A 1 s delay in front; the window's engine TTFT mean (3.3 s: the users' requests stalled on a
    busy machine) is longer than all the probe's own 1.72 s TTFT: queue and prefill share what the
    probe's TTFT leaves after its head (about 710 ms) in the window's ratio, and the front holds most."""
    made = facts("first-token", probed=probe([stream(head=1010.0, ttft=1720.0)] * 6, missing_ms=1000.0),
                 targets=replace(TARGETS, ttft_p95_ms=800),
                 eng=engine(ttft_mean=3300.0, ttft_p95=4000.0, queue_mean=330.0, prefill_mean=2970.0))
    verdict, sizes = first_token_parts(made)
    assert sizes["queue"] == pytest.approx(71.0, abs=1.0) and sizes["prefill"] == pytest.approx(639.0, abs=1.0)
    assert verdict.root is not None and verdict.root.segment == "front", examine.first_line(verdict)


@pytest.mark.parametrize("new_ms, setup", [
    ((1.0, 3700.4, 3740.4), 0.1),        # two connections stalled on a busy machine: not a cost every one pays
    ((300.9, 301.2, 300.8), 300.0),      # a proxy's 300 ms per new connection: every route pays it
])
def test_connection_setup_is_what_every_new_connection_paid(new_ms, setup):
    routes = tuple(Route(path, 200, 0.5, new, 0.4) for path, new in zip(("/health", "/missing", "/v1/models"), new_ms))
    assert setup_ms(replace(probe([stream(head=20.0, ttft=60.0)] * 6), routes=routes)) == pytest.approx(setup, abs=0.2)


@pytest.mark.parametrize("ttft, root", [
    # A busy machine stalled the probe's own prefill: 549 ms against the window's 150 ms mean, within
    # its 500 ms p95 (the run that named "[first_delivery] slow_delivery (400.9 ms of TTFT 549 ms)").
    (549.0, "prefill"),
    # A layer that holds the first text a second: beyond what the engine's spread explains.
    (1550.0, "first_delivery"),
])
def test_first_delivery_is_only_what_the_engines_own_spread_leaves(ttft, root):
    """What is left after the 8 ms head, the engine's p95 of 500 ms and the probe's 20 ms loop lag."""
    made = facts("first-token", probed=replace(probe([stream(head=8.0, ttft=ttft)] * 6), loop_lag_p95_ms=20.0),
                 targets=replace(TARGETS, ttft_p95_ms=20),
                 eng=engine(ttft_mean=150.0, ttft_p95=500.0, queue_mean=3.0, prefill_mean=147.0))
    verdict, sizes = first_token_parts(made)
    assert sizes["first_delivery"] == pytest.approx(ttft - 8.0 - 500.0 - 20.0, abs=1.0), sizes
    assert verdict.root is not None and verdict.root.segment == root, examine.first_line(verdict)


# A window of 100 requests: 90 under 250 ms; the other 10 under 1 s (SLOW) or under 500 ms (FAST).
SLOW = ((0.25, 90.0), (0.5, 97.0), (0.75, 97.0), (1.0, 100.0), (2.5, 100.0), (math.inf, 100.0))
FAST = ((0.25, 90.0), (0.5, 100.0), (0.75, 100.0), (1.0, 100.0), (2.5, 100.0), (math.inf, 100.0))


@pytest.mark.parametrize("ttft, buckets, root", [
    # The probe's six requests doubled a light load: the window's 3rd slowest TTFT (the median
    # probe request's at most) was under 1 s, so the 986 ms probe TTFT fits in the engine (the run
    # that named "[first_delivery] slow_delivery (724.6 ms of TTFT 986.1 ms)").
    (986.0, SLOW, "prefill"),
    (986.0, (), "first_delivery"),        # no histogram: only the p95 of 450 ms bounds the engine
    (1200.0, FAST, "first_delivery"),     # the window's 3rd slowest took under 500 ms
    (2200.0, SLOW, "first_delivery"),     # a layer holds the first text over a second: more than the engine took
])
def test_the_window_slowest_requests_bound_the_engines_share_of_the_probes_ttft(ttft, buckets, root):
    made = facts("first-token", probed=replace(probe([stream(head=8.0, ttft=ttft)] * 6), loop_lag_p95_ms=20.0),
                 targets=replace(TARGETS, ttft_p95_ms=20),
                 eng=engine(ttft_mean=260.0, ttft_p95=450.0, queue_mean=3.0, prefill_mean=257.0,
                            ttft_buckets=buckets))
    verdict, _ = first_token_parts(made)
    assert verdict.root is not None and verdict.root.segment == root, examine.first_line(verdict)


def test_a_stream_interval_is_named_even_when_the_machines_decode_misses_its_target():
    """A loaded machine's TPOT p95 of 370 ms misses the 50 ms target, but 31 of every 32 tokens'
    time between text arrivals is the stream interval: decode alone would hide it."""
    slow = engine(tpot_mean=300.0, tpot_p95=370.0, itl_mean=300.0, itl_p95=370.0, itl_p99=400.0)
    made = facts("streaming", probed=probe([stream(tokens=(1, 32, 32, 31), gap=32 * 370.0)] * 6), eng=slow,
                 settings={"stream_interval": Setting("stream_interval", 32, "exported", "/server_info")})
    root = examine.decide(options("streaming"), made).root
    assert root is not None and (root.segment, root.proposed) == ("stream_interval", 1), root


def test_the_windows_failures_are_the_counters_increase_admission_rejections_by_reason():
    """vLLM 0.32's own counters over a window: statuses on the inference routes and the requests its
    admission limits turned away (a counter that fell, a restarted server, counts from zero)."""
    def scrape(ok: float, failed: float, shed: float) -> prometheus_text.Exposition:
        return prometheus_text.parse_exposition(
            f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {ok}\n'
            f'http_requests_total{{handler="/v1/completions",method="POST",status="5xx"}} {failed}\n'
            f'http_requests_total{{handler="/metrics",method="GET",status="2xx"}} 9\n'
            f'vllm:admission_rejections_total{{model_name="m",reason="max_num_queued_reqs"}} {shed}\n'
            'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 0\n')
    got = failures.between(scrape(10, 2, 2), scrape(40, 12, 12))
    assert got.statuses == (StatusCount("/v1/completions", "2xx", 30), StatusCount("/v1/completions", "5xx", 10))
    assert got.admission == {"max_num_queued_reqs": 10}
    assert failures.between(scrape(10, 2, 20), scrape(40, 12, 5)).admission == {"max_num_queued_reqs": 5}


def test_several_windows_failures_combine_field_by_field():
    """Each replica's window is read alone, then summed: no field may be dropped on the way (the
    admission counts once were)."""
    one = Failures((StatusCount("/v1/completions", "5xx", 3),), finished={"stop": 2.0}, engine_counts=True,
                   request_bytes=100.0, sized_requests=2.0, admission={"max_num_queued_reqs": 3.0})
    two = Failures((StatusCount("/v1/completions", "2xx", 4),), finished={"stop": 4.0, "abort": 1.0},
                   admission={"max_num_queued_tokens": 1.0})
    assert failures.combined([one, two]) == Failures(
        (StatusCount("/v1/completions", "5xx", 3), StatusCount("/v1/completions", "2xx", 4)),
        finished={"stop": 6.0, "abort": 1.0}, engine_counts=True, request_bytes=100.0, sized_requests=2.0,
        admission={"max_num_queued_reqs": 3.0, "max_num_queued_tokens": 1.0})


def test_events_an_api_server_merged_do_not_hide_the_stream_interval():
    """The flake finder's second round: a loaded vLLM merged events its client had not read yet
    (RequestOutputCollector), so middle events of 32, 32, 64, 64 said an interval of 48 (their
    median). The interval is the fewest tokens a middle event carries."""
    streams = [stream(tokens=(1, 32, 32, 31)), stream(tokens=(1, 64, 64, 7))]
    assert tokens_per_event(streams) == 32
