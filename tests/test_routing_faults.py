"""Routing faults: the gateway's view of failed workers against a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from gateway.cluster import ClusterView
from gateway.config import GatewayConfig
from gateway.regions import DEFAULT_CATALOG, RegionCatalog
from kvstore.keys import worker_key
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


async def test_failed_workers_that_leave_the_registry_are_forgotten(
    r: Redis, redis_server: LocalRedis, model: str
) -> None:
    """A gateway set aside every worker that failed a request until it heartbeat again; one
    that never came back (crashed, scaled in) stayed in `failed` for the gateway's life, one
    entry per churned worker. Now an entry goes when the registry no longer lists the worker;
    one still listed without a new heartbeat stays aside, and a worker that registers again
    under a forgotten id is routed to."""
    reg = Registry(r)
    now = time.time()
    workers = [_worker(f"churn-{i}", model, now) for i in range(50)]
    for w in workers:
        await reg.heartbeat(w)
    view = _view(r, redis_server)
    await view.refresh()
    for w in workers:
        view.mark_failed(w.worker_id)
    await view.refresh()
    for w in workers[1:]:  # all but one leave for good
        await reg.deregister(w.worker_id, model)
    await view.refresh()
    assert set(view.failed) <= {w.worker_id for w in view.workers}
    assert "churn-0" in view.failed  # still listed, no heartbeat since: still aside
    assert "churn-0" not in {w.worker_id for w in view.live_workers()}
    back = dataclasses.replace(workers[7], updated_at=now + 1.0)
    await reg.heartbeat(back)  # a worker registering again under a forgotten id
    await view.refresh()
    assert "churn-7" in {w.worker_id for w in view.live_workers()}


async def test_a_worker_carried_after_a_reset_is_not_carried_longer_by_the_next(
    r: Redis, redis_server: LocalRedis, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that Redis lost and that never registers again is carried for CARRY_S from the
    reset that lost it. Each later reset (any failed registry read, then a good one) carried it
    for CARRY_S more: a Redis that failed a read now and then kept a dead worker carried, and
    the gateway `recovering` (no session placed, no prefix lookup), for as long as that went
    on. (CARRY_S scaled down.)"""
    from gateway import cluster

    monkeypatch.setattr(cluster, "CARRY_S", 1.0)
    monkeypatch.setattr(cluster, "CARRY_MARGIN_S", 0.0)
    reg = Registry(r)
    await reg.heartbeat(_worker("gone", model, time.time()))
    view = _view(r, redis_server)
    await view.refresh()
    await r.delete(worker_key("gone"))  # Redis lost it (a restart, a flush) ...
    await reg.heartbeat(_worker("stays", model, time.time()))
    view.redis_ok = False  # ... in an outage: the next good read is a reset
    await view.refresh()
    assert "gone" in {w.worker_id for w in view.workers} and view.recovering
    await asyncio.sleep(0.6)
    view.redis_ok = False  # a read failed again
    await view.refresh()
    assert "gone" in {w.worker_id for w in view.workers}
    await asyncio.sleep(0.6)  # past CARRY_S from the first reset, within it from the second
    await view.refresh()
    assert "gone" not in {w.worker_id for w in view.workers} and not view.recovering


def test_models_the_catalog_lists_as_name_equals_folder_are_known_by_name(
    r: Redis, redis_server: LocalRedis, tmp_path: Path
) -> None:
    """The catalog's `settings.models` entries are store names or NAME=FOLDER (FOLDER served as
    NAME). The gateway took them as written: a request for NAME before any worker or pool of it
    had registered was answered 404 model_not_found (never retried), not 503."""
    path = tmp_path / "regions.yaml"
    path.write_text("regions: [{name: eu-west, latitude: 53.3, longitude: -6.3, settings: "
                    "{models: [chat=/models/stories-chat, SmolLM2-135M-Instruct, =/m/plain]}}, "
                    "{name: odd, latitude: 0, longitude: 0, settings: {models: abc}}]")  # fmt: skip
    view = ClusterView(GatewayConfig("eu-west", redis_server.url, "s"), r, RegionCatalog.load(path))
    assert view.seen_models == {"chat", "SmolLM2-135M-Instruct", "plain"}


async def test_only_calls_that_reach_redis_are_timed_and_failed_ones_say_so(
    r: Redis, redis_server: LocalRedis, model: str
) -> None:
    """The gateway's Redis latency histogram holds the calls made: a session's later requests
    on its worker write nothing (they were timed as `session_record`, 6-10 us each, by the
    proxy), nor does a placement answered from memory while Redis is down; a call that failed
    is told by its error type (it was timed as a success)."""
    calls: list[tuple[str, str | None]] = []
    await Registry(r).heartbeat(_worker("w1", model, time.time()))
    view = _view(r, redis_server)
    view.on_redis = lambda op, seconds, error: calls.append((op, error))
    await view.refresh()
    w1 = next(w for w in view.live_workers() if w.worker_id == "w1")
    assert await view.placement("s") is None
    await view.record("s", None, w1)  # a new session: claimed
    placed = await view.placement("s")
    await view.record("s", placed, w1)  # its next request, on the same worker: no call
    assert calls == [("registry_read", None), ("session_get", None), ("session_claim", None),
                     ("session_get", None)]  # fmt: skip
    calls.clear()
    view.sessions.redis = Redis(port=1, socket_connect_timeout=0.5, retry_on_error=[])  # refused
    assert await view.placement("s") == placed  # remembered, after the failed read
    assert await view.placement("s") == placed  # from memory (Redis down): no call
    assert calls == [("session_get", "ConnectionError")]
