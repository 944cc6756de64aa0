"""What one gateway knows of the cluster: a registry snapshot, session placements, Redis health.

The gateway re-reads the registry every `registry_refresh_s` in the background, so routing reads
memory, never Redis, on the hot path. When Redis is unreachable the last snapshot stays in use
(load-based routing without affinity), readiness reports it, and the loop recovers on its own
when Redis answers again. A Redis that answers but refuses this gateway's writes (out of memory,
a replica, an ACL without writes) is read all the same: the snapshot follows workers and pools
joining and leaving, and the refusal is said once (`refusal`) and in readiness. Workers that
fail a request are set aside locally until the registry shows them heartbeating again after the
failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, ResponseError

from gateway.config import GatewayConfig
from gateway.regions import RegionCatalog
from gateway.routing import Router
from gateway.tokenization import GatewayTokenizers
from kvstore.client import is_refusal, raise_if_cancelling
from kvstore.demand import Demand, PoolInfo
from kvstore.keys import gateway_marker_key
from kvstore.placement import Placement, SessionStore
from kvstore.prefix_index import PrefixIndex
from kvstore.protocol import WorkerInfo
from kvstore.registry import Registry
from runtime.model_specs import parse_models

log = logging.getLogger("edgeinfer.gateway")
T = TypeVar("T")

# how long a worker lost by Redis is routed to without registering again: CARRY_S, or its
# heartbeat period plus CARRY_MARGIN_S (a late heartbeat, the registry read that sees it) if longer
CARRY_S = 10.0
CARRY_MARGIN_S = 5.0
# sessions whose placement this gateway last read or wrote, kept in memory (least recently used
# dropped first) to route them while Redis is down or has lost its data
RECENT_SESSIONS = 65536
MARKER_TTL_S = 3600  # a gateway's marker outlives any pause between its registry reads
# a readiness check's write waits this long at most: inside a probe's own timeout (1 s in
# Kubernetes), so a Redis that hangs makes the probe answer "not ready", not time out
PROBE_TIMEOUT_S = 0.5
# a refusal on requests' paths (Redis answering an error: the same one at every request) is
# logged at most this often per error type
REFUSAL_LOG_S = 60.0


class ClusterView:
    def __init__(self, config: GatewayConfig, redis: Redis, catalog: RegionCatalog) -> None:
        self.config = config
        self.redis = redis
        self.registry = Registry(redis)
        self.sessions = SessionStore(redis, idle_ttl_s=config.session_ttl_s)
        self.router = Router(config.region, catalog, config.routing)
        self.tokenizers = GatewayTokenizers(redis, on_redis_error=self.redis_failed)
        self.prefix = PrefixIndex(redis)
        self.demand = Demand(redis)
        self.catalog = catalog
        self.workers: list[WorkerInfo] = []  # last registry snapshot (+ those carried)
        # workers Redis lost (restart, outage) that have not registered again: until when kept
        self._carried: dict[str, tuple[WorkerInfo, float]] = {}
        self._marker_key = gateway_marker_key(f"gw-{config.region}-{uuid.uuid4().hex[:12]}")
        self.pools: list[PoolInfo] = []  # last snapshot of the pools that can start workers
        # pools Redis lost (restart, flush) that have not announced themselves again: until when
        self._carried_pools: dict[str, tuple[PoolInfo, float]] = {}
        self._refreshing: asyncio.Task[None] | None = None  # the refresh waiters share
        # (operation, seconds, error type or None) per call that reached Redis: only those (a
        # placement answered from memory while Redis is down, or a claim skipped, is no call)
        self.on_redis: Callable[[str, float, str | None], None] = _ignore
        self.redis_ok = False  # the last Redis call succeeded
        # why the last Redis call failed, as readiness says it (`redis_error`)
        self._failure = "no registry read yet"
        # what Redis refused of this gateway's writes (out of memory, READONLY, NOPERM), until
        # it takes one again: Redis still answers, and the registry is read all the same
        self.refusal: str | None = None
        self._refusal_type: str | None = None  # its error type
        self._refusal_said: dict[str, float] = {}  # error type -> monotonic time last logged
        self._refusal_logged = False  # the refusal noted now was logged as it began
        self._marked = False  # the marker was there (written or read) at the last read
        self.refreshed_at = 0.0  # monotonic time of the last good snapshot
        self._start_failure_said = False  # the first registry read's failure has been logged
        # worker id -> (monotonic time it failed a request here, its heartbeat time as the first
        # registry read begun after that showed it; None until one has): it is back once a read
        # shows a later heartbeat. Its heartbeat times are by its own clock, never compared with
        # ours: one 60 s behind was set aside for 60 s by a failure, one ahead not at all
        self.failed: dict[str, tuple[float, float | None]] = {}
        # session id -> its placement as this gateway last read or wrote it (RECENT_SESSIONS),
        # and the monotonic time it was last used here (forgotten after session_ttl_s, as in
        # Redis): (worker_id, region, used): tuples of strings and a float, which the cyclic
        # collector stops tracking, where 65,536 Placement objects would each be scanned by
        # every full collection
        self._recent: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        # every model a snapshot has shown, or the catalog lists (404 vs 503)
        self.seen_models: set[str] = _catalog_models(catalog)

    # ------------------------------------------------------------------ registry snapshot
    async def refresh(self) -> None:
        t0, read_at = time.perf_counter(), time.monotonic()
        try:
            workers = await self.registry.workers()
            pools = await self.demand.pools()
            lost = await self._mark()
            self.on_redis("registry_read", time.perf_counter() - t0, None)
        except Exception as e:  # connection refused, timeout, cluster errors, a read refused
            self.on_redis("registry_read", time.perf_counter() - t0, _error_type(e))
            self._failure = _describe(e)
            what = "refused the registry read" if is_refusal(e) else "unreachable"
            if self.redis_ok:
                log.warning("redis %s, routing on the last known registry: %s", what, e)
            elif not self.refreshed_at and not self._start_failure_said:
                # (never read: the warnings above fire when Redis stops answering, so a gateway
                # that could not read it from the start, a wrong password or URL, never said why)
                log.warning("redis %s, no registry read yet (requests get 503 until one is): "
                            "%s: %s", what, _error_type(e), e)  # fmt: skip
                self._start_failure_said = True
            self.redis_ok = False
            return
        reset = not self.redis_ok or lost
        if lost:
            # Redis lost its data before the marker was read: perhaps after the registry was,
            # so read it again, or the workers and pools it lost would not be carried
            try:
                workers = await self.registry.workers()
                pools = await self.demand.pools()
            except Exception as e:
                log.warning("redis unreachable, routing on the last known registry: %s", e)
                self._failure = _describe(e)
                self.redis_ok = False
                return
        if not self.redis_ok:  # (at start-up routine; after an outage worth a warning)
            level = logging.WARNING if self.refreshed_at else logging.INFO
            log.log(level, "redis reachable: %d workers registered", len(workers))
        self.redis_ok = True
        self.refreshed_at = time.monotonic()
        workers = self._carry(workers, reset)
        self.workers = workers
        self.pools = pools = self._carry_pools(pools, reset)
        self.seen_models.update(w.model for w in workers)
        self.seen_models.update(m for p in pools for m in p.models)
        # A failed worker is back once it heartbeats after the failure; one the snapshot no
        # longer lists (its entry expired: it crashed, or left) is forgotten, as routing reads
        # only the snapshot: a worker that registers again under its id has heartbeat since the
        # failure. So `failed` never outgrows the snapshot, where it kept every worker that
        # failed a request and never came back (a long-lived gateway under churning workers)
        listed = {w.worker_id for w in workers}
        for wid in [wid for wid in self.failed if wid not in listed]:
            del self.failed[wid]
        for w in workers:
            failed = self.failed.get(w.worker_id)
            if failed is None:
                continue
            at, seen = failed
            if seen is None:
                if read_at > at:
                    self.failed[w.worker_id] = (at, w.updated_at)
            elif w.updated_at != seen:
                del self.failed[w.worker_id]

    def _carry(self, workers: list[WorkerInfo], reset: bool) -> list[WorkerInfo]:
        """The registry's workers, plus those of the last snapshot that it lost in an outage or
        a restart of Redis (`reset`), until they register again or for up to `_carry_s`: a
        worker re-registers on its next heartbeat, and meanwhile requests would find no worker
        (503). One that has really gone fails its requests (tried elsewhere) and is set aside."""
        now = time.monotonic()
        listed = {w.worker_id for w in workers}
        if reset:
            lost = [w for w in self.workers if w.worker_id not in listed]
            if lost:
                log.warning("redis lost %d worker entries (restart or outage): routing to them "
                            "until they register again", len(lost))  # fmt: skip
            # (one carried already keeps its deadline: renewed at each reset, a worker gone for
            # good was carried for as long as Redis failed a read now and then, and meanwhile
            # `recovering` held back every session's placement and prefix lookups)
            self._carried = {w.worker_id: (w, now + _carry_s(w)) for w in lost} | self._carried
        carried = self._carried
        self._carried = {wid: (w, until) for wid, (w, until) in carried.items()
                         if until > now and wid not in listed}  # fmt: skip
        # (said when it ends: while workers are carried, prefix lookups and new sessions'
        # placement are off, and the log said when that began but not when it ended, nor which
        # carried workers never came back)
        gone = sorted(wid for wid in carried if wid not in listed and wid not in self._carried)
        if gone:
            log.warning("workers lost by redis did not register again: %s; no longer routed to",
                        ", ".join(gone))  # fmt: skip
        if carried and not self._carried:
            log.warning("every worker lost by redis is back or given up: prefix lookups and "
                        "session placement resume")  # fmt: skip
        return workers + [w for w, _ in self._carried.values()]

    def _carry_pools(self, pools: list[PoolInfo], reset: bool) -> list[PoolInfo]:
        """The registry's pools, plus those of the last snapshot that Redis lost (`reset`),
        until they announce themselves again (at their next heartbeat, every 2 s by default) or
        for up to CARRY_S: meanwhile a model that only a pool serves was answered 503
        no_workers, left /v1/models, and /readyz of a region with no worker running said it was
        not ready. A request held for a pool that has really gone is answered 503 pool_unavailable
        once the carry ends (the gateway's --pool-gone-grace after it)."""
        now = time.monotonic()
        listed = {p.pool_id for p in pools}
        if reset:  # (one carried already keeps its deadline, as a worker does)
            lost = {p.pool_id: (p, now + CARRY_S) for p in self.pools if p.pool_id not in listed}
            self._carried_pools = lost | self._carried_pools
        self._carried_pools = {pid: (p, until) for pid, (p, until) in self._carried_pools.items()
                               if until > now and pid not in listed}  # fmt: skip
        return pools + [p for p, _ in self._carried_pools.values()]

    async def _mark(self) -> bool:
        """Renew this gateway's marker; whether Redis lost its data since the last read (the
        marker was there and is gone: kvstore.keys). A write Redis refuses (out of memory, a
        replica, an ACL) is noted (`refusal`) and the marker read instead: the registry read
        stands (it was dropped, and the snapshot froze for as long as Redis refused), and a
        loss is still seen. (Refused for longer than MARKER_TTL_S, the marker expires, read
        once as a loss: workers and pools that left meanwhile are carried, CARRY_S at most.)"""
        try:
            found = await self.redis.set(self._marker_key, b"1", ex=MARKER_TTL_S, get=True)
        except ResponseError as e:
            if not is_refusal(e):
                raise
            self._refused(e)
            found = await self.redis.get(self._marker_key)
            had, self._marked = self._marked, found is not None
        else:
            self._accepted()
            had, self._marked = self._marked, True
        return had and found is None

    def _refused(self, e: Exception) -> None:
        """Redis answered a write of this gateway's with an error (OOM, READONLY, NOPERM): note
        it for readiness, and say so when it begins (once per REFUSAL_LOG_S per error type: a
        refusal on requests' paths that the next registry read's write does not meet, an ACL's
        on session claims only, would begin again at every read)."""
        kind, now = _error_type(e), time.monotonic()
        if self._refusal_type != kind:
            self._refusal_type = kind
            said_at = self._refusal_said.get(kind, -REFUSAL_LOG_S)
            self._refusal_logged = now - said_at >= REFUSAL_LOG_S
            if self._refusal_logged:
                self._refusal_said[kind] = now
                log.warning("redis refuses this gateway's writes (%s: %s): it routes on the "
                            "registry it reads, without session placement, until Redis takes "
                            "them again", kind, e)  # fmt: skip
        self.refusal = _describe(e)

    def _accepted(self) -> None:
        """Redis took a write of this gateway's: a refusal noted has ended."""
        if self.refusal is not None and self._refusal_logged:
            log.warning("redis takes this gateway's writes again")
        self.refusal = self._refusal_type = None
        self._refusal_logged = False

    @property
    def redis_error(self) -> str | None:
        """What is wrong with Redis, as this gateway last found it (readiness says it): that it
        is unreachable, or what it refused (naming the error: an ACL's NOPERM is not a network
        fault); None when its last calls succeeded."""
        return self.refusal if self.redis_ok else self._failure

    @property
    def redis_problem(self) -> str | None:
        """`redis_error` without Redis's own message, for what anyone may read (readiness, a
        client's 503): whether Redis is unreachable or refused, and the error's type. A
        connection error's message names Redis's address."""
        error = self.redis_error
        return None if error is None else ": ".join(error.split(": ", 2)[:2])

    async def refresh_loop(self) -> None:
        while True:
            await self.refresh()
            raise_if_cancelling()
            await asyncio.sleep(self.config.registry_refresh_s)

    async def refresh_soon(self, max_age_s: float) -> None:
        """A snapshot at most `max_age_s` old, for requests waiting on a worker to start: all of
        them share one refresh in flight rather than each reading Redis."""
        if time.monotonic() - self.refreshed_at <= max_age_s:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self.refresh())
        await asyncio.shield(self._refreshing)

    def pool_region(self, model: str) -> str | None:
        """The nearest region (this gateway's first) with a live pool that can start `model`."""
        regions = sorted({p.region for p in self.pools if model in p.models})
        if not regions:
            return None
        return self.catalog.nearest_first(self.config.region, regions)[0]

    @property
    def recovering(self) -> bool:
        """Whether workers lost by a restart or an outage of Redis are being carried: until
        they register again, the prefix index lacks their blocks (a worker writes them again
        at its next heartbeat), so a prefix match would send every session to whichever worker
        wrote its entries first, and the session would stay there."""
        return bool(self._carried)

    def live_workers(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.worker_id not in self.failed]

    def mark_failed(self, worker_id: str) -> None:
        self.failed[worker_id] = (time.monotonic(), None)

    def models(self) -> list[str]:
        """Models served now, or startable on demand by a pool."""
        pooled = {m for p in self.pools for m in p.models}
        return sorted({w.model for w in self.live_workers()} | pooled)

    # ------------------------------------------------------------------ session placement
    async def placement(self, session_id: str) -> Placement | None:
        """The session's worker, or None.

        While Redis is down, the placement this gateway last read or wrote for the session (kept
        in memory, the most recent RECENT_SESSIONS): the session stays where its KV cache is
        rather than going wherever load sends each request (the router still checks that the
        worker is alive). Once a Redis call has failed, none is tried on a request's path until
        the refresh loop (every registry_refresh_s) reaches Redis again: a Redis that hangs
        would otherwise cost every session request its socket timeout. (A refusal of a write,
        kvstore.client.is_refusal, is no failure: Redis answers, and reads go on being asked.)

        When Redis has no placement but this gateway remembers one, Redis may have lost it
        (a restart that emptied it, FLUSHALL), perhaps before any registry read could notice:
        the remembered worker is claimed again (`_reclaim`), while the workers register again
        and after, rather than load placing the session elsewhere for good."""
        if not self.redis_ok:
            return self._remembered(session_id)
        try:
            found = await self._timed("session_get", self.sessions.get(session_id))
        except Exception as e:
            self.redis_failed(e)
            return self._remembered(session_id)
        if found is None:  # new, idle past its TTL, or lost by Redis with the rest
            return await self._reclaim(session_id)
        self._remember(session_id, found)
        return found

    async def _reclaim(self, session_id: str) -> Placement | None:
        """Place a session Redis lacks on the worker this gateway remembers it on, if that
        worker is live and takes requests: unless another gateway placed it first (whose
        placement stands, as with any claim). Also while `recovering`, unlike `claim`: this
        worker holds the session's KV cache, whatever the partial prefix index says.

        None when this gateway remembers nothing (the session is placed by load), or when the
        remembered worker has failed, gone, or is overloaded or draining: then the session is
        routed as a new one (claimed for the router's pick), or, while `recovering`, the
        remembered placement (the router moves the session, as from any unusable worker)."""
        remembered = self._remembered(session_id)
        if remembered is None:
            return None
        home = next((w for w in self.live_workers() if w.worker_id == remembered.worker_id), None)
        if home is None or home.overloaded:
            return remembered if self.recovering else None
        return await self._claim(session_id, remembered) or remembered

    def _remember(self, session_id: str, placement: Placement) -> None:
        self._recent[session_id] = (placement.worker_id, placement.region, time.monotonic())
        self._recent.move_to_end(session_id)
        if len(self._recent) > RECENT_SESSIONS:
            self._recent.popitem(last=False)

    def _remembered(self, session_id: str) -> Placement | None:
        """The placement remembered for the session, renewed as used; None if none, or if the
        session has been idle longer than its TTL (Redis would have forgotten it too)."""
        found = self._recent.get(session_id)
        if found is None:
            return None
        worker_id, region, used = found
        now = time.monotonic()
        if now - used > self.config.session_ttl_s:
            del self._recent[session_id]
            return None
        self._recent[session_id] = (worker_id, region, now)
        self._recent.move_to_end(session_id)
        return Placement(worker_id, region)

    async def claim(self, session_id: str, worker: WorkerInfo) -> Placement | None:
        """Place a new session on `worker` unless another gateway placed it first, and remember
        the placement that holds: ours, or the winner's, where every gateway then routes it.
        None (nothing placed) while Redis is down, or `recovering`: sessions are routed by what
        this gateway remembers (or by load) meanwhile, and placed once every worker has
        registered again and written its prefix cache's entries (a remembered one on its next
        request: `placement`)."""
        if not self.redis_ok or self.recovering:
            return None
        return await self._claim(session_id, Placement(worker.worker_id, worker.region))

    async def _claim(self, session_id: str, placement: Placement) -> Placement | None:
        """Claim the session for `placement` unless another gateway did first; the placement
        that holds (remembered), or None when Redis failed."""
        try:
            placed = await self._timed("session_claim", self.sessions.claim(session_id, placement))
        except Exception as e:
            self.redis_failed(e)
            return None
        self._remember(session_id, placed)
        return placed

    async def record(self, session_id: str, old: Placement | None, worker: WorkerInfo) -> None:
        """Place the session on `worker` (claim it, or move it from `old`), and remember where
        it is then: on `worker`, or where another gateway placed or moved it first (as Redis
        says), so this gateway does not keep routing it elsewhere once Redis is down."""
        new = Placement(worker.worker_id, worker.region)
        self._remember(session_id, new)  # (in memory even while Redis is down)
        if old is None:
            await self.claim(session_id, worker)
            return
        if old.worker_id == worker.worker_id or not self.redis_ok:
            return
        try:
            moved = self.sessions.move(session_id, old.worker_id, new)
            self._remember(session_id, await self._timed("session_move", moved))
        except Exception as e:
            self.redis_failed(e)

    async def _timed(self, operation: str, call: Awaitable[T]) -> T:
        """`call`'s result, its time reported to `on_redis` (with its error's type if it
        raised)."""
        t0 = time.perf_counter()
        try:
            result = await call
        except Exception as e:
            self.on_redis(operation, time.perf_counter() - t0, _error_type(e))
            raise
        self.on_redis(operation, time.perf_counter() - t0, None)
        return result

    def redis_failed(self, e: Exception) -> None:
        if is_refusal(e):
            # Redis answered, refusing (out of memory, READONLY, NOPERM): it is not down, and a
            # refusal costs no timeout, so requests still ask it (its reads are answered). (Not
            # a cluster's CLUSTERDOWN or TRYAGAIN: redis-py's cluster client sleeps and reconnects
            # before it raises those, so asking again on every request would cost each one that.)
            # Marked failed here, it was marked fine again by the next registry read: two
            # warnings per read, for as long as Redis refused
            self._refused(e)
            return
        if self.redis_ok:
            log.warning("redis failed on a request's path (%s): sessions and prefix lookups are "
                        "skipped until it answers again", e)  # fmt: skip
        self._failure = _describe(e)
        self.redis_ok = False

    async def ping(self) -> bool:
        """Whether Redis takes a write of this gateway's now (readiness; why not: `redis_error`).
        The write renews the marker if it is there (SET XX: never creates it, so a Redis that
        lost its data is still noticed by the next registry read). A PING alone passed a Redis
        that answers but refuses every write: out of memory, a replica after a failover, an
        ACL. Bounded by PROBE_TIMEOUT_S."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self.redis.set(self._marker_key, b"1", ex=MARKER_TTL_S, xx=True)
        except Exception as e:
            if is_refusal(e):
                self._refused(e)
                return False
            if self.redis_ok:  # (a probe is often the first to find it: say so once, here)
                log.warning("redis unreachable (a readiness probe), routing on the last known "
                            "registry: %s", e)  # fmt: skip
            self._failure = _describe(e)
            self.redis_ok = False
            return False
        self._accepted()
        return True


def _carry_s(worker: WorkerInfo) -> float:
    """How long a worker lost by Redis is carried: until its next heartbeat has registered it
    again, with a margin; CARRY_S at least, and for a worker that does not say how often it
    heartbeats (an older one)."""
    if worker.heartbeat_s <= 0:
        return CARRY_S
    return max(CARRY_S, worker.heartbeat_s + CARRY_MARGIN_S)


def _catalog_models(catalog: RegionCatalog) -> set[str]:
    """The served names of the models the catalog's regions list (`settings.models`: a store's
    name, or NAME=FOLDER, FOLDER served as NAME, as the pool manager and the deploy scripts read
    them). Taken as written, NAME=FOLDER named no model a client asks for, and a request for
    NAME before any worker or pool of it registered was answered 404, which clients do not
    retry, rather than 503."""
    names: set[str] = set()
    for region in catalog.regions.values():
        listed = region.settings.get("models")
        if not isinstance(listed, list):  # (the deploy scripts refuse it)
            continue
        for spec in listed:
            if isinstance(spec, str):
                names.update(parse_models(spec, resolve=str))
    return names


def _ignore(operation: str, seconds: float, error: str | None) -> None:
    pass


def _describe(e: BaseException) -> str:
    """A failed Redis call as readiness says it: what Redis refused (it answered an error:
    out of memory, READONLY, NOPERM, a wrong password), another error it answered (a cluster's
    CLUSTERDOWN, say), or that it did not answer."""
    if is_refusal(e) or isinstance(e, AuthenticationError):
        return f"refused: {_error_type(e)}: {e}"
    if isinstance(e, ResponseError):
        return f"failed: {_error_type(e)}: {e}"
    return f"unreachable: {_error_type(e)}: {str(e) or 'no answer in time'}"


def _error_type(e: BaseException) -> str:
    """A failed Redis call's error.type: the exception's class (bounded: redis-py's and the
    socket's), as OpenTelemetry's convention has it; for an error reply redis-py has no class
    for, Redis's own code (MISCONF, WRONGTYPE: bounded too), which its message starts with."""
    if type(e) is ResponseError:
        code = str(e).split(" ", 1)[0]
        if code.isalpha() and code.isupper():
            return code
    return type(e).__name__
