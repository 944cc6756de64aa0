"""The scheduler and block manager, driven step by step with no model: assert on what they decide."""

from __future__ import annotations

from runtime.kv_cache import BlockManager
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams
from runtime.scheduler import QueueFullError, Scheduler, SchedulerOutput


def req(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        params=SamplingParams(temperature=0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({2}),
    )


def sched(
    num_blocks: int = 64, block_size: int = 4, seqs: int = 8, budget: int = 32, waiting: int = 100
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), seqs, budget, waiting)


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def sample_all(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    s.update(out, {x.request.request_id: [token] for x in out.scheduled if x.samples})


def test_block_manager_allocate_and_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.blocks_needed("a", 5) == 2
    assert bm.allocate("a", 5) is not None and len(bm.block_table("a")) == 2
    assert bm.allocate("a", 8) == bm.block_table("a") and len(bm.block_table("a")) == 2
    assert not bm.can_allocate("b", 9)
    assert bm.allocate("b", 9) is None  # no room is a return value
    assert bm.num_free_blocks == 2
    assert bm.free("a") == 2 and bm.num_free_blocks == 4
    assert bm.free("a") == 0


def test_block_manager_hands_out_the_lowest_free_block_first() -> None:
    # The blocks in use stay packed at the start of the cache, whose pages are committed lazily.
    bm = BlockManager(num_blocks=8, block_size=4, caching=False)
    assert bm.allocate("a", 12) == [0, 1, 2]
    assert bm.allocate("b", 8) == [3, 4]
    bm.free("a")
    assert bm.allocate("c", 8) == [0, 1]  # not 5, 6: freed blocks come back before fresh ones
    bm.free("b")
    assert bm.allocate("d", 16) == [2, 3, 4, 5]
    bm.trim("d", 4)  # blocks 3, 4, 5 dropped
    assert bm.allocate("e", 4) == [3]


def test_prefill_then_decode() -> None:
    s = sched()
    s.add(req("a", 10))
    out = s.schedule()
    assert plan(out) == {"a": 10}
    assert out.scheduled[0].samples
    sample_all(s, out)
    assert plan(s.schedule()) == {"a": 1}


def test_chunked_prefill_under_budget() -> None:
    s = sched(budget=8)
    s.add(req("a", 20))
    sizes = []
    for _ in range(3):
        out = s.schedule()
        sizes.append(plan(out)["a"])
        assert out.scheduled[0].samples == (sum(sizes) == 20)
        sample_all(s, out)
    assert sizes == [8, 8, 4]
    assert s.requests["a"].output_token_ids == [7]


def test_decodes_not_starved_by_prefill() -> None:
    s = sched(budget=8)
    for rid in ("a", "b"):
        s.add(req(rid, 2))
    sample_all(s, s.schedule())  # both prefilled
    s.add(req("long", 100))
    for _ in range(5):
        out = s.schedule()
        p = plan(out)
        assert p["a"] == 1 and p["b"] == 1  # every decode runs every step
        assert p["long"] == 6  # the prefill gets what is left of the budget
        sample_all(s, out)


def test_fcfs_and_seat_limit() -> None:
    s = sched(seqs=2)
    for rid in ("a", "b", "c"):
        s.add(req(rid, 4))
    out = s.schedule()
    assert list(plan(out)) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_head_of_queue_blocks_behind_it() -> None:
    s = sched(num_blocks=4, block_size=4)
    s.add(req("big", 20))  # needs 5 blocks: never fits now
    s.add(req("small", 2))
    assert s.schedule().empty  # FCFS: small does not jump ahead


def test_preemption_by_recompute() -> None:
    s = sched(num_blocks=4, block_size=4, budget=64)
    s.add(req("old", 7, max_tokens=20))
    s.add(req("new", 7, max_tokens=20))
    sample_all(s, s.schedule())  # 2 blocks each: cache full
    out = s.schedule()  # both decode at token 8: fits in the second block
    assert plan(out) == {"old": 1, "new": 1}
    sample_all(s, out)
    out = s.schedule()  # token 9 needs a third block for each: the newest is preempted
    assert plan(out) == {"old": 1}
    assert out.preempted == ["new"]
    new = s.requests["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert s.waiting[0] is new  # back at the head of the queue
    assert s.blocks.block_table("new") == []


def test_a_preempted_request_counts_in_the_hit_rate_and_usage_once() -> None:
    """The prefix-cache counters count a request's prompt at its first admission only: readmitted
    after a preemption, it matched its prompt again and found its own blocks still cached, and
    was counted again (query 23 tokens, hits 12, for these two 7-token prompts)."""
    s = sched(num_blocks=4, block_size=4, budget=64)
    old = req("old", 7, max_tokens=6)
    new = req("new", 7, max_tokens=6)
    new.prompt_token_ids = [*old.prompt_token_ids[:4], 50, 51, 52]  # old's first block, then not
    s.add(old)
    sample_all(s, s.schedule())  # old's first block is cached
    s.add(new)
    cached_at_admission = []
    for _ in range(30):
        waited = new.status is RequestStatus.WAITING
        out = s.schedule()
        if out.empty:
            break
        if waited and new.status is RequestStatus.RUNNING:  # admitted: from the cached prefix
            cached_at_admission.append(new.num_computed_tokens)
        sample_all(s, out)
    assert not s.has_unfinished() and s.num_preemptions == 1 and new.num_preemptions == 1
    assert cached_at_admission == [4, 8]  # readmitted: old's block, and its own second one
    assert new.num_cached_tokens == 4  # usage: what its first admission found
    assert s.blocks.query_tokens == 7 + 7, s.blocks.query_tokens
    assert s.blocks.hit_tokens == 4, s.blocks.hit_tokens


def test_an_export_that_needs_room_is_dropped_with_its_blocks_held() -> None:
    # a KV export's puller may be reading the blocks it reported: preempting and recomputing it
    # would hand those blocks to another request mid-transfer
    s = sched(num_blocks=4, block_size=4, budget=5)
    s.add(req("decode", 5, max_tokens=20))
    sample_all(s, s.schedule())  # its prompt: 2 blocks
    export = req("export", 12, max_tokens=1)
    export.prompt_token_ids = list(range(100, 112))  # nothing cached to share
    export.hold_kv = True
    s.add(export)
    for _ in range(2):  # a decode, and a 4-token chunk of the export's prompt each
        out = s.schedule()
        assert plan(out) == {"decode": 1, "export": 4}
        sample_all(s, out)
    assert s.blocks.num_free_blocks == 0
    out = s.schedule()  # its third chunk needs a block: dropped, not recomputed
    assert plan(out) == {"decode": 1} and out.dropped == [export] and out.preempted == []
    assert export.status is RequestStatus.FINISHED_ABORTED and not s.waiting
    assert s.held == {"export"} and len(s.blocks.block_table("export")) == 2
    assert s.release("export") == 2 and s.blocks.num_free_blocks == 2


def test_a_request_waits_for_held_exports_rather_than_preempt_itself() -> None:
    s = sched(num_blocks=4, block_size=4, budget=64)
    s.add(req("decode", 4, max_tokens=20))
    sample_all(s, s.schedule())  # 1 block
    export = req("export", 8, max_tokens=1)
    export.prompt_token_ids = list(range(100, 108))
    export.hold_kv = True
    s.add(export)
    sample_all(s, s.schedule())  # the export's 2 blocks, held once it finished
    assert s.held == {"export"} and s.blocks.num_free_blocks == 0
    for _ in range(3):  # decode's tokens 6 to 8 fill its second block
        sample_all(s, s.schedule())
    for _ in range(3):  # its 9th needs a third: it waits, keeping its blocks
        out = s.schedule()
        assert plan(out) == {} and out.preempted == [] and s.num_preemptions == 0
    s.release("export")
    assert plan(s.schedule()) == {"decode": 1}


def test_an_export_aborted_before_it_held_blocks_holds_nothing() -> None:
    """An export aborted while it waited (no block yet) is not listed as held: a request that
    ran out of room waited for its `release`, as for one holding blocks, instead of preempting
    itself, until the transfer's deadline (seconds), though nothing could come back."""
    s = sched(num_blocks=2, block_size=4, budget=64)
    s.add(req("decode", 4, max_tokens=20))
    sample_all(s, s.schedule())  # 1 block
    export = req("export", 8, max_tokens=1)
    export.hold_kv = True
    s.add(export)
    s.finish("export", RequestStatus.FINISHED_ABORTED)  # never admitted
    assert s.held == set() and s.release("export") == 0
    for _ in range(4):  # decode's tokens 5 to 8 fill its second block
        sample_all(s, s.schedule())
    out = s.schedule()  # its 9th needs a third: nothing can free one, so it preempts itself
    assert out.preempted == ["decode"]  # (it waited for the export's release, step after step)


def test_finish_on_max_tokens_and_eos_frees_blocks() -> None:
    s = sched()
    s.add(req("a", 4, max_tokens=2))
    s.add(req("b", 4, max_tokens=10))
    sample_all(s, s.schedule())
    out = s.schedule()
    results = s.update(out, {"a": [5], "b": [2]})  # a hits max_tokens, b samples eos
    assert {r.request.request_id: r.finished for r in results} == {
        "a": RequestStatus.FINISHED_LENGTH,
        "b": RequestStatus.FINISHED_STOPPED,
    }
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert not s.has_unfinished()


def test_abort_anywhere() -> None:
    s = sched(seqs=1)
    s.add(req("run", 4))
    s.add(req("wait", 4))
    s.schedule()
    assert s.finish("run", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("wait", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("gone", RequestStatus.FINISHED_ABORTED) is None
    assert s.blocks.num_free_blocks == s.blocks.num_blocks and not s.has_unfinished()


def test_bounded_waiting_queue() -> None:
    s = sched(waiting=2)
    s.add(req("a", 4))
    s.add(req("b", 4))
    try:
        s.add(req("c", 4))
    except QueueFullError:
        pass
    else:
        raise AssertionError("the third request should have been refused")


def test_token_slice_is_the_joined_tokens_slice() -> None:
    req = Request("r", [10, 11, 12], SamplingParams(), 0, frozenset())
    req.output_token_ids.extend([20, 21])
    whole = req.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert req.token_slice(start, end) == whole[start:end], (start, end)


def test_lanes_split_requests_fairly_and_plan_alone() -> None:
    """Pipeline lanes: each step plans one lane; waiting requests are shared out between lanes;
    a lane's step never includes another lane's requests (they may be in flight)."""
    s = Scheduler(BlockManager(64, 4), 8, 64, 100, lanes=2)
    for i in range(5):
        s.add(req(f"r{i}", 4))
    a = s.schedule(0)
    assert plan(a) == {"r0": 4, "r1": 4, "r2": 4}  # ceil(5 / 2) seats
    b = s.schedule(1)
    assert plan(b) == {"r3": 4, "r4": 4}
    assert {r.request_id: r.lane for r in s.running} == {
        "r0": 0, "r1": 0, "r2": 0, "r3": 1, "r4": 1}  # fmt: skip
    sample_all(s, a)
    assert plan(s.schedule(0)) == {"r0": 1, "r1": 1, "r2": 1}  # lane 1 still in flight
    # a new request joins the lane whose step is planned next, up to its share
    s.add(req("r5", 4))
    sample_all(s, b)
    assert plan(s.schedule(1)) == {"r3": 1, "r4": 1, "r5": 4}


def test_lanes_preempt_only_within_the_lane() -> None:
    """Out of KV room, a lane preempts its own newest request, not another lane's (whose step
    may be writing its blocks)."""
    s = Scheduler(BlockManager(6, 4), 8, 64, 100, lanes=2)
    for i in range(4):
        s.add(req(f"r{i}", 6, max_tokens=10))  # 2 blocks each: 3 fit
    a = s.schedule(0)
    b = s.schedule(1)
    assert plan(a) == {"r0": 6, "r1": 6} and plan(b) == {"r2": 6}
    sample_all(s, a)
    sample_all(s, b)
    for _ in range(2):  # lane 0 reaches 8 tokens (its blocks full); r2 in lane 1 too
        out0 = s.schedule(0)
        sample_all(s, out0)
    out1 = s.schedule(1)
    sample_all(s, out1)
    out0 = s.schedule(0)  # r0 and r1 each need a third block; one is free
    assert out0.preempted == ["r1"]
    assert plan(out0) == {"r0": 1}
    assert {r.request_id for r in s.running} == {"r0", "r2"}


def _import(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    """A request queued as runtime.engine.commit_import queues a KV import: admitted
    holding its prompt's blocks, all but the last prompt token computed."""
    r = req(rid, prompt_len, max_tokens)
    assert s.blocks.allocate(rid, prompt_len - 1) is not None
    s.blocks.commit(rid, r.all_token_ids[: prompt_len - 1])
    r.num_computed_tokens = prompt_len - 1
    s.add(r)
    return r


def test_waiting_imports_holding_every_block_do_not_deadlock() -> None:
    """Nothing runs, every block is held by waiting KV imports, and each needs one more block
    for its next token (and the plain request at the head needs three): a step must still come.
    Once a decode worker's cache filled with imports, it served nothing until clients left."""
    s = sched(num_blocks=8, block_size=4, seqs=8, budget=32)
    first = req("plain", 12, max_tokens=4)
    s.add(first)
    imports = [_import(s, f"imp{i}", 9, max_tokens=4) for i in range(4)]  # 2 blocks each: all 8
    assert s.blocks.num_free_blocks == 0
    finished: set[str] = set()
    for _ in range(200):
        out = s.schedule()
        if out.empty:
            break
        sample_all(s, out)
        finished |= {r.request_id for r in [first, *imports] if r.status.name.startswith("FIN")}
    assert finished == {"plain", "imp0", "imp1", "imp2", "imp3"}, finished
    assert not s.has_unfinished() and s.blocks.num_free_blocks == 8
    assert s.num_preemptions >= 1  # an import gave its blocks back, and recomputed its prompt


def test_a_request_that_cannot_be_admitted_gives_back_the_tail_it_took() -> None:
    s = sched(num_blocks=4, block_size=4, budget=64)
    a = req("a", 6, max_tokens=1)
    s.add(a)
    sample_all(s, s.schedule())  # 6 prompt tokens computed, one sampled: a finishes
    assert a.status is RequestStatus.FINISHED_LENGTH and s.blocks.num_tail_blocks == 1
    # its next turn (a's tokens and more) takes the tail, but needs 5 blocks of the 4: it waits,
    # and the tail it took goes back to the cache, not to the plain blocks
    b = req("b", 17)
    b.prompt_token_ids = [*a.all_token_ids[:6], *range(40, 51)]
    s.add(b)
    assert not s.schedule().scheduled
    assert b.num_computed_tokens == 0 and s.blocks.num_tail_blocks == 1
    assert s.blocks.num_free_blocks == 4


def test_drafts_never_take_the_block_a_later_decode_needs() -> None:
    """Drafts ride along only where the KV cache has room for them and for one token of each
    decode behind: A's two drafts took the last free block, and B's plain decode, which needed
    a new block, was preempted (recomputed) for them."""
    s = sched(num_blocks=5, block_size=4, budget=64)
    a, b = req("A", 6, max_tokens=20), req("B", 8, max_tokens=20)
    s.add(a)
    s.add(b)
    sample_all(s, s.schedule())  # prefills: A 7 tokens (2 blocks), B 9 (3 blocks, 1 computed)
    assert s.blocks.num_free_blocks == 1
    a.spec_token_ids = [17, 18]  # A's next token and two drafts would need A's third block
    out = s.schedule()
    assert out.preempted == [] and plan(out) == {"A": 1, "B": 1}
    assert [x.spec_token_ids for x in out.scheduled] == [[], []]
    # with room for both, the drafts ride along
    s2 = sched(num_blocks=6, block_size=4, budget=64)
    a2, b2 = req("A", 6, max_tokens=20), req("B", 8, max_tokens=20)
    s2.add(a2)
    s2.add(b2)
    sample_all(s2, s2.schedule())
    a2.spec_token_ids = [17, 18]
    out = s2.schedule()
    assert out.preempted == [] and plan(out) == {"A": 3, "B": 1}
