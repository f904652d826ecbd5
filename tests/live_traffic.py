"""Live traffic for the doctor's fault deployments: users' requests in the background.

`traffic(url, model, ...)` keeps `concurrency` users sending completions (text prompts of about
the given lengths, `long_share` of them longer than the context limit when asked) until
the block ends, and counts their answers by status. Users wait `think_s` between requests (a
Poisson-like pause), so the load is live but not a wall.
"""
from __future__ import annotations

import random
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import httpx

WORDS = "time year people way day man thing woman life child world school state family student".split()


@dataclass
class Counts:
    by_status: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: int) -> None:
        with self.lock:
            self.by_status[status] = self.by_status.get(status, 0) + 1


def prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@contextmanager
def traffic(url: str, model: str, concurrency: int = 2, prompt_words: int = 200, output_tokens: int = 32,
            long_share: float = 0.0, long_words: int = 0, think_s: float = 0.2, stream: bool = False,
            shared: bool = False, timeout_s: float = 300, seed: int = 0) -> Iterator[Counts]:
    """`shared`: every prompt is the same system prompt and a different question after it;
    `timeout_s`: a user gives up on a request after this long (the server counts an abort)."""
    counts = Counts()
    stop = threading.Event()

    def user(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        # Long prompts come at a fixed pace (every 1/long_share-th request, the users staggered), so
        # a short window of a slow server still holds its share of them.
        owed = long_share * (number + 1) / concurrency
        with httpx.Client(base_url=url, timeout=timeout_s) as http:
            while not stop.is_set():
                owed += long_share
                words = long_words if owed >= 1 else prompt_words
                owed -= owed >= 1
                text = f"{prompt(words, random.Random(seed))} question {rng.random()}" if shared else prompt(words, rng)
                body = {"model": model, "prompt": text, "max_tokens": output_tokens,
                        "ignore_eos": True, "stream": stream}
                try:
                    if stream:
                        with http.stream("POST", "/v1/completions", json=body) as response:
                            for _ in response.iter_bytes():
                                pass
                            counts.add(response.status_code)
                    else:
                        counts.add(http.post("/v1/completions", json=body).status_code)
                except httpx.HTTPError:
                    counts.add(0)
                stop.wait(rng.expovariate(1 / think_s) if think_s else 0)

    users = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in users:
        thread.start()
    try:
        yield counts
    finally:
        stop.set()
        for thread in users:
            thread.join(timeout=300)
