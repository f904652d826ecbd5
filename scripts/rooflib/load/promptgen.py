"""Prompts of an exact token length, counted by the server's tokenizer where it offers one."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from rooflib.core import http_client
from rooflib.core.errors import ServerError, UsageError
from rooflib.load import apis

# Words for prompt text: common, plain, mostly one token each in BPE vocabularies.
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money story "
         "fact month lot right study book eye job word business issue side kind head house "
         "service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office "
         "door health person art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()


class TokenCounter:
    """Counts prompt tokens: the server's /tokenize, else tiktoken, else ~4 characters a token.
    `exact` says whether the count is the server's own."""

    def __init__(self, name: str, count: Callable[[str], int], exact: bool):
        self.name, self.count, self.exact = name, count, exact


def server_counter(http, model: str, chat: bool) -> TokenCounter | None:
    """The server's own tokenizer through /tokenize (vLLM, SGLang), or None if it has none.
    For chat the count includes the chat template, as the server's usage does, where the
    server tokenizes messages (vLLM); SGLang's /tokenize takes text only."""
    def counter(form: str) -> Callable[[str], int]:
        def count(text: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": text}],
                    "add_generation_prompt": True} if form == "messages" else {"model": model, "prompt": text}
            answer = http_client.get_json(http, "/tokenize", json=body)
            count = answer.get("count") if isinstance(answer, dict) else None
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                return count
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return len(tokens)
            raise ValueError("/tokenize answered neither a count nor token ids")
        return count
    forms = [("messages", "server /tokenize"), ("prompt", "server /tokenize (message text only, "
                                                          "the chat template is not counted)")]
    for form, name in forms if chat else [("prompt", "server /tokenize")]:
        try:
            counter(form)("hello world")
        except (ServerError, KeyError, TypeError, ValueError):
            continue
        return TokenCounter(name, counter(form), exact=True)
    return None


def fallback_counter() -> TokenCounter:
    """tiktoken's cl100k_base when its files are at hand (it downloads them), else an estimate."""
    try:
        import tiktoken
        encoding = tiktoken.get_encoding("cl100k_base")
        return TokenCounter("tiktoken cl100k_base (not the server's tokenizer)",
                            lambda text: len(encoding.encode(text)), exact=False)
    except Exception:  # noqa: BLE001 - tiktoken fails in many ways offline; all mean "unavailable"
        return TokenCounter("estimate, 4 characters per token (no tokenizer available)",
                            lambda text: max(1, round(len(text) / 4)), exact=False)


def salt_words(index: int, nonce: Sequence[str], digits: int = 3) -> list[str]:
    """A unique word sequence per request (and per run, through the nonce)."""
    words = list(nonce)
    for _ in range(digits):
        index, digit = divmod(index, len(WORDS))
        words.append(WORDS[digit])
    return words


def fit_words(count: Callable[[str], int], head: str, filler: list[str], target: int,
              start: int) -> tuple[str, int]:
    """head + the first n filler words, with n chosen so the text is exactly `target` tokens:
    a secant search kept inside the bracket of counts below and above the target. When one
    multi-token word jumps over the target, that word is swapped for another."""
    def text(n: int) -> str:
        return (head + " " + " ".join(filler[:n])).strip() if n else head
    head_words = len(head.split())
    n, tried, got = max(0, start), {}, 0
    for _ in range(100):
        if n > len(filler):
            filler.extend(WORDS[i % len(WORDS)] for i in range(len(filler), n + 64))
        got = tried[n] = count(text(n))
        if got == target:
            return text(n), n
        below = max((k for k, v in tried.items() if v < target), default=None)
        above = min((k for k, v in tried.items() if v > target), default=None)
        if below is not None and above == below + 1:
            filler[below] = WORDS[(WORDS.index(filler[below]) + 1) % len(WORDS)]
            tried = {k: v for k, v in tried.items() if k <= below}
            n = above
            continue
        per_word = max(got / max(n + head_words, 1), 0.1)
        n = n + (round((target - got) / per_word) or (1 if got < target else -1))
        if below is not None:
            n = max(n, below + 1)
        if above is not None:
            n = min(n, above - 1)
        if n < 0:
            break
    raise UsageError(f"cannot build a prompt of exactly {target} tokens (closest: {got}); "
                     f"the chat template or special tokens may be longer: raise --input-tokens")


def build_prompts(counter: TokenCounter, count: int, input_tokens: int, shared_prefix: int,
                  seed: int, threads: int = 8) -> list[str]:
    """`count` prompts of exactly `input_tokens` tokens (as the counter says): a shared part of
    `shared_prefix` tokens, then a unique salt, then filler words."""
    rng = random.Random(seed)
    filler = [rng.choice(WORDS) for _ in range(input_tokens + 64)]
    shared = ""
    if shared_prefix:
        shared, _ = fit_words(counter.count, "", list(filler), shared_prefix, shared_prefix)
        if shared_prefix >= input_tokens:
            return [shared] * count
    # Random per run, not seeded: a repeated run must not find its prompts in the prefix cache.
    nonce = [random.SystemRandom().choice(WORDS) for _ in range(3)]
    # The first prompt finds the filler length; the others start from it (usually 1 call each).
    first_head = (shared + " " + " ".join(salt_words(0, nonce))).strip()
    _, words = fit_words(counter.count, first_head, list(filler), input_tokens,
                         input_tokens - len(first_head.split()))

    def one(index: int) -> str:
        head = (shared + " " + " ".join(salt_words(index, nonce))).strip()
        return fit_words(counter.count, head, list(filler), input_tokens, words)[0]
    with ThreadPoolExecutor(threads if counter.exact else 1) as pool:
        return list(pool.map(one, range(count)))


def payload(endpoint: str, model: str, prompt: str, output_tokens: int,
            extra: dict[str, Any]) -> dict[str, Any]:
    """The request body of one prompt (rooflib/load/apis.py), with `extra` merged last."""
    return {**apis.body(endpoint, model, prompt, None, output_tokens), **extra}
