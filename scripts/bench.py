#!/usr/bin/env python3
"""Load-test an OpenAI-compatible server (vLLM, SGLang): TTFT, TPOT, ITL, e2e, tok/s, SLO verdict.

--endpoint picks the API (rooflib/load/apis.py has their formats): completions (default), chat,
responses (the OpenAI Responses API, /v1/responses) and messages (the Anthropic Messages API,
/v1/messages) stream text and get the figures below; embeddings (/v1/embeddings) and score
(/score: a query and --documents texts) answer once, so a request's figure is its latency (sent ->
the answer's last byte, e2e_ms), also per input token, with requests/s, input tokens/s and, for
score, pairs/s; their SLO is --slo-latency-p95-ms (a TTFT or TPOT target is a usage error).

Every request streams with temperature 0, `ignore_eos` and `stream_options.include_usage`
(+ `continuous_usage_stats`), so output lengths are exact and counted by the server. Prompts are
exactly --input-tokens long by the server's own tokenizer (/tokenize; else tiktoken, else an
estimate, announced), each with a unique prefix so the prefix cache cannot turn TTFT into a lookup.

Definitions (vLLM names): TTFT = request sent -> first chunk carrying content (never a role-only
chunk); e2e = request sent -> last content chunk; TPOT = (e2e - TTFT) / (output tokens - 1) per
request (= AIPerf ITL, GuideLLM ITL); ITL = per-chunk gaps (vLLM ITL, AIPerf ICL) and per token
(a gap divided over the tokens its chunk carried). Percentiles are linear (numpy default).
Timestamps are taken when bytes arrive (monotonic ns) by a minimal raw-socket HTTP/1.1 client;
SSE is parsed after the stream ends. The client's own event-loop lag is measured: when it may
have distorted the figures, the run is INVALID (exit 4). /metrics is read before and after
(queue vs prefill time, token counts, preemptions, prefix-cache hits) through rooflib/server/snapshots.py
and engine_metrics.py.
SGLang is tested against a live SGLang 0.5.23 (its CPU engine): its /tokenize (which takes chat
messages too, so chat prompts count the template), its usage (cached tokens with
--enable-cache-report) and its /metrics.

Real traffic (rooflib/load/workloads.py has the formats): --prompts JSONL, --sharegpt conversations
(every turn), --input-dist/--output-dist length distributions, --trace (Mooncake/BurstGPT JSONL
replayed on its own absolute schedule, --speed; the schedule lag is reported), agent sessions
(--sessions JSONL of turns, or --agent-turns synthetic ones that grow by a tool result each turn:
each turn resends the session's history; prefix reuse by turn against a perfect cache, with
--shuffle-history as the control; rooflib/load/sessions.py has the format). Requests are made
when sent, from words the tokenizer counts as one token each (a sample is checked first), so a
100,000-request run starts at once. Reasoning models: TTFT of the first answer token and the
reasoning/answer split of tokens and TPOT. /metrics is scraped every --timeline-interval seconds
("timeline"), and the client's TTFT/e2e are checked against the server's histograms. With
--prometheus (or $PROMETHEUS) the GPUs' DCGM exporter series over the run's window are read from
it as `metrics --prometheus` reads them ("server"."gpu_telemetry": each GPU's activity, memory,
power and clock, and the GPU findings), or the report says why there are none.

Images (--endpoint chat; rooflib/load/images.py): --images N per request, each a generated PNG of
--image-size WxH (different per request, deterministic by --seed) or your files from --image-dir
(PNG/JPEG), sent as base64 data URLs in OpenAI `image_url` content parts. An image's tokens are the
server's usage.prompt_tokens minus the text's, per image ("images"); TTFT is split by the server's
means (its TTFT, queue, prefill) into outside the server, rendering (preprocessing), queue and
prefill; --images 0 with the same flags is the text-only control.

Beyond one machine's streams (its cores, open files, source ports): run the same command on N
machines with --shard I/N and one --start-at; each sends its part of the run (requests I, I+N,
..., its share of the concurrency, the run's own send times), starts its measured requests at
that time after its warm-up, and writes its result and records with its clock ("shard");
merge.py joins them into one result, bench_job.py renders the Kubernetes Indexed Job that runs them.

Examples:
  bench.py --url http://127.0.0.1:8000 -n 32 -c 8 --input-tokens 2048 --output-tokens 256
  bench.py -n 64 -c 16 --slo-ttft-p95-ms 500 --slo-tpot-p95-ms 50 --log bench-log.md
  bench.py --rate 4 --burstiness 0.5 --duration 60 -n 1000 --json
  bench.py --endpoint chat --shared-prefix 1024 -n 32 -c 8 --records requests.jsonl
  bench.py --endpoint responses -n 32 -c 8 --input-tokens 1024 --output-tokens 128 --slo-ttft-p95-ms 800
  bench.py --endpoint embeddings -n 256 -c 32 --input-tokens 512 --slo-latency-p95-ms 200
  bench.py --endpoint score --documents 20 --input-tokens 256 -n 64 -c 8 --json-out rerank.json
  INFER_URL=http://gpu-box:8000 INFER_API_KEY=... bench.py -n 256 -c 64 --workers 2
  bench.py --endpoint chat --sharegpt scripts/data/sharegpt-sample.json -c 4 --probe /health
  bench.py --trace scripts/data/trace-sample.jsonl --speed 2 --json > run.json
  bench.py --endpoint chat --agent-turns 10 --input-tokens 1024 --tool-tokens uniform:200,2000 -n 8 -c 4
  bench.py --endpoint messages --sessions scripts/data/sessions-sample.jsonl --speed 4 -c 2 --json-out agents.json
  bench.py --endpoint chat --agent-turns 10 -n 8 -c 4 --shuffle-history     # the control: no history to reuse
  bench.py --endpoint chat --images 2 --image-size 448x448 --input-tokens 256 -n 32 -c 4
  bench.py --endpoint chat --image-dir ./photos --input-tokens 64 --output-tokens 32 -n 64 -c 8
  bench.py -n 1000 -c 64 --json-out run.json     # the table on stdout, the JSON document in run.json
  bench.py --input-dist lognormal:400,2000 --output-dist uniform:64,512 -n 200 -c 16
  bench.py -n 256 -c 32 --prometheus http://prometheus:9090 --json-out run.json
  bench.py --input-dist lognormal:3000,12000 -n 200 --over-limit   # how many the server rejects over max_model_len
  bench.py -n 40000 -c 8192 --shard 1/4 --start-at 2026-06-01T12:00:00Z --records shard-1.records.jsonl --json-out shard-1.json

Exit codes: 0 SLO met (or no SLO set and every request completed), 1 SLO missed or requests
failed, 2 usage error, 3 server unreachable or every request failed, 4 run invalid (the client
may have distorted the figures, or ran out of file descriptors: raise ulimit -n), 5 the result is
printed but --records, --log or --json-out could not be written, 130 interrupted by Ctrl-C or
SIGTERM (partial results still printed and logged).
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from rooflib.core import cli, conf, fileio, signals
from rooflib.core.errors import UsageError
from rooflib.load import asyncclient, bench_options, benchrun
from rooflib.render import bench_text


def run(args: Any, settings: conf.Settings, server: asyncclient.Target) -> int:
    options = bench_options.make_options(args, settings)
    if options.shard and not options.records:
        raise UsageError("--shard needs --records: merge.py takes the run's percentiles from every shard's requests")
    for what, path in (("--records", options.records), ("--log (BENCH_LOG)", options.log)):
        if path:
            fileio.check_writable(path, what)
    target = asyncclient.find_target(server, settings.get("INFER_MODEL", args.model) or None, options.timeout_s)
    with signals.SignalHold("bench") as hold:  # from the end of the load: signals held until the result is written
        result = benchrun.execute(target, options, hold)
        return bench_text.publish(result, args.output, options.records, options.log)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = bench_options.build_parser(sharded=True)
    p.description, p.epilog = cli.split_doc(__doc__)
    return benchrun.run_with_settings(p.parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
