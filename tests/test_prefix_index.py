"""The prefix index against a real redis-server: keys, longest-prefix lookups, TTLs, the publisher;
last, a real worker process restarted under its id.

Every test uses its own model name, so tests share the session's Redis without seeing each
other's keys.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Literal

import pytest
import redis
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from kvstore.block_hash import block_hashes, cache_seed
from kvstore.client import connect
from kvstore.keys import model_workers_key, worker_key
from kvstore.prefix_index import CacheEventPublisher, PrefixIndex, marker_key, prefix_key
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry
from runtime.kv_cache import BlockManager
from tests.stack import generate, start_worker, wait_until

BLOCK = 4  # tokens per block of the test hashes


def chain(n: int, salt: str = "a") -> list[bytes]:
    """The block hashes of an n-block prompt, as the engine and the gateway compute them."""
    return block_hashes(cache_seed(f"test/{salt}"), list(range(n * BLOCK)), BLOCK)


class CountingIndex(PrefixIndex):
    """A PrefixIndex that remembers its publish calls."""

    def __init__(self, redis: Redis, entry_ttl_s: float = 3600.0) -> None:
        super().__init__(redis, entry_ttl_s)
        self.calls: list[tuple[int, int]] = []  # (stored, evicted) sizes, per publish

    async def publish(
        self, model: str, worker_id: str, stored: Sequence[bytes], evicted: Sequence[bytes]
    ) -> bool:
        self.calls.append((len(stored), len(evicted)))
        return await super().publish(model, worker_id, stored, evicted)


class FlakyIndex(PrefixIndex):
    """A PrefixIndex whose writes fail while `failing` says so: "before" Redis applies them
    (connection refused), or, for publishes, "after" (a reply lost to a timeout)."""

    failing: Literal["before", "after"] | None = None

    async def publish(
        self, model: str, worker_id: str, stored: Sequence[bytes], evicted: Sequence[bytes]
    ) -> bool:
        if self.failing == "before":
            raise RedisConnectionError("connection refused")
        found = await super().publish(model, worker_id, stored, evicted)
        if self.failing == "after":
            raise RedisConnectionError("the reply was lost")
        return found

    async def purge_worker(self, model: str, worker_id: str) -> None:
        if self.failing == "before":
            raise RedisConnectionError("connection refused")
        await super().purge_worker(model, worker_id)


class CountingRedis:
    """Wraps a client and counts pipelines (one per round trip in PrefixIndex)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.pipelines = 0

    def pipeline(self, transaction: bool = True):  # type: ignore[no-untyped-def]
        self.pipelines += 1
        return self.redis.pipeline(transaction=transaction)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Wait until `check()` is true; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)


async def model_keys(r: Redis, model: str) -> list[bytes]:
    return [k async for k in r.scan_iter(match=f"ei:p:{{{model}}}:*", count=1000)]


# --- keys -------------------------------------------------------------------------------------


def test_keys_carry_the_model_hash_tag() -> None:
    h = bytes.fromhex("00ff10a0b1c2d3e4")
    assert prefix_key("org/M-1", h) == "ei:p:{org/M-1}:00ff10a0b1c2d3e4"
    assert marker_key("org/M-1", "w:1") == "ei:p:{org/M-1}:w:w:1"
    # A Redis Cluster hashes only the part in braces: one model, one slot.
    slot = key_slot(b"org/M-1")
    assert key_slot(prefix_key("org/M-1", h).encode()) == slot
    assert key_slot(prefix_key("org/M-1", chain(1)[0]).encode()) == slot
    assert key_slot(marker_key("org/M-1", "w1").encode()) == slot


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "x" * 257])
def test_keys_reject_bad_model_and_worker(bad: str) -> None:
    with pytest.raises(ValueError, match="model"):
        prefix_key(bad, b"\x01")
    with pytest.raises(ValueError):
        marker_key("m", bad)


@pytest.mark.parametrize("bad", [b"", "0102", None])
def test_keys_reject_bad_hashes(bad: object) -> None:
    with pytest.raises(ValueError, match="block hash"):
        prefix_key("m", bad)  # type: ignore[arg-type]


def test_index_rejects_bad_ttl() -> None:
    with pytest.raises(ValueError, match="entry_ttl_s"):
        PrefixIndex(connect("redis://127.0.0.1:1/0"), entry_ttl_s=0)


# --- the index --------------------------------------------------------------------------------


async def test_longest_prefixes_counts_leading_blocks_only(r: Redis, model: str) -> None:
    idx = PrefixIndex(r)
    h = chain(10)
    await idx.publish(model, "a", h, [])  # all ten
    await idx.publish(model, "b", h[:4] + h[5:], [])  # a gap at block 4
    await idx.publish(model, "c", h[1:], [])  # everything but block 0
    await idx.publish(model, "d", h[:1], [])
    await idx.publish(model, "e", chain(3, "other"), [])  # another prompt's blocks
    assert await idx.longest_prefixes(model, h) == {"a": 10, "b": 4, "d": 1}
    assert await idx.longest_prefixes(model, h[:3]) == {"a": 3, "b": 3, "d": 1}
    assert await idx.longest_prefixes(model, h[1:]) == {"a": 9, "c": 9, "b": 3}
    assert await idx.longest_prefixes(model, h, workers={"b", "c", "gone"}) == {"b": 4}
    assert await idx.longest_prefixes(model, chain(10, "unseen")) == {}
    assert await idx.longest_prefixes(model, []) == {}
    assert await idx.longest_prefixes(model + "-x", h) == {}  # another model's namespace


async def test_long_prompts_take_few_round_trips_and_stop_early(r: Redis, model: str) -> None:
    counting = CountingRedis(r)
    idx = PrefixIndex(counting)  # type: ignore[arg-type]
    h = chain(1000)
    await idx.publish(model, "all", h, [])
    await idx.publish(model, "half", h[:500], [])
    await idx.publish(model, "some", h[:40], [])
    counting.pipelines = 0
    assert await idx.longest_prefixes(model, h) == {"all": 1000, "half": 500, "some": 40}
    assert counting.pipelines == 6  # 32 + 64 + 128 + 256 + 512 (+ 8) blocks
    counting.pipelines = 0
    assert await idx.longest_prefixes(model, h, workers=["some"]) == {"some": 40}
    assert counting.pipelines == 2  # stops once "some" runs out, in the 64-block trip
    counting.pipelines = 0
    assert await idx.longest_prefixes(model, chain(1000, "unseen")) == {}
    assert counting.pipelines == 1


async def test_evicted_blocks_stop_counting(r: Redis, model: str) -> None:
    idx = PrefixIndex(r)
    h = chain(6)
    await idx.publish(model, "a", h, [])
    await idx.publish(model, "b", h, [])
    await idx.publish(model, "a", [], [h[2]])
    assert await idx.longest_prefixes(model, h) == {"a": 2, "b": 6}
    await idx.publish(model, "b", [], h)
    assert await idx.longest_prefixes(model, h) == {"a": 2}
    await idx.publish(model, "a", [], h)
    assert await idx.longest_prefixes(model, h) == {}
    assert not await r.exists(*(prefix_key(model, x) for x in h))  # empty sets leave no key


async def test_store_sets_and_refreshes_the_ttl(r: Redis, model: str) -> None:
    idx = PrefixIndex(r, entry_ttl_s=100.0)
    (h,) = chain(1)
    key = prefix_key(model, h)
    await idx.publish(model, "a", [h], [])
    assert 0 < await r.pttl(key) <= 100_000
    assert 0 < await r.pttl(marker_key(model, "a")) <= 100_000
    await r.pexpire(key, 500)
    await idx.publish(model, "b", [h], [])  # any worker's store renews it
    assert 50_000 < await r.pttl(key) <= 100_000
    await r.pexpire(key, 500)
    await idx.publish(model, "a", [h], [])  # so does a re-store
    assert 50_000 < await r.pttl(key) <= 100_000


async def test_entries_nobody_renews_expire(r: Redis, model: str) -> None:
    idx = PrefixIndex(r, entry_ttl_s=0.2)
    h = chain(2)
    await idx.publish(model, "crashed", h, [])
    await asyncio.sleep(0.35)
    assert await idx.longest_prefixes(model, h) == {}
    assert await model_keys(r, model) == []


async def test_publish_reports_whether_the_marker_survived(r: Redis, model: str) -> None:
    idx = PrefixIndex(r)
    h = chain(2)
    assert not await idx.publish(model, "a", h[:1], [])  # first publish: no marker yet
    assert await idx.publish(model, "a", h[1:], [])
    await r.delete(marker_key(model, "a"))  # as after a Redis restart
    assert not await idx.publish(model, "a", [], h[:1])


async def test_forget_worker(r: Redis, model: str) -> None:
    idx = PrefixIndex(r)
    h = chain(5)
    await idx.publish(model, "a", h, [])
    await idx.publish(model, "b", h[:3], [])
    await idx.forget_worker(model, "a", h)
    assert await idx.longest_prefixes(model, h) == {"b": 3}
    assert not await r.exists(marker_key(model, "a"))
    assert await r.exists(marker_key(model, "b"))
    await idx.forget_worker(model, "a", h)  # idempotent
    await idx.forget_worker(model, "b", h)
    assert await model_keys(r, model) == []


# --- the publisher ----------------------------------------------------------------------------


async def test_publisher_batches_events_into_one_publish(r: Redis, model: str) -> None:
    idx = CountingIndex(r)
    pub = CacheEventPublisher(idx, model, "w1")
    h = chain(100)
    for i in range(0, 100, 10):
        pub.record(h[i : i + 10], [])
    assert await idx.longest_prefixes(model, h) == {}  # record() never touches Redis
    await pub.flush()
    assert idx.calls == [(100, 0)]
    assert await idx.longest_prefixes(model, h) == {"w1": 100}
    await pub.flush()  # nothing changed: no round trip
    assert idx.calls == [(100, 0)]
    pub.record([], h[50:])
    await pub.flush()
    assert idx.calls == [(100, 0), (0, 50)]
    assert await idx.longest_prefixes(model, h) == {"w1": 50}
    assert pub.held == set(h[:50])


async def test_publisher_splits_large_batches(r: Redis, model: str) -> None:
    idx = CountingIndex(r)
    pub = CacheEventPublisher(idx, model, "w1", max_batch=10)
    h = chain(25)
    pub.record(h, [])
    await pub.flush()
    assert idx.calls == [(10, 0), (10, 0), (5, 0)]
    assert await idx.longest_prefixes(model, h) == {"w1": 25}


async def test_stored_then_evicted_nets_out(r: Redis, model: str) -> None:
    idx = CountingIndex(r)
    pub = CacheEventPublisher(idx, model, "w1")
    await pub.flush()  # (the first flush looks for an earlier run's entries, even with none held)
    idx.calls.clear()
    x, y, z = chain(3)
    pub.record([x], [])
    pub.record([], [x])
    await pub.flush()
    assert idx.calls == []  # stored then evicted before a flush: nothing to write
    assert not await r.exists(prefix_key(model, x))
    pub.record([y], [])
    await pub.flush()
    pub.record([], [y])
    pub.record([y], [])  # evicted then stored again: still held, nothing to write
    await pub.flush()
    assert idx.calls == [(1, 0)]
    assert await r.smembers(prefix_key(model, y)) == {b"w1"}
    pub.record([], [y])
    pub.record([z], [z])  # one call, z not held: stored, then evicted
    await pub.flush()
    assert idx.calls == [(1, 0), (0, 1)]
    assert not await r.exists(prefix_key(model, y))
    assert not await r.exists(prefix_key(model, z))
    pub.record([z], [])
    await pub.flush()
    pub.record([z], [z])  # one call, z held: evicted, then stored again
    await pub.flush()
    assert idx.calls == [(1, 0), (0, 1), (1, 0)]
    assert await r.smembers(prefix_key(model, z)) == {b"w1"}


async def test_a_drain_s_events_net_out_in_the_engine_s_order(r: Redis, model: str) -> None:
    """The engine's drain holds its stores and its evictions in two lists, without their order:
    a block stored then evicted between two drains (a KV import's, committed, then taken by the
    step's allocations) was applied as evicted then stored, and the index claimed it for the
    worker until the next full sync. Drains of the real BlockManager, each [h] and [h]."""
    blocks = BlockManager(num_blocks=2, block_size=BLOCK)
    blocks.record_events = True
    pub = CacheEventPublisher(PrefixIndex(r), model, "w1")
    tokens = list(range(BLOCK))

    blocks.allocate("a", BLOCK)
    blocks.commit("a", tokens)  # stored
    blocks.free("a")
    blocks.allocate("b", 2 * BLOCK)  # every block: the cached one is evicted
    stored, evicted = blocks.drain_events()
    (h,) = stored
    assert evicted == [h]
    pub.record(stored, evicted)
    await pub.flush()
    assert not await r.exists(prefix_key(model, h))  # (it listed the worker)
    assert pub.held == set()

    blocks.free("b")
    blocks.allocate("c", BLOCK)
    blocks.commit("c", tokens)
    pub.record(*blocks.drain_events())
    await pub.flush()
    assert await r.smembers(prefix_key(model, h)) == {b"w1"}
    blocks.free("c")
    blocks.allocate("d", 2 * BLOCK)  # evicted,
    blocks.commit("d", tokens)  # then stored again
    assert blocks.drain_events() == ([h], [h])
    pub.record([h], [h])
    await pub.flush()
    assert pub.held == {h}
    assert await r.smembers(prefix_key(model, h)) == {b"w1"}


async def test_record_is_thread_safe(r: Redis, model: str) -> None:
    pub = CacheEventPublisher(PrefixIndex(r), model, "w1")
    per_thread = [chain(500, f"t{t}") for t in range(4)]

    def engine(hashes: list[bytes]) -> None:
        for i, h in enumerate(hashes):
            pub.record([h], [hashes[i - 1]] if i % 2 else [])  # odd blocks stay

    threads = [threading.Thread(target=engine, args=(h,)) for h in per_thread]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        await pub.flush()  # flushes race the recording threads
        await asyncio.sleep(0)
    for t in threads:
        t.join()
    await pub.flush()
    kept = {h for hashes in per_thread for h in hashes[1::2]}
    assert pub.held == kept
    got = {k.decode().rsplit(":", 1)[1] for k in await model_keys(r, model)}
    assert got == {h.hex() for h in kept} | {"w1"}  # and the marker, ei:p:{model}:w:w1


async def test_publisher_resyncs_when_redis_lost_its_entries(
    r: Redis, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.prefix_index")
    idx = PrefixIndex(r)
    pub = CacheEventPublisher(idx, model, "w1")
    h = chain(8)
    pub.record(h[:6], [])
    await pub.flush()
    await r.delete(*await model_keys(r, model))  # as a Redis restart without persistence does
    pub.record(h[6:], [])
    await pub.flush()  # finds its marker gone and rewrites everything it holds
    assert await idx.longest_prefixes(model, h) == {"w1": 8}
    assert "lost worker w1's entries" in caplog.text


async def test_publisher_refreshes_ttls_of_long_held_blocks(r: Redis, model: str) -> None:
    idx = PrefixIndex(r, entry_ttl_s=100.0)
    pub = CacheEventPublisher(idx, model, "w1", refresh_interval_s=0.2)
    (h,) = chain(1)
    pub.record([h], [])
    await pub.flush()
    await r.pexpire(prefix_key(model, h), 1000)
    await pub.flush()  # nothing new, and the refresh is not due yet
    assert await r.pttl(prefix_key(model, h)) <= 1000
    await asyncio.sleep(0.25)
    await pub.flush()  # due: every held block is written again, with a fresh TTL
    assert 50_000 < await r.pttl(prefix_key(model, h)) <= 100_000


async def test_close_removes_the_worker(r: Redis, model: str) -> None:
    idx = PrefixIndex(r)
    other = CacheEventPublisher(idx, model, "w2")
    pub = CacheEventPublisher(idx, model, "w1", flush_interval_s=0.01)
    task = asyncio.create_task(pub.run())
    h = chain(6)
    other.record(h[:2], [])
    await other.flush()
    pub.record(h[:3], [])
    await eventually(lambda: _has(idx, model, h, {"w1": 3, "w2": 2}))
    pub.record(h[3:5], [])  # maybe not flushed yet
    await r.sadd(prefix_key(model, h[5]), "w1")  # a block only the engine still knew of
    await pub.close(held=[h[5]])
    await asyncio.wait_for(task, timeout=5)  # run() returns after close()
    assert await idx.longest_prefixes(model, h) == {"w2": 2}
    assert not await r.exists(marker_key(model, "w1"))
    pub.record(h, [])  # events after close are ignored
    assert pub.held == set()
    await pub.flush()  # and a late flush writes nothing back
    assert not await r.exists(marker_key(model, "w1"))


async def _has(idx: PrefixIndex, model: str, h: list[bytes], want: dict[str, int]) -> bool:
    return await idx.longest_prefixes(model, h) == want


async def test_run_survives_a_redis_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.prefix_index")
    model = "org/restart"
    with LocalRedis() as server:
        client = connect(server.url)
        try:
            idx = PrefixIndex(client)
            pub = CacheEventPublisher(idx, model, "w1", flush_interval_s=0.02)
            task = asyncio.create_task(pub.run())
            h = chain(10)
            pub.record(h[:5], [])
            await eventually(lambda: _has(idx, model, h, {"w1": 5}))

            server.stop()
            pub.record(h[5:], [])
            pub.record([], h[4:5])  # an eviction during the outage
            pub.record(h[4:5], [])  # and the block back again
            await asyncio.sleep(0.5)  # several failed flushes
            assert not task.done()
            warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
            assert len(warnings) == 1  # once per outage, not once per try
            assert "prefix index unreachable" in warnings[0].getMessage()

            server.start()  # an empty Redis: the full sync rewrites blocks from before, too
            await eventually(lambda: _has(idx, model, h, {"w1": 10}))
            assert "reachable again" in caplog.text
            assert not task.done()
            await pub.close()
            await asyncio.wait_for(task, timeout=5)
            assert await idx.longest_prefixes(model, h) == {}
        finally:
            await client.aclose()


async def test_failed_flushes_keep_bounded_bookkeeping_and_recover_exactly(
    r: Redis, model: str
) -> None:
    """A long outage while the cache churns, its flushes failing after Redis applied them, then
    before: what the publisher keeps stays bounded by what it holds, and the first flush that goes
    through leaves exactly the held blocks listed under the worker."""
    idx = FlakyIndex(r)
    pub = CacheEventPublisher(idx, model, "w1", max_batch=4)
    h = chain(200)
    pub.record(h[:8], [])
    await pub.flush()
    for n, i in enumerate(range(8, 200, 4)):  # 4 blocks in, the 4 oldest out: 8 held throughout
        idx.failing = "after" if n < 24 else "before"
        pub.record(h[i : i + 4], h[i - 8 : i - 4])
        with pytest.raises(RedisConnectionError):
            await pub.flush()
        assert len(pub._published) <= 2 * len(pub.held) + pub.max_batch
    idx.failing = None
    await pub.flush()
    blocks = [k async for k in r.scan_iter(match=f"ei:p:{{{model}}}:*", _type="set")]
    listed = {k for k in blocks if await r.sismember(k, "w1")}
    assert listed == {prefix_key(model, x).encode() for x in h[192:]}


async def test_a_new_run_under_the_same_id_removes_the_old_runs_entries(
    r: Redis, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker id that outlives its process (Kubernetes: the pod's name) restarts with an empty
    cache: its first flush removes what the crashed run left under that id, before any event."""
    caplog.set_level(logging.INFO, logger="kvstore.prefix_index")
    model += "-[a]*?"  # (characters a SCAN pattern would take for wildcards)
    idx = PrefixIndex(r)
    h = chain(6)
    old = CacheEventPublisher(idx, model, "w1")
    old.record(h, [])
    await old.flush()  # and the process dies: no close()
    other = CacheEventPublisher(idx, model, "w2")
    other.record(h[:3], [])
    await other.flush()
    new = CacheEventPublisher(idx, model, "w1")
    await new.flush()
    assert await idx.longest_prefixes(model, h) == {"w2": 3}
    assert "entries of an earlier run of worker w1" in caplog.text
    new.record(h[:2], [])
    await new.flush()
    assert await idx.longest_prefixes(model, h) == {"w1": 2, "w2": 3}
    await new.close()
    await other.close()
    assert await model_keys(r, model) == []


async def test_a_worker_with_a_given_id_purges_at_its_first_flush_without_a_marker(
    r: Redis, model: str
) -> None:
    """The marker expires entry_ttl_s after a run's last write, but blocks that live workers keep
    refreshing still list that run (a set has one TTL): a worker started again under the dead
    run's id finds no marker, and purges all the same when its id was given."""
    idx = PrefixIndex(r)
    h = chain(4)
    old = CacheEventPublisher(idx, model, "pod-1")
    old.record(h, [])
    await old.flush()  # and the process dies: no close()
    live = CacheEventPublisher(idx, model, "w2")
    live.record(h, [])
    await live.flush()
    await r.delete(marker_key(model, "pod-1"))  # (expired, while w2 kept the blocks' TTLs up)
    new = CacheEventPublisher(idx, model, "pod-1", purge_first=True)
    await new.flush()
    assert await idx.longest_prefixes(model, h) == {"w2": 4}
    for x in h:
        assert await r.smembers(prefix_key(model, x)) == {b"w2"}
    new.record(h[:1], [])
    await new.flush()  # (a purge once, then writes as usual)
    assert await r.smembers(prefix_key(model, h[0])) == {b"w2", b"pod-1"}


class CountingPurges(PrefixIndex):
    """A PrefixIndex that counts its purge_workers calls (each a SCAN of the keyspace)."""

    purges = 0

    async def purge_workers(self, model: str, worker_ids: Collection[str]) -> None:
        self.purges += 1
        await super().purge_workers(model, worker_ids)


async def test_the_registry_read_that_prunes_a_dead_worker_purges_it_once(
    r: Redis, model: str
) -> None:
    """A worker killed -9 stays a member of the blocks that live workers keep refreshing: one set
    member more per crash, forever, which every gateway lookup then reads (and a worker started
    again under its id would be credited with them). The registry read that finds it dead and
    prunes it from its model's set purges it from the index; of readers at once, one does."""
    def info(wid: str) -> WorkerInfo:
        return WorkerInfo(worker_id=wid, region="eu", model=model, role="mixed", url="u",
                          max_num_seqs=8, capacity_tokens=4096)  # fmt: skip

    reg = Registry(r, ttl_s=0.3)
    idx = PrefixIndex(r)
    h = chain(4)
    dead, live = CacheEventPublisher(idx, model, "dead"), CacheEventPublisher(idx, model, "live")
    for pub in (dead, live):
        await reg.register(info(pub.worker_id))
        pub.record(h, [])
        await pub.flush()
    # "dead" is killed: no close(), no heartbeat; "live" heartbeats and refreshes every block
    for _ in range(5):
        await asyncio.sleep(0.1)
        await reg.heartbeat(info("live"))
        live.resync()
        await live.flush()
    assert await r.smembers(prefix_key(model, h[0])) == {b"dead", b"live"}
    assert await r.pttl(prefix_key(model, h[0])) > 3_000_000  # (kept up by "live")
    readers = [Registry(r) for _ in range(4)]  # gateways reading the registry together
    for reader in readers:
        reader.index = CountingPurges(r)
    listed = await asyncio.gather(*(reader.workers(model) for reader in readers))
    assert all([w.worker_id for w in ws] == ["live"] for ws in listed)
    for x in h:
        assert await r.smembers(prefix_key(model, x)) == {b"live"}
    assert not await r.exists(marker_key(model, "dead"))
    assert sum(reader.index.purges for reader in readers) == 1  # type: ignore[attr-defined]
    assert await idx.longest_prefixes(model, h) == {"live": 4}  # (no registry filter needed)
    await live.close()


def _info(model: str, wid: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region="eu", model=model, role="mixed", url="u",
                      max_num_seqs=8, capacity_tokens=4096)  # fmt: skip


async def test_a_worker_registering_again_as_a_reader_prunes_it_keeps_its_entries(
    r: Redis, model: str
) -> None:
    """A reader finds a worker's hash gone (a stalled engine's entry expired, a pod restarted
    under its id) and prunes it; the worker registers again and rewrites its entries between
    the reader's HGETALL and its SREM. The SREM still removed it, and the purge took the
    entries it had just written and its marker: as its hash existed, nothing told the worker,
    and gateways routed its cached prefixes elsewhere (and it was missing from its model's set
    until its next heartbeat). Now it is put back and not purged."""
    reg, idx = Registry(r), PrefixIndex(r)
    h = chain(4)
    pub = CacheEventPublisher(idx, model, "w-pod")
    await reg.register(_info(model, "w-pod"))
    pub.record(h, [])
    await pub.flush()
    await r.delete(worker_key("w-pod"))  # its entry expired
    reader = Registry(r)
    prune = reader._prune

    async def registers_again_before_the_srem(
        stale: Iterable[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        stale = list(stale)
        if stale:
            assert await reg.heartbeat(_info(model, "w-pod"))  # created anew: it resyncs
            pub.resync()
            await pub.flush()
        return await prune(stale)

    reader._prune = registers_again_before_the_srem  # type: ignore[method-assign]
    await reader.workers(model)
    assert await idx.longest_prefixes(model, h) == {"w-pod": 4}
    assert await r.exists(marker_key(model, "w-pod"))
    assert await r.sismember(model_workers_key(model), "w-pod")
    assert [w.worker_id for w in await Registry(r).workers(model)] == ["w-pod"]
    await pub.close()


async def test_a_publisher_whose_entries_were_purged_writes_them_again_unasked(
    r: Redis, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that registered again just after a reader decided to purge it (see above) has
    its rewrite cut short by the purge's SCAN, and the marker removed last. It found out only
    at its next publish, so a worker whose cache did not change stayed unlisted until it did
    (or until the full sync, a third of the entries' TTL later). Now a flush with nothing to
    write checks the marker every `marker_check_s`, and writes everything again."""
    caplog.set_level(logging.INFO, logger="kvstore.prefix_index")
    idx = PrefixIndex(r)
    h = chain(6)
    pub = CacheEventPublisher(idx, model, "w1", marker_check_s=0.0)
    pub.record(h, [])
    await pub.flush()
    await pub.flush()  # nothing to write, the marker there: no publish
    await idx.purge_workers(model, ["w1"])  # a reader's purge, after the worker's rewrite
    assert await idx.longest_prefixes(model, h) == {}
    await pub.flush()  # no cache event since
    assert await idx.longest_prefixes(model, h) == {"w1": 6}
    assert await r.exists(marker_key(model, "w1"))
    assert "lost worker w1's entries" in caplog.text
    await pub.close()


async def test_a_paused_publisher_writes_nothing_back_until_it_resumes(r: Redis, model: str) -> None:
    """A worker whose engine hangs stops renewing its registry entry, and a registry reader
    then purges its entries, rightly. Its publisher (on the event loop, alive) wrote them all
    back a second later, renewed for as long as the process lived: paused (the worker's
    `llm.is_stalled`), it writes nothing, and the events wait for it to resume."""
    idx = PrefixIndex(r)
    h = chain(6)
    stalled = False
    pub = CacheEventPublisher(idx, model, "w1", marker_check_s=0.0, paused=lambda: stalled)
    pub.record(h[:4], [])
    await pub.flush()
    stalled = True
    await idx.purge_workers(model, ["w1"])  # the reader's purge of a worker gone silent
    pub.record(h[4:], [])
    for _ in range(3):
        await pub.flush()
    assert await idx.longest_prefixes(model, h) == {}
    assert not await r.exists(marker_key(model, "w1"))
    stalled = False  # the engine goes on: what it holds is listed again
    await pub.flush()
    assert await idx.longest_prefixes(model, h) == {"w1": 6}
    await pub.close()


async def test_close_with_redis_down_logs_and_returns(caplog: pytest.LogCaptureFixture) -> None:
    pub = CacheEventPublisher(PrefixIndex(connect("redis://127.0.0.1:1/0")), "m", "w1")
    pub.record(chain(2), [])
    await pub.close()
    assert "could not remove worker w1" in caplog.text


def test_publisher_checks_its_arguments() -> None:
    idx = PrefixIndex(connect("redis://127.0.0.1:1/0"))
    with pytest.raises(ValueError, match="flush_interval_s"):
        CacheEventPublisher(idx, "m", "w", flush_interval_s=0)
    with pytest.raises(ValueError, match="max_batch"):
        CacheEventPublisher(idx, "m", "w", max_batch=0)
    with pytest.raises(ValueError, match="refresh_interval_s"):
        CacheEventPublisher(idx, "m", "w", refresh_interval_s=-1)
    with pytest.raises(ValueError, match="marker_check_s"):
        CacheEventPublisher(idx, "m", "w", marker_check_s=-1)
    with pytest.raises(ValueError, match="worker_id"):
        CacheEventPublisher(idx, "m", "w{1}")


# --- a real worker ----------------------------------------------------------------------------


@pytest.mark.parametrize("marker", ["kept", "expired"])
def test_a_worker_restarted_under_its_id_inherits_no_entries(
    stories_dir: Path, tmp_path: Path, marker: str
) -> None:
    """In Kubernetes a worker's id is its pod's name. Killed and started again under it, the worker
    has an empty cache: the index must stop listing it under its last run's blocks (a gateway
    would route those prefixes to it for nothing), with no request needed; also once the last
    run's marker has expired (blocks that other workers keep refreshing still list it)."""
    with LocalRedis() as server:
        r = redis.Redis.from_url(server.url)

        def listed() -> int:
            keys = r.scan_iter("ei:p:{stories}:*", _type="set")
            return sum(bool(r.sismember(k, "w-pod")) for k in keys)

        args = ["--worker-id", "w-pod"]
        worker = start_worker("run1", stories_dir, server.url, tmp_path, extra=args)
        try:
            prompt = "Once upon a time, there was a little girl named Lily. " * 4
            assert generate(worker, "fill", prompt, 1) == 200
            wait_until(lambda: listed() >= 3, 10, "the first run's entries", worker)
            worker.kill()
            if marker == "expired":
                assert r.delete("ei:p:{stories}:w:w-pod") == 1
            worker = start_worker("run2", stories_dir, server.url, tmp_path, extra=args)
            wait_until(lambda: listed() == 0, 10, "the first run's entries removed", worker)
        finally:
            worker.stop()
            r.close()
