"""One examination: the server's own word, a passive window, a light probe, the budget of the
user's symptom, the root cause with its owner and value, and the commands that prove it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from rooflib.core import http_client, printing
from rooflib.core.errors import ServerError
from rooflib.core.taskcall import TaskCall
from rooflib.doctor import budget as budgets
from rooflib.doctor import causes, failures, probe, tradeoff, window
from rooflib.doctor.evidence import Engine, Failures, Finding, Owner, Probe, Setting, Targets
from rooflib.load import promptgen
from rooflib.load.apis import APIS
from rooflib.load.asyncclient import Target, find_target
from rooflib.server import deployment, engine_metrics, report_text, slo_targets, snapshots
from rooflib.server.known_settings import LIGHT_C, LIGHT_N

DEFAULT_PROMPT, DEFAULT_OUTPUT = 256, 64
OUTPUT_RANGE = (96, 256)     # enough tokens to see a stream's shape, few enough to stay light
ALSO_SHARE = 0.2             # a part this large of a figure is listed under Also


@dataclass(frozen=True)
class Options:
    url: str
    replicas: tuple[str, ...]
    api_key: str | None
    model: str | None
    symptom: str
    targets: Targets
    give: str                 # "queue" or "speed": what the user gives when the two conflict
    window_s: float
    probe_n: int
    probe_c: int
    prompt_tokens: int | None  # the users' prompt length, when they know it
    timeout: float
    call: TaskCall


@dataclass(frozen=True)
class Verdict:
    budgets: tuple[budgets.Budget, ...]
    root: Finding | None
    also: tuple[Finding, ...]
    verify: tuple[str, ...]
    facts: budgets.Facts


# ---------------------------------------------------------------------------------------------
# The facts

def engine_of(r: dict[str, Any]) -> Engine:
    def ms(name: str, key: str) -> float | None:
        """A figure of the report; a quantile in the histogram's first bucket is its upper bound."""
        row = r[f"{name}_ms"]
        return row[key] if row[key] is not None else row["at_most"].get(key)
    return Engine(
        engine=r["engine"], seconds=r["seconds"], requests=r["requests"], ttft_mean=ms("ttft", "mean"),
        ttft_p95=ms("ttft", "p95"), queue_mean=ms("queue", "mean"), queue_p95=ms("queue", "p95"),
        prefill_mean=ms("prefill", "mean"), tpot_mean=ms("tpot", "mean"), tpot_p95=ms("tpot", "p95"),
        itl_mean=ms("itl", "mean"), itl_p95=ms("itl", "p95"), itl_p99=ms("itl", "p99"), e2e_mean=ms("e2e", "mean"),
        running_mean=r["running_mean"], running_peak=r["running_peak"], waiting_mean=r["waiting_mean"],
        waiting_peak=r["waiting_peak"], kv_usage_max=r["kv_cache_usage_max"], kv_cache_tokens=r["kv_cache_tokens"],
        preemptions=r["preemptions"], prompt_tokens_mean=r["prompt_tokens_mean"],
        output_tokens_mean=r["output_tokens_mean"], gen_tok_s=r["gen_tok_s"], endpoint=r["endpoint"], report=r)


def settings_of(r: dict[str, Any]) -> dict[str, Setting]:
    return {name: Setting(name, known["value"], known["source"], known["how"], known.get("at_least", False))
            for name, known in r["settings"].items()}


def plan_probe(opts: Options, target: Target, first: dict[str, Any], counter: promptgen.TokenCounter | None
               ) -> probe.Plan:
    """Prompts shaped like the traffic so far (its endpoint, its finished requests' lengths), or
    the defaults on an idle server; one request over the limit when failures are the question."""
    limit = target.info.get("max_model_len")
    out = min(max(round(first.get("output_tokens_mean") or DEFAULT_OUTPUT), OUTPUT_RANGE[0]), OUTPUT_RANGE[1])
    prompt = round(first.get("prompt_tokens_mean") or DEFAULT_PROMPT)
    if limit:
        prompt = max(1, min(prompt, limit - out - 8))
    endpoint = "chat" if first.get("endpoint") == "chat" else "completions"
    counter = counter or promptgen.fallback_counter()
    prompts = tuple(promptgen.build_prompts(counter, opts.probe_n, prompt, 0, seed=7))
    over = None
    if limit and opts.symptom in ("errors", "all"):
        over = " ".join(promptgen.WORDS[i % len(promptgen.WORDS)] for i in range(limit + 16))
    return probe.Plan(endpoint, prompts, out, opts.probe_c, over)


class Attribution:
    """Which replica served each probe stream: the replica whose finished-request counter rose by
    one while the others stood still (other traffic finishing meanwhile leaves it unattributed)."""

    def __init__(self, replicas: Sequence[str], api_key: str | None, timeout: float):
        self.replicas, self.api_key, self.timeout = list(replicas), api_key, timeout
        self.before: dict[int, list[float]] = {}
        self.served: dict[int, str | None] = {}

    def _counts(self) -> list[float]:
        counts = []
        for url in self.replicas:
            snap = window.scrape(url, self.api_key, self.timeout).snap
            counts.append(snap["histograms"].get("e2e", {}).get("count", 0.0))
        return counts

    def __call__(self, index: int, when: str) -> None:
        if when == "before":
            self.before[index] = self._counts()
            return
        rose = [after - before for before, after in zip(self.before[index], self._counts())]
        moved = [i for i, d in enumerate(rose) if d > 0]
        self.served[index] = self.replicas[moved[0]] if len(moved) == 1 and rose[moved[0]] == 1 else None


def gather(opts: Options) -> tuple[budgets.Facts, list[window.Window], dict[str, Any]]:
    """The server's word, the window with the probe inside it, and the facts for the budgets."""
    target = find_target(Target(opts.url, opts.api_key), opts.model, opts.timeout)
    metrics_urls = list(opts.replicas) or [opts.url]
    first_snap = window.scrape(metrics_urls[0], opts.api_key, opts.timeout).snap
    engine = first_snap["engine"]
    so_far = engine_metrics.report(first_snap)
    endpoint = "chat" if so_far.get("endpoint") == "chat" else "completions"
    with http_client.client(target.base_url, target.api_key, opts.timeout) as http:
        plan = plan_probe(opts, target, so_far, promptgen.server_counter(http, target.model, endpoint == "chat"))
    served = deployment.server_settings(metrics_urls[0], engine, opts.api_key, opts.timeout)
    attribution = Attribution(opts.replicas, opts.api_key, opts.timeout) if len(opts.replicas) > 1 else None
    printing.progress(f"probe: {len(plan.prompts)} requests to {opts.url} while /metrics is read each second")
    windows, found, error, interrupted = window.collect(
        metrics_urls, opts.api_key, opts.timeout, opts.window_s, lambda: probe.run(target, plan, opts.timeout, attribution))
    if error is not None:
        raise error if isinstance(error, (ServerError, KeyboardInterrupt)) else ServerError(f"the probe failed: {error}")
    # Ctrl-C before the probe ended: the window so far is still reported, without the probe.
    measured: Probe = found or Probe(load="interrupted before the probe finished", routes=(), streams=())
    if attribution:
        measured = replace(measured, replica_of_stream=tuple(attribution.served.get(i) for i in range(len(plan.prompts))))
    facts, extra = facts_of(opts, windows, measured, served, APIS[plan.endpoint].path)
    return facts, windows, {**extra, "target": target.info, "interrupted": interrupted}


def blind(r: dict[str, Any]) -> Engine:
    """An engine none of whose figures can be read (its URL's scrapes mix engines)."""
    known = engine_of(r)
    return Engine(engine=known.engine, seconds=known.seconds, requests=0, **{
        name: None for name in Engine.__dataclass_fields__
        if name not in ("engine", "seconds", "requests", "report", "ttft_buckets")},
        report=r)


def facts_of(opts: Options, windows: Sequence[window.Window], measured: Probe, served: deployment.Served,
             handler: str) -> tuple[budgets.Facts, dict[str, Any]]:
    """The budgets' facts from the windows (merged over replicas; none of the engine's figures
    when a URL's scrapes mix engines: the probe's own timings still hold) and the probe."""
    slo = slo_targets.Targets(opts.targets.ttft_p95_ms, opts.targets.tpot_p95_ms, opts.targets.gap_p95_ms)
    mixed = "; ".join(w.mixed for w in windows if w.mixed)
    deltas = [w.delta() for w in windows]
    merged = deltas[0] if len(deltas) == 1 else snapshots.merge(deltas)
    if len(deltas) > 1:
        merged["seconds"] = max(d["seconds"] or 0 for d in deltas)
    report = engine_metrics.report(merged, slo=slo, served=served if len(deltas) == 1 else None)
    fails = [failures.between(w.first.exposition, w.last.exposition) for w in windows if not w.mixed]
    failed = failures.without_probe(failures.combined(fails), measured, handler)
    model, note = tradeoff.fit(windows[0].snaps) if len(windows) == 1 and not mixed else \
        (None, "several engines: no single fit")
    ttft = merged["histograms"].get("ttft") or {}
    engine = blind(report) if mixed else replace(engine_of(report), ttft_buckets=tuple(
        zip(ttft["le"], ttft["counts"])) if ttft.get("counts") is not None else ())
    facts = budgets.Facts(symptom=opts.symptom, targets=opts.targets, engine=engine,
                          probe=measured, failures=failed, settings=settings_of(report), fit=model, fit_note=note,
                          url=opts.url, mixed=mixed, diagnosis={} if mixed else report["diagnosis"])
    extra = {"replicas": [{"url": w.url, "mixed": w.mixed or None} for w in windows],
             "replica_reports": [engine_metrics.report(d, slo=slo) for d in deltas] if len(deltas) > 1 else []}
    return facts, extra


# ---------------------------------------------------------------------------------------------
# The verdict

def verify(opts: Options, facts: budgets.Facts, root: Finding | None) -> list[str]:
    """Light benches before and after the change (the traffic's lengths, 2 at a time), compare,
    and the doctor again for the symptom; for rejections the users' lengths, over the limit."""
    e = facts.engine
    prompt = round(e.prompt_tokens_mean or DEFAULT_PROMPT)
    output = round(e.output_tokens_mean or DEFAULT_OUTPUT)
    flags = ["--endpoint", "chat"] if facts.probe.endpoint == "chat" else []
    if root is not None and root.cause == "context_length" and root.proposed:
        users = (opts.prompt_tokens or max(prompt, (root.proposed or prompt * 2) // 2))
        prompt, flags = users, flags + ["--over-limit"]
    variables = [("INFER_URL", opts.url), ("BENCH_IN", prompt), ("BENCH_OUT", output), ("BENCH_C", LIGHT_C),
                 ("BENCH_N", LIGHT_N)]
    if "ttft_p95_ms" in facts.targets.given or "tpot_p95_ms" in facts.targets.given:
        variables += [("SLO_TTFT_P95_MS", f"{facts.targets.ttft_p95_ms:g}"),
                      ("SLO_TPOT_P95_MS", f"{facts.targets.tpot_p95_ms:g}")]
    bench = [opts.call.command("bench", variables, [*flags, "--json-out", name]) for name in ("before.json", "after.json")]
    doctor = opts.call.command("doctor", [("INFER_URL", opts.url), ("SYMPTOM", opts.symptom)])
    return [bench[0], bench[1], opts.call.command("compare", [("A", "before.json"), ("B", "after.json")]), doctor]


def decide(opts: Options, facts: budgets.Facts) -> Verdict:
    found = budgets.budgets(facts)
    lead = found[0]
    root = None
    also: list[Finding] = []
    if lead.misses and lead.largest is not None:
        root = causes.explain(facts, lead, lead.largest, opts.prompt_tokens)
        others = [s for s in lead.segments if s is not lead.largest and lead.users_share(s) >= ALSO_SHARE]
        also += [causes.explain(facts, lead, s, opts.prompt_tokens) for s in others]
    for other in found[1:]:
        if other.misses and other.largest is not None:
            also.append(causes.explain(facts, other, other.largest, opts.prompt_tokens))
    also = [a for a in also if root is None or (a.cause, a.segment) != (root.cause, root.segment)]
    if facts.mixed:
        also.insert(0, Finding("engine", "mixed_engines", f"{facts.mixed}: the engine's figures are left out, the "
                               "probe's own timings stand", Owner("the balancer in front of the engines"), None,
                               "give each engine's own URL (--replica, REPLICAS=url,url)",
                               "one engine's /metrics is one engine's", "figures per engine", "high"))
    return Verdict(tuple(found), root, tuple(also), tuple(verify(opts, facts, root) if root else ()), facts)


# ---------------------------------------------------------------------------------------------
# Output

def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else "unknown"
    return f"{value:,}" if isinstance(value, int) else f"{value}"


def first_line(verdict: Verdict) -> str:
    lead = verdict.budgets[0]
    if verdict.root is None:
        figure = "n/a" if lead.value is None else _figure(lead.value, lead.unit)
        return (f"Root cause: none for {lead.symptom}: {lead.figure} {figure} is within its target"
                + (f" {_figure(lead.target, lead.unit)}" if lead.target is not None else "")
                + (f" ({lead.note})" if lead.note else ""))
    root = verdict.root
    seg = next(s for s in lead.segments if s.name == root.segment)
    figure = lead.figure.split(" (")[0]
    share = (f"{_figure(seg.size, lead.unit)} of {figure} {_figure(lead.value, lead.unit)}" if lead.unit == "ms"
             else f"{seg.size:.1%} of requests" if lead.symptom == "errors" else f"{seg.share:.0%} of {figure}")
    owner = root.owner.setting.said() if root.owner.setting else root.owner.component
    # The action's first clause: the rest (how to confirm) is in the lines below.
    change = (f" -> set {root.owner.setting.flag} {_value(root.proposed)}" if root.owner.setting and root.proposed is not None
              else f" -> {root.action.split(':')[0]}" if root.action else "")
    return f"Root cause: [{root.segment}] {root.cause} ({share}); owner: {owner}{change}"


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "share":
        return f"{value:.1%}"
    if unit == "tok/s":
        return f"{value:,.0f} tok/s"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.1f} ms"


def human_text(verdict: Verdict, extra: dict[str, Any]) -> str:
    facts = verdict.facts
    lines = [first_line(verdict)]
    if verdict.root:
        root = verdict.root
        lines += [f"  do: {root.action}" if root.action and ":" in root.action else "",
                  f"  evidence: {root.evidence} (confidence {root.confidence})",
                  f"  why: {root.reason}" if root.reason else "", f"  expect: {root.effect}" if root.effect else ""]
    for finding in verdict.also:
        owner = finding.owner.setting.said() if finding.owner.setting else finding.owner.component
        lines.append(f"Also: [{finding.segment}] {finding.cause}: {finding.evidence}; owner: {owner}")
    if facts.mixed:
        lines.append(f"Warning: {facts.mixed}; give each engine's own URL with --replica for figures per engine")
    for b in verdict.budgets:
        target = f", target {_figure(b.target, b.unit)}" if b.target is not None else ""
        lines.append(f"Budget ({b.symptom}): {b.figure} {_figure(b.value, b.unit)}{target}"
                     + (" MISSES" if b.misses else "") + (f"; {b.note}" if b.note else ""))
        for seg in sorted(b.segments, key=lambda s: -s.size):
            size = f"{seg.size:.1%}" if b.unit == "share" else _figure(seg.size, b.unit)
            lines.append(f"  {seg.name:<16} {size:>10} {seg.share:>5.0%}  {seg.measured}")
    for replica in extra.get("replica_reports", []):
        lines.append(f"Replica: {report_text.format_replica_line(replica).strip()}")
    served_by = [url for url in facts.probe.replica_of_stream]
    if served_by:
        named = sum(1 for url in served_by if url)
        lines.append(f"Probe requests by replica: " + ", ".join(url or "not attributed" for url in served_by)
                     + ("" if named == len(served_by) else " (other requests finished on several replicas meanwhile)"))
    lines.append(f"Probe: {facts.probe.load}")
    for route in facts.probe.routes:
        lines.append(f"  {route.path}: HTTP {route.status}, head {_figure(route.reused_ms, 'ms')} kept alive, "
                     f"{_figure(route.new_ms, 'ms')} new (connect {_figure(route.connect_ms, 'ms')})")
    if verdict.verify:
        lines.append(f"Verify (light: {LIGHT_C} at a time, {LIGHT_N} requests):")
        steps = ("now", "after the change", "then", "and the symptom again")
        lines += [f"  {step}: {command}" for step, command in zip(steps, verdict.verify)]
    return "\n".join(line for line in lines if line)


def as_json(verdict: Verdict, extra: dict[str, Any]) -> dict[str, Any]:
    facts = verdict.facts
    return {
        "kind": "doctor", "schema_version": 1, "url": facts.url, "symptom": facts.symptom,
        "first_line": first_line(verdict),
        "root": causes.as_json(verdict.root) if verdict.root else None,
        "also": [causes.as_json(a) for a in verdict.also],
        "budgets": [{"symptom": b.symptom, "figure": b.figure, "value": b.value, "target": b.target, "unit": b.unit,
                     "misses": b.misses, "note": b.note,
                     "segments": [{"name": s.name, "size": s.size, "share": s.share, "measured": s.measured}
                                  for s in b.segments]} for b in verdict.budgets],
        "targets": {"ttft_p95_ms": facts.targets.ttft_p95_ms, "tpot_p95_ms": facts.targets.tpot_p95_ms,
                    "gap_p95_ms": facts.targets.gap_p95_ms, "error_share": facts.targets.error_share,
                    "given": list(facts.targets.given)},
        "fit": None if facts.fit is None else {**facts.fit.__dict__}, "fit_note": facts.fit_note or None,
        "probe": _probe_json(facts.probe), "failures": _failures_json(facts.failures),
        "mixed_engines": facts.mixed or None, "verify": list(verdict.verify),
        "engine": facts.engine.report, **extra,
    }


def _probe_json(p: Probe) -> dict[str, Any]:
    return {"load": p.load, "endpoint": p.endpoint, "routes": [r.__dict__ for r in p.routes],
            "streams": [{**s.__dict__, "tokens_per_event": list(s.tokens_per_event),
                         "events_per_read": list(s.events_per_read), "text_gaps_ms": list(s.text_gaps_ms)}
                        for s in p.streams],
            "over_limit": None if p.over_limit is None else {"status": p.over_limit.status,
                                                             "error": p.over_limit.error, "detail": p.over_limit.detail},
            "replica_of_stream": list(p.replica_of_stream)}


def _failures_json(f: Failures) -> dict[str, Any]:
    return {"statuses": [s.__dict__ for s in f.statuses], "finished": f.finished,
            "request_bytes_mean": f.request_bytes_mean, "note": "the probe's own requests are left out"}

