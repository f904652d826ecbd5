"""What /v1/models says: the served model a request should name and its context length."""
from __future__ import annotations

from typing import Any, Mapping

import httpx

from rooflib.core.errors import ServerError, UsageError
from rooflib.core.http_client import get_json


def pick_model(listing: dict[str, Any], wanted: str | None, where: str) -> tuple[dict[str, Any], list[str]]:
    """From a /v1/models document: the entry of `wanted` (INFER_MODEL) or the first one, and all names.

    An unknown name is a UsageError listing what is served; an empty listing is the server's
    state (still loading), a ServerError.
    """
    data = listing.get("data") if isinstance(listing, dict) else None
    models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]] \
        if isinstance(data, list) else []
    if not models:
        raise ServerError(f"{where}/v1/models lists no model: is the server still loading?")
    names = [m["id"] for m in models]
    if wanted and wanted not in names:
        raise UsageError(f"model {wanted!r} is not served by {where}: set INFER_MODEL (or --model) to one of "
                         f"{', '.join(names)}")
    return (models[names.index(wanted)] if wanted else models[0]), names


def max_model_len(entry: Mapping[str, Any], where: str) -> int | None:
    """A /v1/models entry's max_model_len (vLLM gives one), checked: a whole number or absent."""
    value = entry.get("max_model_len")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ServerError(f"{where}/v1/models gives max_model_len {str(value)[:40]!r}, not a whole number")
    return value


def served_model(http: httpx.Client, wanted: str | None = None) -> dict[str, Any]:
    """The /v1/models entry of `wanted`, or of the first model listed (vLLM's carry max_model_len)."""
    return pick_model(get_json(http, "/v1/models"), wanted, str(http.base_url).rstrip("/"))[0]
