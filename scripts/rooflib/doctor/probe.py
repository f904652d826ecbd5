"""The doctor's active probe: a few light requests that time each part of the request path.

- Trivial routes (/health, a path that does not exist, /v1/models): the time to the response
  head on a new connection (connect included) and on a kept-alive one. What a missing path pays
  is paid before the server routes anything: a proxy, a balancer, middleware or the network.
- Streamed requests shaped like the traffic (its endpoint and lengths), a few at a time: the
  time to the response head (vLLM and SGLang send it once the request is accepted, before the
  engine runs it), to the first text and to the end; the tokens each event carried (usage in
  every chunk) and the events each socket read brought. Events of many tokens each, one per
  read, are the engine's stream interval; many events in one read are a layer that buffers.
- With `over_limit`, one request just over the context limit, for the error body it earns.

Every request has the caller's timeout; the probe's load is said in `Probe.load`.
"""
from __future__ import annotations

import asyncio
import statistics
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from rooflib.core import redaction
from rooflib.core.errors import ServerError
from rooflib.doctor.evidence import Probe, Route, Stream
from rooflib.load import promptgen
from rooflib.load.apis import APIS
from rooflib.load.asyncclient import Client, Target, request_bytes
from rooflib.load.http1 import _parse_head
from rooflib.load.request_outcome import Outcome, settle

ROUTE_REPEATS = 5
MISSING_PATH = "/roofline-doctor-missing-route"


def get_bytes(target: Target, path: str) -> bytes:
    auth = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else ""
    prefix = target.base_url.split("://", 1)[-1].partition("/")[2].rstrip("/")
    return (f"GET {'/' + prefix if prefix else ''}{path} HTTP/1.1\r\nHost: {target.host_header}\r\n{auth}"
            "Accept: */*\r\n\r\n").encode()


def head_ms(outcome: Outcome) -> float | None:
    """Sent -> the read that completed the response head."""
    seen = b""
    for t_ns, data in outcome.reads:
        seen += data
        try:
            if _parse_head(seen) is not None:
                return (t_ns - outcome.sent_ns) / 1e6
        except ValueError:
            return None
        if len(seen) > 65536:
            return None
    return None


def _status(outcome: Outcome) -> int | None:
    try:
        head = _parse_head(b"".join(data for _, data in outcome.reads))
    except ValueError:
        return None
    return head[0] if head else None


async def route(client: Client, target: Target, path: str, repeats: int = ROUTE_REPEATS) -> Route:
    """The route's time to head: once on a new connection, then `repeats` times on it kept alive."""
    request = get_bytes(target, path)
    first = await client.send(Outcome(index=0), request, reuse=False)
    if first.error or not first.reads:
        return Route(path, None, None, None, first.connect_ms or None, first.error or "no answer")
    new_head = head_ms(first)
    reused = []
    for i in range(repeats):
        outcome = await client.send(Outcome(index=i + 1), request)
        if outcome.error or head_ms(outcome) is None:
            break
        reused.append(head_ms(outcome))
    return Route(path, _status(first), statistics.median(reused) if reused else None,
                 None if new_head is None else new_head + first.connect_ms, first.connect_ms)


# Reads this close together are one delivery: a layer that flushes a held stream does it in a
# burst the kernel may split over several reads, while an engine's events of one stream are at
# least a decode step apart (milliseconds even on the fastest GPUs).
COALESCE_NS = 2_000_000


def _deliveries(outcome: Outcome) -> list[tuple[int, int]]:
    """(arrival ns, text events) of each delivery that brought text: events complete in one read
    share its arrival time (http1.parse_response), and reads within COALESCE_NS are one."""
    grouped: list[tuple[int, int]] = []
    for t_ns in outcome.token_times:
        if grouped and t_ns - grouped[-1][0] <= COALESCE_NS:
            grouped[-1] = (t_ns, grouped[-1][1] + 1)
        else:
            grouped.append((t_ns, 1))
    return grouped


def stream_of(outcome: Outcome, api_key: str | None, request_bytes: int = 0, prompt_bytes: int = 0) -> Stream:
    reads = _deliveries(outcome)
    gaps = tuple((reads[i][0] - reads[i - 1][0]) / 1e6 for i in range(1, len(reads)))
    detail = redaction.redact(outcome.detail, api_key) if outcome.detail else ""
    return Stream(status=outcome.status, error=outcome.error, detail=detail, connect_ms=outcome.connect_ms,
                  head_ms=head_ms(outcome) if outcome.reads else None,
                  ttft_ms=outcome.ttft_ms if outcome.token_times else None,
                  e2e_ms=outcome.e2e_ms if outcome.token_times else None, prompt_tokens=outcome.prompt_tokens,
                  completion_tokens=outcome.completion_tokens, tokens_per_event=tuple(outcome.chunk_tokens),
                  events_per_read=tuple(n for _, n in reads), text_gaps_ms=gaps, request_bytes=request_bytes,
                  prompt_bytes=prompt_bytes)


async def _stream(client: Client, target: Target, endpoint: str, prompt: str, output_tokens: int,
                  index: int) -> Stream:
    body = promptgen.payload(endpoint, target.model, prompt, output_tokens, {})
    request = request_bytes(target, APIS[endpoint].path, body, f"doctor-{uuid.uuid4().hex}")
    # A new connection each: the stream's own connect time is part of what it measures.
    sent = await client.send(Outcome(index=index), request, reuse=False)
    reads = list(sent.reads)
    settled = settle(sent, endpoint)
    settled.reads = reads
    return stream_of(settled, target.api_key, len(request) - request.index(b"\r\n\r\n") - 4, len(prompt.encode()))


async def _streams(client: Client, target: Target, endpoint: str, prompts: Sequence[str], output_tokens: int,
                   concurrency: int, around: Callable[[int, str], None] | None) -> list[Stream]:
    """The streams, `concurrency` at a time; with `around`, one at a time, `around(i, "before")`
    and `around(i, "after")` called beside each (to attribute it to a replica)."""
    limit = asyncio.Semaphore(1 if around else concurrency)

    async def one(i: int) -> Stream:
        async with limit:
            if around:
                await asyncio.to_thread(around, i, "before")
            stream = await _stream(client, target, endpoint, prompts[i], output_tokens, i)
            if around:
                await asyncio.to_thread(around, i, "after")
            return stream
    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def _watch(client: Client, stop: asyncio.Event) -> None:
    while not stop.is_set():
        client.expire_stalled()
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


LAG_TICK_S = 0.005


async def _loop_lag(samples: list[float], stop: asyncio.Event) -> None:
    """How late the loop wakes from a short sleep: every timestamp the probe takes can be that
    late (a busy machine, or this process's other thread parsing /metrics)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        asked = loop.time()
        await asyncio.sleep(LAG_TICK_S)
        samples.append(max(0.0, (loop.time() - asked - LAG_TICK_S) * 1000))


def _p95(samples: list[float]) -> float | None:
    return sorted(samples)[int(0.95 * (len(samples) - 1))] if samples else None


@dataclass(frozen=True)
class Plan:
    """What the probe sends: the endpoint, the prompts (one stream each), the output tokens, how
    many at a time, and the prompt just over the context limit (None: not sent)."""
    endpoint: str
    prompts: tuple[str, ...]
    output_tokens: int
    concurrency: int
    over_limit_prompt: str | None = None


def load_text(plan: Plan, streams: Sequence[Stream]) -> str:
    counted = [s.prompt_tokens for s in streams if s.prompt_tokens]
    prompt = f"{statistics.median(counted):.0f}" if counted else f"about {len(plan.prompts[0].split())} words of"
    return (f"{len(plan.prompts)} streamed {APIS[plan.endpoint].path} requests of {prompt} prompt and "
            f"{plan.output_tokens} output tokens, {plan.concurrency} at a time; {3 * (ROUTE_REPEATS + 1)} GETs of "
            "trivial routes" + ("; one request just over the context limit" if plan.over_limit_prompt else ""))


async def _probe(target: Target, plan: Plan, timeout_s: float, around: Callable[[int, str], None] | None) -> Probe:
    client = Client(target, timeout_s)
    stop = asyncio.Event()
    watchdog = asyncio.ensure_future(_watch(client, stop))
    lags: list[float] = []
    lag_watch = asyncio.ensure_future(_loop_lag(lags, stop))
    try:
        routes = tuple([await route(client, target, path) for path in ("/health", MISSING_PATH, "/v1/models")])
        streams = await _streams(client, target, plan.endpoint, plan.prompts, plan.output_tokens, plan.concurrency,
                                 around)
        over = None
        if plan.over_limit_prompt is not None:
            over = await _stream(client, target, plan.endpoint, plan.over_limit_prompt, 1, len(plan.prompts))
    finally:
        stop.set()
        await watchdog
        await lag_watch
        client.close()
    return Probe(load=load_text(plan, streams), routes=routes, streams=tuple(streams), over_limit=over,
                 endpoint=plan.endpoint, loop_lag_p95_ms=_p95(lags))


def run(target: Target, plan: Plan, timeout_s: float, around: Callable[[int, str], None] | None = None) -> Probe:
    """The probe from the caller's thread, in its own event loop; it ends within a timeout per
    request (a server that stops answering cannot hold it longer)."""
    requests = len(plan.prompts) + 3 * (ROUTE_REPEATS + 1) + (1 if plan.over_limit_prompt else 0)
    limit = timeout_s * (requests / (1 if around else plan.concurrency) + 4)
    try:
        return asyncio.run(asyncio.wait_for(_probe(target, plan, timeout_s, around), limit))
    except asyncio.TimeoutError:
        raise ServerError(f"the probe did not finish within {limit:.0f} s (--timeout {timeout_s:g} s per request)")
