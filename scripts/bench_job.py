#!/usr/bin/env python3
"""Render the Kubernetes Indexed Job that runs one bench run as N shards, one pod each, when one
machine cannot send the load: N pods run bench.py --shard $JOB_COMPLETION_INDEX/N and start together.

Takes bench's own flags (the workload, the SLO, --workers per pod; BENCH_N and the like from the
environment or inference.env too) and writes each of them into the manifest, with the shard, a
wall-clock start (--start-at, else --start-in seconds from now: apply the Job before then) and the
result files under /results/<job name>/ on the PersistentVolumeClaim --results-claim. The API key
goes to the pods from a Secret (--api-key-secret NAME[:KEY]); the manifest never carries it, and an
INFER_API_KEY set here without a Secret is refused. The image needs python3 with httpx, tiktoken,
jinja2 and pyyaml, and the toolbox (task install) at --bench-path's folder. Collect the folder
(kubectl cp from a pod that mounts the claim) and merge it: task merge -- <folder>.

Examples:
  bench_job.py --image registry.example/roofline:1 --shards 4 --url http://vllm.llm.svc:8000 --results-claim bench-results -n 20000 -c 8192 --input-tokens 512 --output-tokens 128 > job.yaml
  bench_job.py --image registry.example/roofline:1 --shards 8 --url http://gateway.llm.svc --results-claim bench-results --api-key-secret llm-key:token --rate 400 --duration 300 -n 200000 --out job.yaml
  task bench-job IMAGE=registry.example/roofline:1 SHARDS=4 INFER_URL=http://vllm.llm.svc:8000 RESULTS_CLAIM=bench-results BENCH_N=20000 BENCH_C=8192 -- --out job.yaml

Exit codes: 0 rendered, 2 usage error (a bench flag that does not make sense, a load that cannot
be split over the shards, a flag a shard sets itself, an API key without a Secret, no URL),
130 interrupted.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Sequence

from rooflib.core import cli, conf, fileio, printing
from rooflib.core.errors import UsageError
from rooflib.load import asyncclient, bench_options, benchrun, shards
from rooflib.render import bench_job

DEFAULT_BENCH_PATH = "/opt/roofline-toolbox/scripts/bench.py"


def build_parser():
    p = bench_options.build_parser(sharded=True)
    p.description, p.epilog = cli.split_doc(__doc__)
    job = p.add_argument_group("the Job")
    job.add_argument("--image", default="", help="the container image: python3 with the toolbox's runtime and scripts")
    job.add_argument("--shards", default="", help="pods, each sending its part of the run (its share of -c, or of --rate)")
    job.add_argument("--results-claim", default="", help="PersistentVolumeClaim mounted at /results in every pod "
                     "(ReadWriteMany when the pods may run on several nodes)")
    job.add_argument("--api-key-secret", default="", help="Secret holding the API key: NAME or NAME:KEY (key "
                     "INFER_API_KEY by default); the pods read it as INFER_API_KEY")
    job.add_argument("--job-name", default="roofline-bench", help="the Job's name, also its results folder")
    job.add_argument("--namespace", default="", help="the Job's namespace (default: kubectl's)")
    job.add_argument("--start-in", default="", help="seconds from now to the shards' start, when --start-at is not "
                     "given (default 120): the time to apply the Job and pull the image")
    job.add_argument("--bench-path", default=DEFAULT_BENCH_PATH, help="bench.py inside the image")
    job.add_argument("--cpu", default="", help="CPU each pod requests (default: --workers, one core per client process)")
    job.add_argument("--out", default="", help="write the manifest here (atomically) instead of to stdout")
    return p


def job_spec(args: Any, settings: conf.Settings, server: asyncclient.Target) -> bench_job.JobSpec:
    """The Job to render, from the flags and settings; a UsageError for what a Job cannot run."""
    if settings.source("INFER_URL", args.url) == "default":
        raise UsageError("give the server as the pods reach it: --url (INFER_URL), e.g. http://vllm.llm.svc:8000")
    options = bench_options.read_options(args, settings)
    set_per_shard = [flag for flag, given in (("--shard", options.shard), ("--records", options.records),
                                              ("--log (BENCH_LOG)", options.log),
                                              ("--prometheus (PROMETHEUS)", options.prometheus)) if given]
    if set_per_shard:
        raise UsageError(f"{set_per_shard[0]} is not for the Job's pods: the Job sets each shard and its files; "
                         "write the log with merge.py --log; read the GPUs with task metrics --prometheus")
    count = cli.number("--shards (SHARDS)", args.shards, int, 1, 1024)
    image = args.image.strip()
    if count is None or not image or not args.results_claim:
        raise UsageError("--image (IMAGE), --shards (SHARDS) and --results-claim (RESULTS_CLAIM) are needed")
    start = options.start_at if options.start_at is not None else \
        time.time() + cli.number("--start-in (START_IN)", args.start_in, float, 1, shards.LONGEST_WAIT_S, default=120.0)
    if start <= time.time():
        raise UsageError(f"--start-at {shards.iso(start)} has passed: the pods would start at once, each when it is "
                         "scheduled; give a start they can all make (--start-in, START_IN)")
    # Checked as each shard will check it: the split over the pods, and over --workers in each.
    bench_options.check_options(dataclasses.replace(options, shard=shards.Shard(0, count), start_at=start))
    secret, secret_key = bench_job.parse_secret(args.api_key_secret)
    if server.api_key and not secret:
        raise UsageError("INFER_API_KEY is set, and a manifest never holds a key: put it in a Secret (kubectl create "
                         "secret generic roofline-bench --from-literal=INFER_API_KEY=...) and pass --api-key-secret "
                         "roofline-bench")
    model = settings.get("INFER_MODEL", args.model)
    return bench_job.JobSpec(
        name=bench_job.check_name(args.job_name, "--job-name"),
        namespace=bench_job.check_name(args.namespace, "--namespace") if args.namespace else None,
        image=image, bench_path=args.bench_path, shards=count, start_at=shards.iso(start), url=server.base_url,
        bench_flags=tuple(bench_options.as_flags(options) + (["--model", model] if model else [])),
        secret=secret, secret_key=secret_key, claim=bench_job.check_name(args.results_claim, "--results-claim", bench_job.SUBDOMAIN),
        cpu=args.cpu or str(options.workers))


def run(args: Any, settings: conf.Settings, server: asyncclient.Target) -> int:
    spec = job_spec(args, settings, server)
    text = bench_job.render(spec)
    if args.out:
        fileio.write_atomic(args.out, text)
    printing.progress(f"bench-job: {spec.shards} shards start at {spec.start_at}: apply the Job before then "
                      f"(kubectl apply -f {args.out or 'job.yaml'}); results in the claim {spec.claim} under "
                      f"{bench_job.RESULTS}/{spec.name}/; collect that folder, then: task merge -- <folder>")
    summary = {**bench_job.summary(spec), "out": args.out or None, "manifest": text}
    return printing.emit(summary, f"written to {args.out}" if args.out else text, args.output)


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    return benchrun.run_with_settings(build_parser().parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
