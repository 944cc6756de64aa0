"""Multi-turn conversations across a cluster: session affinity and cache-aware routing against
round-robin, in one invocation.

The cluster (real processes): a throwaway redis-server, 2 regions x 2 workers, and per routing
mode one gateway per region. 32 conversations run at once, 8 turns each; every conversation
starts with the same system prompt and adds its own history (user message + the model's reply)
turn by turn, so turn t's prompt is turn t-1's prompt + reply + a new user message.
Conversations alternate between the two regions' gateways. Three modes, one after the other:

- `header`:      cache-aware gateways, every request carries `x-session-affinity`;
- `no-header`:   cache-aware gateways, no header (the prefix index alone places requests);
- `round-robin`: gateways started with `--routing round-robin` (no sessions, caches or load).

Between turns a conversation pauses for a think time (exponential, mean `--think-ms`, 1 s by
default; the same draws in every mode), as a person reading the answer does. Without it
(`--think-ms 0`) the conversations on a worker fall into lockstep: they finish together and
send their next turns in the same engine step, and time to first token measures that convoy
(one step holding every conversation's prefill) more than the prefill each request needs.
Each mode's system prompt starts with the mode's name, so no mode reuses another's cache. For
each mode the bench prints:
- hit rate: prompt tokens served from a prefix cache (`usage.prompt_tokens_details.
  cached_tokens`) / reusable prompt tokens. Reusable: for turn 1, the system prompt's full blocks
  once some earlier conversation of the mode sent it; for turn t >= 2, the full blocks of turn
  t-1's prompt (a prefix of turn t's prompt that the cluster has computed before);
- p50 / p99 time to first token of turns 2+ (until the response headers arrive: the gateway
  sends them with the first token);
- tokens/s (prompt + completion over the mode's wall time) and requests/s;
- the largest share of the mode's requests that one worker took;
- computed/turn: the mean prompt tokens of turns 2+ that a worker computed (not from a cache).

Targets (issue text): with the header, hit rate >= 95% of reusable tokens; turn 2+ p50 TTFT
>= 3x lower than round-robin; no worker takes more than 60% of requests.

Run from the repository root: `python -m bench.sessions [--model DIR] [--conversations 32]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.redis_server import LocalRedis  # noqa: E402
from runtime.tokenizer import Tokenizer  # noqa: E402
from tests.stack import Proc, chat_model, get_json, start_gateway, start_worker, wait_until  # noqa: E402

STORIES = ROOT.parent / "shared" / "models" / "stories260K"
CATALOG = (
    "regions:\n"
    "  - {name: eu, latitude: 50.11, longitude: 8.68}\n"
    "  - {name: us, latitude: 38.95, longitude: -77.45}\n"
)
SYSTEM = (
    "You are a storyteller for small children. Every story has a little girl named Lily who "
    "lives in a small house near a big park with her mom and dad. She has a friendly dog named "
    "Max and a big red ball. Lily likes to play with Max in the park, to share her toys with "
    "her friends, and to help her mom in the garden. Each story is short, uses simple words, "
    "and has a happy ending where everyone learns something kind."
)
NAMES = ["Tom", "Sue", "Ben", "Anna", "Sam", "Mia", "Tim", "Lucy"]
BLOCK = 16


@dataclass
class Mode:
    name: str
    gateways: list[Proc]
    session: bool
    ttft: list[float] = field(default_factory=list)  # seconds, turns 2+
    computed: list[int] = field(default_factory=list)  # prompt tokens not from a cache, turns 2+
    cached: int = 0  # prompt tokens served from a cache
    reusable: int = 0  # prompt tokens that could have been
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    workers: Counter[str] = field(default_factory=Counter)
    wall: float = 0.0


async def _turn(s: aiohttp.ClientSession, url: str, body: dict, session: str | None):  # type: ignore[no-untyped-def, type-arg]
    headers = {"x-session-affinity": session} if session else {}
    t0 = time.perf_counter()
    text: list[str] = []
    usage = None
    async with s.post(f"{url}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
        # the gateway answers a stream's headers when the first token exists (a token whose
        # text is empty, e.g. a special token, sends no chunk, so time the headers instead)
        ttft = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        worker = r.headers["x-edgeinfer-worker"]
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = c["delta"].get("content")
                if piece:
                    text.append(piece)
    assert usage is not None
    return ttft, "".join(text), usage, worker


async def _conversation(s: aiohttp.ClientSession, mode: Mode, i: int, turns: int,
                        system_tokens: int, reply_tokens: int, first_seen: asyncio.Event,
                        think_s: float) -> None:  # fmt: skip
    url = mode.gateways[i % len(mode.gateways)].url
    rng = random.Random(i)  # the same think times in every mode
    messages = [{"role": "system", "content": f"{mode.name}. {SYSTEM}"}]
    name = NAMES[i % len(NAMES)]
    prev_prompt = 0
    for t in range(turns):
        if t > 0 and think_s > 0:  # the user reads the answer and types the next message
            await asyncio.sleep(rng.expovariate(1 / think_s))
        messages.append(
            {"role": "user", "content": f"Conversation {i}, part {t + 1}: what did {name} do next?"}
        )
        body = {"model": "stories", "messages": messages, "max_tokens": reply_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if t == 0 and i > 0:
            await first_seen.wait()  # the shared system prompt is reusable once it was computed
        ttft, reply, usage, worker = await _turn(s, url, body, f"{mode.name}-{i}" if mode.session else None)  # fmt: skip
        if t == 0 and i == 0:
            first_seen.set()
        n_prompt = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if t == 0:
            reusable = 0 if i == 0 else system_tokens // BLOCK * BLOCK
        else:
            reusable = min(prev_prompt // BLOCK * BLOCK, (n_prompt - 1) // BLOCK * BLOCK)
            mode.ttft.append(ttft)
            mode.computed.append(n_prompt - cached)
        mode.cached += min(cached, reusable) if reusable else 0
        mode.reusable += reusable
        mode.prompt_tokens += n_prompt
        mode.completion_tokens += usage["completion_tokens"]
        mode.requests += 1
        mode.workers[worker] += 1
        prev_prompt = n_prompt
        messages.append({"role": "assistant", "content": reply})


async def _run_mode(mode: Mode, conversations: int, turns: int, system_tokens: int,
                    reply_tokens: int, think_s: float = 0.0) -> None:  # fmt: skip
    first_seen = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _conversation(s, mode, i, turns, system_tokens, reply_tokens, first_seen, think_s)
            for i in range(conversations)
        ))  # fmt: skip
        mode.wall = time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=STORIES)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--think-ms", type=float, default=1000.0,
                    help="mean pause between a reply and the next turn (exponential); 0: none")  # fmt: skip
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="per worker")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every worker, e.g. --worker-arg=--weight-dtype "
                         "--worker-arg=bfloat16 (repeatable)")  # fmt: skip
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        print(f"model not found: {args.model} (see ../shared/models/README.md)", file=sys.stderr)
        return 2
    print(
        f"bench/sessions.py {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, "
        f"{os.cpu_count()} CPUs; model {args.model.name}; 2 regions x 2 workers; "
        f"{args.conversations} conversations x {args.turns} turns, replies of "
        f"{args.reply_tokens} tokens, think time {args.think_ms:.0f} ms (mean)"
    )
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis:
        root = Path(tmp)
        model = chat_model(args.model.resolve(), root / "model")
        (root / "regions.yaml").write_text(CATALOG)
        tok = Tokenizer.from_dir(model)
        rendered = tok.apply_chat_template([{"role": "system", "content": f"header. {SYSTEM}"}])
        system_tokens = len(tok.encode(rendered, add_special_tokens=False))
        flags = [
            "--threads",
            str(args.worker_threads),
            "--kv-cache-bytes",
            str(args.kv_cache_bytes),
            *args.worker_arg,
        ]
        procs: list[Proc] = []
        try:
            for region in ("eu", "us"):
                for k in (1, 2):
                    procs.append(
                        start_worker(f"{region}{k}", model, redis.url, root, region, flags)
                    )
            aware = [start_gateway(f"gw-{r}", redis.url, root / "regions.yaml", root, r) for r in ("eu", "us")]  # fmt: skip
            rr = [start_gateway(f"rr-{r}", redis.url, root / "regions.yaml", root, r,
                                ["--routing", "round-robin"]) for r in ("eu", "us")]  # fmt: skip
            procs += aware + rr
            for gw in aware + rr:
                wait_until(
                    lambda gw=gw: get_json(f"{gw.url}/readyz")[1]["workers"] == 4, 30, "4 workers"
                )  # type: ignore[misc]
            modes = [Mode("header", aware, True), Mode("no-header", aware, False),
                     Mode("round-robin", rr, False)]  # fmt: skip
            # warm-up: every gateway and worker serves a little before anything is timed
            for warm in (Mode("warm-up", aware, True), Mode("warm-up-rr", rr, False)):
                asyncio.run(_run_mode(warm, 8, 2, system_tokens, 4))
            for mode in modes:
                print(f"  running {mode.name} ...", file=sys.stderr, flush=True)
                asyncio.run(_run_mode(mode, args.conversations, args.turns, system_tokens,
                                      args.reply_tokens, args.think_ms / 1000))  # fmt: skip
        finally:
            for p in procs:
                p.stop()
    rr_p50 = _pct(modes[2].ttft, 0.5)
    print(f"\n{'mode':12} {'hit rate':>9} {'p50 TTFT':>9} {'p99 TTFT':>9} {'tok/s':>8} {'req/s':>6} "
          f"{'max worker share':>17} {'p50 vs round-robin':>19} {'computed/turn':>14}")  # fmt: skip
    for m in modes:
        share = max(m.workers.values()) / m.requests
        p50 = _pct(m.ttft, 0.5)
        print(
            f"{m.name:12} {m.cached / max(1, m.reusable):8.1%} {p50:7.1f}ms {_pct(m.ttft, 0.99):7.1f}ms "
            f"{(m.prompt_tokens + m.completion_tokens) / m.wall:8.0f} {m.requests / m.wall:6.1f} "
            f"{share:16.0%} {rr_p50 / p50:18.2f}x {sum(m.computed) / max(1, len(m.computed)):14.1f}"
        )
    h = modes[0]
    print(
        f"\ntargets: header hit rate {h.cached / max(1, h.reusable):.1%} (>= 95%); turn 2+ p50 "
        f"TTFT {rr_p50 / _pct(h.ttft, 0.5):.2f}x lower than round-robin (>= 3x); largest worker "
        f"share {max(max(m.workers.values()) / m.requests for m in modes[:2]):.0%} (<= 60%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
