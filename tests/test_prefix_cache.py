"""Prefix caching: the block manager's decisions step by step, and exact reuse in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.block_hash import block_hashes, cache_seed
from runtime.kv_cache import BlockManager
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams

B = 4
SEED = cache_seed("test")


def bm(num_blocks: int = 8) -> BlockManager:
    m = BlockManager(num_blocks, B, seed=SEED)
    m.record_events = True
    return m


def run(m: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit a request, 'compute' all its tokens, commit; returns its table."""
    cached = m.match_prefix(rid, tokens)
    table = m.allocate(rid, len(tokens))
    assert table is not None
    m.commit(rid, tokens)
    assert cached % B == 0
    return list(table)


def test_second_request_reuses_the_longest_cached_prefix() -> None:
    m = bm()
    a = run(m, "a", list(range(10)))  # blocks: [0..3] [4..7] partial [8, 9]
    stored, evicted = m.drain_events()
    assert stored == block_hashes(SEED, list(range(10)), B) and evicted == []
    # same first 8 tokens, then different: 2 blocks reused, computed from token 8 on
    assert m.match_prefix("b", [*range(8), 99, 98, 97]) == 8
    assert m.block_table("b") == a[:2]
    assert m.num_free_blocks == 8 - 3 - 0  # shared blocks are not taken twice
    # a prompt that is exactly cached still computes its last token (its last block is redone)
    assert m.match_prefix("c", list(range(8))) == 4


def test_cached_blocks_survive_their_request_and_lru_evicts_tail_first() -> None:
    m = bm(num_blocks=4)
    run(m, "a", list(range(12)))  # 3 full blocks, all cached
    m.free("a")
    assert m.num_free_blocks == 4 and m.num_cached_blocks == 3
    m.drain_events()
    # one new block: the plain (never cached) block goes first, nothing is evicted
    assert m.allocate("x", 4) is not None and m.drain_events() == ([], [])
    # the next one evicts a's LAST block (tail first), the one after it the middle block
    assert m.allocate("y", 4) is not None
    assert m.drain_events()[1] == block_hashes(SEED, list(range(12)), B)[2:3]
    assert m.match_prefix("z", list(range(13))) == 8  # the head blocks are still there


def test_sharing_is_reference_counted() -> None:
    m = bm()
    run(m, "a", list(range(9)))
    assert m.match_prefix("b", list(range(9))) == 8
    m.free("a")
    assert m.num_cached_blocks == 2
    free_before = m.num_free_blocks
    m.free("b")  # now nobody uses the two shared blocks: free, but still cached
    assert m.num_free_blocks == free_before + 2 and m.num_cached_blocks == 2


def test_no_caching_when_disabled() -> None:
    m = BlockManager(8, B, seed=SEED, caching=False)
    run(m, "a", list(range(12)))
    assert m.match_prefix("b", list(range(12))) == 0 and m.drain_events() == ([], [])


def test_a_next_turn_takes_the_partial_last_block_of_the_turn_before() -> None:
    m = bm()
    a = run(m, "a", list(range(10)))  # [0..3] [4..7] partial [8, 9]
    m.free("a", list(range(10)))
    assert m.num_tail_blocks == 1 and m.num_cached_blocks == 2
    m.drain_events()
    # the next turn holds all of a's tokens and more: a's three blocks, computed from token 10
    assert m.match_prefix("b", [*range(10), 50, 51, 52, 53]) == 10
    assert m.block_table("b") == a and m.num_tail_blocks == 0
    assert m.drain_events() == ([], [])  # tails are local: no cache events
    assert m.hit_tokens == 10
    # b goes on writing into the block it took; once full it is cached like any other
    assert m.allocate("b", 14) == [*a, m.block_table("b")[3]]
    m.commit("b", [*range(10), 50, 51, 52, 53])
    assert m.drain_events()[0] == block_hashes(SEED, [*range(10), 50, 51], B)[2:]


def test_a_tail_goes_only_to_a_prompt_that_holds_all_of_it() -> None:
    m = bm()
    a = run(m, "a", list(range(11)))  # tail [8, 9, 10]
    m.free("a", list(range(11)))
    # shares 9 of the 11 tokens: the full blocks, not the tail (it stays for a's next turn)
    assert m.match_prefix("b", [*range(9), 99, 98]) == 8 and m.num_tail_blocks == 1
    # exactly a's tokens: the last one must be computed, so the tail does not fit either
    assert m.match_prefix("c", list(range(11))) == 8 and m.num_tail_blocks == 1
    assert m.match_prefix("d", list(range(11)), tails=False) == 8  # whole blocks only (KV imports)
    assert m.match_prefix("e", list(range(12))) == 11 and m.block_table("e") == a
    # of two tails under the same blocks, the longest that the prompt holds
    m = bm()
    run(m, "x", [0, 1, 2, 3, 7])
    run(m, "y", [0, 1, 2, 3, 7, 8, 9])
    m.free("x", [0, 1, 2, 3, 7])
    m.free("y", [0, 1, 2, 3, 7, 8, 9])
    assert m.num_tail_blocks == 2
    assert m.match_prefix("z", [0, 1, 2, 3, 7, 8, 9, 5]) == 7 and m.num_tail_blocks == 1
    assert m.match_prefix("w", [0, 1, 2, 3, 7, 5]) == 5 and m.num_tail_blocks == 0


def test_tails_are_evicted_first_and_never_kept_without_caching() -> None:
    m = bm(num_blocks=3)
    run(m, "a", list(range(10)))
    m.free("a", list(range(10)))
    assert m.num_free_blocks == 3
    assert m.allocate("x", 4) is not None  # a's tail goes first, with no event
    assert m.num_tail_blocks == 0 and m.num_cached_blocks == 2
    assert m.drain_events()[1] == []
    m = BlockManager(8, B, seed=SEED, caching=False)
    run(m, "a", list(range(10)))
    m.free("a", list(range(10)))
    assert m.num_tail_blocks == 0 and m.match_prefix("b", list(range(12))) == 0


def test_hashes_depend_on_the_cache_identity() -> None:
    toks = list(range(8))
    assert block_hashes(cache_seed("m1"), toks, B) != block_hashes(cache_seed("m2"), toks, B)
    assert block_hashes(SEED, [*toks, 9], B) == block_hashes(SEED, toks, B)  # partial: no hash


# ---------------------------------------------------------------------- the engine
SHARED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it."
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=24, n=2),
    ],
)
def test_output_with_a_prefix_hit_equals_output_without(stories_dir: Path, params: SamplingParams) -> None:  # fmt: skip
    cached = LLM(stories_dir, kv_cache_bytes=2_000_000)
    plain = LLM(stories_dir, kv_cache_bytes=2_000_000, enable_prefix_caching=False)
    first, second = SHARED + " Then her mom", SHARED + " The dog"
    cached.generate([first], params)  # fills the cache with the shared prefix
    hit = cached.generate([second], params)[0]
    assert hit.num_cached_tokens >= 32
    want = plain.generate([second], params)[0]
    assert want.num_cached_tokens == 0
    assert [o.token_ids for o in hit.outputs] == [o.token_ids for o in want.outputs]
    stats = cached.engine.stats()
    # once per request, not per sequence (n = 2 counted twice), as its usage and the worker's
    # telemetry count it: the first request found nothing
    assert stats["prefix_cache_hit_tokens"] == hit.num_cached_tokens
    n_first = len(cached.engine.tokenize_prompt(first))
    assert stats["prefix_cache_query_tokens"] == n_first + len(hit.prompt_token_ids)


def test_batch_with_shared_prefix_and_generated_blocks_are_reused(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=2_000_000)
    plain = LLM(stories_dir, kv_cache_bytes=2_000_000, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=40)
    out = llm.generate([SHARED], params)[0]
    # the next turn re-sends prompt + answer: the answer's blocks were cached while decoding
    follow = out.prompt_token_ids + out.outputs[0].token_ids + [261]
    again = llm.generate([follow], params)[0]
    # every token whose KV the first request computed (all but its last output), the partial
    # last block included
    assert again.num_cached_tokens == len(out.prompt_token_ids) + 40 - 1
    assert again.outputs[0].token_ids == plain.generate([follow], params)[0].outputs[0].token_ids


def test_eviction_under_pressure_keeps_serving_correctly(stories_dir: Path) -> None:
    # room for ~3 prompts of this size: later prompts evict earlier cached blocks
    llm = LLM(stories_dir, kv_cache_bytes=200_000)
    llm.engine.blocks.record_events = True
    plain = LLM(stories_dir, kv_cache_bytes=200_000, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [f"Story {i}. {SHARED}" for i in range(4)] * 2  # distinct blocks, then repeats
    got = [llm.generate([p], params)[0] for p in prompts]
    want = [plain.generate([p], params)[0] for p in prompts]
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    _, evicted = llm.engine.blocks.drain_events()
    assert evicted, "the small cache should have evicted blocks"


def test_a_request_waiting_for_room_counts_in_the_hit_rate_once(stories_dir: Path) -> None:
    """The scheduler matches the head of the queue's prefix at every step it waits for blocks
    (and gives them back when there is no room); the hit-rate counters count it once, when it
    is admitted (they counted every try: 4,020 query tokens for one 126-token wait)."""
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    block = 5 * 2 * 16 * 4 * 8 * 4  # stories260K's, 16 tokens
    engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=8 * block,
                                    num_threads=1))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    hog, waiter = list(range(10, 110)), list(range(10, 26)) + list(range(200, 240))
    engine.add_request("hog", hog, params)  # 7 of the 8 blocks, then all 8 (120 tokens)
    engine.step()
    engine.add_request("waiter", waiter, SamplingParams(temperature=0, max_tokens=2))
    waited = 0
    while engine.has_unfinished():
        engine.step()
        waited += any(r.request_id == "waiter#0" for r in engine.scheduler.waiting)
    assert waited >= 3  # tried (and matched) at each of these steps
    blocks = engine.blocks
    assert blocks.query_tokens == len(hog) + len(waiter), blocks.query_tokens
    assert blocks.hit_tokens == 16  # the waiter's first block: the hog's, cached


def test_a_preempted_request_counts_in_the_hit_rate_and_usage_once(stories_dir: Path) -> None:
    """A request preempted (recomputed) and readmitted matches its prompt again and finds its
    own blocks still cached: the hit-rate counters and its usage count its first admission only
    (they counted the readmission too, as a new query that hit its own blocks), and its output
    is the one it has without a preemption."""
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    def serve(num_blocks: int) -> tuple[LLMEngine, dict[str, list[int]], dict[str, int]]:
        block = 5 * 2 * 16 * 4 * 8 * 4  # stories260K's, 16 tokens
        engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=num_blocks * block,
                                        num_threads=1))  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        first = list(range(10, 50))
        engine.add_request("first", first, params)
        engine.step()  # first's blocks are cached: second's first block hits
        engine.add_request("second", [*first[:16], *range(300, 324)], params)
        tokens, cached = {}, {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
                    cached[o.request_id] = o.num_cached_tokens
        return engine, tokens, cached

    # 8 blocks: the two requests need 5 each (80 tokens, one block shared) and cannot both run
    small, got, cached = serve(8)
    assert small.scheduler.num_preemptions >= 1, "the cache was meant to be too small"
    big, want, _ = serve(64)
    assert big.scheduler.num_preemptions == 0
    assert got == want
    assert cached == {"first": 0, "second": 16}
    for engine in (small, big):
        stats = engine.stats()
        assert stats["prefix_cache_query_tokens"] == 40 + 40, stats
        assert stats["prefix_cache_hit_tokens"] == 16, stats


def test_a_tail_in_use_is_copied_for_a_second_prompt_that_continues_it() -> None:
    """A kept partial block taken over by one request still holds the tail's tokens in its
    first slots: a second prompt that continues them gets a fresh block with those slots copied
    (it recomputed them: the tail was gone from the cache once taken). With no copy (a model
    split over ranks) it computes them, as before; the copy's records go with its blocks."""
    copies: list[tuple[int, int, int]] = []
    m = bm()
    m.copy_slots = lambda src, dst, n: copies.append((src, dst, n))
    run(m, "a", list(range(10)))
    m.free("a", list(range(10)))  # its tail: [8, 9]
    follow = [*range(10), 50, 51]
    assert m.match_prefix("b", follow) == 10  # takes the block over
    tail = m.block_table("b")[2]
    assert m.match_prefix("c", follow) == 10 and copies == [(tail, m.block_table("c")[2], 2)]
    assert m.match_prefix("d", [*range(9), 70]) == 8  # shares part of it only: no copy
    assert len(copies) == 1
    for rid in ("b", "c", "d"):
        m.free(rid)
    assert not m._used_tails and not m._used_parent and m.num_free_blocks == 8
    m.copy_slots = None
    run(m, "a", list(range(10)))
    m.free("a", list(range(10)))
    assert m.match_prefix("b", follow) == 10
    assert m.match_prefix("c", follow) == 8  # no copy: the tail's tokens computed again
