"""The report: saved results (bench, sweep, accept, metrics, vram, roofline, compare) as HTML or text."""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from rooflib.core import fileio
from rooflib.core.errors import UsageError
from rooflib.core.stats import percentile, summarize
from rooflib.load import analysis, sweeps

TEMPLATE = Path(__file__).resolve().parent / "templates" / "report.html.j2"
SCHEMA_VERSIONS = {"bench": 1, "sweep": 1, "accept": 1, "metrics": 1, "vram": 1, "roofline": 1, "compare": 1,
                   "tune": 1}
# Older files carry no "kind": each kind is known by keys no other result has.
KIND_KEYS = [("compare", ("metrics", "verdict", "a", "b")), ("accept", ("ppl_change", "base", "candidate")),
             ("sweep", ("points", "levels")), ("bench", ("ttft_ms", "throughput", "requests")),
             ("vram", ("kv_cache_gib", "levers")), ("roofline", ("table", "peak_tflops", "decode")),
             ("metrics", ("diagnosis", "mode"))]
MAX_INPUT_BYTES = 512 * 1024 * 1024
# Marks drawn per chart: enough to see a shape, few enough for a browser and a reader.
MAX_LINE_POINTS = 400
MAX_DOTS = 200
MAX_BARS = 300
MAX_PREEMPTION_LINES = 20
CDF_POINTS = 200
TABLE_ROWS = 40
WIDTH, HEIGHT = 720, 260
MARGIN = {"left": 64, "right": 20, "top": 14, "bottom": 44}
INVALID_VERDICTS = ("INVALID", "ERROR")


@dataclass
class Result:
    kind: str
    path: str
    doc: dict[str, Any]

    @property
    def label(self) -> str:
        return Path(self.path).stem


# ---------------------------------------------------------------- reading the inputs

def detect_kind(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return None
    if doc.get("kind"):
        return str(doc["kind"])
    return next((kind for kind, keys in KIND_KEYS if all(k in doc for k in keys)), None)


def parse_result(text: str, path: str) -> Result:
    """One result document; an empty file, another kind or schema version is a UsageError."""
    if not text.strip():
        raise UsageError(f"{path} is empty: pass a result file a task wrote with -- --json")
    try:
        doc = fileio.parse_json(text)
    except ValueError:
        raise UsageError(f"{path} is not JSON: pass a result file a task wrote with -- --json")
    kind = detect_kind(doc)
    if kind not in SCHEMA_VERSIONS:
        found = f"of kind {kind!r}" if kind else "not a result"
        raise UsageError(f"{path} is {found}: the report reads {', '.join(SCHEMA_VERSIONS)} results "
                         "(the --json output of those tasks)")
    version = doc.get("schema_version", 1)
    if version != SCHEMA_VERSIONS[kind]:
        raise UsageError(f"{path} is a {kind} result of schema version {version}; this report reads version "
                         f"{SCHEMA_VERSIONS[kind]}: render it with the toolbox that wrote it, or run the task again")
    return Result(kind, path, doc)


def parse_records(text: str, path: str) -> list[dict[str, Any]]:
    """bench --records: one JSON object per line, each with sent_ns."""
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = fileio.parse_json(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "sent_ns" not in record:
            raise UsageError(f"{path} line {number} is not a bench request record: pass bench's --records file")
        records.append(record)
    if not records:
        raise UsageError(f"{path} is empty: pass the file bench wrote with --records")
    return records


# ---------------------------------------------------------------- workloads and labels

def workload_of(result: Result) -> dict[str, Any] | None:
    """What was asked of the server, for results that measured latency under load."""
    doc = result.doc
    if result.kind in ("bench", "sweep"):
        cfg = doc.get("config") or {}
        return {k: cfg.get(k) for k in ("input_tokens", "output_tokens", "endpoint")}
    if result.kind == "compare":
        return doc.get("workload")
    return None


def describe_workload(workload: dict[str, Any] | None) -> str:
    if not workload:
        return "workload not recorded"
    if {"input_tokens", "output_tokens"} <= set(workload) and not analysis.generates(workload):
        return f"texts of {workload['input_tokens']} tokens, {workload['endpoint']}"  # embeddings, score
    if {"input_tokens", "output_tokens"} <= set(workload):
        text = f"{workload['input_tokens']} prompt / {workload['output_tokens']} output tokens"
        return text + (f", {workload['endpoint']}" if workload.get("endpoint") else "")
    return ", ".join(f"{k} {v}" for k, v in workload.items())


def same_workload(results: Sequence[Result], chart: str) -> dict[str, Any] | None:
    """The one workload of the results on a chart; different ones are a UsageError."""
    seen = [(r, workload_of(r)) for r in results]
    first = seen[0]
    for other in seen[1:]:
        if other[1] != first[1]:
            raise UsageError(f"{other[0].path} ({describe_workload(other[1])}) and {first[0].path} "
                             f"({describe_workload(first[1])}) are different workloads on one {chart} chart: "
                             "report them separately")
    return first[1]


def server_of(result: Result) -> str:
    doc = result.doc
    if result.kind == "bench":
        info = (doc.get("server") or {}).get("info") or {}
        cfg = doc.get("config") or {}
        version = info.get("engine_version")
        owner = info.get("owned_by")  # "vllm" or "sglang": /v1/models says which engine answered
        return f"{cfg.get('model') or info.get('model')} at {cfg.get('url')}" + (
            f" ({owner or 'engine'} {version})" if version else "")
    if result.kind == "sweep":
        cfg = doc.get("config") or {}
        return f"{cfg.get('model')} at {cfg.get('url')}"
    return "?"


def servers(results: Iterable[Result]) -> str:
    names = list(dict.fromkeys(server_of(r) for r in results))
    return "; ".join(names)


# ---------------------------------------------------------------- numbers

def fmt(value: Any, digits: int = 3) -> str:
    """A number for people: 3 significant digits, thousands separated; '-' when missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def signed_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


# ---------------------------------------------------------------- chart geometry

class Scale:
    """Data -> pixels, linear or log10, with round ticks."""

    def __init__(self, lo: float, hi: float, px_lo: float, px_hi: float, log: bool = False):
        if log:
            lo, hi = max(lo, 1e-9), max(hi, 1e-9)
        if hi <= lo:
            lo, hi = (lo - 1, hi + 1) if not log else (lo / 10, hi * 10)
        self.lo, self.hi, self.px_lo, self.px_hi, self.log = lo, hi, px_lo, px_hi, log

    def __call__(self, value: float) -> float:
        if self.log:
            value = max(value, self.lo)
            share = (math.log10(value) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            share = (value - self.lo) / (self.hi - self.lo)
        return round(self.px_lo + share * (self.px_hi - self.px_lo), 1)

    def ticks(self) -> list[tuple[float, str]]:
        if self.log:
            decades = range(math.floor(math.log10(self.lo)), math.ceil(math.log10(self.hi)) + 1)
            steps = (1, 2, 5) if len(decades) <= 4 else (1,)
            values = [m * 10.0 ** d for d in decades for m in steps if self.lo <= m * 10.0 ** d <= self.hi]
        else:
            raw = (self.hi - self.lo) / 5
            magnitude = 10 ** math.floor(math.log10(raw))
            step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
            first = math.ceil(self.lo / step - 1e-9) * step
            values = [first + i * step for i in range(int((self.hi - first) / step + 1e-9) + 1)]
        return [(self(v), tick_label(v)) for v in values]


def tick_label(value: float) -> str:
    """Short axis labels (300k, 1.5M) so that they fit beside the axis."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return fmt(round(value, 10))


def nice_range(values: Iterable[float], zero: bool = True, pad: float = 0.05, log: bool = False) -> tuple[float, float]:
    data = [v for v in values if v is not None and (not log or v > 0)]
    if not data:
        return (1.0, 10.0) if log else (0.0, 1.0)
    if log:  # padded by a factor: a log axis has no room below zero
        return min(data) / (1 + 6 * pad), max(data) * (1 + 6 * pad)
    lo, hi = min(data), max(data)
    if zero:
        lo = min(lo, 0.0)
    span = (hi - lo) or abs(hi) or 1.0
    return lo - (0 if zero and lo == 0 else span * pad), hi + span * pad


def thin(points: Sequence[tuple[float, float]], limit: int = MAX_LINE_POINTS) -> list[tuple[float, float]]:
    """At most `limit` points of a line, keeping each bucket's lowest and highest (spikes stay)."""
    if len(points) <= limit:
        return list(points)
    size = math.ceil(len(points) / (limit // 2))
    kept = []
    for start in range(0, len(points), size):
        bucket = points[start:start + size]
        low, high = min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])
        kept.extend(sorted({low, high}, key=lambda p: (p[0], p[1])))
    return kept


@dataclass
class Series:
    name: str
    points: list[tuple[float, float | None]]  # y None: a failed point (drawn as a cross on the x axis)
    invalid: set[int] = field(default_factory=set)  # indices drawn hollow
    line: bool = True
    dots: bool = True
    dash: bool = False
    step: bool = False
    notes: dict[int, str] = field(default_factory=dict)  # tooltip per index
    labels: dict[int, str] = field(default_factory=dict)  # text beside a dot


@dataclass
class Chart:
    id: str
    title: str
    caption: str
    table_head: list[str]
    table_rows: list[list[str]]
    svg: dict[str, Any] = field(default_factory=dict)
    legend: list[dict[str, str]] = field(default_factory=list)
    note: str = ""


def plot_area(height: int = HEIGHT) -> dict[str, float]:
    return {"x": MARGIN["left"], "y": MARGIN["top"], "w": WIDTH - MARGIN["left"] - MARGIN["right"],
            "h": height - MARGIN["top"] - MARGIN["bottom"], "width": WIDTH, "height": height}


def xy_svg(series: Sequence[Series], x_label: str, y_label: str, *, log_x: bool = False, log_y: bool = False,
           x_range: tuple[float, float] | None = None, y_range: tuple[float, float] | None = None,
           hlines: Sequence[tuple[float, str]] = (), vlines: Sequence[tuple[float, str]] = (),
           height: int = HEIGHT, y_zero: bool = True, x_ticks_at: Sequence[float] = ()) -> dict[str, Any]:
    """The marks of an x-y chart in pixels, for the template (which escapes every text)."""
    area = plot_area(height)
    xs = [x for s in series for x, _ in s.points] + [v for v, _ in vlines]
    ys = [y for s in series for _, y in s.points if y is not None] + [v for v, _ in hlines]
    x_lo, x_hi = x_range or nice_range(xs, zero=False, pad=0.03, log=log_x)
    y_lo, y_hi = y_range or nice_range(ys, zero=y_zero and not log_y, log=log_y)
    sx = Scale(x_lo, x_hi, area["x"], area["x"] + area["w"], log_x)
    sy = Scale(y_lo, y_hi, area["y"] + area["h"], area["y"], log_y)
    bottom = area["y"] + area["h"]
    drawn = []
    for index, s in enumerate(series):
        known = [(x, y) for x, y in s.points if y is not None and (not log_x or x > 0) and (not log_y or y > 0)]
        line = thin(known) if s.line else []
        path = ""
        for i, (x, y) in enumerate(line):
            if s.step and i:
                path += f" H{sx(x)} V{sy(y)}"
            else:
                path += f"{' L' if i else 'M'}{sx(x)},{sy(y)}"
        dots, crosses = [], []
        show_dots = s.dots and len(s.points) <= MAX_DOTS
        for i, (x, y) in enumerate(s.points):
            if y is None:
                crosses.append({"x": sx(x), "y": bottom, "title": s.notes.get(i, f"{s.name}: x {fmt(x)} failed")})
            elif show_dots or i in s.invalid:
                dots.append({"x": sx(x), "y": sy(y), "hollow": i in s.invalid, "label": s.labels.get(i, ""),
                             "title": s.notes.get(i, f"{s.name}: {fmt(x)}, {fmt(y)}")})
        drawn.append({"name": s.name, "cls": f"s{index % 6}", "path": path, "dash": s.dash, "dots": dots,
                      "crosses": crosses, "total": len(s.points), "drawn_points": len(line)})
    return {**area, "kind": "xy", "x_label": x_label, "y_label": y_label, "series": drawn,
            "xticks": [(sx(v), tick_label(v)) for v in x_ticks_at] if x_ticks_at else sx.ticks(), "yticks": sy.ticks(),
            "hlines": [{"y": sy(v), "label": label} for v, label in hlines if not log_y or v > 0],
            "vlines": [{"x": sx(v), "label": label, "end": sx(v) > area["x"] + area["w"] * 0.7}
                       for v, label in vlines if not log_x or v > 0]}


def legend_of(svg: dict[str, Any], extra: Sequence[tuple[str, str]] = ()) -> list[dict[str, str]]:
    return [{"name": s["name"], "cls": s["cls"]} for s in svg["series"]] + [{"name": n, "cls": c} for n, c in extra]


def every_nth(rows: list[list[str]], limit: int = TABLE_ROWS) -> tuple[list[list[str]], str]:
    """A long time series as at most `limit` evenly spaced rows, the last one included."""
    if len(rows) <= limit:
        return rows, ""
    step = math.ceil((len(rows) - 1) / (limit - 1))
    kept = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    return kept, f"the table shows every {step}th of {len(rows)} samples"


def cap_rows(rows: list[list[str]], limit: int = TABLE_ROWS) -> tuple[list[list[str]], str]:
    """A table's first rows; a chart with thousands of points keeps its counts in the note."""
    if len(rows) <= limit:
        return rows, ""
    return rows[:limit], f"the table shows the first {limit} of {len(rows)} rows"


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


# ---------------------------------------------------------------- physics and sizing

def bound_at(table: Sequence[dict[str, Any]], batch: float, key: str) -> float | None:
    """The roofline table's value at a batch, interpolated in log(batch) between its rows."""
    rows = sorted((r for r in table if number(r.get(key)) is not None), key=lambda r: r["batch"])
    if not rows or batch < rows[0]["batch"] or batch > rows[-1]["batch"]:
        return None
    batches = [r["batch"] for r in rows]
    i = bisect.bisect_left(batches, batch)
    if batches[i] == batch:
        return rows[i][key]
    lo, hi = rows[i - 1], rows[i]
    share = (math.log(batch) - math.log(lo["batch"])) / (math.log(hi["batch"]) - math.log(lo["batch"]))
    return lo[key] + share * (hi[key] - lo[key])


def physics_chart(measured: Sequence[Result], roofline: Result) -> Chart:
    workload = same_workload(measured, "physics")
    doc = roofline.doc
    table = doc.get("table") or []
    _, curves, _ = sweep_points(measured)
    points = [(p["batch"], number((p.get("tpot_ms") or {}).get("p50")), label, p) for label, pts in curves
              for p in pts if p.get("batch")]
    series = [Series("measured TPOT p50", [(x, y) for x, y, _, _ in points],
                     {i for i, (*_, p) in enumerate(points) if point_invalid(p)}, line=False),
              Series("roofline bound", [(r["batch"], r.get("step_ms_bound")) for r in table], dots=False),
              Series("roofline expected", [(r["batch"], r.get("step_ms_expected")) for r in table], dots=False,
                     dash=True)]
    svg = xy_svg(series, "batch = requests decoding together (concurrency)", "ms per output token",
                 log_x=True, log_y=True)
    rows = []
    for x, y, label, _ in points:
        bound = bound_at(table, x, "step_ms_bound")
        rows.append([label, fmt(x), fmt(y), fmt(bound), fmt(bound_at(table, x, "step_ms_expected")),
                     fmt(y / bound) if y and bound else "-"])
    decode = doc.get("decode") or {}
    where = (f"roofline of {doc.get('model', 'the model')} on {doc.get('gpu')} (TP={doc.get('tp')}, "
             f"{doc.get('weights_quant')}, context {fmt(decode.get('context_tokens'))} tokens); measured "
             f"{describe_workload(workload)} on {servers(measured)}")
    return Chart("physics", "Decode time per token against the roofline", where,
                 ["run", "batch", "measured TPOT p50 (ms)", "bound (ms)", "expected (ms)", "measured / bound"],
                 rows, svg, legend_of(svg),
                 "the bound is physics (bytes and FLOPs over peak); measured far above it is software or "
                 "a different GPU, measured below it means the inputs differ (model, GPU, context)")


BUDGET = [("weights_gib", "weights", "m0"), ("activation_gib", "activation", "m1"),
          ("non_torch_gib", "non-torch", "m2"), ("cudagraph_gib", "CUDA graphs", "m3"),
          ("kv_cache_gib", "KV cache", "m4")]


def sizing_charts(result: Result) -> list[Chart]:
    doc = result.doc
    total = number(doc.get("gpu_memory_gib")) or 0.0
    util = number(doc.get("gpu_util")) or 1.0
    parts = [(label, max(0.0, number(doc.get(key)) or 0.0), cls) for key, label, cls in BUDGET]
    reserved = total * (1 - util)
    parts.append((f"not given to the engine ({fmt((1 - util) * 100)}%)", reserved, "m5"))
    used = sum(size for _, size, _ in parts)
    short = max(0.0, used - total) if not doc.get("fits", True) else 0.0
    width_gib = max(total, used) or 1.0
    area = plot_area(120)
    sx = Scale(0, width_gib, area["x"], area["x"] + area["w"])
    segments, at = [], 0.0
    for label, size, cls in parts:
        segments.append({"x": sx(at), "w": round(sx(at + size) - sx(at), 1), "cls": cls,
                         "title": f"{label}: {size:.2f} GiB"})
        at += size
    where = (f"{doc.get('model')} on {doc.get('gpu')}, TP={doc.get('tp')} PP={doc.get('pp')}, context "
             f"{fmt(doc.get('ctx'))}, weights {doc.get('weights_quant')}, KV {doc.get('kv_dtype')}, "
             f"engine {doc.get('engine')}")
    svg = {**area, "kind": "stack", "x_label": "GiB per GPU", "y_label": "", "segments": segments,
           "limit": sx(total), "xticks": Scale(0, width_gib, area["x"], area["x"] + area["w"]).ticks(),
           "yticks": [], "series": [], "hlines": [], "vlines": []}
    rows = [[label, f"{size:.2f}", f"{size / total * 100:.1f}%" if total else "-"] for label, size, _ in parts]
    rows.append(["GPU memory", f"{total:.2f}", "100%"])
    budget = Chart("sizing-budget", "GPU memory budget", where, ["part", "GiB", "share"], rows, svg,
                   [{"name": label.split(" (")[0], "cls": cls} for label, _, cls in parts],
                   f"short by {short:.2f} GiB: it does not fit" if short else
                   f"{fmt(doc.get('kv_cache_tokens'))} KV tokens, {fmt(doc.get('max_concurrency'))} requests of "
                   f"{fmt(doc.get('ctx'))} tokens at once")
    levers = doc.get("levers") or []
    now = number(doc.get("kv_cache_tokens")) or 0.0
    bars = [("now", now)] + [(lever.get("change") or lever.get("lever"), number(lever.get("kv_cache_tokens")) or 0.0)
                             for lever in levers]
    series = [Series("KV cache tokens", [(i, v) for i, (_, v) in enumerate(bars)], line=False,
                     notes={i: f"{name}: {fmt(v)} KV tokens" for i, (name, v) in enumerate(bars)})]
    lever_svg = xy_svg(series, "", "KV cache tokens", x_range=(-0.5, len(bars) - 0.5))
    lever_svg["xticks"] = [(lever_svg["series"][0]["dots"][i]["x"], str(i)) for i in range(len(bars))] \
        if len(bars) <= MAX_DOTS else []
    lever_svg["columns"] = [{"x": d["x"], "y": d["y"], "bottom": lever_svg["y"] + lever_svg["h"]}
                            for d in lever_svg["series"][0]["dots"]]
    table = [[str(i), name, fmt(v), fmt(lever.get("max_concurrency")), fmt(lever.get("gpus")),
              "yes" if lever.get("fits") else "no"]
             for i, ((name, v), lever) in enumerate(zip(bars, [doc] + levers))]
    return [budget, Chart("sizing-levers", "Levers: KV cache tokens each one buys", where,
                          ["#", "lever", "KV tokens", "max concurrency", "GPUs", "fits"], table, lever_svg,
                          legend_of(lever_svg), "column numbers match the table rows")]


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

@dataclass
class Section:
    id: str
    title: str
    facts: list[tuple[str, str]]
    charts: list[Chart] = field(default_factory=list)
    verdict: str | None = None
    reasons: list[str] = field(default_factory=list)


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
