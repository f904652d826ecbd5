"""GPU telemetry from NVIDIA's DCGM exporter, read from the Prometheus that scrapes the engines,
joined to the engine replicas the GPUs serve, and the findings only the GPU can show.

vLLM's and SGLang's /metrics cannot tell a queue behind the running-requests cap from a queue
behind a saturated GPU; the exporter's series can. Field names and meanings come from
dcgm-exporter's etc/default-counters.csv and DCGM's dcgmlib/dcgm_fields.h (cited with their
commits in the skill's references/gpu-telemetry.md). Each field is averaged, and its peak taken,
per GPU over the window; a field Prometheus does not hold is listed in `absent`, never guessed
(the exporter's default counters leave out SM activity, SM occupancy, the clock event reasons,
the power limit and NVLink traffic: the shipped counters file adds them).

Joining a GPU to a replica, first match wins:
  pod   the exporter's Kubernetes mapping labels the GPU with the pod using it (`pod` and
        `namespace`; `exported_pod` and `exported_namespace` when Prometheus kept its own target
        labels, honor_labels false), equal to the replica's pod labels
  host  the replica's host (its `instance` without the port) equals the exporter's host or the
        GPU's `hostname` label (`Hostname` before dcgm-exporter 4.8.2): every GPU of that host
Replicas sharing a host (and no pod labels) share its GPUs in the figures: the join says so.

Findings, in the causal diagnosis' shape (kind, evidence, confidence, caused_by, setting, current,
current_source) plus `replica` and `gpus`, each with the figures behind it:
  gpu_xid                   the driver reported an XID error: the hardware or driver, not the config
  gpu_throttled             the SM clock was held down by the power cap or heat, with the reason
  gpu_memory_other_process  the framebuffer is fuller than this engine's share: another process
  gpu_memory_bound          decode with DRAM near its practical peak: fewer bytes per token help
  gpu_idle_queue            requests wait while SMs and DRAM are mostly idle: a scheduler limit
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

from rooflib.core import catalogs
from rooflib.core.errors import UsageError
from rooflib.server import engine_metrics, fleet, known_settings

# concept -> (the exporter's metric names, first held wins; how the window reads it)
#   ratio    a gauge 0..1, averaged and its peak taken
#   percent  a gauge 0..100, read as a ratio
#   gauge    a gauge in its own unit (MiB, W, MHz, C, bytes/s)
#   ns       a counter of nanoseconds: its increase over the window, as a share of the window
#   reasons  DCGM_FI_DEV_CLOCKS_EVENT_REASONS' bitmask: each reason's share of the window
#   last     a gauge holding the last event's code (XID): its peak over the window
FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "util": (("DCGM_FI_DEV_GPU_UTIL",), "percent"),
    "gr_active": (("DCGM_FI_PROF_GR_ENGINE_ACTIVE",), "ratio"),
    "sm_active": (("DCGM_FI_PROF_SM_ACTIVE",), "ratio"),
    "sm_occupancy": (("DCGM_FI_PROF_SM_OCCUPANCY",), "ratio"),
    "tensor_active": (("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",), "ratio"),
    "dram_active": (("DCGM_FI_PROF_DRAM_ACTIVE",), "ratio"),
    "fb_used_mib": (("DCGM_FI_DEV_FB_USED",), "gauge"),
    "fb_free_mib": (("DCGM_FI_DEV_FB_FREE",), "gauge"),
    "fb_reserved_mib": (("DCGM_FI_DEV_FB_RESERVED",), "gauge"),
    "power_w": (("DCGM_FI_DEV_POWER_USAGE",), "gauge"),
    "power_limit_w": (("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_POWER_MGMT_LIMIT"), "gauge"),
    "sm_clock_mhz": (("DCGM_FI_DEV_SM_CLOCK",), "gauge"),
    "max_sm_clock_mhz": (("DCGM_FI_DEV_MAX_SM_CLOCK",), "gauge"),
    "clock_reasons": (("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"), "reasons"),
    "power_violation": (("DCGM_FI_DEV_POWER_VIOLATION",), "ns"),
    "thermal_violation": (("DCGM_FI_DEV_THERMAL_VIOLATION",), "ns"),
    "temp_c": (("DCGM_FI_DEV_GPU_TEMP",), "gauge"),
    "xid": (("DCGM_FI_DEV_XID_ERRORS",), "last"),
    "pcie_tx_bytes_s": (("DCGM_FI_PROF_PCIE_TX_BYTES",), "gauge"),
    "pcie_rx_bytes_s": (("DCGM_FI_PROF_PCIE_RX_BYTES",), "gauge"),
    "nvlink_tx_bytes_s": (("DCGM_FI_PROF_NVLINK_TX_BYTES",), "gauge"),
    "nvlink_rx_bytes_s": (("DCGM_FI_PROF_NVLINK_RX_BYTES",), "gauge"),
}

# DCGM_CLOCKS_EVENT_REASON_* bits that hold the clock down for power or heat (dcgmlib/dcgm_fields.h).
# GPU_IDLE, the applications-clocks setting, sync boost and display clocks are not throttling.
THROTTLE_REASONS = {0x4: "power cap (SW)", 0x8: "HW slowdown", 0x20: "thermal (SW)",
                    0x40: "thermal (HW)", 0x80: "power brake (HW)"}

# Rules of thumb of the GPU findings (references/gpu-telemetry.md; change them together).
DRAM_BUSY = 0.5         # DRAM active from which decode reads memory near the bound (practical peak ~0.8)
SM_IDLE = 0.5           # SM active below which the GPU is mostly idle (DCGM: below 0.5, ineffective use)
THROTTLE_SHARE = 0.05   # share of the window with a power or thermal reason that counts as held down
POWER_AT_LIMIT = 0.97   # power draw, as a share of the enforced limit, that counts as at the limit
FB_FULL = 0.95          # framebuffer used, as a share of the total, that counts as full
KV_SMALL_SHARE = 0.25   # an explicit KV cache below this share of the used framebuffer is small
OTHER_MARGIN_MIB = 1024  # framebuffer beyond the engine's share that is not rounding or a CUDA context

DCGM_NAMES = "DCGM_FI_.+"
ENGINE_NAMES = "vllm:.+|sglang:.+"
# Labels that tell one GPU (and its MIG instance) apart, and those the join reads.
GPU_LABELS = ("instance", "job", "gpu", "UUID", "GPU_I_ID", "modelName", "hostname", "Hostname",
              "pod", "namespace", "exported_pod", "exported_namespace")
_UUID = re.compile(r"^[A-Za-z0-9-]+$")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU (or MIG instance) as the exporter labels it."""
    uuid: str
    index: str
    model: str
    exporter: str     # the exporter's scrape target (instance)
    host: str         # the exporter's hostname label, else the exporter's host
    pod: str          # the pod using it, from the Kubernetes mapping ('' without one)
    namespace: str
    mig: str = ""     # GPU_I_ID of a MIG instance

    @property
    def id(self) -> str:
        """The UUID, and the MIG instance after a slash (MIG instances share their GPU's UUID)."""
        return f"{self.uuid}/{self.mig}" if self.mig else self.uuid


@dataclasses.dataclass(frozen=True)
class Target:
    """An engine replica as its series label it: the scrape target and its pod labels."""
    instance: str
    pod: str = ""
    namespace: str = ""


@dataclasses.dataclass(frozen=True)
class Joined:
    """The GPUs of one replica, how they were found, and their figures."""
    instance: str
    by: str | None                       # "pod", "host" or None (no GPU of it found)
    gpus: tuple[Gpu, ...]
    figures: Mapping[str, Mapping[str, Any]]  # gpu id -> concept -> {"mean", "max", ...}
    shared_with: tuple[str, ...] = ()    # other replicas joined to the same host's GPUs


# ---------------------------------------------------------------------------------------------
# Reading Prometheus

def held_names(prom: fleet.Prometheus) -> set[str]:
    """The DCGM exporter metric names Prometheus holds now."""
    rows = prom.query(f'count by (__name__) ({{__name__=~"{DCGM_NAMES}"}})')
    return {row["metric"].get("__name__", "") for row in rows} - {""}


def gpus_held(prom: fleet.Prometheus) -> list[Gpu]:
    """Every GPU the exporters report, with the labels the join reads."""
    rows = prom.query(f'count by ({", ".join(GPU_LABELS)}) ({{__name__=~"{DCGM_NAMES}"}})')
    found = {}
    for row in rows:
        gpu = gpu_of(row["metric"])
        found[(gpu.exporter, gpu.uuid, gpu.mig)] = gpu
    return sorted(found.values(), key=lambda g: (g.exporter, g.index, g.mig))


def gpu_of(labels: Mapping[str, str]) -> Gpu:
    exporter = labels.get("instance", "")
    return Gpu(uuid=labels.get("UUID", ""), index=labels.get("gpu", ""), model=labels.get("modelName", ""),
               exporter=exporter, host=labels.get("hostname") or labels.get("Hostname") or host_of(exporter),
               pod=labels.get("exported_pod") or labels.get("pod", ""),
               namespace=labels.get("exported_namespace") or labels.get("namespace", ""),
               mig=labels.get("GPU_I_ID", ""))


def targets_held(prom: fleet.Prometheus, instances: Sequence[str], match: str = "") -> list[Target]:
    """The replicas `instances` with the pod labels their engine series carry (none: no labels)."""
    rows = prom.query(f"count by (instance, pod, namespace) ({fleet.selector(match, __name__=ENGINE_NAMES)})")
    labelled = {row["metric"].get("instance", ""): row["metric"] for row in rows}
    return [Target(i, labelled.get(i, {}).get("pod", ""), labelled.get(i, {}).get("namespace", ""))
            for i in instances]


def figure_queries(names: set[str], seconds: float, uuids: Sequence[str]) -> dict[str, str]:
    """The PromQL of every figure the held fields give, over the last `seconds`, for these GPUs."""
    rng = fleet.range_of(seconds)
    step = f"{max(1, fleet.range_seconds(seconds) // 60)}s"  # a subquery's resolution: ~60 points
    sel = f'{{UUID=~"{"|".join(uuids)}"}}'
    result = {}
    for concept, (metrics, how) in FIELDS.items():
        metric = next((m for m in metrics if m in names), None)
        if metric is None:
            continue
        series = f"{metric}{sel}"
        if how in ("ratio", "percent", "gauge"):
            result[f"{concept}.mean"] = f"avg_over_time({series}[{rng}])"
            result[f"{concept}.max"] = f"max_over_time({series}[{rng}])"
        elif how == "ns":
            result[f"{concept}.share"] = f"increase({series}[{rng}]) / 1e9 / {fleet.range_seconds(seconds)}"
        elif how == "reasons":
            for bit in THROTTLE_REASONS:
                result[f"{concept}.{bit}"] = f"avg_over_time((floor({series} / {bit}) % 2)[{rng}:{step}])"
        elif how == "last":
            result[f"{concept}.max"] = f"max_over_time({series}[{rng}])"
    return result


def read_figures(prom: fleet.Prometheus, queries: Mapping[str, str]) -> dict[str, dict[str, dict[str, float]]]:
    """{gpu id: {concept: {stat: value}}} of the figure queries; percentages read as ratios."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    for key, expr in queries.items():
        concept, stat = key.split(".", 1)
        scale = 0.01 if FIELDS[concept][1] == "percent" else 1.0
        for row in prom.query(expr):
            value = float(row["value"][1])
            if math.isfinite(value):
                result.setdefault(gpu_of(row["metric"]).id, {}).setdefault(concept, {})[stat] = value * scale
    return result


def absent_fields(names: set[str]) -> list[str]:
    """The fields this module reads that Prometheus does not hold (the first name of each)."""
    return [metrics[0] for metrics, _ in FIELDS.values() if not any(m in names for m in metrics)]


# ---------------------------------------------------------------------------------------------
# The join

def host_of(instance: str) -> str:
    """`host` of `host:port`, `[v6]:port` or a bare host."""
    if instance.startswith("["):
        return instance[1:].split("]", 1)[0]
    return instance.rsplit(":", 1)[0] if instance.count(":") == 1 else instance


def join(targets: Sequence[Target], gpus: Sequence[Gpu]) -> dict[str, tuple[str | None, list[Gpu]]]:
    """{instance: (how, its GPUs)}: by pod where both sides carry pod labels, else by host."""
    result: dict[str, tuple[str | None, list[Gpu]]] = {}
    for target in targets:
        by_pod = [g for g in gpus if target.pod and g.pod == target.pod
                  and (not target.namespace or not g.namespace or g.namespace == target.namespace)]
        if by_pod:
            result[target.instance] = ("pod", by_pod)
            continue
        host = host_of(target.instance)
        by_host = [g for g in gpus if host in (g.host, host_of(g.exporter))]
        result[target.instance] = ("host", by_host) if by_host else (None, [])
    return result


def read(prom: fleet.Prometheus, seconds: float, instances: Sequence[str], match: str = ""
         ) -> tuple[set[str], list[Joined]]:
    """The held DCGM names and, for each replica, its GPUs and their figures over the window."""
    names = held_names(prom)
    if not names:
        return names, [Joined(i, None, (), {}) for i in instances]
    joined = join(targets_held(prom, instances, match), gpus_held(prom))
    uuids = sorted({g.uuid for _, gs in joined.values() for g in gs if _UUID.match(g.uuid)})
    figures = read_figures(prom, figure_queries(names, seconds, uuids)) if uuids else {}
    result = []
    for instance in instances:
        by, gpus = joined[instance]
        shared = tuple(i for i, (b, gs) in joined.items()
                       if i != instance and by == "host" and b == "host" and set(gs) & set(gpus))
        result.append(Joined(instance, by, tuple(gpus), {g.id: figures.get(g.id, {}) for g in gpus}, shared))
    return names, result


# ---------------------------------------------------------------------------------------------
# Findings (pure): `r` is the replica's engine_metrics.report (with `config`, the fleet's cache
# settings, where Prometheus gave them); flag names are the diagnosis' (known_settings.FLAGS).

def _finding(kind: str, joined: Joined, gpus: Sequence[Gpu], evidence: str, confidence: str,
             figures: Mapping[str, Any], setting: str | None = None, current: Any = None,
             source: str | None = None) -> dict[str, Any]:
    return {"kind": kind, "evidence": evidence, "confidence": confidence, "caused_by": None,
            "setting": setting, "current": current, "current_source": source if setting else None,
            "replica": joined.instance, "gpus": [g.id for g in gpus], "figures": dict(figures)}


def deployment(r: Mapping[str, Any]) -> Mapping[str, Any]:
    """The replica's cache settings: its report's, else those of the cache_config_info labels
    Prometheus gave (`config`), read the same way."""
    return r.get("deployment") or engine_metrics.deployment_config(r.get("config") or {}, r.get("tokens_per_request"))


def _stat(figures: Mapping[str, Mapping[str, float]], concept: str, stat: str = "mean") -> float | None:
    return figures.get(concept, {}).get(stat)


def _mean_over(joined: Joined, concept: str) -> float | None:
    """The mean of a figure over the replica's GPUs (tensor-parallel GPUs work in step)."""
    values = [v for v in (_stat(joined.figures.get(g.id, {}), concept) for g in joined.gpus) if v is not None]
    return sum(values) / len(values) if values else None


def busy(joined: Joined) -> tuple[float | None, str]:
    """How busy the GPUs' SMs were, and by which measure: SM activity where exported, else the
    graphics engine's activity, else GPU_UTIL (the time any kernel ran: it overstates)."""
    for concept, measure in (("sm_active", "SM active"), ("gr_active", "graphics engine active"),
                             ("util", "GPU_UTIL (time any kernel ran)")):
        value = _mean_over(joined, concept)
        if value is not None:
            return value, measure
    return None, ""


def framebuffer_mib(figures: Mapping[str, Mapping[str, float]]) -> float | None:
    """The GPU's whole framebuffer: used + free + reserved (a constant, so their means add up)."""
    used, free = _stat(figures, "fb_used_mib"), _stat(figures, "fb_free_mib")
    return None if used is None or free is None else used + free + (_stat(figures, "fb_reserved_mib") or 0.0)


def _name(gpu: Gpu) -> str:
    return f"GPU {gpu.index}{'/' + gpu.mig if gpu.mig else ''} ({gpu.model or gpu.uuid})"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f}%"


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def catalog_gpu(model: str) -> Mapping[str, Any] | None:
    """The GPU catalog's entry for the exporter's modelName ("NVIDIA H100 80GB HBM3"), if any."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", model.strip())
    try:
        return catalogs.find_in_catalog(catalogs.load_catalog("gpus"), name, "GPU")[1] if name else None
    except UsageError:
        return None


def findings(r: Mapping[str, Any], joined: Joined) -> list[dict[str, Any]]:
    """The GPU findings of one replica, hardware first: XID, throttling, another process's memory,
    then what the load does on the GPU: memory-bound decode, or a queue on an idle GPU."""
    if not joined.gpus:
        return []
    return [*_xid(joined), *_throttled(joined), *_other_process(r, joined),
            *_memory_bound(r, joined), *_idle_queue(r, joined)]


def _xid(joined: Joined) -> list[dict[str, Any]]:
    found = []
    for gpu in joined.gpus:
        code = _stat(joined.figures.get(gpu.id, {}), "xid", "max")
        if code:
            found.append(_finding(
                "gpu_xid", joined, [gpu],
                f"{_name(gpu)} on {gpu.host}: the driver reported XID {code:.0f} in the window "
                "(DCGM_FI_DEV_XID_ERRORS holds the last XID); NVIDIA's XID catalog says what it means: "
                "the hardware or the driver, not the serving configuration",
                "high: the driver's own error report", {"xid": int(code)}))
    return found


def _throttled(joined: Joined) -> list[dict[str, Any]]:
    found = []
    for gpu in joined.gpus:
        f = joined.figures.get(gpu.id, {})
        reasons: dict[str, float | None] = {
            THROTTLE_REASONS[bit]: share for bit in THROTTLE_REASONS
            if (share := _stat(f, "clock_reasons", str(bit))) and share >= THROTTLE_SHARE}
        for concept, label in (("power_violation", "power (violation time)"),
                               ("thermal_violation", "thermal (violation time)")):
            share = _stat(f, concept, "share")
            if share and share >= THROTTLE_SHARE:
                reasons[label] = min(1.0, share)
        power, limit = _stat(f, "power_w", "max"), _stat(f, "power_limit_w")
        if reasons:
            confidence = "high: DCGM's clock event reasons (or violation counters) over the window"
        elif power and limit and power >= POWER_AT_LIMIT * limit and "clock_reasons" not in f \
                and "power_violation" not in f:
            reasons = {"power cap (inferred: power at its limit)": None}
            confidence = "low: inferred from power at its limit; export DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
        else:
            continue
        clock, top = _stat(f, "sm_clock_mhz"), _stat(f, "max_sm_clock_mhz") or _stat(f, "sm_clock_mhz", "max")
        parts = [", ".join(name if share is None else f"{name} {_pct(share)} of the window"
                           for name, share in reasons.items())]
        if clock is not None:
            parts.append(f"SM clock mean {clock:.0f} MHz" + (f" (max {top:.0f})" if top else ""))
        if power is not None:
            parts.append(f"power up to {power:.0f} W" + (f" of a {limit:.0f} W limit" if limit else ""))
        temp = _stat(f, "temp_c", "max")
        if temp is not None:
            parts.append(f"up to {temp:.0f} C")
        found.append(_finding("gpu_throttled", joined, [gpu], f"{_name(gpu)}: the clock was held down by "
                              + "; ".join(parts), confidence,
                              {"reasons": reasons, "sm_clock_mhz": clock, "max_sm_clock_mhz": top,
                               "power_w": power, "power_limit_w": limit, "temp_c": temp}))
    return found


def _other_process(r: Mapping[str, Any], joined: Joined) -> list[dict[str, Any]]:
    """Framebuffer beyond what this engine may take. vLLM's --gpu-memory-utilization is a
    per-instance share of the whole GPU (vllm/config/cache.py); an explicit --kv-cache-memory-bytes
    ignores it, and then only a full framebuffer beside a small KV cache points elsewhere."""
    dep = deployment(r)
    share, explicit = dep.get("gpu_memory_utilization"), dep.get("kv_cache_memory_bytes")
    fit = dep.get("requests_of_mean_length")
    holds = f"; the KV cache holds {fit:.1f} requests of the mean length" if fit is not None else ""
    found = []
    for gpu in joined.gpus:
        f = joined.figures.get(gpu.id, {})
        used, total = _stat(f, "fb_used_mib", "max"), framebuffer_mib(f)
        if used is None or total is None:
            continue
        figures = {"fb_used_mib": used, "fb_total_mib": total}
        if r["engine"] == "vllm" and share and not explicit:
            other = used - share * total
            if other >= OTHER_MARGIN_MIB:
                found.append(_finding(
                    "gpu_memory_other_process", joined, [gpu],
                    f"{_name(gpu)}: {_gib(used)} of {_gib(total)} used, while this engine may take {share:g} x "
                    f"{_gib(total)} = {_gib(share * total)} (--gpu-memory-utilization {share:g}): about "
                    f"{_gib(other)} belong to another process{holds}",
                    "medium: DCGM counts the framebuffer per GPU, not per process (nvidia-smi lists them)",
                    {**figures, "other_mib": other}, "--gpu-memory-utilization", share, "exported"))
        elif explicit and used >= FB_FULL * total and explicit / 2**20 <= KV_SMALL_SHARE * used:
            found.append(_finding(
                "gpu_memory_other_process", joined, [gpu],
                f"{_name(gpu)}: framebuffer {used / total * 100:.1f}% full ({_gib(used)} of {_gib(total)}) "
                f"while this engine's KV cache is {_gib(explicit / 2**20)} (--kv-cache-memory-bytes){holds}: "
                "weights and activations rarely take the rest; another process may hold it",
                "low: with an explicit KV size the engine's own share is not exported",
                {**figures, "kv_cache_mib": explicit / 2**20}, "--kv-cache-memory-bytes", explicit, "exported"))
    return found


def _memory_bound(r: Mapping[str, Any], joined: Joined) -> list[dict[str, Any]]:
    dram, tensor = _mean_over(joined, "dram_active"), _mean_over(joined, "tensor_active")
    if dram is None or dram < DRAM_BUSY or (tensor is not None and tensor >= dram) or not r.get("gen_tok_s"):
        return []
    sm, _ = busy(joined)
    figures: dict[str, Any] = {"dram_active": dram, "tensor_active": tensor, "sm_active": sm,
                               "gen_tok_s": r["gen_tok_s"]}
    evidence = (f"DRAM active {_pct(dram)} (its practical peak is about 80%) while tensor pipes are active "
                f"{_pct(tensor)} and SMs {_pct(sm)} on {len(joined.gpus)} GPU(s), decoding "
                f"{r['gen_tok_s']:,.0f} tok/s")
    spec = catalog_gpu(joined.gpus[0].model)
    running = r.get("running_mean")
    if spec and spec.get("bandwidth_tb_s"):
        figures["tb_s_per_gpu"] = moved = dram * spec["bandwidth_tb_s"]
        evidence += f"; about {moved:.2f} of {spec['bandwidth_tb_s']:g} TB/s per GPU ({spec['name']})"
        if running:
            steps = r["gen_tok_s"] / running
            figures["gb_per_step_per_gpu"] = moved * 1e3 / steps
            evidence += (f": {steps:,.0f} decode steps/s of {running:.1f} requests read about "
                         f"{moved * 1e3 / steps:.1f} GB per step per GPU (weights and the batch's KV)")
    evidence += ": each step waits for memory, so admitting more requests does not make a token faster"
    return [_finding("gpu_memory_bound", joined, joined.gpus, evidence,
                     "high: DCGM's DRAM activity over the window, with decode under way" if tensor is not None
                     else "medium: DRAM activity without the tensor pipes' (not exported)", figures)]


def _idle_queue(r: Mapping[str, Any], joined: Joined) -> list[dict[str, Any]]:
    if not fleet.queued(r, known_settings.QUEUE_SHARE):
        return []
    sm, measure = busy(joined)
    dram = _mean_over(joined, "dram_active")
    if sm is None or sm >= SM_IDLE or (dram is not None and dram >= DRAM_BUSY):
        return []
    load, flags = fleet.load_figures(r), known_settings.FLAGS[r["engine"]]
    figures = {"sm_busy": sm, "measure": measure, "dram_active": dram, **load}
    waits = (f"requests wait (queue {_pct(load['queue_share'])} of e2e, waiting up to {load['waiting_peak'] or 0:g}, "
             f"running up to {load['running_peak'] or 0:g}) while the GPU is mostly idle: {measure} {_pct(sm)}, "
             f"DRAM active {_pct(dram)} on {len(joined.gpus)} GPU(s)")
    confidence = ("high: DCGM's profiling counters and the engine's queue histograms" if measure == "SM active"
                  else f"medium: {measure} stands in for SM activity (not exported)")
    if r.get("preemptions") or (r.get("kv_cache_usage_max") or 0) >= known_settings.KV_FULL:
        util = deployment(r).get("gpu_memory_utilization")
        return [_finding("gpu_idle_queue", joined, joined.gpus,
                         f"{waits}; the KV cache is full (preemptions {r.get('preemptions') or 0:g}, usage up to "
                         f"{_pct(r.get('kv_cache_usage_max'))}): memory for the KV cache, not compute, limits "
                         "the batch",
                         confidence, figures, flags["util"], util, "exported" if util is not None else "unknown")]
    cap = (r.get("config") or {}).get("sglang:max_running_requests")
    return [_finding("gpu_idle_queue", joined, joined.gpus,
                     f"{waits}: the scheduler's cap on running requests ({flags['seqs']}) or its token budget per "
                     f"step ({flags['batched']}) holds them, not the GPU (or a client that sends in bursts)",
                     confidence, figures, flags["seqs"], cap, "exported" if cap is not None else "unknown")]


# ---------------------------------------------------------------------------------------------
# Levers, in the causal diagnosis' shape

def _lever(setting: str | None, current: Any, source: str | None, proposed: Any, reason: str, effect: str,
           action: str = "") -> dict[str, Any]:
    if setting:
        text = (f"{setting}: {current if current is not None else 'unknown'} -> {proposed} "
                f"(current: {source or 'unknown'}): {reason}; expect {effect}")
    else:
        text = f"{action}: {reason}; expect {effect}"
    return {"setting": setting, "current": current, "current_source": source if setting else None,
            "proposed": proposed, "reason": reason, "effect": effect, "text": text}


def levers(finding: Mapping[str, Any], engine: str) -> list[dict[str, Any]]:
    """What to change for one GPU finding of an `engine` (vllm, sglang), first lever first."""
    flags = known_settings.FLAGS[engine]
    kv_fp8 = f"{flags['kv_dtype']} {known_settings.FP8_KV[engine]}"
    kind, setting, current, source = (finding["kind"], finding["setting"], finding["current"],
                                      finding["current_source"])
    if kind == "gpu_xid":
        return [_lever(None, None, None, None, "an XID is a hardware or driver event",
                       "the errors and stalls gone once a healthy GPU serves the replica",
                       "drain the replica and check the GPU (dmesg, nvidia-smi -q, NVIDIA's XID catalog)")]
    if kind == "gpu_throttled":
        names = " ".join(finding["figures"]["reasons"])
        result = []
        if "power" in names:
            result.append(_lever(None, None, None, None, "the board draws its power limit",
                                 "the SM clock back up: every step faster",
                                 "check the enforced power limit against the board's default "
                                 "(nvidia-smi -q -d POWER) and the node's power supply"))
        if "thermal" in names or "slowdown" in names:
            result.append(_lever(None, None, None, None, "the GPU runs hot", "the SM clock back up: every step faster",
                                 "check cooling: airflow, fans, inlet temperature"))
        return result
    if kind == "gpu_memory_other_process":
        return [_lever(None, None, None, None, "another process holds framebuffer this engine could use",
                       "the memory free for this engine",
                       "stop or move the other process (nvidia-smi --query-compute-apps=pid,used_memory --format=csv)"),
                _lever(setting, current, source, "higher, once the GPU is this engine's alone",
                       "the freed memory goes to the KV cache", "more requests running at once, fewer preemptions")]
    if kind == "gpu_memory_bound":
        return [_lever(None, None, None, None, "each decode step reads the weights and the batch's KV cache",
                       "fewer bytes per token: faster tokens and more throughput; check accuracy with "
                       "task infer:accept",
                       f"FP8 weights ({flags['quant']} fp8) and {kv_fp8}"),
                _lever(None, None, None, None, "one read of the weights serves every request in the step",
                       "more tokens per second per GPU where the KV cache has room; each token no faster",
                       "a larger decode batch (more requests running per step)"),
                _lever(None, None, None, None, "the weights split over more GPUs' memory bandwidth",
                       "fewer bytes per GPU per step: faster tokens", f"tensor parallel ({flags['tp']})")]
    if kind == "gpu_idle_queue" and setting == flags["util"]:
        return [_lever(setting, current, source, "higher", "the KV cache, not the GPU, limits the batch",
                       "more requests running at once on a GPU that has room"),
                _lever(None, None, None, None, "the KV cache holds twice the tokens",
                       "more requests running at once", kv_fp8)]
    return [_lever(setting, current, source, "higher", "the GPU has room for a larger batch",
                   "queue time down and throughput up; each token a little slower"),
            _lever(flags["batched"], None, "unknown", "higher", "a larger step budget admits the waiting prefills",
                   "queue time down; ITL spikier while prompts prefill")]


# Where each GPU finding sits in the chain: the engine finding it causes (it becomes the root when
# that finding is), "root" (it leads whatever the engine says: the hardware comes first), or the
# engine finding it explains (it sits under that one).
GPU_CAUSES = {"gpu_memory_other_process": ("kv_cache",), "gpu_throttled": ("decode", "prefill")}
GPU_EXPLAINS = {"gpu_idle_queue": ("running_limit", "queue"), "gpu_memory_bound": ("decode",)}


def in_chain(gpu: Mapping[str, Any] | None, engine: Mapping[str, Any], engine_name: str) -> dict[str, Any]:
    """The GPU findings placed in the engine's causal chain: an XID leads; another process's memory
    causes a full KV cache, a throttled clock slow steps (each leads when what it causes is the
    engine's root); an idle GPU under a queue and a DRAM-bound decode explain the engine finding
    they sit under. A GPU root's levers lead the plan; a later lever for a setting the plan has
    is dropped."""
    gpu_found = [dict(f) for f in (gpu or {}).get("findings") or []]
    if not gpu_found:
        return dict(engine)
    found = [dict(f) for f in engine["findings"]]
    kinds = {f["kind"] for f in found}
    leads = []
    for f in gpu_found:
        caused = [kind for kind in GPU_CAUSES.get(f["kind"], ()) if kind in kinds]
        explained = [kind for kind in GPU_EXPLAINS.get(f["kind"], ()) if kind in kinds]
        f["caused_by"] = explained[0] if explained else None
        if f["kind"] == "gpu_xid" or (caused and found[0]["kind"] in caused):
            leads.append(f)
            for other in found:
                if other["kind"] in caused and not other["caused_by"]:
                    other["caused_by"] = f["kind"]
    rest = [f for f in gpu_found if f not in leads]
    ordered_found = leads + found + rest
    settings_planned = {lever["setting"] for lever in engine["plan"] if lever["setting"]}
    gpu_plan = {f["kind"]: levers(f, engine_name) for f in gpu_found}
    first = [lever for f in leads for lever in gpu_plan[f["kind"]]]
    later = [lever for f in rest for lever in gpu_plan[f["kind"]]]
    plan_ = first + list(engine["plan"]) + [lever for lever in later if lever["setting"] not in settings_planned]
    root = ordered_found[0]
    return {"root_cause": root, "findings": ordered_found, "plan": plan_, "verify": list(engine["verify"])}


# ---------------------------------------------------------------------------------------------
# The report

NO_TELEMETRY = ("no GPU telemetry: Prometheus holds no DCGM exporter series (DCGM_FI_*), so what the GPUs did "
                "is unknown; deploy NVIDIA's dcgm-exporter beside the engines and scrape it "
                "(references/gpu-telemetry.md)")


def unread(note: str) -> dict[str, Any]:
    """A `gpu_telemetry` document that says why there is none."""
    return {"source": None, "window_s": None, "exported": False, "note": note, "absent": [], "replicas": [],
            "findings": [], "plan": []}


def gpu_json(gpu: Gpu, figures: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    reasons = figures.get("clock_reasons", {})
    row = {**dataclasses.asdict(gpu), "figures": {k: dict(v) for k, v in figures.items() if k != "clock_reasons"}}
    if reasons:
        row["figures"]["throttle_reasons"] = {THROTTLE_REASONS[int(bit)]: share for bit, share in reasons.items()}
    return row


def summary(reports: Mapping[str, Mapping[str, Any]], names: set[str], joined: Sequence[Joined],
            engine: str, source: str, seconds: float) -> dict[str, Any]:
    """The `gpu_telemetry` document: per replica its GPUs and figures, the fields not exported,
    the GPU findings and their levers. `reports` maps each replica's instance to its report."""
    if not names:
        return {**unread(NO_TELEMETRY), "source": source, "window_s": seconds}
    found = [f for j in joined for f in findings(reports[j.instance], j)]
    held = {concept for concept, (metrics, _) in FIELDS.items() if any(m in names for m in metrics)}
    replicas = [{"instance": j.instance, "joined_by": j.by, "shared_with": list(j.shared_with),
                 "gpus": [gpu_json(g, j.figures.get(g.id, {})) for g in j.gpus],
                 "note": _replica_note(j, reports[j.instance], held, seconds)} for j in joined]
    return {"source": source, "window_s": seconds, "exported": True, "note": None, "absent": absent_fields(names),
            "replicas": replicas, "findings": found, "plan": [lever for f in found for lever in levers(f, engine)]}


def _replica_note(joined: Joined, r: Mapping[str, Any], held: set[str], seconds: float) -> str | None:
    """What a replica's GPU figures cannot say, or what they say without a finding."""
    if not joined.gpus:
        return (f"no GPU telemetry for {joined.instance}: no DCGM series from its pod or its host "
                f"({host_of(joined.instance)})")
    unsampled = sorted(held - {concept for figures in joined.figures.values() for concept in figures})
    if unsampled:
        return (f"no sample of {', '.join(unsampled)} in the {seconds:g} s window: the window is shorter than "
                "the exporter's scrape interval, or its scrapes failed; measure over a longer window")
    if joined.shared_with:
        return (f"joined by host: {', '.join(joined.shared_with)} run on the same host, and the GPUs are not "
                "told apart (the exporter's Kubernetes pod mapping tells them apart)")
    sm, _ = busy(joined)
    if sm is not None and sm < SM_IDLE and not fleet.queued(r, known_settings.QUEUE_SHARE):
        return "the GPU is mostly idle and nothing waits: the load (client concurrency or rate) does not fill it"
    return None


def from_prometheus(url: str, auth: fleet.Credentials, seconds: float, reports: Mapping[str, Mapping[str, Any]],
                    engine: str, match: str = "", timeout: float = 30.0) -> dict[str, Any]:
    """Ask Prometheus about the GPUs of the replicas in `reports` ({instance: report}) over the
    last `seconds`: the `gpu_telemetry` document."""
    with fleet.Prometheus(url, auth, timeout) as prom:
        names, joined = read(prom, seconds, list(reports), match)
    return summary(reports, names, joined, engine, prom.url, float(fleet.range_seconds(seconds)))


def format_lines(doc: Mapping[str, Any]) -> list[str]:
    """The human lines of a `gpu_telemetry` document."""
    lines = ["GPU telemetry (DCGM exporter through Prometheus):"]
    if doc["note"]:
        return lines + [f"  {doc['note']}"]
    for replica in doc["replicas"]:
        lines.append(f"  {replica['instance']}: " + (f"{len(replica['gpus'])} GPU(s), joined by {replica['joined_by']}"
                                                      if replica["gpus"] else "no GPU"))
        lines += [f"    {_gpu_line(g)}" for g in replica["gpus"]]
        if replica["note"]:
            lines.append(f"    note: {replica['note']}")
    if doc["absent"]:
        lines.append(f"  not exported (not guessed): {', '.join(doc['absent'])}")
    for finding in doc["findings"]:
        lines.append(f"  [{finding['kind']}] {finding['replica']}: {finding['evidence']} "
                     f"(confidence {finding['confidence']})")
    if doc["plan"]:
        lines.append("  GPU levers:")
        lines += [f"    {i}. {lever['text']}" for i, lever in enumerate(doc["plan"], 1)]
    return lines


def _gpu_line(g: Mapping[str, Any]) -> str:
    f = g["figures"]

    def mean(concept: str, unit: str = "%", scale: float = 1.0) -> str:
        value = f.get(concept, {}).get("mean")
        if value is None:
            return "n/a"
        return f"{value * 100:.0f}%" if unit == "%" else f"{value * scale:,.{0 if scale == 1 else 2}f} {unit}"
    used, total = f.get("fb_used_mib", {}).get("max"), framebuffer_mib(f)
    return (f"GPU {g['index']} {g['model']} on {g['host']}: util {mean('util')}, SM active {mean('sm_active')}, "
            f"tensor {mean('tensor_active')}, DRAM {mean('dram_active')}, framebuffer "
            f"{'n/a' if used is None or total is None else _gib(used) + ' of ' + _gib(total)}, "
            f"power {mean('power_w', 'W')}, SM clock {mean('sm_clock_mhz', 'MHz')}, "
            f"PCIe tx/rx {mean('pcie_tx_bytes_s', 'GB/s', 1e-9)}/{mean('pcie_rx_bytes_s', 'GB/s', 1e-9)}, "
            f"NVLink tx/rx {mean('nvlink_tx_bytes_s', 'GB/s', 1e-9)}/{mean('nvlink_rx_bytes_s', 'GB/s', 1e-9)}")
