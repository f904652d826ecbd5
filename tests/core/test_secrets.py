"""The API key is never written, whichever way it reaches a script.

A distinctive key is set as INFER_API_KEY (or only as a task argument, only in an env file, only
in a serve profile) and handed back to each script every way a value reaches one: a task
variable that go-task expands (`MODEL={{.INFER_API_KEY}}`, through the real `task`), a flag, a
profile field, an env-file line, a result file, and a fake server (tests/fault_server.py) that
echoes the Authorization header in its error bodies and as the served model's name. Each row
runs a fresh process (the secrets a process knows are its own); its stdout, stderr and every file
it wrote under the test's folder (records, logs, reports, JSON, caches) are scanned for the key
and its JSON-escaped form, and the row names the text that must stand where the key was: `***`
in place of the key, so a row whose key never reached an output fails.

Also: every command line's `main` goes through cli.entry (argparse errors are redacted); a key
too short to mask (redaction.MIN_MASKED_CHARS) leaves the output whole but is still hidden where it is
known to be a key (a profile's); a key that JSON escapes differently; a traceback.
"""
from __future__ import annotations

import ast
import json
import os
import secrets
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_server import FAULTS, fault_server

from rooflib.core import cli, printing, redaction

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TOOLBOX = ROOT / "roofline-toolbox" / "Taskfile.yml"
KEY = f"sk-roofline-test-{secrets.token_hex(12)}"
TEXT = " ".join(f"w{i % 7} word{i % 5} text" for i in range(16))
RUN_TIMEOUT_S = 300  # far above any run here; only a hang reaches it


@dataclass(frozen=True)
class Row:
    argv: tuple[str, ...]  # a script and its arguments, or ("task", task, VAR=value, ...): {key} {url} {inputs}
    shows: str | tuple[str, ...]  # what must stand where the key was (one of these)
    server: str = ""  # the fake server's fault (a FAULTS name, or "healthy"); {url} is its address
    key_from: str = "environment"  # also: task argument, inference.env, --env-file, INFER_ENV_FILE, profile
    settings: str = ""  # more lines of the env file


LOAD = ("-n", "2", "-c", "2", "--warmup", "0", "--input-tokens", "32", "--output-tokens", "4", "--timeout", "30")
PPL = ("--text", "{inputs}/text.txt", "--window", "8", "--stride", "4", "--timeout", "30")
ACCEPT = ("--text", "{inputs}/text.txt", "--window", "8", "--stride", "4", "--repeat", "1", "--skip-bench",
          "--timeout", "30")

ROWS: dict[str, Row] = {
    # vram: the issue's own example first
    "vram/task": Row(("task", "vram", "MODEL={{.INFER_API_KEY}}", "GPU=h100"), "unknown model '***'"),
    "vram/task-argument": Row(("task", "vram", "INFER_API_KEY={key}", "MODEL={{.INFER_API_KEY}}", "GPU=h100"),
                              "unknown model '***'", key_from="task argument"),
    "vram/flag": Row(("vram", "--model", "llama-3.1-8b", "--platform", "{key}"), "invalid choice: '***'"),
    "vram/inference.env": Row(("vram", "--json"), "unknown model '***'", key_from="inference.env",
                              settings="MODEL={key}\nGPU=h100"),
    "vram/server-model-name": Row(("vram", "--url", "{url}", "--gpu", "h100"), "cannot size ***",
                                  server="key_as_model_name"),
    "vram/server-error": Row(("vram", "--url", "{url}", "--gpu", "h100"), "Bearer ***",
                             server="http_401_echoing_the_key"),
    # roofline
    "roofline/task": Row(("task", "roofline", "MODEL={{.INFER_API_KEY}}", "GPU=h100"), "unknown model '***'"),
    "roofline/flag": Row(("roofline", "--model", "llama-3.1-8b", "--gpu", "h100", "--batch", "{key}"),
                         "BATCH must be a whole number, got '***'"),
    "roofline/INFER_ENV_FILE": Row(("roofline", "--model", "llama-3.1-8b"), "unknown GPU '***'",
                                   key_from="INFER_ENV_FILE", settings="GPU={key}"),
    # bench
    "bench/task": Row(("task", "bench", "INFER_URL={url}", "INFER_MODEL={{.INFER_API_KEY}}", "BENCH_N=2"),
                      "model '***' is not served", server="healthy"),
    "bench/flag": Row(("bench", "--url", "{url}", "--timeout", "{key}"), "got '***'"),
    "bench/--env-file": Row(("bench", "--env-file={inputs}/keys.env", "--url", "{url}", *LOAD),
                            "model '***' is not served", server="healthy", key_from="--env-file",
                            settings="INFER_MODEL={key}"),
    "bench/server-model-name": Row(("bench", "--url", "{url}", *LOAD, "--records", "records.jsonl",
                                    "--log", "log.md", "--json"), '"model": "***"', server="key_as_model_name"),
    "bench/server-error": Row(("bench", "--url", "{url}", *LOAD, "--records", "records.jsonl", "--json"),
                              "Bearer ***", server="http_401_on_work_echoing_the_key"),
    # sweep
    "sweep/task": Row(("task", "sweep", "INFER_URL={url}", "INFER_MODEL={{.INFER_API_KEY}}", "SWEEP_C=1",
                       "BENCH_N=1"), "model '***' is not served", server="healthy"),
    "sweep/flag": Row(("sweep", "--url", "{url}", "--sweep-c", "{key}"), "got '***'"),
    "sweep/inference.env": Row(("sweep", "--url", "{url}"), "got '***'", key_from="inference.env",
                               settings="SWEEP_C={key}"),
    "sweep/server-model-name": Row(("sweep", "--url", "{url}", "--sweep-c", "2", *LOAD[:2], *LOAD[4:], "--log",
                                    "log.md", "--json"), "- Model: ***", server="key_as_model_name"),
    # metrics
    "metrics/task": Row(("task", "metrics", "GPU={{.INFER_API_KEY}}"), "unknown GPU '***'"),
    "metrics/flag": Row(("metrics", "--count", "{key}"), "invalid int value: '***'"),
    "metrics/inference.env": Row(("metrics",), "unknown GPU '***'", key_from="inference.env", settings="GPU={key}"),
    "metrics/server-model-name": Row(("metrics", "--url", "{url}", "--json"), '"models": [\n    "***"',
                                     server="key_as_model_name"),
    "metrics/server-error": Row(("metrics", "--url", "{url}"), "Bearer ***", server="http_401_echoing_the_key"),
    # ppl
    "ppl/task": Row(("task", "ppl", "INFER_URL={url}", "TEXT={{.INFER_API_KEY}}"), "cannot read TEXT ***",
                    server="healthy"),
    "ppl/flag": Row(("ppl", "--url", "{url}", *PPL, "--model", "{key}"), "model '***' is not served",
                    server="healthy"),
    "ppl/inference.env": Row(("ppl", "--url", "{url}", *PPL), "model '***' is not served", server="healthy",
                             key_from="inference.env", settings="INFER_MODEL={key}"),
    "ppl/server-model-name": Row(("ppl", "--url", "{url}", *PPL, "--json"), '"model": "***"',
                                 server="key_as_model_name"),
    "ppl/server-error": Row(("ppl", "--url", "{url}", *PPL), "Bearer ***", server="http_500_echoing_the_key"),
    # smoke_toolcall
    "smoke_toolcall/task": Row(("task", "smoke-toolcall", "INFER_URL={url}", "INFER_MODEL={{.INFER_API_KEY}}"),
                               "model '***' is not served", server="healthy"),
    "smoke_toolcall/flag": Row(("smoke_toolcall", "--url", "{url}", "--cases", "{key}"), "unknown case '***'"),
    "smoke_toolcall/INFER_ENV_FILE": Row(("smoke_toolcall", "--url", "{url}"), "model '***' is not served",
                                         server="healthy", key_from="INFER_ENV_FILE", settings="INFER_MODEL={key}"),
    "smoke_toolcall/server-model-name": Row(("smoke_toolcall", "--url", "{url}", "--repeat", "1", "--cases",
                                             "single_auto", "--json"), '"model": "***"', server="key_as_model_name"),
    "smoke_toolcall/server-error": Row(("smoke_toolcall", "--url", "{url}", "--repeat", "1"), "Bearer ***",
                                       server="http_401_echoing_the_key"),
    # accept
    "accept/task": Row(("task", "accept", "BASE={{.INFER_API_KEY}}", "CANDIDATE={url}", "TEXT={inputs}/text.txt"),
                       "unknown profile '***'"),
    "accept/flag": Row(("accept", "--base", "{url}", "--candidate", "{url}", *ACCEPT, "--scheme", "{key}"),
                       "unknown quantization scheme '***'"),
    "accept/profile": Row(("accept", "--base", "{inputs}/profile.yaml", "--candidate", "{url}", *ACCEPT,
                           "--start-timeout", "120"), ("--api-key ***", "--api-key '***'"), server="healthy",
                          key_from="profile"),
    "accept/--env-file": Row(("accept", "--env-file", "{inputs}/keys.env", "--candidate", "{url}", *ACCEPT),
                             "unknown profile '***'", key_from="--env-file", settings="BASE={key}"),
    "accept/server-model-name": Row(("accept", "--base", "{url}", "--candidate", "{url}", *ACCEPT, "--log",
                                     "log.md", "--json"), ", model ***", server="key_as_model_name"),
    "accept/server-error": Row(("accept", "--base", "{url}", "--candidate", "{url}", *ACCEPT, "--log", "log.md"),
                               "Bearer ***", server="http_401_on_work_echoing_the_key"),
    # serve: the profile's key is an engine setting (env VLLM_API_KEY, extra_args --api-key)
    "serve/task": Row(("task", "serve", "INFER_PROFILE={{.INFER_API_KEY}}", "--", "--dry-run"),
                      "unknown profile '***'"),
    "serve/flag": Row(("serve", "--profile", "cpu-tiny", "--set", "served_model_name={key}", "--dry-run"),
                      "--served-model-name ***"),
    "serve/profile": Row(("serve", "--profile", "{inputs}/profile.yaml", "--dry-run"), "VLLM_API_KEY='***'",
                         key_from="profile"),
    "serve/profile-json": Row(("serve", "--profile", "{inputs}/profile.yaml", "--dry-run", "--json"),
                              '"VLLM_API_KEY": "***"', key_from="profile"),
    "serve/inference.env": Row(("serve", "--dry-run"), "unknown profile '***'", key_from="inference.env",
                               settings="INFER_PROFILE={key}"),
    # report and compare: result files that hold the key (as bench's model name)
    "report/task": Row(("task", "report", "REPORT_FORMAT={{.INFER_API_KEY}}", "--", "{inputs}/bench.json"),
                       "invalid choice: '***'"),
    "report/flag": Row(("report", "{inputs}/bench.json", "--format", "text", "--records", "{key}"),
                       "cannot read records ***"),
    "report/file": Row(("report", "{inputs}/bench.json", "--records", "{inputs}/records.jsonl", "--out",
                        "report.html"), "server *** at http"),
    "report/inference.env": Row(("report", "{inputs}/bench.json", "--format", "text"), "*** at http",
                                key_from="inference.env"),
    "compare/task": Row(("task", "compare", "A={{.INFER_API_KEY}}", "B={inputs}/bench.json"), "*** does not exist"),
    "compare/flag": Row(("compare", "{inputs}/bench.json", "{inputs}/bench.json", "--label-a", "{key}"), "A: ***"),
    "compare/file": Row(("compare", "{inputs}/bench.json", "{inputs}/bench.json", "--json"), "*** @ http"),
    "compare/inference.env": Row(("compare", "{inputs}/bench.json", "{inputs}/bench.json"), "*** @ http",
                                 key_from="inference.env"),
}


def clean_env(tmp: Path) -> dict[str, str]:
    """The environment of a run: no setting of the developer's, caches and temporary files under
    the test's folder (so that they are scanned too)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFER_", "PROMETHEUS_", "ROOFLINE_TASK_")) and k != "HF_TOKEN"}
    for folder in ("cache", "tmp"):
        (tmp / folder).mkdir(exist_ok=True)
    return env | {"ROOFLINE_CACHE_DIR": str(tmp / "cache"), "TMPDIR": str(tmp / "tmp"), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def saved_bench(tmp_path_factory) -> tuple[str, str]:
    """A bench result with the key as the model's name (a file saved before the key was known, or
    edited by hand), and its records."""
    tmp = tmp_path_factory.mktemp("saved")
    with fault_server() as url:
        done = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--url", url, *LOAD, "--records",
                               str(tmp / "records.jsonl"), "--json"], cwd=tmp, env=clean_env(tmp),
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode in (0, 4), done.stderr[-500:]  # 4: a busy client, still a result
    result = json.loads(done.stdout)
    assert result["config"]["model"] == "fake-model"
    return done.stdout.replace("fake-model", KEY), (tmp / "records.jsonl").read_text()


def write_inputs(inputs: Path, row: Row, saved_bench: tuple[str, str]) -> None:
    """What a row reads: the text, result files, a profile and an env file (none of it scanned)."""
    inputs.mkdir()
    (inputs / "text.txt").write_text(TEXT, encoding="utf-8")
    (inputs / "bench.json").write_text(saved_bench[0], encoding="utf-8")
    (inputs / "records.jsonl").write_text(saved_bench[1], encoding="utf-8")
    # An engine that logs its arguments (as vLLM logs its non-default args) and dies while starting.
    engine = inputs / "engine"
    engine.write_text("#!/bin/sh\necho \"engine args: $*\"\nexit 1\n", encoding="utf-8")
    engine.chmod(0o755)
    (inputs / "profile.yaml").write_text(textwrap.dedent(f"""\
        engine: vllm
        model: some-org/some-model
        python: {engine}
        env:
          VLLM_API_KEY: {KEY}
        extra_args: ["--api-key", "{KEY}"]
        """), encoding="utf-8")
    (inputs / "keys.env").write_text(f"INFER_API_KEY={KEY}\n{row.settings.format(key=KEY)}\n", encoding="utf-8")


def command(row: Row, task_path: str | None, url: str, inputs: Path) -> list[str]:
    argv = [part.format(key=KEY, url=url, inputs=inputs) if "{{" not in part else part for part in row.argv]
    if argv[0] == "task":
        assert task_path, "a task row needs go-task"
        return [task_path, "-t", str(TOOLBOX), argv[1], f"PYTHON={sys.executable}", *argv[2:]]
    return [sys.executable, str(SCRIPTS / f"{argv[0]}.py"), *argv[1:]]


def outputs(tmp: Path, given: set[Path], out: str, err: str) -> dict[str, str]:
    """Everything the run wrote: stdout, stderr, and each file under the test's folder but those
    the test gave it."""
    files = {str(path.relative_to(tmp)): path.read_text(encoding="utf-8", errors="replace")
             for path in sorted(tmp.rglob("*")) if path.is_file() and path not in given}
    return {"stdout": out, "stderr": err, **files}


def leaks(texts: dict[str, str]) -> list[str]:
    forms = {KEY, json.dumps(KEY)[1:-1]}  # as is, and inside a JSON string
    return [where for where, text in texts.items() if any(form in text for form in forms)]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_the_key_is_never_written(name, tmp_path, saved_bench, request):
    row = ROWS[name]
    task_path = request.getfixturevalue("task") if row.argv[0] == "task" else None
    inputs, run_dir = tmp_path / "inputs", tmp_path / "run"
    write_inputs(inputs, row, saved_bench)
    run_dir.mkdir()
    env = clean_env(tmp_path)
    if row.key_from == "environment":
        env["INFER_API_KEY"] = KEY
    elif row.key_from == "inference.env":
        (run_dir / "inference.env").write_text((inputs / "keys.env").read_text(), encoding="utf-8")
    elif row.key_from == "INFER_ENV_FILE":
        env["INFER_ENV_FILE"] = str(inputs / "keys.env")
    given = set(inputs.rglob("*")) | {run_dir / "inference.env"}
    with fault_server(FAULTS.get(row.server)) if row.server else nullcontext("http://127.0.0.1:9") as url:
        done = subprocess.run(command(row, task_path, url, inputs), cwd=run_dir, env=env, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S)
    texts = outputs(tmp_path, given, done.stdout, done.stderr)
    assert not leaks(texts), f"the key is in {leaks(texts)}"
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    # The key reached an output, masked: else this row proves nothing.
    shows = (row.shows,) if isinstance(row.shows, str) else row.shows
    assert any(marker in text for marker in shows for text in texts.values()), \
        f"{row.shows!r} not in the output (exit {done.returncode}): {done.stderr[-800:]}"


# ---------------------------------------------------------------- every script, from its first line

def command_lines() -> list[str]:
    """The scripts run as programs. tiny_model.py is left out: it builds the test models in the
    engine's Python, without the toolbox's dependencies, and reads no setting."""
    return sorted(path.stem for path in SCRIPTS.glob("*.py")
                  if '__name__ == "__main__"' in path.read_text(encoding="utf-8") and path.stem != "tiny_model")


@pytest.mark.parametrize("script", command_lines())
def test_main_goes_through_the_entry_wrapper(script):
    tree = ast.parse((SCRIPTS / f"{script}.py").read_text(encoding="utf-8"))
    (main,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    assert [ast.unparse(d) for d in main.decorator_list] == ["cli.entry"], \
        f"{script}.main must be decorated with @cli.entry: its secrets are registered before its arguments are read"


@pytest.mark.parametrize("script", command_lines())
def test_a_usage_error_quoting_the_key_is_redacted(script, tmp_path):
    """argparse's own error, before the script's body runs, with the key known from the
    environment only: the marker proves the value was quoted."""
    env = clean_env(tmp_path) | {"INFER_API_KEY": KEY}
    argv = [f"--no-such-flag={KEY}", "a.json", "b.json"]  # compare needs its two files first
    done = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 2 and KEY not in done.stdout + done.stderr
    assert "unrecognized arguments: --no-such-flag=***" in done.stderr, done.stderr


def test_without_the_key_known_it_is_printed(tmp_path):
    """The control of the rows above: the same error with no key set prints the value as is."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "vram.py"), "--model", KEY, "--gpu", "h100"], cwd=tmp_path,
                          env=clean_env(tmp_path), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 2 and f"unknown model '{KEY}'" in done.stderr


def test_a_traceback_is_redacted(tmp_path):
    """A bug's traceback, printed after main has returned its streams, is redacted too."""
    program = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); from rooflib.core import cli\n"
               "@cli.entry\n"
               "def main(argv=None):\n"
               "    raise RuntimeError('a bug that quotes ' + sys.argv[1])\n"
               "main()\n")
    done = subprocess.run([sys.executable, "-c", program, KEY], cwd=tmp_path,
                          env=clean_env(tmp_path) | {"INFER_API_KEY": KEY}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert "RuntimeError: a bug that quotes ***" in done.stderr and KEY not in done.stderr


# ---------------------------------------------------------------- short keys, escaped keys

def test_a_key_too_short_to_mask_leaves_the_output_whole(tmp_path):
    """A one-character key would turn every 1 in the JSON into *** if it were masked as text."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "roofline.py"), "--model", "llama-3.1-8b", "--gpu", "h100",
                           "--json"], cwd=tmp_path, env=clean_env(tmp_path) | {"INFER_API_KEY": "1"},
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "roofline" and "***" not in done.stdout


def test_a_short_key_in_a_url_is_not_taken_for_the_key(tmp_path):
    """`127` is in the URL; too short to look for, so the run goes on (and finds nothing there)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--url", "http://127.0.0.1:9", "-n", "1",
                           "--timeout", "5"], cwd=tmp_path, env=clean_env(tmp_path) | {"INFER_API_KEY": "127"},
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 3 and "contains the API key" not in done.stderr, done.stderr


def test_a_short_profile_key_is_still_hidden_where_it_is_a_key(tmp_path):
    short = "Zq7"
    assert len(short) < redaction.MIN_MASKED_CHARS
    profile = tmp_path / "short.yaml"
    profile.write_text(f"engine: vllm\nmodel: m\nenv:\n  VLLM_API_KEY: {short}\n  TOKENIZERS_PARALLELISM: 'false'\n"
                       f"extra_args: ['--api-key={short}']\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(SCRIPTS / "serve.py"), "--profile", str(profile), "--dry-run"],
                          cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert "VLLM_API_KEY='***'" in done.stdout and "'--api-key=***'" in done.stdout and short not in done.stdout
    assert "TOKENIZERS_PARALLELISM=false" in done.stdout  # a setting whose name only contains TOKEN


def test_a_key_is_masked_in_its_json_and_repr_forms(capsys):
    key = 'sk-"quoted"\\back\u00e9-0123456789'
    redaction.add_secret(key)

    def body() -> int:
        printing.emit({"model": key}, "", printing.Output(json=True))
        print(f"error: unknown model {key!r}", file=sys.stderr)
        print(json.dumps({"model": key}), file=sys.stderr)
        return 0

    assert cli.run_main(body) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"model": "***"}
    assert err == "error: unknown model '***'\n" + '{"model": "***"}\n'
