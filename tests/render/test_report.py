"""report.py: pages rendered from real results (a bench with its records and a sweep against the
CPU vLLM, an acceptance run) and from documents per the contract (a comparison, a server timeline),
each opened in a real headless Chromium: no console errors and no requests, every chart with its
series and marks, no text overflowing at 1280 and 390 px. Screenshots are kept under
test-artifacts/report/. Also: 1 to 10,000 points, failed and invalid points, a hostile model
name, bad input (one line, exit 2) and the text summary."""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import bench
import chromium
import pytest
import report
import roofline
import sweep
from conftest import IN_CI

from rooflib.core import taskcall
from rooflib.load import analysis, request_outcome, sweeps
from rooflib.render import report_charts, report_html, report_inputs, report_physics
from rooflib.server.slo_targets import Targets

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "report"
HOSTILE = '<script>window.__pwned=1</script><img src="x" onerror="window.__pwned=2">tiny'
WORKLOAD = {"input_tokens": 128, "output_tokens": 16, "endpoint": "completions"}


# ---------------------------------------------------------------- a browser and the pages

@pytest.fixture(scope="session")
def browser():
    exe = chromium.find_chromium()
    if not exe:
        message = "chromium is not installed: `task test` installs it (tests/setup_chromium.sh)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"\nreport screenshots: {ARTIFACTS}")
    return exe


def browse(exe: str, html: Path) -> dict:
    """The page at 1280 px, after checking it at 1280 and 390 px: clean console, nothing fetched,
    no script, nothing wider than the window."""
    found = chromium.inspect_page(exe, html, ARTIFACTS)
    assert found["console"] == [], found["console"]
    for width, page in found["widths"].items():
        assert page["page_overflow"] <= 0, f"{width} px: the page scrolls sideways by {page['page_overflow']} px"
        assert page["texts"] == [] and page["outside"] == [], (width, page["texts"], page["outside"])
        assert page["clipped"] == [], f"{width} px: chart text cut at the edge: {page['clipped']}"
        assert page["scripts"] == 0 and page["pwned"] is None
        assert Path(page["screenshot"]).stat().st_size > 5000
    return found["widths"][1280]


def render(tmp_path: Path, capsys, name: str, *argv: str) -> tuple[Path, str]:
    """report.py FILES --out name.html; returns the page and the text summary printed."""
    out = tmp_path / f"{name}.html"
    code = report.main([*argv, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return out, captured.out


def past_answers(text: str) -> str:
    """The text summary after its first section, the answers."""
    head, rest = text.split("\n\n", 1)
    assert head.startswith("== Answers\n")
    return rest


def write(tmp_path: Path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def charts(page: dict) -> dict:
    return {c["id"]: c for c in page["charts"]}


def assert_every_series_drawn(page: dict) -> None:
    for chart in page["charts"]:
        assert chart["series"] or chart["bars"] or chart["intervals"] or chart["segments"], chart["id"]
        for s in chart["series"]:
            assert s["paths"] + s["dots"] + s["crosses"] > 0, (chart["id"], s)


# ---------------------------------------------------------------- documents per the contracts

def outcome(index: int, sent_ms: float, ttft_ms: float, tpot_ms: float, tokens: int, failed: bool = False,
            warmup: bool = False) -> request_outcome.Outcome:
    sent = int(sent_ms * 1e6)
    if failed:
        return request_outcome.Outcome(index, warmup=warmup, sent_ns=sent, status=500, error="http_5xx", detail="boom")
    times = [sent + int((ttft_ms + tpot_ms * k) * 1e6) for k in range(tokens)]
    return request_outcome.Outcome(index, warmup=warmup, sent_ns=sent, status=200, token_times=times,
                         chunk_tokens=[1] * tokens, completion_tokens=tokens, usage_reported=True,
                         prompt_tokens=WORKLOAD["input_tokens"], finish_reason="length", done_ns=times[-1])


def bench_run(requests: int, model: str = "tiny-qwen3", concurrency: int = 4, failed: int = 0,
              lag_ms: tuple = (0.01,), samples: int = 0, seed: int = 0) -> tuple[dict, list[dict]]:
    """A bench result and its records, through analysis.analyse (the real code) on made-up requests;
    with `samples`, a server timeline scraped every 2 s over the same span as the requests."""
    rng = random.Random(seed)
    spacing_ms = 2000 * samples / requests if samples else 5
    outcomes = [outcome(i, 1000 + i * spacing_ms, 40 + rng.random() * 60, 8 + rng.random() * 4, 16,
                        failed=i < failed) for i in range(requests)]
    config = {**WORKLOAD, "num_requests": requests, "concurrency": concurrency, "rate": None,
              "slo_ttft_p95_ms": 200.0, "slo_tpot_p95_ms": 20.0, "model": model, "url": "http://127.0.0.1:8000",
              "load": f"closed loop, {concurrency} in flight, {requests} requests"}
    doc = analysis.analyse(outcomes, config, list(lag_ms), 1, 2, slo=Targets(200.0, 20.0))
    doc["workload"] = {"workload": "synthetic", "concurrency": concurrency, **WORKLOAD}  # as benchrun.execute adds it
    doc["server"] = {"info": {"model": model, "engine_version": "0.32.0", "owned_by": "vllm"}}
    if samples:
        doc["timeline"] = {"interval_s": 2.0, "samples": [
            {"t_s": 2.0 * i, "running": min(i, 8), "waiting": max(0, i - 8), "kv_cache_usage_perc": min(1, i / 20),
             "preemptions": i // 10, "prefix_cache_hit_rate": None, "prompt_tok_s": 100.0, "generation_tok_s": None}
            for i in range(samples)]}
    return doc, [o.record() for o in outcomes]


def sweep_doc(model: str = "tiny-qwen3") -> dict:
    """Five points: C=1 and 2 pass, C=4 invalid (client lag), C=8 with failed requests, C=16 all failed."""
    runs = {1: bench_run(8, model, 1)[0], 2: bench_run(8, model, 2, seed=1)[0],
            4: bench_run(8, model, 4, lag_ms=(0.01,) * 50 + (30.0,) * 5)[0],
            8: bench_run(8, model, 8, failed=3)[0], 16: bench_run(8, model, 16, failed=8)[0]}
    points = [sweeps.point_summary(c, doc) for c, doc in runs.items()]
    return {"kind": "sweep", "schema_version": 1, "points": points, "knee": sweeps.knee(points, True),
            "slo_set": True, "slo": {"ttft_p95_ms": 200.0, "tpot_p95_ms": 20.0}, "levels": list(runs),
            "interrupted": False, "config": {**WORKLOAD, "warmup": 0, "url": "http://127.0.0.1:8000", "model": model}}


def compare_doc(label_b: str = "fp8") -> dict:
    return {"kind": "compare", "schema_version": 1, "verdict": "mixed",
            "a": {"file": "bf16.json", "label": "bf16"}, "b": {"file": "fp8.json", "label": label_b},
            "workload": WORKLOAD,
            "metrics": [{"name": "ttft_ms.p95", "a": 123.0, "b": 110.0, "change_pct": -10.6, "ci95_pct": [-14.0, -6.9],
                         "verdict": "better"},
                        {"name": "tpot_ms.p95", "a": 20.0, "b": 22.0, "change_pct": 10.0, "ci95_pct": [4.0, 16.0],
                         "verdict": "worse"},
                        {"name": "output_tok_s", "a": 500.0, "b": 505.0, "change_pct": 1.0, "ci95_pct": [-3.0, 5.0],
                         "verdict": "no significant difference"},
                        {"name": "e2e_ms.p99", "a": None, "b": 900.0, "change_pct": None, "ci95_pct": None,
                         "verdict": "no significant difference"}]}


def roofline_doc(capsys) -> dict:
    assert roofline.main(["--model", "qwen3-0.6b", "--gpu", "h100", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- real results

@pytest.mark.real_vllm
def test_real_bench_and_sweep_render_and_open_cleanly(vllm_server, browser, capsys, tmp_path):
    records = tmp_path / "requests.jsonl"
    shape = ["--input-tokens", "64", "--output-tokens", "16", "--url", vllm_server.url, "--json"]
    # A busy 2-core machine may make the run INVALID (exit 4): its page must show that too.
    assert bench.main(["-n", "12", "-c", "4", "--records", str(records), *shape]) in (0, 1, 4)
    bench_file = write(tmp_path, "bench.json", capsys.readouterr().out)
    code = sweep.main(["--sweep-c", "1,2,4", "-n", "6", "--slo-tpot-p95-ms", "1000", *shape])
    assert code in (0, 1, 4)
    sweep_result = json.loads(capsys.readouterr().out)
    sweep_file = write(tmp_path, "sweep.json", sweep_result)
    roof_file = write(tmp_path, "roofline.json", roofline_doc(capsys))
    html, text = render(tmp_path, capsys, "real-run", sweep_file, bench_file, roof_file, "--records", str(records))
    page = browse(browser, html)
    found = charts(page)
    assert {"sweep-ttft_ms", "sweep-tpot_ms", "sweep-tradeoff", "run-latency", "run-requests", "physics"} <= set(found)
    assert_every_series_drawn(page)
    ttft = found["sweep-ttft_ms"]
    assert [s["name"] for s in ttft["series"]] == ["p50", "p95", "p99"]
    assert all(s["total"] == 3 and s["dots"] == 3 and s["paths"] == 1 for s in ttft["series"])
    assert ttft["rows"] == 3 and "64 prompt / 16 output tokens" in ttft["caption"]
    assert f"tiny-qwen3 at {vllm_server.url}" in ttft["caption"]
    knee = 1 if sweep_result["knee"] else 0  # the knee line; the SLO line is on TPOT only
    assert (ttft["rules"], found["sweep-tpot_ms"]["rules"]) == (knee, knee + 1)
    invalid = sum(p["verdict"] in ("INVALID", "ERROR") or p["failed"] > 0 for p in sweep_result["points"])
    assert all(s["hollow"] == invalid for s in ttft["series"])
    requests = [json.loads(line) for line in records.read_text().splitlines()]
    assert found["run-requests"]["bars"] == len(requests) == 12 + 4  # warm-up requests drawn grey
    assert found["run-requests"]["ticks"] == sum(1 for r in requests if r["ok"])
    latency = found["run-latency"]
    assert [s["name"] for s in latency["series"]] == ["TTFT", "TPOT", "ITL"]
    bench_doc = json.loads(Path(bench_file).read_text())
    # The same samples as bench's own percentiles: measured requests that completed.
    assert [s["total"] for s in latency["series"][:2]] == [bench_doc["ttft_ms"]["n"], bench_doc["tpot_ms"]["n"]]
    assert found["physics"]["series"][0]["dots"] == 3 + 1  # three sweep points and the bench run
    if "timeline" in bench_doc:  # a bench that scrapes /metrics during the run: its samples, each drawn
        assert found["run-server"]["series"][0]["total"] == len(bench_doc["timeline"]["samples"])
    assert "== Sweep: latency and throughput under load" in text and "knee" in text


@pytest.mark.real_vllm
def test_real_acceptance_run_renders_verdict_first(vllm_server, browser, capsys, tmp_path):
    import accept

    code = accept.main(["--base", vllm_server.url, "--candidate", vllm_server.url, "--skip-smoke", "--window", "256",
                        "--bench-n", "4", "--bench-c", "2", "--bench-in", "32", "--bench-out", "8", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["kind"] == "accept", result["reasons"]
    html, text = render(tmp_path, capsys, "real-accept", write(tmp_path, "accept.json", result))
    page = browse(browser, html)
    chart = charts(page)["accept"]
    assert chart["intervals"] == 4 and chart["rows"] == len(result["rows"])
    assert page["text"].index(result["verdict"]) < page["text"].index("Candidate against base")
    assert text.splitlines()[1].startswith(f"  accept accept  {result['verdict']}")
    assert past_answers(text).startswith(f"== Acceptance: tiny-qwen3 → tiny-qwen3: {result['verdict']}")


# ---------------------------------------------------------------- documents per the contracts

def test_comparison_puts_the_verdict_first_with_intervals(browser, capsys, tmp_path):
    html, text = render(tmp_path, capsys, "compare", write(tmp_path, "compare.json", compare_doc()))
    page = browse(browser, html)
    chart = charts(page)["compare"]
    assert chart["intervals"] == 4 and chart["whiskers"] == 3 * 3 and chart["rows"] == 4
    assert page["text"].index("mixed") < page["text"].index("ttft_ms.p95")
    assert "not measured" in page["text"]  # the metric without a value is named, not dropped
    assert text.splitlines()[:2] == [
        "== Answers", "  compare compare  B (fp8) against A (bf16): mixed; largest change ttft_ms.p95 -10.6% (95% CI "
        "-14.0..-6.9%); weigh the metrics that moved against each other"]
    assert past_answers(text).splitlines()[0] == "== Comparison: compare: mixed"
    assert "    tpot_ms.p95   20   22   +10.0%  +4.0% .. +16.0%  worse" in text
    faster = compare_doc()  # every change below zero: "not measured" must stay inside the chart
    faster["metrics"] = [m for m in faster["metrics"] if m["name"] in ("ttft_ms.p95", "e2e_ms.p99")]
    html, _ = render(tmp_path, capsys, "compare-faster", write(tmp_path, "faster.json", faster))
    assert charts(browse(browser, html))["compare"]["intervals"] == 2


def test_a_run_with_a_server_timeline_shares_the_time_axis(browser, capsys, tmp_path):
    doc, records = bench_run(40, samples=30)
    records_file = tmp_path / "r.jsonl"
    records_file.write_text("\n".join(json.dumps(r) for r in records))
    html, _ = render(tmp_path, capsys, "timeline", write(tmp_path, "bench.json", doc), "--records", str(records_file))
    page = browse(browser, html)
    found = charts(page)
    assert [s["name"] for s in found["run-server"]["series"]] == ["running", "waiting", "preempted (total)"]
    assert all(s["total"] == s["drawn"] == 30 for s in found["run-server"]["series"])
    assert found["run-server"]["rules"] == 2  # the preemption count rises at t = 20 s and 40 s
    assert found["run-kv"]["series"][0]["total"] == 30
    assert found["run-requests"]["bars"] == 40
    # One time axis: the three charts put the same seconds at the same places.
    figures = dict(part.split('"', 1) for part in html.read_text().split('<figure class="chart" id="')[1:])
    axes = [re.findall(r'<text class="tick" x="([\d.]+)" y="[\d.]+" text-anchor="middle">([^<]*)</text>',
                       figures[name]) for name in ("run-requests", "run-server", "run-kv")]
    assert len(axes[0]) >= 3 and axes[0] == axes[1] == axes[2]


@pytest.mark.parametrize("requests", [1, 10_000])
def test_from_one_to_ten_thousand_points(browser, capsys, tmp_path, requests):
    doc, records = bench_run(requests, samples=requests)
    records_file = tmp_path / "r.jsonl"
    records_file.write_text("\n".join(json.dumps(r) for r in records))
    html, text = render(tmp_path, capsys, f"points-{requests}", write(tmp_path, "bench.json", doc),
                        "--records", str(records_file))
    page = browse(browser, html)
    found = charts(page)
    every = -(-requests // report_charts.MAX_BARS)
    assert found["run-requests"]["bars"] == len(range(0, requests, every))
    ttft = found["run-latency"]["series"][0]
    assert ttft["total"] == min(requests, report_charts.CDF_POINTS) and ttft["drawn"] <= report_charts.MAX_LINE_POINTS
    assert found["run-server"]["series"][0]["drawn"] <= report_charts.MAX_LINE_POINTS
    assert found["run-server"]["rows"] == min(requests, report_charts.TABLE_ROWS)
    assert found["run-server"]["rules"] == (0 if requests > report_charts.MAX_PREEMPTION_LINES else requests // 10)
    # The counts stay honest: the table has every request, the note says what was drawn.
    assert f"TTFT  {report_charts.fmt(doc['ttft_ms']['p50'])}" in text and f"  {report_charts.fmt(requests)}" in text
    if requests > report_charts.MAX_BARS:
        assert f"every {every}th of {requests} requests drawn" in page["text"]
    assert_every_series_drawn(page)


def test_failed_and_invalid_points_are_shown_not_hidden(browser, capsys, tmp_path):
    doc = sweep_doc()
    html, text = render(tmp_path, capsys, "sweep-faults", write(tmp_path, "sweep.json", doc))
    page = browse(browser, html)
    p95 = charts(page)["sweep-ttft_ms"]["series"][1]
    assert p95["name"] == "p95" and p95["total"] == 5
    assert p95["crosses"] == 1  # C=16: nothing measured, a cross on the axis
    assert p95["dots"] == 4 and p95["hollow"] == 2  # C=4 invalid, C=8 with failed requests
    facts = dict(line.strip().split("  ", 1) for line in past_answers(text).splitlines()[1:5])
    assert facts["knee"].strip().startswith("C = 2: ")
    assert "invalid or failing points  C = 4, 8, 16" in text and "    sweep  8            77.1" in text


def test_a_hostile_model_name_is_text_never_markup(browser, capsys, tmp_path):
    doc, records = bench_run(10, model=HOSTILE, samples=3)
    records_file = tmp_path / "r.jsonl"
    records_file.write_text("\n".join(json.dumps(r) for r in records))
    files = [write(tmp_path, "bench.json", doc), write(tmp_path, "sweep.json", sweep_doc(HOSTILE)),
             write(tmp_path, "compare.json", compare_doc(HOSTILE))]
    html, _ = render(tmp_path, capsys, "hostile", *files, "--records", str(records_file))
    source = html.read_text()
    assert "<script" not in source and "<img" not in source and "&lt;script&gt;" in source
    page = browse(browser, html)  # no script ran (window.__pwned unset), no image requested
    assert HOSTILE in page["text"]


def test_sizing_shows_the_budget_and_the_levers(browser, capsys, tmp_path):
    import vram

    assert vram.main(["--model", "qwen3-32b", "--gpu", "h100", "--ctx", "32768", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    html, text = render(tmp_path, capsys, "sizing", write(tmp_path, "vram.json", doc))
    found = charts(browse(browser, html))
    assert found["sizing-budget"]["segments"] == len(report_physics.BUDGET) + 1
    assert found["sizing-levers"]["columns"] == len(doc["levers"]) + 1
    assert re.search(rf"\n  KV cache tokens +{doc['kv_cache_tokens']:,}\n", text)
    assert re.search(r"\n  marginal +1\.19x requests of the full context", text)
    assert re.search(rf"\n  requests of 2,048 tokens at once +{report_charts.fmt(doc['typical']['max_concurrency'])}\n", text)
    assert vram.main(["--model", "qwen3-32b", "--gpu", "l4", "--json"]) == 1
    short = json.loads(capsys.readouterr().out)
    html, text = render(tmp_path, capsys, "sizing-short", write(tmp_path, "short.json", short))
    assert charts(browse(browser, html))["sizing-budget"]["segments"] == len(report_physics.BUDGET) + 1
    assert past_answers(text).startswith("== Sizing: qwen3-32b on NVIDIA L4: does not fit\n")
    assert f"  cheapest change that fits        {short['fix']['change']}\n" in text
    assert f"does not fit: 0 requests of 40,960 tokens at once; cheapest change that fits: {short['fix']['change']}" \
        in text.splitlines()[1]
    assert f"(short by {-short['kv_cache_gib']:.2f} GiB: it does not fit)" in text


# ---------------------------------------------------------------- input, output

def test_older_files_without_kind_are_recognised(tmp_path):
    doc, _ = bench_run(4)
    del doc["kind"]
    sweep_result = {k: v for k, v in sweep_doc().items() if k not in ("kind", "schema_version")}
    assert report_inputs.parse_result(json.dumps(doc), "b.json").kind == "bench"
    assert report_inputs.parse_result(json.dumps(sweep_result), "s.json").kind == "sweep"


@pytest.mark.parametrize("content, message", [
    ("", "error: {f} is empty: pass a result file a task wrote with -- --json"),
    ("{not json", "error: {f} is not JSON"),
    ('{"kind": "report", "schema_version": 1}', "error: {f} is of kind 'report': the report reads bench, sweep"),
    ('{"hello": 1}', "error: {f} is not a result: the report reads"),
    ('{"kind": "compare", "schema_version": 2}', "error: {f} is a compare result of schema version 2; this report reads version 1"),
])
def test_bad_files_are_one_line_exit_2(capsys, tmp_path, content, message):
    path = write(tmp_path, "x.json", content)
    assert report.main([path, "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(f=path)) and err.count("\n") == 1, err
    assert not (tmp_path / "r.html").exists()


def test_different_workloads_on_one_chart_are_refused(capsys, tmp_path):
    other = sweep_doc()
    other["config"]["input_tokens"] = 2048
    a, b = write(tmp_path, "a.json", sweep_doc()), write(tmp_path, "b.json", other)
    assert report.main([a, b, "--format", "text"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {b} (2048 prompt / 16 output tokens, completions) and {a} (128 prompt / 16 output "
                   "tokens, completions) are different workloads on one sweep chart: report them separately\n")


def test_records_need_their_bench_and_a_failed_render_keeps_the_old_page(capsys, tmp_path):
    out = tmp_path / "report.html"
    out.write_text("the earlier report")
    records = write(tmp_path, "r.jsonl", '{"sent_ns": 1, "ok": true}\n')
    assert report.main([write(tmp_path, "s.json", sweep_doc()), "--records", records, "--out", str(out)]) == 2
    assert capsys.readouterr().err == "error: --records belongs to one bench run: pass exactly one bench result with it\n"
    bad = write(tmp_path, "bad.jsonl", "not a record\n")
    assert report.main([write(tmp_path, "b.json", bench_run(4)[0]), "--records", bad, "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"error: {bad} line 1 is not a bench request record: pass bench's --records file\n"
    assert out.read_text() == "the earlier report" and [p.name for p in tmp_path.glob(".report.html*")] == []


def test_text_summary_and_json(capsys, tmp_path):
    doc, _ = bench_run(20)
    path = write(tmp_path, "bench.json", doc)
    assert report.main([path, "--format", "text"]) == 0
    text = capsys.readouterr().out
    assert past_answers(text).startswith(f"== Bench run: bench: {doc['verdict']}\n")
    assert text.splitlines()[1].startswith(f"  bench bench  {doc['verdict']}: TTFT p95 ")
    assert f"  TTFT ms     p50 {report_charts.fmt(doc['ttft_ms']['p50'])}, p95 {report_charts.fmt(doc['ttft_ms']['p95'])}" in text
    assert report.main([path, "--out", str(tmp_path / "r.html"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "r.html").stat().st_mode & 0o777 == 0o666 & ~umask
    assert summary["out"] == str(tmp_path / "r.html") and summary["inputs"] == [{"file": path, "kind": "bench"}]
    assert summary["sections"][0]["title"] == "Answers" and summary["sections"][1]["verdict"] == doc["verdict"]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--help"])
    assert exit_.value.code == 0 and "report.py sweep.json --out report.html" in capsys.readouterr().out


def test_server_metrics_show_their_diagnosis(browser, capsys, tmp_path):
    import metrics

    fixtures = REPO / "tests" / "fixtures" / "metrics"
    assert metrics.main(["--file", str(fixtures / "vllm-0.32-queue-before.txt"),
                         "--file", str(fixtures / "vllm-0.32-queue-after.txt"), "--window", "17.87", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    html, text = render(tmp_path, capsys, "metrics", write(tmp_path, "metrics.json", doc))
    browse(browser, html)
    assert text.splitlines()[1].startswith("  metrics metrics  root cause running_limit: --max-num-seqs is at least 2")
    assert past_answers(text).startswith("== Server metrics: metrics\n  - running_limit: --max-num-seqs is at least 2 (inferred: ")
    assert "\n  - queue: requests wait for a slot: queue mean 7.24 s" in text
    assert "\n  - plan 1: --max-num-seqs: at least 2 -> 16 (current: inferred)" in text
    # Run outside any task: the skill's call form, runnable as printed.
    assert f"\n  - verify: task -t {taskcall.toolbox_taskfile()} compare A=before.json B=after.json\n" in text
    assert re.search(r"\n  TTFT ms +p50 7,500, p95 18,667, p99 19,733\n", text) and "\n  queue ms " in text


def test_two_sweeps_share_the_charts_and_open_loop_runs_make_a_curve(browser, capsys, tmp_path):
    files = [write(tmp_path, f"{name}.json", sweep_doc()) for name in ("bf16", "fp8")]
    html, _ = render(tmp_path, capsys, "two-sweeps", *files)
    found = charts(browse(browser, html))
    assert [s["name"] for s in found["sweep-ttft_ms"]["series"]] == [
        "bf16 p50", "bf16 p95", "bf16 p99", "fp8 p50", "fp8 p95", "fp8 p99"]
    assert [s["name"] for s in found["sweep-tradeoff"]["series"]] == ["bf16", "fp8"]
    runs = []
    for rate in (2.0, 0.5, 1.0):
        doc, _ = bench_run(8, seed=int(rate * 10))
        doc["config"]["rate"] = rate
        runs.append(write(tmp_path, f"rate-{rate}.json", doc))
    assert report.main([*runs, "--format", "text"]) == 0
    text = capsys.readouterr().out
    assert "  -- TTFT against rate (req/s)\n    run         rate (req/s)  p50" in text
    assert [line.split()[2] for line in text.splitlines() if line.startswith("    bench runs")][:3] == ["0.5", "1", "2"]


def test_answers_come_first_one_sentence_per_result(browser, capsys, tmp_path):
    """Each result's verdict, the figure behind it and what to do, before any chart; a roofline
    set against a sweep of another model is said to compare two models, there and in its section."""
    sweep_file = write(tmp_path, "sweep.json", sweep_doc())
    roof = roofline_doc(capsys)                                   # qwen3-0.6b; the sweep measured tiny-qwen3
    files = [sweep_file, write(tmp_path, "roofline.json", roof)]
    assert report.main([*files, "--format", "text"]) == 0
    text = capsys.readouterr().out
    answers = text.split("\n\n", 1)[0].splitlines()
    assert answers[0] == "== Answers"
    assert answers[1] == ("  sweep sweep        knee at C = 2: " + report_charts.fmt(sweep_doc()["knee"]["total_tok_s"])
                          + " total tok/s at TPOT p95 " + report_charts.fmt(sweep_doc()["knee"]["tpot_ms"]["p95"])
                          + " ms; serve at most 2 concurrent requests per replica at this workload")
    assert answers[2].startswith("  roofline roofline  decode at batch 1 takes at least ")
    warning = ("the roofline is for qwen3-0.6b, but sweep measured tiny-qwen3: measured / bound compares two "
               "different models unless they are the same one under another name")
    assert answers[3] == f"  warning            {warning}"
    assert re.search(r"== Physics: measured against the roofline\n(  .*\n)*  warning +" + re.escape(warning), text)
    html, _ = render(tmp_path, capsys, "answers", *files, write(tmp_path, "compare.json", compare_doc()))
    page = browse(browser, html)
    assert page["text"].index("Answers") < page["text"].index("knee at C = 2") < page["text"].index("Comparison")
    same = sweep_doc(model="Qwen/Qwen3-0.6B")
    assert report_html.model_mismatch(report_inputs.Result("roofline", "r.json", roof),
                                      [report_inputs.Result("sweep", "s.json", same)]) == []


def test_a_sweep_without_a_valid_point_says_so_in_the_report(capsys, tmp_path):
    doc = sweep_doc()
    doc["points"] = [p for p in doc["points"] if p["verdict"] in ("INVALID", "ERROR")]
    doc["knee"] = None
    assert report.main([write(tmp_path, "sweep.json", doc), "--format", "text"]) == 0
    text = capsys.readouterr().out
    cause = f"C = 4 was INVALID ({doc['points'][0]['reasons'][0]})"
    assert text.splitlines()[1] == f"  sweep sweep  no knee: no valid point: {cause}; rerun on a quieter client machine"
    assert f"  knee                       none: no valid point: {cause}\n" in text


def test_the_progress_line_counts_in_words(capsys, tmp_path):
    assert report.main([write(tmp_path, "compare.json", compare_doc()), "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().err == f"report: 2 sections, 1 chart written to {tmp_path / 'r.html'}\n"
    assert report.plural(1, "section") == "1 section" and report.plural(0, "chart") == "0 charts"
