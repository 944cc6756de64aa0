"""The service end to end: real redis-server, real worker processes on stories260K, a real gateway
process, the real `openai` client.

One cluster per module (starting processes is the slow part). Regions of the test catalog:
eu (the gateway's own, two workers), us and ap (one worker each; us is nearer to eu).
Tests that break the cluster (kill a worker, drain one, stop Redis) run last, in file order.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from redis.asyncio import Redis

from gateway.config import GatewayConfig
from kvstore.client import connect
from kvstore.placement import Placement, SessionStore
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from kvstore.registry import Registry
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.stack import (
    SECRET,
    Proc,
    chat_model,
    get_json,
    start_gateway,
    start_worker,
    wait_until,
    worker_stats,
)

API_KEY = "test-key"
CATALOG = """
regions:
  - {name: eu, latitude: 50.11, longitude: 8.68, settings: {models: [stories, ghost-model]}}
  - {name: us, latitude: 38.95, longitude: -77.45, settings: {}}
  - {name: ap, latitude: 1.35, longitude: 103.82, settings: {}}
"""
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


class Cluster:
    def __init__(self, root: Path, stories: Path) -> None:
        self.root = root
        self.model = chat_model(stories, root / "stories-chat")
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        self.workers: dict[str, Proc] = {}
        for name, region in (("eu1", "eu"), ("eu2", "eu"), ("us1", "us"), ("ap1", "ap")):
            self.workers[name] = start_worker(name, self.model, self.redis.url, root, region)
        self.gateway = start_gateway(
            "gw",
            self.redis.url,
            root / "regions.yaml",
            root,
            "eu",
            [
                "--api-key",
                API_KEY,
                "--max-body-bytes",
                "65536",
                "--body-timeout",
                "1",
                "--worker-idle-timeout",
                "3",
            ],
        )
        wait_until(
            lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 4, 30, "4 workers"
        )
        self.client = openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )

    def by_id(self, worker_id: str) -> Proc:
        return next(w for w in self.workers.values() if w.meta["worker_id"] == worker_id)

    def close(self) -> None:
        self.gateway.stop()
        for w in self.workers.values():
            w.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path_factory.mktemp("cluster"), stories_dir)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> LLM:
    """The engine itself, in this process, on the same weights: what the service must answer."""
    return LLM(cluster.model, kv_cache_bytes=4_000_000)


def _indexed(cluster: Cluster, worker_id: str) -> bool:
    """Whether the gateway can see, in Redis, the tokenizer and a cached block of `worker_id`."""
    import redis

    r = redis.Redis.from_url(cluster.redis.url)
    try:
        if not r.keys("ei:tok:{stories}:*"):
            return False
        return any(
            worker_id.encode() in r.smembers(k)  # type: ignore[operator]
            for k in r.scan_iter("ei:p:{stories}:*")
            if b":w:" not in k
        )
    finally:
        r.close()


def _post(cluster: Cluster, path: str, body: object, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else orjson.dumps(body)
    req = urllib.request.Request(
        f"{cluster.gateway.url}{path}",
        data=data,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        | (headers or {}),
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), orjson.loads(e.read())


def _get(cluster: Cluster, path: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{cluster.gateway.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


# ---------------------------------------------------------------------- the API works
def test_health_ready_models_openapi(cluster: Cluster) -> None:
    gw = cluster.gateway.url
    assert get_json(f"{gw}/healthz") == (200, {"status": "ok"})
    status, ready = get_json(f"{gw}/readyz")
    assert status == 200 and ready["redis"] and ready["workers"] == 4
    assert [m.id for m in cluster.client.models.list().data] == ["stories"]
    assert cluster.client.models.retrieve("stories").id == "stories"
    with pytest.raises(openai.NotFoundError) as e:
        cluster.client.models.retrieve("org/nope")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    status, spec = get_json(f"{gw}/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}])
def test_chat_matches_engine(cluster: Cluster, reference: LLM, sampling: dict) -> None:  # type: ignore[type-arg]
    want = reference.chat(MESSAGES, SamplingParams(max_tokens=24, **sampling))[0]
    raw = cluster.client.chat.completions.with_raw_response.create(
        model="stories", messages=MESSAGES, max_tokens=24, **sampling
    )
    resp = raw.parse()
    assert resp.choices[0].message.content == want.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == want.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert raw.headers["x-edgeinfer-region"] == "eu"
    assert raw.headers["x-edgeinfer-worker"] in {
        cluster.workers[n].meta["worker_id"] for n in ("eu1", "eu2")
    }
    # the worker publishes its cache events every 50 ms (and its tokenizer on a heartbeat)
    wait_until(lambda: _indexed(cluster, raw.headers["x-edgeinfer-worker"]), 10, "prefix index")

    stream = cluster.client.chat.completions.create(
        model="stories",
        messages=MESSAGES,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        **sampling,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [want.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    # the same prompt again: cache-aware routing finds the worker that cached its blocks
    n_prompt = len(want.prompt_token_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16


def test_completion_matches_engine(cluster: Cluster, reference: LLM) -> None:
    prompt = "Once upon a time"
    want = reference.generate([prompt], SamplingParams(max_tokens=20, temperature=0, logprobs=2))[0]
    resp = cluster.client.completions.create(
        model="stories", prompt=prompt, max_tokens=20, temperature=0, logprobs=2
    )
    choice = resp.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 20
    want_lp = [lp.logprob for lp in want.outputs[0].logprobs or []]
    assert choice.logprobs.token_logprobs == pytest.approx(want_lp, abs=1e-4)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)

    chunks = list(
        cluster.client.completions.create(
            model="stories", prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    # token ids as the prompt
    ids = reference.tokenizer.encode(prompt)
    resp = cluster.client.completions.create(
        model="stories", prompt=ids, max_tokens=20, temperature=0
    )
    assert resp.choices[0].text == want.outputs[0].text


def test_logprobs_add_up_to_the_text_when_a_stop_string_cuts_it(
    cluster: Cluster, reference: LLM
) -> None:
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=1, stop=[" was"])
    want = reference.generate([prompt], params)[0].outputs[0]
    assert want.text == ", there" and want.num_shown_tokens == 2 < len(want.token_ids)
    want_lp = [lp.logprob for lp in (want.logprobs or [])[:2]]
    kwargs = {"model": "stories", "prompt": prompt, "max_tokens": 20, "temperature": 0,
              "logprobs": 1, "stop": [" was"]}  # fmt: skip
    lp = cluster.client.completions.create(**kwargs).choices[0].logprobs  # type: ignore[call-overload]
    assert lp is not None and lp.tokens == [",", " there"]  # not " was", cut from the text
    assert lp.token_logprobs == pytest.approx(want_lp, abs=1e-4)
    assert lp.text_offset == [0, 1]
    chunks = list(cluster.client.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens or []]  # fmt: skip
    assert streamed == [",", " there"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ", there"


def test_n_completions_and_stop(cluster: Cluster, reference: LLM) -> None:
    params = SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=5, stop=["."])
    want = reference.generate(["Once upon a time"], params)[0]
    resp = cluster.client.completions.create(
        model="stories", prompt="Once upon a time", n=2, max_tokens=16, temperature=0.8, seed=5,
        stop=["."],
    )  # fmt: skip
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [
        o.text for o in want.outputs
    ]


def test_completion_batch_of_prompts(cluster: Cluster, reference: LLM) -> None:
    """A prompt array (LangChain's OpenAI LLM sends batches): each prompt goes to a worker on its
    own, prompt p's completions are choices p * n + j, usage is the sum; streamed, the prompts'
    chunks interleave in one stream with one [DONE]; a client that hangs up stops them all."""
    texts = ["Once upon a time", "The little dog", "Lily saw a big"]
    prompts: list[Any] = [*texts, reference.tokenizer.encode("A cat sat")]
    want = reference.generate([*texts, "A cat sat"], SamplingParams(max_tokens=12, temperature=0))
    kwargs: dict[str, Any] = {"model": "stories", "prompt": prompts, "max_tokens": 12, "n": 2,
                              "temperature": 0}  # fmt: skip
    raw = cluster.client.completions.with_raw_response.create(**kwargs)
    resp = raw.parse()
    assert [(c.index, c.text) for c in resp.choices] == [
        (p * 2 + j, w.outputs[0].text) for p, w in enumerate(want) for j in range(2)
    ]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert resp.usage.completion_tokens == 2 * sum(len(w.outputs[0].token_ids) for w in want)
    eu = {cluster.workers[n].meta["worker_id"] for n in ("eu1", "eu2")}
    assert set(raw.headers["x-edgeinfer-worker"].split(", ")) <= eu
    assert resp.id == f"cmpl-{raw.headers['x-request-id']}"

    stream = cluster.client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    streamed: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in resp.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == resp.usage

    async def hang_up() -> list[bytes]:
        async with aiohttp.ClientSession() as s:
            body = {**kwargs, "stream": True, "max_tokens": 12}
            async with s.post(f"{cluster.gateway.url}/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as resp:  # fmt: skip
                lines = await _sse_lines(resp)
            long = {**body, "max_tokens": 480, "ignore_eos": True}
            resp = await s.post(f"{cluster.gateway.url}/v1/completions", json=long,
                                headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
            assert resp.status == 200
            await resp.content.readline()  # the first token arrived
            resp.close()  # hang up mid-stream
            return lines

    before = sum(worker_stats(w)["num_aborted"] for w in cluster.workers.values())
    lines = asyncio.run(hang_up())
    assert lines.count(b"data: [DONE]") == 1 and lines[-1] == b"data: [DONE]"

    def aborted() -> bool:
        stats = [worker_stats(w) for w in cluster.workers.values()]
        return sum(s["num_aborted"] for s in stats) == before + len(prompts) and all(
            s["open_requests"] == 0 and s["free_kv_blocks"] == s["total_kv_blocks"] for s in stats
        )

    wait_until(aborted, 10, "every prompt's worker to abort it and free its blocks")
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.completions.create(model="stories", prompt=["Hi"] * 65, max_tokens=1)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    assert "at most 64" in e.value.body["message"]  # type: ignore[index]


def test_assistant_refusal_parts_are_read_as_text(cluster: Cluster) -> None:
    """An earlier refusal sent back as content parts, as the openai client returns it: the
    prompt is the one its text makes."""
    refusal = "I can't help with that."

    def answer(content: Any) -> str | None:
        messages: list[Any] = [*MESSAGES, {"role": "assistant", "content": content},
                               {"role": "user", "content": "Then tell me about a dog."}]  # fmt: skip
        resp = cluster.client.chat.completions.create(
            model="stories", messages=messages, max_tokens=8, temperature=0
        )
        return resp.choices[0].message.content

    assert answer([{"type": "refusal", "refusal": refusal}]) == answer(refusal)


def test_a_request_over_the_context_is_a_context_length_error(cluster: Cluster) -> None:
    """As OpenAI answers it, so that clients that trim a conversation and retry recognise it:
    code context_length_exceeded, param messages (chat) or prompt (completions)."""
    long = "Once upon a time " * 200  # over stories260K's 512 positions
    with pytest.raises(openai.BadRequestError) as chat:
        cluster.client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": long}], max_tokens=4
        )
    with pytest.raises(openai.BadRequestError) as completion:
        cluster.client.completions.create(model="stories", prompt=long, max_tokens=4)
    for e, param, where in ((chat, "messages", "in the messages"), (completion, "prompt", "in the prompt")):  # fmt: skip
        assert e.value.code == "context_length_exceeded" and e.value.param == param
        assert "maximum context length is 512 tokens" in e.value.message and where in e.value.message
        assert f" - {param}: " in e.value.message, e.value.message  # (the client's "Error code")
    assert "prompt" not in chat.value.message, chat.value.message
    # a completion longer than the context: named as the client named it
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            cluster.client.chat.completions.create(
                model="stories", messages=[{"role": "user", "content": "Hi"}], **{field: 600}
            )
        assert e.value.code == "context_length_exceeded" and e.value.param == field
        other = "max_completion_tokens" if field == "max_tokens" else "max_tokens"
        assert field in e.value.message and other not in e.value.message, e.value.message
    # min_tokens past the context, max_tokens not given: refused, not cut at the context
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": "Hi"}],
            extra_body={"min_tokens": 600},
        )  # fmt: skip
    assert e.value.code == "context_length_exceeded" and e.value.param == "min_tokens"
    assert "must be at most" in e.value.message, e.value.message


def test_a_constraint_that_fails_mid_request_is_a_400_not_retried(cluster: Cluster) -> None:
    """A grammar that fails while generating (llguidance's lexer limit, reached by this greedy
    output) fails the same on any worker: a 400 saying why, at once (not a "stop" with JSON the
    schema does not accept, nor a 503 after trying every worker)."""
    schema = {"type": "object", "required": ["n", "a"], "properties": {"n": {"type": "integer"},
              "a": {"type": "string", "pattern": "^(.{0,50}){0,50}$"}}}  # fmt: skip
    prompt = [318, 419, 285, 467, 270, 417, 13, 412, 419, 419, 293, 413, 303, 413, 467]
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.completions.create(model="stories", prompt=prompt, max_tokens=60,
                                          temperature=0, extra_body={"guided_json": schema})  # fmt: skip
    assert e.value.code == "constraint_failed", e.value
    assert "too many expressions" in e.value.message
    assert e.value.param == "guided_json"  # the client's field (it named none)


# ---------------------------------------------------------------------- routing
def test_session_affinity_sticks_and_sessions_spread(cluster: Cluster) -> None:
    seen = set()
    for _ in range(20):
        raw = cluster.client.completions.with_raw_response.create(
            model="stories",
            prompt="Once upon a time",
            max_tokens=2,
            extra_headers={"x-session-affinity": "alpha"},
        )
        assert raw.headers["x-edgeinfer-region"] == "eu"
        seen.add(raw.headers["x-edgeinfer-worker"])
    assert len(seen) == 1, seen

    # New sessions spread over the region's workers by load, as the registry last showed it:
    # start from both idle, as a heartbeat (0.3 s) and the gateway's refresh (0.5 s) show them
    # (a load left from the tests before, still in the snapshot, sent all eight to the other)
    eu_workers = [cluster.workers[n] for n in ("eu1", "eu2")]
    wait_until(lambda: all(worker_stats(w)["running"] == worker_stats(w)["waiting"] == 0
                           for w in eu_workers), 30, "the eu workers idle")  # fmt: skip
    time.sleep(1.0)
    owners = set()
    for i in range(8):
        raw = cluster.client.completions.with_raw_response.create(
            model="stories",
            prompt="Once upon a time",
            max_tokens=2,
            extra_headers={"x-session-affinity": f"spread-{i}"},
        )
        owners.add(raw.headers["x-edgeinfer-worker"])
    eu = {w.meta["worker_id"] for w in eu_workers}
    assert owners == eu, (owners, [worker_stats(w) for w in eu_workers], cluster.gateway.tail(30))


def _connections_to(port: int) -> set[int]:
    """The local ports of this host's open TCP connections to `port`, from /proc/net/tcp."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, remote, state = line.split()[1:4]
                if int(remote.rsplit(":", 1)[1], 16) == port and state == "01":  # ESTABLISHED
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_gateway_reuses_its_connections_to_a_worker(cluster: Cluster) -> None:
    # A finished stream left unread to its end (the chunked body's last bytes come after the
    # `done` event) made aiohttp drop the connection (reset: the bytes were unread), so every
    # request paid a new connection to its worker
    def ask(stream: bool) -> Proc:
        raw = cluster.client.completions.with_raw_response.create(
            model="stories", prompt="Once upon a time", max_tokens=3, stream=stream,
            extra_headers={"x-session-affinity": "connection-reuse"},
        )  # fmt: skip
        if stream:
            assert len(list(raw.parse())) >= 3
        return cluster.by_id(raw.headers["x-edgeinfer-worker"])

    worker = ask(False)
    kept = _connections_to(worker.port)
    assert kept, "no connection to the worker was kept after a request"
    for i in range(8):
        assert ask(i % 2 == 0) is worker
        # (the gateway releases its connection before the client has the answer's end; one
        # kept from earlier may have timed out meanwhile, but none is new)
        now = _connections_to(worker.port)
        assert now and now <= kept, f"request {i} did not reuse a connection: {kept} -> {now}"


def test_requests_held_for_a_pool_share_one_status_read(tmp_path: Path) -> None:
    # Each held request read the pool's start status from Redis every 50 ms on its own: a
    # burst held for a starting worker made Redis reads in proportion to its size (~900 a
    # second for 50 requests). Now one read a poll serves every request held for the model.
    import redis as sync_redis

    from kvstore.demand import Demand, PoolInfo

    held, hold_s = 24, 2.0
    (tmp_path / "regions.yaml").write_text("regions:\n  - {name: local, latitude: 0, longitude: 0}\n")
    with LocalRedis() as server:

        async def announce() -> None:  # a pool that offers the model but never starts it
            client = connect(server.url)
            info = PoolInfo("pool-local-t", "local", ["ghost"], 2, 0, time.time())
            await Demand(client).announce(info, 60)
            await client.aclose()

        asyncio.run(announce())
        gw = start_gateway("gw-hold", server.url, tmp_path / "regions.yaml", tmp_path,
                           extra=["--hold-timeout", str(hold_s)])  # fmt: skip
        try:
            stats = sync_redis.Redis.from_url(server.url)
            time.sleep(1.0)  # (the gateway's snapshot lists the pool)

            async def burst() -> list[int]:
                async with aiohttp.ClientSession() as http:

                    async def one() -> int:
                        body = {"model": "ghost", "prompt": "hi", "max_tokens": 2}
                        async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                            return resp.status

                    return await asyncio.gather(*(one() for _ in range(held)))

            stats.config_resetstat()
            assert set(asyncio.run(burst())) == {503}  # (no worker came: Retry-After)
            calls = sum(v["calls"] for v in stats.info("commandstats").values())  # type: ignore[union-attr]
            # shared: ~hold_s / 50 ms status reads (a script: EVAL, GET, TIME), ~8 commands a
            # request to hold and release it (the hold's script counts its own: TIME, ZADD,
            # ZRANGE, PEXPIRE), the snapshot's refreshes; one read each: held x 120 more
            assert calls < 10 * held + 3 * hold_s / 0.05 + 200, calls
        finally:
            gw.stop()


def test_a_request_whose_tools_take_long_to_validate_does_not_stall_the_gateway(
    tmp_path: Path,
) -> None:
    # Validating a request compiles its tools' schemas (llguidance): 90 tools of 200 patterned
    # properties took ~1 s on the event loop, and every other request and stream of the gateway
    # waited. It now runs on a thread: the gateway answers others meanwhile.
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{1,50}"} for i in range(200)}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": props}}} for i in range(90)]  # fmt: skip
    body = {"model": "stories", "messages": MESSAGES, "tools": tools}
    (tmp_path / "regions.yaml").write_text("regions:\n  - {name: local, latitude: 0, longitude: 0}\n")
    with LocalRedis() as server:
        gw = start_gateway("gw-slow-parse", server.url, tmp_path / "regions.yaml", tmp_path)
        try:

            async def main() -> tuple[int, int]:
                async with aiohttp.ClientSession() as http:
                    heavy = asyncio.ensure_future(http.post(f"{gw.url}/v1/chat/completions",
                                                            json=body))  # fmt: skip
                    await asyncio.sleep(0.05)  # (the heavy one is being read and validated)
                    answered = 0
                    while not heavy.done() and answered < 50:
                        async with http.get(f"{gw.url}/healthz") as r:
                            assert r.status == 200
                        answered += 1
                    resp = await heavy
                    status = resp.status
                    resp.release()
                    return answered, status

            answered, status = asyncio.run(main())
            assert status in (404, 503), status  # (validated: no worker serves the model)
            assert answered >= 3, f"{answered} health checks answered while it was validated"
        finally:
            gw.stop()


# ---------------------------------------------------------------------- bad input
BAD = [
    # (path, body, status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, None),  # (param null, as OpenAI's model_not_found)
    ("/v1/chat/completions", {"model": "stories"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "stories", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": 7, "messages": MESSAGES}, 400, "model"),
    ("/v1/chat/completions", {"model": "stories", "messages": MESSAGES, "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "stories", "messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "stories", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "stories", "messages": MESSAGES, "n": "2"}, 400, "n"),
    ("/v1/completions", {"model": "stories", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "stories", "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "stories", "prompt": "hi " * 2000}, 400, "prompt"),
    ("/v1/completions", {"model": "stories", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", [1, 2], 400, None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_openai_error(cluster: Cluster, path: str, body: object, status: int, param: str | None) -> None:  # fmt: skip
    got, _, err = _post(cluster, path, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["message"]
    if param is not None:
        assert err["error"]["param"] == param, err


def test_every_answer_names_its_request(cluster: Cluster) -> None:
    """x-request-id on every response, errors included (the openai client's
    `APIStatusError.request_id`), one per request; an error from a worker says which."""
    client = cluster.client
    raw = client.completions.with_raw_response.create(model="stories", prompt="Once", max_tokens=2)
    ids: list[str | None] = [raw.headers["x-request-id"]]
    assert raw.parse().id == f"cmpl-{ids[-1]}"  # the id the worker, logs and spans know
    bad_key = openai.OpenAI(base_url=f"{cluster.gateway.url}/v1", api_key="nope", max_retries=0)
    failing: list[tuple[Callable[[], object], type[openai.APIStatusError]]] = [
        (lambda: bad_key.models.list(), openai.AuthenticationError),
        (lambda: client.models.retrieve("nope"), openai.NotFoundError),
        (lambda: client.completions.create(model="nope", prompt="Hi"), openai.NotFoundError),
        (lambda: client.completions.create(model="", prompt="Hi"), openai.BadRequestError),
    ]
    for call, error in failing:
        with pytest.raises(error) as e:
            call()
        assert e.value.request_id is not None and len(e.value.request_id) == 32, e.value
        assert "x-edgeinfer-worker" not in e.value.response.headers  # no worker was chosen
        ids.append(e.value.request_id)
    # the worker refuses it (a token id outside the vocabulary): its error, and where it went
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.completions.create(model="stories", prompt=[1, 2, 99999], max_tokens=2)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    headers = e.value.response.headers
    assert headers["x-edgeinfer-worker"] in {cluster.workers[n].meta["worker_id"]
                                             for n in ("eu1", "eu2")}  # fmt: skip
    assert headers["x-edgeinfer-region"] == "eu"
    ids.append(e.value.request_id)
    # the client's own id (vLLM echoes one): the gateway's begins with it, and a suffix keeps
    # two clients' equal ids apart; one that is no such id is not used
    for _ in range(2):
        raw = client.completions.with_raw_response.create(
            model="stories", prompt="Once", max_tokens=2, extra_headers={"x-request-id": "trace:4.2_a-b"}
        )  # fmt: skip
        ids.append(raw.headers["x-request-id"])
        assert re.fullmatch(r"trace:4\.2_a-b-[0-9a-f]{12}", ids[-1]) and raw.parse().id == f"cmpl-{ids[-1]}"
    for bad in ("has space", "x" * 65, "a{b}"):
        raw = client.completions.with_raw_response.create(
            model="stories", prompt="Once", max_tokens=2, extra_headers={"x-request-id": bad}
        )  # fmt: skip
        assert re.fullmatch(r"[0-9a-f]{32}", raw.headers["x-request-id"]), bad
    assert all(ids) and len(set(ids)) == len(ids)


def _raw(
    cluster: Cluster,
    head: bytes,
    body: bytes = b"",
    wait_s: float = 10.0,
    key: bytes = API_KEY.encode(),
) -> tuple[int, dict]:  # type: ignore[type-arg]
    """Send `head` (request line and headers, without the blank line), `key` as the bearer
    token, and `body` as they are on a socket; the response's status and JSON body."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(cluster.gateway.url)
    with socket.create_connection((url.hostname, url.port), timeout=wait_s) as sock:
        sock.sendall(head + b"\r\nAuthorization: Bearer " + key + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            next((h.split(b":")[1] for h in data.split(b"\r\n") if h.lower().startswith(b"content-length:")), b"0")
        ):  # fmt: skip
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    status = int(data.split(b" ", 2)[1])
    return status, orjson.loads(data.split(b"\r\n\r\n", 1)[1])


def test_malformed_requests_get_openai_errors(cluster: Cluster) -> None:
    """What no client library sends: a header that is not UTF-8, a body that does not decode
    or comes in an encoding the gateway does not read, a body larger than declared limits, a
    body that never comes. Each a 4xx OpenAI error, at once (or after --body-timeout), never a
    500 or a connection held open."""
    import gzip
    import zlib

    body = orjson.dumps({"model": "stories", "prompt": "Hi", "max_tokens": 1})
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
    status, err = _raw(cluster, post + b"\r\nx-session-affinity: s\xe9ssion\r\nContent-Length: "
                       + str(len(body)).encode(), body)  # fmt: skip
    assert status == 400 and err["error"]["param"] == "x-session-affinity", err
    for encoding in (b"gzip", b"deflate"):
        status, err = _raw(cluster, post + b"\r\nContent-Encoding: " + encoding
                           + f"\r\nContent-Length: {len(body)}".encode(), body)  # fmt: skip
        assert status == 400 and err["error"]["code"] == "invalid_body", err
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    for encoding, packed in ((b"gzip", gzip.compress(body)), (b"deflate", zlib.compress(body)),
                             (b"deflate", raw_deflate.compress(body) + raw_deflate.flush())):  # fmt: skip
        status, err = _raw(cluster, post + b"\r\nContent-Encoding: " + encoding
                           + f"\r\nContent-Length: {len(packed)}".encode(), packed)  # fmt: skip
        assert status == 200, (encoding, err)  # a valid one is read
    for encoding in (b"br", b"zstd", b"foo"):  # (aiohttp: a text 400 "install Brotli"; ignored)
        status, err = _raw(cluster, post + b"\r\nContent-Encoding: " + encoding
                           + f"\r\nContent-Length: {len(body)}".encode(), body)  # fmt: skip
        assert status == 415 and err["error"]["code"] == "unsupported_encoding", err
        assert err["error"]["param"] == "Content-Encoding", err
    bomb = gzip.compress(b" " * (1 << 22))  # 4 MiB inflated from 4 KB: over the 64 KiB limit
    status, err = _raw(cluster, post + f"\r\nContent-Encoding: gzip\r\nContent-Length: {len(bomb)}"
                       .encode(), bomb)  # fmt: skip
    assert status == 413 and err["error"]["code"] == "request_too_large", err
    # a bearer token that is not UTF-8: refused like any wrong one
    status, err = _raw(cluster, post + f"\r\nContent-Length: {len(body)}".encode(), body,
                       key=b"k\xff1")  # fmt: skip
    assert status == 401 and err["error"]["code"] == "invalid_api_key", err
    t0 = time.monotonic()
    status, err = _raw(cluster, post + b"\r\nContent-Length: 99999999999")  # declared: at once
    assert status == 413 and err["error"]["code"] == "request_too_large", err
    status, err = _raw(cluster, post + b"\r\nContent-Length: 1000", body)  # 1000 promised
    assert status == 408 and err["error"]["code"] == "request_timeout", err
    assert time.monotonic() - t0 < 8
    # what aiohttp refuses before the app sees it: an OpenAI error all the same (more of them
    # in test_gateway_http.py)
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(cluster.gateway.url)
    for header, status in ((b"x-session-affinity: " + b"a" * 20_000, b"431"),
                           (b"x-session-affinity: a\x01b", b"400")):  # fmt: skip
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(post + b"\r\n" + header + b"\r\nContent-Length: 2\r\n\r\n{}")
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.0 " + status + b" "), answer[:200]
            assert b'"type":"invalid_request_error"' in answer, answer
    # none of these client faults (the bad bodies and tokens, the unparsable headers) wrote a
    # traceback into the gateway's log; aiohttp's own refusals are one WARNING line each
    time.sleep(0.5)
    log = cluster.gateway.log.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert log.count("WARNING") >= 2, log[-3000:]


def test_idle_and_slow_header_connections_are_closed(cluster: Cluster) -> None:
    """--idle-timeout: a connection that never completes its headers (bytes trickling in do not
    count), or sits idle after a response, is closed once it runs out; so is one whose body never
    came, soon after its 408; a streamed answer that takes longer than it is not cut."""
    import socket
    import urllib.parse

    gw = start_gateway("gw-idle", cluster.redis.url, cluster.root / "regions.yaml", cluster.root,
                       "eu", ["--idle-timeout", "0.1", "--body-timeout", "0.5"])  # fmt: skip
    try:
        url = urllib.parse.urlsplit(gw.url)

        def closed_after(sock: socket.socket, trickle: bool) -> float:
            t0 = time.monotonic()
            sock.settimeout(0.05)
            while time.monotonic() - t0 < 10:
                if trickle:
                    sock.sendall(b"X-Slow: 1\r\n")  # a header line, never the blank one
                try:
                    if sock.recv(65536) == b"":
                        return time.monotonic() - t0
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    return time.monotonic() - t0
            raise AssertionError("the gateway held the connection open for 10 s")

        with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            assert closed_after(sock, trickle=True) < 3
        with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            assert closed_after(sock, trickle=False) < 3
        with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{}   ")  # fmt: skip
            assert sock.recv(65536).startswith(b"HTTP/1.1 408")  # the body never came
            assert closed_after(sock, trickle=False) < 2.5  # then no lingering for 10 s
        wait_until(lambda: get_json(f"{gw.url}/readyz")[1]["workers"] >= 2, 30, "workers")
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=60)
        t0 = time.monotonic()
        stream = client.completions.create(model="stories", prompt="Once upon a time",
                                           max_tokens=480, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        text = "".join(c.choices[0].text for c in stream if c.choices)
        # longer than the idle timeout (0.1 s: 400 tokens came in 0.29 s in a CI run on a Zen 5
        # guest, 2026-11-27, where the timeout was 0.3 s)
        assert time.monotonic() - t0 > 0.1 and len(text) > 480
    finally:
        gw.stop()


def test_limits_auth_paths(cluster: Cluster) -> None:
    import urllib.request

    status, _, err = _post(cluster, "/v1/completions", b'{"prompt": "' + b"x" * 70000 + b'"}')
    assert status == 413 and "65536" in err["error"]["message"]
    status, _, err = _post(cluster, "/v1/completions", {"model": "stories", "prompt": "hi"},
                           {"Authorization": "Bearer wrong"})  # fmt: skip
    assert status == 401 and err["error"]["type"] == "invalid_request_error"  # (OpenAI's)
    assert err["error"]["code"] == "invalid_api_key", err
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{cluster.gateway.url}/v1", api_key="nope", max_retries=0
        ).models.list()
    status, err = _get(cluster, "/v1/nowhere")
    assert status == 404 and err["error"]["type"] == "invalid_request_error"  # (OpenAI's)
    status, err = _get(cluster, "/v1/chat/completions")
    assert status == 405 and err["error"]["code"] == "method_not_allowed"
    status, _, err = _post(cluster, "/v1/completions", {"model": "ghost-model", "prompt": "hi"})
    assert status == 503 and err["error"]["code"] == "no_workers"
    # model names: as long as a registry key may be; an unknown one is not echoed whole, nor
    # made a metric label (a client could grow the metrics without end)
    status, _, err = _post(cluster, "/v1/completions", {"model": "m" * 257, "prompt": "hi"})
    assert status == 400 and err["error"]["param"] == "model", err
    assert "at most 256 characters" in err["error"]["message"], err
    status, _, err = _post(cluster, "/v1/completions", {"model": "m" * 256, "prompt": "hi"})
    assert status == 404 and len(err["error"]["message"]) < 100, err
    status, err = _get(cluster, "/v1/models/" + "m" * 4000)
    assert status == 404 and len(err["error"]["message"]) < 100, err
    with urllib.request.urlopen(f"{cluster.gateway.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'gen_ai_request_model="unknown"' in metrics and "m" * 64 not in metrics


def test_cors_origins_must_be_origins() -> None:
    for origin in ("app.example", "https://app.example/", "https://app.example/x", "", "**"):
        with pytest.raises(ValueError, match="cors-origins"):
            GatewayConfig("eu", "redis://x", "s", cors_origins=frozenset({origin}))
    GatewayConfig("eu", "redis://x", "s", cors_origins=frozenset({"*", "http://localhost:5173"}))


def test_cors_for_browser_clients(cluster: Cluster) -> None:
    """--cors-origins: a browser's preflight is answered before auth, from a listed origin only;
    every response to one (errors too) lets the page read it and the gateway's headers. Without
    the flag, no CORS at all."""
    page = "http://localhost:5173"
    gw = start_gateway("gw-cors", cluster.redis.url, cluster.root / "regions.yaml", cluster.root,
                       "eu", ["--api-key", API_KEY, "--cors-origins", f"https://app.example,{page}"])  # fmt: skip
    asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": asked}  # fmt: skip
    auth = {"Origin": page, "Authorization": f"Bearer {API_KEY}"}
    body = {"model": "stories", "prompt": "Once", "max_tokens": 2}

    async def run(url: str) -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as s:
            out = []
            for method, headers, data in [
                ("OPTIONS", preflight, None),
                ("OPTIONS", preflight | {"Origin": "https://evil.example"}, None),
                ("POST", auth, body),
                ("POST", {**auth, "Authorization": "Bearer wrong"}, body),
                ("POST", {**auth, "Origin": "https://evil.example"}, body),
            ]:
                async with s.request(method, f"{url}/v1/completions", headers=headers,
                                     json=data) as resp:  # fmt: skip
                    await resp.read()
                    out.append((resp.status, resp.headers))
            return out

    try:
        wait_until(lambda: get_json(f"{gw.url}/readyz")[1]["workers"] == 4, 30, "workers")
        ok, evil, post, unauthorized, other = asyncio.run(run(gw.url))
    finally:
        gw.stop()
    status, headers = ok
    assert status == 204 and headers["Access-Control-Allow-Origin"] == page
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == asked
    assert int(headers["Access-Control-Max-Age"]) > 0 and headers["Vary"] == "Origin"
    assert evil[0] == 403 and "Access-Control-Allow-Origin" not in evil[1]
    for status, headers in (post, unauthorized):
        assert status in (200, 401) and headers["Access-Control-Allow-Origin"] == page
        exposed = headers["Access-Control-Expose-Headers"]
        assert {"x-request-id", "x-edgeinfer-worker", "x-edgeinfer-region"} <= set(
            exposed.split(", ")
        )
    assert unauthorized[0] == 401 and "x-request-id" in unauthorized[1]
    # a page of an origin not listed: refused before any work (it was served, the answer only
    # hidden from the page: any page a visitor opened could make the gateway generate, blind)
    assert other[0] == 403 and "Access-Control-Allow-Origin" not in other[1]
    # the cluster's gateway runs without --cors-origins: a preflight meets auth, and no CORS;
    # a browser's POST, whatever its origin, is refused, the same without Origin served
    (status, headers), _, (post_status, _), _, _ = asyncio.run(run(cluster.gateway.url))
    assert status == 401 and "Access-Control-Allow-Origin" not in headers
    assert post_status == 403
    text_plain = {"Content-Type": "text/plain"}  # (a page's "simple" request: no preflight)
    status, _, answer = _post(cluster, "/v1/completions", body, text_plain | {"Origin": page})
    assert status == 403 and answer["error"]["code"] == "origin_not_allowed", answer
    assert _post(cluster, "/v1/completions", body, text_plain)[0] == 200  # (curl -d, say)


def test_worker_refuses_without_secret(cluster: Cluster) -> None:
    w = cluster.workers["eu1"]
    assert get_json(f"{w.url}/internal/stats")[0] == 401
    assert get_json(f"{w.url}/internal/stats", "wrong")[0] == 401
    assert get_json(f"{w.url}/internal/stats", SECRET)[0] == 200


def test_client_disconnect_frees_blocks(cluster: Cluster) -> None:
    async def run() -> str:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                f"{cluster.gateway.url}/v1/completions",
                json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 480,
                      "ignore_eos": True, "stream": True},
                headers={"Authorization": f"Bearer {API_KEY}", "x-session-affinity": "gone"},
            )  # fmt: skip
            assert resp.status == 200
            await resp.content.readline()  # the first token arrived
            worker = resp.headers["x-edgeinfer-worker"]
            resp.close()  # hang up mid-stream
            return worker

    before = {n: worker_stats(w)["num_aborted"] for n, w in cluster.workers.items()}
    worker = cluster.by_id(asyncio.run(run()))
    name = next(n for n, w in cluster.workers.items() if w is worker)

    def freed() -> bool:
        s = worker_stats(worker)
        return (
            s["open_requests"] == 0
            and s["free_kv_blocks"] == s["total_kv_blocks"]
            and s["num_aborted"] == before[name] + 1
        )

    wait_until(freed, 10, "the worker to abort the request and free its blocks", worker)


class _Answer(BaseHTTPRequestHandler):
    """Answers a POST with its server's `answer`."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, headers, body = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        for name, value in (headers | {"Content-Length": str(len(body))}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _StubWorker(ThreadingHTTPServer):
    """A worker's internal API that answers every request with `answer` (status, headers,
    body): what a worker that is broken, busy or configured with another secret says. It is in
    the registry while `registered` (as `worker_id`, heartbeating when asked)."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.answer: tuple[int, dict[str, str], bytes] = (500, {}, b"")
        self.redis_url = cluster.redis.url
        self.url = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def heartbeat(self, worker_id: str, model: str) -> None:
        info = WorkerInfo(worker_id=worker_id, region="eu", model=model, role="mixed",
                          url=self.url, max_num_seqs=4, capacity_tokens=10_000,
                          free_kv_blocks=1000, total_kv_blocks=1000,
                          updated_at=time.time())  # fmt: skip
        asyncio.run(self._redis(lambda r: Registry(r, ttl_s=60).heartbeat(info)))

    def deregister(self, worker_id: str, model: str) -> None:
        asyncio.run(self._redis(lambda r: Registry(r).deregister(worker_id, model)))

    def place(self, session: str, worker_id: str) -> None:
        asyncio.run(self._redis(lambda r: SessionStore(r).claim(session, Placement(worker_id, "eu"))))  # fmt: skip

    async def _redis(self, call: Callable[[Redis], Awaitable[object]]) -> None:
        r = connect(self.redis_url)
        try:
            await call(r)
        finally:
            await r.aclose()


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:  # fmt: skip
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})  # fmt: skip


def test_a_worker_that_fails_or_refuses_the_gateway_is_set_aside(cluster: Cluster) -> None:
    """A worker's refusal of a bad request reaches the client; a busy worker's (429, 503 with
    Retry-After) too, whatever its Retry-After says; a worker that refuses the gateway itself
    (401, 403: another shared secret) or fails (5xx) is set aside like a dead one, the request
    tried on another, and the client never sees its authentication error."""
    stub = _StubWorker(cluster)
    Answer = tuple[int, dict[str, str], bytes]
    # (the stub's answer, the status the client gets, what its error holds, its Retry-After)
    busy: list[tuple[Answer, int, dict[str, str], str | None]] = [
        ((400, {}, _error_body("bad sampling", "invalid_request_error", "sampling")),
         400, {"param": "sampling", "message": "bad sampling"}, None),
        ((429, {"Retry-After": "soon"}, _error_body("queue full", "rate_limit_error", None,
                                                    "queue_full")),
         429, {"code": "queue_full", "type": "server_error"}, "1"),
        ((503, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"},
          _error_body("worker is draining", "service_unavailable", None, "draining")),
         503, {"code": "draining", "type": "server_error"}, "1"),
        ((503, {"Retry-After": "inf"}, _error_body("no KV room", "service_unavailable", None,
                                                   "kv_cache_full")),
         503, {"code": "kv_cache_full"}, "1"),
    ]  # fmt: skip
    failed: list[tuple[Answer, int, dict[str, str]]] = [
        ((401, {}, _error_body("missing or wrong shared secret", "authentication_error")),
         502, {"code": "worker_failed", "type": "server_error"}),
        ((403, {}, b"<html>forbidden</html>"), 502, {"code": "worker_failed"}),
        ((500, {}, _error_body("the engine broke", "internal_error", None, "internal_error")),
         502, {"message": "the engine broke", "type": "server_error"}),
        ((503, {}, _error_body("engine is dead", "service_unavailable", None, "engine_dead")),
         503, {"code": "engine_dead"}),
    ]  # fmt: skip
    request = {"model": "stub-model", "prompt": "Hi", "max_tokens": 1}

    def listed() -> bool:
        return "stub-model" in [m.id for m in cluster.client.models.list().data]

    try:
        stub.heartbeat("eu-stub", "stub-model")
        wait_until(listed, 10, "the stub worker")
        for answer, status, error, retry_after in busy:
            stub.answer = answer
            got, headers, err = _post(cluster, "/v1/completions", request)
            assert got == status and error.items() <= err["error"].items(), (answer, err)
            assert headers.get("Retry-After") == retry_after, (answer, headers)
            assert listed(), answer  # not set aside
        for answer, status, error in failed:
            stub.answer = answer
            got, _, err = _post(cluster, "/v1/completions", request)
            assert got == status and error.items() <= err["error"].items(), (answer, err)
            assert "shared secret" not in err["error"]["message"], err
            assert not listed(), answer  # set aside, until it heartbeats after the failure
            time.sleep(1.1)
            stub.heartbeat("eu-stub", "stub-model")
            wait_until(listed, 10, "the stub worker back")
        # a session on a worker that refuses the gateway: tried there, then elsewhere
        stub.answer = failed[0][0]
        before = get_json(f"{cluster.gateway.url}/readyz")[1]["workers"]
        stub.heartbeat("eu-stub-stories", "stories")
        wait_until(lambda: get_json(f"{cluster.gateway.url}/readyz")[1]["workers"] == before + 1,
                   10, "the stub serving stories")  # fmt: skip
        stub.place("refused", "eu-stub-stories")
        raw = cluster.client.completions.with_raw_response.create(
            model="stories", prompt="Hi", max_tokens=2,
            extra_headers={"x-session-affinity": "refused"},
        )  # fmt: skip
        assert raw.headers["x-edgeinfer-worker"] != "eu-stub-stories"
        assert raw.parse().choices[0].text
        assert get_json(f"{cluster.gateway.url}/readyz")[1]["workers"] == before
        assert "refused the gateway (HTTP 401" in cluster.gateway.log.read_text()
    finally:
        stub.deregister("eu-stub", "stub-model")
        stub.deregister("eu-stub-stories", "stories")
        stub.shutdown()
        stub.server_close()


def test_workers_that_refuse_connections_do_not_use_up_the_attempts(cluster: Cluster) -> None:
    """Five registered workers whose host is gone (connections refused: nothing listens on
    their ports) beside the live ones: every request is served, the dead passed over without
    counting as attempts (three of them took a request's three attempts: a 503 while a live
    worker idled)."""
    import socket

    stub = _StubWorker(cluster)
    dead = []
    for i in range(5):
        with socket.socket() as sock:  # a port nothing listens on once closed
            sock.bind(("127.0.0.1", 0))
            dead.append((f"eu-gone-{i}", f"http://127.0.0.1:{sock.getsockname()[1]}"))
    try:
        for attempt in range(2):
            time.sleep(1.1 * attempt)  # (set aside until a heartbeat after the failure)
            for worker_id, url in dead:
                stub.url = url
                stub.heartbeat(worker_id, "stories")
            wait_until(
                lambda: get_json(f"{cluster.gateway.url}/readyz")[1]["workers"] >= 5, 10, "them"
            )
            for i in range(3):
                out = cluster.client.completions.create(
                    model="stories", prompt=f"Round {attempt} request {i}: once", max_tokens=2
                )
                assert out.choices[0].text is not None
            assert "failed (cannot connect)" in cluster.gateway.log.read_text()
    finally:
        for worker_id, _ in dead:
            stub.deregister(worker_id, "stories")
        stub.shutdown()
        stub.server_close()


def test_a_busy_worker_answers_even_where_a_pool_offers_the_model(cluster: Cluster) -> None:
    """A pool that can start workers for a model makes the gateway hold a request no worker
    serves (scale from zero); not one whose only worker is busy (429, 503 with Retry-After):
    that worker serves, no pool starts another, and the client gets its answer at once. (The
    gateway held it for --hold-timeout, 60 s, then answered 503 `worker_starting`.)"""
    from kvstore.demand import Demand, PoolInfo

    stub = _StubWorker(cluster)
    pool = PoolInfo(pool_id="stub-pool", region="eu", models=["stub-model"], max_workers=1,
                    workers=1, updated_at=time.time())  # fmt: skip
    request = {"model": "stub-model", "prompt": "Hi", "max_tokens": 1}
    pools = get_json(f"{cluster.gateway.url}/readyz")[1]["pools"]
    try:
        asyncio.run(stub._redis(lambda r: Demand(r).announce(pool, 60)))
        stub.heartbeat("eu-stub", "stub-model")
        wait_until(lambda: get_json(f"{cluster.gateway.url}/readyz")[1]["pools"] == pools + 1,
                   10, "the pool")  # fmt: skip
        wait_until(lambda: "stub-model" in [m.id for m in cluster.client.models.list().data],
                   10, "the stub worker")  # fmt: skip
        busy = [
            (429, _error_body("queue full", "rate_limit_error", None, "queue_full"), "queue_full"),
            (503, _error_body("no KV room", "service_unavailable", None, "kv_cache_full"),
             "kv_cache_full"),
        ]  # fmt: skip
        # (a worker that answers "draining" is leaving, a pool's scale-down, whatever the
        # registry snapshot says yet: that request does wait for the worker replacing it)
        for status, body, code in busy:
            stub.answer = (status, {"Retry-After": "2"}, body)
            t0 = time.monotonic()
            got, headers, err = _post(cluster, "/v1/completions", request)
            assert (got, err["error"]["code"]) == (status, code), err
            assert headers.get("Retry-After") == "2" and time.monotonic() - t0 < 10
    finally:
        asyncio.run(stub._redis(lambda r: Demand(r).withdraw("stub-pool")))
        stub.deregister("eu-stub", "stub-model")
        stub.shutdown()
        stub.server_close()


# ---------------------------------------------------------------------- faults (run last)
def _post_worker(worker: Proc, body: dict) -> tuple[int, dict]:  # type: ignore[type-arg]
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{worker.url}/internal/generate", data=orjson.dumps(body),
        headers={"x-edgeinfer-secret": SECRET}, method="POST",
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return resp.status, {}
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


def _placement(cluster: Cluster, session: str) -> dict:  # type: ignore[type-arg]
    import redis

    r = redis.Redis.from_url(cluster.redis.url)
    try:
        return orjson.loads(r.get(f"ei:s:{{{session}}}"))
    finally:
        r.close()


def test_a_queued_request_hears_keepalives(cluster: Cluster, tmp_path: Path) -> None:
    """A request waiting its turn (one at a time here) is silent for seconds; the worker fills
    the silence with blank lines, so a gateway does not take it for hung."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    worker = start_worker("queue1", cluster.model, cluster.redis.url, tmp_path, "eu",
                          ["--max-num-seqs", "1"], served="stories-queue")  # fmt: skip

    def stream(i: int, tokens: int) -> list[bytes]:
        body = {"request_id": f"q-{i}", "model": "stories-queue", "prompt": "Once upon a time",
                "sampling": {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}}  # fmt: skip
        req = urllib.request.Request(f"{worker.url}/internal/generate", data=orjson.dumps(body),
                                     headers={"x-edgeinfer-secret": SECRET}, method="POST")  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read().split(b"\n")

    try:
        with ThreadPoolExecutor(7) as ex:
            ahead = [ex.submit(stream, i, 500) for i in range(6)]  # one token a step, in turn
            time.sleep(0.3)
            queued = ex.submit(stream, 9, 2).result()
            for f in ahead:
                f.result()
        events = [orjson.loads(line)["type"] if line else "" for line in queued]
        start, delta = events.index("start"), events.index("delta")
        assert "" in events[start:delta], events  # keepalives before its first token
        assert events[-2:] == ["done", ""], events  # (the last split is after the final newline)
    finally:
        worker.stop()


def test_a_hung_worker_costs_a_retry_not_a_stall(cluster: Cluster) -> None:
    """A worker that stops answering (SIGSTOP: its port still accepts) is failed after the
    gateway's idle timeout (3 s here) and the request, which had no token yet, goes elsewhere."""
    raw = cluster.client.completions.with_raw_response.create(
        model="stories", prompt="Hi", max_tokens=2, extra_headers={"x-session-affinity": "hung"}
    )
    first = raw.headers["x-edgeinfer-worker"]
    hung = cluster.by_id(first)
    hung.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        raw = cluster.client.completions.with_raw_response.create(
            model="stories", prompt="Hi", max_tokens=2, extra_headers={"x-session-affinity": "hung"}
        )
        took = time.monotonic() - t0
        assert raw.headers["x-edgeinfer-worker"] != first
        assert raw.parse().choices[0].text
        assert 2.5 <= took < 15, took  # the idle timeout, then another worker
    finally:
        hung.signal(signal.SIGCONT)
    wait_until(lambda: get_json(f"{cluster.gateway.url}/readyz")[1]["workers"] >= 4, 20,
               "the stopped worker back")  # fmt: skip


def test_killed_worker_sessions_are_replaced(cluster: Cluster) -> None:
    raw = cluster.client.completions.with_raw_response.create(
        model="stories", prompt="Hi", max_tokens=2, extra_headers={"x-session-affinity": "beta"}
    )
    first = raw.headers["x-edgeinfer-worker"]
    assert _placement(cluster, "beta")["worker_id"] == first
    cluster.by_id(first).kill()
    raw = cluster.client.completions.with_raw_response.create(
        model="stories", prompt="Hi", max_tokens=2, extra_headers={"x-session-affinity": "beta"}
    )
    second = raw.headers["x-edgeinfer-worker"]
    assert second != first and raw.headers["x-edgeinfer-region"] == "eu"
    wait_until(lambda: _placement(cluster, "beta")["worker_id"] == second, 5, "re-placement")


def test_sigterm_drains_in_flight_then_geo_routes(cluster: Cluster) -> None:
    last = next(w for n, w in cluster.workers.items() if n.startswith("eu") and w.alive())
    stream = cluster.client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=300, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"x-session-affinity": "drain"},
    )  # fmt: skip
    chunks = [next(iter(stream))]
    last.signal(signal.SIGTERM)  # mid-stream: this request must still finish
    # while it drains, the worker refuses new work (the gateway would try elsewhere)
    refused = None
    for _ in range(100):
        refused = _post_worker(last, {"request_id": f"late-{_}", "model": "stories", "prompt": "Hi",
                                      "sampling": {"max_tokens": 1}})  # fmt: skip
        if refused[0] == 503:
            break
        time.sleep(0.01)
    assert refused is not None and refused[0] == 503 and refused[1]["error"]["code"] == "draining"
    chunks += list(stream)
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 250
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last.popen.wait(20)
    assert last.popen.returncode == 0, last.tail()

    # eu has no worker left: the nearest region with capacity (us, not ap) serves
    raw = cluster.client.chat.completions.with_raw_response.create(
        model="stories", messages=MESSAGES, max_tokens=4
    )
    assert raw.headers["x-edgeinfer-region"] == "us"
    assert raw.headers["x-edgeinfer-route"] == "remote"


def test_redis_outage_keeps_serving(cluster: Cluster) -> None:
    cluster.redis.stop()
    t0 = time.monotonic()
    resp = cluster.client.completions.create(model="stories", prompt="Hi", max_tokens=3)
    assert resp.choices[0].text
    assert time.monotonic() - t0 < 10
    wait_until(lambda: get_json(f"{cluster.gateway.url}/readyz")[0] == 503, 10, "not ready")
    # affinity is skipped, not an error
    resp = cluster.client.completions.create(
        model="stories", prompt="Hi", max_tokens=3, extra_headers={"x-session-affinity": "x"}
    )
    assert resp.choices[0].text
    cluster.redis.start()
    # ready again once the workers' heartbeats re-register them in the fresh Redis (until then,
    # readiness may count the snapshot kept through the outage, then an empty registry)
    import redis

    r = redis.Redis.from_url(cluster.redis.url)
    try:
        wait_until(lambda: len(r.keys("ei:w:*")) >= 2, 20, "workers re-registered")
    finally:
        r.close()

    def ready() -> bool:
        status, body = get_json(f"{cluster.gateway.url}/readyz")
        return status == 200 and body["workers"] >= 2

    wait_until(ready, 20, "ready again")


def test_the_first_request_after_every_worker_died_is_told_when_to_retry(cluster: Cluster) -> None:
    """Every worker of a model killed, the registry not yet aware: the gateway tries the dead one,
    which fails, and answers 503 worker_failed; with Retry-After, as its other 503s (a client
    that honours it waits; without it, it was told nothing)."""
    lone = start_worker("lone", cluster.model, cluster.redis.url, cluster.root, "eu",
                        served="lone")  # fmt: skip
    wait_until(lambda: "lone" in [m.id for m in cluster.client.models.list().data], 10, "lone")
    lone.kill()
    status, headers_, err = _post(cluster, "/v1/completions", {"model": "lone", "prompt": "Hi"})
    assert status == 503 and err["error"]["code"] == "worker_failed", (status, err)
    assert int(headers_["Retry-After"]) >= 1


async def _sse_lines(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [line.strip() async for line in resp.content if line.strip()]


def test_at_capacity_429_and_worker_death_mid_stream(cluster: Cluster) -> None:
    tiny = start_worker("tiny", cluster.model, cluster.redis.url, cluster.root, "eu",
                        ["--max-num-seqs", "1", "--max-waiting", "1"], served="tiny")  # fmt: skip
    wait_until(lambda: "tiny" in [m.id for m in cluster.client.models.list().data], 10, "tiny")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
            "stream": True}  # fmt: skip
    url = f"{cluster.gateway.url}/v1/completions"

    async def run() -> tuple[list[int], list[bytes]]:
        async with aiohttp.ClientSession(headers=headers) as s:
            first = await s.post(url, json=long)  # runs: the worker's only slot
            assert first.status == 200
            await first.content.readline()
            queued = asyncio.ensure_future(s.post(url, json=long))  # waits: the queue's only place
            statuses = []
            for _ in range(50):  # until the worker's queue (or its heartbeat) says it is full
                await asyncio.sleep(0.02)
                r = await s.post(url, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
                statuses.append(r.status)
                if r.status == 429:
                    err = await r.json()
                    assert err["error"]["type"] == "server_error"  # (OpenAI's "overloaded")
                    assert int(r.headers["Retry-After"]) >= 1
                    break
                await r.read()
            # kill the worker while `first` streams: the stream ends with an error event
            tiny.kill()
            lines = await _sse_lines(first)
            queued.cancel()
            return statuses, lines

    statuses, lines = asyncio.run(run())
    assert statuses[-1] == 429, statuses
    assert lines[-1] == b"data: [DONE]"
    error = orjson.loads(lines[-2].removeprefix(b"data: "))
    assert "error" in error and error["error"]["message"], lines[-3:]
    assert "failed after the stream began" in error["error"]["message"], error
    assert error["error"]["code"] == "worker_failed", error
    assert error["error"]["type"] == "server_error", error  # (a 503's, before the first byte)
    # the only worker for the model is gone: 503 with Retry-After
    status, headers_, err = _post(cluster, "/v1/completions", {"model": "tiny", "prompt": "Hi"})
    assert status == 503 and "Retry-After" in headers_ and err["error"]["code"] == "no_workers"
