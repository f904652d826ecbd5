"""bench_job.py (task bench-job): the Kubernetes Indexed Job that runs bench as N shards.

The rendered manifest is validated offline against the Kubernetes API's JSON schemas, strict (no
unknown field), with jsonschema: the schemas ship inside the kubernetes-validate package (the test
extra), for every Kubernetes release it covers; backoffLimitPerIndex, the field that keeps one
failed shard from stopping the others, is in them from 1.28 (beta, on by default, from 1.29).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import bench_job
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from rooflib.core import conf
from rooflib.load import bench_options, shards

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-0123456789-secret"
JOB = ["--image", "registry.example/roofline:1", "--shards", "4", "--url", "http://vllm.llm.svc:8000",
       "--results-claim", "bench-results", "-n", "2000", "-c", "64", "--input-tokens", "512",
       "--output-tokens", "128", "--slo-ttft-p95-ms", "500", "--workers", "2"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No setting of the machine that runs the tests reaches the manifest."""
    monkeypatch.chdir(tmp_path)
    for name in ("INFER_URL", "INFER_MODEL", "INFER_API_KEY", "ROOFLINE_TASK_API_KEY", "BENCH_N", "BENCH_C",
                 "BENCH_IN", "BENCH_OUT", "SLO_TTFT_P95_MS", "SLO_TPOT_P95_MS", "BENCH_LOG", "PROMETHEUS"):
        monkeypatch.delenv(name, raising=False)


def render(capsys, *argv: str) -> tuple[int, dict]:
    code = bench_job.main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def validate(job: dict) -> None:
    for version in ("1.29", "1.33", latest_version()):
        kubernetes_validate.validate(job, version, strict=True)


def test_the_job_is_a_valid_indexed_job_of_n_shards(capsys):
    code, doc = render(capsys, *JOB, "--api-key-secret", "llm-key:token", "--namespace", "llm")
    assert code == 0
    job = yaml.safe_load(doc["manifest"])
    validate(job)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimitPerIndex"]) == \
        ("Indexed", 4, 4, 0)
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    assert pod["restartPolicy"] == "Never" and job["metadata"]["namespace"] == "llm"
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert env["INFER_API_KEY"] == {"secretKeyRef": {"name": "llm-key", "key": "token"}}
    assert env["JOB_COMPLETION_INDEX"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    args = container["args"]
    assert args[:4] == ["--url", "http://vllm.llm.svc:8000", "--shard", "$(JOB_COMPLETION_INDEX)/4"]
    assert args[args.index("--json-out") + 1] == "/results/roofline-bench/shard-$(JOB_COMPLETION_INDEX).json"
    assert container["resources"]["requests"]["cpu"] == "2"  # one core per client process
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "bench-results"


def test_a_pod_runs_the_workload_the_job_was_rendered_for(capsys):
    """The pod's arguments, with its index, read back as the options the render read, split as
    each shard will split them."""
    code, doc = render(capsys, *JOB, "--extra-body", '{"top_k": 1}', "--rate", "50")
    assert code == 0
    args = yaml.safe_load(doc["manifest"])["spec"]["template"]["spec"]["containers"][0]["args"]
    pod = [a.replace("$(JOB_COMPLETION_INDEX)", "3") for a in args]
    parsed = bench_options.build_parser(sharded=True).parse_args(pod)
    options = bench_options.make_options(parsed, conf.settings_from_args(parsed))
    asked = bench_options.build_parser(sharded=True).parse_args([*JOB[JOB.index("-n"):], "--extra-body", '{"top_k": 1}',
                                                            "--rate", "50"])
    expected = bench_options.read_options(asked, conf.settings_from_args(asked))
    assert options.shard == shards.Shard(3, 4) and options.records.endswith("/shard-3.records.jsonl")
    assert options == expected.__class__(**{**vars(expected), "shard": options.shard, "start_at": options.start_at,
                                            "records": options.records})
    assert abs(options.start_at - shards.parse_start_at(doc["start_at"], options.start_at)) < 1e-3


def test_the_api_key_stays_in_its_secret(capsys, monkeypatch):
    monkeypatch.setenv("INFER_API_KEY", KEY)
    assert bench_job.main(JOB) == 2
    err = capsys.readouterr().err
    assert "--api-key-secret" in err and KEY not in err and err.count("\n") == 1
    code, doc = render(capsys, *JOB, "--api-key-secret", "llm-key")
    assert code == 0 and KEY not in json.dumps(doc)
    assert bench_job.main([*JOB, "--api-key-secret", "llm-key"]) == 0
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err and "secretKeyRef" in captured.out


@pytest.mark.parametrize("extra, message", [
    (["--log", "bench-log.md"], "--log (BENCH_LOG) is not for the Job's pods"),
    (["--records", "r.jsonl"], "--records is not for the Job's pods"),
    (["--prometheus", "http://prom:9090"], "--prometheus (PROMETHEUS) is not for the Job's pods"),
    (["--shard", "0/4", "--start-at", f"{time.time() + 3600:.0f}"], "--shard is not for the Job's pods"),
    (["-c", "3"], "each shard needs at least one stream"),
    (["-c", "4", "--workers", "2"], "--workers 2 exceeds the concurrency 1 of this shard"),
    (["--job-name", "Bench_Run"], "--job-name 'Bench_Run' must be lower-case"),
    (["--api-key-secret", "a b"], "--api-key-secret takes a Secret's name"),
    (["--shards", "0"], "--shards (SHARDS) must be between 1 and 1024"),
    (["--start-at", "1700000000"], "has passed: the pods would start at once"),
])
def test_what_a_job_cannot_run_is_a_one_line_error(extra, message, capsys):
    assert bench_job.main([*JOB, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_without_a_url_or_an_image_it_says_what_to_give(capsys):
    no_url = [a for i, a in enumerate(JOB) if a != "--url" and JOB[i - 1] != "--url"]
    assert bench_job.main(no_url) == 2
    assert "the server as the pods reach it" in capsys.readouterr().err
    assert bench_job.main(JOB[2:]) == 2
    assert "--image (IMAGE), --shards (SHARDS) and --results-claim (RESULTS_CLAIM) are needed" in capsys.readouterr().err


def test_a_hostile_value_stays_one_value(capsys):
    """tojson: a value with quotes, colons, a hash or a line break cannot add a key to the YAML."""
    body = '{"stop": ["\\n", "#: x"], "x": "a\\"b: c\\n- d"}'
    code, doc = render(capsys, *JOB, "--extra-body", body, "--image", "reg.example/a:1 # b: c", "--model", "m: {x}")
    assert code == 0
    job = yaml.safe_load(doc["manifest"])
    validate(job)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg.example/a:1 # b: c"
    args = container["args"]
    assert json.loads(args[args.index("--extra-body") + 1]) == json.loads(body)
    assert args[args.index("--model") + 1] == "m: {x}"


def test_the_schema_check_catches_what_a_cluster_would_refuse(capsys):
    """The validation is not vacuous: a misspelt field or a wrong type fails it."""
    job = yaml.safe_load(render(capsys, *JOB)[1]["manifest"])
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "4"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, "1.33", strict=True)


def test_task_bench_job_writes_the_manifest(task, tmp_path):
    out = tmp_path / "job.yaml"
    result = subprocess.run([task, "-t", str(REPO / "skills" / "roofline-toolbox" / "Taskfile.yml"), "bench-job",
                             "IMAGE=registry.example/roofline:1", "SHARDS=2", "INFER_URL=http://vllm.llm.svc:8000",
                             "RESULTS_CLAIM=bench-results", "BENCH_N=100", "BENCH_C=8", "START_IN=300", "--",
                             "--out", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(out.read_text())
    validate(job)
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("-n") + 1] == "100" and args[args.index("-c") + 1] == "8"
