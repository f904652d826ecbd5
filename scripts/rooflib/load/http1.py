"""Raw HTTP/1.1 response parsing for the load generator: head, chunked coding, SSE events.

The load generator reads bytes off the socket itself so that every byte has the time it arrived;
this module turns those timed reads into a response and its timed events.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Sequence


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
