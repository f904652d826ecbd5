"""A fake server that scores prompts with a known toy language model, in vLLM's and SGLang's formats.

The toy model is a bigram: log p(t | previous) depends on the previous token only, so its exact
perplexity on any text is easy to compute here, and windowing must not change it. Its
"tokenizer" maps each character to one id. Shapes follow vLLM 0.32's and SGLang's documented responses:
  vLLM   /tokenize -> {"count", "max_model_len", "tokens"}; /v1/completions with prompt_logprobs ->
         choices[0].prompt_logprobs = [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...];
         with echo + logprobs -> choices[0].logprobs.token_logprobs (null first, generated token last)
  SGLang /generate with return_logprob, logprob_start_len 0 -> meta_info.input_token_logprobs =
         [[null, id0, null], [lp1, id1, null], ...] (no /tokenize)
`shift(position)` adds nats to every logprob (a "quantized" candidate); `bos` makes the tokenizer
add a BOS id; `no_logprobs` answers completions without any logprobs; `fail_after` N answers
HTTP 500 from the N+1st completion on (a crash mid-run); `drift` moves every logprob by 0.01 nats
more with each completion (a server that is not deterministic).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from fake_http import serving

VOCAB = 64
BOS = 1
MODEL = "fake-scorer"


def token_ids(text: str) -> list[int]:
    return [2 + ord(ch) % (VOCAB - 2) for ch in text]


def _scores(previous: int) -> list[float]:
    return [((previous * 31 + v * 17) % 13) / 3.0 for v in range(VOCAB)]


def logprob(previous: int, token: int) -> float:
    scores = _scores(previous)
    return scores[token] - math.log(sum(math.exp(s) for s in scores))


def exact_nll(sequence: list[int]) -> float:
    """What any correct windowing must report: the bigram model sees only one token back."""
    return -sum(logprob(a, b) for a, b in zip(sequence, sequence[1:]))


def handler(engine: str, max_model_len: int, bos: bool, no_logprobs: bool,
            shift: Callable[[int], float], requests: list[dict], fail_after: int | None = None,
            drift: bool = False):
    def scored(tokens: list[int]) -> list[float | None]:
        offset = 0.01 * len(requests) if drift else 0.0
        return [None] + [logprob(a, b) + shift(i + 1) + offset for i, (a, b) in enumerate(zip(tokens, tokens[1:]))]

    def handle(method: str, path: str, body: Any) -> tuple[int, Any]:
        if body is not None:
            requests.append({"path": path, **body})
        if path == "/v1/models":
            return 200, {"data": [{"id": MODEL, "max_model_len": max_model_len}]}
        if engine == "vllm" and path == "/tokenize":
            tokens = ([BOS] if bos and body.get("add_special_tokens", True) else []) + token_ids(body["prompt"])
            return 200, {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
        if engine == "vllm" and path == "/v1/completions":
            if fail_after is not None and sum(r["path"] == path for r in requests) > fail_after:
                return 500, {"error": {"message": "EngineCore encountered an issue."}}
            tokens = body["prompt"]
            if len(tokens) + body.get("max_tokens", 16) > max_model_len:
                return 400, {"error": {"message": f"This model's maximum context length is {max_model_len} tokens."}}
            choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length"}
            values = scored(tokens)
            if no_logprobs:
                pass
            elif body.get("echo"):
                choice["logprobs"] = {"token_logprobs": values + [-1.0],
                                      "tokens": [f"token_id:{t}" for t in tokens] + ["token_id:5"]}
            elif body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": lp, "rank": 1, "decoded_token": chr(t)}}
                    for t, lp in zip(tokens[1:], values[1:])]
            return 200, {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice]}
        if engine == "sglang" and path == "/generate":
            tokens = body.get("input_ids") or token_ids(body["text"])
            if len(tokens) > max_model_len:
                return 400, {"error": {"message": "The input is longer than the context length."}}
            meta = {"prompt_tokens": len(tokens)}
            if body.get("return_logprob") and not no_logprobs:
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(scored(tokens), tokens)]
            return 200, {"text": "", "meta_info": meta}
        return 404, {"detail": "Not Found"}
    return handle


@contextmanager
def fake_ppl_server(engine: str = "vllm", max_model_len: int = 4096, bos: bool = False,
                    no_logprobs: bool = False, shift: Callable[[int], float] = lambda position: 0.0,
                    requests: list[dict] | None = None, fail_after: int | None = None,
                    drift: bool = False) -> Iterator[str]:
    with serving(handler(engine, max_model_len, bos, no_logprobs, shift,
                         requests if requests is not None else [], fail_after, drift)) as url:
        yield url
