"""The report as text for people: where and over what span, a row of quantiles per latency
histogram, the gauges with their peaks and Little's-law means, rates and lengths, the deployment's
own settings, the targets and where they came from, then the diagnosis; and a replica's one line.
"""
from __future__ import annotations

from typing import Any

from rooflib.server import diagnosis, known_settings
from rooflib.server.known_settings import ms as _ms
from rooflib.server.known_settings import pct as _pct
from rooflib.server.known_settings import quantile_text
from rooflib.server.metric_names import ENGINE_LABELS
from rooflib.server.quantiles import QUANTILES
from rooflib.server.reading import Latency

ROWS = [("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "e2e"), ("queue", "queue"),
        ("prefill", "prefill"), ("decode", "decode")]
# Rows that only generated tokens fill: left out when every request was a pooling one.
GENERATION_ROWS = ("itl", "tpot", "decode")


def format_report(r: dict[str, Any]) -> str:
    where = r["source"] + (f" ({', '.join(r['models'])})" if r["models"] else "")
    if r["mode"] == "window":
        span = f"over {r['seconds']:g} s" if r["seconds"] else "between two scrapes"
    else:
        span = "since server start" + (f" ({_uptime(r['seconds'])} ago)" if r["seconds"] else "")
    lines = [f"{ENGINE_LABELS[r['engine']]} at {where}, {span}"
             + (f", {r['engines']} engines" if r["engines"] > 1 else "")]
    lines.append(f"  {'':8}{'p50':>10}{'p95':>10}{'p99':>10}{'mean':>10}{'n':>8}  metric")
    pooling_only = bool(r.get("pooling") and r["pooling"]["only"])
    for concept, label in ROWS:
        row = r[f"{concept}_ms"]
        if row["metric"] is None or (pooling_only and concept in GENERATION_ROWS):
            continue
        cells = "".join(f"{quantile_text(Latency.of(row), q):>10}" for q in QUANTILES)
        lines.append(f"  {label:8}{cells}{_ms(row['mean']):>10}{row['n']:>8}  {row['metric']}")
    lines.append(
        f"  running {_gauge(r, 'running')}, waiting {_gauge(r, 'waiting')}"
        f", KV cache {_pct(r['kv_cache_usage'])} (max {_pct(r['kv_cache_usage_max'])}{_kv_size(r)})"
        f", preemptions {_num(r['preemptions'])}, prefix-cache hits {_pct(r['prefix_cache_hit_rate'])}")
    lengths = (f" of {_rate(r['prompt_tokens_mean'])} prompt + {_rate(r['output_tokens_mean'])} output tokens "
               f"on average ({r['lengths_from']})") if r["prompt_tokens_mean"] is not None else ""
    lines.append(f"  prompt {_rate(r['prompt_tok_s'])} tok/s, generation {_rate(r['gen_tok_s'])} tok/s, "
                 f"{r['requests']} requests finished{lengths}")
    lines += _media_lines(r)
    if r["tflops_per_gpu"] is not None:
        on = f" of {r['gpu']}" if r["gpu"] else " (pass --gpu for MFU)"
        lines.append(f"  per GPU {r['tflops_per_gpu']:.3g} TFLOP/s, {r['tb_s_per_gpu'] * 1000:.3g} GB/s: "
                     f"MFU {_pct(r['mfu'])}, bandwidth {_pct(r['bandwidth_util'])}{on}")
    if r.get("deployment"):
        lines.append(_deployment_line(r["deployment"]))
    for warning in r["warnings"]:
        lines.append(f"  note: {warning}")
    lines.append(_targets_line(r))
    lines += diagnosis.format_diagnosis(r["diagnosis"])
    return "\n".join(lines)


def _media_lines(r: dict[str, Any]) -> list[str]:
    """The pooling APIs' requests and what their latencies mean; the multimodal processor cache."""
    lines = []
    pooling, cache = r.get("pooling"), r.get("multimodal_cache")
    if pooling:
        routes = ", ".join(f"{api} {count:,}" for api, count in pooling["requests"].items())
        lines.append(f"  pooling: {pooling['total']:,} requests ({routes}; http_requests_total): {pooling['meaning']}")
    if cache:
        lines.append(f"  multimodal processor cache: {cache['hits']:,} of {cache['queries']:,} items hit "
                     f"({_pct(cache['hit_rate'])}; vllm:mm_cache_hits_total / vllm:mm_cache_queries_total): "
                     f"{cache['meaning']}")
    return lines


def _deployment_line(dep: dict[str, Any]) -> str:
    """The deployment's own settings, as vllm:cache_config_info (or SGLang) exports them."""
    parts, engine = [], dep.get("engine", "vllm")
    if dep["kv_cache_tokens"]:
        unit = "pages" if engine == "sglang" else "blocks"
        blocks = f" ({dep['num_gpu_blocks']:,} {unit} of {dep['block_size']})" if dep["num_gpu_blocks"] else ""
        parts.append(f"KV cache {dep['kv_cache_tokens']:,} tokens{blocks}"
                     + (f" sized by {dep['kv_cache_sized_by']}" if dep["kv_cache_sized_by"] else ""))
    if dep["requests_of_mean_length"] is not None:
        parts.append(f"{dep['requests_of_mean_length']:.1f} requests of the mean length "
                     f"({dep['mean_request_tokens']:,.0f} tokens)")
    if dep["max_concurrency_at_max_model_len"] is not None:
        limit = "context-length" if engine == "sglang" else "max-model-len"
        parts.append(f"{dep['max_concurrency_at_max_model_len']:,.1f} requests at {limit} {dep['max_model_len'] or 'n/a'}")
    cache = "radix cache" if engine == "sglang" else "prefix caching"
    parts.append(f"KV dtype {dep['kv_cache_dtype'] or 'n/a'}, {cache} {dep['prefix_caching'] or 'n/a'}")
    parts.append(f"{known_settings.FLAGS[engine]['seqs'].lstrip('-')} {dep['max_num_seqs_note']}")
    if engine == "sglang":
        parts.append(f"attention backend {dep['attention_backend'] or 'n/a'}, SGLang {dep['engine_version'] or 'n/a'}")
    return f"  deployment ({dep.get('source', 'vllm:cache_config_info')}): " + "; ".join(parts)


def _targets_line(r: dict[str, Any]) -> str:
    slo = r["slo"]
    text = (f"  targets: TTFT p95 {_ms(slo['ttft_p95_ms'])}, TPOT p95 {_ms(slo['tpot_p95_ms'])}, "
            f"ITL p95 {_ms(slo['itl_p95_ms'])}")
    if r["slo_source"] == "given":
        return text + " (given)"
    return (text + f" ({'starting defaults' if r['slo_source'] == 'default' else 'partly starting defaults: '}"
            f"{'' if r['slo_source'] == 'default' else ', '.join(r['slo_defaulted'])}"
            " for interactive chat, not your SLO: confirm them with the user, or pass --slo-ttft-p95-ms "
            "and --slo-tpot-p95-ms)")


def format_replica_line(r: dict[str, Any]) -> str:
    state = f" ({r['state'].upper()})" if r.get("state", "up") != "up" else ""
    ttft, itl = quantile_text(Latency.of(r["ttft_ms"]), "p95"), quantile_text(Latency.of(r["itl_ms"]), "p95")
    return (f"  {r['source']}{state}: TTFT p95 {ttft}, ITL p95 {itl}, "
            f"running {_num(r['running'])}, waiting {_num(r['waiting'])}, KV {_pct(r['kv_cache_usage'])}, "
            f"preemptions {_num(r['preemptions'])}, findings: "
            f"{', '.join(f['kind'] for f in r['diagnosis']['findings']) or 'none'}")


def _gauge(r: dict[str, Any], name: str) -> str:
    """`waiting 0 (peak 0 in 2 samples; mean 3.9 by the queue-time histogram: ...)`: the value
    at the last scrape, the peak of the sampled values, and the Little's-law mean, which comes
    from the histograms of finished requests and so counts moments the samples missed."""
    extra = []
    samples = r.get("gauge_samples") or 1
    if r["mode"] == "window" and r[name + "_peak"] is not None:
        extra.append(f"peak {r[name + '_peak']:g} in {samples} sample{'s' if samples > 1 else ''}")
    mean = r[name + "_mean"]
    if mean is not None:
        source = "queue-time" if name == "waiting" else "prefill + decode time"
        over = "over the window" if r["mode"] == "window" else "since start"
        extra.append(f"mean {mean:.2g} {over} by the {source} histograms")
    text = _num(r[name]) + (" at the last scrape" if extra else "")
    if extra:
        text += f" ({'; '.join(extra)}"
        peak = r[name + "_peak"] if r["mode"] == "window" else r[name]
        missed = mean is not None and peak is not None and mean > peak
        text += ": the samples missed the busy moments)" if missed else ")"
    return text


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _uptime(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _kv_size(r: dict[str, Any]) -> str:
    return f" of {r['kv_cache_tokens']:,} tokens" if r.get("kv_cache_tokens") else ""
