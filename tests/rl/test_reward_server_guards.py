"""`tether serve-rm` off loopback (issue 48, item 9): what the server guards, each test a finding
of the tester's against the hand-written server before it (no key, a body read whole, rows
without a limit, one lock any request could hold, a backlog of 5, an empty batch as a 500, a
nested body dropping the connection, paths and exception text in answers, a too-long row naming
a trainer's options). Orders are asserted by events (a chunk that waits for the test), never by
wall-clock thresholds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
from refusals import refused
from test_reward_server import PLAIN, RESPONSES, rms  # noqa: F401 - rms: the fixture

from tether.errors import TetherError
from tether.rl.reward.models import load_scoring_model
from tether.rl.reward.remote import connect, score_remote
from tether.tools import serve_rm
from tether.tools.config import ServeRMConfig
from tether.tools.serve_rm import open_server, serve

KEY = "s3cret-key"


@contextmanager
def served(path, **options):
    """`tether serve-rm PATH` in this process on a free port, with `options`, for the block."""
    server = open_server(ServeRMConfig(model=str(path), port=0, device="cpu", **options))
    thread = serve(server)
    try:
        yield server
    finally:
        server.stop()
        thread.join()


def ask(url: str, body: bytes | None = None, key: str | None = None) -> tuple[int, dict]:
    """GET (body None) or POST `body` to `url`: (status, the JSON answer)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def rows(prompts: list, responses: list[str]) -> bytes:
    return json.dumps({"prompts": prompts, "responses": responses}).encode()


def raw_answer(url: str, head: bytes, body: bytes) -> tuple[int, dict]:
    """Send `head` (the request line and headers) and the start of a body, then read the answer
    without sending the rest: what a server answers before it has the whole body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as conn:
        conn.sendall(head + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            assert chunk, answer  # the server closed without answering
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])


def one_line(payload: dict) -> str:
    line = payload["error"]
    assert isinstance(line, str) and line and "\n" not in line and "Traceback" not in line
    return line


# ----------------------------------------------------------------------------- the key

def test_off_loopback_a_server_needs_a_key_to_start(rms, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                   no_loads):
    monkeypatch.delenv("TETHER_RM_API_KEY", raising=False)
    refused(tmp_path, ["serve-rm", str(rms["gpt2"]), "--host", "0.0.0.0", "--port", "0"],
            r"^error: --host 0\.0\.0\.0 is reachable beyond this machine and the API would be "
            "open to anyone: set TETHER_RM_API_KEY \\(or --api-key\\) to a secret the clients "
            "share, or serve on 127.0.0.1$", capsys)
    assert no_loads == []  # refused before the model loads


@pytest.mark.parametrize("host, given", [("0.0.0.0", "option"), ("0.0.0.0", "environment"),
                                         ("127.0.0.1", "option")])
def test_every_request_needs_the_key(host, given, rms, monkeypatch):  # noqa: F811
    # off loopback the key is required; on loopback it is optional, and checked when given
    monkeypatch.delenv("TETHER_RM_API_KEY", raising=False)
    if given == "environment":
        monkeypatch.setenv("TETHER_RM_API_KEY", KEY)
    with served(rms["gpt2"], host=host, api_key=KEY if given == "option" else "") as server:
        url = f"http://127.0.0.1:{urlsplit(server.url).port}"
        for path, body in (("/info", None), ("/score", rows(PLAIN, RESPONSES)),
                           ("/nowhere", None)):
            for key in (None, "wrong", KEY[:-1], KEY + "x"):
                status, payload = ask(url + path, body, key)
                assert status == 401 and "API key" in one_line(payload), (path, key)
        assert ask(url + "/info", None, KEY)[0] == 200
        status, payload = ask(url + "/score", rows(PLAIN, RESPONSES), KEY)
        assert status == 200 and len(payload["scores"]) == len(PLAIN)
        # tether's client sends $TETHER_RM_API_KEY
        monkeypatch.setenv("TETHER_RM_API_KEY", KEY)
        expected = load_scoring_model(str(rms["gpt2"]), "cpu").score_texts(PLAIN, RESPONSES, 16)
        assert score_remote(connect([url]), PLAIN, RESPONSES, 60).tolist() == expected.tolist()


@pytest.mark.parametrize("env_key", ["", "wrong"])
def test_a_client_without_the_right_key_is_one_line(env_key, rms, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TETHER_RM_API_KEY", env_key)
    with served(rms["gpt2"], api_key=KEY) as server:
        with pytest.raises(TetherError) as caught:
            connect([server.url])
    why = "is not it" if env_key else "is not set"
    assert str(caught.value) == (f"--reward-url {server.url}: the server wants its API key, and "
                                 f"$TETHER_RM_API_KEY {why}; set it to the key the server was "
                                 "started with")


# ----------------------------------------------------------------------------- the body and rows

def test_a_body_over_the_limit_is_413_before_it_is_read(rms):  # noqa: F811
    with served(rms["gpt2"], max_body_mb=0.01) as server:  # 10,000 bytes
        host = urlsplit(server.url).netloc.encode()
        # a Content-Length of 50 MB and 1 kB sent: the answer comes without the rest
        head = (b"POST /score HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json"
                b"\r\nContent-Length: 50000000\r\n")
        status, payload = raw_answer(server.url, head, b"[" * 1000)
        assert status == 413 and "--max-body-mb" in one_line(payload)
        # no length given (chunked): refused once past the limit, the body still coming
        head = b"POST /score HTTP/1.1\r\nHost: " + host + b"\r\nTransfer-Encoding: chunked\r\n"
        chunks = b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(12))  # 12 kB
        status, payload = raw_answer(server.url, head, chunks)
        assert status == 413 and "--max-body-mb" in one_line(payload)
        # under the limit: scored
        assert ask(server.url + "/score", rows(PLAIN, RESPONSES))[0] == 200


def test_a_body_that_stalls_is_408(rms, monkeypatch):  # noqa: F811
    monkeypatch.setattr(serve_rm, "BODY_TIMEOUT_S", 0.5)
    with served(rms["gpt2"]) as server:
        head = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
        status, payload = raw_answer(server.url, head, b'{"prompts": ')  # and then nothing
        assert status == 408 and "did not arrive" in one_line(payload)


def test_rows_over_the_limit_are_413_and_no_rows_none(rms):  # noqa: F811
    with served(rms["gpt2"], max_rows=3) as server:
        status, payload = ask(server.url + "/score", rows(PLAIN, RESPONSES))
        assert status == 413 and one_line(payload) == (
            "4 rows in one request, more than the 3 this server takes (tether serve-rm "
            "--max-rows); send fewer at a time")
        assert ask(server.url + "/score", rows([], [])) == (200, {"scores": []})
        assert ask(server.url + "/score", rows(PLAIN[:3], RESPONSES[:3]))[0] == 200


@pytest.mark.parametrize("limit, why", [({"max_rows": 3}, "3 rows, 64 MB"),
                                         ({"max_body_mb": 1e-4}, "4096 rows, 0.0001 MB")])
def test_a_request_past_the_servers_limits_is_one_line_at_the_client(limit, why, rms):  # noqa: F811
    # the client reads the limits off /info and says so before it sends: a large body refused
    # while it is sent would reset the connection, which reads as a dead server
    with served(rms["gpt2"], **limit) as server:
        endpoints = connect([server.url])
        with pytest.raises(TetherError) as caught:
            score_remote(endpoints, PLAIN, RESPONSES, timeout=60)
    assert str(caught.value) == (
        f"--reward-url {server.url}: a request of 4 rows and 0.0 MB, more than the server takes "
        f"({why}); start tether serve-rm with a larger --max-rows or --max-body-mb, or give more "
        "endpoints")


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe{}", b"[" * 100_000,
                                  b'{"prompts": ' + b"[" * 100_000, b"1e999999" * 2,
                                  b'{"prompts": [[[[]]]], "responses": ["a"]}'])
def test_a_malformed_or_deeply_nested_body_is_a_400_line(body, rms):  # noqa: F811
    with served(rms["gpt2"]) as server:
        status, payload = ask(server.url + "/score", body)
        assert status == 400 and one_line(payload)
        assert ask(server.url + "/info")[0] == 200  # and it serves on


# ----------------------------------------------------------------------------- the answers

@pytest.mark.parametrize("which", ["tether", "gpt2"])
def test_no_answer_holds_a_path_exception_text_or_a_trainers_option(which, rms, monkeypatch,  # noqa: F811
                                                                    capfd):
    path = str(rms[which])
    with served(rms[which]) as server:
        status, info = ask(server.url + "/info")
        assert status == 200 and info["model"] == which and path not in json.dumps(info)
        # a row past the model's positions: the model's limit, no trainer option
        status, payload = ask(server.url + "/score", rows(["the movie was " * 200], [" fun."]))
        line = one_line(payload)
        assert status == 400 and line.endswith("; send a shorter prompt or response"), line
        assert "--max" not in line and path not in line
        # a failure of the server's own: the type alone, the text in its log
        def fails(*args, **kwargs):
            raise RuntimeError(f"CUDA out of memory reading {path}/weights")
        monkeypatch.setattr(server.model, "score_texts", fails)
        status, payload = ask(server.url + "/score", rows(PLAIN, RESPONSES))
        assert status == 500 and one_line(payload) == "RuntimeError in the server (its log has the rest)"
        assert f"CUDA out of memory reading {path}/weights" in capfd.readouterr().err
        status, payload = ask(server.url + "/nowhere")
        assert status == 404 and one_line(payload) == "no GET /nowhere; GET /info or POST /score"


# ----------------------------------------------------------------------------- fair turns

def test_a_small_request_is_answered_while_a_large_one_is_scored(rms, monkeypatch):  # noqa: F811
    # batch size 2: the large request is 4 chunks, the small one 1. The large one's first chunk
    # waits until the small one is in line, its third until the small one has its answer: with
    # turns, the small one is scored second and answered while the large one is in flight; one
    # request at a time (the old lock) would score all of the large one first.
    large = ([f"large {i}" for i in range(8)], [f" response {i}." for i in range(8)])
    small = (["small 0", "small 1"], [" short.", " shorter."])
    started, go, small_answered = threading.Event(), threading.Event(), threading.Event()
    with served(rms["gpt2"], batch_size=2) as server:
        real, firsts = server.model.score_texts, []

        def spy(prompts, responses, batch_size, **kwargs):
            firsts.append(prompts[0])
            if prompts[0] == "large 0":
                started.set()
                assert go.wait(60)
            if prompts[0] == "large 4":
                small_answered.wait(60)
            return real(prompts, responses, batch_size, **kwargs)
        monkeypatch.setattr(server.model, "score_texts", spy)
        answers = {}

        def post(name, pair):
            answers[name] = ask(server.url + "/score", rows(*pair))
        big = threading.Thread(target=post, args=("large", large))
        big.start()
        assert started.wait(60)
        little = threading.Thread(target=post, args=("small", small))
        little.start()
        deadline = time.monotonic() + 60
        while not server.scorer.line and time.monotonic() < deadline:  # the small one in line
            time.sleep(0.01)
        go.set()
        little.join(60)
        assert "small" in answers and big.is_alive()  # answered, the large one in flight
        small_answered.set()
        big.join(60)
    assert firsts == ["large 0", "small 0", "large 2", "large 4", "large 6"]
    # each chunk is one forward of 2 rows: the in-process scores with 2 rows per forward
    model = load_scoring_model(str(rms["gpt2"]), "cpu")
    for name, pair in (("large", large), ("small", small)):
        assert answers[name] == (200, {"scores": model.score_texts(*pair, 2).tolist()})


def test_stop_answers_the_requests_in_flight(rms, monkeypatch):  # noqa: F811
    with served(rms["gpt2"], batch_size=2) as server:
        real, scoring, go = server.model.score_texts, threading.Event(), threading.Event()

        def held(*args, **kwargs):
            scoring.set()
            assert go.wait(60)
            return real(*args, **kwargs)
        monkeypatch.setattr(server.model, "score_texts", held)
        answers = []
        client = threading.Thread(target=lambda: answers.append(
            ask(server.url + "/score", rows(PLAIN, RESPONSES))))
        client.start()
        assert scoring.wait(60)
        server.stop()  # as SIGTERM does, while the request is scored
        go.set()
        client.join(60)
    assert answers and answers[0][0] == 200 and len(answers[0][1]["scores"]) == 4
