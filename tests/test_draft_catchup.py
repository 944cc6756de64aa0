"""The draft model's prefill keeps pace with the target's.

The draft began computing its KV of a prompt only once the target had finished the prompt's
prefill; chunked by `max_num_batched_tokens`, as the target's is, a prompt of n budgets was then
decoded n steps plainly (no drafts) after its prefill. The draft now computes the prompt while
the target prefills it (what the target has computed and computes in the step, a step behind),
and a request drafts from its first decode step. Greedy output stays the target's alone; no
block of either cache is held once a request finishes, is aborted mid-prefill, or preempted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from runtime import LLM, SamplingParams
from runtime.engine import LLMEngine
from runtime.request import Request
from tests.test_draft_vocab import _no_block_held, _proposer
from tests.test_engine import llm_block_bytes

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. "
)
LONG = STORY * 4  # 230 tokens: 8 prefill steps of BUDGET, the last one of 6
BUDGET = 32  # max_num_batched_tokens of the engines here
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _llm(model_dir: Path, draft_dir: Path | None = None, kv_cache_bytes: int = 4_000_000) -> LLM:
    spec = None
    if draft_dir is not None:
        spec = {"method": "draft", "draft_model": str(draft_dir), "num_tokens": 4,
                "max_batch_tokens": 64}  # fmt: skip
    return LLM(str(model_dir), kv_cache_bytes=kv_cache_bytes, block_size=16,
               max_num_batched_tokens=BUDGET, speculative=spec)  # fmt: skip


def _queued(engine: LLMEngine, request_id: str, prompt: str, params: SamplingParams) -> Request:
    """Add a request; its (one) sequence, as the scheduler holds it."""
    engine.add_request(request_id, prompt, params)
    (seq,) = [r for r in engine.scheduler.waiting if r.request_id.startswith(request_id)]
    return seq


@pytest.fixture(scope="module")
def base(stories_dir: Path) -> LLM:
    return _llm(stories_dir)


@pytest.fixture(scope="module")
def want(base: LLM) -> list[int]:
    return base.generate(LONG, GREEDY)[0].outputs[0].token_ids


def test_a_long_prompt_drafts_from_its_first_decode_step(
    stories_dir: Path, want: list[int]
) -> None:
    """The target drafting for itself (every greedy draft accepted), a prompt of 8 budgets:
    drafts at every decode step from the first (the old code decoded 7 steps plainly first, its
    draft computing a budget of the prompt each), the draft's KV within a step of the target's
    while it prefills, and the output the target's alone."""
    llm = _llm(stories_dir, stories_dir)
    engine, proposer = llm.engine, _proposer(llm)
    r = _queued(engine, "long", LONG, GREEDY)
    assert len(r.prompt_token_ids) > 7 * BUDGET
    drafted: list[bool] = []  # at each decode step: whether drafts were verified
    behind: list[int] = []  # at each step of the target's prefill: the draft's KV short of it
    while engine.has_unfinished():
        decoding, proposed = bool(r.output_token_ids), r.spec_proposed
        engine.step()
        if decoding:
            drafted.append(r.spec_proposed > proposed)
        elif not r.output_token_ids:
            shadow = proposer._shadows.get(r.request_id)
            behind.append(r.num_computed_tokens - (shadow.num_computed_tokens if shadow else 0))
    assert drafted and all(drafted), drafted
    assert len(behind) == 7 and max(behind) <= BUDGET, behind  # a step behind
    assert r.output_token_ids == want
    assert r.spec_accepted == r.spec_proposed  # the draft is the target
    _no_block_held(llm)


def test_greedy_output_is_the_target_s_with_prompts_prefilling_together(
    base: LLM, stories_dir: Path, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Two long prompts and a short one at once (their prefills share the budget, the draft's
    catch-up too), with the target drafting for itself and with a random-weight draft (most
    drafts rejected): greedy output token for token the target's alone, nothing held after."""
    prompts = [LONG, "Once upon a time", STORY * 3 + "Lily"]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    for draft in (stories_dir, tiny_model_dir("llama")):
        llm = _llm(stories_dir, draft)
        got = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in got] == want
        assert all(o.spec_proposed > 0 for o in got)
        _no_block_held(llm)


def test_abort_mid_prefill_frees_both_caches(stories_dir: Path) -> None:
    """Aborted while the target prefills (the draft holding blocks of the prompt by then):
    neither cache holds a block after."""
    llm = _llm(stories_dir, stories_dir)
    engine, proposer = llm.engine, _proposer(llm)
    r = _queued(engine, "long", LONG, GREEDY)
    for _ in range(4):
        engine.step()
    assert not r.output_token_ids and r.num_computed_tokens < len(r.prompt_token_ids)
    assert proposer.blocks.holds(r.request_id)  # the draft computes the prompt alongside
    shadow = proposer._shadows[r.request_id]
    assert shadow.num_computed_tokens >= 2 * BUDGET
    engine.abort("long")
    assert not engine.has_unfinished()
    _no_block_held(llm)


def test_a_request_preempted_mid_prefill_recovers(base: LLM, stories_dir: Path) -> None:
    """A target cache of 24 blocks, two long prompts (no prefix in common): the second is
    preempted while the target prefills it (its draft KV, begun alongside, goes with the
    target's), then readmitted; both outputs are the target's alone, both draft, nothing held
    after."""
    llm = _llm(stories_dir, stories_dir, kv_cache_bytes=24 * llm_block_bytes(stories_dir))
    engine, proposer = llm.engine, _proposer(llm)
    assert engine.blocks.num_blocks == 24
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    prompts = [LONG, "Tom and Lily were friends. " + LONG]
    a, b = (_queued(engine, rid, p, params) for rid, p in zip("ab", prompts, strict=True))
    warmed, preempted_in_prefill = False, False
    while engine.has_unfinished():
        preemptions = b.num_preemptions
        prefilling = not b.output_token_ids and b.num_computed_tokens > 0
        engine.step()
        if prefilling and b.num_preemptions > preemptions:
            preempted_in_prefill = True
            engine.step()  # (the next proposal lets its draft KV go)
            assert not proposer.blocks.holds(b.request_id)
        if not b.output_token_ids and not b.num_preemptions and proposer.blocks.holds(b.request_id):
            warmed = True
    assert warmed and preempted_in_prefill
    want_ab = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [a.output_token_ids, b.output_token_ids] == want_ab
    assert a.spec_proposed > 0 and b.spec_proposed > 0
    _no_block_held(llm)


def test_a_prompt_cached_in_the_target_still_drafts(stories_dir: Path, want: list[int]) -> None:
    """The same long prompt again: the target finds all but its last tokens cached (one prefill
    step), the draft computes it as a decode's catch-up; the output is the target's alone, and
    it drafts once caught up."""
    llm = _llm(stories_dir, stories_dir)
    llm.generate(LONG, GREEDY)
    (again,) = llm.generate(LONG, GREEDY)
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    assert again.outputs[0].token_ids == want
    assert again.spec_proposed > 0
    _no_block_held(llm)


def test_a_request_held_to_min_tokens_computes_no_draft_beside_its_prefill(
    stories_dir: Path,
) -> None:
    """min_tokens = max_tokens never drafts (decodes skip drafting until min_tokens), yet its
    whole prompt was computed by the draft beside its prefill and held the draft's blocks all
    its life: 224 draft tokens for no draft (reviewer). Its output is the target's."""
    llm = _llm(stories_dir, stories_dir)
    engine, proposer = llm.engine, _proposer(llm)
    params = SamplingParams(max_tokens=20, min_tokens=20, temperature=0.0, ignore_eos=True)
    r = _queued(engine, "held", LONG, params)
    while engine.has_unfinished():
        engine.step()
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    assert r.spec_proposed == 0 and len(r.output_token_ids) == 20
    _no_block_held(llm)
