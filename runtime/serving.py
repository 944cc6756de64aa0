"""What the worker's and the gateway's HTTP servers share."""

from __future__ import annotations

from aiohttp import web


async def listen(runner: web.AppRunner, host: str, port: int, what: str) -> None:
    """Start `runner`'s TCP site. A port that is taken (since it was chosen, say) or any other
    bind error ends the process with one line naming the address, not a traceback; the caller
    runs the app's cleanup first (try/finally): left to asyncio's cancellation at exit, the
    app's tasks never finished and the process hung without listening or exiting."""
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        raise SystemExit(
            f"edgeinfer: error: the {what} cannot listen on {host}:{port}: {e.strerror or e}"
        ) from e
