"""kvstore on a Redis Cluster: every store, through connect("redis+cluster://..."), against a real
local cluster of three primaries (kvstore.redis_server.LocalRedisCluster), with the keys of one
operation spread over different nodes; and the pool's wake-up subscription hearing a wake-up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis, RedisCluster

from kvstore.client import RETRIES, cluster_seed, connect
from kvstore.demand import (
    Demand,
    ModelStatus,
    PoolInfo,
    Wakeups,
    start_key,
    wait_key,
    wake_channel,
)
from kvstore.keys import model_workers_key, session_key, worker_key
from kvstore.placement import Placement, SessionStore
from kvstore.prefix_index import PrefixIndex, marker_key, prefix_key
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedisCluster
from kvstore.registry import Registry
from kvstore.tokenizer_store import fetch_tokenizer_files, publish_tokenizer, tokenizer_key


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    """One local 3-primary Redis Cluster for the module (it takes ~2 s to start)."""
    try:
        c = LocalRedisCluster(primaries=3)
    except RuntimeError as e:  # redis-server is not installed
        pytest.skip(str(e))
    with c:
        yield c


@pytest.fixture
async def rc(cluster: LocalRedisCluster) -> AsyncIterator[Redis]:
    """A cluster client from connect(), every primary emptied before each test."""
    client = connect(cluster.url)
    await client.flushall()  # (a cluster client sends it to every primary)
    yield client
    await client.aclose()


def on_node(
    cluster: LocalRedisCluster, node: int, make_key: Callable[[str], str], stem: str
) -> str:
    """The first id `stem`-0, `stem`-1, ... whose key (make_key(id)) is served by node `node`."""
    return next(
        i for i in (f"{stem}-{n}" for n in range(10_000)) if cluster.node_of(make_key(i)) == node
    )


def held_by(cluster: LocalRedisCluster, key: str) -> list[int]:
    """The nodes whose own keyspace holds `key`, as the nodes say (KEYS on each, which answers
    for that node alone)."""
    found = []
    for i, node in enumerate(cluster.nodes):
        with redis.Redis(port=node.port) as one:
            if one.keys(key):
                found.append(i)
    return found


async def heard(wakeups: Wakeups, models: set[str], timeout_s: float = 2.0) -> set[str]:
    """What `wakeups` hears until it has heard `models` (or `timeout_s` passed). On a cluster,
    one wait sometimes returns before the last of several wake-ups published just before it
    has reached the subscriber (seen: 7 batches in 200; none on one Redis); the next wait has
    it (the pool wakes twice, each model still once a wait)."""
    got: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not models <= got and time.monotonic() < deadline:
        got |= await wakeups.next(max(0.0, deadline - time.monotonic()))
    return got


def worker(wid: str, model: str, region: str = "eu") -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid, region=region, model=model, role="mixed",
        url=f"http://127.0.0.1:9000/{wid}", max_num_seqs=8, capacity_tokens=4096,
        updated_at=time.time(),
    )  # fmt: skip


# --- connect() ---------------------------------------------------------------------------------


def test_connect_picks_a_cluster_or_a_plain_client_by_the_url_scheme() -> None:
    plain = connect("redis://127.0.0.1:6379/2")
    assert type(plain) is Redis and plain.connection_pool.connection_kwargs["db"] == 2
    for url in ("redis+cluster://u:pw@10.0.0.2:7000", "REDIS+CLUSTER://10.0.0.2:7000/0",
                "rediss+cluster://10.0.0.2:7000/"):  # fmt: skip
        c = connect(url, timeout_s=2.5)
        assert isinstance(c, RedisCluster), url
        kwargs = c.nodes_manager.connection_kwargs  # (the settings of its nodes' connections)
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 2.5
        assert c.retry.get_retries() == RETRIES
        assert list(c.nodes_manager.startup_nodes) == ["10.0.0.2:7000"]
        assert (kwargs["connection_class"].__name__ == "SSLConnection") == url.startswith("rediss")
        assert kwargs["password"] == ("pw" if "pw@" in url else None)
    assert cluster_seed("rediss+cluster://h:7000/0?ssl_cert_reqs=none") == (
        "rediss://h:7000/0?ssl_cert_reqs=none"
    )
    assert cluster_seed("redis://h:7000/0") is None and cluster_seed("unix:///tmp/r.sock") is None
    with pytest.raises(ValueError, match="database 0 only"):
        connect("redis+cluster://h:7000/3")


# --- the stores ----------------------------------------------------------------------------


async def test_registry_and_sessions_work_across_nodes(
    cluster: LocalRedisCluster, rc: Redis
) -> None:
    model = on_node(cluster, 2, model_workers_key, "model")
    wid = on_node(cluster, 1, worker_key, "w")
    sid = on_node(cluster, 0, session_key, "s")
    # one heartbeat's pipeline writes to two nodes at least (its worker's hash, its model's set)
    assert held_by(cluster, worker_key(wid)) == [] and cluster.node_of(worker_key(wid)) == 1
    registry = Registry(rc, ttl_s=30.0)
    info = worker(wid, model)
    assert await registry.heartbeat(info)  # created
    assert not await registry.heartbeat(info)  # renewed
    assert held_by(cluster, worker_key(wid)) == [1]
    assert held_by(cluster, model_workers_key(model)) == [2]
    assert await registry.workers(model) == [info]
    assert [w.worker_id for w in await registry.workers()] == [wid]
    assert model in await registry.models()

    sessions = SessionStore(rc)
    here, there = Placement(wid, "eu"), Placement("w-other", "us")
    assert await sessions.claim(sid, here) == here
    assert await sessions.claim(sid, there) == here  # claimed first: kept
    assert await sessions.move(sid, "w-nobody", there) == here  # not on that worker: kept
    assert await sessions.move(sid, wid, there) == there  # (a Lua script on node 0)
    assert await sessions.get(sid) == there
    assert held_by(cluster, session_key(sid)) == [0]

    await registry.deregister(wid, model)
    assert await registry.workers(model) == []


async def test_prefix_index_publishes_reads_and_purges_on_a_cluster(
    cluster: LocalRedisCluster, rc: Redis
) -> None:
    """The model's blocks live on a node other than the one the URL names: a purge's SCAN
    must reach it (a cluster client SCANs every primary)."""
    model = on_node(cluster, 2, lambda m: prefix_key(m, b"\0"), "model")
    index = PrefixIndex(rc)
    hashes = [bytes([i]) * 8 for i in range(5)]
    assert not await index.publish(model, "w1", hashes, [])  # a first publish: no marker yet
    assert await index.publish(model, "w1", [], [])
    await index.publish(model, "w2", hashes[:2], [])
    assert await index.longest_prefixes(model, hashes) == {"w1": 5, "w2": 2}
    assert held_by(cluster, prefix_key(model, hashes[0])) == [2]
    assert held_by(cluster, marker_key(model, "w1")) == [2]

    await index.purge_worker(model, "w1")
    assert await index.longest_prefixes(model, hashes) == {"w2": 2}
    assert held_by(cluster, marker_key(model, "w1")) == []
    assert not await index.publish(model, "w1", [], [])  # its marker went with the purge


async def test_tokenizer_files_are_stored_and_fetched_on_a_cluster(
    cluster: LocalRedisCluster, rc: Redis, tmp_path: Path
) -> None:
    model = on_node(cluster, 1, lambda m: tokenizer_key(m, "rev1"), "model")
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert await publish_tokenizer(rc, model, "rev1", tmp_path)
    assert not await publish_tokenizer(rc, model, "rev1", tmp_path)  # the first copy stays
    files = await fetch_tokenizer_files(rc, model, "rev1")
    assert files is not None and files["tokenizer.json"] == '{"model": {}}'
    assert held_by(cluster, tokenizer_key(model, "rev1")) == [1]
    assert await fetch_tokenizer_files(rc, model, "rev2") is None


async def test_demand_holds_and_wakes_the_pools_on_a_cluster(
    cluster: LocalRedisCluster, rc: Redis
) -> None:
    """A hold (its wait set on one node, the region's wake-up channel on another) and a wake
    reach a pool's subscription (on its own client, as the pool holds it); so does a PUBLISH
    that enters the cluster at a node that does not serve the channel's slot, since a cluster
    carries every PUBLISH to all its nodes."""
    region = on_node(cluster, 0, wake_channel, "region")
    model = on_node(cluster, 1, lambda m: wait_key(m, region), "model")
    assert cluster.node_of(wait_key(model, region)) != cluster.node_of(wake_channel(region))
    pools = connect(cluster.url, timeout_s=5.0)  # (the pool's client for its subscription)
    d = Demand(rc)
    wakeups = Demand(pools).wakeups(region)
    try:
        assert await wakeups.next(0.2) == set()  # subscribed now; nothing yet
        now = time.time()
        await d.hold(model, region, "req-1", now + 60)
        await d.hold(model, region, "req-2", now - 1)  # past its deadline
        await d.wake("other", region)
        assert await heard(wakeups, {model, "other"}) == {model, "other"}
        assert await d.waiting(model, region) == 1
        assert held_by(cluster, wait_key(model, region)) == [1]

        for i, node in enumerate(cluster.nodes):  # a PUBLISH sent to each node in turn
            with redis.Redis(port=node.port) as one:
                one.publish(wake_channel(region), f"via-{i}")
            assert await wakeups.next(2.0) == {f"via-{i}"}

        # its node drops the subscription: the wait raises, the next one subscribes again
        # (re-reading the cluster's slots first) and hears what comes after
        channel_node = cluster.nodes[cluster.node_of(wake_channel(region))]
        with redis.Redis(port=channel_node.port) as one:
            assert one.execute_command("CLIENT", "KILL", "TYPE", "pubsub") == 1
        with pytest.raises(redis.exceptions.ConnectionError):
            await wakeups.next(2.0)
        assert await wakeups.next(0.2) == set()
        await d.wake("again", region)
        assert await wakeups.next(2.0) == {"again"}

        await d.release(model, region, "req-1")
        assert await d.waiting(model, region) == 0
    finally:
        await wakeups.aclose()
        await pools.aclose()

    # the pool's other keys: registration, start claims (Lua), status, events
    await d.announce(PoolInfo("pool-1", region, models=[model]), ttl_s=30.0)
    assert [p.pool_id for p in await d.pools()] == ["pool-1"]
    assert await d.claim_start(model, region, "pool-1", ttl_s=30.0)
    assert not await d.claim_start(model, region, "pool-2", ttl_s=30.0)
    assert await d.renew_start(model, region, "pool-1", ttl_s=30.0)
    assert await d.start_owner(model, region) == "pool-1"
    await d.release_start(model, region, "pool-1")
    assert held_by(cluster, start_key(model, region)) == []
    await d.set_status(model, region, ModelStatus("starting", "pool-1"), ttl_s=30.0)
    status = await d.status(model, region)
    assert status is not None and status.state == "starting"
    await d.record(region, "start", model=model)
    assert [e["event"] for e in await d.events(region)] == ["start"]
    await d.withdraw("pool-1")
    assert await d.pools() == []


async def test_a_running_pool_is_woken_through_the_cluster(
    cluster: LocalRedisCluster, rc: Redis
) -> None:
    """A real Pool (its ticks and its wake-up subscription on the cluster) starts a worker at
    once when a gateway wakes it, not at its next tick 5 s later."""
    from runtime.pool_manager import Pool, PoolConfig

    region = on_node(cluster, 2, wake_channel, "region")
    spawned: list[str] = []

    async def spawn(argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
        spawned.append(argv[argv.index("--served-model-name") + 1])
        proc = await asyncio.create_subprocess_exec("sleep", "60", stdout=asyncio.subprocess.PIPE)
        return proc, "exec"

    cfg = PoolConfig(region=region, models={"m": "/x"}, redis_url=cluster.url, secret="s",
                     max_workers=2, tick_s=5.0, zygote=False, pool_id="pool-m")  # fmt: skip
    pool = Pool(cfg)
    pool._spawn_process = spawn  # type: ignore[method-assign,assignment]
    run = asyncio.ensure_future(pool.run())
    try:
        d = Demand(rc)
        t0 = time.monotonic()
        while not await d.pools() and time.monotonic() - t0 < 4.0:  # announced, then listening
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # (its first tick done: waiting for wake-ups)
        assert spawned == []  # nobody waits
        t0 = time.monotonic()
        await d.wake("m", region)
        while not spawned and time.monotonic() - t0 < 4.0:
            await asyncio.sleep(0.05)
        assert spawned == ["m"] and time.monotonic() - t0 < 4.0  # woken, not its next tick
    finally:
        pool.stop()
        async with asyncio.timeout(30):
            await run
