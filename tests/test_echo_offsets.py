"""Completions' `logprobs.text_offset` with `echo`: each token's offset is where its text begins
in the returned text (the prompt's text, then the completion's: OpenAI's meaning), for the echoed
prompt's tokens as for the generated ones (gateway.openai_response._TextOffsets). A token that
shows nothing there (a bos "<s>") is zero-width where the next text begins; SentencePiece's first
token "▁Once" begins at "Once"; the generated tokens go on from the prompt's end.

Before, the prompt's offsets were its token strings' lengths added up ("<s>" and the first
token's space counted) and cut at the prompt's end, so none pointed at its token, and the last
prompt token's offset was len(prompt), the first generated token's (a reviewer's report)."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.openai_api import ResponseAssembler, parse_completion
from kvstore.protocol import (
    DeltaEvent,
    DoneEvent,
    PromptDelta,
    StartEvent,
    TokenLogprob,
    decode_event,
    encode_event,
)
from tests.stack import stories_client

PROMPT = "Once upon a time,"  # stories260K's tokens, as its worker shows them:
PROMPT_TOKENS = ["<s>", " Once", " upon", " a", " time", ","]
IDS_TEXT = "Tom had a ball."  # a prompt sent as token ids: the worker's decoding of them
IDS_TOKENS = ["<s>", " T", "om", " had", " a", " ball", "."]


def _tok(token: str, raw: bytes | None = None) -> TokenLogprob:
    return TokenLogprob(token, -0.5, list(token.encode() if raw is None else raw), [])


def _stream(tokens: list[str], text: str, n: int, generated: list[list[str]]) -> list[Any]:
    """One prompt's worker stream: the prompt's logprobs ride on the first delta (choice 0's)."""
    prompt = [_tok(t) for t in tokens]
    prompt[0].logprob = math.nan  # (nothing precedes it)
    events: list[Any] = [StartEvent("r1", "w-1", len(tokens))]
    for j in range(n):
        for k, t in enumerate(generated[j]):
            end = "length" if k == len(generated[j]) - 1 else None
            delta = DeltaEvent(j, t, [9], logprobs=[_tok(t)], finish_reason=end)
            if j == k == 0:
                delta = PromptDelta(**{f.name: getattr(delta, f.name) for f in fields(delta)},
                                    prompt_logprobs=prompt, prompt_text=text)  # fmt: skip
            events.append(delta)
    events.append(DoneEvent(len(tokens), sum(map(len, generated))))
    return [decode_event(encode_event(e)) for e in events]


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_offsets_point_at_their_tokens(stream: bool) -> None:
    """A batch of a text prompt and a token-id prompt, n=2, whole and streamed."""
    body: dict[str, Any] = {"model": "stories", "prompt": [PROMPT, [1, 7, 8, 9, 10, 11, 12]],
                            "n": 2, "echo": True, "logprobs": 0, "max_tokens": 2,
                            "stream": stream}  # fmt: skip
    asm = ResponseAssembler(parse_completion(body, "r1")[1], "r1", 1700000000)
    gen = [[" there", " was"], [" the", "re"]]
    chunks = []
    for p, (tokens, text) in enumerate(((PROMPT_TOKENS, PROMPT), (IDS_TOKENS, IDS_TEXT))):
        for e in _stream(tokens, text, 2, gen):
            chunks += asm.on_event(e, p)
    out = asm.final()
    # "Once upon a time," then " there was" / " there"; "Tom had a ball." then the same
    want = {0: [0, 0, 4, 9, 11, 16, 17, 23], 1: [0, 0, 4, 9, 11, 16, 17, 21],
            2: [0, 0, 1, 3, 7, 9, 14, 15, 21], 3: [0, 0, 1, 3, 7, 9, 14, 15, 19]}  # fmt: skip
    for c in out["choices"]:
        lp = c["logprobs"]
        assert c["text"] == (PROMPT, IDS_TEXT)[c["index"] // 2] + "".join(gen[c["index"] % 2])
        assert lp["text_offset"] == want[c["index"]], c["index"]
        shown = [(t, c["text"][o:]) for t, o in zip(lp["tokens"], lp["text_offset"], strict=True)]
        assert all(rest.startswith((t, t.lstrip(" "))) for t, rest in shown if t != "<s>")
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            streamed.setdefault(c["index"], []).extend((c["logprobs"] or {}).get("text_offset", []))
    assert streamed == (want if stream else {})


def test_tokens_the_text_does_not_show_as_they_are() -> None:
    """A character split over byte tokens (both begin where it does), an "<unk>" standing for a
    character it lost (the next token is found past it), and a special token in the generated
    text (zero-width, where the next text begins)."""
    body = {"model": "stories", "prompt": "Cafébar€x", "echo": True, "logprobs": 0,
            "max_tokens": 3}  # fmt: skip
    asm = ResponseAssembler(parse_completion(body, "r1")[1], "r1", 1)
    prompt = [_tok("<s>"), _tok(" Caf"), _tok("bytes:\\xc3", b"\xc3"), _tok("bytes:\\xa9", b"\xa9"),
              _tok("bar"), _tok(" ⁇ "), _tok("x")]  # fmt: skip
    events: list[Any] = [
        StartEvent("r1", "w-1", len(prompt)),
        PromptDelta(0, " y", [5], logprobs=[_tok(" y")], prompt_logprobs=prompt),
        DeltaEvent(0, " z", [6, 7], logprobs=[_tok("<|im_end|>"), _tok(" z")]),
        DeltaEvent(0, "", [], finish_reason="length"),
        DoneEvent(len(prompt), 3),
    ]
    for e in events:
        asm.on_event(decode_event(encode_event(e)))
    choice = asm.final()["choices"][0]
    assert choice["text"] == "Cafébar€x y z"
    assert choice["logprobs"]["text_offset"] == [0, 0, 3, 3, 4, 7, 8, 9, 11, 11]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("offsets"), stories_dir) as c:
        yield c


def test_echo_offsets_on_the_service(client: openai.OpenAI, stories_dir: Path) -> None:
    """The real worker's tokens: every token with text is found at its offset (its leading space
    aside), "<s>" at 0; the prompt's within it, the generated from its end on; streamed as
    whole. A batch of a text and a token-id prompt, n=2."""
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(stories_dir)
    texts = ["Once upon a time, there was a little girl named Lily.", 'Tom said:  "Café 😀!"\nOk']
    ids = tokenizer.encode(texts[1])
    body: dict[str, Any] = {"model": "stories", "prompt": [texts[0], ids], "n": 2, "echo": True,
                            "logprobs": 1, "max_tokens": 4, "temperature": 0.9, "seed": 3}  # fmt: skip
    whole = client.completions.create(**body)
    streamed: dict[int, list[int]] = {}
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(
                (c.logprobs.text_offset or []) if c.logprobs else []
            )
    for c in whole.choices:
        prompt = (texts[0], tokenizer.decode(ids))[c.index // 2]
        n_prompt = len(tokenizer.encode(prompt))
        lp = c.logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        assert c.text.startswith(prompt) and len(lp.tokens) == n_prompt + 4
        offsets = lp.text_offset
        assert offsets == sorted(offsets) and offsets == streamed[c.index]
        assert lp.tokens[0] == "<s>" and offsets[0] == 0
        assert all(o < len(prompt) for o in offsets[:n_prompt])
        assert offsets[n_prompt] == len(prompt)
        for t, o in zip(lp.tokens[1:], offsets[1:], strict=True):
            shown = t.startswith("bytes:") or c.text.startswith((t, t.lstrip(" ")), o)
            assert shown, (t, o, c.text)
