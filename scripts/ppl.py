#!/usr/bin/env python3
"""Perplexity of the served model on a text file, through the API, and its change after quantization.

The text is tokenized by the server (vLLM /tokenize), a BOS token put in front when the tokenizer
adds one, and scored in windows of --window tokens that advance by --stride: each window after
the first scores only its last --stride tokens, with window - stride tokens of context (the
Hugging Face "Perplexity of fixed-length models" method; --stride = window - 1 gives disjoint
chunks with one token of context, as lm-evaluation-harness does). Texts longer than one window
are windowed automatically. APIs: vLLM /v1/completions with prompt_logprobs (default) or
echo + logprobs (--api vllm-echo); SGLang /generate with return_logprob (--api sglang; built
from SGLang's documented format, not run here). Reported: perplexity, token count, a SHA-256
of the token ids (two runs compare token by token only when it matches; otherwise by bits per
byte), bits per byte, and a re-score of the first window at the end (a warning when it moved).

Compare mode (--compare BASE CANDIDATE, each a server URL or a saved --json run): the change in
perplexity in %, with a 95% paired bootstrap interval over blocks of tokens, judged by its upper
bound against the levels of --scheme (fp8 1%/2%, int8 1.5%/3%, 4bit 3%/5%: warn/fail, from
scripts/catalog/ppl_gates.yaml). Use the same text, window and stride on both sides, with
prefix caching off (--no-enable-prefix-caching; vllm#42019).

Examples:
  ppl.py --url http://127.0.0.1:8000                          # the bundled sample text
  ppl.py --text my_traffic.txt --json > base.json             # save a run
  ppl.py --compare base.json http://gpu:8001 --text my_traffic.txt --scheme fp8
  ppl.py --compare base.json cand.json --scheme 4bit
  task infer:ppl INFER_URL=http://127.0.0.1:8000 TEXT=my.txt -- --window 1024 --stride 256

Exit codes: 0 measured (compare: PASS or WARN), 1 compare: FAIL, 2 usage error (empty text, bad
window, runs that cannot be compared, a server without logprobs), 3 server unreachable or failing
(the windows scored so far are printed), 130 interrupted by Ctrl-C or SIGTERM (likewise).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import ServerError, UsageError  # noqa: E402

SAMPLE_TEXT = Path(__file__).resolve().parent / "data" / "sample.txt"
APIS = ("vllm", "vllm-echo", "sglang")
RECHECK_TOLERANCE = 1e-3  # nats per token: a re-scored window that moves more is not deterministic
BOOTSTRAP_SAMPLES = 2000
DEFAULT_WINDOW = 2048  # strided windows of 2048 scored 512 at a time, as in Hugging Face's perplexity guide


# ---------------------------------------------------------------- text and windows

MAX_TEXT_BYTES = 64 << 20  # far more than a perplexity text needs; bounds a read of /dev/zero


def read_text(path: str) -> str:
    text = common.read_bounded(path, "TEXT", MAX_TEXT_BYTES)
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


# ---------------------------------------------------------------- talking to the server

def post(http, path: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    try:
        response = http.post(path, json=body)
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {http.base_url}{path}: {type(exc).__name__}: {exc}")
    if response.status_code == 404:
        raise UsageError(f"{http.base_url} has no {path} endpoint: is it vLLM (--api vllm) or SGLang (--api sglang)?")
    if response.status_code >= 400:
        message = response.text[:300].strip()
        if "logprob" in message.lower():
            raise UsageError(f"the server refused logprobs (HTTP {response.status_code}: {message}): "
                             "ppl needs prompt logprobs (vLLM /v1/completions, SGLang /generate)")
        raise ServerError(f"POST {path} answered HTTP {response.status_code}: {message}")
    try:
        return common.parse_json(response.content)
    except ValueError:
        raise ServerError(f"POST {path} did not answer JSON")


def tokenize(http, api: str, model: str, text: str) -> tuple[list[int], list[int]]:
    """(prefix, ids): the server's own tokens of the text, and the BOS it adds (or none)."""
    if api == "sglang":
        # SGLang has no /tokenize that ppl uses: one /generate of the text returns its token ids
        # (the BOS it adds included), so the text must fit in one request there.
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


# ---------------------------------------------------------------- a run

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
        common.progress(f"the text is {len(sequence):,} tokens, longer than one window of {window:,}: "
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
                common.progress(f"window {number}/{len(plan)}")
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


# ---------------------------------------------------------------- comparing two runs

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
    key, entry = common.find_in_catalog(common.load_catalog("ppl_gates"), scheme, "quantization scheme")
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
    run = common.read_json_file(path, "saved run", f"save a run with `ppl.py --json > {path}`")
    needed = {"text_sha256", "token_ids_sha256", "token_nll", "nll", "bytes", "ppl", "window", "stride"}
    if not isinstance(run, dict) or not needed <= run.keys():
        raise UsageError(f"{path} is not a saved ppl run: save one with `ppl.py --json > {path}`")
    return run


def describe_run(run: dict[str, Any]) -> str:
    lines = [f"perplexity {run['ppl']:.4f} over {run['scored_tokens']:,} scored tokens "
             f"({run['tokens']:,} tokens, {len(run['windows'])} window(s) of {run['window']:,}, stride {run['stride']:,})"]
    if run["stopped"]:
        lines.append(f"PARTIAL: stopped after {len(run['windows'])} window(s) ({run['stopped']})")
    else:
        lines.append(f"bits per byte {run['bits_per_byte']:.4f} ({run['bytes']:,} bytes, {run['words']:,} words)")
    lines.append(f"token ids sha256 {run['token_ids_sha256'][:16]}  prefix {run['prefix'] or 'none'}  api {run['api']}")
    if run["recheck_nll_delta"] is not None and run["recheck_nll_delta"] > RECHECK_TOLERANCE:
        lines.append(f"warning: re-scoring the first window moved it by {run['recheck_nll_delta']:.2e} nats/token: "
                     "the server is not deterministic (turn prefix caching off: --no-enable-prefix-caching)")
    return "\n".join(lines)


def describe_comparison(result: dict[str, Any]) -> str:
    levels = result["levels"]
    ci = result["ci95_pct"]
    interval = f" (95% CI {ci[0]:+.2f}% .. {ci[1]:+.2f}%)" if ci else " (no interval: unpaired)"
    return "\n".join([
        f"base {result['base_ppl']:.4f}  candidate {result['candidate_ppl']:.4f}",
        f"{result['metric']} change {result['change_pct']:+.2f}%{interval}",
        f"levels {levels['name']}: warn above {levels['warn_pct']}%, fail above {levels['fail_pct']}%",
        f"verdict: {result['verdict']}",
    ])


# ---------------------------------------------------------------- command line

def build_parser():
    p = common.parser(__doc__)
    common.add_server_args(p)
    p.add_argument("--model", default="", help="served model name (else $INFER_MODEL, else the first of /v1/models)")
    p.add_argument("--text", default="", help=f"UTF-8 text file to score (else $TEXT, else the bundled {SAMPLE_TEXT.name})")
    p.add_argument("--api", choices=APIS, default="vllm", help="how to ask for prompt logprobs")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens per request, at most max_model_len - 1 (unset: {DEFAULT_WINDOW} or that)")
    p.add_argument("--stride", type=int, default=None,
                   help="new tokens scored per window after the first (unset: a quarter of the window)")
    p.add_argument("--compare", nargs=2, metavar=("BASE", "CANDIDATE"), default=None,
                   help="compare two servers (URLs) or saved --json runs (files)")
    p.add_argument("--scheme", default="fp8", help="quantization scheme for the levels: fp8, int8, 4bit")
    p.add_argument("--warn-pct", type=float, default=None, help="override the scheme's warn level (%%)")
    p.add_argument("--fail-pct", type=float, default=None, help="override the scheme's fail level (%%)")
    p.add_argument("--block", type=int, default=64, help="tokens per bootstrap block (compare)")
    common.add_output_args(p)
    return p


def resolve_text(args) -> tuple[str, str]:
    path = common.settings_from_args(args).get("TEXT", args.text)
    if not path:
        common.progress(f"no TEXT given: scoring the bundled sample {SAMPLE_TEXT} (your own text is the point)")
        path = str(SAMPLE_TEXT)
    return path, read_text(path)


def run_on_server(url: str, api_key: str | None, args, text: str) -> dict[str, Any]:
    wanted = common.settings_from_args(args).get("INFER_MODEL", args.model)
    with common.client(url, api_key, args.timeout) as http:
        entry = common.served_model(http, wanted)
        model, max_model_len = entry["id"], common.max_model_len(entry, url)
        common.progress(f"scoring on {url} ({model}, api {args.api})")
        run = measure(http, args.api, model, text, args.window, args.stride, max_model_len)
    return run | {"url": url}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # Settings are read here, inside run_main: a bad URL or inference.env line is one line, exit 2.
        url, api_key = common.server_settings(args)
        if (args.window is not None and args.window < 2) or (args.stride is not None and args.stride < 1):
            raise UsageError("--window must be at least 2 and --stride at least 1")
        common.number("--block", args.block, int, 1)
        if args.compare is None:
            path, text = resolve_text(args)
            run = run_on_server(url, api_key, args, text) | {"text": path}
            common.emit(run, describe_run(run), args.json)
            if run["stopped"]:
                return common.EXIT_INTERRUPTED if run["stopped"] == "interrupted" else common.EXIT_SERVER
            return common.EXIT_OK
        levels = gate(args.scheme, args.warn_pct, args.fail_pct)
        sides = []
        text = None
        for source in args.compare:
            if source.startswith(("http://", "https://")):
                if text is None:
                    text = resolve_text(args)
                sides.append(run_on_server(common.normalize_url(source), api_key, args, text[1]) | {"text": text[0]})
            else:
                sides.append(load_run(source))
            # The second side is scored in the first side's windows, so the two pair token by token.
            args.window, args.stride = sides[0]["window"], sides[0]["stride"]
        result = compare(sides[0], sides[1], levels, args.block)
        sides = [{k: v for k, v in side.items() if k not in ("token_nll", "windows")} for side in sides]
        common.emit(result | {"base": sides[0], "candidate": sides[1]}, describe_comparison(result), args.json)
        return common.EXIT_CHECK_FAILED if result["verdict"] == "FAIL" else common.EXIT_OK

    return common.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
