"""A split model's ranks starting (runtime.ranks.start_ranks) when one of them dies: a follower
that exits once it has checked in fails the start at once, naming it (rank 0 waited out gloo's
10 minutes), and the others are stopped; a follower whose rank 0 died before the follower could
arm its parent-death signal exits (it was orphaned for ~300 s); the command line reports such a
start in one line (it was a traceback); a follower that hangs while loading fails the start,
named, once silent for a while (rank 0 waited gloo's 10 minutes); a start on a port that a
killed worker's rendezvous left in TIME-WAIT starts (it found the port in use for a minute); a
second split engine in a process is refused before anything starts, and the first serves on
(the failed start destroyed the first's process group).

Followers are the real ones, started by spawn: `_follower_main` is swapped for a function of
this module, which the follower imports and which swaps in its failure there before running the
real `_follower_main`."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from kvstore.redis_server import find_free_port
from runtime import ranks as ranks_module
from runtime.llm import LLM
from runtime.parallel import ParallelConfig
from runtime.ranks import COLLECTIVE_TIMEOUT, RankStartError
from tests.stack import spawned_ranks

ROOT = Path(__file__).resolve().parents[1]


def _exits_once_checked_in(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower (in its own process): rank 1 exits with code 3 once it has checked in, before
    it joins gloo's group."""
    if rank == 1:
        ranks_module._join = lambda *args, **kwargs: os._exit(3)
    ranks_module._follower_main(spec, rank)


def _rank_1_cannot_join(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower: rank 1 fails to join gloo's group of an error of its own. (Its wait to be
    killed, which the code had, made long: a rank 0 that waited for it is caught.)"""
    if rank == 1:
        ranks_module.LEAVE_AFTER_S = 600.0  # type: ignore[attr-defined]

        def join(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no route")

        ranks_module._join = join  # type: ignore[assignment]
    ranks_module._follower_main(spec, rank)


def _rank_2_exits_while_loading(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower: rank 2 exits with code 4 half a second into its load (the group is up)."""
    if rank == 2:

        def load(*args: object) -> None:
            time.sleep(0.5)
            os._exit(4)

        ranks_module._load = load  # type: ignore[assignment]
    ranks_module._follower_main(spec, rank)


def _rank_1_hangs_while_loading(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower: rank 1 stops itself (SIGSTOP: alive, silent) half a second into its load."""
    if rank == 1:

        def load(*args: object) -> None:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGSTOP)

        ranks_module._load = load  # type: ignore[assignment]
    ranks_module._follower_main(spec, rank)


def _starts_after_its_parent_died(spec: ranks_module.RankSpec, rank: int) -> None:
    """A follower that gets to its start only once rank 0 has died, as one does whose rank 0
    dies while it still imports (too early for the parent-death signal to be armed)."""
    rank0 = mp.parent_process()  # its pid (rank 0 may be gone already: this one imported first)
    assert rank0 is not None
    parent = rank0.pid
    deadline = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    ranks_module._follower_main(spec, rank)


def _spawned_children() -> set[int]:
    """This process's children that multiprocessing spawned (ranks), zombies left out."""
    return set(spawned_ranks(os.getpid(), zombies=False))


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize(
    ("follower", "named"),
    [
        # rank 1 exits after checking in: rank 0 waited in gloo's process-group set-up for its
        # address for the 10-minute collective timeout
        (_exits_once_checked_in, r"^rank 1 of 3 exited \(code 3\) while the ranks"),
        # rank 2 exits while loading, once the group is up: its peers see it hang up in the
        # gathering of load errors; rank 0 names rank 2, not a peer that left of that error (a
        # peer waits to be stopped instead)
        (_rank_2_exits_while_loading, r"^rank 2 of 3 exited \(code 4\) while the ranks"),
        # rank 1 fails to join of its own error: it waited 5 s to be killed before leaving (so as
        # not to be named in place of a peer that died), and rank 0 for it; it leaves at once,
        # saying why, and is named with its reason
        (
            _rank_1_cannot_join,
            r"^rank 1 of 3 failed: could not join the group: no route while the ranks",
        ),
    ],
)
def test_a_follower_that_exits_fails_the_start_at_once_named(
    stories_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    follower,
    named: str,  # type: ignore[no-untyped-def]
) -> None:
    """pp=3, a follower exits while the ranks start: rank 0 raises within seconds, naming it,
    the other follower is stopped, and the process group is not left initialized."""
    before = _spawned_children()
    monkeypatch.setattr(ranks_module, "_follower_main", follower)
    t0 = time.monotonic()
    with pytest.raises(RankStartError, match=named):
        ranks_module.start_ranks(str(stories_dir), "float32", None, ParallelConfig(pp=3))
    assert time.monotonic() - t0 < 60
    assert _spawned_children() <= before  # none left running
    assert not dist.is_initialized()


def test_a_follower_that_hangs_while_loading_fails_the_start_named(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp=2, rank 1 stops (alive, silent) while it loads: rank 0 waited in the gathering of the
    load errors for gloo's 10 minutes. Once it has given no sign of life for HANG_AFTER_S, the
    start fails naming it, and it is stopped."""
    before = _spawned_children()
    monkeypatch.setattr(ranks_module, "_follower_main", _rank_1_hangs_while_loading)
    monkeypatch.setattr(ranks_module, "HANG_AFTER_S", 3.0, raising=False)
    raised: list[BaseException] = []

    def start() -> None:
        try:
            ranks_module.start_ranks(str(stories_dir), "float32", None, ParallelConfig(pp=2))
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(20)
    hung = thread.is_alive()
    if hung:  # (the old code: still waiting) its follower killed, so that it ends
        for pid in _spawned_children() - before:
            os.kill(pid, signal.SIGKILL)
        thread.join(30)
    assert not hung, "the start waited on the hung rank"
    (error,) = raised
    assert isinstance(error, RankStartError)
    assert re.match(r"^rank 1 of 2 stopped responding .* while the ranks started", str(error))
    assert _spawned_children() <= before
    assert not dist.is_initialized()


def test_a_start_after_one_failed_in_gloo_forms_its_groups_with_the_usual_timeout(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that failed inside gloo's set-up leaves torch's count of this process's groups at
    1 (set here as it leaves it): rank 0 named its groups from there, the new followers from 0,
    and the next start waited on keys nobody wrote. And rank 0 forms its groups with a short
    bound on gloo's connections (CONNECT_TIMEOUT); its collectives then get the usual one (a
    long prefill would otherwise fail the ranks)."""
    import torch

    monkeypatch.setattr(dist.distributed_c10d._world, "group_count", 1)
    pending, group = ranks_module.start_ranks(str(stories_dir), "float32", None,
                                              ParallelConfig(tp=2))  # fmt: skip
    try:
        model = pending.finish()
        assert model.place.group is not None
        for pg in (dist.distributed_c10d._get_default_group(), model.place.group):
            assert pg._get_backend(torch.device("cpu")).options._timeout == COLLECTIVE_TIMEOUT
    finally:
        group.close()


def test_a_follower_whose_rank_0_died_early_exits(tmp_path: Path, stories_dir: Path) -> None:
    """Rank 0 killed while its follower is still starting, before the follower armed its
    parent-death signal: the follower exits within moments (it went on, reparented, through
    the store's connect timeouts and retries, ~300 s)."""
    pids = tmp_path / "pids"
    script = f"""
import os, signal, sys, threading, time, multiprocessing as mp
sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]
import importlib
from runtime import ranks
from runtime.parallel import ParallelConfig
ranks._follower_main = getattr(importlib.import_module({__name__!r}),
                               "_starts_after_its_parent_died")
def die() -> None:
    while not mp.active_children():
        time.sleep(0.01)
    with open({str(pids)!r}, "w") as f:
        f.write(" ".join(str(p.pid) for p in mp.active_children()))
    os.kill(os.getpid(), signal.SIGKILL)
threading.Thread(target=die, daemon=True).start()
ranks.start_ranks({str(stories_dir)!r}, "float32", None, ParallelConfig(tp=2))
time.sleep(60)
"""
    log = (tmp_path / "log").open("w")
    rank0 = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=log, stderr=log,
                           timeout=120)  # fmt: skip
    assert rank0.returncode == -9, (tmp_path / "log").read_text()
    (follower,) = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + 60
    while not _gone(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(follower), f"rank 1 ({follower}) outlived its rank 0 by a minute"


def test_ranks_started_from_a_thread_outlive_it_and_die_with_rank_0(
    tmp_path: Path, stories_dir: Path
) -> None:
    """An engine split over ranks built in a thread other than the main one (as an application
    starting its model in the background does): its follower was killed as that thread ended
    (the parent-death signal fires at the end of the thread that spawned it), and every request
    failed "rank 1 of 2 exited (code -9)". Now it serves after that thread is gone, and its
    follower still dies with rank 0."""
    pids, out = tmp_path / "pids", tmp_path / "out"
    script = f"""
import os, signal, sys, threading, time
sys.path[:0] = [{str(ROOT)!r}]
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
if __name__ == "__main__":
    made = {{}}
    builder = threading.Thread(target=lambda: made.update(llm=LLM({str(stories_dir)!r}, tp=2,
                                                              kv_cache_bytes=4 << 20)))
    builder.start()
    builder.join()
    llm = made["llm"]
    time.sleep(0.5)
    ranks = llm.engine.runner.ranks
    with open({str(pids)!r}, "w") as f:
        f.write(" ".join(str(p.pid) for p in ranks.procs))
    tokens = llm.generate([[1, 403, 407]], SamplingParams(max_tokens=3, ignore_eos=True))
    with open({str(out)!r}, "w") as f:
        f.write(str(len(tokens[0].outputs[0].token_ids)))
    os.kill(os.getpid(), signal.SIGKILL)
"""
    log = (tmp_path / "log").open("w")
    rank0 = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=log, stderr=log,
                           timeout=120)  # fmt: skip
    (follower,) = (int(p) for p in pids.read_text().split())
    try:
        assert rank0.returncode == -9, (tmp_path / "log").read_text()
        assert out.read_text() == "3", (tmp_path / "log").read_text()
        deadline = time.monotonic() + 10
        while not _gone(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(follower), f"rank 1 ({follower}) outlived its rank 0"
    finally:
        if not _gone(follower):
            os.kill(follower, signal.SIGKILL)


def test_the_command_line_reports_a_failed_start_in_one_line(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edgeinfer generate --tp 2` whose follower exits: one line naming it, exit status 2 (a
    traceback of RuntimeError, status 1)."""
    from runtime.cli import main

    before = _spawned_children()
    monkeypatch.setattr(ranks_module, "_follower_main", _exits_once_checked_in)
    code = main(["generate", "--model", str(stories_dir), "--tp", "2", "--max-tokens", "1",
                 "Once"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("edgeinfer: error: rank 1 of 2 exited (code 3) while the ranks")
    assert not any("Traceback" in line for line in err)
    assert not dist.is_initialized()
    assert _spawned_children() <= before


def test_a_start_on_a_port_left_in_time_wait_starts(tmp_path: Path, stories_dir: Path) -> None:
    """A worker killed (or stopped) closes its rendezvous's connections first, leaving them in
    TIME-WAIT on its --dist-port for a minute: restarted at once on that port, it failed
    "cannot start the ranks' rendezvous ... Address already in use". It starts; a port some
    process listens on is still refused."""
    port, pids = find_free_port(), tmp_path / "pids"
    script = f"""
import os, signal, sys
sys.path[:0] = [{str(ROOT)!r}]
from runtime import ranks
from runtime.parallel import ParallelConfig
if __name__ == "__main__":
    pending, group = ranks.start_ranks({str(stories_dir)!r}, "float32", None, ParallelConfig(tp=2),
                                       port={port})
    pending.finish()
    with open({str(pids)!r}, "w") as f:
        f.write(" ".join(str(p.pid) for p in group.procs))
    os.kill(os.getpid(), signal.SIGKILL)
"""
    log = (tmp_path / "log").open("w")
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=log, stderr=log,
                            timeout=120)  # fmt: skip
    assert killed.returncode == -9, (tmp_path / "log").read_text()
    (follower,) = (int(p) for p in pids.read_text().split())
    try:
        pending, group = ranks_module.start_ranks(str(stories_dir), "float32", None,
                                                  ParallelConfig(tp=2), port=port)  # fmt: skip
        try:
            assert pending.finish().place.group is not None
        finally:
            group.close()
        taken = socket.socket()
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the port's in TIME-WAIT)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        try:
            with pytest.raises(OSError, match=r"rendezvous on 127.0.0.1:\d+: .*in use"):
                ranks_module.start_ranks(str(stories_dir), "float32", None, ParallelConfig(tp=2),
                                         port=port)  # fmt: skip
        finally:
            taken.close()
    finally:
        if not _gone(follower):  # (it dies with its rank 0)
            os.kill(follower, signal.SIGKILL)


def test_a_second_split_engine_is_refused_and_the_first_serves_on(stories_dir: Path) -> None:
    """An engine split over ranks kept, a second made in the same process: its start failed in
    gloo's set-up (the default process group is the process's one), and its clean-up destroyed
    the first engine's group, which failed every request after. It is refused at once, naming
    the rule, with no rank started, and the first serves on; closed, another starts."""
    from runtime.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = LLM(stories_dir, tp=2, kv_cache_bytes=4 << 20)
    ranks = first.engine.runner.ranks
    assert ranks is not None
    try:
        want = list(first.generate([[1, 403]], greedy)[0].outputs[0].token_ids)
        before = _spawned_children()
        with pytest.raises(RuntimeError, match=r"one split engine per process: close the other"):
            LLM(stories_dir, pp=2, kv_cache_bytes=4 << 20)
        assert _spawned_children() == before  # nothing started
        assert list(first.generate([[1, 403]], greedy)[0].outputs[0].token_ids) == want
        assert ranks.failed is None
    finally:
        ranks.close()
    second = LLM(stories_dir, pp=2, kv_cache_bytes=4 << 20)
    assert second.engine.runner.ranks is not None
    try:
        assert list(second.generate([[1, 403]], greedy)[0].outputs[0].token_ids) == want
    finally:
        second.engine.runner.ranks.close()
