"""The one HTTP client factory: auth header, timeouts, and a deadline on every read.

httpx's read timeout restarts on every byte, so a server that drips bytes could hold a request
for ever; the deadline backend bounds the whole request instead. `answered` turns a timeout or a
transport failure into one line that names the server and what to do.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

import httpcore
import httpx

from rooflib.core.errors import ServerError
from rooflib.core.fileio import parse_json

# The end of the current request (time.monotonic), per thread: every socket read ends by then.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
STREAM_DEADLINE_FACTOR = 10  # a streamed answer may take ten times --timeout in all
CONNECT_TIMEOUT_S = 10.0  # at most, to open a connection: a server that listens accepts at once
# A kept-alive connection the server closed as the request went out on it: uvicorn, which both
# engines' API servers run on, closes one idle for 5 s (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
# SGLang's SGLANG_TIMEOUT_KEEP_ALIVE), and the pool can pick it in the instant before the close
# arrives. The server answered nothing, so the request goes once more, on a new connection (as Go's
# net/http does for a request on a reused connection). A new connection closed unanswered is a server
# or proxy that dropped the request, perhaps after running it: that is an error, not sent again.
CLOSED_UNANSWERED = "Server disconnected without sending a response"
# Whether the current request (per thread) went out on a connection that had answered one before.
_ON_KEPT_ALIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("on_kept_alive", default=False)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose reads end by the request's deadline. httpx's read timeout is per read, so
    a server dripping a byte now and then would hold a request forever without this."""

    def __init__(self, stream: httpcore.NetworkStream):
        self.stream = stream
        self.answered = False  # bytes came back on it: a request written now reuses it

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        deadline = _DEADLINE.get()
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise httpcore.ReadTimeout("the answer took longer than its deadline in all")
            timeout = left if timeout is None else min(timeout, left)
        data = self.stream.read(max_bytes, timeout)
        self.answered = self.answered or bool(data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        _ON_KEPT_ALIVE.set(self.answered)
        self.stream.write(buffer, timeout)

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _DeadlineStream(self.stream.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class _DeadlineBackend(httpcore.SyncBackend):
    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _DeadlineStream(super().connect_tcp(*args, **kwargs))


class _Client(httpx.Client):
    """httpx.Client with a deadline on each request in all: --timeout for the head and a body
    read at once, ten times that for a streamed body, whatever the server drips.

    A request from a thread other than the one that made the client goes through a client of that
    thread's own, made alike and closed with this one: httpcore's pool is not safe to share between
    threads (one thread's pass over it can close a connection it has just handed to another, under
    its request: encode/httpcore#1110). Bench's eight prompt-counting threads met it as
    "ReadError: [Errno 9] Bad file descriptor" on /tokenize."""

    def __init__(self, total_s: float, make_transport: Callable[[], httpx.BaseTransport], **kwargs: Any):
        super().__init__(transport=make_transport(), **kwargs)
        self.total_s = total_s
        self._make_transport = make_transport
        self._owner = threading.get_ident()
        self._per_thread: dict[int, _Client] = {}
        self._per_thread_lock = threading.Lock()

    def _this_threads(self) -> _Client:
        with self._per_thread_lock:
            own = self._per_thread.get(threading.get_ident())
            if own is None:  # a thread id is reused only once its thread has ended
                own = _Client(self.total_s, self._make_transport, timeout=self.timeout)
                self._per_thread[threading.get_ident()] = own
            return own

    def close(self) -> None:
        with self._per_thread_lock:
            others, self._per_thread = list(self._per_thread.values()), {}
        for other in others:
            other.close()
        super().close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any) -> httpx.Response:
        if threading.get_ident() != self._owner:  # the request is whole: URL, headers and timeouts
            return self._this_threads().send(request, stream=stream, **kwargs)
        _ON_KEPT_ALIVE.set(False)
        try:
            return self._send_once(request, stream, **kwargs)
        except httpx.RemoteProtocolError as exc:
            if not (str(exc).startswith(CLOSED_UNANSWERED) and _ON_KEPT_ALIVE.get()):
                raise
            return self._send_once(request, stream, **kwargs)

    def _send_once(self, request: httpx.Request, stream: bool, **kwargs: Any) -> httpx.Response:
        _DEADLINE.set(time.monotonic() + self.total_s)  # the head (and a whole body not streamed)
        response = super().send(request, stream=stream, **kwargs)
        if stream:  # the streamed body, read after this returns
            _DEADLINE.set(time.monotonic() + self.total_s * STREAM_DEADLINE_FACTOR)
        return response


def client(base_url: str, api_key: str | None = None, timeout: float = 30.0,
           max_connections: int = 16, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)

    def make_transport() -> httpx.BaseTransport:
        if transport is not None:  # a given transport (a test's) serves every thread as it is
            return transport
        made = httpx.HTTPTransport(limits=limits)
        # httpx has no public way to give its pool a network backend; the pool reads this one.
        made._pool._network_backend = _DeadlineBackend()  # noqa: SLF001
        return made
    return _Client(
        timeout, make_transport, base_url=base_url, headers=headers,
        timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)), limits=limits,
    )


@contextlib.contextmanager
def answered(where: str, timeout_s: float):
    """Around one request to `where` (a URL, or "Prometheus at URL"): a transport failure is one
    ServerError line (exit 3). A timeout says so, after how long and how to raise the limit: a
    server too busy for --timeout is not an unreachable one."""
    started = time.monotonic()
    try:
        yield
    except httpx.ConnectTimeout:  # no connection at all: a longer --timeout would not help
        raise ServerError(f"cannot reach {where}: no connection within {min(timeout_s, CONNECT_TIMEOUT_S):g} s")
    except httpx.ConnectError as exc:  # refused, or no such host: nothing listens at that address
        raise ServerError(f"cannot reach {where} ({str(exc) or type(exc).__name__}): check that the server is up "
                          "and listening at that address")
    except httpx.TimeoutException:
        raise ServerError(f"{where} timed out after {round(time.monotonic() - started, 1):g} s (--timeout {timeout_s:g}): "
                          "the server is busy or the request is long; raise --timeout (task: add -- --timeout N)")
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {where}: {type(exc).__name__}: {exc}".rstrip(": "))


def get_json(http: httpx.Client, path: str, **kwargs: Any) -> Any:
    """GET/POST helper that turns transport and HTTP failures into ServerError lines."""
    method = "POST" if "json" in kwargs else "GET"
    with answered(f"{http.base_url}{path}", http.timeout.read):
        response = http.request(method, path, **kwargs)
    if response.status_code >= 400:
        raise ServerError(f"{method} {path} answered HTTP {response.status_code}: {response.text[:200].strip()}")
    try:
        return parse_json(response.content)
    except ValueError:
        raise ServerError(f"{method} {path} did not answer JSON (is {http.base_url} an inference server?)")
