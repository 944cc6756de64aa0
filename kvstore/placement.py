"""Session placement: which worker (and region) holds a session's KV cache.

A session (the `x-session-affinity` header) is pinned to the worker that first served it, so its
next turn reuses that worker's cached prefix. The pin lives in `ei:s:{<session_id>}` as the orjson
of a Placement, with an idle TTL that every use renews: a session unused for `idle_ttl_s` is
forgotten, and its next request is placed afresh.

Gateway replicas race to place the same new session; `claim` settles that with SET NX, so all of
them route to one winner. When the worker fails or drains, `move` re-pins the session with a
compare-and-set, so two gateways that both noticed do not flap it between two new workers.
Every operation touches one key, so all of them work on a Redis Cluster. Needs Redis >= 7.0
(SET NX GET; GETEX is 6.2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from kvstore.keys import check_id, session_key

log = logging.getLogger(__name__)

# KEYS[1]: the session key. ARGV: expected worker id ("" = only if absent), new value, TTL in ms.
# Replaces the value when the key is absent, unreadable, or names the expected worker; returns
# the value stored afterwards.
_MOVE_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, obj = pcall(cjson.decode, cur)
  if ok and type(obj) == 'table' and type(obj['worker_id']) == 'string'
      and type(obj['region']) == 'string' and obj['worker_id'] ~= ARGV[1] then
    return cur
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return ARGV[2]
"""


@dataclass(slots=True)
class Placement:
    """Where a session's KV cache lives."""

    worker_id: str  # the worker holding the session's cached prefix
    region: str  # that worker's region (lets a gateway prefer or skip it without a lookup)

    def __post_init__(self) -> None:
        check_id(self.worker_id, "worker_id")
        if not isinstance(self.region, str) or not self.region:
            raise ValueError(f"region must be a non-empty string, got {self.region!r}")


def _encode(placement: Placement) -> bytes:
    return orjson.dumps(placement)


def _decode(raw: bytes | str) -> Placement | None:
    """The stored Placement, or None (logged) if the value is not one."""
    try:
        obj = orjson.loads(raw)
        return Placement(worker_id=obj["worker_id"], region=obj["region"])
    except (orjson.JSONDecodeError, TypeError, KeyError, ValueError) as e:
        log.warning("ignoring unreadable session placement %r: %s", raw[:80], e)
        return None


class SessionStore:
    """Get, claim, move and drop session placements; see the module docstring."""

    def __init__(self, redis: Redis, idle_ttl_s: float = 1800.0) -> None:
        if idle_ttl_s < 0.001:
            raise ValueError(f"idle_ttl_s must be at least 0.001 s, got {idle_ttl_s}")
        self.redis = redis  # the process's shared client (kvstore.client.connect)
        self.idle_ttl_s = idle_ttl_s  # a session unused this long is forgotten
        self._ttl_ms = max(1, round(idle_ttl_s * 1000))
        self._move = redis.register_script(_MOVE_LUA)

    async def get(self, session_id: str) -> Placement | None:
        """The session's placement, renewing its idle TTL; None if unknown or expired."""
        raw = await self.redis.getex(session_key(session_id), px=self._ttl_ms)
        return None if raw is None else _decode(raw)

    async def claim(self, session_id: str, placement: Placement) -> Placement:
        """Pin a new session to `placement` unless another caller pinned it first.

        Returns the placement that holds after the call: ours, or the one already stored (whose
        TTL is left as it was). An unreadable stored value is replaced by ours.
        """
        key = session_key(session_id)
        old = await self.redis.set(key, _encode(placement), px=self._ttl_ms, nx=True, get=True)
        if old is None:
            return placement
        current = _decode(old)  # type: ignore[arg-type]
        if current is None:
            return await self.move(session_id, None, placement)
        return current

    async def move(self, session_id: str, from_worker_id: str | None, to: Placement) -> Placement:
        """Re-pin the session to `to` if it is still on `from_worker_id` (or not pinned at all).

        `from_worker_id=None` moves only an unpinned session. Returns the placement stored after
        the call: `to` when the move happened, else whatever another caller put there.
        """
        key = session_key(session_id)
        expected = "" if from_worker_id is None else check_id(from_worker_id, "from_worker_id")
        stored = await self._move(keys=[key], args=[expected, _encode(to), self._ttl_ms])
        current = _decode(stored)
        if current is None:  # the script returns only values it could read
            raise RuntimeError(f"session {session_id!r}: move stored an unreadable placement")
        return current

    async def drop(self, session_id: str) -> None:
        """Forget the session's placement (its worker is gone for good, or the session ended)."""
        await self.redis.delete(session_key(session_id))
