"""A split model's ranks failing in the middle of serving (runtime.ranks.RankGroup): a follower
killed mid-step is the rank named, within moments, and the others are stopped (a follower that
saw it hang up exited first of its own error and was named instead, "code 1"); one that hangs
is named too, once silent for a while (rank 0 waited gloo's 10 minutes and named no one; with
pp, failed after 10 s naming no one); a last pipeline stage whose step takes long is waited for
(rank 0 gave up after 10 s); a close while a step hangs on a stuck follower ends that step and
returns (it waited as long); a step that samples nothing passes the ranks (it failed them); a
closed group is let go."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runtime import ranks as ranks_module
from runtime.llm import LLM
from runtime.ranks import RankFailure
from runtime.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def _serve_until_it_fails(llm: LLM, result: dict[str, object]) -> threading.Thread:
    """A thread that generates, over and over, until a generate raises (what it raised and
    when go in `result`)."""

    def run() -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                llm.generate([[1, 403, 407, 261]] * 4, LONG)
        except BaseException as e:  # (what the test asserts on)
            result["error"], result["at"] = e, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _stop_mid_step(llm: LLM, follower: Any, result: dict[str, object]
                   ) -> tuple[threading.Thread, float]:  # fmt: skip
    """Steps running (`_serve_until_it_fails`), then `follower` stopped (SIGSTOP: alive and
    silent): (the serving thread, when the follower was stopped)."""
    thread = _serve_until_it_fails(llm, result)
    time.sleep(0.5)
    assert follower.pid is not None
    stopped = time.monotonic()
    os.kill(follower.pid, signal.SIGSTOP)
    return thread, stopped


def test_a_rank_killed_mid_step_is_named_and_the_others_stopped(stories_dir: Path) -> None:
    """tp=2 x pp=2, rank 3 killed while steps run: the step fails within moments naming rank 3
    (rank 1, which saw it hang up, exited of that error first and was named: "rank 1 of 4
    exited (code 1)", as often as not: whichever the watchdog saw first), and the other
    followers are stopped by rank 0 at once, without waiting for a close."""
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2, pp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    try:
        result: dict[str, object] = {}
        thread = _serve_until_it_fails(llm, result)
        time.sleep(0.5)  # steps running
        killed = time.monotonic()
        pid = ranks.procs[2].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive()
        error = result["error"]
        assert isinstance(error, RankFailure)
        assert str(error) == "rank 3 of 4 exited (code -9)"
        assert ranks.failed == "rank 3 of 4 exited (code -9)"
        assert float(result["at"]) - killed < 3  # type: ignore[arg-type]
        # stopped by rank 0, every one, and reaped (not zombies until the close), without the
        # close: the peers that saw rank 3 hang up left too (code 1), but it is the one named
        ranks._watch.join(10)
        assert not ranks._watch.is_alive()
        assert [_state(p.pid) for p in ranks.procs] == ["gone"] * 3
        assert all(p.exitcode is not None for p in ranks.procs)
    finally:
        ranks.close()


def _state(pid: int | None) -> str:
    """A process's state letter ("Z": exited, not reaped), or "gone" once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _fails_on_its_own_mid_step(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower (in its own process) whose third step raises an error of its own. (Its wait
    to be killed, which the code had, made long: a rank 0 that waited for it is caught.)"""
    ranks_module.LEAVE_AFTER_S = 600.0  # type: ignore[attr-defined]

    def boom() -> None:
        raise RuntimeError("boom in a step")

    _third_step_first(spec, rank, boom)


def _third_step_first(spec: ranks_module.RankSpec, rank: int, before: Callable[[], None]) -> None:
    """Run a follower (in its own process) whose third step first calls `before`."""
    real, count = ranks_module.run_step, [0]

    def run_step(*args: Any) -> Any:
        count[0] += 1
        if count[0] == 3:
            before()
        return real(*args)

    ranks_module.run_step = run_step  # type: ignore[assignment]
    ranks_module._follower_main(spec, rank)


def test_a_rank_that_fails_on_its_own_is_named_at_once_and_reaped(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp=2, the follower's step raises: it waited LEAVE_AFTER_S (5 s) before exiting, so as not
    to be named in place of a peer that died, and rank 0's step waited as long. It leaves at
    once, saying why, and rank 0 names it with its error; it is reaped without the close."""
    monkeypatch.setattr(ranks_module, "_follower_main", _fails_on_its_own_mid_step)
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    try:
        result: dict[str, object] = {}
        thread = _serve_until_it_fails(llm, result)
        thread.join(30)
        assert not thread.is_alive(), "rank 0 waited for the follower that failed"
        assert isinstance(result["error"], RankFailure)
        assert str(result["error"]) == "rank 1 of 2 failed: RuntimeError: boom in a step"
        ranks._watch.join(10)
        assert _state(ranks.procs[0].pid) == "gone"
    finally:
        for p in ranks.procs:
            if p.exitcode is None:  # (the old code: still waiting)
                p.kill()
        ranks.close()


def test_a_close_while_a_step_hangs_ends_it(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp=2, the follower stopped (SIGSTOP) while steps run: rank 0's step waits on it (gloo's
    10 minutes). A close then stops the follower under the step, which fails with RankFailure
    saying so, and returns (it waited for the step, so as long)."""
    monkeypatch.setattr(ranks_module, "CLOSE_WAIT_S", 1.0, raising=False)
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    follower = ranks.procs[0]
    try:
        result: dict[str, object] = {}
        thread, _ = _stop_mid_step(llm, follower, result)
        time.sleep(0.5)
        assert thread.is_alive() and not result  # the step waits on the stopped follower
        closing = threading.Thread(target=ranks.close, daemon=True)
        t0 = time.monotonic()
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "close waited on the hung step"
        assert time.monotonic() - t0 < 5
        thread.join(5)
        assert isinstance(result.get("error"), RankFailure)
        assert "did not end within 1 s of their close" in str(result["error"])
        assert follower.exitcode is not None
    finally:
        if follower.exitcode is None:  # (the old code: the close hangs until the step ends)
            follower.kill()
            follower.join(5)
        ranks.close()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_rank_that_hangs_mid_step_is_named(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int
) -> None:
    """tp=2, the follower stopped (SIGSTOP: alive, silent) while steps run: rank 0's step waited
    on it for gloo's 10 minutes, then failed without naming it; pp=2, rank 0's receive from the
    last stage gave up after CONNECT_TIMEOUT (10 s; 2 s here), naming no one. Its sign of life
    stops, and once it has been silent for HANG_AFTER_S (5 s here) the step fails naming it,
    and it is stopped."""
    monkeypatch.setattr(ranks_module, "CONNECT_TIMEOUT", timedelta(seconds=2))
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=tp, pp=pp)
    # (after the start: a loaded machine's start-up is no test of this)
    monkeypatch.setattr(ranks_module, "HANG_AFTER_S", 5.0, raising=False)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    follower = ranks.procs[0]
    try:
        result: dict[str, object] = {}
        thread, stopped = _stop_mid_step(llm, follower, result)
        thread.join(15)
        assert not thread.is_alive(), "the step waited on the hung rank"
        assert isinstance(result["error"], RankFailure)
        assert str(result["error"]).startswith("rank 1 of 2 stopped responding")
        assert float(result["at"]) - stopped < 10  # type: ignore[arg-type]
        ranks._watch.join(10)  # (it stops and reaps the follower)
        assert follower.exitcode == -9
    finally:
        if follower.exitcode is None:  # (the old code: still waiting)
            follower.kill()
            follower.join(5)
        ranks.close()


SLOW_STEP_S = 4.0


def _last_stage_slow_once(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower (in its own process) whose first step of more than 32 tokens takes SLOW_STEP_S
    longer (a long prefill on a big model)."""
    real, slowed = ranks_module.run_stages, [False]

    def run_stages(model: Any, kv_caches: Any, plans: Any, sends: Any) -> Any:
        if not slowed[0] and sum(ids.shape[0] for ids, _ in plans) > 32:
            slowed[0] = True
            time.sleep(SLOW_STEP_S)
        return real(model, kv_caches, plans, sends)

    ranks_module.run_stages = run_stages
    ranks_module._follower_main(spec, rank)


def test_a_last_stage_slower_than_the_connect_bound_is_waited_for(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp=2, the last stage's step (a 40-token prompt's prefill) takes longer than
    CONNECT_TIMEOUT (2 s here, 10 s in use): rank 0's receive of its hidden states kept that
    bound, the one its groups were formed with (torch's _set_pg_timeout changes only the
    collectives'), and the step failed the ranks ("Timed out waiting 2000ms for recv"). It is
    waited for, as a collective is (COLLECTIVE_TIMEOUT), and answers as a fast one does."""
    monkeypatch.setattr(ranks_module, "CONNECT_TIMEOUT", timedelta(seconds=2))
    monkeypatch.setattr(ranks_module, "_follower_main", _last_stage_slow_once)
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, pp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    prompt = [1, *range(20, 60)]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        t0 = time.monotonic()
        slow = list(llm.generate([prompt], greedy)[0].outputs[0].token_ids)
        assert time.monotonic() - t0 >= SLOW_STEP_S  # (the slow step was this one)
        assert ranks.failed is None
        assert list(llm.generate([prompt], greedy)[0].outputs[0].token_ids) == slow
    finally:
        ranks.close()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_step_that_samples_nothing_passes_the_ranks(stories_dir: Path, tp: int, pp: int) -> None:
    """A prompt longer than a step's token budget, prefilled alone: its first chunks sample no
    token. Split over ranks, stage 0 ran the LM head on no rows all the same, whose matmul
    refuses them: the ranks failed ("a collective failed: small_linear ... got 0") and the worker
    with them. Now the answers are one rank's."""
    prompts = [[1, *range(20, 120)], [1, 403, 407, 261, 378]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw: dict[str, Any] = {"kv_cache_bytes": 4 << 20, "max_num_batched_tokens": 24}
    want = [
        list(o.outputs[0].token_ids)
        for o in LLM(stories_dir, num_threads=1, **kw).generate(prompts, greedy)
    ]
    llm = LLM(stories_dir, tp=tp, pp=pp, **kw)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    try:
        for prompt, tokens in zip(prompts, want, strict=True):  # each alone: nothing decodes
            assert list(llm.generate([prompt], greedy)[0].outputs[0].token_ids) == tokens
        assert ranks.failed is None
    finally:
        ranks.close()


def test_a_closed_group_is_let_go(stories_dir: Path) -> None:
    """A split engine closed and dropped lets its group go, and with it its followers' pipes
    (its exit hook kept it for good: two more open file descriptors every split engine a
    process starts)."""
    import gc
    import weakref

    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    assert llm.generate([[1, 403, 407]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    ranks.close()
    ranks._watch.join(5)  # (its watchdog, which holds it while it runs, ends with the close)
    group = weakref.ref(ranks)
    del llm, ranks
    gc.collect()
    assert group() is None


def _holds_the_interpreter_in_a_step(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower whose third step first computes for ~6 s in one C call that keeps the
    interpreter (GIL) held: its sign-of-life thread cannot run meanwhile. (The repository's own
    CPU kernels kept it until 7362b5a; a C extension of a model's may still.)"""
    t0 = time.perf_counter()
    sum(range(2_000_000))
    per_item = (time.perf_counter() - t0) / 2_000_000

    def compute() -> None:
        sum(range(int(6.0 / per_item)))  # one call, the GIL held throughout

    _third_step_first(spec, rank, compute)


def test_a_rank_computing_with_the_interpreter_held_is_not_taken_for_hung(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp=2, the follower's step runs one C call that keeps the GIL for longer than HANG_AFTER_S
    (3 s here): its sign-of-life thread was held up with it, and rank 0 named it "stopped
    responding" and failed a healthy group. A follower that computes (its CPU time advancing)
    is not silent; one stopped still is (test_a_rank_that_hangs_mid_step_is_named)."""
    monkeypatch.setattr(ranks_module, "_follower_main", _holds_the_interpreter_in_a_step)
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2)
    monkeypatch.setattr(ranks_module, "HANG_AFTER_S", 3.0, raising=False)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    try:
        for _ in range(4):
            out = llm.generate([[1, 403, 407, 261]], SamplingParams(max_tokens=2))
            assert out[0].outputs[0].token_ids
        assert ranks.failed is None
    finally:
        ranks.close()


def test_a_pause_of_the_whole_group_does_not_count_as_a_silent_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's watch and the followers paused together (Ctrl-Z, a frozen container): on
    resuming, every follower's last sign of life is older than HANG_AFTER_S, and the watch named
    a live rank and stopped them all. Silence counts from the watch's own return; a follower
    that stays silent after it is still named."""
    clock = [1000.0]
    monkeypatch.setattr(ranks_module.time, "monotonic", lambda: clock[0])
    beats = [0.0, 1000.0]
    silence = ranks_module._Silence(beats)
    assert silence.first() is None
    clock[0] += ranks_module.HANG_AFTER_S + 30  # all paused, the clock ran on
    assert silence.first() is None  # (the old watch: "rank 1 of 2 stopped responding")
    for _ in range(int(ranks_module.HANG_AFTER_S) + 2):  # resumed; rank 1 silent from here
        clock[0] += 1.0
        if silence.first() is not None:
            break
    assert "rank 1 of 2 stopped responding" in str(silence.first())
    beats[1] = clock[0]  # a beat: fine again
    assert silence.first() is None


def test_a_silent_rank_that_computes_is_named_only_once_it_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch's view of a follower whose beat is held up (its main thread keeps the GIL):
    while its CPU time advances by half a core or more it is not silent; once that stops too,
    it is named HANG_AFTER_S later."""
    clock, cpu = [1000.0], [50.0]
    monkeypatch.setattr(ranks_module.time, "monotonic", lambda: clock[0])
    beats = [0.0, 1000.0]
    silence = ranks_module._Silence(beats, lambda rank: cpu[0])
    for _ in range(int(ranks_module.HANG_AFTER_S) * 3):  # no beat, a core's worth of CPU a second
        clock[0] += 1.0
        cpu[0] += 1.0
        assert silence.first() is None
    stuck = clock[0]
    while silence.first() is None and clock[0] < stuck + ranks_module.HANG_AFTER_S + 5:
        clock[0] += 1.0
        cpu[0] += 0.01  # (a thread's waits for the GIL: not computing)
    assert "rank 1 of 2 stopped responding" in str(silence.first())
    assert clock[0] - stuck > ranks_module.HANG_AFTER_S
