"""A tiny loopback HTTP server for tests that need answers a real engine cannot give on demand.

`serving(handle)` runs a threaded server on a free loopback port and yields its base URL.
`handle(method, path, body)` returns (status, payload): a dict is sent as JSON, a list of dicts
as a server-sent-event stream (`data: {...}` lines, then `data: [DONE]`), like vLLM streams;
an `Events` list as named events (`event: <type>` before each `data:`), like Anthropic's Messages API;
a str as plain text (a Prometheus /metrics page).
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

Handler = Callable[[str, str, Any], tuple[int, Any]]


class Events(list):
    """Server-sent events named by their "type", with no [DONE] at the end."""


@contextmanager
def serving(handle: Handler) -> Iterator[str]:
    class RequestHandler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, payload = handle(method, self.path, body)
            if isinstance(payload, Events):
                data = "".join(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n" for event in payload)
                content_type = "text/event-stream"
            elif isinstance(payload, str):
                data, content_type = payload, "text/plain; version=0.0.4"
            elif isinstance(payload, list):
                data = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in payload) + "data: [DONE]\n\n"
                content_type = "text/event-stream"
            else:
                data, content_type = json.dumps(payload), "application/json"
            raw = data.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._answer("GET")

        def do_POST(self):
            self._answer("POST")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), RequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
