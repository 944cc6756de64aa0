"""The gateway's OpenAPI 3.1 description, served at `GET /openapi.json`.

Written by hand rather than generated, so that it reads as documentation; tests/test_openapi.py
keeps it honest: the request schemas (gateway/openapi_schemas.py) must list exactly the fields
`parse_chat` / `parse_completion` read (`CHAT_FIELDS`, `COMPLETION_FIELDS`), and every numeric
bound there is probed against the parser (the bound accepted, one step past it refused).
"""

from __future__ import annotations

from gateway.openapi_schemas import JSON, SCHEMAS, ref

# on every answer (the worker's two once a worker was chosen: on an error too)
_ROUTED_HEADERS: JSON = {
    "x-request-id": {"$ref": "#/components/headers/RequestId"},
    "x-edgeinfer-worker": {"$ref": "#/components/headers/Worker"},
    "x-edgeinfer-region": {"$ref": "#/components/headers/Region"},
}


def _error(description: str, retry_after: bool = False) -> JSON:
    response: JSON = {
        "description": description,
        "headers": _ROUTED_HEADERS,
        "content": {"application/json": {"schema": ref("Error")}},
    }
    if retry_after:
        response["headers"] = _ROUTED_HEADERS | {
            "Retry-After": {"$ref": "#/components/headers/RetryAfter"}
        }
    return response


def _errors(*statuses: str) -> JSON:
    return {s: {"$ref": f"#/components/responses/{s}"} for s in statuses}


_RESPONSES: JSON = {
    "400": _error("The request is invalid; error.param names the field."),
    "401": _error("Missing or wrong bearer token."),
    "403": _error(
        "A CORS preflight, or a browser's POST, from an origin --cors-origins does not list "
        "(code origin_not_allowed)."
    ),
    "404": _error("Unknown path, or a model no worker serves (code model_not_found)."),
    "405": _error("The path exists, but not with this method."),
    "408": _error("The request body did not arrive in time after its headers."),
    "413": _error("The request body is over the size limit (decompressed, if compressed)."),
    "415": _error("A Content-Encoding other than gzip or deflate (code unsupported_encoding)."),
    "417": _error("An Expect header other than 100-continue (code expectation_failed)."),
    "429": _error("Every worker for the model is at capacity.", retry_after=True),
    "431": _error(
        "A request line or header over 16,384 bytes (code request_header_too_large), or more "
        "than 128 headers (code too_many_headers)."
    ),
    "500": _error("The request failed inside the service (an engine failure on the worker)."),
    "502": _error(
        "A worker failed, refused the gateway, or broke off or garbled its answer before "
        "anything was sent."
    ),
    "503": _error(
        "No healthy worker can take the request now (error.code says why: worker_starting, "
        "pool_unavailable, ...), or this gateway is shutting down (code gateway_shutting_down: "
        "the request reached no worker; retry it on another gateway).",
        retry_after=True,
    ),
    "504": _error("The gateway timed out serving the request (code timeout)."),
}


def _generate(summary: str, request: str, answer: str, chunk: str) -> JSON:
    return {
        "summary": summary,
        "parameters": [{"$ref": "#/components/parameters/SessionAffinity"}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref(request)}},
        },
        "responses": {
            "200": {
                "description": (
                    "The answer: one JSON object, or with stream: true a text/event-stream of "
                    f"`data: <{chunk}>` events ending with `data: [DONE]`. An error after the "
                    "first event is sent as `data: <Error>` before the stream closes."
                ),
                "headers": _ROUTED_HEADERS,
                "content": {
                    "application/json": {"schema": ref(answer)},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **_errors("400", "401", "403", "404", "405", "408", "413", "415", "417", "429", "431",
                      "500", "502", "503", "504"),
        },
    }


_PREFLIGHT: JSON = {
    "summary": "CORS preflight, answered only when the gateway runs with --cors-origins",
    "description": (
        "A browser's OPTIONS with Origin and Access-Control-Request-Method, answered before "
        "auth. Every other response to a listed origin carries Access-Control-Allow-Origin and "
        "Access-Control-Expose-Headers (x-request-id, the x-edgeinfer-* headers, Retry-After)."
    ),
    "security": [],
    "responses": {
        "204": {
            "description": (
                "Allowed: Access-Control-Allow-Origin, -Allow-Methods, -Allow-Headers (those "
                "asked for) and -Max-Age."
            ),
            "headers": {
                name: {"schema": {"type": "string"}}
                for name in (
                    "Access-Control-Allow-Origin",
                    "Access-Control-Allow-Methods",
                    "Access-Control-Allow-Headers",
                    "Access-Control-Max-Age",
                )
            },
        },
        **_errors("403"),
    },
}


def _probe(summary: str, schema: str, unready: str | None, *parameters: JSON) -> JSON:
    """A probe for load balancers and Kubernetes: no auth, the same body for both answers."""
    body = {"application/json": {"schema": ref(schema)}}
    responses: JSON = {"200": {"description": "Yes.", "content": body}}
    if unready is not None:
        responses["503"] = {"description": unready, "content": body}
    if parameters:
        responses["400"] = {"$ref": "#/components/responses/400"}
    responses["405"] = {"$ref": "#/components/responses/405"}
    probe: JSON = {"summary": summary, "security": [], "responses": responses}
    if parameters:
        probe["parameters"] = list(parameters)
    return probe


OPENAPI: JSON = {
    "openapi": "3.1.0",
    "info": {
        "title": "edgeinfer gateway",
        "version": "0.1.0",
        "description": "OpenAI-compatible inference, routed to workers across regions.",
    },
    "security": [{"bearerAuth": []}],
    "paths": {
        "/v1/chat/completions": {
            "post": _generate(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
            ),
            "options": _PREFLIGHT,
        },
        "/v1/completions": {
            "post": _generate("Text completion", "CompletionRequest", "Completion", "Completion"),
            "options": _PREFLIGHT,
        },
        "/v1/models": {
            "get": {
                "summary": "Models served in the cluster",
                "responses": {
                    "200": {
                        "description": "The models.",
                        "content": {"application/json": {"schema": ref("ModelList")}},
                    },
                    **_errors("401", "405", "503"),
                },
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One model: served in the cluster, or startable on demand",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {
                        "description": "The model.",
                        "content": {"application/json": {"schema": ref("Model")}},
                    },
                    **_errors("401", "404", "405", "503"),
                },
            }
        },
        "/healthz": {"get": _probe("Liveness: the process answers", "Health", None)},
        "/readyz": {
            "get": _probe(
                "Readiness: Redis takes a write and a live worker (or a pool) is known",
                "Readiness",
                "Not ready: Redis unreachable or refusing writes (unless redis=optional), or no "
                "worker and no pool.",
                {
                    "name": "redis",
                    "in": "query",
                    "required": False,
                    "description": (
                        "optional: ready whenever the gateway can serve, Redis or not (it "
                        "routes on its last registry snapshot while Redis is down); what a "
                        "readiness probe should ask, or a Redis outage takes every gateway out "
                        "of service."
                    ),
                    "schema": {"enum": ["required", "optional"], "default": "required"},
                },
            ),
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "security": [],
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_errors("405"),
                },
            }
        },
    },
    "components": {
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        "parameters": {
            "SessionAffinity": {
                "name": "x-session-affinity",
                "in": "header",
                "required": False,
                "description": (
                    "A conversation id: requests with the same value go to the worker that "
                    "holds that conversation's KV cache, while it is alive."
                ),
                "schema": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 256,
                    "pattern": "^[^{}]+$",
                },
            }
        },
        "headers": {
            "RequestId": {
                "description": (
                    "The request's id, on every response: the one the gateway's logs and "
                    "traces (edgeinfer.request.id) know it by."
                ),
                "schema": {"type": "string"},
            },
            "Worker": {
                "description": (
                    "The worker that served the request, or failed or refused it (on an error, "
                    "once one was chosen); a batch of prompts: each worker, comma-separated."
                ),
                "schema": {"type": "string"},
            },
            "Region": {
                "description": "The region of that worker (those workers).",
                "schema": {"type": "string"},
            },
            "RetryAfter": {
                "description": "Seconds to wait before retrying.",
                "schema": {"type": "integer", "minimum": 0},
            },
        },
        "responses": _RESPONSES,
        "schemas": SCHEMAS,
    },
}
