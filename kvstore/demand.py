"""Scale from zero: the pools that can start workers, the requests gateways hold for them, and
what the pools report back.

    ei:p:{<pool_id>}                   hash: the pool's PoolInfo, expires unless heartbeats renew it
    ei:pools                           set: pool ids (readers drop ids whose hash expired)
    ei:d:{<model>}:wait:<region>       sorted set: ids of the requests gateways hold until a worker
                                       of `model` is up in `region`; score = the hold's deadline,
                                       by Redis's clock; expires with the last deadline
    ei:d:{<model>}:status:<region>     string: the pool's ModelStatus (starting, failed + retry time,
                                       by Redis's clock)
    ei:d:{<model>}:start:<region>      string: the id of the pool starting a worker for it now
                                       (SET NX: several pools in a region start one, not one each;
                                       a lease its pool renews while the worker starts)
    ei:pw:{<region>}                   pub/sub channel: wake-ups (model names) for that region's
                                       pools (a message, not a key: nothing is left behind)
    ei:pe:{<region>}                   stream: pool events (start, ready, stop, fail) with timings

The flow: a request arrives for a model that some pool offers and no worker serves. The gateway
adds the request to the model's wait set (with its deadline) and publishes a wake-up; the pool,
listening for wake-ups between ticks, starts a worker at once and publishes `starting`; the
gateway polls the registry until the worker appears, then forwards the request and removes it
from the wait set. A worker that fails to start makes the pool publish `failed` with the time of
its next attempt; waiting gateways answer 503 with that Retry-After instead of waiting out their
deadline. A gateway that dies leaves its entries behind, but their scores (deadlines) age them
out: every count first drops the entries past their deadline, and the set itself expires with
the last of them (counted by no pool, a model's set stayed for good).

Deadlines are kept by one clock, Redis's (TIME, in the scripts that write and count them): a
gateway gives the time its hold has left, a duration its own clock measures right, and the
pool's count compares with the same clock. A deadline written by the gateway's clock and aged by
the pool's was misjudged by their skew: a gateway's clock two minutes behind the pool's had every
held request dropped at once (its deadline past, for the pool), and one an hour ahead had a dead
gateway's requests counted for an hour (the model's workers kept up, its failed starts retried).
A status's times are kept by Redis's clock too, and each reader is given them by its own: a pool
whose clock was an hour ahead had gateways answer its first failed start with a 503 and an hour's
Retry-After, not wait out the retry a second later.

The wait set is the demand a pool acts on; a wake-up only saves it the wait for its next tick
(and, from `Demand.wake`, asks for a worker with no request held). Wake-ups are therefore
published, not queued: every pool of the region hears each one (each acts on its own models),
and only while it listens. A wake-up no pool heard is gone, so none is acted on long after its
request was answered or given up (a list of them, kept for a pool started later, made it start
a worker nobody waited for; the requests still held are in the wait sets it reads each tick).

All keys of one model share the `{<model>}` hash tag, and one region's events the `{<region>}`
tag, so everything here works on a Redis Cluster (which carries a PUBLISH to the subscribers of
every node).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.asyncio import Redis, RedisCluster

from kvstore.client import refusal_ignored
from kvstore.keys import PREFIX, as_text, check_id, usable_id

POOLS_KEY = PREFIX + "pools"
EVENTS_MAXLEN = 1000  # pool events kept per region (approximately: XADD MAXLEN ~)


def pool_key(pool_id: str) -> str:
    return f"{PREFIX}p:{{{check_id(pool_id, 'pool_id')}}}"


def wait_key(model: str, region: str) -> str:
    return f"{PREFIX}d:{{{check_id(model, 'model')}}}:wait:{check_id(region, 'region')}"


def status_key(model: str, region: str) -> str:
    return f"{PREFIX}d:{{{check_id(model, 'model')}}}:status:{check_id(region, 'region')}"


def start_key(model: str, region: str) -> str:
    return f"{PREFIX}d:{{{check_id(model, 'model')}}}:start:{check_id(region, 'region')}"


# KEYS[1]: a claim. ARGV[1]: the claimant, ARGV[2]: milliseconds. Extends the claim only if it
# is still the claimant's; 1 if it did.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS[1]: a claim. ARGV[1]: the claimant. Deletes the claim only if it is still the claimant's.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# KEYS[1]: a wait set. ARGV[1]: a request id, ARGV[2]: the seconds its hold has left. Adds the
# request with its deadline by Redis's clock, and has the set expire with its last deadline.
_HOLD_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
local ms = math.ceil((last - now) * 1000)
if ms ~= ms or ms > 1e15 then ms = 1e15 end  -- (an endless hold's +inf score, from a gateway
-- older than these scripts: PEXPIRE refuses inf, and every hold of the model failed with it)
return redis.call('PEXPIRE', KEYS[1], math.max(1, ms))
"""

# KEYS[1]: a wait set. Drops the entries past their deadline by Redis's clock; the count left.
_WAITING_LUA = """
local t = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(t[1]) + tonumber(t[2]) / 1e6)
return redis.call('ZCARD', KEYS[1])
"""

# KEYS[1]: a key, whose node's clock (TIME) is the one its times are kept by.
_TIME_LUA = "return redis.call('TIME')"

# KEYS[1]: a status. Its value (nil if none) and the clock its times are kept by.
_STATUS_LUA = "return {redis.call('GET', KEYS[1]), redis.call('TIME')}"


def _unix(time_reply: list[Any]) -> float:
    """Redis's TIME reply (seconds, microseconds) as a unix time."""
    return int(time_reply[0]) + int(time_reply[1]) / 1e6


def wake_channel(region: str) -> str:
    return f"{PREFIX}pw:{{{check_id(region, 'region')}}}"


def events_key(region: str) -> str:
    return f"{PREFIX}pe:{{{check_id(region, 'region')}}}"


@dataclass(slots=True)
class PoolInfo:
    """A pool manager as gateways see it: where it runs and which models it can start."""

    pool_id: str
    region: str
    models: list[str] = field(default_factory=list)  # served names it can start workers for
    max_workers: int = 1  # its limit, all models together
    workers: int = 0  # worker processes it runs now (starting included)
    updated_at: float = 0.0

    def to_redis(self) -> dict[str, str]:
        return {k: orjson.dumps(v).decode() for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> PoolInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {as_text(k): orjson.loads(v) for k, v in raw.items() if as_text(k) in names}
        return cls(**values)


@dataclass(slots=True)
class ModelStatus:
    """What a pool last did about a model in its region (published for waiting gateways)."""

    state: str  # "starting" | "ready" | "failed" | "full" (every process slot busy)
    pool_id: str
    error: str = ""  # why the last start failed
    attempts: int = 0  # failed starts in a row
    retry_at: float = 0.0  # unix time of the next attempt (failed), by this host's clock
    updated_at: float = 0.0

    def retry_after(self, now: float | None = None) -> float:
        return max(1.0, self.retry_at - (time.time() if now is None else now))


class Demand:
    """Reads and writes of the keys above; one instance per process over its shared client.

    Wake-ups (`wakeups`) are best heard on a client of their own: their subscription holds a
    connection for good (kvstore.client.connect(timeout_s=...), longer than a wait for them).
    """

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    # ------------------------------------------------------------------ the pool's side
    async def announce(self, info: PoolInfo, ttl_s: float) -> None:
        """Register or renew a pool (its heartbeat)."""
        for m in info.models:
            check_id(m, "model")
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(pool_key(info.pool_id), mapping=info.to_redis())  # type: ignore[arg-type]
        pipe.pexpire(pool_key(info.pool_id), max(1, round(ttl_s * 1000)))
        pipe.sadd(POOLS_KEY, info.pool_id)
        await pipe.execute()

    async def withdraw(self, pool_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(pool_key(pool_id))
        pipe.srem(POOLS_KEY, pool_id)
        await pipe.execute()

    async def waiting(self, model: str, region: str) -> int:
        """Requests held now for `model` in `region` (entries past their deadline, by Redis's
        clock, dropped)."""
        n = await self.redis.eval(_WAITING_LUA, 1, wait_key(model, region))  # type: ignore[misc]
        return int(n)

    def wakeups(self, region: str) -> Wakeups:
        """A subscription to the wake-ups of `region`'s pools (subscribed on its first wait)."""
        return Wakeups(self.redis, region)

    async def set_status(self, model: str, region: str, status: ModelStatus, ttl_s: float) -> None:
        """Publish `status` (its times by this host's clock), kept by Redis's clock: a gateway
        on another host reads them by its own (`status`)."""
        key = status_key(model, region)
        status.updated_at = time.time()
        shift = _unix(await self.redis.eval(_TIME_LUA, 1, key)) - time.time()  # type: ignore[misc]
        kept = dataclasses.replace(
            status,
            retry_at=status.retry_at + shift if status.retry_at else 0.0,
            updated_at=status.updated_at + shift,
        )
        await self.redis.set(key, orjson.dumps(kept), px=max(1, round(ttl_s * 1000)))

    async def claim_start(self, model: str, region: str, pool_id: str, ttl_s: float) -> bool:
        """Claim the start of a worker for `model` in `region`; False if another pool's start is
        in flight. The claim lapses after `ttl_s` unless renewed (`renew_start`), so that a pool
        that died mid-start blocks the others no longer than that."""
        got = await self.redis.set(
            start_key(model, region), pool_id, nx=True, px=max(1, round(ttl_s * 1000))
        )
        return bool(got)

    async def renew_start(self, model: str, region: str, pool_id: str, ttl_s: float) -> bool:
        """Extend this pool's claim to `ttl_s` from now; False if it is not (or no longer) its."""
        ms = max(1, round(ttl_s * 1000))
        got = await self.redis.eval(_RENEW_LUA, 1, start_key(model, region), pool_id, ms)  # type: ignore[misc]
        return bool(got)

    async def start_owner(self, model: str, region: str) -> str | None:
        """The pool whose start of a worker for `model` in `region` is in flight, if any."""
        owner = await self.redis.get(start_key(model, region))
        return owner.decode() if isinstance(owner, bytes) else owner

    async def release_start(self, model: str, region: str, pool_id: str) -> None:
        await self.redis.eval(_RELEASE_LUA, 1, start_key(model, region), pool_id)  # type: ignore[misc]

    async def record(self, region: str, event: str, **fields: Any) -> None:
        """Append a pool event (start, ready, stop, fail) to the region's capped stream."""
        entry = {"event": event, "at": f"{time.time():.3f}"} | {
            k: str(v) for k, v in fields.items()
        }
        await self.redis.xadd(
            events_key(region),
            entry,  # type: ignore[arg-type]
            maxlen=EVENTS_MAXLEN,
            approximate=True,
        )

    async def events(self, region: str, count: int = 100) -> list[dict[str, str]]:
        """The region's latest pool events, oldest first."""
        rows = await self.redis.xrevrange(events_key(region), count=count) or []
        return [
            {as_text(k): as_text(v) for k, v in (fields or {}).items()}
            for _, fields in reversed(rows)
        ]

    # ------------------------------------------------------------------ the gateway's side
    async def pools(self) -> list[PoolInfo]:
        """Live pools, ordered by id; ids whose hash expired leave the set."""
        listed = sorted(as_text(p) for p in await self.redis.smembers(POOLS_KEY))  # type: ignore[misc]
        ids = [p for p in listed if usable_id(p, "pool_id", POOLS_KEY)]
        if len(ids) < len(listed):
            with refusal_ignored():  # (refused: left to a reader that may write)
                await self.redis.srem(POOLS_KEY, *(p for p in listed if p not in ids))  # type: ignore[misc]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for pid in ids:
            pipe.hgetall(pool_key(pid))
        found, stale = [], []
        for pid, raw in zip(ids, await pipe.execute(), strict=True):
            if not raw:
                stale.append(pid)
                continue
            try:
                found.append(PoolInfo.from_redis(raw))
            except (TypeError, ValueError, orjson.JSONDecodeError):
                continue  # garbled: left to expire on its own TTL
        if stale:
            # (refused, READONLY or NOPERM: a gateway on a replica, or whose ACL lets it read
            # only; left to a reader that may write, and the pools read stand)
            with refusal_ignored():
                await self.redis.srem(POOLS_KEY, *stale)  # type: ignore[misc]
        return found

    async def hold(self, model: str, region: str, request_id: str, deadline: float,
                   wake: bool = True) -> None:  # fmt: skip
        """Count a request as waiting for a worker of `model` in `region` until `deadline` (unix
        time, by this host's clock), and (`wake`) wake the pool. The wait set keeps the time
        left, from Redis's clock (see the module's docstring): pools on other hosts read it.
        Holding a request again renews its entry (a Redis that restarted without its data lost
        it).

        Two round trips, not one pipeline: a Redis Cluster client refuses PUBLISH in a pipeline
        (the wait set and the channel are in different slots anyway), and a held request waits
        for a worker to start, seconds."""
        left = min(deadline - time.time(), 1e9)  # (an endless hold's inf: no number to Lua)
        await self.redis.eval(_HOLD_LUA, 1, wait_key(model, region), request_id, repr(left))  # type: ignore[misc]
        if wake:
            await self.wake(model, region)

    async def wake(self, model: str, region: str) -> None:
        """Ask the pools of `region` for a worker of `model` without holding a request for it
        (a gateway serving the model from a region farther away than theirs). Heard by the
        pools listening now, kept by none."""
        await self.redis.publish(wake_channel(region), check_id(model, "model"))

    async def release(self, model: str, region: str, request_id: str) -> None:
        await self.redis.zrem(wait_key(model, region), request_id)

    async def status(self, model: str, region: str) -> ModelStatus | None:
        """The pool's status of `model` in `region`, its times by this host's clock."""
        raw, clock = await self.redis.eval(_STATUS_LUA, 1, status_key(model, region))  # type: ignore[misc]
        if raw is None:
            return None
        try:
            status = ModelStatus(**orjson.loads(raw))
        except (TypeError, ValueError):
            return None
        shift = time.time() - _unix(clock)
        if status.retry_at:
            status.retry_at += shift
        status.updated_at += shift
        return status


class Wakeups:
    """A pool's subscription to its region's wake-ups. It hears those published while it is
    subscribed (from its first `next`), and a wait returns every model named since the last
    one, each once: a burst of held requests wakes the pool once, not once per request."""

    MAX_BATCH = 1000  # messages taken in one `next` at most (a flood must not stall the pool)

    def __init__(self, redis: Redis, region: str) -> None:
        self.redis = redis
        self.channel = wake_channel(region)
        self._pubsub: Any = None  # redis.asyncio PubSub (ClusterPubSub), once subscribed
        self._dropped = False  # the last subscription ended in an error (or a cancel)

    async def next(self, timeout_s: float) -> set[str]:
        """Wait up to `timeout_s` for a wake-up; the models named by those that came (empty if
        none did). A Redis error is raised, the subscription dropped: the next call subscribes
        again (wake-ups published meanwhile are lost; the wait sets still hold the requests)."""
        try:
            if self._pubsub is None:
                await self._subscribe()
            models: set[str] = set()
            deadline = time.monotonic() + timeout_s
            for _ in range(self.MAX_BATCH):
                left = 0.0 if models else max(0.0, deadline - time.monotonic())
                msg = await self._pubsub.get_message(timeout=left)
                if msg is None:  # none within `left` (or a subscription's confirmation)
                    if models or time.monotonic() >= deadline:
                        break
                elif msg.get("type") == "message":
                    models.add(as_text(msg["data"]))
            return models
        except BaseException:
            self._dropped = True
            await self.aclose()
            raise

    async def _subscribe(self) -> None:
        """Subscribe on a connection of its own. On a Redis Cluster, to the node that serves the
        channel's slot (any node would do: a cluster carries each PUBLISH to every node). A
        cluster client reads the slots on its first command, and again when a command meets a
        connection error; a subscription is neither, so it reads them here (and, after a
        subscription failed, reads them again: its node may have failed over)."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()
            if self._dropped:
                await self.redis.nodes_manager.initialize()
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._pubsub = pubsub
        await pubsub.subscribe(self.channel)
        self._dropped = False

    async def aclose(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
