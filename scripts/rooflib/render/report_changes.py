"""The charts of a change: a comparison's and an acceptance's figures as changes in % with their
95% intervals, and tune's trials on the same kind of chart, coloured by what tune decided; the tune
section, and the colour each verdict has on the page.
"""
from __future__ import annotations

from typing import Any, Sequence

from rooflib.render.report_charts import (
    MARGIN,
    WIDTH,
    Chart,
    Scale,
    Section,
    cap_rows,
    fmt,
    nice_range,
    number,
    plot_area,
    signed_pct,
)
from rooflib.render.report_inputs import Result, describe_workload


# ---------------------------------------------------------------- comparison and acceptance

def interval_chart(rows: Sequence[dict[str, Any]], rules: Sequence[tuple[float, str]] = ()) -> dict[str, Any]:
    """One row per measure: the change in % as a dot, its 95% interval as a whisker, 0 as a rule."""
    lane = 30
    height = MARGIN["top"] + MARGIN["bottom"] + lane * max(1, len(rows))
    area = plot_area(height)
    area["x"], area["w"] = 190, WIDTH - 190 - MARGIN["right"]
    values = [v for r in rows for v in (r["change"], *(r["ci"] or ())) if v is not None] + [0.0] + [v for v, _ in rules]
    lo, hi = nice_range(values, zero=False, pad=0.1)
    sx = Scale(lo, hi, area["x"], area["x"] + area["w"])
    marks = []
    for i, r in enumerate(rows):
        y = round(area["y"] + (i + 0.5) * lane, 1)
        mark = {"label": r["name"], "y": y, "cls": r["cls"], "x": None, "lo": None, "hi": None,
                "title": f"{r['name']}: {signed_pct(r['change'])}"
                         + (f" (95% CI {signed_pct(r['ci'][0])} .. {signed_pct(r['ci'][1])})" if r["ci"] else "")}
        if r["change"] is not None:
            mark["x"] = sx(r["change"])
        if r["ci"]:
            mark["lo"], mark["hi"] = sx(r["ci"][0]), sx(r["ci"][1])
        marks.append(mark)
    return {**area, "kind": "intervals", "x_label": "change from A to B (%)", "y_label": "", "marks": marks,
            "zero": sx(0.0), "xticks": sx.ticks(), "yticks": [], "series": [], "hlines": [],
            # Two close rules (warn, fail): the first one's label goes to its left.
            "vlines": [{"x": sx(v), "label": label, "end": i == 0 and len(rules) > 1}
                       for i, (v, label) in enumerate(rules)]}


def compare_chart(result: Result) -> Chart:
    doc = result.doc
    metrics = doc.get("metrics") or []
    rows = [{"name": m.get("name"), "change": number(m.get("change_pct")),
             "ci": [number(v) for v in m["ci95_pct"]] if m.get("ci95_pct") and None not in m["ci95_pct"] else None,
             "cls": VERDICT_CLASS.get(str(m.get("verdict")), "neutral")} for m in metrics]
    a, b = doc.get("a") or {}, doc.get("b") or {}
    svg = interval_chart(rows)
    table = [[str(m.get("name")), fmt(m.get("a")), fmt(m.get("b")), signed_pct(number(m.get("change_pct"))),
              " .. ".join(signed_pct(number(v)) for v in m["ci95_pct"]) if m.get("ci95_pct") else "-",
              str(m.get("verdict"))] for m in metrics]
    table, note = cap_rows(table)
    return Chart("compare", f"{a.get('label') or 'A'} → {b.get('label') or 'B'}: change with its 95% interval",
                 f"A = {a.get('label')} ({a.get('file')}), B = {b.get('label')} ({b.get('file')}): "
                 f"{describe_workload(doc.get('workload'))}",
                 ["metric", "A", "B", "change", "95% CI", "verdict"], table, svg,
                 [{"name": "better", "cls": "better"}, {"name": "worse", "cls": "worse"},
                  {"name": "no significant difference", "cls": "neutral"}], note)


VERDICT_CLASS = {"better": "better", "worse": "worse", "no significant difference": "neutral", "mixed": "mixed",
                 "PASS": "better", "WARN": "mixed", "FAIL": "worse", "INVALID": "worse", "ERROR": "worse",
                 "fits": "better", "does not fit": "worse", "SLO holds": "better", "SLO missed": "worse"}


# ---------------------------------------------------------------- tune

# A trial's decision (rooflib/serving/trials.py) as the colour of its interval.
TRIAL_CLASS = {"kept": "better", "trade-off": "mixed", "did not start": "worse", "engine crashed": "worse",
               "run failed": "worse", "requests failed": "worse"}
SLO_WORDS = {"ttft_p95_ms": "TTFT p95", "tpot_p95_ms": "TPOT p95", "latency_p95_ms": "latency p95"}


def tune_chart(result: Result) -> Chart:
    """Every trial on one chart: the change of each SLO figure against the configuration it would
    replace, with its 95% interval, coloured by what tune decided."""
    rows, table = [], []
    for trial in result.doc.get("trials") or []:
        if trial.get("setting") is None:
            continue
        name = f"{trial.get('n')}. {trial.get('setting')} → {fmt(trial.get('to'))}"
        for slo, figure in (trial.get("figures") or {"": {}}).items():
            ci = figure.get("ci95_pct")
            rows.append({"name": f"{name}: {SLO_WORDS.get(slo, slo)}" if slo else name,
                         "change": number(figure.get("change_pct")),
                         "ci": [number(v) for v in ci] if ci and None not in ci else None,
                         "cls": TRIAL_CLASS.get(str(trial.get("decision")), "neutral")})
            table.append([str(trial.get("n")), str(trial.get("setting")), f"{fmt(trial.get('from'))} → {fmt(trial.get('to'))}",
                          SLO_WORDS.get(slo, slo or "-"), fmt(figure.get("measured")),
                          signed_pct(number(figure.get("change_pct"))),
                          " .. ".join(signed_pct(number(v)) for v in ci) if ci else "-", str(trial.get("decision")),
                          str(trial.get("why"))])
    svg = {**interval_chart(rows), "x_label": "change from the configuration the trial would replace (%)"}
    table, note = cap_rows(table)
    return Chart("tune", "Trials: each change with its 95% interval", f"{result.doc.get('load')}; lower is better",
                 ["#", "setting", "change", "SLO figure", "ms", "change", "95% CI", "decision", "why"], table, svg,
                 [{"name": "kept", "cls": "better"}, {"name": "trade-off", "cls": "mixed"},
                  {"name": "reverted or not run", "cls": "neutral"}, {"name": "did not start, crashed or requests failed", "cls": "worse"}],
                 note)


def tune_section(result: Result) -> Section:
    doc = result.doc
    kept = ", ".join(f"{c.get('setting')} {fmt(c.get('from'))} → {fmt(c.get('to'))}" for c in doc.get("changes") or [])
    facts = [("profile", str((doc.get("profile") or {}).get("source", doc.get("url")))), ("load", str(doc.get("load"))),
             ("SLO", ", ".join(f"{SLO_WORDS.get(k, k)} <= {fmt(v)} ms" for k, v in (doc.get("slo") or {}).items())),
             ("stopped", str((doc.get("stopped") or {}).get("text", doc.get("mode")))), ("kept", kept or "nothing"),
             ("runs", f"{fmt(doc.get('runs'))} in {fmt(doc.get('wall_s'))} s")]
    facts += [("not tried", line) for line in doc.get("passed_over") or []]
    return Section("tune", "Tune: one change at a time", facts, [tune_chart(result)],
                   "SLO holds" if doc.get("slo_holds") else "SLO missed")


def accept_chart(result: Result) -> Chart:
    doc = result.doc
    base, cand = doc.get("base") or {}, doc.get("candidate") or {}
    ppl = doc.get("ppl_change") or {}
    levels = ppl.get("levels") or (doc.get("config") or {}).get("levels") or {}

    def bench_value(side: dict[str, Any], *keys: str) -> float | None:
        value: Any = side.get("bench") or {}
        for key in keys:
            value = (value or {}).get(key)
        return number(value)

    def change(b: float | None, c: float | None) -> float | None:
        return (c / b - 1) * 100 if b and c is not None else None

    measures = [("output tok/s", ("throughput", "output_tok_s"), 1), ("TTFT p95", ("ttft_ms", "p95"), -1),
                ("TPOT p95", ("tpot_ms", "p95"), -1)]
    rows = []
    ppl_pct = number(ppl.get("change_pct"))
    if ppl_pct is not None or ppl:
        rows.append({"name": "perplexity", "change": ppl_pct, "ci": ppl.get("ci95_pct"),
                     "cls": VERDICT_CLASS.get(str(ppl.get("verdict")), "neutral")})
    for name, keys, better_sign in measures:
        value = change(bench_value(base, *keys), bench_value(cand, *keys))
        cls = "neutral" if value is None or abs(value) < 5 else "better" if value * better_sign > 0 else "worse"
        rows.append({"name": name, "change": value, "ci": None, "cls": cls})
    rules = [(number(levels[k]), f"{k.split('_')[0]} +{fmt(levels[k])}%") for k in ("warn_pct", "fail_pct")
             if number(levels.get(k)) is not None]
    svg = interval_chart(rows, rules)
    svg["x_label"] = "change from base to candidate (%)"
    table = [[r.get("measure", ""), r.get("base", ""), r.get("candidate", ""), r.get("change", "")]
             for r in doc.get("rows") or []]
    def side(role: str, s: dict[str, Any]) -> str:
        source = "" if s.get("source") == s.get("url") else f" (profile {s.get('source')})"
        return f"{role} {s.get('model')} at {s.get('url')}{source}"

    return Chart("accept", "Candidate against base", f"{side('base', base)}, {side('candidate', cand)}; bench {' '.join((doc.get('config') or {}).get('bench_args') or []) or 'skipped'}",
                 ["measure", "base", "candidate", "change"], table, svg,
                 [{"name": "better", "cls": "better"}, {"name": "worse", "cls": "worse"},
                  {"name": "within noise / not judged", "cls": "neutral"}],
                 "perplexity has a 95% interval (the warn and fail levels are the vertical lines); "
                 "the bench figures are one short run each, without one")
