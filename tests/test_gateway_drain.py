"""A gateway stopping (SIGTERM: a rolling update, a scale-down) with answers in flight: they get
--drain-timeout to finish, and those still going then end with a 503 or a stream's closing error
event, never an empty reply or a stream that just stops. Real Redis, a worker and a gateway, the
official `openai` client; the worker is paused (SIGSTOP) to hold an answer in flight."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvstore.redis_server import LocalRedis
from tests.stack import Proc, chat_model, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"


@pytest.fixture
def worker(tmp_path: Path, stories_dir: Path, redis_server: LocalRedis) -> Iterator[Proc]:
    proc = start_worker("w", chat_model(stories_dir, tmp_path / "chat"), redis_server.url,
                        tmp_path)  # fmt: skip
    try:
        yield proc
    finally:
        proc.popen.send_signal(signal.SIGCONT)
        proc.stop()


def _gateway(tmp_path: Path, redis_url: str, drain_s: float) -> Proc:
    (tmp_path / "regions.yaml").write_text(CATALOG)
    # (a worker silent this long is failed: longer than the pause here)
    gateway = start_gateway("gw", redis_url, tmp_path / "regions.yaml", tmp_path, "local",
                            ["--drain-timeout", str(drain_s), "--worker-idle-timeout", "60"])  # fmt: skip
    wait_until(lambda: "1 workers" in gateway.tail(50) or _ready(gateway), 30, "a worker", gateway)
    return gateway


def _ready(gateway: Proc) -> bool:
    from tests.stack import get_json

    return get_json(f"{gateway.url}/readyz")[1].get("workers", 0) >= 1


def _connections_to(port: int) -> int:
    """Established TCP connections (IPv4, this host) whose remote end is `port`."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines
               if line.split()[2].endswith(f":{port:04X}") and line.split()[3] == "01")  # fmt: skip


def _stream(gateway: Proc):  # type: ignore[no-untyped-def]
    """A long streamed chat answer, started: the stream and its first chunk."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=400, n=16, temperature=1.0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    return stream, next(iter(stream))


def test_a_stream_in_flight_at_sigterm_finishes_within_the_drain(
    tmp_path: Path, redis_server: LocalRedis, worker: Proc
) -> None:
    """aiohttp's fixed shutdown timeout (5 s, then 5 s more once the request is told it is
    cancelled, which a streaming handler does not hear, then the task cancelled) cut every
    answer still going ~10 s after SIGTERM at each rolling update: the stream just stopped (no
    [DONE], no error event). Now --drain-timeout (here 20 s)."""
    gateway = _gateway(tmp_path, redis_server.url, 20)
    try:
        stream, _ = _stream(gateway)
        worker.popen.send_signal(signal.SIGSTOP)  # the answer is in flight, and stays so
        gateway.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: "request(s) in flight get up to 20s to finish" in gateway.tail(50), 10,
                   "the drain to begin", gateway)  # fmt: skip
        time.sleep(11)  # past the old ~10 s
        worker.popen.send_signal(signal.SIGCONT)
        finished = {c.index for chunk in stream for c in chunk.choices if c.finish_reason}
        assert finished == set(range(16)), finished
        assert gateway.popen.wait(30) == 0, gateway.tail()
    finally:
        gateway.kill()


def test_a_stream_still_going_when_the_drain_ends_gets_a_closing_error(
    tmp_path: Path, redis_server: LocalRedis, worker: Proc
) -> None:
    gateway = _gateway(tmp_path, redis_server.url, 1)
    try:
        stream, _ = _stream(gateway)
        worker.popen.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        gateway.popen.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 5, "the drain's end did not end the stream"
        assert "shutting down" in e.value.message and "drain timeout (1s)" in e.value.message
        assert gateway.popen.wait(30) == 0, gateway.tail()
        assert "drain timeout (1s) over: 1 request(s) still in flight end now" in gateway.tail(50)
    finally:
        gateway.kill()


def test_an_answer_not_begun_when_the_drain_ends_is_a_503(
    tmp_path: Path, redis_server: LocalRedis, worker: Proc
) -> None:
    gateway = _gateway(tmp_path, redis_server.url, 1)
    try:
        worker.popen.send_signal(signal.SIGSTOP)  # the request reaches it, and no answer comes
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=30)  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model="stories", prompt="Once",
                                 max_tokens=4)  # fmt: skip
            # (at the worker: the gateway's connection to it is up; a paused process's kernel
            # still accepts it)
            wait_until(lambda: _connections_to(worker.port) > 0, 10, "the forward", gateway)
            gateway.popen.send_signal(signal.SIGTERM)
            with pytest.raises(openai.APIStatusError) as e:
                answer.result(timeout=20)
        assert e.value.status_code == 503, e.value
        assert e.value.code == "gateway_shutting_down", e.value.body
        assert float(e.value.response.headers["retry-after"]) > 0
        assert gateway.popen.wait(30) == 0, gateway.tail()
    finally:
        gateway.kill()


def test_a_slow_reader_still_gets_the_closing_error_when_the_drain_ends(
    tmp_path: Path, redis_server: LocalRedis, worker: Proc
) -> None:
    """A client that stopped reading (the socket buffers full: the gateway waits in aiohttp's
    drain()) when the drain ends, and reads again after: it gets the closing error event and
    [DONE], not a second HTTP response inside the SSE body. The drain's end first cancelled the
    stream's handler, which a reviewer showed can break the connection's shared drain future
    under a client reading slower still (SO_RCVBUF 4096, too slow a transfer for a test); it
    now closes the handler's worker streams instead, and this guards the path that takes."""
    import json
    import socket

    gateway = _gateway(tmp_path, redis_server.url, 1)
    try:
        host, port = gateway.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        body = json.dumps({"model": "stories", "prompt": ["Once", "Tom", "Lily", "A cat"],
                           "max_tokens": 480, "n": 16, "stream": True, "ignore_eos": True,
                           "temperature": 1.0}).encode()  # fmt: skip
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        sock.settimeout(30)
        data = sock.recv(4096)
        time.sleep(1.0)  # (the socket buffers fill: aiohttp waits on this client's reads)
        gateway.popen.send_signal(signal.SIGTERM)
        time.sleep(2.5)  # the drain (1 s) ends while the gateway still waits on the client
        while chunk := sock.recv(1 << 20):  # then it reads, to the end
            data += chunk
        sock.close()
        assert b"HTTP/1.1 200" in data[:20], data[:200]
        assert b"HTTP/1.1 503" not in data[20:], "a second response inside the stream"
        tail = data[-2000:]
        assert b"gateway_shutting_down" in tail and b"data: [DONE]" in tail, tail[-600:]
        assert gateway.popen.wait(30) == 0, gateway.tail()
    finally:
        gateway.kill()
