"""Perplexity through a server's API: tokenize once, score windows with prompt logprobs (vLLM
completions, echo + logprobs, or SGLang's /generate), and the paired bootstrap change between two
runs with the gate of each quantization scheme. ppl.py is its command line; accept.py uses it.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import catalogs, conf, fileio, http_client, printing
from rooflib.core.errors import ServerError, UsageError

SAMPLE_TEXT = Path(__file__).resolve().parents[2] / "data" / "sample.txt"  # scripts/data: the sample inputs


APIS = ("vllm", "vllm-echo", "sglang")


RECHECK_TOLERANCE = 1e-3  # nats per token: a re-scored window that moves more is not deterministic


BOOTSTRAP_SAMPLES = 2000


DEFAULT_WINDOW = 2048  # strided windows of 2048 scored 512 at a time, as in Hugging Face's perplexity guide


MAX_TEXT_BYTES = 64 << 20  # far more than a perplexity text needs; bounds a read of /dev/zero


def read_text(path: str) -> str:
    text = fileio.read_bounded(path, "TEXT", MAX_TEXT_BYTES)
    if not text.strip():
        raise UsageError(f"TEXT {path} is empty: give a text of your own, ideally tens of thousands of tokens")
    return text


def windows(total: int, length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) per window over a sequence of `total` tokens.

    Window k sends tokens[begin:end] and scores positions first..end-1; position 0 has no
    context and is never scored. Consecutive windows score disjoint positions that cover 1..total-1.
    """
    result = []
    begin, scored_to = 0, 1
    while True:
        end = min(begin + length, total)
        result.append((begin, end, scored_to))
        if end == total:
            return result
        scored_to = end
        begin += stride


def ids_sha256(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def post(http, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with http_client.answered(f"{http.base_url}{path}", http.timeout.read):
        response = http.post(path, json=body)
    if response.status_code == 404:
        raise UsageError(f"{http.base_url} has no {path} endpoint: is it vLLM (--api vllm) or SGLang (--api sglang)?")
    if response.status_code >= 400:
        message = response.text[:300].strip()
        if "logprob" in message.lower():
            raise UsageError(f"the server refused logprobs (HTTP {response.status_code}: {message}): "
                             "ppl needs prompt logprobs (vLLM /v1/completions, SGLang /generate)")
        raise ServerError(f"POST {path} answered HTTP {response.status_code}: {message}")
    try:
        return fileio.parse_json(response.content)
    except ValueError:
        raise ServerError(f"POST {path} did not answer JSON")


def tokenize(http, api: str, model: str, text: str) -> tuple[list[int], list[int]]:
    """(prefix, ids): the server's own tokens of the text, and the BOS it adds (or none)."""
    if api == "sglang":
        # On SGLang one /generate of the text returns the token ids its logprobs are of (the BOS it
        # adds included), so the text must fit in one request there.
        try:
            meta = post(http, "/generate", sglang_body({"text": text}))
        except ServerError as exc:
            raise UsageError(f"SGLang could not take the whole text in one request ({exc}): with --api sglang "
                             "the text must fit in the context; split it into smaller files")
        return [], [entry[1] for entry in sglang_logprobs(meta)]
    ids = token_ids(post(http, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}))
    prefix = token_ids(post(http, "/tokenize", {"model": model, "prompt": "", "add_special_tokens": True}))
    return prefix, ids


def token_ids(answer: Any) -> list[int]:
    """The `tokens` of a /tokenize answer, checked: a list of token ids."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ServerError("/tokenize did not answer {\"tokens\": [token ids]}: is it vLLM?")
    return tokens


def logprob(value: Any, where: str) -> float:
    """A log-probability from the server, checked: a finite number, at most 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value <= 1e-6:
        raise ServerError(f"{where}: the logprob {str(value)[:40]!r} is not a number <= 0")
    return float(value)


def first_choice(answer: Any) -> dict[str, Any]:
    """choices[0] of a completions answer, checked to be an object ({} when there is none)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if choices is not None and not isinstance(choices, list):
        raise ServerError("/v1/completions answered choices that are not a list")
    choice = (choices or [{}])[0]
    if not isinstance(choice, dict):
        raise ServerError(f"/v1/completions answered a choices item that is {type(choice).__name__}, not an object")
    return choice


def sglang_body(prompt: dict[str, Any]) -> dict[str, Any]:
    # SGLang docs/basic_usage/sampling_params.md; python/sglang/lang/backend/runtime_endpoint.py
    return {**prompt, "sampling_params": {"max_new_tokens": 0, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 0, "return_text_in_logprobs": False}


def sglang_logprobs(answer: dict[str, Any]) -> list[list[Any]]:
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if entries and not all(isinstance(e, list) and len(e) >= 2 for e in entries):
        raise ServerError("SGLang meta_info.input_token_logprobs is not a list of [logprob, token id, ...]")
    if not entries:
        raise UsageError("SGLang /generate returned no meta_info.input_token_logprobs: the server does not "
                         "give prompt logprobs")
    return entries


def score_window(http, api: str, model: str, tokens: list[int]) -> list[float | None]:
    """log p(token_i | tokens_<i) for each position of the window; None at position 0."""
    if api == "sglang":
        entries = sglang_logprobs(post(http, "/generate", sglang_body({"input_ids": tokens})))
        if [e[1] for e in entries] != tokens:
            raise ServerError("SGLang echoed other token ids than the window sent")
        return [None] + [logprob(e[0], f"SGLang position {n}") for n, e in enumerate(entries[1:], 1)]
    body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 1.0, "seed": 0}
    if api == "vllm-echo":
        body.update(echo=True, logprobs=1, return_tokens_as_token_ids=True)
    else:
        body["prompt_logprobs"] = 0
    choice = first_choice(post(http, "/v1/completions", body))
    if api == "vllm-echo":
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not values:
            raise UsageError("the server returned no logprobs with echo: it does not give prompt logprobs")
        echoed = logprobs.get("tokens") or []
        if not isinstance(values, list) or len(values) < len(tokens) or not isinstance(echoed, list):
            raise ServerError(f"echo logprobs cover fewer positions than the {len(tokens)} tokens sent")
        if echoed and [str(t).removeprefix("token_id:") for t in echoed[:len(tokens)]] != [str(t) for t in tokens]:
            raise ServerError("the echoed tokens differ from the window sent")
        return [None] + [logprob(v, f"echo position {n}") for n, v in enumerate(values[1:len(tokens)], 1)]
    entries = choice.get("prompt_logprobs")
    if not entries:
        raise UsageError("the server returned no prompt_logprobs: it is not vLLM; try --api vllm-echo, "
                         "or --api sglang for SGLang")
    if not isinstance(entries, list) or len(entries) < len(tokens):
        raise ServerError(f"prompt_logprobs has {len(entries) if isinstance(entries, list) else 'no list of'} "
                          f"entries for the {len(tokens)} tokens sent")
    values: list[float | None] = [None]
    for position in range(1, len(tokens)):
        entries_here = entries[position] or {}
        entry = entries_here.get(str(tokens[position])) if isinstance(entries_here, dict) else None
        if entry is None:
            raise ServerError(f"prompt_logprobs at position {position} lack the prompt token {tokens[position]}")
        values.append(logprob(entry.get("logprob") if isinstance(entry, dict) else entry,
                              f"prompt_logprobs position {position}"))
    return values


def measure(http, api: str, model: str, text: str, window: int | None, stride: int | None,
            max_model_len: int | None) -> dict[str, Any]:
    """Score the whole text; the result is a run that --compare can read back.

    Window default: 2048 or max_model_len - 1 if smaller; stride default: a quarter of the window.
    """
    prefix, ids = tokenize(http, api, model, text)
    sequence = prefix + ids
    if len(sequence) < 2:
        raise UsageError("the text is a single token: give a longer text")
    window = window or min(DEFAULT_WINDOW, (max_model_len or DEFAULT_WINDOW + 1) - 1)
    stride = stride or max(1, window // 4)
    if stride >= window:
        raise UsageError(f"--stride {stride} must be smaller than the window ({window})")
    if max_model_len and window > max_model_len - 1:
        raise UsageError(f"--window {window} does not fit the server's max_model_len {max_model_len}: "
                         f"use at most {max_model_len - 1} (one position is left for the generated token)")
    plan = windows(len(sequence), window, stride)
    if len(plan) > 1:
        printing.progress(f"the text is {len(sequence):,} tokens, longer than one window of {window:,}: "
                        f"scoring {len(plan)} windows with stride {stride:,}")
    token_nll: list[float] = []
    per_window = []
    stopped = None
    try:
        for number, (begin, end, first) in enumerate(plan, 1):
            logprobs = score_window(http, api, model, sequence[begin:end])
            scored = [-lp for lp in logprobs[first - begin:]]
            token_nll += scored
            per_window.append({"begin": begin, "end": end, "scored": len(scored), "nll": sum(scored)})
            if number % 10 == 0:
                printing.progress(f"window {number}/{len(plan)}")
        begin, end, first = plan[0]
        again = [-lp for lp in score_window(http, api, model, sequence[begin:end])[first - begin:]]
        recheck = abs(sum(again) - per_window[0]["nll"]) / len(again)
    except (KeyboardInterrupt, ServerError) as exc:
        # What was scored is kept: a partial run is reported (and refused by --compare).
        if not per_window:
            raise
        stopped = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"server error: {exc}"
        recheck = None
    return summarize(text, sequence, prefix, token_nll, per_window, recheck) | {
        "api": api, "model": model, "window": window, "stride": stride, "stopped": stopped}


def summarize(text: str, sequence: list[int], prefix: list[int], token_nll: list[float],
              per_window: list[dict[str, Any]], recheck: float | None) -> dict[str, Any]:
    nll = sum(token_nll)
    size = len(text.encode("utf-8"))
    return {
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "bytes": size,
        "words": len(text.split()), "tokens": len(sequence), "prefix": prefix,
        "token_ids_sha256": ids_sha256(sequence), "scored_tokens": len(token_nll), "nll": nll,
        # Bits per byte need the whole text scored: a partial run has none.
        "ppl": math.exp(nll / len(token_nll)),
        "bits_per_byte": nll / (math.log(2) * size) if recheck is not None else None,
        "windows": per_window, "recheck_nll_delta": recheck, "token_nll": token_nll,
    }


def block_sums(values: Sequence[float], block: int) -> list[float]:
    return [sum(values[i:i + block]) for i in range(0, len(values), block)]


def paired_change(base: Sequence[float], cand: Sequence[float], block: int,
                  samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """Perplexity change in % with a 95% paired bootstrap interval over blocks of tokens.

    change = (exp(mean per-token NLL difference) - 1) * 100: the ratio of the two perplexities.
    """
    diffs = block_sums([c - b for b, c in zip(base, cand)], block)
    counts = block_sums([1.0] * len(base), block)
    change = (math.exp(sum(diffs) / sum(counts)) - 1) * 100
    rng = random.Random(seed)
    draws = []
    for _ in range(samples):
        picks = [rng.randrange(len(diffs)) for _ in diffs]
        draws.append((math.exp(sum(diffs[i] for i in picks) / sum(counts[i] for i in picks)) - 1) * 100)
    draws.sort()
    return change, draws[int(0.025 * samples)], draws[int(0.975 * samples) - 1]


def gate(scheme: str, warn_pct: float | None, fail_pct: float | None) -> dict[str, Any]:
    key, entry = catalogs.find_in_catalog(catalogs.load_catalog("ppl_gates"), scheme, "quantization scheme")
    levels = {"scheme": key, "name": entry["name"], "warn_pct": entry["warn_pct"], "fail_pct": entry["fail_pct"],
              "source": entry["source"]}
    if warn_pct is not None:
        levels["warn_pct"] = warn_pct
    if fail_pct is not None:
        levels["fail_pct"] = fail_pct
    if levels["warn_pct"] > levels["fail_pct"]:
        raise UsageError(f"--warn-pct {levels['warn_pct']} is above --fail-pct {levels['fail_pct']}")
    return levels


def compare(base: dict[str, Any], cand: dict[str, Any], levels: dict[str, Any], block: int) -> dict[str, Any]:
    if base.get("stopped") or cand.get("stopped"):
        raise UsageError("a partial run cannot be compared: measure the whole text on both sides")
    if base["text_sha256"] != cand["text_sha256"]:
        raise UsageError("the two runs scored different texts: score the same TEXT file on both")
    result: dict[str, Any] = {"base_ppl": base["ppl"], "candidate_ppl": cand["ppl"], "levels": levels}
    alike = (base["token_ids_sha256"] == cand["token_ids_sha256"]
             and (base["window"], base["stride"]) == (cand["window"], cand["stride"]))
    if alike:
        change, low, high = paired_change(base["token_nll"], cand["token_nll"], block)
        result.update(metric="perplexity", change_pct=change, ci95_pct=[low, high], judged_pct=high)
    else:
        # Tokenizers (or windows) differ: per-byte change, tokenizer-free, but unpaired (no interval).
        change = (math.exp((cand["nll"] - base["nll"]) / base["bytes"]) - 1) * 100
        result.update(metric="byte perplexity (tokenizations or windows differ)", change_pct=change,
                      ci95_pct=None, judged_pct=change,
                      base_bits_per_byte=base["bits_per_byte"], candidate_bits_per_byte=cand["bits_per_byte"])
    judged = result["judged_pct"]
    result["verdict"] = "PASS" if judged <= levels["warn_pct"] else "WARN" if judged <= levels["fail_pct"] else "FAIL"
    return result


def load_run(path: str) -> dict[str, Any]:
    run = fileio.read_json_file(path, "saved run", f"save a run with `ppl.py --json > {path}`")
    needed = {"text_sha256", "token_ids_sha256", "token_nll", "nll", "bytes", "ppl", "window", "stride"}
    if not isinstance(run, dict) or not needed <= run.keys():
        raise UsageError(f"{path} is not a saved ppl run: save one with `ppl.py --json > {path}`")
    return run


def resolve_text(args) -> tuple[str, str]:
    path = conf.settings_from_args(args).get("TEXT", args.text)
    if not path:
        printing.progress(f"no TEXT given: scoring the bundled sample {SAMPLE_TEXT} (your own text is the point)")
        path = str(SAMPLE_TEXT)
    return path, read_text(path)
