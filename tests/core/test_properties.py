"""Property-based tests of every parser fed from outside the process: whatever the bytes, each one
returns or raises its one documented error, in bounded time (a hard alarm fails an example stuck in
a loop; no hypothesis deadline: an example that is merely slow on a busy machine is not a fault).

Parsers: HTTP chunked framing (http1.dechunk, asyncclient.ChunkFraming), a streamed response and its
SSE events (http1.parse_response / settle, toolcalls.sse_events), Prometheus text
(prometheus_text.parse_exposition, snapshot, report), a model's config.json (resolve.checked_model), a
serve profile (profiles.load_profile, render), inference.env (conf.parse_env_file, load_env_file),
saved records read back (perplexity.load_run, toolcalls.load_baseline), and files too deep for the
JSON decoder or not YAML (compare, report, bench's datasets, served.root_config, the user's tool-call cases).
"""
from __future__ import annotations

import functools
import json
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rooflib.core import catalogs, conf, fileio, printing
from rooflib.core.errors import UsageError
from rooflib.load import asyncclient, comparison, http1, request_outcome, workloads
from rooflib.quality import perplexity, toolcalls
from rooflib.render import report_inputs
from rooflib.server import engine_metrics, prometheus_text, report_text, served, snapshots
from rooflib.serving import profiles
from rooflib.sizing import resolve

EXAMPLE_BOUND_S = 10  # a hard stop per example, far above any example's time: only a hang reaches it
PROPERTY = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])


class Hang(BaseException):
    pass


def hard_bound(test):
    """Run each example under an alarm: a busy loop inside a parser fails instead of hanging."""
    @functools.wraps(test)
    def bounded(*args, **kwargs):
        def alarm(signum, frame):
            raise Hang(f"one example ran past {EXAMPLE_BOUND_S} s")
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, EXAMPLE_BOUND_S)
        try:
            return test(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return bounded


# ---------------------------------------------------------------- HTTP chunked framing

HOSTILE_LINES = [b"-6\r\n", b"-0\r\n", b"+5\r\n", b" 5\r\n", b"FFFFFFFFFFFFFFFF\r\n", b"1" * 20 + b"\r\n",
                 b"zz\r\n", b"0x5\r\n", b"5;ext=1\r\n", b"\r\n", b"0\r\n\r\n", b"1_0\r\n", "５\r\n".encode()]
chunk = st.binary(min_size=1, max_size=40).map(lambda data: b"%x\r\n%s\r\n" % (len(data), data))
framing_piece = st.one_of(chunk, st.sampled_from(HOSTILE_LINES), st.binary(max_size=30))


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts}) if data else []
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if b > a]


@PROPERTY
@given(st.lists(framing_piece, max_size=12), st.lists(st.integers(0, 10_000), max_size=8))
@hard_bound
def test_chunked_framing_is_total(pieces, cuts):
    raw = b"".join(pieces)
    try:
        segments, complete = http1.dechunk(raw)
        assert all(size >= 0 and 0 <= start <= len(raw) for _, start, size in segments)
    except ValueError:
        pass
    framing = asyncclient.ChunkFraming()
    try:
        for piece in splits(raw, cuts):
            framing.feed(piece)
    except ValueError:
        pass


@PROPERTY
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=10), st.lists(st.integers(0, 10_000), max_size=8))
@hard_bound
def test_chunked_framing_reads_valid_coding_exactly(datas, cuts):
    raw = b"".join(b"%x\r\n%s\r\n" % (len(d), d) for d in datas) + b"0\r\n\r\n"
    segments, complete = http1.dechunk(raw)
    assert complete and b"".join(raw[start:start + size] for _, start, size in segments) == b"".join(datas)
    framing = asyncclient.ChunkFraming()
    done = [framing.feed(piece) for piece in splits(raw, cuts)]
    assert done[-1] and not any(done[:-1])


# ---------------------------------------------------------------- a streamed response, SSE

def head(content_type: bytes = b"text/event-stream", chunked: bool = True) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n" +
            (b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: 100\r\n") + b"\r\n")


json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                              st.sampled_from(["choices", "usage", "text", "delta", "completion_tokens",
                                               "prompt_tokens", "finish_reason", "error", "content"]),
                              inner, max_size=4), max_leaves=12)
event = st.one_of(json_value.map(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n"),
                  st.sampled_from([b"data: [DONE]\n\n", b": ping\n\n", b"data: {\n\n", b"\r\r", b"data:" + b"[" * 5000]),
                  st.binary(max_size=30))


@PROPERTY
@given(st.lists(event, max_size=8), st.booleans(), st.booleans(), st.lists(st.integers(0, 10_000), max_size=6))
@hard_bound
def test_streamed_response_always_settles_to_a_classified_outcome(events, chunked, terminated, cuts):
    body = b"".join(events)
    raw = head(chunked=chunked) + ((b"%x\r\n%s\r\n" % (len(body), body) if body else b"") +
                                   (b"0\r\n\r\n" if terminated else b"") if chunked else body)
    reads = [(i * 1000, piece) for i, piece in enumerate(splits(raw, cuts))]
    outcome = request_outcome.settle(request_outcome.Outcome(index=0, reads=reads), "completions")
    assert outcome.error is None or outcome.error in request_outcome.ERROR_KINDS
    if outcome.error is None:
        assert outcome.token_times and outcome.completion_tokens is not None


@PROPERTY
@given(st.lists(st.one_of(st.text(max_size=20).map(lambda t: "data: " + t), st.text(max_size=20),
                          json_value.map(lambda v: "data: " + json.dumps(v))), max_size=8))
@hard_bound
def test_smoke_stream_parser_raises_only_what_send_reports(lines):
    # send() turns ValueError (bad JSON) and TypeError/AttributeError/KeyError (another shape)
    # into one ServerError line; nothing else may escape.
    try:
        toolcalls.merge_stream(list(toolcalls.sse_events(iter(lines))))
    except (ValueError, TypeError, AttributeError, KeyError):
        pass


# ---------------------------------------------------------------- Prometheus text

metric_line = st.one_of(
    st.tuples(st.sampled_from(["vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                               "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_bucket",
                               "vllm:e2e_request_latency_seconds_count", "x"]),
              st.sampled_from(["", '{le="+Inf"}', '{le="0.1",model_name="m"}', '{a="\\"}', "{", '{a="b"']),
              st.one_of(st.floats().map(repr), st.sampled_from(["NaN", "+Inf", "-Inf", "1e309", "abc", ""])))
    .map(lambda t: f"{t[0]}{t[1]} {t[2]}"),
    st.sampled_from(["# TYPE x gauge", "# HELP x y", "<html>", "# EOF"]),
    st.text(max_size=30))


@PROPERTY
@given(st.lists(metric_line, max_size=12), st.booleans())
@hard_bound
def test_prometheus_text_gives_a_report_or_one_invalid_scrape_line(lines, newline):
    text = "\n".join(lines) + ("\n" if newline else "")
    try:
        report = engine_metrics.report(snapshots.snapshot(text, "scrape"))
    except prometheus_text.InvalidScrape as exc:
        assert "\n" not in str(exc)
        return
    json.dumps(printing.json_safe(report), default=str, allow_nan=False)  # valid JSON, NaN or not
    # No figure printed as "nan" (the warning that names NaN samples aside).
    assert "nan" not in report_text.format_report(report).replace("NaN or Inf", "").lower().split()


# ---------------------------------------------------------------- model config.json

config_number = st.one_of(st.integers(-5, 200_000), st.floats(), st.text(max_size=4), st.none(), st.booleans(),
                          st.lists(st.integers(), max_size=2))
config = st.fixed_dictionaries({}, optional={
    key: config_number for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
                                   "torch_dtype", "num_experts", "tie_word_embeddings")
} | {"text_config": st.none() | st.text(max_size=3) | st.dictionaries(st.just("hidden_size"), config_number),
     "quantization_config": st.none() | st.text(max_size=3) | st.dictionaries(st.just("quant_method"), config_number),
     "architectures": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=8), max_size=2)})


@PROPERTY
@given(st.one_of(config, json_value))
@hard_bound
def test_model_config_gives_a_model_or_one_usage_line(document):
    try:
        resolve.checked_model(document, "m", "config.json")
    except UsageError as exc:
        assert "\n" not in str(exc)


# ---------------------------------------------------------------- serve profile YAML

yaml_text = st.one_of(
    st.text(max_size=200),
    st.sampled_from(["engine: vllm\nmodel: m\nenv: &a {A: 1}\nx: *a\n",
                     "engine: vllm\nmodel: m\nspeculative_config: &a [1, 1]\nb: &b [*a, *a, *a]\nc: [*b, *b]\n",
                     "engine: vllm\nmodel: m\nenv: {'A B': '$(id)'}\n", "engine: sglang\nmodel: m\nport: x\n",
                     "engine: vllm\nmodel: m\nenv: [1]\n", "!!python/object:os.system {}", "- 1\n- 2\n", "{{{"]),
    st.dictionaries(st.sampled_from(["engine", "model", "env", "port", "max_model_len", "speculative_config",
                                     "tensor_parallel_size", "extra_args", "python"]),
                    json_value, max_size=6).map(json.dumps))


@PROPERTY
@given(yaml_text)
@hard_bound
def test_profile_gives_a_command_or_one_usage_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("profile") / "p.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        profiles.render(profiles.load_profile(path), 8000)
    except UsageError as exc:
        assert "\n" not in str(exc)


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    lines = ["engine: vllm", "model: m", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    lines += ["env: {BOMB: *a8}"]  # 10^9 strings if expanded
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(UsageError, match="alias"):
        profiles.load_profile(path)


# ---------------------------------------------------------------- inference.env and saved runs

@PROPERTY
@given(st.binary(max_size=300))
@hard_bound
def test_env_file_gives_settings_or_one_usage_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("env") / "inference.env"
    path.write_bytes(data)
    try:
        values = conf.load_env_file(path)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in values.items())
    except UsageError as exc:
        assert "\n" not in str(exc)


saved = st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode()),
                  st.just(b"[" * 100_000),
                  st.fixed_dictionaries({"cases": st.lists(json_value, max_size=3)}).map(lambda v: json.dumps(v).encode()))


@PROPERTY
@given(saved)
@hard_bound
def test_saved_runs_and_baselines_load_or_give_one_usage_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("saved") / "run.json"
    path.write_bytes(data)
    for load in (perplexity.load_run, toolcalls.load_baseline):
        try:
            load(str(path))
        except UsageError as exc:
            assert "\n" not in str(exc)


def test_endless_and_directory_inputs_are_one_usage_line(tmp_path):
    for path in ("/dev/zero", str(tmp_path)):
        for read in (perplexity.read_text, conf.load_env_file, lambda p: profiles.load_profile(Path(p))):
            with pytest.raises(UsageError, match=path) as caught:
                read(path)
            assert "\n" not in str(caught.value)


def test_server_json_nested_too_deep_is_a_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        fileio.parse_json("[" * 100_000)


def test_files_nested_too_deep_are_one_usage_line(tmp_path):
    """A result, a dataset, a records file or a served model's config.json nested too deeply for
    the JSON decoder is malformed like any other: one line, not a RecursionError."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    records = '{"sent_ns": 1}\n' + "[" * 100_000 + "\n"
    reads = [comparison.load, workloads.read_prompts, lambda p: workloads.read_sharegpt(p, len),
             lambda p: report_inputs.parse_result(deep.read_text(), p), lambda p: report_inputs.parse_records(records, p)]
    for read in reads:
        with pytest.raises(UsageError) as caught:
            read(str(deep))
        assert "\n" not in str(caught.value)
    assert served.root_config(str(deep)) == (None, f"{deep} is not readable JSON")


def test_the_users_case_files_give_cases_or_one_usage_line(tmp_path):
    catalog = catalogs.load_catalog("toolcall_cases")
    faults = {"a folder": lambda f: f.mkdir(), "an alias": lambda f: f.write_text("a: &x {}\ncases: *x\n"),
              "not YAML": lambda f: f.write_text("cases: [\n"), "not UTF-8": lambda f: f.write_bytes(b"\xff")}
    for name, write in faults.items():
        folder = tmp_path / name
        folder.mkdir()
        write(folder / "cases.yaml")
        with pytest.raises(UsageError) as caught:
            toolcalls.with_user_cases(catalog, str(folder))
        assert "\n" not in str(caught.value), name
