"""What a running vLLM server says about itself: the served model, its config, its limits.

Shared by vram.py (--url: size the served model) and accept.py (the candidate's quantization).
/v1/models gives the model's id, `root` (the Hugging Face id or the path the server loaded) and
max_model_len; /metrics gives vllm:cache_config_info (block size, gpu_memory_utilization, KV-cache
tokens and bytes). The config.json behind `root` is read here when `root` is a Hugging Face id
or a path this machine can read; a path on the server is not, and the caller says which flag
supplies it instead.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from rooflib.core import fileio, http_client
from rooflib.core.errors import ServerError, UsageError
from rooflib.server import engine_metrics, metric_sources, model_listing, prometheus_text, snapshots
from rooflib.sizing import resolve, weights

# The acceptance levels (scripts/rooflib/catalog/ppl_gates.yaml) of each weight format sizing names.
SCHEME_OF_QUANT = {"int4": "4bit", "mxfp4": "4bit", "nvfp4": "4bit", "fp8": "fp8", "int8": "int8"}


def served_facts(url: str, api_key: str | None = None, timeout: float = 30.0,
                 wanted_model: str | None = None) -> dict[str, Any]:
    """The served model's /v1/models entry and the deployment's cache_config_info settings."""
    with http_client.client(url, api_key, timeout) as http:
        entry = model_listing.served_model(http, wanted_model)
    try:
        text, _ = metric_sources.scrape(url, api_key, timeout)
        info = snapshots.snapshot(text, url)["cache_config"]
    except (ServerError, prometheus_text.InvalidScrape):
        info = {}
    return {"url": url, "model": entry["id"], "root": entry.get("root") or entry["id"],
            "max_model_len": entry.get("max_model_len"), "cache_config": info,
            "deployment": engine_metrics.deployment_config(info, None)}


def root_config(root: str, transport: Any = None) -> tuple[dict[str, Any] | None, str]:
    """(config.json, where it came from) for a served root, or (None, why it cannot be read here)."""
    path = Path(root).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if file.is_file():
        try:
            return fileio.parse_json(fileio.read_bounded(file, "model config", resolve.MAX_CONFIG_BYTES)), str(file)
        except (UsageError, ValueError):
            return None, f"{file} is not readable JSON"
    if root.startswith(("/", "~", ".")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", root):
        return None, f"the server loaded {root!r}, a path on the server that this machine cannot read"
    try:
        config, _ = resolve.fetch_hf_config(root, transport)
    except (ServerError, UsageError) as exc:
        return None, str(exc)
    return config, f"{resolve.HF_URL}/{root}"


def scheme_of(quant: str) -> str | None:
    """The acceptance scheme of a weight format (None: not quantized)."""
    return SCHEME_OF_QUANT.get(quant)


def quant_of_profile(profile: Mapping[str, Any]) -> str | None:
    """The weight format a serve profile asks vLLM for with --quantization, if it does."""
    method = str(profile.get("quantization") or "").lower()
    return weights.QUANT_ALIASES.get(method) if method else None
