"""The OpenAPI spec kept in step with the parsers, and the error shapes the gateway answers with.

The spec is hand-written (gateway/openapi.py); these tests make drift a failure: the request
schemas list exactly the fields the parsers read, and each numeric bound in them is the
parser's own (the bound accepted, one step past it refused).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import errors
from gateway.errors import APIError
from gateway.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, parse_chat, parse_completion
from gateway.openapi import OPENAPI

ROOT = Path(__file__).resolve().parents[1]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _refused(parse: Any, body: object) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, "req-1")
    return info.value


def _schema(name: str) -> dict[str, Any]:
    return OPENAPI["components"]["schemas"][name]


def _optional(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an optional field's schema."""
    branches = [b for b in prop.get("anyOf", [prop]) if b != {"type": "null"}]
    return branches[0] if len(branches) == 1 else prop


@pytest.mark.parametrize(
    ("schema", "fields"),
    [("ChatCompletionRequest", CHAT_FIELDS), ("CompletionRequest", COMPLETION_FIELDS)],
)
def test_spec_lists_exactly_the_parsed_fields(schema: str, fields: frozenset[str]) -> None:
    assert set(_schema(schema)["properties"]) == set(fields)


BOUND_CASES = [
    pytest.param(parse, base, schema, name, id=f"{schema}.{name}")
    for parse, base, schema in [
        (parse_chat, {**CHAT, "logprobs": True}, "ChatCompletionRequest"),
        (parse_completion, COMPLETION, "CompletionRequest"),
    ]
    for name in sorted(_schema(schema)["properties"])
    if _optional(_schema(schema)["properties"][name]).get("type") in ("integer", "number")
]


@pytest.mark.parametrize(("parse", "base", "schema", "name"), BOUND_CASES)
def test_spec_bounds_are_the_parsers(parse: Any, base: Any, schema: str, name: str) -> None:
    """Each bound in the spec is accepted, and one step past it refused, by the parser."""
    prop = _optional(_schema(schema)["properties"][name])
    step = 1 if prop["type"] == "integer" else 1e-6
    probes: list[tuple[float, bool]] = []
    if "minimum" in prop:
        probes += [(prop["minimum"], True), (prop["minimum"] - step, False)]
    if "exclusiveMinimum" in prop:
        probes += [(prop["exclusiveMinimum"], False), (prop["exclusiveMinimum"] + step, True)]
    if "maximum" in prop:
        probes += [(prop["maximum"], True), (prop["maximum"] + step, False)]
    assert probes, f"{name}: a numeric field without bounds in the spec"
    for value, ok in probes:
        body = {**base, name: value}
        if name == "best_of":  # (only null, 1 or n: n is set to the value where n can be it)
            body["n"] = value if value in range(1, 17) else 1
        if name == "min_tokens":  # (at most max_tokens, which is the largest there can be)
            body["max_tokens"] = 2**31 - 1
        if ok:
            parse(body, "r")
        else:
            assert _refused(parse, body).param == name, (name, value)


def test_spec_states_the_parsers_caps() -> None:
    """Bounds the parser enforces are in the spec (test_spec_bounds_are_the_parsers probes them)."""
    completion = _schema("CompletionRequest")["properties"]
    for schema in ("ChatCompletionRequest", "CompletionRequest"):
        penalty = _optional(_schema(schema)["properties"]["repetition_penalty"])
        assert penalty["maximum"] == 1e4  # (beyond, float32 turns logits into NaN)
    assert _optional(completion["best_of"])["maximum"] == 16
    # unknown keys of structured_outputs are a 400; the spec lists exactly the parser's keys
    so = _optional(completion["structured_outputs"])
    assert so["additionalProperties"] is False
    err = _refused(parse_completion, {**COMPLETION, "structured_outputs": {"bogus": "x"}})
    assert err.param == "structured_outputs.bogus"
    assert f"supports {sorted(so['properties'])}" in err.message


# Fields that change the answer and are not implemented: the spec must list them (with their
# "off" values as the only ones accepted), since the parser refuses them rather than ignores them.
OFF_ONLY_SHARED = [
    "use_beam_search", "allowed_token_ids", "bad_words",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "guided_whitespace_pattern", "cache_salt",
]  # fmt: skip
OFF_ONLY_CHAT = [
    "echo", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    "add_special_tokens", "reasoning_effort", "modalities", "audio", "web_search_options",
]  # fmt: skip
OFF_CASES = [
    pytest.param(parse, base, schema, name, id=f"{schema}.{name}")
    for parse, base, schema, names in [
        (parse_chat, CHAT, "ChatCompletionRequest", [*OFF_ONLY_SHARED, *OFF_ONLY_CHAT]),
        (parse_completion, COMPLETION, "CompletionRequest",
         [*OFF_ONLY_SHARED, "add_special_tokens"]),
    ]
    for name in names
]


@pytest.mark.parametrize(("parse", "base", "schema", "name"), OFF_CASES)
def test_spec_lists_refused_fields_with_their_off_values(
    parse: Any, base: Any, schema: str, name: str
) -> None:
    prop = _schema(schema)["properties"][name]
    assert "Not supported" in prop["description"] or "not supported" in prop["description"]
    branches = [b for b in prop["anyOf"] if b != {"type": "null"}]
    for value in [None, *(b["const"] for b in branches)]:  # the accepted values: accepted
        parse({**base, name: value}, "r")
    assert _refused(parse, {**base, name: "on"}).param == name


def test_spec_refs_resolve() -> None:
    def walk(node: object) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                target: Any = OPENAPI
                for part in ref.removeprefix("#/").split("/"):
                    target = target[part]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(OPENAPI)
    orjson.dumps(OPENAPI)  # servable as it is


def test_spec_covers_endpoints_statuses_and_headers() -> None:
    paths = OPENAPI["paths"]
    assert set(paths) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/healthz",
        "/readyz",
        "/openapi.json",
    }
    # every status the gateway's code raises an APIError with, and those it passes on
    raised = {
        m
        for f in (ROOT / "gateway").glob("*.py")
        for m in re.findall(r"APIError\((\d{3})", f.read_text())
    }
    assert raised >= {"400", "408", "500", "502"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        op = paths[path]["post"]
        assert raised | {"200", "401", "404", "405", "413", "429", "503"} <= set(op["responses"])
        assert set(op["responses"]["200"]["headers"]) == {
            "x-request-id",
            "x-edgeinfer-worker",
            "x-edgeinfer-region",
        }
        assert op["parameters"] == [{"$ref": "#/components/parameters/SessionAffinity"}]
        preflight = paths[path]["options"]  # CORS, with --cors-origins
        assert preflight["security"] == [] and set(preflight["responses"]) == {"204", "403"}
    for response in OPENAPI["components"]["responses"].values():  # errors name their request
        assert "x-request-id" in response["headers"]
    params = OPENAPI["components"]["parameters"]
    assert params["SessionAffinity"]["name"] == "x-session-affinity"
    for status in ("429", "503"):
        assert "Retry-After" in OPENAPI["components"]["responses"][status]["headers"]
    assert OPENAPI["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    for path in ("/healthz", "/readyz", "/openapi.json"):
        assert paths[path]["get"]["security"] == []
    (redis,) = paths["/readyz"]["get"]["parameters"]  # ?redis=optional: Kubernetes' probe
    assert (redis["name"], redis["in"]) == ("redis", "query")
    assert redis["schema"]["enum"] == ["required", "optional"]


# ---- errors (the shape every failure has) ------------------------------------------------------------------------------------


def test_error_shapes() -> None:
    cases = [
        (errors.invalid("n", "bad"), 400, "invalid_request_error"),
        (errors.unauthorized(), 401, "invalid_request_error"),
        (errors.origin_not_allowed("https://evil.example"), 403, "invalid_request_error"),
        (errors.model_not_found("x"), 404, "invalid_request_error"),
        (errors.method_not_allowed("GET", "POST"), 405, "invalid_request_error"),
        (errors.too_large(1024), 413, "invalid_request_error"),
        (errors.unsupported_encoding("br"), 415, "invalid_request_error"),
        (errors.at_capacity(1.2), 429, "server_error"),
        (errors.unavailable("down", 3), 503, "server_error"),
        (errors.internal("boom"), 500, "server_error"),
        (errors.bad_gateway("garbage"), 502, "server_error"),
    ]
    for err, status, type_ in cases:
        assert (err.status, err.type) == (status, type_)
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
        assert err.retryable == (status in (429, 502, 503))
    assert "1024 bytes" in errors.too_large(1024).message
    assert errors.model_not_found("x").body()["error"]["param"] is None  # (as OpenAI's)
    assert len(errors.model_not_found("m" * 5000).message) < 100  # the client knows its name
    assert errors.at_capacity(1.2).headers() == {"Retry-After": "2"}
    assert errors.invalid("n", "bad").headers() == {}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {
                "error": {
                    "message": "no",
                    "type": "invalid_request_error",
                    "param": "n",
                    "code": None,
                }
            },
            (400, "no", "invalid_request_error", "n", None),
        ),
        ("<html>", (400, "worker answered HTTP 400", "invalid_request_error", None, None)),
        (
            {"error": {"message": 5, "param": []}},
            (400, "worker answered HTTP 400", "invalid_request_error", None, None),
        ),
    ],
)
def test_error_from_worker_body(body: object, expected: tuple[Any, ...]) -> None:
    err = APIError.from_body(400, body)
    assert (err.status, err.message, err.type, err.param, err.code) == expected
    assert APIError.from_body(503, None).type == "server_error"
