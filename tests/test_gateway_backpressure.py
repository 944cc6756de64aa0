"""A client that stops reading, and requests that ask for more sequences than a worker runs at
once: the gateway app in this event loop (its settings as the test needs them), a real stories260K
worker process that runs at most four sequences at once (so that an answer takes seconds) and
real Redis.

A streamed answer's client that reads nothing fills its connection's buffers; the gateway then
waits on its write. Before, it waited for as long as the client kept the connection open (~300 s
seen), holding the answer buffered for it and the worker computing the rest; now a write the
client takes none of within client_write_timeout_s drops it (a reset) and aborts the request at
the worker. The worker did nothing wrong: it stays routable, and other clients are served
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.app import PROXY, VIEW, make_app, make_runner
from gateway.config import GatewayConfig
from tests.stack import SECRET, Proc, chat_model, start_worker, worker_stats

CATALOG = "regions:\n  - {name: local, latitude: 50.1, longitude: 8.7, settings: {}}\n"
WRITE_TIMEOUT_S = 1.0
TCP_ESTABLISHED = 1


@pytest.fixture(scope="module")
def worker(  # type: ignore[no-untyped-def]
    redis_server, tmp_path_factory: pytest.TempPathFactory, stories_dir: Path
) -> Iterator[tuple[Proc, str]]:
    """A stories260K worker of a model name of its own (other modules' workers share the Redis),
    four sequences at a time; and that name."""
    root = tmp_path_factory.mktemp("backpressure")
    served = f"stories-bp-{uuid.uuid4().hex[:6]}"
    proc = start_worker("w", chat_model(stories_dir, root / served), redis_server.url, root,
                        served=served, extra=["--max-num-seqs", "4"])  # fmt: skip
    try:
        yield proc, served
    finally:
        proc.stop()


@contextlib.asynccontextmanager
async def serving(
    redis_url: str, model: str, root: Path, **settings: Any
) -> AsyncIterator[tuple[str, web.Application]]:
    """The gateway app on this loop with `settings` (a 1 s client write timeout unless they say
    otherwise), once it routes to the worker of `model`: its base URL and app."""
    catalog = root / "regions.yaml"
    catalog.write_text(CATALOG)
    config = GatewayConfig(region="local", redis_url=redis_url, worker_secret=SECRET,
                           catalog_path=catalog, registry_refresh_s=0.05,
                           **{"client_write_timeout_s": WRITE_TIMEOUT_S, **settings})  # fmt: skip
    app = make_app(config)
    runner = make_runner(app, config)
    await runner.setup()
    # A small send buffer on the listener (its connections inherit it), as a long path to a
    # client has less in flight than loopback's megabytes: a client that stops reading then
    # holds up the gateway's writes at once, not after the worker finished its answer
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        for _ in range(200):  # (the worker is in the registry snapshot)
            if any(w.model == model for w in app[VIEW].live_workers()):
                break
            await asyncio.sleep(0.05)
        yield url, app
    finally:
        await runner.cleanup()


@pytest.fixture
async def gateway(  # type: ignore[no-untyped-def]
    redis_server, worker: tuple[Proc, str], tmp_path: Path
) -> AsyncIterator[tuple[str, web.Application]]:
    async with serving(redis_server.url, worker[1], tmp_path) as served:
        yield served


def _tcp_state(s: socket.socket) -> int:
    """The socket's TCP state (struct tcp_info's first byte): 1 established, 7 closed (reset)."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)[0]


def _non_reader(url: str, body: dict) -> socket.socket:  # type: ignore[type-arg]
    """A client that sends `body` to /v1/completions and then never reads (a 4 KB receive
    buffer, set before it connects: the kernel then does not grow it)."""
    raw = orjson.dumps(body)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    return s


async def _completion(url: str, body: dict) -> tuple[int, dict, float]:  # type: ignore[type-arg]
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=body, timeout=timeout) as resp,
    ):
        return resp.status, await resp.json(), time.monotonic() - t0


async def test_a_client_that_stops_reading_is_dropped(
    gateway: tuple[str, web.Application], worker: tuple[Proc, str]
) -> None:
    """A streamed answer (n=4 x 480 tokens, 20 logprobs each: ~1.3 MB) to a client that reads
    none of it: the gateway drops it (a reset) once a write has waited client_write_timeout_s,
    and lets go of the request (its worker stream closed: an abort, when it still runs there).
    Meanwhile and after, another client is served, and the worker is never set aside (a slow
    client is not a silent worker)."""
    url, app = gateway
    proc, served = worker
    body = {"model": served, "prompt": "Once upon a time", "n": 4, "max_tokens": 480,
            "ignore_eos": True, "logprobs": 20, "stream": True}  # fmt: skip
    s = _non_reader(url, body)
    try:
        t0 = time.monotonic()
        while _tcp_state(s) == TCP_ESTABLISHED:
            assert time.monotonic() - t0 < 15, "the gateway kept the non-reading client for 15 s"
            assert not app[VIEW].failed, "the worker was set aside for a client's slowness"
            await asyncio.sleep(0.05)
        proxy = app[PROXY]
        for _ in range(100):
            stats = await asyncio.to_thread(worker_stats, proc)
            if stats["open_requests"] == 0 and not proxy._in_flight:
                break
            await asyncio.sleep(0.05)
        assert stats["open_requests"] == 0 and not proxy._in_flight, stats
        assert not app[VIEW].failed
        status, answer, took = await _completion(
            url, {"model": served, "prompt": "Once", "max_tokens": 4}
        )
        assert status == 200 and took < 5, (status, answer, took)
    finally:
        s.close()


async def test_a_client_that_reads_slowly_is_not_dropped(
    gateway: tuple[str, web.Application], worker: tuple[Proc, str]
) -> None:
    """A client that reads a little (its 8 KB buffer) every 0.4 s gets its whole answer, though
    each of the gateway's writes then waits ~2 s for its buffer to drain, twice
    client_write_timeout_s: the timeout counts from the client's last taking a byte, not from
    the write's start."""
    url, app = gateway
    _, served = worker
    body = {"model": served, "prompt": "Once upon a time", "n": 2, "max_tokens": 60,
            "ignore_eos": True, "logprobs": 5, "stream": True}  # fmt: skip
    s = _non_reader(url, body)
    got = b""
    try:
        s.settimeout(30)
        while not got.endswith(b"0\r\n\r\n"):
            await asyncio.sleep(0.4 * WRITE_TIMEOUT_S)
            chunk = await asyncio.to_thread(s.recv, 65536)
            assert chunk, got[-300:]
            got += chunk
    finally:
        s.close()
    assert b"data: [DONE]" in got and b'"error"' not in got, got[-300:]
    assert got.count(b'"finish_reason":"length"') == 2, got[-300:]
    assert not app[VIEW].failed


async def test_a_whole_answer_the_client_does_not_read_is_dropped(
    gateway: tuple[str, web.Application], worker: tuple[Proc, str]
) -> None:
    """Not streamed: the answer (~200 KB) is written within client_write_timeout_s or the client
    is dropped; before, aiohttp wrote it after the handler, for as long as the client held on."""
    url, app = gateway
    _, served = worker
    body = {"model": served, "prompt": "Once upon a time", "n": 4, "max_tokens": 100,
            "ignore_eos": True, "logprobs": 20}  # fmt: skip
    s = _non_reader(url, body)
    try:
        t0 = time.monotonic()
        while _tcp_state(s) == TCP_ESTABLISHED:
            assert time.monotonic() - t0 < 15, "the gateway kept the non-reading client for 15 s"
            await asyncio.sleep(0.1)
        assert not app[VIEW].failed
    finally:
        s.close()


async def test_sequences_per_request_are_bounded(
    redis_server,
    worker: tuple[Proc, str],
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """prompts x n is bounded by max_request_seqs (one request of 64 prompts at n=16, 1,024
    sequences, held a worker for minutes): a 400 naming the fields and the limit, before any
    worker is asked; at the limit, served."""
    assert GatewayConfig("local", "redis://x", "s").max_request_seqs == 128  # the default
    with pytest.raises(ValueError, match="max_request_seqs"):
        GatewayConfig("local", "redis://x", "s", max_request_seqs=0)
    async with serving(redis_server.url, worker[1], tmp_path, max_request_seqs=12) as (url, _):
        await _bounded(url, worker[1], 12)


async def _bounded(url: str, served: str, limit: int) -> None:
    over = {"model": served, "prompt": ["Once"] * 3, "n": 5, "max_tokens": 1}
    status, answer, _ = await _completion(url, over)
    assert status == 400, answer
    err = answer["error"]
    assert err["param"] == "n" and err["code"] == "too_many_sequences", err
    assert "3 prompts" in err["message"] and "n is 5" in err["message"], err
    assert "15 sequences" in err["message"] and f"at most {limit}" in err["message"], err
    status, answer, _ = await _completion(url, {**over, "n": 1, "prompt": ["Once"] * 13})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    status, answer, _ = await _completion(url, {**over, "n": 4})  # 12: at the limit
    assert status == 200 and len(answer["choices"]) == 12, answer
    chat = {"model": served, "messages": [{"role": "user", "content": "hi"}], "n": 16,
            "max_tokens": 1}  # fmt: skip
    async with (  # chat: its n alone
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=chat) as resp,
    ):
        err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == "n", err
    assert f"n is 16; at most {limit}" in err["message"], err
