"""The pool manager under faults: workers that die at awkward moments, with a real Redis and real
processes."""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time
from pathlib import Path

from kvstore.client import connect
from kvstore.demand import Demand
from kvstore.protocol import WorkerInfo
from kvstore.registry import Registry
from runtime.pool_manager import Managed, Pool, PoolConfig


def _info(wid: str, model: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region="r", model=model, role="mixed", url="u",
                      max_num_seqs=4, capacity_tokens=100, started_at=time.time(),
                      last_active_at=0.0, updated_at=time.time())  # fmt: skip


def test_a_worker_that_dies_just_after_registering_leaves_the_registry(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A worker that registers and dies before the pool's next tick has seen it ready (a crash
    on the first request the held ones send it): a failed start, and its entry goes at once,
    not when its TTL runs out (gateways kept routing to a dead worker till then)."""

    async def main() -> None:
        redis_ = connect(redis_server.url)
        registry = Registry(redis_, ttl_s=60.0)
        await registry.register(_info("pf1-w1", "pf1"))
        pool = Pool(PoolConfig(region="r", models={"pf1": "/x"}, redis_url=redis_server.url,
                               secret="s"))  # fmt: skip
        pool.registry, pool.demand = registry, Demand(redis_)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
        await proc.wait()
        now = time.monotonic()
        pool.managed["pf1-w1"] = Managed("pf1-w1", "pf1", 0, proc, started=now - 1.0)
        assert await pool._reap({"pf1-w1"}, now) == {"pf1-w1"}
        assert not pool.managed and pool.states["pf1"].failures == 1
        assert [w.worker_id for w in await registry.workers("pf1")] == []
        status = await pool.demand.status("pf1", "r")
        assert status is not None and status.state == "failed" and "code 3" in status.error
        await redis_.aclose()

    asyncio.run(main())


def test_a_shutdown_waits_out_a_drain_timeout_given_by_a_prefix() -> None:
    """`--drain 100` in --worker-args is the worker's --drain-timeout (argparse takes a prefix
    of a flag as the flag): the pool waits for it too, not its 30 s default (it killed its
    workers 40 s into their 100 s drain, cutting off the requests they were finishing)."""
    from runtime.cli import build_parser
    from runtime.pool_manager import STOP_MARGIN_S

    for args in (["--threads", "1", "--drain", "100"], ["--drain-t=100"]):
        assert build_parser().parse_args(["worker", "--model", "x", *args]).drain_timeout == 100
        cfg = PoolConfig(region="r", models={"m": "/x"}, redis_url="", secret="s",
                         worker_args=args)  # fmt: skip
        assert cfg.stop_timeout_s == 100 + STOP_MARGIN_S, args


def test_starts_get_past_a_template_that_could_not_start_for_want_of_descriptors(
    tmp_path: Path,
) -> None:
    """The pool's template started while the process was out of descriptors: its workers start
    as fresh processes (and the template is tried again later), not every start of the pool
    failing for good with the template's "Too many open files"."""

    async def main() -> None:
        pool = Pool(PoolConfig(region="r", models={"m": "/x"}, redis_url="", secret="s"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.dup(0)  # the next descriptor number: none is left under this limit
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:
            pool._start_zygote()
            await asyncio.sleep(0)  # (it fails at its first step)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert pool._zygote is not None and pool._zygote.done()
        proc, how = await pool._spawn_process(["models", "--store", str(tmp_path)], {})
        assert how == "exec"
        assert proc.stdout is not None and b"no models in" in await proc.stdout.read()
        assert await proc.wait() == 0

    asyncio.run(main())
