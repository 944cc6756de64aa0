"""A worker made of several ranks: starting them, running every step on all of them, and ending
them cleanly when one dies.

    rank 0 (the worker's own process: scheduler, internal API, sampler)
      ├─ spawns ranks 1..world-1 (followers), each a process that dies with rank 0 (PDEATHSIG;
      │  one whose rank 0 died before that was armed, while it imported, exits at once)
      ├─ a TCPStore on 127.0.0.1: rank 0 waits for every follower to check in, then
      │  torch.distributed (gloo), its waits for the followers' addresses watched: a follower
      │  that exits before or while the group forms fails the start at once, naming the rank
      │  and its exit code (RankStartError), and the other followers are killed
      ├─ every rank loads only its part of the weights (runtime.parallel.RankPlace), then reports
      │  its load error or None to rank 0 (all_gather_object): any error ends start-up, named
      └─ per step: rank 0 sends the step's plan (micro-batches of input ids and attention
         metadata, the rows whose logits it needs) to every follower, point to point and without
         waiting (each runs its commands in the order sent, and waits for the next for as long
         as the worker is idle: IDLE_WAIT); every rank runs its stage:
              stage 0: embed ─▶ its layers ─isend─▶ stage 1 ─▶ ... ─▶ last stage: final norm
                 ◀────────────── hidden states of each micro-batch ─────────────────┘
              stage 0: the LM head on the sampled rows (vocabulary split over its tp ranks,
                 gathered on rank 0), which samples
         With pp > 1 a step is two commands: `launch` (every stage's layers) and `finish`
         (stage 0 receives the last stage's hidden states and computes the logits). Rank 0
         launches the next step (another lane of requests, runtime.scheduler) before finishing
         the last, so that with pp steps in flight every stage is busy; a compute-bound step is
         also cut into micro-batches, so that stage 0 runs micro-batch i + 1 while stage 1 runs
         micro-batch i. With pp = 1, one `step` command does both.

A watchdog thread on rank 0 checks the followers every 0.2 s: a follower that exits, or gives
no sign of life (no beat, no CPU time) for HANG_AFTER_S, makes the group failed (`RankFailure`),
calls the `on_failure` callbacks (a worker deregisters and exits), and stops and reaps the other
followers, so that rank 0's next or current collective raises rather than waits. A follower
that fails (its own error, or a peer that died hung up on it) writes why in shared memory and
exits at once; the watch names the first follower that died without a word, else the first to
leave (`_first_failed`). A follower whose rank 0 is gone dies with it (PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from kvstore.kv_transfer import KVLayout, KVPages, byte_view
from kvstore.redis_server import find_free_port
from runtime.config import ModelConfig
from runtime.parallel import ParallelConfig, RankPlace

if TYPE_CHECKING:
    from runtime.config import EngineConfig
    from runtime.loader import PendingLoad
    from runtime.model import LlamaForCausalLM, StepContext
    from runtime.model_runner import ModelRunner

log = logging.getLogger("edgeinfer.ranks")

JOIN_TIMEOUT_S = 120.0  # followers' time to start and check in (imports, a cold page cache)
# gloo's bound on one collective or point-to-point receive (a long prefill). A receive is bound
# explicitly (`_recv`): a plain one keeps the bound its group was formed with, CONNECT_TIMEOUT
# on rank 0 (torch's _set_pg_timeout changes only the collectives'), and rank 0 gave up on a
# last pipeline stage whose step took more than 10 s
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# A follower's wait for rank 0's next command: as long as the worker is idle, so not gloo's bound
# (an idle worker's followers timed out after 10 minutes and it died). gloo has no "no timeout",
# and a receive that times out closes its connections (no retrying it): a century. A follower
# still dies with rank 0 (PDEATHSIG), and one that stops is named by rank 0's watchdog
IDLE_WAIT = timedelta(days=36500)
# Rank 0's bound on gloo's connections while the groups form (its waits on the store end as
# soon as a follower exits: `_Watched`). Every follower has checked in by then, so each pair of
# ranks connects within moments; but one that died between publishing its address and
# connecting leaves rank 0's side of the pair waiting, which only this ends: measured, gloo
# gives up after about 5 times it (so about 50 minutes with COLLECTIVE_TIMEOUT)
CONNECT_TIMEOUT = timedelta(seconds=10)
# How long `RankGroup.close` waits for a command in flight to end before it stops the followers
# under it (one stuck, the command waited out COLLECTIVE_TIMEOUT, and the close with it)
CLOSE_WAIT_S = 10.0
# Each follower's sign of life, a thread of its own stamping the time every BEAT_EVERY_S: one
# silent for HANG_AFTER_S (stopped, or stuck with the interpreter held) fails the ranks, named,
# where rank 0 waited gloo's timeout (COLLECTIVE_TIMEOUT) in a collective with it, and after
# that could not say which rank hung
BEAT_EVERY_S = 1.0
HANG_AFTER_S = 60.0
# A follower that cannot go on (its own error, or a peer that hung up on it) writes when and why
# (RankSpec.left, .why) and exits at once; rank 0's watch names the first to leave once this long
# has passed with no follower dead without a word: a peer dying makes the others leave too, after
# it, and its exit shows within this time (`_first_failed`). (Followers waited 5 s to be killed,
# so as not to be the exit rank 0 saw first, and rank 0 learnt of a follower's own error 5 s
# late, the requests of its step waiting.)
LEFT_GRACE_S = 0.5
WHY_ROOM = 300  # bytes of a follower's reason for leaving, in shared memory

# One micro-batch of a step: (input ids (T,), its attention metadata)
Plan = tuple[torch.Tensor, "StepContext"]


class RankFailure(RuntimeError):
    """A rank of this worker died or failed; the worker cannot go on."""


class RankStartError(RankFailure, OSError):
    """The ranks could not start: a follower exited, or did not join in time (the message names
    it). An OSError too, as a taken rendezvous port is: the command line reports it in one line
    (exit status 2), not as a traceback."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a follower needs to start (sent to it pickled)."""

    model: str
    dtype: str
    max_model_len: int | None
    parallel: ParallelConfig
    port: int
    num_threads: int | None  # torch threads per rank; None: cores / world size
    weight_dtype: str = "auto"  # how the linear weights are stored (runtime.loader.start_load)
    # rank r's last sign of life (time.monotonic(); 0 before its first), shared memory
    beats: Any = field(default=None, compare=False)
    # when rank r left of an error (time.monotonic(); 0: it has not), and why (WHY_ROOM bytes
    # each, from r * WHY_ROOM), shared memory: what rank 0's watch names (`_first_failed`)
    left: Any = field(default=None, compare=False)
    why: Any = field(default=None, compare=False)
    from_main_thread: bool = True  # rank 0 spawned the followers from its main thread


def _die_with_parent(from_main_thread: bool = True) -> None:
    """Linux: this process gets SIGKILL when its parent (rank 0) dies. The signal is armed only
    now, after the seconds of interpreter start and imports: a parent that died before then
    never sends it (the follower, reparented, waited ~300 s on the store's connect retries), so
    one gone already ends this process here. multiprocessing's handle on the parent answers
    from a pipe whose write end only the parent holds, as runtime.lifeline's does (spawn makes
    one for every child), with no race on the parent's pid.

    The signal comes when the thread that spawned this process ends, not its process: spawned
    from another thread than rank 0's main one (an engine built in a thread), this process was
    killed as that thread ended, and the engine had lost its ranks. There (`from_main_thread`
    False) a thread of ours waits on that handle instead, and ends this process with rank 0."""
    if from_main_thread:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        os._exit(1)
    if parent is not None and not from_main_thread:
        threading.Thread(target=_exit_with, args=(parent,), name="parent", daemon=True).start()


def _exit_with(parent: mp.process.BaseProcess) -> None:
    parent.join()
    os._exit(1)


def _beat(beats: Any, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(BEAT_EVERY_S)


def _threads(spec: RankSpec) -> int:
    return spec.num_threads or max(1, (os.cpu_count() or 1) // spec.parallel.world_size)


def _join(spec: RankSpec, rank: int, store: dist.Store,
          timeout: timedelta | None = None) -> RankPlace:  # fmt: skip
    """torch.distributed up on this rank, and its stage's process group. `timeout` (default
    COLLECTIVE_TIMEOUT) bounds gloo's waits while the groups form (its collectives get
    COLLECTIVE_TIMEOUT after; its receives are bound each, `_recv`)."""
    timeout = timeout or COLLECTIVE_TIMEOUT
    par = spec.parallel
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=par.world_size, timeout=timeout
    )
    group = None
    g = par.group_size
    for stage in range(par.pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * g, (stage + 1) * g))
        made = dist.new_group(ranks, timeout=timeout) if g > 1 else None
        if rank in ranks:
            group = made
    if timeout != COLLECTIVE_TIMEOUT:  # (rank 0's, while forming: see CONNECT_TIMEOUT)
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(COLLECTIVE_TIMEOUT)  # the whole world's group
        if group is not None:
            _set_pg_timeout(COLLECTIVE_TIMEOUT, group)
    return RankPlace(par, rank, group=group)


def _load(spec: RankSpec, place: RankPlace) -> tuple[PendingLoad | None, str | None]:
    """Start this rank's load; (the load, None) or (None, why it cannot)."""
    from runtime.loader import start_load

    try:
        load = start_load(spec.model, spec.dtype, spec.max_model_len, place=place,
                          weight_dtype=spec.weight_dtype)  # fmt: skip
        return load, None
    except Exception as e:  # reported to rank 0, which raises it
        return None, f"rank {place.rank}: {type(e).__name__}: {e}"


def _follower_main(spec: RankSpec, rank: int) -> None:
    _die_with_parent(spec.from_main_thread)
    # Ctrl-C reaches the terminal's whole process group: rank 0 drains and stops the followers
    # itself (a follower that died of it first failed the requests in flight)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.beats is not None:
        threading.Thread(target=_beat, args=(spec.beats, rank), name="beat", daemon=True).start()
    torch.set_num_threads(_threads(spec))
    try:
        store = dist.TCPStore("127.0.0.1", spec.port, spec.parallel.world_size, is_master=False,
                              timeout=timedelta(seconds=JOIN_TIMEOUT_S))  # fmt: skip
        store.set(f"joined/{rank}", "1")
        place = _join(spec, rank, store)
    except Exception as e:
        _leave(spec, rank, f"could not join the group: {e}")
    pending, error = _load(spec, place)
    model = None
    if pending is not None:
        try:
            model = pending.finish()
        except Exception as e:
            error = f"rank {rank}: {type(e).__name__}: {e}"
    errors: list[str | None] = [None] * spec.parallel.world_size
    try:
        dist.all_gather_object(errors, error)
    except Exception as e:
        _leave(spec, rank, f"the ranks could not start: {e}")
    if any(errors) or model is None:
        os._exit(1)
    try:
        _follow(model)
    except Exception as e:  # a step failed here, or a peer that died hung up: nothing to serve
        log.error("rank %d: leaving\n%s", rank, traceback.format_exc())
        _leave(spec, rank, f"{type(e).__name__}: {e}")
    os._exit(0)


def _leave(spec: RankSpec, rank: int, why: str) -> NoReturn:
    """A follower that cannot go on, of its own error or because a peer that died hung up on it:
    it says when and why where rank 0's watch reads it, and exits now. The watch names the
    first follower that died without a word, else the first that left (`_first_failed`): not
    this one for a peer that died, whichever exit it saw first."""
    print(f"rank {rank}: {why}", flush=True)
    if spec.left is not None and spec.why is not None:
        text = why.encode(errors="replace")[:WHY_ROOM].ljust(WHY_ROOM, b"\0")
        spec.why[rank * WHY_ROOM : (rank + 1) * WHY_ROOM] = text
        spec.left[rank] = time.monotonic()  # (after the reason: a watch that sees one sees both)
    os._exit(1)


def _follow(model: LlamaForCausalLM) -> None:
    """A follower's life after loading: build the KV cache rank 0 sizes, then run commands."""
    from runtime.model_runner import ModelRunner

    sends = Sends(model.place.config.pp + 1)
    setup = _receive()  # ("setup", the runner's arguments), or ("stop",): rank 0 failed first
    if setup[0] == "stop":
        return
    runner = ModelRunner(model, **setup[1])
    runner.pack_weights()  # this rank's weights are all read
    while True:
        command = _receive()
        op = command[0]
        if op in ("step", "launch"):
            sends.mark()
        if op == "step":
            run_step(model, runner.kv_caches, command[1], command[2], sends)
        elif op == "launch":
            run_stages(model, runner.kv_caches, command[1], sends)
        elif op == "finish":
            collect(model, command[1], command[2])
        elif op == "kv_read":
            layers, block_ids = command[1], command[2]
            data = runner.kv_read(layers, block_ids)
            dist.gather_object(data, None, dst=0)
        elif op == "kv_write":
            part: list[Any] = [None]
            dist.scatter_object_list(part, None, src=0)
            runner.kv_write_local(command[1], command[2], part[0])
            dist.barrier()
        elif op == "stop":  # sends of steps rank 0 never finished are never received: no wait
            return
        else:
            raise RuntimeError(f"unknown command {op!r}")


# Point-to-point tags: commands from rank 0, hidden states between stages.
COMMAND_TAG, HIDDEN_TAG = 1, 0


def _receive() -> Any:
    """The next command from rank 0 (its length, then its pickled bytes), waited for as long as
    rank 0 sends none (IDLE_WAIT)."""
    size = torch.empty(1, dtype=torch.int64)
    _recv(size, 0, COMMAND_TAG, IDLE_WAIT)
    data = torch.empty(int(size), dtype=torch.uint8)
    _recv(data, 0, COMMAND_TAG)
    return pickle.loads(data.numpy().tobytes())


def _recv(tensor: torch.Tensor, src: int, tag: int, timeout: timedelta | None = None) -> None:
    """dist.recv, bounded by `timeout` (default COLLECTIVE_TIMEOUT) rather than by the bound the
    group was formed with (CONNECT_TIMEOUT on rank 0)."""
    work = dist.irecv(tensor, src=src, tag=tag)
    assert work is not None  # (every rank is in the default group)
    work.wait(timeout or COLLECTIVE_TIMEOUT)


class Sends:
    """Point-to-point sends not yet known to be done, by step, each tensor kept alive until then.
    Gloo's `is_completed()` stays False until `wait()`, so at each new step (`mark`) the sends of
    steps more than `keep` back are waited for: with at most pp steps in flight, rank 0 has
    finished step k - pp before any rank starts step k, so every message of it was received and
    the wait returns at once."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._steps: deque[list[tuple[dist.Work, torch.Tensor]]] = deque([[]])

    def mark(self) -> None:
        """A new step starts: its sends are grouped apart."""
        self._steps.append([])
        while len(self._steps) > self.keep:
            for work, _ in self._steps.popleft():
                work.wait(COLLECTIVE_TIMEOUT)  # (see `_recv`)

    def add(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        work = dist.isend(tensor, dst=dst, tag=tag)
        assert work is not None
        self._steps[-1].append((work, tensor))

    def drain(self, timeout: timedelta) -> None:
        """Wait for every send, each for up to `timeout`."""
        while self._steps:
            for work, _ in self._steps.popleft():
                work.wait(timeout)
        self._steps.append([])


def run_stages(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    plans: list[Plan],
    sends: Sends | None,
) -> list[torch.Tensor]:
    """This rank's stage of one step, micro-batch by micro-batch, each sent on to the next stage
    (the last stage's back to stage 0) without waiting for it to be received. With one stage,
    the hidden states (T, hidden) of each micro-batch instead."""
    place = model.place
    pp = place.config.pp
    outs: list[torch.Tensor] = []
    for ids, ctx in plans:
        h = None
        if not place.first:
            h = torch.empty(ids.shape[0], model.cfg.hidden_size, dtype=model.dtype)
            _recv(h, place.stage_rank(place.stage - 1), HIDDEN_TAG)
        x = model(ids, ctx, kv_caches, h).contiguous()  # (T, hidden)
        if pp == 1:
            outs.append(x)
        else:
            assert sends is not None
            sends.add(x, place.stage_rank(0 if place.last else place.stage + 1), HIDDEN_TAG)
    return outs


def collect(model: LlamaForCausalLM, sizes: list[int], rows: torch.Tensor) -> torch.Tensor | None:
    """Stage 0 (every tp rank of it) with pp > 1: the last stage's hidden states of a launched
    step's micro-batches (`sizes` tokens each, in order), and the logits of `rows` on rank 0."""
    place = model.place
    outs = []
    for n in sizes:
        h = torch.empty(n, model.cfg.hidden_size, dtype=model.dtype)
        _recv(h, place.stage_rank(place.config.pp - 1), HIDDEN_TAG)
        outs.append(h)
    return _logits(model, outs, rows)


def _logits(model: LlamaForCausalLM, outs: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor | None:
    hidden = outs[0] if len(outs) == 1 else torch.cat(outs)
    if not len(rows):  # a step that samples nothing (a prompt's chunk alone): no LM head, on
        # every rank of stage 0 alike (its matmul refuses no rows, and failed the ranks)
        return hidden.new_empty(0) if model.place.rank == 0 else None
    logits = model.logits(hidden[rows])  # every tp rank of stage 0 takes part
    return logits if model.place.rank == 0 else None


def run_step(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    plans: list[Plan],
    rows: torch.Tensor,
    sends: Sends,
) -> torch.Tensor | None:
    """This rank's part of one whole step (see the module docstring), without pipeline
    parallelism (with it, steps are launched and collected apart). Rank 0 gets the logits of
    `rows` (R, vocab) float32; other ranks None."""
    place = model.place
    assert place.config.pp == 1, "a pipelined step goes through launch and finish"
    outs = run_stages(model, kv_caches, plans, sends)
    if not place.first:
        return None
    return _logits(model, outs, rows)


class RankGroup:
    """Rank 0's handle on its followers: the commands it sends, and their liveness."""

    def __init__(self, spec: RankSpec, procs: Sequence[mp.process.BaseProcess],
                 threads_before: int | None = None, store: dist.Store | None = None):  # fmt: skip
        """`threads_before`: this process's torch threads before the ranks took their share,
        given back at `close`. `store`: the process group's store, kept until `close`: one
        written in Python (`_Watched`) is not kept alive by the group itself (its methods then
        fail inside torch), nor the rendezvous it wraps (whose listener closed with it)."""
        self.spec = spec
        self._threads_before = threads_before
        self._store = store
        self.procs = procs  # procs[i] is rank i + 1
        self.failed: str | None = None
        self._failed = threading.Event()  # set with `failed`
        self.on_failure: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # one command at a time: steps and KV reads interleave
        self._sends = Sends(spec.parallel.pp + 1)
        self._stage0_followers = range(1, spec.parallel.group_size)  # logits on stage 0's ranks
        self._closed = False
        self._watch = threading.Thread(target=self._watchdog, name="ranks-watchdog", daemon=True)
        self._watch.start()
        atexit.register(self.close)

    @property
    def world_size(self) -> int:
        return self.spec.parallel.world_size

    def _watchdog(self) -> None:
        silence = _Silence(self.spec.beats, _cpu_s(self.procs))
        while not self._closed:
            dead = _first_failed(self.procs, self.spec) or silence.first()
            if dead is not None and not self._closed:
                self._fail(dead)
                # the others cannot serve without it: stopped, so that a collective rank 0 is
                # in with them fails now, and reaped (they were zombies until the close)
                for p in self.procs:
                    p.kill()
                for p in self.procs:
                    p.join(timeout=5)
                return
            time.sleep(0.2)

    def _fail(self, why: str) -> None:
        if self.failed is not None:
            return
        self.failed = why
        self._failed.set()
        log.error("%s: this worker cannot serve any more", why)
        for callback in list(self.on_failure):
            with contextlib.suppress(Exception):
                callback(why)

    def _command(self, command: object, to: Sequence[int] | None = None) -> None:
        """Send `command` to followers `to` (all by default), without waiting for them: each
        runs its commands in the order sent."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        for rank in range(1, self.world_size) if to is None else to:
            self._sends.add(size, rank, COMMAND_TAG)
            self._sends.add(payload, rank, COMMAND_TAG)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (a command and rank 0's part of it) alone; any failure fails the group."""
        with self._lock:
            if self._closed:
                raise RankFailure("the ranks were stopped")
            if self.failed is not None:
                raise RankFailure(self.failed)
            try:
                return fn()
            except RankFailure:
                raise
            except Exception as e:  # gloo: a peer hung up
                # let the watchdog see which one (a follower that left is named LEFT_GRACE_S
                # after it left; one that died, at its next look)
                self._failed.wait(LEFT_GRACE_S + 0.5)
                why = self.failed or f"a collective failed: {e}"
                self._fail(why)
                raise RankFailure(why) from e
            except BaseException:  # Ctrl-C mid-command: the followers are in its collectives,
                # which rank 0 left; no later command can line up with them (close kills them)
                self._fail("rank 0 was interrupted in the middle of a command")
                raise

    def setup(self, **runner_args: Any) -> None:
        """The followers build their model runners (KV cache) with these arguments."""
        self._guard(lambda: self._command(("setup", runner_args)))

    def step(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
             plans: list[Plan], rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One whole step on every rank; the logits of hidden rows `rows`."""

        def run() -> torch.Tensor:
            self._sends.mark()
            self._command(("step", plans, rows))
            logits = run_step(model, kv_caches, plans, rows, self._sends)
            assert logits is not None
            return logits

        return self._guard(run)  # type: ignore[no-any-return]

    def launch(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               plans: list[Plan]) -> list[int]:  # fmt: skip
        """Start a step through the pipeline (pp > 1) and return once stage 0 has sent it on:
        later steps may be launched before it is `finish`ed, each stage working on a different
        one. Returns its micro-batches' sizes, for `finish`."""

        def run() -> list[int]:
            self._sends.mark()
            self._command(("launch", plans))
            run_stages(model, kv_caches, plans, self._sends)
            return [ids.shape[0] for ids, _ in plans]

        return self._guard(run)  # type: ignore[no-any-return]

    def finish(self, model: LlamaForCausalLM, sizes: list[int], rows: torch.Tensor) -> torch.Tensor:
        """The oldest launched step's logits of hidden rows `rows` (steps finish in launch
        order)."""

        def run() -> torch.Tensor:
            self._command(("finish", sizes, rows), to=self._stage0_followers)
            logits = collect(model, sizes, rows)
            assert logits is not None
            return logits

        return self._guard(run)  # type: ignore[no-any-return]

    def kv_read(self, layers: slice, block_ids: list[int], local: Callable[[], Any]) -> list[Any]:
        """Every rank's `kv_read(layers, block_ids)`, rank 0's from `local`; in rank order."""

        def run() -> list[Any]:
            self._command(("kv_read", layers, block_ids))
            parts: list[Any] = [None] * self.world_size
            dist.gather_object(local(), parts, dst=0)
            return parts

        return self._guard(run)  # type: ignore[no-any-return]

    def kv_write(self, layers: slice, block_ids: list[int], parts: list[Any],
                 local: Callable[[Any], None]) -> None:  # fmt: skip
        """Rank r writes parts[r] (its layers and heads of the blocks)."""

        def run() -> None:
            self._command(("kv_write", layers, block_ids))
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, parts, src=0)  # each rank its own part only
            local(mine[0])
            dist.barrier()

        self._guard(run)

    def close(self) -> None:
        """Stop the followers (they leave their loops) and wait for them, briefly."""
        if self._closed:
            return
        locked = self._lock.acquire(timeout=CLOSE_WAIT_S)
        if not locked:  # a command in flight hangs (a follower stuck): it waited gloo's timeout
            self._fail(f"the ranks were stopped: a command did not end within {CLOSE_WAIT_S:.0f} "
                       "s of their close")  # fmt: skip
            for p in self.procs:  # rank 0's collective with them fails now
                p.kill()
            locked = self._lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            if self.failed is None:
                with contextlib.suppress(Exception):
                    self._command(("stop",))
                    self._sends.drain(timedelta(seconds=CLOSE_WAIT_S))
            self._closed = True
        finally:
            if locked:
                self._lock.release()
        if self._watch is not threading.current_thread():
            # (its look ends within 0.2 s; one that found a follower dead reaps the followers it
            # stopped: two threads reaping a process at once, one sees no exit code)
            self._watch.join(timeout=CLOSE_WAIT_S)
        for p in self.procs:
            p.join(timeout=0 if self.failed is not None else 5)  # (failed: stuck in a collective)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)  # (reaped: not a zombie for as long as this process lives)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self._store = None  # the rendezvous closes with the group, as it did
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        atexit.unregister(self.close)  # (which kept this group, and its processes' pipes, alive)


class RankedKVPages(KVPages):
    """The KV cache of a model split over ranks, seen whole by KV transfer: every layer and KV
    head in the one-rank layout, so that workers split differently (or not at all) exchange
    blocks. A read gathers each rank's layers and heads of the blocks to rank 0; a write
    scatters them back. Each is one command to the ranks, taken between steps."""

    direct = False

    def __init__(self, runner: ModelRunner, ranks: RankGroup) -> None:
        cfg = runner.model.cfg
        dtype = str(runner.kv_dtype).removeprefix("torch.")
        self.layout = KVLayout(cfg.num_layers, runner.block_size, cfg.num_kv_heads, cfg.head_dim,
                               dtype)  # fmt: skip
        self.runner, self.ranks = runner, ranks
        self._shares: list[tuple[range, range]] | None = None  # per rank: layers, KV heads

    def shares(self) -> list[tuple[range, range]]:
        """Every rank's layers and KV heads, asked of the ranks once."""
        if self._shares is None:
            whole = slice(0, self.layout.num_layers)
            parts = self.ranks.kv_read(whole, [], lambda: self.runner.kv_read(whole, []))
            self._shares = [(layers, heads) for layers, heads, _ in parts]
        return self._shares

    def runs(self, layers: slice, block_ids: list[int]) -> list[memoryview]:
        return [byte_view(self.read(layers, block_ids))]

    def read(self, layers: slice, block_ids: list[int]) -> torch.Tensor:
        lay = self.layout
        first, count = (
            layers.indices(lay.num_layers)[0],
            len(range(*layers.indices(lay.num_layers))),
        )
        out = torch.empty(count, 2, len(block_ids), lay.block_size, lay.num_kv_heads, lay.head_dim,
                          dtype=getattr(torch, lay.dtype))  # fmt: skip
        parts = self.ranks.kv_read(layers, block_ids,
                                   lambda: self.runner.kv_read(layers, block_ids))  # fmt: skip
        for mine, heads, data in parts:  # a replicated KV head is written by each holder alike
            out[mine.start - first : mine.stop - first, :, :, :, heads.start : heads.stop] = data
        return out

    def write(self, layers: slice, block_ids: list[int],
              payload: bytes | bytearray | memoryview) -> None:  # fmt: skip
        lay = self.layout
        first, count = (
            layers.indices(lay.num_layers)[0],
            len(range(*layers.indices(lay.num_layers))),
        )
        flat = torch.frombuffer(bytearray(payload), dtype=getattr(torch, lay.dtype))
        data = flat.view(count, 2, len(block_ids), lay.block_size, lay.num_kv_heads, lay.head_dim)
        parts = []
        for mine, heads in self.shares():
            lo, hi = (
                max(mine.start, first),
                max(max(mine.start, first), min(mine.stop, first + count)),
            )
            parts.append(data[lo - first : hi - first, :, :, :, heads.start : heads.stop].clone())
        self.ranks.kv_write(layers, block_ids, parts,
                            lambda part: self.runner.kv_write_local(layers, block_ids, part))  # fmt: skip


def start_weights(config: EngineConfig) -> PendingLoad:
    """The load of `config.model` an engine runs: this process's alone, or with tp/pp/ep above
    1, rank 0's share with the other ranks started (`start_ranks`; the load's `ranks`)."""
    from kernels.attention import check_triton_head_dim
    from kernels.dispatch import FORCE_TRITON
    from runtime.loader import start_load

    if config.device == "cuda" or FORCE_TRITON:  # before a read that can take minutes (the
        check_triton_head_dim(ModelConfig.from_dir(config.model).head_dim)  # runner: again)
    parallel = ParallelConfig(config.tp, config.pp, config.ep)
    if parallel.world_size == 1:
        # onto the GPU as read, unless its weights are kept compressed: encoded on the host
        device = "cpu" if config.keep_weights_compressed else config.device
        return start_load(config.model, config.dtype, weight_dtype=config.weight_dtype,
                          device=device)  # fmt: skip
    pending, ranks = start_ranks(config.model, config.dtype, None, parallel,
                                 config.num_threads, config.dist_port,
                                 config.weight_dtype)  # fmt: skip
    pending.ranks = ranks
    return pending


def start_ranks(
    model: str,
    dtype: str,
    max_model_len: int | None,
    parallel: ParallelConfig,
    num_threads: int | None = None,
    port: int | None = None,
    weight_dtype: str = "auto",
) -> tuple[PendingLoad, RankGroup]:
    """Check the setting against the model, start the followers, join them, and start rank 0's
    load. Raises ValueError for a setting the model cannot take, OSError for a world that cannot
    start (the port taken; RankStartError: a rank that exits or does not join, the others then
    killed), ModelLoadError for a rank's load error, RuntimeError where this process has a split
    engine already (torch.distributed's default group is the process's one: a second start
    failed, and its clean-up destroyed the first engine's group)."""

    if dist.is_initialized():  # before anything starts, and without touching that group
        raise RuntimeError(
            "cannot start a split engine (tp, pp or ep above 1): this process has one already "
            "(torch.distributed's default process group is initialized); one split engine per "
            "process: close the other first (its engine.runner.ranks.close())"
        )
    cfg = ModelConfig.from_dir(model)
    parallel.check(cfg)  # before any process starts
    port = port or find_free_port()
    # The rendezvous on a socket bound to the loopback interface: TCPStore binds its own to
    # every interface, where anyone could join the ranks' unauthenticated store (rank 0
    # unpickles what the ranks put there). SO_REUSEADDR: a worker restarted on its --dist-port
    # found it in use for a minute, held by the last one's connections in TIME-WAIT
    listener = socket.socket()
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        store = dist.TCPStore("127.0.0.1", port, parallel.world_size, is_master=True,
                              timeout=timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False,
                              master_listen_fd=listener.fileno())  # fmt: skip
        listener.detach()  # the store's now: it closes it when the process group goes
    except Exception as e:
        listener.close()
        # (an OSError, as a port in use is: the command line reports it in one line)
        raise OSError(f"cannot start the ranks' rendezvous on 127.0.0.1:{port}: {e}") from e
    ctx = mp.get_context("spawn")
    beats = ctx.RawArray(ctypes.c_double, parallel.world_size)
    spec = RankSpec(model, dtype, max_model_len, parallel, port, num_threads, weight_dtype, beats,
                    ctx.RawArray(ctypes.c_double, parallel.world_size),
                    ctx.RawArray(ctypes.c_char, parallel.world_size * WHY_ROOM),
                    threading.current_thread() is threading.main_thread())  # fmt: skip
    procs = [
        ctx.Process(target=_follower_main, args=(spec, r), name=f"edgeinfer-rank{r}", daemon=True)
        for r in range(1, parallel.world_size)
    ]
    for p in procs:
        p.start()
    watch = _StartWatch(procs, spec)
    watched = _Watched(store, watch)
    try:
        _wait_joined(store, watch)
        # torch names the groups (the keys gloo uses in the store) by a count kept in this
        # process, which a start that failed inside gloo's set-up left counted; the followers,
        # new processes, count from 0 (and waited for keys never written)
        dist.distributed_c10d._world.group_count = 0
        place = _join(spec, 0, watched, timeout=CONNECT_TIMEOUT)
        pending, error = _load(spec, place)
        errors: list[str | None] = [None] * parallel.world_size
        dist.all_gather_object(errors, error)
    except BaseException as e:
        # gloo says only that a peer hung up: the follower that exited is named instead (the
        # watch sees it within moments of its sockets' closing)
        dead = watch.stop(wait_for_death=1.0 if isinstance(e, Exception) else 0.0)
        for p in procs:
            p.kill()
        for p in procs:
            p.join(timeout=5)
        with contextlib.suppress(Exception):  # where rank 0 had joined it (its own: see the top)
            dist.destroy_process_group()
        if dead is not None and not isinstance(e, RankStartError):
            raise RankStartError(f"{dead} while the ranks started") from e
        raise
    watch.stop()
    failed = [e for e in errors if e]
    if failed or pending is None:
        for p in procs:
            p.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        from runtime.config import ModelLoadError

        raise ModelLoadError("; ".join(e for e in failed if e))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(_threads(spec))
    return pending, RankGroup(spec, procs, threads_before, watched)


def _first_failed(procs: Sequence[mp.process.BaseProcess], spec: RankSpec) -> str | None:
    """What the watches, at start-up and after, name (None: nothing): the first follower
    (procs[i] is rank i + 1) that exited without a word (killed, crashed), "rank r of n exited
    (code c)"; else the first that left saying why (`_leave`), "rank r of n failed: why", once
    LEFT_GRACE_S has passed since with no such exit (a follower that saw a peer die hang up
    leaves too: after it, and the dead one's exit shows meanwhile)."""
    n = len(procs) + 1
    left = spec.left
    for rank, p in enumerate(procs, start=1):
        code = p.exitcode  # (read before its mark: a follower marks, then exits)
        if code is not None and not (left is not None and left[rank]):
            return f"rank {rank} of {n} exited (code {code})"
    if left is None or spec.why is None:
        return None
    marks = [(left[rank], rank) for rank in range(1, n) if left[rank]]
    if not marks:
        return None
    at, rank = min(marks)
    if time.monotonic() - at < LEFT_GRACE_S:
        return None
    why = spec.why[rank * WHY_ROOM : (rank + 1) * WHY_ROOM].rstrip(b"\0")
    return f"rank {rank} of {n} failed: {why.decode(errors='replace')}"


class _Silence:
    """Rank 0's view of the followers' signs of life (`beats`, None: none kept): the first
    follower silent for HANG_AFTER_S, counted from when this watch last ran where it was away
    itself: a pause of the whole process group (Ctrl-Z, a frozen container, a suspended VM)
    stops the followers and the watch alike, and the clock runs on, so every follower looked
    silent on resuming and a healthy group was failed.

    Silent is without a beat and without computing: a follower's beat is a Python thread, held
    up while its main thread runs one C call that keeps the interpreter (GIL) for long (the CPU
    kernels of kernels/csrc did until they released it; a model's own extension still may), and
    a busy, healthy follower was named as hung. `cpu_s(rank)` (None: not known) is
    its process's CPU time: one that used at least half a core since the watch's last look,
    over a second or more, computes. (A stopped or deadlocked one uses none; one stuck with
    the GIL held, a little: its beat thread's waits for the GIL.)"""

    AWAY_S = 2.0  # a watch that looks every 0.2 s at most, not run for this long: it was away
    SAMPLE_S = 1.0  # CPU time is compared over this much at least
    BUSY = 0.5  # CPU seconds a second that count as computing

    def __init__(self, beats: Any, cpu_s: Callable[[int], float | None] | None = None) -> None:
        self.beats = beats
        self.cpu_s = cpu_s
        self._last = time.monotonic()
        self._since = 0.0  # silence is counted from here (where this watch was away)
        self._sample: dict[int, tuple[float, float]] = {}  # rank -> (when, its CPU time then)
        self._busy: dict[int, float] = {}  # rank -> when it was last seen computing

    def first(self) -> str | None:
        """"rank r of n stopped responding ..." for the first follower silent too long, or None."""
        if self.beats is None:
            return None
        now = time.monotonic()
        if now - self._last > self.AWAY_S:
            self._since = now
        self._last = now
        for rank in range(1, len(self.beats)):
            self._computing(rank, now)
            beat = self.beats[rank]
            heard = max(beat, self._since, self._busy.get(rank, 0.0))
            if beat > 0 and heard < now - HANG_AFTER_S:
                return (f"rank {rank} of {len(self.beats)} stopped responding (no sign of life "
                        f"for {now - beat:.0f} s)")  # fmt: skip
        return None

    def _computing(self, rank: int, now: float) -> None:
        """Note when `rank` was last seen using the CPU (`_busy`)."""
        cpu = self.cpu_s(rank) if self.cpu_s is not None else None
        if cpu is None:
            return
        when, used = self._sample.setdefault(rank, (now, cpu))
        if now - when >= self.SAMPLE_S:
            if cpu - used >= self.BUSY * (now - when):
                self._busy[rank] = now
            self._sample[rank] = (now, cpu)


def _cpu_s(procs: Sequence[mp.process.BaseProcess]) -> Callable[[int], float | None]:
    """Rank r's CPU time in seconds (all its threads), from /proc; None where it cannot be read
    (exited, or not Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def cpu_s(rank: int) -> float | None:
        try:
            with open(f"/proc/{procs[rank - 1].pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (OSError, IndexError, ValueError):
            return None

    return cpu_s


def _wait_joined(store: dist.TCPStore, watch: _StartWatch) -> None:
    """Until every follower has checked in; a RankStartError naming one that exits first."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    waiting = set(range(1, len(watch.procs) + 1))
    while waiting:
        waiting = {r for r in waiting if not store.check([f"joined/{r}"])}
        watch.check("while the ranks checked in")
        if time.monotonic() > deadline:
            raise RankStartError(
                f"ranks {sorted(waiting)} did not join within {JOIN_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.02)


class _StartWatch:
    """Rank 0's watch on the followers while they start (RankGroup's watchdog takes over once
    they are up). The first to exit is recorded, and the others are killed at once: whatever
    rank 0 waits in then fails within moments, a store wait (`_Watched`) or a collective with
    them, instead of waiting for the failure to travel round gloo's ring (a follower that saw a
    peer hang up exits of its own error, seconds later: named first, it hid the one that
    died)."""

    def __init__(self, procs: Sequence[mp.process.BaseProcess], spec: RankSpec) -> None:
        self.procs = procs
        self._spec = spec
        self.dead: str | None = None  # "rank r of n exited (code c)"
        self._died = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ranks-start-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        silence = _Silence(self._spec.beats, _cpu_s(self.procs))
        while not self._stopped.wait(0.02):
            self.dead = _first_failed(self.procs, self._spec) or silence.first()
            if self.dead is not None:
                self._died.set()
                for p in self.procs:
                    p.kill()
                return

    def check(self, when: str) -> None:
        """A RankStartError if a follower has exited."""
        if self.dead is not None:
            raise RankStartError(f"{self.dead} {when}")

    def stop(self, wait_for_death: float = 0.0) -> str | None:
        """End the watch, after up to `wait_for_death` s for a follower's exit if none was seen
        yet; the exit it saw, if any."""
        if wait_for_death:
            self._died.wait(wait_for_death)
        self._stopped.set()
        self._thread.join()
        return self.dead


class _Watched(dist.Store):
    """The rendezvous store as rank 0's process groups see it while they form. Gloo waits on it
    for every rank's address (the whole group's, then each stage's): a follower that exited
    after checking in never writes its own, and rank 0 waited out gloo's timeout (10 minutes).
    Here each wait gives up as soon as a follower has exited, naming it. (A store written in
    Python: torch.distributed calls these methods from its C++ side.)"""

    def __init__(self, store: dist.TCPStore, watch: _StartWatch) -> None:
        super().__init__()
        self._store, self._watch = store, watch

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        # gloo's timeout (CONNECT_TIMEOUT) is for connections: a follower alive and slow to
        # publish gets the followers' time to check in
        limit = JOIN_TIMEOUT_S
        deadline = time.monotonic() + limit
        while True:
            # first, even where the keys are there: a follower that published its address and
            # died is not connected to (a wait on that connection is only ended by its timeout)
            self._watch.check("while the ranks formed their group")
            if self._store.check(keys):
                return
            if time.monotonic() > deadline:
                raise RankStartError(f"the ranks did not form their group within {limit:.0f} s")
            time.sleep(0.01)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)
