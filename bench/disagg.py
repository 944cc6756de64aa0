"""Prefill/decode disaggregation: the same 2 CPU cores split two ways, measured in one run.

The workload (issue text): a steady stream of decoding requests (short prompts, 256 output
tokens) plus bursts of 2,000-token prompts, served by
- (a) 2 `mixed` workers, and
- (b) 1 `prefill` + 1 `decode` worker (the gateway sends each request to the decode worker with
  `kv_source` set to the prefill worker; the decode worker pulls the prompt's KV over TCP),
each worker with one torch thread, pinned to its own core (`taskset -c`), the same two cores in
both setups. The gateway and this load generator are not pinned: they share those cores with the
workers. Everything runs as real processes: a throwaway redis-server, two workers, one gateway,
started afresh for each setup (so no setup finds the other's prompts in a prefix cache).

Load (the same seeded schedule in both setups; `POST /v1/completions`, streamed, greedy,
`ignore_eos`, so every request generates exactly `max_tokens`):
- steady: `--concurrency` clients, each sending its next request as soon as the last one ends;
  prompts of `--short-tokens` token ids (real text, each distinct), `--max-tokens` output tokens.
  The clients start `--ramp` seconds before the window opens; a client's first request asks for
  a share of `--max-tokens` (1/C, 2/C, ...), so the streams do not run in lockstep.
- bursts: every `--burst-every` seconds (at a seeded point of each interval) `--burst-size`
  requests at once, each a distinct `--long-tokens` prompt (a distinct first block, so prefix
  caching cannot hide it), `--long-max-tokens` output tokens. The defaults (bursts of 2 every
  20 s) fit a 2-core VM, where one 2,000-token prefill takes ~9 s of a core in 512-token chunks:
  the single prefill worker of (b) is busy ~85% of the time, so its queue stays bounded, and
  the long prompts are a real share of the work (every long prompt stalls the streams of its
  mixed worker in (a) once per chunk, ~3% of all gaps, so the p99 sees them).
- every worker, in both setups, runs chunked prefill with a 512-token step budget
  (`--max-num-batched-tokens`; 0 for the engine's default, 2048), as vLLM and SGLang serve mixed
  loads; on this CPU it is also faster for long prompts than one 2,048-token step (~9 s against
  ~15 s for 2,000 tokens: the reference prefill attention is quadratic in the chunk).

Figures, over the window of `--duration` seconds (events outside it are not counted):
- inter-token latency (ITL): the gaps between consecutive text chunks (SSE events) of the
  steady requests, as they arrive at this client, that open in the window (a gap that a long
  prefill stretches past the window's end still counts): p50, p99, and p99.9 and the longest gap,
  which show the prefill stalls when they are fewer than 1% of the gaps;
- time to first token (TTFT): request sent to its first text chunk, for steady requests sent in
  the window and for every long request (each burst's requests are waited for after the window,
  while the steady stream goes on, up to `--grace` seconds);
- tokens/s: output tokens (steady and long) whose chunks arrived in the window / its length.
Targets (issue text): p99 ITL under (b) <= 1/3 of (a), at no more than 10% lower tokens/s.

KV transfer throughput over loopback (before the setups, on an idle machine): `pull_kv` in this
process (pinned to one CPU, as the decode worker) against a `KVTransferServer` in a process of its
own (pinned to the other CPU, as the prefill worker) moves the KV of one `--long-tokens` prompt
(KVPages over caches of the model's layout, every frame checksummed) several times, twice over:
with the request's blocks consecutive on both sides (the usual case; sent from and received into
the caches in place) and scattered among other blocks (the worst case: one gather and one scatter
copy). The peer: a plain socket copy of the same frames over the same kind of non-blocking socket,
served by another process on the same CPU, sent from and received into buffers as large as the
prompt's KV (the same bytes, each frame in its own place; the kernel's copy only: no checksum, no
gather or scatter). Target: the consecutive case >= 80% of the plain copy.
`--transfer-in-process` runs every end in this process's event loop instead (the ends then take
turns on one thread).

Run from the repository root: `python -m bench.disagg [--duration 75] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.texts import ALICE_OPENING as PASSAGE  # noqa: E402  (the prompts' text)
from kvstore.redis_server import LocalRedis, find_free_port  # noqa: E402
from tests.stack import SECRET, Proc, get_json, wait_until  # noqa: E402

TARGET_ITL_P99 = 1 / 3  # (b) / (a), at most
TARGET_TPS = 0.90  # (b) / (a), at least
TARGET_TRANSFER = 0.80  # pull_kv / plain copy, at least
BLOCK = 16  # the engine's default block size (the transfer bench's layout)
SETUPS = (
    ("a", "2 mixed workers", ("mixed", "mixed")),
    ("b", "1 prefill + 1 decode", ("prefill", "decode")),
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (as bench/sessions.py), NaN for no data."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------------- processes
def _spawn(name: str, args: list[str], log_dir: Path, port: int, cpu: int | None = None) -> Proc:
    """`edgeinfer ...` as a child process (pinned to `cpu` with taskset), in its own session so
    that a Ctrl-C at the terminal reaches this process only, which then stops it in order."""
    log_path = log_dir / f"{name}.log"
    env = os.environ | {"EDGEINFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    popen = subprocess.Popen(
        [*pin, sys.executable, "-m", "runtime.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Proc(name, popen, f"http://127.0.0.1:{port}", log_path, port)


def _stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM to all at once, then wait; SIGKILL what is still there after `timeout`."""
    for p in procs:
        with contextlib.suppress(OSError):
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*")
_EXPECTED = ("no API keys configured", "stopping: draining", "redis reachable:")


def _log_problems(p: Proc, cut_at: float) -> list[str]:
    """Warnings, errors and exceptions in a process's log, counted, each marked as logged during
    the load or after `cut_at` (the epoch time this bench cut its last requests and stopped the
    processes); the messages of a normal start and stop are left out."""
    seen: Counter[str] = Counter()
    stamp = 0.0
    for line in p.log.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m:
            stamp = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
            msg = line[m.end() :]
            if not msg.startswith(("WARNING", "ERROR", "CRITICAL")):
                continue
        elif _EXCEPTION.match(line.strip()):
            msg = "  " + line.strip()
        else:
            continue
        if any(e in msg for e in _EXPECTED):
            continue
        when = "after the cut" if stamp >= cut_at - 0.5 else "during the load"
        seen[f"[{when}] {msg[:240]}"] += 1
    return [f"{n} x {msg}" for msg, n in seen.items()]


# ---------------------------------------------------------------------- the workload
@dataclass
class Workload:
    steady: list[list[int]]  # prompts of the steady stream, in the order they are sent
    long: list[list[int]]  # prompts of the bursts, in the order they are sent
    bursts: list[float]  # seconds into the window
    warmup: list[list[int]]  # prompts of the warm-up requests (none of the above)


def _tokens(model: Path) -> tuple[Any, list[int]]:
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    return tok, tok.encode(PASSAGE, add_special_tokens=False)


def make_workload(model: Path, args: argparse.Namespace) -> Workload:
    """Token-id prompts: a distinct marker ("Request 7. ") then the passage from a seeded offset,
    cut to the length. Distinct markers give every prompt its own first block."""
    tok, text = _tokens(model)
    rng = random.Random(args.seed)

    def prompt(marker: str, n: int) -> list[int]:
        head = tok.encode(marker, add_special_tokens=False)
        start = rng.randrange(len(text))
        body = list(itertools.islice(itertools.cycle(text[start:] + text[:start]), n))
        return (head + body)[:n]

    lo, hi = args.short_tokens
    steady = [prompt(f"Request {j}. ", rng.randint(lo, hi)) for j in range(4000)]
    bursts = []
    every = args.burst_every
    for k in itertools.count():
        t = every * (k + 0.25 + 0.5 * rng.random())  # somewhere in the middle of interval k
        if t > args.duration - every / 2:
            break
        bursts.append(round(t, 2))
    long = [
        prompt(f"Document {j}. ", args.long_tokens) for j in range(len(bursts) * args.burst_size)
    ]
    warmup = [prompt(f"Warm-up {j}. ", n) for j, n in enumerate((hi, hi, 4 * hi, 4 * hi))]
    return Workload(steady, long, bursts, warmup)


@dataclass
class Req:
    kind: str  # steady | long | warmup
    index: int  # prompt index within its kind
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0  # perf_counter
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    completion_tokens: int = 0  # from usage
    cached_tokens: int = 0
    worker: str = ""
    prefill_worker: str | None = None  # the x-edgeinfer-prefill-worker header
    error: str | None = None
    finished: bool = False  # [DONE] after a usage chunk, no error
    cut: bool = False  # cancelled at the end of the run

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None


async def _request(s: aiohttp.ClientSession, url: str, model: str, req: Req,
                   prompt: list[int]) -> Req:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    usage = None
    req.sent = time.perf_counter()
    try:
        async with s.post(f"{url}/v1/completions", data=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}) as r:  # fmt: skip
            if r.status != 200:
                req.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return req
            req.worker = r.headers.get("x-edgeinfer-worker", "")
            req.prefill_worker = r.headers.get("x-edgeinfer-prefill-worker")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                if line.startswith(b"data: [DONE]"):
                    req.finished = req.error is None and usage is not None
                    break
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    req.error = f"error chunk: {str(chunk['error'])[:300]}"
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    req.completion_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    req.cached_tokens = details.get("cached_tokens") or 0
                for c in chunk.get("choices") or []:
                    if c.get("text"):
                        req.chunks.append(now)
            if not req.finished and req.error is None:
                req.error = "stream ended without [DONE] and usage"
    except asyncio.CancelledError:
        req.cut = True
        raise
    except (aiohttp.ClientError, OSError, ValueError) as e:
        req.error = repr(e)[:300]
    return req


@dataclass
class Run:
    """One setup's requests and its window (perf_counter seconds)."""

    reqs: list[Req] = field(default_factory=list)
    w0: float = 0.0
    w1: float = 0.0
    tail_s: float = 0.0  # seconds after the window spent waiting for the bursts' requests
    cut: float = 0.0  # when the requests still running were cancelled
    long_unfinished: int = 0  # long requests cut at the end of the grace period


async def run_load(url: str, model: str, wl: Workload, args: argparse.Namespace) -> Run:
    run = Run()
    conc, mt = args.concurrency, args.max_tokens
    counter = itertools.count()
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.grace + 60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

        async def steady_client(k: int) -> None:
            first = True
            while not stop.is_set():
                j = next(counter)
                prompt = wl.steady[j % len(wl.steady)]
                n = max(4, round(mt * (k + 1) / conc)) if first else mt
                req = Req("steady", j, len(prompt), n)
                run.reqs.append(req)
                await _request(s, url, model, req, prompt)
                first = False
                if req.error:  # do not spin on a broken cluster
                    await asyncio.sleep(0.2)

        async def burst(b: int, at: float) -> None:
            await asyncio.sleep(max(0.0, run.w0 + at - time.perf_counter()))
            log(f"    burst {b + 1}/{len(wl.bursts)} at {at:.1f}s: {args.burst_size} x "
                f"{args.long_tokens}-token prompts")  # fmt: skip
            reqs = []
            for i in range(args.burst_size):
                j = b * args.burst_size + i
                reqs.append(Req("long", j, len(wl.long[j]), args.long_max_tokens))
            run.reqs.extend(reqs)
            await asyncio.gather(*(_request(s, url, model, r, wl.long[r.index]) for r in reqs))

        run.w0 = time.perf_counter() + args.ramp
        run.w1 = run.w0 + args.duration
        clients = [asyncio.create_task(steady_client(k)) for k in range(conc)]
        bursts = [asyncio.create_task(burst(b, t)) for b, t in enumerate(wl.bursts)]
        try:
            await asyncio.sleep(max(0.0, run.w1 - time.perf_counter()))
            pending = [t for t in bursts if not t.done()]
            if pending:  # the steady stream goes on while the bursts' requests finish
                log(f"    window closed; waiting up to {args.grace:.0f}s for "
                    f"{sum(r.kind == 'long' and not r.finished and not r.error for r in run.reqs)} "
                    "long requests")  # fmt: skip
                await asyncio.wait(pending, timeout=args.grace)
            run.tail_s = time.perf_counter() - run.w1
        finally:
            run.cut = time.perf_counter()
            stop.set()
            for t in clients + bursts:
                t.cancel()
            await asyncio.gather(*clients, *bursts, return_exceptions=True)
    run.long_unfinished = sum(r.kind == "long" and r.cut for r in run.reqs)
    return run


async def warm_up(url: str, model: str, wl: Workload) -> list[Req]:
    """A few requests, both workers' first steps and (in (b)) one KV transfer, untimed."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        reqs = [Req("warmup", i, len(p), 8) for i, p in enumerate(wl.warmup)]
        await asyncio.gather(*(_request(s, url, model, r, wl.warmup[r.index]) for r in reqs))
    return reqs


# ---------------------------------------------------------------------- one setup
@dataclass
class SetupResult:
    key: str
    title: str
    roles: tuple[str, ...]
    itl: list[float]
    ttft_steady: list[float]
    ttft_long: list[float]
    tokens_in_window: float
    duration: float
    counts: dict[str, Any]
    worker_stats: dict[str, dict[str, Any]]
    cpu_cores: dict[str, float]
    problems: dict[str, list[str]]

    @property
    def tps(self) -> float:
        return self.tokens_in_window / self.duration

    def summary(self) -> dict[str, Any]:
        ms = 1000
        return {
            "setup": f"({self.key}) {self.title}",
            "roles": list(self.roles),
            "itl_ms": {"p50": _pct(self.itl, 0.5) * ms, "p99": _pct(self.itl, 0.99) * ms,
                       "p99.9": _pct(self.itl, 0.999) * ms,
                       "max": max(self.itl, default=math.nan) * ms, "gaps": len(self.itl),
                       "gaps_over_1s": sum(g > 1.0 for g in self.itl)},
            "ttft_steady_ms": {"p50": _pct(self.ttft_steady, 0.5) * ms,
                               "p99": _pct(self.ttft_steady, 0.99) * ms,
                               "n": len(self.ttft_steady)},
            "ttft_long_ms": {"p50": _pct(self.ttft_long, 0.5) * ms,
                             "p99": _pct(self.ttft_long, 0.99) * ms,
                             "max": max(self.ttft_long, default=math.nan) * ms,
                             "n": len(self.ttft_long)},
            "output_tokens_per_s": self.tps,
            "output_tokens_in_window": self.tokens_in_window,
            "window_s": self.duration,
            "counts": self.counts,
            "worker_stats": self.worker_stats,
            "cpu_cores": self.cpu_cores,
            "log_problems": self.problems,
        }  # fmt: skip


def measure(run: Run) -> tuple[list[float], list[float], list[float], float, dict[str, Any]]:
    w0, w1 = run.w0, run.w1
    itl: list[float] = []
    ttft_s: list[float] = []
    ttft_l: list[float] = []
    tokens = 0.0
    c: Counter[str] = Counter()
    for r in run.reqs:
        c[f"{r.kind} sent"] += 1
        c[f"{r.kind} finished"] += r.finished
        c[f"{r.kind} failed"] += r.error is not None
        c[f"{r.kind} cut at the end"] += r.cut
        c[f"{r.kind} with x-edgeinfer-prefill-worker"] += r.prefill_worker is not None
        c[f"{r.kind} cached prompt tokens"] += r.cached_tokens
        c[f"{r.kind} text chunks"] += len(r.chunks) if r.finished else 0
        c[f"{r.kind} completion tokens"] += r.completion_tokens if r.finished else 0
        if r.finished and r.completion_tokens != r.max_tokens:
            c[f"{r.kind} with a short answer"] += 1
        # a chunk usually holds one token; spread the usage count over the chunks when not
        per_chunk = r.completion_tokens / len(r.chunks) if r.finished and r.chunks else 1.0
        tokens += per_chunk * sum(w0 <= t <= w1 for t in r.chunks)
        if r.kind == "steady":
            # gaps that open in the window, wherever they close: a stall that outlasts the window
            # ends while the bursts are waited for (the steady stream goes on until then)
            itl += [b - a for a, b in itertools.pairwise(r.chunks) if w0 <= a <= w1]
            if w0 <= r.sent <= w1 and r.ttft is not None:
                ttft_s.append(r.ttft)
        elif r.kind == "long" and r.ttft is not None:
            ttft_l.append(r.ttft)
    errors = Counter(r.error for r in run.reqs if r.error)
    counts: dict[str, Any] = dict(sorted(c.items()))
    counts["errors"] = dict(errors.most_common(5))
    counts["workers of steady requests"] = dict(
        Counter(r.worker for r in run.reqs if r.kind == "steady" and r.worker)
    )
    counts["workers of long requests"] = dict(
        Counter(r.worker for r in run.reqs if r.kind == "long" and r.worker)
    )
    counts["tail_s"] = round(run.tail_s, 1)
    counts["long requests (sent at s of the window, TTFT s)"] = [
        (round(r.sent - w0, 1), round(r.ttft, 1) if r.ttft is not None else None)
        for r in run.reqs
        if r.kind == "long"
    ]
    return itl, ttft_s, ttft_l, tokens, counts


def run_setup(key: str, title: str, roles: tuple[str, ...], model: Path, served: str,
              cpus: list[int], wl: Workload, args: argparse.Namespace, tmp: Path) -> SetupResult:  # fmt: skip
    log(f"\n({key}) {title}: starting redis, workers ({', '.join(roles)}) and the gateway")
    logs = tmp / key
    logs.mkdir()
    catalog = logs / "regions.yaml"
    catalog.write_text("regions:\n  - {name: local, latitude: 0, longitude: 0}\n")
    procs: list[Proc] = []
    with LocalRedis() as redis:
        try:
            workers = []
            for i, (role, cpu) in enumerate(zip(roles, cpus, strict=False)):
                port = find_free_port()
                wargs = [
                    "worker", "--model", str(model), "--served-model-name", served,
                    "--region", "local", "--role", role, "--port", str(port),
                    "--redis", redis.url, "--threads", "1",
                    "--kv-cache-bytes", str(args.kv_cache_bytes),
                    "--heartbeat", "0.5", "--ttl", "3", "--drain-timeout", "5",
                ]  # fmt: skip
                if args.max_num_batched_tokens:
                    wargs += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                w = _spawn(f"{key}-{role}-{i}", wargs, logs, port, cpu)
                procs.append(w)
                workers.append(w)
            for w in workers:  # loading in parallel, each on its own core
                wait_until(lambda w=w: get_json(f"{w.url}/internal/health", SECRET)[0] == 200,
                           180, f"worker {w.name}", w)  # fmt: skip
                w.meta["worker_id"] = get_json(f"{w.url}/internal/health", SECRET)[1]["worker_id"]
                affinity = sorted(os.sched_getaffinity(w.popen.pid))
                w.meta["cpus"] = ",".join(map(str, affinity))
            gport = find_free_port()
            gw = _spawn(f"{key}-gateway", [
                "gateway", "--region", "local", "--port", str(gport), "--redis", redis.url,
                "--regions", str(catalog), "--disagg-min-tokens", str(args.disagg_min_tokens),
            ], logs, gport)  # fmt: skip
            procs.append(gw)
            wait_until(lambda: get_json(f"{gw.url}/readyz")[1].get("workers") == len(workers),
                       30, f"the gateway to see {len(workers)} workers", gw)  # fmt: skip
            log("    " + "; ".join(f"{w.name} ({w.meta['worker_id']}) on CPU {w.meta['cpus']}"
                                   for w in workers))  # fmt: skip

            warm = asyncio.run(warm_up(gw.url, served, wl))
            bad = [r.error for r in warm if r.error]
            if bad:
                raise RuntimeError(f"warm-up requests failed: {bad}\n{gw.tail()}")
            if "prefill" in roles and not any(r.prefill_worker for r in warm):
                log("    WARNING: no warm-up request went through a prefill worker")
            log(f"    warm-up done; load: {args.ramp:.0f}s ramp, {args.duration:.0f}s window")

            pids = {w.name: w.popen.pid for w in workers} | {"gateway": gw.popen.pid}
            c0 = {n: _cpu_seconds(p) for n, p in pids.items()}
            self0 = os.times()
            t0 = time.perf_counter()
            run = asyncio.run(run_load(gw.url, served, wl, args))
            cut_at = time.time() - (time.perf_counter() - run.cut)
            wall = time.perf_counter() - t0
            self1 = os.times()
            cores = {n: (_cpu_seconds(p) - c0[n]) / wall for n, p in pids.items()}
            cores["load generator"] = (self1.user + self1.system - self0.user - self0.system) / wall
            stats = {}
            for w in workers:
                st = get_json(f"{w.url}/internal/stats", SECRET)[1]
                stats[w.name] = {k: st.get(k) for k in (
                    "role", "kv_bytes_sent", "kv_bytes_received", "kv_pulls_served",
                    "kv_pulls_failed", "kv_imports", "num_preemptions", "num_aborted",
                    "prefix_cache_hit_tokens", "total_kv_blocks",
                )}  # fmt: skip
        finally:
            _stop_all(procs)
    itl, ttft_s, ttft_l, tokens, counts = measure(run)
    problems = {p.name: _log_problems(p, cut_at) for p in procs}
    problems = {k: v for k, v in problems.items() if v}
    return SetupResult(key, title, roles, itl, ttft_s, ttft_l, tokens, args.duration, counts,
                       stats, cores, problems)  # fmt: skip


# ---------------------------------------------------------------------- KV transfer
def _layout(model: Path) -> tuple[int, int, int, str]:
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = cfg.get("torch_dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "float32"
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim, dtype


@dataclass
class TransferCase:
    """The KV of one prompt, as the transfer bench moves it: the model's layout, the request's
    blocks scattered in caches twice its size (other requests' blocks lie between), the frames
    `KVTransferServer` cuts it into."""

    layers: int
    heads: int
    dim: int
    dtype: str
    tokens: int  # prompt tokens; the prefill side sends all but the last
    seed: int
    blocks: int
    src_ids: list[int]
    dst_ids: list[int]
    token_ids: list[int]
    frames: list[int]  # DATA payload bytes of each frame

    @property
    def total(self) -> int:
        return sum(self.frames)

    def kv(self, fill: bool) -> Any:
        """A cache of this layout: the (seeded) source contents, or zeros."""
        import torch

        shape = (self.layers, 2, 2 * self.blocks * BLOCK, self.heads, self.dim)
        dtype = getattr(torch, self.dtype)
        if not fill:
            return torch.zeros(shape, dtype=dtype)
        return torch.randn(shape, generator=torch.Generator().manual_seed(self.seed)).to(dtype)


def transfer_case(model: Path, tokens: int, seed: int, scattered: bool) -> TransferCase:
    """`scattered`: the request's blocks in random order among others' on both sides (the worst
    case: one gather and one scatter copy); else consecutive (the usual case: the allocator
    hands a new request's blocks out in order), which moves without a copy."""
    from kvstore.kv_transfer import DEFAULT_FRAME_BYTES

    layers, heads, dim, dtype = _layout(model)
    n_tok = tokens - 1
    nb = -(-n_tok // BLOCK)
    rng = random.Random(seed)
    if scattered:
        src_ids, dst_ids = rng.sample(range(2 * nb), nb), rng.sample(range(2 * nb), nb)
    else:
        src_ids, dst_ids = list(range(3, 3 + nb)), list(range(nb // 2, nb // 2 + nb))
    token_ids = [rng.randrange(100, 1000) for _ in range(n_tok)]
    itemsize = 4 if dtype == "float32" else 2
    per_layer = 2 * BLOCK * heads * dim * itemsize * nb  # as KVTransferServer._send_blocks
    step = max(1, DEFAULT_FRAME_BYTES // per_layer)
    frames = [(min(layers, l0 + step) - l0) * per_layer for l0 in range(0, layers, step)]
    return TransferCase(layers, heads, dim, dtype, tokens, seed, nb, src_ids, dst_ids, token_ids,
                        frames)  # fmt: skip


async def _serve(kind: str, case: TransferCase) -> tuple[Callable[[], Awaitable[None]], int]:
    """Start the sending side on a free loopback port: `kv` (a KVTransferServer whose export
    has the whole prompt computed at once) or `plain` (the same frames from one buffer over the
    same kind of socket, nothing else: no checksum, no gather)."""
    from kvstore.kv_transfer import (
        HEADER,
        ExportProgress,
        FrameConn,
        KVPages,
        KVTransferServer,
        PullRequest,
    )

    if kind.startswith("kv"):
        pages = KVPages(case.kv(fill=True), BLOCK)

        async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
            yield ExportProgress(len(pull.token_ids), case.src_ids, True)

        async def release(request_id: str) -> None:
            return None

        kv = KVTransferServer(pages, "bench-cache", SECRET, export, release, hold_s=10)
        return kv.close, await kv.start("127.0.0.1", 0)

    # the same bytes: a source as large as the prompt's KV, each frame from its own part of it
    source = memoryview(case.kv(fill=True).numpy()).cast("B")  # type: ignore[arg-type]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def serve(conn: FrameConn) -> None:
        try:
            await conn.recv(1)
            offset = 0
            for n in case.frames:
                header = HEADER.pack(b"EIKV", 3, 0, 0, 0, 0, 0, n, 0)
                await conn.send(header, source[offset : offset + n])
                offset += n
            await conn.recv(1)  # the acknowledgement
        finally:
            conn.close()

    serving: set[asyncio.Task[None]] = set()

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(listener)
            t = asyncio.ensure_future(serve(FrameConn(sock)))
            serving.add(t)
            t.add_done_callback(serving.discard)

    task = asyncio.ensure_future(accept())

    async def close() -> None:
        task.cancel()
        listener.close()

    return close, int(listener.getsockname()[1])


async def _plain_pull(port: int, frames: list[int]) -> float:
    """The receiving side of a plain copy: a request byte, then header + payload per frame
    received into its own part of a buffer as large as the whole transfer (the kernel's copy
    only), then an acknowledgement byte."""
    from kvstore.kv_transfer import HEADER, FrameConn

    buf = memoryview(bytearray(sum(frames)))
    buf[:] = b"\0" * len(buf)  # touched, as a KV cache is
    t0 = time.perf_counter()
    conn = await FrameConn.connect("127.0.0.1", port)
    offset = 0
    try:
        await conn.send(b"P")
        for n in frames:
            h = HEADER.unpack(await conn.recv(HEADER.size))
            if h[7] != n:
                raise RuntimeError(f"plain copy: frame of {h[7]} bytes, expected {n}")
            await conn.recv_into(buf[offset : offset + n])
            offset += n
        await conn.send(b"A")
        return time.perf_counter() - t0
    finally:
        conn.close()


def transfer_server_main(kind: str, model: Path, tokens: int, seed: int) -> int:
    """The sending side in its own process (`--transfer-server kv|kv-scattered|plain`):
    prints its port, serves until stdin closes."""
    import torch

    torch.set_num_threads(1)  # as a worker started with --threads 1
    case = transfer_case(model, tokens, seed, scattered=kind == "kv-scattered")

    async def main() -> None:
        close, port = await _serve(kind, case)
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await close()

    asyncio.run(main())
    return 0


def _write(pages: Any, layers: slice, ids: list[int], payload: bytes) -> bool:
    pages.write(layers, ids, payload)
    return True


def _components(case: TransferCase) -> dict[str, float]:
    """GB/s of the pull's own work on the same bytes and frames, one thread, no sockets: the
    checksum (each side computes it once), and for scattered blocks only the sender's gather
    (`KVPages.read`) and the receiver's scatter (`KVPages.write`)."""
    import xxhash

    from kvstore.kv_transfer import KVPages

    src, dst = KVPages(case.kv(fill=True), BLOCK), KVPages(case.kv(fill=False), BLOCK)
    step = case.frames[0] // (2 * BLOCK * case.heads * case.dim * src.layout.itemsize * case.blocks)
    slices = [slice(l0, min(case.layers, l0 + step)) for l0 in range(0, case.layers, step)]
    raw = [bytes(memoryview(src.read(s, case.src_ids).numpy()).cast("B"))  # type: ignore[arg-type]
           for s in slices]  # fmt: skip

    def rate(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return 3 * case.total / (time.perf_counter() - t0) / 1e9

    return {
        "xxh3 checksum (once per side)": rate(lambda: [xxhash.xxh3_64_intdigest(b) for b in raw]),
        "scattered only: gather (KVPages.read)": rate(
            lambda: [src.read(s, case.src_ids) for s in slices]
        ),
        "scattered only: scatter (KVPages.write)": rate(
            lambda: [_write(dst, s, case.dst_ids, b) for s, b in zip(slices, raw, strict=True)]
        ),
    }


async def _pulls(cases: dict[str, TransferCase], ports: dict[str, int],
                 reps: int) -> dict[str, list[float]]:  # fmt: skip
    """`reps` rounds of a pull of each kind (consecutive, scattered blocks) and a plain copy,
    alternating, after one warm-up round; each kind's first pull is checked bit for bit."""
    import torch

    from kvstore.kv_transfer import KVPages, PullRequest, pull_kv

    dsts = {k: KVPages(c.kv(fill=False), BLOCK) for k, c in cases.items()}
    times: dict[str, list[float]] = {k: [] for k in (*cases, "plain")}
    for r in range(reps + 1):
        for kind, case in cases.items():
            dst = dsts[kind]
            pull = PullRequest(f"bench-{kind}-{r}", case.token_ids, 0, "bench-cache", SECRET)
            t0 = time.perf_counter()
            res = await pull_kv(f"127.0.0.1:{ports[kind]}", pull, dst, case.dst_ids)
            dt = time.perf_counter() - t0
            if res.bytes != case.total:
                raise RuntimeError(f"pull_kv moved {res.bytes} bytes, expected {case.total}")
            if r == 0:
                src = KVPages(case.kv(fill=True), BLOCK).blocks.index_select(2, torch.tensor(case.src_ids))  # fmt: skip
                if not torch.equal(src, dst.blocks.index_select(2, torch.tensor(case.dst_ids))):
                    raise RuntimeError(f"the pulled KV ({kind}) differs from the source")
                del src
                dst.blocks.zero_()
            else:
                times[kind].append(dt)
        dt = await _plain_pull(ports["plain"], next(iter(cases.values())).frames)
        if r:
            times["plain"].append(dt)
    return times


def _end(children: list[subprocess.Popen[bytes]]) -> None:
    """Close the transfer servers' stdin (they exit), kill any that does not."""
    for child in children:
        with contextlib.suppress(OSError, ValueError):
            assert child.stdin is not None
            child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def measure_transfer(model: Path, args: argparse.Namespace, cpus: list[int],
                     logs: Path) -> dict[str, Any]:  # fmt: skip
    """Sending side in a child process pinned to cpus[1], receiving side here on cpus[0] (as a
    decode worker pulling from a prefill worker), or both in this process's event loop."""
    import torch

    cases = {
        "kv": transfer_case(model, args.transfer_tokens, args.seed, scattered=False),
        "kv-scattered": transfer_case(model, args.transfer_tokens, args.seed, scattered=True),
    }
    case = cases["kv"]
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0)
    torch.set_num_threads(1)  # as a worker started with --threads 1
    children: list[subprocess.Popen[bytes]] = []
    try:
        if args.transfer_in_process:

            async def both() -> dict[str, list[float]]:
                servers = {k: await _serve(k, cases.get(k, case)) for k in (*cases, "plain")}
                try:
                    return await _pulls(cases, {k: p for k, (_, p) in servers.items()}, args.transfer_reps)  # fmt: skip
                finally:
                    for close, _ in servers.values():
                        await close()

            times = asyncio.run(both())
            where = "both sides in this process, one event loop"
        else:
            ports = {}
            for kind in (*cases, "plain"):
                cmd = ["taskset", "-c", str(cpus[1]), sys.executable, "-m", "bench.disagg",
                       "--transfer-server", kind, "--model", str(model), "--transfer-tokens",
                       str(args.transfer_tokens), "--seed", str(args.seed)]  # fmt: skip
                err = (logs / f"transfer-{kind}.log").open("wb")
                child = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, start_new_session=True)  # fmt: skip
                children.append(child)
                assert child.stdout is not None
                line = child.stdout.readline()
                if not line.strip().isdigit():
                    child.wait(5)
                    tail = (logs / f"transfer-{kind}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the {kind} transfer server did not start:\n{tail}")
                ports[kind] = int(line)
            os.sched_setaffinity(0, {cpus[0]})
            times = asyncio.run(_pulls(cases, ports, args.transfer_reps))
            where = f"sender: a process on CPU {cpus[1]}, receiver: this one on CPU {cpus[0]}"
        _end(children)
        os.sched_setaffinity(0, {cpus[0]})
        parts = _components(cases["kv-scattered"])
    finally:
        _end(children)
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    pull_gbs = case.total / statistics.median(times["kv"]) / 1e9
    scattered_gbs = case.total / statistics.median(times["kv-scattered"]) / 1e9
    plain_gbs = case.total / statistics.median(times["plain"]) / 1e9
    return {
        "prompt_tokens": case.tokens,
        "blocks": case.blocks,
        "bytes": case.total,
        "frames": len(case.frames),
        "frame_bytes": max(case.frames),
        "layout": {
            "layers": case.layers,
            "kv_heads": case.heads,
            "head_dim": case.dim,
            "dtype": case.dtype,
            "block_size": BLOCK,
        },
        "where": where,
        "reps": args.transfer_reps,
        "pull_kv_gbs": pull_gbs,
        "plain_copy_gbs": plain_gbs,
        "ratio": pull_gbs / plain_gbs,
        "pull_kv_scattered_gbs": scattered_gbs,
        "ratio_scattered": scattered_gbs / plain_gbs,
        "pull_kv_s": times["kv"],
        "pull_kv_scattered_s": times["kv-scattered"],
        "plain_copy_s": times["plain"],
        "components_gbs": parts,
    }


# ---------------------------------------------------------------------- report
def _ms(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 1000:.0f}ms" if x < 10 else f"{x:.1f}s"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(results: list[SetupResult], transfer: dict[str, Any] | None) -> dict[str, Any]:
    print()
    if results:
        print(f"{'setup':24} {'ITL p50':>8} {'ITL p99':>8} {'p99.9':>8} {'max':>8} "
              f"{'TTFT short p50/p99':>19} {'TTFT long p50/max':>18} {'out tok/s':>10}")  # fmt: skip
    for r in results:
        ttft_s = f"{_ms(_pct(r.ttft_steady, 0.5))} / {_ms(_pct(r.ttft_steady, 0.99))}"
        ttft_l = f"{_ms(_pct(r.ttft_long, 0.5))} / {_ms(max(r.ttft_long, default=math.nan))}"
        print(
            f"({r.key}) {r.title:20} {_ms(_pct(r.itl, 0.5)):>8} {_ms(_pct(r.itl, 0.99)):>8} "
            f"{_ms(_pct(r.itl, 0.999)):>8} {_ms(max(r.itl, default=math.nan)):>8} "
            f"{ttft_s:>19} {ttft_l:>18} {r.tps:10.1f}"
        )
    out: dict[str, Any] = {}
    if len(results) == 2:
        a, b = results

        def ratio(f) -> float:  # type: ignore[no-untyped-def]
            x, y = f(a), f(b)
            return y / x if x else math.nan

        itl50 = ratio(lambda r: _pct(r.itl, 0.5))
        itl99 = ratio(lambda r: _pct(r.itl, 0.99))
        itl999 = ratio(lambda r: _pct(r.itl, 0.999))
        itlmax = ratio(lambda r: max(r.itl, default=math.nan))
        t_s = ratio(lambda r: _pct(r.ttft_steady, 0.5))
        t_s99 = ratio(lambda r: _pct(r.ttft_steady, 0.99))
        t_l = ratio(lambda r: _pct(r.ttft_long, 0.5))
        t_lmax = ratio(lambda r: max(r.ttft_long, default=math.nan))
        tps = ratio(lambda r: r.tps)
        print(
            f"{'(b)/(a)':24} {itl50:7.2f}x {itl99:7.2f}x {itl999:7.2f}x {itlmax:7.2f}x "
            f"{f'{t_s:.2f}x / {t_s99:.2f}x':>19} {f'{t_l:.2f}x / {t_lmax:.2f}x':>18} {tps:9.2f}x"
        )
        print(
            f"\ntargets: p99 ITL (b)/(a) {itl99:.2f}x (target <= {TARGET_ITL_P99:.2f}x: "
            f"{_met(itl99 <= TARGET_ITL_P99)}); tokens/s (b)/(a) {tps:.2f}x (target >= "
            f"{TARGET_TPS:.2f}x: {_met(tps >= TARGET_TPS)})"
        )
        out = {"itl_p50": itl50, "itl_p99": itl99, "itl_p999": itl999, "itl_max": itlmax,
               "ttft_steady_p50": t_s, "ttft_steady_p99": t_s99, "ttft_long_p50": t_l,
               "ttft_long_max": t_lmax, "tokens_per_s": tps,
               "itl_p99_target_met": itl99 <= TARGET_ITL_P99,
               "tokens_per_s_target_met": tps >= TARGET_TPS}  # fmt: skip
    if transfer is not None:
        t = transfer
        print(
            f"KV transfer ({t['prompt_tokens']}-token prompt: {t['blocks']} blocks, "
            f"{t['bytes'] / 1e6:.1f} MB in {t['frames']} frames of <= {t['frame_bytes'] / 1e6:.1f} "
            f"MB; {t['where']}; median of {t['reps']}):\n"
            f"  pull_kv, blocks consecutive (the usual case) {t['pull_kv_gbs']:.2f} GB/s; plain "
            f"socket copy of the same frames {t['plain_copy_gbs']:.2f} GB/s; ratio "
            f"{t['ratio']:.2f}x (target >= {TARGET_TRANSFER:.2f}x: "
            f"{_met(t['ratio'] >= TARGET_TRANSFER)})\n"
            f"  pull_kv, blocks scattered on both sides (worst case) "
            f"{t['pull_kv_scattered_gbs']:.2f} GB/s, ratio {t['ratio_scattered']:.2f}x"
        )
        print("  the pull's own work on the same bytes, one thread: " + ", ".join(
            f"{k} {v:.2f} GB/s" for k, v in t["components_gbs"].items()))  # fmt: skip
    return out


def details(r: SetupResult) -> None:
    c = r.counts
    stalls = [g for g in r.itl if g > 1.0]
    print(f"\n({r.key}) {r.title}: {len(r.itl)} inter-token gaps ({len(stalls)} over 1 s, "
          f"{len(stalls) / max(1, len(r.itl)):.2%} of them, {sum(stalls):.0f} s in all), "
          f"{len(r.ttft_steady)} steady and {len(r.ttft_long)} long first tokens, "
          f"{r.tokens_in_window:.0f} output tokens in the {r.duration:.0f}s window; "
          f"{c['tail_s']}s after it for the bursts")  # fmt: skip
    for kind in ("steady", "long"):
        print(
            f"  {kind}: {c.get(f'{kind} sent', 0)} sent, {c.get(f'{kind} finished', 0)} finished, "
            f"{c.get(f'{kind} failed', 0)} failed, {c.get(f'{kind} cut at the end', 0)} cut at "
            f"the end; {c.get(f'{kind} with x-edgeinfer-prefill-worker', 0)} with "
            f"x-edgeinfer-prefill-worker; cached prompt tokens "
            f"{c.get(f'{kind} cached prompt tokens', 0)}; text chunks / completion tokens "
            f"{c.get(f'{kind} text chunks', 0)} / {c.get(f'{kind} completion tokens', 0)}"
            + (
                f"; {c[f'{kind} with a short answer']} answers shorter than max_tokens"
                if c.get(f"{kind} with a short answer")
                else ""
            )
        )
    print("  long requests' TTFT, by when they were sent: " + ", ".join(
        f"at {t:.1f}s: {f'{x:.1f}s' if x is not None else 'none'}"
        for t, x in c["long requests (sent at s of the window, TTFT s)"]))  # fmt: skip
    print(f"  steady requests per worker: {c['workers of steady requests']}; long: "
          f"{c['workers of long requests']}")  # fmt: skip
    if c["errors"]:
        print(f"  errors: {c['errors']}")
    for name, st in r.worker_stats.items():
        print(
            f"  {name}: KV sent {st['kv_bytes_sent'] / 1e6:.1f} MB in {st['kv_pulls_served']} "
            f"pulls ({st['kv_pulls_failed']} failed), received {st['kv_bytes_received'] / 1e6:.1f}"
            f" MB in {st['kv_imports']} imports; preemptions {st['num_preemptions']}, aborted "
            f"{st['num_aborted']}, prefix-cache hit tokens {st['prefix_cache_hit_tokens']}"
        )
    print("  CPU use over the load phase (cores): " + ", ".join(
        f"{k} {v:.2f}" for k, v in r.cpu_cores.items()))  # fmt: skip
    for name, lines in r.problems.items():
        print(f"  {name} log, warnings and errors:")
        for line in lines[:8]:
            print(f"    {line}")
        if len(lines) > 8:
            print(f"    ... {len(lines) - 8} more kinds (--keep-logs DIR keeps the logs)")


# ---------------------------------------------------------------------- main
def _commit() -> str:
    """The repository's HEAD, with "+dirty" when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def _finite(obj: Any) -> Any:
    """NaN (no data) as null, so that the JSON file is valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _resolve_model(arg: Path | None) -> Path:
    if arg is not None:
        model = arg.expanduser()
        if not (model / "config.json").is_file():
            print(f"model not found: {model} (no config.json there)", file=sys.stderr)
            raise SystemExit(2)
        return model.resolve()
    from runtime.cli import DEFAULT_CACHE
    from runtime.model_cache import DefaultModelUnavailableError, default_model_dir

    try:
        return Path(default_model_dir(DEFAULT_CACHE / "models"))
    except (DefaultModelUnavailableError, OSError) as e:
        print(
            f"the default model is unavailable: {e}\n(run `make run` or `make test` once to set "
            "up the environment, or pass --model DIR)",
            file=sys.stderr,
        )
        raise SystemExit(2) from e


def _fit(model: Path, args: argparse.Namespace) -> list[str]:
    """Shrink the prompt and output lengths to the model's context; returns what changed."""
    cfg = json.loads((model / "config.json").read_text())
    ctx = int(cfg.get("max_position_embeddings") or 2048)
    notes = []
    if args.long_tokens + args.long_max_tokens > ctx:
        was = args.long_tokens
        args.long_tokens = ctx - args.long_max_tokens
        notes.append(f"long prompts {was} -> {args.long_tokens} tokens (context {ctx})")
    hi = args.short_tokens[1]
    if hi + args.max_tokens > ctx:
        was = args.max_tokens
        args.max_tokens = ctx - hi
        notes.append(f"steady max_tokens {was} -> {args.max_tokens} (context {ctx})")
    if args.transfer_tokens is None:
        args.transfer_tokens = args.long_tokens
    return notes


def _kv_bytes_per_token(model: Path) -> int:
    layers, heads, dim, dtype = _layout(model)
    return 2 * layers * heads * dim * (4 if dtype == "float32" else 2)


def _short_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model folder (default: SmolLM2-135M-Instruct from runtime.model_cache)")  # fmt: skip
    ap.add_argument("--duration", type=float, default=75.0, help="measured window per setup, s")
    ap.add_argument("--ramp", type=float, default=5.0, help="steady stream before the window, s")
    ap.add_argument("--grace", type=float, default=60.0,
                    help="after the window, how long to wait for the bursts' requests, s")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=8, help="steady requests in flight")
    ap.add_argument("--short-tokens", type=_short_range, default=(16, 28), metavar="MIN,MAX",
                    help="steady prompt lengths, uniform (keep MAX under --disagg-min-tokens)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens, steady requests")
    ap.add_argument("--long-tokens", type=int, default=2000, help="prompt tokens, burst requests")
    ap.add_argument("--long-max-tokens", type=int, default=16, help="output tokens, bursts")
    ap.add_argument("--burst-size", type=int, default=2, help="requests per burst")
    ap.add_argument("--burst-every", type=float, default=20.0,
                    help="seconds between bursts (each at a seeded point of its interval)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disagg-min-tokens", type=int, default=32, help="the gateway's flag")
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="per worker (default: room for every steady request and two bursts, +25%%)")  # fmt: skip
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="workers' per-step token budget, both setups (default 512: chunked "
                         "prefill; 0: the engine's default, 2048)")  # fmt: skip
    ap.add_argument("--transfer-tokens", type=int, default=None,
                    help="prompt whose KV the transfer bench moves (default: --long-tokens)")  # fmt: skip
    ap.add_argument("--transfer-reps", type=int, default=8)
    ap.add_argument("--transfer-in-process", action="store_true",
                    help="both sides of the transfer bench in this process's event loop (default: "
                    "the sending side in a process of its own on the other CPU)")  # fmt: skip
    ap.add_argument(
        "--transfer-server", choices=("kv", "kv-scattered", "plain"), help=argparse.SUPPRESS
    )
    ap.add_argument("--parts", default="transfer,a,b",
                    help="comma list of transfer, a, b (a subset to run)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--keep-logs", type=Path, help="keep the processes' logs under this folder")
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"transfer", "a", "b"}:
        ap.error(f"--parts: unknown {sorted(parts - {'transfer', 'a', 'b'})}")

    model = _resolve_model(args.model)
    notes = _fit(model, args)
    if args.transfer_server:  # the sending side of the transfer bench, started by it
        return transfer_server_main(args.transfer_server, model, args.transfer_tokens, args.seed)
    per_token = _kv_bytes_per_token(model)
    if args.kv_cache_bytes is None:
        need = args.concurrency * (args.short_tokens[1] + args.max_tokens) + 2 * args.burst_size * (
            args.long_tokens + args.long_max_tokens
        )
        args.kv_cache_bytes = max(16 << 20, int(need * per_token * 1.25))
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"needs 2 CPUs (one per worker); this process may use {cpus}")
    cpus = cpus[:2]
    served = model.name
    wl = make_workload(model, args)

    # a SIGTERM or SIGHUP stops the run as Ctrl-C does, through the `finally`s below
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored

    print(
        f"bench/disagg.py {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, "
        f"{os.cpu_count()} CPUs; model {model}"
    )
    print(
        f"each worker: 1 torch thread, pinned to its own CPU ({cpus[0]} and {cpus[1]}, the same "
        f"split in both setups), KV cache {args.kv_cache_bytes / 1e6:.0f} MB "
        f"({args.kv_cache_bytes // per_token} tokens); the gateway and this load generator are not "
        f"pinned and share CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} with them"
    )
    print(
        f"load: {args.concurrency} steady streams (prompts {args.short_tokens[0]}-"
        f"{args.short_tokens[1]} tokens, {args.max_tokens} output tokens, greedy, ignore_eos) + "
        f"bursts of {args.burst_size} x {args.long_tokens}-token prompts ({args.long_max_tokens} "
        f"output tokens) at {', '.join(f'{t:.1f}s' for t in wl.bursts) or 'no time'} of a "
        f"{args.duration:.0f}s window (seed {args.seed}); gateway --disagg-min-tokens "
        f"{args.disagg_min_tokens}; workers' step budget "
        f"{args.max_num_batched_tokens or 'the engine default'} tokens"
    )
    for n in notes:
        print(f"note: {n}")
    if args.short_tokens[1] >= args.disagg_min_tokens:
        print("note: steady prompts reach --disagg-min-tokens: in (b) some go through a transfer")
    if not wl.bursts:
        print("note: no burst fits the window (raise --duration or lower --burst-every)")
    sys.stdout.flush()

    results: list[SetupResult] = []
    transfer = None
    try:
        with contextlib.ExitStack() as stack:
            if args.keep_logs:
                logs = args.keep_logs / time.strftime("%Y%m%d-%H%M%S")
                logs.mkdir(parents=True)
                log(f"process logs in {logs}")
            else:
                logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ei-disagg-")))
            if "transfer" in parts:
                log(f"KV transfer bench: the KV of a {args.transfer_tokens}-token prompt, "
                    f"{args.transfer_reps} reps")  # fmt: skip
                transfer = measure_transfer(model, args, cpus, logs)
            for key, title, roles in SETUPS:
                if key in parts:
                    results.append(run_setup(key, title, roles, model, served, cpus, wl, args,
                                             logs))  # fmt: skip
    except KeyboardInterrupt:
        log("interrupted; every process this run started is stopped")
        return 130
    for r in results:
        details(r)
    ratios = report(results, transfer)
    if args.json:
        out = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "model": str(model),
            "commit": _commit(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "bursts_s": wl.bursts,
            "setups": [r.summary() for r in results],
            "ratios_b_over_a": ratios,
            "transfer": transfer,
            "notes": notes,
        }
        args.json.write_text(json.dumps(_finite(out), indent=2, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
