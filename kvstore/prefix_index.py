"""The prefix index: which worker holds which KV block, so the gateway routes to cached prefixes.

Every worker's engine caches full KV blocks under their chained hash (kvstore/block_hash.py).
Workers serving one model share one namespace of set keys, one per block hash:

    ei:p:{<model>}:<hex hash>       set: ids of the workers holding that block; TTL entry_ttl_s
    ei:p:{<model>}:w:<worker_id>    string: the worker's marker (see below); TTL entry_ttl_s

The hash tag is the model, so all of one model's keys share a Cluster slot and a lookup is one
pipeline. A set carries no per-member TTL (hash-field TTLs need Redis 7.4), so the whole key's
TTL is pushed forward on every store: a key that no worker stores any more (every holder crashed)
ages out. A crashed worker's id would linger in a key that live workers keep refreshing (a shared
system prompt's blocks: one more member per crash, forever), so the registry purges a worker it
finds dead (kvstore/registry.py: the reader whose SREM removed it from its model's set, one per
crash, calls `purge_workers`). Until then lookups take the registry's live workers
(`longest_prefixes(..., workers=...)`), so a stale entry only ever costs a cache miss.

The worker side, CacheEventPublisher, does not replay an event log. It mirrors the set of blocks
its engine holds and what it last wrote to Redis, and each flush writes the difference. So:

- memory is bounded by the cache size however long Redis is down: no event is ever dropped;
- a block stored then evicted (or evicted then stored) between two flushes costs nothing;
- after an outage, or when the marker shows that Redis lost the worker's entries (a restart
  without persistence, FLUSHDB), the next flush rewrites every held block ("full sync"), and a
  full sync every `refresh_interval_s` keeps long-lived blocks (a system prompt stored once and
  hit for hours) from expiring;
- a failed flush may have been applied in part, so what it tried to store counts as written
  until a full sync evicts it; past twice what the worker holds (a long outage while the cache
  churns) the publisher stops keeping count and "purges" instead: the next flush removes the
  worker from every block of the model (`purge_worker`, a SCAN), then writes what it holds;
- a worker's first flush also purges when it finds a marker already there: an earlier run under
  the same id (a Kubernetes pod's name) left entries that this run's empty cache does not have;
  and a worker whose id was given (`purge_first`) purges before its first write whatever it
  finds: the marker expires `entry_ttl_s` after the earlier run's last write, while a block that
  live workers keep refreshing still lists that run;
- a flush with nothing to write checks the marker every `marker_check_s` (one EXISTS): a
  registry reader that purges the worker as dead while it registers again (kvstore/registry.py)
  removes entries the worker has just rewritten, and the marker last, so the worker finds it
  gone and rewrites them, whether or not its cache changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Collection, Iterable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvstore.client import raise_if_cancelling
from kvstore.keys import PREFIX, as_text, check_id

log = logging.getLogger(__name__)

FIRST_CHUNK = 32  # block hashes read by a lookup's first round trip (most prompts fit)
MAX_CHUNK = 1024  # later round trips double in size up to this, so long prompts take few trips
FORGET_CHUNK = 4096  # blocks removed per round trip by forget_worker (keys scanned: purge_workers)
RETRY_CAP_S = 1.0  # longest wait between a publisher's tries while Redis is down
MARKER_CHECK_S = 1.0  # how often an idle publisher checks that its entries are still there
_GLOB = re.compile(r"[*?\[\]\\]")  # what a SCAN pattern reads as wildcards (a model name may hold)


def _model_prefix(model: str) -> str:
    """The start of every key of `model`'s index, up to the block hash."""
    return f"{PREFIX}p:{{{check_id(model, 'model')}}}:"


def _hex(block_hash: bytes) -> str:
    if not isinstance(block_hash, bytes) or not block_hash:
        raise ValueError(f"a block hash must be non-empty bytes, got {block_hash!r}")
    return block_hash.hex()


def prefix_key(model: str, block_hash: bytes) -> str:
    """The set of ids of the workers serving `model` that hold the block `block_hash`."""
    return _model_prefix(model) + _hex(block_hash)


def marker_key(model: str, worker_id: str) -> str:
    """The worker's marker: present while Redis still has the worker's index entries."""
    return f"{_model_prefix(model)}w:{check_id(worker_id, 'worker_id')}"


class PrefixIndex:
    """Write and query the prefix index; see the module docstring."""

    def __init__(self, redis: Redis, entry_ttl_s: float = 3600.0) -> None:
        if entry_ttl_s < 0.001:
            raise ValueError(f"entry_ttl_s must be at least 0.001 s, got {entry_ttl_s}")
        self.redis = redis  # the process's shared client (kvstore.client.connect)
        self.entry_ttl_s = entry_ttl_s  # a block key no worker stores again expires after this

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.entry_ttl_s * 1000))

    async def publish(
        self, model: str, worker_id: str, stored: Sequence[bytes], evicted: Sequence[bytes]
    ) -> bool:
        """Add the worker to the `stored` blocks' sets and remove it from the `evicted` ones.

        One non-transactional pipeline (the keys may span slots in a future layout; nothing here
        needs atomicity: every command is idempotent). Stored keys get a fresh TTL. A hash in both
        lists ends up removed. Also renews the worker's marker, and returns whether it was still
        there: False on a worker's first publish, or when Redis has lost its entries since the
        last one (restart, flush, expiry), in which case the caller should write all it holds.
        """
        check_id(worker_id, "worker_id")
        prefix, ttl = _model_prefix(model), self._ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(marker_key(model, worker_id), b"1", px=ttl, get=True)
        for h in stored:
            key = prefix + _hex(h)
            pipe.sadd(key, worker_id)
            pipe.pexpire(key, ttl)
        for h in evicted:
            pipe.srem(prefix + _hex(h), worker_id)
        results = await pipe.execute()
        return results[0] is not None

    async def has_marker(self, model: str, worker_id: str) -> bool:
        """Whether the worker's marker is there: its entries have not been purged or lost."""
        return bool(await self.redis.exists(marker_key(model, worker_id)))

    async def longest_prefixes(
        self, model: str, hashes: Sequence[bytes], workers: Collection[str] | None = None
    ) -> dict[str, int]:
        """For each worker, how many leading blocks of `hashes` it holds (blocks 0..n-1, no gap).

        Workers that do not hold block 0 are absent from the result (one holding it alone counts
        1), as are workers not in `workers` when it is given (pass the registry's live workers: their early drop-out also
        ends the scan sooner). The first round trip reads FIRST_CHUNK blocks; the scan stops at
        the first block that no still-running worker holds, and later trips double in size.
        """
        if not hashes:
            return {}
        prefix = _model_prefix(model)
        keys = [prefix + _hex(h) for h in hashes]
        allowed = None if workers is None else set(workers)
        counts: dict[str, int] = {}
        running: set[str] | None = None  # workers holding every block so far; None before block 0
        start, size = 0, FIRST_CHUNK
        while start < len(keys):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys[start : start + size]:
                pipe.smembers(key)
            member_sets: list[set[bytes | str]] = await pipe.execute()
            for i, members in enumerate(member_sets, start):
                holders = {as_text(m) for m in members}
                if running is None:
                    running = holders if allowed is None else holders & allowed
                else:
                    for w in running - holders:  # its run ends before block i
                        counts[w] = i
                    running &= holders
                if not running:
                    return counts
            start, size = start + size, min(size * 2, MAX_CHUNK)
        for w in running or ():
            counts[w] = len(keys)
        return counts

    async def forget_worker(self, model: str, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Remove the worker from those blocks' sets and drop its marker (it leaves cleanly)."""
        prefix = _model_prefix(model)

        async def keys() -> AsyncIterator[str]:
            for h in hashes:
                yield prefix + _hex(h)

        await self._forget(model, [worker_id], keys())

    async def purge_worker(self, model: str, worker_id: str) -> None:
        """Remove the worker from every block set of `model` and drop its marker, for a worker
        that cannot list its blocks (an earlier run's, or ones it lost count of); see
        purge_workers."""
        await self.purge_workers(model, [worker_id])

    async def purge_workers(self, model: str, worker_ids: Collection[str]) -> None:
        """purge_worker for several workers of `model` at once (one SCAN: a host that died took
        all its workers). It SCANs the whole keyspace, FORGET_CHUNK keys a round trip (a million
        keys: 246 SCANs of ~2 ms of Redis time each, 0.65 s in all on a dev VM): for rare events
        (a crash, a restart under a given id), never on a request's path. Idempotent, so two
        purges of one worker at once cost only time."""
        if not worker_ids:
            return
        match = _GLOB.sub(r"\\\g<0>", _model_prefix(model)) + "*"
        keys = self.redis.scan_iter(match=match, count=FORGET_CHUNK, _type="set")
        await self._forget(model, worker_ids, keys)

    async def _forget(
        self, model: str, worker_ids: Collection[str], keys: AsyncIterable[bytes | str]
    ) -> None:
        ids = [check_id(w, "worker_id") for w in worker_ids]
        pipe = self.redis.pipeline(transaction=False)
        async for key in keys:
            pipe.srem(key, *ids)
            if len(pipe) >= FORGET_CHUNK:
                await pipe.execute()  # bounded pipelines: each stays well within the timeout
        # The markers go last: a worker that wrote its entries again while a registry reader
        # purged it (it heartbeated again after being found dead) finds its marker gone at its
        # next flush, and writes them once more.
        pipe.delete(*(marker_key(model, w) for w in ids))
        await pipe.execute()


class CacheEventPublisher:
    """A worker's side of the index: collects cache events, writes them in batches.

    `record` is called from the engine thread (or the event loop) and only updates two sets under
    a lock. `run` is the background task that flushes every `flush_interval_s`; it survives Redis
    outages (one warning per outage, retries backing off to RETRY_CAP_S) and then re-syncs.
    """

    def __init__(
        self,
        index: PrefixIndex,
        model: str,
        worker_id: str,
        flush_interval_s: float = 0.05,
        max_batch: int = 4096,
        refresh_interval_s: float | None = None,
        purge_first: bool = False,
        marker_check_s: float = MARKER_CHECK_S,
        paused: Callable[[], bool] | None = None,
    ) -> None:
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if refresh_interval_s is not None and refresh_interval_s <= 0:
            raise ValueError(f"refresh_interval_s must be > 0, got {refresh_interval_s}")
        if marker_check_s < 0:
            raise ValueError(f"marker_check_s must be >= 0, got {marker_check_s}")
        self.index = index  # where events go
        self.model = check_id(model, "model")  # the model the worker serves (index namespace)
        self.worker_id = check_id(worker_id, "worker_id")  # this worker
        self.flush_interval_s = flush_interval_s  # time between flushes of `run`
        self.max_batch = max_batch  # most stored (and most evicted) hashes per publish round trip
        # How often a full sync renews every held block's TTL; a third of the TTL by default.
        self.refresh_interval_s = (
            refresh_interval_s if refresh_interval_s is not None else index.entry_ttl_s / 3
        )
        self._lock = threading.Lock()  # guards the three fields below (record runs on any thread)
        self._held: set[bytes] = set()  # blocks the engine holds now, per the recorded events
        self._dirty: set[bytes] = set()  # blocks whose state changed since the last flush
        # the next flush writes every held block (after an outage, a loss); the first one does:
        # it finds an earlier run's marker, if any, even when nothing is cached yet
        self._full = True
        self._closed = False  # close() was called: record() ignores further events
        # Below: touched only by flushes, which _flushing serializes.
        self._flushing = asyncio.Lock()
        self._published: set[bytes] = set()  # a superset of the blocks Redis lists us under
        # `_published` was given up, or an earlier run under this id (`purge_first`: one was
        # given, not drawn at random) may have left entries: the next flush purges first
        self._purge = purge_first
        self._ever_published = False  # a first publish finds no marker, and that is no loss
        self._last_full = time.monotonic()  # when the last full sync succeeded
        # how often a flush with nothing to write checks the marker (0: every one), and when the
        # marker was last seen (a publish sees it too)
        self.marker_check_s = marker_check_s
        self._marker_seen = time.monotonic()
        # True while the worker lets its registry entry expire (a hung engine): nothing is
        # written meanwhile, the lost marker's rewrite included, as a registry reader purges
        # such a worker rightly (its entries would come back a second after, renewed for as long
        # as the process lives); the events wait, and its next registration resyncs
        self.paused = paused
        self._down = False  # the last flush of `run` failed (an outage is being logged)
        self._stop = asyncio.Event()  # set by close(): `run` returns

    def record(self, stored: Iterable[bytes], evicted: Iterable[bytes]) -> None:
        """Note the engine's cache events; cheap, thread-safe, never touches Redis.

        The two lists do not say in which order their events came (a drain between engine
        steps may hold a KV import's blocks stored, then evicted by the step's allocations, as
        well as a step's evictions, then its stores), but the engine's events of one hash
        alternate: it stores a hash it does not hold and evicts one it holds. So a hash stored
        more times than evicted is held afterwards, one evicted more times is not, and one
        stored as many times as evicted is as it was before: stored then evicted, it is not
        held; evicted then stored again, it is.
        """
        net: dict[bytes, int] = {}  # per hash: stores less evictions
        for h in stored:
            net[h] = net.get(h, 0) + 1
        for h in evicted:
            net[h] = net.get(h, 0) - 1
        with self._lock:
            if self._closed:
                return
            for h, n in net.items():
                if n > 0:
                    self._held.add(h)
                elif n < 0:
                    self._held.discard(h)
                self._dirty.add(h)

    def resync(self) -> None:
        """Write every held block at the next flush: Redis has lost this worker's entries (its
        registry entry had to be created again), and a worker whose cache does not change would
        otherwise not notice until its next cache event or the periodic full sync."""
        with self._lock:
            self._full = True

    @property
    def held(self) -> set[bytes]:
        """A copy of the blocks the engine holds, per the recorded events."""
        with self._lock:
            return set(self._held)

    async def run(self) -> None:
        """Flush every `flush_interval_s` until close(); Redis errors are logged, never raised."""
        delay = self.flush_interval_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stop.wait()
            if self._stop.is_set():
                return
            try:
                await self.flush()
            except (RedisError, OSError) as e:
                raise_if_cancelling()
                if not self._down:
                    log.warning(
                        "prefix index unreachable (%s: %s); worker %s keeps its cache events and "
                        "re-syncs when Redis is back",
                        type(e).__name__,
                        e,
                        self.worker_id,
                    )
                    self._down = True
                delay = min(delay * 2, max(self.flush_interval_s, RETRY_CAP_S))
                continue
            if self._down:
                log.info("prefix index reachable again; worker %s re-synced", self.worker_id)
                self._down = False
            delay = self.flush_interval_s

    async def flush(self) -> None:
        """Write the changes recorded so far; raises RedisError/OSError when Redis is down.

        On an error nothing is lost: the next flush is a full sync.
        """
        async with self._flushing:
            if await self._flush_once():
                await self._flush_once()

    async def _flush_once(self) -> bool:
        """One flush; returns True when it found that the index must be written again: Redis has
        lost entries it had written, or holds an earlier run's."""
        now = time.monotonic()
        if self.paused is not None and self.paused():
            return False
        with self._lock:
            if self._closed:  # close() removed us from the index; a refresh must not re-add us
                return False
            dirty, self._dirty = self._dirty, set()
            purge, self._purge = self._purge, False
            full = purge or self._full or now - self._last_full >= self.refresh_interval_s
            self._full = False
            held, published = self._held, self._published
            if full:
                stored = list(held)
                evicted = [] if purge else [h for h in published if h not in held]
            else:
                stored = [h for h in dirty if h in held and h not in published]
                evicted = [h for h in dirty if h not in held and h in published]
        if not full and not stored and not evicted:
            # Nothing to write, but a registry reader may have purged this worker as dead while
            # it registered again (its purge removes what the rewrite at registration wrote,
            # ahead of its SCAN, and the marker last): only a publish noticed the marker gone,
            # so a worker whose cache did not change stayed unlisted until it did
            if not self._ever_published or now - self._marker_seen < self.marker_check_s:
                return False
            if await self.index.has_marker(self.model, self.worker_id):
                self._marker_seen = now
                return False
            log.info("prefix index lost worker %s's entries (purged or expired); re-syncing",
                     self.worker_id)  # fmt: skip
            with self._lock:
                self._full = True
            return True
        marker_found = True
        n = self.max_batch
        try:
            if purge:
                await self.index.purge_worker(self.model, self.worker_id)
            for i in range(0, max(len(stored), len(evicted), 1), n):
                found = await self.index.publish(
                    self.model, self.worker_id, stored[i : i + n], evicted[i : i + n]
                )
                marker_found = marker_found and found
        except BaseException:  # an error or a cancellation, maybe after part of it was applied
            self._published.update(stored)  # so it stays a superset of what Redis has,
            if purge or len(self._published) > 2 * len(held) + self.max_batch:  # or is given up
                self._published.clear()
                self._purge = True
            with self._lock:
                self._full = True
            raise
        self._marker_seen = now
        if full:
            self._published = set(stored)
            self._last_full = now
        else:
            self._published.difference_update(evicted)
            self._published.update(stored)
        first, self._ever_published = not self._ever_published, True
        if first and marker_found:
            log.info("prefix index holds entries of an earlier run of worker %s; removing them",
                     self.worker_id)  # fmt: skip
            self._purge = True
            return True
        if not marker_found and not first and not full:
            log.info("prefix index lost worker %s's entries; re-syncing", self.worker_id)
            with self._lock:
                self._full = True
            return True
        return False

    async def close(self, held: Iterable[bytes] = ()) -> None:
        """Stop `run` and remove this worker from the index (clean shutdown).

        Removes every block held, published, or listed in `held` (say the engine's
        `cached_hashes()`), or every block of the model when it lost count (see the module
        docstring); pending events are not flushed first, since the removal covers them.
        A Redis error is logged, not raised: the entries then age out.
        """
        self._stop.set()
        async with self._flushing:
            with self._lock:
                self._closed = True
                hashes = self._held | self._published | set(held)
                self._held.clear()
                self._dirty.clear()
            try:
                if self._purge:  # it lost count of its entries
                    await self.index.purge_worker(self.model, self.worker_id)
                else:
                    await self.index.forget_worker(self.model, self.worker_id, hashes)
            except (RedisError, OSError) as e:
                log.warning(
                    "could not remove worker %s from the prefix index: %s", self.worker_id, e
                )
            self._published.clear()
