"""A DCGM exporter endpoint for the tests: the recorded page of tests/fixtures/dcgm/ served over
HTTP for the GPUs a test names, with the values the test sets, for a real Prometheus to scrape.

`running_exporter(gpus)` starts it on a free loopback port and yields an `Exporter`. Each GPU is a
dict of labels that replace the recorded GPU's (gpu, UUID, device, pod, ...). `set(index, **values)`
gives metrics new values (a number, or a function of the seconds since `set` for a counter);
`drop(prefix)` stops serving the metrics whose names start with it (a field not exported);
`serving = False` serves an empty page (no exporter series at all).
"""
from __future__ import annotations

import http.server
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "dcgm" / "h100-idle.txt"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"')

Value = float | Callable[[float], float]


@dataclass
class Exporter:
    gpus: list[dict[str, str]]
    url: str = ""
    serving: bool = True
    values: dict[int, dict[str, Value]] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)
    dropped: tuple[str, ...] = ()

    @property
    def instance(self) -> str:
        return self.url.removeprefix("http://")

    def set(self, index: int, **values: Value) -> None:
        """New values for GPU `index` (metric name -> number or f(seconds since this call))."""
        self.since = time.monotonic()
        self.values[index] = dict(values)

    def drop(self, *prefixes: str) -> None:
        self.dropped = prefixes

    def page(self) -> str:
        """The recorded page, with one sample line per GPU where it has one."""
        lines = []
        elapsed = time.monotonic() - self.since
        for line in FIXTURE.read_text().splitlines():
            if line.startswith("# ") and not line.startswith(("# HELP", "# TYPE")):
                continue  # the fixture's own notes
            name = line.split()[2] if line.startswith("#") else _SAMPLE.match(line).group(1)
            if self.dropped and name.startswith(self.dropped):
                continue
            if line.startswith("#"):
                lines.append(line)
                continue
            _, labels, recorded = _SAMPLE.match(line).groups()
            for index, overrides in enumerate(self.gpus):
                merged = {**dict(_LABEL.findall(labels)), **overrides}
                value = self.values.get(index, {}).get(name, float(recorded))
                value = value(elapsed) if callable(value) else value
                text = ",".join(f'{key}="{val}"' for key, val in merged.items())
                lines.append(f"{name}{{{text}}} {value:f}")
        return "\n".join(lines) + "\n"


@contextmanager
def running_exporter(gpus: Sequence[Mapping[str, str]]) -> Iterator[Exporter]:
    exporter = Exporter([dict(g) for g in gpus])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/metrics"
            body = (exporter.page() if found and exporter.serving else "").encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    exporter.url = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield exporter
    finally:
        server.shutdown()
        server.server_close()
