"""One request's outcome: what came back, when each token arrived, and what went wrong."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rooflib.core import fileio
from rooflib.load.http1 import Response, parse_response

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # reasoning markers in plain text (DeepSeek-R1, Qwen3)


ERROR_KINDS = ("unreachable", "wrong_model", "http_4xx", "http_5xx", "stream_cut",
               "malformed_sse", "stream_error", "timeout", "empty_output", "client_fd_limit")


@dataclass
class Outcome:
    """One request's measured result (times in ns, monotonic clock)."""
    index: int
    warmup: bool = False
    scheduled_ns: int | None = None
    sent_ns: int = 0
    connect_ms: float = 0.0
    status: int | None = None
    error: str | None = None
    detail: str = ""
    token_times: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    done_ns: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    cached_tokens: int | None = None
    reads: list[tuple[int, bytes]] = field(default_factory=list, repr=False)
    timed_out: bool = False
    settled: bool = False
    turn: int = 0
    text: str = field(default="", repr=False)  # the answer, kept for multi-turn histories
    requested_tokens: int | None = None  # max_tokens asked for
    prompt_target: int | None = None     # the prompt length it was built to (None: dataset text)
    reasoning_seen: bool = False
    answer_at: int | None = None  # index in token_times of the first answer (not reasoning) chunk

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.sent_ns) / 1e6

    @property
    def e2e_ms(self) -> float:
        return (self.token_times[-1] - self.sent_ns) / 1e6

    @property
    def tpot_ms(self) -> float | None:
        tokens = self.completion_tokens or 0
        return (self.e2e_ms - self.ttft_ms) / (tokens - 1) if tokens > 1 else None

    @property
    def reasoning_tokens(self) -> int:
        if not self.reasoning_seen:
            return 0
        end = len(self.chunk_tokens) if self.answer_at is None else self.answer_at
        return sum(self.chunk_tokens[:end])

    @property
    def answer_tokens(self) -> int:
        return (self.completion_tokens or 0) - self.reasoning_tokens

    @property
    def ttft_answer_ms(self) -> float | None:
        """Request sent -> first answer chunk (after any reasoning)."""
        return None if self.answer_at is None else (self.token_times[self.answer_at] - self.sent_ns) / 1e6

    @property
    def tpot_reasoning_ms(self) -> float | None:
        n = self.reasoning_tokens
        if n < 2:
            return None
        last = self.token_times[(len(self.token_times) if self.answer_at is None else self.answer_at) - 1]
        return (last - self.token_times[0]) / 1e6 / (n - 1)

    @property
    def tpot_answer_ms(self) -> float | None:
        n = self.answer_tokens
        if self.answer_at is None or n < 2:
            return None
        return (self.token_times[-1] - self.token_times[self.answer_at]) / 1e6 / (n - 1)

    def chunk_gaps_ms(self) -> list[float]:
        times = self.token_times
        return [(times[i] - times[i - 1]) / 1e6 for i in range(1, len(times))]

    def token_gaps_ms(self) -> list[float]:
        """Each chunk gap spread evenly over the tokens that chunk carried."""
        gaps = []
        for gap, tokens in zip(self.chunk_gaps_ms(), self.chunk_tokens[1:]):
            gaps.extend([gap / tokens] * tokens if tokens > 0 else [])
        return gaps

    def record(self) -> dict[str, Any]:
        """The per-request record written with --records (times relative to sending)."""
        rec = {"index": self.index, "turn": self.turn, "warmup": self.warmup, "ok": self.ok, "error": self.error,
               "detail": self.detail or None, "status": self.status, "sent_ns": self.sent_ns,
               "connect_ms": round(self.connect_ms, 3), "prompt_tokens": self.prompt_tokens,
               "completion_tokens": self.completion_tokens, "finish_reason": self.finish_reason,
               "cached_tokens": self.cached_tokens,
               "schedule_delay_ms": None if self.scheduled_ns is None else
               round((self.sent_ns - self.scheduled_ns) / 1e6, 3),
               # What the analysis reads besides the times: a merge rebuilds the outcome from them.
               "requested_tokens": self.requested_tokens, "prompt_target": self.prompt_target,
               "usage_reported": self.usage_reported}
        if self.token_times:
            rec.update(ttft_ms=round(self.ttft_ms, 3), e2e_ms=round(self.e2e_ms, 3),
                       tpot_ms=None if self.tpot_ms is None else round(self.tpot_ms, 4),
                       chunk_ms=[round((t - self.sent_ns) / 1e6, 3) for t in self.token_times],
                       chunk_tokens=self.chunk_tokens)
            if self.reasoning_seen:
                rec.update(reasoning_tokens=self.reasoning_tokens, answer_tokens=self.answer_tokens,
                           ttft_answer_ms=None if self.ttft_answer_ms is None else round(self.ttft_answer_ms, 3),
                           answer_at=self.answer_at)
        return rec


def _content_of(choice: dict[str, Any], chat: bool) -> tuple[Any, bool]:
    """(what the chunk carries, whether it is a reasoning delta of a reasoning parser)."""
    if not chat:
        return choice.get("text"), False
    delta = choice.get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    answer = delta.get("content") or delta.get("tool_calls")
    return (answer or reasoning), bool(reasoning and not answer)


def mark_reasoning(outcome: Outcome, content: Any, parsed_reasoning: bool, thinking: bool) -> bool:
    """Classify the chunk just appended (reasoning or answer) and say whether the text is now
    inside <think>. Without a reasoning parser the model's <think>...</think> arrives as
    content; a template that opens the tag itself (DeepSeek-R1) shows only the closing one, so
    a first </think> makes everything before it reasoning."""
    chunk = len(outcome.token_times) - 1
    reasoning = parsed_reasoning
    if isinstance(content, str) and not parsed_reasoning:
        if outcome.answer_at is None and not thinking and THINK_OPEN in content:
            thinking = True
        if THINK_CLOSE in content and (thinking or not outcome.reasoning_seen):
            if not thinking:  # no opening tag seen: what came before was reasoning
                outcome.answer_at = None
            thinking, after = False, content.split(THINK_CLOSE, 1)[1]
            reasoning = not after.strip()
            outcome.reasoning_seen = True
        elif thinking:
            reasoning = True
    if reasoning:
        outcome.reasoning_seen = True
    elif outcome.answer_at is None:
        outcome.answer_at = chunk
    return thinking


def interpret(outcome: Outcome, response: Response, chat: bool) -> Outcome:
    """Fill an Outcome from a parsed streamed response; errors are classified by kind."""
    outcome.status = response.status
    if not _stream_opened(outcome, response):
        return outcome
    cumulative, thinking = 0, False
    for t_ns, data in response.events:
        if data.strip() == b"[DONE]":
            outcome.done_ns = t_ns
            break
        chunk = _chunk(outcome, data)
        if chunk is None:
            return outcome
        new_tokens, cumulative = _take_usage(outcome, chunk.get("usage"), cumulative)
        for choice in chunk.get("choices") or []:
            thinking = _take_choice(outcome, choice, t_ns, new_tokens, chat, thinking)
    outcome.completion_tokens = cumulative if outcome.usage_reported else len(outcome.token_times)
    if outcome.done_ns is None:
        outcome.error = "stream_cut"
        outcome.detail = f"stream ended without [DONE] after {len(outcome.token_times)} content chunks"
    elif not outcome.token_times:
        outcome.error, outcome.detail = "empty_output", "the stream carried no content"
    return outcome


def _stream_opened(outcome: Outcome, response: Response) -> bool:
    """Whether the response is an event stream; if not, the outcome's error says why."""
    if response.status is None:
        outcome.error = outcome.error or "stream_cut"
        outcome.detail = outcome.detail or "connection closed before an HTTP response"
        return False
    if response.status >= 400:
        text = response.body[:300].decode("utf-8", "replace").strip()
        wrong_model = response.status == 404 and "model" in text.lower()
        outcome.error = "wrong_model" if wrong_model else f"http_{response.status // 100}xx"
        outcome.detail = f"HTTP {response.status}: {text[:200]}"
        return False
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        outcome.error = "malformed_sse"
        outcome.detail = f"content-type {response.headers.get('content-type')!r}, not an event stream"
        return False
    return True


def _chunk(outcome: Outcome, data: bytes) -> dict[str, Any] | None:
    """One SSE data line as a chunk of the OpenAI stream format; None, with the outcome's error
    set, when it is not JSON, carries an error or does not fit the format."""
    try:
        chunk = fileio.parse_json(data)
        if not isinstance(chunk, dict):
            raise ValueError("not an object")
    except ValueError:
        outcome.error, outcome.detail = "malformed_sse", f"bad SSE data: {data[:80]!r}"
        return None
    if "error" in chunk:
        error = chunk["error"]
        outcome.error = "stream_error"
        outcome.detail = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
        return None
    fault = odd_chunk(chunk)
    if fault:
        outcome.error, outcome.detail = "malformed_sse", fault
        return None
    return chunk


def _take_usage(outcome: Outcome, usage: Any, cumulative: int) -> tuple[int | None, int]:
    """A chunk's usage: (output tokens since the last usage, None without one; the running total)."""
    if not isinstance(usage, dict) or usage.get("completion_tokens") is None:
        return None, cumulative
    outcome.usage_reported = True
    outcome.prompt_tokens = usage.get("prompt_tokens", outcome.prompt_tokens)
    details = usage.get("prompt_tokens_details") or {}
    outcome.cached_tokens = details.get("cached_tokens", outcome.cached_tokens)
    return usage["completion_tokens"] - cumulative, usage["completion_tokens"]


def _take_choice(outcome: Outcome, choice: dict[str, Any], t_ns: int, new_tokens: int | None,
                 chat: bool, thinking: bool) -> bool:
    """Record a choice of a chunk that arrived at t_ns; whether the text is now inside <think>."""
    if choice.get("finish_reason"):
        outcome.finish_reason = choice["finish_reason"]
    content, parsed_reasoning = _content_of(choice, chat)
    if content:
        outcome.token_times.append(t_ns)
        outcome.chunk_tokens.append(1 if new_tokens is None else new_tokens)
        thinking = mark_reasoning(outcome, content, parsed_reasoning, thinking)
        if isinstance(content, str) and not parsed_reasoning:
            outcome.text += content
    elif new_tokens and outcome.chunk_tokens:
        # Tokens with no visible text (e.g. a stop string) belong to the last content chunk.
        outcome.chunk_tokens[-1] += new_tokens
    return thinking


def _count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def odd_chunk(chunk: dict[str, Any]) -> str:
    """Why a well-formed JSON chunk does not fit the OpenAI stream format ('' when it does):
    the fields interpret() reads must have their types."""
    usage = chunk.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return f"usage is {type(usage).__name__}, not an object"
        details = usage.get("prompt_tokens_details")
        if details is not None and not isinstance(details, dict):
            return "usage.prompt_tokens_details is not an object"
        for name, value in [*usage.items(), *(details or {}).items()]:
            if name in ("completion_tokens", "prompt_tokens", "cached_tokens") and not _count(value):
                return f"usage.{name} is {value!r}, not a whole number"
    choices = chunk.get("choices")
    if choices is not None and not isinstance(choices, list):
        return f"choices is {type(choices).__name__}, not a list"
    for choice in choices or []:
        if not isinstance(choice, dict):
            return f"a choices item is {type(choice).__name__}, not an object"
        if choice.get("delta") is not None and not isinstance(choice["delta"], dict):
            return "choices[].delta is not an object"
        if not isinstance(choice.get("finish_reason"), (str, type(None))):
            return "choices[].finish_reason is not a string"
    return ""


def settle(outcome: Outcome, chat: bool) -> Outcome:
    """Parse and interpret the bytes a request received (after the run)."""
    if outcome.settled:
        return outcome
    outcome.settled = True
    reads, outcome.reads = outcome.reads, []
    if outcome.error:  # never sent
        return outcome
    try:
        response = parse_response(reads)
    except ValueError as exc:
        outcome.error, outcome.detail = "malformed_sse", str(exc)
        return outcome
    if outcome.timed_out and not (response.complete and response.events):
        outcome.status = response.status
        outcome.error, outcome.detail = "timeout", "nothing received for --timeout seconds"
        return outcome
    return interpret(outcome, response, chat)
