"""CORS, so that pages in a browser can call the gateway: off unless `--cors-origins` lists the
origins they may come from ("*": any).

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered by `preflight`,
a middleware ahead of auth (a browser sends no credentials on one): 204 with the methods, the
headers it asked to send (the openai client sends x-stainless-* ones besides Authorization) and
how long it may reuse that answer; from an origin not listed, 403. Every other response to a
listed origin, errors included (a page must be able to read them), says so and exposes the
gateway's own headers (`stamp`, on every response prepared). A browser's POST from an origin not
listed (any, without --cors-origins) is refused before any work (`origin_guard`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.errors import origin_not_allowed

ALLOW_METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = 7200  # how long a browser may reuse a preflight's answer (Chromium's own cap)
EXPOSED = ", ".join(
    ("x-request-id", "x-edgeinfer-worker", "x-edgeinfer-region", "x-edgeinfer-route",
     "x-edgeinfer-prefill-worker", "Retry-After", "Server-Timing")
)  # fmt: skip


def origin_guard(cors: Cors | None) -> Any:
    """A middleware ahead of auth: a POST (any method but GET, HEAD, OPTIONS) that carries an
    Origin the gateway does not allow (none without --cors-origins) is refused, 403, before any
    work. A browser sends a "simple" cross-origin POST (text/plain, a form) with no preflight:
    CORS only hides the answer from the page, so any web page a visitor opened could make a
    gateway without API keys (one on localhost, or inside a network) generate for it, blind.
    Clients that are not browsers send no Origin, and a page of a listed origin is let through
    as before."""

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        browser_write = origin is not None and request.method not in ("GET", "HEAD", "OPTIONS")
        if browser_write and (cors is None or cors.allowed(origin) is None):
            raise origin_not_allowed(origin or "")
        return await handler(request)

    return guard


class Cors:
    def __init__(self, origins: frozenset[str]) -> None:
        self.origins = origins  # scheme://host[:port] as browsers send Origin; "*": any

    def allowed(self, origin: str | None) -> str | None:
        """Access-Control-Allow-Origin for a request from `origin`; None when not allowed."""
        if origin is None:
            return None
        if "*" in self.origins:
            return "*"
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return await handler(request)
        if self.allowed(origin) is None:
            raise origin_not_allowed(origin)
        headers = {"Access-Control-Allow-Methods": ALLOW_METHODS,
                   "Access-Control-Max-Age": str(MAX_AGE_S)}  # fmt: skip
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:  # whatever it asked to send: the openai client's names change with versions
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    async def stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        """The CORS headers of any response (aiohttp's on_response_prepare)."""
        if "*" not in self.origins:  # the answer depends on the Origin: caches must know
            response.headers.add("Vary", "Origin")
        allowed = self.allowed(request.headers.get("Origin"))
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
