"""Finding a model and a GPU to size: a model is a local folder / config.json, a catalog name
(scripts/rooflib/catalog/models.yaml, works offline) or a Hugging Face repo id (config.json is
fetched once with httpx, HF_TOKEN if set, and cached); a GPU is a catalog name
(scripts/rooflib/catalog/gpus.yaml) or a memory size. A config.json from outside is checked here,
so a bad one is one usage error, not a traceback.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from rooflib.core import catalogs, conf, fileio, http_client, redaction
from rooflib.core.errors import ServerError, UsageError
from rooflib.sizing.model_shape import Model, _text_config, apply_hf_overrides, model_from_config

HF_URL = "https://huggingface.co"
# GiB that CUDA reports per marketed GB of an HBM card: an "80 GB" H100 reports 79.19 GiB as its
# total ("Free memory on device cuda:1 (60.87/79.19 GiB)", llm-d-incubation/llm-d-planner@d3121e0
# accuracy/results/v0.19.0/logs/codellama-codellama-34b---h100-80gb--tp2pp1dp1--8192.FAILED.log;
# 0.95 x 79.19 = 75.23 GiB in the other logs of that run). Cards that reserve memory for ECC
# report less (L4 22.08, L40S 44.42): the GPU catalog, or --gpu-gib with the total vLLM logs, is
# exact for them.
REPORTED_GIB_PER_MARKETED_GB = 79.19 / 80


def catalog_config(catalog: Mapping[str, Mapping[str, Any]], key: str) -> dict[str, Any]:
    """An entry's config with its `base` entry's config underneath (nested dicts merged)."""
    entry = catalog[key]
    merged = catalog_config(catalog, entry["base"]) if entry.get("base") else {}
    for name, value in (entry.get("config") or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return merged


def _safetensors_bytes(folder: Path) -> int | None:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            total = fileio.parse_json(fileio.read_bounded(index, "safetensors index", MAX_CONFIG_BYTES))["metadata"]["total_size"]
            return int(total) if total else None
        except (ValueError, TypeError, KeyError):
            return None  # the checkpoint size is a cross-check, not needed
    files = list(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def fetch_hf_config(repo_id: str, transport: Any = None) -> tuple[dict[str, Any], int | None]:
    """config.json (and the safetensors index's total size) of a Hub repo, cached on disk."""
    import httpx

    cache = conf.cache_dir() / "hf-configs" / (repo_id.replace("/", "--") + ".json")
    try:
        cached = fileio.parse_json(fileio.read_bounded(cache, "cached config", MAX_CONFIG_BYTES))
        return cached["config"], cached.get("checkpoint_bytes")
    except (UsageError, ValueError, KeyError, TypeError):
        pass  # none yet, or damaged: fetched again
    token = os.environ.get("HF_TOKEN")
    redaction.add_secret(token)  # never printed, as the API key
    with http_client.client(HF_URL, api_key=token, timeout=20.0, transport=transport) as http:
        try:
            response = http.get(f"/{repo_id}/resolve/main/config.json", follow_redirects=True)
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot fetch {repo_id}/config.json from {HF_URL} ({type(exc).__name__}); "
                                     "offline, pass a catalog name or a local folder / config.json")
        if response.status_code in (401, 403):
            raise ServerError(f"{HF_URL}/{repo_id} is gated (HTTP {response.status_code}): "
                                     "set HF_TOKEN to a token that has access, or pass a local config.json")
        if response.status_code == 404:
            raise UsageError(f"no config.json at {HF_URL}/{repo_id}: check the repo id")
        if response.status_code >= 400:
            raise ServerError(f"{HF_URL}/{repo_id}/config.json answered HTTP {response.status_code}")
        try:
            config = fileio.parse_json(response.content)
        except ValueError:
            raise ServerError(f"{HF_URL}/{repo_id}/config.json is not JSON")
        checkpoint_bytes = None
        try:
            index = http.get(f"/{repo_id}/resolve/main/model.safetensors.index.json", follow_redirects=True)
            if index.status_code == 200:
                checkpoint_bytes = fileio.parse_json(index.content).get("metadata", {}).get("total_size")
        except (httpx.HTTPError, ValueError, AttributeError):
            checkpoint_bytes = None
        if isinstance(checkpoint_bytes, bool) or not isinstance(checkpoint_bytes, int):
            checkpoint_bytes = None
    fileio.write_atomic(str(cache), json.dumps({"config": config, "checkpoint_bytes": checkpoint_bytes}))
    return config, checkpoint_bytes


MAX_CONFIG_BYTES = 16 << 20  # config.json and index files are kilobytes; this bounds a bad one
MAX_LAYERS = 10_000  # the deepest published decoders have a few hundred


def checked_model(config: Any, name: str, source: str, **kwargs: Any) -> Model:
    """model_from_config over a config.json from outside: a document that is not an object, or
    a field of the wrong type (a string where a number belongs), is one UsageError line."""
    if not isinstance(config, dict):
        raise UsageError(f"{source}: config.json is {type(config).__name__}, not an object")
    try:
        # A per-layer table is built: a layer count of 10^18 would never finish.
        layers = int(_text_config(config).get("num_hidden_layers") or 0)
        if not 0 <= layers <= MAX_LAYERS:
            raise UsageError(f"{source}: num_hidden_layers {layers} is not a layer count (at most {MAX_LAYERS:,})")
        return model_from_config(config, name, source, **kwargs)
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
        raise UsageError(f"{source}: config.json has a field of the wrong type or value "
                         f"({type(exc).__name__}: {str(exc)[:120]}): fix the file or pass a catalog name")


def resolve_model(name: str, transport: Any = None, hf_overrides: Mapping[str, Any] | None = None) -> Model:
    """A local folder / config.json, else a catalog name, else a Hugging Face repo id; `hf_overrides`
    (vLLM's --hf-overrides, e.g. a rope_scaling that extends the context) applied to its config."""
    if not name:
        raise UsageError("no model given: set MODEL (a catalog name such as qwen3-32b, a Hugging Face "
                         "repo id, or a local folder with config.json)")
    overrides = hf_overrides or {}
    path = Path(name).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise UsageError(f"{path} has no config.json: point MODEL at a model folder or its config.json")
        try:
            config = fileio.parse_json(fileio.read_bounded(file, "model config", MAX_CONFIG_BYTES))
        except ValueError:
            raise UsageError(f"{file} is not valid JSON")
        return checked_model(apply_hf_overrides(config, overrides), path.name if path.is_dir() else path.parent.name,
                             str(file), checkpoint_bytes=_safetensors_bytes(file.parent))
    catalog = catalogs.load_catalog("models")
    try:
        key, entry = catalogs.find_in_catalog(catalog, name, "model")
    except UsageError as exc:
        if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
            config, checkpoint_bytes = fetch_hf_config(name, transport)
            return checked_model(apply_hf_overrides(config, overrides), name, f"{HF_URL}/{name}",
                                 checkpoint_bytes=checkpoint_bytes)
        raise UsageError(f"{exc}; a model outside the catalog needs no network if you pass the path of its "
                         "config.json (or its folder) as MODEL")
    return model_from_config(apply_hf_overrides(catalog_config(catalog, key), overrides), key, entry["source"],
                             params_b=entry.get("params_b"), extra_params_b=entry.get("vision_params_b") or 0.0)


def resolve_gpu(name: str | None, gpu_gb: float | None = None, gpu_gib: float | None = None) -> dict[str, Any]:
    """A catalog GPU, or a memory size: `gpu_gb` the marketed size (80 for an 80 GB card), converted
    to the total CUDA reports as an 80 GB H100 does; `gpu_gib` the total as vLLM logs it. A size
    given with a GPU name replaces that GPU's memory."""
    if gpu_gb is not None and gpu_gib is not None:
        raise UsageError("GPU_GB (marketed GB) and GPU_GIB (the GiB total vLLM logs) are two ways to say the "
                         "same thing: give one")
    if gpu_gb is not None or gpu_gib is not None:
        base = dict(catalogs.find_in_catalog(catalogs.load_catalog("gpus"), name, "GPU")[1]) if name else {}
        reported = gpu_gib if gpu_gib is not None else gpu_gb * REPORTED_GIB_PER_MARKETED_GB
        label = f"{gpu_gib:g} GiB GPU" if gpu_gib is not None else f"{gpu_gb:g} GB GPU ({reported:.2f} GiB)"
        return {**base, "id": base.get("id", "custom"), "name": base.get("name", label), "memory_gib": reported}
    if not name:
        raise UsageError("no GPU given: set GPU (e.g. h100, a100-80gb, l40s; see scripts/rooflib/catalog/gpus.yaml), "
                         "GPU_GB (the marketed size, e.g. 80) or GPU_GIB (the total vLLM logs)")
    catalog = catalogs.load_catalog("gpus")
    try:
        key, entry = catalogs.find_in_catalog(catalog, name, "GPU")
    except UsageError as exc:
        known = ", ".join(sorted(catalog))
        raise UsageError(f"{exc} (known: {known}; or set GPU_GB or GPU_GIB)")
    return {**entry, "id": key}
