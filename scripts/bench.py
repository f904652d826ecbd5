#!/usr/bin/env python3
"""Load-test an OpenAI-compatible server (vLLM, SGLang): TTFT, TPOT, ITL, e2e, tok/s, SLO verdict.

Every request streams with temperature 0, `ignore_eos` and `stream_options.include_usage`
(+ `continuous_usage_stats`), so output lengths are exact and counted by the server. Prompts are
exactly --input-tokens long by the server's own tokenizer (/tokenize; else tiktoken, else an
estimate, announced), each with a unique prefix so the prefix cache cannot turn TTFT into a lookup.

Definitions (vLLM names): TTFT = request sent -> first chunk carrying content (never a role-only
chunk); e2e = request sent -> last content chunk; TPOT = (e2e - TTFT) / (output tokens - 1) per
request (= AIPerf ITL, GuideLLM ITL); ITL = per-chunk gaps (vLLM ITL, AIPerf ICL) and per token
(a gap divided over the tokens its chunk carried). Percentiles are linear (numpy default).
Timestamps are taken when bytes arrive (monotonic ns) by a minimal raw-socket HTTP/1.1 client;
SSE is parsed after the stream ends. The client's own event-loop lag is measured: when it may
have distorted the figures, the run is INVALID (exit 4). /metrics is read before and after
(queue vs prefill time, token counts, preemptions, prefix-cache hits) through scripts/engine_metrics.py.
SGLang is supported from its documented formats (checked against recorded streams, not a live
server); its /tokenize takes text only, so chat prompts there do not count the chat template.

Examples:
  bench.py --url http://127.0.0.1:8000 -n 32 -c 8 --input-tokens 2048 --output-tokens 256
  bench.py -n 64 -c 16 --slo-ttft-p95-ms 500 --slo-tpot-p95-ms 50 --log bench-log.md
  bench.py --rate 4 --burstiness 0.5 --duration 60 -n 1000 --json
  bench.py --endpoint chat --shared-prefix 1024 -n 32 -c 8 --records requests.jsonl
  INFER_URL=http://gpu-box:8000 INFER_API_KEY=... bench.py -n 256 -c 64 --workers 2

Exit codes: 0 SLO met (or no SLO set and every request completed), 1 SLO missed or requests
failed, 2 usage error, 3 server unreachable or every request failed, 4 run invalid (the client
may have distorted the figures, or ran out of file descriptors: raise ulimit -n), 5 the result is
printed but --records or --log could not be written, 130 interrupted by Ctrl-C or SIGTERM (partial
results still printed and logged).
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import datetime
import errno
import gc
import json
import math
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
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import ServerError, UsageError  # noqa: E402

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


# ---------------------------------------------------------------------------------------------
# Statistics

def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile of sorted values (numpy's default method)."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p95/p99/mean/min/max/n of a sample (None values when it is empty)."""
    data = sorted(values)
    if not data:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "min": None, "max": None, "n": 0}
    return {"p50": percentile(data, 50), "p95": percentile(data, 95), "p99": percentile(data, 99),
            "mean": sum(data) / len(data), "min": data[0], "max": data[-1], "n": len(data)}


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 response and SSE parsing, done after the stream ended

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


# ---------------------------------------------------------------------------------------------
# Interpreting one streamed completion

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
        return rec


def _content_of(choice: dict[str, Any], chat: bool) -> Any:
    if not chat:
        return choice.get("text")
    delta = choice.get("delta") or {}
    return (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            or delta.get("tool_calls"))


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
    cumulative = 0
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
            content = _content_of(choice, chat)
            if content:
                if isinstance(content, str):
                    outcome.text += content
                outcome.token_times.append(t_ns)
                outcome.chunk_tokens.append(1 if new_tokens is None else new_tokens)
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


# ---------------------------------------------------------------------------------------------
# The streaming client: asyncio protocol, bytes stored with their arrival time, nothing else

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


class Client:
    """Keep-alive connections to one server; request bytes are built before the run."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float):
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.timeout_ns = int(timeout_s * 1e9)
        self.idle: list[Connection] = []
        self.busy: set[Connection] = set()

    def request_bytes(self, path: str, payload: dict[str, Any], request_id: str) -> bytes:
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{self.auth}"
                f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

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


# ---------------------------------------------------------------------------------------------
# Load: closed loop (C in flight) or open loop (absolute Poisson/gamma schedule)

@dataclass
class Plan:
    """What to send. requests[i] are ready-made HTTP request bytes; the first `warmup` ones
    are warm-up requests, sent at the same concurrency and not counted."""
    requests: list[bytes]
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
    template: dict[str, Any] | None = None
    path: str = ENDPOINTS["chat"]
    run_id: str = ""

    def part(self, indices: list[int], concurrency: int | None, rate: float | None, seed: int) -> "Plan":
        """The share of a worker process: the conversations `indices`."""
        return Plan([self.requests[i] for i in indices], sum(i < self.warmup for i in indices), concurrency,
                    self.chat, rate, self.burstiness, self.duration_s, seed,
                    None if self.turns is None else [self.turns[i] for i in indices],
                    self.template, self.path, self.run_id)


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


async def run_plan(plan: Plan, base_url: str, api_key: str | None, timeout_s: float,
                   before_measured: Callable[[], Any] | None = None, on_done: Callable[[Outcome], None] | None = None,
                   interrupt: asyncio.Event | None = None) -> RunResult:
    """Send the plan; returns every outcome (warm-up ones flagged). Ctrl-C (interrupt) stops
    sending and returns what completed."""
    client = Client(base_url, api_key, timeout_s)
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
        outcome = Outcome(index=index, warmup=index < plan.warmup, scheduled_ns=scheduled_ns)
        await client.send(outcome, plan.requests[index])
        outcomes.append(outcome)
        if on_done:
            on_done(outcome)

    async def conversation(index: int, scheduled_ns: int | None) -> None:
        """The turns of one conversation, one after the other. Each answer is parsed at once
        (it is part of the next prompt): a little loop time that single-turn runs do not spend."""
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(plan.turns[index]):
            messages.append({"role": "user", "content": text})
            request = plan.requests[index] if turn == 0 else client.request_bytes(
                plan.path, {**plan.template, "messages": messages}, f"bench-{plan.run_id}-{index}-{turn}")
            outcome = Outcome(index=index, turn=turn, warmup=index < plan.warmup,
                              scheduled_ns=scheduled_ns if turn == 0 else None)
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
        start = time.perf_counter_ns()
        offsets = arrival_offsets(len(indices), plan.rate, plan.burstiness, plan.seed)
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
    if plan.rate:
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


def run_in_loop(plan: Plan, base_url: str, api_key: str | None, timeout_s: float,
                quiet: bool = False, before_measured: Callable[[], Any] | None = None) -> RunResult:
    """asyncio.run with Ctrl-C turned into 'stop and keep what was measured'."""
    raise_open_file_limit(plan.concurrency or len(plan.requests))

    async def body() -> RunResult:
        interrupt = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, interrupt.set)
            loop.add_signal_handler(signal.SIGTERM, interrupt.set)
        except (NotImplementedError, RuntimeError):
            pass
        return await run_plan(plan, base_url, api_key, timeout_s, before_measured,
                              None if quiet else _progress_printer(plan), interrupt)
    on_term = signal.getsignal(signal.SIGTERM)
    try:
        return asyncio.run(body())
    finally:  # closing the loop resets SIGTERM to the default (die): the caller's handler is back
        signal.signal(signal.SIGTERM, on_term)


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


def _worker(number: int, plan: Plan, base_url: str, api_key: str | None, timeout_s: float,
            barrier, queue) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent passes Ctrl-C on as SIGTERM

    async def meet() -> bool:
        try:
            await asyncio.to_thread(barrier.wait)
            return True
        except threading.BrokenBarrierError:  # the parent was interrupted during warm-up
            return False
    queue.put((number, run_in_loop(plan, base_url, api_key, timeout_s, quiet=True, before_measured=meet)))


def run_workers(plan: Plan, workers: int, base_url: str, api_key: str | None,
                timeout_s: float) -> RunResult:
    """Split the plan over worker processes (round robin). They finish their warm-up, meet at
    a barrier and start the measured phase together; they share CLOCK_MONOTONIC, so their
    timestamps merge directly."""
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
                                         args=(number, sub, base_url, api_key, timeout_s, barrier, queue)))
    for process in processes:
        process.start()
    results: dict[int, RunResult] = {}
    interrupted = False
    while len(results) < workers:
        try:
            number, result = queue.get(timeout=1.0)
            results[number] = result
        except Empty:
            dead = [p for n, p in enumerate(processes) if n not in results and not p.is_alive()]
            if dead and queue.empty():
                raise ServerError(f"a client worker process exited with status {dead[0].exitcode} "
                                  "without results; run with --workers 1 to see why")
        except KeyboardInterrupt:
            interrupted = True
            barrier.abort()
            for process in processes:
                if process.is_alive():
                    process.terminate()  # SIGTERM: the worker stops and sends what it measured
    for process in processes:
        process.join()
    outcomes, lag = [], []
    for number, result in results.items():
        for outcome in result.outcomes:
            outcome.index = shares[number][outcome.index]
            outcomes.append(outcome)
        lag += result.loop_lag_ms
    return RunResult(sorted(outcomes, key=lambda o: (o.index, o.turn)), lag,
                     max(r.cpu_s for r in results.values()), max(r.wall_s for r in results.values()),
                     interrupted or any(r.interrupted for r in results.values()))


# ---------------------------------------------------------------------------------------------
# Prompts of an exact token length

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


# ---------------------------------------------------------------------------------------------
# From outcomes to results

def client_validity(lag: dict[str, Any], ttft: dict[str, Any], tpot: dict[str, Any],
                    schedule_delay: dict[str, Any], cpu_util: float) -> tuple[bool, float, list[str]]:
    """Is the client's own delay small against what it measured? (valid, threshold ms, reasons)

    The verdict stands on p95 figures, so the lag's p95 decides; a p99 above the threshold
    only earns a warning (see analyse)."""
    medians = [s["p50"] for s in (ttft, tpot) if s["p50"]]
    threshold = max(LAG_FLOOR_MS, LAG_SHARE * min(medians)) if medians else LAG_FLOOR_MS
    reasons = []
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
    short = [o for o in done if (o.completion_tokens or 0) < out_tokens]
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
    valid, threshold, invalid_reasons = client_validity(lag, ttft, tpot, schedule, cpu_util)
    if errors.get("client_fd_limit"):
        valid = False
        invalid_reasons.append(f"the client ran out of file descriptors for {errors['client_fd_limit']} requests: "
                               "raise the limit (ulimit -n 65536) and run again; the server is not at fault")
    slo = slo_check(ttft["p95"], tpot["p95"], config.get("slo_ttft_p95_ms"), config.get("slo_tpot_p95_ms"))
    good = [o for o in done if all(
        (name != "ttft_p95_ms" or o.ttft_ms <= c["target"]) and
        (name != "tpot_p95_ms" or o.tpot_ms is None or o.tpot_ms <= c["target"]) for name, c in slo.items())]
    warnings = []
    if short:
        warnings.append(f"ignore_eos not honoured: {len(short)} of {len(done)} requests returned fewer "
                        f"than {out_tokens} tokens (finish_reason: "
                        f"{', '.join(sorted({str(o.finish_reason) for o in short}))}); TPOT holds, throughput is lower")
    uneven = [o for o in done if o.usage_reported and sum(o.chunk_tokens) != o.completion_tokens]
    if uneven:
        warnings.append(f"{len(uneven)} requests had chunks of unknown size (no per-chunk usage, e.g. SGLang "
                        "without continuous_usage_stats): ITL per token counts one token per chunk there")
    if any(not o.usage_reported for o in done):
        warnings.append("the server sent no usage: output tokens counted as content chunks "
                        "(an undercount when a chunk carries several tokens)")
    target_in = config["input_tokens"]
    mismatched = [n for n in prompt_lens if n != target_in] if not config.get("multi_turn") else []
    if mismatched and config.get("prompt_tokenizer", "").startswith("server"):
        warnings.append(f"{len(mismatched)} prompts were not {target_in} tokens by the server's usage "
                        f"(range {min(mismatched)}..{max(mismatched)})")
    cached = [o.cached_tokens for o in done if o.cached_tokens]
    if cached and not config.get("shared_prefix"):
        warnings.append(f"{len(cached)} requests hit the prefix cache although prompts were unique "
                        f"(up to {max(cached)} cached tokens)")
    if valid and lag["p99"] is not None and lag["p99"] > threshold:
        warnings.append(f"client event-loop lag p99 {lag['p99']:.2f} ms > {threshold:.2f} ms: "
                        "p99 figures may include client delay (p95 ones do not)")
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
            "output_tokens": {"requested": out_tokens, "total": total_out, "short": len(short),
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
                   "cpu_util": cpu_util,
                   "transport": "raw asyncio HTTP/1.1, keep-alive, TCP_NODELAY"},
        "warnings": warnings,
        "interrupted": interrupted,
        "definitions": DEFINITIONS,
    }


def exit_code(result: dict[str, Any]) -> int:
    if result["interrupted"]:
        return common.EXIT_INTERRUPTED
    return {"ERROR": common.EXIT_SERVER, "INVALID": common.EXIT_INVALID,
            "FAIL": common.EXIT_CHECK_FAILED}.get(result["verdict"], common.EXIT_OK)


def human_report(result: dict[str, Any]) -> str:
    """The console table (vLLM `bench serve` layout for easy comparison)."""
    cfg, req, thr, client = result["config"], result["requests"], result["throughput"], result["client"]
    lines = [f"{' Roofline bench ':=^72}",
             f"{'Server / model:':<34}{cfg['url']} / {cfg['model']}",
             f"{'Load:':<34}{cfg['load']}",
             f"{'Prompt / output tokens:':<34}{cfg['input_tokens']} / {cfg['output_tokens']} "
             f"({cfg['endpoint']}, prompts by {cfg['prompt_tokenizer']})",
             f"{'Requests completed / failed:':<34}{req['completed']} / {req['failed']}"
             + (f"  ({', '.join(f'{k} {v}' for k, v in req['errors'].items())})" if req["errors"] else ""),
             f"{'Duration (s):':<34}{common.fmt_number(thr['duration_s'])}",
             f"{'Request throughput (req/s):':<34}{common.fmt_number(thr['req_s'])}",
             f"{'Output token throughput (tok/s):':<34}{common.fmt_number(thr['output_tok_s'])}",
             f"{'Total token throughput (tok/s):':<34}{common.fmt_number(thr['total_tok_s'])}",
             f"{'Output tokens (total, short):':<34}{req['output_tokens']['total']}, {req['output_tokens']['short']}",
             f"{'':-<72}",
             f"{'ms':<16}{'p50':>9}{'p95':>9}{'p99':>9}{'mean':>9}{'min':>9}{'max':>9}{'n':>7}"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL (chunk)"),
                       ("itl_token_ms", "ITL (token)"), ("e2e_ms", "E2E")):
        s = result[key]
        lines.append(f"{label:<16}" + "".join(f"{common.fmt_number(s[k]):>9}" for k in ("p50", "p95", "p99", "mean", "min", "max"))
                     + f"{s['n']:>7}")
    lines.append(f"{'':-<72}")
    lag = client["loop_lag_ms"]
    lines.append(f"{'Client loop lag p50/p99/max (ms):':<34}{common.fmt_number(lag['p50'])} / {common.fmt_number(lag['p99'])} / "
                 f"{common.fmt_number(lag['max'])}  (limit {client['lag_threshold_ms']:.2f}, CPU {common.fmt_number((client['cpu_util'] or 0) * 100, 0)}%)")
    server = result.get("server") or {}
    for line in server.get("summary", []):
        lines.append(f"{'Server:':<34}{line}")
    for name, check in result["slo"].items():
        lines.append(f"{'SLO ' + name + ':':<34}{common.fmt_number(check['measured'], 1)} <= {check['target']:g}: "
                     f"{'met' if check['met'] else 'MISSED'}")
    for warning in result["warnings"]:
        lines.append(f"warning: {warning}")
    for error in req["first_errors"]:
        lines.append(f"error: {error}")
    lines.append(f"{'Verdict:':<34}{result['verdict']}" +
                 (f" ({'; '.join(result['verdict_reasons'])})" if result["verdict_reasons"] else ""))
    if result["interrupted"]:
        lines.append("interrupted: partial results")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The server: what it says about itself

@dataclass
class Target:
    base_url: str
    api_key: str | None
    model: str
    info: dict[str, Any]  # /v1/models entry, version


def find_target(base_url: str, api_key: str | None, model: str | None, timeout: float) -> Target:
    """Ask /v1/models what is served (the model defaults to the first one listed) and the version."""
    with common.client(base_url, api_key, timeout) as http:
        entry, served = common.pick_model(common.get_json(http, "/v1/models"), model, base_url)
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
            "max_model_len": common.max_model_len(entry, base_url), "owned_by": entry.get("owned_by"),
            "engine_version": version}
    return Target(base_url, api_key, entry["id"], info)


def metrics_snapshot(target: Target, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """One scrape of /metrics through scripts/metrics.py: (snapshot, '') or (None, why not)."""
    import engine_metrics

    try:
        text, at = engine_metrics.scrape(target.base_url, target.api_key, timeout)
        return engine_metrics.snapshot(text, target.base_url, at), ""
    except (ServerError, UsageError, engine_metrics.InvalidScrape) as exc:
        return None, str(exc)


def server_side(before: dict[str, Any] | None, after: dict[str, Any] | None, note: str,
                completed_tokens: int, slo: dict[str, Any]) -> dict[str, Any]:
    """What the server's own metrics say about the run: its latency histograms, queue vs
    prefill time, token counters, preemptions, prefix hits, and metrics.py's diagnosis."""
    import engine_metrics

    if before is None or after is None:
        return {"metrics": None, "metrics_note": note or "/metrics unavailable", "summary": []}
    delta = engine_metrics.difference(before, after)
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
    lines += [f"{f['bottleneck']}: {f['evidence']}" for f in report["diagnosis"]]
    return {"metrics": {**figures, "lines": lines}, "metrics_note": "", "summary": lines[:2]}


# ---------------------------------------------------------------------------------------------
# Command line

def make_config(args: Any, settings: common.Settings) -> dict[str, Any]:
    """Validated run settings (flag > environment > inference.env > default)."""
    n = common.number("-n/--num-requests (BENCH_N)", settings.get("BENCH_N", args.num_requests), int, 1, LIMITS["num_requests"], default=32)
    rate = common.number("--rate (requests/s)", args.rate, float, 1e-6, 1e6)
    c_default = None if rate else 8
    c = common.number("-c/--concurrency (BENCH_C)", settings.get("BENCH_C", args.concurrency), int, 1, LIMITS["concurrency"], default=c_default)
    cfg = {
        "num_requests": n, "concurrency": c, "rate": rate,
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
        "endpoint": args.endpoint,
        "log": settings.get("BENCH_LOG", args.log, None),
    }
    if cfg["shared_prefix"] > cfg["input_tokens"]:
        raise UsageError(f"--shared-prefix {cfg['shared_prefix']} is longer than --input-tokens {cfg['input_tokens']}")
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
    if rate:
        cfg["load"] = (f"open loop {rate:g} req/s, "
                       f"{'Poisson' if cfg['burstiness'] == 1 else 'gamma burstiness ' + format(cfg['burstiness'], 'g')}"
                       + (f", at most {c} in flight" if c else ""))
    else:
        cfg["load"] = f"closed loop, {c} in flight"
    unit = f"conversations of {cfg['multi_turn']} turns" if cfg["multi_turn"] > 1 else "requests"
    cfg["load"] += (f", {n} {unit}" + (f" or {cfg['duration_s']:g} s" if cfg["duration_s"] else "")
                    + (f", {cfg['warmup']} warm-up" if cfg["warmup"] else ""))
    return cfg


def build_parser():
    p = common.parser(__doc__)
    common.add_server_args(p)
    common.add_output_args(p)
    p.add_argument("--model", default="", help="served model name (else $INFER_MODEL, else the first in /v1/models)")
    p.add_argument("-n", "--num-requests", default="", help="measured requests (else $BENCH_N, 32); the cap of a --duration run")
    p.add_argument("-c", "--concurrency", default="", help="requests in flight (else $BENCH_C, 8; with --rate: a cap, none by default)")
    p.add_argument("--input-tokens", default="", help="prompt tokens, exact by the server's tokenizer (else $BENCH_IN, 2048)")
    p.add_argument("--output-tokens", default="", help="output tokens per request, forced by ignore_eos (else $BENCH_OUT, 256)")
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
    p.add_argument("--seed", default="", help="seed for prompts and arrivals (default 0)")
    p.add_argument("--extra-body", default="", help="JSON object merged into every request body")
    p.epilog += ("\n--timeout is per request: a stream that receives nothing for that long counts as a timeout.")
    return p


def execute(target: Target, cfg: dict[str, Any], quiet: bool = False) -> dict[str, Any]:
    """Build the prompts, run the load, analyse: the result document."""
    chat = cfg["endpoint"] == "chat"
    max_len = target.info.get("max_model_len")
    if max_len and cfg["input_tokens"] + cfg["output_tokens"] > max_len:
        raise UsageError(f"--input-tokens + --output-tokens = {cfg['input_tokens'] + cfg['output_tokens']} "
                         f"exceeds the model's max_model_len {max_len}")
    with common.client(target.base_url, target.api_key, cfg["timeout_s"], max_connections=8) as http:
        counter = server_counter(http, target.model, chat) or fallback_counter()
        if not counter.exact:
            common.progress(f"bench: the server has no /tokenize; prompt lengths by {counter.name}")
        total = (cfg["warmup"] + cfg["num_requests"]) * cfg["multi_turn"]
        common.progress(f"bench: building {total} prompts of {cfg['input_tokens']} tokens ({counter.name})")
        prompts = build_prompts(counter, total, cfg["input_tokens"], cfg["shared_prefix"], cfg["seed"])
    turns = None
    if cfg["multi_turn"] > 1:
        turns = [prompts[i:i + cfg["multi_turn"]] for i in range(0, len(prompts), cfg["multi_turn"])]
        prompts = [conversation[0] for conversation in turns]
    client = Client(target.base_url, target.api_key, cfg["timeout_s"])
    run_id = f"{random.Random().getrandbits(32):08x}"
    path = ENDPOINTS[cfg["endpoint"]]
    requests = [client.request_bytes(path, payload(cfg["endpoint"], target.model, prompt, cfg["output_tokens"],
                                                   cfg["extra_body"]), f"bench-{run_id}-{i}")
                for i, prompt in enumerate(prompts)]
    template = {k: v for k, v in payload("chat", target.model, "", cfg["output_tokens"], cfg["extra_body"]).items()
                if k != "messages"}
    plan = Plan(requests, cfg["warmup"], cfg["concurrency"], chat, cfg["rate"], cfg["burstiness"],
                cfg["duration_s"], cfg["seed"], turns, template, path, run_id)
    config = {**{k: v for k, v in cfg.items() if k != "extra_body"}, "url": target.base_url,
              "model": target.model, "prompt_tokenizer": counter.name, "run_id": run_id,
              "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "extra_body": cfg["extra_body"] or None}
    before, note = metrics_snapshot(target, cfg["timeout_s"])
    common.progress(f"bench: {config['load']} against {target.base_url} ({target.model})")
    if cfg["workers"] > 1:
        run = run_workers(plan, cfg["workers"], target.base_url, target.api_key, cfg["timeout_s"])
    else:
        run = run_in_loop(plan, target.base_url, target.api_key, cfg["timeout_s"], quiet=quiet)
    with common.signals_held("bench") if run.interrupted else contextlib.nullcontext():
        after, note_after = metrics_snapshot(target, cfg["timeout_s"]) if before is not None else (None, note)
    result = analyse(run.outcomes, config, run.loop_lag_ms, run.cpu_s, run.wall_s, run.interrupted)
    all_tokens = sum(o.completion_tokens or 0 for o in run.outcomes if o.ok or o.error == "stream_cut")
    result["server"] = {"info": target.info, **server_side(before, after, note or note_after, all_tokens, result["slo"])}
    generated = (result["server"]["metrics"] or {}).get("generation_tokens")
    if generated is not None and generated != all_tokens:
        result["warnings"].append(f"the server generated {generated:.0f} tokens during the run, the bench "
                                  f"received {all_tokens} (warm-up included): other traffic, or lost streams")
    result["records"] = [o.record() for o in run.outcomes]
    return result


def run(args: Any) -> int:
    settings = common.settings_from_args(args)
    cfg = make_config(args, settings)
    base_url, api_key = common.server_settings(args)
    for what, path in (("--records", args.records), ("--log (BENCH_LOG)", cfg["log"])):
        if path:
            common.check_writable(path, what)
    target = find_target(base_url, api_key, settings.get("INFER_MODEL", args.model) or None, cfg["timeout_s"])
    result = execute(target, cfg)
    with common.signals_held("bench") if result["interrupted"] else contextlib.nullcontext():
        return print_and_write(args, cfg, result)


def print_and_write(args: Any, cfg: dict[str, Any], result: dict[str, Any]) -> int:
    """Print the result, then write --records and --log: the exit code."""
    records = result.pop("records")
    # The result is printed first: a file that cannot be written then loses nothing.
    common.emit(result, human_report(result), args.json)
    files = []
    if args.records:
        files.append(("--records", args.records, "".join(json.dumps(common.json_safe(r)) + "\n" for r in records)))
    if cfg["log"]:
        files.append(("--log", cfg["log"], common.log_with_entry(cfg["log"], common.render_log_entry(result, TEMPLATE))))
    written = common.write_outputs(files)
    if cfg["log"] and written == common.EXIT_OK:
        common.progress(f"bench: log entry appended to {cfg['log']}")
    return written if written != common.EXIT_OK else exit_code(result)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _, api_key = common.server_settings(args)
    except UsageError:
        api_key = None  # run() reports the bad setting
    return common.run_main(lambda: run(args), secret=api_key)


if __name__ == "__main__":
    sys.exit(main())
