"""A bare aiohttp pass-through proxy, the floor under the gateway's hop for `bench.gateway
--bare-proxy`: `POST /internal/generate` is forwarded to the worker as it is and the worker's
stream copied back as it arrives, with nothing else (no parsing, routing, Redis, telemetry or
OpenAI translation). What the gateway adds beyond it is its own work.

    python -m bench.bare_proxy PORT WORKER_URL
"""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def _forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"x-edgeinfer-secret": request.headers.get("x-edgeinfer-secret", "")}
    upstream = request.app[UPSTREAM]
    async with request.app[SESSION].post(f"{upstream}/internal/generate", data=body,
                                         headers=headers) as up:  # fmt: skip
        resp = web.StreamResponse(status=up.status,
                                  headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def _app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/internal/generate", _forward)
    return app


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2]
    try:  # the gateway's event loop, where it has it
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(_app(upstream), host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
