"""The diagnosis of an engine's metrics report (engine_metrics.report, read as a typed
reading.Reading): one root cause, what it causes, one plan of levers checked against the
deployment, and the commands that verify it. Its parts live beside it: known_settings.py (the rules
of thumb, the engines' flags, numbers for people, the deployment's settings), findings.py (the
findings and their order), plan.py (the levers, the plan and the verify commands); this module
joins them, adds the fleet's findings and the time the client saw outside the engine, and prints
the result.

Causes and what they cause, as the findings chain them (`caused_by`):
  outside_engine    time spent outside the engine (proxy, network): TTFT and e2e gaps the engine
                    does not see (a client-against-server check names it; /metrics alone cannot)
  kv_cache          the KV cache is too small for the load -> preemptions -> queue -> TTFT;
                    a low prefix-cache hit rate (prefix_evicted); recomputation stalls tokens (decode)
  running_limit     the cap on running requests holds them while the KV cache has room -> queue -> TTFT
  prefix_cache_off  prefix caching is off on long prompts -> prefill -> TTFT, token stalls (decode)
  prefix_unstable   caching is on and long prompts hit nothing: their start varies (client side)
  prefill           long prefills -> TTFT; tokens stall behind them -> ITL/TPOT (decode)
  queue             requests wait for a slot (a root only when no limit can be named yet)
  decode            tokens slower than the target: big batches, or memory-bound decode

Every setting a finding or lever names is a deployment.Known: exported by the server
(vllm:cache_config_info, SGLang's sglang:max_total_num_tokens, context_len and page_size, /v1/models,
vLLM's /server_info, SGLang's /get_server_info), inferred from the metrics (the evidence is said),
or unknown. A lever reads "setting: current -> proposed (current: exported|inferred|unknown)",
gives the reason for the value and the effect on the user's figures, and is never printed for
what is already in place. The plan holds one lever per setting, the root cause's first, so it
never says both "raise" and "lower" of one setting.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping, Sequence

from rooflib.server.deployment import Known
from rooflib.server.findings import findings, ordered
from rooflib.server.plan import make_lever, plan, verify
from rooflib.server.reading import Reading

# ---------------------------------------------------------------------------------------------
# The diagnosis

def diagnose(r: Reading, s: Mapping[str, Known], url: str | None = None) -> dict[str, Any]:
    """{root_cause, findings (root first, then what it causes, then the others), plan, verify}."""
    found = ordered(findings(r, s))
    root = found[0] if found else None
    return {"root_cause": root, "findings": found, "plan": plan(found, r, s),
            "verify": verify(r, url, root) if root else []}


def _leading(own: list[dict[str, Any]], first: list[dict[str, Any]], engine: Mapping[str, Any]) -> dict[str, Any]:
    """Findings that stand before the engine's (the first is the root) and their levers before its plan."""
    return {"root_cause": own[0], "findings": own + list(engine["findings"]), "plan": first + list(engine["plan"]),
            "verify": list(engine["verify"])}


def with_fleet(fleet_findings: Sequence[Mapping[str, Any]], engine: Mapping[str, Any]) -> dict[str, Any]:
    """The fleet's findings (scripts/fleet.py) before the engine's: a replica down, a mismatch or
    the balancer is the root; their levers lead the plan."""
    if not fleet_findings:
        return dict(engine)
    own = [{k: v for k, v in f.items() if k != "levers"} for f in fleet_findings]
    first = [make_lever(None, None, None, f["cause"], "see the finding's figures per replica", action=lever)
             for f in fleet_findings for lever in f["levers"]]
    return _leading(own, first, engine)


def with_outside(outside: Sequence[Mapping[str, Any]], engine: Mapping[str, Any],
                 engine_ttft_ms: float | None = None) -> dict[str, Any]:
    """The time the client saw outside the engine (bench's cross-check, rooflib/server/watch.py)
    with the engine's findings. Every request waits for it whatever the engine does, so it is the
    root (with its `cause` and `size_ms`, its remedy first in the plan) unless the engine's own
    root costs more: when the engine's mean TTFT (`engine_ttft_ms`: queue and prefill) is longer
    than the largest outside time, the engine's root stays first and the outside time follows."""
    # The largest part first: it is the root (a small partial buffering is no root beside a fixed delay).
    found = sorted((f for f in outside if f["kind"] == "outside_engine"), key=lambda f: -(f["size_ms"] or 0))
    if not found:
        return dict(engine)
    own = [{k: v for k, v in f.items() if k != "remedy"} for f in found]
    levers = [make_lever(None, None, None, f"about {f['size_ms'] or 0:.0f} ms of each request outside the engine "
                         f"({f['cause']})",
                         f"the client's TTFT and e2e up to {f['size_ms'] or 0:.0f} ms nearer the engine's",
                         action=f["remedy"]) for f in found]
    outside_ms = max(f["size_ms"] or 0 for f in found)
    if engine["root_cause"] and engine_ttft_ms is not None and engine_ttft_ms > outside_ms:
        return {**engine, "findings": list(engine["findings"]) + own, "plan": list(engine["plan"]) + levers}
    return _leading(own, levers, engine)


def format_diagnosis(d: Mapping[str, Any]) -> list[str]:
    """The human form: the root cause first (its kind, setting and current value), what it
    causes indented under it, the other findings, one numbered plan, the verify commands."""
    if not d["root_cause"]:
        return ["Diagnosis: no bottleneck found in these figures."]
    lines = []
    causes = {f["kind"]: f for f in d["findings"]}
    for i, finding in enumerate(d["findings"]):
        depth, above = 0, finding["caused_by"]
        while above in causes and depth < len(causes):
            depth, above = depth + 1, causes[above]["caused_by"]
        head = "Root cause: " if i == 0 else ("  " * depth + "-> " if depth else "Also: ")
        lines.append(f"{head}[{finding['kind']}] {finding['evidence']} (confidence {finding['confidence']})")
    lines.append("Plan (one change at a time, in this order):")
    lines += [f"  {i}. {lever['text']}" for i, lever in enumerate(d["plan"], 1)]
    if d["verify"]:
        lines.append("Verify (the same bench before and after the change, then compare):")
        lines += [f"  {command}" for command in d["verify"]]
    return lines


def known_json(s: Mapping[str, Known]) -> dict[str, dict[str, Any]]:
    return {name: asdict(known) for name, known in s.items()}
