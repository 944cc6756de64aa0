"""Large grammars on the worker: a compile that takes seconds keeps the gateway's idle timer fed
(the worker's stream begins while it compiles), is done once (not the gateway's check again,
nor once per request that asks for the same text at once), is bounded in time (a 400 naming the
limit, never a worker failure that the gateway sends on to the next worker), and a refusal
that comes after the stream began still reaches the client as its 400. Found by a reviewer: a
539 KB Lark grammar that passed the gateway's check was compiled three times over (once per
attempt, each past the gateway's 10 s idle timeout) and answered 503 worker_failed."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvstore.redis_server import LocalRedis
from runtime.sampling_params import InvalidRequestError
from runtime.scheduler import QueueFullError
from runtime.structured import StructuredOutputsParams
from runtime.structured_decoding import COMPILE_THREADS, GrammarCompiler
from runtime.tokenizer import Tokenizer
from tests.stack import SECRET, Proc, chat_model, get_json, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 0, longitude: 0, settings: {models: [stories]}}\n"
IDLE_S = 1.5  # the gateway's --worker-idle-timeout here (its default is 10 s)


def _alternatives(n: int, tag: str = "w") -> str:
    """A Lark grammar of n string alternatives: its compile grows faster than n (on stories260K,
    ~0.03 s at 5,000, ~0.4 s at 20,000, ~1.4 s at 50,000 on one core)."""
    return "start: " + " | ".join(f'"{tag}{j}"' for j in range(n))


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


def test_a_compile_past_the_timeout_is_a_400_naming_the_limit_and_is_kept(tok: Tokenizer) -> None:
    """The request that waited too long is refused naming its field and the limit; the compile
    runs on and is kept, so the same grammar sent again is served from the cache."""
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids, timeout_s=0.02)
    spec = StructuredOutputsParams(grammar=_alternatives(20_000, "t"))
    with pytest.raises(InvalidRequestError) as e:
        compiler.grammar(spec, "guided_grammar")
    assert e.value.param == "guided_grammar", e.value
    assert "did not compile within 0.02 s" in e.value.message, e.value
    wait_until(lambda: compiler.compiled == 1, 30, "the compile to finish")
    start = time.perf_counter()
    compiler.grammar(spec, "guided_grammar")  # (from the cache: no wait)
    assert time.perf_counter() - start < 0.02 and compiler.compiled == 1


def test_one_grammar_asked_for_at_once_is_compiled_once(tok: Tokenizer) -> None:
    """Requests with the same grammar text that come while it compiles wait for that compile
    (each compiled it on its own); a refusal reaches each of them, naming each one's field."""
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    spec = StructuredOutputsParams(grammar=_alternatives(20_000, "o"))
    # refused by the worker's compile alone (~0.1 s): forced output past llguidance's item limit
    bad = "start: " + " ".join(f'"b{j}"' for j in range(10_000))
    go = threading.Barrier(8)
    errors: list[str] = []

    def ask(i: int) -> None:
        go.wait()
        try:
            compiler.grammar(spec, "guided_grammar") if i % 2 else compiler.grammar(
                StructuredOutputsParams(grammar=bad, param=f"field{i}"), "guided_grammar"
            )
        except InvalidRequestError as e:
            errors.append(f"{e.param}: {e.message}")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.compiled == 1, compiler.compiled  # (was 4: each compiled it)
    assert sorted(e.split(":")[0] for e in errors) == ["field0", "field2", "field4", "field6"]


def test_the_worker_compiles_a_grammar_once_not_the_gateways_check_too(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's check compiles the grammar without a tokenizer (validate_grammar): the
    worker ran it again before its own compile, which finds the same errors (~1 s of ~2.3 s at
    50,000 alternatives). Its errors stay as clear, naming the field."""
    import llguidance

    calls: list[str] = []
    validate = llguidance.LLMatcher.validate_grammar_with_warnings

    def counted(text: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(text)
        return validate(text, *args, **kwargs)

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", counted)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    compiler.grammar(StructuredOutputsParams(grammar='start: "a" | "b"'), "guided_grammar")
    compiler.grammar(StructuredOutputsParams(json={"type": "object"}), "response_format")
    assert calls == []
    with pytest.raises(InvalidRequestError) as e:
        compiler.grammar(StructuredOutputsParams(grammar="start: foo("), "guided_grammar")
    assert e.value.param == "guided_grammar"
    assert e.value.message.startswith("invalid or unsupported constraint: "), e.value
    with pytest.raises(InvalidRequestError) as e:
        compiler.grammar(StructuredOutputsParams(json={"type": "nope"}), "response_format")
    assert e.value.message.startswith("invalid or unsupported JSON schema: "), e.value


def _give_up_on(compiler: GrammarCompiler, grammars: list[str]) -> list[Exception]:
    """Ask for each grammar at once, each request giving up after the compiler's timeout; what
    each was refused with."""
    go = threading.Barrier(len(grammars))
    refused: list[Exception] = []

    def ask(grammar: str) -> None:
        go.wait()
        try:
            compiler.grammar(StructuredOutputsParams(grammar=grammar), "guided_grammar")
        except (InvalidRequestError, QueueFullError) as e:
            refused.append(e)

    threads = [threading.Thread(target=ask, args=(g,)) for g in grammars]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return refused


def _compiles_settle() -> None:
    wait_until(lambda: not any(t.name == "edgeinfer-grammar" for t in threading.enumerate()),
               60, "the grammar compiles to settle")  # fmt: skip


def test_a_compile_nobody_waits_for_any_more_does_not_run(tok: Tokenizer) -> None:
    """Distinct grammars whose requests all gave up: the compiles that had begun run on (they
    cannot be stopped), but those still waiting for a turn when their requests left are dropped,
    not run (each ran in its turn: a backlog without bound). Their requests are told to retry
    (429 at the worker), not blamed for a compile that never began."""
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids, timeout_s=0.05)
    grammars = [_alternatives(20_000, f"a{i}x") for i in range(2 * COMPILE_THREADS)]
    refused = _give_up_on(compiler, grammars)
    assert len(refused) == len(grammars), refused
    _compiles_settle()
    assert compiler.compiled <= COMPILE_THREADS, compiler.compiled  # (was 8: all of them)
    assert compiler.abandoned == len(grammars) - compiler.compiled
    retry = [e for e in refused if isinstance(e, QueueFullError)]
    assert len(retry) >= compiler.abandoned, refused
    assert all("grammar compiles ahead of it" in str(e) and "retry" in str(e) for e in retry)


def test_a_small_schema_behind_a_backlog_is_not_refused_as_too_large(tok: Tokenizer) -> None:
    """A schema of milliseconds asked for behind compiles of grammars whose requests gave up:
    served, or told to retry, never the 400 "did not compile within" (before, it waited for the
    whole backlog, each abandoned compile run in its turn, and was refused as too large). Asked
    again once the compiles that began are done, it is served (compiled anew if its first
    compile was dropped, nobody waiting for it)."""
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids, timeout_s=0.3)
    _give_up_on(compiler, [_alternatives(20_000, f"b{i}x") for i in range(3 * COMPILE_THREADS)])
    small = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = StructuredOutputsParams(json=small)
    try:
        compiler.grammar(schema, "response_format")
    except QueueFullError as e:  # (the compiles that began still run: the worker's 429)
        assert str(e).startswith("response_format: ") and "retry" in str(e), e
    _compiles_settle()
    assert compiler.compiled <= COMPILE_THREADS + 1, compiler.compiled
    start = time.perf_counter()
    compiler.grammar(schema, "response_format")
    assert time.perf_counter() - start < 0.3


class Stack:
    """Redis, one stories260K worker and a gateway whose idle timeout is IDLE_S."""

    def __init__(self, root: Path, stories: Path) -> None:
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        model = chat_model(stories, root / "stories-chat")
        self.worker: Proc = start_worker("w1", model, self.redis.url, root, "local")
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root, "local",
                                     ["--worker-idle-timeout", str(IDLE_S)])  # fmt: skip
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 1, 30, "worker")

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(f"{self.gateway.url}{path}", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, orjson.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, orjson.loads(e.read())

    def close(self) -> None:
        self.gateway.stop()
        self.worker.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("grammar_compile_limits"), stories_dir)
    try:
        yield s
    finally:
        s.close()


def test_a_slow_compile_begins_the_workers_stream_at_once(stack: Stack) -> None:
    """A grammar whose compile takes over a second: the worker's answer begins (200, then a
    keepalive at least every second) while it compiles, so no read waits longer than the
    gateway's idle timeout; before, nothing came until the compile was done."""
    body = {"request_id": "slow-1", "model": "stories", "prompt": "Once",
            "sampling": {"max_tokens": 2, "structured_outputs": {
                "grammar": _alternatives(60_000, "s")}}}  # fmt: skip
    url = urllib.parse.urlsplit(stack.worker.url)
    # (the timeout bounds each read)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=IDLE_S)
    start = time.perf_counter()
    try:
        headers = {"x-edgeinfer-secret": SECRET, "Content-Type": "application/json"}
        conn.request("POST", "/internal/generate", orjson.dumps(body), headers)
        resp = conn.getresponse()  # (old code: TimeoutError, after IDLE_S of silence)
        assert resp.status == 200, resp.read()
        data = b""
        while chunk := resp.read1(65536):  # (each read waits at most IDLE_S)
            data += chunk
    finally:
        conn.close()
    events = [orjson.loads(line) for line in data.split(b"\n") if line]
    assert data.startswith(b"\n"), data[:200]  # a keepalive first
    assert events[0]["type"] == "start", events
    # (done; or, as this grammar's 60,000 alternatives go past llguidance's items a step once
    # a token is in, the constraint's failure: either way the request was served)
    assert events[-1]["type"] == "done" or events[-1]["code"] == "constraint_failed", events
    assert time.perf_counter() - start > 1.0  # (a compile longer than a keepalive's period)


def test_a_slow_compile_that_fails_is_the_clients_400_not_a_worker_failure(stack: Stack) -> None:
    """A grammar that passes the gateway's check and fails the worker's compile (llguidance's
    symbol limit, a caught panic) after more than the gateway's idle timeout: the refusal,
    sent in the stream the worker began, is the client's 400 naming its field. Before, the
    gateway timed out on the silent worker, tried it again (compiling it again) on each of its
    attempts, and answered 503 worker_failed."""
    grammar = "start: " + " ".join(f'"q{j}"' for j in range(70_000))
    start = time.perf_counter()
    request = {"model": "stories", "prompt": "Once", "max_tokens": 2, "guided_grammar": grammar}
    status, body = stack.post("/v1/completions", request)
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "guided_grammar" and "assertion failed" in error["message"], error
    assert time.perf_counter() - start > IDLE_S  # (it did take longer than the idle timeout)


def test_too_many_tools_for_tool_choice_required_name_tools(stack: Stack) -> None:
    """Each tool's schema compiles alone, but tool_choice "required" joins them in one schema,
    which llguidance refuses ("schema too large"): the 400 names `tools` (was `tool_choice`,
    from the worker's compile)."""
    enum = {"type": "string", "enum": [f"e{m}" for m in range(40)]}
    params = {"type": "object", "properties": {f"p{k}": enum for k in range(14)}}
    tools = [{"type": "function", "function": {"name": f"f{j}", "parameters": params}}
             for j in range(128)]  # fmt: skip
    status, body = stack.post("/v1/chat/completions", {
        "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "tools": tools, "tool_choice": "required"})  # fmt: skip
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "tools" and "128 tools together" in error["message"], error
    status, body = stack.post("/v1/chat/completions", {  # (the same tools, auto: no grammar)
        "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "tools": tools, "tool_choice": "auto"})  # fmt: skip
    assert status == 200, body
