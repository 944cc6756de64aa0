"""Engine behaviour on the real stories260K model: batching, chunking, preemption, abort, bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from runtime import LLM, InvalidRequestError, SamplingParams
from runtime.async_engine import AsyncLLM, EngineDeadError
from runtime.engine import LLMEngine
from tests.memory_tools import resident_pages, vm_flags

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park. They saw a big tree and",
    "Tom",
    "One day, a girl named Sue found a shiny red ball in the garden. She",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(stories_dir: Path) -> list[list[int]]:
    """Each prompt alone, whole prefill, plenty of cache."""
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def test_batched_equals_unbatched(stories_dir: Path, reference: list[list[int]]) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_chunked_prefill_equals_whole(stories_dir: Path, reference: list[list[int]]) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, max_num_batched_tokens=5)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_preempted_request_equals_uninterrupted(
    stories_dir: Path, reference: list[list[int]]
) -> None:
    # 6 blocks of 16 tokens: five requests of up to ~70 tokens each cannot all fit.
    llm = LLM(stories_dir, kv_cache_bytes=6 * llm_block_bytes(stories_dir), block_size=16)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0, (
        "the cache was meant to be too small to hold every request"
    )
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_eager_kv_commit_commits_the_cache_and_changes_no_output(
    stories_dir: Path, reference: list[list[int]]
) -> None:
    def resident(t: torch.Tensor) -> int:  # pages of the KV cache tensor in memory
        return resident_pages(t.data_ptr(), t.nbytes)

    # 32 MiB: a stray 2 MB transparent huge page (one 4 KB touch, or the huge zero page under a
    # read, once made an 8 MiB cache read 511 of its 2045 pages resident) stays far below a quarter
    size = 32 << 20
    lazy = LLM(stories_dir, kv_cache_bytes=size)
    eager = LLM(stories_dir, kv_cache_bytes=size, kv_cache_commit="eager")
    pages = -(-eager.engine.runner.kv.nbytes // 4096)
    assert resident(eager.engine.runner.kv) >= pages - 1
    assert resident(lazy.engine.runner.kv) < pages // 4  # nothing served yet: nothing touched
    # huge pages only for a cache committed at start-up (a fresh one, first touched while
    # serving, can stall a request in a microVM: see ModelRunner)
    if Path("/sys/kernel/mm/transparent_hugepage").exists():
        assert "hg" in vm_flags(eager.engine.runner.kv.data_ptr())
    assert "hg" not in vm_flags(lazy.engine.runner.kv.data_ptr())
    outs = eager.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    with pytest.raises(ValueError, match="kv_cache_commit must be lazy or eager, got 'now'"):
        LLM(stories_dir, kv_cache_bytes=size, kv_cache_commit="now")


def llm_block_bytes(model_dir: Path) -> int:
    # 5 layers x (k, v) x 16 tokens x 4 kv heads x 8 dims x 4 bytes
    return 5 * 2 * 16 * 4 * 8 * 4


def test_abort_frees_blocks(stories_dir: Path) -> None:
    engine = LLMEngine_for(stories_dir)
    total = engine.blocks.num_free_blocks
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=200))
    engine.add_request("b", "The little dog", SamplingParams(max_tokens=200))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_free_blocks < total
    out = engine.abort("a")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    engine.abort("b")
    assert engine.blocks.num_free_blocks == total
    assert not engine.has_unfinished()


def test_an_export_without_room_ends_aborted_holding_what_it_reported(stories_dir: Path) -> None:
    from runtime.config import EngineConfig

    block = llm_block_bytes(stories_dir)
    engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=6 * block,
                                    max_num_batched_tokens=16, enable_prefix_caching=False))  # fmt: skip
    engine.add_request("a", list(range(10, 41)), GREEDY)
    engine.step()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.enqueue(engine.prepare_request("export", list(range(100, 160)), params, hold_kv=True))
    reported: list[int] = []
    for _ in range(40):
        for out in engine.step():
            if out.request_id == "export":
                reported = out.block_ids[: out.num_computed_tokens // 16]  # type: ignore[index]
                last = out
        others = {b for rid, table in engine.blocks._tables.items() if rid != "export#0"
                  for b in table}  # fmt: skip
        assert not others & set(reported), "a reported block went to another request"
        if last.finished:
            break
    assert last.finished and last.outputs[0].finish_reason == "abort" and reported
    assert engine.release_kv("export") == len(last.block_ids)  # type: ignore[arg-type]
    engine.abort("a")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_export_dropped_in_a_step_that_fails_still_gets_its_answer(stories_dir: Path) -> None:
    """The scheduler drops a held export for room, and the model step then fails: the export,
    already out of the engine's groups, still ends (aborted) at once, not when some other request
    next drives a step (its transfer would have kept the decode side waiting on it)."""
    from runtime.config import EngineConfig

    block = llm_block_bytes(stories_dir)
    engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=6 * block,
                                    max_num_batched_tokens=16, enable_prefix_caching=False))  # fmt: skip
    real = engine.runner.execute

    def execute(out, tables):  # type: ignore[no-untyped-def]
        if out.dropped:
            raise RuntimeError("injected: the step that dropped the export fails")
        return real(out, tables)

    engine.runner.execute = execute  # type: ignore[method-assign]
    llm = AsyncLLM(engine)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def main() -> tuple[str, str]:
        async def last(stream):  # type: ignore[no-untyped-def]
            try:
                outs = [out async for out in stream]
                return outs[-1].outputs[0].finish_reason
            except EngineDeadError:
                return "engine error"

        stream_a = llm.submit(list(range(10, 41)), greedy, "a")
        await anext(stream_a)  # "a" runs, holding most of the cache
        a = asyncio.ensure_future(last(stream_a))
        export = llm.submit(list(range(100, 160)), one, "export", hold_kv=True)
        x = asyncio.ensure_future(last(export))
        return await asyncio.wait_for(a, 30), await asyncio.wait_for(x, 10)

    try:
        a_end, export_end = asyncio.run(main())
    finally:
        llm.shutdown()
    assert a_end == "engine error" and export_end == "abort"


def test_an_abort_after_a_failed_step_frees_the_request_and_its_id(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.detokenizer import IncrementalDetokenizer

    engine = LLMEngine_for(stories_dir)
    total = engine.blocks.num_free_blocks
    engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=1))

    def broken(self: IncrementalDetokenizer) -> str:
        raise RuntimeError("a bug in the detokenizer")

    monkeypatch.setattr(IncrementalDetokenizer, "flush", broken)
    with pytest.raises(RuntimeError):
        engine.step()  # the scheduler finished it; recording that failed
    with pytest.raises(RuntimeError):
        engine.abort("r")  # (the same bug again)
    assert engine.unfinished_request_ids() == [] and engine.blocks.num_free_blocks == total
    monkeypatch.undo()
    engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=1))  # the id is free
    while engine.has_unfinished():
        engine.step()


def test_a_dead_engine_loop_fails_its_requests_instead_of_hanging(stories_dir: Path) -> None:
    async def main() -> None:
        engine = LLMEngine_for(stories_dir)
        allm = AsyncLLM(engine)
        calls = 0

        def listener(stored: list[bytes], evicted: list[bytes]) -> None:
            nonlocal calls
            calls += 1
            raise ConnectionError("the prefix index is down")

        allm.set_cache_listener(listener)  # best effort: its failure fails nothing
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = [out async for out in allm.generate("Once upon a time", params)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40 and calls > 0

        def broken() -> dict[str, int]:
            raise RuntimeError("a bug outside the step")

        engine.stats = broken  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(30):
                async for _ in allm.generate("The little dog", params):
                    pass
        with pytest.raises(EngineDeadError):
            allm.submit("Tom", params)
        allm.shutdown()

    asyncio.run(main())


def LLMEngine_for(model_dir: Path) -> LLMEngine:
    from runtime.config import EngineConfig

    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_bytes=1 << 22))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [1, 2]}, "stop"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params(kwargs: dict, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


def test_bad_prompts_leave_engine_serving(stories_dir: Path) -> None:
    engine = LLMEngine_for(stories_dir)
    cases = [
        ("", "prompt"),
        ([], "prompt"),
        ([1, 2.5], "prompt"),
        ([1, 10_000], "prompt"),
        ([1] * 600, "prompt"),  # context is 512
    ]
    for prompt, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", prompt, SamplingParams())  # type: ignore[arg-type]
        assert e.value.param == param, prompt
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", "Once upon a time", SamplingParams(max_tokens=600))
    assert e.value.param == "max_tokens" and "507" in e.value.message
    for bad in ([512], [-1], [2, 100_000]):  # the vocabulary is 512
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", "Once", SamplingParams(stop_token_ids=bad))
        assert e.value.param == "stop_token_ids" and "[0, 512)" in e.value.message
    assert not engine.has_unfinished()
    engine.add_request("ok", "Once upon a time", SamplingParams(temperature=0, max_tokens=4))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_n_and_seed(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    a = llm.generate("Once upon a time", params)[0]
    b = llm.generate(["Tom", "Once upon a time"], params)[1]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_a_batch_larger_than_the_waiting_queue_is_fed_in_as_it_drains(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, max_waiting=4)
    outs = llm.generate(PROMPTS * 2, SamplingParams(temperature=0, max_tokens=4))
    assert [o.prompt_token_ids for o in outs] == [
        llm.tokenizer.encode(p) for p in PROMPTS * 2
    ] and all(o.finished for o in outs)
    with pytest.raises(InvalidRequestError) as e:  # can never fit: not a retryable 429
        llm.generate("Tom", SamplingParams(n=5))
    assert e.value.param == "n" and "at most 4" in str(e.value)
    assert not llm.engine.has_unfinished()


def test_unset_max_tokens_fills_a_kv_cache_smaller_than_the_context(stories_dir: Path) -> None:
    from runtime.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=8 * llm_block_bytes(stories_dir)))  # fmt: skip
    capacity = engine.scheduler.capacity_tokens
    assert capacity < engine.max_model_len
    engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=None, ignore_eos=True))
    while engine.has_unfinished():
        out = engine.step()
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == capacity
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("long", list(range(5, 5 + capacity)), SamplingParams(max_tokens=None))
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    assert f"KV cache holds {capacity} tokens" in str(e.value)


def test_a_request_over_the_context_is_worded_and_coded_as_openai_does(stories_dir: Path) -> None:
    # clients that trim a conversation and retry match the code or "maximum context length"
    engine = LLMEngine_for(stories_dir)
    limit = engine.max_model_len
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", [5] * (limit - 10), SamplingParams(max_tokens=20))
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    assert str(e.value) == (
        f"max_tokens: This model's maximum context length is {limit} tokens. However, you "
        f"requested {limit + 10} tokens ({limit - 10} in the prompt, 20 in the completion). "
        "Please reduce the length of the prompt or the completion (max_tokens: at most 10)."
    )
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", [5] * limit, SamplingParams(max_tokens=None))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")


def test_min_tokens_past_the_context_is_refused_without_max_tokens(stories_dir: Path) -> None:
    """min_tokens beyond what the context leaves after the prompt, max_tokens not given, was
    served and silently cut at the context (finish_reason 'length' at 497 tokens where 600 were
    asked; vLLM refuses it)."""
    engine = LLMEngine_for(stories_dir)
    limit = engine.max_model_len
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", [5] * 10, SamplingParams(max_tokens=None, min_tokens=limit))
    assert (e.value.param, e.value.code) == ("min_tokens", "context_length_exceeded")
    assert f"must be at most {limit - 10}, the tokens the context leaves" in str(e.value)
    assert not engine.has_unfinished()
    engine.add_request("ok", [5] * 10, SamplingParams(max_tokens=None, min_tokens=limit - 10))
    assert engine.has_unfinished()


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64])
def test_a_seed_outside_64_bits_is_refused(seed: int) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(seed=seed).validate()
    assert e.value.param == "seed"


def test_stop_string_and_stop_token(stories_dir: Path, reference: list[list[int]]) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))[0]
    text = full.outputs[0].text
    assert "Lily" in text
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"])
    )[0]
    o = out.outputs[0]
    assert o.text == text[: text.index("Lily")]
    assert o.finish_reason == "stop" and o.stop_reason == "Lily"
    stop_tok = full.outputs[0].token_ids[3]
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok])
    )[0]
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[:4]
    assert out.outputs[0].stop_reason == stop_tok
    # the stop token's text is not output (as vLLM), unless include_stop_str_in_output
    tok = llm.tokenizer
    assert out.outputs[0].text == tok.decode(full.outputs[0].token_ids[:3])
    kept = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=40, stop_token_ids=[stop_tok], include_stop_str_in_output=True
    ))[0].outputs[0]  # fmt: skip
    assert kept.text == tok.decode(full.outputs[0].token_ids[:4]) != out.outputs[0].text
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_logprobs(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[
        0
    ]
    o = out.outputs[0]
    assert o.logprobs is not None and len(o.logprobs) == 5
    for tok, lp in zip(o.token_ids, o.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert lp.logprob <= 0


def test_async_stream_and_abort(stories_dir: Path) -> None:
    async def main() -> None:
        engine = LLMEngine_for(stories_dir)
        total = engine.blocks.num_free_blocks
        allm = AsyncLLM(engine)
        try:
            deltas = []
            async for out in allm.generate(
                "Once upon a time", SamplingParams(temperature=0, max_tokens=20)
            ):
                deltas.append(out.outputs[0].delta_text)
            assert out.finished
            assert "".join(deltas) == out.outputs[0].text

            gen = allm.generate("The little dog", SamplingParams(max_tokens=400, ignore_eos=True))
            n = 0
            async for _ in gen:
                n += 1
                if n == 3:
                    break
            await gen.aclose()  # a client that went away
            for _ in range(200):  # freed before the engine's next step
                if allm.stats()["free_kv_blocks"] == total and allm.num_open_streams == 0:
                    break
                await asyncio.sleep(0.01)
            assert allm.stats()["free_kv_blocks"] == total
            assert allm.stats()["num_aborted"] == 1
            with pytest.raises(InvalidRequestError):
                async for _ in allm.generate("", SamplingParams()):
                    pass
        finally:
            allm.shutdown()

    asyncio.run(main())


def test_a_call_that_kills_the_engine_loop_fails_and_so_do_those_after_it(stories_dir: Path) -> None:
    # a BaseException out of a call (SystemExit from a callee, say) ended the loop; the calls of
    # its batch, itself included, were never answered: their callers (the KV import's reserve,
    # commit and release) waited for ever
    from runtime.config import EngineConfig

    class Fatal(BaseException):
        pass

    llm = AsyncLLM(LLMEngine(EngineConfig(str(stories_dir), kv_cache_bytes=2_000_000,
                                          num_threads=1)))  # fmt: skip

    def bad(engine: LLMEngine) -> None:
        raise Fatal("boom")

    async def main() -> list[str]:
        calls = [llm.call(bad), llm.call(lambda e: e.scheduler.blocks.num_free_blocks)]
        got = []
        for call in calls:
            try:
                await asyncio.wait_for(call, 10)
                got.append("answered")
            except EngineDeadError:
                got.append("engine dead")
            except TimeoutError:
                got.append("hung")
        return got

    try:
        assert asyncio.run(main()) == ["engine dead", "engine dead"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("max_tokens", [2, 3])
def test_a_stop_string_completed_by_the_held_back_tail_is_the_finish_reason(
    stories_dir: Path, max_tokens: int
) -> None:
    """The two byte tokens of "é", then (max_tokens=3) a plain token: the stop string is found
    mid-request or, when the request ends on the bytes, only as the held-back tail is flushed.
    Either way the text ends before it and the output says it stopped on it (it said "length",
    no stop reason, with the text cut all the same)."""
    engine = LLMEngine_for(stories_dir)
    tok = engine.tokenizer
    forced = [tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>"), tok.encode("a", False)[0]]
    assert tok.decode(forced[:2]) == "é"
    real = engine.runner.execute
    steps = iter(forced)

    def execute(out, tables):  # type: ignore[no-untyped-def]
        tokens, logprobs = real(out, tables)
        return {rid: [next(steps)] for rid in tokens}, logprobs

    engine.runner.execute = execute  # type: ignore[method-assign]
    engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=max_tokens, stop=["é"]))
    outs = [o for _ in range(8) for o in engine.step() if o.finished]
    (c,) = outs[0].outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("", "stop", "é")


def test_submit_counts_requests_not_yet_queued_against_the_bound(stories_dir: Path) -> None:
    """While a step runs, submitted requests wait in the async front's inbox: they count
    against max_waiting at submit (a 429 before anything streams), not after the step, when
    each extra one failed on a stream its caller already held."""
    import threading

    from runtime.config import EngineConfig
    from runtime.scheduler import QueueFullError

    engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=1 << 22, max_waiting=4))
    real, stepping, release = engine.runner.execute, threading.Event(), threading.Event()

    def slow(out, tables):  # type: ignore[no-untyped-def]
        stepping.set()
        release.wait(10)
        return real(out, tables)

    engine.runner.execute = slow  # type: ignore[method-assign]

    async def main() -> tuple[int, int, int]:
        llm = AsyncLLM(engine)
        first = llm.submit("Once upon a time", SamplingParams(max_tokens=3))
        await asyncio.to_thread(stepping.wait, 10)  # the engine thread is inside a step
        streams, refused = [], 0
        for _ in range(50):
            try:
                streams.append(llm.submit("Tom", SamplingParams(max_tokens=2)))
            except QueueFullError:
                refused += 1
        release.set()
        done = 0
        for s in [first, *streams]:
            async for out in s:
                done += out.finished
        llm.shutdown()
        return len(streams), refused, done

    accepted, refused, done = asyncio.run(main())
    assert (accepted, refused, done) == (4, 46, 5)


def test_a_bad_onednn_setting_fails_at_start_up(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EDGEINFER_ONEDNN_LINEAR is read when the engine starts: a bad value is an error there,
    not in the first step with a long prompt (and in every one after)."""
    from kernels.linear import onednn_linear_on

    monkeypatch.setenv("EDGEINFER_ONEDNN_LINEAR", "true")
    onednn_linear_on.cache_clear()
    try:
        with pytest.raises(ValueError, match="EDGEINFER_ONEDNN_LINEAR='true'"):
            LLMEngine_for(stories_dir)
    finally:
        onednn_linear_on.cache_clear()


def test_a_prompt_that_tokenizes_past_the_embedding_is_refused(
    stories_dir: Path, tmp_path: Path
) -> None:
    """A tokenizer.json with more tokens than config.json's vocab_size (an added token past the
    embedding: a hand-made folder, an old import): text that tokenizes to such a token was
    taken, and the embedding lookup failed the step, and with it every request in flight. It is
    a refusal naming the prompt; the engine serves the next request."""
    import json
    import shutil

    from tokenizers import AddedToken, Tokenizer

    model = tmp_path / "model"
    shutil.copytree(stories_dir, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tok.add_special_tokens([AddedToken("<extra>", special=True)])
    assert tok.token_to_id("<extra>") >= vocab
    tok.save(str(model / "tokenizer.json"))
    llm = LLM(str(model), kv_cache_bytes=4_000_000)
    with pytest.raises(InvalidRequestError, match=r"prompt.*outside the model's vocabulary"):
        llm.generate(["Once upon a time <extra>"], SamplingParams(max_tokens=2))
    (out,) = llm.generate(["Once upon a time"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out.outputs[0].token_ids) == 2
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
