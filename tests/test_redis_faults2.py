"""Redis failing in ways other than going away: a failover behind one address (the old primary,
demoted, answers READONLY on the connections still open to it), and a password the gateway
cannot authenticate with. Real redis-servers, worker and gateway.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import redis

from kvstore.client import connect
from kvstore.redis_server import LocalRedis, find_free_port
from tests.stack import get_json, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"


class SwitchingProxy:
    """A TCP proxy on 127.0.0.1 in front of a Redis whose backend port can be changed, as a
    DNS name, a load balancer or a cloud's primary endpoint is repointed by a failover:
    connections opened before the change stay on the old backend, new ones reach the new."""

    def __init__(self, backend: int) -> None:
        self.backend = backend
        self.port = find_free_port()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(5):
            raise RuntimeError("the proxy did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _run(self, started: threading.Event) -> None:
        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            started.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            br, bw = await asyncio.open_connection("127.0.0.1", self.backend)
        except OSError:
            cw.close()
            return
        self._writers |= {cw, bw}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except OSError:
                pass
            finally:
                w.close()
                self._writers.discard(w)

        await asyncio.gather(pipe(cr, bw), pipe(br, cw))

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@contextmanager
def _primary_and_replica() -> Iterator[tuple[LocalRedis, LocalRedis, SwitchingProxy]]:
    """Two redis-servers, A and B, and a proxy pointing at A."""
    a, b = LocalRedis().start(), LocalRedis()
    try:
        b.start()
        proxy = SwitchingProxy(a.port)
        try:
            yield a, b, proxy
        finally:
            proxy.stop()
    finally:
        b.stop()
        a.stop()


def _fail_over(a: LocalRedis, b: LocalRedis, proxy: SwitchingProxy) -> None:
    """B takes A's data, becomes the primary, A its replica (read-only), and the proxy sends
    new connections to B: a Sentinel's or a managed Redis's failover, as clients see it."""
    ra, rb = redis.Redis(port=a.port), redis.Redis(port=b.port)
    try:
        rb.replicaof("127.0.0.1", a.port)
        wait_until(lambda: rb.info("replication")["master_link_status"] == "up", 10, "B in sync")
        wait_until(lambda: rb.dbsize() == ra.dbsize(), 5, "B's copy")
        rb.replicaof("NO", "ONE")
        ra.replicaof("127.0.0.1", b.port)
        proxy.backend = b.port
    finally:
        ra.close()
        rb.close()


async def test_a_client_follows_a_failover_behind_its_address() -> None:
    """After a failover behind the client's address, a command on a pooled connection that
    still reaches the old primary (a replica now: READONLY) fails, and that connection is
    closed: the next command connects anew and reaches the new primary. Left open, a pooled
    connection stayed on the old primary for as long as it lived: every write failed, for good."""
    with _primary_and_replica() as (a, b, proxy):
        r = connect(proxy.url)
        try:
            await r.set("k", "1")
            pipe = r.pipeline(transaction=False)
            pipe.set("p", "1")
            await pipe.execute()
            _fail_over(a, b, proxy)
            with pytest.raises(redis.exceptions.ReadOnlyError):  # (not run: not tried again)
                await r.set("k", "2")
            assert await r.set("k", "2")
            pipe = r.pipeline(transaction=False)
            pipe.set("p", "2")
            pipe.pexpire("p", 60_000)
            assert await pipe.execute() == [True, True]
            direct = redis.Redis(port=b.port)
            assert direct.mget("k", "p") == [b"2", b"2"]
            direct.close()
        finally:
            await r.aclose()


async def test_a_pipeline_cut_by_a_failover_is_not_run_again() -> None:
    """A pipeline without a transaction that a failover (Redis's own FAILOVER, as a Sentinel or
    a managed Redis does it) cuts in the middle: the commands before it ran, and the pipeline
    raises; it is not sent again (tried again on READONLY, 400,000 INCRs left n = 623,559 on the
    new primary: ~220,000 ran twice)."""
    n = 200_000
    with _primary_and_replica() as (a, b, proxy):
        ra, rb = redis.Redis(port=a.port), redis.Redis(port=b.port)
        rb.replicaof("127.0.0.1", a.port)
        wait_until(lambda: rb.info("replication")["master_link_status"] == "up", 10, "B in sync")
        r = connect(proxy.url, timeout_s=30)
        await r.ping()

        def failover() -> None:
            base = ra.info("stats")["total_commands_processed"]
            deadline = time.monotonic() + 20
            while (ra.info("stats")["total_commands_processed"] < base + n // 4
                   and time.monotonic() < deadline):  # fmt: skip
                time.sleep(0.0005)
            ra.execute_command("FAILOVER")
            wait_until(lambda: ra.info("replication")["role"] == "slave", 10, "A demoted")
            proxy.backend = b.port

        thread = threading.Thread(target=failover)
        thread.start()
        try:
            pipe = r.pipeline(transaction=False)
            for _ in range(n):
                pipe.incr("n")
            with pytest.raises(redis.exceptions.ReadOnlyError):
                await pipe.execute()
        finally:
            thread.join()
            await r.aclose()
        ran = int(rb.get("n") or 0)
        assert 0 < ran < n, ran  # cut in the middle, and nothing ran twice
        ra.close()
        rb.close()


def test_workers_and_gateways_follow_a_failover_behind_their_address(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A worker and a gateway reach Redis through one address, and a failover repoints it:
    the worker goes on renewing its registry entry on the new primary (it kept writing to the
    demoted one, READONLY, and its entry expired there: a gateway started after the failover
    answered 404 model_not_found), and both gateways serve."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    with _primary_and_replica() as (a, b, proxy):
        worker = start_worker("w1", stories_dir, proxy.url, tmp_path, "local",
                              ["--heartbeat", "0.3", "--ttl", "1.5"])  # fmt: skip
        gateways = [start_gateway("gw1", proxy.url, tmp_path / "regions.yaml", tmp_path)]
        try:
            wait_until(lambda: get_json(f"{gateways[0].url}/readyz")[1]["workers"] == 1, 30,
                       "the worker in the registry")  # fmt: skip
            client = openai.OpenAI(base_url=f"{gateways[0].url}/v1", api_key="x", max_retries=0)
            assert client.completions.create(model="stories", prompt="Hi", max_tokens=1).choices

            _fail_over(a, b, proxy)
            time.sleep(3)  # two TTLs: an entry the worker does not renew on B has expired
            rb = redis.Redis(port=b.port)
            try:
                key = f"ei:w:{{{worker.meta['worker_id']}}}"
                assert rb.exists(key) and rb.pttl(key) > 0, worker.tail()
            finally:
                rb.close()
            gateways.append(start_gateway("gw2", proxy.url, tmp_path / "regions.yaml", tmp_path))
            wait_until(lambda: get_json(f"{gateways[1].url}/readyz")[1]["workers"] == 1, 10,
                       "the worker, seen by a gateway started after the failover")  # fmt: skip
            for gw in gateways:
                c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
                for i in range(3):
                    c.completions.create(model="stories", prompt=f"Hi {i}", max_tokens=1,
                                         extra_headers={"x-session-affinity": "s1"})  # fmt: skip
            assert worker.alive()
        finally:
            for gw in gateways:
                gw.stop()
            worker.stop()
    # each pooled connection meets READONLY once at most (closed, not tried again: see
    # kvstore.client._Retry): a heartbeat that did is renewed at the next one
    log = (tmp_path / "w1.log").read_text()
    if "read only replica" in log:
        assert "redis is back" in log[log.index("read only replica"):], log[-3000:]


def test_a_gateway_that_cannot_authenticate_says_why(tmp_path: Path) -> None:
    """A gateway started with a wrong Redis password answers 503 with Retry-After, and its log
    says why Redis is unreachable (it said nothing: its warnings fire only when a Redis that
    answered stops answering, and this one never had)."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    server = LocalRedis().start()
    try:
        admin = redis.Redis(port=server.port)
        admin.config_set("requirepass", "right")
        admin.close()
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        gateway = start_gateway("gw", url, tmp_path / "regions.yaml", tmp_path)
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model="stories", prompt="Hi", max_tokens=1)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
            time.sleep(1.0)  # (a few registry reads: said once)
        finally:
            gateway.stop()
        log = (tmp_path / "gw.log").read_text()
        said = [line for line in log.splitlines() if "redis unreachable" in line]
        assert len(said) == 1, log
        assert "AuthenticationError" in said[0] and "password" in said[0], said
    finally:
        server.stop()


async def test_the_log_says_when_workers_lost_by_redis_are_back_or_given_up(
    redis: LocalRedis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis emptied under a gateway: it carries the workers it knew, with prefix lookups and
    new sessions' placement off, and says so. The log also says which carried worker never
    registered again, and when carrying ends (it said when it began only: an operator could
    not tell whether the gateway still routed in its degraded way)."""
    from gateway import cluster
    from gateway.config import GatewayConfig
    from gateway.regions import DEFAULT_CATALOG, RegionCatalog
    from kvstore.protocol import WorkerInfo
    from kvstore.registry import Registry

    monkeypatch.setattr(cluster, "CARRY_S", 0.5)  # (the workers below say no heartbeat period)

    def info(wid: str) -> WorkerInfo:
        return WorkerInfo(worker_id=wid, region="eu-west", model="m", role="mixed",
                          url=f"http://127.0.0.1:9/{wid}", max_num_seqs=8,
                          capacity_tokens=4096, updated_at=time.time())  # fmt: skip

    r = connect(redis.url)
    try:
        view = cluster.ClusterView(GatewayConfig("eu-west", redis.url, "s"), r,
                                   RegionCatalog.load(DEFAULT_CATALOG))  # fmt: skip
        registry = Registry(r, ttl_s=60)
        for wid in ("w-back", "w-gone"):
            await registry.register(info(wid))
        await view.refresh()
        await r.flushall()
        with caplog.at_level("WARNING", logger="edgeinfer.gateway"):
            await view.refresh()
            assert view.recovering and len(view.workers) == 2
            await registry.register(info("w-back"))
            await view.refresh()
            assert view.recovering  # (w-gone is still carried)
            await asyncio.sleep(0.6)
            await view.refresh()
            assert not view.recovering and [w.worker_id for w in view.workers] == ["w-back"]
        said = [rec.getMessage() for rec in caplog.records]
        assert any("redis lost 2 worker entries" in m for m in said), said
        assert any("did not register again: w-gone;" in m for m in said), said
        assert "w-back" not in " ".join(m for m in said if "did not register" in m), said
        assert sum("prefix lookups and session placement resume" in m for m in said) == 1, said
    finally:
        await r.aclose()
