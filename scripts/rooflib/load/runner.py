"""Running a plan of requests: closed and open loops, trace replay, worker processes, the client's own lag."""
from __future__ import annotations

import asyncio
import gc
import multiprocessing
import random
import resource
import signal
import threading
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Callable, Iterator

from rooflib.core import printing, signals
from rooflib.core.errors import ServerError
from rooflib.load import apis, images, sessions, workloads
from rooflib.load.analysis import EPOLL_ROUNDING_MS
from rooflib.load.asyncclient import Client, Target, request_bytes
from rooflib.load.request_outcome import Outcome, settle

LAG_PROBE_S = 0.005


@dataclass
class RequestSource:
    """The run's requests as HTTP bytes, each made from the workload when it is about to be
    sent: a run of 100,000 requests starts at once and holds one request's bytes per stream."""
    workload: workloads.Workload
    target: Target
    api: str                  # a name of apis.APIS
    extra: dict[str, Any]     # --extra-body, merged last
    run_id: str
    documents: int = 0        # score: the documents paired with each request's text
    indices: list[int] | None = None  # a worker's share of the workload
    images: images.ImageSource | None = None  # chat: the images each request carries (--images)

    def __len__(self) -> int:
        return self.workload.count if self.indices is None else len(self.indices)

    def index_of(self, i: int) -> int:
        """The workload's index of this source's request i (a part's i is its own count)."""
        return i if self.indices is None else self.indices[i]

    @property
    def path(self) -> str:
        return apis.APIS[self.api].path

    def get(self, i: int) -> tuple[bytes, workloads.Spec]:
        index = self.index_of(i)
        spec = self.workload.spec(index)
        documents = [self.workload.document(index, k, self.documents) for k in range(self.documents)]
        body = apis.body(self.api, self.target.model, spec.prompt, spec.messages, spec.output_tokens, documents)
        if self.images is not None:
            body = images.with_images(body, self.images.parts(index))
        return request_bytes(self.target, self.path, {**body, **self.extra}, f"bench-{self.run_id}-{index}"), spec

    def subset(self, indices: list[int]) -> "RequestSource":
        mine = indices if self.indices is None else [self.indices[i] for i in indices]
        return RequestSource(self.workload, self.target, self.api, self.extra, self.run_id, self.documents, mine,
                             self.images)


@dataclass
class Plan:
    """What to send: the first `warmup` requests are warm-up requests, sent at the same
    concurrency and not counted. `offsets_s` are intended send times, per request (an open loop's
    arrivals, drawn once for the whole run, or a trace's): with them the measured requests go out
    on that schedule, else as slots free up (a closed loop)."""
    requests: RequestSource
    warmup: int
    concurrency: int | None
    duration_s: float | None = None
    # Sessions (--multi-turn, agent sessions): the turns of session i, each sent with the history
    # (the earlier turns' messages and the answers the server gave); requests[i] stands for the session.
    turns: list[list[sessions.Turn]] | None = None
    offsets_s: list[float] | None = None
    # The wall-clock time (ns since the epoch) the measured phase starts at (--start-at): after
    # the warm-up every part of the run waits for it, on whatever machine it runs.
    start_at_ns: int | None = None
    # The shuffled control of sessions: each turn's messages first, the history after them in an
    # order drawn from this seed (sessions.arranged); None: in order.
    shuffle_seed: int | None = None

    def part(self, indices: list[int], concurrency: int | None) -> "Plan":
        """The requests (conversations) `indices` of this plan, sent with `concurrency` in flight."""
        return Plan(self.requests.subset(indices), sum(i < self.warmup for i in indices), concurrency,
                    self.duration_s,
                    None if self.turns is None else [self.turns[i] for i in indices],
                    None if self.offsets_s is None else [self.offsets_s[i] for i in indices], self.start_at_ns,
                    self.shuffle_seed)


def share(plan: Plan, number: int, parts: int) -> tuple[list[int], Plan]:
    """Part `number` of `parts` of a plan, as worker processes (--workers) and machines (--shard)
    split it: (its request indices in the plan, its plan). Requests go round robin (requests
    number, number + parts, ...), so every part gets its share of the warm-up and of the measured
    requests, and no request is in two parts; the concurrency is divided (the first parts take
    the remainder); an open loop's or a trace's send times stay the whole plan's, so the parts
    together keep its rate, burstiness and schedule exactly."""
    indices = list(range(number, len(plan.requests), parts))
    concurrency = None if plan.concurrency is None else \
        max(1, plan.concurrency // parts + (number < plan.concurrency % parts))
    return indices, plan.part(indices, concurrency)


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Absolute send offsets (s) of an open-loop run: gamma gaps (burstiness 1 = Poisson),
    rescaled so the last request goes out at count/rate exactly (as vLLM does)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(t)
    scale = (count / rate) / offsets[-1] if offsets and offsets[-1] > 0 else 1.0
    return [o * scale for o in offsets]


@dataclass
class RunResult:
    outcomes: list[Outcome]
    loop_lag_ms: list[float]
    cpu_s: float
    wall_s: float
    interrupted: bool = False
    measured_from_ns: int | None = None  # when the measured phase started (perf_counter ns; the latest part's)


async def lag_probe(samples: list[float], stop: asyncio.Event) -> None:
    """How late a timer fires: the time the loop was busy or the process was not scheduled,
    i.e. how long an arriving byte could wait before data_received timestamps it. asyncio
    rounds epoll timeouts up to whole milliseconds, so 1 ms of oversleep is not counted."""
    target = int(LAG_PROBE_S * 1e9)
    while not stop.is_set():
        start = time.perf_counter_ns()
        await asyncio.sleep(LAG_PROBE_S)
        samples.append(max(0.0, (time.perf_counter_ns() - start - target) / 1e6 - EPOLL_ROUNDING_MS))


async def _watchdog(client: Client, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.25)
        client.expire_stalled()


@dataclass
class _Sending:
    """One run's state in its event loop: the client, the outcomes so far, the Ctrl-C flag."""
    plan: Plan
    client: Client
    interrupt: asyncio.Event
    on_done: Callable[[Outcome], None] | None
    outcomes: list[Outcome] = field(default_factory=list)
    measured_from_ns: int | None = None  # when the measured phase started (perf_counter ns)

    def _done(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if self.on_done:
            self.on_done(outcome)

    async def one(self, index: int, scheduled_ns: int | None = None) -> None:
        if self.plan.turns is not None:
            return await self.conversation(index, scheduled_ns)
        request, spec = self.plan.requests.get(index)
        generates = apis.APIS[self.plan.requests.api].generates
        outcome = Outcome(index=index, warmup=index < self.plan.warmup, scheduled_ns=scheduled_ns,
                          requested_tokens=spec.output_tokens if generates else None,
                          prompt_target=None if self.plan.requests.documents else spec.prompt_tokens)
        await self.client.send(outcome, request)
        self._done(outcome)

    async def conversation(self, index: int, scheduled_ns: int | None) -> None:
        """The turns of one session, one after the other, each after its gap. Each answer is parsed
        at once (it is part of the next prompt): a little loop time that single-turn runs do not spend."""
        source = self.plan.requests
        session = source.index_of(index)
        history: list[dict[str, str]] = []
        before: list[dict[str, str]] | None = None  # the previous turn's messages and answer
        before_tokens = None
        for turn, step in enumerate(self.plan.turns[index]):
            if turn and step.gap_s and not await self._until(time.perf_counter_ns() + int(step.gap_s * 1e9)):
                return
            added = [m.as_chat() for m in step.messages]
            messages = sessions.arranged(history, added, self.plan.shuffle_seed, f"{session}/{turn}")
            request = request_bytes(source.target, source.path, {**apis.body(
                source.api, source.target.model, None, messages, step.output_tokens), **source.extra},
                f"bench-{source.run_id}-{session}-{turn}")
            outcome = Outcome(index=index, turn=turn, warmup=index < self.plan.warmup,
                              scheduled_ns=scheduled_ns if turn == 0 else None, requested_tokens=step.output_tokens)
            settle(await self.client.send(outcome, request), source.api)
            outcome.perfect_tokens = sessions.perfect_tokens(before, before_tokens, messages, outcome.prompt_tokens)
            self._done(outcome)
            if not outcome.ok or self.interrupt.is_set():
                return
            answer = {"role": "assistant", "content": outcome.text}
            history += [*added, answer]
            before = [*messages, answer]
            before_tokens = None if outcome.prompt_tokens is None or outcome.completion_tokens is None \
                else outcome.prompt_tokens + outcome.completion_tokens

    async def closed_loop(self, indices: list[int], deadline_ns: int | None) -> None:
        queue = iter(indices)
        slots = min(self.plan.concurrency or 1, len(indices)) or 1
        await asyncio.gather(*(self._slot(queue, deadline_ns) for _ in range(slots)))

    async def _slot(self, queue: Iterator[int], deadline_ns: int | None) -> None:
        """One request in flight at a time, taken from the queue the slots share."""
        for index in queue:
            if self.interrupt.is_set() or (deadline_ns and time.perf_counter_ns() >= deadline_ns):
                return
            await self.one(index)

    async def open_loop(self, indices: list[int], start: int) -> None:
        """The requests `indices` at their intended times after `start` (perf_counter ns)."""
        plan = self.plan
        limit = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
        deadline = start + int(plan.duration_s * 1e9) if plan.duration_s else None
        tasks = []
        for index in indices:
            scheduled = start + int(plan.offsets_s[index] * 1e9)
            if deadline and scheduled >= deadline:
                break
            if not await self._until(scheduled):
                break
            tasks.append(asyncio.create_task(self._capped(limit, index, scheduled)))
        await asyncio.gather(*tasks)

    async def _until(self, moment_ns: int) -> bool:
        """Wait until `moment_ns` (perf_counter ns); False when a Ctrl-C came first."""
        delay = (moment_ns - time.perf_counter_ns()) / 1e9
        if delay > 0:
            try:
                await asyncio.wait_for(self.interrupt.wait(), delay)
            except asyncio.TimeoutError:
                pass
        return not self.interrupt.is_set()

    async def _capped(self, limit: asyncio.Semaphore | None, index: int, scheduled: int) -> None:
        if limit is None:
            return await self.one(index, scheduled)
        async with limit:
            await self.one(index, scheduled)

    def measured_start(self) -> int:
        """When the measured phase starts (perf_counter ns): now, or the plan's wall-clock start
        on this machine's monotonic clock when that is still ahead."""
        now = time.perf_counter_ns()
        if self.plan.start_at_ns is None:
            return now
        return max(now, now + self.plan.start_at_ns - time.time_ns())

    async def phases(self, before_measured: Callable[[], Any] | None) -> None:
        """The warm-up, then (once `before_measured` agrees, at the plan's start time) the
        measured requests."""
        plan = self.plan
        indices = list(range(len(plan.requests)))
        warm, measured = indices[:plan.warmup], indices[plan.warmup:]
        if warm:
            await self.closed_loop(warm, None)
        if before_measured and not await before_measured():  # workers start measuring together
            return
        start = self.measured_start()
        if not await self._until(start):
            return
        self.measured_from_ns = start
        if plan.offsets_s is not None:
            await self.open_loop(measured, start)
        else:
            deadline = start + int(plan.duration_s * 1e9) if plan.duration_s else None
            await self.closed_loop(measured, deadline)


async def run_plan(plan: Plan, timeout_s: float,
                   before_measured: Callable[[], Any] | None = None, on_done: Callable[[Outcome], None] | None = None,
                   interrupt: asyncio.Event | None = None) -> RunResult:
    """Send the plan; returns every outcome (warm-up ones flagged). Ctrl-C (interrupt) stops
    sending and returns what completed."""
    client = Client(plan.requests.target, timeout_s)
    stop = asyncio.Event()
    interrupt = interrupt or asyncio.Event()
    sending = _Sending(plan, client, interrupt, on_done)
    lag: list[float] = []
    # A full garbage collection over a heap of stored reads takes tens of ms and stalls every
    # stream; refcounting frees what the run drops, so the collector waits until the end. No
    # collection here either: in a long-lived caller (sweep's levels, an agent's process) its
    # cost is the caller's whole heap, and freezing sets that heap aside at no cost.
    gc.freeze()
    gc.disable()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    background = [asyncio.create_task(lag_probe(lag, stop)), asyncio.create_task(_watchdog(client, stop))]
    work = asyncio.create_task(sending.phases(before_measured))
    waiter = asyncio.create_task(interrupt.wait())
    try:
        await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if interrupt.is_set() and not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        elif work.done():
            work.result()
    finally:
        waiter.cancel()
        stop.set()
        for task in background:
            task.cancel()  # not waiting out the watchdog's and the lag probe's sleeps
        await asyncio.gather(*background, waiter, return_exceptions=True)
        client.close()
        gc.enable()
        gc.unfreeze()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return RunResult(sorted((settle(o, plan.requests.api) for o in sending.outcomes), key=lambda o: (o.index, o.turn)),
                     lag, cpu_s, wall_s, interrupted=interrupt.is_set(), measured_from_ns=sending.measured_from_ns)


def raise_open_file_limit(needed: int) -> None:
    """One socket per stream: lift the soft limit on open files towards the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted, hard))


def run_in_loop(plan: Plan, timeout_s: float, quiet: bool = False,
                before_measured: Callable[[], Any] | None = None,
                hold: signals.SignalHold | None = None) -> RunResult:
    """asyncio.run with Ctrl-C turned into 'stop and keep what was measured'. From the end of the
    run a further Ctrl-C or SIGTERM waits in `hold` (the caller completes and writes the result)."""
    raise_open_file_limit(plan.concurrency or len(plan.requests))

    async def body() -> RunResult:
        interrupt = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, interrupt.set)
            loop.add_signal_handler(signal.SIGTERM, interrupt.set)
        except (NotImplementedError, RuntimeError):
            pass
        # A worker starts with them blocked: one that came while it started up stops it now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.STOP_SIGNALS)
        try:
            return await run_plan(plan, timeout_s, before_measured,
                                  None if quiet else _Progress(plan), interrupt)
        finally:  # asyncio resets the handlers to the defaults (die) as it closes the loop:
            # from here a signal waits until the caller's handlers are back
            signal.pthread_sigmask(signal.SIG_BLOCK, signals.STOP_SIGNALS)
    handlers = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the caller's (a worker's blocks them)
    run = None
    try:
        run = asyncio.run(body())
    finally:
        interrupted = _handlers_back(handlers, hold, run is not None and run.interrupted)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    run.interrupted = interrupted
    return run


def _handlers_back(handlers: dict[int, Any], hold: signals.SignalHold | None, interrupted: bool) -> bool:
    """Put the caller's signal handlers back, with the signals blocked, and start `hold`: from the
    end of the run a Ctrl-C or SIGTERM is noted, not obeyed, so it cannot lose what was measured.
    Whether the run was interrupted (a signal waiting came as it ended)."""
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if hold is not None:
        hold.start()
    return interrupted or bool(set(signal.sigpending()) & set(signals.STOP_SIGNALS))


class _Progress:
    """Prints how many requests are done, at most every 2 s and at the last one."""

    def __init__(self, plan: Plan):
        self.total = sum(map(len, plan.turns)) if plan.turns else len(plan.requests)
        self.done = 0
        self.last = 0.0

    def __call__(self, outcome: Outcome) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= 2.0 or self.done == self.total:
            self.last = now
            printing.progress(f"bench: {self.done}/{self.total} requests done")


def _worker(number: int, plan: Plan, timeout_s: float, barrier, queue) -> None:
    # Ctrl-C and SIGTERM are blocked since run_workers started us: run_in_loop unblocks them once
    # its loop handles them, so one that came while we started up stops the run at once (we send
    # what we measured, maybe nothing) instead of killing us or printing a traceback. After the
    # run they stay blocked: the result is sent whatever comes. The parent passes Ctrl-C on as SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def meet() -> bool:
        try:
            await asyncio.to_thread(barrier.wait)
            return True
        except threading.BrokenBarrierError:  # the parent was interrupted during warm-up
            return False
    queue.put((number, run_in_loop(plan, timeout_s, quiet=True, before_measured=meet)))


def run_workers(plan: Plan, workers: int, timeout_s: float, hold: signals.SignalHold | None = None) -> RunResult:
    """Split the plan over worker processes (`share`, as --shard splits it over machines). They
    finish their warm-up, meet at a barrier and start the measured phase together; they share
    CLOCK_MONOTONIC, so their timestamps merge directly. A Ctrl-C or SIGTERM stops them and keeps what they measured;
    from the end of the run a further one waits in `hold`."""
    # A Ctrl-C or SIGTERM is noted and acted on between steps, not raised in the middle of
    # multiprocessing (a worker left unstarted or unstopped, a semaphore leaked).
    stops: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum)) for sig in signals.STOP_SIGNALS}
    try:
        shares, results = _share_out(plan, workers, timeout_s, stops)
    finally:
        with signals.signals_blocked(*signals.STOP_SIGNALS):
            interrupted = _handlers_back(handlers, hold, bool(stops))
    outcomes, lag = [], []
    for number, result in results.items():
        for outcome in result.outcomes:
            outcome.index = shares[number][outcome.index]
            outcomes.append(outcome)
        lag += result.loop_lag_ms
    starts = [r.measured_from_ns for r in results.values() if r.measured_from_ns is not None]
    return RunResult(sorted(outcomes, key=lambda o: (o.index, o.turn)), lag,
                     max((r.cpu_s for r in results.values()), default=0.0),
                     max((r.wall_s for r in results.values()), default=0.0),
                     interrupted or any(r.interrupted for r in results.values()), max(starts, default=None))


def _share_out(plan: Plan, workers: int, timeout_s: float,
               stops: list[int]) -> tuple[list[list[int]], dict[int, RunResult]]:
    """Run the workers: each one's share of the request indices, and the results they sent.
    Once `stops` has a signal, they stop and send what they measured."""
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(workers), context.Queue()
    shares, processes = [], []
    for number in range(workers):
        mine, sub = share(plan, number, workers)
        shares.append(mine)
        processes.append(context.Process(target=_worker, daemon=True,
                                         args=(number, sub, timeout_s, barrier, queue)))
    with signals.signals_blocked(*signals.STOP_SIGNALS):  # the workers inherit the mask (see _worker)
        for process in processes:
            process.start()
    results: dict[int, RunResult] = {}
    stopping = False
    while len(results) < workers:
        if stops and not stopping:
            stopping = True
            barrier.abort()
            for process in processes:
                if process.is_alive():
                    process.terminate()  # SIGTERM: the worker stops and sends what it measured
        try:
            number, result = queue.get(timeout=0.1)
            results[number] = result
        except Empty:
            gone = [p for n, p in enumerate(processes) if n not in results and not p.is_alive()]
            if gone and queue.empty():
                if not stops:
                    raise ServerError(f"a client worker process exited with status {gone[0].exitcode} "
                                      "without results; run with --workers 1 to see why")
                if len(gone) == workers - len(results):  # interrupted: keep what the others sent
                    break
    for process in processes:
        process.join()
    return shares, results
