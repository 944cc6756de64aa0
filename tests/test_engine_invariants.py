"""Adversarial engine scenarios on the real stories260K model: aborts at every point, preemption,
n > 1, stop strings, prefix caching, chunked prefill and the limits, each checked against the
block manager's books and against the same requests run alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from runtime.async_engine import AsyncLLM
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.outputs import RequestOutput
from runtime.sampling_params import InvalidRequestError, SamplingParams

# 5 layers x (k, v) x 16 tokens x 4 kv heads x 8 dims x 4 bytes: one block of 16 tokens
BLOCK_16 = 5 * 2 * 16 * 4 * 8 * 4
SHARED = [5 + (i * 7) % 300 for i in range(20)]
# (prompt, params) by id: a shared prefix, n > 1 greedy and seeded, a stop string, max_tokens=1
REQUESTS = {
    "a": ([*SHARED, 9, 10], SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)),
    "b": (SHARED[:13], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=["e"])),
    "c": (
        [*SHARED, 11],
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=15, ignore_eos=True),
    ),
    "d": ([7] * 30, SamplingParams(temperature=0, max_tokens=1)),
}


def engine(stories_dir: Path, blocks: int, block_size: int = 4, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(stories_dir), block_size=block_size,
                                  kv_cache_bytes=blocks * BLOCK_16 * block_size // 16,
                                  **kwargs))  # type: ignore[arg-type]  # fmt: skip


def assert_books_balance(e: LLMEngine) -> None:
    """Every block's reference count is the number of tables that hold it, and a block is free
    (plain, or cached / a kept tail in the LRU) exactly when none does."""
    bm = e.blocks
    refs = [0] * bm.num_blocks
    for table in bm._tables.values():
        for b in table:
            refs[b] += 1
    assert refs == bm._ref
    free = set(bm._plain) | set(bm._lru)
    assert len(free) == bm.num_free_blocks
    assert free == {b for b in range(bm.num_blocks) if refs[b] == 0}
    live = set(e.scheduler.requests) | e.scheduler.held
    assert set(bm._tables) <= live, "a finished or aborted request still holds a table"


def assert_all_free(e: LLMEngine) -> None:
    assert_books_balance(e)
    assert e.blocks.num_free_blocks == e.blocks.num_blocks
    assert not e.has_unfinished() and not e.unfinished_request_ids()
    assert not e.scheduler.requests and not e._seq_to_group


def completions(out: RequestOutput) -> list[tuple[list[int], str, str | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def run(e: LLMEngine, abort_at: int = -1, victim: str = "") -> dict[str, RequestOutput]:
    for rid, (prompt, params) in REQUESTS.items():
        e.add_request(rid, prompt, params)
    outs: dict[str, RequestOutput] = {}
    step = 0
    while e.has_unfinished():
        if step == abort_at:
            out = e.abort(victim)
            if out is not None:
                assert out.finished and all(c.finished for c in out.outputs)
                outs[victim] = out
            assert e.abort(victim) is None  # twice: nothing left to abort
            assert e.abort("no-such-request") is None
            assert_books_balance(e)
        for out in e.step():
            outs[out.request_id] = out
        assert_books_balance(e)
        step += 1
        assert step < 1000, "the engine does not finish"
    assert_all_free(e)
    return outs


@pytest.fixture(scope="module")
def alone(stories_dir: Path) -> dict[str, list[tuple[list[int], str, str | None]]]:
    """Each request alone, whole prefill, plenty of cache, no prefix caching."""
    e = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=1 << 22,
                               enable_prefix_caching=False))  # fmt: skip
    result = {}
    for rid, (prompt, params) in REQUESTS.items():
        e.add_request(rid, prompt, params)
        while e.has_unfinished():
            for out in e.step():
                result[rid] = completions(out)
    return result


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_chunked_batch_equals_each_request_alone(
    stories_dir: Path, alone: dict[str, list[tuple[list[int], str, str | None]]], caching: bool
) -> None:
    # 12 blocks of 4 tokens, 5 tokens a step: chunked prefills, shared prefixes, preemption
    e = engine(stories_dir, 12, max_num_batched_tokens=5, enable_prefix_caching=caching)
    outs = run(e)
    assert e.scheduler.num_preemptions > 0, "the cache was meant to be too small for all"
    assert {rid: completions(o) for rid, o in outs.items()} == alone
    for c in outs["b"].outputs:
        assert "e" not in c.text


@pytest.mark.parametrize(
    ("victim", "abort_at"), [("a", 0), ("a", 3), ("c", 7), ("b", 12), ("a", 20)]
)
def test_an_abort_anywhere_frees_everything_and_changes_no_other_output(
    stories_dir: Path,
    alone: dict[str, list[tuple[list[int], str, str | None]]],
    victim: str,
    abort_at: int,
) -> None:
    # waiting (step 0), mid-prefill chunk, mid-decode, after preemptions: a request aborted
    # (twice, and an unknown id) leaks no block and leaves the others' outputs as they were
    e = engine(stories_dir, 12, max_num_batched_tokens=5)
    outs = run(e, abort_at, victim)
    assert outs[victim].finished
    for rid, expected in alone.items():
        if rid != victim:
            assert completions(outs[rid]) == expected, rid


def test_requests_at_the_context_and_cache_limits(stories_dir: Path) -> None:
    e = engine(stories_dir, 2, block_size=4, max_model_len=64)  # 8 tokens of KV cache
    room = e.scheduler.capacity_tokens
    assert room == 8
    # a prompt one under the room: max_tokens unset is one token; max_tokens=1 the same
    for max_tokens in (None, 1):
        e.add_request("edge", list(range(10, 10 + room - 1)),
                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
        while e.has_unfinished():
            out = e.step()
        assert len(out[0].outputs[0].token_ids) == 1 and out[0].outputs[0].finish_reason == "length"
        assert_all_free(e)
    # n sequences that each fit alone run one after the other, never hang
    e.add_request("n3", list(range(10, 14)),
                  SamplingParams(n=3, temperature=0, max_tokens=room - 4, ignore_eos=True))  # fmt: skip
    steps = 0
    while e.has_unfinished():
        out = e.step()
        steps += 1
        assert steps < 100
    assert [len(c.token_ids) for c in out[0].outputs] == [room - 4] * 3
    assert_all_free(e)
    # a prompt of the whole room, or one that leaves no room for max_tokens: refused, clearly
    with pytest.raises(InvalidRequestError) as err:
        e.add_request("long", list(range(10, 10 + room)), SamplingParams(max_tokens=None))
    assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError) as err:
        e.add_request("long", list(range(10, 14)), SamplingParams(max_tokens=room - 3))
    assert err.value.param == "max_tokens" and f"at most {room - 4}" in str(err.value)
    assert_all_free(e)


def test_async_aborts_before_during_and_after_a_request_free_everything(stories_dir: Path) -> None:
    e = engine(stories_dir, 40, max_num_batched_tokens=5)  # 160 tokens
    llm = AsyncLLM(e)
    long = SamplingParams(n=2, temperature=0, max_tokens=60, ignore_eos=True)

    async def main() -> None:
        assert not llm.abort("no-such-request")
        early = llm.submit(list(range(10, 40)), long, "early")  # aborted before it is queued
        assert llm.abort("early") and llm.abort("early")  # (still open: its abort is coming)
        outs = [o async for o in early]
        assert outs[-1].finished and {c.finish_reason for c in outs[-1].outputs} == {"abort"}
        mid = llm.submit(list(range(10, 40)), long, "mid")
        await anext(mid)
        mid.close()
        mid.close()
        done = [o async for o in llm.generate(list(range(50, 60)),
                                              SamplingParams(temperature=0, max_tokens=3), "done")]  # fmt: skip
        assert done[-1].finished and not llm.abort("done")
        for _ in range(500):
            if llm.num_open_streams == 0 and llm.stats()["free_kv_blocks"] == e.blocks.num_blocks:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert llm.num_open_streams == 0
    assert_all_free(e)


def test_closing_a_stream_whose_request_ended_spares_a_new_request_of_the_same_id(
    stories_dir: Path,
) -> None:
    # A handler that stops reading (its client went away) after the engine delivered the final
    # output closes its stream late, when the id may already serve a new request (a retry): the
    # close aborted that new request, which ended at once with finish_reason "abort".
    llm = AsyncLLM(engine(stories_dir, 40))

    async def main() -> RequestOutput:
        first = llm.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=2), "x")
        for _ in range(500):  # its outputs delivered, the last one unread
            if llm.num_open_streams == 0:
                break
            await asyncio.sleep(0.01)
        assert llm.num_open_streams == 0
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        second = llm.submit([5, 6, 7], params, "x")
        first.close()
        return [o async for o in second][-1]

    try:
        out = asyncio.run(main())
    finally:
        llm.shutdown()
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 20


def test_an_id_the_engine_makes_up_is_not_one_a_caller_took(stories_dir: Path) -> None:
    """A caller's own "req-1" was the id the engine's count made up next: a submit without an
    id was refused, 'request_id: req-1 is already in use'."""

    async def main() -> None:
        llm = AsyncLLM(LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=1 << 22)))
        try:
            mine = llm.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=50,
                                                        ignore_eos=True), "req-1")  # fmt: skip
            other = llm.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
            assert other.request_id != "req-1"
            # a caller's id given twice is still refused, not renamed (its abort would miss)
            with pytest.raises(InvalidRequestError, match="already in use"):
                llm.submit([5, 6, 7], SamplingParams(max_tokens=2), "req-1")
            async for _ in other:
                pass
            mine.close()
        finally:
            llm.shutdown()

    asyncio.run(main())
