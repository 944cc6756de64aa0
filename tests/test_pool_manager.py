"""The pool manager: its scaling decisions (a pure function), and scale from zero end to end with
a real Redis, a real gateway, real worker processes started by `edgeinfer pool`, and the
official `openai` client."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis

from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from runtime.pool_manager import (
    Decision,
    Managed,
    ModelState,
    PoolConfig,
    decide,
    make_room,
    needs_room,
    slots_left,
)
from tests.stack import (
    ROOT,
    chat_model,
    get_json,
    start_gateway,
    start_pool,
    start_worker,
    wait_until,
)

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"
WORKER_ARGS = "--threads 1 --kv-cache-bytes 4000000 --heartbeat 0.3 --ttl 1.5 --drain-timeout 5"


# ---------------------------------------------------------------------- decide()
def _cfg(**kw: object) -> PoolConfig:
    base: dict[str, object] = dict(
        region="r", models={"m": "/x"}, redis_url="", secret="s", max_workers=3,
        idle_s=10.0, scale_up_queue=2, scale_up_after_s=1.0,
    )  # fmt: skip
    return PoolConfig(**(base | kw))  # type: ignore[arg-type]


def _managed(wid: str, ready: float = 0.0, stopping: float = 0.0) -> Managed:
    return Managed(wid, "m", 0, proc=None, started=0.0, ready=ready, stopping=stopping)  # type: ignore[arg-type]


def _info(wid: str, **kw: object) -> WorkerInfo:
    base: dict[str, object] = dict(
        worker_id=wid, region="r", model="m", role="mixed", url="u", max_num_seqs=4,
        capacity_tokens=100, started_at=0.0, last_active_at=0.0,
    )  # fmt: skip
    return WorkerInfo(**(base | kw))  # type: ignore[arg-type]


def test_decide_scales_from_zero_only_when_asked() -> None:
    cfg, state = _cfg(), ModelState()
    assert decide(cfg, state, [], [], waiting=0, room=3, now=5.0, wall=5.0) == Decision()
    d = decide(cfg, state, [], [], waiting=1, room=3, now=6.0, wall=6.0)
    assert d.start and "scale from zero" in d.why
    # a start in flight: no second one, whatever is waiting
    starting = [_managed("w1")]
    assert not decide(cfg, state, starting, [], waiting=5, room=2, now=7.0, wall=7.0).start
    # no room left in the pool
    assert not decide(cfg, ModelState(), [], [], waiting=1, room=0, now=1.0, wall=1.0).start
    # our worker is up but the registry lists nothing (Redis restarted empty): no second start
    up = [_managed("w1", ready=6.5)]
    assert not decide(cfg, state, up, [], waiting=0, room=2, now=8.0, wall=8.0).start


def test_decide_backs_off_after_a_failed_start() -> None:
    cfg = _cfg()
    state = ModelState(wanted_at=1.0, settled_at=2.0, failures=1, retry_at=4.0)
    # demand older than the failure is spent; newer demand waits for the retry time
    assert not decide(cfg, state, [], [], waiting=0, room=3, now=3.0, wall=3.0).start
    assert not decide(cfg, state, [], [], waiting=1, room=3, now=3.5, wall=3.5).start
    assert decide(cfg, state, [], [], waiting=0, room=3, now=4.0, wall=4.0).start


def test_decide_needs_recent_demand_to_scale_from_zero() -> None:
    """A worker that dies long after its last demand (killed for memory, idle) is not started
    again with nothing waiting: the demand that started it, at 5, is spent by 290 (it used to
    start one, kept up for --idle, for nobody). Recent or waiting demand still starts one."""
    cfg = _cfg(idle_s=300.0)
    stale = ModelState(wanted_at=5.0, settled_at=0.0)
    assert decide(cfg, stale, [], [], waiting=0, room=3, now=290.0, wall=290.0) == Decision()
    from runtime.pool_manager import DEMAND_FRESH_S

    assert not decide(cfg, stale, [], [], waiting=0, room=3, now=5.0 + DEMAND_FRESH_S + 0.1,
                      wall=0.0).start  # fmt: skip
    assert decide(cfg, stale, [], [], waiting=0, room=3, now=5.0 + DEMAND_FRESH_S, wall=0.0).start
    assert decide(cfg, ModelState(wanted_at=5.0), [], [], waiting=2, room=3, now=290.0,
                  wall=290.0).start  # fmt: skip


def test_decide_keeps_the_minimum() -> None:
    cfg, state = _cfg(min_workers=1), ModelState()
    assert decide(cfg, state, [], [], waiting=0, room=3, now=1.0, wall=1.0).start
    ours = [_managed("w1", ready=1.0)]
    idle = [_info("w1", started_at=0.0, last_active_at=0.0)]
    # idle far past idle_s, but it is the minimum: kept
    assert decide(cfg, state, ours, idle, waiting=0, room=2, now=100.0, wall=100.0) == Decision()


def test_decide_scales_up_after_sustained_queueing() -> None:
    cfg, state = _cfg(), ModelState()
    ours = [_managed("w1", ready=1.0)]
    busy = [_info("w1", running=4, waiting=3)]
    assert not decide(cfg, state, ours, busy, waiting=0, room=2, now=10.0, wall=10.0).start
    d = decide(cfg, state, ours, busy, waiting=0, room=2, now=11.0, wall=11.0)
    assert d.start and "queueing" in d.why
    # queueing stopped: the clock resets
    calm = [_info("w1", running=1, waiting=0)]
    assert not decide(cfg, state, ours, calm, waiting=0, room=2, now=12.5, wall=12.5).start
    assert state.queueing_since == 0.0


def test_decide_stops_an_idle_worker_and_never_a_busy_one() -> None:
    cfg, state = _cfg(), ModelState()
    ours = [_managed("w1", ready=1.0), _managed("w2", ready=1.0)]
    infos = [
        _info("w1", running=1, last_active_at=0.0),  # running: never stopped
        _info("w2", last_active_at=50.0),  # active at 50: idle 10 s at 60
    ]
    assert decide(cfg, state, ours, infos, waiting=0, room=1, now=59.0, wall=59.0) == Decision()
    assert decide(cfg, state, ours, infos, waiting=0, room=1, now=60.0, wall=60.0).stop == ["w2"]
    # requests held at a gateway: nothing stops
    assert decide(cfg, state, ours, infos, waiting=1, room=1, now=60.0, wall=60.0) == Decision()


def test_a_model_waiting_for_a_slot_gets_the_longest_idle_worker_of_another() -> None:
    cfg = _cfg(models={"a": "/x", "b": "/y"}, max_workers=2)

    def m(wid: str, model: str, stopping: float = 0.0) -> Managed:
        return Managed(wid, model, 0, proc=None, started=0.0, ready=1.0, stopping=stopping)  # type: ignore[arg-type]

    ours = [m("a1", "a"), m("a2", "a")]
    reg = [_info("a1", model="a", last_active_at=90.0), _info("a2", model="a", last_active_at=50.0)]
    # b has requests waiting, nothing serving it, and no slot left: it needs room
    assert needs_room(ModelState(), [], [], waiting=2, room=0, now=10.0)
    assert not needs_room(ModelState(), [], [], waiting=0, room=0, now=10.0)
    assert not needs_room(ModelState(), [], [], waiting=2, room=1, now=10.0)  # decide starts
    assert make_room(cfg, ours, reg, "b", wall=100.0, now=100.0) == "a2"  # idle 50 s against 10 s
    # a worker with work, or one already stopping, or at its model's minimum, is never taken
    busy = [_info("a1", model="a", running=1), _info("a2", model="a", waiting=1)]
    assert make_room(cfg, ours, busy, "b", wall=100.0, now=100.0) is None
    assert make_room(cfg, [m("a1", "a"), m("a2", "a", stopping=5.0)], reg, "b", 100.0,
                     100.0) == "a1"  # fmt: skip
    keep_two = _cfg(models={"a": "/x", "b": "/y"}, min_workers=2, max_workers=4)
    assert make_room(keep_two, ours, reg, "b", 100.0, 100.0) is None


def test_two_models_asked_for_in_turn_at_the_process_limit_do_not_evict_each_other_per_request(
) -> None:  # fmt: skip
    """--max-workers 1, models a and b asked for in turn: a worker was stopped for the other
    model as soon as it was idle, so every request paid a cold start. A worker is taken only
    once it has been ready for min_residency_s, and for as long as its own start took."""
    cfg = _cfg(models={"a": "/x", "b": "/y"}, max_workers=1, min_residency_s=5.0)
    # a's worker started at 0, ready at 1.5, has just answered a request (idle 0.1 s)
    a1 = Managed("a1", "a", 0, proc=None, started=0.0, ready=1.5)  # type: ignore[arg-type]
    reg = [_info("a1", model="a", last_active_at=1.9)]
    assert needs_room(ModelState(), [], [], waiting=1, room=0, now=2.0)
    assert make_room(cfg, [a1], reg, "b", wall=2.0, now=2.0) is None  # b's requests are held
    assert make_room(cfg, [a1], reg, "b", wall=6.4, now=6.4) is None
    assert make_room(cfg, [a1], reg, "b", wall=6.5, now=6.5) == "a1"  # 5 s of service
    # a worker that took longer than that to start serves at least as long as its start took
    slow = Managed("a1", "a", 0, proc=None, started=0.0, ready=20.0)  # type: ignore[arg-type]
    assert make_room(cfg, [slow], reg, "b", wall=39.9, now=39.9) is None
    assert make_room(cfg, [slow], reg, "b", wall=40.0, now=40.0) == "a1"
    # min_residency_s 0: as long as its start took (1.5 s) only
    eager = _cfg(models={"a": "/x", "b": "/y"}, max_workers=1, min_residency_s=0.0)
    assert make_room(eager, [a1], reg, "b", wall=2.9, now=2.9) is None
    assert make_room(eager, [a1], reg, "b", wall=3.0, now=3.0) == "a1"
    with pytest.raises(ValueError, match="min_residency_s"):
        _cfg(min_residency_s=-1.0)


def test_a_stopping_worker_holds_its_slot_until_it_has_exited() -> None:
    """A worker draining (a scale-down, or stopped to make room) still has its model in memory:
    its slot is not free until it exits, and while it is stopping no second worker is stopped
    to make room for the same wait (a worker started beside it ran max_workers + 1 models)."""
    cfg = _cfg(models={"a": "/x", "b": "/y"}, max_workers=2)
    up = Managed("a1", "a", 0, proc=None, started=0.0, ready=1.0)  # type: ignore[arg-type]
    draining = Managed("a2", "a", 0, proc=None, started=0.0, ready=1.0, stopping=5.0)  # type: ignore[arg-type]
    room = slots_left(cfg, [up, draining])
    assert room == 0
    assert not decide(cfg, ModelState(), [], [], waiting=1, room=room, now=6.0, wall=6.0).start
    # b waits with every slot taken, but a2's is on its way: nothing else is stopped for it
    assert not needs_room(ModelState(), [], [], waiting=1, room=room, now=6.0, freeing=True)
    assert needs_room(ModelState(), [], [], waiting=1, room=room, now=6.0, freeing=False)
    assert slots_left(cfg, [up]) == 1  # a2 exited (reaped): b starts


def test_a_shutdown_waits_out_the_workers_drain_timeout() -> None:
    """The pool's shutdown waits for its workers' --drain-timeout and a margin before it kills
    them (a fixed 40 s killed workers told to drain for 100 s mid-drain, though the pod's
    grace period, drain + 20 s, let them finish)."""
    from runtime.cli import build_parser
    from runtime.pool_manager import STOP_MARGIN_S, WORKER_DRAIN_TIMEOUT_S

    assert build_parser().parse_args(["worker"]).drain_timeout == WORKER_DRAIN_TIMEOUT_S
    assert _cfg().stop_timeout_s == WORKER_DRAIN_TIMEOUT_S + STOP_MARGIN_S
    slow = ["--threads", "1", "--drain-timeout", "100"]
    assert _cfg(worker_args=slow).stop_timeout_s == 100 + STOP_MARGIN_S
    assert _cfg(worker_args=["--drain-timeout=5"]).stop_timeout_s == 5 + STOP_MARGIN_S


async def test_a_worker_that_never_exits_after_its_stop_is_killed() -> None:
    """A stopping worker holds its slot until it exits; one that never does (a hung step)
    is killed once its drain and the margin have run out, or it held the slot, and every
    scale from zero behind it, for good."""
    import asyncio
    import signal as sig
    import time as clock

    from runtime.pool_manager import Pool

    pool = Pool(_cfg(worker_args=["--drain-timeout", "1"]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); print('up', flush=True); time.sleep(60)",
        stdout=asyncio.subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and await proc.stdout.readline() == b"up\n"
    now = clock.monotonic()
    m = Managed("w1", "m1", 0, proc, started=now - 20, ready=now - 19, stopping=now - 5)
    pool.managed["w1"] = m
    proc.send_signal(sig.SIGTERM)  # (ignored)
    await pool._reap({"w1"}, now)  # 5 s < 1 + STOP_MARGIN_S: waits
    assert proc.returncode is None
    await pool._reap({"w1"}, now + pool.cfg.stop_timeout_s)  # run out: killed
    assert await asyncio.wait_for(proc.wait(), 10) == -sig.SIGKILL


def test_pool_config_rejects_impossible_limits() -> None:
    with pytest.raises(ValueError, match="exceeds --max-workers"):
        _cfg(min_workers=2, max_workers=1)
    with pytest.raises(ValueError, match="--max-workers must be at least 1"):
        _cfg(max_workers=0)


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        # 0: an idle worker counted as queueing, and the pool grew to --max-workers unasked
        (dict(scale_up_queue=0), "--scale-up-queue must be at least 1"),
        (dict(scale_up_queue=-1), "--scale-up-queue must be at least 1"),
        (dict(scale_up_after_s=-5.0), "--scale-up-after must be >= 0"),
        (dict(backoff_s=0.0), "backoff_s must be positive"),
        (dict(backoff_s=-1.0), "backoff_s must be positive"),
        # names that cannot go in a hash tag: the pool ran on, its every tick failing
        (dict(region="eu{1}"), "--region must not contain"),
        (dict(models={"m{x}": "/x"}), "model name must not contain"),
        (dict(models={"": "/x"}), "model name must be a non-empty string"),
        (dict(ttl_s=0.1, heartbeat_s=5.0), "ttl_s .* must exceed heartbeat_s"),
        (dict(ttl_s=2.0, heartbeat_s=2.0), "ttl_s .* must exceed heartbeat_s"),
        (dict(idle_s=float("nan")), "--idle must be a finite number"),
        (dict(scale_up_after_s=float("inf")), "--scale-up-after must be a finite number"),
        (dict(ready_timeout_s=float("nan")), "--ready-timeout must be a finite number"),
        (dict(tick_s=float("nan")), "tick_s must be a finite number"),
        (dict(ttl_s=float("inf")), "ttl_s must be a finite number"),
    ],
)
def test_pool_config_rejects_bad_settings(setting: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        _cfg(**setting)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--worker-id", "fixed-id"], "--worker-id"),  # the pool killed it in a loop
        (["--threads", "1", "--port", "9000"], "--port"),  # every worker after the first broke
        (["--port=9000"], "--port"),
        (["--worker-i", "x"], "--worker-id"),  # (argparse takes a prefix as the flag)
        (["--region=eu"], "--region"),
        (["--redis", "redis://elsewhere"], "--redis"),
        (["--model", "/m"], "--model"),
        (["--served-model-name=other"], "--served-model-name"),
        (["--host", "0.0.0.0"], "--host"),
        (["--no-redis"], "--no-redis"),
    ],
)
def test_pool_config_rejects_worker_args_that_set_the_pools_own_flags(
    args: list[str], flag: str
) -> None:
    with pytest.raises(ValueError, match=f"--worker-args: .* sets {flag}, which the pool sets"):
        _cfg(worker_args=args)


@pytest.mark.parametrize("arg", [["--dist-port", "29500"], ["--kv-port=7001"], ["--dist-p", "1"]])
def test_pool_config_rejects_one_port_for_every_worker(arg: list[str]) -> None:
    """--dist-port or --kv-port in --worker-args gives every worker the same port: the second
    worker of a pool failed to start (address in use). One worker at most: its own."""
    with pytest.raises(ValueError, match=r"gives every worker the same --(dist|kv)-port"):
        _cfg(worker_args=arg, max_workers=2)
    assert _cfg(worker_args=arg, max_workers=1).worker_args == arg


def test_pool_config_takes_other_worker_args() -> None:
    args = ["--threads", "1", "--drain-timeout=5", "--max-num-seqs", "8", "--draft-model", "/d"]
    assert _cfg(worker_args=args).worker_args == args


def test_a_pool_with_a_bad_setting_exits_2_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edgeinfer pool` refuses them at start-up (a region with braces ran on for good, its
    every tick failing; --scale-up-queue 0 grew the pool unasked; --worker-id in --worker-args
    killed a healthy worker in a loop)."""
    import runtime.pool_manager
    from runtime.cli import main

    served: list[PoolConfig] = []

    async def serve(cfg: PoolConfig) -> None:
        served.append(cfg)

    monkeypatch.setattr(runtime.pool_manager, "serve", serve)
    (tmp_path / "config.json").write_text("{}")
    pool = ["pool", "--models", f"m={tmp_path}", "--secret", "s"]
    for bad, error in (
        (["--region", "eu{1}"], "--region must not contain"),
        (["--scale-up-queue", "0"], "--scale-up-queue must be at least 1"),
        (["--idle", "nan"], "--idle must be a finite number"),
        (["--worker-args", "--threads 1 --worker-id fixed"], "sets --worker-id"),
    ):
        assert main([*pool, *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("edgeinfer: error: ") and error in err[0], err
    assert not served
    assert main(pool) == 0 and len(served) == 1


# ---------------------------------------------------------------------- end to end
def _events(redis_url: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "pool", "--region", "local", "--events", "100",
         "--redis", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.splitlines()


def test_commands_without_redis_say_so_in_one_line() -> None:
    from kvstore.redis_server import find_free_port

    nowhere = f"redis://127.0.0.1:{find_free_port()}/0"
    for args in (["pool", "--events", "5"], ["rebalance", "--model", "m", "--prefill", "1"]):
        out = subprocess.run(
            [sys.executable, "-m", "runtime.cli", *args, "--redis", nowhere, "--region", "r"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "EDGEINFER_SECRET": "s"},
        )  # fmt: skip
        assert out.returncode == 2, out
        assert "edgeinfer: error: cannot reach Redis" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.parametrize("what", ["worker", "gateway"])
def test_a_server_whose_port_is_taken_says_so_and_exits(
    stories_dir: Path, tmp_path: Path, what: str
) -> None:
    """Both used to hang for good instead: the failed bind left the app's tasks to asyncio's
    cancellation, which never finished (a bench's worker, its port taken between choosing and
    binding it, never came up and never exited)."""
    import socket

    (tmp_path / "regions.yaml").write_text(CATALOG)
    args = {
        "worker": ["--model", str(stories_dir), "--threads", "1", "--kv-cache-bytes", "4000000"],
        "gateway": ["--region", "local", "--regions", str(tmp_path / "regions.yaml")],
    }[what]
    with LocalRedis() as redis_, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "runtime.cli", what, *args, "--host", "127.0.0.1",
             "--port", str(port), "--redis", redis_.url, "--secret", "s"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode != 0
    assert f"the {what} cannot listen on 127.0.0.1:{port}: " in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.fixture
def redis_server():  # type: ignore[no-untyped-def]
    """A Redis of its own: the test checks that the pool leaves no key behind."""
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.stop()


def test_scale_from_zero_and_back(tmp_path: Path, stories_dir: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (tmp_path / "regions.yaml").write_text(CATALOG)
    pool = start_pool("pool", redis_server.url, tmp_path, f"stories={model},broken={broken}",
                      ["--max-workers", "2", "--idle", "2", "--worker-args", WORKER_ARGS])  # fmt: skip
    gateway = start_gateway("gw", redis_server.url, tmp_path / "regions.yaml", tmp_path, "local")
    try:
        # the gateway knows the pool's models before any worker exists, and is ready
        wait_until(
            lambda: (
                {"stories", "broken"}
                <= {m["id"] for m in get_json(f"{gateway.url}/v1/models")[1]["data"]}
            ),
            30,
            "the pool's models at the gateway",
        )
        status, ready = get_json(f"{gateway.url}/readyz")
        assert status == 200 and ready["workers"] == 0 and ready["pools"] == 1
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=120)  # fmt: skip

        # the first requests (several at once) wait for the one worker the pool starts, and
        # are all answered
        def ask(_: int):  # type: ignore[no-untyped-def]
            return client.chat.completions.with_raw_response.create(
                model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )

        with ThreadPoolExecutor(3) as ex:
            answers = list(ex.map(ask, range(3)))
        for raw in answers:
            assert raw.headers["x-edgeinfer-route"] == "cold_start"
            assert "cold-start;dur=" in raw.headers["server-timing"]
            assert raw.parse().choices[0].message.content
        assert len({raw.headers["x-edgeinfer-worker"] for raw in answers}) == 1
        # the next one finds the worker at once
        raw = client.chat.completions.with_raw_response.create(
            model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert raw.headers["x-edgeinfer-route"] != "cold_start"

        # idle for 2 s: the pool stops it, and says so with its timings
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 0, 30, "scale down")
        wait_until(lambda: any(" stop " in e for e in _events(redis_server.url)), 30, "stop event")
        events = _events(redis_server.url)
        kinds = [e.split()[2] for e in events]
        assert kinds[:4] == ["start", "ready", "stopping", "stop"], events
        assert "ready_s=" in events[1] and "stop_s=" in events[3]
        assert "spawn=fork" in events[0], events  # forked from the pool's warm template

        # a model whose worker cannot start: 503 with Retry-After, not a hang
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="broken", prompt="Once", max_tokens=4)
        assert e.value.status_code == 503
        assert e.value.response.headers["retry-after"]
        assert e.value.body["code"] == "worker_start_failed"  # type: ignore[index]
        assert "config.json" in e.value.body["message"]  # type: ignore[index]
        assert time.monotonic() - t0 < 60
        assert any(" fail " in e and "broken" in e for e in _events(redis_server.url))

        # scale from zero again after the scale-down: streamed this time
        stream = client.completions.create(
            model="stories", prompt="Once upon a time", max_tokens=8, stream=True
        )
        assert "".join(c.choices[0].text for c in stream)
        assert pool.alive(), pool.tail()
    finally:
        gateway.stop()
        pool.stop(60)
    log = (tmp_path / "pool.log").read_text()
    assert "start-up:" in log  # the worker's own timeline reached the pool's output
    r = redis.Redis.from_url(redis_server.url)
    assert not r.keys("ei:p:*")  # the pool withdrew itself
    r.close()


def test_one_start_claim_per_model_and_region(redis_server) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand

    async def run() -> None:
        r = connect(redis_server.url)
        d = Demand(r)
        try:
            assert await d.claim_start("m", "eu", "pool-a", 5.0)
            assert not await d.claim_start("m", "eu", "pool-b", 5.0)  # a's start is in flight
            assert await d.claim_start("m", "us", "pool-b", 5.0)  # another region
            await d.release_start("m", "eu", "pool-b")  # not b's claim: stays
            assert not await d.claim_start("m", "eu", "pool-b", 5.0)
            await d.release_start("m", "eu", "pool-a")
            assert await d.claim_start("m", "eu", "pool-b", 5.0)
            # held requests count until released or past their deadline
            now = time.time()
            await d.hold("m", "eu", "req-1", now + 60)
            await d.hold("m", "eu", "req-2", now - 1)  # a dead gateway's, past its deadline
            assert await d.waiting("m", "eu") == 1
            await d.release("m", "eu", "req-1")
            assert await d.waiting("m", "eu") == 0
        finally:
            await r.aclose()

    asyncio.run(run())


async def test_wakeups_reach_every_pool_of_the_region_and_are_never_kept(redis_server) -> None:  # type: ignore[no-untyped-def]
    """Wake-ups are published, not queued. Requests held and answered (503) before any pool
    listened leave none behind (a pool started later started a worker nobody waited for, one
    per request); every pool of the region hears each wake-up, its own models or not (one pool
    took, and dropped, another's); a burst comes as one wake, each model once; and a pool
    waiting for wake-ups wakes at once."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand

    gateway, pools = connect(redis_server.url), connect(redis_server.url, timeout_s=5.0)
    d = Demand(gateway)
    a, b, far = (Demand(pools).wakeups(region) for region in ("eu", "eu", "us"))
    try:
        now = time.time()
        for i in range(3):  # held, given up on (hold timeout: 503) and released, no pool about
            await d.hold("m", "eu", f"req-{i}", now + 3)
            await d.release("m", "eu", f"req-{i}")
        assert await a.next(0.3) == set()  # a pool started later: nothing left for it
        assert await b.next(0.05) == set() and await far.next(0.05) == set()
        for i in range(5):
            await d.hold("a", "eu", f"burst-{i}", now + 60)
        await d.wake("b", "eu")  # (no request held: a gateway serving "b" from afar)
        assert await a.next(2.0) == {"a", "b"}
        assert await b.next(2.0) == {"a", "b"}
        assert await far.next(0.2) == set()  # another region's
        assert await a.next(0.05) == set()  # each wake-up once

        async def later() -> None:
            await asyncio.sleep(0.2)
            await d.wake("m", "eu")

        t0 = time.monotonic()
        waker = asyncio.ensure_future(later())
        assert await a.next(5.0) == {"m"}
        assert time.monotonic() - t0 < 2.0  # woken, not timed out
        await waker
    finally:
        for w in (a, b, far):
            await w.aclose()
        await gateway.aclose()
        await pools.aclose()


async def test_pools_start_workers_for_fresh_wakeups_of_their_own_models_only(  # type: ignore[no-untyped-def]
    redis_server,
) -> None:
    """Two pools of one region, running: requests held and answered before they started leave
    them nothing to start (they started a worker nobody waited for); a gateway's wake-up for
    "b" starts one at pool b at once, ticks 5 s apart notwithstanding (pool a took, and
    dropped, the wake-ups for b it popped from the list they shared)."""
    import asyncio
    from dataclasses import replace

    from kvstore.client import connect
    from kvstore.demand import Demand
    from runtime.pool_manager import Pool

    spawned: list[str] = []

    async def spawn(argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
        spawned.append(argv[argv.index("--served-model-name") + 1])
        proc = await asyncio.create_subprocess_exec("sleep", "60", stdout=asyncio.subprocess.PIPE)
        return proc, "exec"

    redis_ = connect(redis_server.url)
    d = Demand(redis_)
    for i in range(3):  # a gateway's held requests, given their 503 (hold timeout), no pool up
        await d.hold("b", "r", f"req-{i}", time.time() + 3)
        await d.release("b", "r", f"req-{i}")
    cfg = _cfg(redis_url=redis_server.url, tick_s=5.0, zygote=False)
    pools = [Pool(replace(cfg, models={m: "/x"}, pool_id=f"pool-{m}")) for m in ("a", "b")]
    runs = []
    for pool in pools:
        pool._spawn_process = spawn  # type: ignore[method-assign,assignment]
        runs.append(asyncio.ensure_future(pool.run()))
    try:
        await asyncio.sleep(1.5)
        assert spawned == []  # nobody waits
        t0 = time.monotonic()
        await d.wake("b", "r")
        while not spawned and time.monotonic() - t0 < 4.0:
            await asyncio.sleep(0.05)
        assert spawned == ["b"] and time.monotonic() - t0 < 4.0  # woken, not its next tick
        assert not pools[0].managed and len(pools[1].managed) == 1
    finally:
        for pool in pools:
            pool.stop()
        await asyncio.wait_for(asyncio.gather(*runs), 30)
        await redis_.aclose()


def _on_a_skewed_host(redis_url: str, skew_s: float, call: str) -> None:
    """Await `call` (on `d`, a Demand) as a process on a host whose clock is `skew_s` off does:
    in a process of its own (its time.time() skewed), which then exits; a request it held is
    left behind, as by a gateway that dies."""
    code = f"""
import asyncio, time
real = time.time
time.time = lambda: real() + {skew_s!r}
from kvstore.client import connect
from kvstore.demand import Demand, ModelStatus
async def main():
    r = connect({redis_url!r})
    d = Demand(r)
    await {call}
    await r.aclose()
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def _hold_on_a_skewed_host(redis_url: str, request_id: str, skew_s: float, hold_s: float) -> None:
    """Hold a request for "m" in "r" as a gateway whose clock is `skew_s` off does, and die."""
    call = f'd.hold("m", "r", {request_id!r}, time.time() + {hold_s!r})'
    _on_a_skewed_host(redis_url, skew_s, call)


def test_held_requests_count_by_redis_clock_not_each_hosts(redis_server) -> None:  # type: ignore[no-untyped-def]
    """Gateways and pools on hosts whose clocks disagree: a request held by a gateway whose
    clock is 2 minutes behind the pool's counts as waiting for its whole hold (the pool dropped
    it at once: its deadline, by the gateway's clock, was past by the pool's), and a dead
    gateway's, whose clock was an hour ahead, no longer than its hold (it counted for an hour,
    keeping the model's workers up). A wait set that no pool counts any more expires with its
    last deadline (it stayed for good)."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand, wait_key

    async def waiting() -> int:  # (as a pool counts them, by its own clock, which is right)
        r = connect(redis_server.url)
        try:
            return await Demand(r).waiting("m", "r")
        finally:
            await r.aclose()

    r = redis.Redis.from_url(redis_server.url)
    try:
        _hold_on_a_skewed_host(redis_server.url, "slow-clock", -120.0, 60.0)
        _hold_on_a_skewed_host(redis_server.url, "fast-clock", 3600.0, 1.0)
        assert asyncio.run(waiting()) == 2
        assert 50_000 < r.pttl(wait_key("m", "r")) <= 60_000  # the set lasts the longest hold
        wait_until(lambda: asyncio.run(waiting()) == 1, 10, "the 1 s hold to end")
        assert r.zrange(wait_key("m", "r"), 0, -1) == [b"slow-clock"]

        # its gateway died, and no pool counts the model: the set goes with its last deadline
        r.delete(wait_key("m", "r"))
        _hold_on_a_skewed_host(redis_server.url, "abandoned", 3600.0, 1.0)
        wait_until(lambda: not r.exists(wait_key("m", "r")), 10, "the abandoned wait set to expire")
    finally:
        r.close()


async def test_a_failed_starts_retry_time_is_read_by_the_readers_clock(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A pool whose clock is an hour ahead of the gateway's fails a start and retries in 5 s:
    the gateway reads the retry 5 s ahead by its own clock (it read an hour ahead, answered
    the held requests 503 at once, and told them to come back in an hour)."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand

    failed = 'ModelStatus("failed", "pool-m", "boom", 1, time.time() + 5.0)'
    await asyncio.to_thread(
        _on_a_skewed_host, redis_server.url, 3600.0, f'd.set_status("m", "r", {failed}, 5.0)'
    )
    r = connect(redis_server.url)
    try:
        status = await Demand(r).status("m", "r")
    finally:
        await r.aclose()
    assert status is not None and status.state == "failed"
    assert 3.0 < status.retry_after() <= 5.0
    assert abs(status.updated_at - time.time()) < 2.0


@pytest.mark.parametrize("skew_s", [0.0, -120.0])
async def test_a_pool_started_after_the_wakeup_starts_a_worker_for_the_held_request(  # type: ignore[no-untyped-def]
    redis_server, skew_s: float
) -> None:
    """A pool that was not listening when a gateway held a request (it started later, or its
    subscription was down: the wake-up is lost) still starts a worker on its first tick, from
    the wait set, rather than leave the request to its hold's timeout; also when the gateway's
    clock is 2 minutes behind the pool's (the pool dropped the request as past its deadline,
    and started nothing)."""
    import asyncio

    from runtime.pool_manager import Pool

    spawned: list[str] = []

    async def spawn(argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
        spawned.append(argv[argv.index("--served-model-name") + 1])
        proc = await asyncio.create_subprocess_exec("sleep", "60", stdout=asyncio.subprocess.PIPE)
        return proc, "exec"

    await asyncio.to_thread(_hold_on_a_skewed_host, redis_server.url, "req-1", skew_s, 60.0)
    pool = Pool(_cfg(redis_url=redis_server.url, tick_s=0.2, zygote=False, pool_id="pool-m"))
    pool._spawn_process = spawn  # type: ignore[method-assign,assignment]
    run = asyncio.ensure_future(pool.run())
    try:
        t0 = time.monotonic()
        while not spawned and time.monotonic() - t0 < 5.0:
            await asyncio.sleep(0.05)
        assert spawned == ["m"]
    finally:
        pool.stop()
        async with asyncio.timeout(30):
            await run


def test_a_worker_that_dies_leaves_the_registry_at_once(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A pool's worker that exits unasked is removed from the registry when the pool notices,
    not when its entry expires: gateways stop routing to it and a replacement can start."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand
    from kvstore.registry import Registry
    from runtime.pool_manager import Pool

    async def main() -> None:
        redis_ = connect(redis_server.url)
        registry = Registry(redis_, ttl_s=60.0)
        await registry.register(_info("p-w1", region="r", updated_at=time.time()))
        pool = Pool(_cfg(redis_url=redis_server.url))
        pool.registry, pool.demand = registry, Demand(redis_)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
        await proc.wait()  # died on its own
        pool.managed["p-w1"] = Managed("p-w1", "m", 0, proc, started=0.0, ready=1.0)
        exited = await pool._reap({"p-w1"}, time.monotonic())
        assert exited == {"p-w1"} and "p-w1" not in pool.managed
        assert [w.worker_id for w in await registry.workers()] == []
        await redis_.aclose()

    asyncio.run(main())


def test_a_worker_that_crashes_soon_after_getting_ready_backs_its_model_off(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A worker that dies (code 3) seconds after it got ready, start after start (a request that
    kills it): its model's next start waits, doubling, and held requests are told why and when;
    a start that cannot even make a process is a failed start, not a tick that dies."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand
    from kvstore.registry import Registry
    from runtime.pool_manager import Pool

    async def main() -> None:
        redis_ = connect(redis_server.url)
        pool = Pool(_cfg(redis_url=redis_server.url, backoff_s=2.0))
        pool.registry, pool.demand = Registry(redis_, ttl_s=60.0), Demand(redis_)
        for crashes, delay in ((1, 2.0), (2, 4.0)):
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
            await proc.wait()
            now = time.monotonic()
            pool.managed["p-w1"] = Managed("p-w1", "m", 0, proc, started=now - 5, ready=now - 2)
            await pool._reap(set(), now)
            state = pool.states["m"]
            assert state.crashes == crashes and state.retry_at == pytest.approx(now + delay)
            status = await pool.demand.status("m", "r")
            assert status is not None and status.state == "failed" and "code 3" in status.error

        async def no_process(*args: object) -> None:
            raise OSError(24, "Too many open files")

        pool._spawn_process = no_process  # type: ignore[method-assign,assignment]
        pool.states["m"].retry_at = 0.0
        await pool.demand.hold("m", "r", "req-1", time.time() + 60)
        await pool.tick()  # (it raised out of the tick, holding the start's claim for 305 s)
        state = pool.states["m"]
        assert state.failures == 1 and not pool.managed
        status = await pool.demand.status("m", "r")
        assert status is not None and "Too many open files" in status.error
        assert await pool.demand.claim_start("m", "r", "another-pool", 5.0)  # released
        await redis_.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_workers_outlive_no_pool_that_was_killed(
    tmp_path: Path,
    stories_dir: Path,
    redis_server,
    spawn: str,  # type: ignore[no-untyped-def]
) -> None:
    """A pool killed outright (SIGKILL: no chance to stop its workers) takes them down anyway:
    each watches the pool's lifeline (runtime.lifeline), drains and exits, forked from the
    template or started fresh; none serves on as an orphan nothing would stop."""
    extra = ["--min-workers", "1", "--worker-args", WORKER_ARGS]
    pool = start_pool("pool", redis_server.url, tmp_path, f"stories={stories_dir}",
                      extra + (["--no-zygote"] if spawn == "exec" else []))  # fmt: skip
    pid = 0
    try:

        def started() -> bool:
            nonlocal pid
            found = re.search(r"start \S+ for stories \(.*\): pid (\d+) \((\w+)\)", pool.tail(200))
            if found:
                assert found.group(2) == spawn, pool.tail()
                pid = int(found.group(1))
            return bool(found) and "ready" in pool.tail(200)

        wait_until(started, 120, "the pool's first worker", pool)
        os.kill(pool.popen.pid, signal.SIGKILL)
        pool.popen.wait()
        # the worker drains (nothing in flight) and exits: gone within its drain timeout
        wait_until(lambda: not _alive(pid), 30, f"worker {pid} to exit after its pool died")
    finally:
        pool.kill()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_request_waits_out_its_pools_restart_of_a_crashed_worker(
    tmp_path: Path, stories_dir: Path, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """The pool's only worker killed (as for memory): the model's start is `failed` until the
    pool's next try, about a second later. Requests meanwhile are held for that try and
    answered, not given a 503 at once while the hold had 60 s to go."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    pool = start_pool("pool", redis_server.url, tmp_path, f"stories={model}",
                      ["--min-workers", "1", "--worker-args", WORKER_ARGS])  # fmt: skip
    gateway = start_gateway("gw", redis_server.url, tmp_path / "regions.yaml", tmp_path)
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 1, 120, "worker")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=60)  # fmt: skip
        first = client.completions.with_raw_response.create(model="stories", prompt="Hi",
                                                            max_tokens=2)  # fmt: skip
        worker_id = first.headers["x-edgeinfer-worker"]
        pid = int(re.findall(r"start \S+ for stories \(.*\): pid (\d+) \(", pool.tail(200))[-1])
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)  # (the pool notices at once; the replacement takes a second or more)
        raw = client.completions.with_raw_response.create(model="stories", prompt="Hi",
                                                          max_tokens=2)  # fmt: skip
        assert raw.parse().choices
        assert raw.headers["x-edgeinfer-worker"] != worker_id  # the replacement served it
    finally:
        gateway.stop()
        pool.stop(30)


def _alive(pid: int) -> bool:
    """Running (not exited, nor a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_full_pool_stops_an_idle_worker_for_a_model_that_waits(
    tmp_path: Path,
    stories_dir: Path,
    redis_server,  # type: ignore[no-untyped-def]
) -> None:
    """--max-workers 1 and two models: a request for the second, while the first's worker idles,
    is held while the pool stops that worker and starts one for it; then answered."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    pool = start_pool("pool", redis_server.url, tmp_path,
                      f"one={stories_dir},two={stories_dir}",
                      ["--max-workers", "1", "--idle", "300", "--worker-args", WORKER_ARGS])  # fmt: skip
    gateway = start_gateway("gw", redis_server.url, tmp_path / "regions.yaml", tmp_path, "local",
                            ["--hold-timeout", "60"])  # fmt: skip
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["pools"] == 1, 30, "the pool")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=90)  # fmt: skip
        for model in ("one", "two"):
            raw = client.completions.with_raw_response.create(
                model=model, prompt="Once upon a time", max_tokens=4
            )
            assert raw.parse().choices[0].text and raw.headers["x-edgeinfer-route"] == "cold_start"
        assert "making room for two (1 waiting)" in pool.tail(200), pool.tail()
    finally:
        gateway.stop()
        pool.stop()


def test_a_pool_nearer_than_the_serving_region_is_woken(  # type: ignore[no-untyped-def]
    tmp_path: Path, stories_dir: Path, redis_server
) -> None:
    """A gateway whose region has a pool for a model served only far away (another region's
    worker) serves the request there and wakes its own region's pool, which starts a worker:
    the next requests stay local. (The pool was never told: requests went abroad for ever.)"""
    (tmp_path / "regions.yaml").write_text(
        "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"
        "  - {name: far, latitude: 35.68, longitude: 139.69, settings: {}}\n"
    )
    far = start_worker("far", stories_dir, redis_server.url, tmp_path, region="far")
    pool = start_pool("pool", redis_server.url, tmp_path, f"stories={stories_dir}",
                      ["--max-workers", "1", "--idle", "300", "--worker-args", WORKER_ARGS])  # fmt: skip
    gateway = start_gateway("gw", redis_server.url, tmp_path / "regions.yaml", tmp_path, "local")
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["pools"] == 1, 30, "the pool")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=60)  # fmt: skip

        def ask() -> str:
            raw = client.completions.with_raw_response.create(
                model="stories", prompt="Once upon a time", max_tokens=2
            )
            assert raw.parse().choices[0].text
            return raw.headers["x-edgeinfer-route"]

        assert ask() == "remote"  # served at once, from far away
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 2, 60,
                   "a worker of the woken pool")  # fmt: skip
        assert ask() == "local"
        assert "woke the pool of region local for stories" in gateway.tail(200), gateway.tail()
    finally:
        gateway.stop()
        pool.stop()
        far.stop()


def test_a_start_claim_is_a_lease_that_lapses_with_its_pool(  # type: ignore[no-untyped-def]
    redis_server, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool's claim on a start lasts ttl_s plus what one tick may spend spawning (45 s by
    default) and is renewed each tick while its worker starts; a pool killed mid-start
    (nothing renews it) holds up the region's other pools for that long, not for the ready
    timeout (305 s: a restarted pool started nothing for five minutes and said nothing). A
    pool whose start another pool's claim stops says so, once; one that shuts down releases
    its claim."""
    import asyncio
    import logging

    import runtime.pool_manager as pm
    from kvstore.client import connect
    from kvstore.demand import Demand, start_key
    from kvstore.registry import Registry
    from runtime.pool_manager import Pool

    assert Pool(_cfg())._lease_s == 10.0 + pm.TEMPLATE_WAIT_S + pm.SPAWN_TIMEOUT_S
    monkeypatch.setattr(pm, "START_LEASE_EXTRA_S", 0.0)  # the lease: ttl_s (1 s) here

    async def never_registers(argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        return proc, "exec"

    async def main() -> None:
        redis_ = connect(redis_server.url)
        pools = []
        for name in ("pool-a", "pool-b"):
            pool = Pool(_cfg(redis_url=redis_server.url, ttl_s=1.0, heartbeat_s=0.3, min_workers=1,
                             pool_id=name))  # fmt: skip
            pool.registry, pool.demand = Registry(redis_, ttl_s=60.0), Demand(redis_)
            pool._spawn_process = never_registers  # type: ignore[method-assign,assignment]
            pools.append(pool)
        a, b = pools
        key = start_key("m", "r")
        try:
            await a.tick()  # the minimum: a starts a worker, which never registers
            assert len(a.managed) == 1 and 0 < await redis_.pttl(key) <= 1000
            with caplog.at_level(logging.INFO, logger="edgeinfer.pool"):
                for _ in range(3):
                    await asyncio.sleep(0.5)
                    await a.tick()  # renewed: it would have lapsed by the second
                    await b.tick()  # a's start is in flight: b starts none
            assert not b.managed and await redis_.get(key) in (b"pool-a", "pool-a")
            assert caplog.text.count("pool pool-a is starting a worker for it") == 1
            # a dies (its worker too, its claim left behind): b starts one once the lease lapses
            for m in a.managed.values():
                m.proc.kill()
                await m.proc.wait()
            await asyncio.sleep(1.1)
            await b.tick()
            assert len(b.managed) == 1 and await redis_.get(key) in (b"pool-b", "pool-b")
            await b.shutdown(timeout_s=0.5)
            assert await redis_.get(key) is None  # released, not left to its lease
        finally:
            for pool in pools:
                for m in pool.managed.values():
                    if m.proc.returncode is None:
                        m.proc.kill()
                        await m.proc.wait()
            await redis_.aclose()

    asyncio.run(main())


def test_a_pool_stops_its_workers_at_once_while_redis_hangs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis hangs (SIGSTOP: only timeouts) and the pool is asked to stop: its tick in flight
    is dropped, every worker is signalled at once and the events recorded after (a tick took
    ~15 s of timeouts, then each worker ~3 s of retries before the next was signalled), and
    each stop's time is its own, not the last worker's."""
    import asyncio
    import logging

    from runtime.pool_manager import Pool

    server = LocalRedis().start()
    # a "worker": exits 0.2 s after SIGTERM, as a drained worker does
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.2), sys.exit(0)))\n"
              "time.sleep(60)\n")  # fmt: skip

    async def main() -> tuple[float, float]:
        pool = Pool(_cfg(redis_url=server.url, zygote=False, models={"m": "/x"}))
        running = asyncio.ensure_future(pool.run())
        await asyncio.sleep(1.0)  # its first ticks, against a live Redis
        for i in range(3):
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
            pool.managed[f"p-w{i}"] = Managed(f"p-w{i}", "m", 0, proc, started=0.0, ready=1.0)
        await asyncio.sleep(0.5)  # (the scripts' handlers in place)
        server._proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(1.0)  # a tick now waits on Redis
        t0 = time.monotonic()
        pool.stop()
        procs = [m.proc for m in pool.managed.values()]
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=30)
        workers_done = time.monotonic() - t0
        server._proc.send_signal(signal.SIGCONT)  # (the run's last Redis calls answer now)
        await asyncio.wait_for(running, 60)
        return workers_done, time.monotonic() - t0

    try:
        with caplog.at_level(logging.INFO, logger="edgeinfer.pool"):
            workers_done, _ = asyncio.run(main())
        assert workers_done < 3.0, workers_done
        stops = [float(s) for s in re.findall(r"stopped p-w\d in ([\d.]+)s", caplog.text)]
        assert len(stops) == 3 and max(stops) < 2.0, caplog.text
    finally:
        with contextlib.suppress(Exception):
            server._proc.send_signal(signal.SIGCONT)
        server.stop()


def test_a_held_request_is_counted_again_after_redis_lost_its_data(
    tmp_path: Path, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """Redis restarted without its data while a gateway held a request for a pool's model: the
    request's entry in the wait set, the pool's only sign of it, comes back within the
    gateway's renewal (it was gone for good, and the request waited out its whole hold for a
    worker no pool started)."""
    import asyncio

    from gateway.proxy import REHOLD_S
    from kvstore.client import connect
    from kvstore.demand import Demand, PoolInfo

    async def call(fn):  # type: ignore[no-untyped-def]
        r = connect(redis_server.url)
        try:
            return await fn(Demand(r))
        finally:
            await r.aclose()

    def announce() -> None:  # a pool offering "stories" here (its heartbeat)
        info = PoolInfo("p1", "local", ["stories"], updated_at=time.time())
        asyncio.run(call(lambda d: d.announce(info, 60)))

    def waiting() -> int:
        return int(asyncio.run(call(lambda d: d.waiting("stories", "local"))))

    (tmp_path / "regions.yaml").write_text(CATALOG)
    announce()
    gateway = start_gateway("gw", redis_server.url, tmp_path / "regions.yaml", tmp_path, "local",
                            ["--hold-timeout", "30"])  # fmt: skip
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["pools"] == 1, 30, "the pool")
        with ThreadPoolExecutor(1) as ex:
            held = ex.submit(client.completions.create, model="stories", prompt="Hi", max_tokens=2)
            wait_until(lambda: waiting() == 1, 10, "the request to be held")
            r = redis.Redis.from_url(redis_server.url)
            try:
                r.flushall()  # (a restart without persistence)
            finally:
                r.close()
            announce()
            assert waiting() == 0
            t0 = time.monotonic()
            wait_until(lambda: waiting() == 1, REHOLD_S + 5, "the held request to count again")
            assert time.monotonic() - t0 <= REHOLD_S + 5
            gateway.kill()  # (the request ends with the gateway)
            with pytest.raises(openai.APIError):
                held.result(60)
    finally:
        gateway.stop()


def test_a_hold_beside_an_endless_one_of_an_older_gateway(redis_server) -> None:  # type: ignore[no-untyped-def]
    """An endless hold (score +inf) that a gateway older than the Redis-clock scripts wrote
    (`--hold-timeout inf`, a plain ZADD) does not fail the holds of newer gateways for the
    model (PEXPIRE refused the infinite TTL: every hold failed, each request a 503 at once);
    the set then keeps the longest TTL a number can say."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand, wait_key

    async def run() -> None:
        r = connect(redis_server.url)
        try:
            d = Demand(r)
            await r.zadd(wait_key("m", "r"), {"old-gateway": float("inf")})
            await d.hold("m", "r", "new-gateway/0", time.time() + 30, wake=False)
            assert await d.waiting("m", "r") == 2
            assert await r.pttl(wait_key("m", "r")) > 10**14
        finally:
            await r.aclose()

    asyncio.run(run())


def test_min_residency_is_a_flag_of_the_pool_command() -> None:
    from runtime.cli import build_parser

    args = build_parser().parse_args(["pool", "--min-residency", "12.5"])
    assert args.min_residency == 12.5
    assert build_parser().parse_args(["pool"]).min_residency == 5.0  # (PoolConfig's default)
