"""Redis restarted empty under a running cluster: real redis-server, worker and gateway.

The gateway keeps routing to the workers it knew until they register again (no 503 while they
are alive), and a worker that finds its registry entry gone writes its tokenizer bundle and its
prefix cache's blocks again without waiting for traffic. A request waiting for a pool to start
a worker when Redis goes away waits out its hold, then gets a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import redis

from kvstore.client import connect
from kvstore.demand import Demand, PoolInfo
from kvstore.redis_server import LocalRedis
from tests.stack import Proc, get_json, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 3


def _keys(url: str, pattern: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return sum(1 for _ in r.scan_iter(pattern))
    finally:
        r.close()


@contextmanager
def _stack(
    tmp_path: Path, stories_dir: Path, gateway_args: list[str] | None = None
) -> Iterator[tuple[LocalRedis, Proc, openai.OpenAI]]:
    """Redis, one worker heartbeating every 2 s (the default: the window in which an emptied
    registry lists no worker), a gateway, and a client of it."""
    server = LocalRedis().start()
    (tmp_path / "regions.yaml").write_text(CATALOG)
    worker = start_worker("w1", stories_dir, server.url, tmp_path, "local",
                          ["--heartbeat", "2", "--ttl", "10"])  # fmt: skip
    gateway = start_gateway("gw", server.url, tmp_path / "regions.yaml", tmp_path, "local",
                            gateway_args)  # fmt: skip
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 1, 30, "worker")
        yield server, worker, openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x",
                                            max_retries=0, timeout=30)  # fmt: skip
    finally:
        gateway.stop()
        worker.stop()
        server.stop()


def test_an_emptied_redis_costs_no_request(tmp_path: Path, stories_dir: Path) -> None:
    with _stack(tmp_path, stories_dir) as (server, worker, client):
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=2)
        wait_until(lambda: _keys(server.url, "ei:p:{stories}:*") > 0, 10, "prefix entries")
        assert _keys(server.url, "ei:tok:{stories}:*") == 1

        server.stop()
        server.start()  # the same port, no data
        assert _keys(server.url, "ei:*") == 0
        answered = []
        for _ in range(12):  # ~0.6 s, well inside the worker's next heartbeat
            answered.append(client.completions.create(model="stories", prompt="Hi", max_tokens=1))
            time.sleep(0.05)
        assert all(a.choices for a in answered)

        # no request needed: the worker notices its entry was gone and writes the rest again
        wait_until(lambda: _keys(server.url, "ei:tok:{stories}:*") == 1, 10, "tokenizer bundle")
        wait_until(lambda: _keys(server.url, "ei:p:{stories}:*") > 0, 10, "prefix entries")
        assert worker.alive()


@pytest.mark.parametrize("down_s", [1.5])
def test_a_redis_outage_keeps_serving(tmp_path: Path, stories_dir: Path, down_s: float) -> None:
    """Redis down for a while, then back empty: requests keep being answered throughout."""
    with _stack(tmp_path, stories_dir) as (server, worker, client):
        server.stop()
        t0 = time.monotonic()
        while time.monotonic() - t0 < down_s:
            assert client.completions.create(model="stories", prompt="Hi", max_tokens=1).choices
            time.sleep(0.1)
        server.start()
        for _ in range(12):
            assert client.completions.create(model="stories", prompt="Hi", max_tokens=1).choices
            time.sleep(0.05)
        assert worker.alive()


def test_sessions_stay_on_their_worker_while_redis_is_down(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Two workers; a session placed on one keeps going there while Redis is down and after it
    comes back empty (the gateway remembers the placements it read or wrote), where load alone
    would spread its requests over both."""
    server = LocalRedis().start()
    (tmp_path / "regions.yaml").write_text(CATALOG)
    workers = [start_worker(f"w{i}", stories_dir, server.url, tmp_path, "local",
                            ["--heartbeat", "2", "--ttl", "10"]) for i in (1, 2)]  # fmt: skip
    gateway = start_gateway("gw", server.url, tmp_path / "regions.yaml", tmp_path, "local")
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=30)  # fmt: skip

        def served_by(session: str | None, prompt: str) -> str:
            headers = {"x-session-affinity": session} if session else {}
            raw = client.completions.with_raw_response.create(
                model="stories", prompt=prompt, max_tokens=1, extra_headers=headers
            )
            return raw.headers["x-edgeinfer-worker"]

        home = served_by("s1", PROMPT)
        time.sleep(0.3)  # the placement is written off the request's path
        server.stop()
        down = [served_by("s1", f"{PROMPT} {i}") for i in range(6)]
        assert set(down) == {home}, down
        assert len({served_by(None, f"Hi {i}") for i in range(6)}) == 2  # load alone: both
        server.start()  # the same port, no data
        back = [served_by("s1", f"{PROMPT} again {i}") for i in range(4)]
        assert set(back) == {home}, back
        assert all(w.alive() for w in workers)
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
        server.stop()


def test_redis_lost_while_a_request_waits_for_a_pool(tmp_path: Path, stories_dir: Path) -> None:
    """A request for a model no worker serves waits for a pool to start one (scale from zero);
    Redis goes away meanwhile: the wait goes on until the hold's timeout, then a 503 with
    Retry-After, not a 500."""

    async def announce(url: str) -> None:  # a pool that can start "ghost", and never does
        r = connect(url)
        try:
            await Demand(r).announce(PoolInfo("pool-x", "local", ["ghost"], 1, 0, time.time()), 60)
        finally:
            await r.aclose()

    with _stack(tmp_path, stories_dir, ["--hold-timeout", "3"]) as (server, _, client):
        asyncio.run(announce(server.url))
        wait_until(lambda: "ghost" in [m.id for m in client.models.list().data], 10, "the pool")
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            held = ex.submit(client.completions.with_raw_response.create, model="ghost",
                             prompt="Hi", max_tokens=1)  # fmt: skip
            time.sleep(1.0)  # the gateway holds the request
            server.stop()
            with pytest.raises(openai.APIStatusError) as e:
                held.result()
        assert e.value.status_code == 503, e.value.body
        assert e.value.body["code"] == "worker_starting", e.value.body  # type: ignore[index]
        assert int(e.value.response.headers["Retry-After"]) >= 1
        assert 2.5 < time.monotonic() - t0 < 10
