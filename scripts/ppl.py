#!/usr/bin/env python3
"""Perplexity of the served model on a text file, through the API, and its change after quantization.

The text is tokenized by the server (vLLM /tokenize), a BOS token put in front when the tokenizer
adds one, and scored in windows of --window tokens that advance by --stride: each window after
the first scores only its last --stride tokens, with window - stride tokens of context (the
Hugging Face "Perplexity of fixed-length models" method; --stride = window - 1 gives disjoint
chunks with one token of context, as lm-evaluation-harness does). Texts longer than one window
are windowed automatically. APIs: vLLM /v1/completions with prompt_logprobs (default) or
echo + logprobs (--api vllm-echo); SGLang /generate with return_logprob (--api sglang; tested
against a live SGLang 0.5.23, equal to transformers' own to 0.1%). Reported: perplexity, token count, a SHA-256
of the token ids (two runs compare token by token only when it matches; otherwise by bits per
byte), bits per byte, and a re-score of the first window at the end (a warning when it moved).

Compare mode (--compare BASE CANDIDATE, each a server URL or a saved --json run): the change in
perplexity in %, with a 95% paired bootstrap interval over blocks of tokens, judged by its upper
bound against the levels of --scheme (fp8 1%/2%, int8 1.5%/3%, 4bit 3%/5%: warn/fail, from
scripts/rooflib/catalog/ppl_gates.yaml). Use the same text, window and stride on both sides, with
prefix caching off (--no-enable-prefix-caching; vllm#42019).

Examples:
  ppl.py --url http://127.0.0.1:8000                          # the bundled sample text
  ppl.py --text my_traffic.txt --json > base.json             # save a run
  ppl.py --compare base.json http://gpu:8001 --text my_traffic.txt --scheme fp8
  ppl.py --compare base.json cand.json --scheme 4bit
  task infer:ppl INFER_URL=http://127.0.0.1:8000 TEXT=my.txt -- --window 1024 --stride 256

Exit codes: 0 measured (compare: PASS or WARN), 1 compare: FAIL, 2 usage error (empty text, bad
window, runs that cannot be compared, a server without logprobs), 3 server unreachable, failing or
slower than --timeout for one window (the windows scored so far are printed; a long window on a busy
CPU may need --timeout 600), 130 interrupted by Ctrl-C or SIGTERM (likewise).
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from rooflib.core import cli, conf, http_client, printing
from rooflib.core.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_SERVER, UsageError
from rooflib.quality import perplexity
from rooflib.server import model_listing


def run_text(run: dict[str, Any]) -> str:
    lines = [f"perplexity {run['ppl']:.4f} over {run['scored_tokens']:,} scored tokens "
             f"({run['tokens']:,} tokens, {len(run['windows'])} window(s) of {run['window']:,}, stride {run['stride']:,})"]
    if run["stopped"]:
        lines.append(f"PARTIAL: stopped after {len(run['windows'])} window(s) ({run['stopped']})")
    else:
        lines.append(f"bits per byte {run['bits_per_byte']:.4f} ({run['bytes']:,} bytes, {run['words']:,} words)")
    lines.append(f"token ids sha256 {run['token_ids_sha256'][:16]}  prefix {run['prefix'] or 'none'}  api {run['api']}")
    if run["recheck_nll_delta"] is not None and run["recheck_nll_delta"] > perplexity.RECHECK_TOLERANCE:
        lines.append(f"warning: re-scoring the first window moved it by {run['recheck_nll_delta']:.2e} nats/token: "
                     "the server is not deterministic (turn prefix caching off: --no-enable-prefix-caching)")
    return "\n".join(lines)


def comparison_text(result: dict[str, Any]) -> str:
    levels = result["levels"]
    ci = result["ci95_pct"]
    interval = f" (95% CI {ci[0]:+.2f}% .. {ci[1]:+.2f}%)" if ci else " (no interval: unpaired)"
    return "\n".join([
        f"base {result['base_ppl']:.4f}  candidate {result['candidate_ppl']:.4f}",
        f"{result['metric']} change {result['change_pct']:+.2f}%{interval}",
        f"levels {levels['name']}: warn above {levels['warn_pct']}%, fail above {levels['fail_pct']}%",
        f"verdict: {result['verdict']}",
    ])


def human_text(result: dict[str, Any]) -> str:
    """One server's run, or a base-candidate comparison (it carries a verdict)."""
    return comparison_text(result) if "verdict" in result else run_text(result)


def build_parser():
    p = cli.parser(__doc__)
    cli.add_server_args(p)
    p.add_argument("--model", default="", help="served model name (else $INFER_MODEL, else the first of /v1/models)")
    p.add_argument("--text", default="", help=f"UTF-8 text file to score (else $TEXT, else the bundled {perplexity.SAMPLE_TEXT.name})")
    p.add_argument("--api", choices=perplexity.APIS, default="vllm", help="how to ask for prompt logprobs")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens per request, at most max_model_len - 1 (unset: {perplexity.DEFAULT_WINDOW} or that)")
    p.add_argument("--stride", type=int, default=None,
                   help="new tokens scored per window after the first (unset: a quarter of the window)")
    p.add_argument("--compare", nargs=2, metavar=("BASE", "CANDIDATE"), default=None,
                   help="compare two servers (URLs) or saved --json runs (files)")
    p.add_argument("--scheme", default="fp8", help="quantization scheme for the levels: fp8, int8, 4bit")
    p.add_argument("--warn-pct", type=float, default=None, help="override the scheme's warn level (%%)")
    p.add_argument("--fail-pct", type=float, default=None, help="override the scheme's fail level (%%)")
    p.add_argument("--block", type=int, default=64, help="tokens per bootstrap block (compare)")
    printing.add_output_args(p)
    return p


def run_on_server(url: str, api_key: str | None, args, text: str, window: int | None,
                  stride: int | None) -> dict[str, Any]:
    wanted = conf.settings_from_args(args).get("INFER_MODEL", args.model)
    with http_client.client(url, api_key, args.timeout) as http:
        entry = model_listing.served_model(http, wanted)
        model, max_model_len = entry["id"], model_listing.max_model_len(entry, url)
        printing.progress(f"scoring on {url} ({model}, api {args.api})")
        run = perplexity.measure(http, args.api, model, text, window, stride, max_model_len)
    return run | {"url": url}


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # Settings are read here, inside run_main: a bad URL or inference.env line is one line, exit 2.
        url, api_key = conf.server_settings(args)
        if (args.window is not None and args.window < 2) or (args.stride is not None and args.stride < 1):
            raise UsageError("--window must be at least 2 and --stride at least 1")
        cli.number("--block", args.block, int, 1)
        if args.compare is None:
            path, text = perplexity.resolve_text(args)
            run = run_on_server(url, api_key, args, text, args.window, args.stride) | {"text": path}
            printed = printing.emit(run, human_text(run), args.output)
            if run["stopped"]:
                return printed or (EXIT_INTERRUPTED if run["stopped"] == "interrupted" else EXIT_SERVER)
            return printed
        levels = perplexity.gate(args.scheme, args.warn_pct, args.fail_pct)
        sides = []
        text = None
        window, stride = args.window, args.stride
        for source in args.compare:
            if source.startswith(("http://", "https://")):
                if text is None:
                    text = perplexity.resolve_text(args)
                sides.append(run_on_server(conf.normalize_url(source), api_key, args, text[1], window, stride)
                             | {"text": text[0]})
            else:
                sides.append(perplexity.load_run(source))
            # The second side is scored in the first side's windows, so the two pair token by token.
            window, stride = sides[0]["window"], sides[0]["stride"]
        result = perplexity.compare(sides[0], sides[1], levels, args.block)
        sides = [{k: v for k, v in side.items() if k not in ("token_nll", "windows")} for side in sides]
        printed = printing.emit(result | {"base": sides[0], "candidate": sides[1]}, human_text(result), args.output)
        return printed or (EXIT_CHECK_FAILED if result["verdict"] == "FAIL" else EXIT_OK)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
