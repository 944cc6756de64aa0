"""`edgeinfer pool`: start and stop this machine's worker processes as demand comes and goes.

    edgeinfer pool --region R --models M1,M2 --max-workers N [--min-workers K] [--idle S]

Each tick (every `tick_s`, or at once when a gateway publishes a wake-up) the pool reads, from
Redis, the region's registered workers and the requests gateways are holding for a model with no
worker (kvstore/demand.py), and for each model decides (`decide`, a pure function):

- scale from zero: no live worker and requests waiting (or asked for, by a held request or a
  wake-up, within DEMAND_FRESH_S and since the last failed start or scale-down): start one; the
  gateways hold those requests until it registers;
- scale up: every worker of the model is queueing (requests waiting behind full batches) for
  `scale_up_after_s`: start one more, one start in flight per model at a time;
- scale down: one of our workers has had nothing to do for `idle_s`: SIGTERM it (it drains);
- never fewer than `min_workers` per model, never more than `max_workers` processes in all (a
  worker that is stopping holds its slot until it has exited);
- make room: a model that must scale from zero while every process slot is taken gets one by
  stopping the longest-idle worker of another model (`make_room`) that has served its minimum
  residency (`min_residency_s`, and at least as long as its own start took); with none such, the
  model's status says `full`, and waiting gateways hold its requests (503 `pool_full` once their
  hold runs out). Without the residency, --max-workers 1 and two models asked for in turn
  stopped each one's worker for the other on every request: a cold start each.

Starts are claimed in Redis first (kvstore.demand.Demand.claim_start), so the pools of one
region together start one worker per model at a time, not one each. A claim is a lease of
`ttl_s` + START_LEASE_EXTRA_S (45 s by default), renewed every tick while its worker starts: a
pool that dies mid-start holds up the others for that long only.

A worker that exits before it registers, or does not register within `ready_timeout_s`, failed
to start: the pool publishes `failed` with the time of its next attempt (exponential backoff, so
waiting gateways answer 503 with that Retry-After), and tries again only once requests come
back. Every start, ready, stop and failure is appended to the region's event stream with its
timings (`edgeinfer pool --events` prints them) and logged. What a failure publishes (the
status gateways relay in their 503s, the event) is a short cause: how the worker ended, and its
own one-line error with paths cut to their last part and addresses left out; its last output
lines (the model folder, its internal URL, its KV-transfer address) go to the pool's log only.

A ready worker that leaves the registry while its process lives on (it stopped heartbeating: a
hung engine step, SIGSTOP, a frozen VM) is *silent* once a tick has found it missing for
SILENT_BEATS of its heartbeats (a Redis that lost its data has every entry back within one):
logged once, and no longer counted as serving or towards the minimum, so held requests get a
replacement where a slot is free. Missing for SILENT_GRACE_BEATS heartbeats (20 s at the
worker's default 2 s, after the 10 s its entry took to expire) it is told to stop, freeing its
slot (at --max-workers 1 every model waited behind it for good), and killed if it has neither
exited nor come back (draining) SILENT_BEATS heartbeats later. One that comes back before it is
told to stop (SIGCONT, an engine step that ends) is counted again.

Before an idle stop (and a stop to make room) the pool asks the worker itself
(`/internal/stats`): its registry entry is up to a heartbeat old, and a worker that had just
taken a request was stopped mid-stream. The SIGTERM follows the answer with no wait between;
a request that reaches the worker after the answer and before the signal is drained (served,
within the worker's --drain-timeout), one after it is refused 503 `draining` with Retry-After,
which gateways send to another worker or hold for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvstore.client import connect, stop_task
from kvstore.demand import Demand, ModelStatus, PoolInfo, Wakeups
from kvstore.keys import check_id
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import find_free_port
from kvstore.registry import Registry
from runtime.lifeline import Lifeline
from runtime.pool import idle_for, worker_stats
from runtime.zygote import SPAWN_TIMEOUT_S, ForkedProcess, ZygoteClient, ZygoteError

log = logging.getLogger("edgeinfer.pool")

MAX_BACKOFF_S = 60.0
CRASH_WINDOW_S = 60.0  # a worker that dies (not asked to stop) this soon after getting ready
# counts as a crash: the next start of its model waits, with backoff, as after a failed start
TEMPLATE_WAIT_S = 5.0  # longest a start waits for a worker template still importing
# a start's claim outlives its pool by this at most: renewed each tick, and a tick may spend on
# one start's spawn (a template still importing, then its answer), and on another model's too
START_LEASE_EXTRA_S = TEMPLATE_WAIT_S + SPAWN_TIMEOUT_S
WORKER_DRAIN_TIMEOUT_S = 30.0  # `edgeinfer worker --drain-timeout`'s default
STOP_MARGIN_S = 10.0  # a shutdown's wait beyond the workers' drain: their exit
# a scale from zero needs a request held now, or demand (a held request, a wake-up) this recent:
# a worker that dies long after its last demand (killed for memory while idle) is not started
# again for nobody. It spans a failed start's retry after a short backoff; after a longer one,
# the start waits for requests to come back (they do: 503 Retry-After sent them away till then)
DEMAND_FRESH_S = 30.0
# `edgeinfer worker` flags the pool sets for each worker itself (or that break its watch of
# them): given again in worker_args they would win (argparse keeps the last; --redis would
# override the URL the pool gives in the worker's environment, EDGEINFER_REDIS). A fixed
# --worker-id made the pool kill a healthy worker in a loop ("not registered"); a fixed --port
# broke every worker after the first.
POOL_WORKER_FLAGS = ("--model", "--served-model-name", "--region", "--host", "--port", "--redis",
                     "--worker-id", "--advertise-url", "--no-redis")  # fmt: skip
# a silent worker (see the module docstring): counted in its own heartbeats (those its last
# registry entry gave; DEFAULT_BEAT_S when it gave none), each span at least SILENT_MIN_S
SILENT_BEATS = 2  # missing this long: silent; told to stop this long ago: killed
SILENT_GRACE_BEATS = 10  # missing this long: told to stop
SILENT_MIN_S = 1.0
DEFAULT_BEAT_S = 2.0  # `edgeinfer worker --heartbeat`'s default
STATS_TIMEOUT_S = 2.0  # a worker's /internal/stats, asked before it is stopped for idleness
ROOM_QUIET_S = 1.0  # a worker stopped to make room has had no work for this long, by its account
# ports a worker listens on besides its API: one value for every worker of a pool is taken by
# the first, and each later one fails to start (each picks a free one when not given)
PER_WORKER_PORTS = ("--dist-port", "--kv-port")


@dataclass(slots=True)
class PoolConfig:
    region: str
    models: dict[str, str]  # served model name -> model folder
    redis_url: str
    secret: str
    max_workers: int = 4  # worker processes, all models together
    min_workers: int = 0  # per model, kept running even when idle
    idle_s: float = 300.0  # a worker idle this long is stopped (down to min_workers)
    # a worker is stopped to make room for another model only once it has been ready this long
    # (and as long as its start took): so at the process limit, models asked for in turn each
    # get a stretch of service, rather than a cold start per request (`make_room`)
    min_residency_s: float = 5.0
    scale_up_queue: int = 4  # queued requests per worker that count as queueing
    scale_up_after_s: float = 2.0  # queueing this long starts another worker
    ready_timeout_s: float = 300.0  # a worker not registered by then failed to start
    backoff_s: float = 1.0  # first retry delay after a failed start (doubles, up to a minute)
    tick_s: float = 0.5  # how often demand is read when no wake-up comes
    heartbeat_s: float = 2.0  # the pool's own registration
    ttl_s: float = 10.0
    host: str = "127.0.0.1"  # workers bind and advertise here
    worker_args: list[str] = field(default_factory=list)  # extra `edgeinfer worker` flags
    pool_id: str = ""
    # workers forked from a warm template process that has made their imports (runtime.zygote),
    # rather than started as fresh processes
    zygote: bool = True

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("--models: name at least one model")
        check_id(self.region, "--region")
        for name in self.models:
            check_id(name, "--models: a model name")
        for what, value in (("--idle", self.idle_s), ("--scale-up-after", self.scale_up_after_s),
                            ("min_residency_s", self.min_residency_s),
                            ("--ready-timeout", self.ready_timeout_s), ("backoff_s", self.backoff_s),
                            ("tick_s", self.tick_s), ("heartbeat_s", self.heartbeat_s),
                            ("ttl_s", self.ttl_s)):  # fmt: skip
            if not math.isfinite(value):
                raise ValueError(f"{what} must be a finite number of seconds, got {value}")
        if self.max_workers < 1:
            raise ValueError(f"--max-workers must be at least 1, got {self.max_workers}")
        if self.min_workers < 0 or self.min_workers * len(self.models) > self.max_workers:
            raise ValueError(
                f"--min-workers {self.min_workers} for {len(self.models)} models exceeds "
                f"--max-workers {self.max_workers}"
            )
        if self.idle_s <= 0 or self.tick_s <= 0 or self.ready_timeout_s <= 0:
            raise ValueError("--idle, the tick and --ready-timeout must be positive")
        if self.scale_up_queue < 1:  # (0: an idle worker counted as queueing)
            raise ValueError(f"--scale-up-queue must be at least 1, got {self.scale_up_queue}")
        if self.scale_up_after_s < 0:
            raise ValueError(f"--scale-up-after must be >= 0, got {self.scale_up_after_s}")
        if self.min_residency_s < 0:
            raise ValueError(f"min_residency_s must be >= 0, got {self.min_residency_s}")
        if self.backoff_s <= 0:
            raise ValueError(f"backoff_s must be positive, got {self.backoff_s}")
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s}) must exceed heartbeat_s ({self.heartbeat_s}), which must "
                "be positive: the pool's registration would lapse between its heartbeats"
            )
        for arg in self.worker_args:
            flag = _pool_flag(arg)
            if flag is not None:
                raise ValueError(
                    f"--worker-args: {arg!r} sets {flag}, which the pool sets for each worker "
                    "itself (use the pool's own --region, --host, --redis, --models)"
                )
            port = _pool_flag(arg, PER_WORKER_PORTS)
            if port is not None and self.max_workers > 1:
                raise ValueError(
                    f"--worker-args: {arg!r} gives every worker the same {port}, which only the "
                    f"first of --max-workers {self.max_workers} could listen on (leave it out: "
                    "each worker picks a free port)"
                )
        if not self.pool_id:
            self.pool_id = f"pool-{self.region}-{secrets.token_hex(3)}"
        check_id(self.pool_id, "pool_id")

    @property
    def stop_timeout_s(self) -> float:
        """How long a shutdown waits for the workers to drain before killing them: their
        --drain-timeout (in worker_args; the worker's default otherwise) and STOP_MARGIN_S for
        the exit itself. (A fixed 40 s killed workers told to drain for longer mid-drain.)"""
        drain = WORKER_DRAIN_TIMEOUT_S
        args = self.worker_args
        for i, arg in enumerate(args):
            # (a prefix, `--drain 100`, is the flag to the worker's argparse too: missed, its
            # workers were killed mid-drain at 40 s)
            if _pool_flag(arg, ("--drain-timeout",)) is None:
                continue
            value = (arg.partition("=")[2] if "=" in arg
                     else args[i + 1] if i + 1 < len(args) else None)  # fmt: skip
            if value is not None:
                with contextlib.suppress(ValueError):
                    drain = float(value)
        return max(0.0, drain) + STOP_MARGIN_S


def _pool_flag(arg: str, flags: tuple[str, ...] = POOL_WORKER_FLAGS) -> str | None:
    """The flag of `flags` that `arg` (`--flag`, `--flag=value`, or a prefix of a flag, which
    argparse takes as that flag) sets, if any."""
    name = arg.partition("=")[0]
    if not name.startswith("--") or len(name) < 3:
        return None
    return next((f for f in flags if f.startswith(name)), None)


@dataclass(slots=True)
class Managed:
    """A worker process this pool started."""

    worker_id: str
    model: str
    port: int
    proc: asyncio.subprocess.Process | ForkedProcess
    started: float  # monotonic time of the spawn
    ready: float = 0.0  # monotonic time it first showed up in the registry (0: not yet)
    stopping: float = 0.0  # monotonic time it was sent SIGTERM (0: not asked to stop)
    exited: float = 0.0  # monotonic time its exit was seen, while the pool shuts down
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))  # its last output lines
    beat_s: float = 0.0  # its heartbeat period, as its registry entry says (0: not said yet)
    missing: float = 0.0  # monotonic time a tick found it ready but not registered (0: listed)
    silent: bool = False  # missing for SILENT_BEATS heartbeats: not counted as serving
    killed: bool = False  # silent after its SIGTERM too: sent SIGKILL

    @property
    def serving(self) -> bool:
        """Ready, not told to stop, and heard from (not silent)."""
        return bool(self.ready) and not self.stopping and not self.silent

    def beats_s(self, beats: int) -> float:
        """`beats` of its heartbeats, in seconds (at least SILENT_MIN_S)."""
        return max(SILENT_MIN_S, beats * (self.beat_s or DEFAULT_BEAT_S))


@dataclass(slots=True)
class ModelState:
    """What the pool remembers about a model between ticks."""

    wanted_at: float = 0.0  # last time a request asked for it (wake-up or waiting)
    settled_at: float = 0.0  # last failed start or scale-down: demand older than this is spent
    queueing_since: float = 0.0  # when its workers started queueing (0: not queueing)
    failures: int = 0  # failed starts in a row
    blocked_by: str = ""  # the other pool whose start claim stopped ours (said once in the log)
    crashes: int = 0  # workers in a row that died within CRASH_WINDOW_S of getting ready
    retry_at: float = 0.0  # no start before this (backoff after failures)
    full: bool = False  # it waits for a process slot that no idle worker can free ("full")


@dataclass(slots=True)
class Decision:
    start: bool = False
    stop: list[str] = field(default_factory=list)  # our worker ids to stop
    why: str = ""


def decide(
    cfg: PoolConfig,
    state: ModelState,
    ours: list[Managed],
    registered: list[WorkerInfo],
    waiting: int,
    room: int,
    now: float,
    wall: float,
) -> Decision:
    """What to do about one model this tick. `ours`: this pool's live processes for the model;
    `registered`: the region's registry entries for it (ours and others'); `waiting`: requests
    gateways hold for it; `room`: processes the pool may still start; `now`: monotonic time;
    `wall`: unix time (the registry's clock)."""
    serving = [w for w in registered if not w.draining]
    starting = [m for m in ours if not m.ready and not m.stopping]
    # (a silent worker, ready but gone from the registry, is not counted: a hung engine step or
    # a frozen process held its model at "no worker, none to start" for good)
    active = [m for m in ours if not m.stopping and not m.silent]
    if waiting:
        state.wanted_at = now
    if serving and all(w.waiting >= cfg.scale_up_queue or w.overloaded for w in serving):
        state.queueing_since = state.queueing_since or now
    else:
        state.queueing_since = 0.0
    can_start = room > 0 and not starting and now >= state.retry_at
    if can_start and len(active) < cfg.min_workers:
        return Decision(start=True, why=f"below the minimum of {cfg.min_workers}")
    # (our own ready workers count even when the registry does not list them: Redis restarted)
    # demand since the last failed start or scale-down, and recent (or a worker that died
    # long after its last request would be started again with nobody waiting)
    asked = state.wanted_at > state.settled_at and now - state.wanted_at <= DEMAND_FRESH_S
    if can_start and not serving and not any(m.serving for m in active) and asked:
        return Decision(start=True, why=f"scale from zero ({waiting} waiting)")
    if can_start and state.queueing_since and now - state.queueing_since >= cfg.scale_up_after_s:
        state.queueing_since = now  # the next one only after another full period of queueing
        return Decision(start=True, why=f"{len(serving)} worker(s) queueing")
    if waiting or len(active) <= cfg.min_workers:
        return Decision()
    by_id = {w.worker_id: w for w in registered}
    for m in active:
        w = by_id.get(m.worker_id)
        if w is None or not m.ready or w.running or w.waiting:
            continue
        idle_for = wall - max(w.last_active_at, w.started_at)
        if idle_for >= cfg.idle_s and now - m.ready >= cfg.idle_s:
            return Decision(stop=[m.worker_id], why=f"idle for {idle_for:.0f}s")
    return Decision()


def slots_left(cfg: PoolConfig, managed: list[Managed]) -> int:
    """Processes the pool may still start. A worker that is stopping holds its slot until it
    has exited (a drain can take drain_timeout_s, and its memory is in use until then): started
    beside it, a new worker would put max_workers + 1 models in memory at once."""
    return cfg.max_workers - len(managed)


def needs_room(state: ModelState, ours: list[Managed], registered: list[WorkerInfo],
               waiting: int, room: int, now: float, freeing: bool = False) -> bool:  # fmt: skip
    """Whether the model would scale from zero now (requests wait, nothing serves or starts)
    but for the pool's process slots, all taken and none `freeing` (a worker of the pool is
    stopping: its slot is the next one free, and stopping another would free two)."""
    serving = [w for w in registered if not w.draining]
    active = [m for m in ours if not m.stopping and not m.silent]
    return (bool(waiting) and room <= 0 and not freeing and not serving and not active
            and now >= state.retry_at)  # fmt: skip


def make_room(cfg: PoolConfig, managed: list[Managed], registered: list[WorkerInfo], model: str,
              wall: float, now: float) -> str | None:  # fmt: skip
    """The worker to stop so that `model` can start: the longest idle of another model's ready
    workers with nothing running or queued, above that model's minimum, and resident long
    enough; None if none is. `now`: monotonic time; `wall`: unix time (the registry's clock).

    Resident long enough: ready for `min_residency_s`, and for as long as its own start took
    (a model slow to start is not started again for every request: the pool spends at most
    half its time starting workers however the models alternate). Until then the waiting
    model's requests are held; taken at once, two models asked for in turn at the process
    limit stopped each other's worker on every request."""
    by_id = {w.worker_id: w for w in registered}
    counts: dict[str, int] = {}
    for m in managed:
        if not m.stopping and not m.silent:
            counts[m.model] = counts.get(m.model, 0) + 1
    best, best_idle = None, -1.0
    for m in managed:
        w = by_id.get(m.worker_id)
        if m.model == model or m.stopping or not m.ready or w is None or w.running or w.waiting:
            continue
        if counts[m.model] <= cfg.min_workers:
            continue
        if now - m.ready < max(cfg.min_residency_s, m.ready - m.started):
            continue
        idle = wall - max(w.last_active_at, w.started_at)
        if idle > best_idle:
            best, best_idle = m.worker_id, idle
    return best


class Pool:
    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.managed: dict[str, Managed] = {}
        self.states = {m: ModelState() for m in cfg.models}
        self._serial = 0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._zygote: asyncio.Task[ZygoteClient] | None = None
        # every worker (forked or fresh) watches it: if this process dies, however, they drain
        # and exit instead of serving on as orphans no pool stops (runtime.lifeline)
        self.lifeline = Lifeline()
        self._zygote_started = 0.0  # monotonic time of the last attempt to start one

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        cfg = self.cfg
        redis = connect(cfg.redis_url)
        # BLPOP blocks for up to a tick: its own client, with a socket timeout longer than that
        blocking = connect(cfg.redis_url, timeout_s=cfg.tick_s + 5.0)
        self.demand = Demand(redis)
        self.registry = Registry(redis)
        wakeups = Demand(blocking).wakeups(cfg.region)
        log.info(
            "pool %s: region %s, models %s, %d-%d workers per model, %d at most, idle stop %.0fs",
            cfg.pool_id, cfg.region, ", ".join(cfg.models), cfg.min_workers, cfg.max_workers,
            cfg.max_workers, cfg.idle_s,
        )  # fmt: skip
        last_beat = 0.0
        if cfg.zygote:
            self._start_zygote()
        try:
            while not self._stop.is_set():
                if time.monotonic() - last_beat >= cfg.heartbeat_s:
                    await self._unless_stopped(self._announce())
                    last_beat = time.monotonic()
                try:
                    woke = await self._unless_stopped(self._tick(wakeups))
                except Exception as e:  # Redis down: keep the workers, try again next tick
                    log.warning("pool tick failed (redis?): %s", e)
                    await self._unless_stopped(asyncio.sleep(cfg.tick_s))
                    continue
                for model in (woke or set()) & self.states.keys():  # (others: another pool's)
                    self.states[model].wanted_at = time.monotonic()
        finally:
            await self.shutdown()
            await wakeups.aclose()
            with contextlib.suppress(Exception):
                await self.demand.withdraw(cfg.pool_id)
            await redis.aclose()
            await blocking.aclose()

    def stop(self) -> None:
        self._stop.set()

    @property
    def _lease_s(self) -> float:
        return self.cfg.ttl_s + START_LEASE_EXTRA_S

    async def _tick(self, wakeups: Wakeups) -> set[str]:
        """A tick, then a wait of up to `tick_s` for wake-ups; the models they named."""
        await self.tick()
        return await wakeups.next(self.cfg.tick_s)

    async def _unless_stopped(self, work: Coroutine[Any, Any, Any]) -> Any:
        """`work`'s result, or None once the pool is asked to stop (the work cancelled): a tick
        against a Redis that hangs takes its timeouts (~15 s), and shutdown must not wait them
        out before it signals the workers."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await stop_task(task)  # (a cancel can be lost inside a Redis command)
            return None
        return task.result()

    async def _announce(self) -> None:
        info = PoolInfo(
            pool_id=self.cfg.pool_id,
            region=self.cfg.region,
            models=list(self.cfg.models),
            max_workers=self.cfg.max_workers,
            workers=len(self.managed),
            updated_at=time.time(),
        )
        with contextlib.suppress(Exception):
            await self.demand.announce(info, self.cfg.ttl_s)

    async def tick(self) -> None:
        cfg = self.cfg
        now, wall = time.monotonic(), time.time()
        registered = [w for w in await self.registry.workers() if w.region == cfg.region]
        ids = {w.worker_id for w in registered}
        exited = await self._reap(ids, now)
        registered = [w for w in registered if w.worker_id not in exited]
        by_id = {w.worker_id: w for w in registered}
        await self._watch(by_id, now)
        # a start's claim is a lease renewed while the worker starts: a pool that dies (SIGKILL,
        # the OOM killer) holds up the region's other pools for ttl_s, not ready_timeout_s
        for model in {m.model for m in self.managed.values() if not m.ready and not m.stopping}:
            await self.demand.renew_start(model, cfg.region, cfg.pool_id, self._lease_s)
        for model, state in self.states.items():
            ours = [m for m in self.managed.values() if m.model == model]
            waiting = await self.demand.waiting(model, cfg.region)
            room = slots_left(cfg, list(self.managed.values()))
            mine = [w for w in registered if w.model == model]
            d = decide(cfg, state, ours, mine, waiting, room, now, wall)
            claimed = d.start and await self.demand.claim_start(
                model, cfg.region, cfg.pool_id, self._lease_s
            )
            if d.start and not claimed:
                owner = await self.demand.start_owner(model, cfg.region)
                if owner is not None and owner != state.blocked_by:
                    log.info("%s: pool %s is starting a worker for it in %s; not starting one "
                             "here meanwhile", model, owner, cfg.region)  # fmt: skip
                state.blocked_by = owner or ""
            if claimed:
                state.blocked_by = ""
                try:
                    await self._start(model, d.why)
                except Exception as e:  # no process at all (exec failed, out of descriptors or
                    # memory): a failed start, not a tick that dies holding the start's claim
                    await self._failed(f"{cfg.pool_id}-w{self._serial}", model,
                                       f"could not start a process: {_public(str(e))}", now,
                                       repr(e))  # fmt: skip
            for wid in d.stop:
                if await self._confirmed_idle(self.managed[wid], by_id.get(wid), cfg.idle_s):
                    # (SIGTERM at once after the worker's answer: nothing awaits in between)
                    await self._request_stop(self.managed[wid], d.why)
                    state.settled_at = now
            freeing = any(m.stopping for m in self.managed.values())
            if not d.start and needs_room(state, ours, mine, waiting, room, now, freeing):
                victim = make_room(cfg, list(self.managed.values()), registered, model, wall,
                                   now)  # fmt: skip
                if victim is not None:  # its slot frees once it has exited: a tick then starts
                    stopped = self.managed[victim]
                    # (asked first, as for an idle stop: one that has just taken work is asked
                    # again at the next tick)
                    if await self._confirmed_idle(stopped, by_id.get(victim), ROOM_QUIET_S):
                        # a scale-down: its model's past demand is spent (or it would take the
                        # slot)
                        self.states[stopped.model].settled_at = now
                        await self._request_stop(
                            stopped, f"making room for {model} ({waiting} waiting)"
                        )
                elif not state.full:
                    state.full = True
                    await self._status(model, ModelStatus("full", cfg.pool_id))
            elif state.full and (d.start or not waiting):
                state.full = False

    # ------------------------------------------------------------------ processes
    async def _start(self, model: str, why: str) -> None:
        cfg = self.cfg
        self._serial += 1
        worker_id = f"{cfg.pool_id}-w{self._serial}"
        port = find_free_port()
        argv = [
            "worker", "--model", cfg.models[model],
            "--served-model-name", model, "--region", cfg.region, "--host", cfg.host,
            "--port", str(port), "--worker-id", worker_id, *cfg.worker_args,
        ]  # fmt: skip
        # the Redis URL in the worker's environment, not its argv: a URL may hold a password,
        # and a command line is anyone's to read on the node (ps, /proc/PID/cmdline)
        env = {"EDGEINFER_SECRET": cfg.secret, "EDGEINFER_REDIS": cfg.redis_url,
               "PYTHONUNBUFFERED": "1"} | self.lifeline.env  # fmt: skip
        t0 = time.monotonic()
        proc, how = await self._spawn_process(argv, env)
        m = Managed(worker_id, model, port, proc, t0)
        self.managed[worker_id] = m
        self._spawn(self._pipe_output(m))
        log.info("start %s for %s (%s): pid %d (%s), port %d", worker_id, model, why, proc.pid,
                 how, port)  # fmt: skip
        await self._record("start", m.worker_id, m.model, reason=why, pid=proc.pid, port=port,
                           spawn=how)  # fmt: skip
        await self._status(model, ModelStatus("starting", cfg.pool_id))

    def _start_zygote(self) -> None:
        self._zygote_started = time.monotonic()
        self._zygote = asyncio.ensure_future(self._zygote_start())

    async def _zygote_start(self) -> ZygoteClient:
        try:
            zygote = await ZygoteClient.start(pass_fds=self.lifeline.pass_fds)
        except ZygoteError as e:
            log.warning("worker template: %s; workers start as fresh processes", e)
            raise
        pid = zygote.proc.pid if zygote.proc else 0
        log.info("worker template ready (pid %d, imports %.2fs): workers are forked from it",
                 pid, zygote.imports_s)  # fmt: skip
        return zygote

    async def _spawn_process(
        self, argv: list[str], env: dict[str, str]
    ) -> tuple[asyncio.subprocess.Process | ForkedProcess, str]:
        """`edgeinfer ARGV` with `env` added to the environment, in a process: forked from the
        warm template when there is one ("fork"; one still starting is waited for, up to
        TEMPLATE_WAIT_S, as it is ahead of a fresh process), else a fresh one ("exec"). A
        template that failed to start or died is started again in the background, at most once
        a minute; one that could not fork this time (out of memory?) is kept."""
        task = self._zygote
        if task is not None:
            try:
                async with asyncio.timeout(TEMPLATE_WAIT_S):
                    zygote = await asyncio.shield(task)
                return await zygote.spawn(argv, env), "fork"
            except TimeoutError:
                log.warning("the worker template is not ready after %.0fs: starting a fresh "
                            "process", TEMPLATE_WAIT_S)  # fmt: skip
            except ZygoteError as e:
                log.warning("no worker template (%s): starting a fresh process", e)
            dead = task.done() and (task.exception() is not None or not task.result().alive)
            if dead and time.monotonic() - self._zygote_started >= 60.0:
                if task.exception() is None:
                    await task.result().close()  # (reaps its process)
                self._start_zygote()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime.cli", *argv, env=os.environ | env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            pass_fds=self.lifeline.pass_fds,
        )  # fmt: skip
        return proc, "exec"

    async def _pipe_output(self, m: Managed) -> None:
        """Relay a worker's output, each line prefixed with its id, keeping the last lines."""
        assert m.proc.stdout is not None
        pending = b""
        while True:  # in pieces, not readline(): a line past its limit must not stop the relay
            piece = await m.proc.stdout.read(1 << 16)  # (a worker blocks once the pipe is full)
            if not piece:
                break
            *lines, pending = (pending + piece).split(b"\n")
            if len(pending) > 1 << 16:
                lines.append(pending)
                pending = b""
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                m.tail.append(line[:4000])
                # our stderr gone: keep draining the pipe (a worker blocks once it is full)
                with contextlib.suppress(OSError, ValueError):
                    print(f"[{m.worker_id}] {line}", file=sys.stderr, flush=True)
        if pending:
            m.tail.append(pending.decode(errors="replace")[:4000])

    async def _reap(self, registered: set[str], now: float) -> set[str]:
        """Notice workers that registered, exited, or overran the ready timeout; returns the
        ids of those that exited. One that died (not asked to stop) leaves the registry now,
        not when its entry expires: gateways stop sending it requests, and a replacement can
        start on this tick."""
        cfg = self.cfg
        exited: set[str] = set()
        for m in list(self.managed.values()):
            code = m.proc.returncode
            if code is None and m.ready and now - m.ready >= CRASH_WINDOW_S:
                self.states[m.model].crashes = 0  # one lived: the model's starts are sound
            if code is None and not m.ready and m.worker_id in registered:
                m.ready = now
                state = self.states[m.model]
                state.failures, state.retry_at = 0, 0.0
                log.info("ready %s in %.2fs", m.worker_id, now - m.started)
                await self._record("ready", m.worker_id, m.model,
                                   ready_s=f"{now - m.started:.3f}")  # fmt: skip
                await self._release_start(m.model)
                await self._status(m.model, ModelStatus("ready", cfg.pool_id))
            elif code is None and m.stopping and now - m.stopping > cfg.stop_timeout_s:
                # a drain that never ends (a hung step) held its slot, and every model's
                # scale from zero behind it, for good: killed once its drain has run out
                log.warning("worker %s has not exited %.0fs after it was told to stop; "
                            "killing it", m.worker_id, now - m.stopping)  # fmt: skip
                with contextlib.suppress(ProcessLookupError):  # (exited meanwhile)
                    m.proc.kill()
            elif code is None and not m.ready and now - m.started > cfg.ready_timeout_s:
                m.proc.kill()
                await m.proc.wait()
                cause = f"not registered after {cfg.ready_timeout_s:.0f}s; killed"
                await self._failed(m.worker_id, m.model, _cause(m, cause), now, _tail(m))
            elif code is not None:
                del self.managed[m.worker_id]
                exited.add(m.worker_id)
                if m.stopping:
                    if not m.ready:  # stopped mid-start (the pool shuts down)
                        await self._release_start(m.model)
                    took = (m.exited or now) - m.stopping
                    log.info("stopped %s in %.2fs", m.worker_id, took)
                    await self._record("stop", m.worker_id, m.model, stop_s=f"{took:.3f}",
                                       code=code)  # fmt: skip
                elif not m.ready:
                    cause = f"exited with code {code} before registering"
                    if m.worker_id in registered:  # (it had, since the last tick: its entry
                        # listed a dead worker to the gateways until its TTL ran out)
                        cause = (f"exited with code {code} after registering, before the "
                                 "pool saw it ready")  # fmt: skip
                        await self._forget(m)
                    await self._failed(m.worker_id, m.model, _cause(m, cause), now, _tail(m))
                else:
                    log.warning("worker %s exited with code %s", m.worker_id, code)
                    await self._record("exit", m.worker_id, m.model, code=code)
                    await self._forget(m)
                    if code != 0 and now - m.ready < CRASH_WINDOW_S:
                        await self._crashed(m, code, now)
        return exited

    async def _watch(self, listed: dict[str, WorkerInfo], now: float) -> None:
        """Ready workers that left the registry while their process lives on (see the module
        docstring): silent, then told to stop, then killed; counted again if they come back.
        `listed`: the region's registry entries, by id."""
        for m in list(self.managed.values()):
            if not m.ready or m.proc.returncode is not None or m.killed:
                continue
            w = listed.get(m.worker_id)
            if w is not None:
                m.beat_s = w.heartbeat_s or m.beat_s
                if m.silent:
                    log.warning("worker %s is in the registry again after %.1fs away: counted "
                                "as serving again", m.worker_id, now - m.missing)  # fmt: skip
                    await self._record("back", m.worker_id, m.model,
                                       away_s=f"{now - m.missing:.1f}")  # fmt: skip
                m.missing, m.silent = 0.0, False
                continue
            if m.stopping and not m.silent:
                continue  # (a drain leaves the registry before its process exits)
            m.missing = m.missing or now
            gone = now - m.missing
            if m.stopping:  # silent, and told to stop: no exit, no sign of a drain
                if now - m.stopping >= m.beats_s(SILENT_BEATS):
                    m.killed = True
                    log.warning("worker %s (pid %d) is still silent %.1fs after its SIGTERM: "
                                "killing it", m.worker_id, m.proc.pid, now - m.stopping)  # fmt: skip
                    with contextlib.suppress(ProcessLookupError):  # (exited meanwhile)
                        m.proc.kill()
                    await self._record("kill", m.worker_id, m.model,
                                       silent_s=f"{gone:.1f}")  # fmt: skip
                continue
            if not m.silent and gone >= m.beats_s(SILENT_BEATS):
                m.silent = True
                grace = m.beats_s(SILENT_GRACE_BEATS)
                log.warning("worker %s (pid %d) of %s has left the registry (no heartbeat; a "
                            "hung engine step, a stopped or frozen process?): not counted as "
                            "serving; stopped unless it comes back within %.1fs", m.worker_id,
                            m.proc.pid, m.model, grace - gone)  # fmt: skip
                await self._record("silent", m.worker_id, m.model, missing_s=f"{gone:.1f}")
            if m.silent and gone >= m.beats_s(SILENT_GRACE_BEATS):
                await self._request_stop(m, f"silent for {gone:.1f}s")

    async def _confirmed_idle(self, m: Managed, w: WorkerInfo | None, idle_s: float) -> bool:
        """Whether the worker itself says it has nothing in flight and has had no request for
        `idle_s` (its registry entry, which said so, is up to a heartbeat old: a worker that had
        just taken a request was stopped mid-stream). No answer: not confirmed."""
        if w is None:
            return False
        try:
            stats = await worker_stats(w.url, self.cfg.secret, STATS_TIMEOUT_S)
        except Exception as e:  # (aiohttp.ClientError, TimeoutError, ValueError)
            log.info("not stopping %s: its stats could not be read (%s)", m.worker_id,
                     f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)  # fmt: skip
            return False
        idle = idle_for(stats, time.time())
        if idle is None or idle < idle_s:
            log.info("not stopping %s: it has work (%s)", m.worker_id,
                     "in flight" if idle is None else f"a request {idle:.1f}s ago")  # fmt: skip
            return False
        return True

    async def _forget(self, m: Managed) -> None:
        """A worker that died unasked leaves the registry now, not when its entry expires."""
        with contextlib.suppress(Exception):
            await self.registry.deregister(m.worker_id, m.model)
            # (out of its model's set, no registry reader finds it dead and purges
            # it from the prefix index, where live workers' blocks listed it for good)
            await self.registry.index.purge_workers(m.model, [m.worker_id])

    async def _release_start(self, model: str) -> None:
        with contextlib.suppress(Exception):
            await self.demand.release_start(model, self.cfg.region, self.cfg.pool_id)

    async def _crashed(self, m: Managed, code: int, now: float) -> None:
        """A worker died soon after getting ready (a request that kills it, say): its model's
        next start waits, doubling with each crash in a row, as after failed starts, and the
        requests held for it are told when (a crash loop would restart it at once for ever)."""
        state = self.states[m.model]
        state.crashes += 1
        error = f"worker {m.worker_id} died {now - m.ready:.0f}s after getting ready (code {code})"
        delay = await self._back_off(m.model, state.crashes, error, now)
        log.warning("%s, %d in a row; the next start of %s in %.0fs", error, state.crashes,
                    m.model, delay)  # fmt: skip

    async def _failed(
        self, worker_id: str, model: str, error: str, now: float, detail: str = ""
    ) -> None:
        """A start that gave no worker: its claim released, the next one after a backoff.
        `error`, its cause, is published (status, event: gateways relay it to clients);
        `detail` (the worker's last output lines) is logged only."""
        self.managed.pop(worker_id, None)
        await self._release_start(model)
        state = self.states[model]
        state.failures += 1
        state.settled_at = now
        delay = await self._back_off(model, state.failures, error, now)
        log.warning(
            "worker %s for %s failed to start (attempt %d); next try in %.0fs: %s%s",
            worker_id, model, state.failures, delay, error,
            f"; its last output: {detail}" if detail else "",
        )  # fmt: skip
        await self._record("fail", worker_id, model, attempts=state.failures,
                           retry_in_s=f"{delay:.1f}", error=error)  # fmt: skip

    async def _back_off(self, model: str, attempts: int, error: str, now: float) -> float:
        """No start of `model` for a delay doubling with `attempts` (returned), said in its
        status, where gateways holding its requests answer them 503 with Retry-After."""
        delay = min(MAX_BACKOFF_S, self.cfg.backoff_s * 2 ** (attempts - 1))
        self.states[model].retry_at = now + delay
        await self._status(
            model,
            ModelStatus("failed", self.cfg.pool_id, error, attempts, time.time() + delay),
            ttl_s=max(delay, 1.0),
        )
        return delay

    def _request_stop(self, m: Managed, why: str) -> Coroutine[Any, Any, None]:
        """SIGTERM to `m` now; the "stopping" event to record (awaited, or run in background)."""
        m.stopping = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            m.proc.send_signal(signal.SIGTERM)
        log.info("stopping %s (%s)", m.worker_id, why)
        return self._record("stopping", m.worker_id, m.model, reason=why,
                            served_s=f"{m.stopping - (m.ready or m.started):.1f}")  # fmt: skip

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop every worker (they drain), waiting up to `timeout_s` (default: the config's
        stop_timeout_s), then kill what is left.
        Every worker is signalled first, and the events recorded after, in the background: a
        Redis that hangs cost each worker ~3 s of retries before the next was signalled."""
        for m in self.managed.values():
            if not m.stopping:
                self._spawn(self._request_stop(m, "pool shutting down"))
        procs = [m.proc for m in self.managed.values()]
        if procs:

            async def exit_of(m: Managed) -> None:
                await m.proc.wait()
                m.exited = time.monotonic()  # (the stop's time in the log and the event)

            waits = [asyncio.ensure_future(exit_of(m)) for m in self.managed.values()]
            wait_s = self.cfg.stop_timeout_s if timeout_s is None else timeout_s
            await asyncio.wait(waits, timeout=wait_s)
            for p in procs:
                if p.returncode is None:
                    p.kill()
            for p in procs:
                await p.wait()
            await self._reap(set(), time.monotonic())
        # a start whose tick the stop cancelled (claimed, its process not spawned yet): its
        # claim goes now, not when its lease runs out (no-op for another pool's claims)
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(2.0):
                await asyncio.gather(*(self._release_start(model) for model in self.states))
        for t in self._tasks:
            t.cancel()
        if self._zygote is not None:
            self._zygote.cancel()  # one still starting stops
            with contextlib.suppress(Exception, asyncio.CancelledError):
                zygote = await self._zygote
                await zygote.close()

    # ------------------------------------------------------------------ reporting
    async def _record(self, event: str, worker_id: str, model: str, **fields: object) -> None:
        with contextlib.suppress(Exception):
            await self.demand.record(
                self.cfg.region, event, pool=self.cfg.pool_id, worker=worker_id, model=model,
                **fields,
            )  # fmt: skip

    async def _status(self, model: str, status: ModelStatus, ttl_s: float | None = None) -> None:
        with contextlib.suppress(Exception):
            await self.demand.set_status(
                model, self.cfg.region, status, ttl_s if ttl_s is not None else self.cfg.ttl_s * 6
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _tail(m: Managed) -> str:
    """A worker's last output lines, as one line for the log."""
    return " | ".join(line for line in m.tail if line.strip())[-2000:]


_URL = re.compile(r"\b[A-Za-z][\w+.-]*://\S*")
_ADDRESS = re.compile(r"\[[0-9A-Fa-f:.]+\](?::\d+)?|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"
                      r"|\blocalhost:\d+\b")  # fmt: skip
_PATH = re.compile(r"(?<![\w.~-])(?:~|\.{1,2})?/[^\s'\"(),;]*")
CLI_ERROR = "edgeinfer: error: "  # how `edgeinfer worker` says why it could not start


def _cause(m: Managed, how: str) -> str:
    """What a failed start publishes (the model's status, which gateways relay in their 503s,
    and the event): `how` it ended, and the worker's own one-line error, if it gave one, with
    URLs and addresses left out and paths cut to their last part. Its output lines told
    clients the model's folder, the worker's internal URL and its KV-transfer address."""
    said = next((line for line in reversed(m.tail) if line.startswith(CLI_ERROR)), "")
    return f"{_public(said.removeprefix(CLI_ERROR))} ({how})" if said else how


def _public(text: str) -> str:
    """`text` without URLs and addresses, its paths cut to their last part, and short."""
    text = _ADDRESS.sub("<address>", _URL.sub("<url>", text))
    return _PATH.sub(lambda p: p.group().rstrip("/").rpartition("/")[2] or "/", text)[:300]


async def serve(cfg: PoolConfig) -> None:
    pool = Pool(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, pool.stop)
    await pool.run()
