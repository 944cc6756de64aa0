"""A split worker left idle (runtime.ranks): its followers wait for rank 0's next command for as
long as it sends none. They waited with gloo's bound (COLLECTIVE_TIMEOUT, 10 minutes), rank 0
sends nothing while idle, and every split worker died 10 minutes after its last request ("rank 1
of 2 failed: ... Timed out waiting 600000ms for recv").

The followers here are the real ones, started by spawn, with that bound cut to FOLLOWER_BOUND in
their own processes: `_follower_main` is swapped for a function of this module, which the
follower imports and which cuts it there before running the real `_follower_main`."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime import ranks as ranks_module
from runtime.llm import LLM
from runtime.parallel import RankPlace
from runtime.sampling_params import SamplingParams

FOLLOWER_BOUND = timedelta(seconds=3)


def _gloo_bound_cut(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower (in its own process) whose gloo bound, COLLECTIVE_TIMEOUT, is FOLLOWER_BOUND:
    its groups form with it (`_join`), and its collectives and receives in a step get it."""
    ranks_module.COLLECTIVE_TIMEOUT = FOLLOWER_BOUND
    join = ranks_module._join

    def short_join(spec: ranks_module.RankSpec, rank: int, store: dist.Store,
                   timeout: timedelta | None = None) -> RankPlace:  # fmt: skip
        return join(spec, rank, store, FOLLOWER_BOUND)

    ranks_module._join = short_join
    ranks_module._follower_main(spec, rank)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_an_idle_split_worker_serves_after_its_followers_bound(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int
) -> None:
    """tp=2 and pp=2, idle for longer than the followers' gloo bound (3 s here, 10 minutes in
    use) between two requests: the follower timed out waiting for the next command, left, and
    the second request failed with the ranks. It waits on, and the second answers as the
    first."""
    monkeypatch.setattr(ranks_module, "_follower_main", _gloo_bound_cut)
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=tp, pp=pp)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        first = list(llm.generate([[1, 403, 407]], greedy)[0].outputs[0].token_ids)
        time.sleep(FOLLOWER_BOUND.total_seconds() + 1.5)  # idle
        assert ranks.failed is None, ranks.failed
        assert all(p.exitcode is None for p in ranks.procs)
        assert list(llm.generate([[1, 403, 407]], greedy)[0].outputs[0].token_ids) == first
        assert ranks.failed is None
    finally:
        ranks.close()
