"""A loopback HTTP/1.1 proxy in front of a real server, for the tests of time outside the engine.

It forwards each request after a fixed delay (on every path, as a distant network or a slow
proxy delays them, or on the inference routes only, as a gateway does), and passes each answer
on as it comes, piece by piece after a hold (a drip), or whole once it is complete (a proxy that
buffers responses: a stream then arrives in one read). It may also hold each new connection
before serving it, or answer every Nth request 429 itself (a rate limiter the engine never sees).
One upstream connection per client connection, keep-alive; requests carry a Content-Length
(bench's client and httpx send one), answers a Content-Length or chunks.
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Iterator
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Behaviour:
    delay_s: float = 0.0
    delayed_prefix: str | tuple[str, ...] = "/"  # the paths that are delayed (all by default), or their prefixes
    buffer: bool = False        # send each answer on only once it is complete
    drip_s: float = 0.0         # hold each piece of an answer this long before passing it on
    accept_delay_s: float = 0.0  # a new connection waits this long before the proxy serves it
    limit_every: int = 0        # answer every Nth request on the delayed paths 429 (a rate limiter)


def _head(reader: BinaryIO) -> bytes:
    """A request or status line and its headers, up to the blank line; b"" at the end of the connection."""
    lines = []
    while True:
        line = reader.readline()
        if not line:
            return b""
        lines.append(line)
        if line == b"\r\n":
            return b"".join(lines)


def _header(head: bytes, name: bytes) -> bytes:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return b""


def _body(reader: BinaryIO, head: bytes) -> Iterator[bytes]:
    """The body's pieces as they arrive: each chunk of a chunked answer, or the Content-Length bytes."""
    if _header(head, b"transfer-encoding").lower() == b"chunked":
        while True:
            size_line = reader.readline()
            size = int(size_line.split(b";")[0], 16)
            data = reader.read(size + 2)  # the chunk and its CRLF
            if size == 0:
                yield size_line + data    # the last chunk (this proxy sees no trailers)
                return
            yield size_line + data
    yield reader.read(int(_header(head, b"content-length") or 0))


LIMITED = (b'HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n'
           + b'{"error": {"message": "rate limit exceeded, try again later."}}'.ljust(64))


class Proxy:
    def __init__(self, upstream: str, behaviour: Behaviour):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.behaviour = behaviour
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        time.sleep(self.behaviour.accept_delay_s)
        upstream = socket.create_connection(self.upstream)
        self.sockets.append(upstream)
        for sock in (client, upstream):  # each piece goes on at once (no Nagle delay behind a small write)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        from_client, from_upstream = client.makefile("rb"), upstream.makefile("rb")
        try:
            while True:
                request = _head(from_client)
                if not request:
                    return
                request += from_client.read(int(_header(request, b"content-length") or 0))
                if request.split(b" ")[1].decode("latin-1").startswith(self.behaviour.delayed_prefix):
                    time.sleep(self.behaviour.delay_s)
                    if self._limited():
                        client.sendall(LIMITED)
                        continue
                upstream.sendall(request)
                answer = _head(from_upstream)
                if not answer:
                    return
                if self.behaviour.buffer:
                    client.sendall(answer + b"".join(_body(from_upstream, answer)))
                    continue
                client.sendall(answer)
                for piece in _body(from_upstream, answer):
                    time.sleep(self.behaviour.drip_s)
                    client.sendall(piece)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def _limited(self) -> bool:
        with self.lock:
            self.requests += 1
            return bool(self.behaviour.limit_every) and self.requests % self.behaviour.limit_every == 0

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@contextmanager
def proxy(upstream: str, behaviour: Behaviour) -> Iterator[str]:
    """The proxy's URL while it runs."""
    running = Proxy(upstream, behaviour)
    try:
        yield running.url
    finally:
        running.close()
