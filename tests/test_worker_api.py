"""A worker's internal API on its own (no gateway), on real worker processes: a bad body gets a
4xx JSON error naming what is wrong, never a 500 or aiohttp's text/plain; a drain that runs out
of time aborts the requests left, each stream ending with an error event that a gateway retries
elsewhere while no token has reached its client."""

from __future__ import annotations

import concurrent.futures
import gzip
import http.client
import json
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.openai_response import UNAVAILABLE_CODES
from kvstore.redis_server import LocalRedis
from tests.stack import SECRET, Proc, chat_model, start_worker

TOOL = {"type": "function", "function": {"name": "f"}}


def _deep(levels: int) -> dict:  # type: ignore[type-arg]
    schema: dict = {"type": "string"}  # type: ignore[type-arg]
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


LONG = {"max_tokens": 480, "n": 128, "ignore_eos": True}  # far more than 2 s of work


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, redis_server: LocalRedis):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("worker_api")
    proc = start_worker("api", chat_model(stories_dir, root / "chat"), redis_server.url, root)
    try:
        yield proc
    finally:
        proc.stop()


def _post(worker: Proc, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:  # fmt: skip
    """POST /internal/generate: (status, Content-Type, body)."""
    req = urllib.request.Request(f"{worker.url}/internal/generate", data=body, method="POST",
                                 headers={"x-edgeinfer-secret": SECRET} | (headers or {}))  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def _request(i: int, **fields: Any) -> bytes:
    body = {"request_id": f"bad-{i}", "model": "stories", "prompt": "Once",
            "sampling": {"max_tokens": 2}} | fields  # fmt: skip
    return json.dumps(body).encode()  # (not orjson: it stops at 255 levels of nesting)


BAD: list[tuple[dict[str, Any], str]] = [  # (fields of the request, the param its 400 names)
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),  # was a 500
    ({"tools": [{"type": "function", "function": "f"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),  # was a 500
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(600)}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),  # (was a RecursionError)
    ({"tools": [1], "prompt": None, "messages": [{"role": "user", "content": "Hi"}]}, "tools[0]"),
    ({"request_id": ["r"]}, "request_id"),  # was "sampling"
    ({"kv_source": 5}, "kv_source"),  # was a 500
    ({"kv_source": "127.0.0.1:99999"}, "kv_source"),  # (pulled from port 34463)
    ({"kv_source": "nowhere"}, "kv_source"),
    ({"operation": "xx"}, "operation"),  # (a label value of the worker's metrics)
    ({"session_id": {"a": 1}}, "session_id"),
    ({"sampling": [1]}, "sampling"),
    ({"sampling": {"nonsense": 2}}, "sampling"),  # (a field SamplingParams has not)
    ({"sampling": {"best_of": 2}}, "best_of"),  # (taken as vLLM's: only None, 1 or n)
]  # fmt: skip


@pytest.mark.parametrize(("i", "fields", "param"), [(i, f, p) for i, (f, p) in enumerate(BAD)])
def test_bad_fields_are_a_400_naming_the_field(
    worker: Proc, i: int, fields: dict[str, Any], param: str
) -> None:
    status, content_type, body = _post(worker, _request(i, **fields))
    assert status == 400 and content_type == "application/json", (status, body)
    error = orjson.loads(body)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize(("fields", "param"), [
    ({"sampling": {"max_tokens": 100_000}}, "max_tokens"),
    ({"prompt": "Once upon a time " * 300}, "prompt"),
])  # fmt: skip
def test_a_request_over_the_context_is_coded_as_openai_codes_it(
    worker: Proc, fields: dict[str, Any], param: str
) -> None:
    """Clients that trim a conversation and retry look for code context_length_exceeded."""
    status, _, body = _post(worker, _request(0, **fields))
    error = orjson.loads(body)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded", (status, error)
    assert error["param"] == param and "maximum context length is 512" in error["message"]


def test_an_undecodable_body_is_a_400(worker: Proc) -> None:
    status, content_type, body = _post(worker, b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and content_type == "application/json", (status, body)  # was a 500
    assert orjson.loads(body)["error"]["code"] == "invalid_body"
    status, _, _ = _post(worker, gzip.compress(_request(0)), {"Content-Encoding": "gzip"})
    assert status == 200


def test_a_constraint_that_fails_mid_request_ends_with_an_error_event(worker: Proc) -> None:
    """A grammar that fails mid-request (llguidance's lexer limit) ends the stream with an
    error event that says why, not a "stop" with output the constraint did not accept."""
    schema = {"type": "object", "required": ["n", "a"], "properties": {"n": {"type": "integer"},
              "a": {"type": "string", "pattern": "^(.{0,50}){0,50}$"}}}  # fmt: skip
    # "user: hi\nassistant:" as stories260K tokenizes it: greedy, the lexer gives up
    prompt = [318, 419, 285, 467, 270, 417, 13, 412, 419, 419, 293, 413, 303, 413, 467]
    sampling = {"max_tokens": 60, "temperature": 0, "structured_outputs": {"json": schema}}
    status, _, body = _post(worker, _request(0, prompt=prompt, sampling=sampling))
    events = [orjson.loads(line) for line in body.splitlines() if line.strip()]
    assert status == 200 and events[-1]["type"] == "error", events[-3:]
    assert events[-1]["code"] == "constraint_failed", events[-1]
    assert "too many expressions" in events[-1]["message"], events[-1]
    assert "constraint_failed" not in UNAVAILABLE_CODES  # (mid-stream: a 500 error chunk)


def test_a_drain_that_times_out_fails_what_is_left_and_exits(
    stories_dir: Path, redis_server: LocalRedis, tmp_path: Path
) -> None:
    """Three requests far too long to finish within the drain timeout (2 s): once it is over,
    each is aborted and its stream ends with a "shutdown" error event (one the gateway retries
    elsewhere before a token has gone out), not cut off, and the worker exits."""
    worker = start_worker("drain", stories_dir, redis_server.url, tmp_path,
                          extra=["--drain-timeout", "2"])  # fmt: skip
    started = threading.Barrier(4)

    def stream(i: int) -> list[dict[str, Any]]:
        body = orjson.dumps({"request_id": f"long-{i}", "model": "stories", "prompt": "Once",
                             "sampling": LONG})  # fmt: skip
        req = urllib.request.Request(f"{worker.url}/internal/generate", data=body,
                                     headers={"x-edgeinfer-secret": SECRET}, method="POST")  # fmt: skip
        events = []
        with urllib.request.urlopen(req, timeout=60) as resp:
            events.append(orjson.loads(resp.readline()))  # the start event
            started.wait(30)
            try:
                events += [orjson.loads(line) for line in resp if line.strip()]
            except http.client.IncompleteRead:  # cut off
                events.append({"type": "cut off"})
        return events

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream, i) for i in range(3)]
            started.wait(30)
            worker.signal(signal.SIGTERM)
            ends = [f.result()[-1] for f in streams]
        assert all(e["type"] == "error" and e["code"] == "shutdown" for e in ends), ends
        assert "shutdown" in UNAVAILABLE_CODES  # (the gateway reads it as "worker going away")
        worker.popen.wait(30)
    finally:
        worker.stop()
    assert worker.popen.returncode == 0, worker.tail()
    assert "drain timeout: aborting 3 requests" in worker.log.read_text()


def test_a_disaggregated_request_is_answered_at_once_and_a_failed_pull_in_its_stream(
    worker: Proc,
) -> None:
    """A request whose prompt's KV is to be pulled (`kv_source`) is answered 200 at once, its
    stream blank (keepalives) while the pull runs, so that a gateway tells a hung decode worker
    from a slow pull by its idle timeout (it waited up to 300 s); a pull that fails is then the
    stream's one event, with the code and the status it had as an answer before the stream
    (502 kv_transfer_failed: nothing listens at the source). A request that is itself bad is
    refused before any stream, as any other."""
    status, ctype, body = _post(worker, _request(90, kv_source="127.0.0.1:1"))
    assert status == 200 and ctype.startswith("application/x-ndjson"), body
    assert body.startswith(b"\n"), body  # a keepalive first: the answer does not wait
    [event] = [orjson.loads(line) for line in body.split(b"\n") if line]
    assert event["type"] == "error" and event["code"] == "kv_transfer_failed", event
    assert event["status"] == 502 and event["retry_after"] is None, event
    # the error object the answer would have carried, for the gateway to relay as it was
    assert (event["error"]["type"], event["error"]["param"]) == ("bad_gateway", "kv_source")
    status, _, body = _post(worker, _request(91, kv_source="127.0.0.1:1", sampling={"n": 0}))
    assert status == 400 and orjson.loads(body)["error"]["param"] == "n", body


def test_a_hung_engine_stops_the_keepalives_a_slow_one_keeps_them(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, redis_server: LocalRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's keepalives tell the gateway "busy, not hung". A step that finishes model
    layers, however slowly, keeps them coming; a step that finishes none for ENGINE_STALL_S (a
    device call or collective that never returns) stops them, so the gateway's idle timeout
    fires and it retries elsewhere, and /internal/health answers 503 "stalled": the pods'
    readiness and liveness probes (run here from infra/'s manifest) fail, and its registry
    entry expires; once the step returns, the worker registers again. The keepalive timer used
    to write on whatever the engine thread was doing: a client hung for ever."""
    import asyncio
    import time

    import aiohttp
    from aiohttp import web

    from runtime import async_engine
    from runtime.async_engine import AsyncLLM
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.worker import Worker, WorkerConfig, make_app

    monkeypatch.setattr(async_engine, "ENGINE_STALL_S", 0.6)
    llm = AsyncLLM(LLMEngine(EngineConfig(str(stories_dir), block_size=16,
                                          kv_cache_bytes=4_000_000, num_threads=1)))  # fmt: skip
    model = llm.engine.runner.model
    real_step = llm.engine.step
    mode = {"next": "real"}
    unblock = threading.Event()

    def step():  # type: ignore[no-untyped-def]
        how, mode["next"] = mode["next"], "real"
        if how == "slow" and llm.engine.has_unfinished():  # 1.8 s, a layer every 0.1 s
            for _ in range(18):
                time.sleep(0.1)
                model.layers_run += 1
        elif how == "hung" and llm.engine.has_unfinished():
            unblock.wait(30)  # no layer finishes
        return real_step()

    llm.engine.step = step  # type: ignore[method-assign]
    cfg = WorkerConfig("stories", "r1", "mixed", "127.0.0.1", 0, "http://127.0.0.1:0", SECRET,
                       redis_server.url, heartbeat_s=0.2, ttl_s=1.0)  # fmt: skip
    worker = Worker(cfg, llm)
    headers = {"x-edgeinfer-secret": SECRET}

    async def generate(http: aiohttp.ClientSession, port: int, rid: str) -> list[bytes]:
        body = {"request_id": rid, "model": "stories", "prompt": "Once upon a time",
                "sampling": {"max_tokens": 4}}  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=None, sock_read=2.5)  # the gateway's idle limit
        got: list[bytes] = []
        async with http.post(f"http://127.0.0.1:{port}/internal/generate", headers=headers,
                             data=orjson.dumps(body), timeout=timeout) as resp:  # fmt: skip
            async for line in resp.content:
                got.append(line.strip())
        return got

    import os
    import subprocess
    import sys

    import yaml

    manifest = Path(__file__).parents[1] / "infra" / "k8s" / "base" / "worker.yaml"
    pod = yaml.safe_load(manifest.read_text())["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "worker"]

    async def probe(kind: str, port: int) -> int:
        """The pods' exec probe `kind`, run against this worker: its exit status."""
        script = container[kind]["exec"]["command"][2].replace("9001", str(port))
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", script], capture_output=True, timeout=30,
            env=os.environ | {"EDGEINFER_SECRET": SECRET},
        )  # fmt: skip
        return proc.returncode

    async def main() -> None:
        from redis.asyncio import Redis

        from kvstore.registry import Registry

        redis = Redis.from_url(redis_server.url)
        registry = Registry(redis)
        runner = web.AppRunner(make_app(worker))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            assert await probe("livenessProbe", port) == 0
            assert await probe("readinessProbe", port) == 0
            ours = worker.config.worker_id  # (the module's worker shares the Redis and model)
            assert ours in [w.worker_id for w in await registry.workers("stories")]
            async with aiohttp.ClientSession() as http:
                mode["next"] = "slow"
                got = await generate(http, port, "slow")
                kinds = [orjson.loads(x)["type"] if x else "keepalive" for x in got]
                # a keepalive came during the slow step, before its first token
                assert kinds[:3] == ["start", "keepalive", "delta"], kinds
                assert kinds[-1] == "done"
                mode["next"] = "hung"
                t0 = time.monotonic()
                task = asyncio.ensure_future(generate(http, port, "hung"))
                await asyncio.sleep(1.5)
                async with http.get(f"http://127.0.0.1:{port}/internal/health",
                                    headers=headers) as health:  # fmt: skip
                    assert health.status == 503
                    assert (await health.json())["status"] == "stalled"
                assert await probe("livenessProbe", port) != 0  # the pod is restarted
                assert await probe("readinessProbe", port) != 0
                await asyncio.sleep(1.2)  # past the registry entry's TTL: gone, not renewed
                await worker.publish()  # (as a role change's would: nor by that)
                assert ours not in [w.worker_id for w in await registry.workers("stories")]
                unblock.set()  # the step returns: the engine recovers, and re-registers
                for _ in range(50):
                    if ours in [w.worker_id for w in await registry.workers("stories")]:
                        break
                    await asyncio.sleep(0.1)
                assert ours in [w.worker_id for w in await registry.workers("stories")]
                assert "expired while the engine was stalled" in caplog.text
                with pytest.raises((TimeoutError, aiohttp.ServerTimeoutError)):
                    await task
                assert time.monotonic() - t0 < 10
        finally:
            unblock.set()
            await runner.cleanup()
            await redis.aclose()
            llm.shutdown()

    asyncio.run(main())


def _in_process_worker(stories_dir: Path):  # type: ignore[no-untyped-def]
    """A worker's app and engine in this process (for faults a real process cannot be made to
    have): (its AsyncLLM, and `ask(request_id, before)`, which runs `before(llm)`, serves the
    app on a free port, sends one 4-token request and returns its events, and the engine's free
    KV blocks after it, as the engine thread counts them)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from runtime.async_engine import AsyncLLM
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.worker import Worker, WorkerConfig, make_app

    llm = AsyncLLM(LLMEngine(EngineConfig(str(stories_dir), block_size=16,
                                          kv_cache_bytes=4_000_000, num_threads=1)))  # fmt: skip
    cfg = WorkerConfig("stories", "r1", "mixed", "127.0.0.1", 0, "http://127.0.0.1:0", SECRET,
                       None)  # fmt: skip
    worker = Worker(cfg, llm)

    async def main(request_id: str, before: Any) -> tuple[list[dict[str, Any]], int]:
        await before(llm)
        runner = web.AppRunner(make_app(worker))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        body = {"request_id": request_id, "model": "stories", "prompt": "Once upon a time",
                "sampling": {"max_tokens": 4}}  # fmt: skip
        try:
            async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/internal/generate", data=orjson.dumps(body),
                headers={"x-edgeinfer-secret": SECRET},
            ) as resp:  # fmt: skip
                assert resp.status == 200
                events = [orjson.loads(line) async for line in resp.content if line.strip()]
            return events, await llm.call(lambda e: e.scheduler.blocks.num_free_blocks)
        finally:
            await runner.cleanup()

    def ask(request_id: str, before: Any) -> tuple[list[dict[str, Any]], int]:
        return asyncio.run(main(request_id, before))

    return llm, ask


def test_an_id_the_engine_refuses_after_the_stream_began_is_a_400_event(stories_dir: Path) -> None:
    """A request whose id the engine thread refuses once its stream has begun (here a KV import
    reserved under that id: `submit` sees only the open streams) ends its stream with a refusal
    event standing for a 400, which the gateway answers as such. The error escaped the handler:
    a traceback, and a body cut short that the gateway took for a broken worker."""
    from runtime.sampling_params import SamplingParams

    llm, ask = _in_process_worker(stories_dir)

    async def reserve(llm: Any) -> None:
        ids = list(range(20, 60))
        await llm.call(lambda e: e.reserve_import(e.prepare_request("x", ids, SamplingParams())))

    try:
        events, _ = ask("x", reserve)
    finally:
        llm.shutdown()
    last = events[-1]
    assert last["type"] == "error" and last["status"] == 400, events
    assert "already in use" in last["message"] and last["error"]["param"] == "request_id", last


def test_a_bug_mid_stream_ends_it_with_an_error_event(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception while a request streams (a bug) ends its stream with an
    internal_error event, which the gateway answers or retries elsewhere, and frees its KV
    blocks; the stream was cut short, which the gateway takes for a broken worker, and the
    request was recorded as its client having gone."""
    from runtime import worker as worker_module

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(worker_module, "_delta", broken)
    llm, ask = _in_process_worker(stories_dir)

    async def nothing(llm: Any) -> None:
        return None

    try:
        total = llm.engine.scheduler.blocks.num_free_blocks
        events, free = ask("bug", nothing)
    finally:
        llm.shutdown()
    last = events[-1]
    assert last["type"] == "error" and last["code"] == "internal_error", events
    assert "a bug" in last["message"]
    assert free == total  # the request's blocks went back


def test_an_abort_reaches_a_request_still_pulling_its_kv(worker: Proc) -> None:
    """/internal/abort of a disaggregated request whose KV pull is still running (no engine
    stream yet) stops it: its blocks reserved for the import are freed and its stream ends.
    It answered {"aborted": false} and the request ran on: the pull, then every token."""
    import contextlib
    import socket
    import time

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: a hung prefill
    port = silent.getsockname()[1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pulling = pool.submit(_post, worker, _request(200, kv_source=f"127.0.0.1:{port}",
                                                      request_id="pulling"))  # fmt: skip

        def stats() -> dict[str, Any]:
            req = urllib.request.Request(f"{worker.url}/internal/stats",
                                         headers={"x-edgeinfer-secret": SECRET})  # fmt: skip
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())

        deadline = time.monotonic() + 20
        while stats()["kv_imports_reserved"] != 1:
            assert time.monotonic() < deadline, stats()
            time.sleep(0.05)
        abort = urllib.request.Request(
            f"{worker.url}/internal/abort", data=b'{"request_id": "pulling"}', method="POST",
            headers={"x-edgeinfer-secret": SECRET},
        )  # fmt: skip
        with urllib.request.urlopen(abort, timeout=10) as resp:
            assert json.loads(resp.read()) == {"aborted": True}
        with contextlib.suppress(http.client.HTTPException, OSError):
            pulling.result(timeout=10)  # its stream ends (cut: its client is gone, as a rule)
        deadline = time.monotonic() + 10
        while stats()["kv_imports_reserved"] or stats()["open_requests"]:
            assert time.monotonic() < deadline, stats()
            time.sleep(0.05)
    silent.close()


def _stats(worker: Proc) -> dict[str, Any]:
    req = urllib.request.Request(f"{worker.url}/internal/stats",
                                 headers={"x-edgeinfer-secret": SECRET})  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


NO_ARGS = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip
# two calls: without parallel calls a completion ends at the first (the second is long: a
# completion left to run writes on well past the answer's end)
TWO_CALLS = ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n'
             '{"name": "f", "arguments": {"x": "' + "the cat sat on the mat " * 8 + '"}}\n'
             "</tool_call>")  # fmt: skip


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_completion_that_ends_at_its_one_call_is_no_abort(worker: Proc, choice: str) -> None:
    """parallel_tool_calls false: a completion ends once its one call is complete, ahead of
    the engine (before the end marker the grammar of "required" still asks for; tool_choice
    auto, guided here to write two calls, before the second). The engine ends it there, and
    the request ends as finished: it was aborted, counted in /internal/stats' num_aborted as a
    client that went away (a reviewer: 1-3 a time on SmolLM2 with n=3, every answer whole)."""
    import time

    sampling: dict[str, Any] = {"max_tokens": 300, "temperature": 0, "n": 2}
    if choice == "auto":
        sampling["structured_outputs"] = {"choice": [TWO_CALLS]}
    before = _stats(worker)["num_aborted"]
    status, _, body = _post(worker, _request(0, request_id=f"one-call-{choice}", tools=[NO_ARGS],
                                             tool_choice=choice, parallel_tool_calls=False,
                                             sampling=sampling))  # fmt: skip
    events = [orjson.loads(line) for line in body.splitlines() if line.strip()]
    assert status == 200 and events[-1]["type"] == "done", events[-3:]
    for i in (0, 1):
        deltas = [e for e in events if e["type"] == "delta" and e["index"] == i]
        calls = [c for e in deltas for c in e.get("tool_calls") or [] if "id" in c]
        assert [c["function"]["name"] for c in calls] == ["f"], deltas
        assert deltas[-1]["finish_reason"] == "stop", deltas[-1]
    # (answered before the engine's step that ends it: test_worker_prepare's body-end test)
    deadline = time.monotonic() + 10
    while (s := _stats(worker))["open_requests"]:  # (once its last output is out: counted)
        assert time.monotonic() < deadline, s
        time.sleep(0.02)
    assert s["num_aborted"] == before, s
