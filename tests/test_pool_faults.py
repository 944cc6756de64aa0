"""The pool manager under faults: workers that die, freeze or take work at awkward moments, with a
real Redis and real processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import resource
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvstore.client import connect
from kvstore.demand import Demand
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry
from runtime.pool_manager import Managed, Pool, PoolConfig
from tests.stack import Proc, chat_model, get_json, start_gateway, start_pool, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"


def _info(wid: str, model: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region="r", model=model, role="mixed", url="u",
                      max_num_seqs=4, capacity_tokens=100, started_at=time.time(),
                      last_active_at=0.0, updated_at=time.time())  # fmt: skip


def test_a_worker_that_dies_just_after_registering_leaves_the_registry(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A worker that registers and dies before the pool's next tick has seen it ready (a crash
    on the first request the held ones send it): a failed start, and its entry goes at once,
    not when its TTL runs out (gateways kept routing to a dead worker till then)."""

    async def main() -> None:
        redis_ = connect(redis_server.url)
        registry = Registry(redis_, ttl_s=60.0)
        await registry.register(_info("pf1-w1", "pf1"))
        pool = Pool(PoolConfig(region="r", models={"pf1": "/x"}, redis_url=redis_server.url,
                               secret="s"))  # fmt: skip
        pool.registry, pool.demand = registry, Demand(redis_)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
        await proc.wait()
        now = time.monotonic()
        pool.managed["pf1-w1"] = Managed("pf1-w1", "pf1", 0, proc, started=now - 1.0)
        assert await pool._reap({"pf1-w1"}, now) == {"pf1-w1"}
        assert not pool.managed and pool.states["pf1"].failures == 1
        assert [w.worker_id for w in await registry.workers("pf1")] == []
        status = await pool.demand.status("pf1", "r")
        assert status is not None and status.state == "failed" and "code 3" in status.error
        await redis_.aclose()

    asyncio.run(main())


def test_a_shutdown_waits_out_a_drain_timeout_given_by_a_prefix() -> None:
    """`--drain 100` in --worker-args is the worker's --drain-timeout (argparse takes a prefix
    of a flag as the flag): the pool waits for it too, not its 30 s default (it killed its
    workers 40 s into their 100 s drain, cutting off the requests they were finishing)."""
    from runtime.cli import build_parser
    from runtime.pool_manager import STOP_MARGIN_S

    for args in (["--threads", "1", "--drain", "100"], ["--drain-t=100"]):
        assert build_parser().parse_args(["worker", "--model", "x", *args]).drain_timeout == 100
        cfg = PoolConfig(region="r", models={"m": "/x"}, redis_url="", secret="s",
                         worker_args=args)  # fmt: skip
        assert cfg.stop_timeout_s == 100 + STOP_MARGIN_S, args


def test_starts_get_past_a_template_that_could_not_start_for_want_of_descriptors(
    tmp_path: Path,
) -> None:
    """The pool's template started while the process was out of descriptors: its workers start
    as fresh processes (and the template is tried again later), not every start of the pool
    failing for good with the template's "Too many open files"."""

    async def main() -> None:
        pool = Pool(PoolConfig(region="r", models={"m": "/x"}, redis_url="", secret="s"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.dup(0)  # the next descriptor number: none is left under this limit
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:
            pool._start_zygote()
            await asyncio.sleep(0)  # (it fails at its first step)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert pool._zygote is not None and pool._zygote.done()
        proc, how = await pool._spawn_process(["models", "--store", str(tmp_path)], {})
        assert how == "exec"
        assert proc.stdout is not None and b"no models in" in await proc.stdout.read()
        assert await proc.wait() == 0

    asyncio.run(main())


# ---------------------------------------------------------------------- with real workers
@pytest.fixture
def own_redis():  # type: ignore[no-untyped-def]
    """A Redis of its own: no other test's workers of the same model name in its registry."""
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.stop()


def _stack(tmp_path: Path, redis_url: str, models: str, pool_args: list[str],
           hold_s: float) -> tuple[Proc, Proc, openai.OpenAI]:  # fmt: skip
    (tmp_path / "regions.yaml").write_text(CATALOG)
    pool = start_pool("pool", redis_url, tmp_path, models, pool_args)
    try:
        gateway = start_gateway("gw", redis_url, tmp_path / "regions.yaml", tmp_path, "local",
                                ["--hold-timeout", str(hold_s)])  # fmt: skip
    except BaseException:
        pool.kill()
        raise
    wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["pools"] == 1, 30, "the pool", pool)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                           timeout=60)  # fmt: skip
    return pool, gateway, client


def _worker_pid(pool: Proc, worker_id: str) -> int:
    return int(re.findall(rf"start {worker_id} for .*: pid (\d+) \(", pool.tail(300))[-1])


def _alive(pid: int) -> bool:
    """Running or stopped (not exited, nor a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("max_workers", [1, 2])
def test_a_worker_that_stops_heartbeating_is_replaced_then_killed(
    tmp_path: Path, stories_dir: Path, own_redis, max_workers: int
) -> None:  # type: ignore[no-untyped-def]
    """The pool's ready worker frozen (SIGSTOP: as a hung engine step or a frozen VM, it stops
    heartbeating and its registry entry expires): the next request is held and served by a
    replacement, not answered 503 `worker_starting` once its hold ran out (the pool counted the
    frozen worker as serving, said nothing, and started none); the frozen one is killed after
    its grace (3 s at --heartbeat 0.3), its slot freed: at --max-workers 1 the replacement
    starts in it."""
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    args = "--threads 1 --kv-cache-bytes 4000000 --heartbeat 0.3 --ttl 1.5 --drain-timeout 5"
    pool, gateway, client = _stack(tmp_path, own_redis.url, f"stories={model}",
                                   ["--max-workers", str(max_workers), "--worker-args", args],
                                   12)  # fmt: skip
    pid = 0
    try:
        first = client.completions.with_raw_response.create(model="stories", prompt="Hi",
                                                            max_tokens=2)  # fmt: skip
        frozen = first.headers["x-edgeinfer-worker"]
        pid = _worker_pid(pool, frozen)
        os.kill(pid, signal.SIGSTOP)
        # (its entry expires within --ttl: sent before, a request would go to the frozen worker)
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 0, 10, "expiry")
        t0 = time.monotonic()
        raw = client.completions.with_raw_response.create(model="stories", prompt="Hi",
                                                          max_tokens=2)  # fmt: skip
        assert raw.parse().choices[0].text
        assert raw.headers["x-edgeinfer-worker"] != frozen
        assert time.monotonic() - t0 < 12
        wait_until(lambda: not _alive(pid), 15, "the frozen worker killed", pool)
        log = pool.tail(300)
        assert log.count(f"worker {frozen} (pid {pid}) of stories has left the registry") == 1
        assert f"stopping {frozen} (silent for " in log, log
        assert f"worker {frozen} (pid {pid}) is still silent" in log, log
        assert pool.alive()
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        gateway.stop()
        pool.stop(30)


def test_a_silent_worker_that_comes_back_is_counted_again(own_redis) -> None:  # type: ignore[no-untyped-def]
    """A worker gone from the registry for two of its heartbeats (at least a second) is silent,
    not serving; back in the registry before its grace ends it serves again, unharmed; gone
    for ten heartbeats (at least 3 s) it is sent SIGTERM, and SIGKILL when it neither exits
    nor comes back within two more (at least a second)."""

    async def main() -> None:
        redis_ = connect(own_redis.url)
        registry = Registry(redis_, ttl_s=60.0)
        pool = Pool(PoolConfig(region="r", models={"pf2": "/x"}, redis_url=own_redis.url,
                               secret="s"))  # fmt: skip
        pool.registry, pool.demand = registry, Demand(redis_)
        # (a worker has a SIGTERM handler, which waits while it is stopped: without one, the
        # kernel ends a stopped process at the SIGTERM)
        hangs = ("import signal, time; signal.signal(signal.SIGTERM, lambda *_: None); "
                 "print('up', flush=True); time.sleep(60)")  # fmt: skip
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", hangs,
                                                    stdout=asyncio.subprocess.PIPE)  # fmt: skip
        try:
            assert proc.stdout is not None and await proc.stdout.readline() == b"up\n"
            t = time.monotonic()
            m = Managed("pf2-w1", "pf2", 0, proc, started=t - 5, ready=t - 4)
            pool.managed[m.worker_id] = m
            listed = {m.worker_id: _info(m.worker_id, "pf2")}
            listed[m.worker_id].heartbeat_s = 0.3
            await pool._watch(listed, t)
            assert m.beat_s == 0.3 and m.serving
            await pool._watch({}, t + 0.1)  # missing: not yet silent (Redis may have lost it)
            assert m.serving
            await pool._watch({}, t + 1.2)
            assert m.silent and not m.serving and not m.stopping
            await pool._watch(listed, t + 1.5)  # back
            assert m.serving and not m.missing
            os.kill(proc.pid, signal.SIGSTOP)  # frozen
            await pool._watch({}, t + 2.0)
            await pool._watch({}, t + 3.1)
            assert m.silent and not m.stopping
            await pool._watch({}, t + 5.1)  # 3.1 s missing: told to stop
            assert m.stopping and proc.returncode is None
            m.stopping = t + 5.1  # (stamped by the real clock: put on this test's)
            await asyncio.sleep(0.3)
            await pool._watch({}, t + 5.5)  # (its SIGTERM not yet a second old)
            assert not m.killed and proc.returncode is None  # (stopped: SIGTERM waits)
            await pool._watch({}, t + 6.6)
            assert m.killed
            assert await asyncio.wait_for(proc.wait(), 5) == -signal.SIGKILL
            kinds = [e["event"] for e in await pool.demand.events("r")]
            assert kinds == ["silent", "back", "silent", "stopping", "kill"], kinds
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await redis_.aclose()

    asyncio.run(main())


def test_a_request_in_flight_at_the_idle_deadline_is_not_cut(
    tmp_path: Path, stories_dir: Path, own_redis
) -> None:  # type: ignore[no-untyped-def]
    """--idle 1 and workers heartbeating every 5 s: the worker's registry entry, written before
    the first requests reached it, says idle at the deadline while long streams run. The pool
    asks the worker itself and leaves it be (it stopped it: the streams ended in a `shutdown`
    error after its 0.5 s drain); once the streams are over, the idle stop comes."""
    args = "--threads 1 --kv-cache-bytes 16000000 --heartbeat 5 --ttl 12 --drain-timeout 0.5"
    pool, gateway, client = _stack(tmp_path, own_redis.url, f"stories={stories_dir}",
                                   ["--idle", "1", "--scale-up-after", "60", "--worker-args", args],
                                   30)  # fmt: skip

    def stream(_: int) -> list[str]:  # each choice's finish reason (3 x 16 x 480 tokens: ~3 s+)
        finished = [""] * 16
        for chunk in client.completions.create(
            model="stories", prompt="Once", max_tokens=480, n=16, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            for c in chunk.choices:
                finished[c.index] = c.finish_reason or finished[c.index]
        return finished

    try:
        with ThreadPoolExecutor(3) as ex:
            answers = list(ex.map(stream, range(3)))  # (a stream cut raises openai.APIError)
        assert answers == [["length"] * 16] * 3, answers
        log = pool.tail(300)
        worker = re.findall(r"start (\S+) for stories", log)[0]
        assert f"not stopping {worker}: it has work" in log, log  # (the deadline came mid-stream)
        assert f"stopping {worker} (idle" not in log, log
        wait_until(lambda: f"stopping {worker} (idle" in pool.tail(300), 20, "the idle stop", pool)
    finally:
        gateway.stop()
        pool.stop(30)


def test_a_failed_start_tells_clients_its_cause_without_paths_or_addresses(
    tmp_path: Path, own_redis
) -> None:  # type: ignore[no-untyped-def]
    """A worker that cannot start: the 503 names the cause (its own error, the file it could not
    read) but not the model's folder; the pool's log keeps the full output."""
    broken = tmp_path / "secret-place" / "broken"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{not json")
    pool, gateway, client = _stack(tmp_path, own_redis.url, f"broken={broken}", [], 30)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="broken", prompt="Once", max_tokens=4)
        assert e.value.status_code == 503
        message = e.value.body["message"]  # type: ignore[index]
        assert e.value.body["code"] == "worker_start_failed", message  # type: ignore[index]
        assert "secret-place" not in message and str(tmp_path) not in message, message
        assert "config.json: not valid JSON" in message, message
        assert re.search(r"\(exited with code \d+ before registering\)\)$", message), message
        assert f"{broken}/config.json: not valid JSON" in pool.tail(100)
    finally:
        gateway.stop()
        pool.stop(30)


def test_a_worker_killed_after_registering_publishes_no_addresses(
    own_redis, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """A worker killed (-9) after registering and serving held requests, before a tick saw it
    ready: its model's status (relayed in the 503s of those requests) says how it ended, without
    its output (model folder, internal URL, KV-transfer address), and the log says it had
    registered (it said "before registering")."""

    async def main() -> None:
        redis_ = connect(own_redis.url)
        registry = Registry(redis_, ttl_s=60.0)
        await registry.register(_info("pf3-w1", "pf3"))
        pool = Pool(PoolConfig(region="r", models={"pf3": "/x"}, redis_url=own_redis.url,
                               secret="s"))  # fmt: skip
        pool.registry, pool.demand = registry, Demand(redis_)
        said = ("print('start-up: weights read (edgeinfer drive-rate /srv/models/pf3)'); "
                "print('worker pf3-w1 ready: model pf3, http://10.1.2.3:28318, kv transfer on "
                "10.1.2.3:35719', flush=True); import os, signal; os.kill(os.getpid(), 9)")  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", said, stdout=asyncio.subprocess.PIPE
        )
        m = Managed("pf3-w1", "pf3", 0, proc, started=time.monotonic() - 1.0)
        pool.managed[m.worker_id] = m
        await pool._pipe_output(m)
        await proc.wait()
        with caplog.at_level(logging.WARNING, "edgeinfer.pool"):
            assert await pool._reap({"pf3-w1"}, time.monotonic()) == {"pf3-w1"}
        status = await pool.demand.status("pf3", "r")
        assert status is not None and status.state == "failed"
        assert status.error == "exited with code -9 after registering, before the pool saw it ready"
        logged = caplog.text
        assert "after registering" in logged and "before registering" not in logged, logged
        assert "http://10.1.2.3:28318" in logged  # (the output, for the operator)
        await redis_.aclose()

    asyncio.run(main())
