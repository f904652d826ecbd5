"""The load generator behind `task bench` and `task sweep`: workloads and prompts of exact length,
a raw-socket streaming HTTP/1.1 client that timestamps bytes as they arrive, closed and open loops
and trace replay, the client's own lag and stalls, the analysis (TTFT, TPOT, ITL, e2e, SLO
verdict), and the server's view through engine_metrics.py and server_watch.py. bench.py and
sweep.py are its command lines; the flags and settings they share are here too.
"""
from __future__ import annotations

import asyncio
import bisect
import datetime
import errno
import gc
import hashlib
import json
import multiprocessing
import random
import re
import resource
import signal
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import server_watch  # noqa: E402
import workload as workload_mod  # noqa: E402
from common import ServerError, UsageError  # noqa: E402
from stats import summarize  # noqa: E402

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # reasoning markers in plain text (DeepSeek-R1, Qwen3)

SCHEMA_VERSION = 1


TEMPLATE = Path(__file__).resolve().parent / "templates" / "bench_log_entry.md.j2"


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


ERROR_KINDS = ("unreachable", "wrong_model", "http_4xx", "http_5xx", "stream_cut",
               "malformed_sse", "stream_error", "timeout", "empty_output", "client_fd_limit")


LIMITS = {"num_requests": 1_000_000, "concurrency": 100_000, "input_tokens": 10_000_000,
          "output_tokens": 1_000_000}


# The event-loop lag that may distort a figure: above both this floor and LAG_SHARE of the
# smallest median measured (TTFT, TPOT), the run is invalid.
LAG_FLOOR_MS = 1.0


LAG_SHARE = 0.10


LAG_PROBE_S = 0.005


# Client stalls (lag above the threshold) may cover at most this share of the run. On a busy
# 2-core machine, task bench:calibrate runs with 3% and 7% of their time in stalls stayed within
# 0.3% of the truth at p50 and p95 (the server stalled with the client: nothing was waiting),
# one with 34% had TTFT p50 21% off. Above STALL_WARN the run says how much it stalled.
STALL_SHARE = 0.10


STALL_WARN = 0.01


EPOLL_ROUNDING_MS = 1.0


DEFINITIONS = {
    "ttft_ms": "request sent -> first chunk with content (role-only chunks excluded) = vLLM TTFT",
    "tpot_ms": "(e2e - ttft)/(output_tokens - 1) per request = vLLM/SGLang TPOT = AIPerf ITL = GuideLLM ITL",
    "itl_ms": "per-chunk gaps between content chunks, pooled = vLLM ITL = AIPerf ICL",
    "itl_token_ms": "each chunk gap divided over the tokens the chunk carried (server usage deltas)",
    "e2e_ms": "request sent -> last content chunk",
    "percentiles": "linear interpolation (numpy default), n = samples",
}


# Words for prompt text: common, plain, mostly one token each in BPE vocabularies.
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money story "
         "fact month lot right study book eye job word business issue side kind head house "
         "service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office "
         "door health person art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()


@dataclass
class Response:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    complete: bool = False
    events: list[tuple[int, bytes]] = field(default_factory=list)  # (arrival ns, data payload)
    body: bytes = b""


def content_length(headers: dict[str, str]) -> int | None:
    """The Content-Length header as a size, or None; a value that is not digits is a ValueError."""
    length = headers.get("content-length")
    if length is None:
        return None
    if not length.isascii() or not length.isdigit():
        raise ValueError(f"bad Content-Length {length[:40]!r}")
    return int(length)


def _parse_head(data: bytes) -> tuple[int, dict[str, str], int] | None:
    """(status, lower-cased headers, body offset), or None while the head is incomplete."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP response: {lines[0][:60]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers, end + 4


_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions; longer is not chunked coding


MAX_HEAD = 65536  # response head bytes; a head that does not end by then is not HTTP


def chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (extensions after `;` ignored). Only hex digits: a sign,
    a blank or garbage is a ValueError, so a negative size can never move the parser backwards."""
    digits = line.split(b";", 1)[0].strip()
    if not _CHUNK_SIZE.fullmatch(digits):
        raise ValueError(f"bad chunk-size line {line[:40]!r}")
    return int(digits, 16)


def dechunk(raw: bytes) -> tuple[list[tuple[int, int, int]], bool]:
    """Chunked transfer coding: [(decoded offset, raw offset, size)] segments and completeness.
    Every step moves forward past a validated size line; ValueError if it is not chunked coding."""
    segments, pos, decoded = [], 0, 0
    while True:
        line_end = raw.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
        if line_end < 0:
            if len(raw) - pos > MAX_CHUNK_LINE:
                raise ValueError("chunk-size line too long")
            return segments, False
        size = chunk_size(raw[pos:line_end])
        if size == 0:
            return segments, True
        start = line_end + 2
        if start + size + 2 > len(raw):
            segments.append((decoded, start, max(0, len(raw) - start)))
            return segments, False
        segments.append((decoded, start, size))
        decoded += size
        pos = start + size + 2


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def parse_response(reads: Sequence[tuple[int, bytes]]) -> Response:
    """Rebuild the HTTP response from timestamped socket reads.

    Each SSE event gets the arrival time of the read that carried its last byte: the moment
    the event was complete on the client.
    """
    raw_all = b"".join(data for _, data in reads)
    head = _parse_head(raw_all)
    if head is None:
        return Response()
    status, headers, body_at = head
    read_ends, total = [], 0
    for _, data in reads:
        total += len(data)
        read_ends.append(total)
    raw = raw_all[body_at:]
    if "chunked" in headers.get("transfer-encoding", "").lower():
        segments, complete = dechunk(raw)
        body = b"".join(raw[start:start + size] for _, start, size in segments)
    else:
        length = content_length(headers)
        complete = length is not None and len(raw) >= length
        body = raw[:length] if length is not None else raw
        segments = [(0, 0, len(body))]
    seg_starts = [seg[0] for seg in segments]

    def arrival(decoded_offset: int) -> int:
        seg = segments[bisect.bisect_right(seg_starts, decoded_offset) - 1]
        raw_offset = body_at + seg[1] + (decoded_offset - seg[0])
        return reads[min(bisect.bisect_right(read_ends, raw_offset), len(reads) - 1)][0]

    response = Response(status, headers, complete, body=body)
    if not headers.get("content-type", "").startswith("text/event-stream"):
        return response
    start = 0
    for match in _EVENT_END.finditer(body):
        _append_event(response.events, body[start:match.start()], arrival(match.end() - 1))
        start = match.end()
    if start < len(body) and body[start:].strip():
        _append_event(response.events, body[start:], arrival(len(body) - 1))
    return response


def _append_event(events: list[tuple[int, bytes]], block: bytes, t_ns: int) -> None:
    """SSE event block -> its data payload: `data:` lines joined; comments and pings skipped."""
    data = [line[5:].removeprefix(b" ") for line in block.splitlines() if line.startswith(b"data:")]
    if data:
        events.append((t_ns, b"\n".join(data)))


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
               round((self.sent_ns - self.scheduled_ns) / 1e6, 3)}
        if self.token_times:
            rec.update(ttft_ms=round(self.ttft_ms, 3), e2e_ms=round(self.e2e_ms, 3),
                       tpot_ms=None if self.tpot_ms is None else round(self.tpot_ms, 4),
                       chunk_ms=[round((t - self.sent_ns) / 1e6, 3) for t in self.token_times],
                       chunk_tokens=self.chunk_tokens)
            if self.reasoning_seen:
                rec.update(reasoning_tokens=self.reasoning_tokens, answer_tokens=self.answer_tokens,
                           ttft_answer_ms=None if self.ttft_answer_ms is None else round(self.ttft_answer_ms, 3))
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
    if response.status is None:
        outcome.error = outcome.error or "stream_cut"
        outcome.detail = outcome.detail or "connection closed before an HTTP response"
        return outcome
    if response.status >= 400:
        text = response.body[:300].decode("utf-8", "replace").strip()
        wrong_model = response.status == 404 and "model" in text.lower()
        outcome.error = "wrong_model" if wrong_model else f"http_{response.status // 100}xx"
        outcome.detail = f"HTTP {response.status}: {text[:200]}"
        return outcome
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        outcome.error = "malformed_sse"
        outcome.detail = f"content-type {response.headers.get('content-type')!r}, not an event stream"
        return outcome
    cumulative, thinking = 0, False
    for t_ns, data in response.events:
        if data.strip() == b"[DONE]":
            outcome.done_ns = t_ns
            break
        try:
            chunk = common.parse_json(data)
            if not isinstance(chunk, dict):
                raise ValueError("not an object")
        except ValueError:
            outcome.error, outcome.detail = "malformed_sse", f"bad SSE data: {data[:80]!r}"
            return outcome
        if "error" in chunk:
            error = chunk["error"]
            outcome.error = "stream_error"
            outcome.detail = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
            return outcome
        fault = odd_chunk(chunk)
        if fault:
            outcome.error, outcome.detail = "malformed_sse", fault
            return outcome
        usage = chunk.get("usage")
        new_tokens = None
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            outcome.usage_reported = True
            new_tokens = usage["completion_tokens"] - cumulative
            cumulative = usage["completion_tokens"]
            outcome.prompt_tokens = usage.get("prompt_tokens", outcome.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            outcome.cached_tokens = details.get("cached_tokens", outcome.cached_tokens)
        for choice in chunk.get("choices") or []:
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
    outcome.completion_tokens = cumulative if outcome.usage_reported else len(outcome.token_times)
    if outcome.done_ns is None:
        outcome.error = "stream_cut"
        outcome.detail = f"stream ended without [DONE] after {len(outcome.token_times)} content chunks"
    elif not outcome.token_times:
        outcome.error, outcome.detail = "empty_output", "the stream carried no content"
    return outcome


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


class ChunkFraming:
    """Follows chunked transfer coding as body bytes arrive, to notice the end of a response.

    Only the chunk-size lines are read, each once: a read costs an addition and a comparison,
    plus one short parse per chunk that starts in it. (Walking the whole body again at its end
    cost ~0.08 ms per response: 256 streams ending together stalled the loop for ~20 ms, and
    the first tokens of other streams waiting behind it were timestamped that much late.)"""

    def __init__(self) -> None:
        self.received = 0   # body bytes so far
        self.next_line = 0  # body offset of the next chunk-size line
        self.pending = b""  # bytes from next_line on, while that line is incomplete

    def feed(self, data: bytes) -> bool:
        """True once the last chunk and its trailer section have arrived; ValueError if the
        bytes are not chunked coding."""
        start = self.received
        self.received += len(data)
        if self.received <= self.next_line:
            return False
        buf = self.pending + data if self.pending else data[self.next_line - start:]
        base, pos, self.pending = self.next_line, 0, b""
        while pos < len(buf):
            line_end = buf.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
            if line_end < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise ValueError("chunk-size line too long")
                break
            size = chunk_size(buf[pos:line_end])
            if size == 0:  # the last chunk: complete after the (usually empty) trailer section
                rest = buf[line_end + 2:]
                if rest.startswith(b"\r\n") or b"\r\n\r\n" in rest:
                    return True
                break
            pos = line_end + 2 + size + 2
        if pos < len(buf):
            self.pending = buf[pos:]
        self.next_line = base + pos
        return False


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. data_received only timestamps and stores the bytes,
    and notices the end of the response (chunked terminator or Content-Length)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reads: list[tuple[int, bytes]] = []
        self.waiter: asyncio.Future | None = None
        self.lost = False
        self.reusable = False
        self.timed_out = False
        self.last_read_ns = self.began_ns = 0
        self._head: tuple[int, dict[str, str], int] | None = None
        self._chunked = False
        self._keep_alive = False
        self._received = 0
        self._framing = ChunkFraming()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def begin(self) -> asyncio.Future:
        self.reads, self._head, self._received, self._framing = [], None, 0, ChunkFraming()
        self._chunked = self._keep_alive = False
        self.timed_out = False
        self.last_read_ns = self.began_ns = time.perf_counter_ns()
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        self.reads.append((now, data))
        self.last_read_ns = now
        if self._chunked:  # the hot path: no more than a chunk-size line parsed per read
            self._feed_chunked(data)
        else:
            self._other_read(data)

    def _other_read(self, data: bytes) -> None:
        """Reads before the head is complete, and bodies with a Content-Length."""
        self._received += len(data)
        if self._head is None:
            if self._received > MAX_HEAD:  # joining the reads again per read would grow quadratically
                self._finish(reusable=False)
                return
            try:
                self._head = _parse_head(b"".join(d for _, d in self.reads))
            except ValueError:
                self._finish(reusable=False)
                return
            if self._head is None:
                return
            headers = self._head[1]
            self._keep_alive = headers.get("connection", "").lower() != "close"
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._chunked = True
                self._feed_chunked(b"".join(d for _, d in self.reads)[self._head[2]:])
                return
        try:
            length = content_length(self._head[1])
        except ValueError:
            self._finish(reusable=False)
            return
        if length is not None and self._received - self._head[2] >= length:
            self._finish(self._keep_alive)

    def _feed_chunked(self, data: bytes) -> None:
        try:
            complete = self._framing.feed(data)
        except ValueError:  # not chunked coding: the parse after the run says what it was
            self._finish(reusable=False)
            return
        if complete:
            self._finish(self._keep_alive)

    def _finish(self, reusable: bool) -> None:
        self.reusable = reusable
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._finish(reusable=False)


@dataclass
class Target:
    """The server a run loads, resolved once and carried through bench and sweep: the URL (the
    Host header and the socket address both come from it), the API key, the served model and
    what the server says about itself."""
    base_url: str
    api_key: str | None
    model: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # /v1/models entry, version

    @property
    def host_header(self) -> str:
        return urlsplit(self.base_url).netloc


def request_bytes(target: Target, path: str, payload: dict[str, Any], request_id: str) -> bytes:
    """A complete HTTP/1.1 POST of `payload` to `path` on the target."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    auth = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else ""
    head = (f"POST {urlsplit(target.base_url).path.rstrip('/')}{path} HTTP/1.1\r\nHost: {target.host_header}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{auth}"
            f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class Client:
    """Keep-alive connections to the target's address."""

    def __init__(self, target: Target, timeout_s: float):
        parts = urlsplit(target.base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.timeout_ns = int(timeout_s * 1e9)
        self.idle: list[Connection] = []
        self.busy: set[Connection] = set()

    async def _connection(self, reuse: bool = True) -> tuple[Connection, float | None]:
        """An idle keep-alive connection (connect time None) or a new one."""
        while reuse and self.idle:
            conn = self.idle.pop()
            if not conn.lost:
                return conn, None
        start = time.perf_counter_ns()
        _, conn = await asyncio.get_running_loop().create_connection(
            Connection, self.host, self.port, ssl=self.ssl)
        return conn, (time.perf_counter_ns() - start) / 1e6

    async def send(self, outcome: Outcome, request: bytes, reuse: bool = True) -> Outcome:
        try:
            conn, connect_ms = await self._connection(reuse)
        except OSError as exc:
            outcome.sent_ns = time.perf_counter_ns()
            # Out of file descriptors is the client's own limit, not the server's fault.
            own_limit = exc.errno in (errno.EMFILE, errno.ENFILE)
            outcome.error = "client_fd_limit" if own_limit else "unreachable"
            outcome.detail = f"{type(exc).__name__}: {exc}"
            return outcome
        outcome.connect_ms = connect_ms or 0.0
        waiter = conn.begin()
        self.busy.add(conn)
        try:
            outcome.sent_ns = time.perf_counter_ns()
            conn.transport.write(request)
            await waiter  # the bytes are parsed after the run: parsing here would delay others
        finally:
            self.busy.discard(conn)
            if conn.reusable and not conn.lost:
                self.idle.append(conn)
            elif conn.transport is not None:
                conn.transport.close()
        if connect_ms is None and conn.lost and not conn.reads and not conn.timed_out:
            # The server closed the idle connection as we reused it (keep-alive timeout):
            # nothing was processed, so send again on a new connection.
            return await self.send(outcome, request, reuse=False)
        outcome.reads, outcome.timed_out = conn.reads, conn.timed_out
        return outcome

    def expire_stalled(self) -> None:
        """Close connections that received nothing for the timeout, or no complete response
        head within it (a slow drip of header bytes), called by a watchdog."""
        now = time.perf_counter_ns()
        for conn in list(self.busy):
            if now - conn.last_read_ns > self.timeout_ns or (
                    conn._head is None and now - conn.began_ns > self.timeout_ns):
                conn.timed_out = True
                conn.transport.close()

    def close(self) -> None:
        for conn in self.idle + list(self.busy):
            if conn.transport is not None:
                conn.transport.close()


@dataclass
class RequestSource:
    """The run's requests as HTTP bytes, each made from the workload when it is about to be
    sent: a run of 100,000 requests starts at once and holds one request's bytes per stream."""
    workload: workload_mod.Workload
    target: Target
    path: str
    template: dict[str, Any]  # the body without prompt/messages/max_tokens
    extra: dict[str, Any]     # --extra-body, merged last
    run_id: str
    indices: list[int] | None = None  # a worker's share of the workload

    def __len__(self) -> int:
        return self.workload.count if self.indices is None else len(self.indices)

    def get(self, i: int) -> tuple[bytes, workload_mod.Spec]:
        index = i if self.indices is None else self.indices[i]
        spec = self.workload.spec(index)
        body = dict(self.template, max_tokens=spec.output_tokens)
        if spec.messages is not None and self.path == ENDPOINTS["chat"]:
            body["messages"] = spec.messages
        elif spec.messages is not None:  # a conversation sent to /v1/completions: its text
            body["prompt"] = "\n\n".join(m["content"] for m in spec.messages)
        elif self.path == ENDPOINTS["chat"]:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return request_bytes(self.target, self.path, {**body, **self.extra}, f"bench-{self.run_id}-{index}"), spec

    def subset(self, indices: list[int]) -> "RequestSource":
        mine = indices if self.indices is None else [self.indices[i] for i in indices]
        return RequestSource(self.workload, self.target, self.path, self.template, self.extra, self.run_id, mine)


@dataclass
class Plan:
    """What to send: the first `warmup` requests are warm-up requests, sent at the same
    concurrency and not counted. `offsets_s` (a trace) are intended send times, per request."""
    requests: RequestSource
    warmup: int
    concurrency: int | None
    chat: bool
    rate: float | None = None
    burstiness: float = 1.0
    duration_s: float | None = None
    seed: int = 0
    # Multi-turn chat: the user message of every turn of conversation i (requests[i] is its
    # first turn); later turns carry the history, with the answers the server gave.
    turns: list[list[str]] | None = None
    offsets_s: list[float] | None = None

    def part(self, indices: list[int], concurrency: int | None, rate: float | None, seed: int) -> "Plan":
        """The share of a worker process: the requests (conversations) `indices`."""
        return Plan(self.requests.subset(indices), sum(i < self.warmup for i in indices), concurrency,
                    self.chat, rate, self.burstiness, self.duration_s, seed,
                    None if self.turns is None else [self.turns[i] for i in indices],
                    None if self.offsets_s is None else [self.offsets_s[i] for i in indices])


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Absolute send offsets (s) of an open-loop run: gamma gaps (burstiness 1 = Poisson),
    rescaled so the last request goes out at count/rate exactly (as vLLM does)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(t)
    scale = (count / rate) / offsets[-1] if offsets and offsets[-1] > 0 else 1.0
    return [o * scale for o in offsets]


@dataclass
class RunResult:
    outcomes: list[Outcome]
    loop_lag_ms: list[float]
    cpu_s: float
    wall_s: float
    interrupted: bool = False


async def lag_probe(samples: list[float], stop: asyncio.Event) -> None:
    """How late a timer fires: the time the loop was busy or the process was not scheduled,
    i.e. how long an arriving byte could wait before data_received timestamps it. asyncio
    rounds epoll timeouts up to whole milliseconds, so 1 ms of oversleep is not counted."""
    target = int(LAG_PROBE_S * 1e9)
    while not stop.is_set():
        start = time.perf_counter_ns()
        await asyncio.sleep(LAG_PROBE_S)
        samples.append(max(0.0, (time.perf_counter_ns() - start - target) / 1e6 - EPOLL_ROUNDING_MS))


async def _watchdog(client: Client, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.25)
        client.expire_stalled()


async def run_plan(plan: Plan, timeout_s: float,
                   before_measured: Callable[[], Any] | None = None, on_done: Callable[[Outcome], None] | None = None,
                   interrupt: asyncio.Event | None = None) -> RunResult:
    """Send the plan; returns every outcome (warm-up ones flagged). Ctrl-C (interrupt) stops
    sending and returns what completed."""
    client = Client(plan.requests.target, timeout_s)
    stop = asyncio.Event()
    interrupt = interrupt or asyncio.Event()
    lag: list[float] = []
    outcomes: list[Outcome] = []
    # A full garbage collection over a heap of stored reads takes tens of ms and stalls every
    # stream; refcounting frees what the run drops, so the collector waits until the end.
    gc.collect()
    gc.freeze()
    gc.disable()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    background = [asyncio.create_task(lag_probe(lag, stop)), asyncio.create_task(_watchdog(client, stop))]

    async def one(index: int, scheduled_ns: int | None = None) -> None:
        if plan.turns is not None:
            return await conversation(index, scheduled_ns)
        request, spec = plan.requests.get(index)
        outcome = Outcome(index=index, warmup=index < plan.warmup, scheduled_ns=scheduled_ns,
                          requested_tokens=spec.output_tokens, prompt_target=spec.prompt_tokens)
        await client.send(outcome, request)
        outcomes.append(outcome)
        if on_done:
            on_done(outcome)

    async def conversation(index: int, scheduled_ns: int | None) -> None:
        """The turns of one conversation, one after the other. Each answer is parsed at once
        (it is part of the next prompt): a little loop time that single-turn runs do not spend."""
        messages: list[dict[str, str]] = []
        source = plan.requests
        first, spec = source.get(index)
        for turn, text in enumerate(plan.turns[index]):
            messages.append({"role": "user", "content": text})
            request = first if turn == 0 else request_bytes(
                source.target, source.path, {**source.template, "max_tokens": spec.output_tokens,
                                             "messages": messages, **source.extra},
                f"bench-{source.run_id}-{index}-{turn}")
            outcome = Outcome(index=index, turn=turn, warmup=index < plan.warmup,
                              scheduled_ns=scheduled_ns if turn == 0 else None,
                              requested_tokens=spec.output_tokens)
            settle(await client.send(outcome, request), True)
            outcomes.append(outcome)
            if on_done:
                on_done(outcome)
            if not outcome.ok or interrupt.is_set():
                return
            messages.append({"role": "assistant", "content": outcome.text})

    async def closed_loop(indices: list[int], deadline_ns: int | None) -> None:
        queue = iter(indices)

        async def slot() -> None:
            for index in queue:
                if interrupt.is_set() or (deadline_ns and time.perf_counter_ns() >= deadline_ns):
                    return
                await one(index)
        await asyncio.gather(*(slot() for _ in range(min(plan.concurrency or 1, len(indices)) or 1)))

    async def open_loop(indices: list[int]) -> None:
        limit = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
        if plan.offsets_s is not None:  # a trace: its own times (the first measured one at 0)
            offsets = [plan.offsets_s[i] for i in indices]
        else:
            offsets = arrival_offsets(len(indices), plan.rate, plan.burstiness, plan.seed)
        start = time.perf_counter_ns()
        deadline = start + int(plan.duration_s * 1e9) if plan.duration_s else None
        tasks = []

        async def capped(index: int, scheduled: int) -> None:
            if limit is None:
                return await one(index, scheduled)
            async with limit:
                await one(index, scheduled)
        for index, offset in zip(indices, offsets):
            scheduled = start + int(offset * 1e9)
            if deadline and scheduled >= deadline:
                break
            delay = (scheduled - time.perf_counter_ns()) / 1e9
            if delay > 0:
                try:
                    await asyncio.wait_for(interrupt.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if interrupt.is_set():
                break
            tasks.append(asyncio.create_task(capped(index, scheduled)))
        await asyncio.gather(*tasks)

    work = asyncio.create_task(_run_phases(plan, closed_loop, open_loop, before_measured))
    waiter = asyncio.create_task(interrupt.wait())
    try:
        await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if interrupt.is_set() and not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        elif work.done():
            work.result()
    finally:
        waiter.cancel()
        stop.set()
        for task in background:
            task.cancel()  # not waiting out the watchdog's and the lag probe's sleeps
        await asyncio.gather(*background, waiter, return_exceptions=True)
        client.close()
        gc.enable()
        gc.unfreeze()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return RunResult(sorted((settle(o, plan.chat) for o in outcomes), key=lambda o: (o.index, o.turn)),
                     lag, cpu_s, wall_s, interrupted=interrupt.is_set())


async def _run_phases(plan: Plan, closed_loop, open_loop, before_measured) -> None:
    indices = list(range(len(plan.requests)))
    warm, measured = indices[:plan.warmup], indices[plan.warmup:]
    if warm:
        await closed_loop(warm, None)
    if before_measured and not await before_measured():  # workers start measuring together
        return
    if plan.rate or plan.offsets_s is not None:
        await open_loop(measured)
    else:
        deadline = time.perf_counter_ns() + int(plan.duration_s * 1e9) if plan.duration_s else None
        await closed_loop(measured, deadline)


def raise_open_file_limit(needed: int) -> None:
    """One socket per stream: lift the soft limit on open files towards the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted, hard))


def run_in_loop(plan: Plan, timeout_s: float, quiet: bool = False,
                before_measured: Callable[[], Any] | None = None,
                hold: common.SignalHold | None = None) -> RunResult:
    """asyncio.run with Ctrl-C turned into 'stop and keep what was measured'. From the end of the
    run a further Ctrl-C or SIGTERM waits in `hold` (the caller completes and writes the result)."""
    raise_open_file_limit(plan.concurrency or len(plan.requests))

    async def body() -> RunResult:
        interrupt = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, interrupt.set)
            loop.add_signal_handler(signal.SIGTERM, interrupt.set)
        except (NotImplementedError, RuntimeError):
            pass
        # A worker starts with them blocked: one that came while it started up stops it now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, common.STOP_SIGNALS)
        try:
            return await run_plan(plan, timeout_s, before_measured,
                                  None if quiet else _progress_printer(plan), interrupt)
        finally:  # asyncio resets the handlers to the defaults (die) as it closes the loop:
            # from here a signal waits until the caller's handlers are back
            signal.pthread_sigmask(signal.SIG_BLOCK, common.STOP_SIGNALS)
    handlers = {sig: signal.getsignal(sig) for sig in common.STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the caller's (a worker's blocks them)
    run = None
    try:
        run = asyncio.run(body())
    finally:
        interrupted = _handlers_back(handlers, hold, run is not None and run.interrupted)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    run.interrupted = interrupted
    return run


def _handlers_back(handlers: dict[int, Any], hold: common.SignalHold | None, interrupted: bool) -> bool:
    """Put the caller's signal handlers back, with the signals blocked, and start `hold`: from the
    end of the run a Ctrl-C or SIGTERM is noted, not obeyed, so it cannot lose what was measured.
    Whether the run was interrupted (a signal waiting came as it ended)."""
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if hold is not None:
        hold.start()
    return interrupted or bool(set(signal.sigpending()) & set(common.STOP_SIGNALS))


def _progress_printer(plan: Plan) -> Callable[[Outcome], None]:
    total = len(plan.requests) * (len(plan.turns[0]) if plan.turns else 1)
    state = {"done": 0, "last": 0.0}

    def report(outcome: Outcome) -> None:
        state["done"] += 1
        now = time.monotonic()
        if now - state["last"] >= 2.0 or state["done"] == total:
            state["last"] = now
            common.progress(f"bench: {state['done']}/{total} requests done")
    return report


def _worker(number: int, plan: Plan, timeout_s: float, barrier, queue) -> None:
    # Ctrl-C and SIGTERM are blocked since run_workers started us: run_in_loop unblocks them once
    # its loop handles them, so one that came while we started up stops the run at once (we send
    # what we measured, maybe nothing) instead of killing us or printing a traceback. After the
    # run they stay blocked: the result is sent whatever comes. The parent passes Ctrl-C on as SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def meet() -> bool:
        try:
            await asyncio.to_thread(barrier.wait)
            return True
        except threading.BrokenBarrierError:  # the parent was interrupted during warm-up
            return False
    queue.put((number, run_in_loop(plan, timeout_s, quiet=True, before_measured=meet)))


def run_workers(plan: Plan, workers: int, timeout_s: float, hold: common.SignalHold | None = None) -> RunResult:
    """Split the plan over worker processes (round robin). They finish their warm-up, meet at
    a barrier and start the measured phase together; they share CLOCK_MONOTONIC, so their
    timestamps merge directly. A Ctrl-C or SIGTERM stops them and keeps what they measured;
    from the end of the run a further one waits in `hold`."""
    # A Ctrl-C or SIGTERM is noted and acted on between steps, not raised in the middle of
    # multiprocessing (a worker left unstarted or unstopped, a semaphore leaked).
    stops: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum)) for sig in common.STOP_SIGNALS}
    try:
        shares, results = _share_out(plan, workers, timeout_s, stops)
    finally:
        with common.signals_blocked(*common.STOP_SIGNALS):
            interrupted = _handlers_back(handlers, hold, bool(stops))
    outcomes, lag = [], []
    for number, result in results.items():
        for outcome in result.outcomes:
            outcome.index = shares[number][outcome.index]
            outcomes.append(outcome)
        lag += result.loop_lag_ms
    return RunResult(sorted(outcomes, key=lambda o: (o.index, o.turn)), lag,
                     max((r.cpu_s for r in results.values()), default=0.0),
                     max((r.wall_s for r in results.values()), default=0.0),
                     interrupted or any(r.interrupted for r in results.values()))


def _share_out(plan: Plan, workers: int, timeout_s: float,
               stops: list[int]) -> tuple[list[list[int]], dict[int, RunResult]]:
    """Run the workers: each one's share of the request indices, and the results they sent.
    Once `stops` has a signal, they stop and send what they measured."""
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(workers), context.Queue()
    shares, processes = [], []
    for number in range(workers):
        mine = list(range(number, len(plan.requests), workers))
        concurrency = None if plan.concurrency is None else \
            max(1, plan.concurrency // workers + (number < plan.concurrency % workers))
        sub = plan.part(mine, concurrency, None if plan.rate is None else plan.rate / workers, plan.seed + number)
        shares.append(mine)
        processes.append(context.Process(target=_worker, daemon=True,
                                         args=(number, sub, timeout_s, barrier, queue)))
    with common.signals_blocked(*common.STOP_SIGNALS):  # the workers inherit the mask (see _worker)
        for process in processes:
            process.start()
    results: dict[int, RunResult] = {}
    stopping = False
    while len(results) < workers:
        if stops and not stopping:
            stopping = True
            barrier.abort()
            for process in processes:
                if process.is_alive():
                    process.terminate()  # SIGTERM: the worker stops and sends what it measured
        try:
            number, result = queue.get(timeout=0.1)
            results[number] = result
        except Empty:
            gone = [p for n, p in enumerate(processes) if n not in results and not p.is_alive()]
            if gone and queue.empty():
                if not stops:
                    raise ServerError(f"a client worker process exited with status {gone[0].exitcode} "
                                      "without results; run with --workers 1 to see why")
                if len(gone) == workers - len(results):  # interrupted: keep what the others sent
                    break
    for process in processes:
        process.join()
    return shares, results


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
            answer = common.get_json(http, "/tokenize", json=body)
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
    """The request body: greedy, exact length (ignore_eos), streamed with usage in every chunk."""
    body: dict[str, Any] = {"model": model, "max_tokens": output_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return {**body, **extra}


def stalls(lag_ms: Sequence[float], threshold: float, wall_s: float) -> dict[str, Any]:
    """The client's stalls: lag samples above the threshold, their total and share of the run.
    The probe takes a sample every 5 ms when the loop is free but one per stall, so a count
    of samples (a p95) hides long stalls: their time does not."""
    long = [x for x in lag_ms if x > threshold]
    total_s = sum(long) / 1e3
    return {"count": len(long), "total_s": total_s, "worst_ms": max(long, default=0.0),
            "share": total_s / wall_s if wall_s else 0.0}


def client_validity(lag: dict[str, Any], ttft: dict[str, Any], tpot: dict[str, Any],
                    schedule_delay: dict[str, Any], cpu_util: float,
                    lag_ms: Sequence[float] = (), wall_s: float = 0.0) -> tuple[bool, float, list[str]]:
    """Is the client's own delay small against what it measured? (valid, threshold ms, reasons)

    The verdict stands on p95 figures, so the lag's p95 decides, and so does the share of the
    run the client spent stalled; a p99 above the threshold only earns a warning (see analyse)."""
    medians = [s["p50"] for s in (ttft, tpot) if s["p50"]]
    threshold = max(LAG_FLOOR_MS, LAG_SHARE * min(medians)) if medians else LAG_FLOOR_MS
    reasons = []
    stalled = stalls(lag_ms, threshold, wall_s)
    if stalled["share"] > STALL_SHARE:
        reasons.append(f"the client stalled {stalled['total_s']:.1f} s of the {wall_s:.1f} s run "
                       f"({stalled['share']:.0%}, worst {stalled['worst_ms']:.0f} ms): requests in flight "
                       "then were timed late; run the client on a quieter core or with --workers")
    if lag["p95"] is not None and lag["p95"] > threshold:
        cause = (f"the client used {cpu_util:.0%} of a core: use --workers" if cpu_util > 0.5 else
                 f"the client used only {cpu_util:.0%} of a core: other processes kept it waiting; "
                 "run it on a quieter machine or core")
        reasons.append(f"client event-loop lag p95 {lag['p95']:.2f} ms > {threshold:.2f} ms "
                       f"({LAG_SHARE:.0%} of the smallest median measured); {cause}")
    # A timer may fire up to a millisecond late by asyncio's own rounding: sends that late are on time.
    if schedule_delay["p95"] is not None and schedule_delay["p95"] > threshold + EPOLL_ROUNDING_MS:
        reasons.append(f"open-loop sends ran late: schedule delay p95 {schedule_delay['p95']:.2f} ms "
                       f"> {threshold + EPOLL_ROUNDING_MS:.2f} ms: the client could not keep the rate")
    return not reasons, threshold, reasons


def slo_check(ttft_p95: float | None, tpot_p95: float | None, slo_ttft: float | None,
              slo_tpot: float | None) -> dict[str, Any]:
    checks = {}
    for name, target, value in (("ttft_p95_ms", slo_ttft, ttft_p95), ("tpot_p95_ms", slo_tpot, tpot_p95)):
        if target is not None:
            checks[name] = {"target": target, "measured": value,
                            "met": value is not None and value <= target}
    return checks


def analyse(outcomes: Sequence[Outcome], config: dict[str, Any], lag_ms: Sequence[float],
            cpu_s: float, wall_s: float, interrupted: bool = False) -> dict[str, Any]:
    """The run's result document (--json), from per-request outcomes."""
    measured = [o for o in outcomes if not o.warmup]
    done = [o for o in measured if o.ok]
    failed = [o for o in measured if not o.ok]
    errors = {kind: sum(o.error == kind for o in failed) for kind in ERROR_KINDS}
    errors = {k: v for k, v in errors.items() if v}
    ttft = summarize(o.ttft_ms for o in done)
    tpot = summarize(o.tpot_ms for o in done if o.tpot_ms is not None)
    out_tokens = config["output_tokens"]
    short = [o for o in done if (o.completion_tokens or 0) < (o.requested_tokens or out_tokens)]
    requested_total = sum(o.requested_tokens or out_tokens for o in done)
    prompt_lens = [o.prompt_tokens for o in done if o.prompt_tokens is not None]
    duration_s = 0.0
    if done:
        duration_s = (max(o.token_times[-1] for o in done) - min(o.sent_ns for o in done)) / 1e9
    total_out = sum(o.completion_tokens or 0 for o in done)
    total_in = sum(prompt_lens)
    lag = summarize(lag_ms)
    schedule = summarize((o.sent_ns - o.scheduled_ns) / 1e6 for o in measured
                         if o.scheduled_ns is not None and not config.get("concurrency"))
    cpu_util = cpu_s / wall_s if wall_s else 0.0
    # Worker processes each probe their own loop: their stalls add up over workers x wall time.
    probed_s = wall_s * config.get("workers", 1)
    valid, threshold, invalid_reasons = client_validity(lag, ttft, tpot, schedule, cpu_util, lag_ms, probed_s)
    stalled = stalls(lag_ms, threshold, probed_s)
    if errors.get("client_fd_limit"):
        valid = False
        # First: it makes the run invalid whatever else the client did (a busy host may also have
        # stalled it), and no other remedy helps before it.
        invalid_reasons.insert(0, f"the client ran out of file descriptors for {errors['client_fd_limit']} requests: "
                                  "raise the limit (ulimit -n 65536) and run again; the server is not at fault")
    slo = slo_check(ttft["p95"], tpot["p95"], config.get("slo_ttft_p95_ms"), config.get("slo_tpot_p95_ms"))
    good = [o for o in done if all(
        (name != "ttft_p95_ms" or o.ttft_ms <= c["target"]) and
        (name != "tpot_p95_ms" or o.tpot_ms is None or o.tpot_ms <= c["target"]) for name, c in slo.items())]
    warnings = []
    if short:
        warnings.append(f"ignore_eos not honoured: {len(short)} of {len(done)} requests returned fewer "
                        f"tokens than asked (finish_reason: "
                        f"{', '.join(sorted({str(o.finish_reason) for o in short}))}); TPOT holds, throughput is lower")
    uneven = [o for o in done if o.usage_reported and sum(o.chunk_tokens) != o.completion_tokens]
    if uneven:
        warnings.append(f"{len(uneven)} requests had chunks of unknown size (no per-chunk usage, e.g. SGLang "
                        "without continuous_usage_stats): ITL per token counts one token per chunk there")
    if any(not o.usage_reported for o in done):
        warnings.append("the server sent no usage: output tokens counted as content chunks "
                        "(an undercount when a chunk carries several tokens)")
    fixed_length = config.get("workload", "synthetic") == "synthetic" and not config.get("input_dist")
    target_in = config["input_tokens"] if fixed_length else None
    mismatched = [o.prompt_tokens - o.prompt_target for o in done
                  if o.prompt_target is not None and o.prompt_tokens is not None and o.prompt_tokens != o.prompt_target]
    if mismatched and config.get("prompt_tokenizer", "").startswith("server"):
        warnings.append(f"{len(mismatched)} prompts were not the length they were built to by the server's usage "
                        f"(off by {min(mismatched)}..{max(mismatched)} tokens)")
    cached = [o.cached_tokens for o in done if o.cached_tokens]
    if cached and not config.get("shared_prefix") and config.get("workload", "synthetic") == "synthetic":
        warnings.append(f"{len(cached)} requests hit the prefix cache although prompts were unique "
                        f"(up to {max(cached)} cached tokens)")
    if valid and lag["p99"] is not None and lag["p99"] > threshold:
        warnings.append(f"client event-loop lag p99 {lag['p99']:.2f} ms > {threshold:.2f} ms: "
                        "p99 figures may include client delay (p95 ones do not)")
    if valid and (stalled["share"] > STALL_WARN or stalled["worst_ms"] > max(threshold, 0.5 * (ttft["p50"] or 0))):
        warnings.append(f"the client stalled {stalled['total_s']:.2f} s in all ({stalled['share']:.1%} of the run, "
                        f"worst {stalled['worst_ms']:.0f} ms): requests in flight then may carry that delay "
                        f"(the run stays valid below {STALL_SHARE:.0%} of its time in stalls)")
    if valid and schedule["p99"] is not None and schedule["p99"] > threshold + EPOLL_ROUNDING_MS:
        warnings.append(f"open-loop sends ran late: schedule lag p99 {schedule['p99']:.2f} ms: the slowest "
                        "1% of arrivals were bunched (p95 kept to the schedule)")
    one_read = [o for o in done if (o.completion_tokens or 0) > 1 and o.token_times[0] == o.token_times[-1]]
    if one_read:
        warnings.append(f"{len(one_read)} requests received all their output in one read (TPOT 0.0 ms): a proxy "
                        "or the server buffered the stream, or the client stalled; their TPOT is not a decode time")
    if 0 < ttft["n"] < 100:
        warnings.append(f"n = {ttft['n']}: p99 is about the maximum" + (", p95 too" if ttft["n"] < 20 else ""))
    reasons = []
    if failed:
        reasons.append(f"{len(failed)} of {len(measured)} requests failed ({', '.join(f'{k} {v}' for k, v in errors.items())})")
    reasons += [f"{name} {c['measured']:.1f} ms > {c['target']:g} ms" if c["measured"] is not None
                else f"{name}: nothing measured" for name, c in slo.items() if not c["met"]]
    # Failed requests are facts whatever the client's lag; SLO figures are not when it lagged.
    if errors.get("client_fd_limit"):
        verdict = "INVALID"
    elif measured and not done:
        verdict = "ERROR"
    elif failed:
        verdict = "FAIL"
    elif not valid:
        verdict = "INVALID"
    elif reasons:
        verdict = "FAIL"
    else:
        verdict = "PASS" if slo else "NO SLO"
    return {
        "kind": "bench",
        "schema_version": SCHEMA_VERSION,
        "verdict": verdict,
        "verdict_reasons": invalid_reasons + reasons if verdict == "INVALID" else reasons,
        "slo": slo,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "reasoning": reasoning_summary(done),
        "itl_ms": summarize(g for o in done for g in o.chunk_gaps_ms()),
        "itl_token_ms": summarize(g for o in done for g in o.token_gaps_ms()),
        "e2e_ms": summarize(o.e2e_ms for o in done),
        "throughput": {
            "req_s": len(done) / duration_s if duration_s else None,
            "output_tok_s": total_out / duration_s if duration_s else None,
            "total_tok_s": (total_in + total_out) / duration_s if duration_s else None,
            "input_tok_s": total_in / duration_s if duration_s else None,
            "duration_s": duration_s,
            "effective_concurrency": sum(o.e2e_ms for o in done) / 1e3 / duration_s if duration_s else None,
            "goodput_req_s": len(good) / duration_s if duration_s and slo else None,
        },
        "requests": {
            "sent": len(measured), "completed": len(done), "failed": len(failed), "errors": errors,
            "warmup": len(outcomes) - len(measured),
            "output_tokens": {"requested": out_tokens, "requested_total": requested_total,
                              "total": total_out, "short": len(short),
                              "ignore_eos_honoured": not short},
            "prompt_tokens": {"target": target_in, **{k: v for k, v in summarize(prompt_lens).items()
                                                      if k in ("mean", "min", "max", "n")},
                              "mismatched": len(mismatched)},
            "cached_prompt_tokens": sum(cached),
            "tokens_per_chunk": summarize(k for o in done for k in o.chunk_tokens),
            "first_errors": [f"#{o.index} {o.error}: {o.detail}" for o in failed[:5]],
        },
        "config": config,
        "client": {"valid": valid, "invalid_reasons": invalid_reasons, "loop_lag_ms": lag,
                   "lag_threshold_ms": threshold, "schedule_delay_ms": schedule,
                   "stalls": stalled,
                   "cpu_util": cpu_util,
                   "transport": "raw asyncio HTTP/1.1, keep-alive, TCP_NODELAY"},
        "warnings": warnings,
        "interrupted": interrupted,
        "definitions": DEFINITIONS,
        "samples": samples(done),
    }


def reasoning_summary(done: Sequence[Outcome]) -> dict[str, Any] | None:
    """Reasoning models: time to the first answer token, token counts and TPOT of each part;
    None when no request reasoned."""
    reasoned = [o for o in done if o.reasoning_seen]
    if not reasoned:
        return None
    return {"requests": len(reasoned), "answered": sum(o.answer_at is not None for o in reasoned),
            "ttft_answer_ms": summarize(o.ttft_answer_ms for o in reasoned if o.ttft_answer_ms is not None),
            "reasoning_tokens": summarize(o.reasoning_tokens for o in reasoned),
            "answer_tokens": summarize(o.answer_tokens for o in reasoned),
            "tpot_reasoning_ms": summarize(o.tpot_reasoning_ms for o in reasoned if o.tpot_reasoning_ms is not None),
            "tpot_answer_ms": summarize(o.tpot_answer_ms for o in reasoned if o.tpot_answer_ms is not None)}


def samples(done: Sequence[Outcome]) -> dict[str, list[float | None]]:
    """Per-request figures of the completed measured requests, in request order, for
    compare.py's bootstrap (compact: 0.01 ms)."""
    def r(value: float | None) -> float | None:
        return None if value is None else round(value, 2)
    return {"ttft_ms": [r(o.ttft_ms) for o in done], "tpot_ms": [r(o.tpot_ms) for o in done],
            "e2e_ms": [r(o.e2e_ms) for o in done],
            **({"ttft_answer_ms": [r(o.ttft_answer_ms) for o in done]} if any(o.reasoning_seen for o in done) else {})}


def exit_code(result: dict[str, Any]) -> int:
    if result["interrupted"]:
        return common.EXIT_INTERRUPTED
    return {"ERROR": common.EXIT_SERVER, "INVALID": common.EXIT_INVALID,
            "FAIL": common.EXIT_CHECK_FAILED}.get(result["verdict"], common.EXIT_OK)


def find_target(server: Target, model: str | None, timeout: float) -> Target:
    """The server with its model: /v1/models says what is served (the model defaults to the
    first one listed), /version (or SGLang's /server_info) the engine version."""
    with common.client(server.base_url, server.api_key, timeout) as http:
        entry, served = common.pick_model(common.get_json(http, "/v1/models"), model, server.base_url)
        version = None
        for path in ("/version", "/server_info", "/get_server_info"):
            try:
                version = common.parse_json(http.get(path).content).get("version")
            except (ValueError, AttributeError, common.httpx.HTTPError):
                continue
            if isinstance(version, str) and version:
                break
            version = None
    info = {"model": entry["id"], "served": served, "root": entry.get("root"),
            "max_model_len": common.max_model_len(entry, server.base_url), "owned_by": entry.get("owned_by"),
            "engine_version": version}
    return Target(server.base_url, server.api_key, entry["id"], info)


def metrics_snapshot(target: Target, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """One scrape of /metrics through scripts/engine_metrics.py: (snapshot, '') or (None, why not)."""
    import engine_metrics

    try:
        text, at = engine_metrics.scrape(target.base_url, target.api_key, timeout)
        return engine_metrics.snapshot(text, target.base_url, at), ""
    except (ServerError, UsageError, engine_metrics.InvalidScrape) as exc:
        return None, str(exc)


def server_side(before: dict[str, Any] | None, after: dict[str, Any] | None, note: str,
                completed_tokens: int, slo: dict[str, Any], during: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What the server's own metrics say about the run: its latency histograms, queue vs
    prefill time, token counters, preemptions, prefix hits, and engine_metrics.py's diagnosis."""
    import engine_metrics

    if before is None or after is None:
        return {"metrics": None, "metrics_note": note or "/metrics unavailable", "summary": []}
    delta = engine_metrics.difference(before, after, during)
    targets = engine_metrics.Targets(slo.get("ttft_p95_ms", {}).get("target"), slo.get("tpot_p95_ms", {}).get("target"))
    report = engine_metrics.report(delta, slo=targets)
    generated = delta["counters"].get("generation_tokens", {}).get("value")
    keep = ("engine", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms",
            "preemptions", "prefix_cache_hit_rate", "prompt_tokens", "running_peak", "waiting_peak",
            "kv_cache_usage_max", "diagnosis", "warnings")
    figures = {key: report.get(key) for key in keep}
    figures["generation_tokens"] = generated

    def p(row: dict[str, Any], name: str) -> str:
        return common.fmt_number(row.get(name), 1)
    # Means come from exact sums; quantiles of coarse buckets would not add up.
    lines = [f"TTFT mean {p(report['ttft_ms'], 'mean')} ms = queue {p(report['queue_ms'], 'mean')} + prefill "
             f"{p(report['prefill_ms'], 'mean')} ms; TTFT p50/p95 {p(report['ttft_ms'], 'p50')}/"
             f"{p(report['ttft_ms'], 'p95')} ms, e2e mean {p(report['e2e_ms'], 'mean')} ms ({report['e2e_ms']['n']} requests)",
             f"generation tokens +{common.fmt_number(generated, 0)} (bench counted {completed_tokens}), "
             f"preemptions +{common.fmt_number(report['preemptions'], 0)}, prefix-cache hit rate "
             f"{common.fmt_number(None if report['prefix_cache_hit_rate'] is None else 100 * report['prefix_cache_hit_rate'], 1)}%",
             f"peak running {common.fmt_number(report['running_peak'], 0)}, waiting {common.fmt_number(report['waiting_peak'], 0)}, "
             f"KV cache max {common.fmt_number(None if report['kv_cache_usage_max'] is None else 100 * report['kv_cache_usage_max'], 1)}%"]
    lines += [f"{f['kind']}: {f['evidence']}" for f in report["diagnosis"]["findings"]]
    return {"metrics": {**figures, "lines": lines}, "metrics_note": "", "summary": lines[:2]}


def make_config(args: Any, settings: common.Settings) -> dict[str, Any]:
    """Validated run settings (flag > environment > inference.env > default)."""
    n_given = settings.get("BENCH_N", args.num_requests)
    n = common.number("-n/--num-requests (BENCH_N)", n_given, int, 1, LIMITS["num_requests"], default=32)
    rate = common.number("--rate (requests/s)", args.rate, float, 1e-6, 1e6)
    sources = [name for name in ("prompts", "sharegpt", "trace") if getattr(args, name)]
    if len(sources) > 1:
        raise UsageError(f"--{sources[0]} and --{sources[1]} both give the requests: choose one")
    c_default = None if rate or args.trace else 8
    c = common.number("-c/--concurrency (BENCH_C)", settings.get("BENCH_C", args.concurrency), int, 1, LIMITS["concurrency"], default=c_default)
    cfg = {
        "num_requests": n, "num_requests_given": n_given not in (None, ""), "concurrency": c, "rate": rate,
        "input_tokens": common.number("--input-tokens (BENCH_IN)", settings.get("BENCH_IN", args.input_tokens), int, 1, LIMITS["input_tokens"], default=2048),
        "output_tokens": common.number("--output-tokens (BENCH_OUT)", settings.get("BENCH_OUT", args.output_tokens), int, 1, LIMITS["output_tokens"], default=256),
        "slo_ttft_p95_ms": common.number("--slo-ttft-p95-ms (SLO_TTFT_P95_MS)", settings.get("SLO_TTFT_P95_MS", args.slo_ttft_p95_ms), float, 1e-3, None),
        "slo_tpot_p95_ms": common.number("--slo-tpot-p95-ms (SLO_TPOT_P95_MS)", settings.get("SLO_TPOT_P95_MS", args.slo_tpot_p95_ms), float, 1e-3, None),
        "burstiness": common.number("--burstiness", args.burstiness, float, 1e-3, 1e3, default=1.0),
        "duration_s": common.number("--duration (s)", args.duration, float, 1e-3, 7 * 86400),
        "warmup": common.number("--warmup", args.warmup, int, 0, LIMITS["num_requests"], default=c or 0),
        "shared_prefix": common.number("--shared-prefix", args.shared_prefix, int, 0, LIMITS["input_tokens"], default=0),
        "workers": common.number("--workers", args.workers, int, 1, 256, default=1),
        "multi_turn": common.number("--multi-turn", args.multi_turn, int, 1, 1000, default=1),
        "timeout_s": common.number("--timeout", args.timeout, float, 1e-3, None, default=30.0),
        "seed": common.number("--seed", args.seed, int, 0, None, default=0),
        "speed": common.number("--speed", args.speed, float, 1e-6, 1e6, default=1.0),
        "trace_block_tokens": common.number("--trace-block-tokens", args.trace_block_tokens, int, 1, 1_000_000,
                                            default=workload_mod.MOONCAKE_BLOCK_TOKENS),
        "timeline_interval_s": common.number("--timeline-interval (s)", args.timeline_interval, float, 0, 3600, default=2.0),
        "probe": args.probe or None,
        "endpoint": args.endpoint,
        "workload": sources[0] if sources else "synthetic",
        "dataset": getattr(args, sources[0]) if sources else None,
        "input_dist": args.input_dist or None,
        "output_dist": args.output_dist or None,
        "log": settings.get("BENCH_LOG", args.log, None),
    }
    if cfg["probe"] and not cfg["probe"].startswith("/"):
        raise UsageError(f"--probe takes a path such as /health or /v1/models, got {cfg['probe']!r}")
    if cfg["shared_prefix"] > cfg["input_tokens"]:
        raise UsageError(f"--shared-prefix {cfg['shared_prefix']} is longer than --input-tokens {cfg['input_tokens']}")
    if cfg["workload"] != "synthetic" and (cfg["input_dist"] or cfg["output_dist"] or cfg["shared_prefix"] or cfg["multi_turn"] > 1):
        raise UsageError(f"--{cfg['workload']} gives the prompts and lengths: drop --input-dist, --output-dist, "
                         "--shared-prefix and --multi-turn")
    if cfg["workload"] == "trace" and rate:
        raise UsageError("--trace sends at the trace's own times: use --speed, not --rate")
    for key, what in (("input_dist", "--input-dist"), ("output_dist", "--output-dist")):
        if cfg[key]:
            workload_mod.parse_distribution(cfg[key], what)
    if (cfg["input_dist"] or cfg["output_dist"]) and cfg["multi_turn"] > 1:
        raise UsageError("--multi-turn sends --input-tokens per turn: drop --input-dist/--output-dist")
    try:
        cfg["extra_body"] = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(cfg["extra_body"], dict):
            raise ValueError
    except ValueError:
        raise UsageError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")
    if cfg["multi_turn"] > 1 and cfg["endpoint"] != "chat":
        raise UsageError("--multi-turn needs --endpoint chat: a conversation is a list of chat messages")
    if cfg["workers"] > 1 and c is not None and cfg["workers"] > c:
        raise UsageError(f"--workers {cfg['workers']} exceeds the concurrency {c}: each worker needs a share")
    return cfg


def describe_load(cfg: dict[str, Any], n: int) -> str:
    rate, c = cfg["rate"], cfg["concurrency"]
    if cfg["workload"] == "trace":
        load = f"trace replay at {cfg['speed']:g}x" + (f", at most {c} in flight" if c else "")
    elif rate:
        load = (f"open loop {rate:g} req/s, "
                f"{'Poisson' if cfg['burstiness'] == 1 else 'gamma burstiness ' + format(cfg['burstiness'], 'g')}"
                + (f", at most {c} in flight" if c else ""))
    else:
        load = f"closed loop, {c} in flight"
    unit = f"conversations of {cfg['multi_turn']} turns" if cfg["multi_turn"] > 1 else "requests"
    return load + (f", {n} {unit}" + (f" or {cfg['duration_s']:g} s" if cfg["duration_s"] else "")
                   + (f", {cfg['warmup']} warm-up" if cfg["warmup"] else ""))


def build_parser():
    p = common.parser(__doc__)
    common.add_server_args(p)
    common.add_output_args(p)
    p.add_argument("--model", default="", help="served model name (else $INFER_MODEL, else the first in /v1/models)")
    p.add_argument("-n", "--num-requests", default="", help="measured requests (else $BENCH_N, 32; a dataset's or trace's size); the cap of a --duration run")
    p.add_argument("-c", "--concurrency", default="", help="requests in flight (else $BENCH_C, 8; with --rate or --trace: a cap, none by default)")
    p.add_argument("--input-tokens", default="", help="prompt tokens, exact by the server's tokenizer (else $BENCH_IN, 2048)")
    p.add_argument("--output-tokens", default="", help="output tokens per request, forced by ignore_eos (else $BENCH_OUT, 256; a dataset's default)")
    p.add_argument("--input-dist", default="", help="prompt lengths drawn per request: fixed:N, uniform:LO,HI, normal:MEAN,SD, lognormal:P50,P95")
    p.add_argument("--output-dist", default="", help="output lengths drawn per request (same forms as --input-dist)")
    p.add_argument("--prompts", default="", help='JSONL of {"prompt": ...} or {"messages": [...]}, optional "output_tokens"')
    p.add_argument("--sharegpt", default="", help="ShareGPT conversations (JSON array or JSONL): every human turn, with its history")
    p.add_argument("--trace", default="", help="replay a Mooncake/BurstGPT JSONL trace at its own times (see --speed)")
    p.add_argument("--speed", default="", help="trace replay speed: 2 = twice as fast (default 1)")
    p.add_argument("--trace-block-tokens", default="", help="tokens per trace hash id (default 512, Mooncake's)")
    p.add_argument("--slo-ttft-p95-ms", default="", help="SLO: TTFT p95 at most this (else $SLO_TTFT_P95_MS)")
    p.add_argument("--slo-tpot-p95-ms", default="", help="SLO: TPOT p95 at most this (else $SLO_TPOT_P95_MS)")
    p.add_argument("--log", default="", help="append a log entry to this Markdown file (else $BENCH_LOG)")
    p.add_argument("--rate", default="", help="open loop: requests per second on an absolute schedule")
    p.add_argument("--burstiness", default="", help="open-loop gamma shape: 1 = Poisson, <1 burstier, >1 steadier (default 1)")
    p.add_argument("--duration", default="", help="stop sending after this many seconds (in-flight requests finish)")
    p.add_argument("--warmup", default="", help="warm-up requests at the same concurrency, not counted (default: the concurrency)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions", help="API to load")
    p.add_argument("--shared-prefix", default="", help="the first K prompt tokens are the same in every request (prefix-cache case; default 0)")
    p.add_argument("--multi-turn", default="", help="chat conversations of this many turns: -n counts conversations, "
                   "each turn adds a user message of --input-tokens to the history and the answers (default 1)")
    p.add_argument("--records", default="", help="write one JSON line per request to this file")
    p.add_argument("--workers", default="", help="client processes sharing the load, when one core cannot keep up (default 1)")
    p.add_argument("--timeline-interval", default="", help="seconds between /metrics scrapes during the run (default 2; 0: none, "
                   "as each scrape costs the server a moment)")
    p.add_argument("--probe", default="", help="time a trivial GET (e.g. /health) to split client-vs-engine gaps into network and server")
    p.add_argument("--seed", default="", help="seed for prompts and arrivals (default 0)")
    p.add_argument("--extra-body", default="", help="JSON object merged into every request body")
    p.epilog += ("\n--timeout is per request: a stream that receives nothing for that long counts as a timeout.")
    return p


VERIFY_SAMPLE = 16


def calibrate_maker(counter: TokenCounter, seed: int) -> workload_mod.PromptMaker | None:
    """Find the words that are one token each after the run's head (one tokenizer call per
    word); None when too few are, or they do not add up."""
    head = " ".join(random.SystemRandom().choice(WORDS) for _ in range(3))
    base = counter.count(head)
    with ThreadPoolExecutor(8 if counter.exact else 1) as pool:
        counts = list(pool.map(lambda word: counter.count(f"{head} {word}"), WORDS))
    units = [word for word, got in zip(WORDS, counts) if got == base + 1]
    if len(units) < 16 or counter.count(" ".join([head, *units])) != base + len(units):
        return None
    return workload_mod.PromptMaker(units, head, base, seed)


def verify_sample(counter: TokenCounter, load: workload_mod.Workload) -> list[str]:
    """Count a sample of built prompts with the tokenizer: the mismatches, described."""
    rng = random.Random(load.seed)
    indices = sorted({0, load.count - 1, *(rng.randrange(load.count) for _ in range(VERIFY_SAMPLE - 2))})
    specs = [load.spec(i) for i in indices]
    with ThreadPoolExecutor(8 if counter.exact else 1) as pool:
        got = list(pool.map(lambda spec: counter.count(spec.prompt), specs))
    return [f"#{i}: {n} tokens, built for {spec.prompt_tokens}" for i, spec, n in zip(indices, specs, got)
            if n != spec.prompt_tokens]


def build_workload(target: Target, cfg: dict[str, Any]) -> tuple[workload_mod.Workload, str, list[list[str]] | None]:
    """The run's workload, its prompt-length source (for the report), and multi-turn texts."""
    chat = cfg["endpoint"] == "chat"
    kind, dataset = cfg["workload"], cfg["dataset"]
    out = cfg["output_tokens"]
    if kind in ("prompts", "sharegpt"):
        if kind == "prompts":
            entries = workload_mod.read_prompts(dataset)
            source = "dataset text (lengths by the server's usage)"
        else:
            local = fallback_counter()
            entries = workload_mod.read_sharegpt(dataset, local.count)
            source = f"dataset text (lengths by the server's usage; answer lengths by {local.name})"
        count = cfg["num_requests"] if cfg["num_requests_given"] else len(entries)
        return workload_mod.Workload(kind, cfg["warmup"] + count, out, cfg["seed"], entries=entries), source, None
    with common.client(target.base_url, target.api_key, cfg["timeout_s"], max_connections=8) as http:
        counter = server_counter(http, target.model, chat) or fallback_counter()
        if not counter.exact:
            common.progress(f"bench: the server has no /tokenize; prompt lengths by {counter.name}")
        if kind == "trace":
            rows = workload_mod.read_trace(dataset)
            count = min(cfg["num_requests"], len(rows)) if cfg["num_requests_given"] else len(rows)
            load = workload_mod.Workload("trace", count, out, cfg["seed"], trace=rows,
                                         block_tokens=cfg["trace_block_tokens"])
        else:
            total = (cfg["warmup"] + cfg["num_requests"]) * cfg["multi_turn"]
            load = workload_mod.Workload(
                "synthetic", total, out, cfg["seed"],
                input_dist=workload_mod.parse_distribution(cfg["input_dist"] or str(cfg["input_tokens"]), "--input-dist"),
                output_dist=workload_mod.parse_distribution(cfg["output_dist"] or str(out), "--output-dist"))
        load.maker = calibrate_maker(counter, cfg["seed"])
        if load.maker is not None and cfg["shared_prefix"]:
            load.shared_tokens = load.maker.fits(cfg["shared_prefix"], 0)
            load.shared_prefix = load.maker.text(load.shared_tokens, 0)
        wrong = verify_sample(counter, load) if load.maker is not None else ["too few one-token words"]
        fixed = load.kind == "synthetic" and load.input_dist.kind == "fixed"
        if wrong and fixed:
            # The slow exact way: every prompt fitted with the tokenizer before the run.
            common.progress(f"bench: prompt words do not add up ({wrong[0]}): fitting {total} prompts of "
                            f"{cfg['input_tokens']} tokens one by one ({counter.name})")
            prompts = build_prompts(counter, total, cfg["input_tokens"], cfg["shared_prefix"], cfg["seed"])
            entries = [workload_mod.Entry(prompt=p, prompt_tokens=cfg["input_tokens"]) for p in prompts]
            load = workload_mod.Workload("prompts", total, out, cfg["seed"], entries=entries)
        elif wrong:
            raise UsageError(f"prompts of a chosen length cannot be built with this tokenizer ({wrong[0]}): "
                             "use --input-tokens alone, or --prompts with your own texts")
    turns = None
    if cfg["multi_turn"] > 1:  # the conversations' texts, made now: each turn waits for the last answer
        texts = [load.spec(i).prompt for i in range(load.count)]
        turns = [texts[i:i + cfg["multi_turn"]] for i in range(0, len(texts), cfg["multi_turn"])]
        load = workload_mod.Workload("prompts", len(turns), out, cfg["seed"], entries=[
            workload_mod.Entry(prompt=t[0], prompt_tokens=cfg["input_tokens"]) for t in turns])
    return load, counter.name, turns


def workload_identity(cfg: dict[str, Any], load: workload_mod.Workload) -> dict[str, Any]:
    """What two runs must share to be compared (compare.py): requests, lengths, load shape."""
    identity = {k: cfg[k] for k in ("workload", "endpoint", "concurrency", "rate", "burstiness", "duration_s",
                                    "warmup", "multi_turn", "shared_prefix", "speed")}
    identity["requests"] = load.count - cfg["warmup"]
    identity["extra_body"] = cfg["extra_body"] or None
    if cfg["workload"] == "synthetic":
        identity["input_tokens"] = cfg["input_dist"] or cfg["input_tokens"]
        identity["output_tokens"] = cfg["output_dist"] or cfg["output_tokens"]
        identity["seed"] = cfg["seed"]
    else:
        data = Path(cfg["dataset"]).read_bytes()
        identity["dataset"] = {"name": Path(cfg["dataset"]).name, "sha256": hashlib.sha256(data).hexdigest()}
        identity["output_tokens"] = cfg["output_tokens"] if cfg["workload"] != "trace" else None
    return identity


def execute(target: Target, cfg: dict[str, Any], hold: common.SignalHold, quiet: bool = False) -> dict[str, Any]:
    """Build the workload, run the load, watch the server, analyse: the result document. A Ctrl-C
    or SIGTERM while the workload is built raises KeyboardInterrupt (nothing measured); during the
    load it stops the load; from the end of the load it waits in `hold` (started here, kept by the
    caller until the result is printed and written), so that the last scrape and the analysis
    complete the result, which then says interrupted."""
    started = time.perf_counter()
    chat = cfg["endpoint"] == "chat"
    load, prompt_source, turns = build_workload(target, cfg)
    max_len = target.info.get("max_model_len")
    longest = 0
    if load.input_dist and load.output_dist:
        longest = load.input_dist.upper + load.output_dist.upper
    elif load.trace:
        longest = max(r.input_tokens + r.output_tokens for r in load.trace[:load.count])
    elif cfg["multi_turn"] == 1 and load.kind == "prompts" and cfg["workload"] == "synthetic":
        longest = cfg["input_tokens"] + cfg["output_tokens"]
    if max_len and longest > max_len:
        raise UsageError(f"prompt + output tokens reach {longest}, over the model's max_model_len {max_len}: "
                         "shorten --input-tokens/--output-tokens or their distributions")
    run_id = f"{random.Random().getrandbits(32):08x}"
    path = ENDPOINTS[cfg["endpoint"]]
    template = {k: v for k, v in payload(cfg["endpoint"], target.model, "", 0, {}).items()
                if k not in ("prompt", "messages", "max_tokens")}
    source = RequestSource(load, target, path, template, cfg["extra_body"], run_id)
    offsets = load.offsets_s(cfg["speed"])
    if offsets is not None and cfg["warmup"] < len(offsets):
        offsets = [o - offsets[cfg["warmup"]] for o in offsets]
    plan = Plan(source, cfg["warmup"], cfg["concurrency"], chat, cfg["rate"], cfg["burstiness"],
                cfg["duration_s"], cfg["seed"], turns, offsets)
    config = {**{k: v for k, v in cfg.items() if k not in ("extra_body", "num_requests_given")},
              "num_requests": load.count - cfg["warmup"], "load": describe_load(cfg, load.count - cfg["warmup"]),
              "url": target.base_url, "model": target.model, "prompt_tokenizer": prompt_source, "run_id": run_id,
              "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "extra_body": cfg["extra_body"] or None}
    probed = server_watch.probe(target.base_url, target.api_key, cfg["probe"]) if cfg["probe"] else None
    before, note = metrics_snapshot(target, cfg["timeout_s"])
    timeline = server_watch.Timeline(target.base_url, target.api_key, cfg["timeline_interval_s"]) \
        if before is not None and cfg["timeline_interval_s"] else None
    common.progress(f"bench: {config['load']} against {target.base_url} ({target.model})")
    try:  # a Ctrl-C as the timeline starts still stops it
        if timeline:
            timeline.start(before)
        if cfg["workers"] > 1:  # both start `hold` as the run ends
            run = run_workers(plan, cfg["workers"], cfg["timeout_s"], hold)
        else:
            run = run_in_loop(plan, cfg["timeout_s"], quiet=quiet, hold=hold)
    except KeyboardInterrupt:  # came before the run handled it: nothing measured, and that is the result
        run = RunResult([], [], 0.0, 0.0, interrupted=True)
        hold.start()
    finally:
        if timeline:
            timeline.stop()
    first_sent = min((o.sent_ns for o in run.outcomes if o.sent_ns), default=None)
    # vLLM counts a request's last tokens just after it streamed them: by now it has.
    after, note_after = metrics_snapshot(target, cfg["timeout_s"]) if before is not None else (None, note)
    timeline_doc = timeline.result(after) if timeline else None
    result = analyse(run.outcomes, config, run.loop_lag_ms, run.cpu_s, run.wall_s, run.interrupted)
    result["workload"] = workload_identity(cfg, load)
    # Seconds from the start of execute to the first request on the wire: building the
    # workload, probing and the first scrape included (what a 100,000-request run waits).
    result["startup_s"] = None if first_sent is None else first_sent / 1e9 - started
    all_tokens = sum(o.completion_tokens or 0 for o in run.outcomes if o.ok or o.error == "stream_cut")
    during = timeline.during() if timeline else []
    result["server"] = {"info": target.info, **server_side(before, after, note or note_after, all_tokens,
                                                           result["slo"], during)}
    result["timeline"] = timeline_doc
    result["server"]["probe"] = probed
    if before is not None and after is not None and first_sent is not None:
        import engine_metrics

        delta = engine_metrics.difference(before, after, during)
        checked = server_watch.cross_check(delta, {"ttft_ms": result["ttft_ms"], "e2e_ms": result["e2e_ms"]},
                                           result["client"]["loop_lag_ms"]["p99"], probed)
        result["server"]["cross_check"] = checked
    generated = (result["server"]["metrics"] or {}).get("generation_tokens")
    if generated is not None and generated != all_tokens:
        result["warnings"].append(
            f"the server generated {generated:.0f} tokens during the run, the bench received {all_tokens} "
            "(warm-up included): other traffic shared the server (or streams were lost), so this run measured "
            "a mixed load: its latencies and the verdict hold for that mix, and the server-side figures are "
            "not this run's alone")
    result["records"] = [o.record() for o in run.outcomes]
    # One held since the load ended (during the last scrape, say) ends the run all the same.
    result["interrupted"] = run.interrupted or bool(hold.noted)
    return result


def run_with_settings(args: Any, body: Callable[[Any, common.Settings, Target], int]) -> int:
    """Read the settings (inference.env) and resolve the server (URL, API key) once, for bench
    and sweep alike; errors are redacted with that key."""
    try:
        settings = common.settings_from_args(args)
        server = Target(*common.server_settings(args, settings))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    return common.run_main(lambda: body(args, settings, server), secret=server.api_key)
