"""logit_bias (OpenAI's, vLLM's): token id -> bias in [-100, 100] added to the logits before
sampling, greedy included; logprobs are of the logits before it (vLLM's default raw logprobs).
Checked in the sampler on hand-made logits, in the engine on stories260K (a ban, a forced token,
a zero bias, speculative decoding), and through the service with the real `openai` client."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from gateway.errors import APIError
from gateway.openai_api import parse_chat, parse_completion
from runtime import LLM, SamplingParams
from runtime.sampler import Sampler, SamplingState
from runtime.sampling_params import InvalidRequestError
from tests.stack import stories_client

PROMPT = "Once upon a time"


def _state(**kwargs: Any) -> SamplingState:
    return SamplingState(SamplingParams(**kwargs), None, [1], [])


# ----- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bias", "text"),
    [
        ([1, 2], "must be an object"),
        ({"x": 1}, "keys must be token ids"),
        ({"-1": 1}, "keys must be token ids"),
        ({-1: 1}, "must be >= 0"),
        ({"5": 100.5}, "must be in [-100, 100], got 100.5 for token 5"),
        ({"5": -101}, "must be in [-100, 100]"),
        ({"5": float("nan")}, "token 5: must be a finite number"),
        ({"5": "1"}, "token 5: must be a number"),
        ({"5": True}, "token 5: must be a number"),
        ({5: 1, "5": 2}, "token 5 is given twice"),
        ({str(i): 1 for i in range(301)}, "at most 300 tokens, got 301"),
    ],
)
def test_logit_bias_is_validated_naming_the_field_and_the_limit(bias: Any, text: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias" and text in e.value.message, e.value.message


def test_logit_bias_takes_string_keys_and_drops_zero_biases() -> None:
    p = SamplingParams(logit_bias={"7": -100, 9: 2.5, "11": 0})
    assert p.logit_bias == {7: -100.0, 9: 2.5}
    assert SamplingParams(logit_bias=None).logit_bias == {}
    assert SamplingParams(logit_bias={str(i): 1 for i in range(300)}).logit_bias


def test_a_token_outside_the_vocabulary_is_refused_before_the_scheduler(llm: LLM) -> None:
    engine = llm.engine
    vocab = engine.model.cfg.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("oov", PROMPT, SamplingParams(logit_bias={vocab: 1}))
    assert e.value.param == "logit_bias" and f"[0, {vocab})" in e.value.message
    assert not engine.has_unfinished()


# ----- the sampler ------------------------------------------------------------------------------


def test_the_sampler_biases_only_the_rows_that_have_one_and_leaves_logits_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    before = logits.clone()
    best = logits.argmax(dim=-1).tolist()
    states = [
        _state(temperature=0, logit_bias={best[0]: -100}),  # banned: the second best
        _state(temperature=0),
        _state(temperature=0, logit_bias={7: 100}, logprobs=2),  # forced, logprobs raw
        _state(temperature=1.0, logit_bias={3: 100}),  # forced under sampling too
    ]
    out = Sampler()(logits, states)
    assert torch.equal(logits, before)  # put back after the draw
    assert out.token_ids[0] == before[0].topk(2).indices[1].item()
    assert out.token_ids[1] == best[1]
    assert out.token_ids[2] == 7 and out.token_ids[3] == 3
    lp = out.logprobs[2]
    assert lp is not None
    raw = torch.log_softmax(before[2], dim=-1)
    assert lp.logprob == pytest.approx(raw[7].item())  # before the bias
    assert [t for t, _ in lp.top] == raw.topk(2).indices.tolist()


def test_a_ban_holds_for_sampled_rows_with_truncation_and_penalties() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 20) * 3
    top = logits.argmax().item()
    for kwargs in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.2}, {"repetition_penalty": 1.3},
                   {"temperature": 2.0, "frequency_penalty": 1.0}):  # fmt: skip
        rows = [_state(logit_bias={top: -100}, **kwargs) for _ in range(200)]
        out = Sampler()(logits.expand(200, -1).contiguous(), rows)
        assert top not in out.token_ids, kwargs


# ----- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> LLM:
    return LLM(stories_dir, kv_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].token_ids


def test_a_banned_token_never_appears(llm: LLM, greedy: list[int]) -> None:
    banned = {t: -100.0 for t in set(greedy[:5])}
    for params in (SamplingParams(temperature=0, max_tokens=20, logit_bias=banned),
                   SamplingParams(temperature=1.0, max_tokens=20, n=8, seed=3,
                                  logit_bias=banned)):  # fmt: skip
        for o in llm.generate(PROMPT, params)[0].outputs:
            assert not set(o.token_ids) & set(banned), o.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_a_token_under_greedy_and_sampling(llm: LLM, temperature: float) -> None:
    forced = 300  # a token the greedy path never takes
    params = SamplingParams(temperature=temperature, max_tokens=6, n=2, ignore_eos=True,
                            logit_bias={str(forced): 100}, logprobs=1)  # fmt: skip
    for o in llm.generate(PROMPT, params)[0].outputs:
        assert o.token_ids == [forced] * 6
        assert o.logprobs is not None
        assert all(lp.logprob < -1 for lp in o.logprobs)  # the model's, before the bias


def test_an_empty_or_zero_bias_is_the_same_as_none(llm: LLM, greedy: list[int]) -> None:
    for bias in ({}, {"5": 0}, {greedy[0]: 0.0}):
        got = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, logit_bias=bias))
        assert got[0].outputs[0].token_ids == greedy
    seeded = [SamplingParams(temperature=1.0, seed=11, max_tokens=12, logprobs=2, logit_bias=b)
              for b in (None, {"9": 0})]  # fmt: skip
    a, b = (llm.generate(PROMPT, p)[0].outputs[0] for p in seeded)
    assert a.token_ids == b.token_ids
    assert [x.logprob for x in a.logprobs or []] == [x.logprob for x in b.logprobs or []]


def test_biased_requests_beside_plain_ones_in_one_batch(llm: LLM, greedy: list[int]) -> None:
    prompts = [PROMPT] * 4
    params = [SamplingParams(temperature=0, max_tokens=20, logit_bias={greedy[0]: -100} if i % 2
                             else {}) for i in range(4)]  # fmt: skip
    outs = llm.generate(prompts, params)
    for i, o in enumerate(outs):
        ids = o.outputs[0].token_ids
        assert (greedy[0] not in ids) if i % 2 else ids == greedy


def test_speculative_decoding_leaves_biased_requests_out(stories_dir: Path) -> None:
    spec = LLM(stories_dir, kv_cache_bytes=1 << 22,
               speculative={"num_tokens": 4, "max_batch_tokens": 64})  # fmt: skip
    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
             "in the park. One day, she saw a big red ball under a tree and ran to get it. ")  # fmt: skip
    plain = spec.generate(story * 2, SamplingParams(temperature=0, max_tokens=40))[0]
    assert plain.spec_proposed > 0  # (the prompt repeats: n-gram drafts for the plain one)
    banned = plain.outputs[0].token_ids[10]
    params = SamplingParams(temperature=0, max_tokens=40, logit_bias={banned: -100})
    out = spec.generate(story * 2, params)[0]
    assert banned not in out.outputs[0].token_ids
    assert out.spec_proposed == 0


# ----- the gateway ------------------------------------------------------------------------------


def _sampling(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        reqs, _ = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                              **body}, "r")  # fmt: skip
    else:
        reqs, _ = parse_completion({"model": "m", "prompt": "x", **body}, "r")
    return reqs[0].sampling


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_gateway_sends_logit_bias_on(kind: str) -> None:
    got = _sampling(kind, {"logit_bias": {"50256": -100, "7": 0, "3": 2}})
    assert got["logit_bias"] == {"50256": -100.0, "3": 2.0}
    assert SamplingParams(**got).logit_bias == {50256: -100.0, 3: 2.0}
    assert _sampling(kind, {"logit_bias": None})["logit_bias"] == {}


@pytest.mark.parametrize(
    ("bias", "text"),
    [
        ("x", "must be an object"),
        ({"a": 1}, "keys must be token ids"),
        ({"-3": 1}, "keys must be token ids"),
        ({"99999999999": 1}, "keys must be token ids"),
        ({"3": 101}, "must be a number in [-100, 100], got 101"),
        ({"3": "1"}, "must be a number in [-100, 100], got string"),
        ({str(i): 1 for i in range(301)}, "at most 300 tokens, got 301"),
        ({"7" * 5000: 1}, "keys must be token ids"),  # (int() of it raised: a 500)
        ({"12": 1, "012": -1}, "gives token 12 twice"),  # (the second silently won)
        ({"012": 0, "12": 5}, "gives token 12 twice"),
    ],
)
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_gateway_refuses_a_bad_logit_bias(kind: str, bias: Any, text: str) -> None:
    with pytest.raises(APIError) as e:
        _sampling(kind, {"logit_bias": bias})
    assert e.value.status == 400
    error = e.value.body()["error"]
    assert error["param"] == "logit_bias" and text in error["message"], error


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("logit_bias"), stories_dir) as c:
        yield c


def test_completions_through_the_openai_client(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="stories", prompt=PROMPT, max_tokens=8,
                                      temperature=0, logprobs=1)  # fmt: skip
    first = plain.choices[0].logprobs.tokens[0]  # type: ignore[union-attr]
    ids = client.completions.create(model="stories", prompt=PROMPT, max_tokens=8,
                                    temperature=0, logit_bias={"300": 100}, logprobs=0)  # fmt: skip
    forced = ids.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert len(set(forced)) == 1 and forced[0] != first
    zero = client.completions.create(model="stories", prompt=PROMPT, max_tokens=8,
                                     temperature=0, logprobs=1, logit_bias={"300": 0})  # fmt: skip
    assert zero.choices[0].text == plain.choices[0].text


def test_chat_through_the_openai_client(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Tell me a story"}]
    plain = client.chat.completions.create(model="stories", messages=messages, max_tokens=10,
                                           temperature=0, logprobs=True)  # fmt: skip
    content = plain.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    first = content[0].token
    r = client.chat.completions.create(model="stories", messages=messages, max_tokens=10,
                                       temperature=0.8, seed=1, logprobs=True,
                                       logit_bias={"300": 100})  # fmt: skip
    tokens = [c.token for c in r.choices[0].logprobs.content or []]  # type: ignore[union-attr]
    assert tokens and len(set(tokens)) == 1 and tokens[0] != first
    assert all(c.logprob < -1 for c in r.choices[0].logprobs.content or [])  # type: ignore[union-attr]
    assert not math.isnan(r.choices[0].logprobs.content[0].logprob)  # type: ignore[union-attr, index]


def test_errors_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=2,
                                  logit_bias={"100000": 5})  # fmt: skip
    assert e.value.status_code == 400
    assert "logit_bias" in str(e.value) and "vocabulary [0, 512)" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stories", max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}],
                                       logit_bias={"3": 150})  # fmt: skip
    assert "[-100, 100]" in str(e.value)
