"""The prefix probe: can this server's prefix cache hit at all? Two identical one-token
completions, then the second's cached tokens and the server's cache counters say.

A prefix cache matches a prompt from its first token, in whole KV blocks: vLLM hashes each full
block of block_size tokens together with every block before it (vllm/v1/core/kv_cache_utils.py,
hash_block_tokens, vLLM 0.32.0), so two prompts share cached blocks only up to the first block in
which they differ. A timestamp or a request id before a long shared system prompt makes every
block differ: the cache works and never hits. The probe tells that case (the cache can hit: the
prompts defeat it) from a cache that cannot hit (caching off, or blocks evicted before reuse).

Evidence, strongest first: the second answer's usage.prompt_tokens_details.cached_tokens (vLLM
with --enable-prompt-tokens-details, SGLang with --enable-cache-report); the counters around
each request: vLLM's vllm:prefix_cache_queries/_hits (tokens looked up and found; a request is
looked up only with caching on, vllm/v1/core/kv_cache_manager.py, record_prefix_cache_stats),
vllm:prompt_tokens_cached and vllm:prompt_tokens_cached_by_source where exported (vLLM 0.32.0,
vllm/v1/metrics/loggers.py), SGLang's cached prompt tokens among sglang:prompt_tokens_total (counted
as each request finishes: snapshots.py reads them from its prompt-token histograms before the
first hit creates sglang:cached_tokens_total); vllm:cache_config_info's enable_prefix_caching and
block_size, SGLang's sglang:page_size. The two answer times (the prefill, with the network and the
API server) only support the verdict: a busy server blurs them. SGLang (0.5.23 and main 2026-08,
checked against the live CPU engine) exports no radix-cache switch, so a cache that never hits
there is "off or evicted"; like vLLM it never reuses a prompt's last token (_compute_max_prefix_len
in python/sglang/srt/managers/schedule_batch.py, SGLang 0.5.23).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import httpx

from rooflib.core import http_client
from rooflib.server import metric_names, metric_sources, model_listing, prometheus_text, snapshots

PROBE_BLOCKS = 8           # the prompt fills this many KV blocks: a hit shows plainly
MIN_PROMPT_WORDS = 1024    # and is at least this long, so that its prefill is visible in the time
# Plain words, one or two tokens each in common tokenizers; the prompt repeats them.
FILLER = ("the system prompt of a long running service explains each rule and every tool with care "
          "so that a model can follow the same steps for all of its users over many turns").split()


@dataclass(frozen=True)
class Counters:
    """One /metrics scrape's figures the probe needs (token counts since the server started)."""
    engine: str
    queries: float | None        # prompt tokens looked up (SGLang: all prompt tokens)
    hits: float | None           # prompt tokens found in the cache
    cached: float | None         # vllm:prompt_tokens_cached (local + external), where exported
    cached_by_source: Mapping[str, float]
    cache_config: Mapping[str, str]
    kv_usage: float | None
    start_time: float | None = None   # when the engine started: another value is another engine
    page_size: int | None = None      # SGLang's radix-cache page, sglang:page_size


@dataclass(frozen=True)
class Answer:
    ms: float                    # the one-token answer's round trip
    prompt_tokens: int | None
    cached_tokens: int | None    # usage.prompt_tokens_details.cached_tokens, when the server gives it


def counters(text: str, source: str = "") -> Counters:
    exposition = prometheus_text.parse_exposition(text)
    snap = snapshots.snapshot(exposition, source)

    def value(concept: str) -> float | None:
        return snap["counters"][concept]["value"] if concept in snap["counters"] else None
    cached = exposition.samples.get("vllm:prompt_tokens_cached_total")
    by_source: dict[str, float] = {}
    for labels, count in exposition.samples.get("vllm:prompt_tokens_cached_by_source_total", []):
        by_source[labels.get("source", "")] = by_source.get(labels.get("source", ""), 0.0) + count
    kv = snap["gauges"].get("kv_cache_usage")
    return Counters(snap["engine"], value("prefix_queries"), value("prefix_hits"),
                    sum(v for _, v in cached) if cached else None, by_source, snap["cache_config"],
                    kv["value"] if kv else None, snap["start_time"], _page_size(snap))


def _page_size(snap: dict[str, Any]) -> int | None:
    page = snap["gauges"].get("page_size")
    return int(page["value"]) if page and page["value"] >= 1 else None


def block_size(scrape: Counters) -> tuple[int, str]:
    """The tokens a cache hit is counted in, and where that figure comes from."""
    size = scrape.cache_config.get("block_size", "")
    if size.isdigit() and int(size) > 0:
        return int(size), "vllm:cache_config_info"
    if scrape.engine == "sglang":
        return (scrape.page_size, "sglang:page_size") if scrape.page_size else \
            (1, "SGLang's --page-size default (sglang:page_size not exported)")
    return 16, "vLLM's GPU default (vllm:cache_config_info not exported)"


def prompt_words(block: int, max_model_len: int | None) -> int:
    """Words enough for PROBE_BLOCKS blocks, yet under max_model_len at up to 4 tokens a word."""
    words = max(PROBE_BLOCKS * block, MIN_PROMPT_WORDS)
    return min(words, max_model_len // 4) if max_model_len else words


def probe_prompt(nonce: str, words: int) -> str:
    """A nonce first, so the first request cannot hit what any earlier one left, then filler."""
    return f"probe {nonce}: " + " ".join(FILLER[i % len(FILLER)] for i in range(words))


def delta(before: Counters, after: Counters) -> dict[str, Any]:
    """The counters' increase between two scrapes (None where not exported)."""
    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b
    moved = {k: v - before.cached_by_source.get(k, 0.0) for k, v in after.cached_by_source.items()}
    return {"queries": minus(after.queries, before.queries), "hits": minus(after.hits, before.hits),
            "cached": minus(after.cached, before.cached), "cached_by_source": {k: v for k, v in moved.items() if v}}


def mixed_engines(scrapes: Sequence[Counters], steps: Sequence[Mapping[str, Any]]) -> bool:
    """The scrapes came from more than one engine (a balancer in front): a counter fell, or the
    start time changed. Their differences are then no request's."""
    starts = {round(s.start_time, 3) for s in scrapes if s.start_time}
    return len(starts) > 1 or any((step[k] or 0) < 0 for step in steps for k in ("queries", "hits", "cached"))


def judge(scrapes: tuple[Counters, Counters, Counters], answers: tuple[Answer, Answer]) -> dict[str, Any]:
    """The verdict from the scrapes before, between and after the two identical requests."""
    first_scrape, _, last_scrape = scrapes
    engine = first_scrape.engine
    block, block_source = block_size(first_scrape)
    steps = [delta(scrapes[0], scrapes[1]), delta(scrapes[1], scrapes[2])]
    tokens = answers[1].prompt_tokens or answers[0].prompt_tokens
    # Neither engine reuses the prompt's last token (its logits are needed): whole blocks of n - 1.
    cacheable = (tokens - 1) // block * block if tokens else None
    switch = first_scrape.cache_config.get("enable_prefix_caching")
    # vLLM counts a lookup per prompt token; SGLang's "queries" are all prompt tokens. Any other
    # count means other requests ran in between, and the counters are theirs too.
    other = tokens is not None and any(s["queries"] not in (None, 0, tokens) for s in steps)
    mixed = mixed_engines(scrapes, steps)
    other = other or mixed
    cached_now = answers[1].cached_tokens
    hits_now = None if other else steps[1]["hits"]
    evidence, cause = [], None
    if cached_now is not None:
        evidence.append(f"the second answer's usage says {cached_now:,} of its {tokens or 0:,} prompt tokens were cached")
    if hits_now is not None:
        evidence.append(f"the server counted {hits_now:,.0f} cached tokens for the second request "
                        f"({steps[1]['queries'] or 0:,.0f} looked up)")
    if switch is not None:
        evidence.append(f"vllm:cache_config_info: enable_prefix_caching={switch}, block_size {block}")
    if (cached_now or 0) > 0 or (hits_now or 0) > 0:
        verdict = "can_hit"
    elif switch == "False" or (switch is None and engine == "vllm" and not other
                               and steps[0]["queries"] == 0 and steps[1]["queries"] == 0):
        verdict, cause = "cannot_hit", "caching_off"
        if switch is None:
            evidence.append("the engine looked up none of the prompt tokens: it skips the lookup with caching off")
    elif (cached_now == 0 or (hits_now == 0 and steps[1]["queries"])) and cacheable != 0:
        verdict = "cannot_hit"
        cause = "evicted" if engine == "vllm" else "off_or_evicted"
        if last_scrape.kv_usage is not None:
            evidence.append(f"KV-cache usage {last_scrape.kv_usage:.0%} after the probe")
    else:
        verdict = "unknown"
    if mixed:
        verdict = "unknown" if verdict != "can_hit" else verdict
        cause = "mixed_engines"
        evidence.append("consecutive scrapes came from different engines (a counter fell or the start time changed): "
                        "a balancer answers this URL, so its counters cannot be read as one engine's")
    elif other:
        evidence.append("other requests ran during the probe: the counters are not the probe's alone")
    return {"engine": engine, "block_size": block, "block_size_source": block_source, "prefix_caching": switch,
            "prompt_tokens": tokens, "cacheable_tokens": cacheable, "other_traffic": other,
            "requests": [{"ms": a.ms, "prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens, "server": s}
                         for a, s in zip(answers, steps)],
            "kv_cache_usage": last_scrape.kv_usage, "verdict": verdict, "cause": cause, "evidence": evidence,
            "meaning": meaning(verdict, cause, block, engine)}


def meaning(verdict: str, cause: str | None, block: int, engine: str) -> str:
    """What the verdict means for the live hit rate, and what to do."""
    unit = f"whole blocks of {block} tokens" if engine == "vllm" else "whole pages (--page-size, 1 token by default)"
    if verdict == "can_hit":
        return (f"this server's prefix cache can hit: a 0% hit rate under live traffic is the prompts. The cache "
                f"matches a prompt from its first token in {unit}, so prompts that differ early (a timestamp, a "
                "request or user id before the shared system prompt) share nothing: put the shared part first, "
                "byte-identical, and the varying part after it")
    if cause == "caching_off":
        return "this server's prefix cache cannot hit: prefix caching is off; turn it on with --enable-prefix-caching"
    if cause == "evicted":
        return ("this server's prefix cache cannot hit: caching is on and looked the prompt up, but the first "
                "request's blocks were evicted before the second came: the KV cache is too small for the traffic "
                "(more KV memory: --gpu-memory-utilization or --kv-cache-memory-bytes, fewer running requests)")
    if cause == "mixed_engines":
        return ("cannot tell from this URL: its /metrics comes from several engines behind a balancer. Run the "
                "probe against one engine's own URL (both requests must reach the same engine to share a cache)")
    if cause == "off_or_evicted":
        return ("this server's prefix cache cannot hit: the radix cache is off (--disable-radix-cache) or evicted "
                "the first request's pages before the second came; SGLang's metrics do not say which")
    return ("no evidence either way: the server gave neither cached_tokens in usage (vLLM: "
            "--enable-prompt-tokens-details; SGLang: --enable-cache-report) nor prefix-cache counters")


def _answer(http: httpx.Client, model: str, prompt: str) -> Answer:
    payload = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    body = http_client.get_json(http, "/v1/completions", json=payload)
    ms = (time.perf_counter() - started) * 1e3
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt_tokens = usage.get("prompt_tokens")
    return Answer(ms, prompt_tokens if _count(prompt_tokens) else None, cached if _count(cached) else None)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _scrape(url: str, api_key: str | None, timeout: float) -> Counters:
    text, _ = metric_sources.scrape(url, api_key, timeout)
    return counters(text, url)


def run(url: str, api_key: str | None, model: str | None, timeout: float) -> dict[str, Any]:
    """Probe the server at `url`: at most three scrapes and three requests of `timeout` each."""
    first = _scrape(url, api_key, timeout)
    with http_client.client(url, api_key, timeout, max_connections=1) as http:
        entry = model_listing.served_model(http, model)
        words = prompt_words(block_size(first)[0], entry.get("max_model_len"))
        prompt = probe_prompt(secrets.token_hex(6), words)
        one = _answer(http, entry["id"], prompt)
        mid = _scrape(url, api_key, timeout)
        two = _answer(http, entry["id"], prompt)
    last = _scrape(url, api_key, timeout)
    return {"kind": "prefix_probe", "schema_version": 1, "url": url, "model": entry["id"],
            **judge((first, mid, last), (one, two))}


def format_result(result: Mapping[str, Any]) -> str:
    """The human report."""
    tokens = result["prompt_tokens"]
    cacheable = (f" ({result['cacheable_tokens'] // result['block_size']} full blocks of {result['block_size']}: "
                 f"{result['cacheable_tokens']:,} tokens can hit)") if result["cacheable_tokens"] is not None else ""
    lines = [f"prefix probe: {result['url']} ({result['model']}, {metric_names.ENGINE_LABELS[result['engine']]})",
             f"  two identical prompts of {_num(tokens)} tokens{cacheable}"]
    for name, row in zip(("first", "second"), result["requests"]):
        server = row["server"]
        sources = ", ".join(f"{k} {v:,.0f}" for k, v in server["cached_by_source"].items())
        lines.append(f"  {name + ':':<8}{row['ms']:,.0f} ms, usage cached_tokens {_num(row['cached_tokens'])}; "
                     f"server looked up {_num(server['queries'])}, found {_num(server['hits'])}"
                     + (f" ({sources})" if sources else ""))
    lines += [f"  evidence: {line}" for line in result["evidence"]]
    lines.append(f"verdict: {result['verdict'].replace('_', ' ')}"
                 + (f" ({result['cause'].replace('_', ' ')})" if result["cause"] else "") + f": {result['meaning']}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"
