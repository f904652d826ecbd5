"""rooflib.core (conf, cli, http_client, errors): settings precedence, inference.env parsing, URL checks, error mapping."""
from __future__ import annotations

import itertools
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from fault_server import Action, Request, fault_server

from rooflib.core import catalogs, cli, conf, http_client, printing, signals
from rooflib.core.errors import EXIT_OK, EXIT_OUTPUT, EXIT_SERVER, EXIT_USAGE, ServerError, UsageError
from rooflib.server import model_listing


def test_env_file_parsing_handles_comments_quotes_and_export():
    text = "# settings\nexport INFER_URL=http://h:8000  # trailing comment\nINFER_PROFILE='cpu tiny'\n\nX=\"a#b\"\nCMD=$(rm -rf /)\n"
    assert conf.parse_env_file(text) == {
        "INFER_URL": "http://h:8000", "INFER_PROFILE": "cpu tiny", "X": "a#b", "CMD": "$(rm -rf /)"}


def test_env_file_bad_line_names_the_line():
    with pytest.raises(UsageError, match="line 2 is not KEY=VALUE"):
        conf.parse_env_file("A=1\nnot a setting\n")


@pytest.mark.parametrize("flag, environ, env_file, expected, source", [
    ("http://arg", {"INFER_URL": "http://env"}, {"INFER_URL": "http://file"}, "http://arg", "argument"),
    ("", {"INFER_URL": "http://env"}, {"INFER_URL": "http://file"}, "http://env", "environment"),
    ("", {}, {"INFER_URL": "http://file"}, "http://file", "inference.env"),
    ("", {}, {}, "http://default", "default"),
])
def test_settings_precedence(flag, environ, env_file, expected, source):
    settings = conf.Settings(env_file, environ)
    assert settings.get("INFER_URL", flag, "http://default") == expected
    assert settings.source("INFER_URL", flag) == source


def test_inference_env_is_read_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFER_ENV_FILE", raising=False)
    assert conf.load_env_file() == {}
    (tmp_path / "inference.env").write_text("INFER_URL=http://from-file:9000\n")
    assert conf.load_env_file() == {"INFER_URL": "http://from-file:9000"}
    with pytest.raises(UsageError, match="does not exist"):
        conf.load_env_file(tmp_path / "missing.env")


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("https://api.example.com/v1", "https://api.example.com"),
])
def test_normalize_url(url, expected):
    assert conf.normalize_url(url) == expected


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://x", "", "http:// spaces"])
def test_normalize_url_rejects_non_http(url):
    with pytest.raises(UsageError, match="is not http"):
        conf.normalize_url(url)


def test_api_key_is_sent_and_never_printed(capsys):
    seen = {}

    def handler(request):
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(401, text="bad key sk-secret-123")

    http = http_client.client("http://srv", api_key="sk-secret-123", transport=httpx.MockTransport(handler))

    def body():
        http_client.get_json(http, "/v1/models")
        return 0

    assert cli.run_main(body, secret="sk-secret-123") == EXIT_SERVER
    assert seen["auth"] == "Bearer sk-secret-123"
    err = capsys.readouterr().err
    assert "sk-secret-123" not in err and "HTTP 401" in err


def test_task_argument_api_key_wins_over_environment(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INFER_API_KEY", "from-env")
    monkeypatch.setenv("ROOFLINE_TASK_API_KEY", "from-task")
    args = type("Args", (), {"url": "", "env_file": None})()
    assert conf.server_settings(args) == ("http://127.0.0.1:8000", "from-task")


@pytest.mark.parametrize("name, expected", [("H100 SXM", "h100-sxm"), ("h100sxm", "h100-sxm"), ("nvidia-h100", "h100-sxm")])
def test_find_in_catalog_by_id_or_alias(name, expected):
    catalog = {"h100-sxm": {"aliases": ["nvidia-h100"]}, "a100-80": {}}
    assert catalogs.find_in_catalog(catalog, name, "GPU")[0] == expected


def test_find_in_catalog_suggests_close_names():
    catalog = {"h100-sxm": {}, "h200": {}, "a100-80": {}}
    with pytest.raises(UsageError, match="unknown GPU 'h100-sx': did you mean h100-sxm"):
        catalogs.find_in_catalog(catalog, "h100-sx", "GPU")
    with pytest.raises(UsageError, match="nothing close; the nearest are "):
        catalogs.find_in_catalog(catalog, "tpu", "GPU")


def test_an_unknown_model_lists_the_five_nearest_not_the_catalog():
    with pytest.raises(UsageError) as caught:
        catalogs.find_in_catalog(catalogs.load_catalog("models"), "zzz", "model")
    names = str(caught.value).split("the nearest are ", 1)[1].split(", ")
    assert len(names) == 5 and all(name in catalogs.load_catalog("models") for name in names)


@pytest.mark.parametrize("listing, wanted, expected", [
    ({"data": [{"id": "a", "max_model_len": 4096}, {"id": "b"}]}, None, ("a", ["a", "b"])),
    ({"data": [{"id": "a"}, {"id": "b", "max_model_len": 8}]}, "b", ("b", ["a", "b"])),
])
def test_pick_model_chooses_the_wanted_or_first_entry(listing, wanted, expected):
    entry, names = model_listing.pick_model(listing, wanted, "http://h:8000")
    assert (entry["id"], names) == expected


@pytest.mark.parametrize("listing, wanted, error, message", [
    ({"data": []}, None, ServerError, "http://h:8000/v1/models lists no model: is the server still loading?"),
    ({"object": "list"}, "a", ServerError, "http://h:8000/v1/models lists no model"),
    ({"data": [{"id": "a"}, {"id": "b"}]}, "c", UsageError,
     "model 'c' is not served by http://h:8000: set INFER_MODEL (or --model) to one of a, b"),
])
def test_pick_model_errors_name_the_server_and_the_choices(listing, wanted, error, message):
    with pytest.raises(error) as caught:
        model_listing.pick_model(listing, wanted, "http://h:8000")
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--size", "big"], "error: argument --size: invalid int value: 'big' (see prog --help)"),
    (["--colour", "red"], "error: unrecognized arguments: --colour red (see prog --help)"),
    (["--sise", "3"], "error: unrecognized arguments: --sise 3; did you mean --size? (see prog --help)"),
    (["--kindd=a", "--sizz", "2"],
     "error: unrecognized arguments: --kindd=a --sizz 2; did you mean --kind, --size? (see prog --help)"),
    (["--kind", "x"], "error: argument --kind: invalid choice: 'x' (choose from 'a', 'b') (see prog --help)"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, message):
    p = cli.parser("Does a thing.\n\nExamples:\n  prog --size 3\n")
    p.prog = "prog"
    p.add_argument("--size", type=int)
    p.add_argument("--kind", choices=["a", "b"])
    with pytest.raises(SystemExit) as stopped:
        p.parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == EXIT_USAGE and err == message + "\n"


def test_with_json_an_error_is_also_one_json_document_on_stdout(capsys):
    """An agent that parses stdout gets {"error", "exit_code"}, whatever failed: a flag, the input, the server."""
    @cli.entry
    def main(argv):
        p = cli.parser("Does a thing.\n")
        printing.add_output_args(p)
        p.add_argument("--fail", choices=["usage", "server"])
        args = p.parse_args(argv)
        problem = {"usage": UsageError("MODEL is not set"), "server": ServerError("cannot reach http://h:1")}

        def body():
            raise problem[args.fail]
        return cli.run_main(body)

    for argv, code, message in [(["--fail", "usage"], EXIT_USAGE, "MODEL is not set"),
                                (["--fail", "server"], EXIT_SERVER, "cannot reach http://h:1")]:
        assert main([*argv, "--json"]) == code
        out, err = capsys.readouterr()
        assert json.loads(out) == {"error": message, "exit_code": code} and err == f"error: {message}\n"
        assert main(argv) == code and capsys.readouterr().out == ""      # without --json stdout stays empty
    with pytest.raises(SystemExit) as stopped:
        main(["--fial", "usage", "--json"])
    out, err = capsys.readouterr()
    assert stopped.value.code == EXIT_USAGE and out.count("\n") == 1
    assert json.loads(out) == {"error": "unrecognized arguments: --fial usage; did you mean --fail? (see "
                                        f"{err.split('(see ', 1)[1].split(')')[0]})", "exit_code": EXIT_USAGE}


def test_help_describes_with_the_whole_first_paragraph():
    description, epilog = cli.split_doc("Compares two runs: the change with a 95%\nbootstrap interval.\n\n"
                                        "Examples:\n  prog a b\n")
    assert description == "Compares two runs: the change with a 95%\nbootstrap interval."
    assert epilog == "Examples:\n  prog a b"


def test_connection_refused_names_the_url_and_says_to_check_the_server():
    with pytest.raises(ServerError) as caught:
        with http_client.client("http://127.0.0.1:9") as http, http_client.answered("http://127.0.0.1:9/v1/models", 5):
            http.get("/v1/models")
    assert str(caught.value).startswith("cannot reach http://127.0.0.1:9/v1/models (")
    assert str(caught.value).endswith("): check that the server is up and listening at that address")


def output_of(argv: list[str]) -> printing.Output:
    p = cli.parser("Does a thing.\n")
    printing.add_output_args(p)
    return p.parse_args(argv).output


def closing_on_the_second_request() -> tuple[socket.socket, list[int]]:
    """A server that answers the first request on each connection and closes the connection,
    unanswered, when the next request arrives on it: uvicorn's keep-alive close meeting a request.
    Returns its socket and the requests it answered per connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    answered: list[int] = []

    def serve(conn: socket.socket, _: int) -> None:
        with conn:
            conn.recv(65536)
            answered.append(1)  # before the answer: the client may read it and the test count at once
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            conn.recv(65536)  # the next request: closed without an answer

    serve_each_connection(listener, serve)
    return listener, answered


def serve_each_connection(listener: socket.socket, serve) -> None:
    """Accept connections until the listener closes; each served by `serve(conn, number)` in a
    thread of its own, numbered from 0 in the order they came."""
    def accept() -> None:
        for number in itertools.count():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn, number), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def test_a_kept_alive_connection_closed_as_a_request_goes_out_is_sent_once_more():
    listener, answered = closing_on_the_second_request()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with listener, http_client.client(url, timeout=5) as http:
        assert http_client.get_json(http, "/v1/models") == {}
        assert http_client.get_json(http, "/v1/models") == {}  # on the kept-alive one, then a new one
    assert len(answered) == 2


def test_a_new_connection_closed_unanswered_is_one_error_and_not_sent_again():
    """A proxy that drops a request it may have passed on: sending it again could run it twice.
    The fault server reads the whole request before it closes: the client writes a POST's body
    after its head, and a socket closed before the body came sends a reset, not a close."""
    received = []

    def drop(request: Request) -> Action:
        received.append((request.method, request.path))
        return Action(b"", "close")

    with fault_server(drop) as url, http_client.client(url, timeout=5) as http, pytest.raises(ServerError) as caught:
        http_client.get_json(http, "/v1/completions", json={"prompt": "hi"})
    assert str(caught.value) == f"cannot reach {url}/v1/completions: RemoteProtocolError: {http_client.CLOSED_UNANSWERED}."
    assert received == [("POST", "/v1/completions")]


def keeping_alive() -> tuple[socket.socket, dict[int, bool]]:
    """A server that answers every request on a connection, keeping it open, with the number of
    its connection. Returns its socket and, per connection, whether the client has closed it."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed: dict[int, bool] = {}

    def serve(conn: socket.socket, number: int) -> None:
        closed[number] = False
        with conn:
            while conn.recv(65536):  # one small GET a read
                body = json.dumps({"connection": number}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
            closed[number] = True

    serve_each_connection(listener, serve)
    return listener, closed


def test_each_thread_sends_on_connections_of_its_own_and_closing_the_client_closes_them_all():
    """httpcore's pool is not safe to share between threads (encode/httpcore#1110): a request
    from another thread goes through that thread's own pool, kept alive there, closed with the
    client."""
    listener, closed = keeping_alive()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    used: dict[str, list[int]] = {}
    together = threading.Barrier(2, timeout=30)  # both threads alive at once (an ended thread's id is reused)

    def twice(name: str) -> None:
        used[name] = [http_client.get_json(http, "/v1/models")["connection"] for _ in range(2)]

    def twice_beside_the_other(name: str) -> None:
        together.wait()
        twice(name)
        together.wait()

    with listener:
        with http_client.client(url, timeout=5) as http:
            workers = [threading.Thread(target=twice_beside_the_other, args=(name,)) for name in ("a", "b")]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            twice("main")
        deadline = time.monotonic() + 30  # the server's threads see each close as they get to it
        while closed != {0: True, 1: True, 2: True} and time.monotonic() < deadline:
            time.sleep(0.05)
    assert all(len(set(numbers)) == 1 for numbers in used.values()), used  # kept alive in its thread
    assert len({numbers[0] for numbers in used.values()}) == 3, used  # and never another thread's
    assert closed == {0: True, 1: True, 2: True}


def test_json_and_json_out_fill_one_output(tmp_path):
    out = str(tmp_path / "r.json")
    assert output_of([]) == printing.Output(json=False, file="")
    assert output_of(["--json"]) == printing.Output(json=True, file="")
    assert output_of(["--json-out", out]) == printing.Output(json=False, file=out)
    assert output_of(["--json-out", out, "--json"]) == printing.Output(json=True, file=out)
    assert output_of(["--json-out", ""]) == printing.Output()  # an empty flag means not given


@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
def test_emit_prints_and_writes_the_same_document(tmp_path, capsys, as_json):
    out = tmp_path / "r.json"
    result = {"value": float("nan"), "name": "x"}
    assert printing.emit(result, "the human text", printing.Output(json=as_json, file=str(out))) == EXIT_OK
    printed = capsys.readouterr().out
    assert out.read_text() == printing.json_text(result) and json.loads(out.read_text()) == {"value": None, "name": "x"}
    assert printed == (out.read_text() if as_json else "the human text\n")


def test_emit_reports_a_file_it_could_not_write_after_printing(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "r.json"  # its folder is a file, as root too
    code = printing.emit({"value": 1}, "the human text", printing.Output(file=str(target)))
    captured = capsys.readouterr()
    assert code == EXIT_OUTPUT and captured.out == "the human text\n"
    [line] = captured.err.splitlines()
    assert line.startswith(f"error: the result is printed above, but --json-out {target} was not written")


@pytest.fixture
def ctrl_c_as_usual():
    """Python's own SIGINT handler for the test: a process a non-interactive shell started in the
    background inherits SIGINT ignored, and Python then installs none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_signal_hold_notes_signals_and_raises_one_on_release(capsys, ctrl_c_as_usual):
    with signals.SignalHold("test") as hold:
        with pytest.raises(KeyboardInterrupt):  # not started: Ctrl-C as usual
            signal.raise_signal(signal.SIGINT)
        hold.start()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert hold.noted == [signal.SIGTERM, signal.SIGINT]
        assert capsys.readouterr().err.count("test: finishing: the results are being written") == 2
        with pytest.raises(KeyboardInterrupt):  # what was held is obeyed on release
            hold.release()
        assert hold.noted == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        hold.release()  # nothing held: nothing raised
        hold.start()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("script, argv", [
    ("bench", ["--env-file", "/nonexistent/inference.env"]),       # settings read before run_main
    ("metrics", ["--file", "{html}"]),                               # a scrape that is not Prometheus text
])
def test_every_error_path_gives_the_json_document(script, argv, capsys, tmp_path):
    import importlib
    html = tmp_path / "page.html"
    html.write_text("<html>not metrics</html>")
    code = importlib.import_module(script).main([a.format(html=html) for a in argv] + ["--json"])
    out, err = capsys.readouterr()
    assert code != 0 and json.loads(out) == {"error": err.removeprefix("error: ").rstrip("\n"), "exit_code": code}
