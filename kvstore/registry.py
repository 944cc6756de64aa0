"""The worker registry: which workers are alive, what they serve, and how loaded they are.

A worker writes its WorkerInfo into `ei:w:{<id>}` with a TTL and adds its id to its model's set
`ei:m:{<model>}:workers`, and its model to `ei:models`; it repeats that (the heartbeat) well
within the TTL. A worker that stops heartbeating (crash, partition, SIGKILL) disappears when its
hash expires: readers skip ids whose hash is gone and remove them from the set, so sets never
need a sweeper process. The reader whose SREM removed a dead id (exactly one, whichever gateway
or pool got there first) also removes it from the model's prefix index (kvstore/prefix_index.py),
where blocks that live workers keep refreshing would list it forever. A model whose set a reader
finds empty leaves `ei:models`, which every gateway reads twice a second.

The keys live in different Cluster slots, so writes go through non-transactional pipelines (one
round trip, no MULTI). Races between a reader's pruning and a heartbeat heal themselves: every
heartbeat re-adds the id to its model's set and the model to `ei:models`. A worker heartbeating
again after a reader found it dead (a stalled engine, a partition, a restart under its id) finds
its entry created anew and writes its prefix-index entries again (`CacheEventPublisher.resync`).
One that does so between the reader's read of its hash and its SREM is put back and not purged
(`_still_gone`); one that does so later has its rewrite cut by the purge, finds the marker the
purge removes last gone, and writes them once more.

A reader that Redis refuses writes (a gateway whose URL names a replica, or whose ACL lets it
read only: READONLY, NOPERM) leaves that pruning to readers that may write (the pool managers,
other gateways, the next heartbeat): its read stands. A refused SREM failed the whole read, at
every read for as long as a stale id stayed, and the reader's snapshot froze.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvstore.client import raise_if_cancelling, refusal_ignored
from kvstore.keys import (
    MODELS_KEY,
    as_text,
    check_id,
    model_workers_key,
    usable_id,
    worker_key,
)
from kvstore.prefix_index import PrefixIndex
from kvstore.protocol import WorkerInfo

log = logging.getLogger(__name__)


class Registry:
    """Register, heartbeat, deregister and list workers; see the module docstring."""

    def __init__(self, redis: Redis, ttl_s: float = 10.0) -> None:
        if ttl_s < 0.001:
            raise ValueError(f"ttl_s must be at least 0.001 s, got {ttl_s}")
        self.redis = redis  # the process's shared client (kvstore.client.connect)
        self.ttl_s = ttl_s  # a worker not heard from for this long is gone
        self.index = PrefixIndex(redis)  # where a dead worker's cached blocks are purged from
        # ids whose hash the last read could not parse: logged once, not at every read (a
        # gateway reads twice a second) for as long as the entry lives
        self._unreadable: set[str] = set()

    async def register(self, info: WorkerInfo) -> bool:
        """Announce a worker; the same write as a heartbeat (a restart re-registers)."""
        return await self.heartbeat(info)

    async def heartbeat(self, info: WorkerInfo) -> bool:
        """Write the worker's current state and push its expiry `ttl_s` into the future.

        The caller sets `info.updated_at`; the registry stores the info as given. Returns
        whether the entry had to be created: on the first registration, and whenever Redis has
        lost it since (a restart or flush, or an outage longer than the TTL), which tells the
        worker to write again what else it keeps there.
        """
        key = worker_key(info.worker_id)
        pipe = self.redis.pipeline(transaction=False)
        # HSET and PEXPIRE go out in one write, so Redis runs both; the hash always carries a TTL.
        pipe.exists(key)
        pipe.hset(key, mapping=info.to_redis())  # type: ignore[arg-type]
        pipe.pexpire(key, max(1, round(self.ttl_s * 1000)))
        pipe.sadd(model_workers_key(info.model), info.worker_id)
        pipe.sadd(MODELS_KEY, info.model)
        existed, *_ = await pipe.execute()
        return not existed

    async def deregister(self, worker_id: str, model: str) -> None:
        """Remove a worker at once (clean shutdown), instead of waiting for its TTL."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(worker_key(worker_id))
        pipe.srem(model_workers_key(model), worker_id)
        await pipe.execute()

    async def workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Live workers serving `model` (every model when None), ordered by worker id.

        Ids whose hash has expired, or whose hash now says another model, leave the set and
        their model's prefix index; a model whose set is empty leaves `ei:models`.
        """
        if model is not None:
            models = [check_id(model, "model")]
        else:
            names = sorted(as_text(m) for m in await self.redis.smembers(MODELS_KEY))
            models = [m for m in names if usable_id(m, "model name", MODELS_KEY)]
            if len(models) < len(names):  # written by something other than a worker
                with refusal_ignored():  # (refused: see the module docstring)
                    await self.redis.srem(MODELS_KEY, *(m for m in names if m not in models))
        if not models:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for m in models:
            pipe.smembers(model_workers_key(m))
        member_sets: list[set[bytes | str]] = await pipe.execute()
        pairs: list[tuple[str, str]] = []
        bad: list[tuple[str, str]] = []
        empty: list[str] = []  # models with no worker left
        for m, ids in zip(models, member_sets, strict=True):
            if not ids:
                empty.append(m)
            for wid in map(as_text, ids):
                usable = usable_id(wid, "worker id", model_workers_key(m))
                (pairs if usable else bad).append((m, wid))
        await self._prune(bad)  # (ids that cannot name a prefix-index key: nothing to purge)
        await self._forget_models(empty)
        if not pairs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _, wid in pairs:
            pipe.hgetall(worker_key(wid))
        hashes: list[dict[bytes | str, bytes | str]] = await pipe.execute()
        found: dict[str, WorkerInfo] = {}
        stale: list[tuple[str, str]] = []
        unreadable: set[str] = set()
        for (m, wid), raw in zip(pairs, hashes, strict=True):
            if not raw:  # the hash expired: the worker stopped heartbeating
                stale.append((m, wid))
                continue
            info = self._parse(wid, raw, wid not in self._unreadable)
            if info is None:  # garbled: skipped, and left to expire on its own TTL
                unreadable.add(wid)
                continue
            if info.model != m:  # the id re-registered under another model
                stale.append((m, wid))
                continue
            found[wid] = info
        await self._purge(await self._still_gone(await self._prune(stale)))
        if model is None:  # (a read of every model sees every unreadable entry)
            self._unreadable = unreadable
        else:
            self._unreadable |= unreadable
        return [found[wid] for wid in sorted(found)]

    async def models(self) -> list[str]:
        """Names of the models with at least one live worker, sorted."""
        return sorted({w.model for w in await self.workers()})

    @staticmethod
    def _parse(
        worker_id: str, raw: dict[bytes | str, bytes | str], say: bool = True
    ) -> WorkerInfo | None:
        """WorkerInfo from a hash, or None (logged if `say`) when the hash is incomplete or
        garbled."""
        try:
            return WorkerInfo.from_redis(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError, orjson.JSONDecodeError) as e:
            if say:
                log.warning("skipping worker %s: unreadable registry hash: %s", worker_id, e)
            return None

    async def _prune(self, stale: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Remove (model, worker id) pairs from their model sets; returns those this call
        removed (of readers pruning one pair at once, SREM answers 1 to one only)."""
        stale = list(stale)
        if not stale:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for m, wid in stale:
            pipe.srem(model_workers_key(m), wid)
        removed: list[int] = []
        with refusal_ignored():  # (refused, see the module docstring: this reader removed none)
            removed = await pipe.execute()
        if not removed:
            return []
        return [pair for pair, n in zip(stale, removed, strict=True) if n]

    async def _still_gone(self, pruned: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Of the (model, worker id) pairs this read pruned, those whose worker has not
        registered again since its hash was read; one that has (a stalled engine back, a
        restart under its id, between the HGETALL and the SREM) is put back in its model's set
        and not purged. Purged, it lost the entries it had just written and, as its hash
        existed, never heard of it: the gateways routed its cached prefixes elsewhere until
        its cache changed. (A worker registering again after this check finds its entry
        created anew, and its publisher rewrites what a purge under way removes: see
        CacheEventPublisher's marker check.)"""
        if not pruned:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _, wid in pruned:
            pipe.hget(worker_key(wid), "model")
        models: list[bytes | str | None] = await pipe.execute()
        back: list[tuple[str, str]] = []
        for (m, wid), raw in zip(pruned, models, strict=True):
            try:
                if raw is not None and orjson.loads(raw) == m:
                    back.append((m, wid))
            except orjson.JSONDecodeError:  # garbled: as good as gone
                pass
        if back:
            pipe = self.redis.pipeline(transaction=False)
            for m, wid in back:
                pipe.sadd(model_workers_key(m), wid)
            # (out of memory, Redis takes the SREM and refuses the SADD: the worker's next
            # heartbeat puts it back; the read stands)
            with refusal_ignored():
                await pipe.execute()
        return [pair for pair in pruned if pair not in back]

    async def _purge(self, dead: list[tuple[str, str]]) -> None:
        """Remove dead workers from their models' prefix index: one SCAN per model, by the one
        reader that pruned them. Best effort: a failure is logged, not raised (the snapshot is
        good, and a stale entry costs only a cache miss); a worker restarting under its id
        purges at its first flush too."""
        by_model: dict[str, list[str]] = {}
        for m, wid in dead:
            by_model.setdefault(m, []).append(wid)
        for m, wids in by_model.items():
            try:
                await self.index.purge_workers(m, wids)
            except (RedisError, OSError) as e:
                raise_if_cancelling()
                log.warning("could not remove dead workers %s from the prefix index of %r: %s",
                            wids, m, e)  # fmt: skip

    async def _forget_models(self, empty: list[str]) -> None:
        """Remove models with no worker left from `ei:models`. A worker registering one of them
        at the same time wrote its model's set before `ei:models` (one pipeline, in order): so
        either its SADD comes after our SREM, or our SCARD, after the SREM, sees its id and
        puts the model back. (In a Redis Cluster the two keys' nodes do not keep that order:
        the worker's next heartbeat re-adds the model.)"""
        if not empty:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(MODELS_KEY, *empty)
        for m in empty:
            pipe.scard(model_workers_key(m))
        answered: list[int] = []
        with refusal_ignored():  # (refused, see the module docstring: nothing was removed)
            answered = await pipe.execute()
        if not answered:
            return
        _, *sizes = answered
        back = [m for m, n in zip(empty, sizes, strict=True) if n]
        if back:
            with refusal_ignored():  # (as in _still_gone: the next heartbeat's)
                await self.redis.sadd(MODELS_KEY, *back)
