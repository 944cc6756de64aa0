"""ResponseAssembler: scripted worker event sequences in, OpenAI objects out.

Each object is also parsed by the real `openai` client's types, which is what clients do.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs as CompletionLogprobs

from gateway.errors import APIError
from gateway.openai_api import (
    SSE_DONE,
    RequestOptions,
    ResponseAssembler,
    error_from_event,
    parse_chat,
    parse_completion,
    sse,
)
from kvstore.protocol import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    StartEvent,
    TokenLogprob,
    decode_event,
    encode_event,
)


def _events(*events: Any) -> list[dict[str, Any]]:
    """The events as the gateway sees them: through the NDJSON wire format."""
    return [decode_event(encode_event(e)) for e in events]


def _chat(
    n: int = 1, stream: bool = False, usage: bool = False, logprobs: int | None = None
) -> ResponseAssembler:
    body: dict[str, Any] = {
        "model": "smol",
        "messages": [{"role": "user", "content": "hi"}],
        "n": n,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": usage}
    if logprobs is not None:
        body.update(logprobs=True, top_logprobs=logprobs)
    return ResponseAssembler(parse_chat(body, "r1")[1], "r1", 1700000000)


def _completion(
    n: int = 1, stream: bool = False, usage: bool = False, logprobs: int | None = None
) -> ResponseAssembler:
    body: dict[str, Any] = {"model": "smol", "prompt": "hi", "n": n, "logprobs": logprobs}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": usage}
    return ResponseAssembler(parse_completion(body, "r1")[1], "r1", 1700000000)


def _feed(asm: ResponseAssembler, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    for e in events:
        chunks += asm.on_event(e)
    return chunks


TWO_CHOICES = _events(
    StartEvent("r1", "w-1", 5),
    DeltaEvent(0, "Hel", [1]),
    DeltaEvent(1, "Wor", [2]),
    DeltaEvent(1, "ld", [3], finish_reason="length"),
    DeltaEvent(0, "lo", [4, 5], finish_reason="stop", stop_reason="\n"),
    DoneEvent(prompt_tokens=5, completion_tokens=5, cached_tokens=2),
)
USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 5,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 2},
}


def test_chat_non_streamed_n2_interleaved() -> None:
    asm = _chat(n=2)
    assert _feed(asm, TWO_CHOICES) == []
    assert asm.worker_id == "w-1" and asm.done
    out = asm.final()
    assert out["id"] == "chatcmpl-r1" and out["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "Hello", "stop"),
        (1, "World", "length"),
    ]
    assert out["choices"][0]["stop_reason"] == "\n"
    assert out["choices"][0]["logprobs"] is None
    assert out["usage"] == USAGE
    parsed = ChatCompletion.model_validate(out)
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_stream_order_with_usage() -> None:
    asm = _chat(n=2, stream=True, usage=True)
    chunks = _feed(asm, TWO_CHOICES)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
        assert c["id"] == "chatcmpl-r1" and c["created"] == 1700000000 and c["model"] == "smol"
    # role chunks first, one per choice
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": ""},
    ]
    # usage: null on every chunk, then one last chunk with no choices and the counts
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE
    flat = [(c["choices"][0]["index"], c["choices"][0]) for c in chunks[:-1]]
    assert [(i, ch["delta"], ch["finish_reason"]) for i, ch in flat[2:]] == [
        (0, {"content": "Hel"}, None),
        (1, {"content": "Wor"}, None),
        (1, {"content": "ld"}, None),
        (1, {}, "length"),
        (0, {"content": "lo"}, None),
        (0, {}, "stop"),
    ]
    # the streamed text is the final text
    for i, want in ((0, "Hello"), (1, "World")):
        assert "".join(ch["delta"].get("content", "") for j, ch in flat if j == i) == want
    assert [c["message"]["content"] for c in asm.final()["choices"]] == ["Hello", "World"]


def test_chat_stream_without_usage_has_no_usage_key() -> None:
    chunks = _feed(_chat(n=2, stream=True), TWO_CHOICES)
    assert chunks and all("usage" not in c for c in chunks)
    assert all(c["choices"] for c in chunks)


def test_chat_stream_role_rides_on_first_delta_without_start() -> None:
    asm = _chat(stream=True)
    chunks = _feed(asm, _events(DeltaEvent(0, "x", [1], finish_reason="stop"), DoneEvent(1, 1)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "x"}


def _tool_call_events(rest: str, stop_reason: str | None) -> list[dict[str, Any]]:
    """A forced call whose arguments '{"a": -3, ' go on with `rest`, then a "stop"."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": -3, '}}  # fmt: skip
    return _events(
        StartEvent("r1", "w-1", 3),
        DeltaEvent(0, "", [1, 2], tool_calls=[call]),
        DeltaEvent(0, "", [3], tool_calls=[{"index": 0, "function": {"arguments": rest}}]),
        DeltaEvent(0, "", [4], finish_reason="stop", stop_reason=stop_reason),
        DoneEvent(3, 4),
    )


@pytest.mark.parametrize(
    ("rest", "stop_reason", "finish"),
    [('"b": "x"}', None, "tool_calls"), ("", '"b"', "stop"), ('"b": "x"', "}", "stop")],
)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_finish_only_when_the_last_call_is_whole(
    stream: bool, rest: str, stop_reason: str | None, finish: str
) -> None:
    """A stop string that cut a call's arguments short: "stop", not "tool_calls" (which tells
    a client to run arguments that are not JSON)."""
    asm = _chat(stream=stream)
    chunks = _feed(asm, _tool_call_events(rest, stop_reason))
    choice = ChatCompletion.model_validate(asm.final()).choices[0]
    assert choice.finish_reason == finish
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.arguments == (
        '{"a": -3, ' + rest
    )
    if stream:
        ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert ends[-1] == finish and ends.count(None) == len(ends) - 1


@pytest.mark.parametrize(
    ("arguments", "finish"),
    [
        (["{}"], "tool_calls"),  # a call without arguments (the worker sends "{}")
        ([""], "stop"),  # cut off right after its name
        (["{}", '{"code": "print(1)\nprint(2)\tx"}'], "tool_calls"),  # raw control characters
        (['{"a": NaN}', '{"b": 1}'], "stop"),  # not JSON, if not the last call
        (['{"b": 1}', "1e999"], "stop"),
        # JSON, but no object: a call the client could not send back (its history takes
        # objects, as OpenAI's arguments always are)
        (["null"], "stop"),
        (['{"b": 1}', "[1, 2]"], "stop"),
        (['"x"'], "stop"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_finish_when_every_call_is_json(
    stream: bool, arguments: list[str], finish: str
) -> None:
    """A finish "tool_calls" when every call's arguments are JSON as the worker's parser reads
    it, raw newlines and tabs in strings included (models write them in code; orjson refused
    them: "stop"), or empty (it was "stop"); "stop" when any call's are not (only the last
    call's were read)."""
    calls = [
        {
            "index": i,
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "f", "arguments": a},
        }
        for i, a in enumerate(arguments)
    ]
    asm = _chat(stream=stream)
    chunks = _feed(asm, _events(
        StartEvent("r1", "w-1", 3),
        DeltaEvent(0, "", [1], tool_calls=calls),
        DeltaEvent(0, "", [2], finish_reason="stop"),
        DoneEvent(3, 2),
    ))  # fmt: skip
    choice = ChatCompletion.model_validate(asm.final()).choices[0]
    assert choice.finish_reason == finish
    assert [c.function.arguments for c in choice.message.tool_calls or []] == arguments
    if stream:
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == finish


def _lp(token: str, logprob: float, alts: list[tuple[str, float]]) -> TokenLogprob:
    top = [{"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in alts]
    return TokenLogprob(token, logprob, list(token.encode()), top)


LOGPROB_EVENTS = _events(
    StartEvent("r1", "w-1", 3),
    DeltaEvent(
        0,
        "Hi",
        [7],
        logprobs=[_lp("Hi", -0.5, [("Hi", -0.5), ("Yo", -1.5), ("Hey", -2.0)])],
    ),
    DeltaEvent(
        0,
        " there",
        [8, 9],
        logprobs=[_lp(" th", -math.inf, [(" th", -0.1)]), _lp("ere", 0.0, [])],
        finish_reason="length",
    ),
    DoneEvent(3, 3),
)


def test_chat_logprobs() -> None:
    asm = _chat(stream=True, logprobs=2)
    chunks = _feed(asm, LOGPROB_EVENTS)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    first = chunks[1]["choices"][0]["logprobs"]["content"]
    assert first == [
        {
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [  # three sent, two asked for
                {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
            ],
        }
    ]
    out = asm.final()
    content = out["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in content] == [
        ("Hi", -0.5),
        (" th", -9999.0),  # -inf has no JSON form
        ("ere", 0.0),
    ]
    assert b"null" not in orjson.dumps(content)
    ChatCompletion.model_validate(out)


def test_completion_logprobs_and_offsets() -> None:
    asm = _completion(logprobs=1)
    assert _feed(asm, LOGPROB_EVENTS) == []
    out = asm.final()
    assert out["id"] == "cmpl-r1" and out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["text"] == "Hi there" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " th", "ere"],
        "token_logprobs": [-0.5, -9999.0, 0.0],
        # (each holds the chosen token, with its own logprob; "ere" came with no alternatives)
        "top_logprobs": [{"Hi": -0.5}, {" th": -9999.0}, {"ere": 0.0}],
        "text_offset": [0, 2, 5],
    }
    parsed = Completion.model_validate(out)
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.text_offset == [0, 2, 5]


def test_completion_stream() -> None:
    asm = _completion(n=2, stream=True, usage=True, logprobs=0)
    chunks = _feed(asm, TWO_CHOICES)
    assert chunks[-1] == {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "smol",
        "choices": [],
        "usage": USAGE,
    }
    Completion.model_validate(chunks[-1])
    texts: dict[int, str] = {0: "", 1: ""}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        assert c["usage"] is None
        if choice["finish_reason"] is None:
            # openai's Completion type demands a finish reason that OpenAI's own chunks omit
            Completion.model_validate({**c, "choices": [{**choice, "finish_reason": "stop"}]})
        else:
            Completion.model_validate(c)
    assert texts == {0: "Hello", 1: "World"}
    ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [(e["index"], e["finish_reason"], e["text"]) for e in ends] == [
        (1, "length", ""),
        (0, "stop", ""),
    ]


def test_completion_batch_numbers_choices_by_prompt_and_adds_up_usage() -> None:
    """Two prompts' streams, interleaved: prompt p's choice j is choice p * n + j (OpenAI's
    numbering), usage is the sum, and the answer ends (the usage chunk) with the last stream."""
    body = {"model": "smol", "prompt": ["hi", "yo"], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    asm = ResponseAssembler(parse_completion(body, "r1")[1], "r1", 1700000000)
    second = _events(
        StartEvent("r1-1", "w-2", 3),
        DeltaEvent(1, "B", [7], finish_reason="length"),
        DeltaEvent(0, "A", [8], finish_reason="stop"),
        DoneEvent(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
    )
    chunks = []
    for i in range(max(len(TWO_CHOICES), len(second))):
        for p, events in enumerate((TWO_CHOICES, second)):
            if i < len(events):
                chunks += asm.on_event(events[i], p)
                assert asm.done == (p == 0 and i == len(TWO_CHOICES) - 1)
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "Hello", 1: "World", 2: "A", 3: "B"}
    total = {"prompt_tokens": 8, "completion_tokens": 7, "total_tokens": 15,
             "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == total
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)

    asm = ResponseAssembler(parse_completion({**body, "stream": False, "stream_options": None},
                                             "r1")[1], "r1", 1)  # fmt: skip
    for e in second:
        asm.on_event(e, 1)
    with pytest.raises(APIError):
        asm.final()  # prompt 0 has not answered
    for e in TWO_CHOICES:
        asm.on_event(e, 0)
    out = Completion.model_validate(asm.final())
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (0, "Hello", "stop"), (1, "World", "length"), (2, "A", "stop"), (3, "B", "length")
    ]  # fmt: skip
    assert out.usage is not None and out.usage.model_dump(exclude_none=True) == total
    with pytest.raises(APIError, match="outside"):  # a worker's index is within its own n
        asm.on_event(_events(DeltaEvent(2, "x", [1]))[0], 0)


def test_completion_stream_logprobs_chunk() -> None:
    asm = _completion(stream=True, logprobs=1)
    chunks = _feed(asm, LOGPROB_EVENTS)
    lp = chunks[1]["choices"][0]["logprobs"]
    assert lp == {
        "tokens": [" th", "ere"],
        "token_logprobs": [-9999.0, 0.0],
        "top_logprobs": [{" th": -9999.0}, {"ere": 0.0}],
        "text_offset": [2, 5],
    }
    CompletionLogprobs.model_validate(lp)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_offsets_of_text_held_back(stream: bool) -> None:
    """With stop strings "rl!" and " g!", the worker holds back text that may start one and
    sends it with the next token, or alone: a token starts after the text held back before it
    ("l" at 5, not at its delta's start, 4). A token that holds part of a character starts
    where the character does."""
    events = _events(
        StartEvent("r1", "w-1", 3),
        DeltaEvent(0, "a g", [1, 2], logprobs=[_lp("a", -0.1, []), _lp(" g", -0.2, [])]),
        DeltaEvent(0, "i", [3], logprobs=[_lp("ir", -0.3, [])]),  # "r" held back
        DeltaEvent(0, "rl", [4], logprobs=[_lp("l", -0.4, [])]),
        DeltaEvent(0, "", [2], logprobs=[_lp(" g", -0.2, [])]),  # " g" held back
        DeltaEvent(0, " g", []),  # sent alone
        DeltaEvent(0, " ", [5], logprobs=[_lp(" ", -0.5, [])]),
        DeltaEvent(0, "", [6], logprobs=[TokenLogprob("bytes:\\xc3", -0.6, [0xC3], [])]),
        DeltaEvent(0, "é", [7], logprobs=[TokenLogprob("bytes:\\xa9", -0.7, [0xA9], [])]),
        DeltaEvent(0, "s", [8], logprobs=[_lp("s", -0.8, [])], finish_reason="length"),
        DoneEvent(3, 9),
    )  # fmt: skip
    asm = _completion(stream=stream, logprobs=0)
    chunks = _feed(asm, events)
    offsets = [o for c in chunks if c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]  # fmt: skip
    choice = asm.final()["choices"][0]
    assert choice["text"] == "a girl g és"
    assert choice["logprobs"]["text_offset"] == [0, 1, 3, 5, 6, 8, 9, 9, 10]
    assert offsets == (choice["logprobs"]["text_offset"] if stream else [])


@pytest.mark.parametrize(("logprobs", "want"), [
    (0, {"b": -2.0}),
    (1, {"b": -2.0, "a": -0.1}),
    (2, {"b": -2.0, "a": -0.1, "c": -0.2}),
])  # fmt: skip
def test_completion_alternatives_hold_the_chosen_token(logprobs: int, want: dict) -> None:  # type: ignore[type-arg]
    # A sampled token outside the top alternatives: the legacy API still lists it (up to
    # logprobs + 1 entries, as OpenAI and vLLM answer); it was missing, and logprobs 0 gave {}
    events = _events(
        StartEvent("r1", "w-1", 3),
        DeltaEvent(
            0, "b", [5], logprobs=[_lp("b", -2.0, [("a", -0.1), ("c", -0.2)])], finish_reason="length"
        ),
        DoneEvent(3, 1),
    )
    for stream in (False, True):
        asm = _completion(stream=stream, logprobs=logprobs)
        chunks = _feed(asm, events)
        lp = chunks[0]["choices"][0]["logprobs"] if stream else asm.final()["choices"][0]["logprobs"]
        assert lp["top_logprobs"] == [want]
        assert next(iter(lp["top_logprobs"][0])) == "b"  # the chosen one first, as vLLM has it


@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        ("internal_error", 500, "server_error"),
        ("engine_dead", 503, "server_error"),
        ("draining", 503, "server_error"),
    ],
)
def test_error_event_raises(code: str, status: int, type_: str) -> None:
    asm = _chat(stream=True)
    asm.on_event(_events(StartEvent("r1", "w", 1))[0])
    with pytest.raises(APIError) as info:
        asm.on_event(_events(ErrorEvent("engine died", code))[0])
    assert (info.value.status, info.value.type, info.value.code) == (status, type_, code)
    assert info.value.message == "engine died"


def test_abort_is_a_retryable_error_not_a_finish_reason() -> None:
    asm = _chat()
    with pytest.raises(APIError) as info:
        _feed(asm, _events(DeltaEvent(0, "par", [1], finish_reason="abort")))
    assert (info.value.status, info.value.code, info.value.retryable) == (503, "aborted", True)


@pytest.mark.parametrize(
    "event",
    [
        {"type": "delta", "index": 1, "text": "x", "token_ids": []},
        {"type": "delta", "index": "0", "text": "x", "token_ids": []},
        {"type": "delta", "index": 0, "token_ids": []},
        {"type": "delta", "index": 0, "text": 5, "token_ids": []},
        {"type": "delta", "index": 0, "text": "x", "finish_reason": "weird"},
        {"type": "delta", "index": 0, "text": "x", "logprobs": [{"token": "x"}]},
        {"type": "delta", "index": 0, "text": "x", "logprobs": "x"},
        {"type": "done", "prompt_tokens": 1, "completion_tokens": 0},  # choice 0 never finished
        {"type": "done"},
    ],
)
def test_malformed_events_are_502(event: dict[str, Any]) -> None:
    asm = _chat(logprobs=0)
    if event["type"] == "done" and "prompt_tokens" not in event:
        asm.on_event({"type": "delta", "index": 0, "text": "", "finish_reason": "stop"})
    with pytest.raises(APIError) as info:
        asm.on_event(event)
    assert info.value.status == 502


def test_final_before_done_is_502() -> None:
    asm = _chat()
    asm.on_event(_events(DeltaEvent(0, "x", [1]))[0])
    with pytest.raises(APIError) as info:
        asm.final()
    assert (info.value.status, info.value.code) == (502, "incomplete_stream")


def test_unknown_event_type_is_ignored() -> None:
    assert _chat(stream=True).on_event({"type": "progress", "x": 1}) == []


def test_sse_framing() -> None:
    obj = {"a": "é\n", "b": None}
    frame = sse(obj)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert b"\n" not in frame[:-2]  # one line: a newline inside would split the event
    assert orjson.loads(frame[6:-2]) == obj
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_error_chunk_shape() -> None:
    assert error_from_event({"type": "error", "message": "engine died"}).body() == {
        "error": {
            "message": "engine died",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }


@pytest.mark.parametrize(
    ("code", "kind"),
    [("shutdown", "server_error"), ("engine_dead", "server_error"),
     ("constraint_failed", "invalid_request_error"), ("oops", "server_error")],
)  # fmt: skip
def test_an_error_chunk_is_typed_by_its_code(code: str, kind: str) -> None:
    """Typed as the same failure before the first byte is answered (a constraint that failed is
    the request's fault, as its 400 would have been; a worker shutting down a 503's server_error,
    retried by clients)."""
    chunk = error_from_event({"type": "error", "message": "x", "code": code}).body()["error"]
    assert (chunk["type"], chunk["code"]) == (kind, code)


def test_options_are_what_parse_returns() -> None:
    opts = RequestOptions("chat", "m", True, True, 1, None)
    asm = ResponseAssembler(opts, "x", 1)
    assert asm.id == "chatcmpl-x"


def test_an_error_mid_stream_keeps_the_workers_code() -> None:
    """A worker that fails a stream after its first token (its drain timed out: "shutdown")
    says why in its error event; the client's error chunk carries that code, not a generic one."""
    import asyncio

    from gateway.proxy import Proxy

    class Written:
        def __init__(self) -> None:
            self.data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    resp = Written()
    asm = _completion(stream=True)
    error = {"type": "error", "message": "worker is shutting down", "code": "shutdown"}
    ended = asyncio.run(Proxy._relay(resp, asm, 0, [error]))  # type: ignore[arg-type]
    body = orjson.loads(resp.data.removeprefix(b"data: ").strip())
    assert ended is not None and ended.code == "shutdown" and body == ended.body()
    assert body["error"]["message"] == "worker is shutting down"
    assert body["error"]["type"] == "server_error"  # (as a 503 before the first byte)
