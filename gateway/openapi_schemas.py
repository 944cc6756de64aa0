"""Component schemas of the gateway's OpenAPI document (see gateway/openapi.py).

Request schemas list exactly the fields the parsers read, with the parsers' bounds; response
schemas are the objects `ResponseAssembler` builds. tests/test_openapi.py checks both claims.
"""

from __future__ import annotations

from typing import Any

from gateway.fields import INT32_MAX, INT64_MAX, INT64_MIN
from gateway.openai_api import CHAT_OFF_ONLY, COMPLETION_OFF_ONLY, MAX_N, MAX_PROMPTS, OFF_ONLY
from runtime.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_REPETITION_PENALTY

JSON = dict[str, Any]


def ref(name: str) -> JSON:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: JSON, description: str) -> JSON:
    """An optional field: its schema or null (null means "use the default")."""
    return {"anyOf": [schema, {"type": "null"}], "description": description}


def _int(lo: int, hi: int | None, description: str, default: int | None = None) -> JSON:
    schema: JSON = {"type": "integer", "minimum": lo}
    if hi is not None:
        schema["maximum"] = hi
    if default is not None:
        schema["default"] = default
    return _nullable(schema, description)


def _num(description: str, default: float, **bounds: float) -> JSON:
    return _nullable({"type": "number", "default": default, **bounds}, description)


def _bool(description: str, default: bool = False) -> JSON:
    return _nullable({"type": "boolean", "default": default}, description)


_OFF_ONLY = "Not supported yet: only the value meaning 'off' is accepted, anything else is a 400."


def _off_only(table: dict[str, tuple[tuple[object, ...], str]]) -> JSON:
    """The parser's refused-unless-off fields: null or one of their "off" values."""
    return {
        name: {
            "anyOf": [*({"const": v} for v in off), {"type": "null"}],
            "description": (
                f"Not supported yet ({what}): only null or the value meaning 'off' is accepted, "
                "anything else is a 400."
            ),
        }
        for name, (off, what) in table.items()
    }


_SAMPLING: JSON = {
    "model": {"type": "string", "minLength": 1, "description": "Served model name."},
    "temperature": _num("0 = greedy.", 1.0, minimum=0, maximum=2),
    "top_p": _num("Nucleus sampling mass.", 1.0, exclusiveMinimum=0, maximum=1),
    "n": _int(1, 16, "Completions to generate for the prompt.", 1),
    "min_tokens": _int(
        0,
        INT32_MAX,
        "vLLM extension: tokens each completion generates before end-of-sequence, a stop token "
        "or a stop string may end it (those tokens are not sampled until then); at most "
        "max_tokens (a 400 otherwise). Where the context ends first, the completion ends there "
        "(finish_reason length).",
        0,
    ),
    "stop": _nullable(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "maxItems": 16,
                    "items": {"type": "string", "minLength": 1},
                },
            ]
        },
        "Up to 16 stop strings; the matched string is left out of the text.",
    ),
    "seed": _int(INT64_MIN, INT64_MAX, "Same seed and parameters, same output."),
    "presence_penalty": _num("Penalty on tokens already generated.", 0.0, minimum=-2, maximum=2),
    "frequency_penalty": _num("Penalty per occurrence in the output.", 0.0, minimum=-2, maximum=2),
    "stream": _bool("Answer with server-sent events."),
    "stream_options": _nullable(
        ref("StreamOptions"), "Only allowed when stream is true (400 otherwise)."
    ),
    "user": _nullable({"type": "string"}, "End-user id, for logs."),
    "top_k": _int(-1, INT32_MAX, "vLLM extension: keep the k most likely tokens; -1 = all.", -1),
    "min_p": _num("vLLM extension: drop tokens below min_p * p(best).", 0.0, minimum=0, maximum=1),
    "repetition_penalty": _num(
        "vLLM extension: > 1 discourages repeating prompt or output tokens.",
        1.0,
        exclusiveMinimum=0,
        maximum=MAX_REPETITION_PENALTY,
    ),
    "ignore_eos": _bool("vLLM extension: keep generating past end-of-sequence."),
    "stop_token_ids": _nullable(
        {
            "type": "array",
            "maxItems": 256,
            "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
        },
        "vLLM extension: token ids that end a completion.",
    ),
    "include_stop_str_in_output": _bool("vLLM extension: keep the matched stop string."),
    "prompt_logprobs": _int(
        0,
        20,
        "vLLM extension: each prompt token's log-probability and this many alternatives, in "
        "the answer's prompt_logprobs (a completion choice's, a chat response's); not with "
        "stream. Computed over the whole prompt (not from the prefix cache).",
    ),
    "logit_bias": _nullable(
        {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS_TOKENS,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            },
        },
        "Token id (a string key) -> bias added to its logit before sampling, greedy included: "
        "-100 bans the token, +100 forces it. Logprobs are of the logits before the bias "
        "(vLLM's default). Ids outside the model's vocabulary are a 400.",
    ),
    "response_format": _nullable(
        ref("ResponseFormat"),
        "Structured output: JSON (any object, or one that validates against a schema). "
        "At most one of response_format, guided_* and structured_outputs.",
    ),
    "guided_json": _nullable(
        {"anyOf": [{"type": "object"}, {"type": "string"}]},
        "vLLM extension: a JSON schema (or its text) the output validates against.",
    ),
    "guided_regex": _nullable(
        {"type": "string", "minLength": 1}, "vLLM extension: the output matches this regex."
    ),
    "guided_choice": _nullable(
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 1024,
            "items": {"type": "string", "minLength": 1},
        },
        "vLLM extension: the output is exactly one of these strings.",
    ),
    "guided_grammar": _nullable(
        {"type": "string", "minLength": 1}, "vLLM extension: a Lark grammar (llguidance's dialect)."
    ),
    "guided_decoding_backend": _nullable(
        {"type": "string"}, "vLLM extension; ignored (the engine is llguidance)."
    ),
    "structured_outputs": _nullable(
        {
            "type": "object",
            "properties": {
                "json": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                "regex": {"type": "string"},
                "choice": {"type": "array", "items": {"type": "string"}},
                "grammar": {"type": "string"},
                "json_object": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
        "vLLM extension: exactly one constraint.",
    ),
    **_off_only(OFF_ONLY),
}

_MAX_TOKENS = "Tokens to generate per completion."

CHAT_REQUEST: JSON = {
    "type": "object",
    "required": ["model", "messages"],
    "description": (
        "Fields not listed here are ignored; those known to change the answer are listed, "
        "and refused unless off."
    ),
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
        "max_tokens": _int(1, INT32_MAX, _MAX_TOKENS + " Default: up to the context length."),
        "max_completion_tokens": _int(1, INT32_MAX, "Same as max_tokens (must agree if both)."),
        "logprobs": _bool("Return each token's log-probability."),
        "top_logprobs": _int(0, 20, "Alternatives per token; requires logprobs: true."),
        "tools": _nullable(
            {"type": "array", "maxItems": 128, "items": ref("Tool")},
            "Functions the model may call; rendered by the model's chat template.",
        ),
        "tool_choice": _nullable(
            {"anyOf": [{"enum": ["none", "auto", "required"]}, ref("NamedToolChoice")]},
            "Default auto when tools are given. required and a named function are enforced "
            "with a grammar: the answer is always a call whose arguments match the schema.",
        ),
        "parallel_tool_calls": _bool(
            "false: at most one tool call (required and a named function: a grammar of one "
            "call; auto: the answer ends after its first call).",
            True,
        ),
        "functions": _nullable({"type": "array", "maxItems": 0}, _OFF_ONLY),
        "function_call": _nullable({"enum": ["none", "auto"]}, _OFF_ONLY),
        **_off_only(CHAT_OFF_ONLY),
    },
}

COMPLETION_REQUEST: JSON = {
    "type": "object",
    "required": ["model", "prompt"],
    "description": (
        "Fields not listed here are ignored; those known to change the answer are listed, "
        "and refused unless off."
    ),
    "properties": {
        **_SAMPLING,
        "prompt": {
            "description": (
                "Text or token ids, or a batch of either: prompt p's completions are choices "
                "p * n to p * n + n - 1, usage is their sum."
            ),
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"$ref": "#/components/schemas/TokenIds"},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                    "items": {
                        "anyOf": [
                            {"type": "string", "minLength": 1},
                            {"$ref": "#/components/schemas/TokenIds"},
                        ]
                    },
                },
            ],
        },
        "max_tokens": _int(
            1,
            INT32_MAX,
            _MAX_TOKENS + " With echo: true, 0 is taken too (the prompt alone, as vLLM does).",
            16,
        ),
        "logprobs": _int(0, 20, "Return log-probabilities with this many alternatives."),
        "echo": _bool(
            "The prompt goes first in each choice's text and, with logprobs, its tokens' "
            "log-probabilities (the first token's null) before the generated tokens' "
            "(text_offset counts from the prompt's start)."
        ),
        "suffix": _nullable({"type": "string", "maxLength": 0}, _OFF_ONLY),
        "best_of": _int(1, MAX_N, "Only null, 1 or n."),
        **_off_only(COMPLETION_OFF_ONLY),
    },
}

_USAGE: JSON = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer", "description": "Over all n completions."},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {
                "cached_tokens": {
                    "type": "integer",
                    "description": "Prompt tokens served from the prefix cache.",
                }
            },
        },
    },
}

_FINISH: JSON = {
    "anyOf": [{"enum": ["stop", "length", "tool_calls"]}, {"type": "null"}],
    "description": "null until the choice ends (streaming).",
}
_STOP_REASON: JSON = {
    "anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}],
    "description": "vLLM extension: the stop string or token id that ended the choice.",
}
_TOP_LOGPROB: JSON = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number", "description": "-9999.0 stands for -inf."},
        "bytes": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
    },
}
_CHAT_LOGPROBS: JSON = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "content": {"type": "array", "items": ref("ChatTokenLogprob")},
                "refusal": {"type": "null"},
            },
        },
        {"type": "null"},
    ]
}


_PROMPT_LOGPROBS: JSON = {
    "type": "array",
    "description": (
        "vLLM extension, with prompt_logprobs: per prompt token (the first null), its id and "
        "its alternatives' (string keys) -> logprob, rank (1 = the most likely) and text."
    ),
    "items": {
        "anyOf": [
            {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["logprob", "rank", "decoded_token"],
                    "properties": {
                        "logprob": {"type": "number", "description": "-9999.0 stands for -inf."},
                        "rank": {"type": "integer", "minimum": 1},
                        "decoded_token": {"type": "string"},
                    },
                },
            },
            {"type": "null"},
        ]
    },
}


def _object(object_name: str, choice: JSON, description: str) -> JSON:
    return {
        "type": "object",
        "description": description,
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer", "description": "Unix seconds."},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {
                "anyOf": [ref("Usage"), {"type": "null"}],
                "description": "Streams: null on every chunk but the last (include_usage).",
            },
        },
    }


SCHEMAS: JSON = {
    "ChatCompletionRequest": CHAT_REQUEST,
    "CompletionRequest": COMPLETION_REQUEST,
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
            "content": {
                "description": (
                    "Text, or text parts (assistant: also refusal parts) joined with newlines; "
                    "null only for assistant."
                ),
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {"anyOf": [ref("TextPart"), ref("RefusalPart")]},
                    },
                    {"type": "null"},
                ],
            },
            "name": {"type": "string"},
            "tool_calls": {
                "type": "array",
                "items": ref("ToolCall"),
                "description": "Assistant messages: the calls it made (arguments as JSON text).",
            },
            "tool_call_id": {
                "type": "string",
                "description": "Tool messages: the id of an earlier assistant message's call.",
            },
            "function_call": {
                "type": "null",
                "description": "Deprecated; send tool_calls (anything but null is a 400).",
            },
            "refusal": {
                "anyOf": [{"const": ""}, {"type": "null"}],
                "description": "Send a refusal as a content part (a refusal text here is a 400).",
            },
        },
    },
    "ResponseFormat": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
                    "description": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                },
            },
        },
    },
    "Tool": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object", "description": "A JSON schema of an object."},
                    "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                },
            },
        },
    },
    "NamedToolChoice": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}},
            },
        },
    },
    "ToolCall": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    },
    "ToolCallDelta": {
        "type": "object",
        "required": ["index"],
        "description": "The first delta of a call has id, type and name; later ones add arguments.",
        "properties": {
            "index": {"type": "integer"},
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    },
    "TextPart": {
        "type": "object",
        "required": ["type", "text"],
        "description": "Only text parts are supported (and refusal parts); others are a 400.",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    },
    "RefusalPart": {
        "type": "object",
        "required": ["type", "refusal"],
        "description": "Assistant messages only: an earlier refusal, read as text.",
        "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
    },
    "TokenIds": {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
    },
    "StreamOptions": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean", "default": False},
            "continuous_usage_stats": {
                "const": False,
                "description": "vLLM extension; not supported yet (usage on every chunk).",
            },
        },
    },
    "Usage": _USAGE,
    "ChatTokenLogprob": {
        "type": "object",
        "required": ["token", "logprob", "top_logprobs"],
        "properties": {
            **_TOP_LOGPROB["properties"],
            "top_logprobs": {"type": "array", "items": _TOP_LOGPROB},
        },
    },
    "CompletionLogprobs": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "tokens": {"type": "array", "items": {"type": "string"}},
                    "token_logprobs": {
                        "type": "array",
                        "items": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                        "description": "null for an echoed prompt's first token.",
                    },
                    "top_logprobs": {
                        "type": "array",
                        "items": {
                            "anyOf": [
                                {"type": "object", "additionalProperties": {"type": "number"}},
                                {"type": "null"},
                            ]
                        },
                        "description": "null for an echoed prompt's first token.",
                    },
                    "text_offset": {"type": "array", "items": {"type": "integer"}},
                },
            },
            {"type": "null"},
        ]
    },
    "ChatCompletion": _object(
        "chat.completion",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "message": {
                    "type": "object",
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {
                            "anyOf": [{"type": "string"}, {"type": "null"}],
                            "description": "null when the message is only tool calls.",
                        },
                        "tool_calls": {"type": "array", "items": ref("ToolCall")},
                    },
                },
                "logprobs": _CHAT_LOGPROBS,
                "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                "stop_reason": _STOP_REASON,
            },
        },
        "A non-streamed chat answer.",
    ),
    "ChatCompletionChunk": _object(
        "chat.completion.chunk",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "delta": {
                    "type": "object",
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": "string"},
                        "tool_calls": {"type": "array", "items": ref("ToolCallDelta")},
                    },
                },
                "logprobs": _CHAT_LOGPROBS,
                "finish_reason": _FINISH,
                "stop_reason": _STOP_REASON,
            },
        },
        "One server-sent event of a streamed chat answer.",
    ),
    "Completion": _object(
        "text_completion",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "text": {"type": "string"},
                "logprobs": ref("CompletionLogprobs"),
                "finish_reason": _FINISH,
                "stop_reason": _STOP_REASON,
                "prompt_logprobs": _PROMPT_LOGPROBS,
            },
        },
        "A completions answer, or one chunk of a streamed one (finish_reason null until the end).",
    ),
    "Model": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {
                "type": "integer",
                "description": "Unix seconds: when this gateway first saw the model served (its "
                "earliest worker's start; a model only a pool can start: when first listed).",
            },
            "owned_by": {"type": "string"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": ref("Model")},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}},
    },
    "Readiness": {
        "type": "object",
        "required": ["ready"],
        "properties": {
            "ready": {"type": "boolean"},
            "redis": {
                "type": "boolean",
                "description": (
                    "Redis took a write of this gateway's (with redis=optional, which waits on "
                    "no call: the gateway's last Redis calls succeeded, writes included)."
                ),
            },
            "redis_error": {
                "type": ["string", "null"],
                "description": (
                    "Why redis is false: 'unreachable' or 'refused' (out of memory, a replica, an "
                    "ACL), then the error's type; null when it is true."
                ),
            },
            "workers": {"type": "integer", "description": "Live workers in the cluster view."},
            "pools": {"type": "integer", "description": "Pools that can start workers."},
            "region": {"type": "string", "description": "This gateway's region."},
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string", "description": "Names the field and limit."},
                    "type": {
                        "type": "string",
                        "examples": ["invalid_request_error", "server_error"],
                        "description": "OpenAI's: invalid_request_error for a 4xx but 429; "
                        "server_error for a 5xx and a 429 (the service full). `code` says what "
                        "happened.",
                    },
                    "param": {"type": ["string", "null"], "examples": ["messages[0].content"]},
                    "code": {"type": ["string", "null"], "examples": ["model_not_found"]},
                },
            }
        },
    },
}
# vLLM's place for a chat request's prompt_logprobs: the response's, beside its choices
SCHEMAS["ChatCompletion"]["properties"]["prompt_logprobs"] = _PROMPT_LOGPROBS
