"""GPU telemetry (rooflib/server/gpu_telemetry.py): a REAL Prometheus scrapes a DCGM exporter
endpoint serving the recorded exporter page (tests/dcgm_exporter.py, tests/fixtures/dcgm/) beside
a REAL CPU vLLM; each test sets the GPUs' values (idle under a queue, DRAM-bound decode, a
power-capped clock, another process's memory, an XID, the profiling fields not exported) and
`metrics --prometheus` (and `bench --prometheus`) must name the case with its evidence. Then the
pure parts on their own: the join, each finding on the engine reports of saved scrapes, the levers.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import bench
import httpx
import metrics
import pytest
from dcgm_exporter import running_exporter
from prometheus_server import running_prometheus
from test_fleet import ask, evaluated_at, instance, scraped_since, settled_scrapes
from test_metrics import QUEUEING_PROMPTS, send_load
from vllm_server import ServerUnavailable

from rooflib.render import bench_text
from rooflib.server import engine_metrics, fleet, gpu_telemetry, known_settings, snapshots
from rooflib.server.gpu_telemetry import Gpu, Joined, Target

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
SCRAPE_S = 1
MIN_WINDOW_S = 6
POD = {"pod": "vllm-0", "namespace": "llm"}
GPU0 = "GPU-45e15172-50a7-7489-52c1-f796d686a89b"  # the recorded GPU's UUID
# GPU 0 serves the replica's pod; GPU 1, on the same host, another pod's.
GPUS = [{**POD, "container": "vllm"},
        {"gpu": "1", "UUID": "GPU-0c1372db-bb1d-8346-2259-0d3a03ba7e24", "device": "nvidia1",
         "container": "trainer", "namespace": "ml", "pod": "trainer-0"}]
PROFILING = ["DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY",
             "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES",
             "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES"]

# GPU 0's values in each case (the recorded idle page gives the rest).
IDLE = {"DCGM_FI_DEV_GPU_UTIL": 2, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.03, "DCGM_FI_PROF_SM_ACTIVE": 0.02,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.0, "DCGM_FI_PROF_DRAM_ACTIVE": 0.01, "DCGM_FI_DEV_FB_USED": 70000,
        "DCGM_FI_DEV_FB_FREE": 10995, "DCGM_FI_DEV_POWER_USAGE": 95, "DCGM_FI_DEV_SM_CLOCK": 1980,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0}
DRAM_BOUND = {**IDLE, "DCGM_FI_DEV_GPU_UTIL": 100, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.98,
              "DCGM_FI_PROF_SM_ACTIVE": 0.91, "DCGM_FI_PROF_SM_OCCUPANCY": 0.22,
              "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.18, "DCGM_FI_PROF_DRAM_ACTIVE": 0.86,
              "DCGM_FI_DEV_POWER_USAGE": 560, "DCGM_FI_DEV_GPU_TEMP": 61}
THROTTLED = {**DRAM_BOUND, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.45, "DCGM_FI_PROF_DRAM_ACTIVE": 0.40,
             "DCGM_FI_DEV_POWER_USAGE": 699, "DCGM_FI_DEV_SM_CLOCK": 1410, "DCGM_FI_DEV_GPU_TEMP": 72,
             "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x4,  # SW power cap
             "DCGM_FI_DEV_POWER_VIOLATION": lambda s: 6e8 * s}  # 0.6 s of every second
OTHER_PROCESS = {**IDLE, "DCGM_FI_DEV_FB_USED": 79800, "DCGM_FI_DEV_FB_FREE": 1195}
XID = {**IDLE, "DCGM_FI_DEV_XID_ERRORS": 79}


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"real GPU-telemetry set-up unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"real GPU-telemetry set-up unavailable: {reason}")


@pytest.fixture(scope="module")
def setup(vllm_factory, tmp_path_factory):
    """A real vLLM (max_num_seqs 2) labelled as pod vllm-0, the exporter (serving nothing until a
    test asks), and a real Prometheus scraping both, the exporter with honor_labels as the recipe."""
    with ExitStack() as stack:
        server = stack.enter_context(vllm_factory(sets=["max_num_seqs=2", "enable_prefix_caching=false"]))
        exporter = stack.enter_context(running_exporter(GPUS))
        exporter.serving = False
        job = {"job_name": "dcgm", "honor_labels": True, "static_configs": [{"targets": [exporter.instance]}]}
        try:
            prom = stack.enter_context(running_prometheus(tmp_path_factory.mktemp("prometheus"),
                                                          [instance(server.url)], SCRAPE_S, target_labels=POD,
                                                          more_jobs=[job]))
        except ServerUnavailable as exc:
            _unavailable(str(exc))
        scraped_after(setup_targets(server, exporter), prom, time.time())
        yield {"server": server, "exporter": exporter, "prometheus": prom}


def setup_targets(server, exporter) -> list[str]:
    return [instance(server.url), exporter.instance]


def scraped_after(targets: list[str], prom, since: float) -> float:
    """Wait (60 s at most past `since`) until the latest scrape of both targets began after
    `since` and succeeded (a busy vLLM may miss a scrape); the later of their times."""
    return max(scraped_since(prom, targets, since, job="").values())


@dataclass(frozen=True)
class Window:
    seconds: int  # --window, whole seconds
    at: float     # unix time: its end, the instant every query is evaluated at (test_fleet.evaluated_at)


def window_after(setup, values: dict, load=lambda: None, serving: bool = True) -> Window:
    """Set GPU 0's values, wait for Prometheus to scrape them, run `load`, and return a window
    that opens 1 to 2 s after that scrape and ends at a later one, both targets up: it holds the
    new values only, and the load whole, after a flat sample of the engine's counters (a scrape
    of both after the window opened comes before the load). Not `serving`: the exporter's page is
    empty."""
    targets, prom = setup_targets(setup["server"], setup["exporter"]), setup["prometheus"]
    setup["exporter"].serving = serving
    setup["exporter"].set(0, **values)
    changed = scraped_after(targets, prom, time.time())
    scraped_after(targets, prom, changed + 2 * SCRAPE_S)
    load()
    time.sleep(max(0.0, changed + MIN_WINDOW_S + 1 - time.time()))  # a window of a few scrapes
    _, at = settled_scrapes(prom, targets, time.time(), job="")
    return Window(int(at - changed) - 1, at)


def telemetry(setup, monkeypatch, capsys, window: Window) -> tuple[dict, dict]:
    """metrics --prometheus --json over the window: (the report, its gpu_telemetry)."""
    evaluated_at(monkeypatch, window.at)
    code, report, err = ask(setup["prometheus"], monkeypatch, capsys, "--window", str(window.seconds))
    assert code == 0, err
    return report, report["gpu_telemetry"]


def kinds(doc: dict) -> list[str]:
    return [f["kind"] for f in doc["findings"]]


def named(doc: dict, kind: str) -> dict:
    found = [f for f in doc["findings"] if f["kind"] == kind]
    assert found, f"no {kind} in {kinds(doc)}; replicas: {doc['replicas']}"
    return found[0]


@pytest.mark.real_vllm
@pytest.mark.external  # Prometheus, from tests/install_prometheus.sh
class TestRealGpuTelemetry:
    """In order: no exporter series, a queue on an idle GPU, DRAM-bound decode, a power cap,
    another process's memory, an XID, the profiling fields not exported, bench's run."""

    def test_without_exporter_series_it_says_there_is_no_gpu_telemetry(self, setup, monkeypatch, capsys):
        window = window_after(setup, IDLE, serving=False)
        report, doc = telemetry(setup, monkeypatch, capsys, window)
        assert doc["exported"] is False and doc["note"].startswith("no GPU telemetry: Prometheus holds no DCGM")
        assert doc["findings"] == [] and doc["replicas"] == []
        monkeypatch.setenv("PROMETHEUS_USER", setup["prometheus"].user)
        monkeypatch.setenv("PROMETHEUS_PASSWORD", setup["prometheus"].password)
        assert metrics.main(["--prometheus", setup["prometheus"].url, "--window", str(window.seconds)]) == 0
        assert "GPU telemetry (DCGM exporter through Prometheus):\n  no GPU telemetry:" in capsys.readouterr().out

    def test_a_queue_on_an_idle_gpu_is_a_scheduler_limit(self, setup, monkeypatch, capsys):
        server = setup["server"]
        for prompt_tokens in QUEUEING_PROMPTS:  # prefill-heavy loads until the engine queues
            window = window_after(setup, IDLE, lambda: send_load(server.url, server.model, 16, 16,
                                                                prompt_tokens, 16, seed=31))
            report, doc = telemetry(setup, monkeypatch, capsys, window)
            replica = report["replicas"][0]
            if fleet.queued(replica, known_settings.QUEUE_SHARE):
                break
        finding = named(doc, "gpu_idle_queue")
        assert finding["replica"] == instance(server.url) and finding["gpus"] == [GPU0]
        assert "SM active 2%, DRAM active 1% on 1 GPU(s)" in finding["evidence"]
        assert finding["setting"] == "--max-num-seqs" and finding["current_source"] == "unknown"
        assert finding["confidence"].startswith("high")
        assert kinds(doc) == ["gpu_idle_queue"]
        # joined by the pod labels: GPU 1 on the same host serves another pod
        gpus = doc["replicas"][0]["gpus"]
        assert doc["replicas"][0]["joined_by"] == "pod" and [g["uuid"] for g in gpus] == [GPU0]
        assert gpus[0]["pod"] == "vllm-0" and gpus[0]["model"] == "NVIDIA H100 80GB HBM3"
        assert gpus[0]["figures"]["sm_active"]["mean"] == pytest.approx(0.02)
        assert gpus[0]["figures"]["util"]["mean"] == pytest.approx(0.02)  # GPU_UTIL's percent as a ratio
        assert doc["absent"] == [] and doc["plan"][0]["setting"] == "--max-num-seqs"

    def test_decode_near_the_memory_bound_is_named_with_the_roofline(self, setup, monkeypatch, capsys):
        server = setup["server"]
        window = window_after(setup, DRAM_BOUND, lambda: send_load(server.url, server.model, 4, 2, 64, 64, seed=32))
        report, doc = telemetry(setup, monkeypatch, capsys, window)
        finding = named(doc, "gpu_memory_bound")
        replica = report["replicas"][0]
        assert "DRAM active 86%" in finding["evidence"] and "tensor pipes are active 18%" in finding["evidence"]
        assert "of 3.35 TB/s per GPU (NVIDIA H100 SXM 80GB)" in finding["evidence"]
        figures = finding["figures"]
        assert figures["tb_s_per_gpu"] == pytest.approx(0.86 * 3.35)
        steps = replica["gen_tok_s"] / replica["running_mean"]
        assert figures["gb_per_step_per_gpu"] == pytest.approx(0.86 * 3.35e3 / steps)
        assert "gpu_idle_queue" not in kinds(doc)
        assert [lever["text"].split(":")[0] for lever in doc["plan"]] == [
            "FP8 weights (--quantization fp8) and --kv-cache-dtype fp8",
            "a larger decode batch (more requests running per step)", "tensor parallel (--tensor-parallel-size)"]

    def test_a_power_capped_clock_is_named_with_its_reason(self, setup, monkeypatch, capsys):
        _, doc = telemetry(setup, monkeypatch, capsys, window_after(setup, THROTTLED))
        finding = named(doc, "gpu_throttled")
        assert kinds(doc) == ["gpu_throttled"] and finding["gpus"] == [GPU0]
        assert "power cap (SW) 100% of the window" in finding["evidence"]
        assert "SM clock mean 1410 MHz (max 1980); power up to 699 W of a 700 W limit; up to 72 C" in finding["evidence"]
        # The violation counter's increase: 0.6 s of each second. The exporter (a thread of this
        # process) stamps the counter when it writes the page, Prometheus the sample when the
        # scrape starts: a page a busy process writes late moves a sample's value by that delay,
        # a few hundred ms at most over the window of about 6 s, a few hundredths here.
        assert 0.4 <= finding["figures"]["reasons"]["power (violation time)"] <= 0.8
        assert doc["plan"][0]["text"].startswith("check the enforced power limit")

    def test_a_full_framebuffer_beside_a_small_kv_cache_points_to_another_process(self, setup, monkeypatch, capsys):
        _, doc = telemetry(setup, monkeypatch, capsys, window_after(setup, OTHER_PROCESS))
        finding = named(doc, "gpu_memory_other_process")
        assert kinds(doc) == ["gpu_memory_other_process"]
        # the CPU engine's KV cache, 1 GiB (VLLM_CPU_KVCACHE_SPACE), exported in vllm:cache_config_info
        assert finding["setting"] == "--kv-cache-memory-bytes" and finding["current"] == 1 << 30
        assert finding["current_source"] == "exported" and finding["confidence"].startswith("low")
        assert "framebuffer 97.8% full (77.9 GiB of 79.6 GiB)" in finding["evidence"]
        assert "nvidia-smi --query-compute-apps" in doc["plan"][0]["text"]

    def test_an_xid_is_named_as_the_hardware(self, setup, monkeypatch, capsys):
        _, doc = telemetry(setup, monkeypatch, capsys, window_after(setup, XID))
        finding = named(doc, "gpu_xid")
        assert kinds(doc) == ["gpu_xid"] and finding["figures"] == {"xid": 79}
        assert "XID 79" in finding["evidence"] and "not the serving configuration" in finding["evidence"]
        assert doc["plan"][0]["text"].startswith("drain the replica")

    def test_profiling_fields_not_exported_are_reported_absent(self, setup, monkeypatch, capsys):
        server = setup["server"]
        setup["exporter"].drop("DCGM_FI_PROF_")
        try:  # a DRAM-bound decode whose DRAM activity Prometheus never sees
            window = window_after(setup, DRAM_BOUND,
                                  lambda: send_load(server.url, server.model, 4, 2, 64, 64, seed=33))
            _, doc = telemetry(setup, monkeypatch, capsys, window)
        finally:
            setup["exporter"].drop()
        assert doc["absent"] == PROFILING
        gpu = doc["replicas"][0]["gpus"][0]
        assert "dram_active" not in gpu["figures"] and gpu["figures"]["util"]["mean"] == pytest.approx(1.0)
        assert "gpu_memory_bound" not in kinds(doc)
        lines = gpu_telemetry.format_lines(doc)
        assert f"  not exported (not guessed): {', '.join(PROFILING)}" in lines
        assert "util 100%, SM active n/a, tensor n/a, DRAM n/a" in lines[2]

    def test_bench_reads_the_gpus_under_its_own_load(self, setup, monkeypatch, capsys):
        server, prom = setup["server"], setup["prometheus"]
        setup["exporter"].serving = True
        setup["exporter"].set(0, **DRAM_BOUND)
        scraped_after(setup_targets(server, setup["exporter"]), prom, time.time())
        monkeypatch.setenv("PROMETHEUS_USER", prom.user)
        monkeypatch.setenv("PROMETHEUS_PASSWORD", prom.password)
        # A run of several seconds: its window must hold a few of the exporter's 1 s scrapes.
        code = bench.main(["--url", server.url, "-n", "16", "-c", "2", "--input-tokens", "64", "--output-tokens",
                           "128", "--prometheus", prom.url, "--json"])
        out = capsys.readouterr()
        result = json.loads(out.out)
        # 4: the busy machine's client lag made the run INVALID; the server's side still stands
        assert code in (0, 4), result["verdict_reasons"]
        assert result["requests"]["completed"] == 16
        doc = result["server"]["gpu_telemetry"]
        assert doc["window_s"] >= 3, "the run was too short to read the GPUs over it"
        gpu = doc["replicas"][0]["gpus"][0]
        assert doc["replicas"][0]["joined_by"] == "pod" and gpu["uuid"] == GPU0
        assert gpu["figures"]["dram_active"]["mean"] == pytest.approx(0.86)
        assert "gpu_memory_bound" in kinds(doc)
        assert "prometheus_auth" not in result["config"] and prom.password not in out.out
        text = bench_text.human_text(result)
        assert "GPU telemetry (DCGM exporter through Prometheus):" in text and "[gpu_memory_bound]" in text


# --------------------------------------------------------------------------------------------
# The pure parts: the join, each finding on engine reports of saved scrapes, the levers.

def saved_window(before: str, after: str) -> dict:
    """The engine report of two saved scrapes 30 s apart (tests/fixtures/metrics)."""
    snaps = [snapshots.snapshot((FIXTURES / name).read_text()) for name in (before, after)]
    snaps[0]["time"], snaps[1]["time"] = 0.0, 30.0
    return engine_metrics.report(snapshots.difference(*snaps))


def gpu(index: str = "0", pod: str = "", host: str = "node-1", exporter: str = "node-1:9400") -> Gpu:
    return Gpu(uuid=f"GPU-{index}", index=index, model="NVIDIA H100 80GB HBM3", exporter=exporter, host=host,
               pod=pod, namespace="llm" if pod else "")


def joined(figures: dict, gpus: tuple[Gpu, ...] = (gpu(),)) -> Joined:
    return Joined("node-1:8000", "host", gpus, {g.id: figures for g in gpus})




def test_the_join_takes_the_pod_first_then_the_host():
    gpus = [gpu("0", pod="vllm-0"), gpu("1", pod="trainer-0"), gpu("2", host="node-2", exporter="10.0.0.2:9400")]
    found = gpu_telemetry.join([Target("10.0.0.9:8000", "vllm-0", "llm"), Target("node-1:8000"),
                                Target("10.0.0.2:8000"), Target("[::1]:8000")], gpus)
    assert found["10.0.0.9:8000"] == ("pod", [gpus[0]])            # pod labels, whatever the host
    assert found["node-1:8000"] == ("host", gpus[:2])              # the exporter's hostname label
    assert found["10.0.0.2:8000"] == ("host", [gpus[2]])           # the exporter's own address
    assert found["[::1]:8000"] == (None, [])


def test_the_gpus_user_is_read_from_exported_labels_when_prometheus_kept_its_own():
    labels = {"instance": "10.1.2.3:9400", "UUID": "GPU-a", "gpu": "3", "modelName": "NVIDIA H100 80GB HBM3",
              "hostname": "node-7", "pod": "dcgm-exporter-x2", "namespace": "gpu-operator",
              "exported_pod": "vllm-3", "exported_namespace": "llm", "GPU_I_ID": "2"}
    found = gpu_telemetry.gpu_of(labels)
    assert (found.pod, found.namespace, found.host, found.id) == ("vllm-3", "llm", "node-7", "GPU-a/2")


def test_a_queue_on_an_idle_gpu_and_a_queue_behind_a_full_kv_cache_name_different_settings():
    idle = {"sm_active": {"mean": 0.1}, "dram_active": {"mean": 0.05}}
    queued = saved_window("vllm-0.32-queue-before.txt", "vllm-0.32-queue-after.txt")
    [finding] = gpu_telemetry.findings(queued, joined(idle))
    assert (finding["kind"], finding["setting"], finding["current_source"]) == ("gpu_idle_queue", "--max-num-seqs",
                                                                                "unknown")
    preempted = saved_window("vllm-0.32-preempt-before.txt", "vllm-0.32-preempt-after.txt")
    [finding] = gpu_telemetry.findings(preempted, joined(idle))
    assert finding["setting"] == "--gpu-memory-utilization" and finding["current"] == 0.92
    assert "the KV cache is full (preemptions 5" in finding["evidence"]
    # a busy GPU under the same queue is not the scheduler's doing
    assert gpu_telemetry.findings(queued, joined({"sm_active": {"mean": 0.9}})) == []
    # without SM activity, GPU_UTIL stands in, and the confidence says so
    [finding] = gpu_telemetry.findings(queued, joined({"util": {"mean": 0.3}}))
    assert finding["confidence"].startswith("medium: GPU_UTIL")


def test_another_process_is_what_the_framebuffer_holds_beyond_the_engines_share():
    r = saved_window("vllm-0.32-before.txt", "vllm-0.32-after.txt")
    r = {**r, "deployment": {**r["deployment"], "kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.5}}
    figures = {"fb_used_mib": {"mean": 60000, "max": 60000}, "fb_free_mib": {"mean": 20995},
               "fb_reserved_mib": {"mean": 564}}
    [finding] = gpu_telemetry.findings(r, joined(figures))
    assert (finding["setting"], finding["current"]) == ("--gpu-memory-utilization", 0.5)
    assert finding["figures"]["other_mib"] == pytest.approx(60000 - 0.5 * 81559)
    assert "about 18.8 GiB belong to another process" in finding["evidence"]
    # within the engine's share: nothing
    figures.update(fb_used_mib={"mean": 40000, "max": 40000}, fb_free_mib={"mean": 40995})
    assert gpu_telemetry.findings(r, joined(figures)) == []


def test_a_clock_at_the_power_limit_without_the_reasons_is_a_low_confidence_inference():
    figures = {"power_w": {"mean": 698, "max": 699}, "power_limit_w": {"mean": 700}, "sm_clock_mhz": {"mean": 1500}}
    r = saved_window("vllm-0.32-idle.txt", "vllm-0.32-idle.txt")
    [finding] = gpu_telemetry.findings(r, joined(figures))
    assert finding["kind"] == "gpu_throttled" and finding["confidence"].startswith("low")
    assert "power cap (inferred: power at its limit)" in finding["evidence"]
    # with the reasons exported and clear, power at the limit alone is no finding
    figures["clock_reasons"] = {"4": 0.0, "8": 0.0, "32": 0.0, "64": 0.0, "128": 0.0}
    assert gpu_telemetry.findings(r, joined(figures)) == []


def test_every_lever_has_the_causal_diagnosis_keys():
    queued = saved_window("vllm-0.32-queue-before.txt", "vllm-0.32-queue-after.txt")
    found = gpu_telemetry.findings(queued, joined({"sm_active": {"mean": 0.1}, "xid": {"max": 48}}))
    assert [f["kind"] for f in found] == ["gpu_xid", "gpu_idle_queue"]
    contract = {"kind", "evidence", "confidence", "caused_by", "setting", "current", "current_source"}
    for finding in found:
        assert contract <= set(finding)
        for lever in gpu_telemetry.levers(finding, "vllm"):
            assert set(lever) == {"setting", "current", "current_source", "proposed", "reason", "effect", "text"}


def test_a_prometheus_without_exporter_series_gives_the_plain_note():
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params["query"])
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": []}})
    with fleet.Prometheus("http://prom:9090", transport=httpx.MockTransport(answer)) as prom:
        names, found = gpu_telemetry.read(prom, 60, ["r1:8000"])
    doc = gpu_telemetry.summary({"r1:8000": {}}, names, found, "vllm", prom.url, 60.0)
    assert asked == ['count by (__name__) ({__name__=~"DCGM_FI_.+"})']
    assert doc["exported"] is False and doc["note"] == gpu_telemetry.NO_TELEMETRY
    assert gpu_telemetry.format_lines(doc) == ["GPU telemetry (DCGM exporter through Prometheus):",
                                               f"  {gpu_telemetry.NO_TELEMETRY}"]


def test_a_window_without_samples_of_a_held_field_says_so():
    names = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_DRAM_ACTIVE"}
    queued = saved_window("vllm-0.32-queue-before.txt", "vllm-0.32-queue-after.txt")
    doc = gpu_telemetry.summary({"node-1:8000": queued}, names, [joined({"util": {"mean": 0.9}})], "vllm",
                                "http://prom:9090", 2.0)
    assert doc["replicas"][0]["note"].startswith("no sample of dram_active in the 2 s window")


def _finding(kind: str, setting: str | None = None, caused_by: str | None = None, **figures) -> dict:
    return {"kind": kind, "evidence": f"{kind} evidence", "confidence": "high", "caused_by": caused_by,
            "setting": setting, "current": None, "current_source": None, "figures": figures}


def _engine(*found: dict) -> dict:
    return {"root_cause": found[0] if found else None, "findings": list(found),
            "plan": [{"setting": "--gpu-memory-utilization", "text": "raise it"}], "verify": ["task infer:bench"]}


@pytest.mark.parametrize("gpu_kind, engine_kinds, root, under", [
    # Another process's memory is why the KV cache is small: it leads, the KV finding sits under it.
    ("gpu_memory_other_process", ["kv_cache", "queue"], "gpu_memory_other_process", {"kv_cache": "gpu_memory_other_process"}),
    # An XID leads whatever the engine says.
    ("gpu_xid", ["running_limit", "queue"], "gpu_xid", {"running_limit": None}),
    # An idle GPU under a queue explains the running limit; the engine's root stays the root.
    ("gpu_idle_queue", ["running_limit", "queue"], "running_limit", {"gpu_idle_queue": "running_limit"}),
    # A throttled clock is the cause of slow tokens only when slow tokens are the engine's root.
    ("gpu_throttled", ["decode"], "gpu_throttled", {"decode": "gpu_throttled"}),
    ("gpu_throttled", ["running_limit", "decode"], "running_limit", {"decode": None, "gpu_throttled": None}),
])
def test_gpu_findings_take_their_place_in_the_causal_chain(gpu_kind, engine_kinds, root, under):
    engine = _engine(*[_finding(kind) for kind in engine_kinds])
    gpu = {"findings": [_finding(gpu_kind, reasons=["power"])]}
    placed = gpu_telemetry.in_chain(gpu, engine, "vllm")
    assert placed["root_cause"]["kind"] == root
    by_kind = {f["kind"]: f for f in placed["findings"]}
    assert {kind: by_kind[kind]["caused_by"] for kind in under} == under
    assert placed["verify"] == ["task infer:bench"]
    if root == gpu_kind:  # the GPU root's own lever comes first
        assert placed["plan"][0]["text"] == gpu_telemetry.levers(by_kind[gpu_kind], "vllm")[0]["text"]


def test_without_gpu_findings_the_engine_diagnosis_stands():
    engine = _engine(_finding("kv_cache"))
    assert gpu_telemetry.in_chain({"findings": []}, engine, "vllm") == engine
    assert gpu_telemetry.in_chain(None, engine, "vllm") == engine
