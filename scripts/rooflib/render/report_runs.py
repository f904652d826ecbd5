"""The charts and facts of measured runs: a sweep's latency and throughput curves by concurrency or
rate (several bench runs make one curve), and one bench run's latency distributions and its request
timeline above the server's, on one time axis.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from rooflib.core.stats import percentile, summarize
from rooflib.load import analysis, sweeps
from rooflib.render.report_charts import (
    CDF_POINTS,
    HEIGHT,
    MARGIN,
    MAX_BARS,
    MAX_PREEMPTION_LINES,
    Chart,
    Scale,
    Series,
    cap_rows,
    every_nth,
    fmt,
    legend_of,
    number,
    plot_area,
    xy_svg,
)
from rooflib.render.report_inputs import Result, describe_workload, same_workload, server_of, servers, workload_of

INVALID_VERDICTS = ("INVALID", "ERROR")


# ---------------------------------------------------------------- sweep

def sweep_points(results: Sequence[Result]) -> tuple[str, list[tuple[str, list[dict[str, Any]]]], dict]:
    """(x name, [(label, points)], slo) from sweeps, or from several bench runs (one curve)."""
    curves, slo = [], {}
    benches = [r for r in results if r.kind == "bench"]
    for r in results:
        if r.kind == "sweep":
            points = [{**p, "x": p["concurrency"], "batch": p["concurrency"]} for p in r.doc.get("points") or []]
            curves.append((r.label, points))
            slo = slo or (r.doc.get("slo") or {})
    x_name = "concurrency"
    if benches:
        by_rate = all((b.doc.get("config") or {}).get("rate") for b in benches)
        x_name = "rate (req/s)" if by_rate else "concurrency"
        points = []
        for b in benches:
            cfg, doc = b.doc.get("config") or {}, b.doc
            # An open-loop run has no set batch: the mean number of requests in flight stands for it.
            batch = cfg.get("concurrency") if not cfg.get("rate") else (doc.get("throughput") or {}).get(
                "effective_concurrency")
            points.append({"x": cfg.get("rate") if by_rate else cfg.get("concurrency"), "batch": batch,
                           "verdict": doc.get("verdict"),
                           "reasons": doc.get("verdict_reasons") or [], "failed": (doc.get("requests") or {}).get("failed"),
                           "ttft_ms": doc.get("ttft_ms") or {}, "tpot_ms": doc.get("tpot_ms") or {},
                           "output_tok_s": (doc.get("throughput") or {}).get("output_tok_s"),
                           "total_tok_s": (doc.get("throughput") or {}).get("total_tok_s"),
                           "client_valid": (doc.get("client") or {}).get("valid", True)})
            slo = slo or {k: cfg.get(f"slo_{k}") for k in ("ttft_p95_ms", "tpot_p95_ms")}
        curves.append(("bench runs", sorted((p for p in points if p["x"] is not None), key=lambda p: p["x"])))
    return x_name, curves, slo


def point_invalid(point: dict[str, Any]) -> bool:
    return point.get("verdict") in INVALID_VERDICTS or point.get("client_valid") is False or bool(point.get("failed"))


def point_verdict(point: dict[str, Any]) -> str:
    text = str(point.get("verdict"))
    if point.get("failed"):
        text += f" ({point['failed']} failed)"
    if point.get("client_valid") is False and point.get("verdict") != "INVALID":
        text += " (client invalid)"
    return text


def sweep_charts(results: Sequence[Result], knees: dict[str, Any]) -> list[Chart]:
    workload = same_workload(results, "sweep")
    where = f"{describe_workload(workload)}; server {servers(results)}"
    x_name, curves, slo = sweep_points(results)
    xs = [p["x"] for _, points in curves for p in points]
    log_x = bool(xs) and min(xs) > 0 and max(xs) / min(xs) >= 8
    level_ticks = sorted(set(xs)) if len(set(xs)) <= 12 else []
    charts = []
    for key, name, slo_key in (("ttft_ms", "TTFT", "ttft_p95_ms"), ("tpot_ms", "TPOT", "tpot_p95_ms")):
        series = []
        for label, points in curves:
            for q in ("p50", "p95", "p99"):
                values = [(p["x"], number((p.get(key) or {}).get(q))) for p in points]
                notes = {i: f"{label} {name} {q} at {fmt(p['x'])}: {fmt(v)} ms, {p.get('verdict')}"
                         + (f" ({'; '.join(p.get('reasons') or [])})" if point_invalid(p) else "")
                         for i, (p, (_, v)) in enumerate(zip(points, values))}
                series.append(Series(f"{label} {q}" if len(curves) > 1 else q, values,
                                     {i for i, p in enumerate(points) if point_invalid(p)}, notes=notes,
                                     dash=q == "p99"))
        hlines = [(slo[slo_key], f"SLO p95 {fmt(slo[slo_key])} ms")] if slo.get(slo_key) else []
        vlines = [(k["concurrency"], f"knee C={k['concurrency']}") for k in knees.values() if k]
        svg = xy_svg(series, x_name, f"{name} (ms)", log_x=log_x, hlines=hlines,
                     vlines=vlines if x_name == "concurrency" else [], x_ticks_at=level_ticks)
        rows = [[label, fmt(p["x"]), *(fmt((p.get(key) or {}).get(q)) for q in ("p50", "p95", "p99")),
                 point_verdict(p)]
                for label, points in curves for p in points]
        rows, note = cap_rows(rows)
        charts.append(Chart(f"sweep-{key}", f"{name} against {x_name}",
                            f"{name} p50/p95/p99 by {x_name}: {where}", ["run", x_name, "p50", "p95", "p99", "verdict"],
                            rows, svg, legend_of(svg, [("invalid or failed point", "invalid")]),
                            "; ".join(filter(None, [note, "hollow marks: invalid runs or failed requests; "
                                                    "crosses on the axis: nothing measured"]))))
    series = []
    for label, points in curves:
        pts = [(number((p.get("tpot_ms") or {}).get("p95")), number(p.get("output_tok_s"))) for p in points]
        keep = [(i, xy) for i, xy in enumerate(pts) if xy[0] is not None]
        series.append(Series(label, [xy for _, xy in keep],
                             {n for n, (i, _) in enumerate(keep) if point_invalid(points[i])},
                             notes={n: f"{label} at {x_name} {fmt(points[i]['x'])}: TPOT p95 {fmt(xy[0])} ms, "
                                       f"{fmt(xy[1])} output tok/s" for n, (i, xy) in enumerate(keep)},
                             labels={n: fmt(points[i]["x"]) for n, (i, _) in enumerate(keep)} if len(keep) <= 30 else {}))
    vlines = [(slo["tpot_p95_ms"], f"SLO TPOT p95 {fmt(slo['tpot_p95_ms'])} ms")] if slo.get("tpot_p95_ms") else []
    svg = xy_svg(series, "TPOT p95 (ms per output token)", "output tok/s", vlines=vlines)
    rows = [[label, fmt(p["x"]), fmt((p.get("tpot_ms") or {}).get("p95")), fmt(p.get("output_tok_s")),
             fmt(p.get("total_tok_s"))] for label, points in curves for p in points]
    rows, note = cap_rows(rows)
    charts.append(Chart("sweep-tradeoff", "Throughput against TPOT: the trade-off",
                        f"output tok/s against TPOT p95, one mark per {x_name}: {where}",
                        ["run", x_name, "TPOT p95 (ms)", "output tok/s", "total tok/s"], rows, svg,
                        legend_of(svg), note))
    return charts


def sweep_facts(result: Result) -> list[tuple[str, str]]:
    doc = result.doc
    k = doc.get("knee")
    if k:
        knee = (f"C = {k['concurrency']}: {fmt(k.get('total_tok_s'))} total tok/s at TPOT p95 "
                f"{fmt((k.get('tpot_ms') or {}).get('p95'))} ms, TTFT p95 {fmt((k.get('ttft_ms') or {}).get('p95'))} ms")
    else:
        knee = (f"none: {sweeps.no_knee_reason(doc.get('points') or [])}" if doc.get("slo_set")
                else "no SLO set: the curve is the trade-off")
    invalid = [str(p["concurrency"]) for p in doc.get("points") or [] if point_invalid(p)]
    facts = [("server", server_of(result)), ("workload", describe_workload(workload_of(result))),
             ("concurrencies", ", ".join(str(p["concurrency"]) for p in doc.get("points") or []) or "-"),
             ("knee", knee)]
    if invalid:
        facts.append(("invalid or failing points", "C = " + ", ".join(invalid)))
    if doc.get("interrupted"):
        facts.append(("interrupted", "the points done so far"))
    return facts


# ---------------------------------------------------------------- one run

def cdf_series(name: str, values: Sequence[float]) -> Series:
    data = sorted(values)
    if len(data) <= CDF_POINTS:
        points = [(v, (i + 1) / len(data) * 100) for i, v in enumerate(data)]
    else:
        points = [(percentile(data, q), q) for q in (i * 100 / (CDF_POINTS - 1) for i in range(CDF_POINTS))]
    return Series(name, points, dots=False, step=True)


def distributions(records: Sequence[dict[str, Any]], generated: bool = True) -> dict[str, list[float]]:
    """The figures of the completed measured requests: TTFT, TPOT and ITL of a streamed API, the
    latency of a pooling one (embeddings, score: one answer per request)."""
    done = [r for r in records if r.get("ok") and not r.get("warmup")]
    if not generated:
        return {"latency": [r["e2e_ms"] for r in done if r.get("e2e_ms") is not None]}
    itl = [b - a for r in done for a, b in zip(r.get("chunk_ms") or [], (r.get("chunk_ms") or [])[1:])]
    return {"TTFT": [r["ttft_ms"] for r in done if r.get("ttft_ms") is not None],
            "TPOT": [r["tpot_ms"] for r in done if r.get("tpot_ms") is not None], "ITL": itl}


def distribution_chart(result: Result, records: Sequence[dict[str, Any]]) -> Chart:
    generated = analysis.generates(result.doc.get("config") or {})
    values = distributions(records, generated)
    shown = {name: v for name, v in values.items() if v}
    # A log axis has no 0: a gap of 0 ms (two chunks in one read) is drawn at the smallest one measured.
    floor = min((x for v in shown.values() for x in v if x > 0), default=1e-3)
    series = [cdf_series(name, [max(x, floor) for x in v]) for name, v in shown.items()]
    svg = xy_svg(series, "milliseconds (log)", "share of samples at or below (%)", log_x=True, y_range=(0, 100))
    rows = []
    for name, v in values.items():
        s = summarize(v)
        rows.append([name, *(fmt(s[k]) for k in ("p50", "p95", "p99", "mean", "min", "max")), fmt(s["n"])])
    failed = sum(1 for r in records if not r.get("ok") and not r.get("warmup"))
    return Chart("run-latency", "TTFT, TPOT and ITL distributions" if generated else "Request latency distribution",
                 f"cumulative distributions from {len(records)} request records: "
                 f"{describe_workload(workload_of(result))}; server {server_of(result)}",
                 ["ms", "p50", "p95", "p99", "mean", "min", "max", "n"], rows, svg, legend_of(svg),
                 f"{failed} failed requests have no latency" if failed else "")


def request_rows(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Requests by send time, in seconds from the first send; (rows, every how many was drawn)."""
    start = min(r["sent_ns"] for r in records)
    rows = sorted(({"t": (r["sent_ns"] - start) / 1e9, "ttft": number(r.get("ttft_ms")),
                    "e2e": number(r.get("e2e_ms")), "ok": bool(r.get("ok")), "warmup": bool(r.get("warmup")),
                    "index": r.get("index"), "error": r.get("error")} for r in records), key=lambda r: r["t"])
    every = max(1, math.ceil(len(rows) / MAX_BARS))
    return rows, every


def timeline_charts(result: Result, records: Sequence[dict[str, Any]] | None) -> list[Chart]:
    """The request timeline above the server timeline, one time axis for both."""
    samples = ((result.doc.get("timeline") or {}).get("samples")) or []
    rows, every = request_rows(records) if records else ([], 1)
    ends = [r["t"] + (r["e2e"] or 0) / 1000 for r in rows] + [number(s.get("t_s")) or 0 for s in samples]
    if not ends:
        return []
    x_range = (0.0, max(ends) * 1.02 or 1.0)
    where = f"{describe_workload(workload_of(result))}; server {server_of(result)}"
    charts = []
    if rows:
        drawn = rows[::every]
        area = plot_area(max(HEIGHT, min(600, 40 + 2 * len(drawn) + MARGIN["top"] + MARGIN["bottom"])))
        sx = Scale(*x_range, area["x"], area["x"] + area["w"])
        lane = area["h"] / len(drawn)
        bars = []
        for i, r in enumerate(drawn):
            y = round(area["y"] + i * lane, 1)
            end = r["t"] + (r["e2e"] or 0) / 1000
            cls = "bar-warmup" if r["warmup"] else "bar" if r["ok"] else "bar-failed"
            bars.append({"x": sx(r["t"]), "y": y, "w": max(1.0, round(sx(end) - sx(r["t"]), 1)),
                         "h": max(0.6, round(lane * 0.8, 1)), "cls": cls,
                         "ttft_x": sx(r["t"] + r["ttft"] / 1000) if r["ttft"] is not None else None,
                         "title": f"#{r['index']}: sent at {r['t']:.3f} s, TTFT {fmt(r['ttft'])} ms, "
                                  f"e2e {fmt(r['e2e'])} ms" + ("" if r["ok"] else f", failed: {r['error']}")})
        svg = {**area, "kind": "bars", "x_label": "seconds since the first request", "y_label": "requests by send time",
               "bars": bars, "xticks": sx.ticks(), "yticks": [], "series": [], "hlines": [], "vlines": []}
        table = []
        step = x_range[1] / 10
        for n in range(10):
            lo, hi = n * step, (n + 1) * step
            inside = [r for r in rows if lo <= r["t"] < hi or (n == 9 and r["t"] >= hi)]
            ttfts = [r["ttft"] for r in inside if r["ttft"] is not None]
            table.append([f"{lo:.2f}-{hi:.2f}", fmt(len(inside)), fmt(sum(r["ok"] for r in inside)),
                          fmt(sum(not r["ok"] for r in inside)), fmt(summarize(ttfts)["p50"])])
        charts.append(Chart("run-requests", "Request timeline",
                            f"each request a bar from send to its last token, the TTFT tick on it: {where}",
                            ["seconds", "sent", "completed", "failed", "TTFT p50 (ms)"], table, svg,
                            [{"name": "request", "cls": "bar"}, {"name": "TTFT", "cls": "tick"},
                             {"name": "warm-up", "cls": "bar-warmup"}, {"name": "failed", "cls": "bar-failed"}],
                            f"every {every}th of {len(rows)} requests drawn; the table counts all" if every > 1 else ""))
    if samples:
        charts += server_timeline_charts(result, samples, x_range, where)
    return charts


def server_timeline_charts(result: Result, samples: Sequence[dict[str, Any]], x_range: tuple[float, float],
                           where: str) -> list[Chart]:
    interval = (result.doc.get("timeline") or {}).get("interval_s")
    samples = sorted((s for s in samples if number(s.get("t_s")) is not None), key=lambda s: s["t_s"])

    def line(key: str, scale: float = 1.0) -> list[tuple[float, float | None]]:
        return [(s["t_s"], None if number(s.get(key)) is None else s[key] * scale) for s in samples]

    queue = [Series("running", line("running"), dots=False, step=True),
             Series("waiting", line("waiting"), dots=False, step=True),
             Series("preempted (total)", line("preemptions"), dots=False, step=True, dash=True)]
    preempted, last = [], 0.0
    for s in samples:
        total = number(s.get("preemptions"))
        if total is not None and total > last:
            preempted.append((s["t_s"], f"+{fmt(total - last)} preempted"))
            last = total
    for s in queue:  # an unexported gauge is a gap, not zeros: no crosses for a timeline
        s.points = [(x, y) for x, y in s.points if y is not None]
    # A few preemptions get a line each; a storm shows as the steep rise of the total.
    svg = xy_svg(queue, "seconds since the run started", "requests", x_range=x_range,
                 vlines=preempted if len(preempted) <= MAX_PREEMPTION_LINES else [])
    kv = [Series("KV cache usage", [(x, y) for x, y in line("kv_cache_usage_perc", 100) if y is not None],
                 dots=False, step=True)]
    kv_svg = xy_svg(kv, "seconds since the run started", "KV cache used (%)", x_range=x_range, y_range=(0, 100),
                    height=180)
    table = [[fmt(s["t_s"]), fmt(s.get("running")), fmt(s.get("waiting")),
              fmt(None if number(s.get("kv_cache_usage_perc")) is None else s["kv_cache_usage_perc"] * 100),
              fmt(s.get("preemptions")), fmt(s.get("generation_tok_s"))] for s in samples]
    table, note = every_nth(table)
    missing = [k for k in ("running", "waiting", "kv_cache_usage_perc", "preemptions")
               if all(number(s.get(k)) is None for s in samples)]
    notes = [note, f"not exported by this server: {', '.join(missing)}" if missing else "",
             f"preemptions rose at {len(preempted)} samples" if preempted else "no preemptions"]
    caption = (f"scraped every {fmt(interval)} s, {len(samples)} samples: {where}")
    return [Chart("run-server", "Server timeline: running, waiting, preemptions", caption,
                  ["t (s)", "running", "waiting", "KV used (%)", "preemptions (total)", "generation tok/s"], table,
                  svg, legend_of(svg, [("preemption", "preempt")] if preempted else []),
                  "; ".join(filter(None, notes))),
            Chart("run-kv", "Server timeline: KV cache usage", caption, [], [], kv_svg, legend_of(kv_svg),
                  "the data table is above, with the server timeline")]


def bench_facts(result: Result) -> list[tuple[str, str]]:
    doc = result.doc
    req, tp = doc.get("requests") or {}, doc.get("throughput") or {}
    facts = [("server", server_of(result)), ("workload", describe_workload(workload_of(result))),
             ("load", str((doc.get("config") or {}).get("load", "-"))),
             ("requests", f"{fmt(req.get('completed'))} completed, {fmt(req.get('failed'))} failed")]
    if not analysis.generates(doc.get("config") or {}):  # a pooling API: one answer per request
        pairs = f", {fmt(tp.get('pairs_s'))} pairs/s" if tp.get("pairs_s") is not None else ""
        facts.append(("throughput", f"{fmt(tp.get('req_s'))} req/s, {fmt(tp.get('input_tok_s'))} input tok/s{pairs}"))
        for key, name in (("e2e_ms", "latency ms"), ("latency_per_input_token_ms", "latency per input token ms")):
            s = doc.get(key) or {}
            facts.append((name, f"p50 {fmt(s.get('p50'))}, p95 {fmt(s.get('p95'))}, p99 {fmt(s.get('p99'))}"))
        return facts + [("warning", w) for w in doc.get("warnings") or []]
    facts.append(("throughput", f"{fmt(tp.get('req_s'))} req/s, {fmt(tp.get('output_tok_s'))} output tok/s, "
                                f"{fmt(tp.get('total_tok_s'))} total tok/s"))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        s = doc.get(key) or {}
        facts.append((f"{name} ms", f"p50 {fmt(s.get('p50'))}, p95 {fmt(s.get('p95'))}, p99 {fmt(s.get('p99'))}"))
    facts += [("warning", w) for w in doc.get("warnings") or []]
    return facts
