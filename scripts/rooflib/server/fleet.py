"""A fleet of vLLM or SGLang replicas seen through Prometheus: the PromQL, the replicas' state
and configuration, and the findings only a fleet has. `metrics.py --prometheus` is the command
line; this module holds the Prometheus client and the fleet logic it calls.

Label conventions (what the shipped scrape config keeps, references/prometheus.md):
  instance    one replica (Prometheus sets it to host:port of the scrape target)
  model_name  the served model name, set by the engine (SGLang 0.3 called it `name`)
  engine      vLLM's engine-core index inside one replica (data parallel); added up per replica.
              SGLang's ranks (tp_rank, dp_rank) play that part. Never overwrite it with a
              target label: tell engines apart by the metric prefix (vllm:, sglang:) or by `job`.

Findings, each with the cause, the setting responsible and figures per replica:
  replica_down     up == 0, or a replica seen in the window that is no longer scraped
  config_mismatch  replicas of one model started with different cache settings
  imbalance        one replica queues while another has spare room: the load balancer
  add_replica      every replica queues: the fleet is one replica short
  prefix_split     prefix-cache hits spread over replicas at a low rate: route by session
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import httpx

from rooflib.core import conf, http_client, redaction
from rooflib.core.errors import ServerError, UsageError

# Rules of thumb of the fleet findings (the skill's fleet table; change them together).
IMBALANCE_RATIO = 2.0   # the queueing replica finished at least this many times more requests
PREFIX_SPLIT_LOW = 0.5  # fleet prefix-cache hit rate below which hits spread over replicas cost prefill

# Cache settings in vLLM's cache_config_info labels and the flags that set them; SGLang has no such
# metric, so its configuration gauges stand in (those SGLang 0.5.23 and main 2026-08 export).
CONFIG_FLAGS = {
    "vllm": {"block_size": "--block-size", "cache_dtype": "--kv-cache-dtype",
             "enable_prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
             "gpu_memory_utilization": "--gpu-memory-utilization",
             "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
             "num_gpu_blocks": "--gpu-memory-utilization or --kv-cache-memory-bytes (KV blocks)",
             "kv_cache_size_tokens": "--gpu-memory-utilization or --kv-cache-memory-bytes (KV tokens)",
             "sliding_window": "the model's sliding window", "num_gpu_blocks_override": "--num-gpu-blocks-override"},
    "sglang": {"sglang:max_total_num_tokens": "--mem-fraction-static or --max-total-tokens (KV tokens)",
               "sglang:context_len": "--context-length", "sglang:page_size": "--page-size"},
}
# SGLang repeats scheduler series once per TP rank of one DP group: only rank 0 (or series without
# the label, as the tokenizer's histograms) is counted, as metrics.py does for a single scrape.
RANK_ZERO = {"vllm": "", "sglang": 'tp_rank=~"0|", attn_tp_rank=~"0|"'}
# Labels that differ between replicas by nature, not by configuration.
NOT_CONFIG = {"__name__", "instance", "job", "engine", "model_name", "pid"}


class UnusableAnswer(Exception):
    """Prometheus answered with something that is not its API (an HTML page): exit 4."""


# ---------------------------------------------------------------------------------------------
# The Prometheus HTTP API

@dataclass
class Credentials:
    """Basic auth for a Prometheus behind a proxy or --web.config.file; never printed."""
    user: str | None = None
    password: str | None = None


def credentials(settings: conf.Settings) -> Credentials:
    """PROMETHEUS_USER / PROMETHEUS_PASSWORD from the environment or inference.env."""
    password = settings.get("PROMETHEUS_PASSWORD") or None
    user = settings.get("PROMETHEUS_USER") or None
    if password and not user:
        raise UsageError("PROMETHEUS_PASSWORD is set without PROMETHEUS_USER: set both for basic auth")
    return Credentials(user, password)


class Prometheus:
    """Instant queries against /api/v1/query, all evaluated at one moment so they agree."""

    def __init__(self, url: str, auth: Credentials = Credentials(), timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None):
        if re.match(r"^https?://[^/\s]*@", url.strip()):
            raise UsageError("the Prometheus URL holds credentials: give them in PROMETHEUS_USER and "
                             "PROMETHEUS_PASSWORD instead, so they are never printed")
        self.url = conf.normalize_url(url)  # a path prefix (--web.route-prefix) stays in it
        self.secret = auth.password
        self.at = time.time()
        self.http = httpx.Client(base_url=self.url, transport=transport,
                                 auth=(auth.user, auth.password) if auth.password else None,
                                 timeout=httpx.Timeout(timeout, connect=min(timeout, http_client.CONNECT_TIMEOUT_S)))

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.http.close()

    def _fail(self, error: type[Exception], message: str) -> Exception:
        return error(redaction.redact(message, self.secret))

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The result vector of an instant query: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        where = f"Prometheus at {self.url}"
        try:
            with http_client.answered(where, self.http.timeout.read):
                response = self.http.get("/api/v1/query", params={"query": expr, "time": f"{self.at:.3f}"})
        except ServerError as exc:
            raise self._fail(ServerError, str(exc))
        if response.status_code in (401, 403):
            raise self._fail(ServerError, f"{where} answered HTTP {response.status_code}: set PROMETHEUS_USER "
                                          "and PROMETHEUS_PASSWORD (basic auth)")
        if response.status_code == 404:
            raise self._fail(ServerError, f"{where} has no /api/v1/query (HTTP 404): behind a path prefix "
                                          "(--web.route-prefix)? give the URL with it, e.g. http://host:9090/prometheus")
        body = response.text.lstrip()
        if body.startswith("<") or "html" in response.headers.get("content-type", ""):
            raise self._fail(UnusableAnswer, f"{where} answered an HTML page, not its API (a login page or "
                                             "the web UI?): give the URL that serves /api/v1/query")
        try:
            data = response.json()
        except ValueError:
            raise self._fail(UnusableAnswer, f"{where} did not answer JSON (HTTP {response.status_code}, "
                                             f"{body[:60]!r}): is it Prometheus?")
        if not isinstance(data, dict) or data.get("status") not in ("success", "error"):
            raise self._fail(UnusableAnswer, f"{where} answered JSON that is not the Prometheus API")
        if data["status"] == "error":
            error = str(data.get("error", "no reason given"))
            if data.get("errorType") == "bad_data":
                raise self._fail(UsageError, f"Prometheus rejected the query ({error}): check --match, "
                                             "label matchers like model_name=\"qwen3-8b\",job=\"vllm\"")
            raise self._fail(ServerError, f"{where} failed the query: {data.get('errorType')}: {error}")
        result = data.get("data")
        if response.status_code >= 400 or not isinstance(result, dict) or result.get("resultType") != "vector":
            raise self._fail(ServerError, f"{where} answered HTTP {response.status_code} without a result")
        return result["result"]

    def values(self, expr: str, by: str = "instance") -> dict[str, float]:
        """{label value: number} of a query grouped by `by` (NaN and infinities left out)."""
        found = {}
        for row in self.query(expr):
            value = float(row["value"][1])
            if not (math.isnan(value) or math.isinf(value)):
                found[row["metric"].get(by, "")] = value
        return found


# ---------------------------------------------------------------------------------------------
# PromQL

def range_seconds(seconds: float) -> int:
    """The window as a PromQL range holds it: whole seconds, at least one."""
    return max(1, round(seconds))


def range_of(seconds: float) -> str:
    """A PromQL range of whole seconds: `300s`."""
    return f"{range_seconds(seconds)}s"


def split_series(metric: str) -> tuple[str, dict[str, str]]:
    """`family{label="value",...}` (a histogram concept read from some series of a family, e.g.
    one stage of SGLang's per-stage latencies) -> (family, labels); a plain name has none."""
    family, _, rest = metric.partition("{")
    return family, dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"', rest))


def series(metric: str, suffix: str, sel: str) -> str:
    """PromQL for the `suffix` series of `metric` (see split_series) within the selector `sel`."""
    family, labels = split_series(metric)
    parts = [sel[1:-1]] if sel else []
    parts += [f'{name}="{value}"' for name, value in labels.items()]
    return family + suffix + ("{" + ", ".join(parts) + "}" if parts else "")


def selector(match: str, **extra: str) -> str:
    """`{match,extra}` or '' (extra values are regexes, e.g. __name__)."""
    parts = [match] if match else []
    parts += [f'{name}=~"{value}"' for name, value in extra.items()]
    return "{" + ", ".join(parts) + "}" if parts else ""


def queries(chosen: Mapping[str, Mapping[str, str]], gauge_kinds: Mapping[str, str],
            quantiles: Mapping[str, float], seconds: float, match: str = "", per_instance: bool = False
            ) -> dict[str, str]:
    """The PromQL of every figure over the last `seconds`, for the fleet or `by (instance)`.

    The forms of vLLM's and SGLang's Grafana dashboards: histogram_quantile over summed bucket
    rates (never an average of quantiles), pooled means sum(rate(_sum))/sum(rate(_count)),
    increase() for counts. A gauge's peak is the sum of each series' max_over_time: exact for one
    engine per replica, an upper bound with several.
    """
    sel = selector(match)
    rng = range_of(seconds)
    by = " by (instance)" if per_instance else ""
    le = "le, instance" if per_instance else "le"
    result: dict[str, str] = {}
    for concept, metric in chosen["histograms"].items():
        buckets, sums, counts = (series(metric, suffix, sel) for suffix in ("_bucket", "_sum", "_count"))
        for name, q in quantiles.items():
            result[f"{concept}.{name}"] = f"histogram_quantile({q}, sum by ({le}) (rate({buckets}[{rng}])))"
        result[f"{concept}.mean"] = f"sum{by} (rate({sums}[{rng}])) / sum{by} (rate({counts}[{rng}]))"
        result[f"{concept}.n"] = f"sum{by} (increase({counts}[{rng}]))"
    for concept, metric in chosen["counters"].items():
        result[f"counter.{concept}"] = f"sum{by} (increase({metric}{sel}[{rng}]))"
        result[f"counter.{concept}.series"] = f"count{by} ({metric}{sel})"
    for concept, metric in chosen["gauges"].items():
        agg = "sum" if gauge_kinds[concept] == "sum" else "avg"
        result[f"gauge.{concept}"] = f"{agg}{by} ({metric}{sel})"
        result[f"gauge.{concept}.max"] = f"max{by} (max_over_time({metric}{sel}[{rng}]))"
        result[f"gauge.{concept}.peak"] = f"{agg}{by} (max_over_time({metric}{sel}[{rng}]))"
    return result


def engine_names(prom: Prometheus, match: str) -> tuple[str, set[str]]:
    """The engine (vllm or sglang) whose series Prometheus holds, and their metric names."""
    scope = selector(match, __name__="vllm:.+|sglang:.+")
    names = {row["metric"].get("__name__", "") for row in prom.query(f"count by (__name__) ({scope})")}
    engines = {name.split(":", 1)[0] for name in names if ":" in name}
    if not engines and prom.query(f"count({selector(match, __name__='sglang_.+')})"):
        raise UsageError("Prometheus holds SGLang's series as sglang_* (SGLang 0.5.23 escapes ':' when Prometheus "
                         "asks for OpenMetrics): add the sglang job's metric_relabel_configs of "
                         "references/prometheus/prometheus.yml, which gives them back their sglang: names")
    if not engines:
        raise UnusableAnswer(f"Prometheus at {prom.url} holds no vllm: or sglang: series"
                             f"{' matching ' + match if match else ''}: is it scraping the engines' /metrics?")
    if len(engines) > 1:
        raise UsageError("Prometheus holds both vLLM and SGLang series: select one with --match, "
                         "e.g. --match 'job=\"vllm\"'")
    return engines.pop(), names


@dataclass
class Replica:
    """One scrape target serving the engine: what Prometheus knows of it."""
    instance: str
    job: str
    model: str
    state: str  # "up", "down" (up == 0) or "not_scraped" (seen in the window, target gone)


def replicas(prom: Prometheus, presence_metric: str, match: str, seconds: float) -> list[Replica]:
    """Every replica that served `presence_metric` in the window or is a target of its jobs now.

    A missing `instance` or `model_name` label breaks the fleet view: one line says which.
    """
    rng = range_of(seconds)
    seen = prom.query(f"count by (job, instance, model_name, name) "
                      f"(last_over_time({presence_metric}{selector(match)}[{rng}]))")
    if any("instance" not in row["metric"] for row in seen):
        raise UsageError(f"the {presence_metric} series carry no `instance` label: keep Prometheus' "
                         "instance label (one per replica; see references/prometheus.md)")
    if any("model_name" not in row["metric"] for row in seen):
        old = " (SGLang 0.3 calls it `name`: relabel it to model_name)" if \
            any("name" in row["metric"] for row in seen) else ""
        raise UsageError(f"the {presence_metric} series carry no `model_name` label{old}: keep the engine's "
                         "labels (no relabelling that drops them; see references/prometheus.md)")
    jobs = sorted({row["metric"].get("job", "") for row in seen})
    found: dict[str, Replica] = {}
    for row in seen:
        labels = row["metric"]
        found[labels["instance"]] = Replica(labels["instance"], labels.get("job", ""), labels["model_name"], "not_scraped")
    if jobs:
        job_regex = "|".join(re.escape(job) for job in jobs)
        for row in prom.query(f'up{{job=~"{job_regex}"}}'):
            labels = row["metric"]
            instance = labels.get("instance", "")
            state = "up" if float(row["value"][1]) == 1 else "down"
            if instance in found:
                found[instance].state = state
            elif state == "down":  # down for longer than the window: its model is unknown
                found[instance] = Replica(instance, labels.get("job", ""), "", state)
    return sorted(found.values(), key=lambda r: r.instance)


def configs(prom: Prometheus, engine: str, names: set[str], match: str, seconds: float
            ) -> dict[str, dict[str, str]]:
    """{instance: {setting: value}}: vLLM's cache_config_info labels, SGLang's config gauges."""
    rng = range_of(seconds)
    sel = selector(match)
    found: dict[str, dict[str, str]] = {}
    if engine == "vllm":
        if "vllm:cache_config_info" in names:
            for row in prom.query(f"last_over_time(vllm:cache_config_info{sel}[{rng}])"):
                labels = row["metric"]
                found.setdefault(labels.get("instance", ""), {}).update(
                    {k: v for k, v in labels.items() if k not in NOT_CONFIG})
        return found
    for metric in CONFIG_FLAGS["sglang"]:
        if metric in names:
            for instance, value in prom.values(f"max by (instance) (last_over_time({metric}{sel}[{rng}]))").items():
                found.setdefault(instance, {})[metric] = f"{value:g}"
    return found


# ---------------------------------------------------------------------------------------------
# Fleet findings. `reports` are engine_metrics.report() dicts of each replica plus instance, state,
# model and config; `flags` are the engine's flag names (known_settings.FLAGS).

LEVERS = {
    "replica_down": [
        "check the replica's process and its /health endpoint; restart it",
        "make the load balancer take replicas that fail /health out of its pool",
        "if it runs but is not scraped, fix the scrape target (address, port, path, TLS, auth)"],
    "config_mismatch": [
        "start every replica of a model from one profile (task serve INFER_PROFILE=...) and one image",
        "if the difference is on purpose (different GPUs), weight the load balancer by each replica's capacity"],
    "imbalance": [
        "make the load balancer send each request to the replica with the fewest requests in flight "
        "(least outstanding requests), not round-robin over unequal requests or sticky by client IP",
        "check its pool and weights: every healthy replica in it, weights matching capacity",
        "with session routing, hash many sessions over the replicas so no hot session pins one"],
    "add_replica": [
        "add one replica ({replicas} to {more}) and measure again",
        "first read each replica's own findings: raising {seqs} where the KV cache has room adds capacity without a GPU",
        "shed or rate-limit load the fleet cannot serve in time"],
    "prefix_split": [
        "route by session or prefix: requests that share a prefix go to the replica that cached it "
        "(vLLM production-stack router's session routing, SGLang router --policy cache_aware)",
        "keep shared prefixes byte-identical and first in the prompt",
        "fewer, larger replicas (tensor parallel {tp}) keep one cache instead of several"],
}


def _finding(kind: str, cause: str, evidence: str, named: Sequence[str], per_replica: dict[str, Any],
             flags: Mapping[str, str]) -> dict[str, Any]:
    """A fleet finding in the shape of an engine's (rooflib/server/findings.py), with the replicas it
    names; diagnosis.with_fleet puts its levers first in the plan."""
    words = {**flags, "replicas": len(named), "more": len(named) + 1}
    return {"kind": kind, "scope": "fleet", "cause": cause, "evidence": evidence,
            "confidence": "high: each replica's series in Prometheus", "caused_by": None, "setting": None,
            "current": None, "current_source": None, "replicas": list(named), "per_replica": per_replica,
            "levers": [lever.format(**words) for lever in LEVERS[kind]]}


def queued(r: Mapping[str, Any], queue_share: float) -> bool:
    """Requests of this replica waited for a slot: queue time a large share of e2e, or a waiting peak."""
    queue, e2e = r["queue_ms"]["mean"], r["e2e_ms"]["mean"]
    return bool((queue is not None and e2e and queue / e2e >= queue_share) or (r["waiting_peak"] or 0) > 0)


def load_figures(r: Mapping[str, Any]) -> dict[str, Any]:
    share = r["queue_ms"]["mean"] / r["e2e_ms"]["mean"] \
        if r["queue_ms"]["mean"] is not None and r["e2e_ms"]["mean"] else None
    return {"requests": r["requests"], "queue_share": share, "queue_ms_mean": r["queue_ms"]["mean"],
            "waiting_peak": r["waiting_peak"], "running_peak": r["running_peak"], "running_mean": r["running_mean"]}


def _load_text(instance: str, r: Mapping[str, Any]) -> str:
    figures = load_figures(r)
    share = "n/a" if figures["queue_share"] is None else f"{figures['queue_share'] * 100:.0f}%"
    return (f"{instance}: {figures['requests']} requests, queue {share} of e2e, "
            f"waiting up to {figures['waiting_peak'] or 0:g}")


def findings(reports: Sequence[Mapping[str, Any]], flags: Mapping[str, str], queue_share: float,
             long_prompt: float) -> list[dict[str, Any]]:
    """The fleet findings, in order: down, configuration, imbalance, one replica short, prefix split."""
    result = []
    for r in reports:
        if r["state"] != "up":
            why = ("up == 0: Prometheus cannot scrape it" if r["state"] == "down" else
                   "it served in the window but is no longer a scrape target (removed, or its job renamed)")
            result.append(_finding(
                "replica_down", "the replica is down or unreachable, or Prometheus lost the target",
                f"{r['instance']} (job {r['job'] or 'n/a'}): {why}; it finished {r['requests']} requests in the window",
                [r["instance"]], {r["instance"]: {"state": r["state"], "requests": r["requests"]}}, flags))
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for r in reports:
        if r["state"] == "up":
            by_model.setdefault(r["model"], []).append(r)
    for group in by_model.values():
        result += _config_findings(group, flags)
        result += _load_findings(group, flags, queue_share)
        result += _prefix_findings(group, flags, long_prompt)
    return result


def _config_findings(group: Sequence[Mapping[str, Any]], flags: Mapping[str, str]) -> list[dict[str, Any]]:
    configured = [r for r in group if r["config"]]
    if len(configured) < 2:
        return []
    settings = sorted({k for r in configured for k in r["config"]})
    differing = [k for k in settings if len({r["config"].get(k) for r in configured}) > 1]
    if not differing:
        return []
    engine_flags = CONFIG_FLAGS[configured[0]["engine"]]
    details = "; ".join(f"{k} ({engine_flags.get(k, 'a cache setting')}): " +
                        ", ".join(f"{r['instance']}={r['config'].get(k, 'n/a')}" for r in configured)
                        for k in differing)
    return [_finding("config_mismatch", "replicas of one model were started with different settings",
                     f"model {configured[0]['model']}: {details}", [r["instance"] for r in configured],
                     {r["instance"]: {k: r["config"].get(k) for k in differing} for r in configured}, flags)]


def _load_findings(group: Sequence[Mapping[str, Any]], flags: Mapping[str, str], queue_share: float
                   ) -> list[dict[str, Any]]:
    if not group:
        return []
    waiting = [r for r in group if queued(r, queue_share)]
    free = [r for r in group if not queued(r, queue_share)]
    figures = {r["instance"]: load_figures(r) for r in group}
    if waiting and not free:
        return [_finding("add_replica", "every replica queues: the fleet serves less than the load",
                         "; ".join(_load_text(r["instance"], r) for r in group),
                         [r["instance"] for r in group], figures, flags)]
    if not waiting:
        return []
    busiest = max(r["requests"] for r in waiting)
    idle = [r for r in free if r["requests"] * IMBALANCE_RATIO <= busiest]
    if not idle:
        return []
    return [_finding("imbalance", "the load balancer sends more requests to some replicas than they can "
                                  "run while others have room",
                     "busy: " + "; ".join(_load_text(r["instance"], r) for r in waiting) +
                     " | idle: " + "; ".join(_load_text(r["instance"], r) for r in idle),
                     [r["instance"] for r in waiting + idle], figures, flags)]


def _prefix_findings(group: Sequence[Mapping[str, Any]], flags: Mapping[str, str], long_prompt: float
                     ) -> list[dict[str, Any]]:
    hitting = [r for r in group if r["prefix_cache_hit_rate"]]
    queries = sum(r["prefix_cache_queries"] or 0 for r in group)
    prompts = sum(r["prompt_tokens"] or 0 for r in group)
    requests = sum(r["requests"] for r in group)
    if len(hitting) < 2 or not queries or not requests or prompts / requests < long_prompt:
        return []
    fleet_rate = sum((r["prefix_cache_hit_rate"] or 0) * (r["prefix_cache_queries"] or 0) for r in group) / queries
    if fleet_rate >= PREFIX_SPLIT_LOW:
        return []
    per_replica = {r["instance"]: {"hit_rate": r["prefix_cache_hit_rate"], "queries": r["prefix_cache_queries"],
                                   "requests": r["requests"]} for r in group}
    evidence = (f"fleet hit rate {fleet_rate * 100:.0f}% with {prompts / requests:.0f}-token prompts; hits on "
                f"{len(hitting)} replicas: " +
                ", ".join(f"{r['instance']} {(r['prefix_cache_hit_rate'] or 0) * 100:.0f}%" for r in group))
    return [_finding("prefix_split", "requests sharing a prefix land on several replicas: each computes and "
                                     "caches the prefix itself, and a follow-up rarely finds its cache",
                     evidence, [r["instance"] for r in hitting], per_replica, flags)]


def each_value(prom: Prometheus, exprs: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """{instance: {key: value}} of queries grouped by instance."""
    result: dict[str, dict[str, float]] = {}
    for key, expr in exprs.items():
        for instance, value in prom.values(expr).items():
            result.setdefault(instance, {})[key] = value
    return result
