"""OpenAI request fields and response shapes through the service (gateway, worker, Redis), with
the real `openai` client: what a client asks for is what it gets, or a 400 naming the field.

The parsers' rules one by one are in test_openai_api.py, the assembler's in
test_openai_response.py; here the same requests go through a gateway and a stories260K worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.stack import stories_client

MESSAGES: Any = [{"role": "user", "content": "Once upon a time"}]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("semantics"), stories_dir) as c:
        yield c


def _refused(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return orjson.loads(info.value.response.content)["error"]  # type: ignore[no-any-return]


def test_completion_refuses_chats_max_completion_tokens(client: openai.OpenAI) -> None:
    """/v1/completions reads max_tokens; chat's max_completion_tokens was ignored, so a client
    that asked for 40 tokens got the default 16 with finish_reason "length" and no error."""
    err = _refused(lambda: client.completions.create(
        model="stories", prompt=PROMPT, extra_body={"max_completion_tokens": 40}))  # fmt: skip
    assert err["param"] == "max_completion_tokens" and "max_tokens" in err["message"]
    same = client.completions.create(model="stories", prompt=PROMPT, max_tokens=3, temperature=0,
                                     extra_body={"max_completion_tokens": 3})  # fmt: skip
    assert same.usage is not None and same.usage.completion_tokens == 3


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_an_empty_stop_string_names_stop(client: openai.OpenAI, chat: bool) -> None:
    """A string `stop` is refused as `stop`, not as `stop[0]`, an element it does not have."""
    if chat:
        err = _refused(lambda: client.chat.completions.create(
            model="stories", messages=MESSAGES, stop=""))  # fmt: skip
    else:
        err = _refused(lambda: client.completions.create(model="stories", prompt=PROMPT, stop=""))
    assert err["param"] == "stop" and "non-empty string" in err["message"]
    err = _refused(
        lambda: client.completions.create(model="stories", prompt=PROMPT, stop=["a", ""])
    )
    assert err["param"] == "stop[1]"


def test_n_choices_streamed_as_whole(client: openai.OpenAI) -> None:
    """n choices, streamed with include_usage, are the seeded whole answer's: each index once
    with its role, its own finish reason, and usage (the prompt once, every choice's tokens)
    only on the last chunk, with no choices."""
    kw: Any = {"model": "stories", "messages": MESSAGES, "n": 3, "max_tokens": 12, "seed": 5,
               "stop": ["."]}  # fmt: skip
    whole = client.chat.completions.create(**kw)
    texts: dict[int, str] = {}
    roles: list[int] = []
    finish: dict[int, str] = {}
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))  # fmt: skip
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        c = chunk.choices[0]
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        roles += [c.index] if c.delta.role else []
        if c.finish_reason:
            assert c.index not in finish
            finish[c.index] = c.finish_reason
    assert sorted(roles) == [0, 1, 2]
    assert [(c.message.content, c.finish_reason) for c in whole.choices] == [
        (texts[i], finish[i]) for i in range(3)
    ]
    usage, last = whole.usage, chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and last is not None
    counts = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert (last.prompt_tokens, last.completion_tokens, last.total_tokens) == counts
    assert usage.prompt_tokens < 20 and counts[2] == counts[0] + counts[1]
    without = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None and c.choices for c in without)


def test_a_stop_string_across_tokens_streamed_as_whole(client: openai.OpenAI) -> None:
    """A stop string made of several tokens ends the text before it, streamed or not, and none
    of it is streamed before the match is known."""
    kw: Any = {"model": "stories", "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    free = client.completions.create(**kw).choices[0].text
    start = free.index("little") + 2  # " little girl": the stop string starts inside a token
    stop = free[start : start + 6]
    whole = client.completions.create(stop=stop, **kw).choices[0]
    assert (whole.text, whole.finish_reason) == (free[:start], "stop")
    streamed = list(client.completions.create(stop=[stop, "zzz"], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == free[:start]
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_of_text_held_back_for_a_stop_string(
    client: openai.OpenAI, stream: bool
) -> None:
    """Stop strings that the text never holds, each starting with a token's last character:
    the worker holds that character back until the next token shows no stop string follows.
    The text, tokens and offsets are those of the same request without stop strings (a token
    after a held-back character was placed at the delta's start, one character early)."""
    kw: Any = {"model": "stories", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
               "logprobs": 0}  # fmt: skip
    free = client.completions.create(**kw).choices[0]
    assert free.logprobs is not None and free.logprobs.tokens is not None
    stops = sorted({t[-1] + "\x00QQ" for t in free.logprobs.tokens})[:16]
    if stream:
        chunks = list(client.completions.create(stop=stops, stream=True, **kw))
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for lp in lps for t in lp.tokens or []]
        offsets = [o for lp in lps for o in lp.text_offset or []]
    else:
        held = client.completions.create(stop=stops, **kw).choices[0]
        assert held.logprobs is not None
        text, tokens, offsets = held.text, held.logprobs.tokens, held.logprobs.text_offset
    assert (text, tokens) == (free.text, free.logprobs.tokens)
    assert offsets == free.logprobs.text_offset


def test_min_tokens_as_vllm_takes_it(client: openai.OpenAI, stories_dir: Path) -> None:
    """vLLM's min_tokens, an extra body field of both endpoints (it was a 400): the stop token
    greedy emits second cannot end the completion before min_tokens tokens; the text is the
    Python API's for the same request, streamed or not, n > 1 and logprobs alike."""
    from runtime import LLM, SamplingParams

    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    stop = greedy.outputs[0].token_ids[1]
    kw: Any = {"model": "stories", "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    early = client.completions.create(**kw, extra_body={"stop_token_ids": [stop]})
    assert early.usage is not None and early.usage.completion_tokens == 2
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=6, stop_token_ids=[stop])
    want = llm.generate(PROMPT, params)[0].outputs[0]
    assert len(want.token_ids) > 6
    extra = {"stop_token_ids": [stop], "min_tokens": 6}
    got = client.completions.create(**kw, n=2, logprobs=2, extra_body=extra)
    assert got.usage is not None and got.usage.completion_tokens == 2 * len(want.token_ids)
    for c in got.choices:
        assert (c.text, c.finish_reason) == (want.text, want.finish_reason)
        assert c.logprobs is not None and c.logprobs.tokens is not None
        assert "".join(c.logprobs.tokens) == want.text
    streamed = list(client.completions.create(**kw, stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    # chat: as many tokens as asked for, min_tokens being max_tokens (no stop string or token
    # may end it first)
    answer = client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=20, temperature=0, stop=["."],
        extra_body={"min_tokens": 20, "stop_token_ids": [stop]},
    )  # fmt: skip
    assert answer.usage is not None and answer.usage.completion_tokens == 20
    assert answer.choices[0].finish_reason == "length"
    assert "." in (answer.choices[0].message.content or "")


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (endpoint, fields, the param named, a piece of the message: the limit)
    ("chat", {"n": "2"}, "n", "[1, 16]"),
    ("chat", {"stop": 5}, "stop", "string or an array"),
    ("chat", {"messages": {}}, "messages", "non-empty array"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "[1, "),
    ("chat", {"max_tokens": -1}, "max_tokens", "[1, "),
    ("chat", {"max_completion_tokens": 100000}, "max_completion_tokens", "at most"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "logprobs: true"),
    ("chat", {"temperature": 2.5}, "temperature", "[0, 2]"),
    ("chat", {"top_p": 0}, "top_p", "(0, 1]"),
    ("chat", {"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ("chat", {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ("chat", {"logit_bias": {"abc": 5}}, "logit_bias", "keys must be token ids"),
    ("chat", {"logit_bias": {"5": 500}}, "logit_bias", "[-100, 100]"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ("chat", {"user": 5}, "user", "string"),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        "messages[0].content[1].type",
        "only text content parts",
    ),
    ("completion", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("completion", {"best_of": 2}, "best_of", "null, 1 or n"),
    ("completion", {"echo": "yes"}, "echo", "boolean"),
    ("completion", {"echo": True, "max_tokens": -1}, "max_tokens", "[0, "),
    ("completion", {"suffix": "The end."}, "suffix", "not supported"),
    ("completion", {"max_tokens": 0}, "max_tokens", "[1, "),
    ("completion", {"seed": "1"}, "seed", "integer"),
    ("completion", {"max_tokens": 4, "min_tokens": 5}, "min_tokens", "at most max_tokens (4)"),
    ("chat", {"min_tokens": -1}, "min_tokens", "[0, "),
]


@pytest.mark.parametrize(("kind", "fields", "param", "text"), BAD, ids=repr)
def test_bad_fields_are_400s_naming_them(
    client: openai.OpenAI, kind: str, fields: dict[str, Any], param: str, text: str
) -> None:
    # (extra_body: the fields as sent, the client's types would refuse some; they win over
    # messages and prompt, which the client requires)
    if kind == "chat":
        err = _refused(lambda: client.chat.completions.create(
            model="stories", messages=MESSAGES, extra_body=fields))  # fmt: skip
    else:
        err = _refused(lambda: client.completions.create(
            model="stories", prompt=PROMPT, extra_body=fields))  # fmt: skip
    assert err["param"] == param and text in err["message"], err
    assert err["type"] == "invalid_request_error"
