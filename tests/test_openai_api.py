"""The gateway's OpenAI request parsing: a JSON body in, a worker GenerateRequest out.

Every validation rule is one row of a table: the body, the `param` the 400 must name, and a
piece of the message (the limit). The assembler's tests are in test_openai_response.py, the
OpenAPI spec's (checked against these parsers) in test_openapi.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import orjson
import pytest

from gateway.errors import APIError
from gateway.openai_api import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_PROMPTS,
    RequestOptions,
    parse_chat,
    parse_completion,
)
from kvstore.protocol import GenerateRequest
from runtime.sampling_params import SamplingParams

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
DROP = object()  # in a patch: remove the key from the base body
I32 = 2**31 - 1


def _body(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    body = dict(base)
    for k, v in patch.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def _msg(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi", **fields}]}


def _content(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


# (patch of the base body, param the error names, text the message must contain)
SHARED_INVALID: list[tuple[dict[str, Any], str, str]] = [
    ({"model": DROP}, "model", "required"),
    ({"model": ""}, "model", "non-empty string"),
    ({"model": 3}, "model", "got integer"),
    ({"model": "m" * 257}, "model", "at most 256 characters long, got 257"),
    ({"max_tokens": 0}, "max_tokens", f"[1, {I32}]"),
    ({"max_tokens": I32 + 1}, "max_tokens", f"[1, {I32}]"),
    ({"max_tokens": 1.5}, "max_tokens", "got number"),
    ({"max_tokens": True}, "max_tokens", "got boolean"),
    ({"max_tokens": "10"}, "max_tokens", "got string"),
    ({"temperature": 2.5}, "temperature", "[0, 2]"),
    ({"temperature": -0.1}, "temperature", "[0, 2]"),
    ({"temperature": "hot"}, "temperature", "[0, 2]"),
    ({"temperature": True}, "temperature", "got boolean"),
    ({"temperature": math.nan}, "temperature", "finite"),
    ({"temperature": math.inf}, "temperature", "finite"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.01}, "top_p", "(0, 1]"),
    ({"n": 0}, "n", "[1, 16]"),
    ({"n": 17}, "n", "[1, 16]"),
    ({"n": 2.0}, "n", "must be an integer"),
    ({"n": True}, "n", "got boolean"),
    ({"stop": 5}, "stop", "at most 16"),
    ({"stop": [""]}, "stop[0]", "non-empty string, got an empty string"),
    ({"stop": ""}, "stop", "stop must be a non-empty string, got an empty string"),
    ({"stop": ["a", 3]}, "stop[1]", "non-empty string"),
    ({"stop": ["s"] * 17}, "stop", "at most 16"),
    ({"seed": "x"}, "seed", "integer"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"seed": 2**63}, "seed", str(2**63 - 1)),
    ({"seed": -(2**63) - 1}, "seed", str(-(2**63))),
    ({"presence_penalty": 2.1}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"stream": True, "stream_options": 5}, "stream_options", "object"),
    (
        {"stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "boolean",
    ),
    ({"user": 5}, "user", "string"),
    ({"top_k": -2}, "top_k", f"[-1, {I32}]"),
    ({"top_k": 1.0}, "top_k", "integer"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"min_p": -0.5}, "min_p", "[0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 10000]"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "(0, 10000]"),
    # (1e39 is inf in float32: the sampler's logits would turn NaN)
    ({"repetition_penalty": 1e39}, "repetition_penalty", "(0, 10000]"),
    ({"repetition_penalty": 10000.5}, "repetition_penalty", "(0, 10000]"),
    ({"ignore_eos": "no"}, "ignore_eos", "boolean"),
    ({"stop_token_ids": 5}, "stop_token_ids", "array of integers"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]", f"[0, {I32}]"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]", "got boolean"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids", "at most 256"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "boolean"),
    ({"logit_bias": {"50256": -101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": [1]}, "logit_bias", "object"),
    (
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
        "not supported",
    ),
    (
        {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
        "stream_options.continuous_usage_stats",
        "boolean",
    ),
    # vLLM's extras that change the answer: refused unless "off", never ignored
    # vLLM's min_tokens: an integer in [0, max_tokens]
    ({"min_tokens": -1}, "min_tokens", f"[0, {I32}]"),
    ({"min_tokens": False}, "min_tokens", "got boolean"),  # (JSON false is not 0)
    ({"min_tokens": 2.5}, "min_tokens", "got number"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "at most max_tokens (4), got 5"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"use_beam_search": 0}, "use_beam_search", "send false"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "send null"),
    ({"bad_words": ["darn"]}, "bad_words", "not supported"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "not available when stream"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "not supported"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "not supported"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "not supported"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ({"logits_processors": ["m.f"]}, "logits_processors", "not supported"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "not supported"),
    ({"return_token_ids": True}, "return_token_ids", "not supported"),
]

CHAT_INVALID: list[tuple[dict[str, Any], str, str]] = [
    *SHARED_INVALID,
    ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens", "max_completion_tokens (4)"),
    ({"messages": DROP}, "messages", "required"),
    ({"messages": []}, "messages", "non-empty array"),
    ({"messages": "hi"}, "messages", "non-empty array"),
    ({"messages": [3]}, "messages[0]", "object"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "system"),
    (_msg(role="robot"), "messages[0].role", "'robot'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "system", "content": None}]}, "messages[0].content", "required"),
    (_content(5), "messages[0].content", "string or a non-empty array"),
    (_content([]), "messages[0].content", "non-empty array"),
    (_content(["x"]), "messages[0].content[0]", "object"),
    (
        _content([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        "messages[0].content[0].type",
        "only text",
    ),
    (_content([{"type": "text", "text": 5}]), "messages[0].content[0].text", "string"),
    (_content([{"type": "refusal", "refusal": "no"}]), "messages[0].content[0].type", "refusal"),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]},
        "messages[0].content[0].refusal",
        "string",
    ),
    (_msg(name=5), "messages[0].name", "string"),
    (_msg(tool_calls=[{"id": "c1"}]), "messages[0].tool_calls", "only assistant"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", f"[1, {I32}]"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", "max_completion_tokens"),
    ({"logprobs": 1}, "logprobs", "boolean"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs: true"),
    ({"logprobs": False, "top_logprobs": 1}, "top_logprobs", "requires logprobs: true"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only 'function'"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"function_call": {"name": "f"}}, "function_call", "not supported"),
    # the prompt would not show these: the model would answer another conversation
    (
        {"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f"}}]},
        "messages[0].function_call",
        "send tool_calls",
    ),
    (
        {"messages": [{"role": "assistant", "content": None, "refusal": "I can't."}]},
        "messages[0].refusal",
        "content part",
    ),
    # vLLM's chat extras and OpenAI's newer fields that change the answer
    ({"echo": True}, "echo", "not supported"),
    ({"add_generation_prompt": False}, "add_generation_prompt", "not supported"),
    ({"continue_final_message": True}, "continue_final_message", "not supported"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "not supported"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "not supported"),
    ({"documents": [{"text": "x"}]}, "documents", "not supported"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "not supported"),
    ({"verbosity": "low"}, "verbosity", "not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ({"modalities": []}, "modalities", 'send ["text"]'),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "not supported"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    # a schema under a key OpenAI does not read: refused, not dropped
    (
        {"response_format": {"type": "json_object", "schema": {"type": "object"}}},
        "response_format.schema",
        "unknown: schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "parameters": {}}}},
        "response_format.json_schema.parameters",
        "unknown: parameters",
    ),
    (
        {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
        "response_format.json_schema",
        "takes only type",
    ),
    # (structured output and tool-calling validation: tests/test_tool_calling.py)
]

COMPLETION_INVALID: list[tuple[dict[str, Any], str, str]] = [
    *SHARED_INVALID,
    ({"prompt": DROP}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "non-empty string"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [[]]}, "prompt", "non-empty"),
    ({"prompt": [""]}, "prompt", "non-empty string"),
    ({"prompt": ["a"] * 65}, "prompt", "holds 65 prompts; at most 64 per request"),
    ({"prompt": [[1]] * 65}, "prompt", "at most 64"),
    ({"prompt": ["a", ""]}, "prompt", "prompt[1] must be a non-empty string"),
    ({"prompt": ["a", 3]}, "prompt", "prompt[1] must be a non-empty string or"),
    ({"prompt": [[1], [2, -1]]}, "prompt", "prompt[1][1] must be a token id"),
    ({"prompt": [1, -1]}, "prompt", f"[0, {I32}]"),
    ({"prompt": [1, True]}, "prompt", "token id"),
    ({"prompt": [1.5]}, "prompt", "token id"),
    ({"prompt": 5}, "prompt", "non-empty string"),
    ({"prompt": {"text": "hi"}}, "prompt", "got object"),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"logprobs": -1}, "logprobs", "[0, 20]"),
    ({"logprobs": True}, "logprobs", "got boolean"),
    ({"echo": "x"}, "echo", "boolean"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo: true"),
    ({"max_tokens": -1, "echo": True}, "max_tokens", "[0, "),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "at most max_tokens (0)"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"suffix": 5}, "suffix", "string"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "chat/completions"),
    ({"tool_choice": "required"}, "tool_choice", "chat/completions"),
    ({"functions": [{"name": "f"}]}, "functions", "chat/completions"),
    ({"n": 2, "best_of": 3}, "best_of", "null, 1 or n (2)"),
    ({"best_of": 0}, "best_of", "[1, 16]"),
    ({"best_of": 17}, "best_of", "[1, 16]"),  # (n is at most 16: more is never taken)
    ({"min_tokens": 17}, "min_tokens", "at most max_tokens (16), got 17"),  # (the default 16)
    # chat's name for the limit: ignored, the completion had 16 tokens, whatever it said
    ({"max_completion_tokens": 100}, "max_completion_tokens", "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "max_tokens"),
    ({"max_tokens": 1, "max_completion_tokens": True}, "max_completion_tokens", "max_tokens"),
]


def _refused(parse: Any, body: object) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, "req-1")
    return info.value


@pytest.mark.parametrize(("patch", "param", "text"), CHAT_INVALID, ids=repr)
def test_chat_rejects(patch: dict[str, Any], param: str, text: str) -> None:
    err = _refused(parse_chat, _body(CHAT, patch))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert text in err.message
    assert err.body()["error"]["param"] == param


@pytest.mark.parametrize(("patch", "param", "text"), COMPLETION_INVALID, ids=repr)
def test_completion_rejects(patch: dict[str, Any], param: str, text: str) -> None:
    err = _refused(parse_completion, _body(COMPLETION, patch))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert text in err.message


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
@pytest.mark.parametrize("body", [None, [], "x", 3, True, [CHAT]])
def test_body_must_be_an_object(parse: Any, body: object) -> None:
    err = _refused(parse, body)
    assert err.status == 400 and err.param is None and "JSON object" in err.message


DEFAULT_SAMPLING: dict[str, Any] = {
    "n": 1,
    "min_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "seed": None,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "logprobs": None,
    "include_stop_str_in_output": False,
    "structured_outputs": None,
    "logit_bias": {},
    "prompt_logprobs": None,
}


def test_chat_defaults() -> None:
    (req,), opts = parse_chat(CHAT, "req-1")
    # Chat's default is "up to the context": it must be sent, the engine's own default is 16.
    assert req.sampling == {**DEFAULT_SAMPLING, "max_tokens": None}
    assert (req.request_id, req.model, req.prompt) == ("req-1", "m", None)
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert opts == RequestOptions("chat", "m", False, False, 1, None)


def test_completion_defaults() -> None:
    (req,), opts = parse_completion(COMPLETION, "req-2", session_id="s1")
    assert req.sampling == {**DEFAULT_SAMPLING, "max_tokens": 16}
    assert (req.prompt, req.messages, req.session_id) == ("hi", None, "s1")
    assert opts == RequestOptions("completion", "m", False, False, 1, None)


def test_chat_maps_every_field() -> None:
    body = {
        "model": "smol",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "ann",
            },
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "max_completion_tokens": 64,
        "max_tokens": 64,
        "min_tokens": 64,
        "temperature": 0,
        "top_p": 0.9,
        "n": 3,
        "stop": "\n",
        "seed": -7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logprobs": True,
        "top_logprobs": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u-1",
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "stop_token_ids": [7, 8],
        "include_stop_str_in_output": True,
        "tools": [],
        "tool_choice": "none",
        "functions": None,
        "function_call": "auto",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "metadata": {"ignored": True},  # unknown fields are ignored
        "store": False,
    }
    (req,), opts = parse_chat(body, "r")
    assert req.sampling == {
        "n": 3,
        "max_tokens": 64,
        "min_tokens": 64,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": -7,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "stop": ["\n"],
        "stop_token_ids": [7, 8],
        "ignore_eos": True,
        "logprobs": 4,
        "include_stop_str_in_output": True,
        "structured_outputs": None,
        "logit_bias": {},
        "prompt_logprobs": None,
    }
    assert isinstance(req.sampling["temperature"], float)
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
        ]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]
    assert opts == RequestOptions("chat", "smol", True, True, 3, 4, "u-1")


def test_completion_maps_every_field() -> None:
    body = {
        "model": "smol",
        "prompt": [[1, 2, 3]],
        "max_tokens": 5,
        "min_tokens": 5,
        "temperature": 1.5,
        "top_p": 1,
        "n": 2,
        "best_of": 2,
        "stop": ["a", "b"],
        "seed": 0,
        "logprobs": 0,
        "echo": False,
        "suffix": "",
        "stream": True,
        "stream_options": None,
        "top_k": 0,
        "min_p": 1,
        "repetition_penalty": 2,
        "stop_token_ids": [],
    }
    (req,), opts = parse_completion(body, "r")
    assert req.prompt == [1, 2, 3]
    assert req.sampling == {
        **DEFAULT_SAMPLING,
        "n": 2,
        "max_tokens": 5,
        "min_tokens": 5,
        "temperature": 1.5,
        "top_k": 0,
        "min_p": 1.0,
        "seed": 0,
        "repetition_penalty": 2.0,
        "stop": ["a", "b"],
        "logprobs": 0,
    }
    assert opts == RequestOptions("completion", "smol", True, False, 2, 0)


def test_assistant_refusal_parts_are_its_text() -> None:
    """An earlier answer that OpenAI refused, sent back as the client got it (content parts)."""
    refused = [{"type": "refusal", "refusal": "I can't help with that."}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": refused},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, *refused]},
    ]
    (req,), _ = parse_chat({**CHAT, "messages": messages}, "r")
    assert [m["content"] for m in req.messages or []] == [
        "hi", "I can't help with that.", "a\nI can't help with that."
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), (["hi"], "hi"), ([5, 6], [5, 6]), ([[5, 6]], [5, 6]), ([0], [0])],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    (req,), _ = parse_completion({**COMPLETION, "prompt": prompt}, "r")
    assert req.prompt == expected


@pytest.mark.parametrize("prompts", [["Once", "Upon a"], [[5, 6], [7]], [[5], "mixed"]])
def test_completion_batch_is_a_request_per_prompt(prompts: list[Any]) -> None:
    """LangChain's OpenAI LLM sends prompts in batches: each is the worker's request of its
    own, with the request's sampling, session and an id of its own."""
    body = {**COMPLETION, "prompt": prompts, "n": 3, "temperature": 0.5}
    reqs, opts = parse_completion(body, "r", session_id="s")
    assert [r.prompt for r in reqs] == prompts
    assert [r.request_id for r in reqs] == ["r-0", "r-1"]
    assert all(r.sampling == reqs[0].sampling and r.session_id == "s" for r in reqs)
    assert reqs[0].sampling["n"] == 3 and reqs[0].sampling["temperature"] == 0.5
    assert (opts.n, opts.prompts) == (3, 2)
    assert len(parse_completion({**COMPLETION, "prompt": ["x"] * 64}, "r")[0]) == MAX_PROMPTS


# Each field's "off" value (vLLM's default, or OpenAI's): what a client that does not use the
# feature may send, with the same answer as leaving it out.
OFF_VALUES: dict[str, Any] = {
    "min_tokens": 0,
    "use_beam_search": False,
    "allowed_token_ids": None,
    "bad_words": [],
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "stream": True,
    "stream_options": {"include_usage": False, "continuous_usage_stats": False},
}
CHAT_OFF_VALUES: dict[str, Any] = {
    **OFF_VALUES,
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": {},
    "documents": None,
    "reasoning_effort": None,
    "verbosity": None,
    "modalities": ["text"],
    "audio": None,
    "web_search_options": None,
    "top_logprobs": 0,  # without logprobs: asks for nothing (vLLM takes it too)
    "logprobs": False,
}


@pytest.mark.parametrize(
    ("parse", "base", "off"),
    [(parse_chat, CHAT, CHAT_OFF_VALUES), (parse_completion, COMPLETION, OFF_VALUES)],
    ids=["chat", "completion"],
)
def test_off_values_are_the_defaults(parse: Any, base: Any, off: dict[str, Any]) -> None:
    (plain,), _ = parse({**base, "stream": True}, "r")
    (req,), opts = parse({**base, **off}, "r")
    assert req == plain and opts.logprobs is None
    for name, value in off.items():  # each alone, too
        if name not in ("stream", "stream_options"):
            assert parse({**base, name: value}, "r")[0][0].sampling == plain.sampling, name


@pytest.mark.parametrize("logprobs", [False, None])
def test_top_logprobs_zero_needs_no_logprobs(logprobs: bool | None) -> None:
    """top_logprobs: 0 asks for no alternatives, so it needs no logprobs: true (vLLM refuses
    only top_logprobs > 0 without it)."""
    (req,), opts = parse_chat({**CHAT, "logprobs": logprobs, "top_logprobs": 0}, "r")
    assert req.sampling["logprobs"] is None and opts.logprobs is None


def test_fields_real_clients_send_are_accepted() -> None:
    """What the openai client and LangChain send by default (or when the user sets them), and
    an answer sent back as the openai client's message object dumps it (nulls included)."""
    answer = {
        "role": "assistant",
        "content": "Hello!",
        "refusal": None,
        "function_call": None,
        "tool_calls": None,
        "audio": None,
        "annotations": [],
    }
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": "hi"}, answer, {"role": "user", "content": "?"}],
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "p",
        "parallel_tool_calls": True,
        "prediction": {"type": "content", "content": "Hi"},  # only speeds answering up
        "priority": 0,
        "request_id": "x",
    }
    (req,), opts = parse_chat(body, "r")
    assert (req.messages or [])[1] == {"role": "assistant", "content": "Hello!"}
    assert opts.include_usage
    refused = {**answer, "content": None, "refusal": ""}  # an empty refusal is no refusal
    parse_chat({**CHAT, "messages": [refused, {"role": "user", "content": "hi"}]}, "r")


def test_completion_takes_max_completion_tokens_equal_to_max_tokens() -> None:
    (req,), _ = parse_completion({**COMPLETION, "max_tokens": 5, "max_completion_tokens": 5}, "r")
    assert req.sampling["max_tokens"] == 5


@pytest.mark.parametrize("best_of", [None, 1, 3])
def test_best_of_null_one_or_n(best_of: int | None) -> None:
    parse_completion({**COMPLETION, "n": 3, "best_of": best_of}, "r")


def test_nulls_mean_defaults() -> None:
    nulls = {f: None for f in CHAT_FIELDS - {"model", "messages"}}
    assert parse_chat({**CHAT, **nulls}, "r")[0][0].sampling == {
        **DEFAULT_SAMPLING,
        "max_tokens": None,
    }
    nulls = {f: None for f in COMPLETION_FIELDS - {"model", "prompt"}}
    (req,), _ = parse_completion({**COMPLETION, **nulls}, "r")
    assert req.sampling == {**DEFAULT_SAMPLING, "max_tokens": 16}


def test_sampling_is_what_the_engine_takes() -> None:
    """The worker does SamplingParams(**sampling): every field, each one it knows, all valid."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    for req in (
        parse_chat(CHAT, "r")[0][0],
        parse_completion(COMPLETION, "r")[0][0],
        parse_chat({**CHAT, "logprobs": True, "n": 16, "seed": 2**63 - 1, "stop": "x"}, "r")[0][0],
    ):
        assert set(req.sampling) == names
        SamplingParams(**req.sampling)
        assert GenerateRequest.from_dict(orjson.loads(req.to_json())) == req


WEIRD: list[object] = [
    None, True, False, 0, -1, 1.5, 10**30, "", "x", [], [1], ["x"], [None], [{}], {}, {"a": 1},
    math.nan, [[1], "x"], [{"type": "text"}], {"type": "text"}, {"include_usage": True},
]  # fmt: skip


@pytest.mark.parametrize(
    ("parse", "base", "fields"),
    [(parse_chat, CHAT, CHAT_FIELDS), (parse_completion, COMPLETION, COMPLETION_FIELDS)],
    ids=["chat", "completion"],
)
def test_any_value_of_any_field_is_parsed_or_a_400(parse: Any, base: Any, fields: Any) -> None:
    """No TypeError/KeyError escapes; and each declared field is read (some value is refused)."""
    for name in sorted(fields):
        refused_here = False
        for value in WEIRD:
            try:
                parse({**base, name: value}, "r")
            except APIError as e:
                assert e.status == 400, (name, value, e)
                refused_here |= (e.param or "").startswith(name)
        assert refused_here, f"{name}: no value refused, so the parser never reads it"
