"""Memory of a model split over ranks: the ranks are processes of one host that load at once,
so the weights are checked against the memory available as a whole (rank 0's load, for every
rank), and the KV cache is sized from what is left once every rank's weights are in."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import runtime.loader
from runtime import LLM, ModelLoadError
from runtime.loader import IMPORT_MARKER, start_load
from runtime.model_runner import kv_block_bytes
from runtime.parallel import ParallelConfig, RankPlace

SPLITS = [ParallelConfig(tp=2), ParallelConfig(pp=2)]


def _shares(model: Path, par: ParallelConfig) -> list[int]:
    """Bytes each rank's load takes, loaded rank by rank in this process."""
    shares = []
    for rank in range(par.world_size):
        pending = start_load(model, place=RankPlace(par, rank))
        pending.finish()
        shares.append(pending.nbytes)
    return shares


@pytest.mark.parametrize("par", SPLITS, ids=str)
def test_rank_0_checks_every_ranks_weights_against_the_memory(
    stories_dir: Path, par: ParallelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank checked only its own share: with memory for half the model and a little more,
    tp=2 and pp=2 started (each share passing on its own) and the kernel's OOM killer ended a
    rank mid-load. Rank 0's load now counts every rank's share, as each lays it out."""
    shares = _shares(stories_dir, par)
    pending = start_load(stories_dir, place=RankPlace(par, 0))
    pending.finish()
    assert pending.host_nbytes == sum(shares) > pending.nbytes == shares[0]
    have = sum(shares) - 1  # room for any one share, not for all of them
    assert max(shares) < have
    monkeypatch.setattr(runtime.loader, "available_memory", lambda: have)
    with pytest.raises(
        ModelLoadError,
        match=rf"stories260K: the weights need {sum(shares) / 1e6:.1f} MB of memory \(as "
        r"torch\.float32; the shares of all 2 ranks, which load at once on this host\), only "
        rf"{have / 1e6:.1f} MB is available",
    ):
        start_load(stories_dir, place=RankPlace(par, 0))
    start_load(stories_dir, place=RankPlace(par, 1)).finish()  # (once: rank 0's)
    start_load(stories_dir).close()  # one rank: the whole model's own check, as before


def test_a_split_model_that_does_not_fit_is_refused_before_it_starts(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own start: pp=2 with memory for either stage but not both is refused,
    naming what the weights need and what is available (rank 0 is this process: the
    followers, spawned, see the host's real memory and load; rank 0 refuses for all)."""
    have = sum(_shares(stories_dir, ParallelConfig(pp=2))) - 1
    monkeypatch.setattr(runtime.loader, "available_memory", lambda: have)
    try:
        llm = LLM(stories_dir, kv_cache_bytes=4 << 20, pp=2)
    except ModelLoadError as e:
        assert re.search(
            r"rank 0: ModelLoadError: .*stories260K: the weights need 1\.\d MB of "
            r"memory \(as torch\.float32; the shares of all 2 ranks",
            str(e),
        ), e
    else:
        _close(llm)
        pytest.fail("started")


@pytest.mark.parametrize(
    ("par", "imported"), [(SPLITS[0], False), (SPLITS[1], False), (SPLITS[0], True)], ids=str
)
def test_the_kv_cache_is_sized_from_what_every_ranks_weights_leave(
    stories_dir: Path, tmp_path: Path, par: ParallelConfig, imported: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """kv_cache_fraction of the memory left once the weights are in: every rank's weights, as
    every rank's share of a block counts in the block's bytes (kv_block_bytes). Rank 0's alone
    were subtracted, so a high fraction over-committed the host by the other ranks' weights;
    likewise, for a GGUF import, the exact blocks every rank keeps (packable_bytes)."""
    model = stories_dir
    if imported:  # (what the engine goes by: the importer's marker)
        model = tmp_path / "imported"
        shutil.copytree(stories_dir, model)
        (model / IMPORT_MARKER).write_text("{}")
    weights = sum(_shares(model, par))
    packable = 0
    if imported:
        for rank in range(par.world_size):
            share = start_load(model, place=RankPlace(par, rank))
            packable += share.finish().packable_bytes()
        assert packable > 0
    have = weights + (8 << 20)
    monkeypatch.setattr(runtime.loader, "available_memory", lambda: have)
    llm = LLM(model, kv_cache_fraction=0.95, tp=par.tp, pp=par.pp)
    try:
        block = kv_block_bytes(llm.engine.model, llm.engine.config.block_size)
        assert llm.engine.blocks.num_blocks == int((have - weights - packable) * 0.95) // block
    finally:
        _close(llm)


def _close(llm: LLM) -> None:
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    ranks.close()
