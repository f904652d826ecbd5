"""The parts the report's charts are drawn from: numbers as people read them, scales and the marks
of an x-y chart in pixels (the template draws and escapes them), tables cut to a readable length,
and the Chart and the Section that holds charts. Marks are capped per chart so that a browser, and
a reader, cope with a run of many thousand requests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

# Marks drawn per chart: enough to see a shape, few enough for a browser and a reader.
MAX_LINE_POINTS = 400
MAX_DOTS = 200
MAX_BARS = 300
MAX_PREEMPTION_LINES = 20
CDF_POINTS = 200
TABLE_ROWS = 40
WIDTH, HEIGHT = 720, 260
MARGIN = {"left": 64, "right": 20, "top": 14, "bottom": 44}


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


@dataclass
class Section:
    id: str
    title: str
    facts: list[tuple[str, str]]
    charts: list[Chart] = field(default_factory=list)
    verdict: str | None = None
    reasons: list[str] = field(default_factory=list)


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
