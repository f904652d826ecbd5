"""The asyncio streaming client: one connection per request, bytes timestamped as they arrive."""
from __future__ import annotations

import asyncio
import errno
import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from rooflib.core import fileio, http_client
from rooflib.load.http1 import MAX_CHUNK_LINE, MAX_HEAD, _parse_head, chunk_size, content_length
from rooflib.load.request_outcome import Outcome
from rooflib.server import model_listing


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
            try:
                self._head = _parse_head(b"".join(d for _, d in self.reads))
            except ValueError:
                self._finish(reusable=False)
                return
            if self._head is None:
                # Not HTTP; and joining the reads again per read would grow quadratically. The
                # first read may well hold more (a buffered stream arrives whole): the head first.
                if self._received > MAX_HEAD:
                    self._finish(reusable=False)
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


def find_target(server: Target, model: str | None, timeout: float) -> Target:
    """The server with its model: /v1/models says what is served (the model defaults to the
    first one listed), /version (or SGLang's /server_info) the engine version."""
    with http_client.client(server.base_url, server.api_key, timeout) as http:
        entry, served = model_listing.pick_model(http_client.get_json(http, "/v1/models"), model, server.base_url)
        version = None
        for path in ("/version", "/server_info", "/get_server_info"):
            try:
                version = fileio.parse_json(http.get(path).content).get("version")
            except (ValueError, AttributeError, httpx.HTTPError):
                continue
            if isinstance(version, str) and version:
                break
            version = None
    info = {"model": entry["id"], "served": served, "root": entry.get("root"),
            "max_model_len": model_listing.max_model_len(entry, server.base_url), "owned_by": entry.get("owned_by"),
            "engine_version": version}
    return Target(server.base_url, server.api_key, entry["id"], info)
