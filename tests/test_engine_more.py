"""More engine scenarios on the real stories260K model: the prefix cache's hit-rate counters
over n > 1 and disaggregated requests, kept partial blocks shared by several requests, and the
limits (a KV cache of one block, max_num_seqs 1, a prompt that fills the context), each checked
against the block manager's books and against the same requests without the cache."""

from __future__ import annotations

from pathlib import Path

from runtime.config import EngineConfig
from runtime.engine import LLMEngine, RequestGroup
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from tests.test_engine_invariants import BLOCK_16, assert_all_free, assert_books_balance


def _engine(stories_dir: Path, blocks: int = 64, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_bytes=blocks * BLOCK_16,
                                  num_threads=1, **kwargs))  # type: ignore[arg-type]  # fmt: skip


def _drain(e: LLMEngine) -> dict[str, RequestOutput]:
    outs: dict[str, RequestOutput] = {}
    steps = 0
    while e.has_unfinished():
        for o in e.step():
            outs[o.request_id] = o
        assert_books_balance(e)
        steps += 1
        assert steps < 2000, "the engine does not finish"
    return outs


def _tokens(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


# ---------------------------------------------------------------------- hit-rate counters
def test_n_sequences_count_in_the_hit_rate_once(stories_dir: Path) -> None:
    """A request of n sequences is one prefix lookup (its usage reports one prompt and the
    first sequence's cached tokens, and the worker's telemetry counts it once): the engine's
    counters counted each sequence (n = 3: three times the prompt's tokens)."""
    e = _engine(stories_dir)
    first = list(range(10, 60))  # 50 tokens: 3 full blocks cached after it
    e.add_request("a", first, SamplingParams(temperature=0, max_tokens=4))
    _drain(e)
    second = [*first[:40], *range(300, 320)]  # its first 2 blocks are a's
    params = SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=6, ignore_eos=True)
    e.add_request("b", second, params)
    out = _drain(e)["b"]
    assert out.num_cached_tokens == 32
    stats = e.stats()
    assert stats["prefix_cache_query_tokens"] == len(first) + len(second), stats
    assert stats["prefix_cache_hit_tokens"] == 32, stats
    assert_all_free(e)


def _export(prefill: LLMEngine, rid: str, prompt: list[int]) -> RequestGroup:
    """Run `prompt` as a KV export on `prefill` until it finished (its blocks held)."""
    group = prefill.prepare_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1),
                                    hold_kv=True)  # fmt: skip
    prefill.enqueue(group)
    _drain(prefill)
    return group


def test_a_disaggregated_request_counts_where_its_prompt_was_computed(stories_dir: Path) -> None:
    """The prefill worker's lookup counts the prompt; the decode worker's import does not (it
    counted it again: a disaggregated request's tokens twice in the cluster's hit rate, and a
    decode worker's rate of imports it never computed)."""
    prefill, decode = _engine(stories_dir), _engine(stories_dir)
    prompt = list(range(20, 70))
    _export(prefill, "r", prompt)
    group = decode.prepare_request("r", prompt, SamplingParams(temperature=0, max_tokens=5))
    reserved = decode.reserve_import(group)
    assert reserved is not None
    cached, dst = reserved
    src = prefill.blocks.block_table("r#0")[cached // 16 :][: len(dst)]
    every = slice(0, prefill.model.cfg.num_layers)
    _, _, data = prefill.runner.kv_read(every, src)
    decode.runner.kv_write_local(every, dst, data)
    decode.commit_import(group, cached)
    prefill.release_kv("r")
    out = _drain(decode)["r"]
    assert out.finished and len(out.outputs[0].token_ids) == 5
    assert prefill.stats()["prefix_cache_query_tokens"] == len(prompt)
    assert decode.stats()["prefix_cache_query_tokens"] == 0, decode.stats()
    assert decode.stats()["prefix_cache_hit_tokens"] == 0
    assert_all_free(prefill)
    assert_all_free(decode)


# ---------------------------------------------------------------------- kept partial blocks
def _turns(e: LLMEngine, params: SamplingParams, together: int) -> tuple[list[int], list[RequestGroup], dict[str, RequestOutput]]:  # fmt: skip
    """A first turn, then `together` requests at once that continue its prompt and reply (its
    partial last block kept); returns the first's computed tokens and the later groups."""
    first = list(range(10, 50))  # 40 tokens: 2 full blocks and a partial one
    e.add_request("t1", first, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    reply = _drain(e)["t1"].outputs[0].token_ids
    groups = []
    for i in range(together):
        follow = [*first, *reply, 7 + i, 8, 9]
        groups.append(e.prepare_request(f"t2-{i}", follow, params))
        e.enqueue(groups[-1])
    outs = _drain(e)
    assert_all_free(e)
    return [*first, *reply[:-1]], groups, outs


def test_a_kept_partial_block_serves_every_request_that_continues_it(stories_dir: Path) -> None:
    """A second request of the conversation sent at once (as the other sequences of an n > 1
    request, without a first to wait for) reuses the first turn's partial last block as the
    first request does (it recomputed it: 32 of 45 cached tokens), through a copy of its slots;
    output is the same as with no prefix caching, and every block is free at the end."""
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=8, ignore_eos=True)
    e = _engine(stories_dir)
    computed, groups, got = _turns(e, params, together=2)
    # each request's first sequence: the kept block (the second through a copy); the others
    # wait for it and find its prompt's full blocks, the kept one's filled since
    assert [g.seqs[0].num_cached_tokens for g in groups] == [len(computed)] * 2
    assert all(s.num_cached_tokens >= len(computed) for g in groups for s in g.seqs)
    plain = _engine(stories_dir, enable_prefix_caching=False)
    _, plain_groups, want = _turns(plain, params, together=2)
    assert all(s.num_cached_tokens == 0 for g in plain_groups for s in g.seqs)
    assert {k: _tokens(v) for k, v in got.items()} == {k: _tokens(v) for k, v in want.items()}
    greedy = SamplingParams(temperature=0, n=2, max_tokens=8, ignore_eos=True)
    assert {k: _tokens(v) for k, v in _turns(_engine(stories_dir), greedy, 3)[2].items()} == {
        k: _tokens(v) for k, v in _turns(plain, greedy, 3)[2].items()
    }


def test_a_copied_tail_s_source_may_end_first_and_its_copy_is_kept(stories_dir: Path) -> None:
    """The request that took the kept block over is aborted right after the second copied it:
    the copy's slots stay valid, it is kept as a tail in its turn, and a third request that
    continues the copy computes from its end, with the output of a cache-less engine."""
    e = _engine(stories_dir, blocks=16)
    computed, _, _ = _turns(e, SamplingParams(temperature=0, max_tokens=1), together=0)
    tail = computed[32:]
    follow = [*computed, 500, 501]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    e.add_request("owner", follow, params)  # (the first: takes the kept block over)
    e.add_request("copier", [*computed, 450], params)
    e.step()  # both admitted: owner took the block over, copier got a copy
    assert e.blocks.num_tail_blocks == 0
    e.abort("owner")
    e.abort("copier")
    assert e.blocks.num_tail_blocks == 2  # the block and its copy, each with what it held
    third = [*computed, 450, 451, 452]  # continues the copy (the copier's computed tokens)
    e.add_request("third", third, params)
    out = _drain(e)["third"]
    assert out.num_cached_tokens == len(computed) + 1 and len(tail) == 13
    plain = _engine(stories_dir, enable_prefix_caching=False)
    plain.add_request("third", third, params)
    assert _tokens(out) == _tokens(_drain(plain)["third"])
    assert_all_free(e)


def test_the_sequences_of_a_request_compute_its_prompt_once(stories_dir: Path) -> None:
    """n sequences share a prompt: the others wait while the first computes it, then find its
    full blocks cached (admitted beside it, each computed the whole prompt: n = 4 and 200
    tokens, 808 tokens computed); output is that of an engine without prefix caching."""
    params = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=3, ignore_eos=True)
    prompt = list(range(10, 210))  # 12 full blocks and 8 tokens

    def serve(e: LLMEngine) -> tuple[int, list[list[int]]]:
        computed = 0
        execute = e.runner.execute

        def counted(out, tables):  # type: ignore[no-untyped-def]
            nonlocal computed
            computed += out.num_batched_tokens
            return execute(out, tables)

        e.runner.execute = counted  # type: ignore[method-assign]
        e.add_request("x", prompt, params)
        out = _drain(e)["x"]
        assert_all_free(e)
        return computed, _tokens(out)

    cached, got = serve(_engine(stories_dir))
    plain, want = serve(_engine(stories_dir, enable_prefix_caching=False))
    assert got == want
    assert plain == 4 * (200 + 2)
    assert cached == 200 + 3 * 8 + 4 * 2, cached  # the others: the partial block, 2 decodes
