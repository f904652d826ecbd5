"""The Kubernetes Indexed Job that runs bench as N shards, one pod each (bench --shard
$JOB_COMPLETION_INDEX/N --start-at T), from the toolbox's template (k8s/bench-job.yaml.j2).

Each pod writes its result and records to a volume the pods share (a PersistentVolumeClaim,
ReadWriteMany when the pods may land on several nodes), under a folder named after the Job;
merge.py joins them. The API key reaches the pods from a Secret (env valueFrom secretKeyRef): the
manifest never holds it. No controller: Kubernetes runs an Indexed Job's pods in parallel, and the
shards meet at their wall-clock start.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jinja2

from rooflib.core import conf, fileio
from rooflib.core.errors import UsageError

TEMPLATE = conf.TOOLBOX_DIR / "k8s" / "bench-job.yaml.j2"
RESULTS = "/results"
INDEX = "$(JOB_COMPLETION_INDEX)"
# A Job's name becomes its pods' label value and hostname prefix: a DNS label, kept short enough
# for the index Kubernetes appends to its pods' names.
NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")
# A Secret's or a claim's name: a DNS subdomain (dots allowed, up to 253 characters).
SUBDOMAIN = re.compile(r"[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class JobSpec:
    """What the manifest says: the Job, the image and how bench runs in it, the shards and their
    start, the server, where the key and the results are."""
    name: str
    namespace: str | None
    image: str
    bench_path: str
    shards: int
    start_at: str  # ISO 8601 UTC, as --start-at takes it
    url: str
    bench_flags: tuple[str, ...]  # the workload, as bench's flags (bench_options.as_flags)
    secret: str | None            # the Secret that holds the API key, and the key's name in it
    secret_key: str
    claim: str
    cpu: str


def parse_secret(text: str) -> tuple[str | None, str]:
    """--api-key-secret NAME or NAME:KEY (the key in the Secret, INFER_API_KEY by default)."""
    name, _, key = text.partition(":")
    if not name:
        return None, "INFER_API_KEY"
    if not SUBDOMAIN.fullmatch(name) or (key and not re.fullmatch(r"[-._a-zA-Z0-9]+", key)):
        raise UsageError(f"--api-key-secret takes a Secret's name, optionally :KEY (roofline-bench:api-key), got {text!r}")
    return name, key or "INFER_API_KEY"


def check_name(name: str, what: str, pattern: re.Pattern = NAME) -> str:
    """A Kubernetes name as `pattern` allows it (a short DNS label by default), else a UsageError."""
    if not pattern.fullmatch(name):
        allowed = "'-' and '.'" if pattern is SUBDOMAIN else "'-', at most 52 characters"
        raise UsageError(f"{what} {name!r} must be lower-case letters, digits, {allowed} (a Kubernetes name)")
    return name


def bench_args(spec: JobSpec) -> list[str]:
    """The container's arguments: the server, the shard and its start, where its files go, the workload."""
    folder = f"{RESULTS}/{spec.name}"
    return ["--url", spec.url, "--shard", f"{INDEX}/{spec.shards}", "--start-at", spec.start_at,
            "--records", f"{folder}/shard-{INDEX}.records.jsonl", "--json-out", f"{folder}/shard-{INDEX}.json",
            *spec.bench_flags]


def render(spec: JobSpec) -> str:
    """The manifest's YAML, checked to read back as the Job it describes."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)), autoescape=False,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    args = bench_args(spec)
    text = env.get_template(TEMPLATE.name).render(
        name=spec.name, namespace=spec.namespace, image=spec.image, shards=spec.shards,
        command=["python3", spec.bench_path], args=args, secret=spec.secret, secret_key=spec.secret_key,
        claim=spec.claim, cpu=spec.cpu)
    job = fileio.load_yaml(text, "the rendered Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    if container["args"] != args or job["spec"]["completions"] != spec.shards:
        raise UsageError(f"the template {TEMPLATE} does not render the Job's arguments as given: restore it")
    return text


def summary(spec: JobSpec) -> dict[str, Any]:
    """What the rendered Job runs, for --json and the human lines."""
    return {"kind": "bench-job", "schema_version": 1, "name": spec.name, "namespace": spec.namespace,
            "shards": spec.shards, "start_at": spec.start_at, "url": spec.url, "image": spec.image,
            "results": f"{RESULTS}/{spec.name}", "claim": spec.claim, "api_key_secret": spec.secret,
            "bench_args": bench_args(spec)}
