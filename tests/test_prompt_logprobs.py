"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's) and the completions API's `echo`
(what lm-eval-harness's loglikelihood tasks send: echo, logprobs, max_tokens 0 or 1).

The engine's prompt logprobs are checked against transformers' log_softmax on stories260K,
through chunked prefill, n > 1, a prompt already in the prefix cache and a preemption; the
service's echo with the real `openai` client."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from gateway.openai_api import parse_completion
from runtime import LLM, SamplingParams
from runtime.sampling_params import InvalidRequestError
from tests.stack import stories_client

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside."


@pytest.fixture(scope="module")
def reference(stories_dir: Path):  # type: ignore[no-untyped-def]
    """log_softmax of transformers' logits for a prompt: (T, V) float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)

    return logprobs


def _check(lps: list[Any] | None, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for i in range(1, len(ids)):
        lp = lps[i]
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-5)
        top = ref[i - 1].topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist() or k == 0
        for (_, v), want in zip(lp.top, top.values.tolist(), strict=True):
            assert v == pytest.approx(want, abs=2e-5)


def test_prompt_logprobs_is_validated() -> None:
    for bad, text in ((-1, "[0, 20]"), (21, "[0, 20]"), (1.5, "integer"), (True, "integer")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs" and text in e.value.message


@pytest.mark.parametrize("chunk", [4, 7, 512])
def test_prompt_logprobs_match_transformers_through_chunked_prefill(
    stories_dir: Path, reference: Any, chunk: int
) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, max_num_batched_tokens=chunk)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    _check(out.prompt_logprobs, ids, reference(ids), 3)
    # the generated tokens are the same as without prompt logprobs
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs(stories_dir: Path,
                                                            reference: Any) -> None:  # fmt: skip
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, block_size=4)
    first = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0]
    again = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # the prompt is in the prefix cache
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1,
                                              n=3))[0]  # fmt: skip
    assert out.num_cached_tokens == 0  # (vLLM's requests with prompt logprobs skip it too)
    _check(out.prompt_logprobs, first.prompt_token_ids, reference(first.prompt_token_ids), 1)
    assert all(o.token_ids == first.outputs[0].token_ids for o in out.outputs)
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # every block freed (cached ones kept)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running


def test_prompt_logprobs_beside_other_requests_in_a_batch(stories_dir: Path,
                                                          reference: Any) -> None:  # fmt: skip
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)
    prompts = [PROMPT, "Tom had a red ball.", PROMPT[:30], "The sun"]
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2 if i % 2 == 0
                             else None) for i in range(4)]  # fmt: skip
    outs = llm.generate(prompts, params)
    for i, o in enumerate(outs):
        if i % 2:
            assert o.prompt_logprobs is None
        else:
            _check(o.prompt_logprobs, o.prompt_token_ids, reference(o.prompt_token_ids), 2)


def test_preempted_requests_keep_their_prompt_logprobs(stories_dir: Path, reference: Any) -> None:
    """A KV cache of 12 blocks of 4 tokens for three requests of 27 + 20 tokens: preempted
    mid-prompt or after it, recomputed (not taken from the cache), each prompt row once."""
    from runtime.model_runner import kv_block_bytes

    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, block_size=4)
    block = kv_block_bytes(llm.engine.model, 4)
    small = LLM(stories_dir, kv_cache_bytes=12 * block, block_size=4, max_num_batched_tokens=8)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
              for _ in range(3)]  # fmt: skip
    outs = small.generate([PROMPT] * 3, params)
    assert small.engine.scheduler.num_preemptions > 0
    ids = outs[0].prompt_token_ids
    ref = reference(ids)
    for o in outs:
        _check(o.prompt_logprobs, ids, ref, 1)
    assert small.engine.blocks.num_free_blocks == small.engine.blocks.num_blocks


def test_requests_without_prompt_logprobs_compute_no_prompt_rows(stories_dir: Path) -> None:
    """The fast path: a prefill's logits are its last row's alone."""
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    engine = llm.engine
    launched = []
    launch = engine.runner.launch

    def spy(out: Any, tables: Any) -> Any:
        step = launch(out, tables)
        launched.append(step)
        return step

    engine.runner.launch = spy  # type: ignore[method-assign]
    llm.generate(PROMPT, SamplingParams(max_tokens=2))
    assert launched and all(not s.prompt and len(s.rows) == len(s.sampling) for s in launched)
    launched.clear()
    llm.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0))
    n = len(engine.tokenizer.encode(PROMPT))
    assert sum(p.count for s in launched for p in s.prompt) == n - 1


def test_a_one_token_prompt_has_its_one_null(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    out = llm.generate([1], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]


# ----- the gateway's echo ---------------------------------------------------------------------


def test_echo_asks_the_worker_for_prompt_logprobs() -> None:
    body = {"model": "m", "prompt": ["a", [5, 6]], "echo": True}
    reqs, opts = parse_completion({**body, "logprobs": 2, "max_tokens": 0}, "r")
    assert [r.sampling["prompt_logprobs"] for r in reqs] == [2, 2]
    assert all(r.sampling["max_tokens"] == 1 for r in reqs)
    assert opts.echo and opts.echo_only and opts.prompt_texts == ("a", None)
    reqs, opts = parse_completion(body, "r")  # the text of token ids comes from the worker
    assert [r.sampling["prompt_logprobs"] for r in reqs] == [None, 0]
    assert not opts.echo_only


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("echo"), stories_dir) as c:
        yield c


def _ids(stories_dir: Path, text: str) -> list[int]:
    from runtime.tokenizer import Tokenizer

    return Tokenizer.from_dir(stories_dir).encode(text)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_as_lm_eval_sends_it(client: openai.OpenAI, stories_dir: Path, reference: Any,
                                  max_tokens: int) -> None:  # fmt: skip
    r = client.completions.create(model="stories", prompt=PROMPT, echo=True, logprobs=2,
                                  max_tokens=max_tokens, temperature=0)  # fmt: skip
    ids = _ids(stories_dir, PROMPT)
    ref = reference(ids)
    choice = r.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None and lp.text_offset is not None
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-5)
        assert len(lp.top_logprobs[i]) in (2, 3)  # the token and its 2 best alternatives
    assert len(lp.text_offset) == len(lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert r.usage.completion_tokens == 0
    else:
        greedy = int(ref[-1].argmax())
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1, greedy].item(), abs=2e-5)
        assert len(choice.text) > len(PROMPT)


def test_echo_without_logprobs_and_of_token_ids(client: openai.OpenAI, stories_dir: Path) -> None:
    r = client.completions.create(model="stories", prompt=PROMPT, echo=True, max_tokens=3,
                                  temperature=0)  # fmt: skip
    plain = client.completions.create(model="stories", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    assert r.choices[0].logprobs is None
    ids = _ids(stories_dir, PROMPT)
    t = client.completions.create(model="stories", prompt=ids, echo=True, max_tokens=0)
    assert t.choices[0].text == PROMPT  # the worker's decoding of the ids


def test_echo_with_n_and_a_batch_of_prompts(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Tom had a red ball."]
    r = client.completions.create(model="stories", prompt=prompts, echo=True, logprobs=1, n=2,
                                  max_tokens=2, temperature=0.8, seed=4)  # fmt: skip
    assert len(r.choices) == 4
    for c in r.choices:
        prompt = prompts[c.index // 2]
        assert c.text.startswith(prompt)
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None
        assert c.logprobs.token_logprobs[0] is None
        assert all(v is not None for v in c.logprobs.token_logprobs[1:])
    first = [c.logprobs.token_logprobs for c in r.choices[:2]]  # type: ignore[union-attr]
    n_prompt = len(first[0]) - 2  # (the same prompt: the same prompt logprobs)
    assert first[0][:n_prompt] == first[1][:n_prompt]


def test_streamed_echo_sends_the_prompt_first(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="stories", prompt=PROMPT, echo=True, logprobs=1,
                                       max_tokens=4, temperature=0, stream=True)  # fmt: skip
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT
    first = chunks[0].choices[0].logprobs
    assert first is not None and first.token_logprobs is not None
    assert first.token_logprobs[0] is None and len(first.token_logprobs) > 5
    whole = client.completions.create(model="stories", prompt=PROMPT, echo=True, logprobs=1,
                                      max_tokens=4, temperature=0)  # fmt: skip
    assert "".join(texts) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs or []]  # fmt: skip
    assert streamed == whole.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    assert not any(isinstance(v, float) and math.isnan(v) for v in streamed)


def test_max_tokens_zero_needs_echo(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=0)
    assert "0 only with echo: true" in str(e.value)


def _check_ranked(ranked: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs shape: [null, {"<id>": {"logprob", "rank", "decoded_token"}}]."""
    assert len(ranked) == len(ids) and ranked[0] is None
    for i in range(1, len(ids)):
        entry = ranked[i]
        assert next(iter(entry)) == str(ids[i])  # the prompt token first
        token = entry[str(ids[i])]
        assert token["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-5)
        assert token["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        best = ref[i - 1].topk(k).indices.tolist()
        assert set(entry) == {str(ids[i]), *map(str, best)}
        for j, t in enumerate(best, 1):
            assert entry[str(t)]["rank"] == j and isinstance(entry[str(t)]["decoded_token"], str)


def test_vllm_prompt_logprobs_field_on_completions(client: openai.OpenAI, stories_dir: Path,
                                                   reference: Any) -> None:  # fmt: skip
    r = client.completions.create(model="stories", prompt=[PROMPT, "The sun"], max_tokens=2,
                                  n=2, extra_body={"prompt_logprobs": 2})  # fmt: skip
    for c in r.model_dump()["choices"]:
        prompt = [PROMPT, "The sun"][c["index"] // 2]
        ids = _ids(stories_dir, prompt)
        _check_ranked(c["prompt_logprobs"], ids, reference(ids), 2)
    # with echo and logprobs wider than prompt_logprobs: each answer cut to its own count
    r = client.completions.create(model="stories", prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=4, extra_body={"prompt_logprobs": 1})  # fmt: skip
    ids = _ids(stories_dir, PROMPT)
    _check_ranked(r.model_dump()["choices"][0]["prompt_logprobs"], ids, reference(ids), 1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    assert all(len(d) >= 4 for d in lp.top_logprobs[1:] if d is not None)
    plain = client.completions.create(model="stories", prompt=PROMPT, max_tokens=1)
    assert "prompt_logprobs" not in plain.model_dump()["choices"][0]


def test_vllm_prompt_logprobs_field_on_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="stories", max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"prompt_logprobs": 0})  # fmt: skip
    ranked = r.model_dump()["prompt_logprobs"]
    assert r.usage is not None and len(ranked) == r.usage.prompt_tokens
    assert ranked[0] is None and all(len(e) == 1 for e in ranked[1:])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stories", max_tokens=2, stream=True,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert "not available when stream is true" in str(e.value)
