"""The Redis client: fail fast when Redis is down, reconnect by itself when it comes back.

Open one client per process (at the entry point, or in the aiohttp app's cleanup_ctx) and pass
it to Registry, SessionStore and the rest: it holds a connection pool, so concurrent tasks share
it safely, and its connections are the only Redis state a process owns.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

DEFAULT_TIMEOUT_S = 1.0  # connect and per-command socket timeout
RETRIES = 2  # re-tries after a connection error: a pooled connection may be stale after a restart


def connect(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Redis:
    """A client for `url` (redis://host:port/db) whose commands fail within a few `timeout_s`.

    redis-py's defaults (5 s timeouts, 10 retries with backoff) make a dead Redis hang a request
    for many seconds; the gateway would rather fail over or answer 503 at once. A couple of retries
    stay so that, after Redis restarts, the first command on a stale pooled connection reconnects
    instead of failing. The timeout bounds every command: use another client with a longer
    `timeout_s` for blocking commands (BLPOP, XREAD BLOCK) or very large replies.

    No connection is opened here; the first command opens one.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), RETRIES),
    )
