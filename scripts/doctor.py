#!/usr/bin/env python3
"""Where the time goes: from the user's symptom to the part of the request path that causes it.

One command against a live vLLM or SGLang server. It reads what the server says of itself
(/v1/models, vLLM's /server_info and cache_config_info, SGLang's /get_server_info), watches
/metrics for a window (--window, default 20 s) while a short, light probe runs (a few streamed
requests shaped like the live traffic, 2 at a time, and trivial GETs: the probe's load is
printed), and splits the symptom's figure along the request path, each part measured:

  first-token  TTFT: connect; front (what a missing route pays: a proxy, balancer or middleware
               before routing, or the network); route (what the inference route adds: a gateway,
               the API server's tokenizing); the engine's queue and prefill; the first delivery
  streaming    TPOT p95 against its target (the engine's token time, the batch); else the gap
               between text arrivals: the engine's time per token, tokens per event (the
               engine's --stream-interval), events per read (a layer that buffers), stalls
  errors       failed requests by status and route (http_requests_total), aborted requests,
               and the error body's cause (a request just over the context limit is sent)
  throughput   tokens per second against a queue the engine holds or the offered load
  all          every symptom; those that miss their target first, failures before time

The first line names the root: the part that holds most of the figure, its owner (an engine
flag with its current value and how that is known, or the component outside the engine) and
the value to set; then the evidence, why and what to expect, other parts under `Also:`, each
budget with its parts, and light verify commands in the form of the Taskfile that ran this
(2 at a time, 16 requests). A TPOT target the batch misses is answered from a fit of the
engine's time per token against requests running over the window: the cap that meets it, the
tokens per second one server makes there against the tokens arriving (when the queue would grow
without bound, and how many replicas keep up); --give says which side the user gives.

Behind a balancer, give the engines' own URLs with --replica (their /metrics are read one by
one, never mixed; each probe request is attributed to the replica that served it when nothing
else finished meanwhile); a URL whose consecutive scrapes come from different engines is said so.

Examples:
  doctor.py --url http://127.0.0.1:8000 --symptom first-token
  doctor.py --url http://127.0.0.1:8000 --symptom streaming --slo-tpot-p95-ms 7 --give queue
  doctor.py --url http://127.0.0.1:8000 --symptom errors --prompt-tokens 1500 --json
  doctor.py --url http://gateway:8080 --replica http://10.0.0.1:8000 --replica http://10.0.0.2:8000
  SYMPTOM=all INFER_URL=http://127.0.0.1:8000 doctor.py --window 30

Exit codes: 0 the symptom's figures meet their targets (no root cause), 1 a root cause was found
(printed), 2 usage error, 3 server unreachable or answering an HTTP error, 4 the answer is not
usable metrics, 130 interrupted by Ctrl-C or SIGTERM (what was measured is still reported).
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from rooflib.core import cli, conf, printing, taskcall
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, UsageError
from rooflib.doctor import examine
from rooflib.doctor.evidence import SYMPTOMS, TRADE_SIDES, Targets
from rooflib.server import prometheus_text, slo_targets

DEFAULT_ERROR_SHARE = 0.01   # 1% of requests failing is worth a root cause


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser(__doc__)
    p.add_argument("--url", default="", help=f"the URL the users call (else $INFER_URL, {conf.ENV_FILE_NAME}, "
                                             f"{conf.DEFAULT_URL}); the same URL given twice is one server")
    p.add_argument("--replica", action="append", default=[],
                   help="an engine's own URL behind a balancer (repeat): its /metrics is read on its own")
    p.add_argument("--symptom", default="", help=f"what the user sees: {', '.join(SYMPTOMS)} (else $SYMPTOM; "
                                                 "default all)")
    p.add_argument("--give", default="", help="when token speed and queue time conflict, which the user gives: "
                                              "queue (wait longer, faster tokens) or speed (else $GIVE; default queue)")
    p.add_argument("--slo-ttft-p95-ms", default="", help="TTFT p95 target (else $SLO_TTFT_P95_MS; default 2000)")
    p.add_argument("--slo-tpot-p95-ms", default="", help="TPOT p95 target (else $SLO_TPOT_P95_MS; default 50)")
    p.add_argument("--slo-gap-p95-ms", default="", help="target for the gap between streamed text arrivals, p95 "
                                                        "(else $SLO_GAP_P95_MS; default twice the TPOT target)")
    p.add_argument("--slo-error-share", default="", help=f"failed share of requests worth a root cause "
                                                         f"(default {DEFAULT_ERROR_SHARE:g})")
    p.add_argument("--prompt-tokens", default="", help="the users' prompt length, when known (sizes a context "
                                                       "limit that rejects them)")
    p.add_argument("--window", default="", help="seconds of /metrics to read around the probe (default 20)")
    p.add_argument("--probe-requests", default="", help="streamed probe requests (default 6)")
    p.add_argument("--probe-concurrency", default="", help="probe requests at a time (default 2)")
    p.add_argument("--model", default="", help="the served model (else $INFER_MODEL or the first served)")
    p.add_argument("--env-file", default=None, help=f"settings file (default: ./{conf.ENV_FILE_NAME})")
    p.add_argument("--timeout", type=cli.timeout_arg, default=60.0, help="seconds to wait for each answer")
    printing.add_output_args(p)
    return p


def options(args: argparse.Namespace) -> examine.Options:
    settings = conf.settings_from_args(args)
    url, api_key = conf.server_settings(args, settings)
    replicas = []
    for raw in args.replica:
        for piece in re.split(r"[,\s]+", raw):
            if piece and conf.normalize_url(piece) not in replicas:
                replicas.append(conf.normalize_url(piece))
    symptom = settings.get("SYMPTOM", args.symptom, "all")
    if symptom not in SYMPTOMS:
        raise UsageError(f"--symptom must be one of {', '.join(SYMPTOMS)}, got {symptom!r}")
    give = settings.get("GIVE", args.give, "queue")
    if give not in TRADE_SIDES:
        raise UsageError(f"--give must be queue or speed, got {give!r}")
    ttft = cli.number("SLO_TTFT_P95_MS", settings.get("SLO_TTFT_P95_MS", args.slo_ttft_p95_ms), float)
    tpot = cli.number("SLO_TPOT_P95_MS", settings.get("SLO_TPOT_P95_MS", args.slo_tpot_p95_ms), float)
    gap = cli.number("SLO_GAP_P95_MS", settings.get("SLO_GAP_P95_MS", args.slo_gap_p95_ms), float)
    share = cli.number("--slo-error-share", args.slo_error_share, float, low=0.0, high=1.0)
    defaults = slo_targets.DEFAULT_TARGETS
    tpot_target = tpot if tpot is not None else defaults["tpot_p95_ms"]
    targets = Targets(ttft_p95_ms=ttft if ttft is not None else defaults["ttft_p95_ms"], tpot_p95_ms=tpot_target,
                      gap_p95_ms=gap if gap is not None else slo_targets.ITL_PER_TPOT * tpot_target,
                      error_share=share if share is not None else DEFAULT_ERROR_SHARE,
                      given=tuple(name for name, value in (("ttft_p95_ms", ttft), ("tpot_p95_ms", tpot),
                                                            ("gap_p95_ms", gap)) if value is not None))
    return examine.Options(
        url=url, replicas=tuple(r for r in replicas), api_key=api_key,
        model=settings.get("INFER_MODEL", args.model, None) or None, symptom=symptom, targets=targets, give=give,
        window_s=cli.number("--window", args.window, float, default=20.0),
        probe_n=cli.number("--probe-requests", args.probe_requests, int, default=6),
        probe_c=cli.number("--probe-concurrency", args.probe_concurrency, int, default=2),
        prompt_tokens=cli.number("--prompt-tokens", args.prompt_tokens, int), timeout=args.timeout,
        call=taskcall.from_environment())


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        try:
            opts = options(args)
            facts, _, extra = examine.gather(opts)
        except prometheus_text.InvalidScrape as exc:
            return cli.fail(str(exc), EXIT_INVALID)
        verdict = examine.decide(opts, facts)
        result = examine.as_json(verdict, extra)
        printed = printing.emit(result, examine.human_text(verdict, extra), args.output)
        if extra["interrupted"]:
            return printed or EXIT_INTERRUPTED
        return printed or (EXIT_CHECK_FAILED if verdict.root else EXIT_OK)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
