"""A worker's request preparation and the end of its answer, on a worker's app and engine in
this process: an ordinary request is prepared without a task or a wait, a grammar compiled on
a thread is the one the engine takes (never compiled again on the event loop), and an answer
whose completions ended at their calls ends its body before the engine's next step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.stack import SECRET, chat_model


def _serve(model: Path, body: dict[str, Any], before: Callable[[Any], None] | None = None
           ) -> list[tuple[float, dict[str, Any] | None]]:  # fmt: skip
    """Serve a worker's app on a free port (its engine and `before(worker)` first), send `body`
    and return its events, each with when it came (the body's end last, as None)."""
    import aiohttp
    from aiohttp import web

    from runtime.async_engine import AsyncLLM
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.worker import Worker, WorkerConfig, make_app

    llm = AsyncLLM(LLMEngine(EngineConfig(str(model), block_size=16, kv_cache_bytes=4_000_000,
                                          num_threads=1)))  # fmt: skip
    cfg = WorkerConfig("stories", "r1", "mixed", "127.0.0.1", 0, "http://127.0.0.1:0", SECRET,
                       None)  # fmt: skip
    worker = Worker(cfg, llm)
    if before is not None:
        before(worker)

    async def main() -> list[tuple[float, dict[str, Any] | None]]:
        runner = web.AppRunner(make_app(worker))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        events: list[tuple[float, dict[str, Any] | None]] = []
        try:
            async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/internal/generate", data=orjson.dumps(body),
                headers={"x-edgeinfer-secret": SECRET},
            ) as resp:  # fmt: skip
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if line.strip():
                        events.append((time.monotonic(), orjson.loads(line)))
                events.append((time.monotonic(), None))
            # (the request's end on the engine, before the engine goes)
            deadline = time.monotonic() + 10
            while await llm.call(lambda e: e.unfinished_request_ids()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            return events
        finally:
            await runner.cleanup()

    try:
        return asyncio.run(main())
    finally:
        llm.shutdown()


def test_an_ordinary_request_is_prepared_without_a_task_or_a_wait(stories_dir: Path) -> None:
    """A short prompt without a grammar has nothing to prepare off the event loop: it is
    prepared at once, never suspended (every request took a task and a timed wait, ~10 us)."""
    from aiohttp import web

    from kvstore.protocol import GenerateRequest
    from runtime.async_engine import AsyncLLM
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.worker import Worker, WorkerConfig, _Keepalive, _prepare_begun

    llm = AsyncLLM(LLMEngine(EngineConfig(str(stories_dir), block_size=16,
                                          kv_cache_bytes=4_000_000, num_threads=1)))  # fmt: skip
    try:
        cfg = WorkerConfig("stories", "r1", "mixed", "127.0.0.1", 0, "http://127.0.0.1:0",
                           SECRET, None)  # fmt: skip
        worker = Worker(cfg, llm)
        req = GenerateRequest.from_dict({"request_id": "r", "model": "stories", "prompt": "Once",
                                         "sampling": {"max_tokens": 3}})  # fmt: skip
        resp = web.StreamResponse()
        request: Any = None  # (only a stream that begins uses it)
        coro = _prepare_begun(request, resp, _Keepalive(resp, lambda: False), worker, req)
        with pytest.raises(StopIteration) as stop:  # done at its first step: no suspension
            coro.send(None)
        params, tools, grammar = stop.value.value
        assert params.max_tokens == 3 and tools is None and grammar is None
        assert not resp.prepared
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kv_source", [None, "127.0.0.1:1"])
def test_a_grammar_dropped_from_the_cache_after_its_compile_is_not_compiled_again(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_source: str | None
) -> None:
    """The grammar `_prepare` compiled on a thread is the one the engine takes: the compiler's
    cache keeps only ~2 s of compiles (here none but the newest), and a grammar it dropped
    between the request's preparation and its acceptance (another's compile) was compiled again
    in `_accept`, on the event loop (seconds for a large grammar: every stream and probe of the
    worker held). Disaggregated too (its group prepared for its pull, from a closed port here:
    it fails after)."""
    from runtime import worker as worker_module
    from runtime.structured import StructuredOutputsParams
    from runtime.structured_decoding import GrammarCompiler

    accept = worker_module._accept
    compiled: list[int] = []

    def keep_newest_only(worker: Any) -> None:
        engine = worker.llm.engine
        engine.grammars = GrammarCompiler(engine.tokenizer, engine.grammars.vocab_size,
                                          engine.eos_token_ids, compile_seconds=0.0)  # fmt: skip

    def another_compiled_first(worker: Any, *args: Any) -> Any:
        grammars = worker.llm.engine.grammars
        grammars.grammar(StructuredOutputsParams(regex="x{2}"), "structured_outputs")
        compiled.append(grammars.compiled)  # the request's and this one: 2
        taken = accept(worker, *args)
        compiled.append(grammars.compiled)
        return taken

    monkeypatch.setattr(worker_module, "_accept", another_compiled_first)
    body = {"request_id": "g", "model": "stories", "prompt": "Once", "kv_source": kv_source,
            "sampling": {"max_tokens": 3, "structured_outputs": {"regex": "[ab]{3}"}}}  # fmt: skip
    events = _serve(stories_dir, body, keep_newest_only)
    assert compiled == [2, 2], (compiled, events)
    last = events[-2][1]
    assert last is not None and last["type"] == ("done" if kv_source is None else "error"), events


def test_an_answer_ended_at_its_call_ends_its_body_before_the_engine_ends_it(
    stories_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completion ended at its one call (parallel_tool_calls false) is answered at once: its
    done event, then the body's end, which the gateway reads to before it answers. The engine
    ends the request at its next step, read after; the body stayed open until then (here a step
    held 1 s), and the client's answer waited for it."""
    from runtime.engine import LLMEngine

    end = LLMEngine.end_at_next_token

    def slow_end(engine: LLMEngine, *args: Any, **kwargs: Any) -> None:
        end(engine, *args, **kwargs)
        time.sleep(1.0)  # (on the engine thread: its next step waits)

    monkeypatch.setattr(LLMEngine, "end_at_next_token", slow_end)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip
    body = {"request_id": "c", "model": "stories", "prompt": "Once", "tools": [tool],
            "tool_choice": "required", "parallel_tool_calls": False,
            "sampling": {"max_tokens": 300, "temperature": 0}}  # fmt: skip
    events = _serve(chat_model(stories_dir, tmp_path / "chat"), body)
    (done_at, done), (end_at, eof) = events[-2:]
    assert done is not None and done["type"] == "done" and eof is None, events
    deltas = [e for _, e in events if e is not None and e["type"] == "delta"]
    calls = [c for e in deltas for c in e.get("tool_calls") or [] if "id" in c]
    assert [c["function"]["name"] for c in calls] == ["f"], deltas
    assert deltas[-1]["finish_reason"] == "stop", deltas[-1]
    assert end_at - done_at < 0.5, end_at - done_at
