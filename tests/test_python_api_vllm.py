"""The offline Python API as vLLM's code calls it: `RequestOutput.prompt`,
`CompletionOutput.cumulative_logprob`, `use_tqdm`, `get_tokenizer()`, chat's
`add_generation_prompt` / `continue_final_message` / `chat_template`, and vLLM's SamplingParams
arguments (taken at what edgeinfer does, any other value refused naming the argument)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from runtime import LLM, SamplingParams
from runtime.sampling_params import InvalidRequestError
from tests.stack import chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=4)
CONV: list[dict[str, Any]] = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Once upon"},
]


@pytest.fixture(scope="module")
def llm(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = chat_model(stories_dir, tmp_path_factory.mktemp("vllm") / "chat")
    return LLM(str(model), kv_cache_bytes=1_000_000, num_threads=1)


def test_vllm_quickstart(llm: LLM) -> None:
    """vLLM's quickstart prints `output.prompt`: an AttributeError. The prompt as given for
    text; None for token ids (as vLLM)."""
    prompts: list[str | list[int]] = ["Hello, my name is", [1, 320, 417]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, seed=0))
    assert [o.prompt for o in outputs] == ["Hello, my name is", None]
    assert all(o.outputs[0].text for o in outputs)


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, logprobs=0)
    (out,) = llm.generate("Once upon a time", params)
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 6
        total = c.cumulative_logprob
        assert total is not None and total < 0
        assert total == pytest.approx(math.fsum(lp.logprob for lp in c.logprobs))
    (plain,) = llm.generate("Once upon a time", GREEDY)
    assert plain.outputs[0].cumulative_logprob is None  # (vLLM's, logprobs not asked for)


def test_use_tqdm_is_progress(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate("Once", GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate("Once", GREEDY, use_tqdm=True)
    assert "1/1 requests done" in capsys.readouterr().err
    llm.chat(CONV[:1], GREEDY, use_tqdm=True)
    assert "1/1 requests done" in capsys.readouterr().err
    with pytest.raises(InvalidRequestError, match=r"^use_tqdm: must be true or false .*a tqdm "
                       "class is not supported by edgeinfer"):  # fmt: skip
        llm.generate("Once", GREEDY, use_tqdm=print)  # type: ignore[arg-type]


def test_get_tokenizer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    assert tokenizer.decode(tokenizer.encode("Once upon a time")) == "Once upon a time"


def test_chat_continues_the_final_message(llm: LLM) -> None:
    """vLLM's chat arguments: no generation prompt; the last message continued (the prompt ends
    with its text, not its turn's end); both at once is vLLM's error; a template of one's own."""
    (out,) = llm.chat(CONV[:1], GREEDY)
    assert out.prompt == "user: Hi\nassistant:"  # (tests.stack's CHAT_TEMPLATE)
    (out,) = llm.chat(CONV, GREEDY, add_generation_prompt=False)
    assert out.prompt == "user: Hi\nassistant: Once upon\n"
    (out,) = llm.chat(CONV, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == "user: Hi\nassistant: Once upon"
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4
    parts: list[dict[str, Any]] = [
        CONV[0], {"role": "assistant", "content": [{"type": "text", "text": "Once upon "}]}
    ]  # fmt: skip
    (two,) = llm.chat(parts, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert two.prompt == out.prompt + " "  # (its space rendered as given: kept, as transformers)
    with pytest.raises(InvalidRequestError, match=r"^continue_final_message: cannot be combined "
                       "with add_generation_prompt"):  # fmt: skip
        llm.chat(CONV, GREEDY, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match=r"^messages\[1\]\.content: continue_final_"
                       "message continues the last message's text, and it has none"):  # fmt: skip
        llm.chat([CONV[0], {"role": "assistant", "content": " "}], GREEDY,
                 add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"^continue_final_message: the chat template "
                       "does not render the last message's text"):  # fmt: skip
        llm.chat(CONV, GREEDY, add_generation_prompt=False, continue_final_message=True,
                 chat_template="{% for m in messages %}{{ m['role'] }}\n{% endfor %}")  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"^add_generation_prompt: must be true or "):
        llm.chat(CONV, GREEDY, add_generation_prompt="no")  # type: ignore[arg-type]


def test_chat_with_a_template_of_ones_own(llm: LLM, stories_dir: Path) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"  # fmt: skip
    (out,) = llm.chat(CONV[:1], GREEDY, chat_template=template)
    assert out.prompt == "<user>Hi<assistant>"
    (out,) = llm.chat(CONV[:1], GREEDY)  # (the model's own, as before)
    assert out.prompt == "user: Hi\nassistant:"
    plain = LLM(str(stories_dir), kv_cache_bytes=1_000_000, num_threads=1)  # (has none)
    (out,) = plain.chat(CONV[:1], GREEDY, chat_template=template)
    assert out.prompt == "<user>Hi<assistant>" and len(out.outputs[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match=r"^chat_template: does not compile: "):
        llm.chat(CONV[:1], GREEDY, chat_template="{% for m in messages %}")
    with pytest.raises(InvalidRequestError, match=r"^chat_template: must be a non-empty string"):
        llm.chat(CONV[:1], GREEDY, chat_template="")


def test_special_tokens_are_left_out_of_the_text_as_skip_special_tokens(llm: LLM) -> None:
    """vLLM's default, skip_special_tokens=True, is what edgeinfer does: a special token (<s>,
    forced by logit_bias) is in token_ids, not in the text."""
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={1: 100},
                            skip_special_tokens=True)  # fmt: skip
    assert llm.tokenizer.bos_token_id == 1 and 1 in llm.tokenizer.all_special_ids
    (out,) = llm.generate("Once upon a time", params)
    assert out.outputs[0].token_ids == [1, 1, 1] and out.outputs[0].text == ""


def test_vllm_sampling_arguments_at_what_edgeinfer_does_are_taken() -> None:
    """They were a TypeError ('unexpected keyword argument'). Init-only: not fields, so the
    gateway's `sampling` (every field) and the worker's SamplingParams(**sampling) are as
    they were."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(
        n=2, best_of=2, skip_special_tokens=True, spaces_between_special_tokens=True,
        detokenize=True, truncate_prompt_tokens=None, bad_words=[], allowed_token_ids=None,
    )  # fmt: skip
    assert params == SamplingParams(n=2)
    assert SamplingParams(best_of=None) == SamplingParams(best_of=1) == SamplingParams()
    assert SamplingParams(n=3, best_of=1) == SamplingParams(n=3)  # (as the gateway takes it)
    assert not names & {"best_of", "skip_special_tokens", "detokenize", "bad_words",
                        "spaces_between_special_tokens", "truncate_prompt_tokens",
                        "allowed_token_ids"}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 2, "best_of": 3}, r"^best_of: only None, 1 or n \(2\) is supported by "
                                 r"edgeinfer .*got 3"),
        ({"best_of": True}, r"^best_of: must be an integer, got bool"),
        ({"skip_special_tokens": False}, r"^skip_special_tokens: False is not supported by "
                                         r"edgeinfer \(special tokens are always left out"),
        ({"spaces_between_special_tokens": False}, r"^spaces_between_special_tokens: False is "
                                                   "not supported by edgeinfer"),
        ({"detokenize": False}, r"^detokenize: False is not supported by edgeinfer"),
        ({"detokenize": "no"}, r"^detokenize: must be true or false, got 'no'"),
        ({"truncate_prompt_tokens": 4}, r"^truncate_prompt_tokens: is not supported by "
                                        r"edgeinfer; give the prompt's last k token ids"),
        ({"bad_words": ["dog"]}, r"^bad_words: is not supported by edgeinfer"),
        ({"allowed_token_ids": [5, 6]}, r"^allowed_token_ids: is not supported by edgeinfer"),
    ],
)  # fmt: skip
def test_vllm_sampling_arguments_edgeinfer_cannot_honour_are_refused_by_name(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == next(k for k in kwargs if k != "n")
