"""Redis that answers but refuses: out of memory (maxmemory, noeviction), a replica (READONLY),
an ACL that forbids writes (NOPERM); and a Redis emptied under the pools. Real redis-servers;
the gateway's cluster view in process, and a gateway process for its readiness probe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest
import redis as redis_sync
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway import cluster
from gateway.config import GatewayConfig
from gateway.regions import DEFAULT_CATALOG, RegionCatalog
from kvstore.client import connect
from kvstore.demand import Demand, PoolInfo
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry
from tests.stack import get_json, start_gateway, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"


def _info(wid: str, region: str = "eu-west") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region=region, model="m", role="mixed",
                      url=f"http://127.0.0.1:9/{wid}", max_num_seqs=8, capacity_tokens=4096,
                      updated_at=time.time())  # fmt: skip


@asynccontextmanager
async def _view(url: str) -> AsyncIterator[cluster.ClusterView]:
    r = connect(url)
    try:
        yield cluster.ClusterView(GatewayConfig("eu-west", url, "s"), r,
                                  RegionCatalog.load(DEFAULT_CATALOG))  # fmt: skip
    finally:
        await r.aclose()


@contextmanager
def _out_of_memory(server: LocalRedis) -> Iterator[None]:
    """Redis at its maxmemory with noeviction: it refuses every command that may add memory
    (SET, HSET, SADD, EVAL that writes), and still runs reads, DEL, SREM and PEXPIRE."""
    with redis_sync.Redis.from_url(server.url) as admin:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        try:
            yield
        finally:
            admin.config_set("maxmemory", "0")


def _ids(view: cluster.ClusterView) -> list[str]:
    return sorted(w.worker_id for w in view.workers)


async def test_a_gateway_whose_writes_redis_refuses_keeps_reading_the_registry(
    redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis out of memory refuses the gateway's marker write at each registry read: the
    gateway still takes what it read (a worker that left is no longer routed to; the old code
    kept its whole snapshot, frozen, for as long as Redis refused), says so once, not at every
    read, and says when Redis takes its writes again."""
    admin = connect(redis.url)
    async with _view(redis.url) as view:
        registry = Registry(admin, ttl_s=60)
        for wid in ("w1", "w2"):
            await registry.register(_info(wid))
        await view.refresh()
        assert _ids(view) == ["w1", "w2"]
        with caplog.at_level("WARNING", logger="edgeinfer.gateway"), _out_of_memory(redis):
            await registry.deregister("w2", "m")  # (DEL and SREM: taken under OOM)
            for _ in range(4):
                await view.refresh()
            assert _ids(view) == ["w1"] and view.redis_ok
            assert view.refusal is not None and "OutOfMemoryError" in view.refusal
            # a session's claim, refused too: Redis still answers (reads), and it is said once
            for i in range(3):
                assert await view.claim(f"s{i}", view.workers[0]) is None
                assert view.redis_ok
                await view.refresh()
        await view.refresh()
        assert view.refusal is None
    await admin.aclose()
    said = [rec.getMessage() for rec in caplog.records]
    refused = [m for m in said if "refuses this gateway's writes" in m]
    assert len(refused) == 1 and "OutOfMemoryError" in refused[0], said
    assert not [m for m in said if "unreachable" in m], said


async def test_a_gateway_an_acl_forbids_to_write_sees_workers_join_and_leave(
    redis: LocalRedis,
) -> None:
    """The gateway's ACL user may read but not write (NOPERM): it still sees workers register
    and expire (whose stale ids it cannot prune: left to a reader that may), and its readiness
    check says what Redis refused, not that it is unreachable."""
    with redis_sync.Redis.from_url(redis.url) as admin:
        admin.acl_setuser("gw", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                          commands=["+@all", "-@write"])  # fmt: skip
    url = f"redis://gw:pw@127.0.0.1:{redis.port}/0"
    writer = connect(redis.url)
    async with _view(url) as view:
        await Registry(writer, ttl_s=60).register(_info("w1"))
        await Registry(writer, ttl_s=0.3).register(_info("short"))
        await view.refresh()
        assert _ids(view) == ["short", "w1"] and view.refreshed_at
        await Registry(writer, ttl_s=60).register(_info("w2"))
        await asyncio.sleep(0.4)  # "short" expired: its id is stale in the model's set
        await view.refresh()
        assert _ids(view) == ["w1", "w2"]
        assert view.refusal is not None and "NoPermissionError" in view.refusal
        assert not await view.ping()
        assert view.redis_error is not None and "NoPermissionError" in view.redis_error
        assert "unreachable" not in view.redis_error
    await writer.aclose()


async def test_a_gateway_reading_a_replica_follows_the_primary() -> None:
    """A gateway whose URL names a replica (READONLY to every write) reads the registry the
    workers write on the primary: a worker that joins, one whose entry expired."""
    a, b = LocalRedis().start(), LocalRedis()
    try:
        b.start()
        with redis_sync.Redis(port=a.port) as ra:
            ra.config_set("repl-diskless-sync-delay", "0")  # (5 s by default)
        with redis_sync.Redis(port=b.port) as rb:
            rb.replicaof("127.0.0.1", a.port)
            wait_until(lambda: rb.info("replication")["master_link_status"] == "up", 10,
                       "the replica in sync")  # fmt: skip
        primary = connect(a.url)
        async with _view(b.url) as view:
            await Registry(primary, ttl_s=60).register(_info("w1"))
            await Registry(primary, ttl_s=5).register(_info("short"))
            await primary.execute_command("WAIT", 1, 10_000)  # (replicated: no fixed sleep)
            await view.refresh()
            assert _ids(view) == ["short", "w1"]
            await Registry(primary, ttl_s=60).register(_info("w2"))
            await primary.execute_command("WAIT", 1, 10_000)
            deadline = time.monotonic() + 15  # short's entry expires (5 s)
            while _ids(view) != ["w1", "w2"] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                await view.refresh()
            assert _ids(view) == ["w1", "w2"]
            assert view.refusal is not None and "ReadOnlyError" in view.refusal
        await primary.aclose()
    finally:
        b.stop()
        a.stop()


async def test_pools_are_carried_through_an_emptied_redis(
    redis: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis emptied (FLUSHALL, a restart without its data): the pools it listed are carried,
    as the workers are, until they announce themselves again at their next heartbeat (the
    old code dropped them at once: a model only a pool serves was 503 no_workers, gone from
    /v1/models, and /readyz of a region with no worker running said 503 meanwhile); one that
    does not is given up after CARRY_S."""
    monkeypatch.setattr(cluster, "CARRY_S", 0.5)
    r = connect(redis.url)
    demand = Demand(r)
    async with _view(redis.url) as view:
        for pid in ("pool-back", "pool-gone"):
            await demand.announce(PoolInfo(pid, "eu-west", [f"{pid}-m"], 1, 0, time.time()), 60)
        await view.refresh()
        await r.flushall()
        await view.refresh()
        assert sorted(p.pool_id for p in view.pools) == ["pool-back", "pool-gone"]
        assert view.models() == ["pool-back-m", "pool-gone-m"]
        assert view.pool_region("pool-gone-m") == "eu-west"
        await demand.announce(PoolInfo("pool-back", "eu-west", ["pool-back-m"], 1, 0,
                                       time.time()), 60)  # fmt: skip
        await asyncio.sleep(0.6)
        await view.refresh()
        assert [p.pool_id for p in view.pools] == ["pool-back"]
        assert view.pool_region("pool-gone-m") is None
    await r.aclose()


def _ready(url: str, query: str = "") -> tuple[int, dict]:  # type: ignore[type-arg]
    t0 = time.monotonic()
    status, body = get_json(f"{url}/readyz{query}", timeout=2.0)
    assert time.monotonic() - t0 < 1.0, "a readiness probe must answer within ~1 s"
    return status, body


def test_readyz_says_redis_refuses_writes(tmp_path: Path) -> None:
    """/readyz checks that Redis takes a write, not only that it answers a ping: out of
    memory, it is not ready, and says why; `?redis=optional` stays ready (the gateway routes on
    the registry it still reads) and says why Redis is not well. Both answered it ready, with
    "redis": true (PING is answered under OOM)."""
    server = LocalRedis().start()
    (tmp_path / "regions.yaml").write_text(CATALOG)
    admin = redis_sync.Redis.from_url(server.url)
    gateway = None
    try:
        w = _info("w1", "local")
        asyncio.run(_register(server.url, w))
        gateway = start_gateway("gw", server.url, tmp_path / "regions.yaml", tmp_path, "local")
        wait_until(lambda: _ready(gateway.url)[1]["workers"] == 1, 20, "the worker")
        status, body = _ready(gateway.url)
        assert status == 200 and body["redis"] is True and body.get("redis_error") is None, body
        with _out_of_memory(server):
            status, body = _ready(gateway.url)
            assert status == 503 and body["ready"] is False and body["redis"] is False, body
            assert body["redis_error"] == "refused: OutOfMemoryError", body  # (no message)
            wait_until(lambda: _ready(gateway.url, "?redis=optional")[1]["redis"] is False, 10,
                       "a registry read refused its marker")  # fmt: skip
            status, body = _ready(gateway.url, "?redis=optional")
            assert status == 200 and body["ready"] is True and body["workers"] == 1, body
            assert body["redis_error"] == "refused: OutOfMemoryError", body  # (no message)
        status, body = _ready(gateway.url)
        assert status == 200 and body["redis"] is True and body["redis_error"] is None, body
    finally:
        if gateway is not None:
            gateway.stop()
        admin.close()
        server.stop()
    log = (tmp_path / "gw.log").read_text()
    assert "unreachable" not in log, log


async def _register(url: str, info: WorkerInfo) -> None:
    r: Redis = connect(url)
    try:
        await Registry(r, ttl_s=120).register(info)
    finally:
        await r.aclose()


def test_a_gateway_redis_refuses_from_the_start_says_so_without_its_address(
    tmp_path: Path,
) -> None:
    """A gateway whose Redis refuses it from the start (a password it lacks: NOAUTH) answers
    503 registry_unavailable saying Redis refused its reads, not that Redis is unreachable; nor
    does the client get Redis's own message, which names its address."""
    import openai

    server = LocalRedis().start()
    try:
        with redis_sync.Redis.from_url(server.url) as admin:
            admin.config_set("requirepass", "s3cret")
        (tmp_path / "regions.yaml").write_text(CATALOG)
        gateway = start_gateway("gw", server.url, tmp_path / "regions.yaml", tmp_path, "local")
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model="stories", prompt="Hi", max_tokens=1)
        finally:
            gateway.stop()
    finally:
        server.stop()
    assert e.value.status_code == 503 and e.value.code == "registry_unavailable", e.value
    message = e.value.message
    assert "Redis refused its reads: AuthenticationError" in message, message
    assert "unreachable" not in message and str(server.port) not in message, message


async def test_a_cluster_down_error_is_redis_down_not_a_refusal(redis: LocalRedis) -> None:
    """CLUSTERDOWN, TRYAGAIN and MOVED are ResponseErrors too, but not refusals of a Redis that
    is up: redis-py's cluster client has slept and reconnected before raising them, so a
    request that met one marks Redis down (requests skip it until a read succeeds) rather than
    leaving every later request to pay the same; OOM, READONLY and NOPERM stay refusals."""
    from redis.exceptions import ClusterDownError, OutOfMemoryError, TryAgainError

    async with _view(redis.url) as view:
        await view.refresh()
        assert view.redis_ok
        view.redis_failed(OutOfMemoryError("OOM command not allowed"))
        assert view.redis_ok and view.redis_problem == "refused: OutOfMemoryError"
        await view.refresh()  # (its write is taken: the refusal has ended)
        for error in (ClusterDownError("CLUSTERDOWN The cluster is down"), TryAgainError("x")):
            view.redis_failed(error)
            assert not view.redis_ok and view.refusal is None, error
            assert view.redis_problem == f"failed: {type(error).__name__}", view.redis_problem
            await view.refresh()
            assert view.redis_ok


async def test_a_registry_read_under_oom_survives_its_put_back_refused(redis: LocalRedis) -> None:
    """Out of memory, Redis takes a reader's SREM of a model it thought empty and refuses the
    SADD that puts it back once a worker is seen registering it (the race `_forget_models`
    covers): the read stands (it raised, and the gateway's snapshot froze until the worker's
    next heartbeat), and that heartbeat puts the model back."""
    admin = connect(redis.url)
    registry = Registry(admin, ttl_s=60)
    await registry.register(_info("w1"))
    with _out_of_memory(redis):
        await registry._forget_models(["m"])  # (w1 holds m: SREM taken, SADD refused)
        assert [w.worker_id for w in await registry.workers()] == []  # m is gone for now
    await registry.register(_info("w1"))  # its next heartbeat
    assert [w.worker_id for w in await registry.workers()] == ["w1"]
    await admin.aclose()


async def test_a_redis_that_cannot_save_is_read_on(tmp_path: Path) -> None:
    """MISCONF: a Redis whose snapshot failed (stop-writes-on-bgsave-error) refuses every write
    and answers reads, the commonest refusal, for which redis-py has no class. The gateway reads
    the registry on, says the refusal with Redis's code (it took it for Redis down: its snapshot
    froze, its log said 'unreachable' and requests skipped Redis's reads)."""
    import shutil
    import subprocess

    from kvstore.redis_server import find_free_port

    port, rdb = find_free_port(), tmp_path / "rdb"
    rdb.mkdir()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", str(rdb), "--save", "3600 1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis_sync.Redis(port=port) as r:
            wait_until(lambda: _answers(r), 10, "redis-server")
            admin = connect(url)
            await Registry(admin, ttl_s=60).register(_info("w1"))
            async with _view(url) as view:
                await view.refresh()
                rdb.rmdir()  # (its snapshot has nowhere to go)
                r.bgsave()
                wait_until(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "err", 10,
                           "the snapshot failed")  # fmt: skip
                await view.refresh()
                assert view.redis_ok and _ids(view) == ["w1"], view.redis_problem
                assert view.redis_problem == "refused: MISCONF", view.redis_problem
                view.redis_failed(ResponseError("MISCONF Redis is configured to save RDB ..."))
                assert view.redis_ok  # (a request's refused claim: Redis is not down)
            await admin.aclose()
    finally:
        proc.kill()  # (no SHUTDOWN: redis-py retries on the connection it drops, ~3 s)
        proc.wait()


def _answers(r: redis_sync.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis_sync.ConnectionError:
        return False
