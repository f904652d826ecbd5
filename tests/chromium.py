"""A real headless Chromium for the report tests, driven over the DevTools protocol on a pipe.

`--remote-debugging-pipe` makes Chromium read protocol messages on fd 3 and write them on fd 4,
each JSON and ended by a NUL byte: no websocket, no extra package. `inspect_page` opens a file,
collects console messages, exceptions and any network request that is not the file itself,
measures horizontal overflow at each width, counts SVG marks and saves a screenshot per width.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
         "--remote-debugging-pipe"]
TIMEOUT_S = 120.0

# Run in the page by DevTools (the page itself has no scripts): what overflows, what was drawn.
MEASURE = """(() => {
  const doc = document.documentElement;
  const texts = [...document.querySelectorAll('h1,h2,p,li,dt,dd,figcaption,th,td,span')]
    .filter(e => !e.closest('.table-wrap, .plot-wrap') && e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).display !== 'inline')
    .map(e => e.tagName + ': ' + e.textContent.slice(0, 60));
  const outside = [...document.querySelectorAll('figure, section, dl, .table-wrap, .plot-wrap')]
    .filter(e => e.getBoundingClientRect().right > doc.clientWidth + 1).map(e => e.tagName + '#' + (e.id || e.className));
  const clipped = [...document.querySelectorAll('svg.plot text')].filter(t => {
    const box = t.getBoundingClientRect(), svg = t.ownerSVGElement.getBoundingClientRect();
    return box.width > 0 && (box.left < svg.left - 1 || box.right > svg.right + 1 || box.top < svg.top - 1 || box.bottom > svg.bottom + 1);
  }).map(t => t.closest('figure').id + ': ' + t.textContent.slice(0, 60));
  const charts = [...document.querySelectorAll('figure.chart')].map(f => ({
    id: f.id,
    series: [...f.querySelectorAll('g.series')].map(g => ({
      name: g.dataset.series, total: +g.dataset.total, drawn: +g.dataset.drawn,
      paths: g.querySelectorAll('path.line').length, dots: g.querySelectorAll('circle.dot').length,
      hollow: g.querySelectorAll('circle.dot.invalid').length, crosses: g.querySelectorAll('path.cross').length})),
    bars: f.querySelectorAll('g.requests rect:not(.tick-mark)').length,
    ticks: f.querySelectorAll('g.requests rect.tick-mark').length,
    intervals: f.querySelectorAll('g.interval').length, whiskers: f.querySelectorAll('g.interval line').length,
    segments: f.querySelectorAll('rect.segment').length, columns: f.querySelectorAll('rect.column').length,
    rules: f.querySelectorAll('line.rule').length, rows: f.querySelectorAll('tbody tr').length,
    caption: f.querySelector('figcaption').textContent}));
  return {page_overflow: doc.scrollWidth - doc.clientWidth, texts, outside, clipped, charts,
          scripts: document.querySelectorAll('script').length, text: document.body.innerText,
          pwned: window.__pwned === undefined ? null : String(window.__pwned)};
})()"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """One headless Chromium; `call(method, params, session)` answers, events are kept."""

    def __init__(self, exe: str):
        self.profile = tempfile.mkdtemp(prefix="roofline-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Chromium reads fd 3 and writes fd 4: move our pipe ends there in the child (after
        # close_fds would run, hence close_fds=False).
        def child_fds() -> None:
            reading, writing = os.dup(to_browser_r), os.dup(from_browser_w)  # above 4: no clash
            os.dup2(reading, 3)
            os.dup2(writing, 4)
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     close_fds=False, preexec_fn=child_fds)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe: " + self.proc.stderr.read().decode()[-500:])
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError, TimeoutError):
            self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)


def inspect_page(exe: str, html: Path, shots: Path, widths=(1280, 390)) -> dict[str, Any]:
    """Open `html` from disk; per width: the measurements of MEASURE and a screenshot file."""
    browser = Browser(exe)
    try:
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.call(f"{domain}.enable", session=session)
        found: dict[str, Any] = {"widths": {}}
        for width in widths:
            browser.call("Emulation.setDeviceMetricsOverride",
                         {"width": width, "height": 2000, "deviceScaleFactor": 1, "mobile": width < 600}, session)
            browser.events.clear()
            opened = browser.call("Page.navigate", {"url": html.resolve().as_uri()}, session)
            if opened.get("errorText"):
                raise RuntimeError(f"Chromium could not open {html}: {opened['errorText']}")
            browser.wait_for("Page.loadEventFired", session)
            measured = browser.call("Runtime.evaluate", {"expression": MEASURE, "returnByValue": True},
                                    session)["result"]["value"]
            shot = browser.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
            path = shots / f"{html.stem}-{width}.png"
            path.write_bytes(base64.b64decode(shot["data"]))
            measured["screenshot"] = str(path)
            found["widths"][width] = measured
            found.setdefault("console", []).extend(_problems(browser.events, html))
        return found
    finally:
        browser.close()


def _problems(events: list[dict[str, Any]], html: Path) -> list[str]:
    """Console errors and warnings, uncaught exceptions, and any request but the page itself."""
    problems = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
            problems.append(f"console.{params['type']}: {params.get('args')}")
        elif method == "Runtime.exceptionThrown":
            problems.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
            problems.append(f"log {params['entry']['level']}: {params['entry'].get('text')}")
        elif method == "Network.requestWillBeSent" and params.get("request", {}).get("url") != html.resolve().as_uri():
            problems.append(f"request: {params['request'].get('url')}")
    return problems
