"""The offline Python API (`runtime.LLM`) with what a user may hand it: text that is not UTF-8,
conversations a chat template fails on, a model without a chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime import LLM, NoChatTemplateError, SamplingParams
from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import ChatTemplateError, Tokenizer
from tests.stack import chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = chat_model(stories_dir, tmp_path_factory.mktemp("api") / "chat")
    return LLM(str(model), kv_cache_bytes=1_000_000, num_threads=1)


def test_text_that_is_not_utf8_names_the_field(llm: LLM) -> None:
    """A lone surrogate (bytes that are not UTF-8, decoded with surrogateescape, as Python reads
    a command line or a file name) was a TypeError from the tokenizer, after the batch's other
    prompts had been tokenized; now an InvalidRequestError naming the prompt or the message."""
    with pytest.raises(InvalidRequestError, match=r"prompt: is not UTF-8 text: character 3 is "
                       r"'\\udce9'.*byte 0xe9") as err:  # fmt: skip
        llm.generate(["Once", "caf\udce9"], GREEDY)
    assert err.value.param == "prompt"
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "ok"}, {"role": "user", "content": "\ud800"}]]  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\[1\]\.content: is not UTF-8"):
        llm.chat(convs, GREEDY)
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate("café 🙂", GREEDY)  # (UTF-8 text, of course, goes through)
    assert len(out.outputs[0].token_ids) == 2


def test_a_conversation_the_template_fails_on_is_a_chat_template_error(
    llm: LLM, stories_dir: Path, tmp_path: Path
) -> None:
    """OpenAI-style content parts under a template that adds strings: a TypeError raised while
    rendering (a traceback, or in the gateway and the worker a 500 for a ZeroDivisionError) is
    a ChatTemplateError, a ValueError, its cause kept."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    d = tmp_path / "m"
    d.mkdir()
    for f in stories_dir.iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}{{ 1 // 0 "
        "if messages | length > 1 }}"
    )
    tok = Tokenizer.from_dir(d)
    with pytest.raises(ChatTemplateError, match="TypeError: can only concatenate") as err:
        tok.apply_chat_template(parts)
    assert isinstance(err.value.__cause__, TypeError)
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError") as err:
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    (out,) = LLM(str(d), kv_cache_bytes=1_000_000, num_threads=1).chat(
        [{"role": "user", "content": "Hi"}], GREEDY
    )
    assert len(out.outputs[0].token_ids) == 2


def test_chat_without_a_chat_template_points_to_generate(stories_dir: Path) -> None:
    """The tokenizer's message sends the gateway's users to the completions API; the Python
    API's to `generate`."""
    llm = LLM(str(stories_dir), kv_cache_bytes=1_000_000, num_threads=1)
    with pytest.raises(NoChatTemplateError, match=r"no chat template.*complete text with "
                       "`generate`"):  # fmt: skip
        llm.chat([{"role": "user", "content": "Hi"}])
