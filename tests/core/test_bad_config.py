"""Bad configuration, for every script that reads it: one line on stderr, exit 2, no traceback,
and nothing sent anywhere. Settings are read inside the common error handling everywhere."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

import accept
import bench
import metrics
import ppl
import serve
import smoke_toolcall
import sweep
from as_a_user import as_a_user
from fault_server import NAN_METRICS, refused_url

MAINS = {"bench": bench.main, "sweep": sweep.main, "metrics": metrics.main, "ppl": ppl.main,
         "smoke_toolcall": smoke_toolcall.main, "accept": accept.main}


def base_args(script: str, tmp_path) -> list[str]:
    text = tmp_path / "text.txt"
    text.write_text("some words to score", encoding="utf-8")
    url = refused_url()  # nothing must be sent: a config error comes first
    return {"accept": ["--base", url, "--candidate", url, "--text", str(text)],
            "ppl": ["--url", url, "--text", str(text)]}.get(script, ["--url", url])


def run(main, argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: a bad flag value
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def one_error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


ENV_FILES = {
    "malformed line": b"INFER_URL=http://127.0.0.1:1\nthis is not a setting\n",
    "not UTF-8": b"INFER_URL=\xff\xfe\x00bad\n",
    "a directory": None,
}


@pytest.mark.parametrize("script", sorted(MAINS))
@pytest.mark.parametrize("problem", sorted(ENV_FILES))
def test_a_bad_inference_env_is_one_line_and_exit_2(script, problem, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFER_ENV_FILE", raising=False)
    env = tmp_path / "inference.env"
    if ENV_FILES[problem] is None:
        env.mkdir()
    else:
        env.write_bytes(ENV_FILES[problem])
    code, err = run(MAINS[script], base_args(script, tmp_path), capsys)
    assert code == 2 and "inference.env" in one_error_line(err)


@pytest.mark.parametrize("script", sorted(MAINS))
@pytest.mark.parametrize("value", ["nan", "-1", "1e309", "inf", "0", "soon"])
def test_a_bad_timeout_is_one_line_and_exit_2(script, value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run(MAINS[script], [*base_args(script, tmp_path), "--timeout", value], capsys)
    assert code == 2 and "--timeout" in err


@pytest.mark.parametrize("script", ["bench", "sweep", "metrics", "ppl", "smoke_toolcall"])
def test_a_bad_url_is_one_line_and_exit_2(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INFER_URL", "ftp://nowhere")
    args = [a for a in base_args(script, tmp_path)]
    del args[args.index("--url"):args.index("--url") + 2]
    code, err = run(MAINS[script], args, capsys)
    assert code == 2 and "ftp://nowhere" in one_error_line(err)


def test_ppl_block_0_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run(ppl.main, [*base_args("ppl", tmp_path), "--block", "0"], capsys)
    assert code == 2 and "--block" in one_error_line(err)


@pytest.mark.parametrize("path", ["/dev/zero", "."])
def test_an_endless_or_directory_text_is_one_line_and_exit_2(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run(ppl.main, ["--url", refused_url(), "--text", path], capsys)
    assert code == 2 and "TEXT" in one_error_line(err)


@pytest.mark.parametrize("content", [b"\x00\x01\xff\xfe binary", b"engine: vllm\nmodel: m\nenv: &a {A: 1}\nx: *a\n",
                                     b"x" * (2 << 20)], ids=["binary", "alias", "too large"])
def test_a_bad_profile_is_one_line_and_exit_2(content, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    profile = tmp_path / "bad.yaml"
    profile.write_bytes(content)
    code, err = run(serve.main, ["--profile", str(profile), "--dry-run"], capsys)
    assert code == 2 and "profile" in one_error_line(err)


def test_dry_run_prints_every_value_shell_quoted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    profile = tmp_path / "p.yaml"
    hostile = "$(touch PWNED); `id` 'q' \"dq\""
    profile.write_text(f"engine: vllm\nmodel: m\nenv:\n  VLLM_X: {json.dumps(hostile)}\n", encoding="utf-8")
    assert serve.main(["--profile", str(profile), "--dry-run"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert shlex.split(line)[0] == f"VLLM_X={hostile}"
    profile.write_text("engine: vllm\nmodel: m\nenv:\n  'A;id': x\n", encoding="utf-8")
    code, err = run(serve.main, ["--profile", str(profile), "--dry-run"], capsys)
    assert code == 2 and "not an environment variable name" in one_error_line(err)


def test_nan_in_a_scrape_is_never_printed_as_nan(tmp_path, capsys):
    scrape = tmp_path / "scrape.txt"
    scrape.write_text(NAN_METRICS, encoding="utf-8")
    assert metrics.main(["--file", str(scrape)]) == 0
    human = capsys.readouterr().out
    assert "NaN or Inf" in human
    assert "nan" not in human.replace("NaN or Inf", "").lower().split()  # no figure printed as nan
    assert metrics.main(["--file", str(scrape), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # strict JSON: a bare NaN would not parse the same
    assert any("NaN or Inf" in w for w in result["warnings"])


def run_bench_as_a_user(argv: list[str], cwd) -> tuple[int, str]:
    """bench in a process that writes as a user does, root or not (tests/as_a_user.py)."""
    done = subprocess.run(as_a_user([sys.executable, bench.__file__, *argv]), capture_output=True, text=True, cwd=cwd, timeout=120)
    assert "Traceback" not in done.stderr
    return done.returncode, done.stderr


@pytest.mark.parametrize("target", ["directory", "read-only file", "parent is a file"])
def test_an_unwritable_output_path_is_refused_before_the_run(target, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "out"
    if target == "directory":
        path.mkdir()
    elif target == "read-only file":
        path.write_text("old")
        path.chmod(0o444)
    else:
        path.write_text("a file")
        path = path / "log.md"
    for flag in ("--records", "--log"):
        argv = ["--url", refused_url(), flag, str(path)]
        code, err = run_bench_as_a_user(argv, tmp_path) if target == "read-only file" else run(bench.main, argv, capsys)
        assert code == 2 and flag in one_error_line(err) and "cannot reach" not in err
    if target == "read-only file":
        assert path.read_text() == "old"
