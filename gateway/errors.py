"""Errors the gateway answers with, in the OpenAI error shape.

Every failure a client can see is one `APIError`: an HTTP status, the OpenAI body
`{"error": {"message", "type", "param", "code"}}`, and, for the statuses that mean "come back
later" (429, 503), how long to wait. Handlers raise it from any phase (validate, resolve model,
route, forward, stream) and one place turns it into a response, so the shape cannot differ
between endpoints. The constructors below exist so that the same condition always gets the same
status, type and code.

The `type` is OpenAI's, which clients written against OpenAI read: `invalid_request_error` for
every 4xx but 429 (a missing API key, an unknown model or path included: OpenAI answers its 404
`model_not_found` and its 401 `invalid_api_key` so), `server_error` for 5xx and for 429 (the
service is full: OpenAI's "model is currently overloaded" 429 is a `server_error` too; its other
429 types name a client's own quota, which this gateway does not keep). `code` says more
precisely what happened (`model_not_found`, `at_capacity`, `worker_starting`...).
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import http_exceptions, web

# Statuses after which the same request may be sent again, to another worker or later: the
# request itself was fine, the service could not take it (or lost it) at that moment.
RETRYABLE_STATUSES = frozenset({429, 502, 503})

INVALID_REQUEST = "invalid_request_error"  # OpenAI's type of a 4xx: the request is at fault
SERVER_ERROR = "server_error"  # OpenAI's type of a 5xx, and of its 429 "overloaded"


class APIError(Exception):
    """A failure reported to the client as an OpenAI-style JSON error."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status  # HTTP status of the response
        self.message = message  # human-readable; names the field and the limit when it can
        self.type = type  # OpenAI's error type: `type_for(status)`
        self.param = param  # the request field at fault, e.g. "messages[0].content"
        self.code = code  # machine-readable kind, e.g. "model_not_found"
        self.retry_after = retry_after  # seconds to wait before retrying (429/503), if known

    @property
    def retryable(self) -> bool:
        """Whether sending the same request again (elsewhere, or later) may succeed."""
        return self.status in RETRYABLE_STATUSES

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error shape, all four keys always present."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Extra response headers: `Retry-After` in whole seconds (HTTP allows no fraction)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(0, math.ceil(self.retry_after)))}

    @classmethod
    def from_body(cls, status: int, body: object) -> APIError:
        """Rebuild an error a worker answered with, so the gateway can relay it unchanged.

        A worker that refuses a request sends the same OpenAI shape; anything else in the body
        (a proxy's HTML page, garbage) still becomes an error with the worker's status. The type
        is the gateway's for the status (`type_for`), whatever the worker called it: a worker of
        another version names its types otherwise, and a client sees one vocabulary.
        """
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(status, f"worker answered HTTP {status}", type_for(status))
        message, param, code = err.get("message"), err.get("param"), err.get("code")
        return cls(
            status,
            message if isinstance(message, str) else f"worker answered HTTP {status}",
            type_for(status),
            param if isinstance(param, str) else None,
            code if isinstance(code, str) else None,
        )

    def __repr__(self) -> str:
        return (
            f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"
        )


def clip(text: str, limit: int = 64) -> str:
    """A client's string, cut for a message (the client knows what it sent)."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def type_for(status: int) -> str:
    """OpenAI's error type for an answer's HTTP status (see the module's docstring)."""
    return SERVER_ERROR if status >= 500 or status == 429 else INVALID_REQUEST


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    """400: the request is malformed; `message` names the field and states the limit."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def unsupported(param: str, message: str) -> APIError:
    """400: a valid OpenAI feature this gateway does not implement yet (never silently ignored)."""
    return APIError(400, message, INVALID_REQUEST, param, "unsupported_parameter")


def unauthorized(message: str = "missing or invalid API key") -> APIError:
    """401: no bearer token, or one the gateway does not accept."""
    return APIError(401, message, INVALID_REQUEST, None, "invalid_api_key")


def origin_not_allowed(origin: str) -> APIError:
    """403: a browser's CORS preflight, or its POST, from an origin the gateway's --cors-origins
    does not list."""
    return APIError(
        403,
        f"origin {clip(origin)!r} may not call this gateway from a browser (see --cors-origins)",
        INVALID_REQUEST,
        "Origin",
        "origin_not_allowed",
    )


def not_found(message: str, code: str | None = None) -> APIError:
    """404: an unknown path, or (code="model_not_found") an unserved model."""
    return APIError(404, message, INVALID_REQUEST, None, code)


def model_not_found(model: str) -> APIError:
    """404 for a model no worker serves and the pool manager cannot start. No `param`, as
    OpenAI's: the same answer comes to GET /v1/models/{model}, which has no body field."""
    return not_found(f"model {clip(model)!r} does not exist", "model_not_found")


def method_not_allowed(method: str, allowed: str) -> APIError:
    """405: the path exists, not with this method; `allowed` is e.g. "POST"."""
    return APIError(
        405,
        f"method {method} is not allowed here; use {allowed}",
        INVALID_REQUEST,
        None,
        "method_not_allowed",
    )


def too_large(limit: int) -> APIError:
    """413: the request body is over the gateway's limit (in bytes)."""
    return APIError(
        413,
        f"request body is larger than the limit of {limit} bytes",
        INVALID_REQUEST,
        None,
        "request_too_large",
    )


def unsupported_encoding(encoding: str) -> APIError:
    """415: a request body in a Content-Encoding the gateway does not decode."""
    return APIError(
        415,
        f"Content-Encoding {clip(encoding)!r} is not supported; send the body uncompressed, "
        "or as gzip or deflate",
        INVALID_REQUEST,
        "Content-Encoding",
        "unsupported_encoding",
    )


def at_capacity(retry_after: float | None, message: str | None = None) -> APIError:
    """429: every worker for the model is full (or the client is over its rate limit)."""
    return APIError(
        429,
        message or "all workers for this model are at capacity; retry later",
        SERVER_ERROR,
        None,
        "at_capacity",
        retry_after,
    )


def unavailable(
    message: str, retry_after: float | None = None, code: str | None = None
) -> APIError:
    """503: no healthy worker can take the request now (starting, draining, unreachable)."""
    return APIError(503, message, SERVER_ERROR, None, code, retry_after)


def internal(message: str, code: str = "internal_error") -> APIError:
    """500: the request failed inside the service (an engine failure reported by the worker)."""
    return APIError(500, message, SERVER_ERROR, None, code)


def bad_gateway(message: str, code: str = "bad_worker_response") -> APIError:
    """502: a worker broke the internal protocol (malformed event, stream cut short)."""
    return APIError(502, message, SERVER_ERROR, None, code)


CLIENT_GONE_STATUS = 499  # nginx's "client closed request": recorded, never sent


def client_gone() -> APIError:
    """Not an answer (the client is not there to get one): how a request whose client went away
    is recorded (its span, the duration histogram's error.type), as the worker records it."""
    return APIError(CLIENT_GONE_STATUS, "the client closed the connection", "client_error", None,
                    "client_gone")  # fmt: skip


def from_exception(e: Exception, method: str, path: str, max_body_bytes: int) -> APIError:
    """The answer for an exception out of a handler: an APIError as it is, aiohttp's own HTTP
    errors as OpenAI-style ones, anything else a 500 `server_error` (code internal_error)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return too_large(max_body_bytes)
    if isinstance(e, web.HTTPMethodNotAllowed):
        return method_not_allowed(method, ", ".join(sorted(e.allowed_methods)))
    if isinstance(e, web.HTTPNotFound):
        return not_found(f"no route for {method} {path}")
    if isinstance(e, web.HTTPException):
        return APIError(e.status, e.reason, type_for(e.status))
    return internal("internal error in the gateway")


def unparsable(
    status: int, exc: BaseException | None, header_limit: int, max_headers: int
) -> APIError:
    """The answer to a request aiohttp refused before the app saw it (runtime/serving.py): 431
    for a request line or header over `header_limit` bytes, or too many headers; 400 for HTTP
    that does not parse (a bad request line, a control byte in a header, a Content-Length that
    is not a number, a chunked body that does not decode), naming the fault as aiohttp found
    it. (aiohttp also comes here with 500 or 504 for a handler's exception that no middleware
    answered: the app's outermost one answers them all.)"""
    if isinstance(exc, http_exceptions.LineTooLong):
        return APIError(431, f"the request line (its URL) or a request header is longer than "
                        f"the limit of {header_limit} bytes", INVALID_REQUEST, None,
                        "request_header_too_large")  # fmt: skip
    if isinstance(exc, http_exceptions.BadHttpMessage):
        fault = str(exc.message).strip().splitlines()[0].rstrip(":") if exc.message else ""
        if fault == "Too many headers received":
            return APIError(431, f"the request has more headers than the limit of {max_headers}",
                            INVALID_REQUEST, None, "too_many_headers")  # fmt: skip
        return invalid(None, f"the request is not valid HTTP/1.1 ({clip(fault, 120) or type(exc).__name__})",
                       "malformed_request")  # fmt: skip
    if status == 504:
        return APIError(504, "the gateway timed out", SERVER_ERROR, None, "timeout")
    return internal("internal error in the gateway")
