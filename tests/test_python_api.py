"""The offline Python API (`runtime.LLM`) with what a user may hand it: text that is not UTF-8,
conversations a chat template fails on, a model without a chat template, calls from several
threads, an engine that holds requests the call did not queue (an AsyncLLM's), a "~" path."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from runtime import LLM, NoChatTemplateError, SamplingParams
from runtime.async_engine import AsyncLLM
from runtime.outputs import RequestOutput
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


def test_threads_that_share_an_llm_take_turns(llm: LLM) -> None:
    """Two threads' generate calls on one LLM spun at 100% CPU for ever, or failed (a KeyError,
    an IndexError from a step): each stepped the engine, at once, and took the other's outputs.
    Now a call waits for the one running; each gets its own outputs, the same as alone."""
    prompts = ["Once upon a time", "The dog"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got: list[list[list[int]]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            got.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and got == [want] * 3
    assert not llm.engine.has_unfinished()


def test_generate_leaves_requests_it_did_not_queue_to_their_owner(llm: LLM) -> None:
    """A request already in the engine (engine.add_request, as the CLI queues one): generate
    took its finished output for one of its own (KeyError), and would have taken it from its
    owner. Now generate refuses, naming it; the request runs on for its owner, who gets its
    output; then generate runs."""
    engine = llm.engine
    engine.add_request("theirs", "The dog", SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(RuntimeError, match=r"llm\.engine holds 1 unfinished requests that "
                       r"generate did not queue \(theirs\).*Finish or abort them"):  # fmt: skip
        llm.generate("Once upon a time", GREEDY)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"theirs"}
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 1
    (out,) = llm.generate("Once upon a time", GREEDY)
    assert len(out.outputs[0].token_ids) == 2


def test_generate_beside_an_async_llm_streaming_on_its_engine_is_refused(llm: LLM) -> None:
    """The README's `AsyncLLM(llm.engine)`: a generate while its stream ran stepped the
    stream's request too and took its outputs (the stream lost them, or never ended). Now
    generate refuses at once, and the stream runs to its end, its text whole."""
    prompt = "Once upon a time"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (want,) = llm.generate(prompt, params)
    front = AsyncLLM(llm.engine)
    entered, gate = threading.Event(), threading.Event()

    def hold(_: object) -> None:  # on the engine thread, between two steps: none runs now
        entered.set()
        gate.wait(30)

    def generate() -> BaseException | None:
        try:
            llm.generate("The dog", GREEDY)
        except BaseException as e:
            return e
        return None

    async def main() -> tuple[BaseException | None, str, RequestOutput]:
        stream = front.submit(prompt, params)
        held = front.call(hold)  # (after the request is queued: the inbox keeps order)
        await asyncio.to_thread(entered.wait, 30)
        error = await asyncio.to_thread(generate)
        gate.set()
        await held
        text, last = "", None
        async for out in stream:
            text, last = text + out.outputs[0].delta_text, out
        assert last is not None
        return error, text, last

    try:
        error, text, last = asyncio.run(main())
    finally:
        gate.set()
        front.shutdown()
    assert isinstance(error, RuntimeError)
    assert "did not queue (req-" in str(error) and "an AsyncLLM over llm.engine" in str(error)
    assert last.outputs[0].token_ids == want.outputs[0].token_ids
    assert text == last.outputs[0].text == want.outputs[0].text
    assert not llm.engine.has_unfinished()


@pytest.mark.timeout(60)
def test_a_call_whose_requests_can_never_run_fails_rather_than_spins(stories_dir: Path) -> None:
    """KV imports reserved (their prefill elsewhere, never committed) hold all but two blocks:
    a request that needs three ran out and waited for ever, generate stepping an idle engine
    at 100% CPU. Now it fails, naming the request, which leaves the engine."""
    llm = LLM(str(stories_dir), kv_cache_bytes=1_000_000, num_threads=1)
    engine = llm.engine
    assert (engine.blocks.num_blocks, engine.config.block_size) == (48, 16)
    imports = []
    for rid, length in (("import-1", 500), ("import-2", 225)):  # 32 blocks, 14
        group = engine.prepare_request(rid, [5 + i % 400 for i in range(length)], GREEDY)
        assert engine.reserve_import(group) is not None
        imports.append(group)
    assert engine.blocks.num_free_blocks == 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # 45 tokens
    with pytest.raises(RuntimeError, match=r"can run none of requests \['req-\d+'\] \(a step "
                       r"ran nothing\): the KV blocks they need are held"):  # fmt: skip
        llm.generate("Once upon a time", params)
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == 2
    for group in imports:
        engine.cancel_import(group)
    (out,) = llm.generate("Once upon a time", params)
    assert len(out.outputs[0].token_ids) == 40


def test_a_model_folder_under_home_is_read_from_there(
    stories_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM("~/m"): the folder check expanded "~", the engine was given "~/m" as it was and
    failed, "not a folder"."""
    (tmp_path / "m").symlink_to(stories_dir)
    monkeypatch.setenv("HOME", str(tmp_path))
    llm = LLM("~/m", kv_cache_bytes=1_000_000, num_threads=1)
    assert llm.engine.config.model == str(tmp_path / "m")
    (out,) = llm.generate("Once upon a time", GREEDY)
    assert len(out.outputs[0].token_ids) == 2
