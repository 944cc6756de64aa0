"""The gateway's answers as a client written against OpenAI reads them: error `type`s as
OpenAI's (`invalid_request_error` for a 4xx, `server_error` for a 5xx and an overloaded 429),
whatever a worker called them, and /v1/models' `created` as the time the model was first served.
Real Redis, the gateway app in this event loop, the real `openai` client; no worker process (the
registry entries are written as a worker writes them)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from aiohttp import web

from gateway import errors
from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.proxy import _redis_fault
from kvstore.client import connect
from kvstore.demand import Demand, PoolInfo
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import find_free_port
from kvstore.registry import Registry

CATALOG = "regions:\n  - {name: local, latitude: 50.1, longitude: 8.7, settings: {}}\n"
KEY = "sk-test"


# ---- types, as OpenAI's ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("err", "status", "type_", "code"),
    [
        (errors.unauthorized(), 401, "invalid_request_error", "invalid_api_key"),
        (errors.model_not_found("x"), 404, "invalid_request_error", "model_not_found"),
        (errors.from_exception(web.HTTPNotFound(), "GET", "/v1/x", 1), 404,
         "invalid_request_error", None),
        (errors.at_capacity(1.0), 429, "server_error", "at_capacity"),
        (errors.internal("boom"), 500, "server_error", "internal_error"),
        (errors.from_exception(RuntimeError("bug"), "GET", "/", 1), 500, "server_error",
         "internal_error"),
        (errors.from_exception(web.HTTPServiceUnavailable(), "GET", "/", 1), 503,
         "server_error", None),
        (errors.bad_gateway("garbage"), 502, "server_error", "bad_worker_response"),
        (errors.unavailable("down", 1, "no_workers"), 503, "server_error", "no_workers"),
        (errors.unparsable(504, None, 1, 1), 504, "server_error", "timeout"),
    ],
)  # fmt: skip
def test_error_types_are_openais(err: APIError, status: int, type_: str, code: str | None) -> None:
    """OpenAI answers an unknown model 404 invalid_request_error (code model_not_found, no
    param), a wrong key 401 invalid_request_error (invalid_api_key), its failures and its
    'overloaded' 429 server_error; the gateway said not_found_error (param "model"),
    authentication_error, internal_error, service_unavailable, rate_limit_error. Our codes stay."""
    assert (err.status, err.type, err.param, err.code) == (status, type_, None, code)
    assert err.type == errors.type_for(status)


@pytest.mark.parametrize(
    ("status", "worker_type", "type_"),
    [
        (400, "invalid_request_error", "invalid_request_error"),
        (404, "not_found_error", "invalid_request_error"),
        (429, "rate_limit_error", "server_error"),
        (500, "internal_error", "server_error"),
        (503, "service_unavailable", "server_error"),
    ],
)
def test_a_workers_error_is_relayed_in_the_gateways_types(
    status: int, worker_type: str, type_: str
) -> None:
    """A worker's refusal keeps its message, param and code; its type is the gateway's for the
    status (the worker's own names were relayed as they were)."""
    body = {"error": {"message": "m", "type": worker_type, "param": "p", "code": "c"}}
    err = APIError.from_body(status, body)
    got = (err.status, err.message, err.type, err.param, err.code)
    assert got == (status, "m", type_, "p", "c")


@pytest.mark.parametrize(
    ("problem", "expected"),
    [
        ("refused: OutOfMemoryError", ("refused", "OutOfMemoryError")),
        ("failed: CLUSTERDOWN", ("failed", "CLUSTERDOWN")),
        ("unreachable: ConnectionError", ("unreachable", "ConnectionError")),
        (None, ("unreachable", "")),
    ],
)
def test_the_redis_problem_is_parsed_in_one_place(
    problem: str | None, expected: tuple[str, str]
) -> None:
    """`redis_problem` was split by hand in two places of the proxy (the 503s of an unread
    registry and of a pool that cannot be asked); one helper now reads it for both."""
    assert _redis_fault(problem) == expected


# ---- the gateway, as the openai client sees it ---------------------------------------------


def _worker(model: str, started_at: float) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"w-{uuid.uuid4().hex[:8]}", region="local", model=model, role="mixed",
        url="http://127.0.0.1:9", max_num_seqs=4, capacity_tokens=1024, started_at=started_at,
        updated_at=time.time(), heartbeat_s=1.0,
    )  # fmt: skip


@pytest.fixture
async def gateway(redis_server, tmp_path: Path) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
    """A gateway on the session's Redis (it needs a key), its base URL."""
    catalog = tmp_path / "regions.yaml"
    catalog.write_text(CATALOG)
    config = GatewayConfig(region="local", redis_url=redis_server.url, worker_secret="s",
                           catalog_path=catalog, registry_refresh_s=0.05,
                           api_keys=frozenset({KEY}))  # fmt: skip
    runner = web.AppRunner(make_app(config), access_log=None)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def _until_listed(client: openai.AsyncOpenAI, names: set[str]) -> dict[str, int]:
    for _ in range(100):
        listed = {m.id: m.created for m in (await client.models.list()).data}
        if names <= listed.keys():
            return listed
        await asyncio.sleep(0.05)
    raise AssertionError(f"the gateway never listed {names}")


async def test_models_say_when_they_were_first_served(redis_server, gateway: str) -> None:  # type: ignore[no-untyped-def]
    """`created` was 0 for every model: it is the earliest start among the model's workers
    (kept when that worker leaves), or, for one only a pool can start, when this gateway first
    listed it."""
    served, pooled = f"served-{uuid.uuid4().hex[:8]}", f"pooled-{uuid.uuid4().hex[:8]}"
    now = time.time()
    old, new = _worker(served, now - 3600.5), _worker(served, now - 60)
    redis = connect(redis_server.url)
    client = openai.AsyncOpenAI(base_url=gateway, api_key=KEY, max_retries=0)
    try:
        registry = Registry(redis)
        await registry.register(new)
        await registry.register(old)
        before = int(time.time())
        await Demand(redis).announce(PoolInfo(f"pool-{pooled}", "local", [pooled]), 30)
        listed = await _until_listed(client, {served, pooled})
        after = int(time.time())
        assert listed[served] == int(now - 3600.5), listed  # the old code: 0
        assert before <= listed[pooled] <= after, (before, listed, after)
        assert (await client.models.retrieve(served)).created == listed[served]
        await registry.deregister(old.worker_id, served)  # the oldest worker leaves
        await asyncio.sleep(0.3)  # (several registry refreshes)
        assert (await client.models.retrieve(served)).created == listed[served]
        assert (await client.models.retrieve(pooled)).created == listed[pooled]
    finally:
        await client.close()
        await Registry(redis).deregister(new.worker_id, served)
        await Demand(redis).withdraw(f"pool-{pooled}")
        await redis.aclose()


async def test_the_openai_client_reads_openais_error_types(gateway: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway, api_key=KEY, max_retries=0)
    wrong = openai.AsyncOpenAI(base_url=gateway, api_key="sk-wrong", max_retries=0)
    try:
        unknown = ("invalid_request_error", "model_not_found", None)
        with pytest.raises(openai.NotFoundError) as nf:
            await client.models.retrieve(f"nope-{uuid.uuid4().hex[:8]}")
        # the old code: not_found_error, param "model"
        assert (nf.value.type, nf.value.code, nf.value.param) == unknown
        with pytest.raises(openai.NotFoundError) as nf:
            await client.completions.create(model=f"nope-{uuid.uuid4().hex[:8]}", prompt="x")
        assert (nf.value.type, nf.value.code, nf.value.param) == unknown
        with pytest.raises(openai.AuthenticationError) as auth:
            await wrong.models.list()
        assert (auth.value.type, auth.value.code) == ("invalid_request_error", "invalid_api_key")
    finally:
        await client.close()
        await wrong.close()
