"""A loopback HTTP server that answers like vLLM, except where a fault from FAULTS says otherwise.

Raw sockets, not http.server: the faults are about bytes on the wire (a chunk-size line of -6,
a Content-Length of "abc", a head dripped one byte at a time, a request never answered), which
a well-behaved HTTP library would not produce. One thread per connection, keep-alive.

A healthy answer, per path: /v1/models (one model, max_model_len 4096), /version, /metrics
(a recorded vLLM 0.32 scrape), /tokenize (one id per word), /v1/completions streamed (bench) or
with prompt_logprobs (ppl, the bigram of fake_ppl_server), /v1/chat/completions with tools
(fake_toolcall_server's answers). A fault is a function of the request that returns an Action
(bytes to write and what to do next), or None for the healthy answer.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import fake_ppl_server
import fake_toolcall_server

MODEL = "fake-model"
METRICS = (Path(__file__).resolve().parent / "fixtures" / "metrics" / "vllm-0.32-after.txt").read_text(encoding="utf-8")
# What the tests use as the API key: it must never appear in any output.
KEY = "sk-roofline-test-SECRET-4f9a2c"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Action:
    data: bytes = b""
    then: str = "keep"  # keep (the connection), close, hang (say nothing more), drip (data a byte at a time)
    pieces: tuple[bytes, ...] = ()  # then="paced": data, then each piece after a pause
    pause: float = 0.0


def response(status: int, body: bytes, content_type: str = "application/json", chunked: bool = False,
             extra: str = "") -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n{extra}"
    if chunked:
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + body
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def as_json(status: int, payload: Any) -> Action:
    return Action(response(status, json.dumps(payload).encode()))


def chunks(pieces: list[bytes], end: bool = True) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + (b"0\r\n\r\n" if end else b"")


def sse(events: list[Any], done: bool = True) -> list[bytes]:
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + ([b"data: [DONE]\n\n"] if done else [])


def word_ids(text: str) -> list[int]:
    return [2 + sum(map(ord, word)) % (fake_ppl_server.VOCAB - 2) for word in text.split()]


def completion_events(body: dict[str, Any], usage: Callable[[int], Any] = lambda n: n) -> list[Any]:
    count = body.get("max_tokens", 4)
    return [{"choices": [{"index": 0, "text": " a", "finish_reason": "length" if i == count - 1 else None}],
             "usage": {"prompt_tokens": 8, "completion_tokens": usage(i + 1), "total_tokens": 8 + i + 1}}
            for i in range(count)]


_chat = fake_toolcall_server.handler(set())


def healthy(request: Request) -> Action:
    body = request.body if isinstance(request.body, dict) else {}
    if request.path == "/v1/models":
        return as_json(200, {"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]})
    if request.path == "/version":
        return as_json(200, {"version": "0.32.0-fake"})
    if request.path == "/metrics":
        return Action(response(200, METRICS.encode(), "text/plain; version=0.0.4"))
    if request.path == "/tokenize":
        text = body.get("prompt") if "prompt" in body else " ".join(m["content"] for m in body.get("messages", []))
        tokens = word_ids(text) if isinstance(text, str) else []
        return as_json(200, {"count": len(tokens), "max_model_len": 4096, "tokens": tokens})
    if request.path == "/v1/completions" and body.get("stream"):
        return Action(response(200, chunks(sse(completion_events(body))), "text/event-stream", chunked=True))
    if request.path == "/v1/completions":
        tokens = body.get("prompt") or []
        entries = [None] + [{str(b): {"logprob": fake_ppl_server.logprob(a, b), "rank": 1}}
                            for a, b in zip(tokens, tokens[1:])]
        return as_json(200, {"choices": [{"index": 0, "text": "x", "prompt_logprobs": entries}]})
    if request.path == "/v1/chat/completions":
        status, payload = _chat("POST", request.path, body)
        if isinstance(payload, list):
            return Action(response(status, chunks(sse(payload)), "text/event-stream", chunked=True))
        return as_json(status, payload)
    return as_json(404, {"detail": "Not Found"})


def _work(request: Request) -> bool:
    """The requests that do the measuring (not the model listing, /version or /tokenize)."""
    return request.path in ("/v1/completions", "/v1/chat/completions")


def _echo(request: Request) -> str:
    return f"invalid credentials: {request.headers.get('authorization', '')}"


def _key_as_model_name(request: Request) -> Action | None:
    """The key the client sent, echoed as the served model's name (/v1/models, /metrics labels):
    it then reaches results, records and logs as a name, not as an error."""
    key = request.headers.get("authorization", "").removeprefix("Bearer ")
    if request.path == "/v1/models":
        return as_json(200, {"object": "list", "data": [{"id": key, "root": key, "max_model_len": 4096}]})
    if request.path == "/metrics":
        return Action(response(200, METRICS.replace('model_name="tiny-qwen3"', f'model_name="{key}"').encode(),
                               "text/plain; version=0.0.4"))
    return None


def _stream_with(events_of: Callable[[dict], list[Any]]) -> Callable[[Request], Action | None]:
    """A fault of the streamed answers only (bench), the others healthy."""
    def fault(request: Request) -> Action | None:
        if _work(request) and isinstance(request.body, dict) and request.body.get("stream"):
            return Action(response(200, chunks(events_of(request.body)), "text/event-stream", chunked=True))
        return None
    return fault


def _on_work(make: Callable[[Request], Action]) -> Callable[[Request], Action | None]:
    return lambda request: make(request) if _work(request) else None


def _on_path(path: str, make: Callable[[Request], Action]) -> Callable[[Request], Action | None]:
    return lambda request: make(request) if request.path == path else None


def _logprobs(entry: Callable[[int, Any], Any], short: bool = False) -> Callable[[Request], Action | None]:
    """ppl's non-streamed completions with odd prompt_logprobs; the first one healthy, so that
    a window is scored before the fault (it must be kept)."""
    seen = []

    def fault(request: Request) -> Action | None:
        if request.path != "/v1/completions" or not isinstance(request.body, dict) or request.body.get("stream"):
            return None
        seen.append(1)
        if len(seen) == 1:
            return None
        tokens = request.body.get("prompt") or []
        entries = [None] + [entry(b, fake_ppl_server.logprob(a, b)) for a, b in zip(tokens, tokens[1:])]
        return as_json(200, {"choices": [{"index": 0, "prompt_logprobs": entries[:2] if short else entries}]})
    return fault


NAN_METRICS = METRICS.replace("vllm:num_requests_running{", "vllm:num_requests_running_x{") + \
    'vllm:num_requests_running{engine="0",model_name="tiny-qwen3"} NaN\n' \
    'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-qwen3"} +Inf\n'

# name -> fault. Each row is one way a server (or what stands in its place) goes wrong.
FAULTS: dict[str, Callable[[Request], Action | None]] = {
    "http_500_echoing_the_key": lambda r: as_json(500, {"error": {"message": _echo(r)}}),
    "http_401_echoing_the_key": lambda r: as_json(401, {"error": {"message": _echo(r)}}),
    "http_401_on_work_echoing_the_key": _on_work(lambda r: as_json(401, {"error": {"message": _echo(r)}})),
    "key_as_model_name": _key_as_model_name,
    "http_429_on_work": _on_work(lambda r: as_json(429, {"error": {"message": "Too Many Requests"}})),
    "html_instead_of_json": lambda r: Action(response(200, b"<html><body>login " + _echo(r).encode() +
                                                          b"</body></html>", "text/html")),
    "models_is_a_list": _on_path("/v1/models", lambda r: as_json(200, [{"id": MODEL}])),
    "models_max_len_string": _on_path("/v1/models", lambda r: as_json(
        200, {"data": [{"id": MODEL, "max_model_len": "4096"}]})),
    "models_entry_not_object": _on_path("/v1/models", lambda r: as_json(200, {"data": ["fake-model"]})),
    "chunk_size_negative": _on_work(lambda r: Action(
        response(200, b"-6\r\ndata: x\r\n", "text/event-stream", chunked=True), "hang")),
    "chunk_size_huge": _on_work(lambda r: Action(
        response(200, b"FFFFFFFFFFFFFFFF\r\ndata: x", "text/event-stream", chunked=True), "close")),
    "chunk_size_garbage": _on_work(lambda r: Action(
        response(200, b"zz\r\ndata: x\r\n", "text/event-stream", chunked=True), "hang")),
    "chunk_line_endless": _on_work(lambda r: Action(
        response(200, b"1" * 100_000, "text/event-stream", chunked=True), "hang")),
    "content_length_garbage": _on_work(lambda r: Action(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: -abc\r\n\r\n{}", "hang")),
    "stream_cut_mid_event": _stream_with(lambda b: sse(completion_events(b), done=False)[:2] + [b"data: {\"cho"]),
    "garbage_sse": _stream_with(lambda b: [b"data: {not json\n\n", b"data: [DONE]\n\n"]),
    "sse_error_echoing_the_key": _stream_with(lambda b: [
        f"data: {json.dumps({'error': {'message': 'denied for Bearer ' + KEY}})}\n\n".encode()]),
    "completion_tokens_string": _stream_with(lambda b: sse(completion_events(b, usage=str))),
    "choices_item_not_object": _stream_with(lambda b: sse([{"choices": ["a"]}] * 2)),
    "usage_is_a_list": _stream_with(lambda b: sse([{"choices": [{"text": "a"}], "usage": [1]}])),
    "chat_choices_item_not_object": _on_path("/v1/chat/completions", lambda r: as_json(
        200, {"choices": ["not an object"]})),
    "chat_json_is_a_list": _on_path("/v1/chat/completions", lambda r: as_json(200, [1, 2])),
    "logprob_string": _logprobs(lambda token, lp: {str(token): {"logprob": str(lp)}}),
    "logprob_nan": _logprobs(lambda token, lp: {str(token): {"logprob": float("nan")}}),
    "prompt_logprobs_short": _logprobs(lambda token, lp: {str(token): {"logprob": lp}}, short=True),
    "prompt_logprobs_item_not_object": _logprobs(lambda token, lp: [lp]),
    "tokenize_tokens_strings": _on_path("/tokenize", lambda r: as_json(200, {"count": "2", "tokens": ["a", "b"]})),
    "metrics_nan": _on_path("/metrics", lambda r: Action(response(200, NAN_METRICS.encode(), "text/plain"))),
    "metrics_html": _on_path("/metrics", lambda r: Action(response(200, b"<html>hi</html>", "text/html"))),
    "json_nested_too_deep": lambda r: Action(response(200, b"[" * 100_000)),
    "sse_nested_too_deep": _stream_with(lambda b: [b"data: " + b"[" * 100_000 + b"\n\n"]),
    "slow_drip_head": lambda r: Action(b"HTTP/1.1 200 OK\r\nX-Drip: " + b"a" * 100_000, "drip"),
    "never_answers": lambda r: Action(b"", "hang"),
    "closes_at_once": lambda r: Action(b"", "close"),
}


def paced(pause: float) -> Callable[[Request], Action | None]:
    """Healthy answers, slowly: a pause before each answer, and between the events of a stream
    (for interrupt tests: the scripts are mid-run when the signal comes)."""
    def fault(request: Request) -> Action | None:
        if not _work(request):
            return None
        body = request.body if isinstance(request.body, dict) else {}
        if body.get("stream") and request.path == "/v1/completions":
            events = chunks(sse(completion_events(body)))
            head = response(200, b"", "text/event-stream", chunked=True)
            return Action(head, pieces=tuple(events[i:i + 64] for i in range(0, len(events), 64)), pause=pause)
        return Action(b"", pieces=(healthy(request).data,), pause=pause)
    return fault


class FaultServer:
    def __init__(self, fault: Callable[[Request], Action | None] | None = None):
        self.fault = fault
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.last_request = time.monotonic()  # when a request last arrived: a client's progress
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while not self.stop.is_set():
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
                length = int(headers.get("content-length") or 0)
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                raw, buffer = buffer[:length], buffer[length:]
                request = Request(method, path.split("?")[0], headers, json.loads(raw) if raw else None)
                self.last_request = time.monotonic()
                action = (self.fault(request) if self.fault else None) or healthy(request)
                if action.then == "drip":
                    for byte in action.data:
                        if self.stop.wait(0.05):
                            return
                        conn.sendall(bytes([byte]))
                    return
                conn.sendall(action.data)
                for piece in action.pieces:
                    if self.stop.wait(action.pause):
                        return
                    conn.sendall(piece)
                if action.then == "hang":
                    self.stop.wait()
                    return
                if action.then == "close":
                    return
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@contextmanager
def fault_server(fault: Callable[[Request], Action | None] | None = None) -> Iterator[str]:
    server = FaultServer(fault)
    try:
        yield server.url
    finally:
        server.close()


def refused_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
