"""Failures by the server's own counters, and the cause an error body names.

vLLM's API server counts every request by route and status class
(http_requests_total{handler, method, status="2xx"|"4xx"|"5xx"}, prometheus-fastapi-instrumentator,
which groups status codes by default), rejected ones included: the engine's histograms see only
the requests it ran. vLLM counts finished requests by why they finished
(vllm:request_success_total{finished_reason="stop"|"length"|"abort"|"error"|...}: `abort` is a
client that went away, or a cancelled request). http_request_size_bytes (a summary per route)
sizes every request the route received. vLLM 0.32 counts the requests its own admission limits
turned away with HTTP 503 (vllm:admission_rejections_total{reason="max_num_queued_reqs"|
"max_num_queued_tokens"}, AsyncLLM.check_admission in vllm/v1/engine/async_llm.py).
"""
from __future__ import annotations

import re
from typing import Sequence, TypeVar

from rooflib.doctor.evidence import Failures, Probe, StatusCount
from rooflib.server.prometheus_text import Exposition

# (counter, label): finished requests by why, requests the admission limits turned away by which.
FINISHED = ("vllm:request_success_total", "finished_reason")
REJECTED = ("vllm:admission_rejections_total", "reason")
K = TypeVar("K")
INFERENCE_ROUTE = re.compile(r"^/v1/(chat/)?completions$|^/v1/(responses|messages|embeddings)$|^/generate$")


def _statuses(exposition: Exposition) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for labels, value in exposition.samples.get("http_requests_total", []):
        key = (labels.get("handler", ""), labels.get("status", ""))
        counts[key] = counts.get(key, 0.0) + value
    return counts


def _by_label(exposition: Exposition, metric: str, label: str) -> dict[str, float]:
    """A counter's samples summed by one label's value."""
    counts: dict[str, float] = {}
    for labels, value in exposition.samples.get(metric, []):
        key = labels.get(label, "")
        counts[key] = counts.get(key, 0.0) + value
    return counts


def _increase(old: dict[K, float], new: dict[K, float]) -> dict[K, float]:
    """Each key's increase over the window, those that rose (a counter that fell counts from zero)."""
    rose = {key: (value - old.get(key, 0.0)) if value >= old.get(key, 0.0) else value for key, value in new.items()}
    return {key: value for key, value in rose.items() if value > 0}


def _request_bytes(exposition: Exposition) -> tuple[float, float]:
    total = count = 0.0
    for suffix in ("_sum", "_count"):
        for labels, value in exposition.samples.get(f"http_request_size_bytes{suffix}", []):
            if INFERENCE_ROUTE.match(labels.get("handler", "")):
                if suffix == "_sum":
                    total += value
                else:
                    count += value
    return total, count


def between(before: Exposition, after: Exposition) -> Failures:
    """The window's failures: each counter's increase (a counter that fell counts from zero)."""
    statuses = _increase(_statuses(before), _statuses(after))
    finished = _by_label(after, *FINISHED)
    (sum0, n0), (sum1, n1) = _request_bytes(before), _request_bytes(after)
    return Failures(statuses=tuple(StatusCount(handler, status, count) for (handler, status), count
                                   in sorted(statuses.items()) if INFERENCE_ROUTE.match(handler)),
                    finished=_increase(_by_label(before, *FINISHED), finished), engine_counts=bool(finished),
                    request_bytes=sum1 - sum0 if n1 >= n0 else sum1, sized_requests=n1 - n0 if n1 >= n0 else n1,
                    admission=_increase(_by_label(before, *REJECTED), _by_label(after, *REJECTED)))


def combined(fails: Sequence[Failures]) -> Failures:
    """The failures of several engines' windows as one (each field summed, so none is dropped)."""
    def summed(by: Sequence[dict[str, float]]) -> dict[str, float]:
        return {key: sum(counts.get(key, 0.0) for counts in by) for counts in by for key in counts}
    return Failures(statuses=tuple(s for f in fails for s in f.statuses), finished=summed([f.finished for f in fails]),
                    engine_counts=any(f.engine_counts for f in fails), request_bytes=sum(f.request_bytes for f in fails),
                    sized_requests=sum(f.sized_requests for f in fails),
                    admission=summed([f.admission for f in fails]))


def without_probe(failures: Failures, probe: Probe, handler: str) -> Failures:
    """The window's failures less the probe's own requests (its request just over the limit
    fails on purpose): the users' traffic alone."""
    own: dict[str, float] = {}
    streams = [*probe.streams, *([probe.over_limit] if probe.over_limit else [])]
    for stream in streams:
        if stream.status is not None:
            status = f"{stream.status // 100}xx"
            own[status] = own.get(status, 0.0) + 1
    statuses = tuple(StatusCount(s.handler, s.status, max(0.0, s.count - own.get(s.status, 0.0)))
                     if s.handler == handler else s for s in failures.statuses)
    sent = [s for s in streams if s.status is not None]
    # The probe's requests run to max_tokens (ignore_eos): they finished by length.
    finished = dict(failures.finished)
    if "length" in finished:
        finished["length"] = max(0.0, finished["length"] - own.get("2xx", 0.0))
    return Failures(statuses=tuple(s for s in statuses if s.count > 0), finished=finished,
                    engine_counts=failures.engine_counts, admission=failures.admission,
                    request_bytes=max(0.0, failures.request_bytes - sum(s.request_bytes for s in sent)),
                    sized_requests=max(0.0, failures.sized_requests - len(sent)))


def gave_up(failures: Failures) -> float:
    """Requests the inference routes answered that the engine never finished: a client that goes
    away mid-request is counted by the HTTP layer (its status is the 200 it began with) and aborted
    in the engine, which counts no finished request for it (vLLM 0.32: OutputProcessor.abort_requests
    records no finish stats). Both count a request when it ends, so over a window the difference
    is the requests abandoned in it, less a few at its edges."""
    if not failures.engine_counts:
        return 0.0
    answered = sum(s.count for s in failures.statuses if s.status.startswith("2"))
    return max(0.0, answered - sum(failures.finished.values()))


def failed_share(failures: Failures) -> tuple[float, float, dict[str, float]]:
    """(failed, all, failed by "handler status") on the inference routes."""
    by: dict[str, float] = {}
    total = failed = 0.0
    for row in failures.statuses:
        total += row.count
        if not row.status.startswith(("2", "3")):
            failed += row.count
            key = f"{row.status} on {row.handler}"
            by[key] = by.get(key, 0.0) + row.count
    return failed, total, by


# What an error body says, in the words vLLM and SGLang use (vllm/entrypoints/openai/serving_engine.py:
# "This model's maximum context length is N tokens. However, you requested M tokens ...";
# SGLang: "... is longer than the model's context length (N tokens)"). The engines' own admission
# limits answer 503 with their own words: vLLM 0.32's QueueOverflowError and MaxQueuedTokensError
# (vllm/exceptions.py), SGLang's "The request queue is full." (Scheduler._abort_on_queued_limit).
CAUSES: Sequence[tuple[str, re.Pattern[str]]] = (
    ("max_num_queued_reqs", re.compile(r"currently busy and cannot accept new requests|request queue is full", re.I)),
    ("max_num_queued_tokens", re.compile(r"prefill token backlog limit", re.I)),
    ("context_length", re.compile(r"maximum context length|context length|max_model_len|too long", re.I)),
    ("rate_limited", re.compile(r"rate limit|too many requests", re.I)),
    ("auth", re.compile(r"api key|unauthori[sz]ed|forbidden", re.I)),
    ("wrong_model", re.compile(r"model .*(does not exist|not found)", re.I)),
    ("overloaded", re.compile(r"overload|capacity|try again", re.I)),
)
LIMIT_IN_BODY = re.compile(r"maximum context length is (\d+)|context length \((\d+) tokens\)", re.I)


def cause_of(detail: str) -> str | None:
    for cause, pattern in CAUSES:
        if pattern.search(detail or ""):
            return cause
    return None


def limit_in(detail: str) -> int | None:
    match = LIMIT_IN_BODY.search(detail or "")
    return int(next(g for g in match.groups() if g)) if match else None
