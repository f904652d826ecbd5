"""One request's outcome: what came back, when each token arrived, and what went wrong."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from rooflib.core import fileio
from rooflib.load.apis import APIS
from rooflib.load.http1 import Response, parse_response

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # reasoning markers in plain text (DeepSeek-R1, Qwen3)


ERROR_KINDS = ("unreachable", "wrong_model", "http_4xx", "http_5xx", "stream_cut",
               "malformed_sse", "malformed_answer", "stream_error", "timeout", "empty_output", "client_fd_limit")


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
    items: int | None = None  # a pooling answer's embeddings or scores (score: the pairs)
    perfect_tokens: int | None = None  # a session's turn: what a perfect prefix cache serves (sessions.py)

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
               "usage_reported": self.usage_reported, "items": self.items, "perfect_tokens": self.perfect_tokens}
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


def interpret(outcome: Outcome, response: Response, api: str) -> Outcome:
    """Fill an Outcome from a parsed response of `api` (rooflib/load/apis.py); errors are
    classified by kind."""
    outcome.status = response.status
    if not _opened(outcome, response, APIS[api].generates):
        return outcome
    if not APIS[api].generates:
        return _answer(outcome, response)
    read = {"responses": _responses_event, "messages": _messages_event}.get(api, _openai_event)
    stream = _Stream(chat=api != "completions")
    for t_ns, data in response.events:
        if data.strip() == b"[DONE]":
            outcome.done_ns = t_ns
            break
        event = _chunk(outcome, data)
        if event is None or not read(outcome, event, t_ns, stream):
            break
    if outcome.error:
        return outcome
    outcome.completion_tokens = stream.cumulative if outcome.usage_reported else len(outcome.token_times)
    if outcome.done_ns is None:
        outcome.error = "stream_cut"
        outcome.detail = (f"stream ended without {APIS[api].end_event} after {len(outcome.token_times)} "
                          "content chunks")
    elif not outcome.token_times:
        outcome.error, outcome.detail = "empty_output", "the stream carried no content"
    return outcome


@dataclass
class _Stream:
    """What a stream's events carried so far: its output tokens by usage, whether the text is inside <think>."""
    chat: bool
    cumulative: int = 0
    thinking: bool = False


def _openai_event(outcome: Outcome, chunk: dict[str, Any], t_ns: int, stream: _Stream) -> bool:
    """One chunk of an OpenAI completions or chat stream; False when the outcome's error is set."""
    fault = odd_chunk(chunk)
    if fault:
        outcome.error, outcome.detail = "malformed_sse", fault
        return False
    new_tokens, stream.cumulative = _take_usage(outcome, chunk.get("usage"), stream.cumulative)
    for choice in chunk.get("choices") or []:
        stream.thinking = _take_choice(outcome, choice, t_ns, new_tokens, stream.chat, stream.thinking)
    return True


def _responses_event(outcome: Outcome, event: dict[str, Any], t_ns: int, stream: _Stream) -> bool:
    """One event of a Responses API stream (see apis.py); False at its end or on an error."""
    kind = event.get("type")
    response = event.get("response") if isinstance(event.get("response"), dict) else {}
    if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                "response.function_call_arguments.delta"):
        _take_delta(outcome, event.get("delta"), t_ns, kind == "response.reasoning_text.delta", stream)
    elif kind in ("response.completed", "response.incomplete"):
        usage = response.get("usage")
        fault = _usage_fault(usage, ("input_tokens", "output_tokens"), "input_tokens_details")
        if fault:
            outcome.error, outcome.detail = "malformed_sse", fault
            return False
        if usage and usage.get("output_tokens") is not None:
            outcome.usage_reported = True
            outcome.prompt_tokens = usage.get("input_tokens")
            outcome.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            stream.cumulative = usage["output_tokens"]
        # vLLM sends response.completed with status "incomplete" and the reason when max_output_tokens ends it
        outcome.finish_reason = (response.get("incomplete_details") or {}).get("reason") or response.get("status")
        outcome.done_ns = t_ns
        return False
    elif kind in ("error", "response.failed"):
        error = response.get("error") if kind == "response.failed" else event
        outcome.error = "stream_error"
        outcome.detail = str((error or {}).get("message", error) if isinstance(error, dict) else error)[:200]
        return False
    return True


def _messages_event(outcome: Outcome, event: dict[str, Any], t_ns: int, stream: _Stream) -> bool:
    """One event of an Anthropic Messages stream (see apis.py); False at its end or on an error."""
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") if isinstance(event.get("delta"), dict) else {}
        text = delta.get("text") or delta.get("partial_json") or delta.get("thinking")
        _take_delta(outcome, text, t_ns, delta.get("type") == "thinking_delta", stream)
    elif kind in ("message_start", "message_delta"):
        message = event.get("message") if kind == "message_start" else event
        usage = message.get("usage") if isinstance(message, dict) else None
        fault = _usage_fault(usage, ("input_tokens", "output_tokens", "cache_read_input_tokens",
                                     "cache_creation_input_tokens"))
        if fault:
            outcome.error, outcome.detail = "malformed_sse", fault
            return False
        if usage and usage.get("input_tokens") is not None:  # in message_start, and in vLLM's message_delta too
            outcome.prompt_tokens = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                                                    "cache_creation_input_tokens"))
            outcome.cached_tokens = usage.get("cache_read_input_tokens", outcome.cached_tokens)
        if usage and kind == "message_delta" and usage.get("output_tokens") is not None:  # the final count
            outcome.usage_reported = True
            stream.cumulative = usage["output_tokens"]
        delta = event.get("delta") if kind == "message_delta" and isinstance(event.get("delta"), dict) else {}
        outcome.finish_reason = delta.get("stop_reason") or outcome.finish_reason
    elif kind == "message_stop":
        outcome.done_ns = t_ns
        return False
    return True


def _take_delta(outcome: Outcome, text: Any, t_ns: int, reasoning: bool, stream: _Stream) -> None:
    """A text delta of a stream that carries no usage per event: one chunk, counted as one token
    (the final usage gives the total)."""
    if not isinstance(text, str) or not text:
        return
    outcome.token_times.append(t_ns)
    outcome.chunk_tokens.append(1)
    stream.thinking = mark_reasoning(outcome, text, reasoning, stream.thinking)
    if not reasoning:
        outcome.text += text


def _usage_fault(usage: Any, counts: Sequence[str], details: str = "") -> str:
    """Why a usage object does not fit its format ('' when it does, or there is none)."""
    if usage is None:
        return ""
    if not isinstance(usage, dict):
        return f"usage is {type(usage).__name__}, not an object"
    inner = usage.get(details) if details else None
    if inner is not None and not isinstance(inner, dict):
        return f"usage.{details} is not an object"
    for name, value in [*((k, usage.get(k)) for k in counts), ("cached_tokens", (inner or {}).get("cached_tokens"))]:
        if not _count(value):
            return f"usage.{name} is {value!r}, not a whole number"
    return ""


def _answer(outcome: Outcome, response: Response) -> Outcome:
    """A pooling API's one answer (embeddings, score): its items and usage; its time is when its
    last byte arrived (settle put it in done_ns)."""
    try:
        answer = fileio.parse_json(response.body)
        if not isinstance(answer, dict):
            raise ValueError("not an object")
    except ValueError:
        outcome.error, outcome.detail = "malformed_answer", f"bad JSON answer: {response.body[:80]!r}"
        return outcome
    if answer.get("error") is not None:
        error = answer["error"]
        outcome.error = "stream_error"
        outcome.detail = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
        return outcome
    items = answer.get("data")
    fault = _usage_fault(answer.get("usage"), ("prompt_tokens",))
    if not isinstance(items, list):
        fault = fault or "the answer has no \"data\" list"
    if fault:
        outcome.error, outcome.detail = "malformed_answer", fault
        return outcome
    if not items:
        outcome.error, outcome.detail = "empty_output", "the answer carried no embedding or score"
        return outcome
    outcome.items = len(items)
    usage = answer.get("usage") or {}
    outcome.prompt_tokens = usage.get("prompt_tokens")
    outcome.usage_reported = outcome.prompt_tokens is not None
    outcome.token_times = [outcome.done_ns]
    return outcome


def _opened(outcome: Outcome, response: Response, streamed: bool) -> bool:
    """Whether the response is what the API answers (an event stream when `streamed`, else a
    complete JSON answer); if not, the outcome's error says why."""
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
    content_type = response.headers.get("content-type", "")
    if streamed and not content_type.startswith("text/event-stream"):
        outcome.error = "malformed_sse"
        outcome.detail = f"content-type {content_type!r}, not an event stream"
        return False
    if not streamed and not response.complete:
        outcome.error = "stream_cut"
        outcome.detail = f"the answer ended after {len(response.body)} bytes, incomplete"
        return False
    if not streamed and not content_type.startswith("application/json"):
        outcome.error = "malformed_answer"
        outcome.detail = f"content-type {content_type!r}, not JSON"
        return False
    return True


def _chunk(outcome: Outcome, data: bytes) -> dict[str, Any] | None:
    """One SSE data line as a JSON object; None, with the outcome's error set, when it is not
    JSON or carries an error."""
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


def settle(outcome: Outcome, api: str) -> Outcome:
    """Parse and interpret the bytes a request of `api` received (after the run)."""
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
    if outcome.timed_out and not (response.complete and (response.events or not APIS[api].generates)):
        outcome.status = response.status
        outcome.error, outcome.detail = "timeout", "nothing received for --timeout seconds"
        return outcome
    outcome.done_ns = None if APIS[api].generates else reads[-1][0]  # a pooling answer: its last byte
    return interpret(outcome, response, api)
