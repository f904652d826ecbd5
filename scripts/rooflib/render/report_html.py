"""The report: saved results (bench, sweep, accept, metrics, vram, roofline, compare) as HTML or text.

The answers come first, one sentence per result; then a section per result, built from the charts
of report_runs, report_changes and report_physics; then the page (templates/report.html.j2) or the
text. report_inputs reads the files, report_charts holds what the charts are made of.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from rooflib.core.errors import UsageError
from rooflib.load import analysis, sweeps
from rooflib.render.report_changes import VERDICT_CLASS, accept_chart, compare_chart, tune_section
from rooflib.render.report_charts import Section, fmt, number, signed_pct
from rooflib.render.report_inputs import Result, describe_workload
from rooflib.render.report_physics import physics_chart, sizing_charts
from rooflib.render.report_runs import bench_facts, distribution_chart, sweep_charts, sweep_facts, timeline_charts

TEMPLATE = Path(__file__).resolve().parent / "templates" / "report.html.j2"


# ---------------------------------------------------------------- answers first

def served_model(result: Result) -> str | None:
    """The model a bench or sweep measured, as the server named it."""
    doc = result.doc
    return (doc.get("config") or {}).get("model") or ((doc.get("server") or {}).get("info") or {}).get("model")


def _model_key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().rsplit("/", 1)[-1])


def model_mismatch(roofline: Result, measured: Sequence[Result]) -> list[str]:
    """A warning per measured run whose model's name does not contain the roofline's, or the other
    way round (Qwen/Qwen3-32B-FP8 is qwen3-32b): measured / bound then compares two models."""
    bound = str(roofline.doc.get("model") or "")
    out = []
    for r in measured:
        served = served_model(r)
        if bound and served and _model_key(bound) not in _model_key(served) and _model_key(served) not in _model_key(bound):
            out.append(f"the roofline is for {bound}, but {r.label} measured {served}: measured / bound compares "
                       "two different models unless they are the same one under another name")
    return out


def _bench_answer(doc: dict[str, Any]) -> str:
    verdict, reasons = str(doc.get("verdict")), list(doc.get("verdict_reasons") or [])
    throughput = doc.get("throughput") or {}
    if analysis.generates(doc.get("config") or {}):
        figure = (f"TTFT p95 {fmt((doc.get('ttft_ms') or {}).get('p95'))} ms, TPOT p95 "
                  f"{fmt((doc.get('tpot_ms') or {}).get('p95'))} ms, {fmt(throughput.get('output_tok_s'))} output tok/s")
        targets, further = "SLO_TTFT_P95_MS / SLO_TPOT_P95_MS", "a sweep finds how far it goes"
    else:  # a pooling API (embeddings, score): its latency and rates
        figure = (f"latency p95 {fmt((doc.get('e2e_ms') or {}).get('p95'))} ms, {fmt(throughput.get('req_s'))} req/s, "
                  f"{fmt(throughput.get('input_tok_s'))} input tok/s")
        targets, further = "SLO_LATENCY_P95_MS", "bench at a higher concurrency finds how far it goes"
    todo = {"PASS": f"the SLO holds at this load; {further}",
            "NO SLO": f"set {targets} to judge it"}.get(verdict)
    if todo is None:
        todo = (f"{reasons[0]}" if reasons else "see the run below") + (
            ": not a measurement of the server, rerun it" if verdict == "INVALID" else "")
    return f"{verdict}: {figure}; {todo}"


def _sweep_answer(doc: dict[str, Any]) -> str:
    k, points = doc.get("knee"), doc.get("points") or []
    if k:
        return (f"knee at C = {k['concurrency']}: {fmt(k.get('total_tok_s'))} total tok/s at TPOT p95 "
                f"{fmt((k.get('tpot_ms') or {}).get('p95'))} ms; serve at most {k['concurrency']} concurrent "
                "requests per replica at this workload")
    if not doc.get("slo_set"):
        return "no SLO set: the table is the throughput-latency trade-off; set an SLO to find the knee"
    reason = sweeps.no_knee_reason(points)
    todo = ("rerun on a quieter client machine" if reason.startswith("no valid point") else
            "lower the load per replica or change the setup (bench the first lever of metrics' finding)")
    return f"no knee: {reason}; {todo}"


def _compare_answer(doc: dict[str, Any]) -> str:
    verdict = str(doc.get("verdict"))
    moved = [m for m in doc.get("metrics") or [] if m.get("verdict") in ("better", "worse")
             and number(m.get("change_pct")) is not None]
    top = max(moved, key=lambda m: abs(m["change_pct"]), default=None)
    figure = (f"; largest change {top['name']} {signed_pct(top['change_pct'])} (95% CI {top['ci95_pct'][0]:+.1f}.."
              f"{top['ci95_pct'][1]:+.1f}%)" if top and top.get("ci95_pct") else "")
    todo = {"better": "take B", "worse": "keep A", "mixed": "weigh the metrics that moved against each other"}.get(
        verdict, "no evidence either way: more requests would narrow the intervals")
    a, b = (doc.get(side) or {} for side in ("a", "b"))
    return f"B ({b.get('label')}) against A ({a.get('label')}): {verdict}{figure}; {todo}"


def _accept_answer(doc: dict[str, Any]) -> str:
    verdict, reasons = str(doc.get("verdict")), list(doc.get("reasons") or [])
    todo = "the candidate can ship" if verdict == "PASS" else "do not ship the candidate"
    return f"{verdict}" + (f": {reasons[0]}" if reasons else "") + f"; {todo}"


def _vram_answer(doc: dict[str, Any]) -> str:
    typical = doc.get("typical") or {}
    text = (f"{'fits' if doc.get('fits') else 'does not fit'}" + (" (marginal)" if doc.get("marginal") else "")
            + f": {fmt(doc.get('max_concurrency'))} requests of {fmt(doc.get('ctx'))} tokens at once")
    if typical.get("max_concurrency") is not None:
        text += f", {fmt(typical['max_concurrency'])} of {fmt(typical.get('tokens'))}"
    if doc.get("fix"):
        return text + f"; cheapest change that fits: {doc['fix'].get('change')}"
    if not doc.get("fits"):
        return text + "; no lever fits: more GPUs or a smaller model"
    return text + (f"; {doc['marginal_reason']}" if doc.get("marginal") else "; it fits with margin")


def _roofline_answer(doc: dict[str, Any]) -> str:
    decode = doc.get("decode") or {}
    return (f"decode at batch {fmt(decode.get('batch'))} takes at least {fmt(decode.get('step_ms_bound'))} ms per token "
            f"({decode.get('bound_by')}-bound), at most {fmt(decode.get('tokens_per_s_per_user_bound'))} tok/s per "
            "user; a measured TPOT above 2.5x the bound is a configuration problem")


def _metrics_answer(doc: dict[str, Any]) -> str:
    found = doc.get("diagnosis")
    if isinstance(found, dict):  # the causal diagnosis: its root cause and the plan's first lever
        root, plan = found.get("root_cause"), found.get("plan") or []
        if not root:
            return "no bottleneck found in these figures"
        return f"root cause {root.get('kind')}: {root.get('evidence')}" + (f"; first: {plan[0].get('text')}" if plan else "")
    if not found:  # a file of an older version holds a plain list of findings
        return "no bottleneck found in these figures"
    return f"{found[0].get('bottleneck')}: {found[0].get('evidence')}; fix this first"


def _tune_answer(doc: dict[str, Any]) -> str:
    if doc.get("mode") == "measure_only":
        proposal = doc.get("proposal")
        return ("the SLO holds: nothing to change" if doc.get("slo_holds") else
                f"the SLO misses; proposed: {proposal.get('setting')} {fmt(proposal.get('from'))} → "
                f"{fmt(proposal.get('to'))}, to verify with the commands below" if proposal else
                "the SLO misses, and no server setting is proposed: see the diagnosis")
    kept = ", ".join(f"{c.get('setting')} {fmt(c.get('from'))} → {fmt(c.get('to'))}" for c in doc.get("changes") or [])
    verdict = "the SLO holds" if doc.get("slo_holds") else "the SLO still misses"
    todo = "serve profile.yaml" if kept else "nothing to change" if doc.get("slo_holds") else \
        str((doc.get("stopped") or {}).get("text"))
    return f"{verdict} after {fmt(doc.get('runs'))} runs; kept: {kept or 'nothing'}; {todo}"


ANSWERS = {"bench": _bench_answer, "sweep": _sweep_answer, "compare": _compare_answer, "accept": _accept_answer,
           "vram": _vram_answer, "roofline": _roofline_answer, "metrics": _metrics_answer, "tune": _tune_answer}


def answers_section(results: Sequence[Result]) -> Section:
    """The first section: one sentence per result (its verdict, the figure behind it, what to do),
    and a warning where a roofline is set against a run of another model."""
    measured = [r for r in results if r.kind in ("bench", "sweep")]
    facts = [(f"{r.kind} {r.label}", ANSWERS[r.kind](r.doc)) for r in results]
    facts += [("warning", w) for r in results if r.kind == "roofline" and measured for w in model_mismatch(r, measured)]
    return Section("answers", "Answers", facts)


# ---------------------------------------------------------------- sections

def build_sections(results: Sequence[Result], records: Sequence[dict[str, Any]] | None) -> list[Section]:
    """The report's sections, verdicts first; pure: the inputs are already parsed. A section's id
    is its kind and its place among the sections."""
    by_kind: dict[str, list[Result]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r)
    if records is not None and len(by_kind.get("bench", [])) != 1:
        raise UsageError("--records belongs to one bench run: pass exactly one bench result with it")
    sections = [tune_section(r) for r in by_kind.get("tune", [])]
    for r in by_kind.get("compare", []):
        sections.append(compare_section(r, len(sections)))
    for r in by_kind.get("accept", []):
        sections.append(accept_section(r, len(sections)))
    sweeps, benches = by_kind.get("sweep", []), by_kind.get("bench", [])
    if sweeps or len(benches) > 1:
        sections.append(sweep_section(sweeps, benches))
    for r in benches:
        sections.append(bench_section(r, records, len(sections)))
    for roof in by_kind.get("roofline", []):
        sections.append(physics_section(roof, sweeps + benches, len(sections)))
    for r in by_kind.get("vram", []):
        sections.append(sizing_section(r, len(sections)))
    for r in by_kind.get("metrics", []):
        sections.append(metrics_section(r, len(sections)))
    return unique_ids(sections)


def compare_section(r: Result, place: int) -> Section:
    doc = r.doc
    return Section(f"compare-{place}", f"Comparison: {r.label}", [
        ("workload", describe_workload(doc.get("workload"))),
        *((m.get("name"), f"{signed_pct(number(m.get('change_pct')))} ({m.get('verdict')})")
          for m in doc.get("metrics") or [])], [compare_chart(r)], str(doc.get("verdict")))


def accept_section(r: Result, place: int) -> Section:
    doc = r.doc
    base, cand = doc.get("base") or {}, doc.get("candidate") or {}
    return Section(f"accept-{place}", f"Acceptance: {base.get('model')} → {cand.get('model')}",
                   [(row.get("measure", ""), f"{row.get('base')} → {row.get('candidate')} "
                                             f"({row.get('change')})") for row in doc.get("rows") or []]
                   + [("note", n) for n in doc.get("notes") or []],
                   [accept_chart(r)], str(doc.get("verdict")), list(doc.get("reasons") or []))


def sweep_section(sweeps: Sequence[Result], benches: Sequence[Result]) -> Section:
    """Sweeps, and several bench runs (at several rates, say), on the same charts."""
    load = [*sweeps, *(benches if len(benches) > 1 else [])]
    knees = {r.label: r.doc.get("knee") for r in sweeps}
    facts = [fact for r in sweeps for fact in sweep_facts(r)]
    return Section("sweep", "Sweep: latency and throughput under load", facts, sweep_charts(load, knees))


def bench_section(r: Result, records: Sequence[dict[str, Any]] | None, place: int) -> Section:
    charts = []
    if records is not None:
        charts.append(distribution_chart(r, records))
    charts += timeline_charts(r, records)
    return Section(f"bench-{place}", f"Bench run: {r.label}", bench_facts(r), charts,
                   str(r.doc.get("verdict")), list(r.doc.get("verdict_reasons") or []))


def physics_section(roof: Result, measured: Sequence[Result], place: int) -> Section:
    """The measured runs against the roofline bound; the bound alone when nothing was measured."""
    if not measured:
        return Section(f"physics-{place}", "Physics: the roofline", roofline_facts(roof))
    decode = roof.doc.get("decode") or {}
    return Section(f"physics-{place}", "Physics: measured against the roofline", [
        ("bound at batch 1", f"{fmt(decode.get('step_ms_bound'))} ms per token ({decode.get('bound_by')}-bound)"),
        ("turns compute-bound at batch", fmt(roof.doc.get("compute_bound_from_batch"))),
        *(("warning", w) for w in model_mismatch(roof, measured))],
        [physics_chart(measured, roof)])


def sizing_section(r: Result, place: int) -> Section:
    doc = r.doc
    return Section(f"sizing-{place}", f"Sizing: {doc.get('model')} on {doc.get('gpu')}", [
        ("fits", "yes" if doc.get("fits") else "no"), ("KV cache tokens", fmt(doc.get("kv_cache_tokens"))),
        ("max concurrency at full context", fmt(doc.get("max_concurrency"))),
        *((("range", f"{fmt(doc.get('max_concurrency_low'))} to {fmt(doc.get('max_concurrency_high'))} requests "
                     "of the full context"),) if doc.get("range_sources") else ()),
        *((("marginal", str(doc.get("marginal_reason"))),) if doc.get("marginal") else ()),
        *(((f"requests of {fmt(doc['typical'].get('tokens'))} tokens at once",
            fmt(doc["typical"].get("max_concurrency"))),) if doc.get("typical") else ()),
        *((("cheapest change that fits", str(doc["fix"].get("change"))),) if doc.get("fix") else ()),
        *((f"lever {lever.get('lever')}", f"{lever.get('change')}: {fmt(lever.get('kv_cache_tokens'))} KV tokens")
          for lever in doc.get("levers") or [])], sizing_charts(r), "fits" if doc.get("fits") else "does not fit")


def metrics_section(r: Result, place: int) -> Section:
    doc = r.doc
    facts = [("source", str(doc.get("source"))), ("models", ", ".join(map(str, doc.get("models") or []))),
             ("running / waiting (mean)", f"{fmt(doc.get('running_mean'))} / {fmt(doc.get('waiting_mean'))}"),
             ("KV cache usage (max)", fmt(number(doc.get("kv_cache_usage_max")))),
             ("preemptions", fmt(doc.get("preemptions"))),
             ("prompt / generation tok/s", f"{fmt(doc.get('prompt_tok_s'))} / {fmt(doc.get('gen_tok_s'))}")]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "e2e"),
                      ("queue_ms", "queue")):
        s = doc.get(key) or {}
        if s.get("n"):
            facts.append((f"{name} ms", f"p50 {fmt(s.get('p50'))}, p95 {fmt(s.get('p95'))}, p99 {fmt(s.get('p99'))}"))
    return Section(f"metrics-{place}", f"Server metrics: {r.label}", facts, [], None, diagnosis_lines(doc.get("diagnosis")))


def diagnosis_lines(found: Any) -> list[str]:
    """A metrics result's diagnosis as lines: its findings (root cause first), plan and verify
    commands; a file of an older version holds a plain list of findings."""
    if not isinstance(found, dict):
        return [f"{d.get('bottleneck')}: {d.get('evidence')}" for d in found or []]
    return ([f"{d.get('kind')}: {d.get('evidence')}" for d in found.get("findings") or []]
            + [f"plan {i}: {lever.get('text')}" for i, lever in enumerate(found.get("plan") or [], 1)]
            + [f"verify: {command}" for command in found.get("verify") or []])


def unique_ids(sections: list[Section]) -> list[Section]:
    """Two bench runs or two sizings give charts of the same name: number the later ones."""
    seen: dict[str, int] = {}
    for chart in (c for s in sections for c in s.charts):
        seen[chart.id] = seen.get(chart.id, 0) + 1
        if seen[chart.id] > 1:
            chart.id = f"{chart.id}-{seen[chart.id]}"
    return sections


def roofline_facts(result: Result) -> list[tuple[str, str]]:
    doc = result.doc
    return [(f"batch {fmt(row.get('batch'))}", f">= {fmt(row.get('step_ms_bound'))} ms per token, "
                                                f"<= {fmt(row.get('tokens_per_s_total_bound'))} tok/s total")
            for row in doc.get("table") or []]


# ---------------------------------------------------------------- output

def render_html(sections: Sequence[Section], inputs: Sequence[Result], generated_at: str) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE.name).render(sections=sections, inputs=inputs, generated_at=generated_at,
                                                  verdict_class=VERDICT_CLASS)


def render_text(sections: Sequence[Section]) -> str:
    """The key numbers for a terminal or an agent: verdicts, facts, each chart's table."""
    lines = []
    for s in sections:
        lines.append(f"== {s.title}" + (f": {s.verdict}" if s.verdict else ""))
        lines += [f"  - {reason}" for reason in s.reasons]
        width = max((len(label) for label, _ in s.facts), default=0)
        lines += [f"  {label:<{width}}  {value}" for label, value in s.facts]
        for chart in s.charts:
            if not chart.table_rows:
                continue
            lines.append(f"  -- {chart.title}")
            widths = [max(len(str(cell)) for cell in column) for column in zip(chart.table_head, *chart.table_rows)]
            for row in [chart.table_head, *chart.table_rows]:
                lines.append("    " + "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip())
            if chart.note:
                lines.append(f"    ({chart.note})")
        lines.append("")
    return "\n".join(lines)
