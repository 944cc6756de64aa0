"""What the worker's and the gateway's HTTP servers share.

`AppRunner` is aiohttp's, except for what a server answers to a request aiohttp refuses before
any handler or middleware sees it: a request line or header over the line limit, too many
headers, a control byte in a header, a Content-Length that is not a number, a chunked body that
does not parse, bytes that are not HTTP. aiohttp answers those itself with a text/plain 400
(`RequestHandler.handle_error`) and offers no hook for it (aio-libs/aiohttp#3287, open since
2018): a client of a JSON API then fails to parse the error it got. Here its connections
(`_Protocol`) ask the app's `refusal` for the answer instead. aiohttp still logs the fault and
closes the connection after the answer (the parser's state is lost). Nor does aiohttp tell a
handler reading a body that the body stopped parsing (`_Protocol.data_received`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

try:  # (aiohttp's private record of a parse fault: an aiohttp without it skips that check)
    from aiohttp.web_protocol import _ErrInfo
except ImportError:  # pragma: no cover
    _ErrInfo = None  # type: ignore[assignment, misc]

log = logging.getLogger("edgeinfer.serving")

# The longest request line (method, URL) and header (name and value) taken, in bytes: h11's
# limit on a whole request head (uvicorn's, vLLM's server), where aiohttp's 8190 refused a long
# JWT bearer token or a browser's cookies beside it. The gateway answers longer ones 431. The
# worker takes as much: what the gateway passes on (a W3C tracestate of up to 8192 characters,
# which OpenTelemetry keeps) must not be refused one hop later.
MAX_HEADER_BYTES = 16384
MAX_HEADERS = 128  # headers in one request (aiohttp's default)

# the answer to a request aiohttp refused: its status (400; 500 or 504 for a handler's error
# that no middleware answered) and the exception (a BadHttpMessage for a parse error)
Refusal = Callable[[int, BaseException | None], web.Response]


class AppRunner(web.AppRunner):
    """aiohttp's AppRunner (same arguments), whose refusals `refusal` answers."""

    def __init__(self, app: web.Application, refusal: Refusal, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._refusal = refusal

    async def _make_server(self) -> web.Server:
        # (the app's own server, made as aiohttp makes it, then the same again as a _Server:
        # aiohttp has no argument for the protocol class its server builds)
        made = await super()._make_server()
        try:  # (aiohttp's private fields: an aiohttp whose internals moved serves as its own)
            return _Server(made.request_handler, request_factory=made.request_factory,
                           handler_cancellation=made.handler_cancellation, loop=made._loop,
                           refusal=self._refusal, **made._kwargs)  # fmt: skip
        except (AttributeError, TypeError) as e:  # pragma: no cover
            log.warning("requests aiohttp cannot parse get its own text/plain answers (this "
                        "aiohttp's server has no %s)", e)  # fmt: skip
            return made


class _Server(web.Server):
    def __init__(self, *args: Any, refusal: Refusal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusal = refusal

    def __call__(self) -> RequestHandler:  # (a connection's protocol)
        return _Protocol(self, loop=self._loop, **self._kwargs)


class _Protocol(RequestHandler):
    def data_received(self, data: bytes) -> None:
        messages = getattr(self, "_messages", None)
        queued = len(messages) if messages is not None else 0
        super().data_received(data)
        if messages is None or _ErrInfo is None:  # (an aiohttp whose internals moved)
            return
        # A body that stops parsing once its request is being handled (a chunk size that is not
        # hex, a chunk without its CRLF): aiohttp queues the fault as the connection's next
        # request, to be answered after this one, and never tells this one's body, whose reader
        # waited for bytes that would never come (the gateway's 30 s body timeout, then a 408
        # "did not arrive"). The reader gets the fault, as for a body that does not decode.
        request = getattr(self, "_current_request", None)
        if len(messages) > queued and request is not None:
            fault = messages[-1][0]
            if isinstance(fault, _ErrInfo) and not request.content.is_eof():
                first_line = str(fault.message).strip().split("\n", 1)[0].rstrip(":")
                request.content.set_exception(RequestPayloadError(first_line))

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own: logs the fault, and raises when part of a response has gone already
        super().handle_error(request, status, exc, message)
        assert isinstance(self._manager, _Server)
        answer = self._manager.refusal(status, exc)
        answer.force_close()  # (as aiohttp's: what follows on the connection cannot be parsed)
        return answer


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


class BodyEncodingError(ValueError):
    """A request body `inflate` could not take: `status` 415 (a Content-Encoding other than
    gzip and deflate; `encoding` is it), 400 (a stream that does not decode or is cut short) or
    413 (over the limit once inflated; `size` is how far it got). Each server words its own
    answer from it."""

    def __init__(self, status: int, message: str, encoding: str = "", size: int = 0) -> None:
        super().__init__(message)
        self.status, self.message, self.encoding, self.size = status, message, encoding, size


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """A body as it was before its Content-Encoding (the servers run with auto_decompress off:
    aiohttp would answer an encoding it lacks a module for, br or zstd, in plain text before
    the app sees the request, and pass an unknown one on undecoded). At most `limit` + 1 bytes
    are ever inflated: a decompression bomb stops there. Raises BodyEncodingError."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":  # a zlib stream (RFC 9110); some clients send it raw (no header)
        wbits = zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        raise BodyEncodingError(415, "unsupported Content-Encoding", encoding)
    inflater = zlib.decompressobj(wbits)
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as e:
        raise BodyEncodingError(400, f"the request body cannot be decoded ({encoding}: {e})") from e
    if len(body) > limit:
        raise BodyEncodingError(413, "over the limit once decoded", size=len(body))
    if not inflater.eof:
        raise BodyEncodingError(400, f"the request body cannot be decoded (its {encoding} stream "
                                "is cut short)")  # fmt: skip
    return body
