"""Pool operations on the registered workers of a model: rebalance the prefill:decode ratio.

    edgeinfer rebalance --model M [--region R] --prefill N

`plan` decides, from one registry snapshot, which workers switch: with too few prefill workers,
the decode workers running the fewest sequences become prefill workers; with too many, the
prefill workers with the least prefill work queued become decode workers. Mixed and draining
workers are left alone. `apply` then asks each chosen worker to switch (`POST /internal/role`),
all at once; each drains the work of its old role first (runtime/worker.py).

`worker_stats` and `idle_for` read a worker's own account of its load (`GET /internal/stats`):
the pool manager asks before it stops a worker for idleness, since the worker's registry entry
is up to a heartbeat old (runtime/pool_manager.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvstore.protocol import SECRET_HEADER, WorkerInfo


@dataclass(slots=True)
class RoleChange:
    worker: WorkerInfo  # the worker, as the registry showed it
    role: str  # the role it is asked to take
    result: str = ""  # what happened: "ok (drained 0.42s)" or the error


def plan(
    workers: list[WorkerInfo], model: str, region: str | None, prefill: int
) -> list[RoleChange]:
    """The role changes that leave `prefill` prefill workers among the model's prefill and
    decode workers (of `region`, when given)."""
    pool = [
        w
        for w in workers
        if w.model == model
        and (region is None or w.region == region)
        and w.role in ("prefill", "decode")
        and not w.draining
    ]
    if not 0 <= prefill <= len(pool):
        raise ValueError(
            f"--prefill {prefill}: model {model!r} has {len(pool)} prefill/decode workers"
            + (f" in region {region}" if region else "")
        )
    have = [w for w in pool if w.role == "prefill"]
    if len(have) < prefill:
        spare = sorted(
            (w for w in pool if w.role == "decode"), key=lambda w: (w.decode_seqs, w.worker_id)
        )
        return [RoleChange(w, "prefill") for w in spare[: prefill - len(have)]]
    spare = sorted(have, key=lambda w: (w.prefill_tokens, w.worker_id))
    return [RoleChange(w, "decode") for w in spare[: len(have) - prefill]]


async def apply(changes: list[RoleChange], secret: str, timeout_s: float = 120.0) -> None:
    """Ask every worker of `changes` to switch, concurrently; fills in each `result`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(change: RoleChange) -> None:
            try:
                async with http.post(
                    f"{change.worker.url}/internal/role",
                    data=orjson.dumps({"role": change.role}),
                    headers={SECRET_HEADER: secret, "Content-Type": "application/json"},
                ) as resp:
                    body = orjson.loads(await resp.read())
                if resp.status == 200:
                    change.result = f"ok (drained {body['drained_s']:.2f}s)"
                else:
                    change.result = f"refused ({resp.status}): {body['error']['message']}"
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError) as e:
                change.result = f"failed: {e!r}"

        await asyncio.gather(*(one(c) for c in changes))


async def worker_stats(url: str, secret: str, timeout_s: float) -> dict[str, Any]:
    """The worker's own account of its load (`GET {url}/internal/stats`). Raises
    aiohttp.ClientError, TimeoutError, or ValueError (an answer that is not a stats object)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.get(f"{url}/internal/stats", headers={SECRET_HEADER: secret}) as resp,
    ):
        body = await resp.read()
    if resp.status != 200:
        raise ValueError(f"/internal/stats answered {resp.status}")
    stats = orjson.loads(body)
    if not isinstance(stats, dict):
        raise ValueError("/internal/stats answered no object")
    return stats


def idle_for(stats: dict[str, Any], wall: float) -> float | None:
    """Seconds since the worker whose `/internal/stats` is `stats` last had work (a request's
    arrival, or work in flight: the worker then counts itself active now), at unix time `wall`;
    None while it runs, queues or streams anything, or drains."""
    try:
        if (stats["running"] or stats["waiting"] or stats["open_requests"]
                or stats["draining"]):  # fmt: skip
            return None
        return wall - max(float(stats["last_active_at"]), float(stats["started_at"]))
    except (KeyError, TypeError, ValueError):  # (not a worker's stats)
        return None
