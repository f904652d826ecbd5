"""The data catalogs shipped with the tools (GPUs, models, acceptance gates, tool-call cases)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from rooflib.core.errors import UsageError

CATALOG_DIR = Path(__file__).resolve().parents[1] / "catalog"


def load_catalog(kind: str) -> dict[str, dict[str, Any]]:
    """An embedded catalog, scripts/rooflib/catalog/<kind>.yaml: {id: {..., aliases: [...], source: ...}}."""
    with open(CATALOG_DIR / f"{kind}.yaml", encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _catalog_key(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "", name.lower())


def find_in_catalog(catalog: Mapping[str, Mapping[str, Any]], name: str, what: str) -> tuple[str, Mapping[str, Any]]:
    """Look a name up by id or alias, ignoring case and punctuation ("H100 SXM" = "h100-sxm").

    An unknown name is a UsageError that suggests the close names, or else the five closest
    (a catalog lists dozens).
    """
    import difflib

    index = {}
    for key, entry in catalog.items():
        for alias in [key, *entry.get("aliases", [])]:
            index[_catalog_key(alias)] = key
    wanted = _catalog_key(name)
    if wanted in index:
        return index[wanted], catalog[index[wanted]]
    close = difflib.get_close_matches(wanted, index, n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + ", ".join(sorted({index[c] for c in close}))
    else:
        nearest = dict.fromkeys(index[c] for c in difflib.get_close_matches(wanted, index, n=20, cutoff=0.0))
        hint = "nothing close; the nearest are " + ", ".join(list(nearest)[:5])
    raise UsageError(f"unknown {what} {name!r}: {hint}")
