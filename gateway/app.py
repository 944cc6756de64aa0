"""The gateway's aiohttp app factory: OpenAI API, health, readiness, OpenAPI spec.

    edgeinfer gateway --region R --port 8080 --redis URL

Redis client, the HTTP session to workers, the registry refresh task and telemetry open and
close in `cleanup_ctx`. `/metrics` serves the Prometheus text of the gateway's metrics (no API
key needed: scrape it from inside the region); with `--metrics-port` it is served there, on a
listener of its own (`metrics_app`), and not on the main port, which may be public. Every
error, whichever phase raised it, leaves through `_errors` as an OpenAI error object with a
4xx/5xx status; a request never gets an HTML page or a hang. A request aiohttp cannot parse (a
request line or header over MAX_HEADER_BYTES, more than MAX_HEADERS headers, a control byte in a
header, chunked framing that does not parse) never reaches a handler: `make_runner`'s
connections answer it as an OpenAI error too (431 or 400, `errors.unparsable`); framing that
breaks while a handler reads the body fails that read (a 400, runtime/serving.py). Each is
logged as one WARNING line, as is a body that stops decoding after the app refused it
(`_ClientFaults`). `Expect: 100-continue` is answered once auth and the declared size passed.

`_errors`, the outermost middleware, also gives each request its id (beginning with the client's
own x-request-id, where it sent a usable one): the proxy sends it to the worker and puts it on
its spans and log lines, and every response carries it as x-request-id
(`_stamp`), an error's too, with the success path's worker headers once a worker was chosen.
With `--cors-origins`, browsers' preflights are answered ahead of auth (gateway/cors.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.cluster import ClusterView
from gateway.config import GatewayConfig
from gateway.cors import Cors, origin_guard
from gateway.errors import (
    APIError,
    from_exception,
    invalid,
    model_not_found,
    unauthorized,
    unparsable,
)
from gateway.openai_api import parse_chat, parse_completion
from gateway.openapi import OPENAPI
from gateway.proxy import CALLS, REQUEST_ID, Proxy, routed_headers
from gateway.regions import RegionCatalog
from gateway.telemetry import GatewayTelemetry
from kvstore.client import connect, stop_task
from kvstore.telemetry import (
    PROMETHEUS_CONTENT_TYPE,
    Telemetry,
    TelemetryConfig,
    sample_key_of,
)
from runtime.lifeline import watch_lifeline
from runtime.serving import MAX_HEADER_BYTES, MAX_HEADERS, AppRunner, listen

log = logging.getLogger("edgeinfer.gateway")

CONFIG = web.AppKey("config", GatewayConfig)
CATALOG = web.AppKey("catalog", RegionCatalog)
VIEW = web.AppKey("view", ClusterView)
PROXY = web.AppKey("proxy", Proxy)
TELEMETRY = web.AppKey("telemetry", GatewayTelemetry)


class _ClientFaults(logging.Filter):
    """aiohttp logs a request it could not parse, and the undecodable rest of a body the app
    already answered (it reads the rest before reusing the connection), as ERRORs with a
    traceback: any client could fill the log with them. Each becomes one WARNING line."""

    FAULTS = (aiohttp.http_exceptions.BadHttpMessage, web.RequestPayloadError)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno > logging.WARNING and isinstance(exc, self.FAULTS):
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


_CLIENT_FAULTS = _ClientFaults()


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers
    )


# a client's own x-request-id that the gateway's id may begin with (letters, digits, . _ : -)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _request_id(request: web.Request) -> str:
    """The request's id: a new one, or, when the client sent an x-request-id of up to 64
    letters, digits and . _ : -, that one with a new suffix (its logs, spans and the worker's
    lines then carry the client's id; the suffix keeps two clients' equal ids apart, as the
    worker needs them unique). Anything else the client sent is not used."""
    own = uuid.uuid4().hex
    given = request.headers.get("x-request-id")
    if given and _CLIENT_ID.fullmatch(given):
        return f"{given}-{own[:12]}"
    return own


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    request[REQUEST_ID] = _request_id(request)
    try:
        return await handler(request)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        err = _as_api_error(request, e)
        request.app[TELEMETRY].error(err)
        headers = err.headers() | routed_headers(request.get(CALLS, []))
        if isinstance(e, web.HTTPMethodNotAllowed):  # (a 405 must say what is allowed)
            headers["Allow"] = ", ".join(sorted(e.allowed_methods))
        return _json(err.body(), err.status, headers)


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names its request (on_response_prepare: streamed ones too)."""
    if REQUEST_ID in request:
        response.headers["x-request-id"] = request[REQUEST_ID]


def _as_api_error(request: web.Request, e: Exception) -> APIError:
    err = from_exception(e, request.method, request.path, request.app[CONFIG].max_body_bytes)
    if not isinstance(e, (APIError, web.HTTPException)):
        log.exception("unhandled error on %s %s (request %s)", request.method, request.path,
                      request.get(REQUEST_ID), exc_info=e)  # fmt: skip
    return err


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    keys = request.app[CONFIG].api_keys
    if keys and request.path.startswith("/v1/"):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # (bytes that are not UTF-8 arrive as surrogates: compared as the bytes sent)
        given = token.strip().encode(errors="surrogateescape")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(given, k.encode(errors="surrogateescape")) for k in keys
        ):
            raise unauthorized()
    return await handler(request)


async def _expect_later(request: web.Request) -> None:
    """aiohttp answers `Expect` ahead of the middlewares: 100 Continue to a client whose API key
    or declared body size were then refused (it had been told to send the body), and a
    text/plain 417 to any other expectation. The proxy answers it instead, as it reads the
    body (`proxy._read_json`)."""


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request, parse_chat, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request, parse_completion, "completion")


class ModelClock:
    """The `created` of /v1/models' entries: when this gateway has seen each model first
    served, in whole Unix seconds. The earliest start (`WorkerInfo.started_at`, the worker's
    clock) among the model's workers it has listed; for a model that only a pool can start, the
    time it first listed it. Kept once given: a model's `created` does not move when its oldest
    worker leaves (it only goes back, when a worker started earlier shows up, after a Redis
    outage say)."""

    def __init__(self) -> None:
        self._first: dict[str, float] = {}  # model -> Unix time it was first served, as seen

    def created(self, view: ClusterView) -> dict[str, int]:
        """Each model served now or startable by a pool (`view.models()`), with its `created`."""
        now = time.time()
        started: dict[str, float] = {}
        for w in view.live_workers():
            if w.started_at > 0:  # (0: an entry that does not say)
                started[w.model] = min(w.started_at, started.get(w.model, now))
        out: dict[str, int] = {}
        for m in view.models():
            self._first[m] = first = min(self._first.get(m, now), started.get(m, now))
            out[m] = int(first)
        return out


MODEL_CLOCK = web.AppKey("model_clock", ModelClock)


def _model_object(model: str, created: int) -> dict[str, object]:
    return {"id": model, "object": "model", "created": created, "owned_by": "edgeinfer"}


async def models(request: web.Request) -> web.Response:
    created = request.app[MODEL_CLOCK].created(request.app[VIEW])
    return _json({"object": "list", "data": [_model_object(m, t) for m, t in created.items()]})


async def model(request: web.Request) -> web.Response:
    """One model (`client.models.retrieve`): served now, or startable by a pool; else 404."""
    name = request.match_info["model"]
    created = request.app[MODEL_CLOCK].created(request.app[VIEW])
    if name not in created:
        raise model_not_found(name)
    return _json(_model_object(name, created[name]))


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready: Redis takes a write of this gateway's (a ping passed a Redis that answers but
    refuses writes: out of memory, a replica, an ACL; sessions cannot be placed there), and a
    worker is known (live, or carried through a restart of Redis) or a pool that can start one.
    `?redis=optional`: ready whenever this gateway can serve, Redis or not: it routes on the
    registry it still reads while Redis refuses its writes, and on its last snapshot while Redis
    is down, and a readiness probe that asked for Redis would take every gateway out of service
    meanwhile. Nor does it wait on Redis (one that hangs would outlast the probe's timeout, 1 s
    in Kubernetes): `redis` then says whether the gateway's last Redis calls succeeded, writes
    included. `redis_error` says what is wrong when `redis` is false: unreachable or refused,
    and the error's type (not Redis's message: a connection error's names Redis's address)."""
    redis = request.query.get("redis", "required")
    if redis not in ("required", "optional"):
        raise invalid("redis", f"redis must be 'required' or 'optional', got {redis[:40]!r}")
    view = request.app[VIEW]
    if redis == "optional":
        redis_ok = view.redis_ok and view.refusal is None
    else:
        redis_ok = await view.ping()  # (bounded: cluster.PROBE_TIMEOUT_S)
    workers = len(view.live_workers())
    pools = len(view.pools)  # a pool can start workers on demand (scale from zero)
    ready = (redis_ok or redis == "optional") and (workers > 0 or pools > 0)
    body = {"ready": ready, "redis": redis_ok, "redis_error": None if redis_ok else view.redis_problem,
            "workers": workers, "pools": pools, "region": view.config.region}  # fmt: skip
    return _json(body, 200 if ready else 503)


async def openapi(request: web.Request) -> web.Response:
    return _json(OPENAPI)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[TELEMETRY].tel.prometheus()
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


async def _resources(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    tel = app[TELEMETRY]
    redis = connect(config.redis_url)
    view = ClusterView(config, redis, app[CATALOG])
    view.on_redis = tel.redis
    tel.watch_workers(view)
    await view.refresh()
    http = aiohttp.ClientSession(
        # (shorter than a worker keeps an idle connection: runtime/worker.py IDLE_CONNECTION_S)
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        json_serialize=lambda o: orjson.dumps(o).decode(),
    )
    app[VIEW] = view
    app[PROXY] = Proxy(view, http, tel)
    refresher = asyncio.create_task(view.refresh_loop())
    try:
        yield
    finally:
        await stop_task(refresher)
        await app[PROXY].close()
        await view.tokenizers.aclose()
        await http.close()
        await redis.aclose()
        # flushes spans still buffered (the exporters bound the wait) off the event loop
        await asyncio.get_running_loop().run_in_executor(None, tel.tel.shutdown)


async def _shutting_down(app: web.Application) -> None:
    """on_shutdown: the listener is closed. Requests held for a worker to start (scale from
    zero) are answered 503 at once; those at a worker get `--drain-timeout` to finish, then end
    with a 503 or a stream's closing error event (`Proxy.shut_down`), before aiohttp's own
    shutdown timeout would cancel them unanswered."""
    proxy = app.get(PROXY)
    if proxy is not None:
        proxy.shut_down()


def make_app(
    config: GatewayConfig, catalog: RegionCatalog | None = None, telemetry: Telemetry | None = None
) -> web.Application:
    """`telemetry`: where traces and metrics go (tests pass one with in-memory exporters);
    default: as `config.telemetry` says. Run it with auto_decompress=False, as `serve` does:
    the app decodes compressed request bodies itself."""
    catalog = catalog or RegionCatalog.load(config.catalog_path)
    if config.region not in catalog:
        raise ValueError(
            f"region {config.region!r} is not in the catalog {config.catalog_path} "
            f"(known: {', '.join(sorted(catalog.regions))})"
        )
    cors = Cors(config.cors_origins) if config.cors_origins else None
    guard = origin_guard(cors)
    middlewares = [_errors, guard, _auth] if cors is None else [_errors, cors.preflight, guard,
                                                                _auth]  # fmt: skip
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app.on_response_prepare.append(_stamp)
    if cors is not None:
        app.on_response_prepare.append(cors.stamp)
    logging.getLogger("aiohttp.server").addFilter(_CLIENT_FAULTS)  # (once: the same filter)
    app[CONFIG] = config
    app[CATALOG] = catalog
    app[MODEL_CLOCK] = ModelClock()
    if telemetry is None:
        tel_config = config.telemetry or TelemetryConfig(
            "edgeinfer-gateway", region=config.region, trust_remote_sampled=False
        )
        if not tel_config.sample_key:  # every gateway of the cluster keeps the same client traces
            key = sample_key_of(config.worker_secret)
            tel_config = dataclasses.replace(tel_config, sample_key=key)
        telemetry = Telemetry(tel_config)
    app[TELEMETRY] = GatewayTelemetry(telemetry, config.region)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=_expect_later)
    app.router.add_post("/v1/completions", completions, expect_handler=_expect_later)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # (ids may hold a "/": org/name)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    if not config.metrics_port:  # (else on its own listener: `metrics_app`)
        app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_resources)
    app.on_shutdown.append(_shutting_down)
    return app


def metrics_app(app: web.Application) -> web.Application:
    """`/metrics` of `app`, the gateway, alone: what `--metrics-port` serves (anything else
    there is a 404)."""
    scrape = web.Application()
    scrape[TELEMETRY] = app[TELEMETRY]
    scrape.router.add_get("/metrics", metrics)
    return scrape


def _refusal(status: int, exc: BaseException | None) -> web.Response:
    err = unparsable(status, exc, MAX_HEADER_BYTES, MAX_HEADERS)
    return _json(err.body(), err.status, err.headers())


DRAIN_MARGIN_S = 5.0  # aiohttp's own shutdown wait beyond the drain: the cut requests' answers


def make_runner(app: web.Application, config: GatewayConfig) -> web.AppRunner:
    """The runner `serve` runs `app` (make_app's) with."""
    # keepalive_timeout: aiohttp closes a connection whose handler still waits for a request
    # when it runs out, counted from the connection's start or its last response; bytes of an
    # unfinished request do not reset it, so it bounds slow headers too. lingering_time: after
    # an answer given before its body was read (408, 413), what is left of the body is read and
    # dropped for this long before the connection closes (aiohttp's 10 s let a client that
    # stopped sending hold it 10 s past its 408)
    # auto_decompress: off, the app decodes request bodies itself (proxy._decompressed)
    # shutdown_timeout: past the proxy's drain (Proxy.shut_down), whose cut answers then go out
    return AppRunner(app, _refusal, handler_cancellation=True, access_log=None,
                     shutdown_timeout=config.drain_timeout_s + DRAIN_MARGIN_S,
                     keepalive_timeout=config.idle_timeout_s,
                     lingering_time=1.0, auto_decompress=False, max_line_size=MAX_HEADER_BYTES,
                     max_field_size=MAX_HEADER_BYTES, max_headers=MAX_HEADERS)  # fmt: skip


async def serve(config: GatewayConfig) -> None:
    """Run the gateway until SIGTERM/SIGINT."""
    app = make_app(config)
    runner = make_runner(app, config)
    await runner.setup()
    scrape: web.AppRunner | None = None
    try:  # whatever ends this (a port taken included), the app's cleanup stops its tasks
        if config.metrics_port:
            scrape = web.AppRunner(metrics_app(app), access_log=None, shutdown_timeout=1.0,
                                   keepalive_timeout=config.idle_timeout_s)  # fmt: skip
            await scrape.setup()
            await listen(scrape, config.host, config.metrics_port, "gateway's /metrics")
        await _serve(config, app, runner)
    finally:
        if scrape is not None:
            await scrape.cleanup()
        await runner.cleanup()


async def _serve(config: GatewayConfig, app: web.Application, runner: web.AppRunner) -> None:
    """Listen, say so, and wait for SIGTERM/SIGINT (or `up` gone)."""
    import signal

    await listen(runner, config.host, config.port, "gateway")
    if not config.api_keys:
        log.warning("no API keys configured: the gateway is open to anyone who can reach it")
    view = app[VIEW]
    metrics_at = f", /metrics on port {config.metrics_port}" if config.metrics_port else ""
    print(
        f"gateway ready: http://{config.host}:{config.port} region {config.region}, "
        f"{len(view.live_workers())} workers, redis {'ok' if view.redis_ok else 'UNREACHABLE'}"
        f"{metrics_at} ({time.strftime('%H:%M:%S')})",
        flush=True,
    )
    # What start-up made (~60,000 objects: aiohttp, redis, OpenTelemetry, the app) lives as
    # long as the process: out of the collector's sight, a full collection scans only what
    # requests made since. Unfrozen, each full collection took 13-21 ms under load, every few
    # seconds, stalling every stream in flight (bench/gateway.py's p99).
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def parent_gone() -> None:
        log.warning("`edgeinfer up`, which started this gateway, is gone: stopping")
        stop.set()

    watch_lifeline(loop, parent_gone)
    await stop.wait()
