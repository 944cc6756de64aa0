"""The gateway and the worker with long prompts, end to end: real redis-server, two workers on stories260K (so
that the gateway tokenizes each prompt for its cache-aware routing and forwards the token ids),
a real gateway process that takes bodies up to 3 MB.

The model's chat template writes the tools into the prompt, as real models' templates do.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from kvstore.protocol import SECRET_HEADER
from kvstore.redis_server import LocalRedis
from tests.stack import SECRET, chat_model, get_json, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: eu, latitude: 50.1, longitude: 8.7}\n"
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class Stack:
    def __init__(self, root: Path, stories: Path) -> None:
        self.model = chat_model(stories, root / "stories-tools")
        (self.model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)  # (chat_model's own)
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        # (workers taking 4 MB bodies: the gateway's resend of a prompt's text on a worker's 413,
        # test_a_prompt_whose_token_ids_outgrow_the_workers_body_limit; their default is 32 MiB)
        self.workers = [start_worker(f"w{i}", self.model, self.redis.url, root, "eu",
                                     ["--max-body-bytes", str(4 << 20)]) for i in (1, 2)]  # fmt: skip
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root, "eu",
                                     ["--max-body-bytes", "3000000"])  # fmt: skip
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
        r = redis.Redis.from_url(self.redis.url)
        try:  # the gateway tokenizes once the workers' tokenizer is in Redis
            wait_until(lambda: r.keys("ei:tok:{stories}:*"), 30, "the tokenizer in Redis")
        finally:
            r.close()

    def post(self, path: str, body: dict[str, Any], base: str = "") -> tuple[int, dict[str, Any]]:
        """POST to the gateway (or `base`, with the cluster's secret): the status and the JSON
        answer (the worker's stream: its first event)."""
        headers = {"Content-Type": "application/json"} | ({SECRET_HEADER: SECRET} if base else {})
        req = urllib.request.Request(f"{base or self.gateway.url}{path}", data=orjson.dumps(body),
                                     headers=headers)  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                first = orjson.loads(resp.read().lstrip(b"\n").split(b"\n")[0])
        except urllib.error.HTTPError as e:
            return e.code, orjson.loads(e.read())
        if first.get("type") == "error" and first.get("status"):  # a worker's refusal after a
            # preparation long enough (a loaded host) to begin its stream: as the gateway reads it
            return first["status"], {"error": first["error"]}
        return resp.status, first

    def close(self) -> None:
        self.gateway.stop()
        for w in self.workers:
            w.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    s = Stack(tmp_path_factory.mktemp("review-gw"), stories_dir)
    try:
        yield s
    finally:
        s.close()


def _longest_health_wait(
    stack: Stack, path: str, body: dict[str, Any], base: str = ""
) -> tuple[float, int, dict]:  # type: ignore[type-arg]
    """Post `body` to the gateway (or the worker at `base`) while another connection asks its
    health every 5 ms: the longest wait for a health answer meanwhile, and the post's status
    and body."""
    url = (base or stack.gateway.url).removeprefix("http://")
    health, headers = ("/internal/health", {SECRET_HEADER: SECRET}) if base else ("/healthz", {})
    stop = threading.Event()
    waits: list[float] = []

    def ping() -> None:
        conn = http.client.HTTPConnection(url, timeout=30)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                conn.request("GET", health, headers=headers)
                conn.getresponse().read()
                waits.append(time.perf_counter() - t0)
                time.sleep(0.005)
        finally:
            conn.close()

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        time.sleep(0.05)
        status, answer = stack.post(path, body, base)
        time.sleep(0.05)
    finally:
        stop.set()
        pinger.join()
    return max(waits), status, answer


DESCRIPTION = "The weather in a city on a given day. " * 200  # 7,800 characters
LONG: dict[str, dict[str, Any]] = {
    # ~0.9 MB of message text, and ~0.9 MB of tools beside a short message
    "messages": {"messages": [{"role": "user", "content": DESCRIPTION * 116}]},
    "tools": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": f"f{i}", "description": DESCRIPTION}}
            for i in range(116)
        ],
    },
}


@pytest.mark.parametrize("kind", list(LONG))
def test_a_long_prompt_leaves_the_gateway_answering_meanwhile(stack: Stack, kind: str) -> None:
    """The gateway tokenizes a long prompt (its messages, or the tools the chat template writes
    into it) on a thread, without holding the GIL: each held the event loop, every stream and
    probe of the gateway, for ~0.4-1 s (tokenizers' `encode` holds the GIL on its thread too;
    tools were tokenized on the loop, the prompt's size counted as its messages' content
    alone). The best of two tries, so that one stall of a busy host does not fail it."""
    body = {"model": "stories", "max_tokens": 1, **LONG[kind]}
    waits = []
    for _ in range(2):
        wait, status, answer = _longest_health_wait(stack, "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        waits.append(wait)
    assert min(waits) < 0.25, waits


@pytest.mark.parametrize("kind", list(LONG))
def test_a_long_prompt_leaves_the_worker_answering_meanwhile(stack: Stack, kind: str) -> None:
    """The same straight to a worker (a chat the gateway does not tokenize: the one worker of a
    region): rendered and tokenized on a thread, without the GIL. It held the worker's loop,
    every stream and probe of it, ~0.7 s. The best of two tries."""
    body = {"request_id": "long", "model": "stories", "sampling": {"max_tokens": 1}, **LONG[kind]}
    waits = []
    for i in range(2):
        body["request_id"] = f"long-{kind}-{i}"
        wait, status, answer = _longest_health_wait(
            stack, "/internal/generate", body, stack.workers[0].url
        )
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        waits.append(wait)
    assert min(waits) < 0.25, waits


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_whose_token_ids_outgrow_the_workers_body_limit(stack: Stack, path: str) -> None:
    """1.2 MB of CJK text, within the gateway's 3 MB limit, is 1.2 M byte tokens: their ids as
    JSON (4.8 MB) are over what these workers take (4 MiB), so the gateway sends the text as the
    client sent it and the worker answers (here: over the context). The client got the worker's
    413 for a limit of 4 MB it never sent as much as."""
    text = "你好世界" * 100_000
    body: dict[str, Any] = {"model": "stories", "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    status, answer = stack.post(path, body)
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == ("prompt" if path == "/v1/completions" else "messages")


def test_a_slow_grammar_compile_leaves_the_worker_answering_meanwhile(stack: Stack) -> None:
    """A constraint whose compile takes most of a second (a regex's lexer: `(a{1000}){1000}`)
    is compiled on a thread (llguidance compiles without the GIL), not the worker's loop, which
    it held with every stream and probe of the worker. A new regex each try (compiled grammars
    are kept); the best of two tries."""
    waits = []
    for i in range(2):
        sampling = {"max_tokens": 1, "structured_outputs": {"regex": f"(a{{1000}}){{1000}}b{i}"}}
        body = {"request_id": f"regex-{i}", "model": "stories", "prompt": "Once", "sampling": sampling}
        wait, status, answer = _longest_health_wait(
            stack, "/internal/generate", body, stack.workers[1].url
        )
        assert status == 200 and answer["type"] == "start", answer
        waits.append(wait)
    assert min(waits) < 0.25, waits


def test_a_role_change_waits_for_a_request_being_prepared(stack: Stack) -> None:
    """A request whose grammar compiles on a thread is work in flight: a role change that
    begins meanwhile waits for it, and it is then refused (503 draining: the gateway retries it
    elsewhere). It was served under the new role, the change having drained nothing (and a
    drain likewise counted nothing)."""
    worker = stack.workers[1]
    sampling = {"max_tokens": 1, "structured_outputs": {"regex": "(a{1000}){1000}role"}}
    body = {"request_id": "regex-role", "model": "stories", "prompt": "Once", "sampling": sampling}
    answer: list[tuple[int, dict[str, Any]]] = []
    gen = threading.Thread(target=lambda: answer.append(stack.post("/internal/generate", body,
                                                                   worker.url)))  # fmt: skip
    gen.start()
    try:
        time.sleep(0.2)  # (the grammar compiles for ~0.7 s)
        status, changed = stack.post("/internal/role", {"role": "prefill"}, worker.url)
        gen.join()
        assert status == 200 and changed["drained_s"] > 0.1, changed  # it waited for the request
        (gen_status, gen_answer), = answer
        assert gen_status == 503 and gen_answer["error"]["code"] == "draining", gen_answer
    finally:
        gen.join()
        stack.post("/internal/role", {"role": "mixed"}, worker.url)
