"""Gateway overhead: streamed requests through the gateway against straight to the worker.

The workload (issue text): 2,000 streamed requests at concurrency 64, short prompts, 16 output
tokens each, through the gateway (`POST /v1/completions`, SSE) and straight to the worker
(`POST /internal/generate`, NDJSON), in one run. Figures, per path:

- TTFT: from sending the request to receiving the first token (p50, p99);
- requests/s over the phase;
- the gateway's added latency: gateway TTFT minus direct TTFT, at p50 and p99;
- the gateway process's CPU use during its phase, in cores (from /proc/<pid>/stat);
- the gateway's own work on the first-token path, from its `Server-Timing` header (arrival to
  forward, first token to response headers): the part of the added latency that is the
  gateway's code, free of the engine's queueing noise.

All processes share all CPUs by default. `--pin` gives the gateway half the CPUs to itself and
the worker and the load generator the other half (the same for both paths), as when the gateway
runs at a point of presence and not on the worker's cores: at concurrency 64 the gateway then no
longer takes its CPU from the worker, while unloaded (concurrency 1) the cross-core wake-ups cost
a little more than sharing (see bench/README.md). The phases alternate in rounds (direct then gateway, gateway then
direct, ...) so that drift of a shared machine hits both. A second, unloaded measurement (concurrency 1) isolates the gateway's own
cost from queueing in the worker: at concurrency 64 a 2-core machine runs the worker, the
gateway and this load generator on the same cores, and TTFT is mostly waiting for the engine.

`--bare-proxy` adds, unloaded, a bare aiohttp pass-through proxy (bench/bare_proxy.py, placed
as the gateway is) against the same worker: the floor of an aiohttp hop, beside which the
gateway's added latency splits into aiohttp's and its own.

Everything runs as real processes: a throwaway redis-server, one worker, one gateway.
Run from the repository root: `python -m bench.gateway [--requests 2000] [--concurrency 64]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.redis_server import LocalRedis  # noqa: E402
from tests.stack import SECRET, Proc, find_free_port, start_gateway, start_worker  # noqa: E402

STORIES = ROOT.parent / "shared" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog", "One day, Lily", "Tom had a red ball"]


@dataclass
class Phase:
    name: str
    ttft: list[float] = field(default_factory=list)  # seconds
    wall: float = 0.0  # seconds the phase's requests took
    count: int = 0
    cpu_s: float = 0.0  # gateway CPU seconds used during gateway phases
    own: list[float] = field(default_factory=list)  # gateway's own ms on the TTFT path

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    @property
    def rps(self) -> float:
        return self.count / self.wall if self.wall else 0.0


async def _one_direct(s: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {
        "request_id": uuid.uuid4().hex,
        "model": "stories",
        "prompt": PROMPTS[i % len(PROMPTS)],
        "sampling": {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    ttft = None
    async with s.post(f"{url}/internal/generate", data=orjson.dumps(body),
                      headers={"x-edgeinfer-secret": SECRET}) as resp:  # fmt: skip
        resp.raise_for_status()
        async for line in resp.content:
            if not line.strip():  # a keepalive
                continue
            ev = orjson.loads(line)
            if ttft is None and ev["type"] == "delta" and ev["token_ids"]:
                ttft = time.perf_counter() - t0
            if ev["type"] in ("done", "error"):
                assert ev["type"] == "done", ev
    assert ttft is not None
    return ttft


def _own_ms(resp: aiohttp.ClientResponse) -> float:
    """The gateway's own time on the first-token path, from its Server-Timing header."""
    for part in resp.headers["Server-Timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == "gateway":
            return float(dur)
    raise ValueError(resp.headers["Server-Timing"])


async def _one_gateway(s: aiohttp.ClientSession, url: str, i: int, own: list[float]) -> float:
    body = {
        "model": "stories",
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    done = False
    async with s.post(f"{url}/v1/completions", data=orjson.dumps(body),
                      headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
        resp.raise_for_status()
        own.append(_own_ms(resp))
        # read to the end of the body, as the openai client does: a connection left with
        # unread bytes is closed, and the next request would pay a new one
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            assert not done, f"a chunk after [DONE]: {line!r}"
            if line.startswith(b"data: [DONE]"):
                done = True
                continue
            chunk = orjson.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
    assert ttft is not None and done
    return ttft


async def _run(one, url: str, n: int, concurrency: int, phase: Phase) -> None:  # type: ignore[no-untyped-def]
    queue = iter(range(n))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def client() -> None:
            for i in queue:
                if one is _one_gateway:
                    phase.ttft.append(await one(s, url, i, phase.own))
                else:
                    phase.ttft.append(await one(s, url, i))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        phase.wall += time.perf_counter() - t0
        phase.count += n


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(worker: Proc, gateway: Proc, n: int, conc: int, rounds: int) -> tuple[Phase, Phase]:  # fmt: skip
    direct, via = Phase("direct"), Phase("gateway")
    per = max(1, n // rounds)
    await _run(_one_direct, worker.url, min(64, per), conc, Phase("warmup"))
    await _run(_one_gateway, gateway.url, min(64, per), conc, Phase("warmup"))
    for r in range(rounds):
        # the path that goes first changes each round: drift within a round favours neither
        d_round, g_round = Phase("direct"), Phase("gateway")
        for path in ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct"):
            if path == "direct":
                await _run(_one_direct, worker.url, per, conc, d_round)
            else:
                c0 = _cpu_seconds(gateway.popen.pid)
                await _run(_one_gateway, gateway.url, per, conc, g_round)
                g_round.cpu_s += _cpu_seconds(gateway.popen.pid) - c0
        for total, part in ((direct, d_round), (via, g_round)):
            total.ttft += part.ttft
            total.own += part.own
            total.wall += part.wall
            total.count += part.count
            total.cpu_s += part.cpu_s
        print(
            f"  round {r + 1}/{rounds} (concurrency {conc}, "
            f"{'direct' if r % 2 == 0 else 'gateway'} first): this round's direct p50 "
            f"{d_round.pct(0.5):.2f} ms, gateway p50 {g_round.pct(0.5):.2f} ms, gateway CPU "
            f"{g_round.cpu_s / g_round.wall:.2f} cores",
            file=sys.stderr,
        )
    return direct, via


def _report(title: str, direct: Phase, via: Phase) -> None:
    print(f"\n{title}")
    print(f"  {'':10} {'p50 TTFT':>10} {'p99 TTFT':>10} {'req/s':>9}")
    for p in (direct, via):
        print(f"  {p.name:10} {p.pct(0.5):8.2f}ms {p.pct(0.99):8.2f}ms {p.rps:9.1f}")
    add50, add99 = via.pct(0.5) - direct.pct(0.5), via.pct(0.99) - direct.pct(0.99)
    print(
        f"  gateway added: p50 {add50:+.2f} ms (target <= 1 ms), p99 {add99:+.2f} ms "
        f"(target <= 5 ms); throughput ratio gateway/direct {via.rps / direct.rps:.2f}x; "
        f"gateway CPU {via.cpu_s / via.wall:.2f} cores (target < 1)"
    )
    own = sorted(via.own)
    print(
        f"  the gateway's own work on the first-token path (its Server-Timing header): "
        f"p50 {own[len(own) // 2]:.3f} ms, p99 {own[min(len(own) - 1, int(0.99 * len(own)))]:.3f} ms"
    )


def _bare_proxy(worker: Proc, cpus: list[int], n: int) -> None:
    """Direct against a bare aiohttp proxy to the same worker, unloaded, interleaved."""
    port = find_free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "bench.bare_proxy", str(port), worker.url], cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, set(cpus)),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    async def run() -> tuple[Phase, Phase]:
        for _ in range(100):  # until it listens
            try:
                await _run(_one_direct, url, 20, 1, Phase("warmup"))
                break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
        direct, via = Phase("direct"), Phase("bare proxy")
        for r in range(4):
            for phase, target in ((direct, worker.url), (via, url))[:: 1 if r % 2 == 0 else -1]:
                await _run(_one_direct, target, n // 4, 1, phase)
        return direct, via

    try:
        direct, via = asyncio.run(run())
    finally:
        proxy.terminate()
        proxy.wait(10)
    print(f"\nconcurrency 1, a bare aiohttp proxy (bench/bare_proxy.py), {n} requests per path")
    for p in (direct, via):
        print(f"  {p.name:10} p50 {p.pct(0.5):6.2f} ms  p99 {p.pct(0.99):6.2f} ms")
    print(f"  bare proxy added: p50 {via.pct(0.5) - direct.pct(0.5):+.2f} ms, p99 "
          f"{via.pct(0.99) - direct.pct(0.99):+.2f} ms (the hop's floor in aiohttp)")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the two paths")
    ap.add_argument("--unloaded-requests", type=int, default=300, help="at concurrency 1; 0 skips")
    ap.add_argument("--bare-proxy", action="store_true",
                    help="also time a bare aiohttp proxy's hop, unloaded")  # fmt: skip
    ap.add_argument("--model", type=Path, default=STORIES)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument(
        "--pin", action="store_true",
        help="give the gateway half the CPUs to itself (worker + load generator: the other half)",
    )  # fmt: skip
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        print(f"model not found: {args.model} (see ../shared/models/README.md)", file=sys.stderr)
        return 2
    print(
        f"bench/gateway.py {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; model "
        f"{args.model.name}, {args.requests} streamed requests x 16 tokens at concurrency "
        f"{args.concurrency}"
    )
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis:
        root = Path(tmp)
        (root / "regions.yaml").write_text(
            "regions:\n  - {name: local, latitude: 0, longitude: 0}\n"
        )
        cpus = sorted(os.sched_getaffinity(0))
        pin = args.pin and len(cpus) >= 2
        half = len(cpus) // 2
        if pin:  # children inherit the affinity of this process at spawn time
            os.sched_setaffinity(0, set(cpus[half:]))
            gateway = start_gateway("gateway", redis.url, root / "regions.yaml", root, "local")
            os.sched_setaffinity(0, set(cpus[:half]))
            print(
                f"pinned: gateway alone on CPUs {cpus[half:]} (as at a point of presence), the "
                f"worker and this load generator on CPUs {cpus[:half]} (the same for both paths)"
            )
        worker = start_worker("worker", args.model.resolve(), redis.url, root, "local",
                              ["--threads", str(args.worker_threads)])  # fmt: skip
        if not pin:
            gateway = start_gateway("gateway", redis.url, root / "regions.yaml", root, "local")
        try:
            time.sleep(1.0)  # the gateway's registry snapshot includes the worker
            direct, via = asyncio.run(
                _measure(worker, gateway, args.requests, args.concurrency, args.rounds)
            )
            _report(
                f"concurrency {args.concurrency}, {args.requests} requests per path", direct, via
            )
            if args.unloaded_requests:
                d1, g1 = asyncio.run(_measure(worker, gateway, args.unloaded_requests, 1, 2))
                _report(f"concurrency 1 (the gateway's own cost), {args.unloaded_requests} requests per path", d1, g1)  # fmt: skip
            if args.bare_proxy:
                _bare_proxy(worker, cpus[half:] if pin else cpus, args.unloaded_requests or 300)
        finally:
            gateway.stop()
            worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
