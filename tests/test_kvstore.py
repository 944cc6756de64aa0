"""kvstore's Redis state against a real redis-server: keys, registry, session placement, restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import redis.exceptions
from redis.asyncio import Redis
from redis.crc import key_slot

from kvstore.client import connect
from kvstore.keys import MODELS_KEY, model_workers_key, session_key, worker_key
from kvstore.placement import Placement, SessionStore
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry

if TYPE_CHECKING:
    from gateway.cluster import ClusterView


@pytest.fixture
async def r(redis_server: LocalRedis) -> AsyncIterator[Redis]:
    """A client on the session's Redis, emptied before each test."""
    client = connect(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()


def worker(wid: str, model: str = "m1", region: str = "eu", **kw: object) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid,
        region=region,
        model=model,
        role="mixed",
        url=f"http://127.0.0.1:9000/{wid}",
        max_num_seqs=8,
        capacity_tokens=4096,
        **kw,  # type: ignore[arg-type]
    )


# --- keys -------------------------------------------------------------------------------------


def test_keys_carry_hash_tags() -> None:
    assert worker_key("w1") == "ei:w:{w1}"
    assert model_workers_key("org/Model-1") == "ei:m:{org/Model-1}:workers"
    assert session_key("s:1") == "ei:s:{s:1}"
    assert MODELS_KEY == "ei:models"
    # A Redis Cluster hashes only the part in braces.
    assert key_slot(worker_key("w1").encode()) == key_slot(b"w1")
    assert key_slot(model_workers_key("m").encode()) == key_slot(b"m")
    assert key_slot(session_key("abc").encode()) == key_slot(b"abc")


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "{x}", "x" * 257])
def test_keys_reject_bad_ids(bad: str) -> None:
    for make in (worker_key, model_workers_key, session_key):
        with pytest.raises(ValueError):
            make(bad)


# --- registry ---------------------------------------------------------------------------------


async def test_register_list_and_filter_by_model(r: Redis) -> None:
    reg = Registry(r)
    a, b, c = worker("a", "m1", running=2), worker("b", "m2"), worker("c", "m1", draining=True)
    for w in (c, b, a):
        await reg.register(w)
    assert await reg.workers("m1") == [a, c]  # full round trip, ordered by id
    assert await reg.workers("m2") == [b]
    assert await reg.workers("nope") == []
    assert [w.worker_id for w in await reg.workers()] == ["a", "b", "c"]
    assert await reg.models() == ["m1", "m2"]
    assert 0 < await r.pttl(worker_key("a")) <= 10_000


async def test_heartbeat_updates_state(r: Redis) -> None:
    reg = Registry(r)
    await reg.register(worker("a"))
    await reg.heartbeat(worker("a", running=5, waiting=1, free_kv_blocks=7, updated_at=12.5))
    (got,) = await reg.workers("m1")
    assert (got.running, got.waiting, got.free_kv_blocks, got.updated_at) == (5, 1, 7, 12.5)


async def test_worker_without_heartbeat_expires_and_is_pruned(r: Redis) -> None:
    reg = Registry(r, ttl_s=0.3)
    await reg.register(worker("dead", "m1"))
    await reg.register(worker("alive", "m1"))
    await reg.register(worker("lonely", "m2"))
    for _ in range(6):  # 0.6 s: twice the TTL; only "alive" keeps heartbeating
        await asyncio.sleep(0.1)
        await reg.heartbeat(worker("alive", "m1"))
    assert [w.worker_id for w in await reg.workers("m1")] == ["alive"]
    assert not await r.sismember(model_workers_key("m1"), "dead")
    assert await reg.models() == ["m1"]  # m2 has no live worker left
    assert not await r.sismember(model_workers_key("m2"), "lonely")


async def test_a_model_with_no_worker_left_leaves_the_models_set(r: Redis) -> None:
    """Every gateway reads each model's set of `ei:models` twice a second: a model nobody serves
    any more leaves it (it only grew), and comes back with its next worker's heartbeat."""
    reg = Registry(r, ttl_s=0.2)
    await reg.register(worker("gone", "m2"))
    await reg.register(worker("alive", "m1"))
    await asyncio.sleep(0.3)
    await reg.heartbeat(worker("alive", "m1"))
    assert [w.worker_id for w in await reg.workers()] == ["alive"]  # prunes "gone"
    await reg.workers()  # finds m2's set empty
    assert await r.smembers(MODELS_KEY) == {b"m1"}
    await reg.heartbeat(worker("back", "m2"))
    assert await r.sismember(MODELS_KEY, "m2")
    assert await reg.models() == ["m1", "m2"]


async def test_a_model_registered_while_a_reader_found_it_empty_stays_listed(r: Redis) -> None:
    """A reader found m1's set empty; before its SREM, a worker's heartbeat wrote m1's set and
    `ei:models` (in that order): the reader sees the worker in the set and puts m1 back, where
    gateways would not see that worker until its next heartbeat."""
    reg = Registry(r)
    await reg.register(worker("new", "m1"))  # (after the reader's SMEMBERS, before its SREM)
    await reg._forget_models(["m1", "m2"])  # the rest of that reader's workers()
    assert await r.smembers(MODELS_KEY) == {b"m1"}
    assert [w.worker_id for w in await reg.workers()] == ["new"]


async def test_deregister_removes_at_once(r: Redis) -> None:
    reg = Registry(r)
    await reg.register(worker("a"))
    await reg.register(worker("b"))
    await reg.deregister("a", "m1")
    assert [w.worker_id for w in await reg.workers("m1")] == ["b"]
    assert not await r.exists(worker_key("a"))
    assert not await r.sismember(model_workers_key("m1"), "a")


async def test_worker_that_switched_model_leaves_the_old_set(r: Redis) -> None:
    reg = Registry(r)
    await reg.register(worker("a", "m1"))
    await reg.register(worker("a", "m2"))
    assert await reg.workers("m1") == []
    assert [w.model for w in await reg.workers()] == ["m2"]
    assert not await r.sismember(model_workers_key("m1"), "a")


async def test_unreadable_worker_hash_is_skipped(r: Redis) -> None:
    reg = Registry(r)
    await reg.register(worker("good"))
    await r.hset(worker_key("bad"), mapping={"worker_id": '"bad"'})
    await r.sadd(model_workers_key("m1"), "bad")
    assert [w.worker_id for w in await reg.workers("m1")] == ["good"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_num_seqs", '"8"'), ("running", "true"), ("draining", "0"), ("role", '"both"'),
     ("url", "5"), ("updated_at", '"now"')],
)  # fmt: skip
async def test_a_worker_hash_with_a_field_of_another_type_is_skipped(
    r: Redis, field: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry hash whose field has another type than WorkerInfo says (written by something
    other than a worker of this version) was read as it was: a count as a string made every
    route of its model fail with a TypeError (comparing it with a load), twice a second on
    every gateway, for as long as the entry lived. It is skipped, as a garbled hash is."""
    from gateway.regions import DEFAULT_CATALOG, RegionCatalog
    from gateway.routing import Router

    reg = Registry(r)
    await reg.register(worker("good", region="eu-west"))
    await reg.register(worker("bad", region="eu-west"))
    await r.hset(worker_key("bad"), field, value)
    with caplog.at_level(logging.WARNING, logger="kvstore.registry"):
        listed = await reg.workers("m1")
        assert [w.worker_id for w in listed] == ["good"]
        for _ in range(3):  # read again and again (a gateway: twice a second): said once
            assert [w.worker_id for w in await reg.workers()] == ["good"]
    said = [rec.getMessage() for rec in caplog.records if "skipping worker bad" in rec.getMessage()]
    assert len(said) == 1 and field in said[0], said
    route = Router("eu-west", RegionCatalog.load(DEFAULT_CATALOG)).route("m1", listed)
    assert [w.worker_id for w in route.candidates] == ["good"]


def test_worker_fields_read_back_as_written() -> None:
    """Every field of a worker's entry reads back equal, a float field written as a whole
    number included (JSON writes 2.0 as 2.0, another writer may write 2)."""
    info = dataclasses.replace(worker("a"), role="decode", draining=True, heartbeat_s=2.0,
                               kv_addr="h:1")  # fmt: skip
    raw = info.to_redis()
    assert WorkerInfo.from_redis(raw) == info
    assert WorkerInfo.from_redis(raw | {"heartbeat_s": "2"}).heartbeat_s == 2.0


async def test_an_unusable_id_in_a_set_is_dropped_not_fatal(r: Redis) -> None:
    """An id no worker could have written (a brace would move the Cluster hash tag), added to a
    registry set by something else, is dropped from its set; the refresh still lists every
    worker instead of raising on every gateway's read."""
    from kvstore.demand import POOLS_KEY, Demand, PoolInfo

    reg = Registry(r)
    await reg.register(worker("good"))
    await r.sadd(model_workers_key("m1"), "bad}id")
    await r.sadd(MODELS_KEY, "bad{model")
    assert [w.worker_id for w in await reg.workers()] == ["good"]
    assert [w.worker_id for w in await reg.workers("m1")] == ["good"]
    assert not await r.sismember(model_workers_key("m1"), "bad}id")
    assert not await r.sismember(MODELS_KEY, "bad{model")

    demand = Demand(r)
    await demand.announce(PoolInfo(pool_id="p1", region="eu", models=["m1"], max_workers=1), 10)
    await r.sadd(POOLS_KEY, "x" * 300)
    assert [p.pool_id for p in await demand.pools()] == ["p1"]
    assert await r.scard(POOLS_KEY) == 1


def test_registry_rejects_bad_ttl() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        Registry(connect("redis://127.0.0.1:1/0"), ttl_s=0)


# --- session placement ------------------------------------------------------------------------


async def test_claim_new_session_and_get(r: Redis) -> None:
    store = SessionStore(r)
    assert await store.get("s1") is None
    p = Placement("w1", "eu")
    assert await store.claim("s1", p) == p
    assert await store.get("s1") == p
    assert await store.claim("s1", Placement("w2", "us")) == p  # already placed: the first wins
    assert await r.get(session_key("s1")) == b'{"worker_id":"w1","region":"eu"}'


async def test_concurrent_claims_agree_on_one_winner(r: Redis) -> None:
    store = SessionStore(r)
    tries = [Placement(f"w{i}", "eu") for i in range(20)]
    results = await asyncio.gather(*(store.claim("s1", p) for p in tries))
    assert len(set(map(dataclasses.astuple, results))) == 1
    assert results[0] in tries
    assert await store.get("s1") == results[0]


async def test_get_renews_the_idle_ttl(r: Redis) -> None:
    store = SessionStore(r, idle_ttl_s=100.0)
    await store.claim("s1", Placement("w1", "eu"))
    await r.pexpire(session_key("s1"), 500)
    assert await r.pttl(session_key("s1")) <= 500
    await store.get("s1")
    assert 50_000 < await r.pttl(session_key("s1")) <= 100_000


async def test_session_expires_when_idle(r: Redis) -> None:
    store = SessionStore(r, idle_ttl_s=0.2)
    await store.claim("s1", Placement("w1", "eu"))
    await asyncio.sleep(0.35)
    assert await store.get("s1") is None


async def test_move_is_a_compare_and_set(r: Redis) -> None:
    store = SessionStore(r, idle_ttl_s=100.0)
    w1, w2, w3 = Placement("w1", "eu"), Placement("w2", "eu"), Placement("w3", "us")
    assert await store.move("s1", None, w1) == w1  # absent: moves
    assert await store.move("s1", None, w2) == w1  # present, and None expects absent: refused
    assert await store.move("s1", "w9", w2) == w1  # another worker holds it: refused
    assert await store.get("s1") == w1
    await r.pexpire(session_key("s1"), 500)
    assert await store.move("s1", "w1", w2) == w2  # from matches: moves
    assert 50_000 < await r.pttl(session_key("s1")) <= 100_000  # with a fresh TTL
    assert await store.move("s1", "w1", w3) == w2  # a second, late mover loses
    assert await store.get("s1") == w2
    assert await store.move("s2", "w1", w3) == w3  # absent: moves whatever was expected


async def test_concurrent_moves_from_one_worker_pick_one(r: Redis) -> None:
    store = SessionStore(r)
    await store.claim("s1", Placement("dead", "eu"))
    tries = [Placement(f"w{i}", "eu") for i in range(10)]
    results = await asyncio.gather(*(store.move("s1", "dead", p) for p in tries))
    assert len(set(map(dataclasses.astuple, results))) == 1
    assert await store.get("s1") == results[0]


async def test_unreadable_placement_is_replaced(r: Redis) -> None:
    store = SessionStore(r)
    await r.set(session_key("s1"), b"not json")
    assert await store.get("s1") is None
    p = Placement("w1", "eu")
    assert await store.claim("s1", p) == p
    assert await store.get("s1") == p


async def test_drop(r: Redis) -> None:
    store = SessionStore(r)
    await store.claim("s1", Placement("w1", "eu"))
    await store.drop("s1")
    assert await store.get("s1") is None
    await store.drop("s1")  # idempotent


def test_placement_is_checked() -> None:
    with pytest.raises(ValueError, match="worker_id"):
        Placement("", "eu")
    with pytest.raises(ValueError, match="region"):
        Placement("w1", "")


# --- local server -----------------------------------------------------------------------------


async def test_restart_on_same_port_and_client_reconnects() -> None:
    with LocalRedis() as server:
        port, client = server.port, connect(server.url)
        try:
            reg = Registry(client)
            await reg.register(worker("a"))
            server.stop()
            assert not server.running
            with pytest.raises(redis.exceptions.ConnectionError):
                await asyncio.wait_for(client.ping(), timeout=10)  # fails, does not hang
            server.start()
            assert server.port == port and server.url == f"redis://127.0.0.1:{port}/0"
            assert await client.ping()  # the same client, reconnected
            assert await reg.workers() == []  # nothing persisted
            await reg.heartbeat(worker("a"))  # the next heartbeat re-registers
            assert [w.worker_id for w in await reg.workers()] == ["a"]
        finally:
            await client.aclose()
    assert not server.running


async def test_a_redis_that_hangs_costs_a_command_one_timeout_not_three() -> None:
    """A Redis that accepts but never answers (stopped, overloaded, cut off): the command fails
    after one timeout. Timeouts were retried as connection errors are, on a new connection each
    time: three timeouts a command (a gateway's first request after Redis hung took 3.3 s)."""
    connections = 0
    hung = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await hung.wait()  # reads nothing, answers nothing
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            await client.get("k")
        assert connections == 1
    finally:
        hung.set()
        await client.aclose()
        server.close()
        await server.wait_closed()


def test_free_ports_come_from_outside_the_ephemeral_range() -> None:
    """A port picked for a server we start (a pool's worker, a local Redis) is not one the
    kernel hands to outgoing connections: one of those took a worker's port between the pick
    and the bind (a CI run: "address already in use")."""
    from kvstore.redis_server import _ephemeral_range, find_free_port, port_free

    lo, hi = _ephemeral_range()
    for _ in range(20):
        port = find_free_port()
        assert not lo <= port <= hi, (port, lo, hi)
        assert port_free(port)


def test_missing_redis_server_says_how_to_install() -> None:
    with pytest.raises(RuntimeError, match="make setup"):
        LocalRedis(executable="no-such-redis-server-binary")


async def test_stop_task_ends_a_loop_that_lost_a_cancel() -> None:
    """A loop whose first cancellation is swallowed (as a Redis command's timeout can) is still
    stopped; a loop's own error is raised to whoever stops it."""
    import asyncio

    from kvstore.client import stop_task

    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.02)
    await asyncio.wait_for(stop_task(task), timeout=5)
    assert task.cancelled() and swallowed == 1

    async def broken() -> None:
        raise RuntimeError("loop failed")

    failing = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="loop failed"):
        await stop_task(failing)


async def test_a_loop_ends_on_one_cancel_that_its_redis_step_lost() -> None:
    """raise_if_cancelling after each step: a cancel that a step turned into an error it caught
    (without uncancel) ends the loop at once, so asyncio.run's single cancel at exit is enough
    (the worker's heartbeat loop used to go on, and the process never exited)."""
    import asyncio
    import contextlib

    from kvstore.client import raise_if_cancelling

    in_step = asyncio.Event()

    async def step() -> None:  # a Redis call that catches what its command raised
        in_step.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)
        in_step.clear()

    async def loop() -> None:
        while True:
            await step()
            raise_if_cancelling()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(loop())
    await in_step.wait()
    task.cancel()  # while the step runs: the step loses it
    await asyncio.wait([task], timeout=5)
    assert task.cancelled()


# --- the gateway's view of the registry across a Redis restart ---------------------------------


def _gateway_view(r: Redis, redis_server: LocalRedis) -> ClusterView:
    """A gateway's ClusterView (region eu-west) on the test's Redis."""
    from gateway.cluster import ClusterView
    from gateway.config import GatewayConfig
    from gateway.regions import DEFAULT_CATALOG, RegionCatalog

    return ClusterView(GatewayConfig("eu-west", redis_server.url, "s"), r,
                       RegionCatalog.load(DEFAULT_CATALOG))  # fmt: skip


async def test_workers_lost_while_the_registry_is_read_are_carried(
    r: Redis, redis_server: LocalRedis
) -> None:
    """Redis restarted empty between a refresh's registry read and its marker check: the
    workers it lost are carried (they were dropped), no new session is placed in Redis by load
    until they register again (the prefix index lacks their blocks meanwhile); one the gateway
    remembers is placed again on its remembered worker; then placement resumes."""
    reg = Registry(r)
    for wid in ("w0", "w1", "w2"):
        await reg.heartbeat(worker(wid, region="eu-west"))
    view = _gateway_view(r, redis_server)
    await view.refresh()
    await view.refresh()
    assert sorted(w.worker_id for w in view.workers) == ["w0", "w1", "w2"]
    read = view.demand.pools

    async def restart_after_the_read():  # type: ignore[no-untyped-def]
        pools = await read()
        await r.flushall()  # Redis comes back empty; w0's heartbeat is the first
        await reg.heartbeat(worker("w0", region="eu-west"))
        return pools

    view.demand.pools = restart_after_the_read  # type: ignore[method-assign]
    await view.refresh()
    view.demand.pools = read  # type: ignore[method-assign]
    assert sorted(w.worker_id for w in view.workers) == ["w0", "w1", "w2"]
    assert view.recovering
    w1 = next(w for w in view.workers if w.worker_id == "w1")
    w2 = next(w for w in view.workers if w.worker_id == "w2")
    assert await view.claim("new", w2) is None  # not placed while the index is partial
    await view.record("new", None, w2)
    assert await view.sessions.get("new") is None
    await view.record("talk", None, w1)
    assert await view.sessions.get("talk") is None
    remembered = await view.placement("talk")  # but routed where this gateway sent it
    assert remembered is not None and remembered.worker_id == "w1"
    assert await view.sessions.get("talk") == remembered  # and placed there again
    for wid in ("w1", "w2"):
        await reg.heartbeat(worker(wid, region="eu-west"))
    await view.refresh()
    assert not view.recovering
    assert await view.placement("talk") == remembered
    assert await view.claim("other", w2) == Placement("w2", "eu-west")
    placed = await view.placement("new")  # remembered, and placed on its next request
    assert placed is not None and placed.worker_id == "w2"
    assert await view.sessions.get("new") == placed


async def test_a_lost_worker_is_carried_until_its_next_heartbeat(
    r: Redis, redis_server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarted empty: a worker it lost is carried for CARRY_S, or for its published
    heartbeat period plus a margin when that is longer (one heartbeating every 14 s was dropped
    after 10 s: 4 s of 503 no_workers). An entry without the period (an older worker) parses,
    and carries for CARRY_S. (Both scaled down here.)"""
    from gateway import cluster

    monkeypatch.setattr(cluster, "CARRY_S", 0.3)
    monkeypatch.setattr(cluster, "CARRY_MARGIN_S", 0.3)
    reg = Registry(r)
    await reg.heartbeat(worker("old", region="eu-west"))
    await r.hdel(worker_key("old"), "heartbeat_s")  # as an older worker wrote it
    await reg.heartbeat(worker("slow", region="eu-west", heartbeat_s=0.8))
    view = _gateway_view(r, redis_server)
    await view.refresh()
    assert {w.worker_id: w.heartbeat_s for w in view.workers} == {"old": 0.0, "slow": 0.8}
    await r.flushall()
    await view.refresh()
    assert [w.worker_id for w in view.workers] == ["old", "slow"]
    await asyncio.sleep(0.6)  # past CARRY_S, within slow's heartbeat period plus the margin
    await view.refresh()
    assert [w.worker_id for w in view.workers] == ["slow"]
    await asyncio.sleep(0.6)  # past both: slow never heartbeat again
    await view.refresh()
    assert view.workers == [] and not view.recovering


async def test_a_gateway_that_loses_a_sessions_placement_remembers_the_winner(
    r: Redis, redis_server: LocalRedis
) -> None:
    """Two gateways place one new session at once, each on its own pick: the claim's loser
    remembers the winner's placement (and routes the session there while Redis is down), not
    its own; so does a gateway whose move came second."""
    first, second = _gateway_view(r, redis_server), _gateway_view(r, redis_server)
    await first.refresh()
    await second.refresh()
    wa, wb, wc = (worker(wid, region="eu-west") for wid in ("wa", "wb", "wc"))
    assert await first.claim("s1", wa) == Placement("wa", "eu-west")
    assert await second.claim("s1", wb) == Placement("wa", "eu-west")  # (claimed before forwarding)
    await first.record("s2", None, wa)
    await second.record("s2", None, wb)  # (a claim after forwarding: Redis was down before)
    await first.record("s2", Placement("wa", "eu-west"), wc)  # wa failed: both move it
    await second.record("s2", Placement("wa", "eu-west"), wb)
    second.redis_ok = False  # Redis down: the gateway routes by what it remembers
    assert await second.placement("s1") == Placement("wa", "eu-west")
    assert await second.placement("s2") == Placement("wc", "eu-west")


async def _serve(view: ClusterView, session_id: str) -> str:
    """One request of the session, routed as the gateway's proxy routes it: the session's
    placement, the router's choice, a new session claimed for that choice before forwarding
    (the winner's worker, if another gateway placed it first), the placement recorded after.
    Returns the id of the worker that serves it."""
    placed = await view.placement(session_id)
    chosen = view.router.route("m1", view.live_workers(), placed).candidates[0]
    if placed is None:
        placed = await view.claim(session_id, chosen)
        if placed is not None:
            chosen = view.router.route("m1", view.live_workers(), placed).candidates[0]
    await view.record(session_id, placed, chosen)
    return chosen.worker_id


async def test_sessions_keep_their_workers_when_redis_comes_back_empty(
    r: Redis, redis_server: LocalRedis
) -> None:
    """Redis is flushed (or restarts empty) under a gateway that placed sessions on wa, while
    load now favours wb. Each session stays on wa, and is placed there in Redis again: on its
    first request before a registry read has noticed the reset (Redis misses the session, and
    nothing says yet that it lost it), on one while the workers register again, and on its
    first after that. A session whose remembered worker has failed, or is overloaded, goes by
    load; one that another gateway placed again first goes to that gateway's pick."""
    reg = Registry(r)
    wa, wb, wc = (worker(wid, region="eu-west") for wid in ("wa", "wb", "wc"))
    wd = worker("wd", region="eu-west", running=8, waiting=1)  # overloaded
    for w in (wa, wb, wc, wd):
        await reg.heartbeat(w)
    view, other = _gateway_view(r, redis_server), _gateway_view(r, redis_server)
    await view.refresh()
    await other.refresh()
    sessions = [f"s{i}" for i in range(6)]
    for s in [*sessions, "raced"]:
        await view.record(s, None, wa)
    await view.record("gone", None, wc)
    await view.record("busy", None, wd)
    for w in (wa, wc, wd):
        view.router.sent(w.worker_id, 10_000)  # load alone sends each request to wb now
    assert {await _serve(view, s) for s in [*sessions, "raced"]} == {"wa"}
    await r.flushall()
    view.mark_failed("wc")
    get = view.sessions.get

    async def placed_by_another_gateway_after_the_read(session_id: str) -> Placement | None:
        found = await get(session_id)
        if session_id == "raced":  # a gateway that never saw it places it by load meanwhile
            assert await other.claim(session_id, wb) == Placement("wb", "eu-west")
        return found

    view.sessions.get = placed_by_another_gateway_after_the_read  # type: ignore[method-assign]
    # before the registry read that notices the reset
    assert [await _serve(view, s) for s in sessions[:2]] == ["wa", "wa"]
    assert await _serve(view, "gone") == "wb"
    assert await _serve(view, "busy") == "wb"
    assert await _serve(view, "raced") == "wb"  # the claim's winner stands
    await view.refresh()
    assert view.recovering  # the workers Redis lost are carried
    assert [await _serve(view, s) for s in sessions[2:4]] == ["wa", "wa"]
    for w in (wa, wb, wc, wd):
        await reg.heartbeat(w)
    await view.refresh()
    assert not view.recovering
    assert [await _serve(view, s) for s in sessions] == ["wa"] * 6
    for s in sessions:
        assert await get(s) == Placement("wa", "eu-west"), s
    for s in ("gone", "busy", "raced"):
        assert await get(s) == Placement("wb", "eu-west"), s
        assert await _serve(view, s) == "wb"


async def test_a_remembered_session_idle_past_its_ttl_is_placed_afresh(
    r: Redis, redis_server: LocalRedis
) -> None:
    """A session unused for its idle TTL is forgotten by Redis and by the gateway's memory
    alike: its next request is placed by load, not claimed again on its old worker."""
    reg = Registry(r)
    wa, wb = (worker(wid, region="eu-west") for wid in ("wa", "wb"))
    for w in (wa, wb):
        await reg.heartbeat(w)
    view = _gateway_view(r, redis_server)
    view.config = dataclasses.replace(view.config, session_ttl_s=0.2)
    view.sessions = SessionStore(r, idle_ttl_s=0.2)
    await view.refresh()
    await view.record("s1", None, wa)
    view.router.sent("wa", 10_000)  # load alone sends each request to wb now
    assert await _serve(view, "s1") == "wa"
    await asyncio.sleep(0.35)
    assert await _serve(view, "s1") == "wb"
    assert await view.sessions.get("s1") == Placement("wb", "eu-west")


async def test_a_readiness_probe_that_finds_redis_gone_logs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """/readyz pings Redis every few seconds: when the ping is the first to find it gone, the
    outage is logged there (the request path's and the refresh's warnings only fire while
    Redis is thought fine: it went unlogged, only its recovery was)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"  # nothing listens once closed
    r = connect(url)
    try:
        from gateway.cluster import ClusterView
        from gateway.config import GatewayConfig
        from gateway.regions import DEFAULT_CATALOG, RegionCatalog

        view = ClusterView(
            GatewayConfig("eu-west", url, "s"), r, RegionCatalog.load(DEFAULT_CATALOG)
        )
        view.redis_ok = True  # (as after a good read of the registry)
        with caplog.at_level("WARNING", logger="edgeinfer.gateway"):
            assert not await view.ping() and not await view.ping()
        lines = [
            rec.getMessage() for rec in caplog.records if "redis unreachable" in rec.getMessage()
        ]
        assert len(lines) == 1, lines
    finally:
        await r.aclose()


def test_a_field_typed_optional_or_as_a_container_is_read() -> None:
    """Registry reads check each field's type (a hash of another writer's is skipped): a field
    added later as `X | None`, `list[str]` or `dict[...]` must be read, not crash every read
    (a union hint has no __name__: the AttributeError escaped Registry.workers())."""
    from kvstore.protocol import _typed

    assert _typed("f", str | None, None) is None
    assert _typed("f", str | None, "a") == "a"
    assert _typed("f", float | None, 2) == 2.0
    assert _typed("f", list[str], ["a"]) == ["a"]
    assert _typed("f", dict[str, int], {"a": 1}) == {"a": 1}
    for hint, value in ((str | None, 5), (list[str], "a"), (int | None, True)):
        with pytest.raises(ValueError, match="f must be a JSON"):
            _typed("f", hint, value)
