"""A request held by the gateway while a pool starts a worker (scale from zero), under faults:
the gateway shutting down, the pool going away. Real Redis, a real `edgeinfer pool` and gateway,
the official `openai` client."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.stack import Proc, get_json, start_gateway, start_pool, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"
WORKER_ARGS = "--threads 1 --kv-cache-bytes 4000000 --heartbeat 0.3 --ttl 1.5 --drain-timeout 5"
HOLD_TIMEOUT_S = 30  # the gateway's --hold-timeout: what the old code made the request wait
POOL_GONE_GRACE_S = 3  # the gateway's --pool-gone-grace (30 s by default)


def _stack(
    tmp_path: Path, stories_dir: Path, redis_url: str, pool_args: list[str]
) -> tuple[Proc, Proc]:
    (tmp_path / "regions.yaml").write_text(CATALOG)
    pool = start_pool("pool", redis_url, tmp_path, f"stories={stories_dir}",
                      ["--worker-args", WORKER_ARGS, *pool_args])  # fmt: skip
    try:
        gateway = start_gateway("gw", redis_url, tmp_path / "regions.yaml", tmp_path, "local",
                                ["--hold-timeout", str(HOLD_TIMEOUT_S),
                                 "--pool-gone-grace", str(POOL_GONE_GRACE_S)])  # fmt: skip
    except BaseException:
        pool.kill()
        raise
    return pool, gateway


def _held(gateway: Proc, pool: ThreadPoolExecutor) -> Future[openai.APIStatusError]:
    """A completion sent through `gateway`, once it is held (logged) waiting for a worker; the
    future is the error it was answered with."""

    def ask() -> openai.APIStatusError:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=20)  # fmt: skip
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="stories", prompt="Once upon a time", max_tokens=2)
        return e.value

    answer = pool.submit(ask)
    wait_until(lambda: "waits for a stories worker in local" in gateway.tail(200), 10,
               "the request to be held", gateway)  # fmt: skip
    return answer


def _retry_after(e: openai.APIStatusError) -> float:
    return float(e.response.headers["retry-after"])


def test_a_gateway_shutting_down_answers_its_held_requests_503_at_once(  # type: ignore[no-untyped-def]
    tmp_path: Path, stories_dir: Path, redis
) -> None:
    """SIGTERM to a gateway holding a request (its pool stopped: no worker comes): the request,
    which never reached a worker, is answered 503 with Retry-After at once, an OpenAI error
    saying the gateway shuts down (a client or load balancer retries it on another gateway),
    and the shutdown is logged with the count. Before: aiohttp's shutdown timeout cancelled
    the handler ~10 s later, and the client got an empty reply; the log said nothing."""
    pool, gateway = _stack(tmp_path, stories_dir, redis.url, [])
    stopped = False
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["pools"] == 1, 30, "the pool")
        os.kill(pool.popen.pid, signal.SIGSTOP)  # it never sees the request: no worker starts
        stopped = True
        with ThreadPoolExecutor(1) as threads:
            answer = _held(gateway, threads)
            time.sleep(0.3)
            t0 = time.monotonic()
            gateway.signal(signal.SIGTERM)
            e = answer.result(timeout=25)
            took = time.monotonic() - t0
        assert e.status_code == 503, e
        assert took < 3.0, took  # (aiohttp's shutdown timeout, 5 s, was waited out twice)
        assert _retry_after(e) > 0
        body = e.response.json()["error"]
        assert body["code"] == "gateway_shutting_down", body
        assert body["type"] == "server_error" and "shutting down" in body["message"], body
        assert gateway.popen.wait(15) == 0, gateway.tail()
        assert "shutting down: 1 request(s) waiting for a worker" in gateway.tail(), gateway.tail()
    finally:
        if stopped:
            os.kill(pool.popen.pid, signal.SIGCONT)
        gateway.stop()
        pool.stop(30)


def test_a_held_request_is_answered_once_its_pool_has_gone(  # type: ignore[no-untyped-def]
    tmp_path: Path, stories_dir: Path, redis
) -> None:
    """The pool that was to start the held request's worker stops (SIGTERM: it stops the worker
    it was starting and withdraws): the request is answered 503 pool_unavailable, naming the
    pool's region, a few seconds later (--pool-gone-grace), not after the whole hold (30 s
    here) with "it is still starting" (worker_starting)."""
    # (a worker started fresh, not forked from a template, takes seconds to register: the pool
    # is stopped long before it could serve the request)
    pool, gateway = _stack(tmp_path, stories_dir, redis.url, ["--no-zygote"])
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["pools"] == 1, 30, "the pool")
        with ThreadPoolExecutor(1) as threads:
            answer = _held(gateway, threads)
            t0 = time.monotonic()
            pool.signal(signal.SIGTERM)
            e = answer.result(timeout=25)
            took = time.monotonic() - t0
        assert pool.popen.wait(15) == 0, pool.tail()
        assert e.status_code == 503, e
        assert took < HOLD_TIMEOUT_S / 3, took
        assert _retry_after(e) > 0
        body = e.response.json()["error"]
        assert body["code"] == "pool_unavailable", body
        assert "no pool in region local offers it any more" in body["message"], body
        assert get_json(f"{gateway.url}/readyz")[1]["pools"] == 0
    finally:
        gateway.stop()
        pool.stop(30)
