"""Scale from zero: a request for a model with no worker, answered through the gateway while the
pool manager starts the worker, against the bare cold start of the same model, in one run.

Each repetition drops the model's files from the page cache first (`posix_fadvise(DONTNEED)`),
then measures:
1. ours: a streamed `/v1/completions` request (1 output token, `openai` client) to a gateway
   whose region has no worker for the model but an `edgeinfer pool` that offers it: request sent
   to first token. That covers the wake-up, the worker process's start, its load and
   registration, the gateway noticing it, and the first token. The pool's own `ready_s` is
   printed beside it (spawn to the tick, every 0.5 s, on which the pool saw the registration:
   up to 0.5 s late, so it can exceed the request's own time). Between repetitions the pool stops
   the idle worker (`--idle 1`), and the next one starts once that worker's process has exited:
   every repetition starts from zero. The pool forks its workers from its warm template process
   (runtime.zygote; the first repetition waits until the pool says the template is ready, as a
   pool that has been up a second has it); `--no-zygote` measures fresh processes instead.
2. the peer: a bare `edgeinfer worker` (no Redis, no gateway, no pool) spawned on the same model,
   to the first token of a 1-token request sent straight to its internal API as soon as its
   port accepts (bench.coldstart.worker_first_token).
The ratio (1)/(2) is what the serving path adds to a cold start.

    python -m bench.scale_from_zero [--model DIR] [--reps 3] [--no-zygote]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.coldstart import evict, log, worker_first_token  # noqa: E402
from kvstore.redis_server import LocalRedis  # noqa: E402
from runtime.loader import safetensors_files  # noqa: E402
from tests.stack import get_json, start_gateway, start_pool, wait_until  # noqa: E402

CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"


def _events(redis_url: str, kind: str) -> list[dict[str, str]]:
    """The pool's events of one kind (start, ready, stop, ...), oldest first."""
    import asyncio

    from kvstore.client import connect
    from kvstore.demand import Demand

    async def main() -> list[dict[str, str]]:
        redis = connect(redis_url)
        try:
            return await Demand(redis).events("local", 1000)
        finally:
            await redis.aclose()

    return [e for e in asyncio.run(main()) if e["event"] == kind]


def _stopped(redis_url: str, count: int) -> bool:
    return len(_events(redis_url, "stop")) >= count


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None, help="default: the SmolLM2 demo model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-zygote", action="store_true",
                    help="the pool starts fresh worker processes (edgeinfer pool --no-zygote)")  # fmt: skip
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = ap.parse_args()
    if args.model is None:
        from runtime.model_cache import default_model_dir

        args.model = default_model_dir(Path("~/.cache/edgeinfer/models"))
    model = Path(args.model)
    files = safetensors_files(model)
    name = model.name
    import openai

    ours: list[float] = []
    logs = Path(tempfile.mkdtemp(prefix="scale0-"))
    with LocalRedis() as redis:
        (logs / "regions.yaml").write_text(CATALOG)
        pool = start_pool("pool", redis.url, logs, f"{name}={model}",
                          ["--max-workers", "1", "--idle", "1"]
                          + (["--no-zygote"] if args.no_zygote else []))  # fmt: skip
        gateway = start_gateway("gateway", redis.url, logs / "regions.yaml", logs, "local")
        try:
            wait_until(lambda: get_json(f"{gateway.url}/readyz")[1].get("pools") == 1, 60,
                       "the gateway to see the pool")  # fmt: skip
            if not args.no_zygote:
                wait_until(lambda: "worker template ready" in (logs / "pool.log").read_text(),
                           120, "the pool's worker template")  # fmt: skip
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                                   timeout=300)  # fmt: skip
            for rep in range(args.reps):
                # from zero: the last repetition's worker process has exited, not just left
                # the registry (its teardown would compete for the cores)
                wait_until(partial(_stopped, redis.url, rep), 60, "the last worker's exit")
                evict(files)
                t0 = time.perf_counter()
                stream = client.completions.create(
                    model=name, prompt="Once upon a time", max_tokens=1, stream=True
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        ours.append(time.perf_counter() - t0)
                        break
                for _ in stream:
                    pass
                log(f"rep {rep + 1}: scale from zero to first token {ours[-1]:.2f}s")
            wait_until(lambda: len(_events(redis.url, "ready")) >= args.reps, 30, "ready events")
            ready = [float(e["ready_s"]) for e in _events(redis.url, "ready")]
        finally:
            gateway.stop(60)
            pool.stop(60)
            if args.keep_logs:
                log(f"logs kept in {logs}")
            else:
                shutil.rmtree(logs, ignore_errors=True)
    peer = [worker_first_token(model, files)[0] for _ in range(args.reps)]
    log(
        "each rep, ours / pool's ready_s / peer: "
        + ", ".join(f"{a:.2f}/{b:.2f}/{c:.2f}" for a, b, c in zip(ours, ready, peer, strict=False))
    )
    o, p, r = statistics.median(ours), statistics.median(peer), statistics.median(ready)
    print(f"\nscale from zero ({name}, {args.reps} reps, medians, page cache dropped each time):")
    print(f"  request at the gateway -> first token, pool starting the worker: {o:.2f}s")
    print(f"  the pool's ready_s (spawn -> registration seen on its {0.5}s tick): {r:.2f}s")
    print(f"  peer: a bare `edgeinfer worker`, spawn -> first token of a direct request: {p:.2f}s")
    print(f"  ratio (serving path / bare cold start): {o / p:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
