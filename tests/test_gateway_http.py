"""The gateway's HTTP layer against a real gateway process: what aiohttp refuses before the app
(answered as OpenAI errors all the same), and the worker it reaches being the one it routed to.

One real worker (stories260K) in region `far`; the gateway in region `local`, where the tests
register entries of their own (no process behind them, or another worker's): routing tries the
gateway's own region first, so those entries are tried before the real worker.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import orjson
import pytest

from kvstore.client import connect
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry
from tests.stack import (
    SECRET,
    Proc,
    chat_model,
    get_json,
    start_gateway,
    start_worker,
    wait_until,
)

API_KEY = "test-key"
CATALOG = """
regions:
  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}
  - {name: far, latitude: 1.35, longitude: 103.82, settings: {}}
"""


class Stack:
    def __init__(self, root: Path, stories: Path) -> None:
        (root / "regions.yaml").write_text(CATALOG)
        self.root = root
        self.redis = LocalRedis().start()
        self.procs: list[Proc] = []
        try:
            model = chat_model(stories, root / "stories-chat")
            self.worker = start_worker("far1", model, self.redis.url, root, "far")
            self.procs.append(self.worker)
            self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root,
                                         "local", ["--api-key", API_KEY])  # fmt: skip
            self.procs.append(self.gateway)
            wait_until(lambda: self.workers() == 1, 30, "the worker")
        except BaseException:
            self.close()
            raise
        self.client = openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key=API_KEY,
                                    max_retries=0, timeout=60)  # fmt: skip

    def workers(self) -> int:
        return int(get_json(f"{self.gateway.url}/readyz")[1]["workers"])

    def register(self, worker_id: str, url: str) -> None:
        """An entry of `stories` in region `local` at `url`, as a worker's heartbeat writes it."""
        info = WorkerInfo(worker_id=worker_id, region="local", model="stories", role="mixed",
                          url=url, max_num_seqs=4, capacity_tokens=10_000, free_kv_blocks=1000,
                          total_kv_blocks=1000, updated_at=time.time())  # fmt: skip
        asyncio.run(self._registry(lambda reg: reg.heartbeat(info)))

    def deregister(self, worker_id: str) -> None:
        asyncio.run(self._registry(lambda reg: reg.deregister(worker_id, "stories")))

    async def _registry(self, call):  # type: ignore[no-untyped-def]
        r = connect(self.redis.url)
        try:
            await call(Registry(r, ttl_s=60))
        finally:
            await r.aclose()

    def raw(self, data: bytes) -> tuple[int, bytes, bytes]:
        """`data` sent as it is on a new connection; the status, head and body of the answer
        (read until the gateway closes the connection)."""
        url = urllib.parse.urlsplit(self.gateway.url)
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(data)
            out = b""
            while piece := sock.recv(65536):
                out += piece
        head, _, body = out.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), head, body

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("http"), stories_dir)
    try:
        yield s
    finally:
        s.close()


def _error(head: bytes, body: bytes) -> dict:  # type: ignore[type-arg]
    """The OpenAI error object of an answer, which must be JSON."""
    assert b"content-type: application/json" in head.lower(), head
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err  # type: ignore[no-any-return]


def test_requests_aiohttp_cannot_parse_get_openai_errors(stack: Stack) -> None:
    """What aiohttp refuses before any handler (it answered with a text/plain 400 of its own):
    a header or URL over the limit (431, naming it), too many headers (431), a control byte in
    a header, a request line that is not HTTP, a chunked body that does not parse, a
    Content-Length that is not a number (400). Each is an OpenAI error, and a WARNING line in
    the log, never a traceback. A header of 12 KB (a long JWT bearer token, big cookies) is
    taken, as h11 (uvicorn, vLLM) takes one."""
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n")  # fmt: skip
    long_header = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n"
    status, head, body = stack.raw(long_header)
    err = _error(head, body)
    assert status == 431 and err["code"] == "request_header_too_large", err
    assert "16384 bytes" in err["message"], err
    status, head, body = stack.raw(b"GET /v1/models/" + b"m" * 20_000 + b" HTTP/1.1\r\n\r\n")
    assert status == 431 and _error(head, body)["code"] == "request_header_too_large"
    many = b"".join(b"X-H%d: 1\r\n" % i for i in range(200))
    status, head, body = stack.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    err = _error(head, body)
    assert status == 431 and err["code"] == "too_many_headers" and "128" in err["message"], err
    for bad, fault in (
        (post + b"X-A: a\x01b\r\nContent-Length: 2\r\n\r\n{}", "header value char"),
        (b"GARBAGE\r\n\r\n", "method"),
        (post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "chunk size"),
        (post + b"Content-Length: 12abc\r\n\r\n{}", "Content-Length"),
    ):
        status, head, body = stack.raw(bad)
        err = _error(head, body)
        assert status == 400 and err["code"] == "malformed_request", (bad[-40:], err)
        assert err["type"] == "invalid_request_error" and fault in err["message"], err
    # the same fault once the request is being handled (its headers came first): 400 at once,
    # one answer (it waited out the 30 s body timeout for a 408 "did not arrive")
    url = urllib.parse.urlsplit(stack.gateway.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(post + b"Expect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")  # (the body is being read)
        sock.sendall(b"2\r\n{}\r\nzz\r\n{}\r\n0\r\n\r\n")
        out = b""
        while piece := sock.recv(65536):
            out += piece
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and out.count(b"HTTP/1.") == 1, out
    err = _error(head, body)
    assert err["code"] == "invalid_body" and "chunk size" in err["message"], err
    jwt = b"Bearer " + API_KEY.encode()  # a long token beside it: a 12 KB cookie
    status, head, body = stack.raw(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                   b"Authorization: " + jwt + b"\r\nCookie: c=" + b"x" * 12_000
                                   + b"\r\n\r\n")  # fmt: skip
    assert status == 200 and orjson.loads(body)["object"] == "list", (head, body[:200])
    time.sleep(0.3)  # (the log line of the last refusal)
    log = stack.gateway.log.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert log.count("WARNING aiohttp.server") >= 7, log[-3000:]


class _Impostor(ThreadingHTTPServer):
    """A worker's internal API that serves every generate request whole (one token, "!"), its
    start event naming `worker_id`; it counts the aborts it gets."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(("127.0.0.1", 0), _ImpostorAnswer)
        self.worker_id = worker_id
        self.aborts: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ImpostorAnswer(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = orjson.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        server: _Impostor = self.server  # type: ignore[assignment]
        if self.path == "/internal/abort":
            server.aborts.append(body["request_id"])
            out = b'{"aborted": true}'
        else:
            events = [{"type": "start", "request_id": body["request_id"],
                       "worker_id": server.worker_id, "prompt_tokens": 1},
                      {"type": "delta", "index": 0, "text": "!", "token_ids": [5],
                       "finish_reason": "length"},
                      {"type": "done", "prompt_tokens": 1, "completion_tokens": 1}]  # fmt: skip
            out = b"".join(orjson.dumps(e) + b"\n" for e in events)
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


def test_an_entry_whose_url_reaches_another_worker_is_set_aside(stack: Stack) -> None:
    """A registry entry at a URL where another worker answers (one started on the port of a
    worker that died before its entry expired; a wrong --url), as its start event says: the
    entry is set aside and the mix-up logged once as an ERROR naming both. The answer of a
    worker the gateway knows, at that URL, is taken as that worker's (x-edgeinfer-worker, its
    load, the session's placement); one it does not know is refused (aborted there) and the
    request served elsewhere. Before, either was served as the entry's worker's."""
    real = stack.worker.meta["worker_id"]
    stack.register("local-impostor", stack.worker.url)
    try:
        wait_until(lambda: stack.workers() == 2, 10, "the entry")
        raw = stack.client.completions.with_raw_response.create(
            model="stories", prompt="Once upon a time", max_tokens=2,
            extra_headers={"x-session-affinity": "mixed-up"})  # fmt: skip
        assert raw.headers["x-edgeinfer-worker"] == real, raw.headers
        assert raw.parse().choices[0].text
        wait_until(lambda: stack.workers() == 1, 5, "the entry set aside")
        log = stack.gateway.log.read_text()
        line = next(x for x in log.splitlines() if "where worker" in x)
        assert "ERROR" in line and "local-impostor" in line and real in line, line
        again = stack.client.completions.with_raw_response.create(
            model="stories", prompt="Once upon a time", max_tokens=2,
            extra_headers={"x-session-affinity": "mixed-up"})  # fmt: skip
        assert again.headers["x-edgeinfer-worker"] == real  # where the session was placed
        assert "failed" not in stack.gateway.log.read_text()  # (not a failed attempt)
    finally:
        stack.deregister("local-impostor")
    stranger = _Impostor("not-in-the-registry")
    stack.register("local-impostor-2", stranger.url)
    try:
        wait_until(lambda: stack.workers() == 2, 10, "the entry")
        raw = stack.client.completions.with_raw_response.create(
            model="stories", prompt="Once upon a time", max_tokens=2
        )
        assert raw.headers["x-edgeinfer-worker"] == real, raw.headers
        assert raw.parse().choices[0].text != "!"
        assert stranger.aborts == [raw.headers["x-request-id"]]
        log = stack.gateway.log.read_text()
        assert log.count("where worker") == 2, log[-3000:]
    finally:
        stack.deregister("local-impostor-2")
        stranger.shutdown()
        stranger.server_close()


def test_entries_whose_url_is_unusable_are_named_and_passed_over(stack: Stack) -> None:
    """Registry entries whose URL aiohttp cannot request (not a URL, a port out of range, not
    http): logged as such, naming the URL (it was "a malformed answer", as if the worker had
    answered), set aside, and passed over without using up the request's attempts (the request
    never left, as with a worker that refuses the connection): four of them in the gateway's
    own region took its three attempts, a 503 while the worker afar idled."""
    bad = {"local-bad-0": "not a url", "local-bad-1": "http://127.0.0.1:99999",
           "local-bad-2": "ftp://127.0.0.1:1", "local-bad-3": "127.0.0.1:9000"}  # fmt: skip
    for worker_id, url in bad.items():
        stack.register(worker_id, url)
    try:
        wait_until(lambda: stack.workers() == 5, 10, "the entries")
        out = stack.client.completions.create(model="stories", prompt="Once", max_tokens=2)
        assert out.choices[0].text is not None
        log = stack.gateway.log.read_text()
        assert "malformed answer" not in log, log[-3000:]
        for worker_id, url in bad.items():
            assert f"worker {worker_id} is registered with an unusable URL {url!r}" in log
        assert "its registered URL is not a valid http(s) URL" in log
        assert stack.workers() == 1
    finally:
        for worker_id in bad:
            stack.deregister(worker_id)


def test_a_method_not_allowed_says_which_are(stack: Stack) -> None:
    """405 names the methods the path takes in Allow, as HTTP requires (RFC 9110 15.5.6)."""
    for method, path, allow in ((b"GET", b"/v1/completions", b"POST"),
                                (b"DELETE", b"/v1/models", b"GET, HEAD"),
                                (b"OPTIONS", b"/healthz", b"GET, HEAD")):  # fmt: skip
        status, head, body = stack.raw(method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                       b"Authorization: Bearer " + API_KEY.encode()
                                       + b"\r\nConnection: close\r\n\r\n")  # fmt: skip
        assert status == 405 and _error(head, body)["code"] == "method_not_allowed"
        assert b"\r\nAllow: " + allow + b"\r\n" in head + b"\r\n", head


def test_expect_is_answered_after_auth_and_the_size_limit(stack: Stack) -> None:
    """`Expect: 100-continue` (curl sends it for larger bodies): 100 Continue only once the API
    key and the declared size passed; a client refused for either gets the refusal alone (it was
    told to send its body first, aiohttp answering ahead of the middlewares). Any other
    expectation: 417, an OpenAI error (it was aiohttp's text/plain)."""
    body = orjson.dumps({"model": "stories", "prompt": "Once", "max_tokens": 1})

    def ask(key: bytes, length: int, expect: bytes = b"100-continue") -> tuple[int, bytes, bytes]:
        return stack.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: Bearer " + key + b"\r\nExpect: " + expect
                         + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(length).encode() + b"\r\n\r\n")  # fmt: skip

    status, head, body_out = ask(b"wrong", len(body))
    assert status == 401 and _error(head, body_out)["code"] == "invalid_api_key", head
    status, head, body_out = ask(API_KEY.encode(), 10_000_000)
    assert status == 413 and _error(head, body_out)["code"] == "request_too_large", head
    status, head, body_out = ask(API_KEY.encode(), len(body), b"something-else")
    err = _error(head, body_out)
    assert status == 417 and err["param"] == "Expect" and "something-else" in err["message"]
    url = urllib.parse.urlsplit(stack.gateway.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nExpect: 100-continue"
                     b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")  # fmt: skip
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        out = b""
        while piece := sock.recv(65536):
            out += piece
    assert out.startswith(b"HTTP/1.1 200 "), out[:300]
    assert orjson.loads(out.partition(b"\r\n\r\n")[2])["object"] == "text_completion"


def test_the_worker_takes_the_headers_the_gateway_takes(stack: Stack) -> None:
    """The gateway takes headers up to 16 KiB and passes a W3C tracestate on to the worker (up
    to 8192 characters, as OpenTelemetry keeps it): the worker refused one over aiohttp's 8190
    bytes with a text/plain 400, and a tracing gateway answered the client 400."""
    import urllib.request

    state = ",".join(f"k{i:03d}=" + "v" * 250 for i in range(32))  # 32 entries, 8,191 characters
    req = urllib.request.Request(f"{stack.worker.url}/internal/health",
                                 headers={"tracestate": state[:8191],
                                          "x-edgeinfer-secret": SECRET})  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and orjson.loads(resp.read())["status"] == "ok"
