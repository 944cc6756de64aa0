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
    tmp_path: Path,
    stories_dir: Path,
    gateway_args: list[str] | None = None,
    workers: int = 1,
    gateways: int = 1,
) -> Iterator[tuple[LocalRedis, list[Proc], list[openai.OpenAI]]]:
    """Redis, `workers` workers heartbeating every 2 s (the default: the window in which an
    emptied registry lists no worker), `gateways` gateways, and a client of each."""
    server = LocalRedis().start()
    (tmp_path / "regions.yaml").write_text(CATALOG)
    started: list[Proc] = []
    try:
        for i in range(workers):
            started.append(start_worker(f"w{i + 1}", stories_dir, server.url, tmp_path, "local",
                                        ["--heartbeat", "2", "--ttl", "10"]))  # fmt: skip
        ws = list(started)
        for i in range(gateways):
            started.append(start_gateway(f"gw{i + 1}", server.url, tmp_path / "regions.yaml",
                                         tmp_path, "local", gateway_args))  # fmt: skip
        clients = []
        for gw in started[workers:]:
            wait_until(lambda gw=gw: get_json(f"{gw.url}/readyz")[1]["workers"] == workers, 30,
                       "workers")  # fmt: skip
            clients.append(openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0,
                                         timeout=30))  # fmt: skip
        yield server, ws, clients
    finally:
        for proc in reversed(started):  # gateways first
            proc.stop()
        server.stop()


def _served_by(client: openai.OpenAI, session: str | None, prompt: str, max_tokens: int = 1) -> str:
    """The worker that answered the completion (the gateway's x-edgeinfer-worker)."""
    headers = {"x-session-affinity": session} if session else {}
    raw = client.completions.with_raw_response.create(
        model="stories", prompt=prompt, max_tokens=max_tokens, extra_headers=headers
    )
    return raw.headers["x-edgeinfer-worker"]


def _just_after_a_heartbeat(url: str, worker_id: str, timeout_s: float = 10.0) -> None:
    """Returns right after the worker renewed its registry entry (its TTL jumped back up), so
    that a restart that follows has most of a heartbeat interval before the worker writes again
    (a restart just before a heartbeat left nothing to see empty: a CI run found 6 keys)."""
    r = redis.Redis.from_url(url)
    try:
        key = f"ei:w:{{{worker_id}}}"
        last = r.pttl(key)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.005)
            now = r.pttl(key)
            if now > last:
                return
            last = now
        raise AssertionError(f"{worker_id} did not renew {key} within {timeout_s} s")
    finally:
        r.close()


def test_an_emptied_redis_costs_no_request(tmp_path: Path, stories_dir: Path) -> None:
    with _stack(tmp_path, stories_dir) as (server, [worker], [client]):
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=2)
        wait_until(lambda: _keys(server.url, "ei:p:{stories}:*") > 0, 10, "prefix entries")
        assert _keys(server.url, "ei:tok:{stories}:*") == 1

        _just_after_a_heartbeat(server.url, worker.meta["worker_id"])  # the emptied window is a whole interval
        server.stop()
        server.start()  # the same port, no data
        # empty of what the worker writes (a gateway may have marked the new Redis already)
        assert _keys(server.url, "ei:w:*") + _keys(server.url, "ei:tok:*") == 0
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
    with _stack(tmp_path, stories_dir) as (server, [worker], [client]):
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


def test_a_frozen_redis_is_noticed_by_the_first_prefix_lookup(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A Redis that stops answering (SIGSTOP: no refusal, only timeouts) is marked failed by the
    first request whose prefix lookup times out, as a failed session lookup marks it: later
    requests skip the index until the registry refresh reaches Redis again, rather than each
    waiting out the client's timeouts and retries (a reviewer measured 3.07 and 3.16 s)."""
    import signal

    with _stack(tmp_path, stories_dir, workers=2) as (server, _, clients):
        assert server._proc is not None
        server._proc.send_signal(signal.SIGSTOP)
        try:
            resp = clients[0].completions.create(model="stories", prompt="Once upon a time",
                                                 max_tokens=2)  # fmt: skip
            assert resp.choices[0].text
            log = (tmp_path / "gw1.log").read_text(errors="replace")
            assert "redis failed on a request's path" in log, log[-2000:]
        finally:
            server._proc.send_signal(signal.SIGCONT)


def test_sessions_stay_on_their_worker_while_redis_is_down(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Two workers; a session placed on one keeps going there while Redis is down and after it
    comes back empty (the gateway remembers the placements it read or wrote), where load alone
    would spread its requests over both."""
    with _stack(tmp_path, stories_dir, workers=2) as (server, workers, [client]):
        home = _served_by(client, "s1", PROMPT)
        server.stop()
        down = [_served_by(client, "s1", f"{PROMPT} {i}") for i in range(6)]
        assert set(down) == {home}, down
        assert len({_served_by(client, None, f"Hi {i}") for i in range(6)}) == 2  # load: both
        server.start()  # the same port, no data
        back = [_served_by(client, "s1", f"{PROMPT} again {i}") for i in range(4)]
        assert set(back) == {home}, back
        assert all(w.alive() for w in workers)


def test_gateways_placing_one_new_session_at_once_send_it_to_one_worker(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Two gateways get the first turn of one new session at the same moment, and each would
    pick another idle worker (gw2 has routed one request more, so its tie falls the other way).
    The session's claim in Redis has one winner, and both send the turn there, and the later
    turns too, also while Redis is down: each gateway remembers the winner, not its own pick."""
    with _stack(tmp_path, stories_dir, workers=2, gateways=2) as (server, workers, clients):
        _served_by(clients[1], None, "Hi")  # gw2's next tie goes to the other worker
        with ThreadPoolExecutor(2) as ex:
            first = list(ex.map(lambda c: _served_by(c, "race", "Hello there", 8), clients))
        assert first[0] == first[1], first
        server.stop()
        later = [_served_by(c, "race", f"Hello there {i}") for i in range(2) for c in clients]
        assert set(later) == {first[0]}, (first, later)
        assert all(w.alive() for w in workers)


def test_readyz_redis_optional_is_ready_while_the_gateway_serves(
    tmp_path: Path, stories_dir: Path
) -> None:
    """`/readyz` is "Redis answers and a worker is known"; `/readyz?redis=optional` (Kubernetes'
    readiness probe) is ready while the gateway can serve: through a Redis outage, on its last
    registry snapshot, until no worker is left. The body says whether Redis answered."""
    with _stack(tmp_path, stories_dir) as (server, [worker], [client]):
        url = str(client.base_url.join("/readyz"))
        assert get_json(f"{url}?redis=optional") == (200, get_json(url)[1])
        status, body = get_json(f"{url}?redis=sometimes")
        assert status == 400 and body["error"]["param"] == "redis", body
        server.stop()
        status, body = get_json(url)
        assert status == 503 and body["redis"] is False, body
        status, body = get_json(f"{url}?redis=optional")
        assert status == 200, body
        assert body["ready"] is True and body["redis"] is False and body["workers"] == 1, body
        assert client.completions.create(model="stories", prompt="Hi", max_tokens=1).choices
        worker.kill()
        with pytest.raises(openai.APIStatusError):  # the worker is gone: set aside
            client.completions.create(model="stories", prompt="Hi", max_tokens=1)
        status, body = get_json(f"{url}?redis=optional")
        assert status == 503 and body["workers"] == 0, body


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

    with _stack(tmp_path, stories_dir, ["--hold-timeout", "3"]) as (server, _, [client]):
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


def test_a_gateway_started_while_redis_is_down_answers_503_not_404(tmp_path: Path) -> None:
    """A gateway that has never read the registry cannot know a model is unknown: a 503 with
    Retry-After (clients retry it), not a 404 model_not_found (a reviewer's new gateway, started
    during an outage, told clients a served model did not exist); once it has read the
    registry, an unknown model is a 404 again."""
    server = LocalRedis().start()
    (tmp_path / "regions.yaml").write_text(CATALOG)
    server.stop()
    gateway = start_gateway("gw", server.url, tmp_path / "regions.yaml", tmp_path, "local")
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="stories", prompt="Hi", max_tokens=1)
        assert e.value.status_code == 503, e.value
        assert e.value.code == "registry_unavailable" and e.value.response.headers["retry-after"]
        server.start()

        def status() -> int:
            try:
                client.completions.create(model="stories", prompt="Hi", max_tokens=1)
            except openai.APIStatusError as e:
                return e.status_code
            return 200

        wait_until(lambda: status() == 404, 20, "a 404 once the registry is read")
    finally:
        gateway.stop()
        server.stop()


def test_a_worker_stopped_while_redis_hangs_exits_soon(tmp_path: Path, stories_dir: Path) -> None:
    """SIGTERM to an idle worker while Redis hangs (SIGSTOP: no refusal, only timeouts): all of
    shutdown's Redis work (the drain's "draining" mark, deregistering, leaving the prefix index)
    gets one short deadline, and none once Redis has failed; the entries expire by their TTL.
    Each call used to wait out the client's timeouts in turn: 18.6 s to exit (a reviewer's)."""
    import signal

    with _stack(tmp_path, stories_dir, gateways=0) as (server, [worker], _):
        wait_until(lambda: _keys(server.url, "ei:w:*") == 1, 10, "the worker's registration")
        assert server._proc is not None
        server._proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            worker.signal(signal.SIGTERM)
            worker.popen.wait(60)
            took = time.monotonic() - t0
        finally:
            server._proc.send_signal(signal.SIGCONT)
        assert worker.popen.returncode == 0, worker.tail()
        assert took < 8, (took, worker.tail())  # ~2 s of Redis, then the exit itself
        log = worker.log.read_text(errors="replace")
        # the drain's mark fails within the exit's budget (one timeout: a hung Redis is not
        # retried), then deregistering is skipped or fails within what is left of it
        assert ("deregister skipped (redis is failing)" in log
                or "deregister failed (no answer in time)" in log), log[-2000:]  # fmt: skip


def _registered_worker(server: LocalRedis, stories_dir: Path, tmp_path: Path,
                       heartbeat_s: float) -> Proc:  # fmt: skip
    """A worker on `server` (heartbeats every `heartbeat_s`, a long TTL), once registered."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    worker = start_worker("w1", stories_dir, server.url, tmp_path, "local",
                          ["--heartbeat", str(heartbeat_s), "--ttl", "60"])  # fmt: skip
    wait_until(lambda: _keys(server.url, "ei:w:*") == 1, 10, "registration")
    return worker


def test_a_worker_whose_heartbeat_failed_once_still_deregisters_on_exit(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A heartbeat that failed while Redis was frozen, then Redis answering again: a SIGTERM
    before the next heartbeat still marks the worker draining and deregisters it (its exit
    skipped all of that, so gateways sent requests to a draining, then gone, worker until its
    entry expired)."""
    import signal

    server = LocalRedis().start()
    try:
        worker = _registered_worker(server, stories_dir, tmp_path, heartbeat_s=3)
        assert server._proc is not None
        server._proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: "serving on unregistered" in worker.tail(50), 20, "a failed heartbeat")
        finally:
            server._proc.send_signal(signal.SIGCONT)
        worker.signal(signal.SIGTERM)
        assert worker.popen.wait(30) == 0
        assert _keys(server.url, "ei:w:*") == 0, worker.tail()
    finally:
        server.stop()


def test_a_heartbeat_redis_refuses_is_said_as_refused_not_unreachable(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Redis out of memory (noeviction) answers the heartbeat's writes with an error: the
    worker says Redis refused it, naming the error, not that Redis is unreachable (it said
    'redis unreachable' for OOM, READONLY and NOPERM alike, sending an operator to the network)."""
    import redis as redis_sync

    server = LocalRedis().start()
    try:
        worker = _registered_worker(server, stories_dir, tmp_path, heartbeat_s=1)
        with redis_sync.Redis.from_url(server.url) as r:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", "1")
        wait_until(lambda: "redis refused the heartbeat" in worker.tail(50), 20, "a refusal")
        tail = worker.tail(50)
        assert "OutOfMemoryError" in tail or "OOM" in tail, tail
        assert "redis unreachable" not in tail, tail
        with redis_sync.Redis.from_url(server.url) as r:
            r.config_set("maxmemory", "0")
        wait_until(lambda: "redis is back" in worker.tail(50), 20, "the renewal")
        worker.stop()
    finally:
        server.stop()
