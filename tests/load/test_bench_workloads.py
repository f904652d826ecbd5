"""bench.py on real traffic: datasets, length distributions, traces, reasoning streams, the
/metrics timeline and the client-vs-server cross-check, compare.py, and the client-validity
rules about stalls. Fake streams for what a real server cannot show on demand; the real CPU
vLLM for every feature end to end."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import bench
import compare
import pytest
from calibration_server import CalibrationServer, Schedule
from fault_server import METRICS, Action, fault_server, response

from rooflib.core.errors import UsageError
from rooflib.load import analysis, benchrun, comparison, http1, promptgen, request_outcome, workloads
from rooflib.server import watch

DATA = Path(__file__).resolve().parents[2] / "scripts" / "data"
SHAREGPT, PROMPTS, TRACE = DATA / "sharegpt-sample.json", DATA / "prompts-sample.jsonl", DATA / "trace-sample.jsonl"


def _sse(chunks: list[dict]) -> http1.Response:
    ms = 1_000_000  # event k arrives at k + 1 ms
    events = [((k + 1) * ms, json.dumps(c).encode()) for k, c in enumerate(chunks)] + [((len(chunks) + 1) * ms, b"[DONE]")]
    return http1.Response(200, {"content-type": "text/event-stream"}, True, events)


def _usage(n: int) -> dict:
    return {"prompt_tokens": 10, "completion_tokens": n}


# ---------------------------------------------------------------------------------------------
# Reasoning streams

def test_reasoning_deltas_give_answer_ttft_and_split_counts():
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]},
              {"choices": [{"delta": {"reasoning_content": "Let"}}], "usage": _usage(1)},
              {"choices": [{"delta": {"reasoning": " me think"}}], "usage": _usage(3)},
              {"choices": [{"delta": {"reasoning": "."}}], "usage": _usage(4)},
              {"choices": [{"delta": {"content": "Yes"}}], "usage": _usage(5)},
              {"choices": [{"delta": {"content": "."}}], "usage": _usage(6)},
              {"choices": [{"delta": {"content": "!"}, "finish_reason": "length"}], "usage": _usage(7)}]
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse(chunks), "chat")
    assert o.ok and o.reasoning_seen
    assert o.ttft_ms == 2.0 and o.ttft_answer_ms == 5.0
    assert (o.reasoning_tokens, o.answer_tokens) == (4, 3)
    assert o.tpot_reasoning_ms == pytest.approx((4 - 2) / 3)
    assert o.tpot_answer_ms == pytest.approx((7 - 5) / 2)
    assert o.text == "Yes.!"  # the history of a next turn holds the answer, not the reasoning


def test_think_tags_in_text_split_reasoning_from_answer():
    texts = ["<think>", "hmm", " ok</think>", "\n\nThe", " answer"]
    chunks = [{"choices": [{"text": t}], "usage": _usage(k + 1)} for k, t in enumerate(texts)]
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse(chunks), "completions")
    assert o.reasoning_seen and o.ttft_ms == 1.0 and o.ttft_answer_ms == 4.0
    assert (o.reasoning_tokens, o.answer_tokens) == (3, 2)


def test_a_closing_tag_alone_makes_what_came_before_reasoning():
    """DeepSeek-R1's template opens <think> itself: the stream shows only the closing tag."""
    texts = ["step", " one", "</think>Done", "."]
    chunks = [{"choices": [{"text": t}], "usage": _usage(k + 1)} for k, t in enumerate(texts)]
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse(chunks), "completions")
    assert o.reasoning_seen and o.ttft_answer_ms == 3.0
    assert (o.reasoning_tokens, o.answer_tokens) == (2, 2)


def test_plain_answers_have_no_reasoning_section():
    chunks = [{"choices": [{"text": t}], "usage": _usage(k + 1)} for k, t in enumerate(["a", "b"])]
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse(chunks), "completions")
    assert not o.reasoning_seen and o.reasoning_tokens == 0 and o.answer_tokens == 2
    assert analysis.reasoning_summary([o]) is None


# ---------------------------------------------------------------------------------------------
# Distributions, datasets, traces

@pytest.mark.parametrize("text, kind, a, b", [
    ("512", "fixed", 512, 0), ("fixed:64", "fixed", 64, 0), ("uniform:10,20", "uniform", 10, 20),
    ("normal:100,10", "normal", 100, 10), ("lognormal:400,2000", "lognormal", 400, 2000)])
def test_distributions_parse(text, kind, a, b):
    assert workloads.parse_distribution(text, "--input-dist") == workloads.Distribution(kind, a, b)


@pytest.mark.parametrize("text", ["", "x", "uniform:5", "uniform:9,3", "lognormal:100,50", "gamma:1,2", "normal:1,nan"])
def test_bad_distributions_say_the_forms(text):
    with pytest.raises(UsageError, match="--input-dist"):
        workloads.parse_distribution(text, "--input-dist")


def test_lognormal_is_fitted_to_its_p50_and_p95():
    rng = random.Random(1)
    dist = workloads.parse_distribution("lognormal:400,2000", "x")
    draws = sorted(dist.sample(rng) for _ in range(20000))
    assert draws[10000] == pytest.approx(400, rel=0.05)
    assert draws[19000] == pytest.approx(2000, rel=0.08)
    uniform = [workloads.parse_distribution("uniform:3,5", "x").sample(rng) for _ in range(300)]
    assert set(uniform) == {3, 4, 5}


def test_sample_datasets_read():
    prompts = workloads.read_prompts(str(PROMPTS))
    assert len(prompts) == 6 and prompts[0].prompt and prompts[2].messages[0]["role"] == "system"
    assert prompts[3].output_tokens is None and prompts[0].output_tokens == 48
    turns = workloads.read_sharegpt(str(SHAREGPT), lambda text: len(text.split()))
    conversations = json.loads(SHAREGPT.read_text())
    humans = sum(t["from"] == "human" for c in conversations for t in c["conversations"])
    assert len(turns) == humans  # every human turn, not only the first
    third = [t for t in turns if len(t.messages) == 5][0]  # the haiku conversation's third question
    assert [m["role"] for m in third.messages] == ["user", "assistant", "user", "assistant", "user"]
    trace = workloads.read_trace(str(TRACE))
    assert len(trace) == 40 and trace[0].at_s <= trace[-1].at_s and trace[0].hash_ids


@pytest.mark.parametrize("reader, line, message", [
    ("prompts", '{"prompt": "a"}\n{"nothing": 1}\n', ":2: needs \"prompt\""),
    ("prompts", '{"prompt": "a"}\n{oops\n', ":2: not JSON"),
    ("prompts", '{"prompt": "a", "output_tokens": -3}\n', ":1: output_tokens"),
    ("sharegpt", '{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": [{"from": "robot"}]}\n',
     ":2: turn 1 needs"),
    ("trace", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 0, "output_length": 2}\n',
     ":2: input_length"),
    ("trace", '{"time": 5}\n', ":1: needs \"timestamp\""),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, reader, line, message):
    file = tmp_path / "data.jsonl"
    file.write_text(line)
    read = {"prompts": workloads.read_prompts, "trace": workloads.read_trace,
            "sharegpt": lambda p: workloads.read_sharegpt(p, len)}[reader]
    with pytest.raises(UsageError) as error:
        read(str(file))
    assert str(file) + message in str(error.value)


def test_burstgpt_rows_are_read_in_seconds(tmp_path):
    file = tmp_path / "burst.jsonl"
    file.write_text('{"Timestamp": 2.5, "Request tokens": 30, "Response tokens": 7}\n'
                    '{"Timestamp": 1.0, "Request tokens": 10, "Response tokens": 3}\n')
    rows = workloads.read_trace(str(file))
    assert [(r.at_s, r.input_tokens, r.output_tokens) for r in rows] == [(1.0, 10, 3), (2.5, 30, 7)]


def _maker() -> workloads.PromptMaker:
    return workloads.PromptMaker(list(promptgen.WORDS[:40]), "head words here", 5, seed=3)


def _words(text: str) -> int:
    """A tokenizer of one token per word plus 2 for a template: the maker's overhead is 3 + 2."""
    return len(text.split()) + 2


@pytest.mark.parametrize("tokens", [5, 6, 50, 3000])
def test_prompt_maker_builds_exact_unique_prompts(tokens):
    maker = _maker()
    texts = [maker.text(maker.fits(tokens, i), i) for i in range(60)]
    assert all(_words(t) == maker.fits(tokens, i) for i, t in enumerate(texts))
    assert len(set(texts)) == 60


def test_runs_of_one_seed_start_their_prompts_with_heads_of_their_own():
    """Runs of one seed differ only by the head their run id draws. A head drawn a word per
    generator was one word three times, a hundred heads in all: one run in a hundred met an
    earlier run's whole prompts in the prefix cache (a first turn 94% cached, on a real vLLM)."""
    heads = [benchrun.run_head(f"{random.Random(k).getrandbits(32):08x}") for k in range(1000)]
    assert len(set(heads)) == 1000
    assert benchrun.run_head("53a2ab17") == benchrun.run_head("53a2ab17")  # every shard of a run alike


def test_trace_blocks_share_prefixes_by_hash_id():
    maker = _maker()
    one = maker.blocks(37, [7, 8], 16, salt=1)  # 5 (head, template) + two blocks of 16
    two = maker.blocks(37, [7, 9], 16, salt=2)
    same = maker.blocks(37, [7, 8], 16, salt=3)
    assert _words(one) == _words(two) == 37
    assert one.split()[:3 + 16] == two.split()[:3 + 16] and one.split()[19] != two.split()[19]
    assert one == same  # the same ids fill the whole prompt: the same text
    assert _words(maker.blocks(100, [7], 16, salt=1)) == 100  # short of blocks: unique words after


def test_synthetic_workload_draws_lengths_per_request_and_repeats_them():
    load = workloads.Workload("synthetic", 50, 8, seed=4, maker=_maker(),
                             input_dist=workloads.parse_distribution("uniform:20,200", "x"),
                             output_dist=workloads.parse_distribution("normal:30,5", "x"))
    specs = [load.spec(i) for i in range(50)]
    assert len({s.prompt_tokens for s in specs}) > 20 and all(_words(s.prompt) == s.prompt_tokens for s in specs)
    assert load.spec(17) == specs[17]  # any process makes the same request from its index
    assert 10 < statistics.mean(s.output_tokens for s in specs) < 50


def test_synthetic_shared_prefix_starts_every_prompt():
    maker = _maker()
    load = workloads.Workload("synthetic", 8, 4, seed=1, maker=maker,
                             input_dist=workloads.parse_distribution("30", "x"),
                             output_dist=workloads.parse_distribution("4", "x"),
                             shared_prefix=maker.text(20, 0), shared_tokens=20)
    specs = [load.spec(i) for i in range(8)]
    assert all(s.prompt.startswith(load.shared_prefix + " ") and _words(s.prompt) == s.prompt_tokens == 30
               for s in specs)
    assert len({s.prompt for s in specs}) == 8


# ---------------------------------------------------------------------------------------------
# Validity: stalls, one-read streams

def _done(index: int, ttft_ms: float, tpot_ms: float, tokens: int = 4) -> request_outcome.Outcome:
    times = [int((ttft_ms + tpot_ms * k) * 1e6) for k in range(tokens)]
    return request_outcome.Outcome(index, sent_ns=0, status=200, token_times=times, chunk_tokens=[1] * tokens,
                         completion_tokens=tokens, usage_reported=True, prompt_tokens=8,
                         finish_reason="length", done_ns=times[-1], requested_tokens=tokens)


CONFIG = {"output_tokens": 4, "input_tokens": 8, "concurrency": 2}


def test_long_client_stalls_make_the_run_invalid_even_with_a_quiet_p99():
    """The run of issue 17: 2 s stalls, ~6 s of them in a 14 s run, and thousands of quiet
    probe samples in between, so the lag's p99 looked fine."""
    lag = [0.0] * 2400 + [2000.0, 2100.0, 1900.0]
    outcomes = [_done(i, 100.0, 10.0) for i in range(40)]
    result = analysis.analyse(outcomes, CONFIG, lag, cpu_s=1.0, wall_s=14.0)
    assert result["client"]["loop_lag_ms"]["p99"] == 0.0
    assert result["verdict"] == "INVALID" and not result["client"]["valid"]
    assert result["client"]["stalls"]["total_s"] == pytest.approx(6.0)
    assert "stalled 6.0 s of the 14.0 s run" in result["verdict_reasons"][0]


def test_one_short_stall_in_a_long_run_is_a_warning():
    outcomes = [_done(i, 100.0, 10.0) for i in range(40)]
    result = analysis.analyse(outcomes, CONFIG, [0.0] * 5000 + [80.0], cpu_s=1.0, wall_s=600.0)
    assert result["verdict"] == "NO SLO"
    assert any("worst 80 ms" in w for w in result["warnings"])
    # 5% of the run in stalls: a warning, not (yet) an invalid run
    result = analysis.analyse(outcomes, CONFIG, [0.0] * 5000 + [50.0] * 20, cpu_s=1.0, wall_s=20.0)
    assert result["verdict"] == "NO SLO" and any("(5.0% of the run" in w for w in result["warnings"])


def test_client_lag_is_judged_against_the_size_of_each_figure():
    """Issue #22: runs measuring a TTFT of ~370 ms were INVALID on 5 ms of client lag because the
    TPOT median was 4 ms. A late timestamp moves TTFT by the lag, TPOT by the lag over the tokens
    after the first, one ITL gap by the lag: only ITL could carry it here, and the run says so."""
    lag = [5.0] * 200
    long_prompts = [_done(i, 370.0, 4.0, tokens=32) for i in range(40)]
    result = analysis.analyse(long_prompts, CONFIG, lag, cpu_s=0.1, wall_s=14.0)
    assert result["verdict"] == "NO SLO" and result["client"]["valid"]
    assert result["client"]["lag_limits_ms"] == pytest.approx({"ttft_ms": 37.0, "tpot_ms": 12.4, "itl_ms": 1.0,
                                                               "e2e_ms": 49.4})
    assert result["client"]["lag_threshold_ms"] == pytest.approx(12.4)
    assert result["client"]["distorted"] == {"itl_ms": "lag p95 5.00 ms > 1.00 ms"}
    assert any(w.startswith("the client's own delay may distort ITL (lag p95 5.00 ms > 1.00 ms): ")
               for w in result["warnings"])
    # The same lag against a 40 ms TTFT, or 4-token answers decoded in 30 ms: the verdict's own figures.
    short_ttft = analysis.analyse([_done(i, 40.0, 4.0, tokens=32) for i in range(40)], CONFIG, lag, 0.1, 14.0)
    assert short_ttft["verdict"] == "INVALID" and short_ttft["verdict_reasons"][0].startswith(
        "client event-loop lag p95 5.00 ms > 4.00 ms (10% of the median TTFT); the client used only 1% of a core")
    short_answers = analysis.analyse([_done(i, 370.0, 10.0) for i in range(40)], CONFIG, lag, 0.1, 14.0)
    assert short_answers["verdict"] == "INVALID" and "> 3.00 ms (10% of the median decode span, over which TPOT " \
        "is taken)" in short_answers["verdict_reasons"][0]


def test_cached_prompt_tokens_are_unknown_unless_the_server_reports_them():
    """Issue #22: bench said 0 cached tokens while the server's counters showed 78-97% hits: the
    count needs usage.prompt_tokens_details.cached_tokens in the answers."""
    outcomes = [_done(i, 100.0, 10.0) for i in range(4)]
    silent = analysis.analyse(outcomes, CONFIG, [0.0], cpu_s=0.1, wall_s=2.0)["requests"]
    assert silent["cached_prompt_tokens"] is None
    assert silent["cached_prompt_tokens_note"].startswith("no answer carried usage.prompt_tokens_details.cached_tokens")
    for outcome, cached in zip(outcomes, (0, 64, 64, 0)):
        outcome.cached_tokens = cached
    told = analysis.analyse(outcomes, CONFIG, [0.0], cpu_s=0.1, wall_s=2.0)["requests"]
    assert (told["cached_prompt_tokens"], told["cached_prompt_tokens_note"]) == (128, None)


def test_a_stream_received_in_one_read_is_flagged():
    one_read = _done(0, 100.0, 0.0)  # every token timestamped by the same read: TPOT 0.0
    result = analysis.analyse([one_read, _done(1, 100.0, 10.0)], CONFIG, [0.0], 1.0, 10.0)
    assert result["tpot_ms"]["min"] == 0.0
    assert any("1 requests received all their output in one read" in w for w in result["warnings"])


# ---------------------------------------------------------------------------------------------
# Timeline and cross-check

def _snap(running, waiting, kv, preempt, hits, queries, prompt, gen, ttft=None):
    counters = {"preemptions": preempt, "prefix_hits": hits, "prefix_queries": queries,
                "prompt_tokens": prompt, "generation_tokens": gen}
    return {"gauges": {"running": {"value": running}, "waiting": {"value": waiting}, "kv_cache_usage": {"value": kv}},
            "counters": {k: {"value": v} for k, v in counters.items()}, "histograms": {}}


def test_timeline_samples_follow_the_contract():
    snaps = [(0.0, _snap(0, 0, 0.0, 5, 100, 200, 1000, 50)), (2.0, _snap(3, 1, 0.25, 5, 150, 300, 1400, 250)),
             (4.0, _snap(2, 0, 0.5, 7, 150, 300, 1400, 650))]
    samples = watch.timeline_samples(snaps)
    assert samples[0] == {"t_s": 0.0, "running": 0, "waiting": 0, "kv_cache_usage_perc": 0.0, "preemptions": 0,
                          "prefix_cache_hit_rate": None, "prompt_tok_s": 0.0, "generation_tok_s": 0.0}
    assert samples[1] == {"t_s": 2.0, "running": 3, "waiting": 1, "kv_cache_usage_perc": 0.25, "preemptions": 0,
                          "prefix_cache_hit_rate": 0.5, "prompt_tok_s": 200.0, "generation_tok_s": 100.0}
    assert samples[2]["preemptions"] == 2 and samples[2]["prefix_cache_hit_rate"] is None
    assert samples[2]["generation_tok_s"] == 200.0


def test_the_timeline_has_a_sample_of_its_own_when_start_returns():
    """The run starts when start returns: by then the scraping process (a spawned interpreter,
    seconds to start on a loaded machine) has taken its first sample, so a load shorter than its
    start-up is not left without one. The interval of a minute leaves that first sample alone."""
    with fault_server() as url:
        timeline = watch.Timeline(url, None, 60.0).start(_snap(0, 0, 0.0, 0, 0, 0, 0, 0))
        timeline.stop()
    assert timeline.errors == [] and len(timeline.snapshots) == 2, (timeline.errors, timeline.snapshots)
    assert timeline.snapshots[1][1]["gauges"]["running"]["value"] is not None


def test_a_scraping_process_whose_pages_come_too_late_is_stopped(monkeypatch):
    """A scraping process that sends its pages after bench stopped waiting for them (a starved
    machine) is held in the pipe's write, nobody reading, and ignores SIGTERM: left alive, it held
    the interpreter's exit for ever (multiprocessing joins its children then). Pages larger than
    the pipe's buffer, and no wait at all, make that the case every time."""
    big_page = response(200, (METRICS + "# padding\n" * 20_000).encode(), "text/plain; version=0.0.4")
    monkeypatch.setattr(watch, "PAGES_TIMEOUT_S", -1.0)
    with fault_server(lambda r: Action(big_page) if r.path == "/metrics" else None) as url:
        timeline = watch.Timeline(url, None, 0.1).start(_snap(0, 0, 0.0, 0, 0, 0, 0, 0))
        timeline.stop()
    assert timeline.errors == ["the scraping process sent nothing back"]
    assert not timeline._process.is_alive()


def _hist(le_s: list[float], counts: list[int], mean_s: float) -> dict:
    return {"le": [*le_s, float("inf")], "counts": [*counts, counts[-1]], "sum": mean_s * counts[-1], "count": counts[-1]}


# The engine: TTFT 90% within 50..100 ms, the rest below 200 (mean 80 ms); e2e within 0.5..2 s (mean 800 ms).
ENGINE = {"histograms": {"ttft": _hist([0.05, 0.1, 0.2], [0, 90, 100], 0.08),
                         "e2e": _hist([0.5, 1.0, 2.0], [0, 90, 100], 0.8)}}
LATE_TTFT = {"p50": 160.0, "p95": 260.0, "p99": 300.0, "mean": 180.0, "n": 100}  # 100 ms over the engine's mean


def _client(ttft: dict, e2e_mean: float, one_read: int = 0) -> dict:
    return {"ttft_ms": ttft, "e2e_ms": {"p50": 900.0, "p95": 1500.0, "p99": 1900.0, "mean": e2e_mean, "n": 100},
            "one_read": one_read}


def _by_cause(checked: dict) -> dict:
    return {f["cause"]: f for f in checked["findings"]}


def test_a_fixed_latency_is_split_into_network_and_gateway_by_the_probe():
    checked = watch.cross_check(ENGINE, _client(LATE_TTFT, 905.0), 0.1, {"path": "/health", "p50_ms": 25.0, "n": 20})
    assert checked["percentiles"]["ttft_ms"]["p50"]["side"] == "above"
    assert checked["percentiles"]["ttft_ms"]["p50"]["excess_ms"] == pytest.approx(60.0)
    assert checked["percentiles"]["e2e_ms"]["p50"]["side"] == "within"
    found = _by_cause(checked)
    assert list(found) == ["fixed_latency", "network", "gateway"]
    assert {cause: f["size_ms"] for cause, f in found.items()} == pytest.approx(
        {"fixed_latency": 105.0, "network": 25.0, "gateway": 80.0})
    assert all(f["kind"] == "outside_engine" and f["setting"] is None for f in found.values())
    assert ("its last token 105 ms over the engine's mean e2e, its first 100 ms over the mean TTFT and above the "
            "engine's bucket at every percentile") in found["fixed_latency"]["evidence"]
    assert "(/health) takes 25.0 ms round trip" in found["network"]["evidence"]
    assert "real requests lose 80 ms more than a trivial one" in found["gateway"]["evidence"]


def test_a_gateway_part_the_clients_loop_lag_covers_is_not_named():
    # 80 ms more than the probe, but the client read its clocks up to 90 ms late (below the
    # 105 ms excess, so the client is not the cause of the whole).
    found = _by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 905.0), 90.0,
                                        {"path": "/health", "p50_ms": 25.0, "n": 20}))
    assert list(found) == ["fixed_latency", "network"]


def test_a_network_that_explains_it_all_names_no_gateway():
    found = _by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 905.0), 0.1,
                                               {"path": "/health", "p50_ms": 97.0, "n": 20}))
    assert list(found) == ["fixed_latency", "network"] and found["network"]["size_ms"] == pytest.approx(97.0)


def test_without_a_probe_the_fixed_latency_says_how_to_split_it():
    found = _by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 905.0), 0.1, None))
    assert list(found) == ["fixed_latency"] and "--probe /health" in found["fixed_latency"]["remedy"]


def test_a_late_first_token_alone_is_not_a_fixed_latency():
    # e2e only 10 ms over the engine's: the first token is late, the last is not.
    found = _by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 810.0), 0.1, None))
    assert list(found) == ["unsplit"] and found["unsplit"]["size_ms"] == pytest.approx(100.0)


def test_first_and_last_token_apart_by_less_than_the_clients_loop_lag_are_one_fixed_latency():
    # e2e 200 ms over, TTFT 100 ms: apart by more than FIXED_AGREEMENT of it, but the client read
    # each clock up to 120 ms late (its loop lag, itself below the gap, so not the cause).
    found = _by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 1000.0), 120.0, None))
    assert list(found) == ["fixed_latency"] and found["fixed_latency"]["size_ms"] == pytest.approx(200.0)
    assert list(_by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 1000.0), 0.1, None))) == ["unsplit"]


def test_streams_in_one_read_are_buffering_and_only_e2e_sizes_the_rest():
    # Every first token came with the last: TTFT is the engine's e2e, e2e 5 ms over it.
    buffered = {"p50": 780.0, "p95": 1400.0, "p99": 1800.0, "mean": 805.0, "n": 100}
    found = _by_cause(watch.cross_check(ENGINE, _client(buffered, 805.0, one_read=100), 0.1,
                                               {"path": "/health", "p50_ms": 1.0, "n": 20}))
    assert list(found) == ["buffering"]
    assert found["buffering"]["size_ms"] == pytest.approx(720.0)  # TTFT 725 ms over, e2e 5 ms
    assert found["buffering"]["confidence"].startswith("high") and "proxy_buffering off" in found["buffering"]["remedy"]


def test_a_few_streams_in_one_read_leave_a_fixed_latency_visible():
    # A starved API server sent 10 streams in one read: their first tokens are late, the last are not.
    late = {"p50": 165.0, "p95": 300.0, "p99": 420.0, "mean": 200.0, "n": 100}
    found = _by_cause(watch.cross_check(ENGINE, _client(late, 905.0, one_read=10), 0.1, None))
    assert list(found) == ["buffering", "fixed_latency"]
    assert found["buffering"]["confidence"].startswith("medium: some streams only")
    assert found["fixed_latency"]["size_ms"] == pytest.approx(105.0)


def test_client_lag_explains_a_gap_it_covers():
    # The gap is 100 ms on average (the exact means), 60 ms at the worst-placed percentile's bound.
    checked = watch.cross_check(ENGINE, _client(LATE_TTFT, 905.0), 110.0, None)
    assert [(f["cause"], f["size_ms"]) for f in checked["findings"]] == [("client", pytest.approx(105.0))]
    assert "own loop lag (p99 110.0 ms)" in checked["findings"][0]["evidence"]


def test_client_lag_below_the_mean_gap_explains_nothing():
    # 70 ms of lag clears the 60 ms bucket margin but not the 100 ms the clients waited on average.
    found = _by_cause(watch.cross_check(ENGINE, _client(LATE_TTFT, 905.0), 70.0, None))
    assert "client" not in found and "fixed_latency" in found


def test_a_client_faster_than_the_engine_is_other_traffic_and_agreement_is_silent():
    early = {"p50": 30.0, "p95": 40.0, "p99": 45.0, "mean": 35.0, "n": 100}
    checked = watch.cross_check(ENGINE, _client(early, 800.0), 0.1, None)
    assert [f["kind"] for f in checked["findings"]] == ["other_traffic"]
    agree = watch.cross_check(ENGINE, _client({"p50": 80.0, "p95": 150.0, "p99": 190.0, "mean": 82.0, "n": 100},
                                                     801.0), 0.1, None)
    assert agree["findings"] == [] and agree["percentiles"]["ttft_ms"]["p95"]["side"] == "within"


# ---------------------------------------------------------------------------------------------
# compare.py (pure)

def _run_doc(ttft: list[float], **workload_changes) -> dict:
    return {"kind": "bench", "verdict": "NO SLO", "config": {"model": "m", "url": "u"}, "interrupted": False,
            "workload": {"workload": "synthetic", "concurrency": 8, "input_tokens": 128, **workload_changes},
            "samples": {"ttft_ms": ttft, "tpot_ms": [10.0 + (k % 7) * 0.1 for k in range(len(ttft))],
                        "e2e_ms": [t + 100 for t in ttft]},
            "throughput": {"output_tok_s": 100.0, "req_s": 2.0}, "requests": {"failed": 0}}


def test_compare_finds_a_real_improvement_and_no_change():
    rng = random.Random(7)
    a = [rng.gauss(100, 10) for _ in range(400)]
    b = [rng.gauss(80, 10) for _ in range(400)]
    doc = comparison.compare(_run_doc(a), _run_doc(b), ("a.json", "b.json"), ("A", "B"))
    rows = {r["name"]: r for r in doc["metrics"]}
    assert doc["kind"] == "compare" and doc["schema_version"] == 1
    assert rows["ttft_ms.p50"]["verdict"] == "better" and rows["ttft_ms.p50"]["ci95_pct"][1] < 0
    assert rows["ttft_ms.p50"]["change_pct"] == pytest.approx(-20, abs=4)
    assert rows["tpot_ms.p50"]["verdict"] == "no significant difference"
    assert doc["verdict"] == "better"
    same = comparison.compare(_run_doc(a), _run_doc(list(reversed(a))), ("a", "b"), ("A", "B"))
    assert same["verdict"] == "no significant difference"
    assert all(r["ci95_pct"] is None or r["ci95_pct"][0] <= 0 <= r["ci95_pct"][1] for r in same["metrics"])


def test_compare_resamples_large_runs_fast_and_alike():
    rng = random.Random(8)
    a = [rng.expovariate(1 / 100) for _ in range(5000)]
    b = [x * 1.1 for x in a]
    doc = comparison.compare(_run_doc(a), _run_doc(b), ("a", "b"), ("A", "B"))
    row = {r["name"]: r for r in doc["metrics"]}["ttft_ms.p95"]
    assert row["change_pct"] == pytest.approx(10.0) and row["verdict"] == "worse"


def test_compare_refuses_different_workloads_and_says_what_differs():
    with pytest.raises(UsageError, match=r"concurrency: 8 vs 16; input_tokens: 128 vs 'lognormal:100,400'"):
        comparison.compare(_run_doc([1.0, 2.0]), _run_doc([1.0, 2.0], concurrency=16, input_tokens="lognormal:100,400"),
                        ("a", "b"), ("A", "B"))


def test_compare_lets_the_setting_under_test_differ_and_says_so(tmp_path, capsys):
    """A prefix-cache A/B: unique prompts against prompts that share 500 tokens (issue #22)."""
    rng = random.Random(9)
    unique = _run_doc([rng.gauss(100, 10) for _ in range(200)], shared_prefix=0)
    shared = _run_doc([rng.gauss(60, 10) for _ in range(200)], shared_prefix=500)
    with pytest.raises(UsageError, match=r"shared_prefix: 0 vs 500: .*\(--variable shared_prefix\)"):
        comparison.compare(unique, shared, ("a", "b"), ("A", "B"))
    doc = comparison.compare(unique, shared, ("a", "b"), ("A", "B"), variables=["shared_prefix"])
    assert doc["variables"] == {"shared_prefix": {"a": 0, "b": 500}} and doc["verdict"] == "better"
    with pytest.raises(UsageError, match="--variable shared is not a workload setting: use one of concurrency, "):
        comparison.compare(unique, shared, ("a", "b"), ("A", "B"), variables=["shared"])
    same = comparison.compare(unique, unique, ("a", "b"), ("A", "B"), variables=["concurrency"])
    assert same["warnings"] == ["--variable concurrency is 8 in both runs: nothing varies but the server"]
    paths = [tmp_path / "unique.json", tmp_path / "shared.json"]
    for path, run in zip(paths, (unique, shared)):
        path.write_text(json.dumps(run))
    assert compare.main([str(paths[0]), str(paths[1]), "--variable", "shared_prefix"]) == 0
    assert capsys.readouterr().out.endswith("Verdict: B (shared_prefix 500) is better than A (shared_prefix 0)\n")


def test_compare_cli_bad_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"verdict": "PASS"}')
    assert compare.main([str(bad), str(bad)]) == 2
    assert "not a bench or sweep result" in capsys.readouterr().err


def test_compare_without_b_names_what_is_missing(tmp_path, capsys):
    """The task passes B even when it is not set: an empty name, not a file that "does not exist"."""
    assert compare.main([str(tmp_path / "a.json"), ""]) == 2
    assert capsys.readouterr().err == ("error: B is not given: pass two files written by bench.py --json or "
                                       "sweep.py --json (task compare A=base.json B=candidate.json)\n")


def test_compare_help_describes_before_the_options(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    text = capsys.readouterr().out
    assert text.index("bootstrap confidence interval, and a plain verdict") < text.index("positional arguments")


# ---------------------------------------------------------------------------------------------
# Against the calibration server

@pytest.fixture
def calibration():
    server = CalibrationServer(Schedule(ttft_ms=20, itl_ms=5)).start_in_thread()
    yield server
    server.stop()


def _bench(capsys, *argv: str) -> tuple[int, dict]:
    code = bench.main(["--json", *argv])
    captured = capsys.readouterr()
    assert captured.out.strip(), f"exit {code}: {captured.err.strip()[-400:]}"
    return code, json.loads(captured.out)


def test_trace_replay_reports_schedule_lag(calibration, capsys):
    code, result = _bench(capsys, "--url", calibration.url, "--trace", str(TRACE), "--speed", "8", "-n", "16")
    assert result["kind"] == "bench" and result["requests"]["completed"] == 16
    assert result["client"]["schedule_delay_ms"]["n"] == 16
    assert result["requests"]["prompt_tokens"]["mismatched"] == 0  # exact lengths by the server's count
    rows = workloads.read_trace(str(TRACE))[:16]
    assert result["requests"]["output_tokens"]["requested_total"] == sum(r.output_tokens for r in rows)
    assert result["workload"]["dataset"]["name"] == "trace-sample.jsonl"
    assert code in (0, 4)


def test_distributions_and_prompts_files_run(calibration, capsys):
    code, result = _bench(capsys, "--url", calibration.url, "-n", "20", "-c", "4", "--input-dist", "uniform:20,300",
                          "--output-dist", "fixed:3")
    assert result["requests"]["completed"] == 20 and result["requests"]["prompt_tokens"]["mismatched"] == 0
    assert result["requests"]["prompt_tokens"]["max"] > result["requests"]["prompt_tokens"]["min"]
    code, result = _bench(capsys, "--url", calibration.url, "--prompts", str(PROMPTS), "--endpoint", "chat", "-c", "2",
                          "--warmup", "0")
    assert result["requests"]["completed"] == 6
    assert result["requests"]["output_tokens"]["requested_total"] == 48 + 96 + 40 + 256 + 16 + 80


def test_a_shared_prefix_is_shared_and_exact(calibration, capsys, tmp_path):
    records = tmp_path / "r.jsonl"
    code, result = _bench(capsys, "--url", calibration.url, "-n", "6", "-c", "3", "--input-tokens", "60",
                          "--shared-prefix", "40", "--output-tokens", "2", "--records", str(records))
    assert result["requests"]["completed"] == 6
    assert result["requests"]["prompt_tokens"]["min"] == result["requests"]["prompt_tokens"]["max"] == 60


def test_two_sweeps_compare_point_by_point(calibration, capsys, tmp_path):
    import sweep

    files = []
    for name, levels in (("a", "1,2"), ("b", "1,2"), ("c", "1,3")):
        sweep.main(["--url", calibration.url, "--json", "--sweep-c", levels, "-n", "6", "--input-tokens", "8",
                    "--output-tokens", "4"])
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(capsys.readouterr().out)
    report = json.loads(files[0].read_text())
    assert report["kind"] == "sweep" and all("samples" in p and "workload" in p for p in report["points"])
    code = compare.main([str(files[0]), str(files[1]), "--json"])
    doc = json.loads(capsys.readouterr().out)
    names = {r["name"] for r in doc["metrics"]}
    # Point by point, each row named by its concurrency. Not TPOT: a busy machine's client may read
    # a 4-token stream 5 ms apart in one read (TPOT 0), and compare leaves a figure of 0 out.
    assert {"c=1 ttft_ms.p50", "c=2 ttft_ms.p50", "c=2 e2e_ms.p95"} <= names and code in (0, 1)
    assert compare.main([str(files[0]), str(files[2])]) == 2
    assert "different concurrencies ([1, 2] vs [1, 3])" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--trace", str(TRACE), "--rate", "3"], "use --speed, not --rate"),
    (["--prompts", str(PROMPTS), "--trace", str(TRACE)], "choose one"),
    (["--prompts", str(PROMPTS), "--input-dist", "fixed:9"], "drop --input-dist"),
    (["--input-dist", "lognormal:9,3"], "P95 > P50"),
    (["--probe", "health"], "takes a path"),
])
def test_conflicting_workload_flags_are_usage_errors(argv, message, capsys):
    assert bench.main(["--url", "http://127.0.0.1:9", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_dataset_line_stops_the_run_with_file_and_line(calibration, tmp_path, capsys):
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "ok"}\n\n{"prompt": 3}\n')
    assert bench.main(["--url", calibration.url, "--prompts", str(file)]) == 2
    assert f"{file}:3: needs" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The real CPU vLLM

@pytest.mark.real_vllm
def test_real_vllm_sharegpt_with_a_timeline(vllm_server, capsys):
    # Four passes over the sample: a run of several seconds, so the child that scrapes (a fresh
    # interpreter, up in about a second) usually gets in scrapes mid-run. Only the scrapes
    # before and after the run are certain: a busy machine may start the child late.
    requests = 4 * len(workloads.read_sharegpt(str(SHAREGPT), len))
    code, result = _bench(capsys, "--url", vllm_server.url, "--sharegpt", str(SHAREGPT), "--endpoint", "chat",
                          "-n", str(requests), "-c", "3", "--warmup", "0", "--timeline-interval", "0.5",
                          "--probe", "/health")
    assert result["requests"]["completed"] == requests, result["requests"]["first_errors"]
    assert result["requests"]["output_tokens"]["short"] == 0
    samples = result["timeline"]["samples"]
    assert len(samples) >= 2 and result["timeline"]["interval_s"] == 0.5
    assert set(samples[0]) == {"t_s", "running", "waiting", "kv_cache_usage_perc", "preemptions",
                               "prefix_cache_hit_rate", "prompt_tok_s", "generation_tok_s"}
    # The rates add up to what the server generated during the run (the bench's tokens); t_s
    # is rounded to the millisecond.
    assert sum(s["generation_tok_s"] * (s["t_s"] - p["t_s"]) for p, s in zip(samples, samples[1:])) == \
        pytest.approx(result["server"]["metrics"]["generation_tokens"], rel=0.01)
    assert result["server"]["metrics"]["generation_tokens"] == result["requests"]["output_tokens"]["total"]
    assert result["server"]["probe"]["p50_ms"] is not None
    assert "percentiles" in result["server"]["cross_check"]


@pytest.mark.real_vllm
def test_real_vllm_trace_replay(vllm_server, capsys):
    code, result = _bench(capsys, "--url", vllm_server.url, "--trace", str(TRACE), "--speed", "2", "-n", "12",
                          "--records", "/dev/null")
    assert result["requests"]["completed"] == 12, result["requests"]["first_errors"]
    assert result["requests"]["prompt_tokens"]["n"] >= 8
    assert result["requests"]["prompt_tokens"]["mismatched"] == 0  # hash-id blocks built to exact lengths
    assert result["config"]["prompt_tokenizer"] == "server /tokenize"
    assert result["client"]["schedule_delay_ms"]["n"] == 12
    assert result["startup_s"] is not None


@pytest.mark.real_vllm
def test_real_vllm_compare_two_runs(vllm_server, capsys, tmp_path):
    files = []
    for name, c in (("a", "2"), ("b", "2"), ("c", "3")):
        _, result = _bench(capsys, "--url", vllm_server.url, "-n", "10", "-c", c, "--input-dist", "uniform:50,150",
                           "--output-dist", "fixed:8")
        assert result["requests"]["completed"] == 10, result["requests"]["first_errors"]
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(result))
    code = compare.main([str(files[0]), str(files[1]), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and doc["verdict"] in ("better", "worse", "no significant difference", "mixed")
    # (TPOT rows only where the runs' TPOT is above 0: vLLM may stream a short output in one read)
    assert {r["name"] for r in doc["metrics"]} >= {"ttft_ms.p50", "ttft_ms.p95", "e2e_ms.p50", "e2e_ms.p95"}
    assert compare.main([str(files[0]), str(files[2])]) == 2
    assert "concurrency: 2 vs 3" in capsys.readouterr().err


@pytest.fixture(scope="module")
def reasoning_vllm(vllm_factory):
    # The tiny models' tokenizer has no <think> tokens, which the qwen3 and deepseek_r1 parsers
    # require at start-up; Granite's parser works on text ("Here is my thought process:").
    with vllm_factory(sets=["reasoning_parser=granite"]) as server:
        yield server


@pytest.mark.real_vllm
def test_real_vllm_with_a_reasoning_parser(reasoning_vllm, capsys):
    """The server runs its reasoning parser on every chat stream; the random tiny model never
    writes the markers, so every token is answer: nothing breaks and the counts add up. (The
    split itself is checked on fake streams above: a random model cannot be made to reason.)"""
    code, result = _bench(capsys, "--url", reasoning_vllm.url, "--endpoint", "chat", "-n", "4", "-c", "2",
                          "--input-tokens", "64", "--output-tokens", "12", "--warmup", "0")
    assert result["requests"]["completed"] == 4, result["requests"]["first_errors"]
    assert result["requests"]["output_tokens"]["total"] == 48
    reasoning = result["reasoning"]
    if reasoning is not None:  # a random "<think>" or marker in the text: then the parts add up
        assert reasoning["reasoning_tokens"]["mean"] + reasoning["answer_tokens"]["mean"] == 12
    assert all(t is not None for t in result["samples"]["ttft_ms"])
