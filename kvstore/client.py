"""The Redis client: fail fast when Redis is down, reconnect by itself when it comes back.

Open one client per process (at the entry point, or in the aiohttp app's cleanup_ctx) and pass
it to Registry, SessionStore and the rest: it holds a connection pool, so concurrent tasks share
it safely, and its connections are the only Redis state a process owns.

The URL says which Redis: `redis://host:port/db` (`rediss://` for TLS) one server, or
`redis+cluster://host:port` (`rediss+cluster://`) a Redis Cluster, found from that node (any
of its nodes: the client discovers the others). A cluster client follows the cluster's slots,
redirections and failovers by itself; every key of this package carries a hash tag, so each
command and script stays within one slot (see kvstore.keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any, cast

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError

STOP_POLL_S = 0.2  # how often `stop_task` cancels again a task that is still running
DEFAULT_TIMEOUT_S = 1.0  # connect and per-command socket timeout
RETRIES = 2  # re-tries after a connection error: a pooled connection may be stale after a restart
RETRIED_ERRORS = (RedisConnectionError,)  # errors after which a command is tried again
# Redis answered a write with a refusal: out of memory (maxmemory, noeviction), a replica
# (READONLY), an ACL (NOPERM). It is up and answers reads; not a cluster's CLUSTERDOWN, TRYAGAIN
# or MOVED, which are ResponseErrors too, but after which redis-py's cluster client has slept
# and reconnected: those are Redis down, for the callers that tell the two apart.
REFUSALS = (OutOfMemoryError, ReadOnlyError, NoPermissionError)


def is_refusal(e: BaseException) -> bool:
    """Whether Redis answered with a refusal of writes while it is up and answers reads: one of
    REFUSALS, or MISCONF (it could not save its snapshot and stops writes until it can,
    stop-writes-on-bgsave-error: the commonest refusal, for which redis-py has no class)."""
    return isinstance(e, REFUSALS) or (type(e) is ResponseError and str(e).startswith("MISCONF"))


@contextlib.contextmanager
def refusal_ignored() -> Iterator[None]:
    """Let a refused write go (`is_refusal`); any other error is raised."""
    try:
        yield
    except ResponseError as e:
        if not is_refusal(e):
            raise


# After a READONLY reply has closed a connection, how long further READONLY replies on it leave
# it open: doubling from the first to the last, and back to the first once the connection has
# met none for the last's length (see _Retry).
READONLY_RECONNECT_S = (0.5, 30.0)


class _Retry(Retry):
    """redis-py's Retry (RETRIED_ERRORS, with backoff), and a READONLY reply: the server the
    connection reached is a replica now (a failover demoted it). That connection is closed
    (`fail`), so that the next command on it connects anew, through the DNS name, proxy or load
    balancer of the URL, to the new primary, and the error is raised, not tried again. Left
    open, a pooled connection stayed on the old primary for as long as it lived: the worker
    never registered again and the gateway's registry reads failed, for good. Not tried again:
    a pipeline without a transaction (most of this package's) has run its commands before the
    reply, and trying it again ran them twice (400,000 INCRs through a FAILOVER: n = 623,559).
    Each pooled connection fails once after a failover; the callers take a Redis error anyway
    (a heartbeat or registry read tries again at its next tick).

    A connection that meets READONLY again after its reconnect reached a replica through the
    URL too: one the URL names (a gateway reading a replica), or a failover whose address has
    not moved yet. It is left open for a while (READONLY_RECONNECT_S, doubling at each
    reconnect that met a replica again) before the next READONLY closes it: closed at every
    one, each refused write (a registry read's, a session's claim) cost the next command a new
    connection (TCP, AUTH, TLS), 50 writes 50 connections. A failover after a quiet spell is
    still followed at its first READONLY, and an address that moves late, within about the time
    it took. redis-py copies the Retry into each connection it opens: this state is the
    connection's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closed_at = -math.inf  # when a READONLY reply last closed the connection
        self._readonly_at = -math.inf  # when the connection last met a READONLY reply
        self._open_s = 0.0  # how long after a close READONLY replies leave it open now

    async def call_with_retry(  # type: ignore[override]
        self, do: Any, fail: Any, is_retryable: Any = None, with_failure_count: bool = False
    ) -> Any:
        try:
            return await super().call_with_retry(do, fail, is_retryable, with_failure_count)
        except ReadOnlyError as e:
            if self._reconnect(time.monotonic()):
                with contextlib.suppress(Exception):  # (redis-py's `fail` re-raises its error)
                    await (fail(e, 1) if with_failure_count else fail(e))
            raise

    def _reconnect(self, now: float) -> bool:
        """Whether a READONLY reply met `now` closes the connection (see the class)."""
        first, last = READONLY_RECONNECT_S
        if now - self._readonly_at > last:  # (a replica no longer met: a failover's, begun anew)
            self._open_s = 0.0
        self._readonly_at = now
        if now - self._closed_at < self._open_s:
            return False
        self._closed_at = now
        self._open_s = min(last, max(first, 2 * self._open_s))
        return True


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # -> one node's scheme


def cluster_seed(url: str) -> str | None:
    """For a Redis Cluster's URL (redis+cluster://, rediss+cluster://), the redis:// (rediss://)
    URL of its node that redis-py's clients take; None for any other URL. The database must be
    0 (a cluster has no other): a path naming another is refused."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    if plain is None:
        return None
    db = rest.partition("?")[0].partition("/")[2]
    if db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only, {scheme}:// URL names {db!r}")
    return f"{plain}://{rest}"


def connect(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Redis:
    """A client for `url` (redis://host:port/db, or redis+cluster://host:port for a Redis
    Cluster: see the module docstring) whose commands fail within a few `timeout_s`.

    redis-py's defaults (5 s timeouts, 10 retries with backoff) make a dead Redis hang a request
    for many seconds; the gateway would rather fail over or answer 503 at once. A couple of retries
    stay so that, after Redis restarts, the first command on a stale pooled connection reconnects
    instead of failing: on a connection error (after a READONLY reply, a failover, the
    connection is closed and the error raised: see _Retry). A timeout is not tried again: a Redis that hangs (stopped, overloaded, cut
    off) times out again, and retried, each command took three timeouts (a gateway's first
    request after a hang: 3.3 s, where 1.1 s tells the same). The timeout bounds every command:
    use another client with a longer `timeout_s` for blocking commands (BLPOP, XREAD BLOCK) or
    very large replies.

    A cluster's client is a redis.asyncio.RedisCluster, with the same timeouts and retries (it
    re-reads the cluster's slots after a connection error or a timeout, a failed node's, then
    retries: redis-py adds timeouts to what it retries). It is typed as Redis
    here: it offers the commands this package sends (pipelines without transactions, Lua
    scripts on one key, SCAN over every primary, pub/sub; tests/test_redis_cluster.py runs
    them), so the stores take either.

    No connection is opened here; the first command opens one.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    backoff = ExponentialWithJitterBackoff(base=0.05, cap=0.5)
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": _Retry(backoff, RETRIES, supported_errors=RETRIED_ERRORS),
    }
    seed = cluster_seed(url)
    if seed is None:
        return Redis.from_url(url, **options)
    return cast(Redis, RedisCluster.from_url(seed, **options))


def raise_if_cancelling() -> None:
    """For a background loop, after each step that talks to Redis: end the loop if a cancel
    reached it during the step but was lost there (see stop_task). A loop that went on instead
    kept asyncio.run's own cancel at exit waiting forever (a worker whose port was taken hung
    so: its heartbeat loop was in its first Redis write)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel a background loop that talks to Redis and wait until it has ended.

    One cancel is not always enough: it can be lost inside a Redis command (Python 3.11's
    asyncio.timeout, under redis-py's socket timeouts, can turn a cancel that lands as its
    deadline passes into a TimeoutError, which the loops catch as a Redis error and go on), and
    a shutdown that awaits the task then waits forever (seen: a test's gateway cleanup, 2 runs in
    10). So the cancel is repeated until the task is done. A loop's own error is raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=STOP_POLL_S)
    if not task.cancelled():
        task.result()
