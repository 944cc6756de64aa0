"""Routing faults: the gateway's view of failed workers against a real redis-server."""

from __future__ import annotations

import dataclasses
import time

from redis.asyncio import Redis

from gateway.cluster import ClusterView
from gateway.config import GatewayConfig
from gateway.regions import DEFAULT_CATALOG, RegionCatalog
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry


def _view(r: Redis, redis_server: LocalRedis) -> ClusterView:
    """A gateway's ClusterView (region eu-west) on the test's Redis."""
    return ClusterView(GatewayConfig("eu-west", redis_server.url, "s"), r,
                       RegionCatalog.load(DEFAULT_CATALOG))  # fmt: skip


def _worker(wid: str, model: str, updated_at: float) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region="eu-west", model=model, role="mixed",
                      url=f"http://127.0.0.1:9/{wid}", max_num_seqs=4, capacity_tokens=4096,
                      updated_at=updated_at, heartbeat_s=0.3)  # fmt: skip


async def test_a_failed_worker_is_back_at_its_next_heartbeat_whatever_its_clock(
    r: Redis, redis_server: LocalRedis, model: str
) -> None:
    """A worker that failed a request is set aside until it heartbeats after the failure. Its
    heartbeat times are by its own clock: compared with the gateway's, a worker 60 s behind was
    set aside for 60 s after one failure (503 no_workers while it served), and one 60 s ahead
    was routed to again at the next registry read though it never heartbeat again."""
    reg = Registry(r)
    now = time.time()
    behind, ahead = _worker("behind", model, now - 60), _worker("ahead", model, now + 60)
    for w in (behind, ahead):
        await reg.heartbeat(w)
    view = _view(r, redis_server)
    await view.refresh()
    ids = {"behind", "ahead"}
    assert ids <= {w.worker_id for w in view.live_workers()}
    for w in (behind, ahead):
        view.mark_failed(w.worker_id)
    for _ in range(2):  # no heartbeat since the failure: both stay aside
        await view.refresh()
        assert not ids & {w.worker_id for w in view.live_workers()}
    for w in (behind, ahead):  # each heartbeats once more, a second later by its own clock
        await reg.heartbeat(dataclasses.replace(w, updated_at=w.updated_at + 1.0))
    await view.refresh()
    assert ids <= {w.worker_id for w in view.live_workers()}
