"""What a running server says about its own settings beyond /metrics, so that the diagnosis
(rooflib/server/plan.py) checks each lever against what is already set.

vLLM: GET /server_info?config_format=json, served only when the server runs with
VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/dev/server_info/api_router.py, vLLM 0.32.0): the
whole VllmConfig. SGLang: GET /get_server_info (python/sglang/srt/entrypoints/http_server.py,
sgl-project/sglang main): its ServerArgs (python/sglang/srt/server_args.py) and the scheduler's
info; read from a live SGLang 0.5.23 and SGLang main of 2026-08 (its CPU engine, the project's
tests). Both: /v1/models gives max_model_len. A route that does not answer is skipped: the setting
stays for the diagnosis to infer from the metrics, or unknown. Only the named fields are read;
nothing else of these answers (SGLang's holds the API key, 0.5.23's a watermark key) is kept or printed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import httpx

from rooflib.core import http_client, printing
from rooflib.core.errors import ServerError, UsageError
from rooflib.server import model_listing

EXPORTED, INFERRED, UNKNOWN = "exported", "inferred", "unknown"


@dataclass(frozen=True)
class Known:
    """A deployment setting: its value (None when unknown), whether the server exported it, the
    diagnosis inferred it from the metrics, or neither, and how: the endpoint or metric that
    gave it, or the evidence it was inferred from. `at_least`: the value is only a floor (an
    inferred running cap: no figure counts more requests at once than the cap, none is sure to
    count the cap itself)."""
    value: Any
    source: str
    how: str
    at_least: bool = False


@dataclass(frozen=True)
class Served:
    """A live server: its base URL and the settings it exported about itself."""
    url: str
    settings: Mapping[str, Known]


# setting -> (section, field) of vLLM's VllmConfig as /server_info gives it (vllm/config/scheduler.py,
# cache.py, model.py, parallel.py of vLLM 0.32.0).
VLLM_FIELDS = {
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "prefix_caching": ("cache_config", "enable_prefix_caching"),
    "block_size": ("cache_config", "block_size"),
    "max_model_len": ("model_config", "max_model_len"),
    "tensor_parallel_size": ("parallel_config", "tensor_parallel_size"),
    "stream_interval": ("scheduler_config", "stream_interval"),
    "max_num_active_seqs": ("scheduler_config", "max_num_active_seqs"),
    "max_num_queued_reqs": ("scheduler_config", "max_num_queued_reqs"),
    "max_num_queued_tokens": ("scheduler_config", "max_num_queued_tokens"),
}
# setting -> SGLang ServerArgs field. The radix cache is SGLang's prefix cache: on unless
# --disable-radix-cache; chunked_prefill_size plays max_num_batched_tokens' part (tokens
# prefilled per step); mem_fraction_static that of gpu_memory_utilization. max_running_requests
# and context_length are null unless set on the command line (SGLang then chooses them).
SGLANG_FIELDS = {
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",
    "prefix_caching": "disable_radix_cache",
    "block_size": "page_size",
    "max_model_len": "context_length",
    "tensor_parallel_size": "tp_size",
    "gpu_memory_utilization": "mem_fraction_static",
    "max_total_tokens": "max_total_tokens",
    "stream_interval": "stream_interval",
    "max_num_queued_reqs": "max_queued_requests",
    "cache_dtype": "kv_cache_dtype",
    "attention_backend": "attention_backend",
    "engine_version": "version",
}
# The running cap SGLang chose when --max-running-requests is not set, per data-parallel rank:
# internal_states[0] of /get_server_info (the scheduler's, SGLang 0.5.23 and main 2026-08).
SGLANG_CHOSEN_CAP = "effective_max_running_requests_per_dp"
# What each setting must be to be read at all (a bool is not a count).
FRACTIONS = {"gpu_memory_utilization"}
BOOLEANS = {"prefix_caching"}
TEXTS = {"cache_dtype", "attention_backend", "engine_version"}


def _checked(setting: str, value: Any) -> Any:
    """The value if it has the setting's type, else None (the setting then stays unread)."""
    if setting in BOOLEANS:
        return value if isinstance(value, bool) else None
    if setting in TEXTS:
        return value if isinstance(value, str) and value else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if setting in FRACTIONS:
        return float(value) if 0 < value <= 1 else None
    return int(value) if value >= 1 and value == int(value) else None


def from_vllm(info: Any) -> dict[str, Known]:
    """The settings in a vLLM /server_info?config_format=json answer."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    found = {}
    for setting, (section, field) in VLLM_FIELDS.items():
        part = config.get(section) if isinstance(config, dict) else None
        value = _checked(setting, part.get(field) if isinstance(part, dict) else None)
        if value is not None:
            found[setting] = Known(value, EXPORTED, f"vLLM /server_info {section}.{field}")
    if "max_num_active_seqs" in found and "max_num_seqs" in found:
        found["max_num_active_seqs"] = Known(found["max_num_active_seqs"].value, EXPORTED, (
            "vLLM /server_info scheduler_config.max_num_active_seqs: the requests admitted into RUNNING, at most "
            f"max_num_seqs {found['max_num_seqs'].value}, which sizes the model runner (raise both beyond it)"))
    return found


def from_sglang(info: Any) -> dict[str, Known]:
    """The settings in an SGLang /get_server_info answer. max_running_requests is null there
    when SGLang chose the cap: then the scheduler's own figure (SGLANG_CHOSEN_CAP) times the
    data-parallel size; context_length null stays unread (/v1/models and sglang:context_len say it)."""
    found = {}
    for setting, field in SGLANG_FIELDS.items():
        raw = info.get(field) if isinstance(info, dict) else None
        if setting == "prefix_caching" and isinstance(raw, bool):
            raw = not raw
        value = _checked(setting, raw)
        if value is not None:
            found[setting] = Known(value, EXPORTED, f"SGLang /get_server_info {field}")
    states = info.get("internal_states") if isinstance(info, dict) else None
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    chosen = _checked("max_num_seqs", state.get(SGLANG_CHOSEN_CAP))
    if "max_num_seqs" not in found and chosen is not None:
        ranks = _checked("max_num_seqs", info.get("dp_size")) or 1
        found["max_num_seqs"] = Known(chosen * ranks, EXPORTED, f"SGLang /get_server_info internal_states[0]."
                                      f"{SGLANG_CHOSEN_CAP}{f' x dp_size {ranks}' if ranks > 1 else ''}"
                                      " (SGLang's own choice: --max-running-requests not set)")
    return found


def server_settings(url: str, engine: str, api_key: str | None = None, timeout: float = 30.0,
                    transport: httpx.BaseTransport | None = None) -> Served:
    """What the server at `url` says about its settings (see the module's doc); routes that do
    not answer are skipped."""
    found: dict[str, Known] = {}
    with http_client.client(url, api_key, timeout, max_connections=1, transport=transport) as http:
        try:
            entry = model_listing.served_model(http)
            length = model_listing.max_model_len(entry, url)
            if length:
                found["max_model_len"] = Known(length, EXPORTED, "/v1/models max_model_len")
        except (ServerError, UsageError):
            pass
        found.update(_own_settings(http, engine))
    return Served(url, found)


def _own_settings(http: httpx.Client, engine: str) -> dict[str, Known]:
    """The settings the engine's own route says, asked twice where it did not answer (a server busy
    starting or serving may miss one timeout); a route the server lacks (vLLM without
    VLLM_SERVER_DEV_MODE=1 answers 404) is not asked again. Where it still does not answer, stderr
    says so: the settings it would have said are then inferred or unknown for that reason."""
    path, params, read = ("/server_info", {"config_format": "json"}, from_vllm) if engine == "vllm" else \
        ("/get_server_info", None, from_sglang)
    for attempt in (1, 2):
        try:
            return read(http_client.get_json(http, path, params=params))
        except ServerError as exc:
            if "answered HTTP 4" in str(exc):
                return {}
            if attempt == 2:
                printing.progress(f"{path} did not answer twice ({exc}): the settings it says are read from the "
                                  "metrics or inferred")
    return {}
