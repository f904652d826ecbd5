"""metrics --prefix-probe (scripts/prefix_probe.py): the counters read from recorded scrapes, the
verdict from each kind of evidence, and bad input. The probe against real CPU vLLMs (caching on,
caching off) runs in test_diagnosis_live.py."""
from __future__ import annotations

from pathlib import Path

import metrics
import pytest

from rooflib.server import prefix_probe
from rooflib.server.prefix_probe import Answer, Counters

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
ON = {"enable_prefix_caching": "True", "block_size": "128"}
OFF = {"enable_prefix_caching": "False", "block_size": "128"}
TOKENS = 1285  # a prompt of 10 full blocks of 128 and 5 tokens: 1,280 can hit


def test_counters_of_a_recorded_vllm_scrape():
    got = prefix_probe.counters((FIXTURES / "vllm-0.32-after.txt").read_text())
    assert (got.engine, got.queries, got.hits, got.cached) == ("vllm", 19200.0, 11776.0, 11776.0)
    assert got.cached_by_source == {"device": 11776.0, "host": 0.0, "p2p": 0.0, "disk": 0.0, "external_unspecified": 0.0}
    assert prefix_probe.block_size(got) == (128, "vllm:cache_config_info")
    assert got.cache_config["enable_prefix_caching"] == "True"


def test_counters_of_a_documented_sglang_scrape():
    got = prefix_probe.counters((FIXTURES / "sglang-0.5-tp2.txt").read_text())
    # SGLang counts cached tokens among all prompt tokens; it exports no block size or switch.
    assert (got.engine, got.queries, got.hits, got.cached) == ("sglang", 412000.0, 20600.0, None)
    assert prefix_probe.block_size(got)[0] == 1 and got.cache_config == {}


def scrape(queries: float, hits: float, config: dict | None = None, engine: str = "vllm") -> Counters:
    return Counters(engine, queries, hits, None, {}, ON if config is None else config, 0.0)


def three(steps: list[tuple[float, float]], config: dict | None = None, engine: str = "vllm"):
    """Scrapes before, between and after two requests that looked up and found `steps`."""
    (q1, h1), (q2, h2) = steps
    return (scrape(100.0, 10.0, config, engine), scrape(100.0 + q1, 10.0 + h1, config, engine),
            scrape(100.0 + q1 + q2, 10.0 + h1 + h2, config, engine))


def answers(cached: int | None, tokens: int | None = TOKENS) -> tuple[Answer, Answer]:
    return Answer(140.0, tokens, None if cached is None else 0), Answer(20.0, tokens, cached)


def test_a_hit_by_usage_and_counters_can_hit():
    verdict = prefix_probe.judge(three([(TOKENS, 0), (TOKENS, 1280)]), answers(1280))
    assert (verdict["verdict"], verdict["cause"], verdict["cacheable_tokens"]) == ("can_hit", None, 1280)
    assert [r["server"]["hits"] for r in verdict["requests"]] == [0, 1280]
    assert "whole blocks of 128 tokens" in verdict["meaning"] and not verdict["other_traffic"]


def test_counters_alone_can_show_a_hit():
    verdict = prefix_probe.judge(three([(TOKENS, 0), (TOKENS, 1280)]), answers(None))
    assert verdict["verdict"] == "can_hit"
    assert verdict["evidence"][0].startswith("the server counted 1,280 cached tokens for the second request")


def test_caching_off_by_the_exported_switch():
    verdict = prefix_probe.judge(three([(0, 0), (0, 0)], OFF), answers(0))
    assert (verdict["verdict"], verdict["cause"]) == ("cannot_hit", "caching_off")
    assert "--enable-prefix-caching" in verdict["meaning"]


def test_caching_off_from_lookups_never_made_without_the_switch():
    verdict = prefix_probe.judge(three([(0, 0), (0, 0)], {}), answers(None))
    assert (verdict["verdict"], verdict["cause"]) == ("cannot_hit", "caching_off")
    assert any("skips the lookup" in line for line in verdict["evidence"])


def test_looked_up_and_not_found_is_eviction():
    verdict = prefix_probe.judge(three([(TOKENS, 0), (TOKENS, 0)]), answers(0))
    assert (verdict["verdict"], verdict["cause"]) == ("cannot_hit", "evicted")
    assert "too small" in verdict["meaning"] and "KV-cache usage 0% after the probe" in verdict["evidence"]


def test_other_traffic_leaves_the_counters_out():
    # Another client's requests looked up 5,000 tokens in between: only usage can speak.
    steps = [(TOKENS + 5000, 4000), (TOKENS, 0)]
    assert prefix_probe.judge(three(steps), answers(None))["verdict"] == "unknown"
    verdict = prefix_probe.judge(three(steps), answers(1280))
    assert verdict["verdict"] == "can_hit" and verdict["other_traffic"]


def test_sglang_cannot_tell_off_from_evicted():
    verdict = prefix_probe.judge(three([(TOKENS, 0), (TOKENS, 0)], {}, "sglang"), answers(0))
    assert (verdict["verdict"], verdict["cause"]) == ("cannot_hit", "off_or_evicted")
    # SGLang too never reuses the last token: with 1-token pages all but one can hit.
    assert verdict["cacheable_tokens"] == TOKENS - 1 and "--disable-radix-cache" in verdict["meaning"]


def test_a_prompt_shorter_than_a_block_proves_nothing():
    verdict = prefix_probe.judge(three([(100, 0), (100, 0)]), answers(0, tokens=100))
    assert (verdict["cacheable_tokens"], verdict["verdict"]) == (0, "unknown")


def test_counters_that_never_move_with_caching_on_prove_nothing():
    # A static page (a stale exporter) under a server that gives no usage: no evidence either way.
    verdict = prefix_probe.judge(three([(0, 0), (0, 0)]), answers(None, tokens=None))
    assert verdict["verdict"] == "unknown" and "--enable-prompt-tokens-details" in verdict["meaning"]


def test_the_prompt_fills_the_blocks_and_fits_the_model():
    assert prefix_probe.prompt_words(16, None) == prefix_probe.MIN_PROMPT_WORDS
    assert prefix_probe.prompt_words(256, None) == 8 * 256
    assert prefix_probe.prompt_words(128, 2048) == 512  # up to 4 tokens a word still fit
    text = prefix_probe.probe_prompt("abc123", 10)
    assert text.startswith("probe abc123: ") and len(text.split()) == 12


def test_the_human_report_names_the_verdict_and_the_evidence():
    verdict = prefix_probe.judge(three([(TOKENS, 0), (TOKENS, 1280)]), answers(1280))
    text = prefix_probe.format_result({"url": "http://h:8000", "model": "m", **verdict})
    assert "two identical prompts of 1,285 tokens (10 full blocks of 128: 1,280 tokens can hit)" in text
    assert "second: 20 ms, usage cached_tokens 1,280; server looked up 1,285, found 1,280" in text
    assert text.splitlines()[-1].startswith("verdict: can hit: this server's prefix cache can hit")


@pytest.mark.parametrize("argv", [
    ["--url", "http://127.0.0.1:9", "--prefix-probe", "--window", "5"],
    ["--url", "http://127.0.0.1:9,http://127.0.0.1:10", "--prefix-probe"],
    ["--file", str(FIXTURES / "vllm-0.32-after.txt"), "--prefix-probe"],
])
def test_the_probe_takes_one_live_server_only(capsys, argv):
    assert metrics.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prefix-probe sends requests to one live server") and err.count("\n") == 1


def test_an_unreachable_server_is_one_line(capsys):
    assert metrics.main(["--url", "http://127.0.0.1:9", "--prefix-probe", "--timeout", "2"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach http://127.0.0.1:9/metrics") and err.count("\n") == 1


def test_behind_a_balancer_the_counters_of_two_engines_are_not_read_as_one():
    """The reported case: consecutive scrapes from two replicas made the probe print "found -9,216"
    and "looked up 0". Counters that fall are another engine's: no evidence from them."""
    busy, idle = scrape(50_000.0, 12_000.0), scrape(400.0, 10.0)
    verdict = prefix_probe.judge((busy, idle, busy), answers(None))
    assert (verdict["verdict"], verdict["cause"]) == ("unknown", "mixed_engines")
    assert "a balancer answers this URL" in " ".join(verdict["evidence"])
    assert "one engine's own URL" in verdict["meaning"]
    assert all(step["server"]["hits"] is not None for step in verdict["requests"])  # kept, but not judged
    # The answer's own usage still speaks for the engine that served it.
    assert prefix_probe.judge((busy, idle, busy), answers(1280))["verdict"] == "can_hit"
