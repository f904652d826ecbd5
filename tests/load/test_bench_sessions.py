"""Agent sessions (rooflib/load/sessions.py): the sessions JSONL reader, the synthetic generator,
the shuffled control's order, the prefix-reuse accounting, bench's options for them, a replay
against the calibration server, and the real CPU vLLM's prefix cache growing with the turns (and
not in the shuffled control)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import bench
import compare
import pytest
from calibration_server import CalibrationServer, Schedule

from rooflib.core import conf
from rooflib.core.errors import UsageError
from rooflib.load import bench_options, benchrun, promptgen, sessions, workloads
from rooflib.load.request_outcome import Outcome

USER = {"role": "user", "content": "fix the test"}


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "sessions.jsonl"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------
# The reader

@pytest.mark.parametrize("lines, message", [
    ('{"messages": [{"role": "user", "content": "a"}]}', ":1: session must be the session's id"),
    ('{"session": true, "messages": [{"role": "user", "content": "a"}]}', ":1: session must be"),
    ('{"session": "a", "messages": [{"role": "user", "content": "a"}]}\n{"session": "a"}', ":2: messages must be a non-empty list"),
    ('{"session": "a", "messages": []}', ":1: messages must be a non-empty list"),
    ('{"session": "a", "messages": [{"role": "bot", "content": "x"}]}', ":1: messages[].role must be one of system, user, tool"),
    ('{"session": "a", "messages": ["hi"]}', ":1: messages[].role must be one of"),
    ('{"session": "a", "messages": [{"role": "user"}]}', ':1: a message needs "content" (text) or "tokens"'),
    ('{"session": "a", "messages": [{"role": "user", "content": "x", "tokens": 3}]}', ':1: a message needs "content"'),
    ('{"session": "a", "messages": [{"role": "user", "content": ""}]}', ":1: messages[].content must be non-empty text"),
    ('{"session": "a", "messages": [{"role": "tool", "tokens": 0}]}', ":1: messages[].tokens must be a whole number >= 1"),
    ('{"session": "a", "messages": [{"role": "tool", "tokens": 2.5}]}', ":1: messages[].tokens must be a whole number"),
    ('{"session": "a", "messages": [{"role": "user", "content": "a"}], "output_tokens": "9"}', ":1: output_tokens must be"),
    ('{"session": "a", "messages": [{"role": "user", "content": "a"}], "gap_s": -1}', ":1: gap_s must be seconds"),
    ('{"session": "a", "messages": [{"role": "user", "content": "a"}], "gap_s": "2"}', ":1: gap_s must be seconds"),
    ('{"session": "a", "messages": [{"role": "user", "content": "a"}]}\n{oops', ":2: not JSON"),
    ('[1, 2]', ":1: a line must be a JSON object"),
])
def test_a_bad_sessions_line_names_the_line_and_the_field(tmp_path, lines, message):
    path = _file(tmp_path, lines + "\n")
    with pytest.raises(UsageError) as error:
        sessions.read_sessions(path, 16)
    assert f"{path}{message}" in str(error.value) and "\n" not in str(error.value)


def test_the_sample_sessions_read():
    found = sessions.read_sessions(str(Path(__file__).resolve().parents[2] / "scripts" / "data" / "sessions-sample.jsonl"), 16)
    assert [(s.name, len(s.turns)) for s in found] == [("fix-test", 5), ("refactor", 4)]
    assert found[0].turns[0].messages[0] == sessions.Message("system", tokens=600)
    assert found[0].turns[3].messages[0].content.startswith("===== 1 failed")


def test_an_empty_sessions_file_is_an_error(tmp_path):
    with pytest.raises(UsageError, match="is empty"):
        sessions.read_sessions(_file(tmp_path, "\n"), 16)


def test_sessions_are_grouped_in_file_order_with_defaults(tmp_path):
    path = _file(tmp_path, "\n".join(json.dumps(row) for row in [
        {"session": "a", "messages": [{"role": "system", "content": "be brief"}, USER], "output_tokens": 40},
        {"session": 7, "messages": [{"role": "user", "tokens": 300}]},
        {"session": "a", "gap_s": 2.5, "messages": [{"role": "tool", "tokens": 1800}], "output_tokens": 60},
    ]) + "\n")
    a, seven = sessions.read_sessions(path, 16)
    assert (a.name, seven.name) == ("a", "7")
    assert [len(t.messages) for t in a.turns] == [2, 1] and a.turns[1].messages[0] == sessions.Message("tool", tokens=1800)
    assert [(t.output_tokens, t.gap_s) for t in a.turns] == [(40, 0.0), (60, 2.5)]
    assert seven.turns[0].output_tokens == 16  # the default: --output-tokens
    assert sessions.context_tokens(a.turns) is None  # a text has no length until the server counts it
    assert sessions.context_tokens(seven.turns) == 300 + 16


# ---------------------------------------------------------------------------------------------
# The generator, the texts, the order

def _generated(seed: int) -> list[sessions.Session]:
    return sessions.synthetic(3, 4, 100, workloads.parse_distribution("uniform:20,80", "x"),
                              workloads.parse_distribution("uniform:4,9", "x"), 0.5, seed)


def test_the_generator_is_deterministic_by_seed_and_grows_by_tool_results():
    one = _generated(5)
    assert one == _generated(5) and one != _generated(6)
    for session in one:
        first, *later = session.turns
        assert first.messages == (sessions.Message("user", tokens=100),) and first.gap_s == 0
        assert all(len(t.messages) == 1 and t.messages[0].role == "tool" and 20 <= t.messages[0].tokens <= 80
                   and t.gap_s == 0.5 for t in later)
        assert all(4 <= t.output_tokens <= 9 for t in session.turns)
        assert sessions.context_tokens(session.turns) == sum(m.tokens for t in session.turns for m in t.messages) + \
            sum(t.output_tokens for t in session.turns)


def _maker() -> workloads.PromptMaker:
    return workloads.PromptMaker(list(promptgen.WORDS[:40]), "head words here", 5, seed=3)


def test_written_sessions_have_unique_texts_of_their_lengths_and_the_run_head_first(tmp_path):
    recorded = sessions.read_sessions(_file(tmp_path, json.dumps(
        {"session": "r", "messages": [USER, {"role": "tool", "tokens": 12}]}) + "\n"), 8)
    turns = sessions.written(_generated(1) + recorded, 5, _maker())  # 4 sessions, the first again
    texts = [m.content for session in turns for t in session for m in t.messages]
    assert len(set(texts)) == len(texts)  # no two messages alike, a session sent twice neither
    first = turns[0][0].messages[0]
    assert first.content.startswith("head words here ") and len(first.content.split()) == 3 + 100
    assert all(not m.content.startswith("head") for t in turns[0][1:] for m in t.messages)
    assert all(len(m.content.split()) == m.tokens for t in turns[0][1:] for m in t.messages)
    assert turns[3][0].messages[0].content == "head words here fix the test"  # a text is kept, after the head
    assert [len(s) for s in turns] == [4, 4, 4, 1, 4]


def test_the_shuffled_control_puts_the_turn_first_and_the_history_after_it():
    history = [{"role": "user", "content": f"m{k}"} for k in range(6)]
    added = [{"role": "tool", "content": "new"}]
    assert sessions.arranged(history, added, None, "0/6") == [*history, *added]
    shuffled = sessions.arranged(history, added, 3, "0/6")
    assert shuffled[0] == added[0] and sorted(m["content"] for m in shuffled[1:]) == [f"m{k}" for k in range(6)]
    assert shuffled == sessions.arranged(history, added, 3, "0/6")  # the same seed and turn, the same order


# ---------------------------------------------------------------------------------------------
# The reuse accounting

ANSWER = {"role": "assistant", "content": "done"}


@pytest.mark.parametrize("before, before_tokens, messages, prompt_tokens, perfect", [
    (None, None, [USER], 30, 0),                                             # a first turn: nothing before
    ([USER, ANSWER], 38, [USER, ANSWER, {"role": "tool", "content": "x"}], 60, 38),  # the whole history again
    ([USER, ANSWER], 38, [USER, ANSWER, {"role": "tool", "content": "x"}], 30, 30),  # at most the prompt
    ([USER, ANSWER], 38, [USER, ANSWER, {"role": "tool", "content": "x"}], None, 38),
    ([USER, ANSWER], 38, [{"role": "tool", "content": "x"}, USER, ANSWER], 60, 0),   # the control: first differs
    ([USER, ANSWER], 38, [USER, {"role": "assistant", "content": "other"}], 60, None),  # part of it: unknown
    ([USER, ANSWER], None, [USER, ANSWER, {"role": "tool", "content": "x"}], 60, None),  # no usage before
])
def test_perfect_tokens(before, before_tokens, messages, prompt_tokens, perfect):
    assert sessions.perfect_tokens(before, before_tokens, messages, prompt_tokens) == perfect


def _turn(session: int, turn: int, prompt: int, perfect: int | None, cached: int | None, ok: bool = True) -> Outcome:
    return Outcome(session, turn=turn, sent_ns=0, token_times=[(10 + turn) * 1_000_000], prompt_tokens=prompt,
                   perfect_tokens=perfect, cached_tokens=cached, error=None if ok else "timeout")


def test_reuse_is_summed_by_turn_and_over_the_run():
    outcomes = [_turn(0, 0, 100, 0, 0), _turn(0, 1, 200, 110, 96), _turn(0, 2, 300, 210, 192),
                _turn(1, 0, 100, 0, 0), _turn(1, 1, 200, 110, 96), _turn(1, 2, 300, None, 160, ok=False)]
    report = sessions.reuse(outcomes)
    assert report["sessions"] == 2 and [r["turn"] for r in report["by_turn"]] == [1, 2, 3]
    one, two, three = report["by_turn"]
    assert (one["requests"], one["perfect_share"], one["cached_share"], one["cached_of_perfect"]) == (2, 0.0, 0.0, None)
    assert (two["prompt_tokens"], two["perfect_tokens"], two["cached_tokens"]) == (400, 220, 192)
    assert two["perfect_share"] == pytest.approx(0.55) and two["cached_of_perfect"] == pytest.approx(192 / 220)
    assert three["requests"] == 1 and three["perfect_share"] == pytest.approx(0.7)  # the failed turn is left out
    assert three["ttft_ms"] == {"p50": 12.0, "p95": 12.0}
    total = report["total"]
    assert (total["requests"], total["prompt_tokens"], total["perfect_tokens"], total["cached_tokens"]) == \
        (5, 900, 430, 384)


def test_without_the_servers_cached_count_the_server_column_is_unknown_not_zero():
    report = sessions.reuse([_turn(0, 0, 100, 0, None), _turn(0, 1, 200, 110, None),
                             _turn(0, 2, 300, None, None)])
    assert all(r["cached_tokens"] is None and r["cached_share"] is None for r in report["by_turn"])
    assert report["by_turn"][2]["perfect_unknown"] == 1 and report["by_turn"][2]["perfect_share"] is None


# ---------------------------------------------------------------------------------------------
# bench's options

def _options(argv: list[str]) -> bench_options.BenchOptions:
    args = bench_options.build_parser(sharded=True).parse_args(argv)
    return bench_options.make_options(args, conf.settings_from_args(args))


@pytest.mark.parametrize("argv, message", [
    (["--agent-turns", "4"], "need --endpoint chat"),
    (["--endpoint", "chat", "--tool-tokens", "64"], "shape the synthetic sessions of --agent-turns"),
    (["--endpoint", "chat", "--turn-gap", "1"], "shape the synthetic sessions of --agent-turns"),
    (["--endpoint", "chat", "--shuffle-history"], "--shuffle-history is the control of a sessions run"),
    (["--endpoint", "chat", "--agent-turns", "4", "--multi-turn", "3"], "drop --multi-turn"),
    (["--endpoint", "chat", "--agent-turns", "4", "--input-dist", "uniform:5,9"], "drop --multi-turn, --input-dist"),
    (["--endpoint", "chat", "--agent-turns", "4", "--tool-tokens", "uniform:9,3"], "--tool-tokens"),
    (["--endpoint", "chat", "--agent-turns", "0"], "--agent-turns"),
    (["--endpoint", "chat", "--sessions", "s.jsonl", "--agent-turns", "3"], "drop --input-dist, --output-dist"),
    (["--endpoint", "chat", "--sessions", "s.jsonl", "--prompts", "p.jsonl"], "choose one"),
])
def test_session_options_that_do_not_fit_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message.replace("-", r"\-")):
        _options(argv)


def test_session_options_written_as_flags_read_back_the_same():
    options = _options(["--endpoint", "chat", "--agent-turns", "6", "--tool-tokens", "uniform:100,400",
                        "--turn-gap", "1.5", "--shuffle-history", "-n", "8", "-c", "4", "--seed", "2"])
    assert options.sessions and _options(bench_options.as_flags(options)) == options


# ---------------------------------------------------------------------------------------------
# Against the calibration server (one token per word, no prefix cache)

@pytest.fixture
def calibration():
    server = CalibrationServer(Schedule(ttft_ms=5, itl_ms=1)).start_in_thread()
    yield server
    server.stop()


def _bench(capsys, *argv: str) -> tuple[int, dict]:
    code = bench.main(["--json", "--endpoint", "chat", "--warmup", "0", *argv])
    captured = capsys.readouterr()
    assert captured.out.strip(), f"exit {code}: {captured.err.strip()[-400:]}"
    return code, json.loads(captured.out)


def _shares(result: dict, key: str) -> list[float]:
    return [row[key] for row in result["sessions"]["by_turn"]]


def test_recorded_sessions_replay_with_their_history_and_their_gaps(calibration, capsys, tmp_path):
    rows = [{"session": s, "messages": [{"role": "user", "tokens": 40}], "output_tokens": 4} for s in "ab"]
    rows += [{"session": s, "gap_s": 0.02, "messages": [{"role": "tool", "tokens": 30}], "output_tokens": 4}
             for _ in range(3) for s in "ab"]
    records = tmp_path / "records.jsonl"
    _, result = _bench(capsys, "--url", calibration.url, "--sessions", _file(tmp_path, "\n".join(map(json.dumps, rows))),
                          "-c", "2", "--records", str(records))
    assert result["requests"]["completed"] == 8, result["requests"]["first_errors"]
    assert result["config"]["workload"] == "sessions" and result["workload"]["dataset"]["name"] == "sessions.jsonl"
    by_turn = result["sessions"]["by_turn"]
    assert [r["requests"] for r in by_turn] == [2, 2, 2, 2] and result["sessions"]["sessions"] == 2
    # The calibration server counts a word a token, and 3 for the template: the first prompt is the
    # run's 3 head words and 40; each later one the last, its answer and a 30-token tool result.
    means = [r["prompt_tokens"] // r["requests"] for r in by_turn]
    steps = {later - earlier for earlier, later in itertools.pairwise(means)}
    assert means[0] == 3 + 40 + 3 and len(steps) == 1 and steps.pop() >= 30 + 4
    perfect = _shares(result, "perfect_share")
    assert perfect[0] == 0 and perfect == sorted(perfect) and perfect[-1] > 0.7
    assert by_turn[1]["perfect_tokens"] == 2 * (46 + 4)  # the first prompt and its answer, per session
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert sorted(r["perfect_tokens"] for r in lines if r["turn"] == 1) == [50, 50]


def test_the_shuffled_control_leaves_nothing_for_a_perfect_cache(calibration, capsys, tmp_path):
    argv = ["--url", calibration.url, "--agent-turns", "4", "-n", "3", "-c", "3", "--input-tokens", "50",
            "--tool-tokens", "uniform:20,40", "--output-tokens", "5"]
    _, in_order = _bench(capsys, *argv)
    _, control = _bench(capsys, *argv, "--shuffle-history")
    assert [r["prompt_tokens"] for r in control["sessions"]["by_turn"]] == \
        [r["prompt_tokens"] for r in in_order["sessions"]["by_turn"]]  # the same turns, the same tokens
    assert _shares(control, "perfect_share") == [0, 0, 0, 0]
    assert all(share > 0.4 for share in _shares(in_order, "perfect_share")[1:])
    assert control["workload"]["shuffle_history"] is True and "shuffle_history" not in in_order["workload"]
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for file, result in zip(files, (in_order, control)):
        file.write_text(json.dumps(result))
    assert compare.main([str(files[0]), str(files[1])]) == 2  # the control is another workload...
    assert "shuffle_history: None vs True" in capsys.readouterr().err
    assert compare.main([str(files[0]), str(files[1]), "--variable", "shuffle_history"]) in (0, 1)  # ...under test


def test_multi_turn_conversations_report_their_reuse_too(calibration, capsys):
    _, result = _bench(capsys, "--url", calibration.url, "--multi-turn", "3", "-n", "2", "-c", "2",
                       "--input-tokens", "20", "--output-tokens", "3")
    assert result["requests"]["completed"] == 6 and result["requests"]["prompt_tokens"]["mismatched"] == 0
    perfect = _shares(result, "perfect_share")
    assert perfect[0] == 0 and 0 < perfect[1] < perfect[2]
    assert not any("hit the prefix cache" in w for w in result["warnings"])


def test_the_console_shows_reuse_by_turn(calibration, capsys):
    code = bench.main(["--url", calibration.url, "--endpoint", "chat", "--agent-turns", "3", "-n", "2", "-c", "2",
                       "--warmup", "0", "--input-tokens", "30", "--tool-tokens", "20", "--output-tokens", "3"])
    out = capsys.readouterr().out
    # (exit 4 when a busy machine stalled the client: the table is printed all the same)
    assert code in (0, 4) and "Prefix reuse by turn, 2 sessions" in out and "agent sessions of 3 turns" in out
    assert "first message 30, tool results 20 / output 3 tokens" in out
    assert "no answer carried usage.prompt_tokens_details.cached_tokens" in out


@pytest.mark.parametrize("over_limit", [False, True])
def test_sessions_that_outgrow_the_model_are_a_usage_error_or_with_over_limit_a_warning(over_limit):
    options = _options(["--endpoint", "chat", "--agent-turns", "4", "-n", "3", "--warmup", "0"]
                       + (["--over-limit"] if over_limit else []))
    turns = [[sessions.Turn((sessions.Message("tool", "x", size),), 10)] * 4 for size in (100, 1100, 2000)]
    assert benchrun.check_session_fits(4096, options, turns[:1]) == []
    if not over_limit:
        with pytest.raises(UsageError, match="2 of the 3 sessions outgrow the model's max_model_len 4096 "
                                             r"\(messages and answers up to 8040 tokens\)"):
            benchrun.check_session_fits(4096, options, turns)
    else:
        assert "last turns are expected to be rejected" in benchrun.check_session_fits(4096, options, turns)[0]


# ---------------------------------------------------------------------------------------------
# The real CPU vLLM: its prefix cache, turn by turn

@pytest.fixture(scope="module")
def cached_vllm(vllm_factory):
    """The cpu-tiny server, prefix caching on, with usage.prompt_tokens_details.cached_tokens in every answer."""
    with vllm_factory(sets=["enable_prefix_caching=true", 'extra_args=["--enable-prompt-tokens-details"]']) as server:
        yield server


@pytest.mark.real_vllm
def test_real_vllm_prefix_reuse_grows_with_the_turns_and_falls_when_shuffled(cached_vllm, capsys):
    # Turns of 256 tokens: several of vLLM's 128-token CPU blocks each, so what the cache keeps
    # shows; 6 turns stay within max_model_len 4096.
    argv = ["--url", cached_vllm.url, "--agent-turns", "6", "-n", "4", "-c", "2", "--input-tokens", "256",
            "--tool-tokens", "256", "--output-tokens", "16", "--turn-gap", "0.05", "--seed", "7"]
    _, in_order = _bench(capsys, *argv)
    _, control = _bench(capsys, *argv, "--shuffle-history")
    with capsys.disabled():  # the figures, for the note
        print(json.dumps({"in_order": in_order["sessions"], "control": control["sessions"]}))
    for result in (in_order, control):
        assert result["requests"]["completed"] == 24, result["requests"]["first_errors"]
    cached = _shares(in_order, "cached_share")
    assert cached[0] < 0.5 and cached[1] < cached[3] < cached[5]  # more of the prompt from the cache each turn
    assert all(row["cached_tokens"] <= row["perfect_tokens"] for row in in_order["sessions"]["by_turn"][1:])
    assert in_order["sessions"]["total"]["cached_of_perfect"] > 0.6  # whole 128-token blocks, not the last token
    shuffled = _shares(control, "cached_share")
    assert all(s < 0.5 * c for s, c in zip(shuffled[2:], cached[2:])) and shuffled[5] < shuffled[1] + 0.05
    assert control["sessions"]["total"]["cached_share"] < 0.5 * in_order["sessions"]["total"]["cached_share"]
    # The server's own counters over the run say the same.
    assert control["sessions"]["server_hit_rate"] < in_order["sessions"]["server_hit_rate"]


@pytest.mark.real_vllm
@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_real_vllm_sessions_on_the_agents_apis_meet_the_cache(cached_vllm, capsys, endpoint):
    """The same sessions on the APIs coding agents speak (Responses; Anthropic Messages, whose
    usage says cache_read_input_tokens): each turn resends the history, tool results as user
    messages, and later turns find more of it cached."""
    code, result = _bench(capsys, "--url", cached_vllm.url, "--endpoint", endpoint, "--agent-turns", "4", "-n", "2",
                          "-c", "2", "--input-tokens", "256", "--tool-tokens", "256", "--output-tokens", "16",
                          "--seed", "8")
    assert result["requests"]["completed"] == 8, result["requests"]["first_errors"]
    cached = _shares(result, "cached_share")
    assert cached[0] < 0.5 < cached[3] and cached[1] < cached[3], cached
    assert all(row["cached_tokens"] <= row["perfect_tokens"] for row in result["sessions"]["by_turn"][1:])
