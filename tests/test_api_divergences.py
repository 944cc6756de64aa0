"""Where the OpenAI API, as the real `openai` client sees it, and ours differed (found by a
reviewer): tool_choice without tools, a batch's prompt named in its context-length error,
tool_choice allowed_tools; and the worker's prompt-logprobs delta as part of the worker/gateway
protocol. (The reviewer also found logprobs listing fewer tokens than usage counts when a stop
string ends the answer: kept, as 394254e chose, OpenAI's rule that logprobs add up to the text,
tested in test_service; vLLM lists every token.)

One gateway and one stories260K worker (real Redis, real processes), as test_api_semantics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest

from kvstore.protocol import DeltaEvent, TokenLogprob, decode_event, encode_event
from tests.stack import stories_client
from tests.test_api_semantics import _refused

MESSAGES: Any = [{"role": "user", "content": "Once upon a time"}]
PROMPT = "Once upon a time"
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("divergences"), stories_dir) as c:
        yield c


# ----- 2. tool_choice without tools --------------------------------------------------------------


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["auto", "required", "named"],
)  # fmt: skip
def test_tool_choice_without_tools_is_refused(client: openai.OpenAI, choice: Any) -> None:
    """OpenAI answers 400 (param tool_choice) for a tool_choice without tools; "auto" was taken."""
    extras: list[dict[str, Any]] = [{}, {"tools": []}]  # (an empty array: no tools either)
    for extra in extras:
        err = _refused(lambda extra=extra: client.chat.completions.create(
            model="stories", messages=MESSAGES, max_tokens=2, tool_choice=choice,
            extra_body=extra))  # fmt: skip
        assert err["param"] == "tool_choice" and err["type"] == "invalid_request_error"
        assert "tools" in err["message"]


def test_tool_choice_none_without_tools_is_taken(client: openai.OpenAI) -> None:
    """"none" is what no tools mean anyway (the default without tools): taken, as before."""
    resp = client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=2,
                                          tool_choice="none")  # fmt: skip
    assert resp.choices[0].finish_reason == "length"


# ----- 3. a batch's prompt in its context-length error ------------------------------------------


def test_a_batch_prompt_too_long_is_named_by_its_index(client: openai.OpenAI) -> None:
    """A completions batch whose second prompt is past the context: the error named `prompt`;
    it names `prompt[1]`, message and param. A lone prompt is still `prompt`."""
    long = "Once upon a time " * 200
    err = _refused(lambda: client.completions.create(model="stories", prompt=[PROMPT, long],
                                                     max_tokens=4))  # fmt: skip
    assert err["param"] == "prompt[1]" and err["code"] == "context_length_exceeded"
    assert "prompt[1]" in err["message"] and "maximum context length" in err["message"]
    err = _refused(lambda: client.completions.create(model="stories", prompt=long, max_tokens=4))
    assert err["param"] == "prompt" and "prompt[" not in err["message"]


# ----- 4. tool_choice allowed_tools --------------------------------------------------------------


def test_tool_choice_allowed_tools_is_refused_as_such(client: openai.OpenAI) -> None:
    """{"type": "allowed_tools", ...} was refused as if a named choice were misspelt ("a named
    tool_choice is {'type': 'function', ...}"): it is said to be unsupported, by name."""
    choice: Any = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}  # fmt: skip
    err = _refused(lambda: client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=2, tools=TOOLS,
        tool_choice=choice))  # fmt: skip
    assert err["param"] == "tool_choice" and err["code"] == "unsupported_parameter"
    assert "allowed_tools" in err["message"] and "not supported" in err["message"]
    assert "'type': 'function'" not in err["message"]


# ----- 5. the prompt-logprobs delta is part of the protocol -------------------------------------


def test_prompt_delta_is_a_protocol_event() -> None:
    """The first delta of a request that asked for prompt logprobs is the protocol's PromptDelta
    (kvstore.protocol, beside DeltaEvent), documented there; it encodes as one delta line."""
    import kvstore.protocol as protocol
    from kvstore.protocol import PromptDelta  # (was runtime.worker's)

    first = TokenLogprob("▁Once", math.nan, [32, 79], [])
    event = PromptDelta(index=0, text=" upon", token_ids=[7], prompt_logprobs=[first],
                        prompt_text="Once", prompt_ranked=[None])  # fmt: skip
    assert isinstance(event, DeltaEvent)
    line = decode_event(encode_event(event))
    assert line["type"] == "delta" and line["prompt_text"] == "Once"
    assert line["prompt_logprobs"][0]["logprob"] is None  # (NaN: null in JSON)
    doc = protocol.__doc__ or ""
    assert all(name in doc for name in ("PromptDelta", "prompt_logprobs", "prompt_ranked"))
