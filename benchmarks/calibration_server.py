#!/usr/bin/env python3
"""A local OpenAI-compatible server that streams tokens on a known schedule, to calibrate bench.py.

It answers /v1/models, /version, /tokenize (one token per word), /metrics and streaming
/v1/completions, /v1/chat/completions, /v1/responses and /v1/messages (each in its own event format,
rooflib/load/apis.py): the first token TTFT ms after the request arrived, then one chunk every ITL
ms, exactly the requested number of tokens (or fewer under a fault). /v1/embeddings and /score
answer once, TTFT ms after the request arrived (one embedding, or one score per document).

It records the truth for every request (by its X-Request-Id), served at GET /calibration/truth:
when the request arrived and when each content chunk was written (monotonic ns, the clock bench.py
uses on the same machine). A request arrives when its bytes reached this server's socket, by the
kernel's receive timestamp (SO_TIMESTAMPNS; arrived_by "kernel"), else the time just before the
server read them (arrived_by "read"). The schedule counts from that arrival, so the time this
server takes to get round to reading a request is inside its TTFT, as it would be inside a real
server's. Its own event-loop lag is at GET /calibration/lag.

Faults on demand (--fault KIND:EVERY, every EVERY-th request): http500, http400, cut (connection
closed mid-stream), malformed (bad SSE data), stream_error (an error object inside the stream),
stall (stops sending), short (stops early: ignore_eos not honoured), no_usage (no usage in the
stream).

Examples:
  calibration_server.py --port 8100 --ttft-ms 40 --itl-ms 20
  taskset -c 0 calibration_server.py --port 0 --itl-ms 10 --tokens-per-chunk 2
  calibration_server.py --port 8100 --fault cut:5 --fault http500:7

Exit codes: 0 stopped by Ctrl-C or SIGTERM, 2 bad arguments or port in use.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from rooflib.core import cli, stats
from rooflib.core.errors import EXIT_OK, ServerError, UsageError
from rooflib.load import runner
from rooflib.load.apis import APIS

FAULTS = ("http500", "http400", "cut", "malformed", "stream_error", "stall", "short", "no_usage")
MODEL = "calibration"
CHAT_TEMPLATE_TOKENS = 3  # what /tokenize adds for a chat message, like a real template would


@dataclass
class Schedule:
    ttft_ms: float = 40.0
    itl_ms: float = 20.0
    tokens_per_chunk: int = 1
    model: str = MODEL
    faults: list[tuple[str, int]] = field(default_factory=list)
    api_key: str | None = None  # when set, /v1/* requests need `Authorization: Bearer <key>`
    # Close a kept-alive connection when its next request arrives, unanswered, as a server
    # whose keep-alive timeout expires at that moment does.
    drop_reused: bool = False

    def fault_for(self, number: int) -> str | None:
        """The fault of the number-th streaming request (1-based), if any."""
        for kind, every in self.faults:
            if number % every == 0:
                return kind
        return None


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
              500: "Internal Server Error"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class Stream:
    """One streamed completion, driven by loop timers (no coroutine per token)."""

    def __init__(self, server: "CalibrationServer", transport: asyncio.Transport, request: dict[str, Any],
                 api: str, request_id: str, arrived_ns: int, fault: str | None, arrived_by: str):
        self.server, self.transport, self.api, self.fault = server, transport, api, fault
        self.chat = api == "chat"
        self.total = int(request.get("max_tokens") or request.get("max_completion_tokens")
                         or request.get("max_output_tokens") or 16)
        if fault == "short":
            self.total = max(1, self.total // 2)
        options = request.get("stream_options") or {}
        # The Responses and Messages streams carry their usage once, in their last events.
        self.usage = fault != "no_usage" and (bool(options.get("include_usage")) or api in ("responses", "messages"))
        self.continuous = self.usage and bool(options.get("continuous_usage_stats"))
        self.prompt_tokens = server.count_tokens(request, APIS[api].chat_template)
        self.sent = 0
        self._middle = self._middle_event()
        self.truth = {"arrived_ns": arrived_ns, "arrived_by": arrived_by, "writes_ns": [], "tokens": []}
        server.truth[request_id] = self.truth
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        transport.write(head)
        # What opens the stream, as vLLM sends it: not a token
        if self.chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        elif api == "responses":
            self._event({"type": "response.created", "response": {"status": "in_progress", "usage": None}})
        elif api == "messages":
            self._event({"type": "message_start", "message": {"role": "assistant", "content": [],
                                                               "usage": {"input_tokens": self.prompt_tokens,
                                                                         "output_tokens": 0}}})
        loop = asyncio.get_running_loop()
        schedule = server.schedule
        self.start_s = arrived_ns / 1e9 - time.perf_counter() + loop.time()  # loop clock of arrival
        loop.call_at(self.start_s + schedule.ttft_ms / 1e3, self.step)

    def _chunk(self, tokens: int, finish: str | None) -> dict[str, Any]:
        text = " tok" * tokens
        if self.api == "responses":
            return {"type": "response.output_text.delta", "delta": text}
        if self.api == "messages":
            return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
        choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if self.chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        chunk: dict[str, Any] = {"object": "chat.completion.chunk" if self.chat else "text_completion",
                                 "model": self.server.schedule.model, "choices": [choice]}
        if self.continuous:
            chunk["usage"] = self._usage()
        return chunk

    def _middle_event(self) -> bytes:
        """The SSE event of a chunk in mid-stream, with %d for the two usage counts."""
        chunk = self._chunk(self.server.schedule.tokens_per_chunk, None)
        if not self.continuous:
            return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        chunk["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": -1, "total_tokens": -2}
        text = json.dumps(chunk, separators=(",", ":")).replace("%", "%%")
        text = text.replace('"completion_tokens":-1', '"completion_tokens":%d').replace('"total_tokens":-2', '"total_tokens":%d')
        return b"data: " + text.encode() + b"\n\n"

    def _event(self, chunk: dict[str, Any] | bytes) -> None:
        data = chunk if isinstance(chunk, bytes) else json.dumps(chunk, separators=(",", ":")).encode()
        self.transport.write(_chunked(b"data: " + data + b"\n\n"))

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.sent,
                "total_tokens": self.prompt_tokens + self.sent}

    def step(self) -> None:
        if self.transport.is_closing():
            return
        schedule = self.server.schedule
        if self.fault == "cut" and self.sent >= 3:
            self.transport.close()
            return
        if self.fault == "stall" and self.sent >= 2:
            return
        if self.fault == "malformed" and self.sent >= 2:
            self.transport.write(_chunked(b"data: {\"choices\": [{\"text\": \n\n"))
            self._finish()
            return
        if self.fault == "stream_error" and self.sent >= 2:
            self._event({"error": {"message": "calibration: injected error", "type": "InternalServerError", "code": 500}})
            self._finish()
            return
        k = min(schedule.tokens_per_chunk, self.total - self.sent)
        self.sent += k
        last = self.sent >= self.total
        # The time the write starts: its bytes cannot reach the client any earlier.
        self.truth["writes_ns"].append(time.perf_counter_ns())
        if last or k != schedule.tokens_per_chunk:
            self._event(self._chunk(k, ("stop" if self.fault == "short" else "length") if last else None))
        else:  # the hot path: a preformatted event, so the server keeps its own schedule at load
            data = self._middle % (self.sent, self.prompt_tokens + self.sent) if self.continuous else self._middle
            self.transport.write(_chunked(data))
        self.truth["tokens"].append(k)
        self.server.generation_tokens += k
        if last:
            if self.usage:
                self._last_usage()
            self._finish()
        else:
            loop = asyncio.get_running_loop()
            loop.call_at(self.start_s + (schedule.ttft_ms + schedule.itl_ms * (len(self.truth["writes_ns"]))) / 1e3,
                         self.step)

    def _last_usage(self) -> None:
        """The usage after the last token, in the API's own event."""
        if self.api == "responses":
            self._event({"type": "response.completed", "response": {
                "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.sent,
                          "total_tokens": self.prompt_tokens + self.sent, "input_tokens_details": {"cached_tokens": 0}}}})
        elif self.api == "messages":
            self._event({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                         "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.sent}})
        else:
            self._event({"choices": [], "usage": self._usage()})

    def _finish(self) -> None:
        if self.api == "messages":
            self._event({"type": "message_stop"})
        elif self.api != "responses":  # response.completed ended that stream
            self._event(b"[DONE]")
        self.transport.write(b"0\r\n\r\n")
        self.server.finished += 1


def answer_once(server: "CalibrationServer", transport: asyncio.Transport, request: dict[str, Any], api: str,
                request_id: str, arrived_ns: int, arrived_by: str) -> None:
    """A pooling answer (embeddings, score), written TTFT ms after the request arrived."""
    truth = {"arrived_ns": arrived_ns, "arrived_by": arrived_by, "writes_ns": [], "tokens": []}
    server.truth[request_id] = truth
    prompt_tokens = server.count_tokens(request, False)
    items = ([{"index": k, "object": "score", "score": 0.5} for k in range(len(request.get("text_2") or []))]
             if api == "score" else [{"index": 0, "object": "embedding", "embedding": [0.0] * 8}])
    body = json.dumps({"object": "list", "model": server.schedule.model, "data": items,
                       "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}).encode()

    def write() -> None:
        if transport.is_closing():
            return
        truth["writes_ns"].append(time.perf_counter_ns())
        transport.write(_response(200, body))
        server.finished += 1
    loop = asyncio.get_running_loop()
    loop.call_at(arrived_ns / 1e9 - time.perf_counter() + loop.time() + server.schedule.ttft_ms / 1e3, write)


# SO_TIMESTAMPNS (Linux): the kernel notes when each segment arrived, in CLOCK_REALTIME ns.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESTAMP_SPACE = socket.CMSG_SPACE(16)


def kernel_arrival_ns(sock: socket.socket, scratch: bytearray) -> int | None:
    """When the kernel received the bytes now waiting on sock (the newest segment among them),
    on the perf_counter_ns clock; None when the kernel did not say. Peeks: reads nothing."""
    try:
        _, ancillary, _, _ = sock.recvmsg_into([scratch], TIMESTAMP_SPACE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            seconds, nanoseconds = struct.unpack("qq", data[:16])
            # Realtime to monotonic: the two clocks read back to back differ by well under 1 µs.
            return seconds * 1_000_000_000 + nanoseconds - (time.time_ns() - time.perf_counter_ns())
    return None


class HttpProtocol(asyncio.BufferedProtocol):
    """A keep-alive HTTP/1.1 connection: requests with Content-Length bodies.

    A request arrives when its bytes reached this server's socket, by the kernel's receive
    timestamp, taken just before the loop reads them. The loop's own time would charge a request
    with however long the loop was busy with other connections before it got to this one: at 256
    streams, requests that come together wait for each other to be parsed, up to ~15 ms, which is
    this server's slowness, not the client's. Where the kernel gives no timestamp, the time just
    before the read is used."""

    def __init__(self, server: "CalibrationServer"):
        self.server = server
        self.buffer = b""
        self.served = 0
        self.transport: asyncio.Transport | None = None
        self.read_buffer = bytearray(65536)
        self.peek_buffer = bytearray(65536)
        self.sock: socket.socket | None = None
        self.arrived = 0
        self.arrived_by = "read"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(transport)
        # A socket object of our own on the same connection, for the peeking recvmsg (it has
        # SO_TIMESTAMPNS from the listening socket; asyncio already set TCP_NODELAY).
        self.sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self.transport)
        if self.sock is not None:
            self.sock.close()

    def get_buffer(self, sizehint: int) -> bytearray:
        kernel = kernel_arrival_ns(self.sock, self.peek_buffer)
        self.arrived, self.arrived_by = (kernel, "kernel") if kernel else (time.perf_counter_ns(), "read")
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        arrived, arrived_by = self.arrived, self.arrived_by
        self.buffer += self.read_buffer[:nbytes]
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buffer[:end].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, path = (lines[0].split(" ") + ["", ""])[:2]
            path = path.rstrip("/") or "/"
            self.served += 1
            if self.server.schedule.drop_reused and self.served > 1 and path.startswith("/v1/"):
                self.transport.close()
                return
            self.server.handle(self.transport, method, path, headers, body, arrived, arrived_by)


class CalibrationServer:
    """The server, in a thread of its own (tests, benchmarks) or as the process (main)."""

    def __init__(self, schedule: Schedule, host: str = "127.0.0.1", port: int = 0):
        self.schedule, self.host, self.port = schedule, host, port
        self.truth: dict[str, dict[str, Any]] = {}
        self.requests = 0
        self.finished = 0
        self.generation_tokens = 0
        self.connections: set[asyncio.BaseTransport] = set()
        self.lag_ms: list[float] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def count_tokens(self, request: dict[str, Any], chat: bool) -> int:
        """One token per word: of the messages (with the template's tokens), the Responses input,
        the prompt, or a pooling request's texts."""
        if chat:
            turns = request.get("messages") or request.get("input")
            text = turns if isinstance(turns, str) else " ".join(str(m.get("content", "")) for m in turns or [])
            return len(text.split()) + CHAT_TEMPLATE_TOKENS
        texts = [request.get("prompt") or request.get("input") or request.get("text_1") or "",
                 *(request.get("text_2") or [])]
        return sum(len(str(text).split()) for text in texts)

    def handle(self, transport, method: str, path: str, headers: dict[str, str], body: bytes, arrived: int,
               arrived_by: str) -> None:
        if self.schedule.api_key and path.startswith("/v1/") and \
                headers.get("authorization") != f"Bearer {self.schedule.api_key}":
            transport.write(_response(401, b'{"error": {"message": "invalid API key"}}'))
            return
        try:
            request = json.loads(body) if body else {}
        except ValueError:
            transport.write(_response(400, b'{"error": {"message": "body is not JSON"}}'))
            return
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": self.schedule.model, "object": "model",
                                                  "owned_by": "roofline", "root": self.schedule.model,
                                                  "max_model_len": 1_000_000}]}
            transport.write(_response(200, json.dumps(models).encode()))
        elif method == "GET" and path == "/version":
            transport.write(_response(200, b'{"version": "calibration-1"}'))
        elif method == "GET" and path == "/calibration/truth":
            transport.write(_response(200, json.dumps(self.truth).encode()))
        elif method == "GET" and path == "/calibration/lag":
            transport.write(_response(200, json.dumps(stats.summarize(self.lag_ms)).encode()))
        elif method == "GET" and path == "/metrics":
            text = (f"# TYPE calibration:generation_tokens counter\n"
                    f"calibration:generation_tokens_total {self.generation_tokens}\n"
                    f"calibration:requests_finished_total {self.finished}\n")
            transport.write(_response(200, text.encode(), "text/plain; version=0.0.4"))
        elif method == "POST" and path == "/tokenize":
            chat = "messages" in request
            count = self.count_tokens(request, chat)
            transport.write(_response(200, json.dumps({"count": count, "tokens": list(range(count))}).encode()))
        elif method == "POST" and path in {api.path for api in APIS.values()}:
            if request.get("model") != self.schedule.model:
                message = f"The model `{request.get('model')}` does not exist."
                transport.write(_response(404, json.dumps({"error": {"message": message, "code": 404}}).encode()))
                return
            self.requests += 1
            fault = self.schedule.fault_for(self.requests)
            if fault in ("http500", "http400"):
                status = int(fault[4:])
                transport.write(_response(status, json.dumps({"error": {"message": f"injected {fault}"}}).encode()))
                return
            api = next(name for name, api in APIS.items() if api.path == path)
            request_id = headers.get("x-request-id", str(self.requests))
            if APIS[api].generates:
                Stream(self, transport, request, api, request_id, arrived, fault, arrived_by)
            else:
                answer_once(self, transport, request, api, request_id, arrived, arrived_by)
        else:
            transport.write(_response(404, b'{"error": {"message": "not found"}}'))

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: HttpProtocol(self), self.host, self.port,
                                                     backlog=4096)  # 1,024 streams connect at once
        self.port = self._server.sockets[0].getsockname()[1]
        for sock in self._server.sockets:
            # Accepted connections inherit it, so even a request sent at once with the connection
            # gets a kernel timestamp, and the kernel starts stamping from now on.
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        # The server's own lateness, measured as bench.py measures the client's: it tells how
        # much of a gap between the two is the server's.
        self.loop.create_task(runner.lag_probe(self.lag_ms, asyncio.Event()))

    def start_in_thread(self) -> "CalibrationServer":
        ready = threading.Event()

        def serve() -> None:
            async def body() -> None:
                await self.start()
                ready.set()
                await self._server.serve_forever()
            try:
                asyncio.run(body())
            except asyncio.CancelledError:
                pass
        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        """Stop as a crashing server would: listener and every open connection closed at once."""
        if self.loop and self._server and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._shut)
        if self._thread:
            self._thread.join(5)

    def _shut(self) -> None:
        self._server.close()
        for transport in list(self.connections):
            transport.close()
        for task in asyncio.all_tasks(self.loop):
            task.cancel()

    def __enter__(self) -> "CalibrationServer":
        return self.start_in_thread()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def parse_fault(text: str) -> tuple[str, int]:
    kind, _, every = text.partition(":")
    if kind not in FAULTS or not every.isdigit() or int(every) < 1:
        raise UsageError(f"--fault {text!r}: use KIND:EVERY with KIND one of {', '.join(FAULTS)}, e.g. cut:5")
    return kind, int(every)


@contextmanager
def spawned(args: Sequence[str] = (), prefix: Sequence[str] = ()) -> Iterator[str]:
    """This server in a child process on a free port (`prefix`: e.g. taskset): its URL."""
    server = subprocess.Popen([*prefix, sys.executable, str(Path(__file__).resolve()), "--port", "0", *args],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise ServerError(f"the calibration server did not start: {line or 'no output'}")
        yield line.split()[-1]
    finally:
        server.terminate()
        server.wait(10)


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8100, help="port (0 = any free port, printed on stdout)")
    p.add_argument("--ttft-ms", type=float, default=40.0, help="time from request to first token")
    p.add_argument("--itl-ms", type=float, default=20.0, help="time between chunks")
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens each chunk carries (speculative decoding)")
    p.add_argument("--model", default=MODEL, help="served model name")
    p.add_argument("--fault", action="append", default=[], help="KIND:EVERY, repeatable")
    args = p.parse_args(argv)

    def body() -> int:
        if args.ttft_ms < 0 or args.itl_ms < 0 or args.tokens_per_chunk < 1:
            raise UsageError("--ttft-ms and --itl-ms must be >= 0 and --tokens-per-chunk >= 1")
        schedule = Schedule(args.ttft_ms, args.itl_ms, args.tokens_per_chunk, args.model,
                            [parse_fault(f) for f in args.fault])
        server = CalibrationServer(schedule, args.host, args.port)

        async def serve() -> None:
            try:
                await server.start()
            except OSError as exc:
                raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}")
            print(f"listening on {server.url}", flush=True)
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await stop.wait()
        asyncio.run(serve())
        return EXIT_OK
    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
