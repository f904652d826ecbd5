"""The latency targets (SLOs) that the prefill and decode findings are judged against, and the
starting defaults taken where the user states none (interactive chat): a default to confirm with the
user, never their SLO. The command lines read them from their flags and pass them down to the report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Targets:
    """Latency targets (SLOs) that the prefill and decode findings are judged against; a target
    not given takes the starting default (DEFAULT_TARGETS), and `source` says which did. The ITL
    target, unless given, is ITL_PER_TPOT times the TPOT target and does not count in `source`."""
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    itl_p95_ms: float | None = None

    def resolved(self) -> dict[str, Any]:
        given = {"ttft_p95_ms": self.ttft_p95_ms, "tpot_p95_ms": self.tpot_p95_ms}
        targets = {k: v if v is not None else DEFAULT_TARGETS[k] for k, v in given.items()}
        defaulted = [k for k, v in given.items() if v is None]
        source = "given" if not defaulted else "default" if len(defaulted) == len(given) else "partly default"
        itl = self.itl_p95_ms if self.itl_p95_ms is not None else ITL_PER_TPOT * targets["tpot_p95_ms"]
        return {**targets, "itl_p95_ms": itl, "source": source, "defaulted": defaulted}


# Starting targets when the user states none (interactive chat): TTFT p95 under 2 s on a long
# prompt, TPOT p95 under 50 ms (20 tok/s per user; chat reads comfortably at 20-40 tok/s).
# They are a default to confirm with the user, never their SLO: the report says so.
DEFAULT_TARGETS = {"ttft_p95_ms": 2000.0, "tpot_p95_ms": 50.0}
# ITL counts every gap between tokens, so a stall that TPOT averages over a request shows in its
# p95: twice the TPOT target (100 ms by default, a pause a reader of streamed text notices).
ITL_PER_TPOT = 2.0
