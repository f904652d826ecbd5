"""bench.py, sweep.py and the calibration server: pure functions, faults and exact timing
against the calibration server, and the real CPU vLLM (token counts and latencies against the
server's own metrics)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench
import httpx
import pytest
import sweep
from calibration_server import CalibrationServer, Schedule, parse_fault
from fault_server import MODEL, Action, as_json, fault_server, paced, response, word_ids

from rooflib.core import conf
from rooflib.core.errors import UsageError
from rooflib.load import analysis, asyncclient, bench_options, http1, promptgen, request_outcome, runner, sweeps
from rooflib.render import bench_text
from rooflib.server import diagnosis, metric_sources, slo_targets, snapshots

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


# ---------------------------------------------------------------------------------------------
# HTTP and SSE parsing from timestamped reads

def _chunked_stream(events: list[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return head + body + b"0\r\n\r\n"


def _split(raw: bytes, cuts: list[int]) -> list[tuple[int, bytes]]:
    """The raw bytes as socket reads at the given offsets, read k arriving at time 1000 * (k + 1)."""
    edges = [0, *cuts, len(raw)]
    return [(1000 * (k + 1), raw[a:b]) for k, (a, b) in enumerate(zip(edges, edges[1:]))]


def test_dechunk_reports_completeness():
    raw = b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n"
    segments, complete = http1.dechunk(raw)
    assert complete and [s[2] for s in segments] == [5, 3]
    assert http1.dechunk(raw[:-7])[1] is False


# A chunk whose data ends in "0\r\n\r\n" looks like the end of the body to a check of the tail.
FRAMED = b"5\r\nhello\r\n8\r\nx: 0\r\n\r\n\r\n3;ext=1\r\nabc\r\n0\r\n\r\n"


@pytest.mark.parametrize("cut", range(1, len(FRAMED)))
def test_chunk_framing_notices_the_end_only_after_the_last_chunk(cut):
    framing = asyncclient.ChunkFraming()
    ends = [framing.feed(FRAMED[:cut]), framing.feed(FRAMED[cut:])]
    assert ends == [False, True]


def test_chunk_framing_byte_by_byte_and_with_trailers():
    raw = b"4\r\n0\r\n\r\n\r\n0\r\nx-trailer: 1\r\n\r\n"
    framing = asyncclient.ChunkFraming()
    ends = [framing.feed(raw[i:i + 1]) for i in range(len(raw))]
    assert ends == [False] * (len(raw) - 1) + [True]
    with pytest.raises(ValueError):
        asyncclient.ChunkFraming().feed(b"zz\r\nhello")


# A 300-token stream as a starved API server (or a buffering proxy) hands it over: whole, in
# one read of more than MAX_HEAD bytes, or all but its [DONE] and last chunk.
WHOLE_STREAM = _chunked_stream([b'data: {"choices":[{"text":"%s"}]}\n\n' % (b"x" * 300)] * 300
                               + [b"data: [DONE]\n\n"])


@pytest.mark.parametrize("held_back", [0, 25])
def test_a_first_read_larger_than_a_head_may_be_is_read_to_the_end_of_the_response(held_back):
    first, rest = WHOLE_STREAM[:len(WHOLE_STREAM) - held_back], WHOLE_STREAM[len(WHOLE_STREAM) - held_back:]
    assert len(first) > asyncclient.MAX_HEAD

    async def received() -> tuple[asyncclient.Connection, list[bool]]:
        conn = asyncclient.Connection()
        waiter = conn.begin()
        done = []
        for piece in (first, rest):
            if piece:
                conn.data_received(piece)
                done.append(waiter.done())
        return conn, done
    conn, done = asyncio.run(received())
    assert done == [False] * (len(done) - 1) + [True] and conn.reusable
    assert http1.parse_response(conn.reads).events[-1][1] == b"[DONE]"


def test_each_event_gets_the_time_of_the_read_that_completed_it():
    events = [b"data: {\"a\": 1}\n\n", b": ping\n\n", b"data:{\"a\": 2}\n\n", b"data: [DONE]\n\n"]
    raw = _chunked_stream(events)
    first_event_end = raw.index(b"1}\n\n") + 4
    # read 1 stops one byte before the first event is complete; read 2 completes it and more.
    reads = _split(raw, [first_event_end - 1, raw.index(b"[DONE]")])
    response = http1.parse_response(reads)
    assert response.complete and response.status == 200
    assert [data for _, data in response.events] == [b'{"a": 1}', b'{"a": 2}', b"[DONE]"]
    assert [t for t, _ in response.events] == [2000, 2000, 3000]


def test_last_event_without_blank_line_is_kept():
    raw = _chunked_stream([b"data: {\"a\": 1}\n\n", b"data: [DONE]"])
    response = http1.parse_response(_split(raw, []))
    assert [d for _, d in response.events] == [b'{"a": 1}', b"[DONE]"]


def test_content_length_body_and_incomplete_head():
    raw = b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nabcde"
    response = http1.parse_response(_split(raw, [10]))
    assert response.status == 404 and response.complete and response.body == b"abcde"
    assert http1.parse_response([(1, b"HTTP/1.1 200")]).status is None


# ---------------------------------------------------------------------------------------------
# Interpreting a stream

def _sse_response(chunks: list, status: int = 200, done: bool = True) -> http1.Response:
    events = [(1_000_000 * (i + 1), c if isinstance(c, bytes) else json.dumps(c).encode())
              for i, c in enumerate(chunks)]
    if done:
        events.append((events[-1][0] + 1 if events else 1, b"[DONE]"))
    return http1.Response(status, {"content-type": "text/event-stream"}, True, events)


def _usage(n: int) -> dict:
    return {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}


def test_chat_role_only_chunk_does_not_start_ttft():
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "a"}}], "usage": _usage(1)},
              {"choices": [{"delta": {"content": "b"}}], "usage": _usage(3)},
              {"choices": [{"delta": {"content": "c"}, "finish_reason": "length"}], "usage": _usage(4)},
              {"choices": [], "usage": _usage(4)}]
    outcome = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse_response(chunks), "chat")
    assert outcome.ok, outcome.detail
    assert outcome.ttft_ms == 2.0  # the second event, not the role chunk at 1 ms
    assert outcome.e2e_ms == 4.0
    assert outcome.completion_tokens == 4 and outcome.chunk_tokens == [1, 2, 1]
    assert outcome.tpot_ms == pytest.approx((4.0 - 2.0) / 3)
    assert outcome.chunk_gaps_ms() == [1.0, 1.0]
    assert outcome.token_gaps_ms() == [0.5, 0.5, 1.0]
    assert outcome.finish_reason == "length" and outcome.prompt_tokens == 10


def test_completions_empty_text_chunk_is_not_a_token():
    chunks = [{"choices": [{"text": ""}]}, {"choices": [{"text": "x"}]}, {"choices": [{"text": "y"}]}]
    outcome = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse_response(chunks), "completions")
    assert outcome.ttft_ms == 2.0
    assert outcome.completion_tokens == 2 and not outcome.usage_reported


def test_sglang_completion_stream():
    """SGLang's stream as its serving_completions.py writes it (sgl-project/sglang@004c82e0,
    python/sglang/srt/entrypoints/openai/serving_completions.py): `usage` null in text chunks
    unless continuous_usage_stats, `matched_stop`, a final usage chunk with `choices: []`."""
    def chunk(text, finish=None, usage=None):
        return {"id": "a1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                             "matched_stop": None}], "usage": usage}
    chunks = [chunk(" a"), chunk(" b"), chunk(" c", "length"),
              {"id": "a1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}]
    outcome = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse_response(chunks), "completions")
    assert outcome.ok and outcome.completion_tokens == 3 and outcome.prompt_tokens == 5
    assert outcome.usage_reported and outcome.finish_reason == "length"
    assert outcome.ttft_ms == 1.0 and outcome.e2e_ms == 3.0


@pytest.mark.parametrize("chunks, status, done, kind", [
    ([{"choices": [{"text": "a"}]}], 200, False, "stream_cut"),
    ([{"choices": [{"text": "a"}]}, b"{not json"], 200, True, "malformed_sse"),
    ([{"choices": [{"text": "a"}]}, {"error": {"message": "boom"}}], 200, True, "stream_error"),
    ([{"choices": [{"text": ""}]}], 200, True, "empty_output"),
])
def test_stream_faults_are_classified(chunks, status, done, kind):
    outcome = request_outcome.interpret(request_outcome.Outcome(0), _sse_response(chunks, status, done), "completions")
    assert outcome.error == kind


@pytest.mark.parametrize("status, body, kind", [
    (404, b'{"error": {"message": "The model `x` does not exist."}}', "wrong_model"),
    (400, b'{"error": {"message": "bad"}}', "http_4xx"),
    (503, b"overloaded", "http_5xx"),
])
def test_http_errors_are_classified(status, body, kind):
    response = http1.Response(status, {"content-type": "application/json"}, True, body=body)
    assert request_outcome.interpret(request_outcome.Outcome(0), response, "completions").error == kind


# ---------------------------------------------------------------------------------------------
# Load schedule, prompts, config

def test_open_loop_schedule_is_absolute_and_rescaled():
    offsets = runner.arrival_offsets(200, rate=10.0, burstiness=1.0, seed=3)
    assert offsets == sorted(offsets)
    assert offsets[-1] == pytest.approx(20.0)
    assert offsets == runner.arrival_offsets(200, 10.0, 1.0, 3)

    def cv(xs):
        gaps = [b - a for a, b in zip([0.0, *xs], xs)]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    # Gamma with shape k has a coefficient of variation 1/sqrt(k): burstier below 1.
    assert cv(runner.arrival_offsets(2000, 10.0, 0.25, 1)) > 1.5 > cv(runner.arrival_offsets(2000, 10.0, 1.0, 1)) > 0.8
    assert cv(runner.arrival_offsets(2000, 10.0, 16.0, 1)) < 0.4


def _counter(two_token_words=("information", "community")) -> promptgen.TokenCounter:
    """A tokenizer where most words are one token, some two, plus a BOS token."""
    def count(text: str) -> int:
        return 1 + sum(2 if w in two_token_words else 1 for w in text.split())
    return promptgen.TokenCounter("test", count, exact=True)


@pytest.mark.parametrize("start", [0, 5, 50, 500])
def test_fit_words_reaches_the_target_from_any_first_guess(start):
    # A first guess above the target (no count below it yet) once ended in max() of nothing.
    counter = _counter()
    text, _ = promptgen.fit_words(counter.count, "information community", ["problem", "kid"] * 40, 20, start)
    assert counter.count(text) == 20


def test_prompts_are_exact_and_unique():
    counter = _counter()
    prompts = promptgen.build_prompts(counter, 50, 100, 0, seed=1)
    assert all(counter.count(p) == 100 for p in prompts)
    heads = {" ".join(p.split()[:6]) for p in prompts}
    assert len(heads) == 50


def test_shared_prefix_is_the_same_in_every_prompt():
    counter = _counter()
    prompts = promptgen.build_prompts(counter, 10, 120, 40, seed=2)
    assert all(counter.count(p) == 120 for p in prompts)
    shared = " ".join(prompts[0].split()[:35])
    assert all(p.startswith(shared) for p in prompts)
    assert len({p for p in prompts}) == 10
    assert len(set(promptgen.build_prompts(counter, 3, 50, 50, seed=2))) == 1


def test_prompts_of_two_runs_differ():
    counter = _counter()
    assert promptgen.build_prompts(counter, 1, 30, 0, 0) != promptgen.build_prompts(counter, 1, 30, 0, 0)


@pytest.mark.parametrize("argv, message", [
    (["-n", "0"], "-n/--num-requests (BENCH_N) must be between 1"),
    (["-c", "-3"], "-c/--concurrency (BENCH_C) must be between 1"),
    (["--input-tokens", "abc"], "--input-tokens (BENCH_IN) must be a whole number"),
    (["--output-tokens", "99999999999"], "--output-tokens (BENCH_OUT) must be between 1"),
    (["--rate", "0"], "--rate (requests/s) must be between"),
    (["--shared-prefix", "3000", "--input-tokens", "100"], "--shared-prefix 3000 is longer"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--slo-ttft-p95-ms", "nan"], "--slo-ttft-p95-ms (SLO_TTFT_P95_MS) must be"),
])
def test_bad_numbers_are_usage_errors(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("BENCH_N", "BENCH_C", "BENCH_IN", "BENCH_OUT", "INFER_URL"):
        monkeypatch.delenv(name, raising=False)
    assert bench.main(["--url", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BENCH_N", "7")
    monkeypatch.setenv("BENCH_IN", "33")
    (tmp_path / "inference.env").write_text("BENCH_C=3\n")
    args = bench_options.build_parser().parse_args([])
    options = bench_options.make_options(args, conf.settings_from_args(args))
    assert (options.num_requests, options.input_tokens, options.concurrency, options.warmup) == (7, 33, 3, 3)
    args = bench_options.build_parser().parse_args(["-n", "5"])
    assert bench_options.make_options(args, conf.settings_from_args(args)).num_requests == 5


def _options(argv: list[str], monkeypatch, tmp_path) -> bench_options.BenchOptions:
    monkeypatch.chdir(tmp_path)
    for name in ("BENCH_N", "BENCH_C", "BENCH_IN", "BENCH_OUT", "SLO_TTFT_P95_MS", "SLO_TPOT_P95_MS", "BENCH_LOG"):
        monkeypatch.delenv(name, raising=False)
    args = bench_options.build_parser().parse_args(argv)
    return bench_options.read_options(args, conf.settings_from_args(args))


def test_options_are_recorded_as_the_config_saved_results_carry(monkeypatch, tmp_path):
    options = _options(["--slo-tpot-p95-ms", "50", "--extra-body", '{"top_k": 1}'], monkeypatch, tmp_path)
    assert options.slo == slo_targets.Targets(None, 50.0) and options.extra_body == {"top_k": 1}
    recorded = options.recorded()
    # Every setting is recorded but those that only steer the run (and credentials, never
    # recorded): a new one must reach `config`.
    steering = {"num_requests_given", "warmup_given", "extra_body", "slo", "prometheus_auth"}
    assert set(recorded) == {f.name for f in dataclasses.fields(options)} - steering | {"slo_ttft_p95_ms", "slo_tpot_p95_ms"}
    assert (recorded["slo_ttft_p95_ms"], recorded["slo_tpot_p95_ms"], recorded["concurrency"], recorded["warmup"]) \
        == (None, 50.0, 8, 8)


def test_a_sweep_point_takes_its_concurrency_and_requests(monkeypatch, tmp_path):
    asked = _options(["--workers", "4"], monkeypatch, tmp_path)
    point = sweep.point_options(asked, 16)
    assert (point.concurrency, point.num_requests, point.num_requests_given, point.warmup) == (16, 64, True, 16)
    assert sweep.point_options(asked, 4).num_requests == 16 and asked.concurrency == 8  # asked stays as it was
    with pytest.raises(UsageError, match="--workers 4 exceeds the concurrency 2"):
        sweep.point_options(asked, 2)
    given = _options(["-n", "5", "--warmup", "1"], monkeypatch, tmp_path)
    assert (sweep.point_options(given, 16).num_requests, sweep.point_options(given, 16).warmup) == (5, 1)


# ---------------------------------------------------------------------------------------------
# Verdicts

def _done(index: int, ttft_ms: float, tpot_ms: float, tokens: int = 4, warmup: bool = False) -> request_outcome.Outcome:
    times = [int((ttft_ms + tpot_ms * k) * 1e6) for k in range(tokens)]
    return request_outcome.Outcome(index, warmup=warmup, sent_ns=0, status=200, token_times=times,
                         chunk_tokens=[1] * tokens, completion_tokens=tokens, usage_reported=True,
                         prompt_tokens=8, finish_reason="length", done_ns=times[-1])


def _config() -> dict:
    return {"output_tokens": 4, "input_tokens": 8, "concurrency": 2}


def test_verdicts_and_exit_codes():
    outcomes = [_done(0, 500, 50, warmup=True)] + [_done(i, 100 + i, 10) for i in range(1, 21)]
    passed = analysis.analyse(outcomes, _config(), [0.01], 1, 2, slo=slo_targets.Targets(200, 20))
    assert passed["verdict"] == "PASS" and analysis.exit_code(passed) == 0
    assert passed["requests"]["warmup"] == 1 and passed["ttft_ms"]["n"] == 20
    assert passed["ttft_ms"]["max"] == pytest.approx(120)  # the warm-up's 500 ms is not counted
    failed = analysis.analyse(outcomes, _config(), [0.01], 1, 2, slo=slo_targets.Targets(tpot_p95_ms=5))
    assert failed["verdict"] == "FAIL" and analysis.exit_code(failed) == 1
    assert "tpot_p95_ms 10.0 ms > 5 ms" in failed["verdict_reasons"][0]
    lagged = analysis.analyse(outcomes, _config(), [0.01] * 50 + [30.0] * 5, 1, 2, slo=slo_targets.Targets(tpot_p95_ms=20))
    assert lagged["verdict"] == "INVALID" and analysis.exit_code(lagged) == 4
    assert not lagged["client"]["valid"]
    rare = analysis.analyse(outcomes, _config(), [0.01] * 97 + [30.0] * 3, 1, 20, slo=slo_targets.Targets(tpot_p95_ms=20))
    assert rare["verdict"] == "PASS" and any("p99 figures may include client delay" in w for w in rare["warnings"])
    errored = analysis.analyse([request_outcome.Outcome(1, error="unreachable")], _config(), [], 1, 2)
    assert errored["verdict"] == "ERROR" and analysis.exit_code(errored) == 3
    none = analysis.analyse(outcomes, _config(), [0.01], 1, 2)
    assert none["verdict"] == "NO SLO" and analysis.exit_code(none) == 0


@pytest.mark.parametrize("spans_ms, peak", [
    ([(0, 100), (0, 100), (0, 100)], 3),                  # sent together
    ([(0, 100), (100, 200), (200, 300)], 1),              # one sent as the last one ends: never two at once
    ([(0, 300), (50, 100), (150, 200), (250, 400)], 2),   # a long one beside short ones that come and go
    ([], 0),
])
def test_the_peak_in_flight_is_the_most_requests_the_client_had_out_at_once(spans_ms, peak):
    done = [dataclasses.replace(_done(i, end - start, 0, tokens=1), sent_ns=int(start * 1e6),
                                token_times=[int(end * 1e6)]) for i, (start, end) in enumerate(spans_ms)]
    assert analysis.peak_in_flight(done) == peak


def test_out_of_file_descriptors_comes_first_when_the_client_also_stalled():
    outcomes = [_done(i, 100, 10) for i in range(10)] + [request_outcome.Outcome(10, error="client_fd_limit")]
    stalled = analysis.analyse(outcomes, _config(), [0.01] * 50 + [300.0] * 5, 1, 1)
    assert stalled["verdict"] == "INVALID" and analysis.exit_code(stalled) == 4
    reasons = stalled["verdict_reasons"]
    assert reasons[0].startswith("the client ran out of file descriptors for 1 requests: raise the limit (ulimit -n")
    assert any(r.startswith("the client stalled 1.5 s of the 1.0 s run") for r in reasons[1:]), reasons


def test_a_failed_request_fails_the_verdict():
    outcomes = [_done(i, 100, 10) for i in range(10)] + [request_outcome.Outcome(10, error="http_5xx", detail="HTTP 500")]
    result = analysis.analyse(outcomes, _config(), [0.01], 1, 2, slo=slo_targets.Targets(ttft_p95_ms=1000))
    assert result["verdict"] == "FAIL" and result["requests"]["errors"] == {"http_5xx": 1}
    assert "1 of 11 requests failed" in result["verdict_reasons"][0]


def test_short_outputs_are_reported():
    outcomes = [_done(i, 100, 10, tokens=4) for i in range(5)] + [_done(5, 100, 10, tokens=2)]
    outcomes[-1].finish_reason = "stop"
    result = analysis.analyse(outcomes, _config(), [0.01], 1, 2)
    assert result["requests"]["output_tokens"]["short"] == 1
    assert not result["requests"]["output_tokens"]["ignore_eos_honoured"]
    assert any("ignore_eos not honoured" in w and "stop" in w for w in result["warnings"])


# ---------------------------------------------------------------------------------------------
# Against the calibration server (exact timing, faults)

@pytest.fixture
def calibration():
    servers = []

    def start(**kwargs) -> CalibrationServer:
        faults = [parse_fault(f) for f in kwargs.pop("faults", [])]
        server = CalibrationServer(Schedule(faults=faults, **kwargs)).start_in_thread()
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.stop()


def _run(capsys, url: str, *argv: str) -> tuple[int, dict]:
    code = bench.main(["--url", url, "--json", *argv])
    captured = capsys.readouterr()
    assert captured.out.strip(), f"exit {code}, no result: {captured.err.strip()[-500:]}"
    return code, json.loads(captured.out)


def test_timing_against_a_known_schedule(calibration, capsys, tmp_path):
    server = calibration(ttft_ms=60, itl_ms=15)
    records = tmp_path / "records.jsonl"
    code, result = _run(capsys, server.url, "-n", "8", "-c", "4", "--input-tokens", "32",
                        "--output-tokens", "6", "--records", str(records))
    assert code in (0, 4), result["verdict_reasons"]
    assert result["requests"]["completed"] == 8 and result["requests"]["failed"] == 0
    assert result["requests"]["rejected"] == {"count": 0, "share": 0.0, "by_cause": {}, "first_body": None}
    assert result["requests"]["output_tokens"]["total"] == 48
    assert result["requests"]["prompt_tokens"]["min"] == result["requests"]["prompt_tokens"]["max"] == 32
    # The client cannot see a token before the server wrote it: the schedule is a lower bound of
    # TTFT and e2e (the last of 6 tokens at 60 + 5 x 15 ms). Not of TPOT: a client that reads the
    # first token late finds the others already there.
    assert result["ttft_ms"]["min"] >= 60 and result["e2e_ms"]["min"] >= 60 + 5 * 15
    truth = httpx.get(server.url + "/calibration/truth").json()
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(lines) == 12 and sum(r["warmup"] for r in lines) == 4
    for record in lines:
        entry = truth[f"bench-{result['config']['run_id']}-{record['index']}"]
        first_write_ms = (entry["writes_ns"][0] - record["sent_ns"]) / 1e6
        # The server's arrival time is the kernel's: after the client sent, and the schedule counts from it.
        assert entry["arrived_by"] == "kernel"
        assert record["sent_ns"] < entry["arrived_ns"] <= entry["writes_ns"][0] - 59_000_000
        assert record["ttft_ms"] >= first_write_ms  # client timestamps come after the server's writes
        assert record["e2e_ms"] >= (entry["writes_ns"][-1] - record["sent_ns"]) / 1e6
        assert len(record["chunk_ms"]) == 6


def test_chat_endpoint_skips_the_role_chunk(calibration, capsys):
    server = calibration(ttft_ms=50, itl_ms=5)
    code, result = _run(capsys, server.url, "-n", "4", "-c", "2", "--input-tokens", "20",
                        "--output-tokens", "4", "--endpoint", "chat")
    assert result["requests"]["completed"] == 4
    assert result["ttft_ms"]["min"] >= 50  # the role chunk comes at once; it is not a token
    assert result["requests"]["prompt_tokens"]["min"] == 20  # template tokens included


def test_multi_token_chunks_give_per_token_itl(calibration, capsys):
    server = calibration(ttft_ms=10, itl_ms=20, tokens_per_chunk=2)
    code, result = _run(capsys, server.url, "-n", "4", "-c", "4", "--input-tokens", "16",
                        "--output-tokens", "8", "--warmup", "0")
    assert result["requests"]["output_tokens"]["total"] == 32
    assert result["requests"]["tokens_per_chunk"]["p50"] == 2
    assert result["itl_token_ms"]["n"] == 2 * result["itl_ms"]["n"]
    assert result["itl_token_ms"]["p50"] == pytest.approx(result["itl_ms"]["p50"] / 2, rel=0.01)


@pytest.mark.parametrize("fault, kind", [
    ("http500:3", "http_5xx"), ("http400:3", "http_4xx"), ("cut:3", "stream_cut"),
    ("malformed:3", "malformed_sse"), ("stream_error:3", "stream_error"),
])
def test_faults_are_counted_and_the_run_goes_on(calibration, capsys, fault, kind):
    server = calibration(ttft_ms=5, itl_ms=2, faults=[fault])
    code, result = _run(capsys, server.url, "-n", "9", "-c", "3", "--input-tokens", "16",
                        "--output-tokens", "6", "--warmup", "0", "--slo-ttft-p95-ms", "1000")
    assert result["requests"]["errors"] == {kind: 3}
    assert result["requests"]["completed"] == 6
    assert result["verdict"] == "FAIL" and code == 1
    # Only a 4xx is a rejection; its body ("injected http400") does not name the context length.
    assert result["requests"]["rejected"]["by_cause"] == ({"other": 3} if kind == "http_4xx" else {})


def test_stalled_streams_time_out(calibration, capsys):
    server = calibration(ttft_ms=5, itl_ms=5, faults=["stall:2"])
    code, result = _run(capsys, server.url, "-n", "4", "-c", "4", "--input-tokens", "8",
                        "--output-tokens", "6", "--warmup", "0", "--timeout", "3")
    assert result["requests"]["errors"] == {"timeout": 2} and result["requests"]["completed"] == 2


@pytest.mark.parametrize("fault, total, short, warning", [
    ("short:2", 24, 2, "ignore_eos not honoured"),  # half the requests stop at 4 of 8 tokens
    ("no_usage:1", 32, 0, "the server sent no usage"),
])
def test_length_problems_are_reported(calibration, capsys, fault, total, short, warning):
    server = calibration(ttft_ms=5, itl_ms=2, faults=[fault])
    code, result = _run(capsys, server.url, "-n", "4", "-c", "2", "--input-tokens", "8",
                        "--output-tokens", "8", "--warmup", "0")
    assert result["requests"]["output_tokens"]["total"] == total
    assert result["requests"]["output_tokens"]["short"] == short
    assert any(warning in w for w in result["warnings"])


def test_api_key_is_sent_and_never_printed(calibration, capsys, monkeypatch):
    server = calibration(ttft_ms=5, itl_ms=2, api_key="sk-secret-123")
    monkeypatch.setenv("INFER_API_KEY", "sk-secret-123")
    code, result = _run(capsys, server.url, "-n", "2", "-c", "1", "--input-tokens", "8", "--output-tokens", "3")
    assert result["requests"]["completed"] == 2 and "sk-secret-123" not in json.dumps(result)
    monkeypatch.setenv("INFER_API_KEY", "sk-wrong-456")
    assert bench.main(["--url", server.url, "-n", "1"]) == 3
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "sk-wrong-456" not in err


def test_a_connection_closed_as_it_is_reused_is_retried(calibration, capsys):
    server = calibration(ttft_ms=5, itl_ms=2, drop_reused=True)
    code, result = _run(capsys, server.url, "-n", "6", "-c", "2", "--input-tokens", "8", "--output-tokens", "3")
    assert result["requests"]["completed"] == 6 and result["requests"]["errors"] == {}


def test_a_server_that_dies_mid_run_still_gives_results(calibration, capsys):
    server = calibration(ttft_ms=5, itl_ms=20)

    def stop_after_some_requests() -> None:
        # With -c 2, a third request arrives only once the client has finished one.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            truth = httpx.get(server.url + "/calibration/truth", timeout=30).json()
            if sum(key.startswith("bench-") for key in truth) >= 3:
                break
            time.sleep(0.05)
        server.stop()
    threading.Thread(target=stop_after_some_requests, daemon=True).start()
    code, result = _run(capsys, server.url, "-n", "40", "-c", "2", "--input-tokens", "8",
                        "--output-tokens", "10", "--warmup", "0", "--timeout", "10")
    assert code == 1 and result["verdict"] == "FAIL"
    assert 0 < result["requests"]["completed"] < 40
    assert result["requests"]["completed"] + result["requests"]["failed"] == result["requests"]["sent"]
    assert set(result["requests"]["errors"]) <= {"unreachable", "timeout", "stream_cut"}


def test_unreachable_server_is_exit_3(capsys):
    code = bench.main(["--url", "http://127.0.0.1:9", "-n", "2", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("error: cannot reach") and len(err.strip().splitlines()) == 1


def test_wrong_model_is_a_usage_error(calibration, capsys):
    server = calibration()
    assert bench.main(["--url", server.url, "--model", "nope", "-n", "1"]) == 2
    assert "model 'nope' is not served" in capsys.readouterr().err


def test_open_loop_duration_run(calibration, capsys):
    server = calibration(ttft_ms=5, itl_ms=2)
    code, result = _run(capsys, server.url, "--rate", "40", "--duration", "0.5", "-n", "200",
                        "--input-tokens", "8", "--output-tokens", "4")
    assert 10 <= result["requests"]["sent"] < 40  # about 40/s for 0.5 s, not all 200
    assert result["client"]["schedule_delay_ms"]["n"] == result["requests"]["sent"]
    assert result["requests"]["warmup"] == 0


def test_worker_processes_share_the_load(calibration, capsys, tmp_path):
    server = calibration(ttft_ms=20, itl_ms=5)
    records = tmp_path / "r.jsonl"
    code, result = _run(capsys, server.url, "-n", "12", "-c", "4", "--workers", "2",
                        "--input-tokens", "8", "--output-tokens", "4", "--records", str(records))
    assert result["requests"]["completed"] == 12 and result["ttft_ms"]["min"] >= 20
    indices = sorted(json.loads(line)["index"] for line in records.read_text().splitlines())
    assert indices == list(range(16))


def test_log_entries_are_appended(calibration, capsys, tmp_path):
    server = calibration(ttft_ms=5, itl_ms=2)
    log = tmp_path / "bench-log.md"
    for _ in range(2):
        _run(capsys, server.url, "-n", "2", "-c", "1", "--input-tokens", "8", "--output-tokens", "3",
             "--log", str(log), "--slo-ttft-p95-ms", "500")
    text = log.read_text()
    assert text.count("\n## ") + text.startswith("## ") == 2
    for heading in ("### Date", "### Server", "### Config", "### Results", "### SLO verdict",
                    "### Server metrics (before -> after)", "### Notes"):
        assert text.splitlines().count(heading) == 2
    assert "Engine version: calibration-1" in text and "| TTFT |" in text


def test_ctrl_c_keeps_partial_results(calibration):
    server = calibration(ttft_ms=5, itl_ms=50)
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "bench.py"), "--url", server.url, "--json",
                             "-n", "40", "-c", "2", "--input-tokens", "8", "--output-tokens", "10",
                             "--warmup", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Interrupt once a measured request is done (the first progress line says so).
    while "requests done" not in (line := proc.stderr.readline()):
        assert line, f"bench.py ended before a request was done: exit {proc.wait()}"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    result = json.loads(out)
    assert result["interrupted"] and 0 < result["requests"]["completed"] < 40


def test_sweep_finds_the_knee(calibration, capsys):
    server = calibration(ttft_ms=20, itl_ms=5)
    code = sweep.main(["--url", server.url, "--json", "--sweep-c", "1,2", "-n", "4",
                       "--input-tokens", "8", "--output-tokens", "4", "--slo-ttft-p95-ms", "5000"])
    report = json.loads(capsys.readouterr().out)
    assert [p["concurrency"] for p in report["points"]] == [1, 2]
    if code == 0:
        assert report["knee"]["concurrency"] == 2
    else:  # a loaded machine may make a point client-bound; that is reported, not hidden
        assert code == 4 and any(p["verdict"] == "INVALID" for p in report["points"])
    assert sweeps.knee([{"concurrency": 1, "verdict": "PASS"}, {"concurrency": 4, "verdict": "FAIL"}], True) \
        == {"concurrency": 1, "verdict": "PASS"}
    with pytest.raises(UsageError):
        sweeps.parse_levels("4,0")


OTHER_PROCESSES = ("client event-loop lag p95 9.00 ms > 5.00 ms (10% of the smallest median measured); the client "
                   "used only 12% of a core: other processes kept it waiting; run it on a quieter machine or core")


def test_sweep_knee_stops_below_an_invalid_run():
    """The caveat gives the invalid point's own cause, as bench gave it (here other processes, not
    a client that could not keep up)."""
    points = [{"concurrency": 1, "verdict": "PASS", "reasons": []},
              {"concurrency": 4, "verdict": "INVALID", "reasons": [OTHER_PROCESSES]},
              {"concurrency": 8, "verdict": "PASS", "reasons": []}]
    found = sweeps.knee(points, True)
    assert found["concurrency"] == 1
    caveat = sweeps.knee_caveat(points, found)
    assert caveat == (f"C = 4 was INVALID ({OTHER_PROCESSES}): the knee cannot be named above it; the passes at "
                      "C = 8 are not counted; rerun that point")
    report = {"points": [], "knee": None, "knee_caveat": caveat, "slo_set": True, "interrupted": False}
    assert f"note: C = 4 was INVALID ({OTHER_PROCESSES})" in sweep.human(report)
    assert sweeps.knee_caveat([{"concurrency": 1, "verdict": "PASS"}], found) is None


def test_sweep_without_a_valid_point_says_so_not_that_the_slo_was_missed():
    """Every point met the SLO but was INVALID: "no valid point" and the real cause."""
    points = [{"concurrency": c, "verdict": "INVALID", "reasons": [OTHER_PROCESSES], "req_s": 1.0,
               "output_tok_s": 1.0, "total_tok_s": 1.0, "ttft_ms": {"p50": 1.0, "p95": 1.0},
               "tpot_ms": {"p50": 1.0, "p95": 1.0}} for c in (1, 4)]
    report = {"points": points, "knee": None, "knee_caveat": sweeps.knee_caveat(points, None), "slo_set": True,
              "interrupted": False}
    assert sweep.human(report).splitlines()[-1] == f"Knee: none: no valid point: C = 1 was INVALID ({OTHER_PROCESSES})"
    failed = [{"concurrency": 1, "verdict": "FAIL", "reasons": ["ttft_p95_ms 900.0 ms > 500 ms"]}, points[1]]
    assert sweeps.no_knee_reason(failed) == "no concurrency met the SLO below C = 4"
    assert sweeps.no_knee_reason(failed[:1]) == "no concurrency met the SLO"


# ---------------------------------------------------------------------------------------------
# Against a fake vLLM (fault_server): requests over max_model_len, the server's diagnosis

CONTEXT_LIMIT = 64


# What a server answers a request longer than its context, by the prompt and output tokens asked:
# vLLM's OpenAI server (serving_engine's length check), SGLang's, and a refusal for another cause.
REFUSALS = {
    "vllm": lambda prompt, output: {"error": {"message": (
        f"This model's maximum context length is {CONTEXT_LIMIT} tokens. However, you requested {prompt + output} "
        f"tokens ({prompt} in the messages, {output} in the completion). Please reduce the length of the messages "
        "or completion."), "type": "BadRequestError", "param": None, "code": 400}},
    "sglang": lambda prompt, output: {"object": "error", "message": (
        f"The input ({prompt} tokens) is longer than the model's context length ({CONTEXT_LIMIT} tokens)."),
        "type": "BadRequestError", "param": None, "code": 400},
    "other": lambda prompt, output: {"error": {"message": "the prompt was refused by a content filter",
                                               "type": "BadRequestError", "code": 400}},
}


def _refusing_over_the_limit(refusal, refused: list[int]):
    """A vLLM serving CONTEXT_LIMIT tokens that answers 400 with `refusal`'s body to a longer
    streamed request, noting each one's length in `refused`."""
    def fault(request):
        if request.path == "/v1/models":
            return as_json(200, {"object": "list", "data": [{"id": MODEL, "max_model_len": CONTEXT_LIMIT}]})
        body = request.body if isinstance(request.body, dict) else {}
        if request.path == "/v1/completions" and body.get("stream"):
            prompt = len(word_ids(body["prompt"]))  # what the fake /tokenize counts
            if prompt + body["max_tokens"] > CONTEXT_LIMIT:
                refused.append(prompt + body["max_tokens"])
                return as_json(400, refusal(prompt, body["max_tokens"]))
        return None
    return fault


def _bench(url: str, tmp_path: Path, *argv: str) -> tuple[int, dict | None]:
    """bench's exit code and its JSON (--json-out; None when it wrote none): the human text stays on stdout."""
    out = tmp_path / "run.json"
    code = bench.main(["--url", url, "-n", "16", "-c", "4", "--warmup", "0", "--output-tokens", "4",
                       "--timeline-interval", "0", "--json-out", str(out), *argv])
    return code, json.loads(out.read_text()) if out.exists() else None


def test_a_workload_over_max_model_len_is_a_usage_error_without_over_limit(capsys, tmp_path):
    refused = []
    with fault_server(_refusing_over_the_limit(REFUSALS["vllm"], refused)) as url:
        code, result = _bench(url, tmp_path, "--input-tokens", "100")
    err = capsys.readouterr().err
    assert code == 2 and result is None and not refused
    assert "prompt + output tokens reach 104, over the model's max_model_len 64" in err and "--over-limit" in err


@pytest.mark.parametrize("answer, lengths, cause, verdict, exit_code", [
    # Some requests over the limit: FAIL and exit 1, as any run with failed requests.
    ("vllm", ["--input-dist", "uniform:30,90"], "context_length", "FAIL", 1),
    ("sglang", ["--input-dist", "uniform:30,90"], "context_length", "FAIL", 1),
    ("other", ["--input-dist", "uniform:30,90"], "other", "FAIL", 1),
    # Every request over it: ERROR and exit 3, as any run whose every request failed.
    ("vllm", ["--input-tokens", "100"], "context_length", "ERROR", 3),
])
def test_over_limit_sends_long_requests_and_counts_the_servers_rejections(answer, lengths, cause, verdict,
                                                                          exit_code, capsys, tmp_path):
    refused = []
    with fault_server(_refusing_over_the_limit(REFUSALS[answer], refused)) as url:
        code, result = _bench(url, tmp_path, *lengths, "--over-limit")
    human = capsys.readouterr().out
    count = len(refused)
    assert 0 < count and (code, result["verdict"]) == (exit_code, verdict)
    assert result["config"]["over_limit"] is True and result["requests"]["failed"] == count
    rejected = result["requests"]["rejected"]
    assert (rejected["count"], rejected["share"], rejected["by_cause"]) == (count, count / 16, {cause: count})
    # The first rejected request's detail, as its error line gives it (every failure here is a rejection).
    assert result["requests"]["first_errors"][0].endswith(f" http_4xx: {rejected['first_body']}")
    assert rejected["first_body"].startswith('HTTP 400: {"')
    # bench's own count of the requests over the limit, before the run, is the server's.
    assert result["warnings"][0].startswith(f"{count} of the 16 measured requests are longer than max_model_len 64")
    assert f"\nRejected: {count} of 16 requests ({count / 16:.1%}): {cause} {count}; first: HTTP 400: {{" in human


METRICS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
IDLE = (METRICS_DIR / "vllm-0.32-idle.txt").read_text()


def _engine_served(n: int, ttft_s: float, e2e_s: float) -> str:
    """The idle vLLM scrape after the engine served `n` requests, each with this TTFT and e2e."""
    text = IDLE
    for name, seconds in (("vllm:time_to_first_token_seconds", ttft_s), ("vllm:e2e_request_latency_seconds", e2e_s)):
        head = re.escape(name)
        text = re.sub(rf'^({head}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} )\S+$',
                      lambda m: m[1] + str(float(n if float(m[2]) >= seconds else 0)), text, flags=re.M)
        text = re.sub(rf"^({head}_count{{[^}}]*}} )\S+$", lambda m: f"{m[1]}{float(n)}", text, flags=re.M)
        text = re.sub(rf"^({head}_sum{{[^}}]*}} )\S+$", lambda m: f"{m[1]}{n * seconds}", text, flags=re.M)
    return text


def _scrapes(before: str, after: str, pause: float):
    """/metrics is `before` at bench's first scrape and `after` from then on; the requests are
    answered after `pause` s, and again between the pieces of a stream (when not 0)."""
    scraped, slow = [], paced(pause)

    def fault(request):
        if request.path == "/metrics":
            scraped.append(request)
            page = before if len(scraped) == 1 else after
            return Action(response(200, page.encode(), "text/plain; version=0.0.4"))
        return slow(request) if pause else None
    return fault


@pytest.mark.parametrize("before, after, pause, outside", [
    # The engine's own root: requests queue behind the running cap (a recorded vLLM window).
    ((METRICS_DIR / "vllm-0.32-queue-before.txt").read_text(), (METRICS_DIR / "vllm-0.32-queue-after.txt").read_text(),
     0.0, False),
    # The engine took 1 ms to the first token, the client about 150: the time outside the engine is the root.
    (IDLE, _engine_served(16, 0.0005, 0.1), 0.05, True),
])
def test_the_human_text_carries_the_diagnosis_as_task_metrics_prints_it(before, after, pause, outside,
                                                                       capsys, tmp_path):
    with fault_server(_scrapes(before, after, pause)) as url:
        code, result = _bench(url, tmp_path, "--input-tokens", "8", "--output-tokens", "2")
    lines = capsys.readouterr().out.splitlines()
    found = result["server"]["metrics"]["diagnosis"]
    assert found["root_cause"] and (found["root_cause"]["kind"] == "outside_engine") == outside
    told = diagnosis.format_diagnosis(found)
    assert told[0].startswith(f"Root cause: [{found['root_cause']['kind']}] ") and told[0] in lines
    first = lines.index(told[0])
    assert lines[first:first + len(told)] == told  # the plan and the verify commands with it
    assert "Plan (one change at a time, in this order):" in told
    # The cross-check's finding is said once, as the diagnosis says it.
    assert sum(found["root_cause"]["evidence"] in line for line in lines) == 1


# ---------------------------------------------------------------------------------------------
# The real CPU vLLM

def _scrape(url: str) -> dict:
    text, at = metric_sources.scrape(url)
    return snapshots.snapshot(text, url, at)


def _bucket_shifts(delta: dict, records: list[dict], concept: str, key: str) -> list[int]:
    """How many buckets of the server's histogram our k-th fastest request sits above the
    server's k-th fastest. Our clock starts before the server's and stops after it, so the
    shift is never negative."""
    hist = delta["histograms"][concept]
    server_counts = [round(b - a) for a, b in zip([0.0, *hist["counts"]], hist["counts"])]
    server_ranks = sorted(i for i, n in enumerate(server_counts) for _ in range(n))
    our_ranks = sorted(next(i for i, le in enumerate(hist["le"]) if r[key] / 1000 <= le) for r in records)
    assert len(server_ranks) == len(our_ranks)
    return [o - s for o, s in zip(our_ranks, server_ranks)]


def _measure_against_vllm(server, capsys, records: Path) -> tuple[dict, list[dict], dict]:
    url = server.url
    before = _scrape(url)
    # No /metrics scrapes during the run: vLLM's API server renders each page between token
    # writes, a delay the engine's histograms do not hold (this test compares to the bucket).
    code, result = _run(capsys, url, "-n", "12", "-c", "4", "--input-tokens", "200",
                        "--output-tokens", "24", "--warmup", "2", "--records", str(records),
                        "--timeline-interval", "0")
    delta = snapshots.difference(before, _scrape(url))
    return result, [json.loads(line) for line in records.read_text().splitlines()], delta


@pytest.mark.real_vllm
def test_real_vllm_counts_and_latencies_match_the_server(vllm_server, capsys, tmp_path):
    result, records, delta = _measure_against_vllm(vllm_server, capsys, tmp_path / "r.jsonl")
    assert result["requests"]["completed"] == 12, result["requests"]["first_errors"]
    assert result["config"]["prompt_tokenizer"] == "server /tokenize"
    # Exact prompts and outputs, by the server's own count; warm-up requests are in both.
    assert result["requests"]["prompt_tokens"]["min"] == result["requests"]["prompt_tokens"]["max"] == 200
    assert result["requests"]["output_tokens"] == {"requested": 24, "requested_total": 288, "total": 288, "short": 0,
                                                   "ignore_eos_honoured": True}
    assert delta["counters"]["generation_tokens"]["value"] == sum(r["completion_tokens"] for r in records) == 336
    assert result["server"]["metrics"]["generation_tokens"] == 336
    assert not any("generated" in w for w in result["warnings"])
    # Our clock starts before the server's and stops after it: never a bucket below the server's.
    # How far above is a matter of load (other processes can stall vLLM's API server between the
    # engine's clock and the socket for 100+ ms on a busy host), so no upper bound is asserted
    # here: the client's error is measured by `task bench:calibrate` (benchmarks/bench_accuracy.py).
    shifts = {c: _bucket_shifts(delta, records, c, k) for c, k in (("ttft", "ttft_ms"), ("e2e", "e2e_ms"))}
    assert all(s >= 0 for row in shifts.values() for s in row), shifts


@pytest.mark.real_vllm
def test_real_vllm_chat_with_a_shared_prefix(vllm_server, capsys):
    code, result = _run(capsys, vllm_server.url, "-n", "6", "-c", "3", "--input-tokens", "300",
                        "--output-tokens", "8", "--endpoint", "chat", "--shared-prefix", "200",
                        "--warmup", "0", "--log", os.devnull)
    assert result["requests"]["completed"] == 6, result["requests"]["first_errors"]
    assert result["requests"]["prompt_tokens"]["min"] == result["requests"]["prompt_tokens"]["max"] == 300
    assert result["requests"]["output_tokens"]["short"] == 0
    assert result["server"]["info"]["engine_version"]
    assert result["server"]["info"]["max_model_len"] == 4096
    hit_rate = result["server"]["metrics"]["prefix_cache_hit_rate"]
    assert hit_rate is not None and hit_rate > 0.3  # the shared 200 tokens came from the cache


def test_every_label_of_the_human_report_leaves_a_space_before_its_value():
    """A label as wide as its 34-column field ran into the number ("... worst):731")."""
    source = Path(bench_text.__file__).read_text()  # bench's and merge's console text
    labels = re.findall(r"\{'([^']+)':<34\}", source)
    assert "Client stalls (n, total, worst):" in labels
    assert all(len(label) < 34 for label in labels), [label for label in labels if len(label) >= 34]
