"""The worker service under faults: its cluster state in Redis (against a real redis-server), its
internal API (a real worker process) and its KV transfer server (real sockets).

Every test uses its own model name, so tests share the session's Redis without seeing each
other's keys.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import signal
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import torch
from redis.asyncio import Redis

from kvstore.block_hash import block_hashes, cache_seed
from kvstore.demand import Demand
from kvstore.kv_transfer import ExportProgress, KVPages, KVTransferServer, PullRequest, pull_kv
from kvstore.prefix_index import CacheEventPublisher, PrefixIndex, marker_key, prefix_key
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry
from runtime.pool_manager import Managed, Pool, PoolConfig
from tests.stack import SECRET, Proc, _spawn, find_free_port, get_json, start_worker, worker_stats


def _info(wid: str, model: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region="r", model=model, role="mixed", url="u",
                      max_num_seqs=8, capacity_tokens=4096, updated_at=time.time())  # fmt: skip


async def test_a_pool_worker_that_dies_leaves_the_prefix_index_too(
    r: Redis, redis_server: LocalRedis, model: str
) -> None:
    """A pool's worker that dies unasked is deregistered by its pool at once: out of its model's
    set, where no registry reader then finds it dead, so none purged it from the prefix index.
    A block that live workers keep refreshing (a shared system prompt) listed it for good: one
    member more per crash. The pool purges it as it deregisters it."""
    registry = Registry(r, ttl_s=60.0)
    index = PrefixIndex(r)
    h = block_hashes(cache_seed("test/review"), list(range(16)), 4)
    dead = CacheEventPublisher(index, model, "p-w1")
    live = CacheEventPublisher(index, model, "p-w2")
    for pub in (dead, live):
        await registry.register(_info(pub.worker_id, model))
        pub.record(h, [])
        await pub.flush()
    assert await r.smembers(prefix_key(model, h[0])) == {b"p-w1", b"p-w2"}
    cfg = PoolConfig(region="r", models={model: "/x"}, redis_url=redis_server.url, secret="s")
    pool = Pool(cfg)
    pool.registry, pool.demand = registry, Demand(r)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
    await proc.wait()  # died on its own (killed -9, say): no close() of its publisher
    pool.managed["p-w1"] = Managed("p-w1", model, 0, proc, started=0.0, ready=1.0)
    assert await pool._reap({"p-w1", "p-w2"}, time.monotonic()) == {"p-w1"}
    assert [w.worker_id for w in await registry.workers(model)] == ["p-w2"]
    for x in h:
        assert await r.smembers(prefix_key(model, x)) == {b"p-w2"}
    assert not await r.exists(marker_key(model, "p-w1"))
    await live.close()


# --- a worker process ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, redis_server: LocalRedis):  # type: ignore[no-untyped-def]
    proc = start_worker("review", stories_dir, redis_server.url,
                        tmp_path_factory.mktemp("review"))  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


def _post(worker: Proc, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(f"{worker.url}{path}", data=orjson.dumps(body), method="POST",
                                 headers={"x-edgeinfer-secret": SECRET})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_stats(
    worker: Proc, check: Callable[[dict[str, Any]], bool], timeout_s: float = 20
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check(stats := worker_stats(worker)):
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_a_second_pull_under_a_pulling_id_leaves_the_first_abortable(worker: Proc) -> None:
    """A disaggregated request arriving under the id of one still pulling its KV took its place
    among the worker's pulls, and, refused by the engine (the id is in use), removed it: the
    first could no longer be aborted (nor cut off by a drain that ran out), its blocks reserved
    until its pull ended (up to 10 minutes with a prefill worker sending keepalives). The
    second is refused before it touches the first."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: a hung prefill
    source = f"127.0.0.1:{silent.getsockname()[1]}"
    body = {"request_id": "dup", "model": "stories", "prompt": "Once upon a time",
            "sampling": {"max_tokens": 2}, "kv_source": source}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_post, worker, "/internal/generate", body)
        _wait_stats(worker, lambda s: s["kv_imports_reserved"] == 1)
        status, text = _post(worker, "/internal/generate", body)
        assert b"already in use" in text, (status, text)
        assert _post(worker, "/internal/abort", {"request_id": "dup"}) == (200, b'{"aborted":true}')
        with contextlib.suppress(http.client.HTTPException, OSError):
            first.result(timeout=10)
        _wait_stats(worker, lambda s: not s["kv_imports_reserved"] and not s["open_requests"], 5)
    silent.close()


@pytest.mark.parametrize(("listen", "reach"), [("::1", "::1"), ("::", "::1"), ("::", "127.0.0.1")])
async def test_the_kv_transfer_server_listens_on_an_ipv6_address(listen: str, reach: str) -> None:
    """A worker given an IPv6 interface to bind (`--host ::`, which the command line expects)
    could not start: its KV transfer server bound with create_server's default family, IPv4,
    which refuses an IPv6 address. It serves pulls there; on "::" over IPv4 too, where the
    worker's advertised address (127.0.0.1 for `--host ::`) may point."""
    block = 4
    src = KVPages(torch.randn(2, 2, 8 * block, 2, 8), block)
    dst = KVPages(torch.zeros(2, 2, 8 * block, 2, 8), block)
    tokens = list(range(3 * block))

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        yield ExportProgress(len(pull.token_ids), [0, 1, 2], True)

    async def release(request_id: str) -> None:
        return None

    server = KVTransferServer(src, "c", "s", export, release)
    port = await server.start(listen, 0)
    try:
        result = await pull_kv(f"{reach}:{port}", PullRequest("r", tokens, 0, "c", "s"), dst,
                               [5, 6, 7])  # fmt: skip
    finally:
        await server.close()
    assert result.blocks == 3
    assert torch.equal(dst.blocks[:, :, 5:8], src.blocks[:, :, 0:3])


def test_a_connection_to_the_kv_port_that_sends_no_pull_is_no_work_in_flight(
    worker: Proc,
) -> None:
    """A connection to the KV transfer port that sends nothing (a TCP probe, a scanner holding
    it open) counted as a pull being served for up to 10 s: the worker took itself for busy,
    so its idle time (the pool's scale-down) started again, and a role change or a drain
    waited for it; anyone who could reach the port kept it so by connecting again."""
    before = worker_stats(worker)
    for _ in range(100):  # idle first: its time of last activity stays put
        time.sleep(0.1)
        if (now := worker_stats(worker))["last_active_at"] == before["last_active_at"]:
            break
        before = now
    host, port = before["kv_addr"].rsplit(":", 1)
    with socket.create_connection((host, int(port))):
        time.sleep(0.3)
        assert worker_stats(worker)["last_active_at"] == before["last_active_at"]
        status, text = _post(worker, "/internal/role", {"role": "mixed"})
        assert status == 200 and orjson.loads(text)["drained_s"] < 2.0, (status, text)


def test_a_role_change_whose_caller_hangs_up_leaves_the_worker_serving(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A role change whose caller gave up (its timeout, a rebalance stopped) while the worker's
    "draining" mark was still being written to Redis (Redis slow to answer) was cancelled
    before the code that clears the mark: the worker refused every request (503 draining) and
    told the registry so, for good, Redis answering again or not."""
    server = LocalRedis().start()
    try:
        w = start_worker("role", stories_dir, server.url, tmp_path, extra=["--ttl", "60"])
        try:
            assert server._proc is not None
            server._proc.send_signal(signal.SIGSTOP)  # each Redis write now takes its timeouts
            try:
                req = urllib.request.Request(f"{w.url}/internal/role", data=b'{"role": "decode"}',
                                             headers={"x-edgeinfer-secret": SECRET})  # fmt: skip
                with pytest.raises(TimeoutError):
                    urllib.request.urlopen(req, timeout=0.5)
            finally:
                server._proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 10  # (the worker sees the hang-up)
            while get_json(f"{w.url}/internal/health", SECRET)[1]["status"] != "ok":
                assert time.monotonic() < deadline, "still draining"
                time.sleep(0.05)
            body = {"request_id": "after", "model": "stories", "prompt": "Once",
                    "sampling": {"max_tokens": 2}}  # fmt: skip
            status, text = _post(w, "/internal/generate", body)
            assert status == 200 and b'"type":"done"' in text, (status, text)
        finally:
            w.stop()
    finally:
        server.stop()


@pytest.mark.parametrize("host", ["::", "::1"])
async def test_a_worker_on_an_ipv6_interface_advertises_where_it_answers(
    host: str, redis_server: LocalRedis, r: Redis, tmp_path: Path, stories_dir: Path
) -> None:
    """`--host ::` (or an IPv6 address): the worker listens on IPv6, and the URL it registers
    must reach it there: it advertised http://127.0.0.1:PORT for "::", where nothing answered
    (and "http://::1:PORT" for "::1", no URL), so no gateway could send it a request."""
    wid = f"w-ipv6-{uuid.uuid4().hex[:6]}"
    port = find_free_port()
    args = ["worker", "--model", str(stories_dir), "--served-model-name", wid, "--host", host,
            "--port", str(port), "--redis", redis_server.url, "--threads", "1",
            "--kv-cache-bytes", "4000000", "--heartbeat", "0.3", "--ttl", "30"]  # fmt: skip
    proc = _spawn(wid, args, tmp_path, port, f"http://[::1]:{port}")
    try:
        registry = Registry(r)
        infos: list[WorkerInfo] = []

        async def registered() -> bool:
            infos[:] = await registry.workers(wid)
            return bool(infos)

        deadline = time.monotonic() + 120
        while not await registered():
            assert proc.alive(), proc.tail()
            assert time.monotonic() < deadline, proc.tail()
            await asyncio.sleep(0.05)
        assert urllib.parse.urlsplit(infos[0].url).port == port, infos[0].url  # (a URL)
        status, body = get_json(f"{infos[0].url}/internal/health", SECRET)
        assert status == 200 and body["worker_id"] == infos[0].worker_id, infos[0].url
    finally:
        proc.popen.terminate()
        proc.popen.wait(30)


def test_a_worker_paused_past_its_ttl_says_so_when_it_registers_again(
    tmp_path: Path, stories_dir: Path, redis_server: LocalRedis
) -> None:
    """A worker stopped (SIGSTOP, a frozen VM) for longer than its ttl found its registry entry
    gone when it ran again, and logged 'Redis restarted or flushed?', sending an operator to a
    Redis that was fine."""
    proc = start_worker("paused", stories_dir, redis_server.url, tmp_path)  # ttl 1.5 s
    try:
        registry = redis.Redis.from_url(redis_server.url)
        key = f"ei:w:{{{proc.meta['worker_id']}}}"
        proc.popen.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while registry.exists(key) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not registry.exists(key), "the paused worker's entry did not expire"
        finally:
            proc.popen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while "registry entry was gone" not in proc.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = proc.log.read_text()
        assert "registry entry was gone (it expired: this worker last renewed it" in log, log
        assert "was the process paused?" in log and "Redis restarted" not in log, log
    finally:
        proc.stop()
