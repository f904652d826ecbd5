"""Physics and sizing in the report: measured decode time per token against the roofline's bound
at that batch, and a vram result's GPU memory budget with the KV cache tokens each lever buys.
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

from rooflib.render.report_charts import MAX_DOTS, Chart, Scale, Series, fmt, legend_of, number, plot_area, xy_svg
from rooflib.render.report_inputs import Result, describe_workload, same_workload, servers
from rooflib.render.report_runs import point_invalid, sweep_points


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
