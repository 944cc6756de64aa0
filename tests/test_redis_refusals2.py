"""Redis refusing writes, continued: a client whose URL names a replica (READONLY to every
write) does not reconnect at each refused write, and still follows its address to a primary;
a request for a model only a pool serves, under Redis out of memory, gets a 503 that says why,
logged once. Real redis-servers and a gateway process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import redis as redis_sync
from redis.backoff import NoBackoff

from kvstore.client import READONLY_RECONNECT_S, _Retry, connect
from kvstore.demand import Demand, PoolInfo
from kvstore.redis_server import LocalRedis
from tests.stack import start_gateway, wait_until
from tests.test_redis_degraded import CATALOG, _out_of_memory
from tests.test_redis_faults2 import SwitchingProxy


@contextmanager
def _primary_and_replica() -> Iterator[tuple[LocalRedis, LocalRedis]]:
    """Two redis-servers: A the primary, B its replica, in sync."""
    a, b = LocalRedis().start(), LocalRedis()
    try:
        b.start()
        with redis_sync.Redis(port=a.port) as ra, redis_sync.Redis(port=b.port) as rb:
            ra.config_set("repl-diskless-sync-delay", "0")  # (5 s by default)
            rb.replicaof("127.0.0.1", a.port)
            wait_until(lambda: rb.info("replication")["master_link_status"] == "up", 10,
                       "the replica in sync")  # fmt: skip
        yield a, b
    finally:
        b.stop()
        a.stop()


def _connections(admin: redis_sync.Redis) -> int:
    """Connections `admin`'s server has accepted since it started."""
    return int(admin.info("stats")["total_connections_received"])


async def test_a_client_whose_url_names_a_replica_keeps_its_connection() -> None:
    """Writes refused READONLY by the replica the URL names (a gateway reading a replica: its
    registry reads' marker, its session claims) leave the connection open, and reads go on on
    it: the old client closed it at each one, and 100 refused writes opened 100 connections."""
    with _primary_and_replica() as (_, b), redis_sync.Redis(port=b.port) as admin:
        r = connect(b.url)
        try:
            await r.ping()
            before = _connections(admin)
            for i in range(50):
                with pytest.raises(redis_sync.exceptions.ReadOnlyError):
                    await r.set("k", i)
                pipe = r.pipeline(transaction=False)
                pipe.set("p", i)
                pipe.pexpire("p", 60_000)
                with pytest.raises(redis_sync.exceptions.ReadOnlyError):
                    await pipe.execute()
                assert await r.get("k") is None
            # the first refusal closes it (a failover may have demoted its server), and one
            # after 0.5 s, 1.5 s, 3.5 s... (READONLY_RECONNECT_S): a slow run's few
            assert _connections(admin) - before <= 4, _connections(admin) - before
        finally:
            await r.aclose()


async def test_a_client_on_a_replica_follows_its_address_to_a_primary() -> None:
    """The client's address leads to a replica, whose READONLY replies keep its connection
    open, and then is repointed to a primary (a failover whose DNS name or proxy moved late,
    a replica promoted behind a load balancer): the client's writes reach the primary within
    about the time they were refused (READONLY_RECONNECT_S, doubling), not never."""
    with _primary_and_replica() as (a, b):
        proxy = SwitchingProxy(b.port)
        r = connect(proxy.url)
        try:
            refused_until = time.monotonic() + 1.0
            while time.monotonic() < refused_until:
                with pytest.raises(redis_sync.exceptions.ReadOnlyError):
                    await r.set("k", "1")
                await asyncio.sleep(0.02)
            proxy.backend = a.port
            t0 = time.monotonic()
            while True:
                try:
                    assert await r.set("k", "2")
                    break
                except redis_sync.exceptions.ReadOnlyError:
                    assert time.monotonic() - t0 < 5, "the client never left the replica"
                    await asyncio.sleep(0.02)
            with redis_sync.Redis(port=a.port) as ra:
                assert ra.get("k") == b"2"
        finally:
            await r.aclose()
            proxy.stop()


def test_readonly_replies_close_a_connection_less_and_less_often() -> None:
    """When READONLY replies close a connection (True): at the first, then once each time the
    connection has stayed open READONLY_RECONNECT_S's first, twice that, ... up to the last;
    after a spell with none (a failover begins anew), at once again."""
    first, last = READONLY_RECONNECT_S
    retry = _Retry(NoBackoff(), 0)
    assert retry._reconnect(100.0)
    assert not retry._reconnect(100.0 + first / 2)
    assert retry._reconnect(100.0 + first)  # open for `first`: now for 2 * first
    t = 100.0 + first
    assert not retry._reconnect(t + 2 * first - 0.01)
    assert retry._reconnect(t + 2 * first)
    t += 2 * first
    for _ in range(20):  # the wait doubles up to `last`, and stays there
        t += last
        assert retry._reconnect(t)
    assert not retry._reconnect(t + last - 0.01)
    assert retry._reconnect(t + 3 * last)  # a quiet spell longer than `last`: at once
    assert not retry._reconnect(t + 3 * last + first / 2)


async def _announce(url: str, pool: PoolInfo) -> None:
    r = connect(url)
    try:
        await Demand(r).announce(pool, 600)
    finally:
        await r.aclose()


def test_a_request_for_a_pool_model_under_oom_says_why_and_is_logged_once(
    tmp_path: Path,
) -> None:
    """A model only a pool serves, and Redis out of memory: the request's hold (the pool's
    signal) is refused, and no worker the pool started could register. Each request gets a 503
    at once, with Retry-After, that says Redis refuses the gateway's writes and names the error;
    the gateway logs it once, not once per request. The old gateway logged a warning per
    request and answered 'no worker is serving model' (no_workers), naming no cause. Once Redis
    takes writes again, requests are held for the pool again."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    server = LocalRedis().start()
    gateway = None
    try:
        pool = PoolInfo("pool-x", "local", ["ghost"], 1, 0, time.time())
        asyncio.run(_announce(server.url, pool))
        gateway = start_gateway("gw", server.url, tmp_path / "regions.yaml", tmp_path, "local",
                                ["--hold-timeout", "2"])  # fmt: skip
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        wait_until(lambda: "ghost" in [m.id for m in client.models.list().data], 20, "the pool")
        with _out_of_memory(server):
            for _ in range(5):
                t0 = time.monotonic()
                with pytest.raises(openai.APIStatusError) as e:
                    client.completions.create(model="ghost", prompt="Hi", max_tokens=1)
                assert time.monotonic() - t0 < 1.5  # (at once: not the hold's 2 s)
                assert e.value.status_code == 503, e.value.body
                body = e.value.body
                assert isinstance(body, dict) and body["code"] == "pool_unavailable", body
                assert "OutOfMemoryError" in body["message"], body
                assert "refuses this gateway's writes" in body["message"], body
                assert "127.0.0.1" not in body["message"], body  # (Redis's address is not said)
                assert int(e.value.response.headers["Retry-After"]) >= 1
        t0 = time.monotonic()  # Redis takes writes: held for the pool, which starts nothing
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="ghost", prompt="Hi", max_tokens=1)
        assert e.value.status_code == 503 and time.monotonic() - t0 >= 1.9, e.value.body
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "worker_starting"
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()
    log = (tmp_path / "gw.log").read_text()
    said = [line for line in log.splitlines() if "cannot ask the pools" in line]
    assert len(said) == 1 and "OutOfMemoryError" in said[0], log[-3000:]
    assert "cannot signal the pool" not in log, log[-3000:]
