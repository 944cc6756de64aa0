"""A worker's internal API against callers that send what a gateway never would (any process
that reaches a worker's port can): every answer is the worker's JSON error, never aiohttp's
text/plain one or a 500 with a traceback in the worker's log (which anyone could fill), and
nothing that is not a well-formed request is generated from. On one real worker process."""

from __future__ import annotations

import gzip
import http.client
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvstore.redis_server import LocalRedis
from tests.stack import SECRET, Proc, chat_model, start_worker

LIMIT = 6_000_000  # the worker's --max-body-bytes here: over the 4 MiB it had, with no option


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, redis_server: LocalRedis):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("worker_api_defects")
    proc = start_worker("defects", chat_model(stories_dir, root / "chat"), redis_server.url,
                        root, extra=["--max-body-bytes", str(LIMIT)])  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def log(worker: Proc) -> Iterator[None]:
    """The test writes no traceback into the worker's log."""
    start = worker.log.stat().st_size
    yield
    with worker.log.open("rb") as f:
        f.seek(start)
        written = f.read().decode(errors="replace")
    assert "Traceback" not in written and "ERROR" not in written, written


def _call(worker: Proc, method: str, path: str, body: bytes = b"",
          headers: dict[str, str | bytes] | None = None) -> tuple[int, str, bytes]:  # fmt: skip
    """One request, its header values sent as given (bytes: as they are, not UTF-8 perhaps):
    (status, Content-Type, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if method == "POST":
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body if method == "POST" else None)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def _error(status: int, content_type: str, body: bytes, expected: int) -> dict[str, Any]:
    assert (status, content_type) == (expected, "application/json"), (status, content_type, body)
    error: dict[str, Any] = orjson.loads(body)["error"]
    return error


def _request(i: int, **fields: Any) -> bytes:
    body = {"request_id": f"d-{i}", "model": "stories", "prompt": "Once",
            "sampling": {"max_tokens": 2}} | fields  # fmt: skip
    return orjson.dumps(body)


AUTH = {"x-edgeinfer-secret": SECRET}


@pytest.mark.usefixtures("log")
def test_a_secret_that_is_not_utf8_is_a_json_401(worker: Proc) -> None:
    """It was a 500 (UnicodeEncodeError: surrogates not allowed) and an ERROR traceback."""
    for method, path in (("GET", "/internal/stats"), ("POST", "/internal/generate")):
        got = _call(worker, method, path, _request(0), {"x-edgeinfer-secret": b"\xff\xfe"})
        assert _error(*got, 401)["type"] == "authentication_error"
    # a secret that differs only past its UTF-8 is refused, not taken as the secret
    got = _call(worker, "GET", "/internal/stats", headers={"x-edgeinfer-secret": SECRET.encode()
                                                           + b"\xff"})  # fmt: skip
    assert _error(*got, 401)["type"] == "authentication_error"


@pytest.mark.usefixtures("log")
@pytest.mark.parametrize(("method", "path", "expect", "secret", "status"), [
    ("POST", "/internal/generate", b"\xff", False, 401),  # was a 500, no secret needed
    ("POST", "/nowhere", b"\xff", False, 401),  # (a path no route takes: was a 500 too)
    ("POST", "/internal/generate", b"\xff", True, 417),  # was a 500
    ("POST", "/internal/generate", b"foo", True, 417),  # was a text/plain 417
    ("POST", "/internal/abort", b"foo", True, 417),
    ("POST", "/internal/generate", b"foo", False, 401),  # auth first, as for the gateway
    ("POST", "/nowhere", b"\xff", True, 404),
])  # fmt: skip
def test_an_expectation_is_answered_after_auth_as_json(
    worker: Proc, method: str, path: str, expect: bytes, secret: bool, status: int
) -> None:
    headers: dict[str, str | bytes] = {"Expect": expect} | (AUTH if secret else {})
    error = _error(*_call(worker, method, path, b"{}", headers), status)
    if status == 417:
        assert (error["param"], error["code"]) == ("Expect", "expectation_failed"), error
        assert "only 100-continue" in error["message"], error


def _first_line(worker: Proc, head: bytes) -> bytes:
    """The first line the worker answers `head` (a request's headers, its body not sent)."""
    with socket.create_connection(("127.0.0.1", worker.port), timeout=30) as s:
        s.sendall(head)
        got = b""
        while b"\r\n" not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    return got.split(b"\r\n", 1)[0]


@pytest.mark.usefixtures("log")
def test_100_continue_comes_only_once_auth_and_the_declared_size_passed(worker: Proc) -> None:
    """A caller told to send its body (100 Continue) was then refused it: the worker said 100
    before it looked at the secret or the declared size."""
    head = (b"POST /internal/generate HTTP/1.1\r\nHost: w\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n%s\r\n")  # fmt: skip
    secret = b"x-edgeinfer-secret: " + SECRET.encode() + b"\r\n"
    assert _first_line(worker, head % (10, b"")).startswith(b"HTTP/1.1 401 "), "no secret"
    assert _first_line(worker, head % (LIMIT + 1, secret)).startswith(b"HTTP/1.1 413 ")
    assert _first_line(worker, head % (10, secret)) == b"HTTP/1.1 100 Continue"
    body = _request(0)  # and the body sent after it is served
    got = _call(worker, "POST", "/internal/generate", body, AUTH | {"Expect": "100-continue"})
    assert got[0] == 200 and got[2].rstrip().endswith(b'"type":"done"}'), got


@pytest.mark.usefixtures("log")
@pytest.mark.parametrize("encoding", [b"br", b"zstd", b"\xff", b"compress", b"gzip, br"])
def test_a_content_coding_the_worker_does_not_decode_is_a_json_415(
    worker: Proc, encoding: bytes
) -> None:
    """br and zstd were aiohttp's text/plain 400 ("install Brotli", with a traceback in the
    log); a coding it does not know was ignored and the body generated from as it came."""
    headers = AUTH | {"Content-Encoding": encoding}
    error = _error(*_call(worker, "POST", "/internal/generate", _request(1), headers), 415)
    assert (error["param"], error["code"]) == ("Content-Encoding", "unsupported_encoding"), error


@pytest.mark.usefixtures("log")
def test_gzip_and_deflate_are_decoded_within_the_limit(worker: Proc) -> None:
    def post(encoding: str, body: bytes) -> tuple[int, str, bytes]:
        return _call(worker, "POST", "/internal/generate", body,
                     AUTH | {"Content-Encoding": encoding})  # fmt: skip

    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # (deflate as some clients send it: no header)
    for encoding, body in [("gzip", gzip.compress(_request(2))),
                           ("deflate", zlib.compress(_request(3))),
                           ("deflate", raw.compress(_request(4)) + raw.flush())]:  # fmt: skip
        got = post(encoding, body)
        assert got[0] == 200, (encoding, got)
    bomb = gzip.compress(b" " * (LIMIT + 1) + _request(5))  # (~6 KB as sent)
    assert f"limit of {LIMIT} bytes" in _error(*post("gzip", bomb), 413)["message"]
    assert _error(*post("gzip", b"not gzip"), 400)["code"] == "invalid_body"


@pytest.mark.usefixtures("log")
def test_the_body_limit_is_the_workers_option_and_its_413_says_so(worker: Proc) -> None:
    """A gateway with --max-body-bytes 8000000 had a 5 MB completion refused by the worker's
    fixed 4 MiB, its client told of a limit it could not know."""
    got = _call(worker, "POST", "/internal/generate", b" " * 5_000_000 + _request(6), AUTH)
    assert got[0] == 200, got[:2]
    for declared in (True, False):  # refused before reading it; as aiohttp reads it (chunked)
        body = b" " * LIMIT + _request(7)
        if declared:
            got = _call(worker, "POST", "/internal/generate", body, AUTH)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=30)
            conn.request("POST", "/internal/generate", iter([body]), AUTH, encode_chunked=True)
            resp = conn.getresponse()
            got = resp.status, resp.getheader("Content-Type", ""), resp.read()
            conn.close()
        error = _error(*got, 413)
        assert error["code"] == "request_too_large", error
        assert f"the worker's limit of {LIMIT} bytes" in error["message"], error
        assert "edgeinfer worker --max-body-bytes" in error["message"], error


def test_the_body_limit_defaults_far_above_a_gateways() -> None:
    from runtime.cli import build_parser
    from runtime.worker import MAX_BODY_BYTES, WorkerConfig

    args = build_parser().parse_args(["worker", "--model", "m"])
    assert args.max_body_bytes == MAX_BODY_BYTES == 32 << 20
    assert WorkerConfig("m", "r", "mixed", "h", 1, "u", "s", None).max_body_bytes == 32 << 20
    with pytest.raises(ValueError, match="max_body_bytes must be at least 1024"):
        WorkerConfig("m", "r", "mixed", "h", 1, "u", "s", None, max_body_bytes=10)


@pytest.mark.usefixtures("log")
@pytest.mark.parametrize(("messages", "param"), [
    ("x", "messages"),  # each was rendered by the chat template and generated from (200)
    ([], "messages"),
    ({"role": "user", "content": "hi"}, "messages"),
    ([1], "messages[0]"),
    ([{"role": 5, "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "messages[1].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": {"text": "hi"}}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]"),
])  # fmt: skip
def test_messages_of_another_shape_are_a_400_naming_the_field(
    worker: Proc, messages: Any, param: str
) -> None:
    body = _request(8, prompt=None, messages=messages, operation="chat")
    error = _error(*_call(worker, "POST", "/internal/generate", body, AUTH), 400)
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error


@pytest.mark.usefixtures("log")
def test_messages_of_the_shapes_a_gateway_sends_are_served(worker: Proc) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "Once"}]  # fmt: skip
    body = _request(9, prompt=None, messages=messages, operation="chat")
    status, _, answer = _call(worker, "POST", "/internal/generate", body, AUTH)
    assert status == 200 and answer.rstrip().endswith(b'"type":"done"}'), (status, answer)
