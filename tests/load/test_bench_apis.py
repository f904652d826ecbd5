"""bench beyond text completions: the Responses and Anthropic Messages APIs (streamed text) and the
pooling APIs (embeddings, score). Formats against answers recorded from vLLM 0.32.0
(tests/fixtures/apis: the tiny chat model for responses and messages, the tiny BERT encoder of
profile cpu-tiny-pooling for embeddings and score), faults and usage errors against a fake
server, and the real CPU vLLM."""
from __future__ import annotations

import json
import re
from pathlib import Path

import bench
import compare
import httpx
import pytest
import report
import sweep
from calibration_server import CalibrationServer, Schedule
from fault_server import KEY, Action, as_json, chunks, fault_server, response

from rooflib.load import apis, http1, request_outcome

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "apis"
RECORDED = {name: (FIXTURES / f"vllm-0.32-{name}.{'sse' if name in ('responses', 'messages') else 'json'}").read_bytes()
            for name in ("responses", "messages", "embeddings", "score")}
PATHS = {api.path: api.name for api in apis.APIS.values()}


def _events(recorded: bytes) -> list[bytes]:
    """A recorded SSE stream as its event blocks, each with its blank line."""
    return [block + b"\n\n" for block in recorded.split(b"\n\n") if block.strip()]


def _sse(events: list[bytes], status: int = 200) -> http1.Response:
    body = b"".join(events)
    return http1.Response(status, {"content-type": "text/event-stream"}, True,
                          [(1000 * (k + 1), data) for k, (_, data) in enumerate(http1.parse_response(
                              [(0, response(200, chunks(events), "text/event-stream", chunked=True))]).events)],
                          body)


def _json(body: bytes, status: int = 200, complete: bool = True) -> http1.Response:
    return http1.Response(status, {"content-type": "application/json"}, complete, [], body)


# ---------------------------------------------------------------------------------------------
# Request bodies

@pytest.mark.parametrize("api, messages, expected", [
    ("responses", None, {"input": "hi", "max_output_tokens": 5, "ignore_eos": True, "stream": True, "store": False}),
    ("responses", [{"role": "user", "content": "hi"}], {"input": [{"role": "user", "content": "hi"}]}),
    ("messages", None, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}),
    ("messages", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
     {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}),
    ("embeddings", None, {"input": "hi", "encoding_format": "float"}),
    ("score", None, {"text_1": "hi", "text_2": ["d1", "d2"]}),
    ("chat", None, {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": 5}),
    # A session's tool result: its own role in chat, a user message where the API's tool items need a tool call.
    ("chat", [{"role": "tool", "content": "out"}], {"messages": [{"role": "tool", "content": "out"}]}),
    ("responses", [{"role": "tool", "content": "out"}], {"input": [{"role": "user", "content": "out"}]}),
    ("messages", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                  {"role": "tool", "content": "out"}],
     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": "out"}]}),
    ("completions", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {"prompt": "a\n\nb"}),
])
def test_each_api_gets_its_own_body(api, messages, expected):
    body = apis.body(api, "m", None if messages else "hi", messages, 5, ["d1", "d2"] if api == "score" else ())
    assert body["model"] == "m"
    assert {k: body.get(k) for k in expected} == expected
    if not apis.APIS[api].generates:  # a pooling request asks for no tokens and streams nothing
        assert not {"max_tokens", "stream", "messages", "prompt"} & set(body)
    if api == "messages":  # the Anthropic request has no ignore_eos, and no system turn among the messages
        assert "ignore_eos" not in body and all(m["role"] != "system" for m in body["messages"])


# ---------------------------------------------------------------------------------------------
# Streams and answers as vLLM 0.32.0 sent them

@pytest.mark.parametrize("api, chunks_seen, finish", [("responses", 3, "max_output_tokens"),
                                                      ("messages", 4, "max_tokens")])
def test_recorded_streams_give_tokens_usage_and_times(api, chunks_seen, finish):
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse(_events(RECORDED[api])), api)
    assert o.ok, o.detail
    # 4 tokens asked for; the Responses stream carried two of them in one delta (" cut overri").
    assert (o.completion_tokens, o.prompt_tokens, o.finish_reason) == (4, 17, finish)
    assert len(o.token_times) == chunks_seen and o.text == "keys cut overri cut"
    # TTFT is the first text delta, not the events that open the stream (created, message_start).
    first = next(k for k, block in enumerate(_events(RECORDED[api])) if b'"delta":' in block)
    assert o.token_times[0] == 1000 * (first + 1)  # event k arrived at 1000 (k + 1)
    assert o.done_ns == 1000 * len(_events(RECORDED[api]))


def _without_end(api: str) -> list[bytes]:
    return [e for e in _events(RECORDED[api]) if apis.APIS[api].end_event.encode() not in e.split(b"\n")[0]]


@pytest.mark.parametrize("api, events, kind, detail", [
    ("responses", lambda: _without_end("responses"), "stream_cut", "without response.completed"),
    ("messages", lambda: _without_end("messages"), "stream_cut", "without message_stop"),
    ("responses", lambda: _events(RECORDED["responses"])[:4] + [
        b'event: error\ndata: {"type": "error", "code": "x", "message": "engine died"}\n\n'], "stream_error",
     "engine died"),
    ("messages", lambda: _events(RECORDED["messages"])[:3] + [
        b'event: error\ndata: {"type": "error", "error": {"type": "x", "message": "overloaded"}}\n\n'],
     "stream_error", "overloaded"),
    ("messages", lambda: [e.replace(b'"output_tokens":4', b'"output_tokens":"4"')
                          for e in _events(RECORDED["messages"])], "malformed_sse", "usage.output_tokens"),
    ("responses", lambda: [b"event: response.output_text.delta\ndata: {not json\n\n"], "malformed_sse", "bad SSE"),
])
def test_broken_streams_are_classified(api, events, kind, detail):
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0), _sse(events()), api)
    assert o.error == kind and detail in o.detail


@pytest.mark.parametrize("api, answer, kind, items, prompt_tokens", [
    ("embeddings", lambda: _json(RECORDED["embeddings"]), None, 1, 6),
    ("score", lambda: _json(RECORDED["score"]), None, 2, 15),
    ("score", lambda: _json(b'{"error": {"message": "At least one text_pair element must be given"}}', 400),
     "http_4xx", None, None),
    ("embeddings", lambda: _json(b'{"detail": "Not Found"}', 404), "http_4xx", None, None),
    ("embeddings", lambda: _json(RECORDED["embeddings"][:100], complete=False), "stream_cut", None, None),
    ("embeddings", lambda: _json(b"[1, 2]"), "malformed_answer", None, None),
    ("score", lambda: _json(b'{"data": [], "usage": {"prompt_tokens": 3}}'), "empty_output", None, None),
    ("score", lambda: _json(b'{"data": [{"score": 1}], "usage": {"prompt_tokens": -1}}'), "malformed_answer",
     None, None),
    ("embeddings", lambda: http1.Response(200, {"content-type": "text/html"}, True, [], b"<html>"),
     "malformed_answer", None, None),
])
def test_pooling_answers(api, answer, kind, items, prompt_tokens):
    o = request_outcome.interpret(request_outcome.Outcome(0, sent_ns=0, done_ns=7_000_000), answer(), api)
    assert o.error == kind, o.detail
    assert (o.items, o.prompt_tokens) == (items, prompt_tokens)
    if kind is None:  # its one time: the answer's last byte
        assert o.token_times == [7_000_000] and o.e2e_ms == 7.0 and o.tpot_ms is None


# ---------------------------------------------------------------------------------------------
# bench against a server that answers every API as vLLM 0.32.0 did

def _recorded_api(request) -> Action | None:
    """The recorded answers, whatever was asked (4 output tokens; the usage's prompt tokens), and
    the key required on the APIs."""
    api = PATHS.get(request.path)
    if api not in RECORDED:
        return None
    if request.headers.get("authorization") != f"Bearer {KEY}":
        return as_json(401, {"error": {"message": f"bad key {request.headers.get('authorization')}"}})
    if api in ("responses", "messages"):
        return Action(response(200, chunks(_events(RECORDED[api])), "text/event-stream", chunked=True))
    if api == "score":  # one score per document
        scores = [{"index": k, "object": "score", "score": 0.5} for k in range(len(request.body["text_2"]))]
        return as_json(200, {"data": scores, "usage": {"prompt_tokens": 9, "total_tokens": 9}})
    return Action(response(200, RECORDED[api]))


@pytest.fixture(autouse=True)
def _settings(monkeypatch, tmp_path):
    """No inference.env or settings of the caller's; the key the recorded server requires."""
    monkeypatch.chdir(tmp_path)
    for name in ("BENCH_N", "BENCH_C", "BENCH_IN", "BENCH_OUT", "BENCH_LOG", "SLO_TTFT_P95_MS", "SLO_TPOT_P95_MS",
                 "SLO_LATENCY_P95_MS", "INFER_URL", "INFER_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("INFER_API_KEY", KEY)


def _bench(url: str, capsys, *argv: str) -> tuple[int, dict, str]:
    code = bench.main(["--url", url, "--json", "--timeline-interval", "0", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else {}, err


@pytest.mark.parametrize("api, extra, rows", [
    ("responses", [], {"ttft_ms": 8, "tpot_ms": 8, "e2e_ms": 8}),
    ("messages", [], {"ttft_ms": 8, "tpot_ms": 8, "e2e_ms": 8}),
    ("embeddings", [], {"ttft_ms": 0, "tpot_ms": 0, "e2e_ms": 8}),
    ("score", ["--documents", "3"], {"ttft_ms": 0, "tpot_ms": 0, "e2e_ms": 8}),
])
def test_each_api_has_its_figures(api, extra, rows, capsys, tmp_path):
    records = tmp_path / "r.jsonl"
    with fault_server(_recorded_api) as url:
        code, result, err = _bench(url, capsys, "--endpoint", api, "-n", "8", "-c", "2", "--input-tokens", "16",
                                   "--output-tokens", "4", "--records", str(records), *extra)
    assert code in (0, 4), result.get("verdict_reasons") or err
    assert result["requests"]["completed"] == 8 and result["requests"]["failed"] == 0
    assert {key: result[key]["n"] for key in rows} == rows
    assert not any("ignore_eos" in w or "no usage" in w for w in result["warnings"])
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    done = [r for r in lines if not r["warmup"]]
    throughput = result["throughput"]
    if apis.APIS[api].generates:
        assert result["requests"]["output_tokens"]["total"] == 32 and result["requests"]["prompt_tokens"]["min"] == 17
        assert result["latency_per_input_token_ms"] is None and throughput["pairs_s"] is None
        return
    # A pooling answer: its latency, per input token, requests and input tokens per second.
    prompt = 9 if api == "score" else 6
    assert result["requests"]["prompt_tokens"]["min"] == prompt
    assert result["latency_per_input_token_ms"]["p50"] == pytest.approx(result["e2e_ms"]["p50"] / prompt, rel=1e-6)
    assert throughput["input_tok_s"] == pytest.approx(throughput["req_s"] * prompt)
    assert throughput["output_tok_s"] == 0
    assert throughput["pairs_s"] == (pytest.approx(3 * throughput["req_s"]) if api == "score" else None)
    assert result["samples"]["ttft_ms"] == [] and len(result["samples"]["e2e_ms"]) == 8
    assert [r["items"] for r in done] == [3 if api == "score" else 1] * 8
    assert all(r["e2e_ms"] > 0 and r["completion_tokens"] is None for r in done)
    assert result["requests"]["output_tokens"]["short"] == 0


def test_a_latency_slo_judges_the_pooling_run(capsys):
    with fault_server(_recorded_api) as url:
        missed = _bench(url, capsys, "--endpoint", "embeddings", "-n", "4", "-c", "2", "--input-tokens", "8",
                        "--slo-latency-p95-ms", "0.001")
        met = _bench(url, capsys, "--endpoint", "embeddings", "-n", "4", "-c", "2", "--input-tokens", "8",
                     "--slo-latency-p95-ms", "60000")
    code, result, _ = missed
    assert result["slo"]["latency_p95_ms"]["target"] == 0.001 and not result["slo"]["latency_p95_ms"]["met"]
    assert result["verdict"] in ("FAIL", "INVALID") and code in (1, 4)
    assert result["throughput"]["goodput_req_s"] == 0
    code, result, _ = met
    assert result["slo"]["latency_p95_ms"]["met"] and code in (0, 4)
    assert result["throughput"]["goodput_req_s"] == pytest.approx(result["throughput"]["req_s"])


@pytest.mark.parametrize("api", ["responses", "embeddings"])
def test_a_wrong_key_is_a_failure_that_never_prints_the_key(api, capsys, monkeypatch):
    wrong = KEY + "-WRONG"
    monkeypatch.setenv("INFER_API_KEY", wrong)
    with fault_server(_recorded_api) as url:
        code = bench.main(["--url", url, "--endpoint", api, "-n", "2", "-c", "1", "--input-tokens", "8",
                           "--timeline-interval", "0"])
    out, err = capsys.readouterr()
    assert code == 3  # every request failed
    assert "http_4xx" in out and wrong not in out + err and KEY not in out + err


def test_a_server_without_the_api_says_so_in_the_first_error(capsys):
    with fault_server() as url:  # answers 404 Not Found on /v1/embeddings
        code, result, _ = _bench(url, capsys, "--endpoint", "embeddings", "-n", "2", "-c", "1", "--input-tokens", "8")
    assert code == 3 and result["verdict"] == "ERROR"
    assert result["requests"]["first_errors"][0].startswith("#1 http_4xx: HTTP 404")


@pytest.mark.parametrize("argv, message", [
    (["--endpoint", "embeddings", "--slo-ttft-p95-ms", "100"], "set --slo-latency-p95-ms"),
    (["--endpoint", "score", "--slo-tpot-p95-ms", "10"], "no TTFT or TPOT"),
    (["--endpoint", "chat", "--documents", "3"], "--documents pairs documents with a query for --endpoint score"),
    (["--endpoint", "embeddings", "--output-dist", "uniform:1,9"], "generates no tokens"),
    (["--endpoint", "score", "--trace", str(Path(bench.__file__).parent / "data" / "trace-sample.jsonl")],
     "not --trace"),
    (["--endpoint", "score", "--documents", "0"], "--documents"),
    (["--endpoint", "embeddings", "--slo-latency-p95-ms", "-1"], "--slo-latency-p95-ms"),
    (["--endpoint", "embeddings", "--multi-turn", "2"], "need --endpoint chat, responses or messages"),
])
def test_options_that_do_not_fit_the_api_are_one_line_usage_errors(argv, message, capsys):
    with fault_server(_recorded_api) as url:
        code = bench.main(["--url", url, "-n", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_sweep_refuses_an_api_without_ttft(capsys):
    code = sweep.main(["--url", "http://127.0.0.1:9", "--endpoint", "embeddings"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not have: run bench at each concurrency" in err and len(err.splitlines()) == 1


def test_pooling_runs_compare_and_report_on_their_latency(capsys, tmp_path):
    files = []
    with fault_server(_recorded_api) as url:
        for name in ("a", "b"):
            code, result, _ = _bench(url, capsys, "--endpoint", "score", "--documents", "2", "-n", "6", "-c", "2",
                                     "--input-tokens", "8", "--slo-latency-p95-ms", "60000")
            files.append(tmp_path / f"{name}.json")
            files[-1].write_text(json.dumps(result))
    assert compare.main([str(files[0]), str(files[1]), "--json"]) in (0, 1)
    rows = {row["name"] for row in json.loads(capsys.readouterr().out)["metrics"]}
    assert {"e2e_ms.p50", "e2e_ms.p95", "throughput.req_s", "throughput.pairs_s"} <= rows
    assert not any(name.startswith(("ttft", "tpot")) for name in rows)
    assert report.main([str(files[0]), "--format", "text"]) == 0
    text = capsys.readouterr().out
    # INVALID where this busy machine stalled the client: the figures are said all the same.
    assert re.search(r"(PASS|INVALID): latency p95 [\d.,]+ ms, [\d.,]+ req/s, [\d.,]+ input tok/s", text), text
    assert re.search(r"throughput +[\d.,]+ req/s, [\d.,]+ input tok/s, [\d.,]+ pairs/s", text), text
    assert "texts of 8 tokens, score" in text and "TTFT" not in text


def test_the_console_table_shows_latency_rows_for_a_pooling_api(capsys):
    with fault_server(_recorded_api) as url:
        bench.main(["--url", url, "--endpoint", "score", "--documents", "2", "-n", "4", "-c", "2",
                    "--input-tokens", "8", "--timeline-interval", "0"])
    out = capsys.readouterr().out
    assert re.search(r"^Latency +[\d.]+", out, re.M) and re.search(r"^Latency/in tok +[\d.]+", out, re.M)
    assert re.search(r"^Pair throughput \(pairs/s\): +[\d.]+", out, re.M)
    assert "texts of 8 tokens, 2 documents per query (score" in out
    assert not re.search(r"^(TTFT|TPOT|ITL)", out, re.M)


@pytest.mark.parametrize("api", ["responses", "messages", "embeddings", "score"])
def test_the_calibration_server_speaks_each_api(api, capsys):
    """The server task bench:calibrate measures the client's error with (its timing truth is the
    benchmark's to compare): every request answered in the API's format, counted exactly."""
    server = CalibrationServer(Schedule(ttft_ms=5, itl_ms=1)).start_in_thread()
    try:
        code, result, err = _bench(server.url, capsys, "--endpoint", api, "-n", "6", "-c", "3", "--input-tokens", "12",
                                   "--output-tokens", "5")
        truth = httpx.get(server.url + "/calibration/truth").json()
    finally:
        server.stop()
    assert result["requests"]["completed"] == 6, result["requests"]["first_errors"] or err
    # 12 tokens by the server's count, its chat template included; score: a query and one document
    assert result["requests"]["prompt_tokens"]["min"] == (24 if api == "score" else 12)
    writes = [len(entry["writes_ns"]) for entry in truth.values()]
    assert writes == [5 if apis.APIS[api].generates else 1] * 9  # 6 measured, 3 warm-up
    assert result["requests"]["output_tokens"]["total"] == (30 if apis.APIS[api].generates else 0)


# ---------------------------------------------------------------------------------------------
# The real CPU vLLM: the tiny chat model (cpu-tiny) and the tiny encoder (cpu-tiny-pooling)

def _real(url: str, capsys, tmp_path: Path, *argv: str) -> tuple[int, dict, list[dict]]:
    records = tmp_path / "records.jsonl"
    code, result, err = _bench(url, capsys, "--records", str(records), *argv)
    assert result, err
    return code, result, [json.loads(line) for line in records.read_text().splitlines()]


@pytest.mark.real_vllm
@pytest.mark.parametrize("api", ["responses", "messages"])
def test_real_vllm_streams_the_responses_and_messages_apis(api, vllm_server, capsys, tmp_path):
    code, result, records = _real(vllm_server.url, capsys, tmp_path, "--endpoint", api, "-n", "6", "-c", "3",
                                  "--input-tokens", "120", "--output-tokens", "12", "--warmup", "1")
    assert code in (0, 4), result["verdict_reasons"]  # 4: this busy machine may stall the client
    assert result["requests"]["completed"] == 6, result["requests"]["first_errors"]
    # Exact prompts by the server's own count, the chat template included; exact outputs (the
    # model never stops early, and the Messages API has no ignore_eos to ask it).
    assert result["requests"]["prompt_tokens"]["min"] == result["requests"]["prompt_tokens"]["max"] == 120
    assert result["requests"]["output_tokens"]["total"] == 72 and result["requests"]["output_tokens"]["short"] == 0
    assert result["ttft_ms"]["n"] == result["tpot_ms"]["n"] == 6
    # TTFT is the first text delta's arrival and e2e the stream's end, in every stream. Not TTFT
    # below e2e: a busy machine's API server sends a stream of 12 tokens in one write now and then
    # (a loaded run had all six in one read), which bench counts apart.
    assert all(r["ttft_ms"] == r["chunk_ms"][0] and r["e2e_ms"] >= r["chunk_ms"][-1] for r in records), records
    in_one_read = [r for r in records if not r["warmup"] and len(set(r["chunk_ms"])) == 1]
    assert result["requests"]["one_read"] == len(in_one_read)
    # The server generated what the usage in the streams said, warm-up included: nothing lost.
    assert result["server"]["metrics"]["generation_tokens"] == sum(r["completion_tokens"] for r in records) == 84
    assert {r["finish_reason"] for r in records} == {"max_output_tokens" if api == "responses" else "max_tokens"}


@pytest.mark.real_vllm
@pytest.mark.parametrize("api, documents", [("embeddings", 0), ("score", 4)])
def test_real_vllm_pooling_model_serves_embeddings_and_score(api, documents, vllm_pooling_server, capsys, tmp_path):
    extra = ["--documents", str(documents)] if documents else []
    code, result, records = _real(vllm_pooling_server.url, capsys, tmp_path, "--endpoint", api, "-n", "8", "-c", "4",
                                  "--input-tokens", "200", "--warmup", "2", "--slo-latency-p95-ms", "60000", *extra)
    assert code in (0, 4), result["verdict_reasons"]
    assert result["requests"]["completed"] == 8, result["requests"]["first_errors"]
    assert result["server"]["info"]["model"] == "tiny-bert"
    assert result["slo"]["latency_p95_ms"]["met"] and result["e2e_ms"]["n"] == 8 and result["ttft_ms"]["n"] == 0
    # The server counted the prompt tokens its answers reported, warm-up included.
    assert result["server"]["metrics"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert result["server"]["metrics"]["generation_tokens"] == 0
    if api == "embeddings":  # a text of exactly --input-tokens by the server's tokenizer
        assert result["requests"]["prompt_tokens"]["min"] == result["requests"]["prompt_tokens"]["max"] == 200
        assert result["throughput"]["pairs_s"] is None
    else:  # the query and its 4 documents, each embedded: 5 texts of 200 tokens, and 4 scores
        assert result["requests"]["prompt_tokens"]["min"] == 1000
        assert all(r["items"] == 4 for r in records)
        assert result["throughput"]["pairs_s"] == pytest.approx(4 * result["throughput"]["req_s"])
